"""Heads merged as the INNER factor of a dim: BLOOM's ``q.reshape(B * heads, T, hd)``.

Terms (see ``fxsplit.tp.shapes`` and ``fxsplit.tp.propagate``): a **merged** sharded dim
(``State.merged = H``) is a dim of global size ``N * H`` laid out ``[N, H]``, of which each rank
holds its own 1/t of the ``H`` factor for every outer index ``n``: the strided set ``{n * H + h :
h in rank r's heads}``. Locally it is ``N * H / t`` rows laid out n-major, which is exactly what
each rank's own computation makes of its heads, so ops that never slice the dim nor read its
size are exact on it as they are on a plain sharded dim (``Rule.merged == "carry"``).

    enter(p, op, outer_in, outer_out, in_shape, out_shape)   # [B, H, T, hd] -> [B*H, T, hd]
    view(p, op)          # a view of a merged dim: kept ([B*H, T, T] -> [B*H, 1, T, T]) or split
                         # back into [B, H] (the shard on H again, a plain sharded dim)
    size_read(p, node, H)  # sym_size of the merged dim, read only as ``// H`` (the outer N)

[Note: heads merged as an inner factor]
``[Note: factored views]`` passes a sharded dim through a merge only as the OUTER factor (a
contiguous range of ``H * hd`` is a range of ``H``). BLOOM merges the heads as the inner factor
of ``B * heads`` (its qkv ``[B, T, heads, 3, hd]`` is selected, transposed to ``[B, heads, T,
hd]`` and reshaped to ``(B * heads, T, hd)`` for ``baddbmm`` / ``bmm``), so rank r's rows are not
a range of the global dim. The state records it (``State.merged``: the inner factor's global
size ``H``), and:
- the view making it (the sharded dim the innermost non-1 factor of a merged group, ``H`` a
  constant t divides) rewrites the merged size ``N * H`` to ``N * H / t`` (an int, or a size
  computed at run time: ``LocalSize``); the outer factors stay whole;
- ops whose rule is exact for any layout of the sharded dim carry it (transposes, selects on
  other dims, softmax and reductions on other dims, pointwise ops, batched matmuls with both
  operands merged by the same ``H``, baddbmm); every operand that is sharded must be merged by the
  same ``H``, a plain sharded operand with a merged one fails the region (their rows differ);
- a replicated operand with the merged dim's full size (ALiBi's ``[B * heads, 1, T]``) is read
  through a STRIDED scatter: unflattened to ``[N, H]``, ``scatter_to_region`` on ``H``, flattened
  back (the pass, from ``Scatter.heads`` in ``TPRewrite.scatters``), so each rank reads its heads' rows;
- a view splitting the merged dim back into ``[N, H]`` puts the shard on ``H`` (plain again);
  one keeping it whole keeps it merged; anything else (merging it further, splitting it
  elsewhere) fails the region;
- reading its size is exact only as ``size // H`` (the outer N, BLOOM's ``batch_size =
  x.shape[0] // num_heads``): each such divisor becomes ``H / t``; any other read fails;
- a row linear, sdpa, a slice of the dim, or an op with no such rule fails the region (the plan
  names the op). The pass's local shapes of merged values come from their traced shapes
  (``sharded_nodes`` size -1 where the merged size is symbolic).
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from fxsplit.graph.meta import to_expr
from fxsplit.tp.shapes import LocalSize, Op, State, arg, eq, int_args, norm_dim, node_shape, view_groups

__all__ = ["enter", "view", "size_read"]


def _rewrite_size(p, op: Op, j: int, out_size) -> None:
    """The view's size argument for output dim ``j`` (global ``N * H``) becomes local."""
    node = op.node
    if op.name not in ("view", "reshape", "unflatten"):
        return  # flatten, squeeze, unsqueeze: no size arguments
    if "size" in node.kwargs or "shape" in node.kwargs:
        p.fail(node, "shape given by keyword")
    if op.name == "unflatten":
        start = norm_dim(arg(node, 1, "dim"), len(node_shape(node.args[0])))
        sizes = node.args[2] if len(node.args) > 2 else None
        if not isinstance(sizes, (list, tuple)):
            p.fail(node, "unflatten sizes given by keyword")
        path, value = (2, j - start), sizes[j - start]
    else:
        sizes = int_args(node, 1)
        lst = len(node.args) == 2 and isinstance(node.args[1], (list, tuple))
        path, value = ((1, j) if lst else (1 + j,)), sizes[j]
    if isinstance(value, int):
        if value == -1:
            return
        if value % p.t:
            p.fail(node, f"the merged size {value} does not divide by t={p.t}")
        p.local_arg(node.name, path, value // p.t)
        return
    traced = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
    if isinstance(traced, (int, torch.SymInt)) and eq(to_expr(traced), out_size):
        p.local_arg(node.name, path, LocalSize(p.t))  # N * H // t == N * (H / t) exactly
        return
    p.fail(node, f"the merged size {out_size} is given as {value}, not traced as that size")


def enter(p, op: Op, outer_in, outer_out, in_shape, out_shape) -> bool:
    """A view merging the sharded dim as the innermost non-1 factor of a group into one output
    dim: the output is merged by ``H`` (True), else False (the view rule fails as before)."""
    st = op.st
    if st.merged is not None or len(outer_in) < 2 or outer_in[-1] != st.dim or len(outer_out) != 1:
        return False
    h = in_shape[st.dim]
    if not isinstance(h, int) or h % p.t:
        return False
    j = outer_out[0]
    _rewrite_size(p, op, j, out_shape[j])
    p.now.state[op.node.name] = State(j, frozenset(), h)
    return True


def view(p, op: Op) -> None:
    """A view of a merged value ([Note: heads merged as an inner factor])."""
    node, st, out_shape = op.node, op.st, op.out_shape
    in_shape = node_shape(node.args[0])
    if op.name not in ("view", "reshape", "unflatten", "flatten", "squeeze", "unsqueeze"):
        p.fail(node, f"{op.name} of a value whose heads are merged into an outer dim")
    groups = view_groups(in_shape, out_shape)
    if groups is None:
        p.fail(node, f"cannot match view {in_shape} -> {out_shape}")
    gi, gj = next((gi, gj) for gi, gj in groups if st.dim in gi)
    outer_in = [i for i in gi if not eq(in_shape[i], 1)]
    outer_out = [j for j in gj if not eq(out_shape[j], 1)]
    if outer_in != [st.dim] or not outer_out or len(outer_out) > 2:
        p.fail(node, f"the view {in_shape} -> {out_shape} regroups a dim whose heads are merged as its inner factor")
    if len(outer_out) == 1:  # kept whole: still merged
        j = outer_out[0]
        _rewrite_size(p, op, j, out_shape[j])
        p.now.state[node.name] = State(j, frozenset(), st.merged)
        return
    j0, j1 = outer_out
    if not eq(out_shape[j1], st.merged):
        p.fail(node, f"the view {in_shape} -> {out_shape} splits a dim whose heads ({st.merged}) are merged as "
                     "its inner factor elsewhere than at the heads")
    if op.name in ("view", "reshape", "unflatten"):
        if op.name == "unflatten":
            start = norm_dim(arg(node, 1, "dim"), len(in_shape))
            sizes, path = node.args[2], (2, j1 - start)
            value = sizes[j1 - start]
        else:
            sizes = int_args(node, 1)
            lst = len(node.args) == 2 and isinstance(node.args[1], (list, tuple))
            path, value = ((1, j1) if lst else (1 + j1,)), sizes[j1]
        if isinstance(value, int) and value != -1:
            p.local_arg(node.name, path, value // p.t)
        elif value != -1:
            p.fail(node, f"the heads of a merged dim are given as {value}, not a constant")
    p.set(node, j1)


def size_read(p, node: torch.fx.Node, h: int) -> None:
    """The size of a merged dim (``node``: ``sym_size``, ``x.size(d)``, fx ``x.shape[d]``), read
    only as ``size // H`` (the outer factor N): each divisor becomes ``H / t``."""
    users = list(node.users)
    if not users or any(u.op != "call_function" or u.target not in (operator.floordiv,) or u.args[0] is not node
                        or u.args[1] != h or u.kwargs for u in users):
        p.fail(node, f"reads the size of a dim whose heads are merged as its inner factor (other than as // {h})")
    for u in users:
        p.local_arg(u.name, (1,), h // p.t)
