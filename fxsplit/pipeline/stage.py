"""Stage construction: cut one traced graph into pipeline stage GraphModules.

Terms
- **compute node**: a `call_function`, `call_method` or `call_module` node. Placeholders, `get_attr`
  nodes and the output node are not assigned by the caller; the builder places them.
- **assignment**: compute node name -> stage id. Stages are contiguous: a node's stage is >= the
  stage of each of its inputs, and every stage 0..S-1 holds at least one compute node.
- **boundary value**: a tensor produced in stage i and read by a stage j > i. It is an output of
  stage i and an input of stage j, sent DIRECTLY from i to j (skip connections are not relayed
  through the stages between). Model outputs are all returned by the LAST stage; values produced
  earlier are boundary values into the last stage.
- **flat model inputs / outputs**: the graph placeholders in order (args then kwargs); the output
  node's leaves in pytree order (`StageGraphs.output_spec` rebuilds the structure).

Representative signature::

    sg = build_stages(gm, {"linear": 0, "relu": 0, "linear_1": 1}, num_stages=2)
    flat_out = sg.run_sequential(x)        # == gm(x), flattened

[Note: values across a cut]
- Tensors cross a cut as stage outputs / inputs. A tensor that is not floating point or that does
  not depend on a parameter (integer masks, position ids, the model inputs themselves) crosses
  with `requires_grad=False`; model inputs never require grad.
- Non-tensor values (Python ints, SymInts, tuples, None, dtypes, devices) and tuple-valued nodes
  (`split`, `chunk`) never cross. A stage that reads one RECOMPUTES it: the producing node (and
  its non-tensor inputs, recursively) is copied into the consumer stage, and the tensors it reads
  cross instead (so `y = x.size(0)` in stage 0 read by stage 2 makes `x` an input of stage 2).
  Only getitem results of a tuple-valued node cross. Nodes that cannot be recomputed (module
  calls, random or side-effecting functions) raise `StageBuildError` naming the node.
- Parameters, buffers and constants (`get_attr` targets, `call_module` submodules) are copied BY
  REFERENCE into every stage that uses them, at the same FQN, so `named_parameters()` of a stage
  gives the original names and running the stages in one process accumulates gradients on the
  original model's parameters. A parameter held by more than one stage (tied weights, found by
  tensor identity, under one FQN or two) is listed in `StageGraphs.shared_params`; the runtime
  sums its gradient over the group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.fx.passes.shape_prop import TensorMetadata
from torch.utils import _pytree as pytree

from fxsplit.graph.meta import Dim, TensorMeta, tensor_metas
from fxsplit.graph.ops import is_random, owner_and_leaf, resolve_path
from fxsplit.pipeline.layout import dim_order_of, hand_over
from fxsplit.errors import ArgumentTypeError, StageBuildError

__all__ = [
    "StageBuildError",
    "StageGraphs",
    "StageIO",
    "ValueMeta",
    "ValueSource",
    "build_stages",
]


# --------------------------------------------------------------------------------------------
# Plan dataclasses (contract 3)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ValueSource:
    """Where a stage input comes from: `stage=None` -> flat model input `index`; else output
    `index` of producer stage `stage`."""

    stage: int | None
    index: int

    def __post_init__(self) -> None:
        if self.index < 0:
            raise StageBuildError(f"ValueSource.index must be >= 0, got {self.index}")
        if self.stage is not None and self.stage < 0:
            raise StageBuildError(f"ValueSource.stage must be None or >= 0, got {self.stage}")

    def __str__(self) -> str:
        return f"in{self.index}" if self.stage is None else f"s{self.stage}.out{self.index}"


@dataclass(frozen=True, init=False)
class ValueMeta:
    """One value passed into or out of a stage: its name and, for a tensor, its
    :class:`~fxsplit.graph.meta.TensorMeta` (``tensor``; None for any other value). Shapes are
    ints or sympy expressions in the batch / sequence symbols; ``requires_grad`` is True only for
    a floating tensor that carries a gradient back (see [Note: values across a cut]).

        ValueMeta("h", True, (b, T, C), torch.float32, True)   # name, is_tensor, shape, dtype, requires_grad
        ValueMeta("n", False)                                   # a non-tensor value
        ValueMeta.of("h", tensor_meta)                          # from a TensorMeta (or None)
        meta.shape, meta.dtype; meta.tensor.nbytes, meta.tensor.concrete_shape(bindings)

    ``dim_order`` is the memory layout the value crosses in ([Note: boundary layouts] in
    :mod:`fxsplit.pipeline.layout`); None: contiguous.
    """

    name: str
    tensor: TensorMeta | None

    def __init__(self, name: str, is_tensor: bool, shape: tuple[Dim, ...] | None = None,
                 dtype: torch.dtype | None = None, requires_grad: bool = False,
                 dim_order: tuple[int, ...] | None = None) -> None:
        if not is_tensor and (shape is not None or dtype is not None or requires_grad or dim_order is not None):
            raise StageBuildError(
                f"ValueMeta {name!r}: a non-tensor value has shape=None, dtype=None and "
                f"requires_grad=False, got shape={shape}, dtype={dtype}, requires_grad={requires_grad}"
            )
        try:
            tensor = TensorMeta(shape, dtype, requires_grad, dim_order) if is_tensor else None
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"ValueMeta {name!r}: {exc}") from None
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "tensor", tensor)

    @classmethod
    def of(cls, name: str, tensor: TensorMeta | None) -> ValueMeta:
        if tensor is None:
            return cls(name, False)
        return cls(name, True, tensor.shape, tensor.dtype, tensor.requires_grad, tensor.dim_order)

    @property
    def is_tensor(self) -> bool:
        return self.tensor is not None

    @property
    def shape(self) -> tuple[Dim, ...] | None:
        return None if self.tensor is None else self.tensor.shape

    @property
    def dtype(self) -> torch.dtype | None:
        return None if self.tensor is None else self.tensor.dtype

    @property
    def requires_grad(self) -> bool:
        return self.tensor is not None and self.tensor.requires_grad

    @property
    def dim_order(self) -> tuple[int, ...] | None:
        return None if self.tensor is None else self.tensor.dim_order

    def __str__(self) -> str:
        if self.tensor is None:
            return f"{self.name}:obj"
        return f"{self.name}:{self.tensor}{'*' if self.requires_grad else ''}"


@dataclass(frozen=True)
class StageIO:
    """Inputs and outputs of one stage. `stage_module(*inputs)` returns a tuple of `outputs`;
    `consumers[k]` lists the later stages that read output k; `model_outputs` maps flat model
    output indices to local output indices (only the last stage has them)."""

    index: int
    inputs: tuple[ValueSource, ...]
    input_meta: tuple[ValueMeta, ...]
    outputs: tuple[ValueMeta, ...]
    consumers: tuple[tuple[int, ...], ...]
    model_outputs: tuple[tuple[int, int], ...]
    param_names: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.inputs) != len(self.input_meta):
            raise StageBuildError(
                f"StageIO {self.index}: {len(self.inputs)} inputs but {len(self.input_meta)} input_meta"
            )
        if len(self.outputs) != len(self.consumers):
            raise StageBuildError(
                f"StageIO {self.index}: {len(self.outputs)} outputs but {len(self.consumers)} consumer lists"
            )
        for k, cons in enumerate(self.consumers):
            bad = [c for c in cons if c <= self.index]
            if bad:
                raise StageBuildError(
                    f"StageIO {self.index}: output {k} consumed by stages {bad}, which are not later stages"
                )
        for flat_idx, local in self.model_outputs:
            if not 0 <= local < len(self.outputs):
                raise StageBuildError(
                    f"StageIO {self.index}: model output {flat_idx} maps to local output {local}, "
                    f"but the stage has {len(self.outputs)} outputs"
                )


@dataclass(frozen=True)
class StageGraphs:
    """The result of `build_stages`: one GraphModule per stage plus the wiring between them."""

    modules: tuple[torch.fx.GraphModule, ...]
    io: tuple[StageIO, ...]
    shared_params: tuple[tuple[tuple[int, str], ...], ...]
    input_meta: tuple[ValueMeta, ...]
    output_spec: Any

    def __post_init__(self) -> None:
        if len(self.modules) != len(self.io):
            raise StageBuildError(f"StageGraphs: {len(self.modules)} modules but {len(self.io)} StageIO")
        for k, io in enumerate(self.io):
            if io.index != k:
                raise StageBuildError(f"StageGraphs: io[{k}].index is {io.index}, expected {k}")
            if io.model_outputs and k != len(self.io) - 1:
                raise StageBuildError(f"StageGraphs: stage {k} has model outputs; only the last stage may")

    @property
    def num_stages(self) -> int:
        return len(self.modules)

    def run_sequential(self, *flat_inputs: Any) -> list:
        """Reference executor: run the stages in order in this process; return the flat model
        outputs (`pytree.tree_unflatten(out, self.output_spec)` rebuilds the structure)."""
        if len(flat_inputs) != len(self.input_meta):
            names = [m.name for m in self.input_meta]
            raise ArgumentTypeError(
                f"run_sequential expects {len(self.input_meta)} flat model inputs {names}, "
                f"got {len(flat_inputs)}"
            )
        stage_outputs: list[tuple] = []
        for module, io in zip(self.modules, self.io):
            args = [  # handed over as the runtime transfers them ([Note: boundary layouts])
                flat_inputs[src.index] if src.stage is None
                else hand_over(stage_outputs[src.stage][src.index], meta.dim_order)
                for src, meta in zip(io.inputs, io.input_meta)
            ]
            out = module(*args)
            assert isinstance(out, tuple) and len(out) == len(io.outputs), (
                f"stage {io.index} returned {type(out).__name__} of length "
                f"{len(out) if isinstance(out, tuple) else '-'}, expected {len(io.outputs)} outputs"
            )
            stage_outputs.append(out)
        last = stage_outputs[-1]
        return [last[local] for _, local in sorted(self.io[-1].model_outputs)]

    def unflatten_outputs(self, flat_outputs: list) -> Any:
        """Rebuild the model's output structure from `run_sequential`'s flat outputs."""
        return pytree.tree_unflatten(list(flat_outputs), self.output_spec)

    def __str__(self) -> str:
        rows = [f"StageGraphs: {self.num_stages} stages, {len(self.input_meta)} model inputs"]
        for module, io in zip(self.modules, self.io):
            n_compute = sum(n.op in _COMPUTE_OPS for n in module.graph.nodes)
            ins = ", ".join(f"{m.name}<-{src}" for src, m in zip(io.inputs, io.input_meta))
            outs = ", ".join(
                f"{m}->{','.join(map(str, c)) or 'model'}" for m, c in zip(io.outputs, io.consumers)
            )
            rows.append(
                f"  stage {io.index}: {n_compute} nodes, {len(io.param_names)} params | in: {ins or '-'}"
                f" | out: {outs or '-'}"
            )
        for group in self.shared_params:
            rows.append("  shared: " + " = ".join(f"s{s}:{fqn}" for s, fqn in group))
        return "\n".join(rows)


_COMPUTE_OPS = ("call_function", "call_method", "call_module")


def build_stages(
    gm: torch.fx.GraphModule, assignment: Mapping[str, int], num_stages: int,
    recompute: frozenset[str] = frozenset(),
) -> StageGraphs:
    """Cut `gm` into `num_stages` stage GraphModules following `assignment`.

    `assignment` maps every compute node name to a stage id in 0..num_stages-1 (names of
    placeholders / get_attr nodes are ignored; nodes with no users, such as export's
    `_guards_fn` and `_assert_*` checks, may be left out and join the stage of their latest
    input). Values needed across a cut need `node.meta["val"]` (or ShapeProp's
    `"tensor_meta"`), as written by `fxsplit.trace`. See [Note: values across a cut].

    Raises `StageBuildError` naming the node for an invalid assignment or a non-tensor value that
    cannot be recomputed in its consumer stage.
    """
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    stage_of = _check_assignment(nodes, assignment, num_stages)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output_node = next(n for n in reversed(nodes) if n.op == "output")
    flat_outputs, output_spec = _flat_outputs(gm, output_node)
    grad_nodes = _grad_reachable(gm, nodes)
    plans = _plan_stages(nodes, stage_of, num_stages, recompute, flat_outputs)
    wiring = _wire(plans, stage_of, pos, flat_outputs, placeholders)

    def meta_of(n: torch.fx.Node) -> ValueMeta:
        return _value_meta(n, gm, grad_nodes, model_input=n.op == "placeholder")

    modules, ios = [], []
    for plan in plans:  # 3. Build one GraphModule per stage.
        inputs = sorted(plan.external, key=pos.__getitem__)
        module = _build_module(gm, plan, inputs, wiring.out_values[plan.index], pos)
        ios.append(wiring.stage_io(plan.index, inputs, module, meta_of))
        modules.append(module)
    return StageGraphs(
        modules=tuple(modules),
        io=tuple(ios),
        shared_params=_shared_params(modules),
        input_meta=tuple(meta_of(p) for p in placeholders),
        output_spec=output_spec,
    )


def _plan_stages(nodes: list[torch.fx.Node], stage_of: dict, num_stages: int, recompute: frozenset[str],
                 flat_outputs: list) -> list["_StagePlan"]:
    """1. Plan: per stage, its local nodes (assigned + recomputed), its inputs and get_attrs."""
    plans = [_StagePlan(s) for s in range(num_stages)]
    for n, s in stage_of.items():
        plans[s].local.add(n)
    again = {n for n in nodes if n.name in recompute}
    for plan in plans:
        for n in list(plan.local):
            for m in n.all_input_nodes:
                _need(m, plan, stage_of, again)
    for leaf in flat_outputs:
        if isinstance(leaf, torch.fx.Node):
            _need(leaf, plans[-1], stage_of, again)
    return plans


@dataclass(frozen=True)
class _Wiring:
    """Which stage sends what to whom: ``out_values[s]`` the values stage s outputs (the last
    stage: the flat model outputs, each distinct node once), ``consumers[s][v]`` the later stages
    that read its value v."""

    stage_of: dict
    input_index: dict  # model input placeholder -> its index
    consumers: list  # per stage: {node: set of consuming stages}
    out_values: list  # per stage: its output values in order
    out_index: list  # per stage: {node: its output index}
    model_outputs: tuple

    def source_of(self, m: torch.fx.Node) -> ValueSource:
        if m.op == "placeholder":
            return ValueSource(None, self.input_index[m])
        return ValueSource(self.stage_of[m], self.out_index[self.stage_of[m]][m])

    def stage_io(self, s: int, inputs: list, module: torch.fx.GraphModule, meta_of: Callable) -> StageIO:
        outs = self.out_values[s]
        last = s == len(self.out_values) - 1
        return StageIO(
            index=s,
            inputs=tuple(self.source_of(m) for m in inputs),
            input_meta=tuple(meta_of(m) for m in inputs),
            outputs=tuple(meta_of(v) if isinstance(v, torch.fx.Node) else _constant_meta(f"output_{k}", v)
                          for k, v in enumerate(outs)),
            consumers=tuple(tuple(sorted(self.consumers[s].get(v, ()))) if isinstance(v, torch.fx.Node) else ()
                            for v in outs),
            model_outputs=self.model_outputs if last else (),
            param_names=tuple(name for name, _ in module.named_parameters()),
        )


def _wire(plans: list, stage_of: dict, pos: dict, flat_outputs: list, placeholders: list) -> _Wiring:
    """2. Wire: a tensor from stage t read by stage s > t is an output of t consumed by s; the
    last stage returns the flat model outputs (each distinct node once)."""
    consumers: list[dict[torch.fx.Node, set[int]]] = [{} for _ in plans]
    for plan in plans:
        for m in plan.external:
            if m.op != "placeholder":
                consumers[stage_of[m]].setdefault(m, set()).add(plan.index)
    out_values: list[list[Any]] = [sorted(c, key=pos.__getitem__) for c in consumers[:-1]]
    last_outs, model_outputs = _dedup_model_outputs(flat_outputs)
    out_values.append(last_outs)
    out_index = [{v: k for k, v in enumerate(outs) if isinstance(v, torch.fx.Node)} for outs in out_values]
    return _Wiring(stage_of, {n: i for i, n in enumerate(placeholders)}, consumers, out_values, out_index,
                   model_outputs)


# --------------------------------------------------------------------------------------------
# Planning and building helpers
# --------------------------------------------------------------------------------------------


class _StagePlan:
    """Mutable scratch for one stage while planning (never leaves this module)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.local: set[torch.fx.Node] = set()
        self.external: set[torch.fx.Node] = set()  # stage inputs: model inputs and earlier tensors
        self.attrs: set[torch.fx.Node] = set()


