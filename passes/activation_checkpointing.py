"""The activation-checkpointing pass: each layer of a (stage) graph becomes one checkpointed call.

Written only against fxsplit's public API. Terms (layer key, region, mode, kept node) are
``fxsplit.graph.recompute``'s. For every region of the graph the pass

1. moves the region's compute nodes into a small GraphModule (``ckpt_<layer>`` in the graph
   dumps) that owns no parameters: parameters, buffers and called modules stay where they are
   and come in as inputs (a module call becomes ``call_module(mod, ...)``), so every parameter
   keeps its name and ``state_dict`` does not change;
2. writes the call site as ``checkpointed(self.ckpt_<layer>, mode, *inputs)``, which runs
   ``torch.utils.checkpoint.checkpoint`` (non-reentrant, RNG state preserved) and, for
   ``mode="selective"``, torch's selective policy; kept nodes inside a selective region are
   written ``keep_<op>(...)`` ([Note: selective policy] in ``fxsplit.graph.recompute``).

A region of one node, or whose nodes save nothing for backward (per the cost model), is left
alone. ``mode="none"``
changes nothing. The plan runs it on every stage graph with the stage's mode
(``ParallelConfig.activation_checkpointing``); bind options with ``functools.partial``:

    PassManager([partial(activation_checkpointing, mode="selective")])(stage_gm, ctx)
"""

from __future__ import annotations

import operator
import re
import torch
import torch.fx
from torch import nn

from fxsplit.graph.meta import annotate_node
from fxsplit.errors import PlanError
from fxsplit.graph.pass_api import PassContext, PassResult
from fxsplit.graph.recompute import MODES, call_module, checkpointed, keep, keeps_output, regions, worth_checkpointing

__all__ = ["activation_checkpointing"]


def _attr_name(gm: torch.fx.GraphModule, key: str) -> str:
    base = "ckpt_" + re.sub(r"\W", "_", key)
    name, i = base, 1
    while hasattr(gm, name):
        name, i = f"{base}_{i}", i + 1
    return name


def _outline(gm: torch.fx.GraphModule, key: str, nodes: list[torch.fx.Node], mode: str) -> int:
    """Replace ``nodes`` (one region, consecutive compute nodes) by one checkpointed call;
    returns how many nodes the region keeps (selective)."""
    graph = gm.graph
    inside = set(nodes)
    inputs: list[torch.fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    first, last = nodes[0], nodes[-1]
    modules: dict[str, torch.fx.Node] = {}  # module target -> outer get_attr of the module
    for n in nodes:
        if n.op == "call_module" and n.target not in modules:
            with graph.inserting_before(first):
                modules[str(n.target)] = graph.get_attr(str(n.target))

    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
        env[a].meta.update({k: v for k, v in a.meta.items() if k == "val"})
    mods = {t: sub.placeholder(m.name) for t, m in modules.items()}
    kept = 0
    for n in nodes:
        args = torch.fx.map_arg(n.args, lambda a: env[a])
        kwargs = torch.fx.map_arg(n.kwargs, lambda a: env[a])
        hold = mode == "selective" and keeps_output(n, gm)
        kept += hold
        if n.op == "call_module":
            args, target = (mods[str(n.target)], *args), call_module
        elif n.op == "call_method":
            target = getattr(torch.Tensor, str(n.target)) if hold else n.target
        else:
            target = n.target
        if hold:
            new = sub.call_function(keep(target), args, kwargs)
        elif n.op == "call_method":
            new = sub.call_method(target, args, kwargs)
        else:
            new = sub.call_function(target, args, kwargs)
        new.meta.update(n.meta)
        new.name = n.name  # same names as in the stage graph, for reading the dumps
        env[n] = new
    sub.output(tuple(env[o] for o in outputs))
    region = torch.fx.GraphModule(nn.Module(), sub, class_name="CheckpointRegion")
    name = _attr_name(gm, key)
    gm.add_submodule(name, region)

    with graph.inserting_after(last):
        fn = graph.get_attr(name)
    with graph.inserting_after(fn):
        call = graph.call_function(checkpointed, (fn, mode, *inputs, *modules.values()))
    if all("val" in out.meta for out in outputs):  # the metadata contract: the region's outputs
        call.meta["val"] = tuple(out.meta["val"] for out in outputs)
        annotate_node(call, gm)
    anchor = call
    for i, out in enumerate(outputs):
        with graph.inserting_after(anchor):
            item = graph.call_function(operator.getitem, (call, i))
        item.meta.update(out.meta)
        out.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
        anchor = item
    for n in reversed(nodes):
        graph.erase_node(n)
    return kept


def activation_checkpointing(gm: torch.fx.GraphModule, ctx: PassContext, *, mode: str) -> PassResult:
    """Checkpoint every region of ``gm`` with ``mode`` ("none", "selective" or "full");
    ``ctx.report["activation_checkpointing"]`` lists (layer key, nodes, kept nodes) per region."""
    if mode not in MODES:
        raise PlanError(f"activation_checkpointing: mode must be one of {MODES}, got {mode!r}")
    done: list[tuple[str, int, int]] = []
    if mode != "none":
        for key, nodes in regions(gm.graph):
            if worth_checkpointing(nodes):
                done.append((key, len(nodes), _outline(gm, key, nodes, mode)))
    ctx.report.setdefault("activation_checkpointing", []).append(tuple(done))
    return PassResult(gm, bool(done))
