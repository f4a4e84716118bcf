"""Ring attention's blocks by torch's CPU flash-attention kernel: no block's scores held whole.

Terms as in ``fxsplit.tp.ring`` (block, lane, lse) and ``fxsplit.tp.context`` (C, S, chunk: a
rank's local tokens are chunks r and 2C-1-r of the 2C chunks of a sequence); **pair** -- one query
chunk of the lane against one key chunk of the block.

[Note: tiled ring blocks]
``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` computes sdpa tile by tile (never an
[Sq, Sk] score matrix per head) and returns the log-sum-exp of every query row; its backward takes
the output and log-sum-exp of the WHOLE attention (every block's, merged) and gives the block's
share of dQ, dK, dV, the flash-attention backward. So a ring step needs no scores of its own: per
pair, the chunks' positions decide the mask without materializing it -- a key chunk before the
query chunk is attended whole, the same chunk causally (``is_causal``: both chunks start at the
same global position and have the same length), a later chunk not at all -- and the pairs' (out,
lse) merge as the blocks do (``out = sum_i exp(lse_i - lse) out_i``, ``lse = logaddexp_i lse_i``).
With a sliding window or a given mask each pair gets an additive mask of its own (one number per
(query, key) of the pair and no head dim: the given mask read at the pair's rows and key positions,
causal and window rows from the positions), a quarter of a block's and never per head; a row with no
allowed key in a pair comes back from the kernel with lse 0, set to -inf so it adds nothing. Inputs
are read in the accumulation dtype (float32; float64 stays float64), as the rest of the ring computes.
"""

from __future__ import annotations

from typing import Any

import torch

from fxsplit.tp.context import chunks_of, positions_of

__all__ = ["FlashMerge", "block_mask", "pair_backward", "pairs"]

_aten = torch.ops.aten


def block_mask(spec: Any, q: torch.Tensor, mask: torch.Tensor | None, rows: torch.Tensor, keys: torch.Tensor,
               qrows: slice) -> torch.Tensor:
    """The additive mask (0 / -inf, or the given additive values) of one pair: queries at global
    positions ``rows`` (the lane's local rows ``qrows``) against keys at ``keys``, 4-D for the kernel:
    the given mask read at those rows and key positions, the causal and sliding-window rows at the
    global positions. One number per (query, key), no head dim unless the given mask has one."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    add = torch.zeros(rows.shape[0], keys.shape[0], dtype=dtype, device=q.device)
    if mask is not None:
        cols = mask if mask.shape[-2] == 1 else mask[..., qrows, :]
        cols = cols if cols.shape[-1] == 1 else cols.index_select(-1, keys)
        add = add.masked_fill(~cols, float("-inf")) if cols.dtype == torch.bool else add + cols.to(dtype)
    allowed = torch.ones(add.shape[-2:], dtype=torch.bool, device=q.device)
    if spec.causal:
        allowed = allowed & (keys.unsqueeze(0) <= rows.unsqueeze(1))
    if spec.window is not None:
        allowed = allowed & (rows.unsqueeze(1) - keys.unsqueeze(0) < spec.window)
    add = add.masked_fill(~allowed, float("-inf"))
    while add.dim() < 4:
        add = add.unsqueeze(0)
    return add.reshape(-1, *add.shape[-3:]).contiguous()


def pairs(spec: Any, lane: int, src: int) -> list[tuple[slice, slice, bool]]:
    """(query rows, key rows, same chunk) of every pair lane ``lane`` attends in rank ``src``'s block:
    causal, the key chunks not after the query chunk; else every pair."""
    c, n = spec.cp, spec.seq_len // (2 * spec.cp)

    def chunks(r: int) -> tuple:  # (chunk index, its local rows)
        head, tail = chunks_of(r, c)
        return ((head, slice(0, n)), (tail, slice(n, 2 * n)))

    return [(qrows, krows, kc == qc) for qc, qrows in chunks(lane) for kc, krows in chunks(src)
            if not spec.causal or kc <= qc]


def _pair_args(spec: Any, q: torch.Tensor, mask: torch.Tensor | None, lane: int, src: int) -> list[tuple]:
    """(query rows, key rows, is_causal, additive mask or None) of every kernel call of one block:
    without a mask or window, the whole block (not causal) or the chunk pairs (the same chunk causal,
    no mask built); else the chunk pairs, each its own mask ([Note: tiled ring blocks])."""
    plain = mask is None and spec.window is None
    if plain and not spec.causal:
        return [(slice(None), slice(None), False, None)]
    if plain:
        return [(r, k, same, None) for r, k, same in pairs(spec, lane, src)]
    rows = positions_of(lane, spec.cp, spec.seq_len, q.device)
    keys = positions_of(src, spec.cp, spec.seq_len, q.device)
    return [(r, k, False, block_mask(spec, q, mask, rows[r], keys[k], r)) for r, k, _ in pairs(spec, lane, src)]


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """(..., H, S, D) as the kernel's (B, H, S, D), in the accumulation dtype."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x.reshape(-1, *x.shape[-3:]) if x.dim() != 4 else x


