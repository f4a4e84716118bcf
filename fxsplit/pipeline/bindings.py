"""A graph's symbolic sizes bound to numbers, and the bytes a chain of units holds across each
position: what the split (``fxsplit.pipeline.split``) and the auto-planner
(``fxsplit.planner.workload``) both evaluate costs and boundaries with.

    binds = resolve_bindings(gm, {"batch": 4})     # the traced example's sizes, overridden
    batch_bindings(gm, 2)                          # {batch symbol: 2} when the trace saw another size
    cut_bytes(units, binds)                        # bytes live across positions 0..n (ends 0)
"""

from __future__ import annotations

from typing import Any, Mapping

import sympy
import torch
import torch.fx

from fxsplit.errors import SplitError
from fxsplit.graph.cost import value_bytes as tensor_bytes
from fxsplit.graph.meta import substitute

__all__ = ["batch_bindings", "example_bindings", "resolve_bindings", "concrete", "value_bytes", "cut_bytes"]


def batch_bindings(gm: torch.fx.GraphModule, batch: int | None) -> dict[sympy.Symbol, int]:
    """``{batch symbol: batch}`` when dim 0 of the graph's first tensor input is a symbol traced at
    another size (a batch of 1 is traced as 2: [Note: batch of one]; an example of the whole batch
    planned for smaller microbatches), so costs and memory are those of one microbatch; else {}."""
    if batch is None:
        return {}
    for node in gm.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        if isinstance(val, torch.Tensor) and val.dim() >= 1:
            s = val.shape[0]
            if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol) and s.node.hint != batch:
                return {s.node.expr: int(batch)}
            return {}
    return {}


def example_bindings(gm: torch.fx.GraphModule) -> dict[sympy.Symbol, int]:
    """The example sizes the graph was traced with, for every symbol in its input shapes."""
    out: dict[sympy.Symbol, int] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for s in val.shape:
            if isinstance(s, torch.SymInt):
                expr = s.node.expr
                hint = s.node.hint
                if isinstance(expr, sympy.Symbol) and hint is not None:
                    out[expr] = int(hint)
    return out


def concrete(x: Any, bindings: Mapping) -> float:
    if isinstance(x, sympy.Expr):
        v = substitute(x, bindings)
        if v.free_symbols:
            raise SplitError(f"cannot evaluate {x} at {dict(bindings)}: symbols {sorted(map(str, v.free_symbols))} are unbound")
        return float(v)
    return float(x)


def value_bytes(node: torch.fx.Node, bindings: Mapping) -> float:
    """Bytes ``node``'s tensor sends at ``bindings`` (``NodeInfo.output_bytes``; a node with no
    metadata by its value's shape)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        info = node.meta.get("fxsplit")
        if info is not None and info.outputs:
            return info.output_bytes(bindings)
        return concrete(tensor_bytes(val), bindings)
    return 0.0  # tuples travel as their getitem results; non-tensors are recomputed, not sent


def resolve_bindings(gm: torch.fx.GraphModule, bindings: Mapping[str | sympy.Symbol, int] | None) -> dict[Any, int]:
    """Sizes for the graph's symbolic dims: the traced example's, overridden by ``bindings``."""
    binds: dict[Any, int] = dict(example_bindings(gm))
    info = getattr(gm, "meta", {}).get("fxsplit")
    for k, val in (bindings or {}).items():
        if isinstance(k, str):
            if info is None or k not in info.symbols:
                raise SplitError(f"bindings: no symbolic dimension named {k!r}; the graph has {sorted(info.symbols) if info else []}")
            binds[info.symbols[k]] = int(val)
        else:
            binds[k] = int(val)
    return binds


def cut_bytes(units: list[torch.fx.Node], binds: Mapping, skip: frozenset[str] = frozenset()) -> list[float]:
    """Bytes live across each position 0..n (produced before it, used at or after it; the ends 0),
    leaving out the units named in ``skip`` (recomputed where they are read)."""
    n = len(units)
    index = {u: i for i, u in enumerate(units)}
    diff = [0.0] * (n + 2)  # difference array over [producer + 1, last use]
    for i, u in enumerate(units):
        b = 0.0 if u.name in skip else value_bytes(u, binds)
        if not b:
            continue
        last = max((index.get(user, n) for user in u.users), default=i)
        if last > i:
            diff[i + 1] += b
            diff[last + 1] -= b
    out, run = [0.0] * (n + 1), 0.0
    for k in range(n + 1):
        run += diff[k]
        out[k] = run if 0 < k < n else 0.0
    return out
