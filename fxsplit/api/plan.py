"""The one-line API: ``fxsplit.plan`` (single process, no weights needed) and ``fxsplit.parallelize``.

Terms: d, t, p data-, tensor- and pipeline-parallel degrees (world size d * t * p, mesh dims
("dp", "pp", "tp"), tp innermost); v stages per pipeline rank (S = p * v stages, rank r holds
stages r, r + p, ..., or those the schedule places on it: ``Plan.stage_ranks``, ZB-V's V);
m microbatches per step.

    plan = fxsplit.plan(model, (idx,), tp=2, pp=2)        # pure: trace -> passes -> TP -> split -> schedule
    print(plan); plan.simulate(); plan.to_dot("g.dot"); plan.timeline("pp.png")

    pm = fxsplit.parallelize(model, (idx,), loss_fn=F.cross_entropy, tp=2, pp=2)   # under torchrun
    opt = torch.optim.AdamW(pm.parameters())
    loss = pm.step(idx, target=y); opt.step(); opt.zero_grad()

Everything up to the runtime happens here, in one process and without weights; what each rank
then does is :mod:`fxsplit.api.parallelize` ([Note: what every rank does]).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.fx
from torch import nn

from fxsplit import schedule as _schedules
from fxsplit.api.options import SCHEDULES, ParallelConfig, make_config
from fxsplit.errors import OutOfRangeError, PlanError, SplitError, UsageError
from fxsplit.graph.examples import batch_of, check_example_batch, example_at_batch
from fxsplit.hardware import Hardware
from fxsplit.graph.batch_marker import rebatch
from fxsplit.graph.pass_api import PassContext, PassManager, PassResult
from fxsplit.graph.shapes import graph_marker, substitute
from fxsplit.graph.trace import trace
from fxsplit.pipeline.comm import CommPlan, plan_all_communication
from fxsplit.pipeline.rank_plan import RankPlan
from fxsplit.pipeline.split import SplitPlan, batch_bindings
from fxsplit.pipeline.stage import StageGraphs
from fxsplit.tp.moe import EPPlan
from fxsplit.tp.plan import TPPlan

__all__ = ["Plan", "plan", "ParallelConfig", "PlanError", "SCHEDULES"]


@dataclass(frozen=True)
class Plan:
    """Everything decided before any process starts: printable, comparable, no weights needed.

    ``graph`` is the traced graph after user passes and tensor parallelism (shared by all tp
    ranks: shard offsets are read from the tp group at run time); ``stages`` its stage
    GraphModules; ``split`` the balanced partition; ``schedule`` the per-rank action lists;
    ``comm`` / ``forward_comm`` every pipeline rank's communication plan for a training step and
    for inference ([Note: message order] in fxsplit.pipeline.comm). ``rank_plan(r)`` is what the
    runtime of pipeline rank r runs.
    """

    config: ParallelConfig
    graph: torch.fx.GraphModule
    split: SplitPlan
    stages: StageGraphs
    schedule: list
    tp_plan: TPPlan = field(default_factory=TPPlan.identity)  # the identity plan when tp=1, no overrides
    pass_report: Mapping[str, Any] = field(default_factory=dict)
    plan_seconds: float = 0.0
    comm: tuple[CommPlan, ...] = ()
    forward_comm: tuple[CommPlan, ...] = ()
    stage_ranks: tuple[int, ...] = ()  # rank of every stage, chosen by the schedule (schedule.placement)
    # strategy="auto" ([Note: auto plan] in fxsplit.api.auto): seconds per optimizer step and bytes
    # per rank the search predicted for this config, and the search (its candidate table); else None
    predicted_step_time: float | None = None
    predicted_memory: Mapping[str, float] | None = None
    search: Any = None
    # the planner's breakdown of predicted_step_time (fxsplit.planner.Breakdown, [Note: step
    # breakdown]): an auto plan's, or any plan's given hardware= and global_batch_size=
    predicted_breakdown: Any = None

    def __post_init__(self) -> None:
        if not self.stage_ranks:
            p = self.config.pp
            object.__setattr__(self, "stage_ranks", tuple(s % p for s in range(self.stages.num_stages)))

    def stages_of(self, pp_rank: int) -> tuple[int, ...]:
        """The stages pipeline rank ``pp_rank`` holds, in order."""
        return tuple(s for s, r in enumerate(self.stage_ranks) if r == pp_rank)

    def rank_plan(self, pp_rank: int) -> RankPlan:
        """Pipeline rank ``pp_rank``'s part of the plan: what its runtime runs."""
        p = self.config.pp
        if not 0 <= pp_rank < p:
            raise OutOfRangeError(f"pp_rank {pp_rank} out of range: pp={p}")
        g = self.stages
        return RankPlan(rank=pp_rank, num_ranks=p, stage_ranks=self.stage_ranks, io=g.io,
                        input_meta=g.input_meta, shared_params=g.shared_params, output_spec=g.output_spec,
                        schedule=tuple(tuple(row) for row in self.schedule), train=self.comm[pp_rank],
                        forward=self.forward_comm[pp_rank])

    # -- inspection
    @property
    def ep_plan(self) -> EPPlan:
        """The expert-parallel plan ([Note: MoE regions] in fxsplit.tp.moe): the MoE layers whose
        experts are placed over ``ep`` ranks, and those kept as they are with the reason."""
        return self.pass_report.get("expert_parallel", EPPlan(ep=self.config.ep))

    def stage_graph(self, stage: int, tp_rank: int = 0) -> torch.fx.GraphModule:
        """The fx GraphModule of ``stage``. Every tp rank runs the same graph on its own shards
        (its offsets come from the tp group at run time), so ``tp_rank`` only checks the range."""
        if not 0 <= stage < self.config.num_stages:
            raise OutOfRangeError(f"stage {stage} out of range: the plan has {self.config.num_stages} stages")
        if not 0 <= tp_rank < self.config.tp:
            raise OutOfRangeError(f"tp_rank {tp_rank} out of range: tp={self.config.tp}")
        return self.stages.modules[stage]

    def simulate(self, comm: float | None = None):
        """The schedule simulated with the split's per-stage estimates: each stage's F, I and W
        seconds ([Note: F, I, W estimates] in fxsplit.pipeline.split) and the time to send its
        output over the link (or ``comm`` seconds for every message)."""
        costs = self.stage_costs()
        return _schedules.simulate(
            self.schedule, forward=costs["forward"], backward=costs["backward"], backward_input=costs["backward_input"],
            backward_weight=costs["backward_weight"], comm=costs["comm"] if comm is None else comm)

    def stage_costs(self) -> dict[str, tuple[float, ...]]:
        """Per-stage seconds per microbatch: ``forward``, ``backward`` (= I + W),
        ``backward_input``, ``backward_weight``, and ``comm`` (sending the stage's output), as the
        simulator and ``zb_auto`` take them (see :func:`stage_costs`)."""
        return stage_costs(self.split)

    def memory(self, *, optimizer_bytes_per_param: float = 8.0) -> list:
        """Per pipeline rank, the bytes one rank expects: parameters, gradients, optimizer state
        (Adam: 2 x float32, plus a float32 master copy of 16-bit parameters), activations and
        gradients at the peak, FSDP's gathered stages (fxsplit.api.memory.RankMemory). The one
        figure ``print(plan)``, ``predicted_memory`` and ``memory_limit`` use ([Note: memory model])."""
        from fxsplit.api.memory import rank_memory

        return rank_memory(self, optimizer_bytes_per_param=optimizer_bytes_per_param)

    def to_dot(self, path: str | None = None, *, level: str = "node") -> str:
        """Graphviz DOT of the plan: ``level="node"`` one box per op coloured by stage;
        ``level="module"`` stages as clusters of module calls, repeated layers folded into one box,
        tensor-parallel collectives and point-to-point messages marked (``fxsplit.api.plan_dot``).
        ``path`` ending in ``.png``/``.svg``/``.pdf`` is rendered when graphviz is installed."""
        if level == "module":
            from fxsplit.api.plan_dot import module_dot

            return module_dot(self, path)
        if level != "node":
            raise UsageError(f"to_dot(level={level!r}): use 'node' or 'module'")
        return self.split.to_dot(self.graph, path)

    def timeline(self, path: str) -> str:
        sim, c = self.simulate(), self.config
        _schedules.timeline_png(sim, path, unit="s", title=f"{c.schedule}: p={c.pp} v={c.stages_per_rank} "
                                f"m={c.microbatches}; simulated step {sim.makespan * 1e3:.3g} ms")
        return path

    def schedule_grid(self) -> str:
        return _schedules.format_grid(self.schedule)

    def tp_table(self) -> str:
        """The full tensor-parallel table: every sharded module with its shards, and why any was left whole."""
        return str(self.tp_plan)

    def stage_table(self) -> str:
        """The full stage table: every stage's modules, nodes, parameters, FLOPs, activations, messages, time."""
        return str(self.split)

    def __str__(self) -> str:
        """The plan on one screen ([Note: a plan on one screen] in fxsplit.api.summary)."""
        from fxsplit.api.summary import plan_lines

        return "\n".join(plan_lines(self))


