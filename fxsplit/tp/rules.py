"""The sharding-propagation rules: op name -> how a sharded dim passes through the op.

Terms (``fxsplit.tp.shapes``, ``fxsplit.tp.propagate``): sharded dim, origins (a seed's output
whose block layout is still free), choice (a view that splits a free dim picks which factor
carries the shard), cuts / pieces (the boundaries a fused projection's output is split at, and
the ranges that must stay whole). One small function per op family, registered in one table,
as DTensor registers one strategy per op and tinygrad writes its rewrites as data.

    RULES["select"]          # Rule(_select): select on another dim drops that dim
    rule_for(node, "mean")   # a reduction over other dims keeps the sharded dim (per-head norms)

[Note: factored views] (DTensor's ``_view_ops`` calls them Split / Flatten of an input dim.) A
view splits a dim into factors ``[B, N, 3*H*hd] -> [B, N, 3, H, hd]`` or merges factors back.
A sharded dim (rank r holds a contiguous 1/t of it) passes through a merge as the outer
factor (as the inner one it becomes a merged dim: ``fxsplit.tp.merged``), and through a split as the outer factor (a contiguous range of ``H*hd`` is a range of
``H``). A seed's own output (``origins``) has no layout yet: the weight rows can be permuted at
materialization, so the view may put the shard on ANY factor t divides -- on ``H`` in ``[3, H,
hd]`` every rank gets the r-th 1/t of each of the 3 blocks, i.e. the weight is sharded with
``blocks=(H*hd,)*3``. Which factor is a choice (``prop.choose``): outermost first, and the
propagation backtracks to the next when a later op fails (sharding ``3`` at t=3 fails at the
``unbind`` of q/k/v; sharding ``hd`` fails at attention's contraction). Splits, chunks and
slices of a seed's output on its feature dim cut it into blocks the same way (``prop.cut``).
A use that fixes the layout as one contiguous range (a row linear, or any op whose output is no
longer free: stack, a norm, attention) records the whole range as a piece, and a piece with a
cut inside fails the region (``fxsplit.tp.propagate._blocks``): all uses of one weight agree on its
blocks. Every rule stays exact for any choice, so whatever propagates is right.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.fx

from fxsplit.errors import TPPlanError
from fxsplit.graph.ops import ELEMENTWISE, RESHAPES, is_elementwise, op_name
from fxsplit.graph.meta import to_expr
from fxsplit.tp import merged
from fxsplit.tp.shapes import (Op, Rule, State, arg, divisibility_msg, eq, int_args, node_shape, norm_dim,
                               tensor_inputs, view_groups)

__all__ = ["RULES", "rule_for", "no_rule", "REDUCTION_NAMES"]


def no_rule(p, op: Op) -> None:
    """No rule for this op: the region stays replicated, and the reason names the op."""
    if op.out_shape is None:
        p.fail(op.node, "a sharded value used by an op that returns no tensor")
    if "norm" in op.name:
        p.fail(op.node, f"a normalization ({op.name}) reads the whole sharded feature dim")
    seeds = {p.linears[s].module_path: "replicate" for s in sorted(p.seeds)}
    p.fail(op.node, f"an op the pass does not know how to shard (left replicated): no propagation rule for "
                    f"'{op.name}' (fxsplit.tp.rules.RULES), and no tp_plan style shards through it (tp_plan="
                    f"{seeds} says so and skips the attempt; the other linears sharing their input are "
                    f"tried without them)")


def _shape_attr(p, op: Op) -> None:
    """fx ``x.shape`` of a sharded x: remembered, so that reading the sharded size fails."""
    if op.node.args[1] != "shape":
        return no_rule(p, op)
    p.now.shape_of[op.node.name] = op.st.dim


def _size(p, op: Op) -> None:
    node = op.node
    d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if d is not None and norm_dim(d, len(node_shape(op.x))) != op.st.dim:
        return
    if d is not None and op.st.merged is not None:
        return merged.size_read(p, node, op.st.merged)
    p.fail(node, "reads the size of the sharded dim")


def _getitem(p, op: Op) -> None:
    """A piece of a split (its state was set by :func:`_split`), or fx tensor indexing."""
    node = op.node
    piece = p.now.state.get(f"{node.args[0].name}[{node.args[1]}]")
    if f"{node.args[0].name}[{node.args[1]}]" in p.now.cuts.whole_pieces:
        p.now.cuts.whole_read.add(f"{node.args[0].name}[{node.args[1]}]")
        return  # a block kept whole: replicated ([Note: whole blocks])
    if piece is not None:
        return p.set(node, piece.dim, piece.origins)
    if op.st is not None and node_shape(node.args[0]) is not None and op.out_shape is not None:
        return _fx_index(p, op)
    p.fail(node, "indexing a sharded tensor")


def _fx_index(p, op: Op) -> None:
    """fx ``x[..., :hd]``, ``x[:, 0]``, ``x[None]``: basic indexing of other dims keeps the
    sharded dim; a slice of a seed's output on its feature dim cuts it into blocks."""
    node, st = op.node, op.st
    shape = node_shape(op.x)
    idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if any(isinstance(i, torch.fx.Node) or not (i is None or i is Ellipsis or isinstance(i, (int, slice)))
           for i in idx):
        p.fail(node, "indexes a sharded tensor with a tensor or a computed index")
    if sum(i is Ellipsis for i in idx) > 1:
        p.fail(node, "two ellipses")
    used = sum(1 for i in idx if i is not None and i is not Ellipsis)
    full: list[tuple[int | None, object]] = []  # (position in the index tuple, index)
    for k, i in enumerate(idx):
        full.extend([(None, slice(None))] * (len(shape) - used) if i is Ellipsis else [(k, i)])
    full.extend([(None, slice(None))] * (len(shape) - sum(1 for _, i in full if i is not None)))
    din = dout = 0
    out_dim, cut = None, False
    for k, i in full:
        if i is None:
            dout += 1
            continue
        if din == st.dim:
            if isinstance(i, int):
                p.fail(node, "selects one index of the sharded dim")
            if i != slice(None):
                path = (1, k) if isinstance(node.args[1], tuple) else (1,)
                _cut_slice(p, op, i.start, i.stop, i.step, path, slice_obj=True)
                cut = True
            out_dim = dout
        if not isinstance(i, int):
            dout += 1
        din += 1
    p.set(node, out_dim, frozenset() if cut else st.origins)


