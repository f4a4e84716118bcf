"""Shapes: sizes as numbers (:func:`to_expr`) and the tensor-metadata type (:class:`TensorMeta`)
every layer reads from a graph.

This module sits below the cost model (which reads tensor metadata) and ``fxsplit.graph.meta``
(which annotates nodes with metadata and their cost); import these names from
``fxsplit.graph.meta``, which re-exports them.

Terms:
    Number      ``int | float | sympy.Expr``; a symbolic size is a sympy expression in the tracer's
                symbols (batch ``s0``, sequence ``s1``).
    Dim         ``int | sympy.Expr``: one entry of a shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import sympy
import torch

from fxsplit.errors import ArgumentTypeError, UsageError

__all__ = ["Dim", "Number", "to_expr", "substitute", "TensorMeta", "tensor_metas", "BATCH", "MARKER_ATTR", "marker_of",
           "batch_dims", "marker_example", "marked", "graph_marker"]

Dim = int | sympy.Expr
Number = int | float | sympy.Expr

# [Note: a marker batch] (fxsplit.graph.batch_marker): the batch symbol of a graph traced at a
# marker batch, and the attribute of its fake-tensor mode that holds the marker
BATCH = sympy.Symbol("batch", integer=True, positive=True)
MARKER_ATTR = "fxsplit_batch_marker"
EXAMPLE_ATTR = "fxsplit_batch_example"  # the example's own batch: what BATCH is bound to by default


def to_expr(x: Any) -> Number:
    """``int``/``SymInt``/``float``/``SymFloat``/sympy -> ``int``, ``float`` or ``sympy.Expr``.

    A static size stays an ``int``; a symbolic value becomes its sympy expression
    (``x.node.expr``); a sympy value that is a plain number comes back as ``int`` (integers) or
    ``float``. Anything else raises ``ArgumentTypeError`` (a TypeError).
    """
    if isinstance(x, bool):
        return int(x)
    if isinstance(x, (int, float)):
        return x
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _simplify_number(x.node.expr)
    if isinstance(x, sympy.Basic):
        return _simplify_number(x)
    raise ArgumentTypeError(
        f"to_expr: cannot turn {x!r} (type {type(x).__name__}) into a number; expected int, float, "
        "torch.SymInt/SymFloat or a sympy expression"
    )


def substitute(x: Any, bindings: Mapping[sympy.Symbol, int | float]) -> Any:
    """``x`` (a number or sympy expression) with the symbols of ``bindings`` replaced by their
    values, evaluated: ``xreplace``, a plain structural substitution about 20x faster than
    ``subs`` (costs are evaluated per node, per binding), falling back to ``subs`` when it leaves
    an unevaluated non-number with no symbol left. Symbols ``bindings`` lacks stay symbols."""
    if not isinstance(x, sympy.Basic):
        return x
    v = x.xreplace(bindings)
    if isinstance(v, sympy.Basic) and not v.is_Number and not v.free_symbols:
        v = x.subs(bindings)
    return v


def _simplify_number(e: sympy.Basic) -> Number:
    if e.is_Integer:
        return int(e)
    if e.is_Number:
        return float(e)
    return e


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and requires_grad of one tensor value; the one tensor-metadata type of fxsplit.

    ``shape`` holds ints and sympy expressions (never ``SymInt``: convert with :func:`to_expr`);
    ``numel`` and ``nbytes`` are symbolic where the shape is. ``requires_grad`` needs a floating
    or complex dtype. ``dim_order``: the dims from outermost to innermost in memory when the value
    is a permutation of a dense layout other than row-major, else None; set on pipeline boundary
    values only ([Note: boundary layouts] in ``fxsplit.pipeline.layout``).
    """

    shape: tuple[Dim, ...]
    dtype: torch.dtype
    requires_grad: bool = False
    dim_order: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.shape, tuple):
            raise ArgumentTypeError(f"TensorMeta.shape must be a tuple of ints or sympy expressions, got "
                                    f"{self.shape!r} (type {type(self.shape).__name__})")
        for i, d in enumerate(self.shape):
            if isinstance(d, bool) or not isinstance(d, (int, sympy.Expr)):
                raise ArgumentTypeError(f"TensorMeta.shape[{i}] must be an int or a sympy expression, got {d!r} "
                                        f"(type {type(d).__name__}) in shape {self.shape}; convert sizes with "
                                        "fxsplit.graph.meta.to_expr")
            if isinstance(d, int) and d < 0:
                raise UsageError(f"TensorMeta.shape[{i}] must be >= 0, got {d} in shape {self.shape}")
        if not isinstance(self.dtype, torch.dtype):
            raise ArgumentTypeError(f"TensorMeta.dtype must be a torch.dtype, got {self.dtype!r} "
                                    f"(type {type(self.dtype).__name__})")
        if not isinstance(self.requires_grad, bool):
            raise ArgumentTypeError(f"TensorMeta.requires_grad must be a bool, got {self.requires_grad!r}")
        if self.requires_grad and not (self.dtype.is_floating_point or self.dtype.is_complex):
            raise UsageError(f"TensorMeta: requires_grad=True needs a floating or complex dtype, got "
                             f"dtype={self.dtype} (shape {self.shape})")
        if self.dim_order is not None and (not isinstance(self.dim_order, tuple)
                                           or sorted(self.dim_order) != list(range(len(self.shape)))):
            raise UsageError(f"TensorMeta.dim_order must be None or a permutation of the {len(self.shape)} dims "
                             f"of shape {self.shape}, got {self.dim_order!r}")

    @property
    def numel(self) -> Dim:
        n = math.prod(self.shape, start=1)
        return to_expr(n) if isinstance(n, sympy.Basic) else n

    @property
    def nbytes(self) -> Dim:
        n = self.numel * self.dtype.itemsize
        return to_expr(n) if isinstance(n, sympy.Basic) else n

    @property
    def is_symbolic(self) -> bool:
        return any(isinstance(d, sympy.Expr) for d in self.shape)

    def concrete_shape(self, bindings: Mapping[Any, int]) -> tuple[int, ...]:
        """The shape with symbols substituted (``bindings`` maps sympy symbols or their names to ints)."""
        by_name = {(k if isinstance(k, str) else k.name): v for k, v in bindings.items()}
        out = []
        for d in self.shape:
            if isinstance(d, sympy.Expr):
                val = sympy.sympify(substitute(d, {s: by_name[s.name] for s in d.free_symbols if s.name in by_name}))
                if not val.is_Integer:
                    raise UsageError(f"shape {self.shape}: dimension {d} has unbound symbols {sorted(map(str, val.free_symbols))}")
                out.append(int(val))
            else:
                out.append(int(d))
        return tuple(out)

    def __str__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        order = "" if self.dim_order is None else f"{{order {','.join(map(str, self.dim_order))}}}"
        return f"{dt}[{', '.join(map(str, self.shape))}]{order}"


