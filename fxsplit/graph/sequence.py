"""A graph that torch.export traced at a static sequence length made to take every length up to it:
the sizes that depend on the length are found by tracing a second time one position shorter, and
become expressions of the step's length, read from the token ids when the graph runs.

Terms
- **traced length** ``L``: dim 1 of the first integer tensor input with two or more dims (the token
  ids) of a graph torch.export traced with the sequence static.
- **length literal**: an integer in a node's arguments that differs between the trace at ``L`` and the
  trace at ``L - 1`` (a view's sequence size, an ``arange(L)``, a mask's ``expand``); every other
  argument of the two graphs is equal.
- **step length** ``s``: ``sym_size(token_ids, 1)`` of the call, a node of the rewritten graph.

[Note: following the sequence from two static traces]
A symbolic sequence makes torch.export several times slower ([Note: a static sequence for export]
in fxsplit.graph.trace), so a static trace is made to follow the length after the fact: the model is
exported again at ``L - 1`` (static, as fast as the first) and the two graphs are compared node by
node. They must have the same nodes with the same targets; an argument that differs must be an
integer that is an expression of the length: ``a * L`` (``a * (L - 1)`` in the second; a view's
sequence size, a flattened ``batch * L``), ``L + c`` (a shifted slice) or ``k * L * L`` (a flattened
square mask). Each length literal is replaced by that expression of ``s``, computed once from the
token ids after the graph's inputs. The graph's fake values are then propagated again with the batch
(where it was symbolic) and the sequence as symbols, so the metadata (boundary shapes, costs) is
what a ``dynamic_sequence=True`` trace gives: the stage boundaries of a pipeline follow each step's
length with no handshake, since every rank reads the length from the inputs it is given.

Anything else (the graphs differ in structure, a float or a lifted constant tensor depends on the
length, an integer fits none of the forms, the symbolic propagation fails) leaves the graph as it
was traced, static, and the reason is returned: the plan then serves shorter lengths padded to
``L`` ([Note: padding to the traced length] in fxsplit.api.padding). Two traces agreeing on a form
is evidence, not proof, so ``fxsplit.verify`` also runs a rewritten plan at ``L // 2`` against the
model, as it checks padding.

    gm, why = follow_sequence(gm, again=lambda n: export_at(n), propagate=prop)   # why: None or the reason
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

__all__ = ["follow_sequence", "sequence_input", "at_length"]

_sym_size = torch.ops.aten.sym_size.int


def sequence_input(gm: torch.fx.GraphModule) -> tuple[torch.fx.Node, int] | None:
    """The token-ids placeholder and its static length ``L`` (None: no such input, or a symbolic one)."""
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if n.op == "placeholder" and isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dim() >= 2:
            return (n, v.shape[1]) if type(v.shape[1]) is int else None
    return None


def at_length(values: Any, length: int, n: int) -> Any:
    """``values`` (a pytree of example inputs) with every tensor whose dim 1 is ``length`` cut to ``n``."""
    def cut(x: Any) -> Any:
        return x[:, :n].contiguous() if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == length else x

    return pytree.tree_map(cut, values)


def _fit(v1: int, v2: int, length: int) -> tuple[int, int, int] | None:
    """``(k, a, c)`` with ``v = k*s*s + a*s + c`` at s = length and length - 1, in one of the forms of
    the Note; None when neither fits."""
    short = length - 1
    d = v1 - v2
    if v1 == d * length:
        return 0, d, 0
    if d == 1:
        return 0, 1, v1 - length
    if v1 % (length * length) == 0 and v2 == (v1 // (length * length)) * short * short:
        return v1 // (length * length), 0, 0
    return None


def _literals(g1: torch.fx.GraphModule, g2: torch.fx.GraphModule, length: int) -> tuple[dict, str | None]:
    """{(node, flat argument index): (k, a, c)} of the length literals of ``g1``, or the reason the two
    traces cannot be matched."""
    n1, n2 = list(g1.graph.nodes), list(g2.graph.nodes)
    if len(n1) != len(n2):
        return {}, f"the traces at {length} and {length - 1} positions have {len(n1)} and {len(n2)} nodes"
    index = {a: i for i, a in enumerate(n1)}
    index2 = {b: i for i, b in enumerate(n2)}
    found: dict = {}
    for a, b in zip(n1, n2):
        if a.op != b.op or str(a.target) != str(b.target):
            return {}, f"node {a.name} ({a.op} {a.target}) is {b.op} {b.target} in the trace at {length - 1}"
        flat1, spec1 = pytree.tree_flatten((a.args, a.kwargs))
        flat2, spec2 = pytree.tree_flatten((b.args, b.kwargs))
        if spec1 != spec2:
            return {}, f"node {a.name} ({a.target}) has other arguments in the trace at {length - 1}"
        for k, (x, y) in enumerate(zip(flat1, flat2)):
            if isinstance(x, torch.fx.Node) and isinstance(y, torch.fx.Node):
                if index[x] != index2[y]:
                    return {}, f"node {a.name} ({a.target}) reads other values in the trace at {length - 1}"
            elif type(x) is int and type(y) is int:
                if x != y:
                    form = _fit(x, y, length)
                    if form is None:
                        return {}, (f"node {a.name} ({a.target}) takes {x} at {length} positions and {y} at "
                                    f"{length - 1}, which is no expression of the length fxsplit knows")
                    found[(a, k)] = form
            elif type(x) is not type(y) or x != y:
                return {}, (f"node {a.name} ({a.target}) takes {x!r} at {length} positions and {y!r} at "
                            f"{length - 1}: a value that depends on the length")
        if a.op == "get_attr":
            t1, t2 = _attr(g1, str(a.target)), _attr(g2, str(b.target))
            if isinstance(t1, torch.Tensor) and (not isinstance(t2, torch.Tensor) or t1.shape != t2.shape or (
                    not t1.is_meta and not isinstance(t1, torch.nn.Parameter) and not torch.equal(t1, t2))):
                return {}, f"the constant {a.target} of the graph depends on the length"
    return found, None


def _attr(gm: torch.fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


class _Exprs:
    """Nodes computing ``k*s*s + a*s + c`` from ``s``, one per form, inserted after ``s``."""

    def __init__(self, graph: torch.fx.Graph, s: torch.fx.Node) -> None:
        self.graph, self.s, self.last, self.made = graph, s, s, {}

    def _op(self, fn: Callable, *args: Any) -> torch.fx.Node:
        with self.graph.inserting_after(self.last):
            self.last = self.graph.call_function(fn, args)
        return self.last

    def get(self, form: tuple[int, int, int]) -> torch.fx.Node:
        if form not in self.made:
            k, a, c = form
            terms = []
            if k:
                sq = self._op(operator.mul, self.s, self.s)
                terms.append(sq if k == 1 else self._op(operator.mul, sq, k))
            if a:
                terms.append(self.s if a == 1 else self._op(operator.mul, self.s, a))
            out = terms[0]
            for t in terms[1:]:
                out = self._op(operator.add, out, t)
            self.made[form] = out if not c else self._op(operator.add, out, c)
        return self.made[form]


def follow_sequence(gm: torch.fx.GraphModule, *, again: Callable[[int], torch.fx.GraphModule],
                    propagate: Callable[[torch.fx.GraphModule], None]) -> tuple[torch.fx.GraphModule, str | None]:
    """Rewrite ``gm`` (static sequence ``L``) so that it takes the length of its token ids ([Note:
    following the sequence from two static traces]). ``again(n)``: the model traced at ``n`` positions;
    ``propagate(gm)``: fill ``meta["val"]`` with the sequence symbolic (raises when it cannot). Returns
    ``(gm, None)`` rewritten, or ``(gm, why)`` with ``gm`` unchanged and the reason."""
    found = sequence_input(gm)
    if found is None:
        return gm, "the graph has no integer token input of static length"
    ids, length = found
    if length < 3:
        return gm, f"the traced length {length} is too short to tell the length from other sizes"
    try:
        other = again(length - 1)
    except Exception as exc:  # noqa: BLE001 -- the reason is recorded; the static graph still serves
        return gm, f"the trace at {length - 1} positions failed ({type(exc).__name__}: {str(exc)[:200]})"
    literals, why = _literals(gm, other, length)
    if why is not None:
        return gm, why
    if not literals:
        return gm, None if _propagated(gm, propagate) is None else "no size of the graph depends on the length"
    saved = {n: (n.args, n.kwargs, n.meta.get("val")) for n in gm.graph.nodes}
    last_input = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(last_input):
        s = gm.graph.call_function(_sym_size, (ids, 1))
    exprs = _Exprs(gm.graph, s)
    by_node: dict = {}
    for (node, k), form in literals.items():
        by_node.setdefault(node, {})[k] = exprs.get(form)
    for node, subs in by_node.items():
        flat, spec = pytree.tree_flatten((node.args, node.kwargs))
        for k, expr in subs.items():
            flat[k] = expr
        node.args, node.kwargs = pytree.tree_unflatten(flat, spec)
    gm.graph.lint()
    gm.recompile()
    failed = _propagated(gm, propagate)
    if failed is None:
        return gm, None
    added = [n for n in gm.graph.nodes if n not in saved]
    for n, (args, kwargs, val) in saved.items():
        n.args, n.kwargs = args, kwargs
        n.meta["val"] = val
    for n in reversed(added):
        gm.graph.erase_node(n)
    gm.recompile()
    return gm, f"the graph with the length as a symbol does not propagate ({failed})"


def _propagated(gm: torch.fx.GraphModule, propagate: Callable[[torch.fx.GraphModule], None]) -> str | None:
    try:
        propagate(gm)
    except Exception as exc:  # noqa: BLE001 -- the caller keeps the static graph and says why
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return None
