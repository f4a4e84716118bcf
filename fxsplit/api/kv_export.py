"""The KV cache for graphs traced at a fixed sequence length (torch.export without
``dynamic_sequence``: the Hugging Face families): each stage's graph rewritten into a decode graph
that takes the new tokens, reads the keys and values cached on the rank, and builds its positions
and causal mask from the global position.

Terms
- **L**: the traced length; **T**: the positions a call adds (the prompt at prefill, then 1);
  **N**: the positions so far, cached ones included (past + T).
- **labels**: the dims of a value that hold the sequence (fxsplit.api.seq_dims).
- **mask region** of a stage: the nodes whose values reach an attention only through its
  ``attn_mask`` (positions compared, the model's attention mask indexed, a sliding window
  subtracted); **activation region**: every other node that depends on the sequence.
- slot, prefill, decode step: as in fxsplit.api.kv_cache.

Representative use (inside :func:`fxsplit.api.generate.generate`)::

    why = export_refusal(plan.stages.modules, plan, length=16, mask_input=1)   # None: exact
    dec = export_decode({s: runtime.modules[s] for s in held}, plan.stages.modules, plan, 16, 1)
    cache = KVCache(dec.modules, shapes=dec)      # the runtime reads dec.input_meta / dec.stage_input_meta

[Note: KV cache for exported graphs]
An exported graph holds the traced length L as literal ints (views ``[b, 16, -1, 16]``, the mask's
``expand([b, -1, 16, 16])``, ``arange(16)`` for the positions), so the rewrite first finds which
dims hold the sequence by following labels from ``input_ids`` through every stage (view groups,
transposes, reductions: fxsplit.api.seq_dims), then copies each stage's graph with:
- in the activation region, every shape entry of a labelled dim scaled from L to T (``16 -> T``,
  GPT-2's ``b * 16 -> b * T``; T read from the stage's first input that has a sequence dim), and
  each position ``arange(L)`` (rotary tables, absolute position embeddings) replaced by
  ``arange(past, past + T)``: :func:`fxsplit.api.kv_cache.cached_positions`;
- in the mask region, the same with N, and its position ``arange(L)`` by ``arange(0, N)``: the
  mask of every position so far, built by the graph's own ops (causal, sliding window, padding
  from the attention mask, packed sequences), of which the attention keeps the last T rows. The
  mask region may mix positions (a cumulative sum over positions): it runs over all of them.
  The model's attention mask is fed with N columns (ones), as Hugging Face's generate feeds it;
- each ``sdpa(q, k, v, mask)`` replaced by :func:`cached_masked_attention`, which appends k, v to
  the slot and attends over every cached position with those mask rows.
A node needed by both regions is copied once for each. The boundary values keep their planned
metas with L replaced by the symbols ``kv_new`` (T) and ``kv_all`` (N), which the runtime binds
from the inputs of each call (``input_ids`` has T columns, the attention mask N), so messages are
allocated at their decode shapes.
Exact because: outside attention (and the mask region, run over every position) the activation
region mixes no positions (checked: a reduction, softmax, cumsum or cat along a labelled dim, a
matmul contracting one, or a slice of positions is refused, naming the node), so each position's
values depend only on its token, its position and, through attention, the cached keys and
values, which are the ones the full sequence computes. Refused, with the node named, where the
labels cannot be followed, where the mask crosses a stage boundary, where an attention is not a
plain sdpa without dropout, or where a ``arange`` of another length could be a position.
A dim of size L that is not the sequence (a head size equal to the traced length) is told apart by
the labels, not by its size; a view that splits a merged (b * L) dim into two dims of size L picks
the later one (row-major order puts the sequence after the batch).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.nn.functional as F
from torch import fx, nn

from fxsplit.api.kv_cache import _SLOT, cached_positions
from fxsplit.api.seq_dims import SeqDims, SeqDimsError
from fxsplit.graph.ops import op_name, sdpa_arguments
from fxsplit.pipeline.stage import ValueMeta

__all__ = ["ExportDecode", "ExportGraphs", "all_positions", "cached_masked_attention", "export_decode",
           "export_graphs", "export_refusal", "kv_total"]

NEW = sympy.Symbol("kv_new", integer=True, positive=True)
ALL = sympy.Symbol("kv_all", integer=True, positive=True)
_SHAPE_ARG = {"view": 1, "reshape": 1, "_unsafe_view": 1, "expand": 1, "new_ones": 1, "new_zeros": 1,
              "new_full": 1, "new_empty": 1, "ones": 0, "zeros": 0, "full": 0, "empty": 0}
ACT, MASK = "act", "mask"


def kv_total(new: int) -> int:
    """N: the positions cached in the bound slot plus ``new`` (outside a slot, ``new``)."""
    slot = _SLOT.get()
    return new if slot is None else slot.past + new


def all_positions(total: int, **kwargs: Any) -> torch.Tensor:
    """``arange(0, N)``: every position so far, for the mask region."""
    return torch.arange(total, **kwargs)


def cached_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
                            is_causal: bool = False, scale: float | None = None,
                            enable_gqa: bool = False) -> torch.Tensor:
    """``sdpa(q, k, v, mask)`` over the cached keys and values followed by ``k``, ``v``; ``mask``
    is the mask of all N positions (N x N), of which the last T rows (this call's queries) apply."""
    slot = _SLOT.get()
    if slot is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    i, slot.seen, slot.new = slot.seen, slot.seen + 1, k.shape[-2]
    if i == len(slot.keys):
        slot.keys.append(k)
        slot.values.append(v)
        keys, values = k, v
    else:
        keys = slot.keys[i] = torch.cat([slot.keys[i], k], dim=-2)  # (b, h, past + T, hs)
        values = slot.values[i] = torch.cat([slot.values[i], v], dim=-2)
    t, n = q.shape[-2], keys.shape[-2]
    if mask is not None:
        mask = mask[..., n - t:, :]
    elif is_causal and n > t:  # query j (position n - t + j) sees keys 0..n - t + j
        mask = torch.ones(t, n, dtype=torch.bool, device=q.device).tril(n - t)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=is_causal and n == t,
                                          scale=scale, enable_gqa=enable_gqa)


