"""Data-parallel gradient reduction in flat buckets: ``launch_all_reduce`` packs gradients into
buckets of about ``bucket_bytes`` (per dtype, in the mixed-precision ``reduce_dtype`` when given) and
starts their asynchronous all-reduces; ``finish_all_reduce`` waits (through the runtime's bounded
wait when given), scales and copies the sums back. ``ParallelModel`` reduces every stage's
gradients over "dp" with them, and the experts placed by ep over "ep_replica" ([Note: expert
gradients] in fxsplit.api.model).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["bucketed_all_reduce", "finish_all_reduce", "launch_all_reduce"]


def launch_all_reduce(grads: Sequence[torch.Tensor], group: Any, bucket_bytes: int,
                       reduce_dtype: torch.dtype | None = None) -> list:
    """Start asynchronous all-reduces of ``grads`` packed into flat buckets (per dtype, each
    reduced in ``reduce_dtype`` when given: mp_policy); returns the pending work for
    :func:`finish_all_reduce`."""
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for g in grads:
        if size and size + g.numel() * g.element_size() > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += g.numel() * g.element_size()
    pending = []
    for bucket in buckets:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in bucket:
            by_dtype.setdefault(g.dtype, []).append(g)
        for gs in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in gs])
            if reduce_dtype is not None and flat.dtype != reduce_dtype:
                flat = flat.to(reduce_dtype)
            pending.append((flat, gs, dist.all_reduce(flat, group=group, async_op=True)))
    return pending


def finish_all_reduce(pending: list, *, scale: float, wait: Callable[[Any], None] | None = None) -> None:
    for flat, gs, work in pending:
        if wait is None:
            work.wait()
        else:
            wait(work)
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for g in gs:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()


def bucketed_all_reduce(grads: Sequence[torch.Tensor], group: Any, bucket_bytes: int, *, scale: float,
                         reduce_dtype: torch.dtype | None = None, wait: Callable[[Any], None] | None = None) -> None:
    finish_all_reduce(launch_all_reduce(grads, group, bucket_bytes, reduce_dtype), scale=scale, wait=wait)
