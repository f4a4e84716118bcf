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
experts in a loop (rows split by data-dependent counts, one linear per expert: JetMoE's form),
a region with another op or a value escaping it (gpt-oss's expert biases gathered per row between
its matmuls), E not divisible by ep.

[Note: sentinel masks] transformers 5.17's grouped_mm experts zero the rows of "sentinel" tokens
(expert id >= E, which only its own expert parallelism makes) after each grouped matmul:
``proj_out.masked_fill((expert_ids_g >= E).unsqueeze(-1), 0.0)``, unconditionally (5.25 masks only
under its own expert parallelism). The mask is a per-row value from outside the region, so the
region would be kept as traced. Where the graph shows the mask is never true (the ids are the
indices of a ``topk``, ``max`` or ``argmax`` over a dim of at most E entries, moved only by reshapes,
``sort`` and ``cat`` (through a no_grad block's subgraph too: phimoe's router), with no
in-place write before the comparison), the fill is the identity: the region accepts it and
``MoELayer.identities`` names it, for the pass to remove (exactly: the same values, the same
gradients). A mask that could be true keeps the region as traced.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

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
    identities: tuple[str, ...] = field(default=(), compare=False)  # fills never applied ([Note: sentinel masks])

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
             last: torch.fx.Node, identities: set[torch.fx.Node] = frozenset()) -> str | None:
    """Why ``region`` cannot run on the experts' owners row by row, or None when it can
    (``identities``: fills that are never applied, [Note: sentinel masks])."""
    for n in region:
        if n in identities:
            if any(u not in region for u in n.users):
                return f"{n.name} is also used outside the expert region"
            continue
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
    skipped += _dense_experts(gm, linears) + _looped_experts(gm)
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