@dataclass(frozen=True)
class ExportDecode:
    """The decode modules of the stages a rank holds, and the metas the runtime allocates and binds
    with during a cached call: the model inputs' and every stage's inputs', L replaced by the
    symbols ``kv_new`` / ``kv_all``."""

    modules: dict[int, nn.Module]
    input_meta: tuple[ValueMeta, ...]
    stage_input_meta: dict[int, tuple[ValueMeta, ...]]


def _is_sdpa(node: fx.Node, gm: nn.Module) -> bool:
    return node.op == "call_function" and op_name(node, gm) == "scaled_dot_product_attention"


def _needs(gm: fx.GraphModule) -> dict[fx.Node, set[str]]:
    """For each node, the regions ([Note: KV cache for exported graphs]) its value is needed in."""
    need: dict[fx.Node, set[str]] = {n: set() for n in gm.graph.nodes}
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "output":
            for x in node.all_input_nodes:
                need[x].add(ACT)
            continue
        if not need[node]:
            continue
        mask = sdpa_arguments(node).get("attn_mask") if _is_sdpa(node, gm) else None
        for x in node.all_input_nodes:
            need[x] |= {MASK} if x is mask else need[node]
    return need


def _mask_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    return {n for n, v in _needs(gm).items() if v == {MASK}}


def _labelled(labels: Any) -> bool:
    return any(_labelled(x) for x in labels) if isinstance(labels, tuple) else bool(labels)


def _seq_dims(graphs: Sequence[fx.GraphModule], input_meta: Sequence[ValueMeta], length: int) -> SeqDims:
    dims = SeqDims(length)
    for m in input_meta:
        if m.is_tensor and m.shape is not None and len(m.shape) >= 2 and m.shape[1] == length:
            dims.seed(m.name, frozenset({1}))
    for gm in graphs:
        masks = _mask_nodes(gm)
        dims.propagate(gm, mixing_ok=masks.__contains__)
    return dims


