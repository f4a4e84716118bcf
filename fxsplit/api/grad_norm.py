"""The gradient norm of the whole parallelized model, and clipping by it (``ParallelModel.clip_grad_norm_``).

Terms as in :mod:`fxsplit.api` (d, t, p; stages). A **local parameter** is one tensor this rank
holds (a tp shard, or a whole replicated tensor); a **contribution** is the sum of
``|g|^p`` (or the max of ``|g|`` for ``p = inf``) over the local gradients a rank counts.

    params = norm_parameters(stage_modules, shared_params=plan.stages.shared_params,
                             sharded=plan.tp_plan.param_specs, coords={"dp": 0, "pp": 1, "tp": 0})
    total = global_norm([p.grad for p in params], 2.0, group=dist.group.WORLD)   # same on every rank
    scale_grads(all_local_params, max_norm, total)

[Note: counting each parameter once]
The model's gradient norm is that of every original parameter's full gradient, each counted
once, which is what ``torch.nn.utils.clip_grad_norm_`` computes on the unsplit model. A
rank's local gradients hold copies (Megatron's clip_grads.py, torchtitan's distributed utils):
- a parameter the TP plan shards (its FQN in ``TPPlan.param_specs``) is split over the t tp ranks,
  each holding a disjoint piece: every tp rank counts its shard (vocabulary padding rows have a
  zero gradient, so they add nothing);
- a parameter the TP plan leaves replicated is whole, with the same gradient, on every tp rank
  (with sequence parallelism the graph sums its partial gradients over tp): tp rank 0 counts it;
- a parameter tied across stages (``StageGraphs.shared_params``: the embedding and the LM head)
  has one copy per stage holding it, each with the summed gradient after the step: only the
  first entry of its group (the lowest stage) counts it;
- data-parallel replicas hold identical gradients after the step's all-reduce: dp rank 0 counts;
- an expert weight placed by ep is split in blocks over the ep ranks of each ep group, and the ep
  groups (expert replicas) hold the same blocks after the step's reduction: the ranks of the first
  ep group (data index < ep, whatever their dp coordinate) count their blocks;
- sharded data parallelism (dp_shard, FSDP) splits each local parameter's gradient into disjoint
  shards over the dp_shard ranks: every dp_shard rank counts its shard (DTensor's local part).
The contributions are summed (max for inf) over every rank in one float32 all-reduce over the
world group, so every rank gets the same total, bit for bit, and then scales ALL its local
gradients (copies included) by the same factor. ``torch.nn.utils.clip_grad_norm_(pm.parameters())``
sees only one rank's gradients: a different norm on every tp and pp rank, so each would clip by
its own factor, and the copies of a tp-replicated or tied parameter would drift apart.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fxsplit.errors import UsageError
from fxsplit.runtime.fsdp import local_tensor

__all__ = ["norm_parameters", "global_norm", "scale_grads", "check_norm_type", "agree_nonfinite"]

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_: clip_coef = max_norm / (total_norm + 1e-6)


def check_norm_type(norm_type: Any) -> float:
    """``norm_type`` as a float p > 0 (``inf`` included); UsageError (a ValueError) naming the value otherwise."""
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        p = float("nan")
    if not p > 0:
        raise UsageError(
            f"clip_grad_norm_: norm_type={norm_type!r} must be a number p > 0 (2.0 for the Euclidean "
            "norm, float('inf') for the largest absolute value)"
        )
    return p


def norm_parameters(
    stage_modules: Mapping[int, nn.Module],
    *,
    shared_params: Sequence[Sequence[tuple[int, str]]],
    sharded: Collection[str],
    coords: Mapping[str, int],
    experts: Collection[str] = frozenset(),
    first_expert_group: bool = True,
) -> list[nn.Parameter]:
    """The local parameters whose gradients this rank counts in the model's norm ([Note:
    counting each parameter once]): distinct Parameters of ``stage_modules`` (stage -> module,
    this rank's stages), dropping the non-first holders of each ``shared_params`` group, the
    parameters not in ``sharded`` (FQNs of tp-sharded parameters) unless ``coords["tp"] == 0``,
    and everything unless ``coords["dp"] == 0`` and ``coords["cp"] == 0`` (context-parallel ranks hold the
    same gradients after the step's all-reduce, as replicas do), except the expert weights placed by
    ep (``experts``), which the ranks of the first ep group count (``first_expert_group``)."""
    replica_zero = coords.get("dp", 0) == 0 and coords.get("cp", 0) == 0
    later_holders = {tuple(entry) for group in shared_params for entry in list(group)[1:]}
    first_tp = coords.get("tp", 0) == 0
    out: list[nn.Parameter] = []
    seen: set[int] = set()
    for stage in sorted(stage_modules):
        for name, param in stage_modules[stage].named_parameters():
            if (stage, name) in later_holders or (name not in sharded and not first_tp) or id(param) in seen:
                continue
            if not (first_expert_group if name in experts else replica_zero):
                continue
            seen.add(id(param))
            out.append(param)
    return out


def global_norm(grads: Iterable[torch.Tensor], norm_type: float, *, group: Any,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """The p-norm over every rank of ``group`` of the gradients each rank counts (``grads``),
    as a float32 0-dim tensor on ``device``, equal on every rank. Collective: every rank of
    ``group`` calls it (with an empty ``grads`` if it counts nothing). ``group=None``: this
    process alone."""
    p = check_norm_type(norm_type)
    grads = list(grads)
    if p == math.inf:
        local = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            if g.numel():
                local = torch.maximum(local, g.detach().abs().max().to(device, torch.float32))
        op = dist.ReduceOp.MAX
    else:
        norms = [torch.linalg.vector_norm(g.detach(), p, dtype=torch.float32).to(device) for g in grads]
        local = torch.stack(norms).pow(p).sum() if norms else torch.zeros((), dtype=torch.float32, device=device)
        op = dist.ReduceOp.SUM
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(local, op=op, group=group)
    return local if p == math.inf else local.pow(1.0 / p)


@torch.no_grad()
def scale_grads(params: Iterable[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Multiply every gradient of ``params`` by ``min(max_norm / (total_norm + 1e-6), 1)``, the
    factor ``torch.nn.utils.clip_grad_norm_`` uses (applied even when it is 1, as torch does)."""
    coef = torch.clamp(float(max_norm) / (total_norm + EPS), max=1.0)
    for param in params:
        if param.grad is not None:  # an FSDP shard (DTensor) scales its local part
            grad = local_tensor(param.grad)
            grad.mul_(coef.to(grad.device))


@torch.no_grad()
def agree_nonfinite(params: Iterable[nn.Parameter], *, group: Any, device: torch.device | str = "cpu") -> bool:
    """Whether any rank of ``group`` holds a non-finite gradient; if one does, make one of this
    rank's gradients non-finite too, so that every rank's ``GradScaler`` skips the step.

    [Note: one skip decision for a GradScaler]
    ``torch.amp.GradScaler.step(optimizer)`` unscales the gradients the optimizer holds, skips the
    step if any is inf/nan, and ``update()`` then halves the scale; the test sees only this rank's
    gradients. On a split model an overflow on one stage or shard (a weight gradient overflowing
    in float16 while the input gradients it sends stay finite, say) would make that rank skip and
    the others step: the replicas of tp-replicated and tied parameters drift apart, and the
    ranks' scales differ from then on. Megatron and FSDP's ``ShardedGradScaler`` all-reduce the
    found-inf flag inside their own scaler; to keep the user's plain ``torch.amp.GradScaler``
    (and its public API: scale, unscale_, step, update) we agree BEFORE it looks: one MAX
    all-reduce of a local "some gradient is not finite" flag over all ranks, and a rank that
    found none but learns that another did sets one element of its first gradient to inf. Its
    scaler then skips and backs off exactly as the others do; the poisoned gradient is never
    applied (the step is skipped) and is zeroed with the rest before the next step.
    """
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    local = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        if g.numel() and not torch.isfinite(g).all():
            local.fill_(1.0)
            break
    found = local.clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    grads = [g for g in grads if g.numel()]  # (an FSDP shard may be empty)
    if found.item() and not local.item() and grads:
        grads[0].view(-1)[0] = math.inf
    return bool(found.item())
