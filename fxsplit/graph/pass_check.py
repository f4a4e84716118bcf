"""The metadata check the PassManager runs after a pass: does the graph still keep the contract?

Terms:
    contract: [Note: metadata contract] in :mod:`fxsplit.graph.meta`: every node carries
        ``meta["val"]`` (fake tensors) and ``meta["fxsplit"]`` (a NodeInfo).
    changed node: a node the pass added, or whose op, target, args or kwargs it changed
        (``replace_all_uses_with`` changes the args of every user).
    dirty node: a changed node whose output shapes differ from before the pass (or that is new);
        the nodes that read it are checked too, so a change that moves a shape is followed as far
        as it reaches.

    snapshot = take_snapshot(gm)                 # before the pass; None when gm has no metadata
    check_after(gm, snapshot, pass_name="p")     # after it; raises PassContractError

[Note: metadata check after a pass]
A pass that adds a node without ``meta["val"]`` leaves later passes blind: tensor parallelism
reads every node's shape to decide what is sharded, so a GELU added without one is taken as a full
tensor next to a sharded one and the plan fails only when it runs ("The size of tensor a (128) must
match the size of tensor b (64)", naming neither the pass nor the node). So after each pass, on a
graph that carried the contract before it, every changed node and every reader of a dirty node is
recomputed on fake tensors (its inputs' ``meta["val"]``, in the graph's fake mode) and its output
shapes and dtypes compared with its own ``meta["val"]`` and ``meta["fxsplit"].outputs``. The first
node (graph order) that has no metadata, fails on its inputs' shapes, or disagrees with its
metadata raises :class:`PassContractError` naming the pass, the node and the helper that fixes it.
Nodes whose value cannot be recomputed without running user code (``call_module``, a Python
function outside torch) are checked for the presence of their metadata only.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx
import torch.fx.experimental.symbolic_shapes
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.node import map_arg

from fxsplit.errors import PassContractError
from fxsplit.graph.shapes import tensor_metas

__all__ = ["Snapshot", "check_after", "take_snapshot"]

_FIX_VAL = ('copy meta["val"] from the node it replaces when the shape is the same, or compute it on '
            'fake tensors (torch.fx.passes.fake_tensor_prop.FakeTensorProp), then call '
            'fxsplit.graph.meta.annotate_node(node, gm)')
_FIX_INFO = 'call fxsplit.graph.meta.annotate_node(node, gm) after setting meta["val"]'


@dataclass(frozen=True)
class Snapshot:
    """The graph before a pass: each node's signature and output shapes."""

    signatures: dict[torch.fx.Node, str]
    shapes: dict[torch.fx.Node, tuple | None]  # None: the node had no meta["val"] (e.g. fx's getattr on a tensor)
    has_info: bool  # the graph carried meta["fxsplit"] as well
    no_val: frozenset[str]  # names of the nodes without meta["val"]: a copied graph keeps the names


def _signature(node: torch.fx.Node) -> str:
    # nodes by identity: the snapshot holds the old nodes, so their ids are not reused
    args = map_arg((node.args, node.kwargs), lambda n: f"<node {id(n)}>")
    return f"{node.op}|{node.target!r}|{args!r}"


def _shapes(val: Any) -> tuple:
    return tuple((m.shape, m.dtype) for m in tensor_metas(val))


def take_snapshot(gm: torch.fx.GraphModule) -> Snapshot | None:
    """The state to compare against after a pass, or None when ``gm`` does not carry the
    contract (e.g. a plain ``torch.fx.symbolic_trace`` graph): then there is nothing to keep."""
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if not placeholders or any("val" not in n.meta for n in placeholders):
        return None
    return Snapshot(
        signatures={n: _signature(n) for n in nodes},
        shapes={n: _shapes(n.meta["val"]) if "val" in n.meta else None for n in nodes},
        has_info=all("fxsplit" in n.meta for n in placeholders),
        no_val=frozenset(n.name for n in nodes if "val" not in n.meta),
    )


def check_after(gm: torch.fx.GraphModule, snapshot: Snapshot | None, *, pass_name: str,
                cache: dict | None = None) -> None:
    """Raise :class:`PassContractError` at the first node that breaks the contract after
    ``pass_name`` ([Note: metadata check after a pass]). ``cache``: output shapes already computed
    for an op on the same input shapes (one dict per PassManager run, [Note: cached fake values])."""
    if snapshot is None:
        return
    cache = {} if cache is None else cache
    dirty: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        new = node not in snapshot.signatures
        changed = new or snapshot.signatures[node] != _signature(node)
        if not changed and not any(a in dirty for a in node.all_input_nodes):
            continue
        if (not new and snapshot.shapes[node] is None) or (new and "val" not in node.meta
                                                              and node.name in snapshot.no_val):
            continue  # the tracer gave it no value (nothing to keep); a copy of such a node neither
        if node.op == "get_attr" and "val" not in node.meta and _attr(gm, str(node.target)) is None:
            continue  # a submodule (a checkpointed region's callee), not a tensor: no value to carry
        _check_node(gm, node, snapshot, pass_name, new=new, cache=cache)
        if new or _shapes(node.meta["val"]) != snapshot.shapes[node]:
            dirty.add(node)