def tensor_metas(val: Any) -> tuple[TensorMeta, ...]:
    """Flatten a node's value into TensorMetas: ``meta["val"]`` (a tensor, or a list, tuple or dict
    of them) or ShapeProp's ``meta["tensor_meta"]``; non-tensors are skipped."""
    from torch.fx.passes.shape_prop import TensorMetadata

    if isinstance(val, torch.Tensor):
        return (TensorMeta(batch_dims(val), val.dtype, bool(val.requires_grad)),)
    if isinstance(val, TensorMetadata):
        return (TensorMeta(tuple(to_expr(s) for s in val.shape), val.dtype, bool(val.requires_grad)),)
    if isinstance(val, dict):
        val = list(val.values())
    if isinstance(val, (list, tuple)):
        return tuple(m for v in val for m in tensor_metas(v))
    return ()


def marker_of(val: Any) -> int | None:
    """The marker batch of a value's graph (its fake-tensor mode carries it: [Note: a marker batch]
    in fxsplit.graph.batch_marker), else None."""
    return getattr(getattr(val, "fake_mode", None), MARKER_ATTR, None)


def graph_marker(gm: Any) -> int | None:
    """The marker batch of a graph module traced at one (its inputs' values carry it), else None."""
    return next((m for n in gm.graph.nodes if n.op == "placeholder" and (m := marker_of(n.meta.get("val")))), None)


def marker_example(val: Any) -> int | None:
    """The example batch a marker-batch graph's ``BATCH`` stands for by default, else None."""
    return getattr(getattr(val, "fake_mode", None), EXAMPLE_ATTR, None)


def batch_dims(val: torch.Tensor) -> tuple[Dim, ...]:
    """The sizes of ``val`` as ints and sympy expressions; in a marker-batch graph a multiple
    ``k * P`` of the marker is read as ``k * BATCH``."""
    dims = tuple(to_expr(s) for s in val.shape)
    p = marker_of(val)
    return dims if p is None else tuple(marked(d, p) for d in dims)


def marked(d: Dim, p: int | None) -> Dim:
    """A size of a graph traced at the marker ``p`` as fxsplit reads it: a multiple ``k * p`` (an
    int, or an expression whose every coefficient is one) is ``k * BATCH``; ``p`` None: ``d``."""
    if p is None:
        return d
    if isinstance(d, int):
        return BATCH * (d // p) if d and d % p == 0 else d
    terms = sympy.Add.make_args(sympy.expand(d))
    if all((c := t.as_coeff_Mul()[0]).is_Integer and int(c) % p == 0 for t in terms):
        return sympy.expand(sympy.Add(*[t / p for t in terms]) * BATCH)
    return d
