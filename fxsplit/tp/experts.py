"""Expert-parallel token exchange: dispatch the rows of a mixture of experts to the ranks that hold
their experts and combine them back, as graph-friendly functions of a mesh axis name ("ep").

Terms: **n** -- ranks on the ep axis; **E** -- experts of the layer; **k** -- experts per rank
(E / n; rank r holds experts ``[r * k, (r + 1) * k)``, a contiguous block of the fused 3-D expert
weight); **rows** -- the routed rows ``[S, C]`` sorted by expert (one per token and chosen expert);
**offs** -- the end row of each expert's group (int, length E); **recv** -- ``[n, k]``: how many rows
each source rank sends to each of this rank's experts; **source-major** / **expert-major** -- the
received rows ordered by source then expert (as all_to_all delivers them) / by expert then source
(as a grouped matmul over the local experts reads them).

    recv = ep_token_counts(offs, axis="ep")              # all_to_all of the per-expert counts
    local = ep_dispatch(rows, offs, recv, axis="ep")     # rows of this rank's experts, expert-major
    local_offs = ep_local_offsets(recv, offs)            # their group ends (length k)
    ... grouped matmuls of ``local`` over the local expert weights ``W[r*k:(r+1)*k]`` ...
    out = ep_combine(local_out, offs, recv, axis="ep")   # back to this rank's rows, in its order

[Note: expert-parallel exchange]
The rows are already sorted by expert and each rank owns a contiguous block of k experts, so the
rows for rank j are one contiguous run: the send split sizes are the per-owner sums of the
per-expert counts. The counts go first (an all_to_all of E integers, k to each rank), so every
rank knows how many rows it receives from each source for each of its experts (``recv``). The rows
then travel with ``all_to_all_single`` (variable splits) and are regrouped source-major ->
expert-major (a permutation computed from ``recv``); the local group ends are the cumulative sums
of ``recv`` over sources. ``ep_combine`` is the exact inverse (un-permute, the reverse
all_to_all), so dispatch's backward is combine's forward and vice versa: every row comes home in
its place and no row is dropped (dropless: no capacity factor). The ops are their own autograd
Functions rather than torch's ``_functional_collectives.all_to_all_single_autograd`` (which does
take variable splits) because every wait here goes through the runtime's bounded, failure-aware
waiter ([Note: failure protocol] in fxsplit.runtime.watch, ``bind_waiter``): a functional
collective's ``wait_tensor`` blocks without a bound a peer's death could end. With the axis
unbound or of size 1 every op is the identity (``ep_local_offsets`` gives back ``offs``), so a
plan's graph runs unchanged in one process, and the fake tensors of a trace see plain shapes.
Bound and traced (the graph split, compile=True), the exchange becomes opaque custom ops of static
shape ([Note: traced exchange] below): the same all-to-alls and waits when the graph runs.

[Note: exchange statistics] Inside ``with exchange_stats() as st:`` every all-to-all this process
runs adds its host seconds (issue to the end of its wait: on the CPU the exchange itself; on a
GPU the host's wait) to ``st.seconds``, and every forward count exchange adds this rank's rows per
local expert (``recv.sum(0)``, length k) to ``st.rows``: what the experts of this rank received,
summed over the MoE layers and microbatches of the block. Gathered over the ep group
(rank r's entries are experts ``[r * k, (r + 1) * k)``), that is the load of every expert
(``expert_load``: min / mean / max), which a dropless exchange must carry whatever its imbalance.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx

from torch.distributed._functional_collectives import _are_we_tracing

from fxsplit.errors import RunError, ShardingError
from fxsplit.tp import collectives as C

__all__ = ["EP_OPS", "ExchangeStats", "emulated_combine", "emulated_dispatch", "emulated_token_counts", "ep_combine", "ep_dispatch",
           "ep_local_offsets", "ep_token_counts", "exchange_stats", "expert_load"]


@dataclass
class ExchangeStats:
    """What the expert-parallel exchanges of a block did on this rank ([Note: exchange statistics])."""

    seconds: float = 0.0  # host seconds in all-to-alls
    calls: int = 0
    rows: torch.Tensor | None = None  # rows received per local expert (int64, length k), summed

    def add_rows(self, per_expert: torch.Tensor) -> None:
        self.rows = per_expert.clone() if self.rows is None else self.rows + per_expert


_STATS: contextvars.ContextVar[ExchangeStats | None] = contextvars.ContextVar("fxsplit_ep_stats", default=None)


@contextlib.contextmanager
def exchange_stats() -> Iterator[ExchangeStats]:
    """Record this rank's exchanges inside the block ([Note: exchange statistics])."""
    stats = ExchangeStats()
    token = _STATS.set(stats)
    try:
        yield stats
    finally:
        _STATS.reset(token)


