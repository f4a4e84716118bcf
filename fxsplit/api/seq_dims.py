"""Which dimensions of a graph's values hold the sequence, in a graph traced at a fixed length L
(torch.export without ``dynamic_sequence``): what the KV cache of export-traced models
(fxsplit.api.kv_export) rewrites from L to the length of a decode step.

Terms
- **L**: the traced sequence length (the plan's ``input_ids`` is (b, L)).
- **labels** of a tensor value: the set of its dims whose size carries one factor L (a (b, L, h)
  hidden state: {1}; GPT-2's flattened (b * L, h): {0}); of a tuple: one set per element; of a
  scalar: empty (a scalar is rewritten only where it is a shape entry of a labelled dim).
- **mixing**: an op that combines values of different positions (a reduction, softmax, cumsum or
  cat along a labelled dim; a matmul contracting one). Outside attention a causal language model
  has none on its hidden states; the causal mask is built from positions with such ops, which is
  exact there because the mask is rebuilt over every position ([Note: KV cache for exported
  graphs] in fxsplit.api.kv_export).

Representative use::

    dims = SeqDims(L)
    dims.seed("input_ids", {1})
    for gm in stage_graphs:
        dims.propagate(gm, mixing_ok=lambda node: node in mask_region)
    dims.of(node)            # frozenset of labelled dims
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from fxsplit.graph.ops import op_name

__all__ = ["SeqDimsError", "SeqDims", "view_groups"]

Labels = Any  # frozenset[int] for a tensor, tuple[Labels, ...] for a tuple, frozenset() for a scalar
_NONE: frozenset[int] = frozenset()

_VIEWS = {"view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "flatten", "unflatten"}
_REDUCTIONS = {"mean", "sum", "amax", "amin", "max", "min", "argmax", "argmin", "var", "std", "prod", "norm",
               "logsumexp", "any", "all"}
_ALONG_DIM = {"softmax", "_softmax", "log_softmax", "_log_softmax", "cumsum", "cumprod", "topk", "sort", "diff",
              "argsort", "cummax"}
_SPLITS = {"split", "split_with_sizes", "chunk", "unbind", "tensor_split"}
_EMBEDDINGS = {"embedding", "vocab_parallel_embedding"}


class SeqDimsError(Exception):
    """A node whose sequence dims cannot be followed, or that mixes positions where it must not."""


def _shape(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(val, torch.Tensor):
        return tuple(int(s) if isinstance(s, int) else s for s in val.shape)
    return None


def view_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Dims of ``src`` and ``dst`` (static sizes of the same element count) grouped so that each
    group's sizes have equal products, greedily from the left; dims of size 1 left over join no group."""
    groups, i, j = [], 0, 0
    while i < len(src) and j < len(dst):
        gi, gj, pi, pj = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj and i < len(src):
                pi, gi = pi * src[i], gi + [i]
                i += 1
            elif j < len(dst):
                pj, gj = pj * dst[j], gj + [j]
                j += 1
            else:
                break
        groups.append((gi, gj))
    return groups


def _dim(d: Any, rank: int) -> int:
    return int(d) % rank if rank else 0