def _dedup_model_outputs(flat_outputs: list) -> tuple[list, tuple[tuple[int, int], ...]]:
    """The last stage's outputs (each distinct node once, constants as they are) and the
    (flat model-output index, local output index) pairs."""
    outs: list[Any] = []
    mapping = []
    for flat_idx, leaf in enumerate(flat_outputs):
        local = None
        if isinstance(leaf, torch.fx.Node):
            local = next((k for k, v in enumerate(outs) if v is leaf), None)
        if local is None:
            outs.append(leaf)
            local = len(outs) - 1
        mapping.append((flat_idx, local))
    return outs, tuple(mapping)


def _build_module(
    gm: torch.fx.GraphModule,
    plan: _StagePlan,
    inputs: list[torch.fx.Node],
    outputs: list[Any],
    pos: Mapping[torch.fx.Node, int],
) -> torch.fx.GraphModule:
    """One stage's GraphModule: placeholders for `inputs`, its get_attrs, its local nodes in graph
    order, and a tuple output. Attributes are shared by reference: GraphModule copies the
    referenced submodules / tensors of `gm` at the same FQN."""
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for m in inputs:
        env[m] = g.create_node("placeholder", m.name, name=m.name)
        env[m].meta = dict(m.meta)
    for a in sorted(plan.attrs, key=pos.__getitem__):
        env[a] = g.create_node("get_attr", a.target, name=a.name)
        env[a].meta = dict(a.meta)
    for n in sorted(plan.local, key=pos.__getitem__):
        env[n] = g.node_copy(n, env.__getitem__)
    g.output(tuple(env[v] if isinstance(v, torch.fx.Node) else v for v in outputs))
    g.lint()
    module = torch.fx.GraphModule(gm, g, class_name=f"Stage{plan.index}")
    _copy_buffer_persistence(gm, module)
    return module


