"""The one-line API: ``fxsplit.plan`` (single process, no weights needed) and ``fxsplit.parallelize``.

Terms: d, t, p data-, tensor- and pipeline-parallel degrees (world size d * t * p, mesh dims
("dp", "pp", "tp"), tp innermost); v stages per pipeline rank (S = p * v stages, rank r holds
stages r, r + p, ...); m microbatches per step.

    plan = fxsplit.plan(model, (idx,), tp=2, pp=2)        # pure: trace -> passes -> TP -> split -> schedule
    print(plan); plan.simulate(); plan.to_dot("g.dot"); plan.timeline("pp.png")

    pm = fxsplit.parallelize(model, (idx,), loss_fn=F.cross_entropy, tp=2, pp=2)   # under torchrun
    opt = torch.optim.AdamW(pm.parameters())
    loss = pm.step(idx, target=y); opt.step(); opt.zero_grad()

[Note: what every rank does]
Every rank plans the same model the same way (planning is deterministic), keeps only the stages
of its pipeline rank, copies their structure without copying tensors, and materializes only its
tensor-parallel shard of each parameter: sliced from the model's real weights, or freshly
initialized when the model lives on the meta device. The user's model is never modified.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx
from torch import nn

from . import schedules as _schedules
from .pass_api import PassContext, PassManager
from .split import Hardware, SplitPlan
from .stage import StageGraphs
from .trace import trace
from .failures import RankFailedError
from .parallel_model import ParallelModel, load_full_checkpoint

__all__ = [
    "ParallelConfig", "Plan", "plan", "parallelize", "ParallelModel", "PlanError", "RankFailedError",
    "load_full_checkpoint",
]

log = logging.getLogger(__name__)

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


class PlanError(ValueError):
    """A parallelization request that cannot be planned; the message says what to change."""


@dataclass(frozen=True)
class ParallelConfig:
    """The degrees and options of a plan (validated on creation)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    schedule: str = "interleaved_1f1b"
    stages_per_rank: int = 1
    split_points: tuple[str, ...] | None = None
    tp_plan: Mapping[str, str] | None = None
    memory_limit: float | None = None
    sequence_parallel: bool = False
    vocab_parallel_loss: bool = False

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "microbatches", "stages_per_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name} must be an int >= 1, got {value!r}")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.pp > 1 and self.microbatches < self.pp:
            raise PlanError(
                f"microbatches={self.microbatches} < pp={self.pp}: every pipeline rank needs at least "
                f"one microbatch in flight; use microbatches >= {self.pp} (2 * pp = {2 * self.pp} is a good start)"
            )

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


@dataclass(frozen=True)
class Plan:
    """Everything decided before any process starts: printable, comparable, no weights needed.

    ``graph`` is the traced graph after user passes and tensor parallelism (shared by all tp
    ranks: shard offsets are read from the tp group at run time); ``stages`` its stage
    GraphModules; ``split`` the balanced partition; ``schedule`` the per-rank action lists.
    """

    config: ParallelConfig
    graph: torch.fx.GraphModule
    split: SplitPlan
    stages: StageGraphs
    schedule: list
    tp_plan: Any = None
    pass_report: Mapping[str, Any] = field(default_factory=dict)
    plan_seconds: float = 0.0

    # -- inspection
    def stage_graph(self, stage: int, tp_rank: int = 0) -> torch.fx.GraphModule:
        """The fx GraphModule of ``stage``. Every tp rank runs the same graph on its own shards
        (its offsets come from the tp group at run time), so ``tp_rank`` only checks the range."""
        if not 0 <= stage < self.config.num_stages:
            raise IndexError(f"stage {stage} out of range: the plan has {self.config.num_stages} stages")
        if not 0 <= tp_rank < self.config.tp:
            raise IndexError(f"tp_rank {tp_rank} out of range: tp={self.config.tp}")
        return self.stages.modules[stage]

    def simulate(self, comm: float | None = None):
        """The schedule simulated with the split's estimated stage times (one rank's share costs
        v x the bottleneck stage; forward 1/3, backward 2/3 of it)."""
        per_rank = self.split.bottleneck * self.config.stages_per_rank
        link = self.split.problem.bandwidth if self.split.problem is not None else float("inf")
        if comm is None:
            boundary = max((s.bytes_out for s in self.split.stages), default=0.0)
            comm = boundary / link if link not in (0.0, float("inf")) else 0.0
        return _schedules.simulate(self.schedule, forward=per_rank / 3, backward=2 * per_rank / 3, comm=comm)

    def to_dot(self, path: str | None = None) -> str:
        return self.split.to_dot(self.graph, path)

    def timeline(self, path: str) -> str:
        _schedules.timeline_png(self.simulate(), path, title=f"{self.config.schedule}: p={self.config.pp} v={self.config.stages_per_rank} m={self.config.microbatches}")
        return path

    def schedule_grid(self) -> str:
        return _schedules.format_grid(self.schedule)

    def __str__(self) -> str:
        c = self.config
        info = self.graph.meta.get("fxsplit")
        head = [
            f"fxsplit plan: dp={c.dp} tp={c.tp} pp={c.pp} (world size {c.world_size}); "
            f"{c.num_stages} stages (v={c.stages_per_rank}), {c.schedule}, m={c.microbatches}",
            f"traced with {info.method}: {info.reason}" if info is not None else "",
        ]
        if self.tp_plan is not None:
            head.append(str(self.tp_plan))
        sim = self.simulate()
        lines = [h for h in head if h] + [str(self.split)]
        lines.append(
            f"simulated step: {sim.makespan * 1e3:.3f} ms; bubble {100 * sim.bubble_fraction:.1f}% of the step "
            f"(idle/ideal {100 * sim.bubble_ratio:.1f}%); peak in-flight microbatches per rank {list(sim.peak_inflight)}"
        )
        lines.append(f"planned in {self.plan_seconds:.2f}s")
        return "\n".join(lines)


