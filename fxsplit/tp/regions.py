"""The region search of a tensor-parallel plan: which column linears, propagated together, end
in row linears ([Note: sharded-dim propagation] in ``fxsplit.tp.propagate``).

Terms: see ``fxsplit.tp.plan`` (t, column / row, region, blocks) and ``fxsplit.tp.propagate``
(seeds, attempt). Every group of linears sharing an input is tried as the seeds of a region;
a failed try is retried with the attention partners of the failing node ([Note: attention
partners]), then without the seeds that reached the failure, then each seed alone.

    found = find_regions(gm, 2, find_linears(gm), forced={}, excluded=set(), claimed=set())
    found.regions[0]            # Region(columns=('blocks_0_attn_q', 'blocks_0_attn_k', 'blocks_0_attn_v'),
                                #        rows=('blocks_0_attn_proj',), inputs=('blocks_0_ln1',), kind='attention')
    found.failures["lm_head"]   # 'output (output): a sharded value is a model output'

``fxsplit.tp.plan.find_tp_plan`` turns what is found into the plan and its rewrite.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from fxsplit.graph.ops import RESHAPES, op_name
from fxsplit.tp.linears import LinearInfo
from fxsplit.tp.propagate import Attempt, GraphOrder, Propagation, RegionFailed, TPPlanError, divisibility_msg, node_shape
from fxsplit.tp.rewrite import PartialSum, Scatter, ShapeArg, ShardedValue

__all__ = ["Region", "Found", "find_regions", "linear_x", "input_source"]


@dataclass(frozen=True)
class Region:
    """Column linears (node names) sharing ``inputs``, and the row linears ending the region."""

    columns: tuple[str, ...]
    rows: tuple[str, ...]
    inputs: tuple[str, ...]  # the distinct input nodes of the column linears (f goes there)
    kind: str  # "attention" or "mlp"


def linear_x(node: torch.fx.Node, info: LinearInfo) -> Any:
    return node.args[0] if info.kind == "module" else node.args[info.x_index]


@dataclass
class Found:
    """What the region search found: the regions, the seeds that failed and why, and per node
    what the pass applies (gathered into :class:`TPRewrite` by :func:`find_tp_plan`)."""

    regions: list[Region] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)  # seed -> why its region failed
    blocks_of: dict[str, tuple] = field(default_factory=dict)  # seed -> (blocks, indices of whole blocks)
    layouts: dict[str, str] = field(default_factory=dict)
    sharded: dict[str, ShardedValue] = field(default_factory=dict)
    shape_args: list[ShapeArg] = field(default_factory=list)
    scatters: list[Scatter] = field(default_factory=list)
    no_sums: set[tuple[str, str]] = field(default_factory=set)  # no f, no scatter ([Note: whole blocks])
    partials: list[PartialSum] = field(default_factory=list)
    merged: dict[str, int] = field(default_factory=dict)


def find_regions(gm, tp, linears, forced, excluded, claimed) -> Found:
    """Try each group of linears sharing an input (then each alone) as a region's columns."""
    order = GraphOrder(gm.graph)  # one for every propagation of the search
    nodes = order.by_name
    found = Found()
    by_input: dict[str, list[str]] = {}
    for name, info in linears.items():
        by_input.setdefault(input_source(linear_x(nodes[name], info)), []).append(name)
    forced_rows = {n for n, l in linears.items() if forced.get(l.module_path) == "rowwise"}
    for group in by_input.values():
        cands = [n for n in group if n not in claimed and n not in excluded and n not in forced_rows]
        tries, tried = [cands] + ([[c] for c in cands] if len(cands) > 1 else []), set()
        while tries:
            seeds = [s for s in tries.pop(0) if s not in claimed]
            if not seeds or tuple(seeds) in tried:
                continue
            tried.add(tuple(seeds))
            try:
                got = Propagation(gm, tp, linears, seeds, excluded, forced_rows, order).run()
                if not got.rows:
                    raise RegionFailed("no row-parallel linear consumes the sharded output")
                bad = [r for r in got.rows if r in claimed or forced.get(linears[r].module_path) == "colwise"]
                if bad:
                    raise RegionFailed(f"{linears[bad[0]].module_path} would be row-parallel after a column-parallel "
                                "linear, but it is set to colwise (column after column needs a gather between)")
            except RegionFailed as exc:
                tries[:0] = _after_failure(exc, seeds, found.failures, linears, claimed | excluded | forced_rows)
                continue
            _record(found, got, seeds, gm, tp, linears, nodes)
            claimed |= set(seeds) | set(got.rows)
            break
    return found


def _after_failure(exc: RegionFailed, seeds: list[str], failures: dict[str, str], linears, unavailable) -> list:
    """Record why ``seeds`` failed; the tries to make next, first to last."""
    culprits = getattr(exc, "seeds", frozenset())
    for s in seeds:  # a seed's own failure, else its group's (alone it lacks its siblings)
        if s not in failures or (s in culprits and len(seeds) > 1):
            failures[s] = str(exc)
    tries = []
    # first: with the linears feeding the attention's other operands ([Note: attention
    # partners]: cross-attention's q from the decoder, k / v from the encoder)
    partners = _partners(getattr(exc, "node", None), linears, unavailable)
    if partners - set(seeds):
        tries.append(seeds + sorted(partners - set(seeds)))
    # next: the group without the seeds whose values reached the failure (a router
    # among the MLP's gate/up), before each seed alone
    rest = [s for s in seeds if s not in culprits]
    if 0 < len(rest) < len(seeds):
        tries.append(rest)
    return tries


