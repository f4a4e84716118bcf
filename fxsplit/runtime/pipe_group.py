"""The pipeline process group of one rank and its bounded waits: :class:`PipeGroup`.

Terms (fxsplit.runtime.executor): **pipeline rank** -- this rank's index in the pipeline group
(``None`` group: the default group); **global rank** -- its index in the default group, which the
failure board ([Note: failure protocol] in fxsplit.runtime.watch) names ranks by.

    pipe = PipeGroup(group, rank=r, timeout=300.0, watch=watch, blocking_waits=True)
    pipe.wait(work, "broadcasting the loss", peer=last_rank, p2p=False)   # PipelineError / RankFailedError
    pipe.give_up()                                                         # after a failure: never used again
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from fxsplit.runtime.p2p import PipelineError
from fxsplit.runtime.watch import Watch, abandon

__all__ = ["PipeGroup"]


class PipeGroup:
    """The group a pipeline runtime talks over (point-to-point besides its channel: tied gradient
    sums, the loss broadcast, gathered outputs), with every wait bounded."""

    def __init__(self, group: dist.ProcessGroup | None, *, rank: int, timeout: float, watch: Watch | None,
                 blocking_waits: bool):
        self.group = group
        self.rank = rank
        self.timeout = timeout
        self.watch = watch
        self.blocking_waits = blocking_waits

    def global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def wait(self, work: dist.Work, what: str, peer: int | None, *, p2p: bool = True) -> None:
        """Wait for ``work`` with pipeline rank ``peer``: through the watch where waits block the host,
        else bounded by ``timeout``; a failure raises naming the peer."""
        if self.watch is not None and self.blocking_waits:
            g = self.global_rank(peer) if peer is not None else None
            self.watch.wait(work, f"{what} with global rank {g}", () if g is None else (g,), sliced=not p2p)
            return
        try:
            if self.blocking_waits:
                work.wait(datetime.timedelta(seconds=self.timeout))
            else:
                work.wait()
        except Exception as exc:
            raise PipelineError(
                f"pipeline rank {self.rank}: {what} with pipeline rank "
                f"{peer if peer is not None else '(any)'} failed or timed out after "
                f"{self.timeout:g} s ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                "that rank most likely failed: look for its own error first",
                rank=self.rank, peer=peer, action=None, microbatch=None) from exc

    def give_up(self) -> None:
        """Abandon the group ([Note: failure protocol] point 4): it may hold transfers no peer completes."""
        abandon(self.group)
        self.group = None

    def destroy(self) -> None:
        """Destroy the group so that peers blocked on this rank fail at once (no failure board)."""
        group, self.group = self.group, None
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 -- best effort: the original error is what matters
            pass
