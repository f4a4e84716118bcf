"""Schedule validation: completeness, ordering and a deadlock check, before any process exists.

Terms (see ``fxsplit.schedule.ir`` and DESIGN.md): p ranks, S stages, M microbatches; an action
``sKm`` is kind K of microbatch m on stage s; a stage lives on exactly one rank.

Representative use::

    info = validate(schedule)                 # raises ScheduleError, or returns a ScheduleInfo
    info.num_stages, info.stage_ranks         # (4, (0, 1, 0, 1))

[Note: dependencies] The data dependencies of every action, shared by ``validate`` and
``simulate``:
    sFm  needs (s-1)Fm                       activation from the previous stage (none for s = 0)
    sBm  needs sFm, and (s+1)Bm or (s+1)Im   stored activations, and the gradient from the next
    sIm  same as sBm                         stage (none for the last stage: its loss is local)
    sWm  needs sIm                           weight gradient after the input gradient
A rank executes its list in order; ``None`` entries are idle steps that wait for nothing. An action
blocks until each dependency has been executed; if no rank can progress, the schedule deadlocks
(point-to-point sends and receives would wait for each other forever).
"""

from __future__ import annotations

from dataclasses import dataclass

from fxsplit.schedule.ir import Action, ActionKind, format_marked_grid, parse_schedule

from fxsplit.errors import ScheduleError

__all__ = ["ScheduleError", "ScheduleInfo", "validate", "dependencies"]

F = ActionKind.FORWARD
B = ActionKind.BACKWARD
BI = ActionKind.BACKWARD_INPUT
BW = ActionKind.BACKWARD_WEIGHT


@dataclass(frozen=True)
class ScheduleInfo:
    """What ``validate`` learned about a valid schedule.

    ``stage_ranks[s]`` is the rank that runs stage s; ``split_backward`` is True when the
    backward is given as I and W actions instead of B.
    """

    num_ranks: int
    num_stages: int
    num_microbatches: int
    stage_ranks: tuple[int, ...]
    split_backward: bool

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """Stages held by ``rank``, in increasing order."""
        return tuple(s for s, r in enumerate(self.stage_ranks) if r == rank)


def dependencies(action: Action, num_stages: int) -> tuple[Action, ...]:
    """Actions that must have run before ``action`` (see [Note: dependencies]).

    For a backward that needs the next stage's gradient, both ``(s+1)B`` and ``(s+1)I`` are
    returned; exactly one of them exists in a valid schedule, and the caller picks that one.
    """
    s, k, m = action.stage, action.kind, action.microbatch
    if k is F:
        return () if s == 0 else (Action(s - 1, F, m),)
    if k is BW:
        return (Action(s, BI, m),)
    local = (Action(s, F, m),)
    if s == num_stages - 1:
        return local
    return local + (Action(s + 1, B, m), Action(s + 1, BI, m))


def _fail(rows, rule: str, detail: str, marks=()) -> ScheduleError:
    return ScheduleError(f"{rule}: {detail}\n{format_marked_grid(rows, marks)}")


def validate(schedule, num_stages: int | None = None, num_microbatches: int | None = None) -> ScheduleInfo:
    """Check ``schedule`` and return a ``ScheduleInfo``; raise ``ScheduleError`` naming the rule.

    ``schedule`` is a ``Schedule``, per-rank lists of action strings, or the string form.
    ``num_stages`` / ``num_microbatches`` default to one more than the largest used.
    Rules, in the order checked:
      1. every stage runs on one rank only;
      2. every (stage, microbatch) has exactly one F, and exactly one B or exactly one I and one W
         (not both kinds of backward); no stage or microbatch outside the given ranges;
      3. on one rank, an action comes after its dependencies held by the same rank
         (F before its B/I, I before W, F of stage s before F of s+1, B of s+1 before B of s);
      4. executing the ranks' lists in order cannot deadlock (see [Note: dependencies]).
    """
    rows = parse_schedule(schedule)
    where, stage_rank = _placed(rows)
    used_s = max((a.stage for a in where), default=-1) + 1
    used_m = max((a.microbatch for a in where), default=-1) + 1
    n_s = used_s if num_stages is None else num_stages
    n_m = used_m if num_microbatches is None else num_microbatches
    _check_ranges(rows, where, stage_rank, n_s, n_m)
    split = _check_complete(rows, where, stage_rank, n_s, n_m)
    deps = _check_rank_order(rows, where, n_s)
    _check_deadlock(rows, where, deps)
    p = len(rows)
    return ScheduleInfo(p, n_s, n_m, tuple(stage_rank[s][0] for s in range(n_s)), split)


def _placed(rows) -> tuple[dict[Action, tuple[int, int]], dict[int, tuple[int, int]]]:
    """Rule 1 and the "once" of rule 2: ``(where, stage_rank)``, the (rank, step) of every action
    and the first (rank, step) of every stage."""
    where: dict[Action, tuple[int, int]] = {}
    stage_rank: dict[int, tuple[int, int]] = {}
    for r, row in enumerate(rows):
        for t, a in enumerate(row):
            if a is None:
                continue
            if a in where:
                r0, t0 = where[a]
                raise _fail(rows, "duplicate action", f"{a} appears at rank {r0} step {t0} and again at "
                            f"rank {r} step {t}; each action must run exactly once", [(r0, t0), (r, t)])
            where[a] = (r, t)
            if a.stage in stage_rank and stage_rank[a.stage][0] != r:
                r0, t0 = stage_rank[a.stage]
                raise _fail(rows, "stage on two ranks", f"stage {a.stage} has actions on rank {r0} "
                            f"(step {t0}) and on rank {r} ({a} at step {t}); a stage lives on one rank",
                            [(r0, t0), (r, t)])
            stage_rank.setdefault(a.stage, (r, t))
    return where, stage_rank


