"""Checks of a call's inputs against a plan, on the rank that was given them and before any
communication: :func:`check_batch` (can the batch be split into the plan's microbatches, with
shapes the traced graph accepts?) and :func:`inference_microbatches` (how many a forward uses).

Terms as in :mod:`fxsplit.api` (m microbatches; [Note: a static batch] in fxsplit.graph.examples,
[Note: a static sequence for export] in fxsplit.graph.trace).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from fxsplit.errors import PlanError
from fxsplit.runtime.microbatch import bind_symbols, split_microbatches

if TYPE_CHECKING:
    from fxsplit.api import Plan

__all__ = ["check_batch", "inference_microbatches"]


def inference_microbatches(flat: Sequence[Any], plan_: Plan) -> int:
    """m' = min(B, m): the microbatches a forward-only call splits a batch of B into ([Note: fewer
    microbatches for inference] in fxsplit.api.generate); m when the inputs have no batch dim."""
    m = plan_.config.microbatches
    batch = next((x.shape[0] for x in flat if isinstance(x, torch.Tensor) and x.dim() > 0), m)
    return max(1, min(batch, m))


def check_batch(flat: Sequence[Any], plan_: Plan, what: str, *, microbatches: int | None = None) -> None:
    """Raise ValueError naming the sizes, on the rank that was given them and before any
    communication, when the inputs cannot be split into the plan's microbatches: a batch (dim 0
    of the first tensor input that has one, as fxsplit.runtime.microbatch splits it) smaller than
    m, or microbatch shapes the traced graph does not accept (a size fixed at trace time).
    ``microbatches``: check a split into that many instead of m (inference with fewer samples)."""
    config = plan_.config
    m = config.microbatches if microbatches is None else microbatches
    batch = next((x.shape[0] for x in flat if isinstance(x, torch.Tensor) and x.dim() > 0), None)
    if batch is not None and batch < m:
        fix = (f"parallelize(..., microbatches=k) with {config.pp} <= k <= {batch}" if batch >= config.pp
               else f"fewer pipeline ranks (microbatches must be >= pp={config.pp})")
        raise PlanError(
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
        info = plan_.graph.meta.get("fxsplit")
        seq = ("" if info is None or info.method != "export" or config.dynamic_sequence is True else
               " (torch.export traced the sequence at the example's length, which serves shorter ones padded "
               "unless pad_sequence=False; plan with dynamic_sequence=True to serve any length: [Note: a "
               "static sequence for export] in fxsplit.graph.trace)")
        static = (info is not None and info.method == "export" and config.microbatch_size is not None
                  and config.dynamic_batch is not True)
        bat = (f" (torch.export traced the batch static at microbatch_size={config.microbatch_size}: pass batches of "
               f"{config.microbatch_size * m} samples, or plan with dynamic_batch=True to serve any batch size: "
               "[Note: a static batch] in fxsplit.graph.examples)" if static else "")
        raise PlanError(f"{what}(): a batch of {batch} in microbatches={m} gives microbatches of "
                         f"{sorted(set(split.sizes))} samples, which the plan does not accept: {exc}{bat}{seq}") from None
