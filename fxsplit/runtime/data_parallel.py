"""Data-parallel gradients of one rank: the mean over its replicas, in flat buckets, started per stage
while the pipeline still runs.

Terms (DESIGN.md, fxsplit.runtime.mesh): **dp group** -- the ranks holding the same shards of the
same stages (with context parallelism it spans dp x cp, [Note: cp gradients]); **bucket** -- gradients
packed into one flat tensor of about ``bucket_bytes`` (per dtype, in the mixed-precision
``reduce_dtype`` when given) and all-reduced as one; **ready** stage -- one whose last backward of the
step has run, so its gradients are final (except tied parameters, which the pipeline sums across
stages after its last action).

    grads = DataParallelGrads(stages, groups=..., wait=..., tied=..., experts=...)
    PipelineRuntime(rank_plan, stages, options, grad_hooks=grads)   # the runtime calls
    ...                                                             # grads.stage_grads_ready(s)
    grads.finish()                                                  # after the step: the rest, then wait

The runtime calls :meth:`DataParallelGrads.stage_grads_ready` as each stage becomes ready, which starts
that stage's bucketed all-reduces asynchronously (overlapping later stages' compute); :meth:`finish`
waits for them, reduces what is left (tied parameters, and everything when one stage or no overlap),
and the experts placed by ep over their replicas ([Note: expert gradients]). torch's DDP buckets by
hooks on the autograd graph of one module and cannot see a pipeline's stages finishing, and FSDP2
(``dp_shard``, fxsplit.runtime.fsdp) reduce-scatters instead, so the all-reduce buckets are our own.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fxsplit.runtime.fsdp import ShardedGradSync

__all__ = ["DataParallelGrads", "GroupWait", "bucketed_all_reduce", "finish_all_reduce", "launch_all_reduce"]

# wait(work, what, group): a bounded, failure-aware wait on ``group``'s ranks ([Note: failure protocol])
GroupWait = Callable[[Any, str, Any], None]


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
    """Wait for ``pending`` (from :func:`launch_all_reduce`), scale the sums and copy them back."""
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


def _size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


class DataParallelGrads:
    """The data-parallel mean of one rank's gradients (see the module docstring).

    - ``stages``: this rank's stage modules (stage index -> module), in the order the model holds them
      (their parameters, deduplicated in that order, are bucketed in that order on every replica).
    - ``dp`` / ``ep_replica``: the groups the gradients and the experts' gradients are summed over.
    - ``wait``: the bounded wait of every all-reduce ([Note: failure protocol]).
    - ``tied`` / ``experts``: parameters reduced only in :meth:`finish` (tied: summed across stages
      first) / over ``ep_replica`` ([Note: expert gradients]).
    - ``cp``: context-parallel degree ([Note: cp gradients]); ``data_ranks``: dp * dp_shard.
    - ``sharded``: FSDP2's units with ``dp_shard`` > 1, which do the data-parallel mean themselves (with
      cp, over dp_shard x cp: [Note: FSDP over cp] in fxsplit.runtime.mesh).
    - ``overlap``: start a stage's all-reduces when it is ready (False: all in :meth:`finish`; one
      stage has nothing computing after its backward).
    """

    def __init__(self, stages: Mapping[int, nn.Module], *, dp: Any, ep_replica: Any, wait: GroupWait,
                 tied: Collection[nn.Parameter] = (), experts: Collection[nn.Parameter] = (), cp: int = 1,
                 data_ranks: int = 1, sharded: ShardedGradSync | None = None, overlap: bool = True,
                 bucket_bytes: int = 25 * 2**20, reduce_dtype: torch.dtype | None = None):
        self._stages = nn.ModuleDict({str(s): m for s, m in stages.items()})
        self._dp, self._ep_replica, self._wait = dp, ep_replica, wait
        self._tied = {id(p) for p in tied}
        self._experts = {id(p) for p in experts}
        self._cp, self._data_ranks, self._sharded = cp, data_ranks, sharded
        self._overlap = overlap and sharded is None and _size(dp) > 1
        self._bucket_bytes, self._reduce_dtype = bucket_bytes, reduce_dtype
        self._pending: list = []  # all-reduces started during this step
        self._done: set[int] = set()  # parameters (by id) whose all-reduce has started this step

    @property
    def in_flight(self) -> bool:
        """Whether all-reduces started during the step wait for :meth:`finish`."""
        return bool(self._pending)

    def drop(self) -> None:
        """Forget the all-reduces of a failed step (their group is abandoned by the caller)."""
        self._pending, self._done = [], set()

    def _parameters(self) -> Iterator[nn.Parameter]:
        return self._stages.parameters()

    def stage_grads_ready(self, stage: int) -> None:
        """The runtime's hook: ``stage``'s gradients are final; start their all-reduces."""
        if not self._overlap:
            return
        params = [p for p in self._stages[str(stage)].parameters()
                  if p.grad is not None and id(p) not in self._tied and id(p) not in self._done
                  and id(p) not in self._experts]
        self._done.update(id(p) for p in params)
        self._pending += launch_all_reduce([p.grad for p in params], self._dp, self._bucket_bytes,
                                           self._reduce_dtype)

    def finish(self) -> None:
        """After the pipeline: wait for the started all-reduces, reduce the rest. With sequence
        parallelism the replicated parameters' partial gradients are already summed over tp by the
        graph itself (the tensor-parallel pass reads them through Megatron's f)."""
        if self._sharded is not None:
            self._sharded.reduce()  # the dp_shard (and dp) mean: reduce-scatter, FSDP's own
            self._reduce_experts(1.0 / self._data_ranks)  # FSDP ignores them
            return
        pending, self._pending = self._pending, []
        if _size(self._dp) == 1:
            return
        # [Note: cp gradients] each cp rank holds its tokens' share of a gradient: the "dp" group spans
        # dp x cp ranks (fxsplit.runtime.mesh.build_groups), and the mean over dp is the sum over cp
        # divided by dp
        scale = self._cp / _size(self._dp)
        wait = lambda work: self._wait(work, "in the data-parallel gradient all-reduce", self._dp)  # noqa: E731
        finish_all_reduce(pending, scale=scale, wait=wait)
        done, self._done = self._done, set()
        rest = [p.grad for p in self._parameters()
                if p.grad is not None and id(p) not in done and id(p) not in self._experts]
        bucketed_all_reduce(rest, self._dp, self._bucket_bytes, scale=scale, reduce_dtype=self._reduce_dtype,
                            wait=wait)
        self._reduce_experts(scale)

    # [Note: expert gradients] An expert's rows come from every rank of its ep group (the exchange's
    # backward brings each source's gradient home to the expert), so a rank's expert gradient already
    # sums its ep group's losses; the replicas of that expert (same ep rank, other ep groups) hold the
    # rest of the global batch. Their sum over the replica group times 1 / (dp * dp_shard) is the
    # gradient of the mean loss over all data ranks: the unsplit model's on the global batch.
    def _reduce_experts(self, scale: float) -> None:
        grads = [p.grad for p in self._parameters() if p.grad is not None and id(p) in self._experts]
        if not grads:
            return
        group = self._ep_replica
        if _size(group) == 1:
            for g in grads:
                g.mul_(scale)
            return
        wait = lambda work: self._wait(work, "in the expert-replica gradient all-reduce", group)  # noqa: E731
        bucketed_all_reduce(grads, group, self._bucket_bytes, scale=scale, reduce_dtype=self._reduce_dtype,
                            wait=wait)
