"""Example inputs for tracing: which dims are traced as symbols (``dynamic_dims``), a batch of
one widened to two ([Note: batch of one]), and the example cut or repeated to a plan's static
microbatch size (``static_batch_size`` decides it, for ``trace`` and ``ParallelConfig`` alike:
[Note: a static batch]). Used by :mod:`fxsplit.graph.trace` and :mod:`fxsplit.graph.export` (and
by ``verify``, which runs the plan on the example at the traced size).

    args, kwargs = example_at_batch(args, kwargs, 4)   # every tensor whose dim 0 is the batch, at 4
    static_batch_size(dynamic_batch=None, microbatch_size=4, example_batch=8)   # 4: export traces it static
    check_example_batch(args, kwargs, "plan")          # PlanError on an example of 0 samples
"""

from __future__ import annotations

from typing import Any

import torch

from fxsplit.errors import PlanError

__all__ = ["example_at_batch", "batch_of", "check_example_batch", "static_batch_size", "dynamic_dims", "widen_batch",
           "WIDE_NOTE"]


# [Note: a static batch]
# With the batch symbolic, torch.export is still 1.3x (8 Llama layers) to 1.8x (80) a static
# export, growing with depth (every view, expand and matmul carries a sympy size and its guards),
# and everything downstream (the TP pass's local fake tensors, cost expressions, saved bytes) pays
# for the symbol again. A plan whose batch is known needs none of it: with an explicit config and
# a known global batch B (``plan(..., global_batch_size=B)``, or ``microbatch_size=b`` directly)
# every microbatch has b = B / (dp * dp_shard * m) samples, so ``trace(microbatch_size=b)`` exports
# at exactly that size, fully static, the way the sequence already is: the example's tensors whose
# dim 0 is the example's batch are cut or repeated along it to b (values do not matter for the
# shapes; a meta example stays meta). A step whose microbatches differ from b is refused by
# ``check_batch`` with the traced size, naming ``dynamic_batch=True`` (the switch back to a
# symbolic batch), never run wrongly. What keeps the symbol: ``dynamic_batch=True``; torch.fx
# (its graph code reads sizes at run time and its fake propagation is cheap, so it stays
# symbolic, with costs evaluated at b); a global batch that does not divide into equal
# microbatches (PlanError: they would differ by one sample); and ``strategy="auto"``'s search
# trace, which prices every microbatch size from the one symbolic graph (the plan of its pick
# then traces static at the pick's size). ``trace`` itself keeps the symbolic batch by default.
# Where the batch stays "symbolic" under torch.export and ``dynamic_batch`` is not True, it is
# traced static at a marker batch and only fxsplit's own sizes carry the symbol ([Note: a marker
# batch] in fxsplit.graph.batch_marker): the 70B plan with no global batch went from 2.39x a bare
# export to 1.43x.


def static_batch_size(*, dynamic_batch: bool | None, microbatch_size: int | None,
                      example_batch: int | None) -> int | None:
    """The batch torch.export traces static ([Note: a static batch]), or None for a symbolic one:
    ``dynamic_batch`` True keeps the symbol; None (the default of ``trace`` and
    ``ParallelConfig``) is static at ``microbatch_size`` when it is known, else symbolic; False
    is static at ``microbatch_size``, or else at the example's batch. torch.fx keeps the batch
    symbolic either way."""
    if dynamic_batch is True:
        return None
    if microbatch_size is not None:
        return microbatch_size
    return example_batch if dynamic_batch is False else None


def example_at_batch(args: tuple, kwargs: dict, batch: int) -> tuple[tuple, dict]:
    """The example with its batch (dim 0 of every tensor whose dim 0 is the example's batch, as
    :func:`batch_of` reads it) cut or repeated to ``batch`` samples ([Note: a static batch])."""
    have = batch_of((args, kwargs))
    if have is None or have == batch:
        return args, kwargs

    def resize(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != have:
            return x
        if batch < have:
            y = x.detach()[:batch]
        else:
            reps = -(-batch // have)
            y = x.detach().repeat(reps, *([1] * (x.dim() - 1)))[:batch]
        return y.contiguous().requires_grad_(x.requires_grad)

    new_args, new_kwargs = torch.utils._pytree.tree_map(resize, (args, kwargs))
    return tuple(new_args), dict(new_kwargs)


# [Note: batch of one]
# Tracing specializes a dimension of size 1 (fake tensors and torch.export treat sizes 0 and 1
# as constants: broadcasting depends on them), so an example of ONE sample would fix the batch
# size to 1 and every later batch split into microbatches of 2 would be refused. When the batch
# (dim 0 of the first tensor input with a dim, as fxsplit.runtime.microbatch reads it) is 1,
# the symbolic trace runs on a copy of the example with every tensor whose dim 0 is 1 repeated
# to 2 along it (the inputs the runtime would split at that batch size); the graph then holds a
# batch symbol (valid for sizes >= 1: the traced graph does not depend on the hint) whose example
# value (hint) is 2. A static fallback traces the example as given.
_WIDE_BATCH = 2
WIDE_NOTE = f" (the example batch of 1 traced as {_WIDE_BATCH}, so the batch size stays symbolic)"  # in the trace reason


def dynamic_dims(t: torch.Tensor, sequence: bool = True, batch: bool = True) -> list[int]:
    """Which dims of an example input to trace as symbols: with ``batch``, batch (0) and, with
    ``sequence``, sequence (1 of int inputs)."""
    dims = []
    if batch and t.dim() >= 1 and t.shape[0] >= 2:
        dims.append(0)
    if sequence and t.dim() >= 2 and not t.is_floating_point() and t.shape[1] >= 2:
        dims.append(1)
    return dims


def batch_of(values: Any) -> int | None:
    """Dim 0 of the first tensor with a dim (the batch, as fxsplit.runtime.microbatch reads it)."""
    leaves = torch.utils._pytree.tree_leaves(values)
    return next((int(x.shape[0]) for x in leaves if isinstance(x, torch.Tensor) and x.dim() >= 1), None)


def check_example_batch(args: Any, kwargs: Any, where: str) -> None:
    """PlanError when the example's batch (``batch_of``: dim 0 of its first tensor with a dim) is 0.

    An example of 0 samples traces to a graph specialized to the empty batch (torch.export), or
    to one whose costs and boundary sizes are all 0 (fx): the plan would balance stages on nothing.
    """
    leaves, _ = torch.utils._pytree.tree_flatten_with_path((tuple(args), dict(kwargs or {})))
    for path, x in leaves:
        if isinstance(x, torch.Tensor) and x.dim() >= 1:
            if x.shape[0] == 0:
                root = ("example_args", "example_kwargs")[path[0].idx]
                name = root + torch.utils._pytree.keystr(path[1:])
                raise PlanError(
                    f"{where}: the example has 0 samples: {name} has shape {tuple(x.shape)}, and its dim 0 "
                    "is the batch (dim 0 of the first input tensor); give an example with at least one sample "
                    "(dim 0 >= 1): the plan is traced and costed at the example's shapes"
                )
            return


def widen_batch(args: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
    """``(args, kwargs, widened)``: the example with a batch of 1 repeated to 2 ([Note: batch of one])."""
    if batch_of((args, kwargs)) != 1:
        return args, kwargs, False

    def widen(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == 1:
            return x.detach().expand(_WIDE_BATCH, *x.shape[1:]).contiguous().requires_grad_(x.requires_grad)
        return x

    wide_args, wide_kwargs = torch.utils._pytree.tree_map(widen, (args, kwargs))
    return tuple(wide_args), dict(wide_kwargs), True

