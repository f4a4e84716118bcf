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

import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx
from torch.utils import _pytree as pytree

__all__ = [
    "StageBuildError",
    "StageGraphs",
    "StageIO",
    "ValueMeta",
    "ValueSource",
    "build_stages",
]


class StageBuildError(ValueError):
    """A graph or an assignment that cannot be cut into stages; the message names the node."""


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
            raise ValueError(f"ValueSource.index must be >= 0, got {self.index}")
        if self.stage is not None and self.stage < 0:
            raise ValueError(f"ValueSource.stage must be None or >= 0, got {self.stage}")

    def __str__(self) -> str:
        return f"in{self.index}" if self.stage is None else f"s{self.stage}.out{self.index}"


@dataclass(frozen=True)
class ValueMeta:
    """One value passed into or out of a stage. `shape` entries are ints or sympy expressions in
    the batch / sequence symbols; `requires_grad` is True only for a floating tensor that carries
    a gradient back (see [Note: values across a cut])."""

    name: str
    is_tensor: bool
    shape: tuple[int | sympy.Expr, ...] | None
    dtype: torch.dtype | None
    requires_grad: bool

    def __post_init__(self) -> None:
        if not self.is_tensor and (self.shape is not None or self.dtype is not None or self.requires_grad):
            raise ValueError(
                f"ValueMeta {self.name!r}: a non-tensor value has shape=None, dtype=None and "
                f"requires_grad=False, got shape={self.shape}, dtype={self.dtype}, "
                f"requires_grad={self.requires_grad}"
            )
        if self.requires_grad and self.dtype is not None and not (
            self.dtype.is_floating_point or self.dtype.is_complex
        ):
            raise ValueError(
                f"ValueMeta {self.name!r}: requires_grad=True needs a floating dtype, got {self.dtype}"
            )

    def __str__(self) -> str:
        if not self.is_tensor:
            return f"{self.name}:obj"
        dims = "x".join(str(d) for d in self.shape) if self.shape is not None else "?"
        dtype = str(self.dtype).replace("torch.", "") if self.dtype is not None else "?"
        return f"{self.name}:{dtype}[{dims}]{'*' if self.requires_grad else ''}"


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
            raise ValueError(
                f"StageIO {self.index}: {len(self.inputs)} inputs but {len(self.input_meta)} input_meta"
            )
        if len(self.outputs) != len(self.consumers):
            raise ValueError(
                f"StageIO {self.index}: {len(self.outputs)} outputs but {len(self.consumers)} consumer lists"
            )
        for k, cons in enumerate(self.consumers):
            bad = [c for c in cons if c <= self.index]
            if bad:
                raise ValueError(
                    f"StageIO {self.index}: output {k} consumed by stages {bad}, which are not later stages"
                )
        for flat_idx, local in self.model_outputs:
            if not 0 <= local < len(self.outputs):
                raise ValueError(
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
            raise ValueError(f"StageGraphs: {len(self.modules)} modules but {len(self.io)} StageIO")
        for k, io in enumerate(self.io):
            if io.index != k:
                raise ValueError(f"StageGraphs: io[{k}].index is {io.index}, expected {k}")
            if io.model_outputs and k != len(self.io) - 1:
                raise ValueError(f"StageGraphs: stage {k} has model outputs; only the last stage may")

    @property
    def num_stages(self) -> int:
        return len(self.modules)

    def run_sequential(self, *flat_inputs: Any) -> list:
        """Reference executor: run the stages in order in this process; return the flat model
        outputs (`pytree.tree_unflatten(out, self.output_spec)` rebuilds the structure)."""
        if len(flat_inputs) != len(self.input_meta):
            names = [m.name for m in self.input_meta]
            raise TypeError(
                f"run_sequential expects {len(self.input_meta)} flat model inputs {names}, "
                f"got {len(flat_inputs)}"
            )
        stage_outputs: list[tuple] = []
        for module, io in zip(self.modules, self.io):
            args = [
                flat_inputs[src.index] if src.stage is None else stage_outputs[src.stage][src.index]
                for src in io.inputs
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
    gm: torch.fx.GraphModule, assignment: Mapping[str, int], num_stages: int
) -> StageGraphs:
    raise NotImplementedError("build_stages is being written")
