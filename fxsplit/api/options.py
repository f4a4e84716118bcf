"""The options of a plan: one typed, validated dataclass that ``plan``, ``parallelize`` and the CLI share.

Terms as in :mod:`fxsplit.api.plan` (d, t, p, v, m).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from fxsplit.errors import PlanError

__all__ = ["ParallelConfig", "SCHEDULES", "resolve_config"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass(frozen=True)
class ParallelConfig:
    """The degrees and options of a plan (validated on creation)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    schedule: str = "interleaved_1f1b"
    stages_per_rank: int = 1
    split_points: tuple[str, ...] | None = None
    tp_plan: Mapping[str, str] | None = None
    memory_limit: float | None = None
    sequence_parallel: bool = False
    vocab_parallel_loss: bool = False

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "microbatches", "stages_per_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name} must be an int >= 1, got {value!r}")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.pp > 1 and self.microbatches < self.pp:
            raise PlanError(
                f"microbatches={self.microbatches} < pp={self.pp}: every pipeline rank needs at least "
                f"one microbatch in flight; use microbatches >= {self.pp} (2 * pp = {2 * self.pp} is a good start)"
            )

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


def _default_microbatches(pp: int) -> int:
    return 1 if pp == 1 else 2 * pp


def resolve_config(
    *, tp, pp, dp, microbatches, schedule, stages_per_rank, split_points, tp_plan, memory_limit,
    sequence_parallel, vocab_parallel_loss,
) -> ParallelConfig:
    m = _default_microbatches(pp) if microbatches is None else microbatches
    if stages_per_rank is None:
        stages_per_rank = 2 if (schedule == "interleaved_1f1b" and pp > 1) else 1
    if pp == 1 and schedule == "interleaved_1f1b":
        schedule = "1f1b"  # one pipeline rank: nothing to interleave
    if schedule == "interleaved_1f1b" and stages_per_rank < 2:
        raise PlanError(
            f"interleaved_1f1b needs stages_per_rank >= 2 (got {stages_per_rank}); use schedule='1f1b' for one stage per rank"
        )
    return ParallelConfig(
        dp=dp, tp=tp, pp=pp, microbatches=m, schedule=schedule, stages_per_rank=stages_per_rank,
        split_points=tuple(split_points) if split_points is not None else None,
        tp_plan=dict(tp_plan) if tp_plan is not None else None, memory_limit=memory_limit,
        sequence_parallel=sequence_parallel, vocab_parallel_loss=vocab_parallel_loss,
    )