def plan(
    model: nn.Module,
    example_args: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    config: ParallelConfig | None = None,
    strategy: str | None = None,
    world_size: int | None = None,
    global_batch_size: int | None = None,
    **options: Any,
) -> Plan:
    """Plan ``model`` for dp x tp x pp in this process: trace, user passes, tensor parallelism,
    balanced pipeline split, schedule, communication. No process group and no weights needed
    (meta is fine).

    The options are the fields of :class:`fxsplit.ParallelConfig`, given as keywords
    (``plan(model, (x,), tp=2, pp=4)``) or as ``config=`` (keywords then override its fields).
    ``microbatches`` defaults to 2 * pp; ``stages_per_rank`` to 2 for interleaved 1F1B;
    ``passes`` are user passes ``(gm, ctx) -> PassResult`` run first, through a PassManager
    (``debug`` names a folder for per-pass dumps). ``hardware`` is what stage times are estimated
    for (default ``Hardware()``; ``parallelize`` on CPU uses ``Hardware.cpu()``);
    ``cut_at="modules"`` lets stages start only where a module call begins. ``verify=True``
    checks the plan against the unsplit model in this process (:func:`fxsplit.verify`; needs real
    weights), raising VerificationError naming the first diverging node.

    ``global_batch_size=B`` without ``strategy`` plans the given layout for B samples per step:
    ``microbatch_size`` = B / (dp * dp_shard * m), and torch.export traces the batch static at it
    (``dynamic_batch=True`` keeps it symbolic: [Note: a static batch] in fxsplit.graph.examples).
    With ``hardware=`` too, the plan carries the auto-planner's prediction of the layout:
    ``predicted_step_time``, ``predicted_breakdown`` and ``predicted_memory`` ([Note: a layout's
    prediction] in fxsplit.api.auto). ``world_size`` with a layout must be its own.

    ``strategy="auto"`` searches the layout for ``world_size`` ranks and ``global_batch_size``
    samples per step instead ([Note: auto plan] in :mod:`fxsplit.api.auto`): ``Plan.config`` is
    the pick, with ``predicted_step_time``, ``predicted_memory`` and ``search`` (the table).

    An example of 0 samples (its batch, dim 0 of the first input tensor, is 0) is refused with a
    PlanError naming the input.
    """
    check_example_batch(example_args if isinstance(example_args, (tuple, list)) else (example_args,),
                        example_kwargs, "plan")
    if strategy is not None:
        return _auto_plan(model, example_args, example_kwargs, strategy=strategy, config=config, options=options,
                          world_size=world_size, global_batch_size=global_batch_size)
    t0 = time.perf_counter()
    config = with_global_batch(make_config(config, options, where="plan").resolved(), global_batch_size)
    _check_world_size(config, world_size)
    hardware = config.hardware if config.hardware is not None else Hardware()
    config, example_args, example_kwargs, gm = _traced(model, example_args, example_kwargs, config)
    scored = None  # [Note: a layout's prediction], from the graph before any pass rewrites it
    if config.hardware is not None and global_batch_size is not None:
        from fxsplit.api.auto import score_layout

        scored = score_layout(gm, config, hardware, global_batch_size)
    ctx = PassContext(
        example_args=tuple(example_args) if isinstance(example_args, (tuple, list)) else (example_args,),
        example_kwargs=dict(example_kwargs or {}),
        options={"tp": config.tp, "pp": config.pp, "dp": config.dp, "ep": config.ep, "cp": config.cp},
    )
    stage_ranks = _schedules.placement(config.schedule, config.pp, config.stages_per_rank)
    split_pass = _split_pass(config, gm, hardware, stage_ranks, batch_of((example_args, example_kwargs or {})))
    # every pass (the user's, tensor parallel, the split) runs through one PassManager, so the
    # debug dumps (debug=DIR or FXSPLIT_DEBUG_DIR) show each of them
    gm = PassManager(_rewrite_passes(config, gm) + [split_pass], debug=config.debug)(gm, ctx).graph_module
    result = _assemble(config, gm, ctx, stage_ranks, t0)
    result = _within_memory_limit(result, split_pass, ctx)
    if scored is not None:
        from fxsplit.pipeline.memory import worst

        result = dataclasses.replace(result, predicted_step_time=scored.step_time, predicted_breakdown=scored.breakdown,
                                     predicted_memory=worst(result.memory()).as_dict())
    if config.verify:  # [Note: plan-time verification]; raises VerificationError on a mismatch
        from fxsplit.api.verify import verify

        verify(model, example_args, result, example_kwargs)
    return result


