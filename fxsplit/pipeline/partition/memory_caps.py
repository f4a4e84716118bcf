"""The memory-coupled partition search (``memory_limit`` with ``v > 1``) and the memory error.

Internal to :mod:`fxsplit.pipeline.partition` (the chain model it searches is ``chain``): ``solve``
calls `solve_coupled` when a rank holds several stages and memory is capped, and
``solve``/``brute_force`` raise `memory_error` when no partition fits. The cost model is [Note:
partition cost model] and the guarantees are "Guarantees of `solve`", both in the package
docstring, ``fxsplit/pipeline/partition/__init__.py``.

Terms
-----
(unit, position, stage, rank, ``v`` and bottleneck as in ``fxsplit.pipeline.partition``)

rank memory  the sum of the memories of a rank's stages (``r, r + p, ...`` or the schedule's placement); with ``v > 1`` it
             couples stages that are far apart in the chain, so the per-stage sweep of
             ``partition.forward`` cannot enforce it alone.
relaxation   the problem with each stage alone capped at ``memory_limit``: its optimum is a lower
             bound, and exact when its partition also fits every rank.
exact search `_dfs_decide`, a depth-first search over cut tuples bounded by ``exact_budget`` steps.
fallback     per-stage caps that sum to the limit on every rank: sound, not exact.

    cuts, exact = solve_coupled(chain)      # cuts None: no partition fits
    raise memory_error(chain, sound_only=not exact)
"""

from __future__ import annotations

import math
from dataclasses import replace

from fxsplit.errors import PartitionError
from fxsplit.pipeline.partition.chain import (
    INF,
    NEG,
    Chain,
    Partition,
    PartitionProblem,
    all_cuts,
    check_counts,
    evaluate_cuts,
    forward,
    min_bottleneck,
    reconstruct,
    search,
)

__all__ = ["solve_coupled", "memory_error"]

_RANK_SCAN_LIMIT = 16  # suggestions scan up to 4 * p + this many ranks ...
_RANK_SCAN_WORK = 2_000_000  # ... or this many (stage x unit) steps, about 2 s


# ----------------------------------------------------------------------------- the coupled search


class _Exhausted(Exception):
    pass


def _dfs_decide(ch: Chain, B: float, budget: list) -> tuple[int, ...] | None:
    """Exact decision for v > 1 with a rank memory cap: cuts with bottleneck <= B and every rank
    within the limit, the smallest last cut first (the tie rule), or None. Raises _Exhausted."""
    L, S, p = ch.pb.memory_limit, ch.S, ch.p
    caps = (L,) * S
    feasible, layers, _, _ = forward(ch, B, caps)  # per-stage relaxation prunes the search
    if not feasible:
        return None
    failed: set = set()
    cuts = [0] * (S + 1)
    cuts[S] = ch.n

    def go(s: int, b: int, mems: tuple) -> bool:
        # choose the start a of stage s, which ends at b; stages s+1.. are fixed in cuts
        key = (s, b, mems)
        if key in failed:
            return False
        prev, r, a0 = layers[s], ch.rank[s], ch.seg_start(b)
        budget[0] -= b - a0 + 1
        if budget[0] < 0:
            raise _Exhausted
        for a in range(a0, b):
            if prev[a] == NEG or ch.E[b] - ch.K[a] > B:
                continue
            x = ch.mem(s, a, b)
            if mems[r] + x > L:
                continue
            cuts[s] = a
            if s == 0:
                if evaluate_cuts(ch, cuts, "", True).fits_memory:
                    return True
                continue
            if go(s - 1, a, mems[:r] + (mems[r] + x,) + mems[r + 1:]):
                return True
        failed.add(key)
        return False

    return tuple(cuts) if go(S - 1, ch.n, (0.0,) * p) else None


