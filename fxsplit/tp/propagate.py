"""Sharded-dim propagation: which dim of each value carries a tensor-parallel shard.

Terms (see ``fxsplit.tp.plan`` for t, column / row, region, blocks):
- **sharded dim**: the one dim of a value that holds 1/t of its global size on each rank, a
  contiguous range of it (``State.dim``); a value with no entry in ``Attempt.state`` is
  replicated.
- **seeds**: the column linears a region is tried from; their outputs are sharded on the last
  (feature) dim. **origins**: the seeds whose whole output feature dim a value's sharded dim
  still is: their weight rows may still be laid out in blocks ([Note: factored views] in
  ``fxsplit.tp.rules``).
- **cuts / pieces**: the boundaries a seed's output is split at (by split, chunk, slices, or a
  view putting the shard on an inner factor) and the ranges each use needs whole; the cuts give
  the seed's weight ``blocks`` (``ShardSpec.blocks``). **layouts**: seed -> how it was cut.
- **choices**: at a view that splits a free dim, which factor carries the shard; the run
  backtracks over them ([Note: factored views]).
- **shape args**: :class:`fxsplit.tp.rewrite.ShapeArg`, shape arguments (view sizes, split
  sizes, expand sizes, slice bounds) that become local sizes once the value is sharded.
- **attempt**: one walk from the seeds with one set of layout choices; its mutable state
  (:class:`Attempt`) is ``prop.now`` while it runs. The inputs of a propagation are frozen.
- **rules**: ``fxsplit.tp.rules.RULES``, op name -> rule (``rule_for``); an op with no rule
  leaves the region replicated, and the plan names the op.

    prop = Propagation(gm, t, linears, seeds=["q", "k", "v"])
    got = prop.run()           # raises RegionFailed (the region stays replicated) or TPPlanError
    got.state["attn"]          # State(dim=1, origins=frozenset()); got.rows == ["o"]
    got.blocks.blocks["qkv"]   # (64, 64, 64): q, k and v each sharded by heads

[Note: sharded-dim propagation] The dim is pushed forward in graph order from the seeds through
pointwise ops (with broadcast operands), views/reshapes that split or merge it
([Note: factored views]), transposes, permutes, splits/chunks/unbind/select/slices/index on
other dims, stack and cat on other dims (rotary embeddings, halves or interleaved pairs),
reductions and norms over other dims (per-head q/k norms), expand and repeat_interleave
(grouped-query attention), softmax on other dims, scaled-dot-product attention and batched
matmuls over heads, until every path ends in a linear whose input feature dim is the sharded one
(a row linear). Anything else (a norm or reduction over the sharded dim, a residual add with a
replicated tensor, a model output, reading the sharded size) raises :class:`RegionFailed` naming
the node: the region stays replicated and the plan says why. A sharded size that t does not
divide raises :class:`TPPlanError` (node, module, sizes, nearest valid t), when no other layout
of the seeds' outputs propagates. ``fxsplit.tp.plan.find_tp_plan`` chooses the seeds and turns
the result into the plan; ``fxsplit.passes.tensor_parallel`` applies its shape args.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.fx

from fxsplit.errors import TPPlanError
from fxsplit.graph.ops import op_name
from fxsplit.tp.linears import LinearInfo
from fxsplit.tp.merged import size_read as merged_size_read
from fxsplit.tp.rewrite import PartialSum, Scatter, ShapeArg
from fxsplit.tp.rules import RULES, no_rule, rule_for
from fxsplit.tp.shapes import LocalSize, Op, RegionFailed, Rule, State, divisibility_msg, node_shape, norm_dim

__all__ = [
    "TPPlanError",
    "node_shape",
    "divisibility_msg",
    "State",
    "RegionFailed",
    "Propagation",
    "Attempt",
    "Blocks",
    "GraphOrder",
    "Op",
    "Rule",
    "RULES",
    "rule_for",
    "LocalSize",
]

_MAX_TRIES = 64


class GraphOrder:
    """A graph's nodes in order, by name and with each one's position, for the propagations of
    one plan search (the graph is not edited while the plan is found)."""

    def __init__(self, graph: torch.fx.Graph):
        self.nodes = list(graph.nodes)
        self.pos = {n: i for i, n in enumerate(self.nodes)}
        self.by_name = {n.name: n for n in self.nodes}
        self._last: dict[str, int] = {}

    def last_use(self, name: str) -> int:
        """Position of the last user of the node ``name`` (its own position without users, -1 for
        a name that is not a node, e.g. a rule's ``"split[i]"`` piece)."""
        got = self._last.get(name)
        if got is None:
            node = self.by_name.get(name)
            got = -1 if node is None else max((self.pos[u] for u in node.users), default=self.pos[node])
            self._last[name] = got
        return got


@dataclass
class Cuts:
    """Where one attempt cut the seeds' outputs into blocks ([Note: factored views] in
    ``fxsplit.tp.rules``), and the blocks it keeps whole ([Note: whole blocks])."""

    cuts: dict[str, set[int]] = field(default_factory=dict)  # seed -> its cut points
    pieces: dict[str, list[tuple[int, int, str]]] = field(default_factory=dict)  # seed -> [a, b) read whole, by
    notes: dict[str, list[str]] = field(default_factory=dict)  # seed -> how each use cut it
    cut_by: dict[str, set[str]] = field(default_factory=dict)  # node -> the seeds it cut
    whole_pieces: set[str] = field(default_factory=set)  # "split[i]": a block of a seed's output kept whole
    whole_ranges: dict[str, set[tuple[int, int]]] = field(default_factory=dict)  # seed -> [a, b) of its whole blocks
    whole_read: set[str] = field(default_factory=set)  # whole pieces read (getitem), and those read as a
    whole_used: set[str] = field(default_factory=set)  # broadcast head: every read one must be


@dataclass(frozen=True)
class Blocks:
    """The blocks an attempt found: seed -> block sizes (seeds cut in more than one block), seed ->
    indices of its whole blocks, seed -> how it was cut (for the plan's note column)."""

    blocks: dict[str, tuple[int, ...]]
    whole: dict[str, tuple[int, ...]]
    layouts: dict[str, str]


@dataclass
class Attempt:
    """The mutable state of one propagation attempt: one set of layout choices replayed from the
    start. ``choices``: the option taken at each choice (0 past its end); ``points``: the number
    of options at each choice made, in order; ``merging``: H while a rule runs on values merged
    by H. ``run`` returns the attempt that succeeded, with ``blocks`` filled."""

    choices: list[int]
    points: list[int] = field(default_factory=list)
    state: dict[str, State] = field(default_factory=dict)
    shape_of: dict[str, int] = field(default_factory=dict)  # fx getattr(x, "shape") of a sharded x -> its dim
    rows: list[str] = field(default_factory=list)
    shape_args: list[ShapeArg] = field(default_factory=list)
    scatters: list[Scatter] = field(default_factory=list)
    partial_sums: list[PartialSum] = field(default_factory=list)
    no_sums: set[tuple[str, str]] = field(default_factory=set)  # (node, operand): a partial gradient left partial
    merging: int | None = None
    cuts: Cuts = field(default_factory=Cuts)
    blocks: Blocks | None = None


@dataclass
class _Search:
    """What a search keeps across attempts: the current one, and the layouts skipped or
    indivisible (said when every attempt fails)."""

    attempt: Attempt = field(default_factory=lambda: Attempt([]))
    skipped: list[str] = field(default_factory=list)
    indivisible: list[str] = field(default_factory=list)


@dataclass(frozen=True, eq=False)
class Propagation:
    """Push sharded dims from a set of column linears forward through the graph
    ([Note: sharded-dim propagation]); ``run`` returns the :class:`Attempt` that succeeded (its
    ``state``, ``rows``, ``blocks``, ``shape_args``, ...). Each op is handled by its rule
    (``fxsplit.tp.rules.rule_for``), which reads the inputs (``p.t``, ``p.linears``), the
    current attempt (``p.now``) and records through the methods below."""

    gm: torch.fx.GraphModule
    t: int
    linears: Mapping[str, LinearInfo]
    seeds: frozenset[str]
    excluded: frozenset[str] = frozenset()
    forced_rows: frozenset[str] = frozenset()
    order: GraphOrder | None = None
    search: _Search = field(default_factory=_Search, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("seeds", "excluded", "forced_rows"):
            object.__setattr__(self, name, frozenset(getattr(self, name)))
        if self.order is None:
            object.__setattr__(self, "order", GraphOrder(self.gm.graph))

    @property
    def now(self) -> Attempt:
        """The current attempt."""
        return self.search.attempt

    # ---------------------------------------------------------------- the search

    def run(self) -> Attempt:
        """Propagate; on a failure, try the next layout choice (depth first, the last choice
        first), at most ``_MAX_TRIES`` runs. All failing: the first run's reason, or the
        TPPlanError of a heads dim that t does not divide."""
        search = self.search
        search.skipped.clear()
        search.indivisible.clear()
        first: RegionFailed | None = None
        choices: list[int] = []
        for _ in range(_MAX_TRIES):
            search.attempt = Attempt(list(choices))
            try:
                self._run_once()
                return search.attempt
            except RegionFailed as exc:
                first = first or exc
            except TPPlanError as exc:
                if not choices:
                    raise
                first = first or RegionFailed(str(exc))
            choices = _next_choices(search.attempt)
            if choices is None:
                break
        if search.indivisible:
            raise TPPlanError(search.indivisible[0])
        if search.skipped:
            exc = RegionFailed(f"{first} (and {search.skipped[0]})")
            exc.seeds = getattr(first, "seeds", frozenset())
            raise exc
        raise first

    def choose(self, node: torch.fx.Node, n: int) -> int:
        """The option to take at a choice with ``n`` options (0 the first time through)."""
        if n == 1:
            return 0
        now = self.now
        i = len(now.points)
        now.points.append(n)
        return now.choices[i] if i < len(now.choices) else 0

    def skipped(self, msg: str) -> None:
        """A layout not tried because t does not divide it (said when every other one fails)."""
        if msg not in self.search.skipped:
            self.search.skipped.append(msg)

    def indivisible(self, msg: str) -> None:
        if msg not in self.search.indivisible:
            self.search.indivisible.append(msg)

    def _run_once(self) -> None:
        # [Note: the walk's window] Nothing before the first seed has a state (each attempt starts
        # empty), so the walk starts there; and it stops past the horizon, the last user
        # of any value with a state (or a sharded size) and the last seed: no node after it reads
        # one, so none could step. One region's propagation thus visits its layer, not the
        # rest of the graph (80 layers x 2 regions x the graph's 5.6k nodes for a Llama-70B).
        order, now = self.order, self.now
        nodes = order.nodes
        idx = [order.pos[n] for n in (order.by_name.get(s) for s in self.seeds) if n is not None]
        start = min(idx, default=len(nodes))
        horizon = max(idx, default=-1)
        known = 0  # state and shape_of entries when the horizon was last taken
        for i in range(start, len(nodes)):
            if i > horizon:
                break
            node = nodes[i]
            if node.name in self.seeds:
                now.state[node.name] = State(len(node_shape(node)) + self.linears[node.name].out_axis,
                                             frozenset([node.name]))
            else:
                ins = [a for a in node.all_input_nodes if a.name in now.state or a.name in now.shape_of]
                if not ins:
                    continue
                self.step(node)
            if len(now.state) + len(now.shape_of) != known:  # new values with a state: their users
                horizon = max(horizon, *(order.last_use(name) for name in [*now.state, *now.shape_of]))
                known = len(now.state) + len(now.shape_of)
        unused = sorted(now.cuts.whole_read - now.cuts.whole_used)
        if unused:
            exc = RegionFailed(f"{unused[0]}: a block kept whole is read other than as the one k / v head of "
                               "multi-query attention (its gradient would not be partial)")
            exc.seeds = frozenset()
            raise exc
        now.blocks = _blocks(now.cuts, self.linears)

    # ---------------------------------------------------------------- what rules call

    def fail(self, node: torch.fx.Node, why: str) -> None:
        exc = RegionFailed(f"{node.name} ({op_name(node, self.gm)}): {why}")
        exc.seeds = self._reaching(node)
        exc.node = node
        raise exc

    def _reaching(self, node: torch.fx.Node) -> frozenset[str]:
        """The seeds whose sharded values reach ``node`` (through sharded values only): without
        them the rest of the group may still form a region (``fxsplit.tp.regions.find_regions``)."""
        out, seen, stack = set(), set(), [node]
        state, shape_of = self.now.state, self.now.shape_of
        while stack:
            n = stack.pop()
            for a in n.all_input_nodes:
                if a.name in seen or (a.name not in state and a.name not in shape_of):
                    continue
                seen.add(a.name)
                if a.name in self.seeds:
                    out.add(a.name)
                else:
                    stack.append(a)
        return frozenset(out)

    def set(self, node, dim, origins=frozenset()):
        self.now.state[node.name] = State(dim, origins)

    def local_arg(self, name: str, path: tuple, value) -> None:
        """The argument at ``path`` of node ``name`` becomes ``value``, already local."""
        self.now.shape_args.append(ShapeArg(name, path, value))

    def rewrite(self, node, path, value, dim_size):
        if isinstance(value, int) and value != -1:
            if value % self.t:
                raise TPPlanError(divisibility_msg(node, self.t, value, "a shape argument"))
            self.local_arg(node.name, path, value // self.t)
        elif isinstance(value, torch.fx.Node):
            traced = value.meta.get("val")
            if isinstance(traced, int) and isinstance(dim_size, int) and traced == dim_size and traced % self.t == 0:
                self.local_arg(node.name, path, LocalSize(self.t))
                return
            self.fail(node, f"the sharded size {dim_size} is computed at run time ({value.name}) and "
                            "not traced as that constant; it must be a constant or -1 to be rewritten to the local size")

    def scatter(self, node, operand, dim) -> None:
        """A replicated operand of ``node`` with the sharded dim's full size on ``dim`` (a
        per-head score bias): each rank reads its own range of it ([Note: scattered operands]
        in ``fxsplit.tp.rules``); the pass puts ``scatter_to_region`` on that read. On a merged
        dim (a rule running under ``merging``) the range is strided: H rides along."""
        self.now.scatters.append(Scatter(node.name, operand.name, dim, self.now.merging or None))

    def partial_sum(self, node, kind: str) -> None:
        """A sum / mean over the sharded dim: replicated after the pass's g ([Note: reductions
        over the sharded dim] in ``fxsplit.tp.rules``); its value has no sharded dim."""
        self.now.partial_sums.append(PartialSum(node.name, kind))

    def rewrite_slice(self, node, path, start, stop, size):
        """fx ``x[..., a:b]`` of a dim of global ``size``: the slice at ``path`` gets local bounds."""
        lo = None if start in (None, 0) else start // self.t
        hi = None if stop is None or stop >= size else stop // self.t
        self.local_arg(node.name, path, slice(lo, hi))

    def cut(self, origins, node, ranges, how: str) -> None:
        """A use of the seeds' outputs ``origins`` that reads ``ranges`` (global [a, b) of the
        feature dim) each as one block: the boundaries become cuts, the insides stay whole."""
        c = self.now.cuts
        for o in origins:
            c.cut_by.setdefault(node.name, set()).add(o)
            cuts = c.cuts.setdefault(o, set())
            for a, b in ranges:
                cuts |= {a, b}
                c.pieces.setdefault(o, []).append((a, b, node.name))
            c.notes.setdefault(o, []).append(how)

    # ---------------------------------------------------------------- one node

    def step(self, node: torch.fx.Node) -> None:
        """One node with a sharded input: the model output, a read of a sharded size, a row
        linear (the region ends), else the rule of its op (:func:`rule_for`); no rule fails."""
        state = self.now.state
        name = op_name(node, self.gm)
        if node.op == "output":
            self.fail(node, "a sharded value is a model output")
        if any(a.name in self.now.shape_of for a in node.all_input_nodes):  # fx: B, T, C = x.shape
            return self._read_shape(node, name)
        merged = {state[a.name].merged for a in node.all_input_nodes if a.name in state}
        if merged != {None} and node.name in self.linears:
            self.fail(node, "a linear reads a value whose heads are merged as the inner factor of a dim")
        if node.name in self.linears:
            return self._end_at_row(node)
        x = node.args[0] if node.args else None
        op = Op(node, name, state.get(x.name) if isinstance(x, torch.fx.Node) else None, node_shape(node))
        if op.st is None and name in ("cat", "stack") and node.args and isinstance(node.args[0], (list, tuple)):
            first = next((a for a in node.args[0] if isinstance(a, torch.fx.Node) and a.name in state), None)
            op = Op(node, name, state.get(first.name) if first is not None else None, op.out_shape)
        rule = rule_for(node, name)
        if rule is None or not rule.accepts(op.out_shape):
            return no_rule(self, op)
        if op.st is None and not rule.any_operand:
            self.fail(node, "a sharded operand other than the first")
        if merged != {None}:
            return self._step_merged(op, rule, merged)
        free = {o for a in node.all_input_nodes if a.name in state for o in state[a.name].origins}
        rule.fn(self, op)
        out = state.get(node.name)
        if out is not None:
            # a free input whose layout this op fixes as one contiguous range (its output is no longer
            # free and the op made no cut): no later use may cut that seed into blocks
            for o in sorted(free - out.origins - self.now.cuts.cut_by.get(node.name, set())):
                self.cut([o], node, [(0, self.linears[o].out_features)], f"read whole by {name}")

    def _step_merged(self, op: Op, rule: Rule, merged: set) -> None:
        """A node reading values whose sharded dim is merged ([Note: heads merged as an inner
        factor] in ``fxsplit.tp.merged``): every sharded operand merged by one H, and a rule
        exact for it; a "carry" rule's outputs stay merged."""
        node = op.node
        if len(merged) > 1:
            self.fail(node, "combines a value whose heads are merged as the inner factor of a dim with a value "
                            "sharded otherwise")
        (h,) = merged
        if not rule.merged:
            self.fail(node, f"no rule for '{op.name}' of a value whose heads are merged as the inner factor of a dim")
        before = set(self.now.state)
        self.now.merging = h
        try:
            rule.fn(self, op)
        finally:
            self.now.merging = None
        if rule.merged == "carry":
            for k in set(self.now.state) - before:
                self.now.state[k] = State(self.now.state[k].dim, frozenset(), h)

    def _read_shape(self, node, name):
        src = next(a for a in node.all_input_nodes if a.name in self.now.shape_of)
        if name == "getitem" and isinstance(node.args[1], int):
            if norm_dim(node.args[1], len(node_shape(src.args[0]) or ())) != self.now.shape_of[src.name]:
                return
            st = self.now.state.get(src.args[0].name)
            if st is not None and st.merged is not None:
                return merged_size_read(self, node, st.merged)
        self.fail(node, "reads the size of the sharded dim")

    def _end_at_row(self, node):
        """A linear reading the sharded value on its features ends the region as a row linear
        (a seed's output read whole: no blocks may cut it)."""
        state = self.now.state
        info = self.linears[node.name]
        if node.name in self.excluded:
            self.fail(node, f"{info.module_path} is set to replicate")
        ins = [a for a in node.all_input_nodes if a.name in state]
        xin = node.args[info.x_index] if info.kind != "module" else node.args[0]
        if not isinstance(xin, torch.fx.Node) or xin.name not in state or len(ins) != 1:
            self.fail(node, "a sharded weight or bias")
        xs = node_shape(xin)
        if state[xin.name].dim != len(xs) + info.x_axis:
            self.fail(node, f"input sharded on dim {state[xin.name].dim}, not on its features")
        origins = state[xin.name].origins
        for o in origins:
            self.cut([o], node, [(0, self.linears[o].out_features)], "read whole by a row linear")
        self.now.rows.append(node.name)


def _next_choices(attempt: Attempt) -> list[int] | None:
    """The choices of the next attempt after ``attempt`` failed (depth first, the last choice
    first); None when every one was tried."""
    points = attempt.points
    made = attempt.choices[:len(points)] + [0] * (len(points) - len(attempt.choices))
    for i in reversed(range(len(points))):
        if made[i] + 1 < points[i]:
            return made[:i] + [made[i] + 1]
    return None


def _blocks(c: Cuts, linears) -> Blocks:
    """The blocks of every cut seed, checked against the pieces each use needs whole."""
    out = Blocks({}, {}, {})
    for o, cuts in c.cuts.items():
        size = linears[o].out_features
        bounds = sorted(cuts | {0, size})
        for a, b, where in c.pieces[o]:
            inner = [x for x in bounds if a < x < b]
            if inner:
                raise RegionFailed(f"{where}: reads [{a}:{b}] of {o}'s output as one block, but another "
                                   f"use splits it at {inner} (the blocks of one weight must agree)")
        blocks = tuple(b - a for a, b in zip(bounds, bounds[1:]))
        whole = tuple(i for i, ab in enumerate(zip(bounds, bounds[1:])) if ab in c.whole_ranges.get(o, ()))
        if whole:
            out.whole[o] = whole
        if len(blocks) > 1:
            out.blocks[o] = blocks
            out.layouts[o] = "; ".join(dict.fromkeys(n for n in c.notes[o] if not n.startswith("read whole")))
    return out