def expert_load(rows: torch.Tensor) -> dict[str, float]:
    """min / mean / max of the rows per expert ``rows`` (every expert's, e.g. the ep group's
    ``ExchangeStats.rows`` joined in rank order)."""
    r = rows.to(torch.float64)
    return {"min": float(r.min()), "mean": float(r.mean()), "max": float(r.max())}


def _active(axis: str, op: str):
    """The bound ep group, or None (identity)."""
    return C.active(axis)


def _bound(axis: str, op: str):
    """The bound ep group where a traced exchange runs ([Note: traced exchange]); RunError unbound."""
    b = C.active(axis)
    if b is None:
        raise RunError(f"{op}: a graph traced with the expert-parallel exchange over axis {axis!r} runs where that "
                       "axis is not bound to a group of more than one rank; run it inside the model's step")
    return b


def _counts(offs: torch.Tensor) -> torch.Tensor:
    """Rows per expert from the group ends ``offs`` (int64, length E)."""
    ends = offs.to(torch.int64)
    return torch.diff(ends, prepend=ends.new_zeros(1))


def _check(offs: torch.Tensor, n: int, op: str) -> int:
    if offs.dim() != 1 or offs.numel() % n:
        raise ShardingError(f"{op}: {offs.numel()} experts (offs of shape {tuple(offs.shape)}) cannot be split into "
                            f"blocks for {n} expert-parallel ranks; choose ep dividing the number of experts")
    return offs.numel() // n


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], b, phase: str) -> torch.Tensor:
    b.note("ep_exchange", "all_to_all", phase, x)
    t0 = time.perf_counter()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=b.group, async_op=True)
    b.wait(work, "all-to-all")
    stats = _STATS.get()
    if stats is not None:
        stats.seconds += time.perf_counter() - t0
        stats.calls += 1
    return out


def _expert_major(recv: torch.Tensor) -> torch.Tensor:
    """The permutation that reorders rows received source-major (``recv [n, k]`` rows from source s
    for local expert e) into expert-major order: ``expert_major = source_major[perm]``."""
    flat = recv.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view_as(recv).t().reshape(-1)  # start of block (s, e), e-major
    sizes = recv.t().reshape(-1)
    total = int(flat.sum())
    block_start = torch.repeat_interleave(starts, sizes)
    offset_in_block = torch.arange(total) - torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
    return (block_start + offset_in_block).to(recv.device)


def _route(offs: torch.Tensor, recv: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor]:
    """(rows sent to each rank, rows received from each rank, the expert-major permutation)."""
    n, k = recv.shape
    send = _counts(offs).view(n, k).sum(1).tolist()
    return send, recv.sum(1).tolist(), _expert_major(recv.cpu())


def _to_experts(x: torch.Tensor, offs: torch.Tensor, recv: torch.Tensor, b, phase: str) -> torch.Tensor:
    send, got, perm = _route(offs, recv)
    return _all_to_all(x, got, send, b, phase)[perm.to(x.device)]


def _from_experts(y: torch.Tensor, offs: torch.Tensor, recv: torch.Tensor, b, phase: str) -> torch.Tensor:
    send, got, perm = _route(offs, recv)
    source_major = torch.empty_like(y)
    source_major[perm.to(y.device)] = y
    return _all_to_all(source_major, send, got, b, phase)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, offs, recv, b):
        ctx.save_for_backward(offs, recv)
        ctx.b = b
        return _to_experts(x, offs, recv, b, "forward")

    @staticmethod
    def backward(ctx, grad):
        offs, recv = ctx.saved_tensors
        return _from_experts(grad, offs, recv, ctx.b, "backward"), None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, offs, recv, b):
        ctx.save_for_backward(offs, recv)
        ctx.b = b
        return _from_experts(y, offs, recv, b, "forward")

    @staticmethod
    def backward(ctx, grad):
        offs, recv = ctx.saved_tensors
        return _to_experts(grad, offs, recv, ctx.b, "backward"), None, None, None


