"""The auto-planner: choose dp, tp, pp, v, microbatches, schedule, checkpointing and sequence
parallelism for a world size and a global batch by search ([Note: search strategy]).

Modules: ``workload`` (the traced model's per-unit costs as arrays, computed once: [Note: planner
workload]), ``space`` (the candidates and why some are left out: [Note: candidate space]),
``score`` (per-stage F / I / W, collectives by the Hardware's alpha-beta formulas, memory per
rank, the schedule simulated: [Note: planner cost model]), ``breakdown`` (where a predicted step
goes: [Note: step breakdown]), ``fsdp`` (what a runtime's FSDP holds and hides: fxsplit's own
or a published run's per-layer FSDP2, [Note: FSDP policies]), ``host`` (ranks sharing one host's
cores: [Note: host sharing]) and ``search`` (the table and the pick).
``fxsplit.plan(model, args, strategy="auto", world_size=N, global_batch_size=B, hardware=hw)``
is the entry point (``fxsplit.api.auto``); this package never builds a Plan itself.

    w = analyze(gm, world_size=8, hardware=hw)
    result = search(w, world_size=8, global_batch=64, hardware=hw)
    print(result); result.best.candidate.config_fields(); result.split_points()

May import: ``fxsplit.tp``, ``fxsplit.pipeline``, ``fxsplit.schedule``, ``fxsplit.graph``,
``fxsplit.errors`` and numpy; not the runtime, the passes or the API.
"""

from fxsplit.planner.breakdown import Breakdown
from fxsplit.planner.host import shared_makespan
from fxsplit.planner.score import MAX_SIMULATED_ACTIONS, OPTIMIZERS, Calibration, Memory, Score, Scorer, calibrate
from fxsplit.planner.search import SearchResult, analyze, search
from fxsplit.planner.space import Candidate, candidates, shard_supported
from fxsplit.planner.workload import Workload, repeat_layers

__all__ = ["Breakdown", "Calibration", "calibrate", "Candidate", "MAX_SIMULATED_ACTIONS", "Memory", "OPTIMIZERS", "Score", "Scorer",
           "SearchResult", "Workload", "analyze", "candidates", "repeat_layers", "search", "shard_supported",
           "shared_makespan"]