def _default_microbatches(pp: int) -> int:
    return 1 if pp == 1 else 2 * pp


def _resolve_config(
    *, tp, pp, dp, microbatches, schedule, stages_per_rank, split_points, tp_plan, memory_limit,
    sequence_parallel, vocab_parallel_loss,
) -> ParallelConfig:
    m = _default_microbatches(pp) if microbatches is None else microbatches
    if stages_per_rank is None:
        stages_per_rank = 2 if (schedule == "interleaved_1f1b" and pp > 1) else 1
    if pp == 1 and schedule == "interleaved_1f1b":
        schedule = "1f1b"  # one pipeline rank: nothing to interleave
    if schedule == "interleaved_1f1b" and stages_per_rank < 2:
        raise PlanError(
            f"interleaved_1f1b needs stages_per_rank >= 2 (got {stages_per_rank}); use schedule='1f1b' for one stage per rank"
        )
    return ParallelConfig(
        dp=dp, tp=tp, pp=pp, microbatches=m, schedule=schedule, stages_per_rank=stages_per_rank,
        split_points=tuple(split_points) if split_points is not None else None,
        tp_plan=dict(tp_plan) if tp_plan is not None else None, memory_limit=memory_limit,
        sequence_parallel=sequence_parallel, vocab_parallel_loss=vocab_parallel_loss,
    )


def plan(
    model: nn.Module,
    example_args: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    microbatches: int | None = None,
    schedule: str = "interleaved_1f1b",
    stages_per_rank: int | None = None,
    passes: Sequence[Callable] = (),
    split_points: Sequence[str] | None = None,
    tp_plan: Mapping[str, str] | None = None,
    memory_limit: float | None = None,
    sequence_parallel: bool = False,
    vocab_parallel_loss: bool = False,
    method: str = "auto",
    leaf_modules: Sequence[Any] = (),
    hardware: Hardware = Hardware(),
    cut_at: str = "any",
    debug: str | None = None,
) -> Plan:
    """Plan ``model`` for dp x tp x pp in this process: trace, user passes, tensor parallelism,
    balanced pipeline split, schedule. No process group and no weights needed (meta is fine).

    ``microbatches`` defaults to 2 * pp; ``stages_per_rank`` to 2 for interleaved 1F1B;
    ``passes`` are user passes ``(gm, ctx) -> PassResult`` run first, through a PassManager
    (``debug`` names a folder for per-pass dumps). ``hardware`` is what stage times are estimated
    for (``parallelize`` on CPU uses ``Hardware.cpu()``); ``cut_at="modules"`` lets stages start
    only where a module call begins.
    """
    t0 = time.perf_counter()
    config = _resolve_config(
        tp=tp, pp=pp, dp=dp, microbatches=microbatches, schedule=schedule, stages_per_rank=stages_per_rank,
        split_points=split_points, tp_plan=tp_plan, memory_limit=memory_limit,
        sequence_parallel=sequence_parallel, vocab_parallel_loss=vocab_parallel_loss,
    )
    gm = trace(model, example_args, example_kwargs, method=method, leaf_modules=leaf_modules)
    ctx = PassContext(
        example_args=tuple(example_args) if isinstance(example_args, (tuple, list)) else (example_args,),
        example_kwargs=dict(example_kwargs or {}),
        options={"tp": config.tp, "pp": config.pp, "dp": config.dp},
    )
    pipeline = list(passes)
    tp_result = None
    if config.tp > 1 or config.tp_plan:
        from .passes.tensor_parallel import tensor_parallel

        pipeline.append(
            functools.partial(
                tensor_parallel, tp=config.tp, overrides=config.tp_plan,
                sequence_parallel=config.sequence_parallel, vocab_parallel_loss=config.vocab_parallel_loss,
            )
        )
    from .passes.pipeline_split import pipeline_split

    pipeline.append(
        functools.partial(
            pipeline_split, num_stages=config.num_stages, num_ranks=config.pp, split_points=config.split_points,
            schedule=config.schedule, num_microbatches=config.microbatches,
            memory_limit=config.memory_limit, hardware=hardware, loss_seconds=_loss_seconds(gm, hardware),
            cut_at=cut_at,
        )
    )
    # every pass (the user's, tensor parallel, the split) runs through one PassManager, so the
    # debug dumps (debug=DIR or FXSPLIT_DEBUG_DIR) show each of them
    gm = PassManager(pipeline, debug=debug)(gm, ctx).graph_module
    tp_result = ctx.report.get("tensor_parallel")
    split = ctx.report["pipeline_split"]
    stages = split.build(gm)
    sched_name = "1f1b" if config.schedule == "1f1b" else config.schedule
    sched = _schedules.build(sched_name, config.pp, config.microbatches, stages_per_rank=config.stages_per_rank)
    _schedules.validate(sched)
    return Plan(
        config=config, graph=gm, split=split, stages=stages, schedule=sched, tp_plan=tp_result,
        pass_report=dict(ctx.report), plan_seconds=time.perf_counter() - t0,
    )


