"""Schedule simulator: start and end of every action under a simple cost model, bubbles, memory.

Terms (see DESIGN.md): p ranks, m microbatches, v_r = number of stages rank r holds. Each cost
(``forward``, ``backward``, ``backward_input``, ``backward_weight``, ``comm``) is either
- a number: per microbatch for ONE RANK'S WHOLE SHARE of the model; an action on one of the v_r
  stages of rank r costs 1/v_r of it (``comm`` is per message, not divided); or
- a sequence with one value per stage: that stage's own cost per microbatch ([Note: per-stage
  costs]); numbers and sequences mix (a number then is a rank share, divided as above).
``comm`` is a point-to-point latency between a producer's end and a consumer's earliest start when
they run on different ranks; per stage, ``comm[s]`` is the latency of every message stage s sends
(its activations forward, its input gradients back).

Representative use::

    t = simulate(build("1f1b", 4, 8), forward=1.0, backward=2.0)
    t.makespan          # 33.0 == (m + p - 1) * (F + B)
    t.bubble_ratio      # 0.375 == (p - 1) / m
    t.peak_inflight     # (4.0, 3.0, 2.0, 1.0)

[Note: per-stage costs] Stages are rarely equal (the embedding and the loss make the first and
the last heavier), and zero-bubble schedules are sensitive to it: a W is only free where it fills
a bubble of its own rank. ``fxsplit.Plan.simulate`` therefore passes the split's per-stage F, I,
W and comm estimates, and ``zb_auto`` builds its order from the same numbers. Internally every
cost becomes one table ``stage -> kind -> seconds`` (``Timeline.stage_costs``); a B costs I + W of
its stage when only I and W are given per stage, and I / W default to half of B each.

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

from collections.abc import Sequence
from dataclasses import dataclass

from fxsplit.errors import ScheduleError
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
    costs: tuple[tuple[str, float], ...]  # (kind letter, cost per microbatch of a rank's share); () if per stage
    comm: float  # the one latency, or the largest per-stage one
    makespan: float
    busy: tuple[float, ...]
    idle_active: tuple[float, ...]
    peak_inflight: tuple[float, ...]
    stage_costs: tuple[tuple[tuple[str, float], ...], ...] = ()  # per stage: (kind letter, seconds)
    stage_comm: tuple[float, ...] = ()  # per stage: latency of a message it sends

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
        costs = ", ".join(f"{k}={c:g}" for k, c in self.costs) if self.costs else "per-stage costs"
        peaks = ", ".join(f"{x:.3g}" for x in self.peak_inflight)
        return (
            f"Timeline: {self.num_ranks} ranks, {self.num_stages} stages, {self.num_microbatches} "
            f"microbatches ({costs}, comm={self.comm:g})\n"
            f"  makespan {self.makespan:g}; bubble_fraction {self.bubble_fraction:.4f} (idle share of "
            f"p x makespan), bubble_ratio {self.bubble_ratio:.4f} (idle / ideal), bubble_active "
            f"{self.bubble_active:.4f} (idle inside active windows)\n"
            f"  peak in-flight microbatches per rank: [{peaks}]"
        )


Cost = float | Sequence[float]
"""A number (a rank's whole share, split over its stages) or one value per stage."""


def _per_stage(name: str, value, n_s: int, v_of_stage: Sequence[int], divide: bool) -> list[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [float(value) / (v_of_stage[s] if divide else 1) for s in range(n_s)]
    try:
        out = [float(x) for x in value]
    except TypeError:
        raise ScheduleError(f"simulate: {name} must be a number or one number per stage, got {value!r}") from None
    if len(out) != n_s:
        raise ScheduleError(f"simulate: {name} has {len(out)} values for {n_s} stages; give one per stage (or a number)")
    return out


def _stage_costs(n_s: int, v_of_stage: Sequence[int], forward, backward, backward_input,
                 backward_weight) -> list[dict[ActionKind, float]]:
    """``stage -> kind -> seconds`` per [Note: per-stage costs]."""
    fw = _per_stage("forward", forward, n_s, v_of_stage, True)
    bi = None if backward_input is None else _per_stage("backward_input", backward_input, n_s, v_of_stage, True)
    bw = None if backward_weight is None else _per_stage("backward_weight", backward_weight, n_s, v_of_stage, True)
    if backward is None:
        if bi is None or bw is None:
            raise ScheduleError("simulate: with backward=None give both backward_input and backward_weight")
        bb = [i + w for i, w in zip(bi, bw)]
    else:
        bb = _per_stage("backward", backward, n_s, v_of_stage, True)
    if bi is None and bw is None:
        bi = [b / 2 for b in bb]
        bw = list(bi)
    elif bi is None:
        bi = [b - w for b, w in zip(bb, bw)]
    elif bw is None:
        bw = [b - i for b, i in zip(bb, bi)]
    table = []
    for s in range(n_s):
        costs = {ActionKind.FORWARD: fw[s], ActionKind.BACKWARD: bb[s],
                 ActionKind.BACKWARD_INPUT: bi[s], ActionKind.BACKWARD_WEIGHT: bw[s]}
        for kind, value in costs.items():
            if not value >= 0:
                raise ScheduleError(
                    f"simulate: the cost of {kind.name} ({kind.value}) must be >= 0, got {value!r} "
                    f"(stage {s}; forward={forward!r}, backward={backward!r}, backward_input={backward_input!r}, "
                    f"backward_weight={backward_weight!r}); when only one of backward_input / "
                    "backward_weight is given the other is backward minus it"
                )
        table.append(costs)
    return table


def simulate(schedule, forward: Cost = 1.0, backward: Cost | None = 2.0, comm: Cost = 0.0, *,
             backward_input: Cost | None = None, backward_weight: Cost | None = None) -> Timeline:
    """Simulate ``schedule`` (validated first) and return its ``Timeline``.

    Each rank runs its list in order; an action starts at max(rank free, every dependency's end,
    plus the dependency's ``comm`` when it ran on another rank) (see [Note: dependencies] in
    ``fxsplit.schedule.validate``). ``None`` entries take no time. ``backward_input`` /
    ``backward_weight`` price I and W actions; by default each is half of ``backward``. Every
    cost is a number (a rank's share) or one value per stage ([Note: per-stage costs]).
    """
    rows = parse_schedule(schedule)
    info = validate(rows)
    p, n_s = info.num_ranks, info.num_stages
    v = [len(info.stages_of(r)) for r in range(p)]
    v_of_stage = [v[info.stage_ranks[st]] for st in range(n_s)]
    links = _per_stage("comm", comm, n_s, v_of_stage, False)
    if not all(c >= 0 for c in links):
        raise ScheduleError(f"simulate: comm must be >= 0, got {comm!r}")
    table = _stage_costs(n_s, v_of_stage, forward, backward, backward_input, backward_weight)
    events = _run(rows, info, lambda r, a: table[a.stage][a.kind], links.__getitem__)
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
    used = [k for k in ActionKind if any(a is not None and a.kind is k for row in rows for a in row)]
    scalar = all(isinstance(x, (int, float)) or x is None for x in (forward, backward, backward_input, backward_weight))
    rank_share = _stage_costs(1, [1], forward, backward, backward_input, backward_weight)[0] if scalar else {}
    return Timeline(
        events=tuple(events),
        num_ranks=p,
        num_stages=n_s,
        num_microbatches=info.num_microbatches,
        stages_per_rank=tuple(v),
        costs=tuple((k.value, rank_share[k]) for k in used) if scalar else (),
        comm=float(comm) if isinstance(comm, (int, float)) else max(links, default=0.0),
        makespan=makespan,
        busy=busy,
        idle_active=idle_active,
        peak_inflight=_peak_inflight(rows, v),
        stage_costs=tuple(tuple((k.value, table[st][k]) for k in used) for st in range(n_s)),
        stage_comm=tuple(links),
    )


def _run(rows, info, cost_of, comm_of) -> list[Event]:
    """Execute the validated ``rows``; ``cost_of(rank, action)`` gives each action's duration,
    ``comm_of(stage)`` the latency of a message that stage sends to another rank."""
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
                ready = max((end[d] + (comm_of(d.stage) if rank_of[d.stage] != r else 0.0) for d in deps),
                            default=0.0)
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
    for e in _run(rows, info, lambda r, a: 1.0, lambda s: 0.0):
        out[e.rank] += [None] * (int(e.start) - len(out[e.rank]))
        out[e.rank].append(e.action)
    return out
