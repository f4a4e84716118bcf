"""Microbatches: split the flat model inputs and the target, merge the outputs, and turn symbolic
shapes of the plan into concrete ones for a given microbatch.

Terms
- **batch size** ``B``: the size along ``dim`` (default 0) of the first tensor input that has
  that dimension. **batched** input: a tensor whose size along ``dim`` is ``B`` (or as the
  caller says with ``batched=``); every other input (scalars, non-tensors, tensors whose ``dim``
  is not ``B``) goes whole into every microbatch.
- **microbatch sizes**: ``torch.tensor_split`` of ``B`` into ``m`` chunks, so ``m`` need not
  divide ``B`` (sizes differ by at most 1). **weight** of microbatch i: ``w_i = b_i / B``.

[Note: loss weighting] ``loss_fn(output_i, target_i)`` is a MEAN over microbatch i. The step's
loss is ``sum_i w_i * loss_i`` and microbatch i's backward starts from ``w_i * loss_i``, so the
accumulated gradients equal the gradient of the full-batch mean whenever that mean averages the
same number of terms per sample (cross entropy over (B, T) tokens, MSE over (B, D)); with equal
chunks ``w_i = 1/m``. A loss that is a SUM over samples needs ``w_i = 1`` instead: wrap it as a
mean (``sum / b_i``) or divide by the batch size yourself.

Representative signature::

    mb = split_microbatches((idx,), 4)                 # MicrobatchSplit: inputs, sizes, weights
    targets = split_target(y, mb.sizes, dim=0)
    merged = merge_microbatches([out_0, out_1, ...])   # flat outputs, cat along dim
    binding = bind_symbols(input_meta, mb.inputs[0])   # {b: 2, t: 16}
    concrete_shape((b, t, 32), binding)                 # (2, 16, 32)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch.utils import _pytree as pytree

from fxsplit.errors import PlanError, UsageError
from fxsplit.graph.shapes import substitute
from fxsplit.pipeline.stage import ValueMeta

__all__ = [
    "MicrobatchSplit",
    "bind_symbols",
    "concrete_shape",
    "merge_microbatches",
    "split_microbatches",
    "split_target",
]


@dataclass(frozen=True)
class MicrobatchSplit:
    """``inputs[i]`` are the flat inputs of microbatch i; ``sizes[i]`` its batch size ``b_i``;
    ``weights[i] = b_i / batch_size`` (see [Note: loss weighting])."""

    inputs: tuple[tuple[Any, ...], ...]
    sizes: tuple[int, ...]
    weights: tuple[float, ...]
    batch_size: int
    batched: tuple[bool, ...]

    def __post_init__(self) -> None:
        if not (len(self.inputs) == len(self.sizes) == len(self.weights)):
            raise UsageError(f"MicrobatchSplit: {len(self.inputs)} inputs, {len(self.sizes)} sizes and "
                             f"{len(self.weights)} weights must have one entry per microbatch")
        if sum(self.sizes) != self.batch_size:
            raise UsageError(f"MicrobatchSplit: sizes {self.sizes} do not add up to batch_size "
                             f"{self.batch_size}")


def _batch_size(flat: Sequence[Any], dim: int) -> int:
    for x in flat:
        if isinstance(x, torch.Tensor) and x.dim() > dim:
            return x.shape[dim]
    kinds = [type(x).__name__ if not isinstance(x, torch.Tensor) else f"Tensor{tuple(x.shape)}"
             for x in flat]
    raise UsageError(f"cannot split into microbatches along dim {dim}: no input tensor has that "
                     f"dimension (inputs: {kinds}); pass split_dim= for the batch dimension")


def split_microbatches(
    flat_inputs: Sequence[Any],
    num_microbatches: int,
    *,
    dim: int = 0,
    batched: Sequence[bool] | None = None,
) -> MicrobatchSplit:
    """Split every batched input along ``dim`` into ``num_microbatches`` chunks (views, no copy).

    ``batched[i]`` forces whether input i is split (default: a tensor whose size along ``dim``
    equals the batch size). Raises ``UsageError`` (a ValueError) when the batch is smaller than
    ``num_microbatches`` or a forced input has the wrong size.
    """
    flat = list(flat_inputs)
    if num_microbatches < 1:
        raise UsageError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if batched is not None and len(batched) != len(flat):
        raise UsageError(f"batched has {len(batched)} entries but there are {len(flat)} flat inputs")
    if batched is not None and any(batched):
        first = next(i for i, b in enumerate(batched) if b)
        if not isinstance(flat[first], torch.Tensor) or flat[first].dim() <= dim:
            raise UsageError(f"input {first} is marked batched but is not a tensor with dim {dim}")
        size = flat[first].shape[dim]
    elif batched is not None:
        size = None
    else:
        size = _batch_size(flat, dim)
    mask = []
    for i, x in enumerate(flat):
        is_split = (isinstance(x, torch.Tensor) and x.dim() > dim and x.shape[dim] == size)
        if batched is not None:
            if batched[i] and not is_split:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise UsageError(f"input {i} is marked batched but its size along dim {dim} is not "
                                 f"the batch size {size} (got {got})")
            is_split = bool(batched[i])
        mask.append(is_split)
    if size is None:  # nothing batched: every microbatch sees the whole input, equal weights
        return MicrobatchSplit(tuple(tuple(flat) for _ in range(num_microbatches)),
                               (1,) * num_microbatches, (1.0 / num_microbatches,) * num_microbatches,
                               num_microbatches, tuple(mask))
    if size < num_microbatches:
        raise UsageError(f"a batch of {size} (dim {dim}) cannot be split into {num_microbatches} "
                         f"microbatches; use num_microbatches <= {size} or a larger batch")
    chunks = [torch.tensor_split(x, num_microbatches, dim=dim) if split else None
              for x, split in zip(flat, mask)]
    sizes = tuple(len(r) for r in torch.tensor_split(torch.arange(size), num_microbatches))
    inputs = tuple(
        tuple(c[i] if c is not None else x for x, c in zip(flat, chunks))
        for i in range(num_microbatches)
    )
    return MicrobatchSplit(inputs, sizes, tuple(s / size for s in sizes), size, tuple(mask))


def split_target(target: Any, sizes: Sequence[int], *, dim: int = 0) -> list[Any]:
    """Split each tensor leaf of ``target`` whose size along ``dim`` is ``sum(sizes)`` into chunks
    of ``sizes``; other leaves go whole to every microbatch. ``None`` -> ``[None] * m``."""
    total = sum(sizes)
    leaves, spec = pytree.tree_flatten(target)
    per_leaf = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > dim and leaf.shape[dim] == total:
            per_leaf.append(torch.split(leaf, list(sizes), dim=dim))
        else:
            per_leaf.append([leaf] * len(sizes))
    return [pytree.tree_unflatten([p[i] for p in per_leaf], spec) for i in range(len(sizes))]


def merge_microbatches(per_microbatch: Sequence[Sequence[Any]], *, dim: int = 0) -> list[Any]:
    """Merge flat outputs: position k is ``torch.cat`` along ``dim`` over microbatches when every
    microbatch gives a tensor with that dimension, else the list of per-microbatch values."""
    if not per_microbatch:
        return []
    merged = []
    for k in range(len(per_microbatch[0])):
        vals = [outs[k] for outs in per_microbatch]
        if all(isinstance(v, torch.Tensor) and v.dim() > dim for v in vals):
            merged.append(torch.cat(vals, dim=dim))
        else:
            merged.append(vals)
    return merged


# --------------------------------------------------------------------------------------------
# Symbolic shapes
# --------------------------------------------------------------------------------------------


def _as_expr(d: Any) -> sympy.Expr | int:
    if isinstance(d, (int, sympy.Integer)):
        return int(d)
    if isinstance(d, torch.SymInt):
        return d.node.expr
    return d


def bind_symbols(metas: Sequence[ValueMeta], values: Sequence[Any]) -> dict[sympy.Symbol, int]:
    """Bind the sympy symbols in ``metas[i].shape`` to the sizes of the tensors ``values[i]``.

    A dimension that is a bare symbol binds it; an expression with one unbound symbol is solved
    for it; every dimension is then checked. Raises ``PlanError`` (a ValueError) naming the input, the dim, the
    expected and the actual size when they disagree (e.g. a graph traced with fixed shapes fed a
    different microbatch size).
    """
    if len(metas) != len(values):
        raise PlanError(f"bind_symbols: {len(metas)} metas but {len(values)} values")
    binding: dict[sympy.Symbol, int] = {}
    pending: list[tuple[int, int, sympy.Expr, int]] = []
    for i, (meta, x) in enumerate(zip(metas, values)):
        if not meta.is_tensor or meta.shape is None or not isinstance(x, torch.Tensor):
            continue
        if len(meta.shape) != x.dim():
            raise PlanError(f"input {i} ({meta.name}): the plan expects {len(meta.shape)} dims "
                            f"{tuple(meta.shape)}, got a tensor of shape {tuple(x.shape)}")
        for d, (want, got) in enumerate(zip(meta.shape, x.shape)):
            want = _as_expr(want)
            if isinstance(want, sympy.Symbol) and want not in binding:
                binding[want] = int(got)
            else:
                pending.append((i, d, want, int(got)))
    for i, d, want, got in pending:
        if isinstance(want, sympy.Expr):
            free = [s for s in want.free_symbols if s not in binding]
            if len(free) == 1:
                sol = [s for s in sympy.solve(sympy.Eq(want, got), free[0]) if s.is_integer]
                if len(sol) == 1:
                    binding[free[0]] = int(sol[0])
    for i, d, want, got in pending:
        value = concrete_shape((want,), binding)[0] if isinstance(want, sympy.Expr) else want
        if value != got:
            raise PlanError(
                f"input {i} ({metas[i].name}) dim {d}: the plan was traced with size {want} "
                f"(= {value} here) but the microbatch has {got}. Trace with microbatch-sized "
                "example inputs, or mark the dimension dynamic when tracing (torch.export Dim), "
                "or pick num_microbatches so every microbatch has the traced size"
            )
    return binding


def concrete_shape(shape: Sequence[Any], binding: Mapping[sympy.Symbol, int]) -> tuple[int, ...]:
    """Evaluate each dimension of ``shape`` (ints or sympy expressions) under ``binding``."""
    out = []
    for d in shape:
        d = _as_expr(d)
        if isinstance(d, int):
            out.append(d)
            continue
        value = sympy.sympify(substitute(d, binding))
        if value.free_symbols:
            raise PlanError(
                f"shape {tuple(shape)}: dimension {d} uses {sorted(map(str, value.free_symbols))}, "
                f"which no model input binds (bound: {sorted(map(str, binding))}); the plan's "
                "boundary shapes must be expressions in the model inputs' dimensions"
            )
        out.append(int(value))
    return tuple(out)
