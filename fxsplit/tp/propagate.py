"""Sharded-dim propagation: which dim of each value carries a tensor-parallel shard.

Terms (see ``fxsplit.tp.plan`` for t, column / row, region, blocks):
- **sharded dim**: the one dim of a value that holds 1/t of its global size on each rank
  (``State.dim``); a value with no entry in ``Propagation.state`` is replicated.
- **seeds**: the column linears a region is tried from; their outputs are sharded on the last
  (feature) dim. **origins**: the seeds whose output blocks a later ``split`` may still choose.
- **view groups**: the dims of a view ``a -> b`` matched into groups of equal size product
  (``_view_groups``); symbolic sizes are compared with sympy.
- **rewrites**: ``(node name, argument path, local int)``, shape arguments (view sizes, split
  sizes, expand sizes) that become local sizes once the value is sharded.
- **op name**: one short name per op shared by fx and export graphs
  (``fxsplit.graph.ops.op_name``, [Note: op names]); the op classes are that module's too.
- **rules**: :data:`RULES`, op name -> :class:`Rule`, one small function per op family (views,
  transposes, splits, pointwise, softmax, attention, ...) registered in one table; an op with
  no rule leaves the region replicated, and the plan names the op (:func:`rule_for`).

    prop = Propagation(gm, t, linears, seeds=["q", "k", "v"], excluded=set(), forced_rows=set())
    prop.run()           # raises RegionFailed (the region stays replicated) or TPPlanError
    prop.state["attn"]   # State(dim=1, origins=frozenset()); prop.rows == ["o"]

[Note: sharded-dim propagation] The dim is pushed forward in graph order from the seeds through
pointwise ops (with broadcast operands), views/reshapes (the sharded dim must be the outer dim
of its view group), transposes, permutes, splits/chunks, expand and repeat_interleave
(grouped-query attention), slices and cats on other dims (RoPE), softmax on other dims,
scaled-dot-product attention and batched matmuls over heads, until every path ends in a linear
whose input feature dim is the sharded one (a row linear). Anything else (a norm or reduction
over the sharded dim, a residual add with a replicated tensor, a model output, reading the
sharded size) raises :class:`RegionFailed` naming the node: the region stays replicated and the
plan says why. A sharded size that t does not divide raises :class:`TPPlanError` (node, module,
sizes, nearest valid t). ``fxsplit.tp.plan.find_tp_plan`` chooses the seeds and turns the
result into the plan; ``fxsplit.passes.tensor_parallel`` applies ``rewrites``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import sympy
import torch
import torch.fx

from fxsplit.graph.meta import to_expr
from fxsplit.graph.ops import ELEMENTWISE, RESHAPES, is_elementwise, op_name
from fxsplit.errors import TPPlanError

__all__ = [
    "TPPlanError",
    "node_shape",
    "divisibility_msg",
    "State",
    "RegionFailed",
    "Propagation",
    "Op",
    "Rule",
    "RULES",
    "rule_for",
]


# --------------------------------------------------------------------------------------------
# shapes


def node_shape(node: Any) -> tuple | None:
    """The traced shape of a tensor value (sizes as ints or sympy expressions), else None."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if isinstance(val, torch.Tensor):
        return tuple(to_expr(s) for s in val.shape)
    return None


def _eq(a: Any, b: Any) -> bool:
    return sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0


def _view_groups(a: tuple, b: tuple) -> list[tuple[list[int], list[int]]] | None:
    """Match the dims of a view from shape ``a`` to shape ``b`` into groups of equal product."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        gi, gj = [i], [j]
        pa, pb = sympy.sympify(a[i]), sympy.sympify(b[j])
        i, j = i + 1, j + 1
        for _ in range(64):
            if _eq(pa, pb):
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

# --------------------------------------------------------------------------------------------
# propagation


@dataclass
class State:
    """How one value is sharded ([Note: sharded-dim propagation])."""

    dim: int
    origins: frozenset  # seed linears whose output blocks may still be chosen by a split


class RegionFailed(Exception):
    """These seeds cannot form a region; the message (node and why) is the plan's replicated reason."""


def _tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def _int_args(node: torch.fx.Node, start: int) -> list:
    """fx varargs (x.view(a, b, c)) or one list argument (x.view([a, b, c]))."""
    rest = list(node.args[start:])
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        return list(rest[0])
    return rest


