"""Tensor-parallel plans: what to shard, found from the traced graph (no per-model policy).

Terms:
- **t**: the tensor-parallel degree. **linear**: a node computing ``x @ W (+ b)`` with ``W`` a
  parameter, whatever its spelling (``nn.Linear`` call_module, ``F.linear``/``aten.linear``,
  ``aten.addmm``/``aten.mm`` with ``W`` stored ``[in, out]`` as HF GPT-2's ``Conv1D``, ``x @ W.T``
  as Falcon's ``FalconLinear``).
- **column** (``"colwise"``): W split on its output dim, input copied (Megatron's f), output
  sharded on the feature dim. **row** (``"rowwise"``): W split on its input dim, input sharded,
  partial outputs summed (g), bias added once after the sum. **vocab**: an embedding table split
  by rows (vocabulary); an LM head column-parallel on the vocabulary. **replicate**: untouched.
- **region**: the column linears that share one input (q, k, v; gate, up) and the row linears
  that consume their sharded outputs (o; down), with every node between them carrying one
  sharded dim (heads or hidden width). One forward all-reduce per region.
- **blocks**: a fused projection (``qkv``, ``gate_up``) whose output is split, chunked, sliced
  or viewed into parts on the sharded dim (``[3, heads, hd]``, ``[q heads | k heads | v
  heads]``, ``chunk(2)``) is sharded block by block (q, k and v each by heads), never as one
  plain column range ([Note: factored views] in ``fxsplit.tp.rules``); ``plan.layouts`` says how.

    plan = find_tp_plan(gm, 2)              # pure: inspect, print, compare
    print(plan)                             # one row per module: style, shards, reason
    plan.param_specs["blocks.0.attn.qkv.weight"]   # ShardSpec(dim=0, num_shards=2, blocks=(32, 16, 16))

Detection: every group of linears sharing an input is tried as the column linears of a
region (then each alone); the "sharded dim" is pushed forward from them until every path ends
in a row linear, as [Note: sharded-dim propagation] in ``fxsplit.tp.propagate`` describes
(that module holds the propagation and the view-shape arithmetic; op names and op classes are
``fxsplit.graph.ops``'s, [Note: op names]). A region that fails stays replicated and the plan says why. Sizes that t
does not divide raise :class:`TPPlanError` (module, numbers, nearest t).

Vocabulary: an embedding whose indices are a model input is vocabulary-parallel (rows; padded
to a multiple of t when V is not divisible, see ``fxsplit.tp.sharding``); a linear tied to it, or
returning vocabulary-sized outputs to the model output, is the LM head. With
``sequence_parallel`` the plan also records where the activations between regions run sharded
along the sequence (``plan.sequence_plan``, planned by ``fxsplit.tp.sequence``; it needs such a
token embedding to start the sequence-sharded residual stream); the pass only applies it.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.fx

from fxsplit.tp.linears import EmbeddingInfo, LinearInfo, aliases, find_embeddings, find_linears
from fxsplit.tp.sequence import SequenceParallelPlan, plan_sequence_parallel
from fxsplit.graph.ops import CREATION, METADATA, RESHAPES, op_name, resolve_path
from fxsplit.tp.sharding import ShardSpec, padded_size
from fxsplit.tp.propagate import LocalSize, TPPlanError, divisibility_msg
from fxsplit.tp.regions import Region, find_regions
from fxsplit.tp.rewrite import GradSum, PartialSum, Scatter, ShapeArg, ShardedValue, TPRewrite

__all__ = [
    "STYLES",
    "LinearInfo",
    "EmbeddingInfo",
    "Region",
    "TPPlan",
    "TPRewrite",
    "ShardedValue",
    "ShapeArg",
    "GradSum",
    "Scatter",
    "PartialSum",
    "SequenceParallelPlan",
    "TPPlanError",
    "LocalSize",
    "find_tp_plan",
    "find_linears",
    "find_embeddings",
]

STYLES = ("colwise", "rowwise", "vocab", "replicate")


# --------------------------------------------------------------------------------------------
# data


@dataclass(frozen=True)
class TPPlan:
    """A tensor-parallel plan (frozen data; :func:`fxsplit.passes.tensor_parallel` applies it).

    What a user reads: styles: module path -> style for every linear and embedding of the
    graph. param_specs: FQN (every alias of a tied parameter) -> ShardSpec; full_shapes: FQN ->
    the global shape of each sharded parameter. regions: the column/row groups.
    replicated: (module path, why) for linears/embeddings left whole. layouts: module path ->
    how a fused projection's output is cut into the blocks of its ShardSpec (``"split [64, 32,
    32]"``, ``"view [3, 4, 16], shard on factor 1 (4)"``), printed in the plan's note column.
    vocab_size: V (unpadded) of the vocabulary-parallel embedding and LM heads.
    sequence_parallel, vocab_parallel_loss, overrides: as asked of :func:`find_tp_plan`.

    rewrite: the node-level recipe derived with it (:class:`fxsplit.tp.rewrite.TPRewrite`:
    sharded values, shape arguments, the collectives on operands and reductions, the
    sequence-parallel decisions). The cost model and ``verify`` read a few of its fields
    through the properties below.
    """

    tp: int
    styles: Mapping[str, str]
    param_specs: Mapping[str, ShardSpec]
    regions: tuple[Region, ...]
    replicated: tuple[tuple[str, str], ...]
    vocab_size: int | None = None
    sequence_parallel: bool = False
    vocab_parallel_loss: bool = False
    overrides: Mapping[str, str] = field(default_factory=dict)
    full_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    layouts: Mapping[str, str] = field(default_factory=dict)
    rewrite: TPRewrite = field(default_factory=TPRewrite)

    @property
    def sharded_nodes(self) -> Mapping[str, ShardedValue]:
        return self.rewrite.sharded_nodes

    @property
    def vocab_embeddings(self) -> tuple[str, ...]:
        return self.rewrite.vocab_embeddings

    @property
    def lm_heads(self) -> tuple[str, ...]:
        return self.rewrite.lm_heads

    @property
    def merged(self) -> Mapping[str, int]:
        return self.rewrite.merged

    @property
    def sequence_plan(self) -> SequenceParallelPlan:
        return self.rewrite.sequence_plan

    @classmethod
    def identity(cls) -> TPPlan:
        """The plan of t=1 with no overrides: every parameter replicated, nothing sharded,
        nothing rewritten (``fxsplit.plan`` records it when no tensor parallelism runs)."""
        return cls(tp=1, styles={}, param_specs={}, regions=(), replicated=())

    @property
    def is_identity(self) -> bool:
        return self == TPPlan.identity()

    def style_of(self, module_path: str) -> str:
        return self.styles.get(module_path, "replicate")

    def __str__(self) -> str:
        if self.is_identity:
            return "TPPlan(t=1, identity: every parameter replicated)"
        why = dict(self.replicated)
        rows = [("module", "style", "shards", "note")]
        for path, style in self.styles.items():
            specs = [f"{n.rsplit('.', 1)[-1]}: {_spec_str(s)}" for n, s in self.param_specs.items()
                     if n.rpartition(".")[0] == path]
            note = why.get(path, "") or (f"blocks from {self.layouts[path]}" if path in self.layouts else "")
            rows.append((path, style, "; ".join(specs) or "-", note))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"TPPlan(t={self.tp}, regions={len(self.regions)}, sequence_parallel="
                 f"{self.sequence_parallel}, vocab_parallel_loss={self.vocab_parallel_loss})"]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + ("  " + r[3] if r[3] else ""))
        if self.sequence_parallel:
            lines.append(str(self.sequence_plan))
        return "\n".join(lines)


def _spec_str(s: ShardSpec) -> str:
    extra = (f", blocks={s.blocks}" if s.blocks else "") + (f", whole={s.whole}" if s.whole else "") + (f", pad_to={s.pad_to}" if s.pad_to else "")
    return f"dim {s.dim}/{s.num_shards}{extra}"


# --------------------------------------------------------------------------------------------
# the plan


def _match_overrides(overrides: Mapping[str, str], paths: list[str]) -> dict[str, str]:
    styles: dict[str, str] = {}
    for pattern, style in overrides.items():
        if style not in STYLES:
            raise TPPlanError(f"overrides[{pattern!r}] = {style!r}: the style must be one of {STYLES}")
        hits = [p for p in paths if fnmatch.fnmatchcase(p, pattern)]
        if not hits:
            close = difflib.get_close_matches(pattern, paths, n=3, cutoff=0.4)
            raise TPPlanError(
                f"overrides: pattern {pattern!r} names no linear or embedding module of the graph"
                + (f"; did you mean {close}?" if close else f"; modules are e.g. {paths[:4]}")
            )
        for p in hits:
            styles[p] = style
    return styles


def find_tp_plan(
    gm: torch.fx.GraphModule,
    tp: int,
    *,
    overrides: Mapping[str, str] | None = None,
    sequence_parallel: bool = False,
    vocab_parallel_loss: bool = False,
) -> TPPlan:
    """Find the tensor-parallel plan of a traced graph for degree ``tp`` (pure: gm unchanged).

    overrides: fnmatch patterns over module paths -> "colwise" | "rowwise" | "vocab" |
    "replicate"; a pattern matching nothing, or a forced style the graph cannot honour, raises
    :class:`TPPlanError`. vocab_parallel_loss: the LM head's logits stay sharded (the loss must be
    ``fxsplit.tp.functional.vocab_parallel_cross_entropy``); otherwise they are gathered.

    Steps: the graph's linears and embeddings (:class:`_Graph`), the vocabulary-parallel
    embeddings and LM heads (:func:`_vocab_parallel`), the regions by propagation
    (:func:`fxsplit.tp.regions.find_regions`), then styles, specs and the report (:func:`_styles_and_specs`),
    checked against the overrides and t (:func:`_check_plan`); with ``sequence_parallel``, the
    sequence-parallel decisions (:func:`fxsplit.tp.sequence.plan_sequence_parallel`).
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise TPPlanError(f"find_tp_plan: tp must be an int >= 1, got {tp!r}")
    g0 = _Graph.of(gm, overrides)
    blocked: dict[str, str] = {}  # module path -> why it stays whole ([Note: one parameter, two names])
    while True:
        g = dataclasses.replace(g0, forced={**{p: "replicate" for p in blocked}, **g0.forced}) if blocked else g0
        excluded = {n for n, l in g.linears.items() if g.forced.get(l.module_path) in ("replicate", "vocab")}
        vocab = _vocab_parallel(g, vocab_parallel_loss=vocab_parallel_loss, sequence_parallel=sequence_parallel)
        excluded |= set(vocab.lm_heads)
        found = find_regions(gm, tp, g.linears, g.forced, excluded, set(vocab.lm_heads))
        styles, specs, replicated, uses = _styles_and_specs(g, tp, vocab, found.regions, found.blocks_of,
                                                            found.failures, excluded)
        more = _disagreeing_uses(g0, uses)
        if not more:
            break
        blocked.update(more)
    replicated = [(path, blocked.get(path, why)) for path, why in replicated]
    scattered = {(sc.node, sc.operand) for sc in found.scatters} | found.no_sums
    grad_sums = _grad_sums(gm, found.sharded, g.linears, specs, scattered)
    _check_plan(g, tp, styles, replicated, found.sharded)
    rewrite = TPRewrite(
        sharded_nodes=found.sharded, shape_args=tuple(found.shape_args), linears=g.linears, embeddings=g.embeds,
        vocab_embeddings=tuple(e.node for e in vocab.embeddings), lm_heads=tuple(vocab.lm_heads),
        grad_sums=tuple(grad_sums), scatters=tuple(found.scatters), partial_sums=tuple(found.partials),
        merged=found.merged,
    )
    plan = TPPlan(
        tp=tp, styles=styles, param_specs=specs, regions=tuple(found.regions), replicated=tuple(replicated),
        vocab_size=vocab.size, sequence_parallel=sequence_parallel,
        vocab_parallel_loss=vocab_parallel_loss, overrides=dict(overrides or {}),
        full_shapes={n: tuple(int(s) for s in resolve_path(gm, n).shape) for n in specs},
        layouts=found.layouts, rewrite=rewrite,
    )
    if sequence_parallel:
        sequence = plan_sequence_parallel(gm, plan)
        plan = dataclasses.replace(plan, rewrite=dataclasses.replace(rewrite, sequence_plan=sequence))
    return plan