def _loss_seconds(gm: torch.fx.GraphModule, hardware: Hardware) -> float:
    """Estimated forward+backward time of a loss over the model's outputs (a cross-entropy-like
    loss reads each output element a few times), charged to the last stage by the balancer."""
    from .cost import NodeCost, estimate_time
    from .split import example_bindings

    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    binds = example_bindings(gm)
    total = 0.0
    for node in out.all_input_nodes:
        info = node.meta.get("fxsplit")
        for t in (info.outputs if info is not None else ()):
            if t.dtype.is_floating_point:
                nbytes = t.nbytes.subs(binds) if hasattr(t.nbytes, "subs") else t.nbytes
                numel = nbytes / t.dtype.itemsize
                total += estimate_time(
                    NodeCost(flops=int(8 * numel), bytes_read=int(3 * nbytes), bytes_written=int(2 * nbytes)),
                    flops_per_s=hardware.flops_per_s, bytes_per_s=hardware.bytes_per_s, backward=False,
                )
    return total


# ------------------------------------------------------------------------------------------------
# per-rank materialization


def _structural_copy(module: nn.Module) -> nn.Module:
    """Copy ``module``'s structure with every parameter/buffer replaced by a meta tensor of the
    same shape (tied tensors stay tied); no tensor data is copied."""
    memo: dict[int, Any] = {}
    for _, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        if id(t) in memo:
            continue
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def _materialize(
    module: nn.Module, *, specs: Mapping[str, Any], tp_rank: int, source: nn.Module, device: torch.device,
    full_shapes: Mapping[str, Sequence[int]] | None = None,
) -> nn.Module:
    from .sharding import materialize_module

    local = _structural_copy(module)
    names = {n for n, _ in local.named_parameters(remove_duplicate=False)} | {n for n, _ in local.named_buffers(remove_duplicate=False)}
    mine = {k: v for k, v in specs.items() if k in names}
    on_meta = any(p.is_meta for p in source.parameters())
    materialize_module(
        local, mine, tp_rank, source=None if on_meta else source, device=device,
        full_shapes={k: v for k, v in (full_shapes or {}).items() if k in names},
    )
    return local


# ------------------------------------------------------------------------------------------------
# the distributed model