def _need(m: torch.fx.Node, plan: _StagePlan, stage_of: Mapping[torch.fx.Node, int],
          again: frozenset[torch.fx.Node] | set[torch.fx.Node] = frozenset()) -> None:
    """Make value `m` available in `plan`'s stage: an input, a get_attr, or a recomputed node
    (a non-tensor value, or a tensor in `again`)."""
    if m in plan.local or m in plan.external or m in plan.attrs:
        return
    if m.op == "placeholder":
        plan.external.add(m)
    elif m.op == "get_attr":
        plan.attrs.add(m)
    elif m not in again and _is_tensor(m):
        assert stage_of[m] < plan.index, f"{m.name} in stage {stage_of[m]} read by {plan.index}"
        plan.external.add(m)
    else:
        _check_recomputable(m, stage_of[m], plan.index)
        plan.local.add(m)
        for i in m.all_input_nodes:
            _need(i, plan, stage_of, again)


def _check_recomputable(m: torch.fx.Node, producer: int, consumer: int) -> None:
    random = m.op != "call_module" and is_random(m)
    why = None
    if m.op == "call_module":
        why = "it is a module call"
    elif random:
        why = "it is random"
    elif m.is_impure():
        why = "it has side effects"
    if why is not None:
        raise StageBuildError(
            f"node {m.name!r}{_where(m)} produces a non-tensor value in stage {producer} that stage "
            f"{consumer} reads; non-tensor values are recomputed in the consumer, but {m.name!r} "
            f"cannot be because {why}. Fix: assign its users to stage {producer} too, or make the "
            f"value a tensor."
        )