def _norm(d: int, n: int) -> int:
    return d % n if n else d


class Propagation:
    """Push sharded dims from a set of column linears forward through the graph
    ([Note: sharded-dim propagation]); ``run`` fills ``state``, ``rows``, ``blocks``, ``rewrites``.
    Each op is handled by its rule in :data:`RULES` (``step`` looks it up)."""

    def __init__(self, gm, t, linears, seeds, excluded, forced_rows):
        self.gm, self.t, self.linears = gm, t, linears
        self.seeds = set(seeds)
        self.excluded = excluded
        self.forced_rows = forced_rows
        self.state: dict[str, State] = {}
        self.rows: list[str] = []
        self.blocks: dict[str, tuple[int, ...]] = {}
        self.rewrites: list[tuple[str, tuple, int]] = []
        self.reshaped: set[str] = set()
        self.shape_of: dict[str, int] = {}  # fx getattr(x, "shape") of a sharded x -> its dim

    def fail(self, node: torch.fx.Node, why: str) -> None:
        raise RegionFailed(f"{node.name} ({op_name(node, self.gm)}): {why}")

    def run(self) -> None:
        for node in self.gm.graph.nodes:
            if node.name in self.seeds:
                self.state[node.name] = State(len(node_shape(node)) - 1, frozenset([node.name]))
                continue
            ins = [a for a in node.all_input_nodes if a.name in self.state or a.name in self.shape_of]
            if not ins:
                continue
            self.step(node)

    def _set(self, node, dim, origins=frozenset()):
        self.state[node.name] = State(dim, origins)

    def _rewrite(self, node, path, value, dim_size):
        if isinstance(value, int) and value != -1:
            if value % self.t:
                raise TPPlanError(divisibility_msg(node, self.t, value, "a shape argument"))
            self.rewrites.append((node.name, path, value // self.t))
        elif isinstance(value, torch.fx.Node):
            self.fail(node, f"the sharded size {dim_size} is computed at run time ({value.name}); "
                            "it must be a constant or -1 to be rewritten to the local size")

    def step(self, node: torch.fx.Node) -> None:
        """One node with a sharded input: the model output, a read of a sharded size, a row
        linear (the region ends), else the rule of its op (:func:`rule_for`); no rule fails."""
        name = op_name(node, self.gm)
        if node.op == "output":
            self.fail(node, "a sharded value is a model output")
        if any(a.name in self.shape_of for a in node.all_input_nodes):  # fx: B, T, C = x.shape
            return self._read_shape(node, name)
        if node.name in self.linears:
            return self._end_at_row(node)
        x = node.args[0] if node.args else None
        op = Op(node, name, self.state.get(x.name) if isinstance(x, torch.fx.Node) else None, node_shape(node))
        rule = rule_for(node, name)
        if rule is None or not rule.accepts(op.out_shape):
            return _no_rule(self, op)
        rule.fn(self, op)

    def _read_shape(self, node, name):
        src = next(a for a in node.all_input_nodes if a.name in self.shape_of)
        if name == "getitem" and isinstance(node.args[1], int):
            if _norm(node.args[1], len(node_shape(src.args[0]) or ())) != self.shape_of[src.name]:
                return
        self.fail(node, "reads the size of the sharded dim")

    def _end_at_row(self, node):
        """A linear reading the sharded value on its features ends the region as a row linear."""
        info = self.linears[node.name]
        if node.name in self.excluded:
            self.fail(node, f"{info.module_path} is set to replicate")
        ins = [a for a in node.all_input_nodes if a.name in self.state]
        xin = node.args[info.x_index] if info.kind != "module" else node.args[0]
        if not isinstance(xin, torch.fx.Node) or xin.name not in self.state or len(ins) != 1:
            self.fail(node, "a sharded weight or bias")
        xs = node_shape(xin)
        if self.state[xin.name].dim != len(xs) - 1:
            self.fail(node, f"input sharded on dim {self.state[xin.name].dim}, not on its features")
        if self.state[xin.name].origins & set(self.blocks):
            self.fail(node, "input still carries fused blocks")
        self.rows.append(node.name)


# --------------------------------------------------------------------------------------------
# rules: op name -> how the sharded dim moves through the op ([Note: sharded-dim propagation])


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
    """``fn(prop, op)`` sets the sharded dim of ``op.node`` (``prop._set``), records shape
    rewrites, or fails the region (``prop.fail``). ``output``: the results the rule handles,
    "tensor" (one tensor), "tuple" (no single tensor: split, chunk) or "any"."""

    fn: Callable[[Propagation, Op], None]
    output: str = "tensor"

    def accepts(self, out_shape: tuple | None) -> bool:
        return self.output == "any" or (out_shape is None) == (self.output == "tuple")


def _no_rule(p: Propagation, op: Op) -> None:
    """No rule for this op: the region stays replicated, and the reason names the op."""
    if op.out_shape is None:
        p.fail(op.node, "a sharded value used by an op that returns no tensor")
    if "norm" in op.name:
        p.fail(op.node, f"a normalization ({op.name}) reads the whole sharded feature dim")
    p.fail(op.node, "an op the pass does not know how to shard (left replicated)")


def _shape_attr(p: Propagation, op: Op) -> None:
    """fx ``x.shape`` of a sharded x: remembered, so that reading the sharded size fails."""
    if op.node.args[1] != "shape":
        return _no_rule(p, op)
    p.shape_of[op.node.name] = op.st.dim


def _size(p: Propagation, op: Op) -> None:
    node = op.node
    d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if d is not None and _norm(d, len(node_shape(op.x))) != op.st.dim:
        return
    p.fail(node, "reads the size of the sharded dim")


def _getitem(p: Propagation, op: Op) -> None:
    """A piece of a split (its state was set by :func:`_split`)."""
    node = op.node
    piece = p.state.get(f"{node.args[0].name}[{node.args[1]}]")
    if piece is None:
        p.fail(node, "indexing a sharded tensor")
    p._set(node, piece.dim, piece.origins)


def _view(p: Propagation, op: Op) -> None:
    """Views and reshapes: the sharded dim must be the outer dim of its view group; expand."""
    node, name, st, out_shape = op.node, op.name, op.st, op.out_shape
    in_shape = node_shape(node.args[0])
    if name in ("expand", "expand_as"):
        d = st.dim + len(out_shape) - len(in_shape)
        if name == "expand":
            sizes = _int_args(node, 1)
            lst = len(node.args) == 2 and isinstance(node.args[1], (list, tuple))
            p._rewrite(node, (1, d) if lst else (1 + d,), sizes[d], out_shape[d])
        else:
            p.fail(node, "expand_as of a sharded tensor")
        return p._set(node, d, st.origins)
    groups = _view_groups(in_shape, out_shape)
    if groups is None:
        p.fail(node, f"cannot match view {in_shape} -> {out_shape}")
    gi, gj = next((gi, gj) for gi, gj in groups if st.dim in gi)
    outer_in = [i for i in gi if not _eq(in_shape[i], 1)]
    outer_out = [j for j in gj if not _eq(out_shape[j], 1)]
    if not outer_in or outer_in[0] != st.dim or not outer_out:
        p.fail(node, f"the sharded dim {st.dim} of {in_shape} is merged into an outer dim by the view to {out_shape}")
    d = outer_out[0]
    size = out_shape[d]
    if not isinstance(size, int):
        p.fail(node, f"the sharded dim has symbolic size {size}")
    if size % p.t:
        raise TPPlanError(divisibility_msg(node, p.t, size, "a view of the sharded value"))
    changed = len(outer_in) != 1 or len(outer_out) != 1
    origins = st.origins
    if changed:
        p.reshaped |= set(origins)
    if name in ("view", "reshape"):
        sizes = _int_args(node, 1)
        lst = len(node.args) == 2 and isinstance(node.args[1], (list, tuple))
        if "size" in node.kwargs or "shape" in node.kwargs:
            p.fail(node, "shape given by keyword")
        p._rewrite(node, (1, d) if lst else (1 + d,), sizes[d], size)
    elif name in ("unflatten", "view_as"):
        p.fail(node, f"{name} of a sharded tensor")
    p._set(node, d, origins)


def _transpose(p: Propagation, op: Op) -> None:
    node, n = op.node, len(op.out_shape)
    if op.name == "t":
        d0, d1 = 0, 1
    else:
        d0, d1 = _norm(node.args[1], n), _norm(node.args[2], n)
    p._set(node, {d0: d1, d1: d0}.get(op.st.dim, op.st.dim), op.st.origins)


def _permute(p: Propagation, op: Op) -> None:
    dims = [_norm(d, len(op.out_shape)) for d in _int_args(op.node, 1)]
    p._set(op.node, dims.index(op.st.dim), op.st.origins)


def _repeat_interleave(p: Propagation, op: Op) -> None:
    """Grouped-query attention repeats key/value heads: the head dim stays sharded."""
    node = op.node
    if not isinstance(node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats"), int):
        p.fail(node, "repeats given as a tensor")
    p._set(node, op.st.dim, frozenset())


def _slice(p: Propagation, op: Op) -> None:
    node, st, out_shape = op.node, op.st, op.out_shape
    d = _norm(node.args[1] if len(node.args) > 1 else 0, len(out_shape))
    if d == st.dim and not _eq(out_shape[d], node_shape(op.x)[d]):
        p.fail(node, "slices the sharded dim")
    p._set(node, st.dim, st.origins)


def _cat(p: Propagation, op: Op) -> None:
    """A cat on another dim of tensors all sharded on one dim (RoPE's rotate_half)."""
    node = op.node
    tensors = node.args[0]
    d = _norm(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(op.out_shape))
    dims = {p.state[a.name].dim if a.name in p.state else None for a in tensors}
    if None in dims or len(dims) != 1:
        p.fail(node, "concatenates sharded and replicated tensors")
    (sd,) = dims
    if sd == d:
        p.fail(node, "concatenates along the sharded dim")
    p._set(node, sd)


def _softmax(p: Propagation, op: Op) -> None:
    node = op.node
    d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if d is None or _norm(d, len(op.out_shape)) == op.st.dim:
        p.fail(node, "softmax over the sharded dim")
    p._set(node, op.st.dim, op.st.origins)


def _split(p: Propagation, op: Op) -> None:
    """split / chunk: on another dim each piece keeps the dim; on the sharded dim, the blocks of
    a fused projection (q, k, v), each sharded by itself."""
    node, name, st = op.node, op.name, op.st
    xs = node_shape(node.args[0])
    n = len(xs)
    if name == "unbind":
        p.fail(node, "unbind of a sharded tensor")
    dim_arg = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    d = _norm(dim_arg, n)
    val = node.meta.get("val")
    sizes = [int(to_expr(v.shape[d])) for v in val]
    if d != st.dim:
        for i in range(len(sizes)):
            p.state[f"{node.name}[{i}]"] = State(st.dim, st.origins)
        p.state[node.name] = st
        return
    if name == "chunk":
        p.fail(node, "chunk on the sharded dim (use split)")
    arg = node.args[1]
    dynamic = [a for a in (arg if isinstance(arg, (list, tuple)) else [arg]) if isinstance(a, torch.fx.Node)]
    if dynamic:
        p.fail(node, f"the split sizes are computed at run time ({dynamic[0].name}); they must be constants "
                     "to be rewritten to the local sizes")
    bad = [s for s in sizes if s % p.t]
    if bad:
        raise TPPlanError(divisibility_msg(node, p.t, sizes, "the split of a fused projection"))
    if not st.origins or st.origins & p.reshaped:
        p.fail(node, "splits the sharded dim of a value that is not a projection's direct output")
    for o in st.origins:
        prev = p.blocks.get(o)
        if prev is not None and prev != tuple(sizes):
            p.fail(node, f"splits {o} into {sizes} and elsewhere into {prev}")
        p.blocks[o] = tuple(sizes)
    if isinstance(arg, int):
        p.rewrites.append((node.name, (1,), arg // p.t))
    else:
        for i, s in enumerate(arg):
            p.rewrites.append((node.name, (1, i), s // p.t))
    for i in range(len(sizes)):
        p.state[f"{node.name}[{i}]"] = State(d, frozenset())
    p.state[node.name] = st


def _sdpa(p: Propagation, op: Op) -> None:
    """Scaled-dot-product attention with q, k, v sharded by heads (a mask broadcast over heads)."""
    node, out_shape = op.node, op.out_shape
    q, k, v = node.args[:3]
    for a in (q, k, v):
        s = p.state.get(a.name) if isinstance(a, torch.fx.Node) else None
        if s is None or s.dim != len(node_shape(a)) - 3:
            p.fail(node, f"{a} is not sharded by heads")
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if isinstance(mask, torch.fx.Node):
        ms = node_shape(mask)
        pos = len(out_shape) - 3 - (len(out_shape) - len(ms))
        if mask.name in p.state:
            if p.state[mask.name].dim != pos:
                p.fail(node, "mask sharded on another dim")
        elif pos >= 0 and not _eq(ms[pos], 1):
            p.fail(node, f"attention mask {mask.name} has {ms[pos]} heads; a per-head mask is not sharded")
    p._set(node, len(out_shape) - 3)


def _matmul(p: Propagation, op: Op) -> None:
    """A batched matmul of two operands sharded on one batch dim (attention over heads)."""
    node, n = op.node, len(op.out_shape)
    a, b = node.args[:2]
    sa, sb = node_shape(a), node_shape(b)
    if a.name not in p.state or b.name not in p.state or len(sa) < 3 or len(sb) < 3:
        p.fail(node, "matmul with one sharded operand")
    da, db = p.state[a.name].dim, p.state[b.name].dim
    if da >= len(sa) - 2 or db >= len(sb) - 2 or da + n - len(sa) != db + n - len(sb):
        p.fail(node, "matmul not batched over the sharded dim")
    p._set(node, da + n - len(sa))


def _pointwise(p: Propagation, op: Op) -> None:
    """Pointwise ops: every sharded operand on one (broadcast) dim; replicated operands of size 1 there."""
    node, n = op.node, len(op.out_shape)
    out_dim, origins = None, frozenset()
    for a in _tensor_inputs(node):
        s = node_shape(a)
        if a.name in p.state:
            d = p.state[a.name].dim + n - len(s)
            if out_dim is not None and d != out_dim:
                p.fail(node, "operands sharded on different dims")
            out_dim = d
            origins |= p.state[a.name].origins
    for a in _tensor_inputs(node):
        if a.name in p.state:
            continue
        s = node_shape(a)
        pos = out_dim - (n - len(s))
        if pos >= 0 and not _eq(s[pos], 1):
            p.fail(node, f"combines the sharded value with replicated {a.name} of full size {s[pos]} on the sharded dim")
    p._set(node, out_dim, origins)


_POINTWISE_RULE = Rule(_pointwise)

# The one registry of propagation rules: op names -> rule. Ops with aten's pointwise tag and no
# entry here use the pointwise rule (:func:`rule_for`); anything else has no rule (:func:`_no_rule`).
_RULE_TABLE: tuple[tuple[Iterable[str], Rule], ...] = (
    (("getattr",), Rule(_shape_attr, "any")),
    (("size", "sym_size"), Rule(_size, "any")),
    (("getitem",), Rule(_getitem, "any")),
    (("split", "split_with_sizes", "chunk", "unbind"), Rule(_split, "tuple")),
    (sorted(RESHAPES | {"expand", "expand_as"}), Rule(_view)),
    (("transpose", "swapaxes", "t"), Rule(_transpose)),
    (("permute",), Rule(_permute)),
    (("repeat_interleave",), Rule(_repeat_interleave)),
    (("slice",), Rule(_slice)),
    (("cat",), Rule(_cat)),
    (("softmax", "log_softmax"), Rule(_softmax)),
    (("scaled_dot_product_attention",), Rule(_sdpa)),
    (("matmul", "bmm"), Rule(_matmul)),
    (sorted(ELEMENTWISE), _POINTWISE_RULE),
)
RULES: dict[str, Rule] = {name: rule for names, rule in _RULE_TABLE for name in names}
assert len(RULES) == sum(len(list(names)) for names, _ in _RULE_TABLE), "an op name has two propagation rules"


def rule_for(node: torch.fx.Node, name: str) -> Rule | None:
    """The propagation rule of a node's op: its entry in :data:`RULES`, else the pointwise rule
    for an aten op tagged pointwise, else None (no rule: the region stays replicated)."""
    rule = RULES.get(name)
    if rule is None and is_elementwise(node, name):
        rule = _POINTWISE_RULE
    return rule


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
    if sh is not None and len(sh) == 4:
        heads = " (the number of attention heads or key/value heads)"
    return (f"tensor parallel t={t}: {what} at {_node_where(node)} has size {sizes}{heads}, "
            f"which t={t} does not divide; nearest valid t: {_nearest_t(sizes_l, t)}")