def _auto_plan(model: nn.Module, example_args: Any, example_kwargs: Any, *, strategy: str,
               config: ParallelConfig | None, options: Mapping[str, Any], world_size: int | None,
               global_batch_size: int | None) -> Plan:
    """``strategy="auto"``: the searched layout's plan, with its prediction and the search table
    ([Note: auto plan] in :mod:`fxsplit.api.auto`)."""
    t_auto = time.perf_counter()
    if strategy != "auto":
        raise PlanError(f"strategy must be 'auto' or None, got {strategy!r}")
    from fxsplit.api.auto import build_pick, choose

    chosen, found = choose(model, example_args, example_kwargs, config=config, options=options,
                           world_size=world_size, global_batch_size=global_batch_size)
    picked, found = build_pick(lambda c: plan(model, example_args, example_kwargs, config=c), chosen, found)
    return dataclasses.replace(picked, predicted_step_time=found.best.step_time,
                               predicted_memory=found.best.memory.as_dict(), search=found,
                               predicted_breakdown=found.best.breakdown,
                               plan_seconds=time.perf_counter() - t_auto)


def _traced(model: nn.Module, example_args: Any, example_kwargs: Any,
            config: ParallelConfig) -> tuple[ParallelConfig, Any, Any, torch.fx.GraphModule]:
    """``(config, example_args, example_kwargs, gm)``: the model traced as ``config`` asks, the
    example (and ``config.microbatch_size``) at the static microbatch size when there is one."""
    static_batch = config.static_batch(batch_of((example_args, example_kwargs or {})))
    if static_batch is not None:  # [Note: a static batch]: the example at the microbatch size
        config = dataclasses.replace(config, microbatch_size=static_batch)
        example_args, example_kwargs = example_at_batch(
            tuple(example_args) if isinstance(example_args, (tuple, list)) else (example_args,),
            dict(example_kwargs or {}), static_batch)
    # [Note: attention modules as ops] (fxsplit.graph.decompose): with tensor parallelism, torch's
    # nn.MultiheadAttention / TransformerEncoder(Layer) are traced as ops (fused in_proj chunked
    # into q/k/v, heads, sdpa, out_proj) so the planner shards them by heads: fx would keep each a
    # leaf with no linear in it, export merges the batch into the heads. Same parameter names.
    gm = trace(model, example_args, example_kwargs, method="export" if config.cp > 1 else config.method,
               leaf_modules=config.leaf_modules,
               dynamic_sequence=False if config.cp > 1 else config.dynamic_sequence,
               param_dtype=config.mp_policy.param_dtype if config.mp_policy is not None else None,
               decompose_attention=config.tp > 1, dynamic_batch=config.dynamic_batch, microbatch_size=static_batch,
               follow_sequence=_follows(config, model))
    return config, example_args, example_kwargs, gm