def parallelize(
    model: nn.Module,
    example_args: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    mesh: Any = None,
    device: torch.device | str | None = None,
    timeout: float = 300.0,
    log_every: int | None = None,
    **options: Any,
) -> ParallelModel:
    """Parallelize ``model`` over dp x tp x pp processes (inside a torchrun launch); returns this
    rank's :class:`ParallelModel`. Options are those of :func:`plan`. The process group is
    initialized from torchrun's environment when needed (NCCL with CUDA, else gloo), and the mesh
    built from it unless ``mesh=`` gives a DeviceMesh with dims ("dp", "pp", "tp") over every rank.

    Bad requests (world size != dp * tp * pp, a mesh of another shape, microbatches < pp) raise
    on every rank before any collective. ``timeout`` bounds every wait on another rank; a failure
    on any rank in ``step()`` / ``forward()`` raises on every rank, naming it ([Note: failures]
    at ``ParallelModel._agree``)."""
    from .mesh import build_mesh, check_mesh, init_from_env, mesh_coords, mesh_groups
    from .runtime import PipelineRuntime

    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (output, target) -> scalar tensor, got {type(loss_fn).__name__}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0 (the longest any wait on another rank "
                         f"may take), got {timeout!r}")
    dp, tp, pp = options.get("dp", 1), options.get("tp", 1), options.get("pp", 1)
    init_from_env()
    if mesh is None:
        mesh = build_mesh(dp=dp, pp=pp, tp=tp)
    else:
        check_mesh(mesh, dp, pp, tp)
    if dist.is_initialized() and mesh.mesh.numel() != dist.get_world_size():
        raise ValueError(
            f"the mesh covers {mesh.mesh.numel()} ranks but the default process group has "
            f"{dist.get_world_size()}; fxsplit runs on every rank of the default group: build the mesh "
            f"over all of them (fxsplit.mesh.build_mesh(dp=..., pp=..., tp=...))"
        )
    coords = mesh_coords(mesh)
    groups = mesh_groups(mesh)
    # [Note: failures]: flag all-reduces over every rank, on the CPU (gloo); the runtime gets a
    # pipeline group of its own, which it destroys on a failure (the mesh's "pp" group may be the
    # world group itself, and the mesh stays usable for the next parallelize)
    pipe_group = None
    if dist.get_world_size() > 1:
        # a group of its own: data-parallel gradient all-reduces run asynchronously during the
        # pipeline and must never interleave with the flags on one group
        groups["errors"] = dist.new_group(backend="gloo")
        if pp > 1:  # one group per (dp, tp) coordinate, ordered by pp rank; collective on every rank
            chains = mesh.mesh.reshape(dp, pp, tp).permute(0, 2, 1).reshape(-1, pp).tolist()
            pipe_group, _ = dist.new_subgroups_by_enumeration(chains)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    device = torch.device(device)
    if "hardware" not in options and device.type == "cpu":
        options["hardware"] = Hardware.cpu()  # cost the stages for the machine they will run on
    the_plan = plan(model, example_args, example_kwargs, **options)
    c = the_plan.config
    specs = getattr(the_plan.tp_plan, "param_specs", {}) or {}
    full_shapes = {k: tuple(v) for k, v in (getattr(the_plan.tp_plan, "full_shapes", {}) or {}).items()}
    pp_rank = coords["pp"]
    mine = [s for s in range(c.num_stages) if s % c.pp == pp_rank]
    stages = {
        s: _materialize(the_plan.stages.modules[s], specs=specs, tp_rank=coords["tp"], source=model, device=device,
                        full_shapes=full_shapes)
        for s in mine
    }
    runtime = PipelineRuntime(
        stages={s: (stages[s], the_plan.stages.io[s]) for s in mine},
        num_stages=c.num_stages,
        schedule=the_plan.schedule,
        pp_group=pipe_group,
        pp_rank=pp_rank,
        num_ranks=c.pp,
        input_meta=the_plan.stages.input_meta,
        loss_fn=_checked_loss(loss_fn) if loss_fn is not None else None,
        device=device,
        stage_io=the_plan.stages.io,
        shared_params=the_plan.stages.shared_params,
        output_spec=the_plan.stages.output_spec,
        timeout=timeout,
        abort_on_error=c.pp > 1,  # with pp == 1 there is no pipeline group to destroy (not the world's)
    )
    return ParallelModel(plan_=the_plan, stages=stages, runtime=runtime, mesh=mesh, coords=coords,
                         groups=groups, loss_fn=loss_fn, log_every=log_every)


def _checked_loss(loss_fn: Callable) -> Callable:
    """``loss_fn`` wrapped to check its result: a scalar tensor (the mean over the microbatch,
    [Note: loss weighting]) that can be differentiated when training."""

    @functools.wraps(loss_fn)
    def wrapped(output: Any, target: Any) -> torch.Tensor:
        loss = loss_fn(output, target)
        if not isinstance(loss, torch.Tensor):
            raise ValueError(
                f"loss_fn must return a scalar tensor, got a {type(loss).__name__} ({loss!r:.40}); return "
                "the loss tensor itself, not loss.item() or a Python number"
            )
        if loss.dim() != 0:
            raise ValueError(
                f"loss_fn must return a scalar tensor (the mean over the microbatch), got a tensor of shape "
                f"{tuple(loss.shape)}; reduce it, e.g. return loss.mean() (a sum over samples gives wrong "
                "gradients when batches are split into microbatches: see fxsplit.runtime.microbatch)"
            )
        if torch.is_grad_enabled() and not loss.requires_grad:
            raise ValueError(
                "loss_fn returned a tensor that does not require grad, so no gradient can reach the "
                "model; compute it from the model output without .detach(), .item() or torch.no_grad()"
            )
        return loss

    return wrapped
