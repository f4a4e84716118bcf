"""Graph metadata that every fxsplit pass can rely on, whichever tracer produced the graph.

Terms:
- **NodeInfo**: ``node.meta["fxsplit"]``, written by :func:`fxsplit.trace` on every node.
- **TensorMeta**: shape (ints, or sympy expressions in the batch/sequence symbols), dtype and
  requires_grad of one tensor value: what a node produces (``NodeInfo.outputs``), what the cost
  model reads, what crosses a pipeline stage boundary (``fxsplit.pipeline.stage.ValueMeta``).
  Defined with :func:`to_expr` in ``fxsplit.graph.shapes``, below the cost model that
  :func:`annotate_node` runs; import both from here.
- **TraceInfo**: ``gm.meta["fxsplit"]``: which tracer ran and why, the symbols of the dynamic
  dimensions, and the names of the model inputs.

[Note: metadata contract]
After ``fxsplit.trace`` every node carries ``node.meta["val"]`` (a FakeTensor, a tuple of them, an
int/SymInt or None) and ``node.meta["fxsplit"]`` (a :class:`NodeInfo`). Passes that add nodes call
:func:`annotate_node` (or :func:`annotate_graph`) so later passes see the same contract.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

import sympy
import torch
import torch.fx

from fxsplit.errors import MissingKeyError
from fxsplit.graph.shapes import Dim, Number, TensorMeta, substitute, tensor_metas, to_expr
from fxsplit.graph.symbolic import keeping_symbols  # re-exported: passes use it from here

__all__ = [
    "fake_like",
    "keeping_symbols",
    "Dim",
    "TensorMeta",
    "NodeInfo",
    "TraceInfo",
    "node_info",
    "trace_info",
    "Number",
    "to_expr",
    "substitute",
    "tensor_metas",
    "module_path_of",
    "params_read",
    "annotate_node",
    "annotate_graph",
]

@dataclass(frozen=True)
class NodeInfo:
    """fxsplit's metadata of one node (``node.meta["fxsplit"]``).

    ``module_path`` is the FQN of the innermost module the node came from ("" at top level);
    ``outputs`` the tensors it produces (flattened; empty for non-tensor values); ``params`` the
    parameter/buffer FQNs it reads directly (a get_attr's own target, a call_module's parameters,
    or the get_attr nodes among its inputs); ``cost`` its :class:`fxsplit.graph.cost.NodeCost` (None only
    while the cost model is not attached).
    """

    module_path: str
    module_type: str = ""
    outputs: tuple[TensorMeta, ...] = ()
    params: tuple[str, ...] = ()
    cost: Any = None

    def replace(self, **changes: Any) -> "NodeInfo":
        return dataclasses.replace(self, **changes)

    def output_bytes(self, binds: Mapping[sympy.Symbol, int | float] | None = None) -> float:
        """Bytes of every output tensor, symbolic sizes evaluated at ``binds`` (the one place a
        node's output bytes are computed: the split's boundaries, the checkpointing and memory
        models and the planner's workload all ask it)."""
        return float(sum(float(substitute(t.nbytes, binds or {})) for t in self.outputs))


@dataclass(frozen=True)
class TraceInfo:
    """How a graph was traced (``gm.meta["fxsplit"]``)."""

    method: str  # "fx" or "export"
    reason: str  # why this method (e.g. "fx failed: ...; used export")
    input_names: tuple[str, ...]  # flat model inputs, graph placeholder order
    symbols: Mapping[str, sympy.Symbol] = field(default_factory=dict)  # "batch", "seq", ... -> symbol
    dynamic: bool = False  # whether batch/sequence are symbolic in the graph itself
    on_meta: bool = False  # whether the model's parameters were on the meta device
    # the length torch.export traced the sequence at when it traced it static (None: fx, or a symbolic
    # trace), and whether the graph was then made to take every length up to it ([Note: following
    # the sequence from two static traces] in fxsplit.graph.sequence)
    traced_length: int | None = None
    follows_sequence: bool = False
    follow_refused: str | None = None  # why a graph asked to follow the length stays static

    def bindings(self, **sizes: int) -> dict[sympy.Symbol, int]:
        """``info.bindings(batch=8, seq=128)`` -> {symbol: value} for :meth:`TensorMeta.concrete_shape`."""
        unknown = set(sizes) - set(self.symbols)
        if unknown:
            raise MissingKeyError(f"no symbolic dimension named {sorted(unknown)}; this graph has {sorted(self.symbols)}")
        return {self.symbols[k]: v for k, v in sizes.items()}


def node_info(node: torch.fx.Node) -> NodeInfo:
    """The :class:`NodeInfo` of ``node``; a clear error if the graph was not traced by fxsplit."""
    info = node.meta.get("fxsplit")
    if info is None:
        raise MissingKeyError(
            f"node {node.name!r} ({node.op} {node.target}) has no fxsplit metadata; trace the model "
            f"with fxsplit.trace(...) or call fxsplit.graph.meta.annotate_node(node, gm) after adding nodes"
        )
    return info


def trace_info(gm: torch.fx.GraphModule) -> TraceInfo | None:
    return getattr(gm, "meta", {}).get("fxsplit")


def _normalize_path(path: str) -> str:
    # export may spell paths as "L['self'].h[0].attn" or "h.0.attn"
    path = path.replace("L['self'].", "").replace("L['self']", "")
    path = path.replace("[", ".").replace("]", "").replace("'", "")
    return path.strip(".")


def module_path_of(node: torch.fx.Node) -> tuple[str, str]:
    """(module FQN, module class name) the node came from, from fx/export's ``nn_module_stack``."""
    if node.op == "call_module":
        stack = node.meta.get("nn_module_stack") or {}
        cls = ""
        if stack:
            last = list(stack.values())[-1]
            cls = last[1] if isinstance(last[1], str) else getattr(last[1], "__name__", str(last[1]))
        return str(node.target), cls.rsplit(".", 1)[-1]
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0], ""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, cls = list(stack.values())[-1]
    if path == "_empty_nn_module_stack_from_metadata_hook":
        return "", ""
    cls_name = cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))
    return _normalize_path(str(path)), cls_name.rsplit(".", 1)[-1]


