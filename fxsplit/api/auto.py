"""``strategy="auto"``: the planner's search (``fxsplit.planner``) turned into a ParallelConfig and a Plan.

Terms as in :mod:`fxsplit.api.plan`; B the global batch (samples per optimizer step, all replicas).

    plan = fxsplit.plan(model, (idx,), strategy="auto", world_size=64, global_batch_size=512,
                        hardware=fxsplit.Hardware.preset("a100-80gb"))
    plan.config                 # the chosen dp, tp, pp, v, schedule, m, checkpointing, sp
    plan.predicted_step_time    # seconds per optimizer step
    plan.predicted_memory       # bytes on the most loaded rank by plan.memory(): params, grads, optimizer, ...
    print(plan.search)          # the candidate table, best first, and why each rejected one was

[Note: auto plan]
The model is traced once for the search (every candidate is scored from that one graph), then the
chosen configuration is planned as any other (``fxsplit.plan`` with its fields: ``choose`` here returns them, and ``plan`` / ``parallelize`` plan
them), with the
search's stage boundaries given as ``split_points`` so the built stages are the ones the search
scored. The fields the search chooses (dp, tp, pp, stages_per_rank, schedule, microbatches,
activation_checkpointing, sequence_parallel, ep, and dp_shard where ParallelConfig has it) may not be
given with strategy="auto"; every other option (passes, method, hardware, memory_limit, ...)
is kept. ``hardware`` defaults to ``Hardware.preset("a100-80gb")`` and ``memory_limit`` to its
memory. The example inputs only need the model's shapes (any batch size): the search scales every
cost by the microbatch size B / (dp * m).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from torch import nn

from fxsplit.api.options import ParallelConfig, make_config
from fxsplit.errors import PlanError
from fxsplit.hardware import Hardware
from fxsplit.graph.trace import trace
from fxsplit.planner import SearchResult, analyze, search, shard_supported

__all__ = ["build_pick", "choose", "config_of", "score_layout", "SEARCHED"]

SEARCHED = ("dp", "tp", "pp", "stages_per_rank", "schedule", "microbatches", "activation_checkpointing",
            "sequence_parallel", "dp_shard", "ep", "split_points", "microbatch_size")


def choose(model: nn.Module, example_args: Any, example_kwargs: Mapping[str, Any] | None, *,
           config: ParallelConfig | None, options: Mapping[str, Any], world_size: int | None,
           global_batch_size: int | None, where: str = "plan") -> tuple[ParallelConfig, SearchResult]:
    """The config the search picks for ``world_size`` ranks and ``global_batch_size`` (and the
    search itself); see [Note: auto plan]."""
    fixed = [k for k in options if k in SEARCHED]
    if fixed:
        raise PlanError(f"{where}(strategy='auto') chooses {', '.join(fixed)} itself; leave them out (or plan "
                        f"without strategy='auto')")
    if world_size is None or global_batch_size is None:
        raise PlanError(f"{where}(strategy='auto') needs world_size=N and global_batch_size=B (samples per "
                        "optimizer step over all replicas)")
    base = make_config(config, options, where=where)
    hardware = base.hardware if base.hardware is not None else Hardware.preset("a100-80gb")
    gm = trace(model, example_args, example_kwargs, method=base.method, leaf_modules=base.leaf_modules,
               dynamic_sequence=base.dynamic_sequence,
               param_dtype=base.mp_policy.param_dtype if base.mp_policy is not None else None,
               decompose_attention=world_size > 1)
    workload = analyze(gm, world_size=world_size, hardware=hardware)
    result = search(workload, world_size=world_size, global_batch=global_batch_size, hardware=hardware,
                    memory_limit=base.memory_limit, shard=shard_supported(ParallelConfig))
    return config_of(result.best, result, base, hardware), result


def config_of(score: Any, result: SearchResult, base: ParallelConfig, hardware: Hardware) -> ParallelConfig:
    """The ParallelConfig of one scored candidate, with the search's stage boundaries."""
    fields = score.candidate.config_fields()
    fields.setdefault("dp_shard", 1)  # ``base`` may be another candidate's config
    fields.setdefault("ep", 1)
    cuts = score.cuts[1:-1]
    chosen = dataclasses.replace(base, **fields, hardware=hardware, memory_limit=None, microbatch_size=None,
                                 split_points=tuple(result.group_paths[k] for k in cuts) or None)
    # the pick's microbatch size is known: its plan traces the batch static at it ([Note: a static batch])
    per = chosen.dp * chosen.dp_shard * chosen.resolved().microbatches
    if result.global_batch % per == 0:
        chosen = dataclasses.replace(chosen, microbatch_size=result.global_batch // per)
    return chosen


def score_layout(gm: Any, config: ParallelConfig, hardware: Hardware, global_batch_size: int) -> Any:
    """[Note: a layout's prediction] The auto-planner's score (``fxsplit.planner.Score``: step
    time and its breakdown, [Note: step breakdown]) of the layout ``config`` names, for
    ``global_batch_size`` samples per step on ``hardware``: the same model the search ranks its
    candidates by, so a layout of the user's own and the search's pick compare. ``gm`` is the
    traced model before any pass. The score's stages are the planner's own cuts at layer
    boundaries (the plan's split may cut elsewhere: its ``simulate()`` times those). None when
    the layout is outside what the planner models (the TP structure not found at ``config.tp``,
    a microbatch size that does not divide)."""
    from fxsplit.planner import Candidate, Scorer

    c = config.resolved()
    data = c.dp * c.dp_shard
    if global_batch_size % (data * c.microbatches):
        return None
    world = data * c.tp * c.pp
    workload = analyze(gm, world_size=world, hardware=hardware, tp=c.tp)
    if c.tp > 1 and workload.max_tp % c.tp:
        return None
    cand = Candidate(dp=data, tp=c.tp, pp=c.pp, stages_per_rank=c.stages_per_rank, schedule=c.schedule,
                     microbatches=c.microbatches, microbatch_size=global_batch_size // (data * c.microbatches),
                     activation_checkpointing=c.activation_checkpointing if isinstance(c.activation_checkpointing, str)
                     and c.activation_checkpointing in ("none", "selective", "full") else "none",
                     sequence_parallel=bool(c.sequence_parallel), dp_shard=c.dp_shard, ep=c.ep)
    limit = float(c.memory_limit) if c.memory_limit is not None else hardware.memory_bytes
    return Scorer(workload, hardware, limit).score(cand, simulate=True)


_BUILDS = 3  # candidates built, best first, before the auto plan gives up on memory


def build_pick(plan_fn: Callable[[ParallelConfig], Any], chosen: ParallelConfig, result: SearchResult) -> Any:
    """[Note: the pick's memory is its plan's] The search ranks candidates by its own estimate of
    each one's memory (per layer group, from one trace); the plan it returns is judged by the
    function every plan is (``Plan.memory()``, [Note: memory model] in fxsplit.pipeline.memory).
    So the pick is built (``plan_fn(config)``) and kept if it is within the limit by that
    function; else the same layout is split again under the limit (the partitioner moves the
    cuts), else the next candidate is built, up to ``_BUILDS`` of them; PlanError names every
    tried layout and what it needs. The kept plan's ``predicted_memory``, ``print(plan)`` and
    the search table's pick row all show that plan's figure.

    A built plan over the limit also says by how much the search's estimate was low on this model
    (its peak / the estimate; the largest such ratio so far): the candidates after it whose estimate
    times that ratio is over the limit are passed over unbuilt, with that reason. Without this the
    builds went to the next-best layouts, which differ from the first in little but the schedule and
    were over by as much: Llama-70B on 64 H100 at a global batch of 512 tried three such layouts
    (the search estimated 67-72 GiB, their plans needed 76-84 GiB) and raised PlanError."""
    from fxsplit.errors import SplitError
    from fxsplit.graph.units import fmt_bytes
    from fxsplit.pipeline.memory import worst

    limit, tried, passed = result.memory_limit, [], {}
    low = 1.0  # the largest (built plan's peak / the search's estimate) so far
    builds = 0
    for k, score in enumerate(result.scores):
        if builds == _BUILDS:
            break
        if score.memory.peak * low > limit:
            passed[k] = (f"memory: the search's {fmt_bytes(score.memory.peak)} x {low:.2f} (how low its estimate was "
                         f"for the plans built before) is over the limit {fmt_bytes(limit)}")
            continue
        builds += 1
        config = chosen if k == 0 else config_of(score, result, chosen, chosen.hardware)
        attempts = [config, dataclasses.replace(config, split_points=None, memory_limit=limit)]
        for attempt in attempts:
            try:
                built = plan_fn(attempt)
            except (PlanError, SplitError) as exc:
                tried.append(f"{score.candidate.short()} split under the limit: {str(exc).split(';')[0][:160]}")
                continue
            mem = worst(built.memory())
            if mem.peak <= limit:
                return built, result.with_pick(k, mem, "built" if attempt is config else "built, re-split", passed)
            low = max(low, mem.peak / score.memory.peak)
            tried.append(f"{score.candidate.short()}: its plan needs {mem.peak / 2**30:.2f} GiB on pp rank {mem.pp_rank} "
                         f"(the search estimated {score.memory.peak / 2**30:.2f} GiB)")
    skipped = f" ({len(passed)} candidates passed over unbuilt: their estimate x {low:.2f} is over it)" if passed else ""
    raise PlanError(f"strategy='auto': the search's best {len(tried)} attempts do not fit memory_limit = "
                    f"{limit / 2**30:.2f} GiB per rank by their built plans' memory{skipped}: " + "; ".join(tried)
                    + ". Fix: raise memory_limit, use more ranks, or a smaller global batch.")
