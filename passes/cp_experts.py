"""Context-parallel rules for a mixture-of-experts block: routing, the sort of token rows by expert,
the grouped expert matmuls and the return to token order, all on this rank's tokens.

Terms as in ``passes/context_parallel.py`` (sharded value, ``Seq``); **local value** -- a value
computed from this rank's tokens that is neither sharded along the sequence nor the full value
(``Local``: the count of rows per expert, and its cumulative sum, the grouped matmul's offsets).

[Note: an MoE block under cp]
Every token's output of an MoE block depends on that token alone (its router scores, its top-k
experts, their weights), so the block computes exactly on any subset of the tokens: the local ones.
In the graph the block is not row-wise op by op -- it sorts the (token, choice) rows by expert along
the token dim, gathers rows by the sort's indices, counts the rows per expert, and scatters back by
the inverse permutation -- so these ops get rules that keep them on the local rows:
- ``sort`` along the sequence dim: the local rows' order by expert; its indices are local row
  numbers (tracked: ``rw.row_numbers``, through a floor division by the top-k and the inverse
  permutation), which only ``index`` into a value sharded like them may use;
- ``index(x, [idx])`` with x sharded and idx this rank's row numbers: the rows idx names, sharded
  like idx (an index by any other tensor, e.g. token ids, raises: its values name global rows);
- ``histc`` of a sharded value: a ``Local`` value (the local count per expert), allowed only into
  ``cumsum`` / casts and as a grouped matmul's offsets (anything else raises, so a local count never
  passes as the full one);
- ``index_put(empty_like(rows), [idx], arange(n))`` (the inverse permutation): the arange of the
  full row count becomes the local one;
- ``grouped_mm(x, W, offs)`` with x sharded along its rows, W full: rows stay sharded.
A parameter's gradient from these ops is its local tokens' share, summed over cp as every other.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx

from fxsplit.graph.ops import op_name
from fxsplit.passes.cp_attention import ndim, val

__all__ = ["EXPERT_RULES", "LOCAL_OK", "Local"]


@dataclass(frozen=True)
class Local:
    """A value computed from this rank's tokens only, not sharded along the sequence ([Note: an MoE
    block under cp])."""


# ops that may read a Local value (the rest raise): its cumulative sum, casts, the grouped matmul's offsets
LOCAL_OK = frozenset({"cumsum", "to", "_to_copy", "grouped_mm", "_grouped_mm", "grouped_mm_fallback"})


def _seq(rw: Any, a: Any) -> Any:
    """``a``'s sequence dim (a ``Seq``), or None (full, local, or a tuple)."""
    s = rw.state.get(a) if isinstance(a, torch.fx.Node) else None
    return None if isinstance(s, (Local, tuple)) else s


def _topk(rw: Any, node: torch.fx.Node) -> tuple:
    s = _seq(rw, node.args[0])
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    if dim % ndim(node.args[0]) == s.dim:
        raise rw.fail(node, "a top-k along the sequence dim")
    return (s, s)


def _sort(rw: Any, node: torch.fx.Node) -> tuple:
    """The local rows' order (along the sequence dim: its indices are local row numbers) or a row-wise sort."""
    s = _seq(rw, node.args[0])
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
    if dim % ndim(node.args[0]) == s.dim:
        rw.row_numbers.update(u for u in node.users if u.target is operator.getitem and u.args[1] == 1)
    return (s, s)


def _floor_divide(rw: Any, node: torch.fx.Node) -> Any:
    """Row numbers of (token, choice) rows divided by the choices: the token's row number."""
    s = _seq(rw, node.args[0])
    if s is None or not isinstance(node.args[1], int):
        raise rw.fail(node, "a floor division of sequence-sharded values other than by a constant")
    if node.args[0] in rw.row_numbers:
        rw.row_numbers.add(node)
    return s


def _index(rw: Any, node: torch.fx.Node) -> Any:
    """Rows of a sharded value picked by this rank's row numbers (from a sort along the sequence, or its
    inverse): any other index tensor raises, since its values would name rows of the full sequence."""
    x, indices = node.args[0], node.args[1]
    s = _seq(rw, x)
    if len(indices) != 1 or not isinstance(indices[0], torch.fx.Node) or s is None or s.dim != 0:
        raise rw.fail(node, "an index other than the rows of a sequence-sharded value by one index tensor")
    si = _seq(rw, indices[0])
    if si is None or indices[0] not in rw.row_numbers:
        raise rw.fail(node, "rows of a sequence-sharded value picked by an index that is not this rank's row "
                            "numbers (a sort's indices along the sequence, or their inverse)")
    return si


def _histc(rw: Any, node: torch.fx.Node) -> Local:
    return Local()


def _cumsum(rw: Any, node: torch.fx.Node) -> Any:
    s = _seq(rw, node.args[0])
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if s is None or dim % ndim(node.args[0]) == s.dim:
        raise rw.fail(node, "a cumulative sum along the sequence dim")
    return s


def _grouped_mm(rw: Any, node: torch.fx.Node) -> Any:
    s = _seq(rw, node.args[0])
    if s is None or s.dim != 0 or rw.state.get(node.args[1]) is not None:
        raise rw.fail(node, "a grouped matmul whose sharded operand is not the rows of its input")
    return s


def _index_put(rw: Any, node: torch.fx.Node) -> Any:
    """The inverse permutation: ``index_put(rows, [idx], arange(n))`` with n the full row count."""
    dst, indices, values = node.args[0], node.args[1], node.args[2]
    s = _seq(rw, dst)
    if s is None or s.dim != 0 or len(indices) != 1 or _seq(rw, indices[0]) != s:
        raise rw.fail(node, "an index_put other than into sequence-sharded rows at this rank's row numbers")
    if _seq(rw, values) == s:
        return s
    if not (isinstance(values, torch.fx.Node) and op_name(values) == "arange" and len(values.args) == 1
            and val(values).dim() == 1 and val(values).shape[0] == val(dst).shape[0]):  # (shapes are the full ones until the walk ends)
        raise rw.fail(node, "an index_put of values that are neither sharded like the rows nor the row numbers")
    size = values.args[0]
    with rw.graph.inserting_before(node):
        local = size // rw.cp if isinstance(size, int) else rw.new(operator.floordiv, (size, rw.cp), like=node)
        rows = rw.new(values.target, (local,), dict(values.kwargs), like=node)
    node.update_arg(2, rows)
    rw.row_numbers.add(node)  # the inverse permutation: row numbers too
    return s


EXPERT_RULES: dict[str, Callable[[Any, torch.fx.Node], Any]] = {
    "topk": _topk, "sort": _sort, "floor_divide": _floor_divide, "index": _index, "histc": _histc, "cumsum": _cumsum,
    "grouped_mm": _grouped_mm, "_grouped_mm": _grouped_mm, "grouped_mm_fallback": _grouped_mm,
    "index_put": _index_put,
}
