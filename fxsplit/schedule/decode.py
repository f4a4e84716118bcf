"""Decode schedules as data: generation's forward-only program, prefill then one-token steps, with
the steps of one microbatch overlapping those of the others.

Terms
- **m'**: the microbatches a generate call splits the batch into; **steps**: the forwards each
  microbatch runs (the prefill, then one per further token).
- **virtual microbatch** ``j = k * m' + i``: step k of microbatch i; action ``sFj`` is its
  forward on stage s, so a decode schedule prints and parses like any other.
- **token dependency**: ``0Fj`` needs the token that ``(S-1)F(j - m')`` chose (S stages): step k + 1
  of a microbatch starts once its step k has left the last stage.

Representative use::

    rows = decode(stage_ranks=(0, 1), microbatches=2, steps=3)   # overlapped
    validate_decode(rows, num_stages=2, microbatches=2)
    idle_fraction(rows), idle_fraction(decode((0, 1), 2, 3, overlap=False))

[Note: decode schedules]
Built by list scheduling in unit time: at each tick every rank runs, of its actions whose
dependencies ran at earlier ticks, the one of the smallest (virtual microbatch, stage); a rank with
none is idle (None). The dependencies are the forward's (``sFj`` after ``(s-1)Fj``) and the token's;
``overlap=False`` adds the barrier of ``generate(overlap_steps=False)`` (no step k + 1 before every
microbatch's step k has ended), for comparison. With m' >= the number of stages the overlapped program keeps
every rank busy after the first p ticks, while the stepwise one idles (p - 1) / (m' + p - 1) of
every step; with m' = 1 nothing can overlap (each token waits for the whole pipeline). The program
is what ``ParallelModel.generate`` runs with its KV cache ([Note: overlapped steps] in
fxsplit.api.generate): one forward of ``m' * steps`` microbatches, the activations lowered like any
forward by ``fxsplit.pipeline.comm``, the token one more message from the last stage's rank to the
first's.
"""

from __future__ import annotations

from collections.abc import Sequence

from fxsplit.schedule.ir import Action, ActionKind, Schedule, format_marked_grid, parse_schedule
from fxsplit.schedule.validate import ScheduleError

__all__ = ["decode", "decode_dependencies", "idle_fraction", "validate_decode"]

F = ActionKind.FORWARD


def decode_dependencies(action: Action, num_stages: int, microbatches: int) -> tuple[Action, ...]:
    """What ``action`` (a forward of a virtual microbatch) waits for ([Note: decode schedules])."""
    s, j = action.stage, action.microbatch
    if s > 0:
        return (Action(s - 1, F, j),)
    return (Action(num_stages - 1, F, j - microbatches),) if j >= microbatches else ()


def decode(stage_ranks: Sequence[int], microbatches: int, steps: int, *, overlap: bool = True) -> Schedule:
    """The decode program for stages placed by ``stage_ranks`` (stage s on rank ``stage_ranks[s]``),
    ``microbatches`` m' and ``steps`` forwards per microbatch, one row per rank, None where idle."""
    for name, value in (("microbatches", microbatches), ("steps", steps), ("stages", len(stage_ranks))):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"decode(): {name}={value!r} must be an int >= 1")
    n_s, n_j, p = len(stage_ranks), microbatches * steps, max(stage_ranks) + 1
    todo = [sorted((j, s) for j in range(n_j) for s in range(n_s) if stage_ranks[s] == r) for r in range(p)]
    done: set[tuple[int, int]] = set()
    rows: Schedule = [[] for _ in range(p)]
    step_left = [microbatches * n_s] * steps  # actions of each step not yet run (the barrier)

    def ready(j: int, s: int) -> bool:
        deps = decode_dependencies(Action(s, F, j), n_s, microbatches)
        k = j // microbatches
        return all((d.microbatch, d.stage) in done for d in deps) and (overlap or k == 0 or step_left[k - 1] == 0)

    while any(todo):
        ran = []
        for r in range(p):
            pick = next(((j, s) for j, s in todo[r] if ready(j, s)), None)
            rows[r].append(None if pick is None else Action(pick[1], F, pick[0]))
            if pick is not None:
                todo[r].remove(pick)
                ran.append(pick)
        if not ran:  # cannot happen for these dependencies; kept as a guard, not a hang
            raise ScheduleError(f"decode(): no action is ready with {sum(map(len, todo))} left")
        done.update(ran)
        for j, _ in ran:
            step_left[j // microbatches] -= 1
    return rows


def validate_decode(schedule, *, num_stages: int, microbatches: int) -> None:
    """Check a decode program: every stage on one rank, each ``sFj`` once for every stage and every
    virtual microbatch below the largest, only forwards, and the ranks' lists in order never block
    on a dependency ([Note: decode schedules]); raise ``ScheduleError`` with the grid otherwise."""
    rows = parse_schedule(schedule)
    where: dict[Action, tuple[int, int]] = {}
    for r, row in enumerate(rows):
        for t, a in enumerate(row):
            if a is None:
                continue
            if a.kind is not F or a in where or a.stage >= num_stages:
                why = ("only forwards run in a decode program" if a.kind is not F else
                       f"it appears twice (also at rank {where[a][0]} step {where[a][1]})" if a in where else
                       f"there are {num_stages} stages")
                raise ScheduleError(f"decode schedule: {a} at rank {r} step {t}: {why}\n"
                                    f"{format_marked_grid(rows, [(r, t)])}")
            where[a] = (r, t)
    n_j = max((a.microbatch for a in where), default=-1) + 1
    for s in range(num_stages):
        ranks = {where[a][0] for a in where if a.stage == s}
        missing = [j for j in range(n_j) if Action(s, F, j) not in where]
        if len(ranks) != 1 or missing:
            raise ScheduleError(f"decode schedule: stage {s} runs on ranks {sorted(ranks)} and misses virtual "
                                f"microbatches {missing}; a stage lives on one rank and runs every one\n"
                                f"{format_marked_grid(rows)}")
    _check_progress(rows, where, num_stages, microbatches)


def _check_progress(rows, where, num_stages: int, microbatches: int) -> None:
    done: set[Action] = set()
    heads = [0] * len(rows)
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(rows):
            while heads[r] < len(row) and (row[heads[r]] is None or all(
                    d in done for d in decode_dependencies(row[heads[r]], num_stages, microbatches))):
                if row[heads[r]] is not None:
                    done.add(row[heads[r]])
                heads[r] += 1
                progress = True
    blocked = [(r, heads[r]) for r, row in enumerate(rows) if heads[r] < len(row)]
    if blocked:
        lines = [f"rank {r} step {t}: {rows[r][t]} waits for "
                 f"{[str(d) for d in decode_dependencies(rows[r][t], num_stages, microbatches) if d not in done]}"
                 for r, t in blocked]
        raise ScheduleError("decode schedule: deadlock (the token of step k comes from the last stage):\n  "
                            + "\n  ".join(lines) + "\n" + format_marked_grid(rows, blocked))


def idle_fraction(schedule) -> float:
    """Idle ticks over all ticks of a unit-time program (the first meaning of bubble in DESIGN.md)."""
    rows = parse_schedule(schedule)
    width = max(len(row) for row in rows)
    busy = sum(a is not None for row in rows for a in row)
    return 1.0 - busy / (width * len(rows))
