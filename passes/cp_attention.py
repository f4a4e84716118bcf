"""Attention under the context-parallel rewrite (``passes/context_parallel.py`` calls these rules):
the local queries read every rank's keys and values, by all-gather or by ring, chosen per
attention call ([Note: all-gather or ring]).

Terms as in ``passes/context_parallel.py`` (C, S, sharded value, sequence dim); **K/V width** --
the elements per token of the keys plus the values an attention reads; **H** -- its query heads.
Written only against fxsplit's public API.

    rule = sdpa_rule        # (rw, node) -> the output's sequence dim, or None once the node is replaced

[Note: all-gather or ring]
- **all-gather** (Llama 3): keys and values are all-gathered along the sequence
  (``gather_to_region``: backward reduce-scatters dK / dV) and put in natural order; the local
  queries run torch's sdpa against all of them. One collective per attention; the gathered K/V
  (S tokens) are held for the backward, and ``is_causal`` becomes an (S / C, S) mask.
- **ring**: ``fxsplit.tp.ring.ring_attention`` passes each rank's block around the ring with a
  log-sum-exp merge ([Note: ring attention]); C - 1 dependent exchanges forward and C
  backward (each overlapped with a block's compute), two blocks held at a time; each block by
  torch's CPU flash kernel, no scores held, causal blocks as chunk pairs with no mask, a window or
  a given mask one additive mask per chunk pair ([Note: tiled ring blocks] in fxsplit.tp.ring_tiles).
- ``cp_kv=None`` (auto), per attention. Both move the same bytes per step (the all-gather
  (C - 1) / C of K/V at once, the ring the same in C - 1 blocks, each overlapped with a block's
  compute); they differ in what is held and in the kernel. With no mask to read (``is_causal``, or
  none: every traced model whose causal mask the ``causal_masks`` pass turned into ``is_causal``)
  the ring is taken: its blocks run the flash kernel, causal blocks as chunk pairs with no mask,
  and it holds its own K/V block and the one in flight, where the all-gather's sdpa reads an
  (S / C, S) causal-rows mask (so not the flash kernel: on the CPU the math kernel holds the
  scores) and keeps every rank's K/V. Measured on a small Llama (benchmarks/README.md, "Context
  parallelism after the causal-mask pass"): the ring held less and stepped faster in every layout
  at 2k and 4k. With a given mask (padding, documents, a window the model builds), the ring
  builds one additive mask per chunk pair and stepped 1.1-1.6x the all-gather's time (measured
  before the pass, when every traced mask was a given one), so memory decides: the extra memory of
  the all-gather is the other ranks' K/V, ``(C - 1) * (S / C) * (Wk + Wv)`` elements per sample,
  against the layer's own activations, about ``17 * (S / C) * hidden`` (Korthikanti et al. 2022:
  34 s b h bytes per layer in 16-bit with no score term; hidden = the query width Wq); the ring is
  taken when that extra exceeds about a quarter of them, ``(C - 1) * (Wk + Wv) > 4 * Wq``,
  whatever the length. Multi-head attention (Wk + Wv = 2 Wq) then takes the all-gather at C = 2, 3
  and the ring from C = 4; grouped-query attention with 1/8 of the heads for K/V (Llama 3 70B /
  405B) keeps the all-gather up to C = 17, as Llama 3 trained at cp = 16 (its paper: all-gather
  for GQA's small K/V and any mask). Wk and Wv are the widths the attention reads: K/V repeated to
  the query heads before sdpa (Hugging Face's ``repeat_kv``) are read before the repeat ([Note:
  K/V before their repeat]). Either may be forced with ``cp_kv="allgather"`` / ``"ring"``. On a CUDA
  rank ``parallelize`` plans with ``cp_kv="allgather"`` ([Note: the ring on CUDA] in fxsplit.tp.ring).
- The ring is not taken, whatever was asked, and the plan says why, when the attention is
  eager ``softmax(Q K^T) V`` (no single op to replace: its two matmuls all-gather K and V) or
  its mask needs a gradient (a learned score bias: the ring does not differentiate the mask).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from fxsplit.graph.ops import SDPA_ARGS, sdpa_arguments
from fxsplit.tp.context import causal_rows
from fxsplit.tp.ring import ring_attention

__all__ = ["KV_STRATEGIES", "choose_kv", "matmul_rule", "ndim", "same", "sdpa_rule", "val"]

KV_STRATEGIES = ("allgather", "ring")
_AXIS = "cp"
_aten = torch.ops.aten


def val(node: Any) -> Any:
    """A node's ``meta["val"]`` (its fake tensor), None for a non-node."""
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def ndim(node: Any) -> int:
    v = val(node)
    return v.dim() if isinstance(v, torch.Tensor) else 0


def same(a: Any, b: Any) -> bool:
    return a == b if type(a) is int and type(b) is int else str(a) == str(b)


