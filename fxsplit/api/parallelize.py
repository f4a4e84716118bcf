"""``fxsplit.parallelize``: plan on every rank, keep this rank's stages, materialize its shards, run.

Terms as in :mod:`fxsplit.api.plan`.

[Note: what every rank does]
Every rank plans the same model the same way (planning is deterministic), keeps only the stages
of its pipeline rank, copies their structure without copying tensors, and materializes only its
tensor-parallel shard of each parameter: sliced from the model's real weights, or freshly
initialized when the model lives on the meta device. The user's model is never modified.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import itertools
import logging
import warnings
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from fxsplit.api.materialize import (keep_own_experts, materialize_sharded_stage, materialize_stage,
                                     share_tied_on_rank)
from fxsplit.api.model import ParallelModel
from fxsplit.api.options import ParallelConfig, make_config
from fxsplit.api.plan import Plan, plan
from fxsplit.errors import ArgumentTypeError, PlanError, UsageError
from fxsplit.hardware import Hardware
from fxsplit.pipeline.rank_plan import RankPlan
from fxsplit.runtime import PipelineRuntime, RuntimeOptions
from fxsplit.runtime.data_parallel import DataParallelGrads
from fxsplit.runtime.fsdp import ShardedGradSync
from fxsplit.runtime.mesh import Groups, fsdp_mesh
from fxsplit.runtime.watch import Watch, group_wait, host_blocking
from fxsplit.tp.ring import ring_on_cuda

__all__ = ["parallelize", "planning_config"]

_log = logging.getLogger("fxsplit")


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
    config: ParallelConfig | None = None,
    strategy: str | None = None,
    global_batch_size: int | None = None,
    **options: Any,
) -> ParallelModel:
    """Parallelize ``model`` over dp x dp_shard x tp x pp processes (inside a torchrun launch); returns this
    rank's :class:`ParallelModel`. Options are those of :func:`plan` (the fields of
    :class:`fxsplit.ParallelConfig`, as keywords or ``config=``). The process group is
    initialized from torchrun's environment when needed (NCCL with CUDA, else gloo), and the mesh
    built from it unless ``mesh=`` gives a DeviceMesh with dims ("dp", "pp", "tp") over every rank
    (("dp", "dp_shard", "pp", "tp") with ``dp_shard`` > 1: each rank's stages are then sharded
    with torch FSDP2 over dp_shard, :mod:`fxsplit.runtime.fsdp`).

    Bad requests (world size != dp * tp * pp, a mesh of another shape, microbatches < pp) raise
    on every rank before any collective. ``timeout`` bounds every wait on another rank; a failure
    on any rank in ``step()`` / ``forward()`` raises on every rank, naming it ([Note: failures]
    at ``ParallelModel._agree``).

    ``global_batch_size=B`` without ``strategy``: the batch traced static at B / (dp * dp_shard * m)
    samples per microbatch, as in :func:`plan`.

    ``strategy="auto"`` searches the layout for the launched world size and ``global_batch_size``
    ([Note: auto plan] in :mod:`fxsplit.api.auto`), on ``hardware`` or, by default, this
    machine's ``Hardware.measure()`` (collective: every rank gets rank 0's figures, so every rank
    picks the same plan); ``ParallelModel.plan`` then carries the prediction and the search."""
    searched = None
    if strategy is not None:
        config, searched = _searched_config(model, example_args, example_kwargs, strategy=strategy, config=config,
                                            options=options, global_batch_size=global_batch_size)
        options, global_batch_size = {}, None  # the pick carries its microbatch_size
    _check_arguments(loss_fn, timeout)
    config = make_config(config, options, where="parallelize")
    if device is not None and torch.device(device).type == "cuda" and torch.device(device).index is not None:
        torch.cuda.set_device(torch.device(device))  # before the process group and any allocation: see _rank_device
    mesh, coords, groups = _process_groups(config, mesh, timeout)
    device = _rank_device(device, mesh.device_type)
    _check_one_gpu_per_rank(device, groups.errors)
    the_plan = plan(model, example_args, example_kwargs, config=planning_config(config, device.type),
                    global_batch_size=global_batch_size)
    _verify(model, example_args, example_kwargs, the_plan, config.verify)
    _warn_fresh_weights(model)
    c = the_plan.config
    pp_rank = coords["pp"]
    stages, units = _materialized(the_plan, model, mesh, coords, groups, device, timeout)
    seed = _agreed_seed(c.seed, groups.errors)  # collective: before the watch starts, as every rank does
    watch = _start_watch(mesh, the_plan, timeout) if dist.get_world_size() > 1 else None
    sharded = None
    if units:  # FSDP2 units, gathered before and reduced after the pipeline ([Note: FSDP collectives
        # outside the pipeline] in fxsplit.runtime.fsdp); they also do the dp mean
        sharded = ShardedGradSync(units)
    grads = _data_parallel(the_plan, stages, groups, watch, sharded)
    runtime = _runtime(the_plan.rank_plan(pp_rank), stages, groups, watch, grads, loss_fn=loss_fn, device=device,
                       timeout=timeout, seed=seed, deferred=sharded is not None, c=c)
    if searched is not None:
        the_plan = _with_search(the_plan, searched)
    return ParallelModel(plan_=the_plan, stages=stages, runtime=runtime, mesh=mesh, coords=coords,
                         groups=groups, loss_fn=loss_fn, grads=grads, log_every=log_every, sharded=sharded,
                         watch=watch)


def planning_config(config: ParallelConfig, device_type: str) -> ParallelConfig:
    """The config every rank of :func:`parallelize` plans with, on a ``device_type`` rank: stages
    costed for the machine they run on (``Hardware.cpu()`` on a CPU rank, unless ``hardware`` is
    given) and no plan-time verification (parallelize verifies the plan itself, after planning)."""
    if config.hardware is None and device_type == "cpu":
        config = dataclasses.replace(config, hardware=Hardware.cpu())
    if device_type == "cuda" and config.cp > 1:  # [Note: the ring on CUDA] in fxsplit.tp.ring
        if config.cp_kv == "ring":
            raise PlanError(ring_on_cuda("cp_kv='ring' on a CUDA rank"))
        config = dataclasses.replace(config, cp_kv="allgather")
    return dataclasses.replace(config, verify=False)


def _searched_config(model: nn.Module, example_args: Any, example_kwargs: Any, *, strategy: str,
                     config: ParallelConfig | None, options: Mapping[str, Any],
                     global_batch_size: int | None) -> tuple[ParallelConfig, Any]:
    """``strategy="auto"``: ``(the picked config, the search)`` for the launched world size, on
    ``hardware`` or this machine's ``Hardware.measure()`` ([Note: auto plan] in fxsplit.api.auto)."""
    from fxsplit.api.auto import choose
    from fxsplit.runtime.mesh import init_from_env

    if strategy != "auto":
        raise PlanError(f"strategy must be 'auto' or None, got {strategy!r}")
    init_from_env()
    if "hardware" not in options and (config is None or config.hardware is None):
        options = {**options, "hardware": Hardware.measure()}
    world = dist.get_world_size() if dist.is_initialized() else 1
    return choose(model, example_args, example_kwargs, config=config, options=options,
                  world_size=world, global_batch_size=global_batch_size, where="parallelize")