def _check_ranges(rows, where, stage_rank, n_s: int, n_m: int) -> None:
    """Rule 2's ranges: every action inside (num_stages, num_microbatches), every stage present."""
    for a, (r, t) in where.items():
        if a.stage >= n_s or a.microbatch >= n_m:
            raise _fail(rows, "out of range", f"{a} at rank {r} step {t} is outside num_stages={n_s}, "
                        f"num_microbatches={n_m} (stages 0..{n_s - 1}, microbatches 0..{n_m - 1})", [(r, t)])
    if n_s == 0 or n_m == 0:
        raise _fail(rows, "empty schedule", f"num_stages={n_s}, num_microbatches={n_m}; a schedule needs "
                    "at least one stage and one microbatch")
    for s in range(n_s):
        if s not in stage_rank:
            raise _fail(rows, "missing stage", f"stage {s} has no actions (num_stages={n_s}); every stage "
                        "needs a forward and a backward for every microbatch")


def _check_complete(rows, where, stage_rank, n_s: int, n_m: int) -> bool:
    """Rule 2: one F and one backward (B, or I and W) per (stage, microbatch). Returns whether
    the backward is split."""
    split = False
    for s in range(n_s):
        for m in range(n_m):
            fwd, full = Action(s, F, m), Action(s, B, m)
            inp, wgt = Action(s, BI, m), Action(s, BW, m)
            if fwd not in where:
                raise _fail(rows, "missing forward", f"{fwd} is not in the schedule (stage {s} runs on rank "
                            f"{stage_rank[s][0]})")
            has_b, has_i, has_w = full in where, inp in where, wgt in where
            if has_b and (has_i or has_w):
                other = inp if has_i else wgt
                raise _fail(rows, "mixed backward", f"{full} and {other} both appear; use either B or the "
                            "split pair I and W for one (stage, microbatch)", [where[full], where[other]])
            if not has_b and not (has_i and has_w):
                if has_i or has_w:
                    have, lack = (inp, wgt) if has_i else (wgt, inp)
                    raise _fail(rows, "missing backward", f"{have} appears without {lack}; a split "
                                "backward needs both I and W", [where[have]])
                raise _fail(rows, "missing backward", f"no backward for stage {s} microbatch {m}: expected "
                            f"{full} (or {inp} and {wgt}) on rank {stage_rank[s][0]}", [where[fwd]])
            split = split or has_i
    return split


def _check_rank_order(rows, where, n_s: int) -> dict[Action, tuple[Action, ...]]:
    """Rule 3: dependencies held by the same rank come earlier in that rank's list. Returns every
    action's dependencies that are in the schedule."""
    deps = {a: tuple(d for d in dependencies(a, n_s) if d in where) for a in where}
    for a, (r, t) in where.items():
        for d in deps[a]:
            if where[d][0] == r and where[d][1] > t:
                raise _fail(rows, _order_rule(a, d), f"{a} at rank {r} step {t} runs before {d} "
                            f"(step {where[d][1]}) on the same rank", [(r, t), where[d]])
    return deps


def _order_rule(a: Action, d: Action) -> str:
    if a.kind is F:
        return "forward order (F of stage s before F of stage s+1)"
    if a.kind is BW:
        return "split backward order (I before W)"
    if d.kind is F:
        return "forward before backward"
    return "backward order (B of stage s+1 before B of stage s)"


def _check_deadlock(rows, where: dict[Action, tuple[int, int]],
                    deps: dict[Action, tuple[Action, ...]]) -> None:
    """Run the lists in order; raise ``ScheduleError`` when no rank can progress."""
    done: set[Action] = set()
    heads = [0] * len(rows)

    def missing(a: Action) -> Action | None:
        for d in deps[a]:
            if d not in done:
                return d
        return None

    progress = True
    while progress:
        progress = False
        for r, row in enumerate(rows):
            while heads[r] < len(row):
                a = row[heads[r]]
                if a is not None and missing(a) is not None:
                    break
                if a is not None:
                    done.add(a)
                heads[r] += 1
                progress = True
    blocked = [r for r, row in enumerate(rows) if heads[r] < len(row)]
    if not blocked:
        return
    lines = []
    for r in blocked:
        a = rows[r][heads[r]]
        d = missing(a)
        dr, dt = where[d]
        what = "activation" if a.kind is F else ("gradient" if d.kind in (B, BI) else "input")
        lines.append(f"rank {r} step {heads[r]}: {a} waits for the {what} from {d} (rank {dr} step {dt}, "
                     f"not reached: rank {dr} is blocked at step {heads[dr]})")
    raise _fail(rows, "deadlock", "no rank can progress; each blocked rank waits for an action queued "
                "behind another blocked action:\n  " + "\n  ".join(lines)
                + "\nFix: move an awaited action before the blocked action of its rank, or that blocked "
                "action later",
                [(r, heads[r]) for r in blocked])
