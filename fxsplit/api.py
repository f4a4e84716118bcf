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
import datetime
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
from .split import Hardware, SplitPlan, plan_split
from .stage import StageGraphs
from .trace import flatten_inputs, trace

__all__ = ["ParallelConfig", "Plan", "plan", "parallelize", "ParallelModel", "PlanError", "RankFailedError"]

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
    debug: str | None = None,
) -> Plan:
    """Plan ``model`` for dp x tp x pp in this process: trace, user passes, tensor parallelism,
    balanced pipeline split, schedule. No process group and no weights needed (meta is fine).

    ``microbatches`` defaults to 2 * pp; ``stages_per_rank`` to 2 for interleaved 1F1B;
    ``passes`` are user passes ``(gm, ctx) -> PassResult`` run first, through a PassManager
    (``debug`` names a folder for per-pass dumps).
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
    if pipeline:
        gm = PassManager(pipeline, debug=debug)(gm, ctx).graph_module
        tp_result = ctx.report.get("tensor_parallel")
    split = plan_split(
        gm, num_stages=config.num_stages, num_ranks=config.pp, split_points=config.split_points,
        schedule=config.schedule, num_microbatches=config.microbatches,
        memory_limit=config.memory_limit, hardware=hardware,
    )
    stages = split.build(gm)
    sched_name = "1f1b" if config.schedule == "1f1b" else config.schedule
    sched = _schedules.build(sched_name, config.pp, config.microbatches, stages_per_rank=config.stages_per_rank)
    _schedules.validate(sched)
    return Plan(
        config=config, graph=gm, split=split, stages=stages, schedule=sched, tp_plan=tp_result,
        pass_report=dict(ctx.report), plan_seconds=time.perf_counter() - t0,
    )


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


class ParallelModel(nn.Module):
    """This rank's part of a parallelized model: its stages' modules (local shards) and the
    pipeline runtime. ``parameters()`` are the local shards, so any torch optimizer works."""

    def __init__(self, *, plan_: Plan, stages: Mapping[int, nn.Module], runtime: Any, mesh: Any,
                 coords: Mapping[str, int], groups: Mapping[str, Any], loss_fn: Callable | None,
                 bucket_bytes: int = 25 * 2**20, log_every: int | None = None):
        super().__init__()
        self.plan = plan_
        self.stage_modules = nn.ModuleDict({str(s): m for s, m in stages.items()})
        self._runtime = runtime
        self.mesh = mesh
        self.coords = dict(coords)
        self._groups = dict(groups)
        self.loss_fn = loss_fn
        self._bucket_bytes = bucket_bytes
        self._log_every = log_every
        self._steps = 0
        self.last_step_seconds = 0.0
        self.last_bubble = 0.0  # share of the last step this rank spent blocked on its peers

    # -- inspection
    def local_stage_graphs(self) -> dict[int, torch.fx.GraphModule]:
        return {int(s): m for s, m in self.stage_modules.items()}

    # -- running
    def _bound(self):
        from .collectives import bind_groups

        return bind_groups({"tp": self._groups.get("tp"), "dp": self._groups.get("dp")})

    def _flat(self, args: tuple, kwargs: dict) -> list:
        return flatten_inputs(self.plan.graph, args, kwargs)

    # [Note: failures] set when a step failed inside the runtime on some rank; the pipeline group
    # of that rank is destroyed then, so this model cannot run again.
    _failure: str | None = None

    def step(self, *args: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        """Forward + backward over all microbatches; returns the full-batch loss on every rank
        (averaged over data-parallel replicas). Gradients land in ``self.parameters()``.

        Any batch size B >= m and any sequence length the model allows run without re-planning
        (batch and sequence are traced as symbols). B need not divide by m: the microbatches
        differ by at most one sample and microbatch i's loss is weighted by b_i / B
        ([Note: loss weighting] in fxsplit.runtime.microbatch), which equals the full-batch loss
        and gradients for a loss that is a mean over samples. Errors: [Note: failures].
        """
        if self.loss_fn is None:
            raise RuntimeError(
                "step() needs a loss: this model was parallelized without loss_fn (inference only); "
                "call pm(inputs) for inference, or pass fxsplit.parallelize(..., loss_fn=...) to train"
            )
        self._check_usable("step")
        t0 = time.perf_counter()
        error, loss = None, None
        try:
            flat = self._flat(args, kwargs)
            _check_batch(flat, self.plan, "step")
            if target is None and self.plan.config.num_stages - 1 in self.local_stage_graphs():
                raise ValueError(
                    "step(): this rank holds the last stage, which computes the loss, and needs the "
                    "target: pass step(inputs, target=...) (on every rank is simplest)"
                )
        except Exception as exc:  # noqa: BLE001 -- re-raised on every rank by _agree
            error = exc
        self._agree(error, False, "step")  # before the runtime: no rank enters it alone
        try:
            with self._bound():
                loss = self._runtime.step(flat, target=target)
        except Exception as exc:  # noqa: BLE001 -- re-raised on every rank by _agree
            error = exc
        self._agree(error, True, "step")
        self._sync_grads()
        dp = self._groups.get("dp")
        if dp is not None and dist.get_world_size(dp) > 1:
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=dp)
            loss /= dist.get_world_size(dp)
        self.last_step_seconds = time.perf_counter() - t0
        waited = getattr(self._runtime, "last_wait_seconds", 0.0)
        self.last_bubble = waited / self.last_step_seconds if self.last_step_seconds > 0 else 0.0
        self._steps += 1
        if self._log_every and self._steps % self._log_every == 0:
            log.info(
                "step %d: loss %.6f, %.3fs, measured bubble %.1f%% (time blocked on pipeline peers)",
                self._steps, float(loss), self.last_step_seconds, 100 * self.last_bubble,
            )
        return loss

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Inference through the pipeline; the output in the model's own structure, on every rank.
        Other batch sizes (>= m) and sequence lengths run without re-planning, as in :meth:`step`."""
        self._check_usable("forward")
        error, out = None, None
        try:
            flat = self._flat(args, kwargs)
            _check_batch(flat, self.plan, "forward")
        except Exception as exc:  # noqa: BLE001 -- re-raised on every rank by _agree
            error = exc
        self._agree(error, False, "forward")
        try:
            with self._bound(), torch.no_grad():
                out = self._runtime.forward(flat, all_ranks=True)
        except Exception as exc:  # noqa: BLE001 -- re-raised on every rank by _agree
            error = exc
        self._agree(error, True, "forward")
        return out

    def _check_usable(self, what: str) -> None:
        if self._failure is not None:
            raise RuntimeError(
                f"{what}(): this ParallelModel cannot run again: {self._failure}. The failed rank "
                "destroyed its pipeline process group; build a new one with fxsplit.parallelize(...)"
            )

    def _agree(self, error: Exception | None, in_runtime: bool, what: str) -> None:
        """[Note: failures] Every rank learns whether any rank failed, and all raise together.

        Called twice per step: after the input checks (so that no rank enters the pipeline while a
        peer it waits for refused its inputs) and after the runtime. Each is one all-reduce of a
        4-byte flag over every rank on the happy path (over gloo, waited with the runtime's
        timeout). When some rank failed, every rank gathers the error texts: a rank whose own code
        raised re-raises its exception (same type) with a note naming the other failed ranks;
        every other rank raises :class:`RankFailedError` naming the failed global rank(s), their
        mesh coordinates and their errors. A failure inside the pipeline runtime destroys that
        rank's pipeline group (so its peers stop waiting at once), after which this model refuses
        to run again; errors found before the runtime (bad batch, missing target) leave it usable.
        """
        group = self._groups.get("errors")
        if group is None:  # one process: nobody to tell
            if error is not None:
                raise error
            return
        failure = _exchange_errors(group, error, in_runtime, timeout=self._runtime.timeout,
                                   coords=self.coords, what=what)
        if failure is None:
            return
        worst, exc = failure
        if worst >= 2 and self.plan.config.pp > 1:
            if isinstance(exc, RankFailedError):
                cause = f"on global rank(s) {sorted(exc.failed)}"
            else:
                first = (str(exc).splitlines() or [""])[0]
                cause = f"on this rank ({type(exc).__name__}: {first[:120]}{'...' if len(first) > 120 else ''})"
            self._failure = f"an earlier {what}() failed in the pipeline runtime {cause}"
        raise exc

    def _sync_grads(self) -> None:
        """Data-parallel mean of the gradients (bucketed, asynchronous all-reduces). With sequence
        parallelism the replicated parameters' partial gradients are already summed over tp by
        the graph itself (the tensor-parallel pass reads them through Megatron's f)."""
        dp = self._groups.get("dp")
        if dp is None or dist.get_world_size(dp) == 1:
            return
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        _bucketed_all_reduce(grads, dp, self._bucket_bytes, scale=1.0 / dist.get_world_size(dp))

    # -- state
    def _local_state(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for mod in self.stage_modules.values():
            for k, v in mod.state_dict(keep_vars=False).items():
                out.setdefault(k, v)
        return out

    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor] | None:
        """The original model's state dict (original names and shapes, CPU tensors), gathered from
        every rank's shards; on every rank, or only on global rank 0 with ``rank0_only``."""
        from .sharding import unshard_state_dict

        specs = getattr(self.plan.tp_plan, "param_specs", {}) or {}
        local = {k: v.detach().cpu() for k, v in self._local_state().items()}
        tp = self._groups.get("tp")
        if tp is not None and dist.get_world_size(tp) > 1:
            per_rank: list = [None] * dist.get_world_size(tp)
            dist.all_gather_object(per_rank, local, group=tp)
            local = unshard_state_dict(per_rank, {k: s for k, s in specs.items() if k in local})
        pp = self._groups.get("pp")
        merged = dict(local)
        if pp is not None and dist.get_world_size(pp) > 1:
            parts: list = [None] * dist.get_world_size(pp)
            dist.all_gather_object(parts, local, group=pp)
            merged = {}
            for part in parts:
                for k, v in part.items():
                    merged.setdefault(k, v)
        if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
            return None
        return merged

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
        """Load a full (unsharded) state dict with the original names; each rank keeps its shards."""
        specs = getattr(self.plan.tp_plan, "param_specs", {}) or {}
        tp_rank = self.coords.get("tp", 0)
        missing = []
        for mod in self.stage_modules.values():
            for name, t in [*mod.named_parameters(remove_duplicate=False), *mod.named_buffers(remove_duplicate=False)]:
                if name not in state_dict:
                    missing.append(name)
                    continue
                src = state_dict[name]
                if name in specs:
                    src = specs[name].shard(src, tp_rank)
                if tuple(src.shape) != tuple(t.shape):
                    raise ValueError(f"load_full_state_dict: {name!r} has shape {tuple(src.shape)}, expected {tuple(t.shape)} (after sharding)")
                t.copy_(src)
        if strict and missing:
            raise KeyError(f"load_full_state_dict: missing {sorted(set(missing))[:10]}")

    def save_checkpoint(self, path: str) -> None:
        """Sharded save: each rank writes its own shards (original names) and their shard specs; the
        checkpoint can be loaded under any (dp, tp, pp) with :meth:`load_checkpoint`."""
        import os

        os.makedirs(path, exist_ok=True)
        specs = getattr(self.plan.tp_plan, "param_specs", {}) or {}
        dp_rank = self.coords.get("dp", 0)
        if dp_rank == 0:  # replicas hold the same shards
            local = {k: v.detach().cpu() for k, v in self._local_state().items()}
            torch.save(
                {"tensors": local, "specs": {k: s for k, s in specs.items() if k in local},
                 "tp_rank": self.coords.get("tp", 0), "tp": self.plan.config.tp},
                os.path.join(path, f"shard-pp{self.coords.get('pp', 0)}-tp{self.coords.get('tp', 0)}.pt"),
            )
        if dist.is_initialized():
            dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Load a checkpoint written by :meth:`save_checkpoint` under any (dp, tp, pp)."""
        self.load_full_state_dict(load_full_checkpoint(path))


def load_full_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """Reassemble the full state dict from a sharded checkpoint folder (any process, no group)."""
    import glob
    import os

    from .sharding import unshard_state_dict

    files = sorted(glob.glob(os.path.join(path, "shard-pp*-tp*.pt")))
    if not files:
        raise FileNotFoundError(f"no fxsplit checkpoint shards (shard-pp*-tp*.pt) in {path!r}")
    by_pp: dict[str, list] = {}
    for f in files:
        pp_tag = os.path.basename(f).split("-")[1]
        by_pp.setdefault(pp_tag, []).append(torch.load(f, weights_only=False))
    full: dict[str, torch.Tensor] = {}
    for parts in by_pp.values():
        parts.sort(key=lambda d: d["tp_rank"])
        specs = parts[0]["specs"]
        if len(parts) > 1:
            tensors = unshard_state_dict([p["tensors"] for p in parts], specs)
        else:
            tensors = parts[0]["tensors"]
        for k, v in tensors.items():
            full.setdefault(k, v)
    return full


def _bucketed_all_reduce(grads: Sequence[torch.Tensor], group: Any, bucket_bytes: int, *, scale: float) -> None:
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for g in grads:
        if size and size + g.numel() * g.element_size() > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += g.numel() * g.element_size()
    pending = []
    for bucket in buckets:
        if not bucket:
            continue
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in bucket:
            by_dtype.setdefault(g.dtype, []).append(g)
        for gs in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in gs])
            pending.append((flat, gs, dist.all_reduce(flat, group=group, async_op=True)))
    for flat, gs, work in pending:
        work.wait()
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for g in gs:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()


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
        gloo = str(dist.get_backend()).lower() == "gloo"
        groups["errors"] = dist.group.WORLD if gloo else dist.new_group(backend="gloo")
        if pp > 1:  # one group per (dp, tp) coordinate, ordered by pp rank; collective on every rank
            chains = mesh.mesh.reshape(dp, pp, tp).permute(0, 2, 1).reshape(-1, pp).tolist()
            pipe_group, _ = dist.new_subgroups_by_enumeration(chains)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    device = torch.device(device)
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


class RankFailedError(RuntimeError):
    """Another rank failed a ``step()`` or ``forward()`` call; raised on every rank whose own code
    did not fail ([Note: failures]). ``failed`` maps each failed global rank to its error text."""

    def __init__(self, message: str, *, failed: Mapping[int, str]):
        super().__init__(message)
        self.failed = dict(failed)


# codes of a rank's outcome in the error exchange ([Note: failures]); higher wins
_OK, _BAD_INPUT, _RAISED, _PEER_FAILED = 0, 1, 2, 3


def _exchange_errors(group: Any, error: Exception | None, in_runtime: bool, *, timeout: float,
                     coords: Mapping[str, int], what: str) -> tuple[int, Exception] | None:
    """All-reduce this rank's outcome code over ``group``; None when every rank succeeded, else
    (the highest code, the exception this rank must raise). Waits at most ``timeout`` seconds."""
    from .runtime import PipelineError

    if error is None:
        code = _OK
    elif isinstance(error, PipelineError):
        code = _PEER_FAILED  # waited for a rank that failed: an echo, not a cause
    else:
        code = _RAISED if in_runtime else _BAD_INPUT
    flag = torch.tensor([code], dtype=torch.int32)
    try:
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
        work.wait(datetime.timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001 -- a rank never arrived
        text = (f"{what}(): the end-of-call error check with the other ranks failed or timed out after "
                f"{timeout:g} s ({type(exc).__name__}); some rank crashed, hangs, or did not call "
                f"{what}() (every rank must)")
        if error is not None:
            error.add_note(f"fxsplit: {text}")
            return (_RAISED, error)
        return (_RAISED, RankFailedError(text, failed={}))
    worst = int(flag.item())
    if worst == _OK:
        return None
    me = dist.get_rank()
    report = (me, code, dict(coords), "" if error is None else f"{type(error).__name__}: {error}")
    reports: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, report, group=group)
    causes = [r for r in reports if r[1] in (_BAD_INPUT, _RAISED)] or [r for r in reports if r[1] != _OK]

    def where(r: tuple) -> str:
        return f"global rank {r[0]} ({', '.join(f'{k} {v}' for k, v in r[2].items())})"

    lines = [f"{where(r)}: {r[3]}" for r in causes]
    echoes = [r[0] for r in reports if r[1] == _PEER_FAILED and r not in causes]
    tail = (f"; rank(s) {echoes} stopped waiting for them" if echoes else "")
    if error is not None and code in (_BAD_INPUT, _RAISED):
        mine = report[3]
        same = [r[0] for r in causes if r[0] != me and r[3] == mine]
        others = [line for r, line in zip(causes, lines) if r[0] != me and r[3] != mine]
        if same:
            error.add_note(f"fxsplit: {what}() failed the same way on global rank(s) {same}")
        if others:
            error.add_note(f"fxsplit: {what}() also failed on " + "; ".join(others))
        return (worst, error)
    text = (f"{what}() failed on {len(causes)} rank(s), so it fails on every rank (this is global rank "
            f"{me}): " + "; ".join(lines) + tail + "; their own tracebacks say where.")
    exc = RankFailedError(text, failed={r[0]: r[3] for r in causes})
    if error is not None:
        exc.__cause__ = error
    return (worst, exc)


def _check_batch(flat: Sequence[Any], plan_: Plan, what: str) -> None:
    """Raise ValueError naming the sizes, on the rank that was given them and before any
    communication, when the inputs cannot be split into the plan's microbatches: a batch (dim 0
    of the first tensor input that has one, as fxsplit.runtime.microbatch splits it) smaller than
    m, or microbatch shapes the traced graph does not accept (a size fixed at trace time)."""
    from .runtime.microbatch import bind_symbols, split_microbatches

    config = plan_.config
    m = config.microbatches
    batch = next((x.shape[0] for x in flat if isinstance(x, torch.Tensor) and x.dim() > 0), None)
    if batch is not None and batch < m:
        fix = (f"parallelize(..., microbatches=k) with {config.pp} <= k <= {batch}" if batch >= config.pp
               else f"fewer pipeline ranks (microbatches must be >= pp={config.pp})")
        raise ValueError(
            f"{what}(): batch size {batch} (dim 0 of the inputs) is smaller than microbatches={m}, so a "
            f"microbatch would be empty; pass a batch of at least {m} samples, or use {fix}. (A batch "
            f"size that {m} does not divide is fine: the microbatches then differ by one sample and their "
            "losses are weighted by their sizes.)"
        )
    if len(flat) != len(plan_.stages.input_meta):
        return  # the runtime names the inputs it expected
    split = split_microbatches(flat, m)
    try:  # microbatch sizes differ by at most one: the first and last cover every shape (~20 us)
        for inputs in (split.inputs[0], split.inputs[-1]) if m > 1 else split.inputs:
            bind_symbols(plan_.stages.input_meta, inputs)
    except ValueError as exc:
        raise ValueError(f"{what}(): a batch of {batch} in microbatches={m} gives microbatches of "
                         f"{sorted(set(split.sizes))} samples, which the plan does not accept: {exc}") from None
