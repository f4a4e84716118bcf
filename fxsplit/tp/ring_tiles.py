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
A sliding window or a given mask is not a whole pair nor a causal diagonal: those calls keep the
blocks of ``fxsplit.tp.ring`` (scores materialized per block, the mask read at the block's
positions); :func:`tiled` says which. Inputs are read in the accumulation dtype (float32; float64
stays float64), as the rest of the ring computes.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["FlashMerge", "pair_backward", "pairs", "tiled"]

_aten = torch.ops.aten


def tiled(spec: Any, mask: torch.Tensor | None) -> bool:
    """Whether a call's blocks run by the kernel ([Note: tiled ring blocks]): no mask, no window,
    the sequence in 2C equal chunks."""
    return mask is None and spec.window is None and spec.seq_len % (2 * spec.cp) == 0


def pairs(spec: Any, lane: int, src: int) -> list[tuple[slice, slice, bool]]:
    """(query rows, key rows, causal) of every pair lane ``lane`` attends in rank ``src``'s block."""
    c, n = spec.cp, spec.seq_len // (2 * spec.cp)
    if not spec.causal:  # one call over the whole block
        return [(slice(0, 2 * n), slice(0, 2 * n), False)]
    chunks = lambda r: ((r, slice(0, n)), (2 * c - 1 - r, slice(n, 2 * n)))  # noqa: E731
    return [(qrows, krows, kc == qc) for qc, qrows in chunks(lane) for kc, krows in chunks(src) if kc <= qc]


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """(..., H, S, D) as the kernel's (B, H, S, D), in the accumulation dtype."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x.reshape(-1, *x.shape[-3:]) if x.dim() != 4 else x


def _scale(spec: Any, q: torch.Tensor) -> float:
    return spec.scale if spec.scale is not None else q.shape[-1] ** -0.5


class FlashMerge:
    """One lane's running (out, lse) over its query rows, merged pair by pair."""

    def __init__(self, q: torch.Tensor, dv: int) -> None:
        b = _bhsd(q)
        self.out = torch.zeros((*b.shape[:-1], dv), dtype=b.dtype, device=q.device)
        self.lse = torch.full(b.shape[:-1], float("-inf"), dtype=b.dtype, device=q.device)
        self.shape = (*q.shape[:-1], dv)

    def add(self, spec: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lane: int, src: int) -> None:
        """Lane ``lane``'s queries against rank ``src``'s keys / values (GQA repeated by the caller)."""
        q4, k4, v4 = _bhsd(q), _bhsd(k), _bhsd(v)
        for rows, cols, causal in pairs(spec, lane, src):
            o, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
                q4[:, :, rows].contiguous(), k4[:, :, cols].contiguous(), v4[:, :, cols].contiguous(), 0.0, causal,
                scale=_scale(spec, q))
            old, old_o = self.lse[:, :, rows], self.out[:, :, rows]
            new = torch.logaddexp(old, lse)
            base = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
            self.out[:, :, rows] = old_o * torch.exp(old - base).unsqueeze(-1) + o * torch.exp(lse - base).unsqueeze(-1)
            self.lse[:, :, rows] = new

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse (..., Sq, 1)), the shapes ``fxsplit.tp.ring``'s online softmax gives."""
        return self.out.reshape(self.shape), self.lse.reshape(*self.shape[:-1], 1)


def pair_backward(spec: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, do: torch.Tensor, lane: int, src: int) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of lane ``lane``'s queries against rank ``src``'s block, from the whole attention's
    ``out`` / ``lse`` ((..., Sq, 1)) and output gradient ``do``; in the accumulation dtype, shaped as
    q, k, v."""
    q4, k4, v4, o4, do4 = (_bhsd(x) for x in (q, k, v, out, do))
    l4 = lse.reshape(o4.shape[:-1]).to(o4.dtype)
    dq, dk, dv = torch.zeros_like(q4), torch.zeros_like(k4), torch.zeros_like(v4)
    for rows, cols, causal in pairs(spec, lane, src):
        gq, gk, gv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do4[:, :, rows].contiguous(), q4[:, :, rows].contiguous(), k4[:, :, cols].contiguous(),
            v4[:, :, cols].contiguous(), o4[:, :, rows].contiguous(), l4[:, :, rows].contiguous(), 0.0, causal,
            scale=_scale(spec, q))
        dq[:, :, rows] += gq
        dk[:, :, cols] += gk
        dv[:, :, cols] += gv
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)