class SeqDims:
    """Labels of the nodes of one or more graphs, by node (and, across stages, by value name)."""

    def __init__(self, length: int):
        self.length = length
        self._by_name: dict[str, Labels] = {}
        self._of: dict[fx.Node, Labels] = {}

    def seed(self, name: str, labels: frozenset[int]) -> None:
        self._by_name[name] = frozenset(labels)

    def of(self, node: Any) -> Labels:
        return self._of.get(node, _NONE) if isinstance(node, fx.Node) else _NONE

    def by_name(self, name: str) -> Labels:
        return self._by_name.get(name, _NONE)

    def propagate(self, gm: fx.GraphModule, mixing_ok: Callable[[fx.Node], bool]) -> None:
        """Label every node of ``gm``; its placeholders take the labels recorded under their names
        (model inputs seeded, values of earlier stages by the names their producers had)."""
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                labels = self._by_name.get(node.name, _NONE)
            elif node.op in ("get_attr", "output"):
                labels = _NONE
            else:
                try:
                    labels = self._rule(node, gm, mixing_ok(node))
                except SeqDimsError:
                    raise
                except Exception as exc:  # noqa: BLE001 -- an op whose arguments the rules do not expect
                    raise SeqDimsError(f"node {node.name!r} ({op_name(node, gm)}): {type(exc).__name__}: {exc}") from exc
            self._of[node] = labels
            if node.op != "output":
                self._by_name[node.name] = labels

    # ------------------------------------------------------------------ rules

    def _mixing(self, node: fx.Node, what: str, ok: bool) -> None:
        if not ok:
            raise SeqDimsError(f"node {node.name!r} {what}: it mixes positions outside attention")

    def _rule(self, node: fx.Node, gm: fx.GraphModule, mixing_ok: bool) -> Labels:
        name = op_name(node, gm)
        if node.op == "call_function" and node.target is operator.getitem:
            src = self.of(node.args[0])
            return src[node.args[1]] if isinstance(src, tuple) else _NONE
        out = _shape(node)
        x = node.args[0] if node.args else None
        xl, xs = self.of(x), _shape(x)
        if name == "arange":
            return frozenset({0}) if out is not None and out == (self.length,) and self._is_position(node) else _NONE
        if name in ("sym_size", "size", "sym_numel", "sym_stride"):
            return _NONE
        if name in _VIEWS and out is not None and xs is not None:
            return self._view(node, xl, xs, out)
        if name == "transpose" and xs is not None:
            a, b = _dim(node.args[1], len(xs)), _dim(node.args[2], len(xs))
            return frozenset({b if d == a else a if d == b else d for d in xl})
        if name == "permute" and xs is not None:
            order = [_dim(d, len(xs)) for d in node.args[1]]
            return frozenset(order.index(d) for d in xl)
        if name == "t":
            return frozenset(1 - d for d in xl)
        if name in ("slice", "select", "narrow") and xs is not None:
            return self._slice(node, name, xl, xs, mixing_ok)
        if name == "index" and xs is not None:
            return self._index(node, xl, xs, out, mixing_ok)
        if name in _EMBEDDINGS:
            ids = node.args[1] if name == "embedding" else node.args[0]
            return self.of(ids)
        if name in ("linear", "addmm", "mm", "bmm", "matmul", "baddbmm"):
            return self._matmul(node, name, mixing_ok)
        if name == "scaled_dot_product_attention":
            return self.of(node.args[0])
        if name in _REDUCTIONS and xs is not None and (out is None or len(out) < len(xs) or _dims_arg(node) is not None):
            return self._reduce(node, xl, xs, out, mixing_ok)
        if name in _ALONG_DIM and xs is not None:
            d = _dim(node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else -1), len(xs))
            if name == "topk":
                d = _dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1), len(xs))
            if d in xl:
                self._mixing(node, f"runs {name} along sequence dim {d}", mixing_ok)
            return (xl, xl) if name in ("topk", "sort", "cummax") else xl
        if name in _SPLITS and xs is not None:
            d = _dim(node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0), len(xs))
            if name == "unbind":
                d = _dim(node.args[1] if len(node.args) > 1 else 0, len(xs))
            if d in xl:
                raise SeqDimsError(f"node {node.name!r} splits along sequence dim {d}")
            n = len(node.meta.get("val") or ())
            each = frozenset(e - (e > d) for e in xl) if name == "unbind" else xl
            return tuple(each for _ in range(n))
        if name == "cat":
            d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
            parts = [self.of(p) for p in node.args[0]]
            labels = frozenset().union(*parts) if parts else _NONE
            if out is not None and _dim(d, len(out)) in labels:
                self._mixing(node, "concatenates along the sequence", mixing_ok)
            return labels
        if name == "repeat_interleave" and xs is not None:
            return xl
        if name in ("new_ones", "new_zeros", "new_full", "new_empty", "ones", "zeros", "full", "empty"):
            size = node.args[1] if name.startswith("new_") else node.args[0]
            return frozenset(d for d, e in enumerate(size) if e == self.length)
        return self._elementwise(node, name, out)

    def _is_position(self, node: fx.Node) -> bool:
        args = node.args
        return len(args) == 1 or (len(args) == 2 and args[0] == 0)

    def _view(self, node: fx.Node, xl: frozenset, xs: tuple, out: tuple) -> frozenset:
        labels = set()
        for gi, gj in view_groups(xs, out):
            hit = [d for d in gi if d in xl]
            if not hit:
                continue
            if len(hit) > 1:
                raise SeqDimsError(f"node {node.name!r} merges two sequence dims {hit} of {xs}")
            if len(gj) == 1:
                labels.add(gj[0])
                continue
            exact = [d for d in gj if out[d] == self.length]
            multiple = [d for d in gj if out[d] % self.length == 0]
            pick = exact[-1] if exact else multiple[0] if multiple else None
            if pick is None:
                raise SeqDimsError(f"node {node.name!r} splits the sequence dim {hit[0]} of {xs} into {out}")
            labels.add(pick)
        return frozenset(labels)

    def _slice(self, node: fx.Node, name: str, xl: frozenset, xs: tuple, mixing_ok: bool) -> frozenset:
        d = _dim(node.args[1] if len(node.args) > 1 else 0, len(xs))
        if name == "select":
            index = node.args[2]
            if d in xl and not (mixing_ok and isinstance(index, int) and index >= 0):
                raise SeqDimsError(f"node {node.name!r} selects position {index} of sequence dim {d}")
            return frozenset(e - (e > d) for e in xl if e != d)
        if d in xl:
            start = node.args[2] if len(node.args) > 2 else 0
            end = node.args[3] if len(node.args) > 3 else None
            whole = start in (0, None) and (end is None or (isinstance(end, int) and end >= xs[d]))
            if whole:
                return xl
            # the first positions (a fixed count from 0) are the same positions at any length
            fixed = isinstance(start, int) and isinstance(end, int) and 0 <= start < end < xs[d]
            if name == "narrow" or not (mixing_ok and fixed):
                raise SeqDimsError(f"node {node.name!r} takes positions {start}:{end} of sequence dim {d}")
            return xl - {d}
        return xl

    def _index(self, node: fx.Node, xl: frozenset, xs: tuple, out: tuple | None, mixing_ok: bool) -> frozenset:
        indices = list(node.args[1])
        used = [k for k, ix in enumerate(indices) if ix is not None]
        if out is None or used != list(range(len(used))):
            raise SeqDimsError(f"node {node.name!r} indexes dims {used} (only leading index tensors are followed)")
        for k in used:
            if k in xl and not self.of(indices[k]):
                self._mixing(node, f"picks positions of sequence dim {k} with an index that is not a position",
                             mixing_ok)
        rank = len(out) - (len(xs) - len(used))
        labels = set()
        for ix in (indices[k] for k in used):
            shape = _shape(ix)
            if shape is not None:
                labels |= {d + rank - len(shape) for d in self.of(ix)}
        labels |= {d - len(used) + rank for d in xl if d >= len(used)}
        return frozenset(labels)

    def _matmul(self, node: fx.Node, name: str, mixing_ok: bool) -> frozenset:
        args = node.args[1:] if name in ("addmm", "baddbmm") else node.args
        a, b = args[0], args[1]
        al, bl, as_, bs = self.of(a), self.of(b), _shape(a), _shape(b)
        if as_ is None or bs is None:
            raise SeqDimsError(f"node {node.name!r} ({name}): operand shapes unknown")
        if name == "linear":
            if len(as_) - 1 in al:
                raise SeqDimsError(f"node {node.name!r} contracts the sequence dim")
            return al
        if len(as_) - 1 in al or (len(bs) - 2 in bl and len(bs) >= 2):
            self._mixing(node, "contracts the sequence dim (attention written as a matmul)", mixing_ok)
        out = _shape(node)
        rank = len(out) if out is not None else max(len(as_), len(bs))
        labels = {d + rank - len(as_) for d in al if d != len(as_) - 1}
        labels |= {d + rank - len(bs) for d in bl if d == len(bs) - 1 or d < len(bs) - 2}
        return frozenset(labels)

    def _reduce(self, node: fx.Node, xl: frozenset, xs: tuple, out: tuple | None, mixing_ok: bool) -> frozenset:
        dims = _dims_arg(node)
        dims = list(range(len(xs))) if dims is None else [_dim(d, len(xs)) for d in dims]
        if set(dims) & xl:
            self._mixing(node, f"reduces sequence dim(s) {sorted(set(dims) & xl)}", mixing_ok)
        keep = out is not None and len(out) == len(xs)
        return frozenset(d if keep else d - sum(r < d for r in dims) for d in xl if d not in dims)

    def _elementwise(self, node: fx.Node, name: str, out: tuple | None) -> Labels:
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)):
            if all(isinstance(v, torch.Tensor) and len(v.shape) == len(_shape(node.args[0]) or ()) for v in val):
                return tuple(self.of(node.args[0]) for _ in val)
            raise SeqDimsError(f"node {node.name!r} ({name}) returns {len(val)} values the rules do not follow")
        if out is None:
            return _NONE
        labels = set()
        for arg in _tensor_args(node):
            shape, al = _shape(arg), self.of(arg)
            if shape is None or not al:
                continue
            if len(shape) > len(out):
                raise SeqDimsError(f"node {node.name!r} ({name}) turns {shape} into {out}; fxsplit cannot follow "
                                   "its sequence dim")
            for d in al:
                e = d + len(out) - len(shape)
                if out[e] != shape[d]:
                    raise SeqDimsError(f"node {node.name!r} ({name}) changes sequence dim {d} from {shape[d]} "
                                       f"to {out[e]}")
                labels.add(e)
        return frozenset(labels)


def _dims_arg(node: fx.Node) -> list | None:
    d = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    dims = list(d) if isinstance(d, (list, tuple)) else [d]
    return dims if dims and all(isinstance(x, int) and not isinstance(x, bool) for x in dims) else None


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    found = []
    for a in list(node.args) + list(node.kwargs.values()):
        for x in (a if isinstance(a, (list, tuple)) else [a]):
            if isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor):
                found.append(x)
    return found