@dataclass(frozen=True)
class _Graph:
    """What :func:`find_tp_plan` reads off the graph before deciding anything: its linears and
    embeddings, tied-parameter aliases, and the styles the overrides force (module path -> style)."""

    gm: torch.fx.GraphModule
    nodes: Mapping[str, torch.fx.Node]
    linears: Mapping[str, LinearInfo]
    embeds: Mapping[str, EmbeddingInfo]
    aliases: Mapping[str, tuple[str, ...]]
    forced: Mapping[str, str]

    @classmethod
    def of(cls, gm: torch.fx.GraphModule, overrides: Mapping[str, str] | None) -> "_Graph":
        linears = find_linears(gm)
        embeds = find_embeddings(gm)
        paths = list(dict.fromkeys([l.module_path for l in linears.values()] + [e.module_path for e in embeds.values()]))
        forced = _match_overrides(dict(overrides or {}), paths)
        return cls(gm, {n.name: n for n in gm.graph.nodes}, linears, embeds, aliases(gm), forced)


@dataclass(frozen=True)
class _Vocab:
    """The vocabulary-parallel part of a plan: token embeddings, LM head nodes, V (unpadded)."""

    embeddings: list[EmbeddingInfo]
    lm_heads: list[str]
    size: int | None


def _vocab_parallel(g: _Graph, *, vocab_parallel_loss: bool, sequence_parallel: bool) -> _Vocab:
    """Embeddings and LM heads (vocabulary parallel): an embedding of model-input ids, and the
    linears tied to it or returning vocabulary-sized outputs to the model output."""
    vocab_embeds, vocab_weights = [], set()
    for e in g.embeds.values():
        style = g.forced.get(e.module_path)
        if style in ("colwise", "rowwise"):
            raise TPPlanError(f"overrides: {e.module_path!r} is an embedding; its styles are 'vocab' or 'replicate', not {style!r}")
        if style == "vocab" or (style is None and e.from_input):
            vocab_embeds.append(e)
            vocab_weights |= set(g.aliases.get(e.weight, (e.weight,)))
    vocab_size = None
    if vocab_embeds:
        vocab_size = vocab_embeds[0].num_embeddings
    lm_heads = []
    for l in g.linears.values():
        tied = l.weight in vocab_weights
        style = g.forced.get(l.module_path)
        if style == "replicate":
            if tied:
                raise TPPlanError(f"overrides: {l.module_path!r} is set to replicate, but its weight is tied to the "
                                  f"vocabulary-parallel embedding; set both to 'replicate' or both to 'vocab'")
            continue
        is_head = tied or style == "vocab" or (vocab_size is not None and l.out_features == vocab_size
                                                and l.out_dim == 0 and l.kind not in ("grouped", "batched")
                                                and _reaches_output(g.nodes[l.node]))
        if style == "vocab" and l.out_dim != 0:
            raise TPPlanError(f"overrides: {l.module_path!r} stores its weight [in, out]; 'vocab' supports [out, in] weights")
        if is_head and style not in ("colwise", "rowwise"):
            if vocab_size is None:
                vocab_size = l.out_features
            if l.out_features != vocab_size:
                raise TPPlanError(f"LM head {l.module_path!r} has {l.out_features} outputs but the vocabulary-parallel "
                                  f"embedding has {vocab_size} rows; mark one 'replicate' in overrides")
            lm_heads.append(l.node)
    if vocab_parallel_loss and not lm_heads:
        raise TPPlanError("vocab_parallel_loss=True but no LM head was found (a linear tied to the token embedding "
                          "or with vocabulary-sized outputs that the model returns); mark it with overrides={path: 'vocab'}")

    if sequence_parallel and not vocab_embeds:
        raise TPPlanError("sequence_parallel=True needs a token embedding (a vocabulary-parallel embedding whose "
                          "[B, T, C] output starts the sequence-sharded residual stream); this graph has none. "
                          "Use sequence_parallel=False, or mark the token embedding with overrides={path: 'vocab'}")
    return _Vocab(vocab_embeds, lm_heads, vocab_size)


