"""Mixture-of-experts layers found from the graph, for expert parallelism: the expert-parallel plan.

Terms: **ep** -- the expert-parallel degree (ranks that hold different experts of a layer and
exchange tokens); **E** -- experts of a layer; **rows** -- the routed rows sorted by expert that the
first grouped matmul(s) read; **offs** -- their group ends; **region** -- the nodes from the first
grouped matmul(s) to the last: grouped linears over one ``offs`` and row-wise ops between them
(the expert FFN); **skipped** -- a layer left as it is, with the reason.

    ep_plan = find_moe_layers(gm, ep=2)
    print(ep_plan)                  # one line per MoE layer: experts, weights, experts per rank
    ep_plan.expert_params           # the fused expert weights, sharded on dim 0 into ep blocks

[Note: MoE regions] A MoE layer is recognised by what its graph computes, not by module class:
grouped linears (``fxsplit.tp.linears``: transformers' ``grouped_mm`` experts, torchtitan-style
grouped experts; [Note: experts as grouped linears]) that share one ``offs``; the first ones read
the same rows, one last one ends the region, and every node between them is a row-wise op
(activation, gate product, the fused gate/up's split on the feature dim) used only inside the
region. Such a region maps each row to its own output row through its own expert, so it can run
on the rank owning that expert: ``fxsplit.passes.expert_parallel`` puts the token exchange
([Note: expert-parallel exchange] in ``fxsplit.tp.experts``) around it. The router, the sort, the
routing weights, the combine over top-k, shared experts, expert biases gathered per row after the
last matmul and auxiliary losses are outside the region and stay as they are (replicated, data
parallel). Anything else is left as traced (no token exchange), with the reason in ``skipped``:
``batched_mm`` experts (each row gathers its expert's matrix, ``W[expert_ids]``, in token order: no sorted rows
to exchange), dense experts (``bmm`` of every token with every expert's matrix, Llama 4's form),
a region with another op or a value escaping it (gpt-oss's expert biases gathered per row between
its matmuls), E not divisible by ep.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from fxsplit.errors import PlanError
from fxsplit.graph.inspection import module_path
from fxsplit.graph.ops import op_name
from fxsplit.tp.linears import find_linears

__all__ = ["EPPlan", "MoELayer", "find_moe_layers"]

# ops that act on each row alone (dim 0 untouched): what may sit between the grouped linears
_ROW_WISE = frozenset({"silu", "gelu", "relu", "sigmoid", "tanh", "mul", "add", "sub", "div", "neg", "to",
                       "type_as", "clamp", "pow", "square", "getitem", "slice", "chunk", "split", "split_with_sizes", "contiguous",
                       "_to_copy", "clone", "alias"})
_SPLITS = frozenset({"chunk", "split", "split_with_sizes", "slice"})  # row-wise unless along dim 0


@dataclass(frozen=True)
class MoELayer:
    """One MoE region: ``rows`` -> grouped linears ``first`` ... ``last`` over ``offs``."""

    module_path: str
    experts: int  # E
    weights: tuple[str, ...]  # fused 3-D expert weights [E, ...], sharded on dim 0
    rows: str  # node names
    offs: str
    first: tuple[str, ...]
    last: str
    matmuls: tuple[str, ...]  # every grouped linear of the region, first and last included
    region: tuple[str, ...] = field(default=(), compare=False)  # every node of the expert FFN, in graph order

    def __str__(self) -> str:
        return f"{self.module_path or '<root>'}: {self.experts} experts, weights {', '.join(self.weights)}"


@dataclass(frozen=True)
class EPPlan:
    """The expert-parallel plan: the MoE layers sharded over ``ep`` and those kept as they are."""

    ep: int = 1
    layers: tuple[MoELayer, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()  # (module path, why it is left as traced)
    spans: tuple[tuple[str, str], ...] = field(default=(), compare=False)  # (dispatch, combine) node names

    @property
    def expert_params(self) -> tuple[str, ...]:
        return tuple(w for layer in self.layers for w in layer.weights)

    def __str__(self) -> str:
        lines = [f"expert parallelism ep={self.ep}: {len(self.layers)} MoE layer(s)"]
        lines += [f"  {layer} ({layer.experts // self.ep} per rank)" for layer in self.layers]
        lines += [f"  kept as is: {where or '<root>'}: {why}" for where, why in self.skipped]
        return "\n".join(lines)


def _region(first: list[torch.fx.Node], last: torch.fx.Node, group: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """Nodes on some path from a first grouped linear to the last (both included)."""
    down: set[torch.fx.Node] = set()
    todo = list(first)
    while todo:
        n = todo.pop()
        if n in down:
            continue
        down.add(n)
        if n is not last:
            todo.extend(n.users)
    up: set[torch.fx.Node] = set()
    todo = [last]
    while todo:
        n = todo.pop()
        if n in up or n not in down:
            continue
        up.add(n)
        todo.extend(a for a in n.all_input_nodes)
    return up


def _why_not(region: set[torch.fx.Node], group: set[torch.fx.Node], rows: torch.fx.Node, offs: torch.fx.Node,
             last: torch.fx.Node) -> str | None:
    """Why ``region`` cannot run on the experts' owners row by row, or None when it can."""
    for n in region:
        if n not in group:
            name = op_name(n)
            if name not in _ROW_WISE:
                return f"{n.name} ({name}) between the grouped matmuls is not a row-wise op"
            if name in _SPLITS and _split_dim(n) == 0:
                return f"{n.name} splits the rows (dim 0)"
        if n is not last and any(u not in region for u in n.users):
            outside = next(u for u in n.users if u not in region)
            return f"{n.name} is also used outside the expert region (by {outside.name})"
        for a in n.all_input_nodes:
            if a in region or a is rows or a is offs:
                continue
            val = a.meta.get("val")
            if a.op != "get_attr" and not _weight_read(a) and isinstance(val, torch.Tensor) and val.dim() >= 1 \
                    and val.dim() != 3:
                return f"{n.name} reads {a.name}, a per-row value from outside the expert region"
    return None