def solve_coupled(ch: Chain) -> tuple[tuple[int, ...] | None, bool]:
    """v > 1 with a memory cap: (cuts or None, exact).

    1. Relaxation: each stage alone within the limit. Its optimum is a lower bound; when its
       partition also keeps every rank within the limit it is the exact answer (tie rule too).
    2. Exact search (`_dfs_decide`) over the sorted stage-time values, within exact_budget.
    3. Sound fallback: per-stage caps that sum to the limit on every rank (uniform ``L / v``,
       and caps proportional to the stage memories of the relaxed and of the best found
       partition); the best partition that fits is returned, not proven optimal.
    """
    L, S = ch.pb.memory_limit, ch.S
    relaxed = min_bottleneck(ch, (L,) * S)
    if relaxed is None:  # one stage alone is over the limit: no partition fits
        return None, True
    if evaluate_cuts(ch, relaxed, "", True).fits_memory:
        return relaxed, True
    pos = [k for k in range(ch.n + 1) if k == 0 or ch.ok[k]]
    if len(pos) <= 400:
        b0 = max(ch.time(a, b) for a, b in zip(relaxed, relaxed[1:]))
        values = sorted({ch.time(a, b) for i, a in enumerate(pos) for b in pos[i + 1:]
                         if ch.seg_start(b) <= a and ch.time(a, b) >= b0})
        budget = [ch.pb.exact_budget]
        try:
            best = _dfs_decide(ch, values[-1], budget)
            if best is None:
                return None, True
            lo, hi = 0, len(values) - 1  # values[hi] feasible; find the first feasible
            while lo < hi:
                mid = (lo + hi) // 2
                found = _dfs_decide(ch, values[mid], budget)
                if found is None:
                    lo = mid + 1
                else:
                    best, hi = found, mid
            return best, True
        except _Exhausted:
            pass
    return _fallback(ch, relaxed), False


def _fallback(ch: Chain, relaxed: tuple[int, ...]) -> tuple[int, ...] | None:
    """Sound heuristic for v > 1 with a memory cap (see `solve_coupled`)."""
    L, S, p = ch.pb.memory_limit, ch.S, ch.p
    best: Partition | None = None

    def attempt(caps: tuple[float, ...]) -> None:
        nonlocal best
        # a stage memory equal to its cap in exact arithmetic may round above it (L / v against a
        # sum of thirds): start a hair above; the rank check below is against L itself
        caps = tuple(c * (1 + 1e-12) for c in caps)
        for _ in range(4):  # within L up to the rounding of the per-rank sums: shrink and retry
            cuts = min_bottleneck(ch, caps)
            if cuts is None:
                return
            part = evaluate_cuts(ch, cuts, "", False)
            if part.fits_memory:
                if best is None or (part.bottleneck, cuts[::-1]) < (best.bottleneck, best.cuts[::-1]):
                    best = part
                return
            caps = tuple(c * (1 - 1e-12) for c in caps)

    def proportional(cuts: tuple[int, ...], weight: float) -> tuple[float, ...]:
        mem = [ch.mem(s, a, b) for s, (a, b) in enumerate(zip(cuts, cuts[1:]))]
        total = [sum(x for s, x in enumerate(mem) if ch.rank[s] == r) for r in range(p)]
        share = [m / total[ch.rank[s]] if total[ch.rank[s]] else 1 / ch.v for s, m in enumerate(mem)]
        return tuple(L * ((1 - weight) / ch.v + weight * x) for x in share)

    attempt((L / ch.v,) * S)
    attempt(proportional(relaxed, 1.0))
    attempt(proportional(relaxed, 0.5))
    if best is not None:
        attempt(proportional(best.cuts, 1.0))
    return None if best is None else best.cuts


# ----------------------------------------------------------------------------- the memory error


def _min_cap(ch: Chain) -> float:
    """The smallest single per-stage memory cap any partition meets (time ignored)."""

    def check(L: float):
        caps = (L,) * ch.S
        feasible, layers, _, next_l = forward(ch, INF, caps)
        if not feasible:
            return False, None, None, next_l
        cuts = reconstruct(ch, layers, INF, caps)
        return True, cuts, max(ch.mem(s, a, b) for s, (a, b) in enumerate(zip(cuts, cuts[1:]))), None

    top = (ch.state * ch.Q[-1] + max(ch.factor) * ch.A[-1]) * (1 + 1e-6) + 1e-300
    found = search(check, 0.0, top)
    assert found is not None
    return found[1]


