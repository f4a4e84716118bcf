"""The expert-parallel pass: each MoE layer's expert FFN runs on the ranks that own its experts.

Written only against fxsplit's public API. For every MoE region of the graph ([Note: MoE regions]
in ``fxsplit.tp.moe``) it inserts the token exchange of ``fxsplit.tp.experts`` ([Note:
expert-parallel exchange]): the per-expert counts and the rows dispatched before the first grouped
matmul, the local group ends read by every grouped matmul of the region, and the combine after the
last one. The expert weights keep their names; each rank materializes rows ``[r * E / ep, (r + 1) *
E / ep)`` of them (``EPPlan.expert_params``, dim 0). The plan goes to ``ctx.report["expert_parallel"]``
with the spans the pipeline split must not cut (the rows between dispatch and combine have a size
only known at run time). Bind options with ``functools.partial``:

    PassManager([partial(expert_parallel, ep=2)])(gm, ctx)
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from fxsplit.graph.meta import annotate_node
from fxsplit.graph.pass_api import PassContext, PassResult
from fxsplit.tp.experts import ep_combine, ep_dispatch, ep_local_offsets, ep_token_counts
from fxsplit.tp.moe import EPPlan, MoELayer, find_moe_layers

__all__ = ["expert_parallel"]


def expert_parallel(gm: torch.fx.GraphModule, ctx: PassContext, *, ep: int, axis: str = "ep") -> PassResult:
    """Insert dispatch / combine around every MoE region of ``gm`` for ``ep`` expert-parallel ranks."""
    plan = find_moe_layers(gm, ep)
    spans = tuple(_rewrite(gm, layer, ep, axis) for layer in plan.layers)
    plan = dataclasses.replace(plan, spans=spans)
    ctx.report["expert_parallel"] = plan
    ctx.logger.info("expert_parallel:\n%s", plan)
    return PassResult(gm, bool(spans))


def _rewrite(gm: torch.fx.GraphModule, layer: MoELayer, ep: int, axis: str) -> tuple[str, str]:
    graph = gm.graph
    nodes = {n.name: n for n in graph.nodes}
    for name in layer.identities:  # fills never applied ([Note: sentinel masks] in fxsplit.tp.moe)
        fill = nodes.pop(name)
        fill.replace_all_uses_with(fill.args[0])
        graph.erase_node(fill)
    rows, offs, last = nodes[layer.rows], nodes[layer.offs], nodes[layer.last]
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min((nodes[f] for f in layer.first), key=order.__getitem__)
    with graph.inserting_before(first):
        recv = graph.call_function(ep_token_counts, (offs,), {"axis": axis})
        local = graph.call_function(ep_dispatch, (rows, offs, recv), {"axis": axis})
        local_offs = graph.call_function(ep_local_offsets, (recv, offs))
    for node in (nodes[m] for m in layer.matmuls):
        node.args = tuple(local_offs if a is offs else local if a is rows and node.name in layer.first else a
                          for a in node.args)
        node.kwargs = {k: local_offs if v is offs else v for k, v in node.kwargs.items()}
    with graph.inserting_after(last):
        out = graph.call_function(ep_combine, (last, offs, recv), {"axis": axis})
    last.replace_all_uses_with(out, delete_user_cb=lambda user: user is not out)
    offs_val = offs.meta.get("val")
    recv.meta["val"] = offs_val.new_empty((ep, layer.experts // ep), dtype=torch.int64) if offs_val is not None else None
    for node, like in ((local, rows), (local_offs, offs), (out, last)):
        node.meta["val"] = like.meta.get("val")
    for node in (recv, local, local_offs, out):
        for key in ("nn_module_stack", "stack_trace"):
            if key in last.meta:
                node.meta[key] = last.meta[key]
        annotate_node(node, gm)
    return recv.name, out.name
