"""Schedule simulator: start and end of every action under a simple cost model, bubbles, memory.

Terms (see DESIGN.md): p ranks, m microbatches, v_r = number of stages rank r holds. Costs are per
microbatch for ONE RANK'S WHOLE SHARE of the model; an action on one of the v_r stages of rank r
costs 1/v_r of it. ``comm`` is a point-to-point latency between a producer's end and a consumer's
earliest start when they run on different ranks.

Representative use::

    t = simulate(build("1f1b", 4, 8), forward=1.0, backward=2.0)
    t.makespan          # 33.0 == (m + p - 1) * (F + B)
    t.bubble_ratio      # 0.375 == (p - 1) / m
    t.peak_inflight     # (4.0, 3.0, 2.0, 1.0)

[Note: three bubbles] Papers mean three different things by "bubble"; all three are reported:
    bubble_fraction  idle share of the total time over all ranks:
                     sum_r (makespan - busy_r) / (p * makespan).  GPipe/1F1B: (p-1)/(m+p-1).
    bubble_ratio     idle time relative to the ideal (busy) time, Megatron's t_pb / t_id:
                     sum_r (makespan - busy_r) / sum_r busy_r.  GPipe/1F1B: (p-1)/m;
                     interleaved 1F1B: (p-1)/(v*m).
    bubble_active    idle share inside each rank's active window (its first start to its last
                     end), as zero-bubble papers count it: sum_r idle_in_window_r / sum_r window_r.
                     ``idle_active`` holds the per-rank idle times inside the window.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxsplit.schedule.ir import Action, ActionKind, parse_schedule
from fxsplit.schedule.validate import dependencies, validate

__all__ = ["Event", "Timeline", "simulate", "align_steps"]


@dataclass(frozen=True)
class Event:
    """One simulated action: ``action`` ran on ``rank`` from ``start`` to ``end``."""

    rank: int
    action: Action
    start: float
    end: float

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.action} [{self.start:g}, {self.end:g})"


@dataclass(frozen=True)
class Timeline:
    """Result of ``simulate``; bubble measures per [Note: three bubbles].

    ``peak_inflight[r]``: the largest number of forwards on rank r whose activations are still held
    (from the forward's start until its B ends, or its W ends for a split backward), counted in
    microbatches of rank r's full share: a forward of one of v_r stages counts 1/v_r. 1F1B gives
    p - r, GPipe m, interleaved 1F1B about p + (p-1)/v on rank 0.
    """

    events: tuple[Event, ...]
    num_ranks: int
    num_stages: int
    num_microbatches: int
    stages_per_rank: tuple[int, ...]
    costs: tuple[tuple[str, float], ...]  # (kind letter, cost per microbatch of a rank's share)
    comm: float
    makespan: float
    busy: tuple[float, ...]
    idle_active: tuple[float, ...]
    peak_inflight: tuple[float, ...]

    @property
    def idle(self) -> tuple[float, ...]:
        """Per rank: makespan minus busy time."""
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the total time over all ranks (see [Note: three bubbles])."""
        total = self.num_ranks * self.makespan
        return (total - sum(self.busy)) / total if total else 0.0

    @property
    def bubble_ratio(self) -> float:
        """Idle time relative to the ideal busy time, Megatron's t_pb / t_id."""
        work = sum(self.busy)
        return (self.num_ranks * self.makespan - work) / work if work else 0.0

    @property
    def bubble_active(self) -> float:
        """Idle share inside each rank's active window, summed over ranks (zero-bubble papers)."""
        window = sum(b + i for b, i in zip(self.busy, self.idle_active))
        return sum(self.idle_active) / window if window else 0.0

    def events_of(self, rank: int) -> tuple[Event, ...]:
        """Events of ``rank`` in execution order."""
        return tuple(e for e in self.events if e.rank == rank)

    def __str__(self) -> str:
        costs = ", ".join(f"{k}={c:g}" for k, c in self.costs)
        peaks = ", ".join(f"{x:.3g}" for x in self.peak_inflight)
        return (
            f"Timeline: {self.num_ranks} ranks, {self.num_stages} stages, {self.num_microbatches} "
            f"microbatches ({costs}, comm={self.comm:g})\n"
            f"  makespan {self.makespan:g}; bubble_fraction {self.bubble_fraction:.4f} (idle share of "
            f"p x makespan), bubble_ratio {self.bubble_ratio:.4f} (idle / ideal), bubble_active "
            f"{self.bubble_active:.4f} (idle inside active windows)\n"
            f"  peak in-flight microbatches per rank: [{peaks}]"
        )


def _costs(forward: float, backward: float, backward_input: float | None,
           backward_weight: float | None) -> dict[ActionKind, float]:
    if backward_input is None and backward_weight is None:
        backward_input = backward_weight = backward / 2
    elif backward_input is None:
        backward_input = backward - backward_weight
    elif backward_weight is None:
        backward_weight = backward - backward_input
    costs = {
        ActionKind.FORWARD: forward,
        ActionKind.BACKWARD: backward,
        ActionKind.BACKWARD_INPUT: backward_input,
        ActionKind.BACKWARD_WEIGHT: backward_weight,
    }
    for kind, value in costs.items():
        if not value >= 0:
            raise ValueError(
                f"simulate: the cost of {kind.name} ({kind.value}) must be >= 0, got {value!r} "
                f"(forward={forward!r}, backward={backward!r}, backward_input={backward_input!r}, "
                f"backward_weight={backward_weight!r}); when only one of backward_input / "
                "backward_weight is given the other is backward minus it"
            )
    return costs


def simulate(schedule, forward: float = 1.0, backward: float = 2.0, comm: float = 0.0, *,
             backward_input: float | None = None, backward_weight: float | None = None,
             recompute: float = 0.0) -> Timeline:
    """Simulate ``schedule`` (validated first) and return its ``Timeline``.

    Each rank runs its list in order; an action starts at max(rank free, every dependency's end,
    plus ``comm`` when the dependency ran on another rank) (see [Note: dependencies] in
    ``fxsplit.schedule.validate``). ``None`` entries take no time. ``backward_input`` /
    ``backward_weight`` price I and W actions; by default each is half of ``backward``.
    ``recompute`` is activation checkpointing's forward recomputation (per microbatch of a rank's
    share): a backward that starts from the saved activations pays it first, so it is added to
    B, and to both I and W (two autograd calls, each recomputes: torch.utils.checkpoint keeps
    recomputed values per call).
    """
    if not comm >= 0:
        raise ValueError(f"simulate: comm must be >= 0, got {comm!r}")
    rows = parse_schedule(schedule)
    info = validate(rows)
    cost = _costs(forward, backward, backward_input, backward_weight)
    if not recompute >= 0:
        raise ValueError(f"simulate: recompute must be >= 0, got {recompute!r}")
    cost[ActionKind.BACKWARD] += recompute
    cost[ActionKind.BACKWARD_INPUT] += recompute
    cost[ActionKind.BACKWARD_WEIGHT] += recompute
    p = info.num_ranks
    v = [len(info.stages_of(r)) for r in range(p)]
    events = _run(rows, info, lambda r, a: cost[a.kind] / v[r], comm)
    free = [0.0] * p
    first: list[float | None] = [None] * p
    for e in events:
        free[e.rank] = max(free[e.rank], e.end)
        first[e.rank] = e.start if first[e.rank] is None else min(first[e.rank], e.start)
    makespan = max(free, default=0.0)
    busy = tuple(sum(e.end - e.start for e in events if e.rank == r) for r in range(p))
    idle_active = tuple(
        (free[r] - first[r] - busy[r]) if first[r] is not None else 0.0 for r in range(p)
    )
    return Timeline(
        events=tuple(events),
        num_ranks=p,
        num_stages=info.num_stages,
        num_microbatches=info.num_microbatches,
        stages_per_rank=tuple(v),
        costs=tuple((k.value, c) for k, c in cost.items()
                    if any(a is not None and a.kind is k for row in rows for a in row)),
        comm=comm,
        makespan=makespan,
        busy=busy,
        idle_active=idle_active,
        peak_inflight=_peak_inflight(rows, v),
    )


def _run(rows, info, cost_of, comm: float) -> list[Event]:
    """Execute the validated ``rows``; ``cost_of(rank, action)`` gives each action's duration."""
    present = {a for row in rows for a in row if a is not None}
    n_s, rank_of = info.num_stages, info.stage_ranks
    needs = {a: tuple(d for d in dependencies(a, n_s) if d in present) for a in present}
    end: dict[Action, float] = {}
    free = [0.0] * len(rows)
    heads = [0] * len(rows)
    events: list[Event] = []
    remaining = len(present)
    while remaining:
        progressed = False
        for r, row in enumerate(rows):
            while heads[r] < len(row):
                a = row[heads[r]]
                if a is None:
                    heads[r] += 1
                    continue
                deps = needs[a]
                if any(d not in end for d in deps):
                    break
                ready = max((end[d] + (comm if rank_of[d.stage] != r else 0.0) for d in deps), default=0.0)
                start = max(free[r], ready)
                free[r] = end[a] = start + cost_of(r, a)
                events.append(Event(r, a, start, free[r]))
                heads[r] += 1
                remaining -= 1
                progressed = True
        assert progressed, "validate() accepted a schedule that deadlocks in simulate()"
    events.sort(key=lambda e: (e.start, e.rank))
    return events


def _peak_inflight(rows, v: list[int]) -> tuple[float, ...]:
    peaks = []
    for r, row in enumerate(rows):
        held = peak = 0
        for a in row:
            if a is None:
                continue
            if a.kind is ActionKind.FORWARD:
                held += 1
                peak = max(peak, held)
            elif a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
                held -= 1
        peaks.append(peak / v[r] if v[r] else 0.0)
    return tuple(peaks)


def align_steps(schedule) -> list[list[Action | None]]:
    """Return ``schedule`` with ``None`` idle steps inserted so that every action sits at the step
    it would start at if every action took one step (a time-aligned picture; same order per rank).
    """
    rows = [[a for a in row if a is not None] for row in parse_schedule(schedule)]
    info = validate(rows)
    out: list[list[Action | None]] = [[] for _ in rows]
    for e in _run(rows, info, lambda r, a: 1.0, 0.0):
        out[e.rank] += [None] * (int(e.start) - len(out[e.rank]))
        out[e.rank].append(e.action)
    return out