def _scaled(entry: Any, size: fx.Node, length: int, graph: fx.Graph, where: str) -> Any:
    if isinstance(entry, int):
        if entry == -1:
            return entry
        if entry == length:
            return size
        if entry % length == 0:
            return graph.call_function(operator.mul, (size, entry // length))
        raise SeqDimsError(f"{where}: shape entry {entry} of a sequence dim is not a multiple of L={length}")
    if isinstance(entry, fx.Node):
        return graph.call_function(operator.mul, (graph.call_function(operator.floordiv, (entry, length)), size))
    raise SeqDimsError(f"{where}: shape entry {entry!r} of a sequence dim")


class _Copy:
    """One stage's decode graph, built node by node ([Note: KV cache for exported graphs])."""

    def __init__(self, gm: fx.GraphModule, dims: SeqDims, length: int, model_inputs: set[str]):
        self.gm, self.dims, self.length, self.model_inputs = gm, dims, length, model_inputs
        self.graph = fx.Graph()
        self.env: dict[str, dict[fx.Node, Any]] = {ACT: {}, MASK: {}}
        self.size: dict[str, Any] = {}
        self.dep: set[fx.Node] = set()
        self.need = _needs(gm)
        self.kinds: dict[str, str] = {}
        self.source: dict[str, tuple[fx.Node, int]] = {}  # the input (and dim) each length is read from

    def build(self) -> fx.Graph:
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self._placeholder(node)
            elif node.op == "get_attr":
                new = self.graph.get_attr(node.target)
                new.meta = dict(node.meta)
                self.env[ACT][node] = self.env[MASK][node] = new
            elif node.op == "output":
                self.graph.output(fx.map_arg(node.args[0], self.env[ACT].__getitem__))
            elif self.need[node]:
                self._compute(node)
        self.graph.lint()
        return self.graph

    def _placeholder(self, node: fx.Node) -> None:
        new = self.graph.placeholder(node.name)
        new.meta = dict(node.meta)
        self.env[ACT][node] = self.env[MASK][node] = new
        labels = self.dims.of(node)
        if not _labelled(labels):
            return
        regions: set[str] = set()
        for user in node.users:  # a read of the batch size alone depends on no position
            if not (op_name(user, self.gm) == "sym_size" and user.args[1] not in labels):
                regions |= self.need[user]
        if not regions:
            return
        self.dep.add(node)
        if regions == {ACT, MASK}:
            raise SeqDimsError(f"input {node.name!r} is read both as a sequence of new tokens and by the "
                               "attention mask")
        kind = MASK if regions == {MASK} else ACT
        if kind == MASK and node.name not in self.model_inputs:
            raise SeqDimsError(f"input {node.name!r}: the attention mask crosses a stage boundary")
        self.kinds[node.name] = kind
        self.source.setdefault(kind, (new, min(labels)))

    def _sizes(self, region: str) -> fx.Node:
        if region not in self.size:
            if region in self.source:
                self.size[region] = self.graph.call_function(torch.ops.aten.sym_size.int, self.source[region])
            elif region == MASK:
                self.size[MASK] = self.graph.call_function(kv_total, (self._sizes(ACT),))
            else:
                raise SeqDimsError(f"no input of the stage gives the {region} length")
        return self.size[region]

    def _compute(self, node: fx.Node) -> None:
        name = op_name(node, self.gm)
        inputs_dep = any(x in self.dep for x in node.all_input_nodes)
        if name == "sym_size":
            inputs_dep = node.args[1] in self.dims.of(node.args[0])
        if _labelled(self.dims.of(node)) or inputs_dep:
            self.dep.add(node)
        else:  # independent of the sequence: one copy serves both regions
            new = self.graph.node_copy(node, self.env[ACT].__getitem__)
            self.env[ACT][node] = self.env[MASK][node] = new
            return
        for region in sorted(self.need[node]):
            self.env[region][node] = self._rewrite(node, name, region)

    def _rewrite(self, node: fx.Node, name: str, region: str) -> fx.Node:
        env = self.env[region]
        where = f"node {node.name!r} ({name})"
        if name == "scaled_dot_product_attention":
            new = self._attention(node, region, env, where)
            new.meta = dict(node.meta)
            return new
        args = fx.map_arg(node.args, env.__getitem__)
        kwargs = fx.map_arg(node.kwargs, env.__getitem__)
        if name == "arange" and self.dims.of(node):
            size = self._sizes(region)
            if region == ACT:
                new = self.graph.call_function(cached_positions, (0, size), dict(kwargs))
            else:
                new = self.graph.call_function(all_positions, (size,), dict(kwargs))
        elif name == "arange" and any(a == self.length for a in node.args):
            raise SeqDimsError(f"{where}: an arange of the traced length that is not a position table")
        elif name in _SHAPE_ARG and node.op == "call_function":
            labels = self.dims.of(node)
            i = _SHAPE_ARG[name]
            size_arg = list(args[i])
            for d in labels:
                size_arg[d] = _scaled(size_arg[d], self._sizes(region), self.length, self.graph, where)
            args = args[:i] + (size_arg,) + args[i + 1:]
            new = self.graph.create_node(node.op, node.target, args, kwargs)
        else:
            new = self.graph.create_node(node.op, node.target, args, kwargs)
        new.meta = dict(node.meta)
        return new

    def _attention(self, node: fx.Node, region: str, env: dict, where: str) -> fx.Node:
        given = sdpa_arguments(node)
        if region != ACT:
            raise SeqDimsError(f"{where}: an attention inside the mask region")
        if given.get("dropout_p", 0.0) not in (0, 0.0):
            raise SeqDimsError(f"{where}: attention with dropout_p={given.get('dropout_p')}")
        mask = given.get("attn_mask")
        causal = given.get("is_causal", False)
        if mask is None and causal is not True:
            raise SeqDimsError(f"{where}: an attention with neither a mask nor is_causal sees later positions")
        extra = {k: given[k] for k in ("scale", "enable_gqa") if k in given}
        q, k, v = (env[given[n]] for n in ("query", "key", "value"))
        return self.graph.call_function(cached_masked_attention,
                                        (q, k, v, None if mask is None else self.env[MASK][mask]),
                                        {"is_causal": bool(causal) and mask is None, **extra})


def _meta_at(meta: ValueMeta, labels: frozenset[int], symbol: sympy.Symbol, length: int) -> ValueMeta:
    shape = list(meta.shape)
    for d in labels:
        shape[d] = symbol if shape[d] == length else sympy.sympify(shape[d]) / length * symbol
    return ValueMeta(meta.name, True, tuple(shape), meta.dtype, meta.requires_grad, meta.dim_order)


def _analyse(graphs: Sequence[fx.GraphModule], input_meta: Sequence[ValueMeta], length: int,
             ) -> tuple[SeqDims, list[fx.Graph], list[dict[str, str]]]:
    dims = _seq_dims(graphs, input_meta, length)
    names = {m.name for m in input_meta}
    built, kinds = [], []
    found = False
    for s, gm in enumerate(graphs):
        copy = _Copy(gm, dims, length, names)
        try:
            built.append(copy.build())
        except SeqDimsError as exc:
            raise SeqDimsError(f"stage {s}: {exc}") from None
        kinds.append(copy.kinds)
        found |= any(_is_sdpa(n, gm) for n in gm.graph.nodes)
    if not found:
        raise SeqDimsError("no attention found in the plan's graphs")
    return dims, built, kinds


def export_refusal(graphs: Sequence[fx.GraphModule], input_meta: Sequence[ValueMeta], length: int) -> str | None:
    """None when [Note: KV cache for exported graphs] is exact for the stage ``graphs`` traced at
    ``length``, else one line saying why not (naming the stage and node)."""
    try:
        _analyse(graphs, input_meta, length)
    except SeqDimsError as exc:
        return f"{exc} (graph traced by torch.export at {length} tokens)"
    return None


@dataclass(frozen=True)
class ExportGraphs:
    """Every stage's decode graph (no parameters yet: :meth:`on` puts a rank's stages under them)
    and the metas of a cached call, as :class:`ExportDecode` holds them."""

    graphs: tuple[fx.Graph, ...]
    input_meta: tuple[ValueMeta, ...]
    stage_input_meta: dict[int, tuple[ValueMeta, ...]]

    def on(self, held: Mapping[int, nn.Module]) -> ExportDecode:
        """The decode modules of the ``held`` stages, on their own parameters (what each graph's
        ``get_attr`` reads now), with these metas."""
        modules = {s: fx.GraphModule(mod, _copied(self.graphs[s]), class_name="DecodeStage")
                   for s, mod in held.items()}
        return ExportDecode(modules, self.input_meta, self.stage_input_meta)


def _copied(graph: fx.Graph) -> fx.Graph:
    # a graph belongs to one GraphModule; the kept one stays unowned for the next rebuild
    new = fx.Graph()
    new.output(new.graph_copy(graph, {}))
    return new


def export_graphs(graphs: Sequence[fx.GraphModule], io: Sequence[Any], input_meta: Sequence[ValueMeta], length: int,
                  *, mask_input: int | None) -> ExportGraphs:
    """Every stage's decode graph and the metas of a cached call; ``graphs``: every stage's graph
    (labels flow from the first stage), ``io``: the plan's StageIO per stage; ``mask_input``: the
    index of the attention mask among the model inputs. Raises SeqDimsError where
    :func:`export_refusal` says why not."""
    dims, built, _ = _analyse(graphs, input_meta, length)
    metas = []
    for i, m in enumerate(input_meta):
        labels = dims.by_name(m.name)
        metas.append(_meta_at(m, labels, ALL if i == mask_input else NEW, length) if labels else m)
    stage_metas = {}
    for s in range(len(io)):  # every stage: a sender reads the metas of the stage it sends to
        ins = []
        for src, m in zip(io[s].inputs, io[s].input_meta):
            if src.stage is None:
                ins.append(metas[src.index])
                continue
            labels = dims.by_name(m.name)
            ins.append(_meta_at(m, labels, NEW, length) if m.is_tensor and labels else m)
        stage_metas[s] = tuple(ins)
    return ExportGraphs(tuple(built), tuple(metas), stage_metas)


def export_decode(held: Mapping[int, nn.Module], graphs: Sequence[fx.GraphModule], io: Sequence[Any],
                  input_meta: Sequence[ValueMeta], length: int, *, mask_input: int | None) -> ExportDecode:
    """The decode modules of the ``held`` stages (on their own parameters) and the metas of a
    cached call (:func:`export_graphs`, then :meth:`ExportGraphs.on`)."""
    return export_graphs(graphs, io, input_meta, length, mask_input=mask_input).on(held)