def _scale(spec: Any, q: torch.Tensor) -> float:
    return spec.scale if spec.scale is not None else q.shape[-1] ** -0.5


def _key(rows: slice) -> tuple:
    return (rows.start, rows.stop)


def _joined(parts: dict, like: torch.Tensor, keys: list[tuple]) -> torch.Tensor:
    """The row parts (dim 2) put back in order, a part never reached zeros ([Note: functional merge])."""
    if (None, None) in parts:
        return parts[(None, None)]
    return torch.cat([parts[k] if k in parts else torch.zeros_like(like[:, :, k[0]:k[1]]) for k in keys], 2)


def _halves(n: int) -> list[tuple]:
    return [(0, n), (n, 2 * n)]


# [Note: functional merge] Every step builds new tensors (the merged row parts are kept apart and
# joined at the end) and writes into none: a ring traced into a graph (the zero-bubble split, compile)
# keeps only what values flow into, and an in-place write into a slice would be dropped there.
class FlashMerge:
    """One lane's running (out, lse) over its query rows, merged pair by pair (row parts: the whole
    block, or the head and tail chunks)."""

    def __init__(self, q: torch.Tensor, dv: int) -> None:
        self.shape = (*q.shape[:-1], dv)
        self.parts: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, spec: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            lane: int, src: int) -> None:
        """Lane ``lane``'s queries against rank ``src``'s keys / values (GQA repeated by the caller)."""
        q4, k4, v4 = _bhsd(q), _bhsd(k), _bhsd(v)
        for rows, cols, causal, add in _pair_args(spec, q, mask, lane, src):
            o, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
                q4[:, :, rows].contiguous(), k4[:, :, cols].contiguous(), v4[:, :, cols].contiguous(), 0.0,
                causal, attn_mask=add, scale=_scale(spec, q))
            if add is not None:  # a row with no allowed key comes back with lse 0: it adds nothing
                lse = lse.masked_fill(torch.isneginf(add).all(-1), float("-inf"))
            if _key(rows) not in self.parts:
                self.parts[_key(rows)] = (o, lse)
                continue
            old_o, old = self.parts[_key(rows)]
            new = torch.logaddexp(old, lse)
            base = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
            self.parts[_key(rows)] = (old_o * torch.exp(old - base).unsqueeze(-1)
                                      + o * torch.exp(lse - base).unsqueeze(-1), new)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse (..., Sq, 1)), the shapes ``fxsplit.tp.ring`` works with."""
        keys = sorted(self.parts, key=lambda k: -1 if k[0] is None else k[0])
        out = torch.cat([self.parts[k][0] for k in keys], 2)
        lse = torch.cat([self.parts[k][1] for k in keys], 2)
        return out.reshape(self.shape), lse.reshape(*self.shape[:-1], 1)


def pair_backward(spec: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  out: torch.Tensor, lse: torch.Tensor, do: torch.Tensor, lane: int, src: int) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of lane ``lane``'s queries against rank ``src``'s block, from the whole attention's
    ``out`` / ``lse`` ((..., Sq, 1)) and output gradient ``do``; in the accumulation dtype, shaped as
    q, k, v (k, v at the query heads). No in-place write ([Note: functional merge])."""
    q4, k4, v4, o4, do4 = (_bhsd(x) for x in (q, k, v, out, do))
    l4 = lse.reshape(o4.shape[:-1]).to(o4.dtype)
    l4 = torch.where(torch.isneginf(l4), torch.zeros_like(l4), l4)  # no allowed key at all: p = exp(-inf) = 0
    grads: list[dict] = [{}, {}, {}]
    for rows, cols, causal, add in _pair_args(spec, q, mask, lane, src):
        got = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do4[:, :, rows].contiguous(), q4[:, :, rows].contiguous(), k4[:, :, cols].contiguous(),
            v4[:, :, cols].contiguous(), o4[:, :, rows].contiguous(), l4[:, :, rows].contiguous(), 0.0, causal,
            attn_mask=add, scale=_scale(spec, q))
        for parts, key, g in zip(grads, (_key(rows), _key(cols), _key(cols)), got):
            parts[key] = parts[key] + g if key in parts else g
    keys = _halves(spec.seq_len // (2 * spec.cp))
    dq, dk, dv = (_joined(parts, like, keys) for parts, like in zip(grads, (q4, k4, v4)))
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)
