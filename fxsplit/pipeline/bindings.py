"""A graph's symbolic sizes bound to numbers, and the bytes a chain of units holds across each
position: what the split (``fxsplit.pipeline.split``) and the auto-planner
(``fxsplit.planner.workload``) both evaluate costs and boundaries with.

    binds = resolve_bindings(gm, {"batch": 4})     # the traced example's sizes, overridden
    batch_bindings(gm, 2)                          # {batch symbol: 2} when the trace saw another size
    cut_bytes(units, binds)                        # bytes live across positions 0..n (ends 0)

Terms: **backed** symbol -- a dynamic input dim (``s0``), bound to the traced example's size;
**data-dependent** (unbacked) symbol -- a size the trace learnt only as a value of the data
(``u0``: ``tensor.tolist()``, ``nonzero``), which no example size gives.

[Note: data-dependent sizes]
A model that splits its rows by counts it computes (JetMoE's experts: ``x.split(expert_size.tolist())``,
one linear per expert) traces to shapes in unbacked symbols ``u0 .. u3``, which the costs and
boundaries of a split have to evaluate. torch.export records what it knows of them as runtime
asserts in the graph; the one we use is a sum, ``Eq(u0 + u1 + u2 + u3, 2*s0*s1)`` (the groups
cover every routed row). Each symbol of such a sum is estimated as an equal share of its value at
the backed sizes (balanced routing: the average, which is what a balanced split should plan for);
the actual counts vary per step and the step is exact whatever they are (the estimate only sizes
the cost model). A data-dependent symbol with no such sum stays unbound, and evaluating a cost in
it raises the UsageError naming it.
"""

from __future__ import annotations

from typing import Any, Mapping

import sympy
import torch
import torch.fx

from torch.utils._sympy.symbol import SymT, symbol_is_type

from fxsplit.errors import SplitError
from fxsplit.graph.cost import value_bytes as tensor_bytes
from fxsplit.graph.meta import substitute
from fxsplit.graph.shapes import BATCH, graph_marker, marked, marker_example, marker_of

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
            if marker_of(val) is not None:  # [Note: a marker batch]
                return {BATCH: int(batch)} if marker_example(val) != batch else {}
            s = val.shape[0]
            if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol) and s.node.hint != batch:
                return {s.node.expr: int(batch)}
            return {}
    return {}


def example_bindings(gm: torch.fx.GraphModule) -> dict[sympy.Symbol, int]:
    """The example sizes the graph was traced with, for every symbol in its input shapes, and an
    estimate of the data-dependent sizes at them ([Note: data-dependent sizes])."""
    out = _backed_example_sizes(gm)
    return {**out, **data_dependent_estimates(gm, out)}


def _unbacked(s: sympy.Basic) -> bool:
    return isinstance(s, sympy.Symbol) and symbol_is_type(s, SymT.UNBACKED_INT)


def data_dependent_estimates(gm: torch.fx.GraphModule, binds: Mapping) -> dict[sympy.Symbol, int]:
    """Each data-dependent symbol that a runtime assert ``Eq(u_a + ... + u_k, size)`` of ``gm``
    sums, as an equal share of ``size`` at ``binds`` (rounded up); [Note: data-dependent sizes]."""
    out: dict[sympy.Symbol, int] = {}
    p = graph_marker(gm)
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if not isinstance(val, torch.SymBool) or not isinstance(val.node.expr, sympy.Eq):
            continue
        for parts, size in ((val.node.expr.lhs, val.node.expr.rhs), (val.node.expr.rhs, val.node.expr.lhs)):
            size = marked(int(size) if size.is_Integer else size, p)  # [Note: a marker batch]
            terms = sympy.Add.make_args(parts)
            if not all(_unbacked(t) for t in terms) or any(_unbacked(x) for x in size.free_symbols):
                continue
            total = substitute(size, binds)
            if total.free_symbols:
                continue
            share = -(-int(total) // len(terms))
            out.update({t: share for t in terms if t not in out})
    return out


def _backed_example_sizes(gm: torch.fx.GraphModule) -> dict[sympy.Symbol, int]:
    out: dict[sympy.Symbol, int] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        if marker_of(val) is not None:  # [Note: a marker batch]: its symbol stands for the example's batch
            out[BATCH] = int(marker_example(val))
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
    if bindings:  # the data-dependent sizes at the overridden ones, unless bound themselves
        given = {info.symbols[k] if isinstance(k, str) else k for k in bindings}
        binds.update({u: v for u, v in data_dependent_estimates(gm, binds).items() if u not in given})
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