def _check_arguments(loss_fn: Any, timeout: Any) -> None:
    if loss_fn is not None and not callable(loss_fn):
        raise ArgumentTypeError(f"loss_fn must be callable (output, target) -> scalar tensor, got {type(loss_fn).__name__}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise UsageError(f"timeout must be a number of seconds > 0 (the longest any wait on another rank "
                         f"may take), got {timeout!r}")


def _process_groups(config: ParallelConfig, mesh: Any, timeout: float) -> tuple[Any, dict, Groups]:
    """``(mesh, coords, groups)``: the process group joined, the mesh built (or the given one
    checked), and every group this rank's runtime and model use, each wait bounded by ``timeout``."""
    from fxsplit.runtime.mesh import build_groups, build_mesh, check_mesh, init_from_env, mesh_coords

    dp, tp, pp, ds, cp = config.dp, config.tp, config.pp, config.dp_shard, config.cp
    # the rendezvous waits for every rank to start: bounded by `timeout`, but never below 30 s,
    # since ranks reach it after importing torch and building the model at their own pace
    init_from_env(timeout_s=max(float(timeout), 30.0))
    if mesh is None:
        mesh = build_mesh(dp=dp, pp=pp, tp=tp, dp_shard=ds, cp=cp)
    else:
        check_mesh(mesh, dp, pp, tp, dp_shard=ds, cp=cp)
    if dist.is_initialized() and mesh.mesh.numel() != dist.get_world_size():
        raise PlanError(
            f"the mesh covers {mesh.mesh.numel()} ranks but the default process group has "
            f"{dist.get_world_size()}; fxsplit runs on every rank of the default group: build the mesh "
            f"over all of them (fxsplit.runtime.mesh.build_mesh(dp=..., pp=..., tp=...))"
        )
    coords = mesh_coords(mesh)
    # [Note: process groups] in fxsplit.runtime.mesh; [Note: failures]: flag all-reduces over every
    # rank on a group of their own, and the runtime its own pipeline group, which it gives up on a failure
    groups = build_groups(mesh, ep=config.ep, timeout=datetime.timedelta(seconds=timeout))
    return mesh, coords, groups


def _materialized(the_plan: Any, model: nn.Module, mesh: Any, coords: Mapping[str, int], groups: Groups,
                  device: torch.device, timeout: float) -> tuple[dict, dict | None]:
    """``(stages, FSDP units or None)``: this rank's stages of ``the_plan``, each holding only its
    shards ([Note: what every rank does])."""
    c = the_plan.config
    mine = the_plan.stages_of(coords["pp"])
    units = None
    if c.dp_shard > 1:  # FSDP units ([Note: FSDP units and reshard_after_forward] in fxsplit.runtime.fsdp),
        # each rank materializing only its shards ([Note: materializing FSDP shards])
        # with cp, over dp_shard x cp, dividing by the data ranks only ([Note: FSDP over cp] in fxsplit.runtime.mesh)
        shards = fsdp_mesh(mesh, timeout=datetime.timedelta(seconds=timeout))
        units = stages = {
            s: materialize_sharded_stage(the_plan, s, tp_rank=coords["tp"], source=model, mesh=shards,
                                         device=device, mp_policy=c.mp_policy,
                                         ep_rank=groups.ep.rank() if c.ep > 1 else 0,
                                         divide_factor=c.dp * c.dp_shard if c.cp > 1 else None) for s in mine
        }
    else:
        stages = {
            s: materialize_stage(the_plan, s, tp_rank=coords["tp"], source=model, device=device) for s in mine
        }
        # one Parameter per tied group on this rank (FSDP shards each stage as its own unit, so
        # with dp_shard the copies stay apart and the memory model counts each)
        share_tied_on_rank(stages, the_plan.stages.shared_params)
    if c.ep > 1 and units is None:  # (with dp_shard, materialized as their blocks already)
        keep_own_experts(stages, the_plan.ep_plan, groups.ep.rank())
    return stages, units


def _with_search(the_plan: Any, searched: Any) -> Any:
    """The plan of an automatic layout, carrying the search and its prediction, the memory figure
    its own (built) plan's ([Note: the pick's memory is its plan's] in fxsplit.api.auto)."""
    from fxsplit.pipeline.memory import worst

    mem = worst(the_plan.memory())
    searched = searched.with_pick(0, mem, "built")
    return dataclasses.replace(the_plan, predicted_step_time=searched.best.step_time,
                               predicted_memory=mem.as_dict(), search=searched,
                               predicted_breakdown=searched.best.breakdown)


def _data_parallel(the_plan: Plan, stages: Mapping[int, nn.Module], groups: Groups, watch: Watch | None,
                   sharded: ShardedGradSync | None) -> DataParallelGrads:
    """This rank's data-parallel gradient mean (fxsplit.runtime.data_parallel), the runtime's hooks."""
    c = the_plan.config
    # parameters shared between stages (tied weights): their gradients are final only after the
    # runtime sums them across stages, so their data-parallel all-reduce waits for the end
    tied = [stages[s].get_parameter(name) for grp in the_plan.stages.shared_params for s, name in grp if s in stages]
    # expert weights placed by ep: reduced over their replicas only ([Note: expert gradients])
    names = set(the_plan.ep_plan.expert_params) if c.ep > 1 else set()
    experts = [p for m in stages.values() for name, p in m.named_parameters() if name in names]
    return DataParallelGrads(stages, dp=groups.dp, ep_replica=groups.ep_replica, tied=tied, experts=experts,
                             wait=group_wait(watch, polled=host_blocking(groups.pipe)), cp=c.cp,
                             data_ranks=c.dp * c.dp_shard, sharded=sharded, overlap=c.num_stages > 1,
                             reduce_dtype=c.mp_policy.reduce_dtype if c.mp_policy is not None else None)


def _runtime(rank_plan: RankPlan, stages: Mapping[int, nn.Module], groups: Groups, watch: Watch | None,
             grads: DataParallelGrads, *, loss_fn: Callable | None, device: torch.device, timeout: float,
             seed: int, deferred: bool, c: ParallelConfig) -> PipelineRuntime:
    """This rank's pipeline runtime over its stages."""
    return PipelineRuntime(rank_plan, stages, RuntimeOptions(
        group=groups.pipe,
        loss_fn=_checked_loss(loss_fn) if loss_fn is not None else None, device=device, timeout=timeout,
        abort_on_error=c.pp > 1,  # with pp == 1 there is no pipeline group to destroy (not the world's)
        seed=seed,
        reduce_dtype=c.mp_policy.reduce_dtype if c.mp_policy is not None else None,
        split_backward=c.split_backward, compile=c.compile, fuse_backward=c.fuse_backward, watch=watch,
        grad_hooks=grads,
        defer_tied_grads=deferred,  # summed once FSDP has reduced them
    ))


def _rank_device(device: torch.device | str | None, mesh_device_type: str) -> torch.device:
    """This rank's device, made torch's current CUDA device: NCCL's object collectives
    (``all_gather_object``, ``broadcast_object_list``: full_state_dict, checkpoints, outputs gathered
    to every rank) and the communicators torch creates lazily use the current device, not the
    tensors', so a current device other than the stages' would put them on another GPU."""
    if device is None:
        device = "cuda" if mesh_device_type == "cuda" else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is None:  # set by init_from_env (LOCAL_RANK), DeviceMesh or the user
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def _check_one_gpu_per_rank(device: torch.device, group: Any) -> None:
    """Refuse, on every rank, ranks sharing a GPU (a process group the user made without
    ``torch.cuda.set_device`` puts every rank on cuda:0), before NCCL hangs or fails on it."""
    if device.type != "cuda" or group is None:
        return
    import socket

    from fxsplit.runtime.mesh import shared_gpus

    props = torch.cuda.get_device_properties(device)
    mine = (socket.gethostname(), str(getattr(props, "uuid", f"cuda:{device.index}")))
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)  # the gloo "errors" group: no GPU involved
    shared = shared_gpus(every)
    if shared:
        lines = "; ".join(f"global ranks {ranks} all use GPU {gpu} on host {host}" for (host, gpu), ranks in shared.items())
        raise UsageError(
            f"parallelize: {lines}, but NCCL needs a GPU of its own per rank. Call torch.cuda.set_device(local_rank) "
            "before parallelize (torchrun sets LOCAL_RANK; fxsplit.runtime.mesh.init_from_env does this when it makes "
            "the process group), or pass device=f'cuda:{local_rank}'; with fewer GPUs than ranks, run on the CPU "
            "over gloo (fxsplit.runtime.mesh.choose_backend)")


