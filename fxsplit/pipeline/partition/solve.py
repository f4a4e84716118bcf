"""`solve`, `brute_force`, `evaluate` and the baselines (equal layers, parameter counts) over the
chain model of :mod:`fxsplit.pipeline.partition.chain`.

The cost model ([Note: partition cost model]) and the guarantees of `solve` are the package
docstring, :mod:`fxsplit.pipeline.partition`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

from fxsplit.errors import PartitionError
from fxsplit.pipeline.partition.chain import (
    INF,
    Chain,
    Partition,
    PartitionProblem,
    all_cuts,
    check_counts,
    evaluate_cuts,
    min_bottleneck,
)
from fxsplit.pipeline.partition.memory_caps import memory_error, solve_coupled


__all__ = ["solve", "brute_force", "evaluate", "equal_layer_cuts", "parameter_count_cuts"]

def evaluate(problem: PartitionProblem, cuts: Sequence[int], *, method: str = "given") -> Partition:
    """Cost of given cuts under [Note: partition cost model] (memory cap reported, not enforced)."""
    ch = Chain(problem)
    cuts = tuple(int(x) for x in cuts)
    if len(cuts) != ch.S + 1 or cuts[0] != 0 or cuts[-1] != ch.n or any(
            y <= x for x, y in zip(cuts, cuts[1:])):
        raise PartitionError(
            f"cuts {cuts} are not {ch.S + 1} strictly increasing positions from 0 to {ch.n}")
    return evaluate_cuts(ch, cuts, method, exact=False)


def solve(problem: PartitionProblem) -> Partition:
    """The minimum-bottleneck partition; see the module docstring for what is guaranteed.

    Raises `PartitionError` when the stage count exceeds the possible cuts, or when no partition
    meets ``memory_limit`` (naming the memory needed and a rank count that would fit).
    """
    ch = Chain(problem)
    check_counts(ch)
    L = problem.memory_limit
    if L is None or ch.v == 1:
        cuts = min_bottleneck(ch, None if L is None else (L,) * ch.S)
        exact = True
    else:
        cuts, exact = solve_coupled(ch)
    if cuts is None:
        raise memory_error(ch, sound_only=not exact)
    part = evaluate_cuts(ch, cuts, "solve", exact)
    assert part.fits_memory, part
    return part


def brute_force(problem: PartitionProblem, *, max_candidates: int = 2_000_000) -> Partition:
    """Reference: evaluate every allowed cut tuple; same objective and tie rule as `solve`."""
    ch = Chain(problem)
    check_counts(ch)
    count = math.comb(ch.num_cut_points - len(problem.forced), ch.S - 1 - len(problem.forced))
    if count > max_candidates:
        raise PartitionError(f"brute_force would evaluate {count} cut tuples (> {max_candidates}); use solve")
    best, best_key = None, None
    for cuts in all_cuts(ch):
        part = evaluate_cuts(ch, cuts, "brute_force", True)
        if not part.fits_memory:
            continue
        key = (part.bottleneck, cuts[::-1])
        if best_key is None or key < best_key:
            best, best_key = part, key
    if best is None:
        raise memory_error(ch, sound_only=False)
    return best


def equal_layer_cuts(problem: PartitionProblem) -> Partition:
    """Baseline: equal numbers of units per stage (Megatron/PTD split points).

    With every position allowed and no forced cuts, stage s starts at ``s * n // S`` (PTD's
    ``n / S`` units per stage when S divides n). Otherwise the cuts minimize the largest unit
    count per stage within ``allowed``/``forced``. Memory is reported, not enforced.
    """
    ch = Chain(problem)
    check_counts(ch)
    n, S = ch.n, ch.S
    if not problem.forced and all(ch.ok[1:]):
        cuts = tuple(s * n // S for s in range(S + 1))
    else:
        units = replace(problem, compute=(1.0,) * n, cut_bytes=(0.0,) * (n + 1), memory_limit=None,
                        bandwidth=INF, cut_penalty=None)
        cuts = solve(units).cuts
    return evaluate_cuts(ch, cuts, "equal_layers", exact=False)


def parameter_count_cuts(problem: PartitionProblem) -> Partition:
    """Baseline: DeepSpeed's ``partition_method="parameters"``, which balances parameter counts
    (the minimum over allowed/forced cuts of the largest per-stage ``param_bytes``), evaluated
    with the real cost model. Memory is reported, not enforced."""
    ch = Chain(problem)
    check_counts(ch)
    params = replace(problem, compute=problem.param_bytes, cut_bytes=(0.0,) * (ch.n + 1),
                     memory_limit=None, bandwidth=INF, cut_penalty=None)
    return evaluate_cuts(ch, solve(params).cuts, "parameters", exact=False)