def _record(found: Found, got: Attempt, seeds: list[str], gm, tp, linears, nodes) -> None:
    """A region found from ``seeds``: check its blocks divide by t, and add what it shards."""
    blocks = got.blocks
    for s in seeds:
        per = blocks.blocks.get(s, (linears[s].out_features,))
        if any(b % tp for i, b in enumerate(per) if i not in blocks.whole.get(s, ())):
            raise TPPlanError(divisibility_msg(nodes[s], tp, list(per),
                                                f"the output features of {linears[s].module_path!r}"))
    inputs = tuple(dict.fromkeys(linear_x(nodes[s], linears[s]).name for s in seeds))
    attn = any(op_name(nodes[n]) in _ATTENTION
               for n in got.state if n in nodes)
    found.regions.append(Region(tuple(seeds), tuple(dict.fromkeys(got.rows)), inputs,
                                "attention" if attn else "mlp"))
    found.blocks_of.update({s: (b, blocks.whole.get(s, ())) for s, b in blocks.blocks.items()})
    found.no_sums |= got.no_sums
    found.layouts.update({linears[s].module_path: how for s, how in blocks.layouts.items()})
    found.shape_args.extend(got.shape_args)
    found.scatters.extend(got.scatters)
    found.partials.extend(got.partial_sums)
    for n, st in got.state.items():
        if n in nodes:  # split outputs (tuples) and symbolic sizes are marked with size -1
            shape = node_shape(nodes[n])
            size = shape[st.dim] if shape is not None else -1
            found.sharded[n] = ShardedValue(st.dim, size if isinstance(size, int) else -1)
            if st.merged is not None:
                found.merged[n] = st.merged


_ATTENTION = ("scaled_dot_product_attention", "ring_attention", "matmul", "bmm")  # ring: fxsplit.tp.ring
_PASS_BACK = RESHAPES | {"transpose", "permute", "contiguous", "to", "mul", "div", "clone", "alias"}


def _partners(node: torch.fx.Node | None, linears, unavailable) -> set[str]:
    """The linears whose outputs are an attention node's operands (through views, transposes,
    casts and scalings): the seeds that must be sharded by heads together with the failed ones."""
    if node is None or op_name(node) not in _ATTENTION:
        return set()
    out: set[str] = set()
    for x in node.args[:3] if op_name(node) in ("scaled_dot_product_attention", "ring_attention") else node.args[:2]:
        for _ in range(16):
            if not isinstance(x, torch.fx.Node) or x.name in linears:
                break
            name, first = op_name(x), x.args[0] if x.args else None
            scalar = name not in ("mul", "div") or not any(isinstance(a, torch.fx.Node) for a in x.args[1:])
            if name not in _PASS_BACK or not scalar or not isinstance(first, torch.fx.Node):
                x = None
                break
            x = first
        if isinstance(x, torch.fx.Node) and x.name in linears and x.name not in unavailable:
            out.add(x.name)
    return out


# [Note: whole blocks] Multi-query attention (GPTBigCode) fuses q (H heads) and ONE k / v head
# in one projection, ``[q | k | v]`` split at ``[H*hd, hd, hd]``: q shards by heads, but one
# head does not. When sharding every block fails, the split's second choice keeps k and v whole
# (``ShardSpec.whole``): every rank computes the k / v head, and the ``expand`` of it to H
# heads is rewritten to the local H / t (``fxsplit.tp.rules._broadcast_heads``), which is each
# rank's heads' k / v exactly. Gradients: rank r's dk is its heads' share only (partial), and
# stays partial, because it flows back through the column linear into x, whose f sums it over
# the ranks with dq's; an f on k would sum it there too and count it t times. So no f goes on
# k (``Attempt.no_sums``); instead the weight (and bias) rows of the whole blocks are read
# through an f (``passes/tp_operands.whole_blocks``), which makes their partial gradient
# whole. A whole piece read any other way (its gradient would not be partial) fails the try.


# [Note: attention partners] Seeds are first tried by shared input, so the q, k and v of a
# cross-attention (q from the decoder's stream, k and v from the encoder's output, shared by every
# decoder layer) are never in one try. When a try fails at an attention node (sdpa, or the
# scores / values matmul) because another operand is not sharded by heads, the linears feeding
# its operands join the seeds and the try repeats: the region then has several inputs, each
# with its f (the encoder output's once for all the cross-attentions that read it).


def input_source(x: Any) -> str:
    """The value a linear reads, seen through views (GPT-2's addmm reads view(ln, [-1, C]))."""
    while isinstance(x, torch.fx.Node) and x.op != "placeholder" and op_name(x) in ("view", "reshape"):
        x = x.args[0]
    return x.name if isinstance(x, torch.fx.Node) else str(x)