def _styles_and_specs(g: _Graph, tp: int, vocab: _Vocab, regions: list[Region], blocks_of: Mapping[str, tuple],
                      failures: Mapping[str, str], excluded: set[str]):
    """Styles, specs, report: module path -> style, FQN (every alias) -> ShardSpec, and
    (module path, why) for every linear and embedding left replicated."""
    styles: dict[str, str] = {}
    specs: dict[str, ShardSpec] = {}
    replicated: list[tuple[str, str]] = []
    uses: list[_Use] = []  # every read of a parameter by a linear or embedding, sharded or not

    def put(fqn: str, spec: ShardSpec, path: str, style: str) -> None:
        uses.append(_Use(fqn, path, style, spec))
        for a in g.aliases.get(fqn, (fqn,)):
            specs[a] = spec

    col = {c for r in regions for c in r.columns}
    row = {c for r in regions for c in r.rows}
    vocab_size = vocab.size
    for name, l in g.linears.items():
        path = l.module_path
        if name in col:
            styles[path] = "colwise"
            blocks, whole = blocks_of.get(name, (None, ()))
            put(l.weight, ShardSpec(l.out_dim, tp, blocks, whole=whole), path, "colwise")
            if l.bias:
                put(l.bias, ShardSpec(0, tp, blocks, whole=whole), path, "colwise")
        elif name in row:
            styles[path] = "rowwise"
            put(l.weight, ShardSpec(l.in_dim, tp), path, "rowwise")
            if l.bias:  # added once after the sum: whole on every rank
                uses.append(_Use(l.bias, path, "rowwise", None))
        elif name in vocab.lm_heads:
            styles[path] = "vocab"
            pad = padded_size(vocab_size, tp) if vocab_size % tp else None
            put(l.weight, ShardSpec(0, tp, pad_to=pad, size=vocab_size), path, "vocab")
            if l.bias:
                put(l.bias, ShardSpec(0, tp, pad_to=pad, size=vocab_size), path, "vocab")
        else:
            uses.extend(_Use(fqn, path, "replicate", None) for fqn in (l.weight, l.bias) if fqn)
            styles.setdefault(l.module_path, "replicate")
            if l.module_path not in dict(replicated):
                replicated.append((l.module_path, failures.get(name, "set to replicate" if name in excluded else
                                                               "consumes a replicated value with no column-parallel partner")))
    for e in g.embeds.values():
        if e in vocab.embeddings:
            styles[e.module_path] = "vocab"
            pad = padded_size(e.num_embeddings, tp) if e.num_embeddings % tp else None
            put(e.weight, ShardSpec(0, tp, pad_to=pad, size=e.num_embeddings), e.module_path, "vocab")
        else:
            uses.append(_Use(e.weight, e.module_path, "replicate", None))
            styles[e.module_path] = "replicate"
            replicated.append((e.module_path, "set to replicate" if g.forced.get(e.module_path) == "replicate"
                               else "its indices are not a model input (positions or types)"))
    return styles, specs, replicated, uses


