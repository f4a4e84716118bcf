"""Sequence parallelism (Megatron-3) as a plan: what runs sharded along the sequence, and where.

Terms (see ``fxsplit.tp.plan`` for t, region, f / g, row, vocab):
- **sequence shard**: 1/t of a value along its sequence dim (dim 1 of the [B, T, C] residual
  stream; T must divide by t at run time). The activations *between* regions run on it.
- **stream**: the values the plan keeps sequence-sharded, each with its sequence dim. It starts
  at the vocabulary embeddings (their output is scattered) and at the row linears (g becomes a
  reduce-scatter); a region's f reading it becomes an all-gather (backward: reduce-scatter).
- **edge**: ``(consumer, operand, action, dim)``: what the pass inserts in front of one input of a
  consumer node: ``"scatter"`` (a replicated operand spanning the sequence is scattered on
  ``dim``), ``"sum"`` (a replicated parameter or value read by the shard goes through
  ``copy_to_region``, so that its gradient is summed over the tp ranks), ``"gather"`` (a consumer
  that cannot run on the shard gets the value all-gathered on ``dim`` first, e.g. the model
  output). ``operand`` is a node name, or a parameter's FQN for parameters.

    plan = find_tp_plan(gm, 2, sequence_parallel=True)     # no process group needed
    sp = plan.rewrite.sequence_plan
    print(sp)                       # one line per decision kind
    sp.sharded["blocks_0_ln1"]      # ("layer_norm", 1): runs on the shard, sequence on dim 1
    sp.reduce_scatters              # ("blocks_0_attn_proj", ...): row linears whose g is a reduce-scatter
    sp.edges_of("sum")              # [("blocks_0_ln1", "blocks.0.ln1.weight", 0), ...]

[Note: sequence-parallel plan] Nodes are named as in the traced graph (the one ``find_tp_plan``
read). The walk follows graph order and sees the graph as the tensor-parallel rewrite leaves it:
a region's column linears read f (never the stream), a row linear's users read its reduced
output, an LM head reads its own f. A node with a stream input runs on the shard when it is
pointwise (every stream operand on one broadcast dim; a replicated operand that spans the
sequence is scattered, any other is summed), a layer norm or per-token linear whose sequence dim
is not the normalized one (its parameters summed), or a reduction with keepdim over other dims;
a read of the sharded size (``x.shape[1]``, ``x.size(1)``) is multiplied by t; anything else gets
its stream inputs all-gathered. ``fxsplit.passes.tensor_parallel`` applies the plan and decides
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.fx
from torch import nn

from fxsplit.errors import TPPlanError
from fxsplit.graph.ops import is_elementwise, op_name, resolve_path

__all__ = ["SequenceParallelPlan", "plan_sequence_parallel", "EDGE_ACTIONS"]

EDGE_ACTIONS = ("scatter", "sum", "gather")

_NORMS_AND_LINEARS = ("layer_norm", "linear")
_REDUCTIONS = ("mean", "sum", "amax", "var")


@dataclass(frozen=True)
class SequenceParallelPlan:
    """The sequence-parallel decisions of a TP plan ([Note: sequence-parallel plan]); empty when
    sequence parallelism is off.

    scatters: vocabulary embeddings whose output is scattered along the sequence (the stream
    starts). all_gathers: f source value -> sequence dim, for each f (before a region or an LM
    head) that becomes an all-gather. reduce_scatters: row linears whose g becomes a
    reduce-scatter (dim 1). sharded: node -> (op name, sequence dim of its local shard) for every
    other node running on the shard. edges: ``(consumer, operand, action, dim)`` in graph order.
    size_reads: nodes reading the sharded size, multiplied by t.
    """

    scatters: tuple[str, ...] = ()
    all_gathers: Mapping[str, int] = field(default_factory=dict)
    reduce_scatters: tuple[str, ...] = ()
    sharded: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    edges: tuple[tuple[str, str, str, int], ...] = ()
    size_reads: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        bad = [e for e in self.edges if e[2] not in EDGE_ACTIONS]
        if bad:
            raise TPPlanError(f"SequenceParallelPlan: edge {bad[0]} has action {bad[0][2]!r}; "
                              f"the actions are {EDGE_ACTIONS}")

    def edges_of(self, action: str) -> list[tuple[str, str, int]]:
        """``(consumer, operand, dim)`` of every edge with ``action``, in graph order."""
        return [(c, a, d) for c, a, act, d in self.edges if act == action]

    def __str__(self) -> str:
        if self == SequenceParallelPlan():
            return "sequence parallel: off"
        lines = [
            "sequence parallel (the activations between regions sharded on the sequence):",
            *_wrapped("scatter after the token embedding", self.scatters),
            *_wrapped("f -> all-gather on", [f"{s} (dim {d})" for s, d in self.all_gathers.items()]),
            *_wrapped("g -> reduce-scatter after", self.reduce_scatters),
            *_wrapped("on the shard", [f"{n} ({op})" for n, (op, _) in self.sharded.items()]),
            *_wrapped("replicated operands scattered", [f"{a} -> {c} (dim {d})" for c, a, d in self.edges_of("scatter")]),
            *_wrapped("gradients summed over tp", [a for _, a, _ in self.edges_of("sum")]),
            *_wrapped("all-gathered for", [f"{a} -> {c} (dim {d})" for c, a, d in self.edges_of("gather")]),
        ]
        if self.size_reads:
            lines += _wrapped("sizes read times t", self.size_reads)
        return "\n".join(lines)


def _wrapped(what: str, items: Any, width: int = 110) -> list[str]:
    """``  what: a, b, c`` over as many lines as it takes, never breaking an item."""
    items = list(items) or ["-"]
    lines, cur = [], f"  {what}:"
    for i, item in enumerate(items):
        piece = f" {item}" + ("," if i < len(items) - 1 else "")
        if len(cur) + len(piece) > width and cur.strip().endswith(","):
            lines.append(cur)
            cur = "     "
        cur += piece
    return lines + [cur]


def plan_sequence_parallel(gm: torch.fx.GraphModule, plan: Any) -> SequenceParallelPlan:
    """The sequence-parallel decisions for a tensor-parallel plan of ``gm`` (pure: gm unchanged).

    ``plan`` is the ``fxsplit.tp.plan.TPPlan`` found on ``gm`` (its regions, rows, vocabulary
    embeddings, LM heads and local shapes); :func:`fxsplit.tp.plan.find_tp_plan` calls this
    with ``sequence_parallel=True`` and records the result as ``plan.rewrite.sequence_plan``.
    """
    return _Walk(gm, plan).run()


def _norm_dim(d: int, n: int) -> int:
    return d % n if n else d


def _is_view(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and op_name(node) in ("view", "reshape")


class _Walk:
    """One pass over the traced graph in order ([Note: sequence-parallel plan]). ``plan`` is a
    ``TPPlan`` (typed ``Any``: ``fxsplit.tp.plan`` imports this module, not the other way)."""

    def __init__(self, gm: torch.fx.GraphModule, plan: Any) -> None:
        self.gm, self.plan = gm, plan
        self.nodes = {n.name: n for n in gm.graph.nodes}
        self.params = {id(p) for p in gm.parameters()}
        self.stream: dict[str, int] = {}  # value (as its consumers read it) -> sequence dim
        self.shape_of: dict[str, int] = {}  # fx getattr(x, "shape") of a stream x -> its dim
        self.all_gathers: dict[str, int] = {}
        self.reduce_scatters: list[str] = []
        self.sharded: dict[str, tuple[str, int]] = {}
        self.edges: list[tuple[str, str, str, int]] = []
        self.size_reads: list[str] = []
        self.columns = {c for r in plan.regions for c in r.columns}
        self.rows = {r for reg in plan.regions for r in reg.rows}
        self.f_sources, self.behind_f = self._f_edges()
        self.row_ends = {self._row_end(r): r for r in self.rows}

    # -- the tensor-parallel rewrite, as the walk sees it

    def _linear_x(self, name: str) -> torch.fx.Node:
        info = self.plan.rewrite.linears[name]
        node = self.nodes[name]
        return node.args[0] if info.kind == "module" else node.args[info.x_index]

    def _f_edges(self) -> tuple[set[str], set[tuple[str, str]]]:
        """Where each region's f goes (before the views of its source, as the pass puts it): the
        sources, and the (consumer, source) edges that read f instead of the source."""
        sources, behind = set(), set()
        for region in self.plan.regions:
            for c in region.columns:
                consumer, src = self.nodes[c], self._linear_x(c)
                while _is_view(src) and len(src.users) == 1 and isinstance(src.args[0], torch.fx.Node):
                    consumer, src = src, src.args[0]
                sources.add(src.name)
                behind.add((consumer.name, src.name))
        return sources, behind

    def _row_end(self, row: str) -> str:
        """The value g reduces: the row linear's output through its single-user views."""
        end = self.nodes[row]
        while len(end.users) == 1:
            (user,) = end.users
            if not _is_view(user) or (user.name, end.name) in self.behind_f:
                break
            end = user
        return end.name

    # -- shapes as the rewritten graph has them (local on the tensor-parallel dim)

    def shape(self, node: Any) -> tuple | None:
        if not isinstance(node, torch.fx.Node):
            return None
        plan = self.plan
        if node.op == "get_attr":
            fqn = str(node.target)
            if fqn in plan.param_specs:
                return tuple(plan.param_specs[fqn].local_shape(plan.full_shapes[fqn]))
            val = node.meta.get("val")
            if val is None:
                val = self._attr(fqn)
            return tuple(val.shape) if isinstance(val, torch.Tensor) else None
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        shape = list(val.shape)
        if node.name in plan.rewrite.sharded_nodes:
            sharded = plan.rewrite.sharded_nodes[node.name]
            dim, size = sharded.dim, sharded.size
            shape[dim] = (size if size >= 0 else shape[dim]) // plan.tp
        if node.name in plan.rewrite.lm_heads and plan.vocab_parallel_loss:
            info = plan.rewrite.linears[node.name]
            shape[-1] = (plan.param_specs[info.weight].pad_to or info.out_features) // plan.tp
        return tuple(shape)

    def _attr(self, fqn: str) -> Any:
        return resolve_path(self.gm, fqn)

    # -- the walk

    def run(self) -> SequenceParallelPlan:
        plan = self.plan
        for node in self.gm.graph.nodes:
            name = node.name
            if name in plan.rewrite.vocab_embeddings:
                self.stream[name] = 1
            elif name in plan.rewrite.lm_heads:
                x = self._linear_x(name)
                if x.name in self.stream:
                    self.all_gathers[x.name] = self.stream[x.name]
            elif name not in self.columns and name not in self.rows:
                self._visit(node)
            if name in self.row_ends:
                shape = self.shape(node)
                if shape is not None and len(shape) >= 3:
                    row = self.row_ends[name]
                    self.reduce_scatters.append(row)
                    bias = plan.rewrite.linears[row].bias
                    if bias is not None and self._grad_param(bias):
                        self.edges.append((row, bias, "sum", 0))
                    self.stream[name] = 1
            if name in self.f_sources and name in self.stream:
                self.all_gathers[name] = self.stream[name]
        return SequenceParallelPlan(
            scatters=tuple(plan.rewrite.vocab_embeddings), all_gathers=self.all_gathers,
            reduce_scatters=tuple(self.reduce_scatters), sharded=self.sharded, edges=tuple(self.edges),
            size_reads=tuple(self.size_reads),
        )

    def _visit(self, node: torch.fx.Node) -> None:
        name = op_name(node, self.gm)
        if any(a.name in self.shape_of for a in node.all_input_nodes):
            src = next(a for a in node.all_input_nodes if a.name in self.shape_of)
            if name == "getitem" and node.args[1] == self.shape_of[src.name]:
                self.size_reads.append(node.name)
            return
        ins = [a for a in node.all_input_nodes if a.name in self.stream and (node.name, a.name) not in self.behind_f]
        if not ins:
            return
        x = node.args[0] if node.args else None
        if name == "getattr" and node.args[1] == "shape":
            self.shape_of[node.name] = self.stream[x.name]
            return
        if name in ("size", "sym_size") and len(node.args) > 1:
            if _norm_dim(node.args[1], len(self.shape(x))) == self.stream[x.name]:
                self.size_reads.append(node.name)
            return
        out = self.shape(node)
        if out is None or not self._on_shard(node, name, x, ins, len(out)):
            for a in ins:
                self.edges.append((node.name, a.name, "gather", self.stream[a.name]))

    def _on_shard(self, node: torch.fx.Node, name: str, x: Any, ins: list[torch.fx.Node], n: int) -> bool:
        """Whether ``node`` runs on the sequence shard; if so its dim and operand edges are recorded."""
        module = self.gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        if isinstance(module, nn.LayerNorm):
            name = "layer_norm"  # the pass calls it as F.layer_norm, its parameters as get_attr
        elif isinstance(module, nn.Linear):
            name = "linear"
        if self._pointwise(node, name):
            dims = {self.stream[a.name] + n - len(self.shape(a)) for a in ins}
            if len(dims) != 1:
                return False
            (d,) = dims
            for a in node.all_input_nodes:
                va = self.shape(a)
                if a.name in self.stream or va is None:
                    continue
                pos = d - (n - len(va))
                if pos >= 0 and va[pos] != 1:
                    self.edges.append((node.name, self._key(a), "scatter", pos))
                else:
                    self._sum(node, a)
        elif (name in _NORMS_AND_LINEARS and isinstance(x, torch.fx.Node) and x.name in self.stream
              and self.stream[x.name] < len(self.shape(x)) - 1):
            d = self.stream[x.name]
            if module is not None:
                for p in ("weight", "bias"):
                    if getattr(module, p, None) is not None and self._grad_param(f"{node.target}.{p}"):
                        self.edges.append((node.name, f"{node.target}.{p}", "sum", 0))
            else:
                for a in node.args[1:]:
                    if isinstance(a, torch.fx.Node):
                        self._sum(node, a)
        elif name in _REDUCTIONS and isinstance(x, torch.fx.Node) and x.name in self.stream and len(node.args) > 1 \
                and isinstance(node.args[1], (list, tuple)):
            keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
            d = self.stream[x.name]
            if not keep or d in [_norm_dim(k, len(self.shape(x))) for k in node.args[1]]:
                return False
        else:
            return False
        self.sharded[node.name] = (name, d)
        self.stream[node.name] = d
        return True

    @staticmethod
    def _pointwise(node: torch.fx.Node, name: str) -> bool:
        return is_elementwise(node, name)

    def _key(self, a: torch.fx.Node) -> str:
        return str(a.target) if a.op == "get_attr" else a.name

    def _grad_param(self, fqn: str) -> bool:
        p = self._attr(fqn)
        return id(p) in self.params and p.requires_grad

    def _sum(self, node: torch.fx.Node, a: torch.fx.Node) -> None:
        """A replicated operand read by the shard: its gradient is summed over tp (buffers,
        constants and non-tensors have none)."""
        if a.op == "get_attr":
            if self._grad_param(str(a.target)):
                self.edges.append((node.name, str(a.target), "sum", 0))
        elif self.shape(a) is not None:
            self.edges.append((node.name, a.name, "sum", 0))

