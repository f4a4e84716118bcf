"""The per-rank memory a plan expects: parameters, gradients, optimizer state and activations,
with tensor, pipeline and sharded data parallelism (``Plan.memory()``, printed by ``plan()``).

Terms as in :mod:`fxsplit.api.plan` (d, s = dp_shard, t, p). A rank holds the stages of its
pipeline rank, each parameter at its tp-local shape, split by FSDP into s dim-0 chunks
(``ceil(rows / s)`` rows for the first ranks: the figure is the largest rank's).

[Note: memory model]
- at rest (between steps): parameters, gradients and optimizer state of this rank's FSDP shards
  (the whole tp-local tensors without dp_shard); Adam keeps two float32 tensors per parameter
  (``exp_avg``, ``exp_avg_sq``), ``optimizer_bytes_per_param`` otherwise;
- during a step with dp_shard > 1 FSDP also holds each stage whole ([Note: FSDP units and
  reshard_after_forward] in fxsplit.runtime.fsdp): the gathered parameters (in the
  mixed-precision param_dtype) and the unsharded gradients accumulated over microbatches (in the
  reduce dtype), freed by the reduce-scatter at the end of the step;
- activations: the partition's model, in-flight microbatches times the bytes each stage saves
  for backward (``SplitPlan.peak_activations``), for the traced example's microbatch;
- the peak of a step: parameters + optimizer state at rest, FSDP's gathered parameters, and the
  larger of the activations and the whole (tp-local) gradients, as backward frees the one while
  it fills the other; plain data parallelism (dp > 1 without dp_shard) adds one more copy of the
  gradients, the flat buckets of fxsplit's all-reduce. With dp_shard the sharded gradients are
  written by the reduce-scatter after the whole ones are freed, so they are not in the peak.
  Measured with ``benchmarks/fsdp_memory.py`` (peak / predicted per rank in its README section).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["RankMemory", "rank_memory"]


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank of pipeline rank ``pp_rank`` expects ([Note: memory model])."""

    pp_rank: int
    params: float  # at rest: this rank's shards
    grads: float
    optimizer: float
    activations: float  # peak during a step
    gathered: float  # during a step with dp_shard > 1: the whole (gathered) stage parameters
    whole_grads: float  # during a step: the tp-local gradients before any reduction
    buckets: float  # during a step with plain dp: the all-reduce's flat copies of the gradients

    @property
    def at_rest(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> float:
        """Bytes held at the peak of a step ([Note: memory model])."""
        return self.params + self.optimizer + self.gathered + max(self.activations, self.whole_grads) + self.buckets


def _mib(x: float) -> str:
    return f"{x / 2**20:.2f} MiB"


def rank_memory(plan: Any, *, optimizer_bytes_per_param: float = 8.0) -> list[RankMemory]:
    """One :class:`RankMemory` per pipeline rank of ``plan`` (``optimizer_bytes_per_param``: 8 for
    Adam/AdamW's two float32 states)."""
    c = plan.config
    s = c.dp_shard
    specs = plan.tp_plan.param_specs
    full_shapes = {k: tuple(v) for k, v in plan.tp_plan.full_shapes.items()}
    policy = c.mp_policy
    try:
        acts = plan.split.peak_activations()[0]
    except Exception:  # noqa: BLE001 -- a plan without a partition model: no estimate
        acts = ()
    out = []
    for r in range(c.pp):
        shard = whole = opt = gathered = grads = 0.0
        seen: set[int] = set()
        for stage in plan.stages_of(r):
            for name, p in plan.stages.modules[stage].named_parameters(remove_duplicate=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                shape = tuple(p.shape)
                full = full_shapes.get(name, shape)
                if name in specs and shape == full:
                    shape = specs[name].local_shape(full)
                numel = math.prod(shape)
                rows = shape[0] if shape else 1
                mine = numel if s == 1 or not shape else math.ceil(rows / s) * (numel // max(rows, 1))
                size = p.element_size()
                shard += mine * size
                whole += numel
                opt += mine * optimizer_bytes_per_param
                gdt = policy.reduce_dtype if policy is not None and policy.reduce_dtype is not None else p.dtype
                grads += numel * _size(gdt)
                if s > 1:
                    pdt = policy.param_dtype if policy is not None and policy.param_dtype is not None else p.dtype
                    gathered += numel * _size(pdt)
        buckets = grads if c.dp > 1 and s == 1 else 0.0
        out.append(RankMemory(pp_rank=r, params=shard, grads=shard, optimizer=opt,
                              activations=float(acts[r]) if r < len(acts) else 0.0, gathered=gathered,
                              whole_grads=grads, buckets=buckets))
    return out


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def format_memory(rows: list[RankMemory], dp_shard: int) -> str:
    """The lines ``plan()`` prints: one per pipeline rank."""
    lines = [f"expected memory per rank (Adam; [Note: memory model] in fxsplit.api.memory; dp_shard={dp_shard}):"]
    for m in rows:
        extra = f", gathered during the step {_mib(m.gathered)}" if m.gathered else ""
        extra += f", whole gradients during the step {_mib(m.whole_grads)}"
        extra += f", all-reduce buckets {_mib(m.buckets)}" if m.buckets else ""
        lines.append(f"  pp rank {m.pp_rank}: params {_mib(m.params)}, grads {_mib(m.grads)}, optimizer "
                     f"{_mib(m.optimizer)}, activations {_mib(m.activations)}{extra}; peak {_mib(m.peak)}")
    return "\n".join(lines)
