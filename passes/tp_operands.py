"""The tensor-parallel pass's steps on operands of sharded nodes (``passes/tensor_parallel.py``
runs them, in this order, after the local shapes and parameters): ``x @ W.T`` linears made
linears, f on replicated operands whose gradient is partial (``plan.rewrite.grad_sums``),
``scatter_to_region`` on per-head biases (``plan.rewrite.scatters``), g after sums over the sharded dim
(``plan.rewrite.partial_sums``). The notes are in ``fxsplit.tp.plan`` ([Note: partial gradients of
replicated operands]) and ``fxsplit.tp.rules`` ([Note: scattered operands], [Note: reductions
over the sharded dim]). Written only against fxsplit's public API.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Mapping

import torch
import torch.fx
import torch.nn.functional as F

from fxsplit.tp.collectives import copy_to_region, reduce_from_region, scatter_to_region
from fxsplit.tp.plan import TPPlan

__all__ = ["new_node", "matmuls_as_linears", "grouped_weights", "whole_blocks", "sum_grads", "scatter_operands", "partial_sums"]


def new_node(graph: torch.fx.Graph, target, args, kwargs=None, *, like: torch.fx.Node, val=None) -> torch.fx.Node:
    n = graph.call_function(target, tuple(args), dict(kwargs or {}))
    for key in ("nn_module_stack", "stack_trace"):
        if key in like.meta:
            n.meta[key] = like.meta[key]
    if val is not None:
        n.meta["val"] = val
    return n


def matmuls_as_linears(gm: torch.fx.GraphModule, plan: TPPlan, nodes: Mapping[str, torch.fx.Node]) -> None:
    """Step 0: each ``x @ W.T`` linear of the plan (kind ``"matmul"``) becomes ``linear(x, W)``
    (the same value; node name kept), so the steps below treat it as any linear."""
    graph = gm.graph
    is_export = any(isinstance(n.target, torch._ops.OpOverload) for n in graph.nodes)
    for name, info in plan.rewrite.linears.items():
        if info.kind != "matmul" or name not in nodes:
            continue
        node = nodes[name]
        x, wt = node.args
        node.target = torch.ops.aten.linear.default if is_export else F.linear
        node.args = (x, wt.args[0])
        if not wt.users:
            graph.erase_node(wt)


def grouped_weights(plan: TPPlan, nodes: Mapping[str, torch.fx.Node], local_val: Callable[[Any, int, int], Any]) -> None:
    """Step 1b: a grouped linear's expert weight read transposed (``W.transpose(-2, -1)``), a
    batched linear's expert weight gathered per row (``W[ids]``): that read's metadata gets the
    local shape ([Note: experts as grouped linears])."""
    for name, info in plan.rewrite.linears.items():
        spec = plan.param_specs.get(info.weight)
        if info.kind == "grouped" and name in nodes:
            wt, flip = nodes[name].args[1], True
        elif info.kind == "batched" and name in nodes:
            wt, flip = nodes[name].args[1 - info.x_index], False  # W[ids]: W's dims kept
        else:
            continue
        if spec is None or not isinstance(wt, torch.fx.Node) or wt.op == "get_attr":
            continue
        d = spec.dim % 3
        size = spec.local_shape(plan.full_shapes[info.weight])[d]
        wt.meta["val"] = local_val(wt.meta.get("val"), 3 - d if flip else d, size)


def whole_blocks(gm: torch.fx.GraphModule, plan: TPPlan, nodes: dict[str, torch.fx.Node], axis: str,
                 module_to_function: Callable[[torch.fx.GraphModule, torch.fx.Node], torch.fx.Node]) -> None:
    """Step 1c: a column linear whose weight keeps some blocks whole (``ShardSpec.whole``: a
    multi-query k / v head) reads its weight and bias as ``cat(split(w))`` with f on the whole
    blocks: their gradient is partial on each rank (its heads' share), f sums it ([Note: whole
    blocks] in ``fxsplit.tp.regions``)."""
    graph = gm.graph
    is_export = any(isinstance(n.target, torch._ops.OpOverload) for n in graph.nodes)
    split = torch.ops.aten.split_with_sizes.default if is_export else torch.split
    cat = torch.ops.aten.cat.default if is_export else torch.cat
    for name, info in plan.rewrite.linears.items():
        spec = plan.param_specs.get(info.weight)
        if spec is None or not spec.whole or name not in nodes or info.kind not in ("module", "linear"):
            continue
        node = nodes[name]
        if info.kind == "module":  # F.linear under the module's node name (the plan's key)
            node = nodes[name] = module_to_function(gm, node)
            node.name = name
        ref = node.meta.get("val")
        for pos, fqn in ((1, info.weight), (2, info.bias)):
            a = node.args[pos] if len(node.args) > pos else None
            if fqn is None or not isinstance(a, torch.fx.Node) or a.op != "get_attr":
                continue
            s = plan.param_specs[fqn]
            full = plan.full_shapes[fqn]
            d = s.dim % len(full)
            runs: list[list] = []  # [size, whole]: adjacent blocks of one kind as one piece (one f for k and v)
            for i, b in enumerate(s.blocks):
                w_i = i in s.whole
                size = b if w_i else b // s.num_shards
                if runs and runs[-1][1] == w_i:
                    runs[-1][0] += size
                else:
                    runs.append([size, w_i])
            shape = list(s.local_shape(full))
            with graph.inserting_before(node):
                parts = new_node(graph, split, (a, [r[0] for r in runs], d), like=node)
                pieces = []
                for i, (size, w_i) in enumerate(runs):
                    g = new_node(graph, operator.getitem, (parts, i), like=node,
                                 val=_fake(ref, shape[:d] + [size] + shape[d + 1:]))
                    if w_i:
                        g = new_node(graph, copy_to_region, (g,), {"axis": axis}, like=node, val=g.meta["val"])
                    pieces.append(g)
                parts.meta["val"] = tuple(p.meta["val"] for p in pieces)
                w = new_node(graph, cat, (pieces, d), like=node, val=_fake(ref, shape))
            node.replace_input_with(a, w)


def _fake(ref: Any, shape: list[int]) -> Any:
    """A tensor of ``shape`` in ``ref``'s fake mode (metadata of the nodes whole_blocks adds)."""
    mode = getattr(ref, "fake_mode", None)
    if mode is None:
        return torch.empty(shape, device="meta")
    with mode:
        return torch.empty(shape, dtype=ref.dtype, device=ref.device)


