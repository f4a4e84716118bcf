"""Per-rank materialization of a plan's stage modules: this tp rank's real tensors, no more.

Terms as in :mod:`fxsplit.api.plan`. ``parallelize`` builds a rank's stages with
:func:`materialize_stage`; ``fxsplit.verify`` builds every rank's, in one process, the same way.

    local = materialize_stage(plan, stage=0, tp_rank=1, source=model, device="cpu")

See [Note: what every rank does] in :mod:`fxsplit.api.parallelize` and [Note: every buffer keeps
its value] in :mod:`fxsplit.tp.sharding`.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

import torch
import torch.fx
from torch import nn

from fxsplit.tp.sharding import materialize_module, materialize_tensor

__all__ = ["keep_own_experts", "materialize_sharded_stage", "materialize_stage", "on_device", "share_tied_on_rank", "structural_copy"]


def materialize_stage(plan: Any, stage: int, *, tp_rank: int, source: nn.Module,
                      device: torch.device | str = "cpu") -> nn.Module:
    """Stage ``stage`` of ``plan`` (a :class:`fxsplit.Plan`) with tp rank ``tp_rank``'s tensors:
    its shards sliced from ``source`` (the user's model), every buffer and constant with its
    value, parameters of a meta model freshly initialized (tied copies alike)."""
    tp = plan.tp_plan
    return _materialize(
        plan.stages.modules[stage], specs=tp.param_specs, tp_rank=tp_rank, source=source, device=torch.device(device),
        full_shapes={k: tuple(v) for k, v in tp.full_shapes.items()},
        seed_names=_tied_seed_names(plan.stages.shared_params, stage),
    )


def share_tied_on_rank(stages: Mapping[int, nn.Module], shared_params: Sequence[Sequence[tuple[int, str]]]) -> int:
    """Make the stages of one rank that hold the same tied parameter (``StageGraphs.shared_params``:
    tied embeddings under ZB-V, a weight shared across layers in two interleaved stages) hold one
    Parameter object, in place; returns how many copies were dropped. Each stage is materialized
    on its own, so without this a rank would store (and Adam would keep state for) one copy per
    stage; with one object autograd accumulates both stages' gradients into it, which is the sum
    the runtime otherwise forms between the copies ([Note: memory model] counts it once)."""
    from fxsplit.graph.ops import owner_and_leaf

    dropped = 0
    for group in shared_params:
        mine = sorted((s, name) for s, name in group if s in stages)
        if len({s for s, _ in mine}) < 2:
            continue
        keep = stages[mine[0][0]].get_parameter(mine[0][1])
        for s, name in mine[1:]:
            owner, leaf = owner_and_leaf(stages[s], name)
            if owner._parameters[leaf] is not keep:
                owner._parameters[leaf] = keep
                dropped += 1
    return dropped


def keep_own_experts(stages: Mapping[int, nn.Module], ep_plan: Any, ep_rank: int) -> int:
    """Replace every fused expert weight of ``ep_plan`` (``EPPlan.expert_params``) in ``stages`` by
    ep rank ``ep_rank``'s block of experts, rows ``[r * E / ep, (r + 1) * E / ep)`` of dim 0, in
    place ([Note: expert-parallel exchange] in fxsplit.tp.experts); returns how many were replaced.
    The block is copied, so the full tensor materialized before is freed with the old Parameter."""
    from fxsplit.graph.ops import owner_and_leaf

    ep, replaced = ep_plan.ep, 0
    names = set(ep_plan.expert_params)
    for module in stages.values():
        for name, p in list(module.named_parameters()):
            if name not in names:
                continue
            k = p.shape[0] // ep
            owner, leaf = owner_and_leaf(module, name)
            owner._parameters[leaf] = nn.Parameter(p.detach()[ep_rank * k:(ep_rank + 1) * k].clone(),
                                                   requires_grad=p.requires_grad)
            replaced += 1
    return replaced


def structural_copy(module: nn.Module) -> nn.Module:
    """Copy ``module``'s structure with every parameter/buffer replaced by a meta tensor of the
    same shape (tied tensors stay tied); no tensor data is copied."""
    memo: dict[int, Any] = {}
    for _, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        if id(t) in memo:
            continue
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def on_device(gm: nn.Module, device: torch.device | str) -> int:
    """[Note: device literals]: a trace bakes the devices it saw into the graph: torch.export writes
    ``aten.arange(..., device=cpu)``, ``aten.to.device(x, cpu)`` and ``to.dtype_layout(device=cpu)``
    where the model's code said ``device=x.device`` (Hugging Face's position ids, causal masks and
    rotary tables). Traced on the CPU (or on the meta device, or on another rank's GPU) and run on
    this rank's GPU, such a node would make its tensor on the wrong device, or move activations
    off the GPU. A stage runs on one device, so every ``torch.device`` in its graph's arguments
    becomes that device (in place; returns how many changed). Device strings are left alone."""
    device = torch.device(device)
    if not isinstance(gm, torch.fx.GraphModule):
        return 0
    changed = 0

    def fix(arg: Any) -> Any:
        nonlocal changed
        if isinstance(arg, torch.device) and arg != device:
            changed += 1
            return device
        return arg

    # the graphs of higher-order ops too (torch 2.11's export puts a rotary table's no_grad block
    # in a wrap_with_set_grad_enabled subgraph, a GraphModule attribute of the stage)
    for sub in gm.modules():
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        before = changed
        for node in sub.graph.nodes:
            node.args = torch.fx.node.map_aggregate(node.args, fix)
            node.kwargs = dict(torch.fx.node.map_aggregate(node.kwargs, fix))
        if changed != before:
            sub.recompile()
    return changed


def _materialize(
    module: nn.Module, *, specs: Mapping[str, Any], tp_rank: int, source: nn.Module, device: torch.device,
    full_shapes: Mapping[str, Sequence[int]] | None = None, seed_names: Mapping[str, str] | None = None,
) -> nn.Module:
    local = structural_copy(module)
    on_device(local, device)
    names = {n for n, _ in local.named_parameters(remove_duplicate=False)} | {n for n, _ in local.named_buffers(remove_duplicate=False)}
    mine = {k: v for k, v in specs.items() if k in names}
    materialize_module(
        local, mine, tp_rank, source=_value_sources(module, source), device=device,
        full_shapes={k: v for k, v in (full_shapes or {}).items() if k in names}, seed_names=seed_names,
    )
    return local


def _value_sources(stage: nn.Module, model: nn.Module) -> dict[str, torch.Tensor]:
    """Where each tensor of a stage takes its value from ([Note: every buffer keeps its value] in
    fxsplit.tp.sharding): the user's model where it holds the name on a real device, else the
    plan's stage module itself, which holds the constants the trace created (``lifted_tensor_*``
    of torch.export, fx's ``_tensor_constant*``, plain tensor attributes) by reference. Meta
    tensors are left out: they have no value to give."""
    out = {n: t for n, t in [*stage.named_parameters(remove_duplicate=False), *stage.named_buffers(remove_duplicate=False)]
           if not t.is_meta}
    out.update((n, t) for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
               if not t.is_meta)
    return out


def _tied_seed_names(shared_params: Sequence[Sequence[tuple[int, str]]], stage: int) -> dict[str, str]:
    """Stage ``stage``'s names of parameters tied across stages -> one name per tied group (its
    first holder's), so a model on the meta device initializes every copy identically."""
    return {name: sorted(group)[0][1] for group in shared_params for s, name in group if s == stage}


def materialize_sharded_stage(plan: Any, stage: int, *, tp_rank: int, source: nn.Module, mesh: Any,
                              device: torch.device | str = "cpu", mp_policy: Any = None, ep_rank: int = 0,
                              divide_factor: int | None = None) -> nn.Module:
    """Stage ``stage`` as :func:`materialize_stage` makes it, wrapped with FSDP over ``mesh``
    (:func:`fxsplit.runtime.fsdp.shard_stages`), holding only this rank's FSDP shard of its tp
    shard of each parameter.

    [Note: materializing FSDP shards]
    The stage is copied on the meta device with each parameter at its tp-local shape, sharded
    there by ``fully_shard`` (no memory), and given storage for its FSDP shards only
    (``to_empty``). Then one tensor at a time: the tp-local tensor is made exactly as
    :func:`materialize_stage` would make it (sliced from the model's real weights, or freshly
    initialized under the same per-name seeds for a meta model, so values do not depend on
    dp_shard), this rank's FSDP slice is copied out, and the tensor is dropped. Expert weights placed
by ep (``plan.ep_plan``) are left out of FSDP (``ignored_params``: their gradients are reduced over
their replicas only, [Note: expert gradients] in fxsplit.runtime.data_parallel) and hold ep rank ``ep_rank``'s
block of experts, whole. Peak memory is
    the stage's FSDP shards plus one tp-local tensor. Buffers are materialized whole (FSDP does
    not shard buffers)."""
    from fxsplit.graph.ops import owner_and_leaf
    from fxsplit.runtime.fsdp import local_tensor, shard_stages
    from torch.distributed.tensor import distribute_tensor

    tp = plan.tp_plan
    module = plan.stages.modules[stage]
    device = torch.device(device)
    local = structural_copy(module)
    specs = tp.param_specs
    full_shapes = {k: tuple(v) for k, v in tp.full_shapes.items()}
    on_device(local, device)
    seeds = _tied_seed_names(plan.stages.shared_params, stage)
    src = _value_sources(module, source)
    opts = dict(source=src, device=device, full_shapes=full_shapes, seed_names=seeds)
    params: dict[int, list[str]] = {}
    objects: dict[int, torch.Tensor] = {}
    for name, t in local.named_parameters(remove_duplicate=False):
        params.setdefault(id(t), []).append(name)
        objects[id(t)] = t
    buffers: dict[int, list[str]] = {}
    for name, t in local.named_buffers(remove_duplicate=False):
        if t is not None:
            buffers.setdefault(id(t), []).append(name)
            objects[id(t)] = t
    originals = {key: objects[key] for key in (*params, *buffers)}
    ep = plan.config.ep
    experts = {key for key, names in params.items() if ep > 1 and set(names) & set(plan.ep_plan.expert_params)}
    # 1. parameters at their tp-local shape (experts: ep_rank's block), still on the meta device (tied names: one object)
    for key, names in params.items():
        old = objects[key]
        spec = next((specs[n] for n in names if n in specs), None)
        full = next((tuple(full_shapes[n]) for n in names if n in full_shapes), tuple(old.shape))
        shape = tuple(old.shape) if spec is None or tuple(old.shape) != full else spec.local_shape(full)
        if key in experts:
            shape = (shape[0] // ep, *shape[1:])
        new = nn.Parameter(torch.empty(shape, dtype=old.dtype, device="meta"), requires_grad=old.requires_grad)
        for n in names:
            owner, leaf = owner_and_leaf(local, n)
            owner._parameters[leaf] = new
    # 2. FSDP shards on the meta device, then storage for them only
    ignored = {local.get_parameter(params[key][0]) for key in experts}
    local = shard_stages({stage: local}, mesh, mp_policy=mp_policy, ignored={stage: ignored},
                         divide_factor=divide_factor)[stage]
    local.to_empty(device=device)
    with torch.no_grad():
        for key, names in buffers.items():
            value = materialize_tensor(names, originals[key], specs, tp_rank, **opts)
            for n in names:
                owner, leaf = owner_and_leaf(local, n)
                owner._buffers[leaf] = value
        # 3. one tensor at a time: the tp-local value, of which this rank keeps its FSDP slice
        for key, names in params.items():
            value = materialize_tensor(names, originals[key], specs, tp_rank, **opts)
            param = local.get_parameter(names[0])
            if key in experts:
                param.detach().copy_(value.chunk(ep)[ep_rank])
                continue
            piece = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
            local_tensor(param).copy_(local_tensor(piece))
            del value, piece
    return local