def _width(x: Any, heads_dim: int = -3) -> int:
    shape = val(x).shape
    return int(shape[heads_dim]) * int(shape[-1])


def choose_kv(request: str | None, cp: int, q: Any, k: Any, v: Any, mask: Any) -> tuple[str, str]:
    """(strategy, why) for one sdpa call ([Note: all-gather or ring])."""
    if mask is not None and getattr(val(mask), "requires_grad", False):
        return "allgather", "its mask needs a gradient (a learned score bias), which the ring does not compute"
    if request is not None:
        return request, f"cp_kv={request!r}"
    if mask is None:
        return "ring", ("auto: no mask to read (causal or none): the ring's blocks run the flash kernel and hold two K/V "
                        "blocks, where the all-gather's sdpa reads an (S/C, S) mask and holds every rank's K/V")
    others, budget = (cp - 1) * (_width(k) + _width(v)), 4 * _width(q)
    if others > budget:
        return "ring", (f"auto: a given mask; the all-gather would hold the other {cp - 1} ranks' K/V, {others} elements "
                        f"per local token, > 4 x the query width {budget} (a quarter of a layer's activations)")
    return "allgather", (f"auto: a given mask; the other {cp - 1} ranks' K/V the all-gather holds, {others} elements per "
                         f"local token, <= 4 x the query width {budget} (a quarter of a layer's activations)")


def matmul_rule(rw: Any, node: torch.fx.Node) -> Any:
    """``A @ B``: A sharded on its rows (the local queries); B full, or sharded along the
    contraction (V in P @ V) or the columns (K^T in Q @ K^T): then gathered whole (eager attention
    keeps the all-gather: [Note: all-gather or ring])."""
    a, b = node.args[0], node.args[1]
    sa, sb = rw.seq_of(a), rw.seq_of(b)
    na, nb = ndim(a), ndim(b)
    if sa is None or sa.dim != na - 2 or sa.inner != 1:
        raise rw.fail(node, "a matmul whose left operand is not sharded along its rows")
    if sb is not None:
        if sb.dim not in (nb - 2, nb - 1) or sb.inner != 1:
            raise rw.fail(node, "a matmul whose right operand is sharded along a batch dim")
        node.update_arg(1, rw.gather(b, sb.dim, node))
        why = "" if rw.kv != "ring" else " (not the ring: eager attention has no single op to replace)"
        rw.plan.attention.append(f"{node.name}: eager attention, {b.name} all-gathered along dim {sb.dim}{why}")
    return type(sa)(sa.dim + ndim(node) - na)


def sdpa_rule(rw: Any, node: torch.fx.Node) -> Any:
    """Local queries against every key and value, by all-gather or ring, masks at the queries'
    global rows."""
    args = sdpa_arguments(node)
    q, k, v = args["query"], args["key"], args["value"]
    for name, x in (("query", q), ("key", k), ("value", v)):
        s = rw.seq_of(x)
        if s is None or s.dim != ndim(x) - 2 or s.inner != 1:
            raise rw.fail(node, f"its {name} is not sharded along the sequence dim (-2)")
    if args.get("dropout_p", 0.0):
        raise rw.fail(node, "attention dropout (dropout_p > 0) draws its mask per key block")
    grouped = _unrepeated(rw, k, q), _unrepeated(rw, v, q)
    unrepeat = all(g is not None for g in grouped) and not args.get("enable_gqa", False)
    if unrepeat:  # [Note: K/V before their repeat]
        k, v = args["key"], args["value"] = grouped
        args["enable_gqa"] = True
    mask = args.get("attn_mask")
    causal = bool(args.get("is_causal", False))
    if mask is not None and causal:
        raise rw.fail(node, "both a mask and is_causal=True")
    how = [f"K/V before their repeat to the {int(val(q).shape[-3])} query heads (enable_gqa)"] if unrepeat else []
    if mask is not None:
        args["attn_mask"] = _mask_rows(rw, node, mask)
        how.append("mask rows of the local queries")
    strategy, why = choose_kv(rw.kv, rw.cp, q, k, v, mask)
    if strategy == "ring":
        return _ring(rw, node, args, causal, how + (["causal rows per block"] if causal else []), why)
    args["key"] = rw.gather(k, ndim(k) - 2, node)
    args["value"] = rw.gather(v, ndim(v) - 2, node)
    if causal:
        with rw.graph.inserting_before(node):
            args["attn_mask"] = rw.new(causal_rows, (q, rw.S), {"axis": _AXIS}, like=node)
        args["is_causal"] = False
        how.append("is_causal -> causal rows at the local queries' global positions")
    node.args = tuple(args.get(k_, d) for k_, d in zip(SDPA_ARGS[:6], (None, None, None, None, 0.0, False)))
    node.kwargs = {k_: args[k_] for k_ in SDPA_ARGS[6:] if k_ in args}
    rw.plan.attention.append(f"{node.name}: sdpa, K/V all-gathered ({why})" + (f", {', '.join(how)}" if how else ""))
    return rw.seq_of(q)


