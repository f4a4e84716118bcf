"""Exact balanced partition of a chain of units into pipeline stages (pure Python, no torch).

Terms
-----
unit        one element of the chain the pipeline split pass builds (a node, or the nodes of a
            module), in topological order; ``n`` units numbered ``0 .. n-1``.
position k  a cut placed before unit ``k``, ``0 <= k <= n``; positions 0 and n are the chain's
            ends and always cuts.
stage s     units ``[cuts[s], cuts[s+1])``; ``S = num_stages`` stages, each non-empty.
rank r      a pipeline rank; stage ``s`` lives on rank ``s % p`` (``p = num_ranks``), so a rank
            holds ``v = S // p`` stages (Megatron's interleaving when ``v > 1``), or on
            ``stage_ranks[s]`` when the schedule places stages otherwise (ZB-V's V).
bottleneck  the largest stage time, ``B``.

Representative call::

    part = solve(PartitionProblem(compute=..., param_bytes=..., activation_bytes=...,
                                  cut_bytes=..., num_stages=8, num_ranks=4))
    part.cuts         # (0, k1, ..., n)
    print(part)       # one line per stage: units, time, memory

[Note: partition cost model]  The single definition used by `solve`, `brute_force`, `evaluate`
and the baselines.

- Communication seconds of position k: ``c[k] = cut_bytes[k] * cut_penalty[k] / bandwidth``
  (0 when ``bandwidth`` is inf). A stage ``[a, b)`` receives position a and sends position b;
  the chain ends count as given (``cut_bytes[0]`` model-input bytes, ``cut_bytes[n]`` output
  bytes: pass 0 to leave them out). ``cut_penalty`` (default 1) scales a cut's communication, so a
  caller can make cuts inside a module dearer than cuts at module boundaries; ``allowed`` forbids
  cuts outright; ``forced`` cuts (user split points) are always present and always allowed.
- Stage time ``t(a, b) = sum(compute[a:b]) + c[a] + c[b]``, evaluated as ``E[b] - K[a]`` with
  ``P`` the prefix sums of ``compute``, ``E[k] = P[k] + c[k]`` and ``K[k] = P[k] - c[k]``. Every
  routine here computes it with that one expression, so the bottleneck `solve` reports is
  bit-identical to the one `brute_force` finds for the same cuts.
- Stage memory of stage s on rank r = s % p (or ``stage_ranks[s]``):
  ``state_bytes_per_param_byte * sum(param_bytes[a:b]) + inflight[r] * sum(activation_bytes[a:b])``.
  ``state_bytes_per_param_byte`` (default 4: fp32 parameter, gradient, Adam m and v) is the
  training state per parameter byte; bf16 parameters and gradients with an fp32 master copy and
  fp32 Adam state make (2 + 2 + 4 + 4 + 4) / 2 = 8. ``activation_bytes`` are the bytes a unit
  saves for backward per microbatch.
- Rank memory: the sum of its stages' memories, in stage order. ``memory_limit`` caps it.
- ``inflight[r]``: how many microbatches' activations rank r holds at its peak, counted in
  microbatches of the rank's whole share (all of its stages): GPipe ``m``
  (`inflight_gpipe`); 1F1B ``p - r``; interleaved 1F1B (Megatron) ``((p-r-1)*2 + (v-1)*p + 1) / v``,
  which is ``p + (p-1)/v`` on rank 0 (`inflight_1f1b`, the default). In an interleaved schedule
  a rank's stages hold different numbers of microbatches; this model charges each the rank's
  average, an approximation.
- Objective: minimize the bottleneck over all partitions whose cuts are allowed, that contain
  every forced cut and whose rank memories are within ``memory_limit``. Ties: among optimal
  partitions, the one whose LAST cut is smallest, then the cut before it, and so on (the cut
  tuple compared from the end). This fills stages from the last one backwards and leaves the
  earliest stages lightest, which is where 1F1B keeps the most microbatches in flight.

Guarantees of `solve`:

- No ``memory_limit``, or ``v == 1``: exact (optimal bottleneck and the tie rule above). Method:
  a search over the finite set of stage-time values (galloping, then bisection; an infeasible
  probe jumps straight to the next value at which anything could change), each probe an
  O(S * band) reachability sweep over positions with prefix sums, where the band holds the
  positions a stage can end at given the compute (and memory) bounds. n = 5000, S = 64: ~0.2 s.
- ``memory_limit`` and ``v > 1`` (a rank sums memory over stages r, r+p, ...):
  exact (``Partition.exact`` True) when the optimum of the relaxation "each stage alone within
  the limit" also fits every rank, or when a depth-first search over cut tuples (at most 400
  allowed positions) finishes within ``exact_budget`` steps. Otherwise sound, not exact:
  per-stage caps that sum to the limit on every rank (uniform ``memory_limit / v``, or in
  proportion to the stage memories of near-optimal partitions); the best partition found is
  returned with ``exact=False``: it fits the limit, its bottleneck may exceed the optimum, and a
  `PartitionError` may be raised although a fitting partition exists (the message says so).
- A `PartitionError` for memory names the smallest per-rank memory any partition needs (exact
  for v == 1 and for enumerable v > 1 problems, else a lower bound) and, for the default
  in-flight model, the smallest ``num_ranks`` (same v) found to fit.

The memory-coupled search (``memory_limit`` and ``v > 1``) and the memory error are in the
internal module ``fxsplit.pipeline.partition_memory``, which builds on the sweeps here (`forward`,
`min_bottleneck`); it is imported where it is used, as it imports this module.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

from fxsplit.errors import PartitionError
from fxsplit.pipeline.chain import (
    INF,
    Chain,
    Partition,
    PartitionProblem,
    all_cuts,
    check_counts,
    evaluate_cuts,
    inflight_1f1b,
    inflight_gpipe,
    min_bottleneck,
)
from fxsplit.pipeline.partition_memory import memory_error, solve_coupled

__all__ = [
    "PartitionError",
    "PartitionProblem",
    "Partition",
    "solve",
    "brute_force",
    "evaluate",
    "equal_layer_cuts",
    "parameter_count_cuts",
    "inflight_1f1b",
    "inflight_gpipe",
]

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