def _rewrite_passes(config: ParallelConfig, gm: torch.fx.GraphModule) -> list[Callable]:
    """The passes before the split, in order: the user's, causal masks (where an attention reads a
    mask), context, tensor and expert parallelism, mixed precision."""
    from fxsplit.passes.causal_masks import causal_masks, reads_a_mask

    pipeline = list(config.passes)
    if reads_a_mask(gm):  # [Note: causal masks as is_causal]
        pipeline.append(causal_masks)
    if config.cp > 1:  # before tensor parallelism, on the aten graph export traced
        from fxsplit.passes.context_parallel import context_parallel

        pipeline.append(functools.partial(context_parallel, cp=config.cp, kv=config.cp_kv))
    if config.tp > 1 or config.tp_plan:
        from fxsplit.passes.tensor_parallel import tensor_parallel

        pipeline.append(
            functools.partial(
                tensor_parallel, tp=config.tp, overrides=config.tp_plan,
                sequence_parallel=config.sequence_parallel, vocab_parallel_loss=config.vocab_parallel_loss,
            )
        )
    if config.ep > 1:
        from fxsplit.passes.expert_parallel import expert_parallel

        pipeline.append(functools.partial(expert_parallel, ep=config.ep))
    if config.mp_policy is not None and config.mp_policy.param_dtype is not None:
        from fxsplit.passes.mixed_precision import mixed_precision

        pipeline.append(functools.partial(mixed_precision, param_dtype=config.mp_policy.param_dtype))
    if graph_marker(gm) is not None:
        pipeline.append(batch_literals)
    return pipeline


