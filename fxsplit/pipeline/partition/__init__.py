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

Modules: ``chain`` (the problem, the result and the exact bottleneck sweep), ``solve`` (`solve`,
`brute_force`, `evaluate` and the baselines) and ``memory_caps`` (the memory-coupled search for
``memory_limit`` with ``v > 1``, and the memory error). Import from this package: the modules
inside it are internal.
"""
from fxsplit.errors import PartitionError
from fxsplit.pipeline.partition.chain import Partition, PartitionProblem, inflight_1f1b, inflight_gpipe
from fxsplit.pipeline.partition.solve import (
    brute_force,
    equal_layer_cuts,
    evaluate,
    parameter_count_cuts,
    solve,
)

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
