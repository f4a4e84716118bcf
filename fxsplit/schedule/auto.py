"""``zb_auto``'s search: a zero-bubble order from per-stage F, I, W and comm times and a memory limit.

``fxsplit.schedule.zb_auto`` (in ``builders``, which holds the registry) checks the sizes and
calls ``search`` here with ZB-H1 and 1F1B as baselines.

Terms (``fxsplit.schedule.ir``, ``fxsplit.schedule.simulate``): p ranks, one stage per rank (stage
r on rank r), m microbatches; F, I, W the forward, input-gradient and weight-gradient costs of each
stage per microbatch; ``comm[s]`` the latency of a message stage s sends; **in flight** on a rank:
microbatches whose F has run and whose W has not (their activations are held), the memory
measure of ``Timeline.peak_inflight``.

    s = zb_auto(4, 8, forward=[1.2, 1, 1, 1.4], backward_input=[1, 1, 1, 1.5],
                backward_weight=[1, .8, .8, .6], comm=0.05, max_inflight=4)   # ZB-1p's memory
    s = zb_auto(4, 8, max_inflight=8)                                          # ZB-2p's

[Note: zb_auto heuristic] Qi et al.'s automatic schedules (ZB-1p / ZB-2p, arXiv 2401.10241,
section 3) come from an ILP, or a greedy heuristic, on profiled F, I, W and comm times under a
per-rank memory limit. This is a greedy list scheduler in that spirit, run as an event
simulation over all ranks with the given costs. Whenever a rank is free at time t it picks:
    1. its next I, if the gradient has arrived (I is the critical path: it unblocks the previous
       rank), unless the rank is still warming up and its next F is ready (``warmup`` variants);
    2. else its next F, if its input has arrived and fewer than ``max_inflight`` microbatches are in
       flight (1F1B-like: as many warm-up forwards as memory allows);
    3. else the oldest pending W, if memory is full (W frees it) or the rank would otherwise idle
       for at least ``alpha * W`` (W fills the bubble; a W is delayed while other work is ready);
    4. else it waits for the next arrival.
Actions of one rank run in microbatch order per kind, and every action is placed only after its
dependencies ran in the simulation, so the order is deadlock-free by construction (and
``validate`` checks it). The heuristic has knobs (``alpha`` in {0, 1}, warm-up priority on or
off, and the memory limits p and ``max_inflight``); every variant is simulated with the same
costs, together with ZB-H1 (when its peak of p in flight fits) and 1F1B with a split backward
(p - r in flight), and the shortest makespan wins (ties: the earlier candidate). ``zb_auto`` is
therefore never slower in the simulator than ZB-H1 on the same costs, nor than 1F1B, and a
``max_inflight`` above p is never slower than p itself (ZB-2p >= ZB-1p). It is a heuristic, not the paper's ILP: no claim
of optimality.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from fxsplit.errors import ScheduleError
from fxsplit.schedule.ir import Action, ActionKind, Schedule

__all__ = ["search", "split_backward"]

F = ActionKind.FORWARD
BI = ActionKind.BACKWARD_INPUT
BW = ActionKind.BACKWARD_WEIGHT


def _per_stage(name: str, value, p: int) -> tuple[float, ...]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        out = (float(value),) * p
    else:
        out = tuple(float(x) for x in value)
    if len(out) != p or not all(x >= 0 for x in out):
        raise ScheduleError(f"zb_auto: {name} must be a number >= 0 or {p} of them (one per stage), got {value!r}")
    return out


def search(num_ranks: int, num_microbatches: int, *, forward: float | Sequence[float] = 1.0,
           backward_input: float | Sequence[float] = 1.0, backward_weight: float | Sequence[float] = 1.0,
           comm: float | Sequence[float] = 0.0, max_inflight: int | Sequence[int] | None = None,
           baselines: Sequence[Schedule] = ()) -> Schedule:
    """The shortest of the greedy variants and ``baselines`` (hand-made orders, e.g. ZB-H1) for
    these per-stage costs, within the memory limit; see [Note: zb_auto heuristic]. The public
    entry is ``fxsplit.schedule.zb_auto``, which passes ZB-H1 and 1F1B as baselines."""
    from fxsplit.schedule.simulate import simulate

    p, m = num_ranks, num_microbatches
    cost = {F: _per_stage("forward", forward, p), BI: _per_stage("backward_input", backward_input, p),
            BW: _per_stage("backward_weight", backward_weight, p)}
    link = _per_stage("comm", comm, p)
    if max_inflight is None:
        max_inflight = p
    limits = (max_inflight,) * p if isinstance(max_inflight, int) else tuple(max_inflight)
    if len(limits) != p or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in limits):
        raise ScheduleError(f"zb_auto: max_inflight must be an int >= 1 or {p} of them (one per rank), got {max_inflight!r}")
    limits = tuple(min(x, m) for x in limits)

    candidates: list[Schedule] = []
    for lim in dict.fromkeys([limits, tuple(min(x, p) for x in limits)]):
        for warmup in (False, True):
            for alpha in (0.0, 1.0):
                candidates.append(_greedy(p, m, cost, link, lim, alpha, warmup))
    candidates += [split_backward(b) for b in baselines]
    best, best_span = None, None
    for cand in candidates:
        t = simulate(cand, forward=list(cost[F]), backward=None, backward_input=list(cost[BI]),
                     backward_weight=list(cost[BW]), comm=list(link))
        if any(peak > lim for peak, lim in zip(t.peak_inflight, limits)):
            continue  # a baseline that holds more than the limit
        if best_span is None or t.makespan < best_span:
            best, best_span = cand, t.makespan
    assert best is not None  # the greedy runs hold at most the limit
    return best


def split_backward(schedule: Schedule) -> Schedule:
    """``schedule`` with each B as I then W at once (the same order and memory, split backward)."""
    return [[b for a in row for b in ((Action(a.stage, BI, a.microbatch), Action(a.stage, BW, a.microbatch))
                                      if a.kind is ActionKind.BACKWARD else (a,))] for row in schedule]


def _greedy(p: int, m: int, cost, link, limits, alpha: float, warmup: bool) -> Schedule:
    """One run of the list scheduler of [Note: zb_auto heuristic]."""
    nf, ni = [0] * p, [0] * p
    pending: list[deque[int]] = [deque() for _ in range(p)]
    f_end: dict[tuple[int, int], float] = {}
    i_end: dict[tuple[int, int], float] = {}
    clock, started = [0.0] * p, [False] * p
    rows: list[list[Action | None]] = [[] for _ in range(p)]
    left = [3 * m] * p
    blocked: set[int] = set()  # ranks that wait for an action another rank has not placed yet
    while any(left):
        ready = [q for q in range(p) if left[q] and q not in blocked]
        if not ready:
            raise AssertionError(f"zb_auto: no rank can progress (blocked {sorted(blocked)})")  # pragma: no cover
        r = min(ready, key=lambda q: (clock[q], q))
        t = clock[r]

        def f_ready() -> float | None:  # arrival of the next forward's input, None if unknown
            if nf[r] >= m or len(pending[r]) + (nf[r] - ni[r]) >= limits[r]:
                return None
            if r == 0:
                return t
            end = f_end.get((r - 1, nf[r]))
            return None if end is None else end + link[r - 1]

        def i_ready() -> float | None:
            if ni[r] >= nf[r]:
                return None
            if r == p - 1:
                return f_end[(r, ni[r])]
            end = i_end.get((r + 1, ni[r]))
            return None if end is None else end + link[r + 1]

        tf, ti = f_ready(), i_ready()
        now_f, now_i = tf is not None and tf <= t, ti is not None and ti <= t
        inflight = len(pending[r]) + nf[r] - ni[r]
        kind = None
        if now_i and not (warmup and not started[r] and now_f):
            kind = BI
        elif now_f:
            kind = F
        elif now_i:
            kind = BI
        elif pending[r]:
            arrivals = [x for x in (tf, ti) if x is not None]
            gap = min(arrivals) - t if arrivals else float("inf")
            if inflight >= limits[r] or nf[r] >= m and ni[r] >= m or gap >= alpha * cost[BW][r] or not arrivals:
                kind = BW
        if kind is None:  # wait for the next arrival or for another rank to move
            later = [x for x in (tf, ti) if x is not None and x > t]
            if later:
                clock[r] = min(later)
            else:
                blocked.add(r)
            continue
        if kind is F:
            mb, start = nf[r], max(t, tf)
            nf[r] += 1
            f_end[(r, mb)] = start + cost[F][r]
        elif kind is BI:
            mb, start = ni[r], max(t, ti)
            ni[r] += 1
            started[r] = True
            pending[r].append(mb)
            i_end[(r, mb)] = start + cost[BI][r]
        else:
            mb, start = pending[r].popleft(), t
        rows[r].append(Action(r, kind, mb))
        clock[r] = start + cost[kind][r]
        left[r] -= 1
        blocked.clear()
    return rows