# [Note: one parameter, two names]
# A parameter can be reachable under two names (an alias attribute ``self.b.weight =
# self.a.weight``, one submodule registered twice, tied embedding and LM head) and read by two
# linears or embeddings. It is ONE tensor on every rank, so its uses must agree: all sharded by
# the same ShardSpec (tied embedding and LM head both by vocabulary rows; one Linear called twice
# as a column both times), or all whole. When they disagree (a square weight row-parallel in one
# region and column-parallel in another, or sharded in one use and replicated in the other),
# every module reading it is set to replicate and the regions are found again without them
# (repeated until the uses agree: the set only grows); ``TPPlan.replicated`` names the parameter,
# its other names and the two uses. Without this, the last use's spec won for both and the other
# use crashed at run time with a shape error naming no node.


@dataclass(frozen=True)
class _Use:
    """One read of parameter ``fqn`` by the linear or embedding of module ``path`` with
    ``style``; ``spec`` None when that use keeps it whole."""

    fqn: str
    path: str
    style: str
    spec: ShardSpec | None


def _spec_key(spec: ShardSpec | None, ndim: int) -> Any:
    return None if spec is None else dataclasses.replace(spec, dim=spec.dim % ndim)


def _disagreeing_uses(g: _Graph, uses: list[_Use]) -> dict[str, str]:
    """Module path -> why it must stay whole, for every parameter whose uses disagree
    ([Note: one parameter, two names]); empty when they all agree. A user's override that
    shards such a module raises TPPlanError naming the parameter."""
    by_param: dict[tuple[str, ...], list[_Use]] = {}
    for u in uses:
        by_param.setdefault(g.aliases.get(u.fqn, (u.fqn,)), []).append(u)
    out: dict[str, str] = {}
    for names, group in by_param.items():
        ndim = resolve_path(g.gm, names[0]).dim()
        keys = {_spec_key(u.spec, ndim) for u in group}
        if len(keys) < 2:
            continue
        a = next(u for u in group if u.spec is not None)
        b = next(u for u in group if _spec_key(u.spec, ndim) != _spec_key(a.spec, ndim))

        def how(u: _Use) -> str:
            return (f"{u.path!r} ({u.style}) reads it as {u.fqn!r} and "
                    + ("keeps it whole" if u.spec is None else f"shards it on {_spec_str(u.spec)}"))

        also = [n for n in names if n != names[0]]
        why = (f"parameter {names[0]!r}{f' (also reachable as {also})' if also else ''} is one parameter "
               f"used in two ways: {how(a)}, {how(b)}; a parameter reachable under two names is sharded "
               "alike for every use or not at all, so every module reading it stays replicated (to shard "
               "them, give each use its own parameter, or make both uses agree)")
        for u in group:
            if g.forced.get(u.path) in ("colwise", "rowwise", "vocab"):
                raise TPPlanError(f"overrides: {u.path!r} is set to {g.forced[u.path]!r}, but {why}; set "
                                  f"{sorted({v.path for v in group})} to 'replicate' or to styles that agree")
            out.setdefault(u.path, why)
    return out