_WATCHES = [0]  # parallelize calls in this process: every rank makes the same calls in one order


def _start_watch(mesh: Any, the_plan: Any, timeout: float) -> Any:
    """This rank's :class:`~fxsplit.runtime.watch.Watch` on the rendezvous store, describing every
    global rank by its mesh coordinates and stages ([Note: failure protocol])."""
    from fxsplit.runtime.watch import Watch

    grid = mesh.mesh
    names = mesh.mesh_dim_names
    where = {}
    for index in itertools.product(*(range(n) for n in grid.shape)):
        coords = dict(zip(names, index))
        stages = the_plan.stages_of(coords["pp"])
        held = f"stage {stages[0]}" if len(stages) == 1 else "stages " + ", ".join(map(str, stages))
        where[int(grid[index])] = (f"global rank {int(grid[index])} ("
                                   + ", ".join(f"{k} {v}" for k, v in coords.items()) + f") holding {held}")
    _WATCHES[0] += 1
    # the store every rank joined the default group through; torch has no public getter for it
    store = dist.distributed_c10d._get_default_store()
    return Watch(store, prefix=f"fxsplit/parallelize-{_WATCHES[0]}", rank=dist.get_rank(),
                 world_size=dist.get_world_size(), timeout=timeout,
                 describe=lambda r: where.get(r, f"global rank {r}"))


