"""Tied parameters across stages: one parameter held by several stages (an embedding and the LM
head), whose gradient is the sum of every holder's: :class:`TiedGrads`.

Terms (fxsplit.pipeline.stage): **shared group** -- the (stage, parameter name) pairs holding one
parameter (``RankPlan.shared_params``); **holders** -- the pipeline ranks holding a stage of it.

    tied = TiedGrads.of(rank_plan, modules)       # this rank's groups
    tied.sum(pipe, tag_base=..., reduce_dtype=None)   # after the last action of a step
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fxsplit.errors import StageBuildError
from fxsplit.pipeline.rank_plan import RankPlan
from fxsplit.runtime.fsdp import local_tensor
from fxsplit.runtime.pipe_group import PipeGroup

__all__ = ["TiedGrads"]


@dataclass(frozen=True)
class _Group:
    index: int  # in RankPlan.shared_params: the message tag
    holders: tuple[int, ...]  # pipeline ranks, ascending
    params: tuple[nn.Parameter, ...]  # this rank's distinct Parameters of the group


@dataclass(frozen=True)
class TiedGrads:
    """The shared groups this rank holds."""

    groups: tuple[_Group, ...]

    @classmethod
    def of(cls, plan: RankPlan, modules: Mapping[int, nn.Module]) -> TiedGrads:
        out = []
        for g, group in enumerate(plan.shared_params):
            holders = tuple(sorted({plan.rank_of_stage(s) for s, _ in group}))
            if plan.rank not in holders:
                continue
            params: list[nn.Parameter] = []
            for s, fqn in sorted(group):
                if s not in modules:
                    continue
                try:
                    p = modules[s].get_parameter(fqn)
                except AttributeError as exc:
                    raise StageBuildError(f"shared parameter group {g}: stage {s} has no parameter "
                                          f"{fqn!r} ({exc})") from exc
                if all(p is not q for q in params):  # stages on one rank may share the object
                    params.append(p)
            out.append(_Group(g, holders, tuple(params)))
        return cls(tuple(out))

    def sum(self, pipe: PipeGroup, *, tag_base: int, reduce_dtype: torch.dtype | None) -> None:
        """Sum each tied parameter's gradient over the stages and ranks holding it; every holder
        adds the per-rank partial sums in rank order, so all copies get bit-identical gradients."""
        for grp in self.groups:
            partial = _partial(grp.params)
            if partial.numel() == 0:
                continue  # an empty FSDP shard (fewer rows than dp_shard ranks): empty on every holder
            if reduce_dtype is not None:
                partial = partial.to(reduce_dtype)
            parts = _exchange(pipe, grp, partial, tag_base)
            total = parts[grp.holders[0]]
            for q in grp.holders[1:]:
                total = total + parts[q]
            total = total.to(grp.params[0].dtype)
            for p in grp.params:
                if p.grad is None:
                    p.grad = total.clone()
                else:
                    local_tensor(p.grad).copy_(total)


def _partial(params: tuple[nn.Parameter, ...]) -> torch.Tensor:
    """This rank's sum of the group's gradients. An FSDP-sharded parameter ([Note: FSDP collectives
    outside the pipeline] in fxsplit.runtime.fsdp) is summed shard by shard: its copies on the
    holders are sharded alike (the same shape over the same dp_shard degree)."""
    for p in params:
        if p.grad is None and isinstance(p, DTensor):
            p.grad = torch.zeros_like(p)
    partial = None
    for p in params:
        if p.grad is not None:
            pg = local_tensor(p.grad)
            partial = pg.clone() if partial is None else partial + pg
    return torch.zeros_like(local_tensor(params[0])) if partial is None else partial


def _exchange(pipe: PipeGroup, grp: _Group, partial: torch.Tensor, tag_base: int) -> dict[int, torch.Tensor]:
    """Every holder's partial sum, by pipeline rank (this rank's own included)."""
    parts = {pipe.rank: partial}
    works = []
    for q in grp.holders:
        if q == pipe.rank:
            continue
        buf = torch.empty_like(partial)
        parts[q] = buf
        ops = [("send", partial), ("recv", buf)]
        if q < pipe.rank:  # one order per pair on both sides (NCCL)
            ops.reverse()
        for kind, t in ops:
            fn = dist.isend if kind == "send" else dist.irecv
            works.append((fn(t, pipe.global_rank(q), group=pipe.group, tag=tag_base + grp.index), q))
    for work, q in works:
        pipe.wait(work, f"summing the gradient of tied parameter group {grp.index}", q)
    return parts