def _check_plan(g: _Graph, tp: int, styles: Mapping[str, str], replicated: list[tuple[str, str]],
                sharded_nodes: Mapping[str, ShardedValue]) -> None:
    """Every forced style honoured, and every sharded size divisible by t (else TPPlanError)."""
    for path, style in g.forced.items():
        if style in ("colwise", "rowwise", "vocab") and styles.get(path) != style:
            why = dict(replicated).get(path, f"found {styles.get(path)}")
            raise TPPlanError(f"overrides: {path!r} is set to {style!r} but the graph does not allow it: {why}")
    if tp > 1:
        for n, v in sharded_nodes.items():
            if v.size > 0 and v.size % tp:
                raise TPPlanError(divisibility_msg(g.nodes[n], tp, v.size, "a sharded value"))


def _grad_sums(gm, sharded_nodes, linears, specs, scattered) -> list[GradSum]:
    """``TPRewrite.grad_sums``: (sharded node, replicated operand) for every operand of a sharded
    node (linears aside: their weights are the sharded ones, their input gets the region's f)
    whose value carries a gradient (to a parameter or back into the shards) ([Note: partial
    gradients of replicated operands]); ``(node, "<module>")`` for a sharded call_module with
    trainable parameters of its own."""
    out: list[GradSum] = []
    grads = _carries_grad(gm)
    for node in gm.graph.nodes:
        if node.name not in sharded_nodes or node.name in linears:
            continue
        if node.op == "call_module" and any(p.requires_grad for p in gm.get_submodule(str(node.target)).parameters()):
            out.append(GradSum(node.name, "<module>"))
        for a in dict.fromkeys(node.all_input_nodes):
            if (a.name not in sharded_nodes and a.name in grads and (node.name, a.name) not in scattered
                    and not (a.op == "get_attr" and str(a.target) in specs)):
                out.append(GradSum(node.name, a.name))
    return out