def _cut_slice(p, op: Op, start, stop, step, path, slice_obj=False) -> None:
    """A slice of the sharded dim: only of a seed's own output (a block of a fused projection),
    with constant bounds; the bounds become local (``x / t``: every block divides by t)."""
    node, st = op.node, op.st
    size = node_shape(op.x)[st.dim]
    if step not in (None, 1):
        p.fail(node, "slices the sharded dim with a step")
    if not st.origins:
        p.fail(node, "slices the sharded dim of a value that is not a projection's direct output")
    if any(isinstance(v, torch.fx.Node) for v in (start, stop)) or not isinstance(size, int):
        p.fail(node, "slices the sharded dim at bounds computed at run time")
    a = 0 if start is None else (start + size if start < 0 else min(start, size))
    b = size if stop is None or stop >= size else (stop + size if stop < 0 else stop)
    if b <= a:
        p.fail(node, "an empty slice of the sharded dim")
    p.cut(st.origins, node, [(a, b)], f"slice [{a}:{b}]")
    if slice_obj:
        p.rewrite_slice(node, path, start, stop, size)
    else:
        for pos, v in ((2, start), (3, stop)):
            if isinstance(v, int) and -size < v < size and v != 0:
                p.local_arg(node.name, (pos,), v // p.t)


def _view(p, op: Op) -> None:
    """Views and reshapes ([Note: factored views]); expand / broadcast_to."""
    node, name, st, out_shape = op.node, op.name, op.st, op.out_shape
    in_shape = node_shape(node.args[0])
    if st.merged is not None:
        return merged.view(p, op)
    if name in ("expand", "expand_as", "broadcast_to"):
        d = st.dim + len(out_shape) - len(in_shape)
        if name in ("expand", "broadcast_to"):
            sizes = int_args(node, 1)
            lst = len(node.args) == 2 and isinstance(node.args[1], (list, tuple))
            p.rewrite(node, (1, d) if lst else (1 + d,), sizes[d], out_shape[d])
        else:
            p.fail(node, "expand_as of a sharded tensor")
        return p.set(node, d, st.origins)
    groups = view_groups(in_shape, out_shape)
    if groups is None:
        p.fail(node, f"cannot match view {in_shape} -> {out_shape}")
    gi, gj = next((gi, gj) for gi, gj in groups if st.dim in gi)
    outer_in = [i for i in gi if not eq(in_shape[i], 1)]
    outer_out = [j for j in gj if not eq(out_shape[j], 1)]
    if not outer_in or outer_in[0] != st.dim or not outer_out:
        if outer_in and merged.enter(p, op, outer_in, outer_out, in_shape, out_shape):
            return  # the heads merged as the inner factor ([Note: heads merged as an inner factor])
        p.fail(node, f"the sharded dim {st.dim} of {in_shape} is merged into an outer dim by the view to {out_shape}")
    if len(outer_in) > 1 and len(outer_out) > 1:
        p.fail(node, f"the view {in_shape} -> {out_shape} regroups the sharded dim")
    if any(not isinstance(out_shape[j], int) for j in outer_out):
        p.fail(node, f"the sharded dim has symbolic size {[out_shape[j] for j in outer_out]}")
    free = bool(st.origins) and len(outer_out) > 1
    cands = outer_out if free else outer_out[:1]
    ok = [j for j in cands if out_shape[j] % p.t == 0]
    if not ok:
        sizes = [out_shape[j] for j in cands]
        raise TPPlanError(divisibility_msg(node, p.t, sizes[0] if len(sizes) == 1 else sizes,
                                           "a view of the sharded value"))
    for j in cands:
        if j not in ok:
            p.skipped(f"t={p.t} does not divide the factor {out_shape[j]} of the view to {list(out_shape)} at {node.name}")
    # the heads of [..., heads, head_dim]: t divides no factor but head_dim (with another factor
    # divisible, as [heads, 3, hd] or [3, heads, hd], the search tries it and replicates with a reason)
    if free and len(cands) >= 2 and not any(j in ok for j in cands[:-1]):
        p.indivisible(divisibility_msg(node, p.t, out_shape[cands[-2]], "a view of the sharded value"))
    d = ok[p.choose(node, len(ok))]
    origins = st.origins
    if len(outer_in) != 1 or len(outer_out) != 1:
        if origins:
            k = outer_out.index(d)
            n = math.prod(out_shape[j] for j in outer_out[:k])
            size = in_shape[st.dim]
            block = size // n
            p.cut(origins, node, [(i * block, (i + 1) * block) for i in range(n)],
                  f"view {[out_shape[j] for j in outer_out]}, shard on factor {k} ({out_shape[d]})")
        origins = frozenset()
    if name in ("view", "reshape"):
        sizes = int_args(node, 1)
        lst = len(node.args) == 2 and isinstance(node.args[1], (list, tuple))
        if "size" in node.kwargs or "shape" in node.kwargs:
            p.fail(node, "shape given by keyword")
        p.rewrite(node, (1, d) if lst else (1 + d,), sizes[d], out_shape[d])
    elif name == "unflatten":
        start = norm_dim(arg(node, 1, "dim"), len(in_shape))
        if not isinstance(node.args[2] if len(node.args) > 2 else None, (list, tuple)):
            p.fail(node, "unflatten sizes given by keyword")
        p.rewrite(node, (2, d - start), node.args[2][d - start], out_shape[d])
    elif name == "view_as":
        p.fail(node, f"{name} of a sharded tensor")
    p.set(node, d, origins)


def _transpose(p, op: Op) -> None:
    node, n = op.node, len(op.out_shape)
    if op.name == "t":
        d0, d1 = 0, 1
    else:
        d0, d1 = norm_dim(node.args[1], n), norm_dim(node.args[2], n)
    p.set(node, {d0: d1, d1: d0}.get(op.st.dim, op.st.dim), op.st.origins)


def _permute(p, op: Op) -> None:
    dims = [norm_dim(d, len(op.out_shape)) for d in int_args(op.node, 1)]
    p.set(op.node, dims.index(op.st.dim), op.st.origins)


def _repeat_interleave(p, op: Op) -> None:
    """Grouped-query attention repeats key/value heads: the head dim stays sharded."""
    node = op.node
    if not isinstance(node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats"), int):
        p.fail(node, "repeats given as a tensor")
    p.set(node, op.st.dim, frozenset())


def _slice(p, op: Op) -> None:
    """aten ``slice`` / ``narrow``: another dim keeps the shard (and the origins); the sharded
    dim of a seed's output is cut into blocks."""
    node, st, out_shape = op.node, op.st, op.out_shape
    d = norm_dim(arg(node, 1, "dim", 0), len(out_shape))
    if d != st.dim or eq(out_shape[d], node_shape(op.x)[d]):
        return p.set(node, st.dim, st.origins)
    if op.name == "narrow":
        start, length = arg(node, 2, "start"), arg(node, 3, "length")
        if not isinstance(start, int) or not isinstance(length, int) or start < 0:
            p.fail(node, "narrows the sharded dim at bounds computed at run time")
        if not st.origins:
            p.fail(node, "slices the sharded dim of a value that is not a projection's direct output")
        p.cut(st.origins, node, [(start, start + length)], f"narrow [{start}:{start + length}]")
        p.local_arg(node.name, (2,), start // p.t)
        p.local_arg(node.name, (3,), length // p.t)
    else:
        _cut_slice(p, op, arg(node, 2, "start"), arg(node, 3, "end"), arg(node, 4, "step", 1), None)
    p.set(node, st.dim)


def _select(p, op: Op) -> None:
    """select / index_select / index on another dim: the shard stays (select drops its dim)."""
    node, st, name = op.node, op.st, op.name
    n_in = len(node_shape(op.x))
    if name == "index":
        indices = list(arg(node, 1, "indices"))
        used = [k for k, i in enumerate(indices) if i is not None]
        if len(used) != 1 or used[0] == st.dim or getattr(indices[used[0]], "name", None) in p.now.state:
            p.fail(node, "indexes the sharded dim, or with several index tensors")
        k = used[0]
        extra = len(node_shape(indices[k]) or (0,)) - 1
        return p.set(node, st.dim if st.dim < k else st.dim + extra, st.origins)
    d = norm_dim(arg(node, 1, "dim", 0), n_in)
    if d == st.dim:
        p.fail(node, f"{name} on the sharded dim")
    if name == "index_select":
        return p.set(node, st.dim, st.origins)
    p.set(node, st.dim - (1 if st.dim > d else 0), st.origins)


def _cat(p, op: Op) -> None:
    """A cat on another dim of tensors all sharded on one dim (RoPE's rotate_half)."""
    node = op.node
    tensors = node.args[0]
    d = norm_dim(arg(node, 1, "dim", 0), len(op.out_shape))
    dims = {p.now.state[a.name].dim if a.name in p.now.state else None for a in tensors}
    if None in dims or len(dims) != 1:
        p.fail(node, "concatenates sharded and replicated tensors")
    (sd,) = dims
    if sd == d:
        p.fail(node, "concatenates along the sharded dim")
    p.set(node, sd)


def _stack(p, op: Op) -> None:
    """A stack of tensors all sharded on one dim (interleaved rotary: stack(-x2, x1) then flatten)."""
    node = op.node
    tensors = node.args[0]
    d = norm_dim(arg(node, 1, "dim", 0), len(op.out_shape))
    dims = {p.now.state[a.name].dim if a.name in p.now.state else None for a in tensors}
    if None in dims or len(dims) != 1:
        p.fail(node, "stacks sharded and replicated tensors")
    (sd,) = dims
    p.set(node, sd + (1 if sd >= d else 0))


def _softmax(p, op: Op) -> None:
    node = op.node
    d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if d is None or norm_dim(d, len(op.out_shape)) == op.st.dim:
        p.fail(node, "softmax over the sharded dim" + (
            ": the whole output of a linear (a router's scores over its experts; it stays replicated, so every "
            "rank routes every token alike)" if op.st.origins else ""))
    p.set(node, op.st.dim, op.st.origins)


REDUCTION_NAMES = ("sum", "mean", "amax", "amin", "var", "std", "norm", "prod", "logsumexp")
# positions of (dim, keepdim) in torch-level calls (aten calls are read by schema name)
_REDUCE_ARGS = {"var": (1, 3), "std": (1, 3), "norm": (2, 3)}


def _reduce(p, op: Op) -> None:
    """A reduction over dims other than the sharded one (per-head RMSNorm over head_dim): each
    rank reduces whole rows; the sharded dim moves down by the reduced dims before it."""
    node, st = op.node, op.st
    di, ki = _REDUCE_ARGS.get(op.name, (1, 2))
    dims = arg(node, di, "dim")
    keep = bool(arg(node, ki, "keepdim", False))
    n_in = len(node_shape(op.x))
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        p.fail(node, f"{op.name} over every dim, the sharded one included")
    if not isinstance(dims, (list, tuple)):
        dims = [dims]
    if any(not isinstance(d, int) for d in dims):
        p.fail(node, f"{op.name} over dims given as {dims}")
    dims = [norm_dim(d, n_in) for d in dims]
    if st.dim in dims and op.name in ("sum", "mean") and len(dims) == 1 and not node.kwargs.get("dtype"):
        return p.partial_sum(node, op.name)  # [Note: reductions over the sharded dim]
    if st.dim in dims:
        p.fail(node, f"{op.name} over the sharded dim")
    p.set(node, st.dim if keep else st.dim - sum(1 for d in dims if d < st.dim), st.origins)


# [Note: reductions over the sharded dim] A sum (or mean) over the sharded dim alone is a
# partial sum on each rank: the pass adds g (``reduce_from_region``: forward all-reduce) after
# it (and divides a mean of local means by t), and its value is replicated from there on. Its
# readers are sharded nodes (OLMo 2's q/k RMSNorm over the whole projection: x * rsqrt(mean(x^2)
# + eps)), so the statistic's gradient is partial on each rank and the f of [Note: partial
# gradients of replicated operands] (``fxsplit.tp.plan``) sums it before g's identity backward:
# forward and backward each one all-reduce, as Megatron's distributed norms do. Other reductions
# (amax, var over the shards, a reduction over several dims) have no rule.


def _layer_norm(p, op: Op) -> None:
    """layer_norm / rms_norm over trailing dims that exclude the sharded one (per-head q/k norms)."""
    node, st = op.node, op.st
    if node.op == "call_module":
        mod = p.gm.get_submodule(str(node.target))
        if type(mod) not in (torch.nn.LayerNorm, getattr(torch.nn, "RMSNorm", torch.nn.LayerNorm)):
            return no_rule(p, op)
        shape = mod.normalized_shape
    else:
        shape = arg(node, 1, "normalized_shape")
    if not isinstance(shape, (list, tuple, int)):
        return no_rule(p, op)
    k = 1 if isinstance(shape, int) else len(shape)
    n_in = len(node_shape(op.x))
    if st.dim >= n_in - k:
        p.fail(node, f"a normalization ({op.name}) reads the whole sharded feature dim")
    if any(a.name in p.now.state for a in tensor_inputs(node)[1:]):
        p.fail(node, "a normalization with a sharded weight")
    if op.out_shape is None:  # native_layer_norm: (out, mean, rstd), all with the same dims
        for i in range(3):
            p.now.state[f"{node.name}[{i}]"] = State(st.dim, frozenset())
        p.now.state[node.name] = State(st.dim, frozenset())
        return
    p.set(node, st.dim)


def _split(p, op: Op) -> None:
    """split / chunk / unbind: on another dim each piece keeps the dim (unbind drops one); on
    the sharded dim of a seed's output, the blocks of a fused projection (q, k, v; gate, up),
    each sharded by itself."""
    node, name, st = op.node, op.name, op.st
    xs = node_shape(node.args[0])
    n = len(xs)
    d = norm_dim(arg(node, 2 if name != "unbind" else 1, "dim", 0), n)
    val = node.meta.get("val")
    if name == "unbind":
        if d == st.dim:
            p.fail(node, "unbind of the sharded dim")
        for i in range(len(val)):
            p.now.state[f"{node.name}[{i}]"] = State(st.dim - (1 if st.dim > d else 0), st.origins)
        p.now.state[node.name] = st
        return
    sizes = [int(to_expr(v.shape[d])) for v in val]
    if d != st.dim:
        for i in range(len(sizes)):
            p.now.state[f"{node.name}[{i}]"] = State(st.dim, st.origins)
        p.now.state[node.name] = st
        return
    arg1 = node.args[1]
    dynamic = [a for a in (arg1 if isinstance(arg1, (list, tuple)) else [arg1]) if isinstance(a, torch.fx.Node)]
    if dynamic:
        p.fail(node, f"the split sizes are computed at run time ({dynamic[0].name}); they must be constants "
                     "to be rewritten to the local sizes")
    if not st.origins:
        p.fail(node, "splits the sharded dim of a value that is not a projection's direct output")
    # multi-query [q | k | v]: q larger than the equal k and v; first all sharded, then (a
    # choice) q sharded by heads and k / v whole ([Note: whole blocks] in fxsplit.tp.regions)
    mqa = name != "chunk" and len(sizes) == 3 and sizes[1] == sizes[2] < sizes[0]
    whole = {1, 2} if mqa and p.choose(node, 2) == 1 else set()
    bad = [s for i, s in enumerate(sizes) if s % p.t and i not in whole]
    if bad:
        raise TPPlanError(divisibility_msg(node, p.t, sizes, "the split of a fused projection"))
    bounds, off = [], 0
    for s in sizes:
        bounds.append((off, off + s))
        off += s
    p.cut(st.origins, node, bounds, f"{name} {sizes}" + (", k / v whole" if whole else ""))
    for o in st.origins:
        p.now.cuts.whole_ranges.setdefault(o, set()).update(bounds[i] for i in whole)
    if name != "chunk":  # chunk(n) gives n local chunks as it is
        if isinstance(arg1, int):
            p.local_arg(node.name, (1,), arg1 // p.t)
        else:
            for i, s in enumerate(arg1):
                if i not in whole:
                    p.local_arg(node.name, (1, i), s // p.t)
    for i in range(len(sizes)):
        if i in whole:
            p.now.cuts.whole_pieces.add(f"{node.name}[{i}]")
            continue
        p.now.state[f"{node.name}[{i}]"] = State(d, frozenset())
    p.now.state[node.name] = State(d, frozenset())


def _sdpa(p, op: Op) -> None:
    """Scaled-dot-product attention with q, k, v sharded by heads (a mask broadcast over heads)."""
    node, out_shape = op.node, op.out_shape
    q, k, v = node.args[:3]
    for a in (q, k, v):
        if a is not q and isinstance(a, torch.fx.Node) and a.name not in p.now.state:
            _broadcast_heads(p, a, len(node_shape(a)) - 3, out_shape[len(out_shape) - 3])
        s = p.now.state.get(a.name) if isinstance(a, torch.fx.Node) else None
        if s is None or s.dim != len(node_shape(a)) - 3:
            p.fail(node, f"{a} is not sharded by heads")
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if isinstance(mask, torch.fx.Node):
        ms = node_shape(mask)
        pos = len(out_shape) - 3 - (len(out_shape) - len(ms))
        if mask.name in p.now.state:
            if p.now.state[mask.name].dim != pos:
                p.fail(node, "mask sharded on another dim")
        elif pos >= 0 and eq(ms[pos], out_shape[len(out_shape) - 3]):
            p.scatter(node, mask, pos)  # a per-head bias (T5's relative positions): each rank its heads
        elif pos >= 0 and not eq(ms[pos], 1):
            p.fail(node, f"attention mask {mask.name} has {ms[pos]} heads; a per-head mask is not sharded")
    p.set(node, len(out_shape) - 3)


def _broadcast_heads(p, a: torch.fx.Node, hpos: int, heads) -> None:
    """A replicated k / v of ``heads`` heads that is one head expanded (multi-query attention:
    ``k.unsqueeze(2).expand(B, 1, H, T, hd).reshape(B, H, T, hd)``, or ``expand(B, H, T, hd)``
    of ``[B, 1, T, hd]``) from a block kept whole: the expand and the view are rewritten to the
    local heads, so each rank's copy is its heads' k / v, exactly ([Note: whole blocks] in
    ``fxsplit.tp.regions``). Anything else: left as it is (the sdpa rule then fails)."""
    view = a if op_name(a) in ("view", "reshape") else None
    e = a.args[0] if view is not None else a
    if not isinstance(e, torch.fx.Node) or op_name(e) not in ("expand", "broadcast_to") or len(e.users) != 1:
        return
    es, us, src = node_shape(e), node_shape(e.args[0]), e.args[0]
    if view is not None:
        groups = view_groups(es, node_shape(a))
        g = next((gi for gi, gj in (groups or ()) if gj == [hpos]), None)
        big = [j for j in (g or ()) if not eq(es[j], 1)]
        if len(big) != 1:
            return
        j = big[0]
    else:
        j = hpos
    if not isinstance(heads, int) or not eq(es[j], heads) or len(us) != len(es) or not eq(us[j], 1) or heads % p.t:
        return
    for _ in range(8):  # back to the whole block through single-reader views and slices
        if not isinstance(src, torch.fx.Node) or len(src.users) != 1:
            return
        if op_name(src) == "getitem" and f"{src.args[0].name}[{src.args[1]}]" in p.now.cuts.whole_pieces:
            p.now.cuts.whole_used.add(f"{src.args[0].name}[{src.args[1]}]")
            break
        if op_name(src) not in RESHAPES | {"slice", "alias", "contiguous"}:
            return
        src = src.args[0]
    else:
        return
    sizes = int_args(e, 1)
    lst = len(e.args) == 2 and isinstance(e.args[1], (list, tuple))
    p.rewrite(e, (1, j) if lst else (1 + j,), sizes[j], es[j])
    p.set(e, j)
    p.now.no_sums.add((e.name, e.args[0].name))
    if view is not None:
        vs = int_args(view, 1)
        vlst = len(view.args) == 2 and isinstance(view.args[1], (list, tuple))
        p.rewrite(view, (1, hpos) if vlst else (1 + hpos,), vs[hpos], heads)
        p.set(view, hpos)


def _matmul(p, op: Op) -> None:
    """A batched matmul of two operands sharded on one batch dim (attention over heads)."""
    node, n = op.node, len(op.out_shape)
    a, b = node.args[:2]
    sa, sb = node_shape(a), node_shape(b)
    if a.name not in p.now.state or b.name not in p.now.state or len(sa) < 3 or len(sb) < 3:
        p.fail(node, "matmul with one sharded operand")
    da, db = p.now.state[a.name].dim, p.now.state[b.name].dim
    if da >= len(sa) - 2 or db >= len(sb) - 2 or da + n - len(sa) != db + n - len(sb):
        p.fail(node, "matmul not batched over the sharded dim")
    p.set(node, da + n - len(sa))


def _baddbmm(p, op: Op) -> None:
    """``baddbmm(bias, b1, b2)``: a batched matmul over the sharded batch dim (both factors
    sharded on it) plus a bias sharded on it too, broadcast over it, or replicated with its full
    size there (ALiBi's per-head ``[B * heads, 1, T]``: each rank reads its rows, scattered)."""
    node, out_shape = op.node, op.out_shape
    bias, b1, b2 = arg(node, 0, "input"), arg(node, 1, "batch1"), arg(node, 2, "batch2")
    for a in (b1, b2):
        if not isinstance(a, torch.fx.Node) or a.name not in p.now.state or p.now.state[a.name].dim != 0:
            p.fail(node, "baddbmm not batched over the sharded dim")
    bs = node_shape(bias) if isinstance(bias, torch.fx.Node) else None
    if bs is not None:
        pos = len(bs) - len(out_shape)
        if bias.name in p.now.state:
            if p.now.state[bias.name].dim != pos:
                p.fail(node, "the bias of baddbmm is sharded on another dim")
        elif pos >= 0 and eq(bs[pos], out_shape[0]) and not eq(bs[pos], 1):
            p.scatter(node, bias, pos)
        elif pos >= 0 and not eq(bs[pos], 1):
            p.fail(node, f"the bias of baddbmm has size {bs[pos]} on the sharded dim")
    p.set(node, 0)


def _pointwise(p, op: Op) -> None:
    """Pointwise ops: every sharded operand on one (broadcast) dim; replicated operands of size 1 there."""
    node, n = op.node, len(op.out_shape)
    out_dim, origins = None, frozenset()
    for a in tensor_inputs(node):
        s = node_shape(a)
        if a.name in p.now.state:
            d = p.now.state[a.name].dim + n - len(s)
            if out_dim is not None and d != out_dim:
                p.fail(node, "operands sharded on different dims")
            out_dim = d
            origins |= p.now.state[a.name].origins
    for a in tensor_inputs(node):
        if a.name in p.now.state:
            continue
        s = node_shape(a)
        pos = out_dim - (n - len(s))
        if pos < 0 or eq(s[pos], 1):
            continue
        if (out_dim < n - 1 or _param_read(a)) and eq(s[pos], op.out_shape[out_dim]):  # [Note: scattered operands]
            p.scatter(node, a, pos)
            origins = frozenset()
            continue
        p.fail(node, f"combines the sharded value with replicated {a.name} of full size {s[pos]} on the sharded dim")
    p.set(node, out_dim, origins)


# [Note: scattered operands] A replicated operand that has the sharded dim's full size (not 1)
# is combined element for element with the sharded value: a per-head score bias (T5's relative
# position bias [1, heads, T, T] added to the scores or given to sdpa as its mask, ALiBi). Rank r
# holds the r-th contiguous range of the sharded dim, so it reads the r-th range of the operand:
# ``scatter_to_region`` (forward: own range; backward: all-gather, so the replicated operand gets
# its whole gradient on every rank, and no f is put on it, ``TPRewrite.grad_sums``). The sharded
# value's layout is then fixed as one contiguous range (its origins dropped). Only where the
# sharded dim is not the last one (heads, not features), or where the operand is a parameter
# read (OLMo 2's q/k norm weight over the whole projection): a replicated residual added to a
# feature-sharded value is the end of a region, not a bias to scatter.


def _param_read(a: torch.fx.Node) -> bool:
    """A parameter or buffer read, through casts and views (a norm's weight on the features)."""
    for _ in range(8):
        if a.op == "get_attr":
            return True
        name = op_name(a)
        if a.op not in ("call_function", "call_method") or not (name in RESHAPES or name in
                                                                  ("to", "type_as", "float", "half", "bfloat16", "contiguous")):
            return False
        a = a.args[0]
        if not isinstance(a, torch.fx.Node):
            return False
    return False


_POINTWISE_RULE = Rule(_pointwise, any_operand=True, merged="carry")


def _sequence_op(p, op: Op) -> None:
    """Context parallelism's ops along the sequence (``fxsplit.tp.context``: a cut to the local
    tokens, an all-gather over ``"cp"``): a shard on another dim (heads) stays."""
    node = op.node
    d = norm_dim(arg(node, 1, "dim", 0), len(op.out_shape))
    if d == op.st.dim:
        p.fail(node, f"{op.name} along the sharded dim")
    p.set(node, op.st.dim)


def _reads_device(p, op: Op) -> None:
    """Context parallelism's positions and masks read only their ``like`` operand's device: replicated."""

# The one registry of propagation rules: op names -> rule. Ops with aten's pointwise tag and no
# entry here use the pointwise rule (:func:`rule_for`); anything else has no rule (:func:`no_rule`).
_RULE_TABLE: tuple[tuple[Iterable[str], Rule], ...] = (
    (("getattr",), Rule(_shape_attr, "any", merged="own")),
    (("size", "sym_size"), Rule(_size, "any", merged="own")),
    (("getitem",), Rule(_getitem, "any", merged="carry")),
    (("split", "split_with_sizes", "chunk", "unbind"), Rule(_split, "tuple", merged="carry")),
    (sorted(RESHAPES | {"expand", "expand_as", "broadcast_to"}), Rule(_view, merged="own")),
    (("transpose", "swapaxes", "t"), Rule(_transpose, merged="carry")),
    (("permute",), Rule(_permute, merged="carry")),
    (("repeat_interleave",), Rule(_repeat_interleave)),
    (("slice", "narrow"), Rule(_slice, merged="carry")),
    (("select", "index_select", "index"), Rule(_select, merged="carry")),
    (("cat",), Rule(_cat, any_operand=True, merged="carry")),
    (("stack",), Rule(_stack, any_operand=True, merged="carry")),
    (("softmax", "log_softmax"), Rule(_softmax, merged="carry")),
    (REDUCTION_NAMES, Rule(_reduce, merged="carry")),
    (("layer_norm", "rms_norm"), Rule(_layer_norm, "any", merged="carry")),
    (("scaled_dot_product_attention", "ring_attention"), Rule(_sdpa, any_operand=True)),  # same (q, k, v, mask)
    (("matmul", "bmm"), Rule(_matmul, any_operand=True, merged="carry")),
    (("baddbmm",), Rule(_baddbmm, any_operand=True, merged="carry")),
    (sorted(ELEMENTWISE), _POINTWISE_RULE),
    (("keep_local", "gather_to_region", "gather_from_region"), Rule(_sequence_op, merged="carry")),
    (("natural_order", "causal_rows", "local_positions"), Rule(_reads_device, "any")),
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