def _looped_experts(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """Experts run one by one (JetMoE's form): the rows ``split_with_sizes`` along dim 0 by counts
    computed from the data (data-dependent sizes), each piece through a linear whose weight is one
    expert's slice (``select`` on dim 0) of a 3-D parameter. No grouped linear over one ``offs``
    to put the exchange around, so they stay whole on every rank."""
    found = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or op_name(n) != "split_with_sizes" or _split_dim(n) != 0:
            continue
        pieces = n.meta.get("val")
        if not isinstance(pieces, (list, tuple)) or not any(
                isinstance(p, torch.Tensor) and p.dim() and _data_dependent(p.shape[0]) for p in pieces):
            continue
        for piece in n.users:
            if any(_expert_slice_linear(u, piece) for u in piece.users):
                # at the root a module path names no loop: its split node does (two loops stay two entries)
                found.append((module_path(n) or f"<root> {n.name}",
                              "experts in a loop: the rows split by counts computed from the data "
                              "(split_with_sizes), one linear per expert on its slice of a 3-D weight; expert "
                              "parallelism needs grouped linears over one offs (grouped_mm experts)"))
                break
    return found


def _data_dependent(size: object) -> bool:
    return isinstance(size, torch.SymInt) and bool(free_unbacked_symbols(size))


def _expert_slice_linear(node: torch.fx.Node, rows: torch.fx.Node) -> bool:
    """``node`` is ``linear(rows, W[i])`` with ``W`` a 3-D parameter."""
    if node.op != "call_function" or op_name(node) != "linear" or node.args[0] is not rows or len(node.args) < 2:
        return False
    w = node.args[1]
    if not isinstance(w, torch.fx.Node) or op_name(w) != "select" or not w.args or w.args[1] != 0:
        return False
    src = w.args[0]
    val = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
    return isinstance(src, torch.fx.Node) and src.op == "get_attr" and isinstance(val, torch.Tensor) and val.dim() == 3


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
    experts = offs.meta["val"].shape[0] if isinstance(offs.meta.get("val"), torch.Tensor) else None
    identities = {n for n in region if isinstance(experts, int) and _never_filled(n, experts)}
    why = _why_not(region, members, x, offs, last, identities)
    if why is not None:
        return None, why
    weights = tuple(dict.fromkeys(linears[g.name].weight for g in group))
    sizes = {tuple(gm.get_parameter(w).shape)[0] for w in weights}
    if len(sizes) != 1 or offs.meta.get("val") is None or tuple(offs.meta["val"].shape) != (sizes.copy().pop(),):
        return None, f"expert weights {weights} and {offs.name} disagree on the number of experts"
    path = linears[last.name].module_path
    ordered = tuple(n.name for n in gm.graph.nodes if n in region and n not in identities)
    return MoELayer(path, sizes.pop(), weights, x.name, offs.name, tuple(g.name for g in firsts), last.name,
                    tuple(g.name for g in group), ordered,
                    tuple(n.name for n in gm.graph.nodes if n in identities)), ""


# ops that keep every element's value (another shape or a copy): what may sit between a topk's
# indices and a sentinel comparison ([Note: sentinel masks])
_VALUE_KEEPING = frozenset({"view", "reshape", "flatten", "unsqueeze", "squeeze", "contiguous", "clone", "alias"})


def _never_filled(node: torch.fx.Node, experts: int) -> bool:
    """Whether ``node`` is ``masked_fill(x, mask, value)`` with a mask that is never true: ``ids >= c``
    (or ``ids > c - 1``), kept by reshapes, for ``c >= experts`` and ids below ``experts``."""
    if node.op not in ("call_function", "call_method") or op_name(node) != "masked_fill" or _in_place(node) \
            or len(node.args) < 3:
        return False
    mask = node.args[1]
    while isinstance(mask, torch.fx.Node) and op_name(mask) in _VALUE_KEEPING and not _in_place(mask) and mask.args:
        mask = mask.args[0]
    if not isinstance(mask, torch.fx.Node) or mask.op not in ("call_function", "call_method") or len(mask.args) != 2:
        return False
    ids, c = mask.args
    if isinstance(c, bool) or not isinstance(c, int) or not isinstance(ids, torch.fx.Node):
        return False
    bound = {"ge": c, "gt": c + 1}.get(op_name(mask))
    return bound is not None and bound >= experts and _ids_below(ids, experts, before=mask)


def _ids_below(ids: torch.fx.Node, bound: int, before: torch.fx.Node | None) -> bool:
    """Whether every element of ``ids`` is below ``bound``: the indices of a ``topk`` / ``max`` /
    ``argmax`` over a dim of at most ``bound`` entries, through value-keeping ops, ``sort``'s values,
    ``cat`` and the outputs of a no_grad block's subgraph, none written in place (before ``before``,
    in ``ids``'s graph)."""
    val = ids.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype.is_floating_point or val.dtype.is_complex or _in_place(ids):
        return False
    if _written_before(ids, before):
        return False
    name, args = op_name(ids), ids.args
    if name in _VALUE_KEEPING and args and isinstance(args[0], torch.fx.Node):
        return _ids_below(args[0], bound, before)
    if name in ("cat", "concat") and args and isinstance(args[0], (list, tuple)):
        return all(isinstance(a, torch.fx.Node) and _ids_below(a, bound, before) for a in args[0])
    if name in ("argmax", "argmin"):
        return _dim_at_most(args[0], args[1] if len(args) > 1 else ids.kwargs.get("dim"), bound)
    if name != "getitem" or not isinstance(args[0], torch.fx.Node) or not isinstance(args[1], int):
        return False
    src, i = args
    src_name = op_name(src)
    if src_name == "sort" and i == 0:  # the values, sorted: the same elements
        return _ids_below(src.args[0], bound, before)
    if src_name == "topk" and i == 1:  # the indices: in [0, size of the dim)
        return _dim_at_most(src.args[0], src.args[2] if len(src.args) > 2 else src.kwargs.get("dim", -1), bound)
    if src_name in ("max", "min") and i == 1:  # max(x, dim): the indices
        return _dim_at_most(src.args[0], src.args[1] if len(src.args) > 1 else src.kwargs.get("dim"), bound)
    if src.target is getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None):
        sub = src.args[1]  # a no_grad block ([Note: no_grad blocks inlined] in fxsplit.graph.export)
        sub = getattr(src.graph.owning_module, str(sub.target), None) if isinstance(sub, torch.fx.Node) else None
        if not isinstance(sub, torch.fx.GraphModule):
            return False
        outs = next(n for n in sub.graph.nodes if n.op == "output").args[0]
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        return i < len(outs) and isinstance(outs[i], torch.fx.Node) and _ids_below(outs[i], bound, None)
    return False


# ops whose output may share ``node``'s storage (a view, or the input itself): an in-place op on one
# of them writes ``node``
_MAY_ALIAS = frozenset({"view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "expand", "expand_as",
                        "transpose", "permute", "t", "slice", "select", "narrow", "getitem", "alias", "detach",
                        "as_strided", "unfold", "view_as", "split", "split_with_sizes", "chunk", "unbind",
                        "contiguous", "to", "type_as", "movedim", "swapaxes", "diagonal", "real", "imag"})


def _written_before(node: torch.fx.Node, before: torch.fx.Node | None) -> bool:
    """Whether an in-place op writes ``node``, directly or through a value that may alias it (a view),
    before ``before`` (anywhere in the graph when None)."""
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    limit = len(order) if before is None else order[before]
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if order[u] >= limit:
                continue
            if _in_place(u) and u.args and u.args[0] is n:
                return True
            if op_name(u) in _MAY_ALIAS and u.args and u.args[0] is n:
                todo.append(u)
    return False


def _dim_at_most(x: object, dim: object, bound: int) -> bool:
    """Whether ``x``'s dim ``dim`` has at most ``bound`` entries (a static size)."""
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or isinstance(dim, bool) or not isinstance(dim, int) \
            or not -val.dim() <= dim < val.dim():
        return False
    size = val.shape[dim]
    return isinstance(size, int) and size <= bound


def _in_place(node: torch.fx.Node) -> bool:
    """An op that writes its first argument (``x.clamp_``, ``aten.masked_fill_``)."""
    t = node.target
    name = t.overloadpacket.__name__ if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", str(t))
    return node.op in ("call_function", "call_method") and name.endswith("_") and not name.endswith("__")


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