# [Note: K/V before their repeat]
# Grouped-query models repeat each K/V head to the query heads before sdpa (Hugging Face's
# ``repeat_kv``: ``x[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)``), so an
# all-gather or a ring of sdpa's own K/V moves n_rep times the bytes and holds n_rep times the
# memory it needs. Where the key or value is exactly that repeat of a sequence-sharded (b, kv, s, d)
# value (full slices and one unsqueeze before the expand, shapes checked at every step), the
# attention reads the unrepeated value with ``enable_gqa=True`` instead: sdpa's own grouped-query
# mode repeats head j // n_rep, which is what expand + reshape compute, so the result is the same;
# the repeat's nodes go when nothing else reads them.


def _full_slice(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target is not _aten.slice.Tensor:
        return False
    src = val(node.args[0])
    dim = (node.args[1] if len(node.args) > 1 else 0) % src.dim()
    start, end = (node.args[2] if len(node.args) > 2 else None), (node.args[3] if len(node.args) > 3 else None)
    step = node.args[4] if len(node.args) > 4 else 1
    return start in (None, 0) and step == 1 and (end is None or (type(end) is int and _reaches(end, src.shape[dim])))


def _reaches(end: int, size: Any) -> bool:
    try:
        return end >= int(size)
    except (TypeError, ValueError):
        return end >= 2 ** 62  # torch.export's "to the end" on a symbolic size


def _unrepeated(rw: Any, x: Any, q: Any) -> torch.fx.Node | None:
    """The (b, kv, s, d) value ``x`` repeats to the query heads ([Note: K/V before their repeat]), or None."""
    if not isinstance(x, torch.fx.Node) or x.op != "call_function":
        return None
    if x.target not in (_aten.reshape.default, _aten.view.default, _aten._unsafe_view.default):
        return None
    e = x.args[0]
    while isinstance(e, torch.fx.Node) and e.target in (_aten.clone.default, _aten.contiguous.default):
        e = e.args[0]
    if not isinstance(e, torch.fx.Node) or e.target is not _aten.expand.default:
        return None
    u, unsqueezes = e.args[0], 0
    while isinstance(u, torch.fx.Node) and (_full_slice(u) or u.target is _aten.unsqueeze.default):
        if u.target is _aten.unsqueeze.default:
            if u.args[1] % (ndim(u.args[0]) + 1) != 2:
                return None
            unsqueezes += 1
        u = u.args[0]
    if unsqueezes != 1 or not isinstance(u, torch.fx.Node) or ndim(u) != 4:
        return None
    src, wide, out, qs = val(u).shape, val(e).shape, val(x).shape, val(q).shape
    if len(wide) != 5 or len(out) != 4:
        return None
    b, kv, s, d = src
    if not (same(wide[0], b) and same(wide[1], kv) and same(wide[3], s) and same(wide[4], d)):
        return None
    n_rep = wide[2]
    if not (same(out[0], b) and same(out[1], kv * n_rep) and same(out[2], s) and same(out[3], d)
            and same(qs[-3], kv * n_rep)):
        return None
    seq = rw.seq_of(u)
    if seq is None or seq.dim != 2 or seq.inner != 1:
        return None
    return u


def _mask_rows(rw: Any, node: torch.fx.Node, mask: torch.fx.Node) -> torch.fx.Node:
    """A mask given to sdpa, cut to the rows of the local queries (keys stay whole, natural order)."""
    sm = rw.seq_of(mask)
    md = ndim(mask) - 2
    if sm is not None:
        if sm.dim != md:
            raise rw.fail(node, "its mask is sharded along the keys")
        return mask
    rows = val(mask).shape[md]
    if same(rows, 1):
        return mask
    if not same(rows, rw.S):
        raise rw.fail(node, f"its mask of shape {tuple(val(mask).shape)} has no row per query")
    return rw.cut(mask, md, 1, node)


def _ring(rw: Any, node: torch.fx.Node, args: dict, causal: bool, how: list[str], why: str) -> None:
    """``node`` replaced by one ``ring_attention`` call on the local q, k, v."""
    with rw.graph.inserting_before(node):
        ring = rw.new(ring_attention, (args["query"], args["key"], args["value"], args.get("attn_mask"),
                                       args.get("scale"), bool(args.get("enable_gqa", False))),
                      {"seq_len": rw.S, "causal": causal, "axis": _AXIS}, like=node)
    ring.meta["val"] = node.meta.get("val")  # the full shape, as the walk reads until shapes are redone
    node.replace_all_uses_with(ring)
    rw.graph.erase_node(node)
    rw.state[ring] = rw.seq_of(args["query"])
    rw.plan.attention.append(f"{ring.name}: ring attention ({why})" + (f", {', '.join(how)}" if how else ""))
    return None
