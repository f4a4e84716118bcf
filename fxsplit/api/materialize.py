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
from torch import nn

from fxsplit.tp.sharding import materialize_module

__all__ = ["materialize_stage", "structural_copy"]


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


def _materialize(
    module: nn.Module, *, specs: Mapping[str, Any], tp_rank: int, source: nn.Module, device: torch.device,
    full_shapes: Mapping[str, Sequence[int]] | None = None, seed_names: Mapping[str, str] | None = None,
) -> nn.Module:
    local = structural_copy(module)
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