def _where(n: torch.fx.Node) -> str:
    info = n.meta.get("fxsplit")
    path = getattr(info, "module_path", None)
    if path is None:
        stack = n.meta.get("nn_module_stack") or {}
        path = str(list(stack.values())[-1][0]) if stack else ""
    return f" (module {path!r})" if path else ""


def _check_assignment(
    nodes: list[torch.fx.Node], assignment: Mapping[str, int], num_stages: int
) -> dict[torch.fx.Node, int]:
    """Validate `assignment`; return compute node -> stage (unassigned user-less nodes placed)."""
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise StageBuildError(f"num_stages must be an int >= 1, got {num_stages!r}")
    by_name = {n.name: n for n in nodes}
    unknown = sorted(k for k in assignment if k not in by_name)
    if unknown:
        raise StageBuildError(
            f"assignment names {len(unknown)} node(s) not in the graph: {unknown[:5]}; use node.name "
            f"of the graph passed to build_stages"
        )
    stage_of: dict[torch.fx.Node, int] = {}
    missing = []
    for n in nodes:
        if n.op not in _COMPUTE_OPS:
            continue
        if n.name in assignment:
            s = assignment[n.name]
            if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < num_stages:
                raise StageBuildError(
                    f"node {n.name!r}{_where(n)} is assigned stage {s!r}; stage ids are ints in "
                    f"0..{num_stages - 1} (num_stages={num_stages})"
                )
            stage_of[n] = s
        elif not n.users:
            stage_of[n] = max((stage_of.get(m, 0) for m in n.all_input_nodes), default=0)
        else:
            missing.append(n.name)
    if missing:
        raise StageBuildError(
            f"{len(missing)} compute node(s) have no stage in the assignment: {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}; every call_function/call_method/call_module node "
            f"with users needs one"
        )
    for n, s in stage_of.items():
        for m in n.all_input_nodes:
            t = stage_of.get(m)
            if t is not None and t > s:
                raise StageBuildError(
                    f"node {n.name!r}{_where(n)} is in stage {s} but reads {m.name!r} from the later "
                    f"stage {t}; stages must follow the graph's topological order: move {n.name!r} "
                    f"to stage >= {t} or {m.name!r} to stage <= {s}"
                )
    used = set(stage_of.values())
    empty = [s for s in range(num_stages) if s not in used]
    if empty:
        raise StageBuildError(
            f"stage(s) {empty} hold no compute node; each of 0..{num_stages - 1} needs at least one "
            f"(reduce num_stages or move nodes)"
        )
    return stage_of