def params_read(node: torch.fx.Node, gm: torch.fx.GraphModule) -> tuple[str, ...]:
    """FQNs of the parameters and buffers ``node`` reads directly."""
    if node.op == "get_attr":
        return (str(node.target),)
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        prefix = f"{node.target}."
        names = [prefix + n for n, _ in mod.named_parameters(remove_duplicate=False)]
        names += [prefix + n for n, _ in mod.named_buffers(remove_duplicate=False)]
        return tuple(names)
    return tuple(str(a.target) for a in node.all_input_nodes if a.op == "get_attr")


def annotate_node(node: torch.fx.Node, gm: torch.fx.GraphModule, *, module_path: str | None = None,
                  cost: Any = None) -> NodeInfo:
    """(Re)compute ``node.meta["fxsplit"]`` from ``node.meta["val"]`` and the cost model
    (``cost``: the node's ``NodeCost`` when the caller has it, as ``annotate_graph`` does)."""
    from fxsplit.graph.cost import node_cost  # the cost model is a pure function of this metadata

    path, cls = module_path_of(node)
    if module_path is not None:
        path = module_path
    info = NodeInfo(
        module_path=path,
        module_type=cls,
        outputs=tensor_metas(node.meta.get("val")),
        params=params_read(node, gm),
    )
    node.meta["fxsplit"] = info
    try:
        cost = node_cost(node, gm) if cost is None else cost
    except Exception as exc:  # the cost model must never block tracing; record why
        exc.add_note(f"while estimating the cost of node {node.name!r} ({node.op} {node.target})")
        raise
    info = info.replace(cost=cost)
    node.meta["fxsplit"] = info
    return info


def annotate_graph(gm: torch.fx.GraphModule) -> None:
    """Annotate every node of ``gm`` (after fake-tensor propagation filled ``meta["val"]``).

    The costs come from one ``graph_costs`` pass, which resolves parameter ownership once: a
    ``node_cost`` per node rescans the earlier nodes for every parameter read, quadratic in the
    graph (seconds for a Llama-70B graph, run after the trace and after tensor parallelism)."""
    from fxsplit.graph.cost import graph_costs

    costs = graph_costs(gm)
    for node in gm.graph.nodes:
        annotate_node(node, gm, cost=costs[node.name])


# [Note: fake tensors without dispatch]
# The TP pass (fxsplit.passes.tensor_parallel) gives every sharded node a local ``meta["val"]``
# (~40 per Llama layer) and every new parameter read one. ``torch.empty(shape)`` under the graph's FakeTensorMode costs ~0.4 ms with
# static sizes (the mode's dispatch: cache lookup, meta kernel, output wrapping) and ~3 ms with a
# symbolic batch. With int sizes, the fake tensor the mode would return is a FakeTensor wrapping
# a meta tensor of that shape, dtype and default (contiguous) strides, on the fake device: built
# directly, as the mode's own ``from_tensor`` does (~0.03 ms). Symbolic sizes keep the mode (a
# meta tensor cannot hold a SymInt outside it). Each call returns a new tensor, as torch.empty did.


def fake_like(val: torch.Tensor, shape: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new contiguous fake tensor of ``shape`` (and ``dtype``, default ``val``'s) in ``val``'s
    fake mode and on its device; a meta tensor when ``val`` is not fake."""
    dtype = val.dtype if dtype is None else dtype
    mode = getattr(val, "fake_mode", None)
    if mode is None:
        return torch.empty(tuple(shape), dtype=dtype, device="meta")
    shape = tuple(shape)
    if all(type(s) is int for s in shape):
        from torch._subclasses.fake_tensor import FakeTensor

        return FakeTensor(mode, torch.empty(shape, dtype=dtype, device="meta"), val.fake_device)
    with mode:
        return torch.empty(shape, dtype=dtype, device=val.device)