def _needed_memory(ch: Chain) -> tuple[float, bool]:
    """(smallest achievable max rank memory, exact) for the error message. For v > 1 with too
    many cut tuples to enumerate it is a lower bound instead: the rank average of the least
    total memory, or the heaviest single unit, whichever is larger."""
    if ch.v == 1:
        return _min_cap(ch), True
    combos = math.comb(ch.num_cut_points - len(ch.pb.forced), ch.S - 1 - len(ch.pb.forced))
    if combos <= 20_000:
        return min(max(evaluate_cuts(ch, c, "", True).rank_memory) for c in all_cuts(ch)), True
    pb, f = ch.pb, min(ch.inflight)
    unit = max(ch.state * q + f * a for q, a in zip(pb.param_bytes, pb.activation_bytes))
    return max(unit, (ch.state * ch.Q[-1] + f * ch.A[-1]) / ch.p), False


def _fits_with_ranks(pb: PartitionProblem, p: int) -> bool:
    """Whether p ranks (same v, default in-flight model) fit pb.memory_limit (sound)."""
    try:
        q = replace(pb, num_ranks=p, num_stages=p * pb.stages_per_rank, inflight=None, stage_ranks=None)
        ch = Chain(q)
        check_counts(ch)
    except PartitionError:
        return False
    caps = (pb.memory_limit / ch.v,) * ch.S
    feasible, layers, _, _ = forward(ch, INF, caps)
    return feasible and evaluate_cuts(ch, reconstruct(ch, layers, INF, caps), "", False).fits_memory


def memory_error(ch: Chain, sound_only: bool) -> PartitionError:
    """The `PartitionError` when no partition meets ``memory_limit``: the memory needed and a fix
    (a rank count that fits, for the default in-flight model). ``sound_only``: the search that
    found none was the fallback, so a fitting partition may still exist."""
    pb = ch.pb
    need, exact = _needed_memory(ch)
    what = "the smallest maximum rank memory any partition reaches is" if exact else \
        "every partition needs at least (a lower bound of)"
    msg = (f"memory_limit = {pb.memory_limit:.6g} bytes per rank cannot be met with num_stages = {ch.S} "
           f"on num_ranks = {ch.p}: {what} {need:.6g} bytes per rank "
           f"(params x {ch.state:g} + in-flight activations {tuple(round(x, 3) for x in ch.inflight)}).")
    if sound_only and exact and need <= pb.memory_limit:
        msg = (f"memory_limit = {pb.memory_limit:.6g} bytes per rank: a partition within it exists (the "
               f"smallest maximum rank memory is {need:.6g} bytes per rank), but the exact search ran out "
               f"of exact_budget = {pb.exact_budget} steps and the sound fallback (per-stage caps that sum "
               f"to the limit on each rank) found none. Fix: raise exact_budget, or raise memory_limit.")
        return PartitionError(msg)
    if sound_only:
        msg += (" (The exact search ran out of exact_budget and the sound fallback capped stages so that "
                "each rank's caps sum to the limit, so a partition within the limit may still exist.)")
    if pb.inflight is None:
        top = min(ch.num_cut_points + 1, (4 * ch.p + _RANK_SCAN_LIMIT) * ch.v) // ch.v
        fit, work = None, 0
        for q in range(ch.p + 1, top + 1):
            work += q * ch.v * ch.n
            if work > _RANK_SCAN_WORK:
                top = q - 1
                break
            if _fits_with_ranks(pb, q):
                fit = q
                break
        if fit is not None:
            msg += (f" Fix: use num_ranks = {fit} (num_stages = {fit * ch.v}), which fits, "
                    f"or raise memory_limit.")
        else:
            msg += (f" No num_ranks up to {top} fits with this in-flight model (more 1F1B ranks keep more "
                    f"microbatches in flight); raise memory_limit, use fewer microbatches in flight or "
                    f"recompute activations.")
    else:
        msg += " Fix: raise memory_limit, add ranks, or keep fewer microbatches in flight."
    return PartitionError(msg)
