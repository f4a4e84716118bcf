"""The per-rank memory a plan expects: parameters, gradients, optimizer state and activations,
with tensor, pipeline and sharded data parallelism (``Plan.memory()``, printed by ``plan()``).

Terms as in :mod:`fxsplit.api.plan` (d, s = dp_shard, t, p). A rank holds the stages of its
pipeline rank, each parameter at its tp-local shape (a fused expert weight placed by ep: its E / ep
experts), split by FSDP into s dim-0 chunks
(``ceil(rows / s)`` rows for the first ranks: the figure is the largest rank's). The model
itself is [Note: memory model] in :mod:`fxsplit.pipeline.memory` (``rank_memory``), the one the
auto-planner scores candidates with; this module counts a built plan's parameters for it and
walks the plan's schedule for the activations and gradients live at the peak ([Note: the
schedule's walk] in fxsplit.pipeline.memory) with the split's per-stage bytes per microbatch
([Note: what a stage holds]) and message buffers. The split is costed at one microbatch
(``microbatch_size`` when known, from ``global_batch_size``; else the example's batch, so trace
with an example of one microbatch, or pass the batch you step with and ``microbatches=1``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fxsplit.errors import PlanError
from fxsplit.graph.units import fmt_bytes
from fxsplit.pipeline import memory as _model
from fxsplit.pipeline.memory import RankMemory
from fxsplit.schedule import schedule_spec

__all__ = ["RankMemory", "rank_memory"]


def rank_memory(plan: Any, *, optimizer_bytes_per_param: float = 8.0) -> list[RankMemory]:
    """One :class:`RankMemory` per pipeline rank of ``plan`` (``optimizer_bytes_per_param``: float32
    optimizer state per element, 8 for Adam/AdamW's m and v; a 16-bit parameter adds its float32
    master copy: ``fxsplit.pipeline.memory.optimizer_bytes_per_element``)."""
    c = plan.config
    s = c.dp_shard
    specs = plan.tp_plan.param_specs
    full_shapes = {k: tuple(v) for k, v in plan.tp_plan.full_shapes.items()}
    experts = set(plan.ep_plan.expert_params) if c.ep > 1 else set()  # E / ep experts per rank
    policy = c.mp_policy
    try:
        inflight = plan.split.problem.inflight_per_rank()
        buffers = plan.split.message_buffers()
    except Exception:  # noqa: BLE001 -- a plan without a partition model: no estimate
        inflight, buffers = (1.0,) * c.pp, (0.0,) * c.pp
    plain_acts = [st.activation_bytes for st in plan.split.stages]
    extra, exchange = _expert_terms(plan)  # [Note: expert memory]
    stage_acts = [a + e for a, e in zip(plain_acts, extra)]
    after_i = [st.weight_bytes for st in plan.split.stages]
    stage_grads = [0.0] * len(stage_acts)
    computed = [0.0] * len(stage_acts)  # the gradients a stage's weight backward computes (shared ones too)
    loss = getattr(plan.split, "loss_bytes", 0.0)
    last = plan.split.stages[-1].rank if plan.split.stages else c.pp - 1
    # the transients of the walk: as a stage's backward starts, the loss's gradients (last stage)
    # or the region it recomputes, the larger; the graph split's W adds its gradients in at once
    start = [max(st.recompute_bytes, _model.loss_gradient_bytes(loss) if i == len(plan.split.stages) - 1 else 0.0)
             for i, st in enumerate(plan.split.stages)]
    graph_w = schedule_spec(c.schedule).splits_backward and c.split_backward == "graph"
    w_transient = computed if graph_w else None  # filled per parameter below, read by the walks
    out = []
    for r in range(c.pp):
        shard = whole = shard_numel = gathered = grads = optimizer = 0.0
        seen: set = set()
        for stage in plan.stages_of(r):
            for name, p in plan.stages.modules[stage].named_parameters(remove_duplicate=False):
                # a parameter two stages of the rank share is one tensor there (share_tied_on_rank
                # in fxsplit.api.materialize), except under FSDP, which shards each stage apart
                key = id(p) if s == 1 else (stage, id(p))
                shape = tuple(p.shape)
                full = full_shapes.get(name, shape)
                if name in specs and shape == full:
                    shape = specs[name].local_shape(full)
                if name in experts:
                    shape = (shape[0] // c.ep, *shape[1:])
                numel = math.prod(shape)
                gdt = policy.reduce_dtype if policy is not None and policy.reduce_dtype is not None else p.dtype
                computed[stage] += numel * _size(gdt)  # a stage's W computes a shared parameter's part too
                if key in seen:
                    continue
                seen.add(key)
                rows = shape[0] if shape else 1
                # (FSDP leaves the expert weights placed by ep whole: its ignored_params)
                mine = numel if s == 1 or not shape or name in experts else math.ceil(rows / s) * (numel // max(rows, 1))
                size = p.element_size()
                shard += mine * size
                whole += numel
                shard_numel += mine
                grads += numel * _size(gdt)
                stage_grads[stage] += numel * _size(gdt)
                pdt = policy.param_dtype if policy is not None and policy.param_dtype is not None else p.dtype
                gathered += numel * _size(pdt)
                optimizer += mine * _model.optimizer_bytes_per_element(size, optimizer_bytes_per_param)
        recompute = max((plan.split.stages[st].recompute_bytes for st in plan.stages_of(r)), default=0.0)
        acts, grads_at_peak, transient = _model.schedule_walk(plan.schedule[r], stage_acts, after_i, stage_grads,
                                                              start, w_transient)
        imbalance = acts - _model.schedule_walk(plan.schedule[r], plain_acts, after_i, stage_grads, start,
                                                w_transient)[0] if any(extra) else 0.0
        out.append(_model.rank_memory(shard_bytes=shard, numel=whole, shard_numel=shard_numel,
                                      grad_itemsize=grads / max(whole, 1), gather_itemsize=gathered / max(whole, 1),
                                      optimizer_bytes_per_param=optimizer / max(shard_numel, 1), dp=c.dp, dp_shard=s, activations=acts + buffers[r],
                                      recompute=recompute,
                                      microbatches=c.microbatches, inflight=min(inflight[r], c.microbatches),
                                      loss_bytes=loss if last == r else 0.0, pp_rank=r, grads_at_peak=grads_at_peak,
                                      exchange=exchange[r], imbalance=imbalance, transient=transient))
    return out


def _expert_terms(plan: Any) -> tuple[list[float], list[float]]:
    """[Note: expert memory] of an ep plan: per stage, the busiest ep rank's extra expert
    activations per microbatch (at the stage's checkpointing mode); per pipeline rank, the exchange
    buffers of its largest MoE layer. Zeros without ep."""
    from fxsplit.graph.saved import first_saver_bytes, unit_saved
    from fxsplit.pipeline.bindings import example_bindings
    from fxsplit.pipeline.checkpointing import mode_held

    c, stages = plan.config, plan.split.stages
    layers = plan.ep_plan.layers if c.ep > 1 else ()
    extra, buffers = [0.0] * len(stages), [0.0] * c.pp
    if not layers:
        return extra, buffers
    gm = plan.graph
    binds = {k: plan.split.bindings.get(str(k), v) for k, v in example_bindings(gm).items()}  # the split's sizes
    units = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    base = unit_saved(gm, units, binds)
    traced = c.compile or (schedule_spec(c.schedule).splits_backward and c.split_backward == "graph")
    expert = {name for layer in layers for name in layer.region}
    stage_of = plan.split.stage_of
    saved: dict[str, list[float]] = {}
    for s, st in enumerate(stages):
        if st.checkpointing not in saved:
            held = base if st.checkpointing == "none" else mode_held(gm, units, binds, base, st.checkpointing)[0]
            saved[st.checkpointing] = first_saver_bytes(held)
        mine = sum(b for u, b in zip(units, saved[st.checkpointing]) if u.name in expert and stage_of.get(u.name) == s)
        extra[s] = _model.expert_memory(mine, (), c.ep, traced)[0]
    nodes = {n.name: n for n in gm.graph.nodes}
    per_rank: list[list[float]] = [[] for _ in range(c.pp)]
    for layer in layers:
        per_rank[stages[stage_of[layer.last]].rank].append(_model.exchange_bytes(nodes[layer.rows], nodes[layer.last], binds))
    return extra, [_model.expert_memory(0.0, e, c.ep, traced)[1] for e in per_rank]


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def format_memory(rows: list[RankMemory], dp_shard: int) -> str:
    """The lines ``plan()`` prints: one per pipeline rank."""
    lines = [f"expected memory per rank (Adam; [Note: memory model] in fxsplit.pipeline.memory; dp_shard={dp_shard}):"]
    for m in rows:
        extra = f", gathered during the step {fmt_bytes(m.gathered)}" if m.gathered else ""
        extra += f", whole gradients during the step {fmt_bytes(m.whole_grads)}"
        extra += f", all-reduce buckets {fmt_bytes(m.buckets)}" if m.buckets else ""
        extra += f", ep exchange buffers {fmt_bytes(m.exchange)}" if m.exchange else ""
        lines.append(f"  pp rank {m.pp_rank}: params {fmt_bytes(m.params)}, grads {fmt_bytes(m.grads)}, optimizer "
                     f"{fmt_bytes(m.optimizer)}, activations {fmt_bytes(m.activations)}{extra}; peak {fmt_bytes(m.peak)}")
    return "\n".join(lines)


def partition_state_factor(config: Any, gm: Any, *, optimizer_bytes_per_param: float = 8.0) -> float:
    """The partition's training state per parameter byte for ``config`` (its mixed-precision
    policy and dp_shard) and ``gm``'s parameter dtype, by the memory model's own terms
    (``fxsplit.pipeline.memory.state_bytes_per_param_byte``)."""
    itemsize = max((p.element_size() for p in gm.parameters()), default=4)
    dtype = {4: torch.float32, 2: torch.bfloat16, 8: torch.float64}.get(itemsize, torch.float32)
    policy = config.mp_policy
    grad = policy.reduce_dtype if policy is not None and policy.reduce_dtype is not None else dtype
    gather = policy.param_dtype if policy is not None and policy.param_dtype is not None else dtype
    return _model.state_bytes_per_param_byte(
        param_itemsize=itemsize, grad_itemsize=_size(grad), gather_itemsize=_size(gather), dp_shard=config.dp_shard,
        optimizer_bytes_per_param=_model.optimizer_bytes_per_element(itemsize, optimizer_bytes_per_param))


def memory_limit_error(plan: Any) -> PlanError:
    """The PlanError for a plan over its ``memory_limit`` by ``Plan.memory()``: every rank over it
    with the terms of its peak, and the fixes."""
    c = plan.config
    rows = [m for m in plan.memory() if m.peak > c.memory_limit]
    what = "; ".join(f"pp rank {m.pp_rank} needs {fmt_bytes(m.peak)} ({_terms(m)})" for m in rows)
    return PlanError(
        f"memory_limit = {fmt_bytes(c.memory_limit)} per rank is not met by any split fxsplit found for dp={c.dp} "
        f"dp_shard={c.dp_shard} tp={c.tp} pp={c.pp} (v={c.stages_per_rank}, {c.schedule}, m={c.microbatches}, "
        f"activation_checkpointing={c.activation_checkpointing!r}): {what}. Fix: raise memory_limit, add pipeline "
        f"or tensor ranks, shard the optimizer state (dp_shard), recompute activations "
        f"(activation_checkpointing='full'), or use smaller microbatches (more of them).")


def _terms(m: RankMemory) -> str:
    parts = [("params", m.params), ("optimizer", m.optimizer), ("activations", m.activations),
             ("gathered", m.gathered), ("whole gradients", m.whole_grads), ("buckets", m.buckets),
             ("loss gradients", m.backward), ("ep exchange buffers", m.exchange)]
    return ", ".join(f"{k} {fmt_bytes(v)}" for k, v in parts if v)