def sum_grads(gm: torch.fx.GraphModule, plan: TPPlan, nodes: dict[str, torch.fx.Node], axis: str,
              module_to_function: Callable[[torch.fx.GraphModule, torch.fx.Node], torch.fx.Node]) -> None:
    """Step 2b: a replicated operand of a sharded node that carries a gradient (a per-head norm's
    weight, ``1 + w``, a statistic) gets a partial gradient on each rank: one f on that operand,
    before its first sharded reader, sums it (``plan.rewrite.grad_sums``)."""
    graph = gm.graph
    fs: dict[torch.fx.Node, torch.fx.Node] = {}
    for gs in plan.rewrite.grad_sums:
        name, operand = gs.node, gs.operand
        node = nodes[name]
        if operand == "<module>":
            node = nodes[name] = module_to_function(gm, node)
            reads = [a for a in node.all_input_nodes if a.op == "get_attr"]
        else:
            reads = [nodes[operand]]
        for a in reads:
            if a not in fs:
                with graph.inserting_before(node):
                    fs[a] = new_node(graph, copy_to_region, (a,), {"axis": axis}, like=node, val=a.meta.get("val"))
            node.replace_input_with(a, fs[a])


def scatter_operands(gm: torch.fx.GraphModule, plan: TPPlan, nodes: dict[str, torch.fx.Node], axis: str,
                     local_val: Callable[[Any, int, int], Any]) -> None:
    """Step 2c: a replicated operand with the sharded dim's full size (a per-head score bias) is
    read through ``scatter_to_region`` on that dim, one per (operand, dim), before its first
    sharded reader (``plan.rewrite.scatters``). On a merged dim (``Scatter.heads`` H: ``[N, H]`` with H
    sharded, [Note: heads merged as an inner factor] in ``fxsplit.tp.merged``) the read is
    strided: unflatten to ``[N, H]``, scatter on H, flatten back."""
    graph, t = gm.graph, plan.tp
    order = {n: i for i, n in enumerate(graph.nodes)}
    done: dict[tuple, torch.fx.Node] = {}
    for sc in sorted(plan.rewrite.scatters, key=lambda s: order[nodes[s.node]]):
        node, a, dim = nodes[sc.node], nodes[sc.operand], sc.dim
        key = (sc.operand, dim, sc.heads)
        if key not in done:
            val = a.meta.get("val")
            with graph.inserting_before(node):
                if sc.heads:
                    done[key] = _strided_scatter(graph, a, dim, sc.heads, t, axis, node)
                else:
                    local = local_val(val, dim, val.shape[dim] // t) if isinstance(val, torch.Tensor) else None
                    done[key] = new_node(graph, scatter_to_region, (a,), {"dim": dim, "axis": axis},
                                         like=node, val=local)
        node.replace_input_with(a, done[key])


def _strided_scatter(graph: torch.fx.Graph, a: torch.fx.Node, dim: int, heads: int, t: int, axis: str,
                     like: torch.fx.Node) -> torch.fx.Node:
    """Rank r's heads' rows of ``a``'s dim ``dim`` laid out ``[N, heads]``: unflatten, scatter
    on the heads, flatten (the scatter's backward all-gathers, as for a contiguous range)."""
    val = a.meta.get("val")
    fake = isinstance(val, torch.Tensor)
    v1 = torch.unflatten(val, dim, (-1, heads)) if fake else None
    u = new_node(graph, torch.unflatten, (a, dim, (-1, heads)), like=like, val=v1)
    v2 = torch.unflatten(val, dim, (-1, heads)).narrow(dim + 1, 0, heads // t) if fake else None
    sc = new_node(graph, scatter_to_region, (u,), {"dim": dim + 1, "axis": axis}, like=like, val=v2)
    v3 = torch.flatten(v2, dim, dim + 1) if fake else None
    return new_node(graph, torch.flatten, (sc, dim, dim + 1), like=like, val=v3)


def partial_sums(gm: torch.fx.GraphModule, plan: TPPlan, nodes: dict[str, torch.fx.Node], axis: str) -> None:
    """Step 2d (after the f's of step 2b): a sum / mean over the sharded dim gets g after it (a
    mean of local means divided by t), read by all its readers (``plan.rewrite.partial_sums``)."""
    graph = gm.graph
    is_export = any(isinstance(n.target, torch._ops.OpOverload) for n in graph.nodes)
    for ps in plan.rewrite.partial_sums:
        node, kind = nodes[ps.node], ps.kind
        val = node.meta.get("val")
        with graph.inserting_after(node):
            g = new_node(graph, reduce_from_region, (node,), {"axis": axis}, like=node, val=val)
        out = g
        if kind == "mean":
            with graph.inserting_after(g):
                div = torch.ops.aten.div.Tensor if is_export else operator.truediv
                out = new_node(graph, div, (g, plan.tp), like=node, val=val)
        node.replace_all_uses_with(out, delete_user_cb=lambda u: u is not g)
