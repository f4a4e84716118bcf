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

from dataclasses import dataclass
from typing import Any, Mapping

import sympy
import torch

__all__ = ["Dim", "Number", "to_expr", "TensorMeta", "tensor_metas"]

Dim = int | sympy.Expr
Number = int | float | sympy.Expr


def to_expr(x: Any) -> Number:
    """``int``/``SymInt``/``float``/``SymFloat``/sympy -> ``int``, ``float`` or ``sympy.Expr``.

    A static size stays an ``int``; a symbolic value becomes its sympy expression
    (``x.node.expr``); a sympy value that is a plain number comes back as ``int`` (integers) or
    ``float``. Anything else raises ``TypeError``.
    """
    if isinstance(x, bool):
        return int(x)
    if isinstance(x, (int, float)):
        return x
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _simplify_number(x.node.expr)
    if isinstance(x, sympy.Basic):
        return _simplify_number(x)
    raise TypeError(
        f"to_expr: cannot turn {x!r} (type {type(x).__name__}) into a number; expected int, float, "
        "torch.SymInt/SymFloat or a sympy expression"
    )


def _simplify_number(e: sympy.Basic) -> Number:
    if e.is_Integer:
        return int(e)
    if e.is_Number:
        return float(e)
    return e


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor a node produces."""

    shape: tuple[Dim, ...]
    dtype: torch.dtype
    requires_grad: bool = False

    @property
    def numel(self) -> Dim:
        n: Dim = 1
        for d in self.shape:
            n = n * d
        return n

    @property
    def nbytes(self) -> Dim:
        return self.numel * self.dtype.itemsize

    @property
    def is_symbolic(self) -> bool:
        return any(isinstance(d, sympy.Expr) for d in self.shape)

    def concrete_shape(self, bindings: Mapping[Any, int]) -> tuple[int, ...]:
        """The shape with symbols substituted (``bindings`` maps sympy symbols or their names to ints)."""
        subs = {(sympy.Symbol(k) if isinstance(k, str) else k): v for k, v in bindings.items()}
        out = []
        for d in self.shape:
            if isinstance(d, sympy.Expr):
                val = d.subs(subs)
                if not val.is_Integer:
                    raise ValueError(f"shape {self.shape}: dimension {d} has unbound symbols {sorted(map(str, val.free_symbols))}")
                out.append(int(val))
            else:
                out.append(int(d))
        return tuple(out)

    def __str__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return f"{dt}[{', '.join(map(str, self.shape))}]"


def tensor_metas(val: Any) -> tuple[TensorMeta, ...]:
    """Flatten a node's ``meta["val"]`` into TensorMetas (non-tensors are skipped)."""
    if isinstance(val, torch.Tensor):
        return (
            TensorMeta(
                tuple(to_expr(s) for s in val.shape),
                val.dtype,
                bool(val.requires_grad),
            ),
        )
    if isinstance(val, (list, tuple)):
        out: list[TensorMeta] = []
        for v in val:
            out.extend(tensor_metas(v))
        return tuple(out)
    return ()