# [Note: partial gradients of replicated operands] A sharded node (rank r computes the r-th 1/t
# of its output) that reads a replicated operand (a per-head norm's weight broadcast over the
# heads, a mask broadcast over heads, a statistic summed over the shards) gets, on rank r, only
# rank r's part of that operand's gradient: the rules admit a replicated operand only where it
# is broadcast over the sharded dim, so the full gradient is the sum over ranks. Megatron's f
# (identity forward, all-reduce backward) on the operand makes it so. The operand need not be a
# parameter read: Gemma 3 reads its q/k norm weight as ``1 + w.float()``, and a replicated
# activation (a learned gate, a statistic) needs the sum as much as a weight does. So f goes on
# every replicated operand whose value carries a gradient (:func:`_carries_grad`), one f per
# operand shared by its sharded readers; operands that carry none (rotary tables of a buffer,
# masks, sizes) get none. Operands read through ``scatter_to_region`` ([Note: scattered
# operands]) are left out: its backward all-gathers, the gradient is whole already.


_NO_GRAD = CREATION | METADATA | {"detach", "argmax", "argmin", "eq", "ne", "lt", "le", "gt", "ge", "sign"}


def _carries_grad(gm) -> set[str]:
    """Names of the nodes whose value has a gradient path to a trainable parameter, sharded or
    not, or to an input that requires grad (through any differentiable op; integer and boolean
    values, creation ops, metadata reads and ``detach`` carry none). A replicated value whose
    gradient flows back into sharded values (a statistic summed over the shards) needs the sum
    as much as one reaching a replicated weight."""
    trainable = {n for n, p in gm.named_parameters(remove_duplicate=False) if p.requires_grad}
    out: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            if str(node.target) in trainable:
                out.add(node.name)
            continue
        if node.op == "placeholder":
            if getattr(node.meta.get("val"), "requires_grad", False):
                out.add(node.name)
            continue
        if node.op == "output":
            continue
        val = node.meta.get("val")
        tensors = [v for v in (val if isinstance(val, (list, tuple)) else [val]) if isinstance(v, torch.Tensor)]
        if val is not None and (not tensors or not any(v.is_floating_point() or v.is_complex() for v in tensors)):
            continue
        if op_name(node, gm) in _NO_GRAD:
            continue
        own = node.op == "call_module" and any(
            p.requires_grad for p in gm.get_submodule(str(node.target)).parameters())
        if own or any(a.name in out for a in node.all_input_nodes):
            out.add(node.name)
    return out


def _reaches_output(node: torch.fx.Node) -> bool:
    """Whether a value is returned by the model, through views/casts only."""
    frontier, seen = [node], set()
    while frontier:
        n = frontier.pop()
        if n.name in seen:
            continue
        seen.add(n.name)
        for u in n.users:
            if u.op == "output":
                return True
            if op_name(u) in RESHAPES | {"to", "contiguous", "float", "slice", "alias", "getitem"}:
                frontier.append(u)
    return False
