"""DualPipeV as a per-rank action list (DeepSeek-V3, arXiv 2412.19437; the V-shaped half of DualPipe).

[Note: DualPipeV] The model is cut into 2p stages placed in a V, as ZB-V places them
(``v_placement``): rank r holds stage r (descending, "chunk 0") and stage 2p-1-r (ascending,
"chunk 1"), so a microbatch goes down the ranks and back up and the loss sits on rank 0. What
sets DualPipeV apart is its steady state: each step pairs the forward of one chunk with the full
backward of the other chunk on the same rank ("F&B"), so that on a GPU the all-to-all (expert
parallelism) or the point-to-point transfers of one half run under the other half's compute.
Rank r runs, with counters per (stage, kind) giving the microbatch of each action:
    1. 2(p-r-1) forwards of chunk 0;
    2. r+1 pairs F chunk 0, F chunk 1;
    3. p-r-1 triples I chunk 1, the oldest pending W (if any), F chunk 1;
    4. m-2p+r+1 steps of two F&B pairs: (F chunk 0 & B chunk 1), then (F chunk 1 & B chunk 0);
       on the last rank the first step's first pair runs F then B unpaired;
    5. p-r-1 steps: B chunk 1, then (F chunk 1 & B chunk 0);
    6. r+1 steps of B chunk 1 then B chunk 0, where from the middle step on (chunk 1 first on odd
       ranks, chunk 0 first on even ranks) the backward is split: I now, its W queued;
    7. p-r-1 steps: the oldest queued W, then chunk 0's backward (split);
    8. the queued W's that are left (r+1 of them).
This is the order torch 2.13's ``ScheduleDualPipeV`` computes (tests compare the two action by
action, its overlapped pairs expanded F first), written here as data so that it is validated,
simulated and drawn like every other schedule. An F&B pair is two consecutive actions of the
rank's list; fxsplit's runtime runs them one after the other (on CPU nothing can overlap them; the
pairing is what a GPU runtime would overlap). It needs m >= 2p (every stage's warm-up).

Memory: every rank holds at most p + 1 microbatches of its share in flight; the zero-bubble tail
(steps 6-8) defers W's as ZB-H1 does.
"""

from __future__ import annotations

from fxsplit.errors import ScheduleError
from fxsplit.schedule.builders import check_sizes, v_placement
from fxsplit.schedule.ir import Action, ActionKind, Schedule

__all__ = ["dualpipev"]

F = ActionKind.FORWARD
B = ActionKind.BACKWARD
BI = ActionKind.BACKWARD_INPUT
BW = ActionKind.BACKWARD_WEIGHT


class _Row:
    """One rank's list with the microbatch counters of [Note: DualPipeV]."""

    def __init__(self) -> None:
        self.actions: list[Action | None] = []
        self.next_f: dict[int, int] = {}
        self.next_b: dict[int, int] = {}  # a full B and an I draw from the same counter
        self.pending_w: list[Action] = []

    def forward(self, stage: int) -> None:
        mb = self.next_f.get(stage, 0)
        self.next_f[stage] = mb + 1
        self.actions.append(Action(stage, F, mb))

    def backward(self, stage: int, split: bool = False) -> None:
        mb = self.next_b.get(stage, 0)
        self.next_b[stage] = mb + 1
        self.actions.append(Action(stage, BI if split else B, mb))
        if split:
            self.pending_w.append(Action(stage, BW, mb))

    def weight(self) -> None:
        if self.pending_w:
            self.actions.append(self.pending_w.pop(0))

    def f_and_b(self, forward_stage: int, backward_stage: int) -> None:
        self.forward(forward_stage)
        self.backward(backward_stage)


def dualpipev(num_ranks: int, num_microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """DualPipeV ([Note: DualPipeV]): 2 stages per rank in a V, forward of one chunk paired with
    the backward of the other in the steady state, a zero-bubble tail. Needs m >= 2p."""
    check_sizes("dualpipev", num_ranks, num_microbatches, stages_per_rank)
    if stages_per_rank != 2:
        raise ScheduleError(f"dualpipev places exactly 2 stages per rank in a V, got stages_per_rank={stages_per_rank}")
    p, m = num_ranks, num_microbatches
    if m < 2 * p:
        raise ScheduleError(f"dualpipev needs at least 2 * num_ranks = {2 * p} microbatches (one per stage), got "
                            f"{m}; raise microbatches or use schedule='zbv', which runs any m")
    placement = v_placement(p)
    schedule: Schedule = []
    for r in range(p):
        down, up = placement.index(r), len(placement) - 1 - placement.index(r)
        row = _Row()
        for _ in range(2 * (p - r - 1)):
            row.forward(down)
        for _ in range(r + 1):
            row.forward(down)
            row.forward(up)
        for _ in range(p - r - 1):
            row.backward(up, split=True)
            row.weight()
            row.forward(up)
        for i in range(m - 2 * p + r + 1):
            row.f_and_b(down, up)  # on the last rank, the first of these runs unpaired: the same order
            row.f_and_b(up, down)
        for _ in range(p - r - 1):
            row.backward(up)
            row.f_and_b(up, down)
        steps = r + 1
        split = False
        for i in range(steps):
            if i == steps // 2 and r % 2 == 1:
                split = True
            row.backward(up, split)
            if i == steps // 2 and r % 2 == 0:
                split = True
            row.backward(down, split)
        for _ in range(p - r - 1):
            row.weight()
            row.backward(down, split)
        for _ in range(r + 1):
            row.weight()
        schedule.append(row.actions)
    return schedule