def _warn_fresh_weights(model: nn.Module) -> None:
    """One warning (global rank 0) when the model's parameters are on the meta device: each rank then
    initializes its shards fresh, and a user who meant to train their weights would not know."""
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if not meta or (dist.is_initialized() and dist.get_rank() != 0):
        return
    warnings.warn(
        f"fxsplit.parallelize: {len(meta)} of the model's parameters are on the meta device (e.g. {meta[0]!r}); "
        "every rank initializes its shards with FRESH random values (fxsplit.tp.sharding.default_init), not "
        "trained weights. Load weights after with pm.load_checkpoint(dir), or build the model on a real device",
        UserWarning, stacklevel=3)


def _verify(model: nn.Module, example_args: Any, example_kwargs: Any, the_plan: Any, mode: bool | None) -> None:
    """[Note: plan-time verification]: every rank checks the plan in its own process (the same
    deterministic answer everywhere, so a mismatch raises on every rank, before any collective)."""
    from fxsplit.api.verify import auto_verify_reason, verify
    from fxsplit.graph.examples import batch_of

    if mode is False:
        return
    if mode is None:
        why_not = auto_verify_reason(model, the_plan)
        ep = the_plan.config.ep
        batch = batch_of((tuple(example_args) if isinstance(example_args, (tuple, list)) else (example_args,),
                          dict(example_kwargs or {})))
        if why_not is None and ep > 1 and (batch is None or batch % ep):
            why_not = f"the example batch of {batch} does not split into ep={ep} slices (one per expert-parallel rank)"
        if why_not is not None:
            _log.info("fxsplit: not verifying the plan (verify=None): %s", why_not)
            return
    report = verify(model, example_args, the_plan, example_kwargs, reference="graph", quiet=True)
    _log.info("fxsplit: %s", report)