# ----------------------------------------------------------------------------- traced exchange
# [Note: traced exchange] Under a tracer (make_fx for the graph split, fake tensors:
# ``_tracing``) the exchange is three opaque custom ops of static shape: the graph split
# (fxsplit.runtime.compile.split_graph) can then cut a stage with experts into F, I and W graphs
# and torch.compile (inductor) compiles everything around them, calling each op as an extern
# kernel. A rank receives at most every row of its ep group (n * S for S rows per rank, all routed
# to its experts: dropless), so the dispatched rows are padded to n * S: the received rows first,
# expert-major, then zeros. The local group ends (``ep_local_offsets``) end at the received rows,
# so the grouped matmuls leave the padding out of every expert's group; the region's row-wise ops
# compute on it (their values never leave it: the combine reads the received rows only, and the
# padding's gradient is zero). What runs at run time is the eager exchange above: the same
# all-to-alls, through the same bounded waiter, counted in the same log and statistics. The cost
# is the padding: the region's activations are held for n * S rows instead of the rows received.


def _tracing(x: torch.Tensor) -> bool:
    return _are_we_tracing() or isinstance(x, torch._subclasses.fake_tensor.FakeTensor)


@torch.library.custom_op("fxsplit::ep_counts", mutates_args=())
def _counts_op(counts: torch.Tensor, axis: str, n: int) -> torch.Tensor:
    b = _bound(axis, "ep_token_counts")
    k = counts.numel() // n
    recv = _all_to_all(counts, [k] * n, [k] * n, b, "no_grad").view(n, k)
    stats = _STATS.get()
    if stats is not None:
        stats.add_rows(recv.sum(0).cpu())
    return recv


