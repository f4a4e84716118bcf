"""Context-parallel ops: which tokens a cp rank keeps, and the values built from that.

Terms: **C** -- the cp degree (ranks along mesh axis ``"cp"``); **S** -- the global sequence
length; **chunk** -- one of the 2C equal pieces of the sequence; **local tokens** -- the S / C
tokens rank r keeps: chunks r and 2C-1-r, in that order ([Note: load-balanced chunks]);
**gathered order** -- the order of an all-gather of every rank's local tokens (rank 0's, then
rank 1's, ...); **natural order** -- positions 0..S-1.

    idx = local_positions(x, S)                     # (S / C,) global positions of my tokens
    x_local = keep_local(x, dim=1, seq_len=S)       # a full value cut to my tokens
    k_all = gather_to_region(k_local, dim=2, axis="cp").index_select(2, natural_order(k_local, S))
    mask = causal_rows(q, S)                        # (S / C, S): key j <= my query i

[Note: load-balanced chunks]
With a causal mask, query i attends to i + 1 keys, so the last tokens cost the most. Cutting the
sequence in 2C chunks and giving rank r chunks r and 2C-1-r (one from the head, one from the
tail) gives every rank the same number of (query, key) pairs: Megatron-core's and torch's
``context_parallel`` load balancing (``_HeadTailLoadBalancer``), and Llama 3's all-gather CP.

Every op is a plain function of its arguments and the group bound to ``axis``
(``fxsplit.tp.collectives.axis_rank`` / ``axis_size``, 0 / 1 when unbound, so an unsplit run
keeps every token), and a leaf under ``torch.fx`` tracing. Only ``gather_to_region`` (in
``collectives``) communicates; everything here is local index arithmetic, and the backward of
``keep_local`` (an ``index_select``) puts this rank's gradient at its tokens' places, so a full
value's gradient is this rank's share, summed over cp ranks as parameter gradients are.
"""

from __future__ import annotations

import torch

from fxsplit.errors import ShardingError
from fxsplit.tp.collectives import axis_rank, axis_size

__all__ = ["causal_rows", "keep_local", "local_positions", "natural_order"]


def _check(seq_len: int, cp: int, op: str) -> None:
    if seq_len % (2 * cp):
        raise ShardingError(
            f"{op}: a sequence of {seq_len} tokens cannot be cut in 2 * cp = {2 * cp} equal chunks "
            f"([Note: load-balanced chunks] in fxsplit.tp.context); use a length divisible by {2 * cp} "
            f"(pad and mask the tail), or a cp degree whose double divides {seq_len}")


def chunks_of(rank: int, cp: int) -> tuple[int, int]:
    """The chunks (of 2cp) rank ``rank`` of ``cp`` keeps, head then tail: ``rank`` and ``2cp-1-rank``
    (plain ints: read while tracing a graph, where a tensor's value is unknown)."""
    return rank, 2 * cp - 1 - rank


def positions_of(rank: int, cp: int, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions rank ``rank`` of ``cp`` keeps: its :func:`chunks_of`, in that order."""
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunks_of(rank, cp)])


def local_positions(like: torch.Tensor, seq_len: int, axis: str = "cp") -> torch.Tensor:
    """(seq_len / C,) int64 on ``like``'s device: the global positions of this rank's tokens."""
    cp = axis_size(axis)
    _check(seq_len, cp, "local_positions")
    return positions_of(axis_rank(axis), cp, seq_len, like.device)


def natural_order(like: torch.Tensor, seq_len: int, axis: str = "cp") -> torch.Tensor:
    """(seq_len,) int64: ``gathered.index_select(dim, natural_order(S))`` puts an all-gather of every
    rank's local tokens (gathered order) back in positions 0..S-1."""
    cp = axis_size(axis)
    _check(seq_len, cp, "natural_order")
    gathered = torch.cat([positions_of(r, cp, seq_len, like.device) for r in range(cp)])
    return torch.argsort(gathered)


def keep_local(x: torch.Tensor, dim: int, seq_len: int, inner: int = 1, axis: str = "cp") -> torch.Tensor:
    """``x`` (a value every rank holds whole) cut to this rank's tokens along ``dim``, whose size is
    ``outer * seq_len * inner`` (the sequence merged with outer dims such as the batch, and inner
    ones, as a flattened ``[B * S]`` is); ``outer`` is read from ``x``."""
    if axis_size(axis) == 1:
        return x
    dim = dim % x.dim()
    size = x.shape[dim]
    if size % (seq_len * inner):
        raise ShardingError(f"keep_local: dim {dim} of shape {tuple(x.shape)} is not a multiple of the sequence "
                            f"({seq_len}) times {inner}")
    idx = local_positions(x, seq_len, axis)
    if inner == 1 and size == seq_len:
        return x.index_select(dim, idx)
    parts = x.unflatten(dim, (size // (seq_len * inner), seq_len, inner))
    return parts.index_select(dim + 1, idx).flatten(dim, dim + 2)


def causal_rows(like: torch.Tensor, seq_len: int, window: int | None = None, axis: str = "cp") -> torch.Tensor:
    """(seq_len / C, seq_len) bool: True where key j may be read by this rank's query i (j <= i,
    and i - j < ``window`` for a sliding window), keys in natural order: the rows of the causal
    mask at this rank's global query positions."""
    q = local_positions(like, seq_len, axis).unsqueeze(1)
    k = torch.arange(seq_len, device=like.device).unsqueeze(0)
    allowed = k <= q
    if window is not None:
        allowed = allowed & (q - k < window)
    return allowed


torch.fx.wrap("local_positions")
torch.fx.wrap("natural_order")
torch.fx.wrap("keep_local")
torch.fx.wrap("causal_rows")