def _agreed_seed(seed: int | None, group: Any) -> int:
    """The seed of the RNG streams ([Note: RNG streams] in fxsplit.tp.random): ``seed``, or
    ``torch.initial_seed()`` of global rank 0 (the user's ``torch.manual_seed``) broadcast to every
    rank, so that ranks seeded differently (or not at all) still draw replicated masks alike."""
    if seed is not None:
        return seed
    box = torch.tensor([torch.initial_seed() & ((1 << 63) - 1)], dtype=torch.int64)
    if group is not None and dist.get_world_size() > 1:
        dist.broadcast(box, dist.get_global_rank(group, 0), group=group)
    return int(box.item())


def _checked_loss(loss_fn: Callable) -> Callable:
    """``loss_fn`` wrapped to check its result: a scalar tensor (the mean over the microbatch,
    [Note: loss weighting]) that can be differentiated when training."""

    @functools.wraps(loss_fn)
    def wrapped(output: Any, target: Any) -> torch.Tensor:
        loss = loss_fn(output, target)
        if not isinstance(loss, torch.Tensor):
            raise UsageError(
                f"loss_fn must return a scalar tensor, got a {type(loss).__name__} ({loss!r:.40}); return "
                "the loss tensor itself, not loss.item() or a Python number"
            )
        if loss.dim() != 0:
            raise UsageError(
                f"loss_fn must return a scalar tensor (the mean over the microbatch), got a tensor of shape "
                f"{tuple(loss.shape)}; reduce it, e.g. return loss.mean() (a sum over samples gives wrong "
                "gradients when batches are split into microbatches: see fxsplit.runtime.microbatch)"
            )
        if torch.is_grad_enabled() and not loss.requires_grad:
            raise UsageError(
                "loss_fn returned a tensor that does not require grad, so no gradient can reach the "
                "model; compute it from the model output without .detach(), .item() or torch.no_grad()"
            )
        return loss

    return wrapped