@_counts_op.register_fake
def _(counts, axis, n):
    return counts.new_empty((n, counts.numel() // n))


@torch.library.custom_op("fxsplit::ep_to_experts", mutates_args=())
def _to_experts_op(x: torch.Tensor, offs: torch.Tensor, recv: torch.Tensor, axis: str, phase: str) -> torch.Tensor:
    rows = _to_experts(x, offs, recv, _bound(axis, "ep_dispatch"), phase)
    if rows.shape[0] > recv.shape[0] * x.shape[0]:
        raise RunError(f"ep_dispatch: this rank received {rows.shape[0]} rows, more than the {recv.shape[0]} x "
                       f"{x.shape[0]} its traced graph holds: the ranks of the ep group sent different numbers of "
                       "rows (every data-parallel replica must step with the same microbatch shape)")
    out = rows.new_zeros((recv.shape[0] * x.shape[0], *x.shape[1:]))
    out[:rows.shape[0]] = rows
    return out


@_to_experts_op.register_fake
def _(x, offs, recv, axis, phase):
    return x.new_empty((recv.shape[0] * x.shape[0], *x.shape[1:]))


@torch.library.custom_op("fxsplit::ep_from_experts", mutates_args=())
def _from_experts_op(y: torch.Tensor, offs: torch.Tensor, recv: torch.Tensor, axis: str, phase: str) -> torch.Tensor:
    return _from_experts(y[:int(recv.sum())], offs, recv, _bound(axis, "ep_combine"), phase)


@_from_experts_op.register_fake
def _(y, offs, recv, axis, phase):
    return y.new_empty((y.shape[0] // recv.shape[0], *y.shape[1:]))


def _save_route(ctx, inputs, output) -> None:
    _, offs, recv, axis, _ = inputs
    ctx.save_for_backward(offs, recv)
    ctx.axis = axis


def _to_experts_grad(ctx, grad):
    offs, recv = ctx.saved_tensors
    return _from_experts_op(grad, offs, recv, ctx.axis, "backward"), None, None, None, None


def _from_experts_grad(ctx, grad):
    offs, recv = ctx.saved_tensors
    return _to_experts_op(grad, offs, recv, ctx.axis, "backward"), None, None, None, None


_to_experts_op.register_autograd(_to_experts_grad, setup_context=_save_route)
_from_experts_op.register_autograd(_from_experts_grad, setup_context=_save_route)


def _traced(fn, args: tuple, kwargs: dict):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.fx.Proxy):
            return a.tracer.create_proxy("call_function", fn, args, kwargs)
    return None


def ep_token_counts(offs: torch.Tensor, axis: str = "ep") -> torch.Tensor:
    """``recv [n, k]`` (int64): the rows each source rank of ``axis`` routes to each of this rank's
    k experts, from every rank's group ends ``offs``; ``[1, E]`` (this rank's own counts) unbound."""
    if (node := _traced(ep_token_counts, (offs,), {"axis": axis})) is not None:
        return node
    b = _active(axis, "ep_token_counts")
    counts = _counts(offs)
    if b is None:
        return counts.view(1, -1)
    n = b.group.size()
    k = _check(offs, n, "ep_token_counts")
    if _tracing(offs):  # [Note: traced exchange]
        return _counts_op(counts, axis, n)
    recv = _all_to_all(counts, [k] * n, [k] * n, b, "no_grad").view(n, k)
    stats = _STATS.get()
    if stats is not None:  # (a forward recomputed by activation checkpointing counts again)
        stats.add_rows(recv.sum(0).cpu())
    return recv


def ep_dispatch(x: torch.Tensor, offs: torch.Tensor, recv: torch.Tensor, axis: str = "ep") -> torch.Tensor:
    """The rows ``x [S, C]`` (sorted by expert, group ends ``offs``) sent to the ranks holding their
    experts; returns the rows of this rank's experts, expert-major ([Note: expert-parallel exchange])."""
    if (node := _traced(ep_dispatch, (x, offs, recv), {"axis": axis})) is not None:
        return node
    b = _active(axis, "ep_dispatch")
    if b is not None and _tracing(x):  # [Note: traced exchange]
        return _to_experts_op(x, offs, recv, axis, "forward")
    return x if b is None else _Dispatch.apply(x, offs, recv, b)


def ep_combine(y: torch.Tensor, offs: torch.Tensor, recv: torch.Tensor, axis: str = "ep") -> torch.Tensor:
    """The inverse of :func:`ep_dispatch`: this rank's experts' output rows sent back to the ranks
    they came from; returns ``[S, C']`` in the order of the rows ``ep_dispatch`` was given."""
    if (node := _traced(ep_combine, (y, offs, recv), {"axis": axis})) is not None:
        return node
    b = _active(axis, "ep_combine")
    if b is not None and _tracing(y):  # [Note: traced exchange]
        return _from_experts_op(y, offs, recv, axis, "forward")
    return y if b is None else _Combine.apply(y, offs, recv, b)


def ep_local_offsets(recv: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The group ends of the rows :func:`ep_dispatch` returns (length k, ``offs``' dtype): the
    cumulative rows per local expert over every source. With ``recv`` of one source, ``offs``."""
    if (node := _traced(ep_local_offsets, (recv, offs), {})) is not None:
        return node
    if recv.shape[0] == 1 and recv.shape[1] == offs.numel():
        return offs
    return torch.cumsum(recv.sum(0), 0).to(offs.dtype)


# ----------------------------------------------------------------------------- one-process emulation
# Every rank's values at once (index r: rank r's), as fxsplit.verify runs ranks in lockstep ([Note:
# emulated collectives] in fxsplit.tp.emulate): the exchange written with differentiable torch ops
# (split, cat, index), so one backward of all ranks' losses gives each rank its real gradient.


def emulated_token_counts(offs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``ep_token_counts`` over ``len(offs)`` ranks: rank r's ``recv [n, k]``."""
    n = len(offs)
    k = _check(offs[0], n, "ep_token_counts")
    counts = [_counts(o) for o in offs]
    return [torch.stack([c[r * k:(r + 1) * k] for c in counts]) for r in range(n)]


def emulated_dispatch(xs: list[torch.Tensor], offs: list[torch.Tensor], recvs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``ep_dispatch`` over ``len(xs)`` ranks: rank r's rows of its experts, expert-major."""
    n = len(xs)
    k = offs[0].numel() // n
    pieces = [x.split(_counts(o).view(n, k).sum(1).tolist()) for x, o in zip(xs, offs)]  # [source][dest]
    return [torch.cat([pieces[s][r] for s in range(n)])[_expert_major(recvs[r].cpu()).to(xs[r].device)]
            for r in range(n)]


def emulated_combine(ys: list[torch.Tensor], offs: list[torch.Tensor], recvs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``ep_combine`` over ``len(ys)`` ranks: every rank's rows back, in the order it dispatched them."""
    n = len(ys)
    back = []  # [holder][source]
    for y, recv in zip(ys, recvs):
        perm = _expert_major(recv.cpu()).to(y.device)
        source_major = y[torch.argsort(perm)]
        back.append(source_major.split(recv.sum(1).tolist()))
    return [torch.cat([back[r][s] for r in range(n)]) for s in range(n)]


EP_OPS = frozenset({ep_token_counts, ep_dispatch, ep_combine, ep_local_offsets})

torch.fx.wrap("ep_token_counts")
torch.fx.wrap("ep_dispatch")
torch.fx.wrap("ep_combine")
torch.fx.wrap("ep_local_offsets")