def batch_literals(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """[Note: a marker batch] (fxsplit.graph.batch_marker): sizes that the passes before wrote into the
    graph from its static values (multiples of the marker) read the batch from the input again."""
    return PassResult(gm, rebatch(gm) > 0)


def _split_pass(config: ParallelConfig, gm: torch.fx.GraphModule, hardware: Hardware,
                stage_ranks: tuple[int, ...], example_batch: int | None) -> Callable:
    """The pipeline split with every option ``config`` sets (``memory_limit`` is rebound when the
    built plan is over it: ``_within_memory_limit``)."""
    from fxsplit.api.memory import partition_state_factor
    from fxsplit.passes.pipeline_split import pipeline_split

    return functools.partial(
        pipeline_split, num_stages=config.num_stages, num_ranks=config.pp, split_points=config.split_points,
        schedule=config.schedule, num_microbatches=config.microbatches,
        memory_limit=config.memory_limit, hardware=hardware, loss_seconds=_loss_seconds(gm, hardware),
        cut_at=config.cut_at, stage_ranks=stage_ranks,
        activation_checkpointing=config.activation_checkpointing, checkpoint_modes=_checkpoint_modes(config),
        split_backward=config.split_backward, state_bytes_per_param_byte=partition_state_factor(config, gm),
        param_casts_free=config.dp_shard > 1 and config.mp_policy is not None
        and config.mp_policy.param_dtype is not None,
        # costs and memory of one microbatch, whatever batch the symbolic trace saw
        bindings=batch_bindings(gm, config.microbatch_size if config.microbatch_size is not None
                                else example_batch) or None,
    )


def _check_world_size(config: ParallelConfig, world_size: int | None) -> None:
    """``world_size`` given with a layout must be the layout's own."""
    if world_size is None:
        return
    own = config.dp * config.dp_shard * config.tp * config.pp
    if world_size != own:
        raise PlanError(f"world_size={world_size} but the layout dp={config.dp} x dp_shard={config.dp_shard} x "
                        f"tp={config.tp} x pp={config.pp} uses {own} ranks; give matching degrees, or "
                        "strategy='auto' to search a layout for world_size")


_MEMORY_TIGHTENINGS = 3  # re-splits under a tighter cap when the built plan is over memory_limit


def _within_memory_limit(result: Plan, split_pass: Any, ctx: PassContext) -> Plan:
    """[Note: one memory model] ``result``, or its re-split, within ``memory_limit`` by
    ``Plan.memory()``; PlanError naming the rank and its terms when no split is.

    The partition caps a linear model of the rank memory (training state per parameter byte plus
    in-flight activations: ``fxsplit.pipeline.memory.state_bytes_per_param_byte``); the terms it
    cannot see (message buffers, the loss's gradients, all-reduce buckets) are checked here with
    the function ``Plan.memory()``, ``print(plan)`` and the auto-planner's pick report: when the
    built plan is over the limit, the split runs again with its cap lowered by the excess."""
    c = result.config
    if c.memory_limit is None:
        return result
    from fxsplit.api.memory import memory_limit_error
    from fxsplit.pipeline.memory import worst

    cap = float(c.memory_limit)
    for _ in range(_MEMORY_TIGHTENINGS):
        over = worst(result.memory()).peak - c.memory_limit
        if over <= 0:
            return result
        cap -= over
        if cap <= 0:
            break
        try:
            gm = PassManager([functools.partial(split_pass, memory_limit=cap)], debug=c.debug)(result.graph, ctx).graph_module
        except (SplitError, PlanError):
            break  # no split within the lowered cap: the last one's figures name what does not fit
        result = _assemble(c, gm, ctx, result.stage_ranks, time.perf_counter() - result.plan_seconds)
    if worst(result.memory()).peak > c.memory_limit:
        raise memory_limit_error(result)
    return result


def _assemble(config: ParallelConfig, gm: torch.fx.GraphModule, ctx: PassContext, stage_ranks: tuple[int, ...],
              t0: float) -> Plan:
    """The Plan of ``gm`` after the split pass: stage graphs (checkpointed), schedule, communication."""
    tp_result = ctx.report.get("tensor_parallel", TPPlan.identity())
    split = ctx.report["pipeline_split"]
    stages = split.build(gm)
    _checkpoint_stages(stages, split.checkpointing, config.debug, ctx)
    sched = _schedules.build(config.schedule, config.pp, config.microbatches, stages_per_rank=config.stages_per_rank,
                             **_schedule_options(config, split))
    placed = _schedules.validate(sched).stage_ranks
    if placed != stage_ranks:  # the builder and its placement agree (a bug of fxsplit otherwise)
        raise PlanError(f"schedule {config.schedule!r} runs stages on ranks {placed}, but its placement is {stage_ranks}")
    comm = {fwd: plan_all_communication(sched, stages.io, num_ranks=config.pp, rank_of_stage=stage_ranks.__getitem__,
                                        forward_only=fwd) for fwd in (False, True)}
    return Plan(
        config=config, graph=gm, split=split, stages=stages, schedule=sched, tp_plan=tp_result,
        pass_report=dict(ctx.report), plan_seconds=time.perf_counter() - t0, comm=comm[False],
        forward_comm=comm[True], stage_ranks=stage_ranks,
    )


def with_global_batch(config: ParallelConfig, global_batch_size: int | None) -> ParallelConfig:
    """``config`` (resolved) with ``microbatch_size`` = B / (dp * dp_shard * m) for a global batch
    of B samples per step ([Note: a static batch] in fxsplit.graph.examples); PlanError when B does
    not divide into equal microbatches (they would differ by one sample, which a static trace
    cannot serve) or disagrees with a given ``microbatch_size``."""
    if global_batch_size is None:
        return config
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise PlanError(f"global_batch_size must be an int >= 1, got {global_batch_size!r}")
    per = config.dp * config.dp_shard * config.microbatches
    if global_batch_size % per:
        raise PlanError(f"global_batch_size={global_batch_size} does not divide into dp * dp_shard * microbatches = "
                        f"{config.dp} * {config.dp_shard} * {config.microbatches} = {per} equal microbatches; pick a "
                        f"multiple of {per}, or leave global_batch_size out (the batch is then traced symbolic)")
    b = global_batch_size // per
    if config.microbatch_size is not None and config.microbatch_size != b:
        raise PlanError(f"microbatch_size={config.microbatch_size} disagrees with global_batch_size={global_batch_size} "
                        f"/ {per} = {b}; give one of them")
    return dataclasses.replace(config, microbatch_size=b)


def _checkpoint_modes(config: ParallelConfig) -> tuple[str, ...]:
    """The checkpointing modes the schedule can run: torch's selective checkpoint allows one
    backward per region, and a split backward on autograd (I, then W) runs two, so "selective" is
    refused there ("auto" chooses between "none" and "full"); ``split_backward="graph"`` traces
    one backward, split afterwards, so every mode runs. ``zb_auto`` is built from the split's
    costs, after it; it splits the backward like the other zero-bubble schedules."""
    split = _schedules.schedule_spec(config.schedule).splits_backward
    if not split or config.split_backward == "graph":  # one traced backward per region: any mode
        return ("none", "selective", "full")
    if config.activation_checkpointing == "selective":
        raise PlanError(
            f"activation_checkpointing='selective' cannot run with schedule={config.schedule!r}: its backward is "
            "split into I and W (two autograd passes over each region) and torch's selective checkpoint allows "
            "one; use activation_checkpointing='full' (or 'auto'), or a schedule without a split backward")
    return ("none", "full")


def _checkpoint_stages(stages: StageGraphs, modes: tuple[str, ...], debug: str | None, ctx: PassContext) -> None:
    """Run the activation-checkpointing pass on every stage graph with its mode (in place; per
    stage dumps under ``debug/stage_<s>``)."""
    if all(m == "none" for m in modes):
        return
    from pathlib import Path

    from fxsplit.passes.activation_checkpointing import activation_checkpointing

    for s, (gm, mode) in enumerate(zip(stages.modules, modes)):
        if mode != "none":
            PassManager([functools.partial(activation_checkpointing, mode=mode)],
                        debug=str(Path(debug) / f"stage_{s}") if debug else False)(gm, ctx)


def stage_costs(split: SplitPlan) -> dict[str, tuple[float, ...]]:
    """The split's per-stage estimates ([Note: F, I, W estimates] in fxsplit.pipeline.split) as
    ``{"forward", "backward", "backward_input", "backward_weight", "comm": one value per stage}``.
    A stage whose cost model gives no forward time (a stand-in without costs) gets a third of its
    time for each of F, I and W."""
    out: dict[str, list[float]] = {k: [] for k in ("forward", "backward", "backward_input", "backward_weight", "comm")}
    for st in split.stages:
        f, i, w = st.forward_time, st.input_grad_time, st.weight_grad_time
        if f + i + w <= 0:
            f = i = w = st.time / 3
        out["forward"].append(f)
        out["backward_input"].append(i)
        out["backward_weight"].append(w)
        out["backward"].append(i + w)
        out["comm"].append(st.comm_time)
    return {k: tuple(v) for k, v in out.items()}


def _schedule_options(config: ParallelConfig, split: SplitPlan) -> dict[str, Any]:
    """What a cost-driven schedule (``zb_auto``) is built from: the split's per-stage F, I, W and
    comm estimates and, per rank, how many microbatches' activations fit: with ``memory_limit``,
    ``(limit - training state of the stage's parameters) // activation bytes per microbatch``
    (the split fitted p of them, so at least p); without it p, 1F1B's peak (ZB-1p)."""
    if not _schedules.schedule_spec(config.schedule).built_from_costs:
        return {}
    costs = stage_costs(split)
    m, p = config.microbatches, config.pp
    limits = [p] * p
    if config.memory_limit is not None and split.problem is not None:
        state = split.problem.state_bytes_per_param_byte
        for st in split.stages:
            room = config.memory_limit - state * st.param_bytes
            fit = int(room // st.activation_bytes) if st.activation_bytes > 0 else m
            limits[st.rank] = max(p, min(fit, m))
    return dict(forward=costs["forward"], backward_input=costs["backward_input"],
                backward_weight=costs["backward_weight"], comm=costs["comm"], max_inflight=tuple(limits))


def _loss_seconds(gm: torch.fx.GraphModule, hardware: Hardware) -> float:
    """Estimated forward+backward time of a loss over the model's outputs (a cross-entropy-like
    loss reads each output element a few times), charged to the last stage by the balancer."""
    from fxsplit.graph.cost import NodeCost, estimate_time
    from fxsplit.pipeline.split import example_bindings

    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    binds = example_bindings(gm)
    total = 0.0
    for node in out.all_input_nodes:
        info = node.meta.get("fxsplit")
        for t in (info.outputs if info is not None else ()):
            if t.dtype.is_floating_point:
                nbytes = substitute(t.nbytes, binds)
                numel = nbytes / t.dtype.itemsize
                total += estimate_time(
                    NodeCost(flops=int(8 * numel), bytes_read=int(3 * nbytes), bytes_written=int(2 * nbytes)),
                    flops_per_s=hardware.flops_per_s, bytes_per_s=hardware.bytes_per_s, backward=False,
                )
    return total


def _follows(config: ParallelConfig, model: nn.Module) -> bool:
    """Whether torch.export's static sequence is made to follow each step's length ([Note: following the
    sequence from two static traces] in fxsplit.graph.sequence): only when ``config.follow_sequence``
    asks, with real weights (a meta-device plan is for planning: no second trace). Not by default: the
    second trace costs plan time (1.6-2x on small models), and generation's KV cache of an exported
    graph is built from the static trace ([Note: KV cache for exported graphs] in fxsplit.api.kv_export)."""
    if not config.follow_sequence or config.cp > 1 or config.pad_sequence is False:
        return False
    return not any(p.is_meta for p in model.parameters())
