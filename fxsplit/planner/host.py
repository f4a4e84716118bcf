"""Ranks sharing one host's cores: a schedule's makespan under processor sharing.

Terms as in :mod:`fxsplit.planner.score`; ``cores`` is what the ranks get of the host's cores
between them (``Calibration.host_cores``), ``copies`` the processes that run each pipeline rank's
actions at the same time (its dp replicas and tp ranks: dp x tp).

    t = shared_makespan(build("1f1b", 4, 8), F, I, W, comm, cores=1.7, copies=1)

[Note: host sharing]
On a CPU host (gloo ranks) every rank is a process, and the OS shares the cores among the
processes that are computing: n busy processes on c cores each run at min(1, c / n) of their
speed alone (processor sharing). A pipeline's bubble is then neither free (as it would be if
the total work over the cores were the step time) nor all lost (as it is on devices of their
own): while some ranks wait, the others run faster, and capacity goes unused only while fewer
processes are busy than there are cores (a 1F1B fill and drain with one rank busy on 1.7
cores). So the schedule is simulated as ``fxsplit.schedule.simulate`` runs it (each rank its
list in order; an action starts when its dependencies have ended, plus the message latency
when one ran on another rank), but every busy action advances at the shared rate: an event
simulation over action ends and message arrivals. A message in flight waits (it takes no
core). The two limits are exact: with every process busy all the time the makespan is the
total work over the cores; with at least as many cores as busy processes, the plain
simulation's makespan.
"""

from __future__ import annotations

import math
from typing import Sequence

from fxsplit.errors import UsageError
from fxsplit.schedule import ActionKind, dependencies, parse_schedule, validate

__all__ = ["shared_makespan", "shared_rate"]


def shared_rate(busy: float, cores: float) -> float:
    """Speed of each of ``busy`` processes on ``cores`` cores, relative to running alone."""
    return 1.0 if busy <= cores else cores / busy


def shared_makespan(schedule, forward: Sequence[float], backward_input: Sequence[float],
                    backward_weight: Sequence[float], comm: Sequence[float], *, cores: float,
                    copies: int = 1) -> float:
    """Makespan of ``schedule`` (per-rank action lists, validated) with per-stage costs
    (seconds alone; a B costs I + W) when every pipeline rank is ``copies`` processes and all of
    them share ``cores`` cores ([Note: host sharing]); ``comm[s]`` is the latency of a message
    stage s sends to another rank."""
    if not cores > 0:
        raise UsageError(f"shared_makespan: cores must be > 0, got {cores!r}")
    rows = parse_schedule(schedule)
    info = validate(rows)
    n_s, rank_of = info.num_stages, info.stage_ranks
    rows = [[a for a in row if a is not None] for row in rows]
    present = {a for row in rows for a in row}
    needs = {a: tuple(d for d in dependencies(a, n_s) if d in present) for a in present}
    cost = {ActionKind.FORWARD: forward, ActionKind.BACKWARD_INPUT: backward_input,
            ActionKind.BACKWARD_WEIGHT: backward_weight}
    p = len(rows)
    head = [0] * p
    left: list[float | None] = [None] * p  # remaining seconds (alone) of the rank's running action
    size = [0.0] * p
    end: dict = {}
    t, remaining = 0.0, len(present)
    while remaining:
        arrival = math.inf
        for r in range(p):
            if left[r] is not None or head[r] >= len(rows[r]):
                continue
            a = rows[r][head[r]]
            if any(d not in end for d in needs[a]):
                continue
            ready = max((end[d] + (comm[d.stage] if rank_of[d.stage] != r else 0.0) for d in needs[a]), default=0.0)
            if ready > t:
                arrival = min(arrival, ready)
                continue
            c = (backward_input[a.stage] + backward_weight[a.stage] if a.kind is ActionKind.BACKWARD
                 else cost[a.kind][a.stage])
            left[r], size[r] = float(c), float(c)
            head[r] += 1
        busy = [r for r in range(p) if left[r] is not None]
        if not busy:
            assert math.isfinite(arrival), "validate() accepted a schedule that deadlocks"
            t = arrival
            continue
        rate = shared_rate(copies * len(busy), cores)
        step = min(min(left[r] for r in busy) / rate, arrival - t)
        t += step
        for r in busy:
            left[r] -= step * rate
            if left[r] <= 1e-12 * size[r]:
                end[rows[r][head[r] - 1]] = t
                left[r] = None
                remaining -= 1
    return t
