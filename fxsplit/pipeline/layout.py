"""Memory layouts of values crossing a stage boundary: what the plan records, and the one
transfer function the runtime and ``fxsplit.verify`` both apply.

Terms
- **dim order**: a value's dims from outermost to innermost in memory; ``(0, 2, 1, 3)`` is what
  ``y = a.transpose(1, 2)`` of a contiguous ``a`` has. ``None`` means row-major (contiguous).
- **wire form**: the tensor that travels: ``x.permute(order).contiguous()`` (plain
  ``x.contiguous()`` when the order is None); contiguous, shape ``wire_shape(shape, order)``.

Representative signature::

    order = dim_order_of(node.meta["val"])       # (0, 2, 1, 3), or None
    wire = to_wire(x, order)                      # sender (or the mailbox on one rank)
    x2 = from_wire(wire, order)                   # receiver: x's values AND x's strides
    x2 = hand_over(x, order)                      # both at once (verify, run_sequential)

[Note: boundary layouts]
A stage's code may depend on the strides of what it reads: ``y.transpose(1, 2).view(B, T, C)``
is valid only where ``y`` is a transpose of a contiguous tensor, as the producing stage made it
(attention outputs whose trace has no ``.contiguous()``). Point-to-point transfer moves
contiguous buffers, so the plan records, for every boundary value, its dim order from the
trace's fake tensor (``TensorMeta.dim_order``, set by ``build_stages``). A value that is a
permutation of a dense layout travels in its dense permuted form (no copy: ``permute`` of such
a value is already contiguous) and the receiver permutes the buffer back, restoring the
producer's strides exactly (a contiguous value travels as it is). Anything else (a slice, an
expanded or overlapping value) becomes contiguous. The runtime applies this to remote and local
(same-rank) handovers alike, and ``fxsplit.verify`` and ``StageGraphs.run_sequential`` hand
values between stages through :func:`hand_over`, so a plan verify accepts runs: they see the
strides the runtime gives. Gradients travel contiguous (their layout never changes a result:
autograd takes them as they come).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sympy
import torch

from fxsplit.graph.meta import to_expr
from fxsplit.graph.shapes import substitute

__all__ = ["dim_order_of", "from_wire", "hand_over", "to_wire", "wire_shape"]


def _is_one(d: Any) -> bool:
    return d == 1


def _numeric(e: Any, symbols: dict) -> float:
    """A stride as a number for ordering: symbols (batch, sequence) stand for large distinct
    sizes, so products of sizes order as they do for any real size >= 2."""
    return float(substitute(e, symbols))


def dim_order_of(val: Any) -> tuple[int, ...] | None:
    """The dim order of ``val`` (a fake or real tensor, or ShapeProp's TensorMetadata) when it is a
    permutation of a dense layout other than row-major; None when row-major or not dense
    ([Note: boundary layouts]). Size-1 dims never decide it (their strides are arbitrary)."""
    if isinstance(val, torch.Tensor):
        shape, stride = tuple(val.shape), tuple(val.stride())
    elif hasattr(val, "stride") and hasattr(val, "shape") and isinstance(val.stride, tuple):
        shape, stride = tuple(val.shape), val.stride
    else:
        return None
    shape = [to_expr(s) for s in shape]
    stride = [to_expr(s) for s in stride]
    free = sorted({s for e in (*shape, *stride) if isinstance(e, sympy.Basic) for s in e.free_symbols}, key=str)
    symbols = {s: 1_000_003 + 7919 * i for i, s in enumerate(free)}
    big = [d for d in range(len(shape)) if not _is_one(shape[d])]
    phys = sorted(big, key=lambda d: (-_numeric(stride[d], symbols), d))
    expected: Any = 1
    for d in reversed(phys):
        if sympy.expand(sympy.sympify(stride[d]) - sympy.sympify(expected)) != 0:
            return None  # not dense: sent contiguous
        expected = expected * shape[d]
    if phys == big:
        return None  # row-major already
    order = list(phys)
    for u in range(len(shape)):
        if u not in big:
            order.insert(min(u, len(order)), u)
    return tuple(order)


def _inverse(order: Sequence[int]) -> tuple[int, ...]:
    inv = [0] * len(order)
    for i, d in enumerate(order):
        inv[d] = i
    return tuple(inv)


def wire_shape(shape: Sequence[Any], order: Sequence[int] | None) -> tuple:
    """The shape of the wire form of a value of ``shape``."""
    return tuple(shape) if order is None else tuple(shape[d] for d in order)


def to_wire(x: torch.Tensor, order: Sequence[int] | None) -> torch.Tensor:
    """The contiguous tensor that carries ``x`` ([Note: boundary layouts]); ``x`` itself when it
    is already in that form."""
    if order is None:
        return x if x.is_contiguous() else x.contiguous()
    y = x.permute(tuple(order))
    return y if y.is_contiguous() else y.contiguous()


def from_wire(buf: torch.Tensor, order: Sequence[int] | None) -> torch.Tensor:
    """The value a wire form ``buf`` carries, with the strides of dim order ``order`` (a view)."""
    return buf if order is None else buf.permute(_inverse(order))


def hand_over(x: Any, order: Sequence[int] | None) -> Any:
    """``x`` as the next stage receives it: values equal, strides those of the transfer."""
    if not isinstance(x, torch.Tensor):
        return x
    return from_wire(to_wire(x, order), order)