def _split_dim(node: torch.fx.Node) -> int:
    """The dim a chunk / split / slice node splits its 2-D input along (0 or 1)."""
    at = 1 if op_name(node) == "slice" else 2  # slice(x, dim, start, end, step); split(x, size, dim)
    dim = node.args[at] if len(node.args) > at else node.kwargs.get("dim", 0)
    return dim % 2 if isinstance(dim, int) else 0


def _weight_read(node: torch.fx.Node) -> bool:
    """A parameter read as it is or transposed (the grouped linear's weight operand)."""
    return node.op == "get_attr" or (op_name(node) in ("transpose", "permute", "t")
                                     and all(a.op == "get_attr" for a in node.all_input_nodes))


def find_moe_layers(gm: torch.fx.GraphModule, ep: int) -> EPPlan:
    """The MoE regions of ``gm`` ([Note: MoE regions]) and the layers kept as they are, for degree ``ep``."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise PlanError(f"ep must be an int >= 1, got {ep!r}")
    linears = find_linears(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    by_offs: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    skipped: list[tuple[str, str]] = []
    for name, info in linears.items():
        node = nodes[name]
        if info.kind == "batched":
            skipped.append((info.module_path, "batched_mm experts (W[expert_ids] per row, in token order); "
                            "use the grouped_mm experts implementation for expert parallelism"))
        elif info.kind == "grouped":
            offs = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
            if isinstance(offs, torch.fx.Node):
                by_offs.setdefault(offs, []).append(node)
    skipped += _dense_experts(gm, linears)
    layers = []
    for offs, group in by_offs.items():
        layer, why = _layer(gm, linears, offs, group)
        if layer is None:
            skipped.append((linears[group[0].name].module_path, why))
        elif layer.experts % ep:
            skipped.append((layer.module_path, f"{layer.experts} experts do not divide into ep={ep} blocks"))
        else:
            layers.append(layer)
    return EPPlan(ep=ep, layers=tuple(layers), skipped=tuple(dict.fromkeys(skipped)))


def _dense_experts(gm: torch.fx.GraphModule, linears: dict) -> list[tuple[str, str]]:
    """Experts that every token goes through (``bmm`` of a ``[E, rows, C]`` view with a 3-D
    parameter, Llama 4's form): no routed rows to exchange, so they stay whole on every rank."""
    found = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.name in linears or op_name(n) != "bmm" or len(n.args) < 2:
            continue
        w = n.args[1]
        val = w.meta.get("val") if isinstance(w, torch.fx.Node) else None
        if _weight_read(w) and isinstance(val, torch.Tensor) and val.dim() == 3:
            found.append((module_path(n), "dense experts: every token runs through every expert (bmm over "
                          "[experts, tokens, features]), so there are no routed rows to exchange"))
    return found


def _layer(gm: torch.fx.GraphModule, linears: dict, offs: torch.fx.Node,
           group: list[torch.fx.Node]) -> tuple[MoELayer | None, str]:
    members = set(group)
    feeds = {g: _reaches(g, members - {g}) for g in group}
    firsts = [g for g in group if not any(g in feeds[h] for h in group if h is not g)]
    lasts = [g for g in group if not feeds[g]]
    rows = {g.args[0] for g in firsts}
    if len(lasts) != 1 or len(rows) != 1:
        return None, (f"grouped matmuls over {offs.name} do not form one expert FFN "
                      f"({len(rows)} row input(s), {len(lasts)} last matmul(s))")
    last, (x,) = lasts[0], rows
    region = _region(firsts, last, members)
    if not members <= region:
        return None, f"grouped matmuls over {offs.name} are not all on a path from the first to the last"
    why = _why_not(region, members, x, offs, last)
    if why is not None:
        return None, why
    weights = tuple(dict.fromkeys(linears[g.name].weight for g in group))
    sizes = {tuple(gm.get_parameter(w).shape)[0] for w in weights}
    if len(sizes) != 1 or offs.meta.get("val") is None or tuple(offs.meta["val"].shape) != (sizes.copy().pop(),):
        return None, f"expert weights {weights} and {offs.name} disagree on the number of experts"
    path = linears[last.name].module_path
    ordered = tuple(n.name for n in gm.graph.nodes if n in region)
    return MoELayer(path, sizes.pop(), weights, x.name, offs.name, tuple(g.name for g in firsts), last.name,
                    tuple(g.name for g in group), ordered), ""


def _reaches(start: torch.fx.Node, targets: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """The nodes of ``targets`` reachable from ``start`` through its users."""
    seen, found, todo = set(), set(), list(start.users)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in targets:
            found.add(n)
        todo.extend(n.users)
    return found
