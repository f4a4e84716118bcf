"""What one pipeline rank runs: :class:`RankPlan`, the per-rank part of a :class:`fxsplit.Plan`.

Terms as in :mod:`fxsplit.pipeline.comm` (stages, actions, messages; p pipeline ranks, stage s on
rank ``stage_ranks[s]``, by default ``s % p``).

    rp = plan.rank_plan(pp_rank)                       # from a Plan: comm plans already computed
    rp = RankPlan.build(io, schedule, rank=r, num_ranks=p, input_meta=meta)   # hand-built stages
    print(rp)                                          # its stages, actions and messages per peer
    PipelineRuntime(rp, {s: module for s in rp.stages}, group=pp_group, loss_fn=..., device=...)

Everything the runtime needs to know about the pipeline is here and was decided before any
process started: the runtime runs it and never plans ([Note: layer contract] in fxsplit).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fxsplit.errors import PlanError
from fxsplit.pipeline.comm import CommPlan, plan_all_communication
from fxsplit.pipeline.stage import StageGraphs, StageIO, ValueMeta
from fxsplit.schedule.ir import Action

__all__ = ["RankPlan"]


LEGEND = ("  legend: an action is <stage><kind><microbatch> (2F0: forward of microbatch 0 on stage 2; B full "
          "backward, I input gradient, W weight gradient); a message is <S send|R receive><a activation|g gradient>"
          "<stage>.<input>@<microbatch> (Sa1.0@0: send stage 1's input 0 of microbatch 0), per peer in the order "
          "posted")


@dataclass(frozen=True)
class RankPlan:
    """Pipeline rank ``rank``'s program: the wiring of ALL stages (every rank derives the same
    message order from it), the whole schedule, and this rank's communication plans for a
    training step (``train``) and for inference (``forward``, F actions only)."""

    rank: int
    num_ranks: int
    stage_ranks: tuple[int, ...]
    io: tuple[StageIO, ...]
    input_meta: tuple[ValueMeta, ...]
    shared_params: tuple[tuple[tuple[int, str], ...], ...]
    output_spec: Any
    schedule: tuple[tuple[Action | None, ...], ...]
    train: CommPlan
    forward: CommPlan

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.num_ranks:
            raise PlanError(f"RankPlan: rank {self.rank} out of range for num_ranks={self.num_ranks}")
        if len(self.stage_ranks) != len(self.io):
            raise PlanError(f"RankPlan: stage_ranks has {len(self.stage_ranks)} entries for {len(self.io)} stages")
        bad = [(s, r) for s, r in enumerate(self.stage_ranks) if not 0 <= r < self.num_ranks]
        if bad:
            raise PlanError(f"RankPlan: stage(s) on ranks outside 0..{self.num_ranks - 1}: {bad}")
        for name, comm in (("train", self.train), ("forward", self.forward)):
            if comm.rank != self.rank or comm.num_ranks != self.num_ranks:
                raise PlanError(f"RankPlan: the {name} CommPlan is for rank {comm.rank} of {comm.num_ranks}, "
                                f"not rank {self.rank} of {self.num_ranks}")

    @classmethod
    def build(cls, io: Sequence[StageIO], schedule: Sequence[Sequence[Action | None]], *, rank: int,
              num_ranks: int, input_meta: Sequence[ValueMeta],
              shared_params: Sequence[Sequence[tuple[int, str]]] = (), output_spec: Any = None,
              stage_ranks: Sequence[int] | Mapping[int, int] | None = None) -> RankPlan:
        """Plan rank ``rank`` from the stages' wiring and the schedule (computes its CommPlans);
        ``stage_ranks`` maps stage -> rank (default ``s % num_ranks``)."""
        if stage_ranks is None:
            ranks = tuple(s % num_ranks for s in range(len(io)))
        elif isinstance(stage_ranks, Mapping):  # stage -> rank
            ranks = tuple(stage_ranks[s] for s in range(len(io)))
        else:
            ranks = tuple(stage_ranks)
        comm = {fwd: plan_all_communication(schedule, io, num_ranks=num_ranks, rank_of_stage=ranks.__getitem__,
                                            forward_only=fwd)[rank] for fwd in (False, True)}
        return cls(rank=rank, num_ranks=num_ranks, stage_ranks=ranks, io=tuple(io), input_meta=tuple(input_meta),
                   shared_params=tuple(tuple(tuple(x) for x in g) for g in shared_params), output_spec=output_spec,
                   schedule=tuple(tuple(row) for row in schedule), train=comm[False], forward=comm[True])

    @classmethod
    def from_stage_graphs(cls, graphs: StageGraphs, schedule: Sequence[Sequence[Action | None]], *, rank: int,
                          num_ranks: int, stage_ranks: Sequence[int] | None = None) -> RankPlan:
        return cls.build(graphs.io, schedule, rank=rank, num_ranks=num_ranks, input_meta=graphs.input_meta,
                         shared_params=graphs.shared_params, output_spec=graphs.output_spec,
                         stage_ranks=stage_ranks)

    def forward_with(self, microbatches: int) -> CommPlan:
        """This rank's inference CommPlan for ``microbatches`` (1 <= microbatches <= the plan's m):
        the schedule's F actions of microbatches below that, in the schedule's order. Dropping a
        microbatch's actions and every backward keeps each rank's order a valid one (a forward
        waits only on forwards of its own microbatch), so a batch smaller than m still runs
        pipelined: inference needs no more microbatches than samples."""
        m = self.forward.num_microbatches
        if not 1 <= microbatches <= m:
            raise PlanError(f"RankPlan.forward_with: microbatches={microbatches} is outside 1..{m} "
                            f"(the plan's schedule has {m})")
        if microbatches == m:
            return self.forward
        rows = [[a for a in row if a is not None and a.microbatch < microbatches] for row in self.schedule]
        return plan_all_communication(rows, self.io, num_ranks=self.num_ranks, rank_of_stage=self.rank_of_stage,
                                      forward_only=True)[self.rank]

    @property
    def num_stages(self) -> int:
        return len(self.io)

    @property
    def stages(self) -> tuple[int, ...]:
        """The stages this rank holds, in order."""
        return tuple(s for s, r in enumerate(self.stage_ranks) if r == self.rank)

    @property
    def rank_of_stage(self) -> Callable[[int], int]:
        return self.stage_ranks.__getitem__

    def __str__(self) -> str:
        mine = " ".join(str(a) for a in self.schedule[self.rank] if a is not None)
        return "\n".join([
            f"pipeline rank {self.rank} of {self.num_ranks}: stages {list(self.stages)} of {self.num_stages}",
            f"  actions: {mine}",
            *("  " + line for line in str(self.train).splitlines()),
            LEGEND,
        ])