def _check_node(gm: torch.fx.GraphModule, node: torch.fx.Node, snapshot: Snapshot, pass_name: str, *,
                new: bool, cache: dict) -> None:
    what = "added" if new else "changed (or fed from a changed node)"
    where = f"node {node.name!r} ({node.op} {_target_name(node)}) that pass {pass_name!r} {what}"
    if "val" not in node.meta:
        raise PassContractError(f'{where} has no meta["val"]; {_FIX_VAL}', pass_name=pass_name, node=node.name)
    if snapshot.has_info:
        info = node.meta.get("fxsplit")
        if info is None:
            raise PassContractError(f'{where} has no meta["fxsplit"]; {_FIX_INFO}', pass_name=pass_name,
                                    node=node.name)
        declared = tuple((m.shape, m.dtype) for m in info.outputs)
        if not _same(declared, _shapes(node.meta["val"])):
            raise PassContractError(
                f'{where}: meta["fxsplit"] says {_fmt(declared)} but meta["val"] is {_fmt(_shapes(node.meta["val"]))}; '
                f"{_FIX_INFO}", pass_name=pass_name, node=node.name)
    computed = _recompute_shapes(gm, node, where, pass_name, cache)
    if computed is not None and not _same(computed, _shapes(node.meta["val"])):
        raise PassContractError(
            f'{where} computes {_fmt(computed)} from its inputs, but its meta["val"] says '
            f'{_fmt(_shapes(node.meta["val"]))}; {_FIX_VAL}', pass_name=pass_name, node=node.name)


def _recomputable(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return True
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return True
    module = getattr(target, "__module__", None) or ""
    if module in ("_operator", "operator") or target is operator.getitem:
        return True
    return module.startswith("torch") and not module.startswith(("torch.utils", "torch.distributed"))


# [Note: cached fake values]
# Tensor parallelism changes the same few nodes in every layer (the views that carry the local head
# count, the collectives it adds), so the check recomputes the same op on the same input shapes once
# per layer. An op's output shapes are a function of its target, its constant arguments and its
# inputs' shapes, dtypes and strides, so one PassManager run keeps them by that key and recomputes
# each distinct case once (a 70B Llama: 80 layers, one computation per case; measured in
# benchmarks/README.md). A case that failed is not kept: it raises at its first node.


def _freeze(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(map(str, x.shape)), x.dtype, tuple(map(str, x.stride())))
    return repr(x) if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)) else x


def _recompute_shapes(gm: torch.fx.GraphModule, node: torch.fx.Node, where: str, pass_name: str,
                      cache: dict) -> tuple | None:
    """The output shapes ``node`` computes from its inputs' ``meta["val"]`` (None: unknowable)."""
    if node.op != "get_attr" and _recomputable(node) and all("val" in a.meta for a in node.all_input_nodes):
        try:
            key = (node.op, node.target, _freeze(map_arg((node.args, node.kwargs), lambda a: a.meta["val"])))
            hash(key)
        except TypeError:  # an argument that cannot be a key (a callable with state, ...)
            key = None
        if key is not None and key in cache:
            return cache[key]
        computed = _recompute(gm, node, where, pass_name)
        shapes = None if computed is None else _shapes(computed)
        if key is not None:
            cache[key] = shapes
        return shapes
    computed = _recompute(gm, node, where, pass_name)
    return None if computed is None else _shapes(computed)


def _recompute(gm: torch.fx.GraphModule, node: torch.fx.Node, where: str, pass_name: str) -> Any:
    if node.op == "get_attr":
        return _attr(gm, str(node.target))
    if not _recomputable(node) or any("val" not in a.meta for a in node.all_input_nodes):
        return None
    args, kwargs = map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
    if node.op == "call_method" and not (args and isinstance(args[0], torch.Tensor)):
        return None  # a method of a non-tensor value (a dict's .items(), ...)
    mode = torch._guards.detect_fake_mode([a.meta["val"] for a in node.all_input_nodes])
    if mode is None:  # no tensor input (an arange of a size): the mode the node's value was made in,
        # so that its sizes read as the graph reads them ([Note: a marker batch])
        mode = getattr(node.meta.get("val"), "fake_mode", None)
    try:
        # the python dispatcher: ops whose C++ kernel needs concrete sizes (baddbmm broadcasting
        # its input) run their Python decompositions on symbolic shapes, as torch.export ran them
        with mode if mode is not None else contextlib.nullcontext(), enable_python_dispatcher():
            if node.op == "call_method":
                return getattr(args[0], node.target)(*args[1:], **kwargs)
            return node.target(*args, **kwargs)
    except _UNKNOWABLE:
        return None  # the output shape depends on the data (nonzero, ...): nothing to compare
    except Exception as exc:
        inputs = ", ".join(f"{a.name}: {_fmt(_shapes(a.meta['val']))}" for a in node.all_input_nodes)
        raise PassContractError(
            f"{where} fails on its inputs' shapes ({inputs}): {type(exc).__name__}: {str(exc).splitlines()[0]}",
            pass_name=pass_name, node=node.name) from exc


_UNKNOWABLE = (
    torch._subclasses.fake_tensor.DataDependentOutputException,
    torch._subclasses.fake_tensor.DynamicOutputShapeException,
    torch._subclasses.fake_tensor.UnsupportedOperatorException,
    torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode,
)


def _attr(gm: torch.fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, torch.Tensor) else None


def _same(a: tuple, b: tuple) -> bool:
    if len(a) != len(b):
        return False
    for (shape_a, dtype_a), (shape_b, dtype_b) in zip(a, b):
        if dtype_a != dtype_b or len(shape_a) != len(shape_b):
            return False
        for x, y in zip(shape_a, shape_b):
            if x != y and sympy.expand(sympy.sympify(x) - sympy.sympify(y)) != 0:
                return False
    return True


def _fmt(shapes: tuple) -> str:
    parts = [f"{list(s)} {str(d).removeprefix('torch.')}" for s, d in shapes]
    return ", ".join(parts) if parts else "no tensor"


def _target_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", None) or str(target)