def _flat_outputs(gm: torch.fx.GraphModule, output_node: torch.fx.Node) -> tuple[list, Any]:
    """Flat model outputs (Nodes or constants) and the spec that rebuilds the structure."""
    out = output_node.args[0]
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is not None and info.out_spec is not None:
        leaves = list(out) if isinstance(out, (tuple, list)) else [out]
        return leaves, info.out_spec
    return pytree.tree_flatten(out)


def _grad_reachable(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """Nodes whose value depends on a parameter that requires grad."""
    reach: set[torch.fx.Node] = set()
    for n in nodes:
        if n.op == "get_attr":
            obj = resolve_path(gm, str(n.target))
            if isinstance(obj, torch.Tensor):
                hit = obj.requires_grad
            elif isinstance(obj, torch.nn.Module):
                hit = any(p.requires_grad for p in obj.parameters())
            else:
                hit = False
        elif n.op == "call_module":
            mod = gm.get_submodule(str(n.target))
            hit = _may_carry_grad(n) and (
                any(p.requires_grad for p in mod.parameters())
                or any(m in reach for m in n.all_input_nodes)
            )
        elif n.op in _COMPUTE_OPS:
            hit = _may_carry_grad(n) and any(m in reach for m in n.all_input_nodes)
        else:
            hit = False
        if hit:
            reach.add(n)
    return reach


def _may_carry_grad(n: torch.fx.Node) -> bool:
    """False when the value holds no floating tensor (`x.dtype`, `x.size()`, an int mask), so a
    gradient cannot flow through it; True when unknown."""
    val = _node_value(n)
    if val is _NO_META:
        return True

    def floating(v: Any) -> bool:
        if isinstance(v, (torch.Tensor, TensorMetadata)):
            return v.dtype.is_floating_point or v.dtype.is_complex
        if isinstance(v, (tuple, list)):
            return any(floating(x) for x in v)
        if isinstance(v, dict):
            return any(floating(x) for x in v.values())
        return False

    return floating(val)


_NO_META = object()


def _node_value(n: torch.fx.Node) -> Any:
    """node.meta["val"], or ShapeProp's tensor_meta; `_NO_META` when neither is there."""
    if "val" in n.meta:
        return n.meta["val"]
    if "tensor_meta" in n.meta:
        return n.meta["tensor_meta"]
    if "type" in n.meta:  # ShapeProp ran and the value holds no tensor
        return None
    if _obviously_not_tensor(n):  # fake propagation leaves e.g. `x.dtype` without "val"
        return None
    return _NO_META


_NON_TENSOR_ATTRS = frozenset(
    {"dtype", "device", "shape", "ndim", "layout", "is_cuda", "requires_grad", "is_sparse", "names"}
)
_NON_TENSOR_METHODS = frozenset(
    {"size", "dim", "ndimension", "numel", "nelement", "stride", "element_size", "is_contiguous",
     "is_floating_point", "get_device"}
)


def _obviously_not_tensor(n: torch.fx.Node) -> bool:
    if n.op == "call_function" and n.target is getattr and len(n.args) == 2:
        return n.args[1] in _NON_TENSOR_ATTRS
    if n.op == "call_method":
        return n.target in _NON_TENSOR_METHODS
    # a number computed from numbers (``x.shape[0]``, ``C ** -0.5``): torch 2.11's FakeTensorProp
    # records no "val" for a plain int or float (2.13's does); an operator or math function of
    # values that hold no tensor returns none
    if n.op == "call_function" and getattr(n.target, "__module__", None) in ("_operator", "operator", "math") \
            and n.all_input_nodes:
        return all(_holds_no_tensor(_node_value(a)) for a in n.all_input_nodes)
    # likewise an input passed as a number (``scale=1.0``): fake propagation gives every tensor input
    # a "val", so an input without one, in a graph whose other inputs have one, is not a tensor
    if n.op == "placeholder":
        return any(p.op == "placeholder" and isinstance(p.meta.get("val"), torch.Tensor) for p in n.graph.nodes)
    return False


def _holds_no_tensor(val: Any) -> bool:
    if val is _NO_META or isinstance(val, (torch.Tensor, TensorMetadata)):
        return False
    if isinstance(val, (tuple, list)):
        return all(_holds_no_tensor(v) for v in val)
    if isinstance(val, dict):
        return all(_holds_no_tensor(v) for v in val.values())
    return True


def _is_tensor(n: torch.fx.Node) -> bool:
    val = _node_value(n)
    if val is _NO_META:
        raise StageBuildError(
            f"node {n.name!r}{_where(n)} has no metadata (node.meta['val']); build_stages needs it to "
            f"tell tensors from other values across a cut. Fix: trace with fxsplit.trace, or run "
            f"torch.fx.passes.fake_tensor_prop.FakeTensorProp / shape_prop.ShapeProp on the graph"
        )
    return isinstance(val, (torch.Tensor, TensorMetadata))


def _value_meta(
    n: torch.fx.Node, gm: torch.fx.GraphModule, grad_nodes: set[torch.fx.Node], *, model_input: bool
) -> ValueMeta:
    val = _node_value(n)
    if val is _NO_META and n.op == "get_attr":
        val = resolve_path(gm, str(n.target))
    if val is _NO_META:
        _is_tensor(n)  # raises, naming the node and the fix
    if not isinstance(val, (torch.Tensor, TensorMetadata)):
        return ValueMeta.of(n.name, None)
    (tensor,) = tensor_metas(val)
    floating = tensor.dtype.is_floating_point or tensor.dtype.is_complex
    grad = floating and not model_input and n in grad_nodes
    order = None if model_input else dim_order_of(val)  # model inputs are read locally, never sent
    return ValueMeta.of(n.name, dataclasses.replace(tensor, requires_grad=grad, dim_order=order))


def _constant_meta(name: str, value: Any) -> ValueMeta:
    if isinstance(value, torch.Tensor):
        return ValueMeta.of(name, dataclasses.replace(tensor_metas(value)[0], requires_grad=False))
    return ValueMeta.of(name, None)


def _copy_buffer_persistence(root: torch.nn.Module, stage: torch.nn.Module) -> None:
    """GraphModule registers every copied tensor as a persistent buffer; keep the original's
    non-persistent ones out of the stage's state_dict so stage state dicts map back."""
    for fqn, _ in stage.named_buffers():
        try:
            orig_owner, field = owner_and_leaf(root, fqn)
        except AttributeError:  # PathError: the stage holds a tensor the root does not
            continue
        if field in getattr(orig_owner, "_non_persistent_buffers_set", ()):
            owner_and_leaf(stage, fqn)[0]._non_persistent_buffers_set.add(field)


def _shared_params(modules: list[torch.fx.GraphModule]) -> tuple[tuple[tuple[int, str], ...], ...]:
    """Groups of (stage, fqn) holding the same Parameter object in more than one stage."""
    holders: dict[int, list[tuple[int, str]]] = {}
    for s, module in enumerate(modules):
        for name, p in module.named_parameters():
            holders.setdefault(id(p), []).append((s, name))
    return tuple(tuple(g) for g in holders.values() if len({s for s, _ in g}) > 1)
