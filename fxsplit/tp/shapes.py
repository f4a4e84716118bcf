"""Shape arithmetic and the data the sharding-propagation rules share.

Terms (see ``fxsplit.tp.propagate``): **sharded dim** (``State.dim``), **origins** (the seeds
whose whole output feature dim a value's sharded dim still is, so their block layout is still
free), **view groups** (``view_groups``), **rule** (``Rule``: a function of the propagation and
one ``Op``). Pure functions of node metadata; nothing here mutates a graph.

    view_groups((2, 16, 96), (2, 16, 3, 4, 8))   # [([0], [0]), ([1], [1]), ([2], [2, 3, 4])]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import sympy
import torch
import torch.fx

from fxsplit.graph.meta import to_expr

__all__ = [
    "node_shape",
    "eq",
    "view_groups",
    "norm_dim",
    "int_args",
    "arg",
    "tensor_inputs",
    "State",
    "RegionFailed",
    "Op",
    "Rule",
    "divisibility_msg",
    "LocalSize",
]


def node_shape(node: Any) -> tuple | None:
    """The traced shape of a tensor value (sizes as ints or sympy expressions), else None."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if isinstance(val, torch.Tensor):
        return tuple(to_expr(s) for s in val.shape)
    return None


def eq(a: Any, b: Any) -> bool:
    return sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0


def view_groups(a: tuple, b: tuple) -> list[tuple[list[int], list[int]]] | None:
    """Match the dims of a view from shape ``a`` to shape ``b`` into groups of equal product
    (DTensor's view ops call the same thing Flatten / Split of input dims)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        gi, gj = [i], [j]
        pa, pb = sympy.sympify(a[i]), sympy.sympify(b[j])
        i, j = i + 1, j + 1
        for _ in range(64):
            if eq(pa, pb):
                break
            num, den = sympy.fraction(sympy.cancel(pb / pa))
            if den == 1 and i < len(a):  # pb is a multiple of pa: take more of a
                gi.append(i)
                pa = pa * a[i]
                i += 1
            elif j < len(b):
                gj.append(j)
                pb = pb * b[j]
                j += 1
            elif i < len(a):
                gi.append(i)
                pa = pa * a[i]
                i += 1
            else:
                return None
        else:
            return None
        groups.append((gi, gj))
    # trailing size-1 dims join the last group
    if not groups:
        return [([*range(len(a))], [*range(len(b))])]
    groups[-1][0].extend(range(i, len(a)))
    groups[-1][1].extend(range(j, len(b)))
    return groups


def norm_dim(d: int, n: int) -> int:
    return d % n if n else d


def int_args(node: torch.fx.Node, start: int) -> list:
    """fx varargs (x.view(a, b, c)) or one list argument (x.view([a, b, c]))."""
    rest = list(node.args[start:])
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        return list(rest[0])
    return rest


def arg(node: torch.fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` of a call, given by position ``index`` or by keyword (aten ops: the
    position in the op's schema, ``index`` ignored)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        names = [a.name for a in target._schema.arguments]
        if name in names:
            index = names.index(name)
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name, default)


def tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


@dataclass
class State:
    """How one value is sharded ([Note: sharded-dim propagation] in ``fxsplit.tp.propagate``)."""

    dim: int
    origins: frozenset  # seeds whose whole output feature dim this sharded dim is (layout still free)
    merged: int | None = None  # H: the dim is [N, H] with H sharded ([Note: heads merged as an inner factor])


@dataclass(frozen=True)
class LocalSize:
    """A rewrite value for a shape argument computed at run time (fx ``c`` of ``B, N, c =
    x.shape`` in ``y.reshape(B, N, c)``): the pass replaces the argument by ``arg // divisor``."""

    divisor: int


class RegionFailed(Exception):
    """These seeds cannot form a region; the message (node and why) is the plan's replicated reason."""


@dataclass(frozen=True)
class Op:
    """One node seen by a rule: ``st`` is the state of its first argument (None: replicated)."""

    node: torch.fx.Node
    name: str
    st: State | None
    out_shape: tuple | None  # None: the op returns no tensor (a tuple of tensors, a size)

    @property
    def x(self) -> Any:
        return self.node.args[0] if self.node.args else None


@dataclass(frozen=True)
class Rule:
    """``fn(prop, op)`` sets the sharded dim of ``op.node`` (``prop.set``), records shape
    rewrites, or fails the region (``prop.fail``). ``output``: the results the rule handles,
    "tensor" (one tensor), "tuple" (no single tensor: split, chunk) or "any". A rule without
    ``any_operand`` runs only when the first operand is the sharded one; ``merged`` says what
    it does with a merged sharded dim."""

    fn: Callable[[Any, Op], None]
    output: str = "tensor"
    any_operand: bool = False  # the rule reads every operand's state, not only the first's
    # a value whose sharded dim is merged (``State.merged``, ``fxsplit.tp.merged``): "" no rule,
    # "carry" the rule is exact for any layout of the sharded dim (its outputs stay merged),
    # "own" the rule reads ``State.merged`` itself
    merged: str = ""

    def accepts(self, out_shape: tuple | None) -> bool:
        return self.output == "any" or (out_shape is None) == (self.output == "tuple")


# --------------------------------------------------------------------------------------------
# error text


def _node_where(node: torch.fx.Node) -> str:
    info = node.meta.get("fxsplit")
    path = getattr(info, "module_path", "") or ""
    return f"node {node.name!r}" + (f" in module {path!r}" if path else "")


def _nearest_t(sizes: list[int], t: int) -> str:
    ok = [d for d in range(1, 65) if all(s % d == 0 for s in sizes)]
    below = [d for d in ok if d < t]
    above = [d for d in ok if d > t]
    near = ([below[-1]] if below else []) + ([above[0]] if above else [])
    return " or ".join(f"t={d}" for d in near)


def divisibility_msg(node, t, sizes, what) -> str:
    """The TPPlanError text for sizes that t does not divide: where, the sizes, the nearest valid t."""
    sizes_l = sizes if isinstance(sizes, list) else [sizes]
    heads = ""
    sh = node_shape(node)
    if sh is not None and len(sh) in (4, 5):
        heads = " (the number of attention heads or key/value heads)"
    return (f"tensor parallel t={t}: {what} at {_node_where(node)} has size {sizes}{heads}, "
            f"which t={t} does not divide; nearest valid t: {_nearest_t(sizes_l, t)}")
