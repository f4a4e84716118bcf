"""A key/value cache for :meth:`ParallelModel.generate`: prefill once over the prompt, then decode
steps of one token whose attention reads the keys and values cached on the rank.

Terms
- **slot**: the cache of one (stage, microbatch): the keys and values of each attention of the
  stage, (b, heads on this tp rank, positions so far, head size), and the positions so far.
- **prefill**: the first step, over the whole prompt; **decode step**: one token per row.
- **decode module**: a stage's graph rewritten by :func:`decode_module` (the same parameters).

Representative use (inside :func:`fxsplit.api.generate.generate`)::

    why = cache_refusal(pm.plan, feed)                  # None: the cache is exact for this plan
    cache = KVCache({s: decode_module(runtime.modules[s]) for s in runtime.modules})
    runtime.forward(inputs, microbatches=m, override=cache)   # prefill, then one token per call

[Note: generation with a KV cache]
Which option, and why: of the two ways (a decode graph per stage from a graph pass, or
Hugging Face's own cache run eagerly on the original modules), only the graph pass works at
tp > 1, where the stages are rewritten graphs and the original modules are not what a rank runs;
so it is the graph pass, in its simplest exact form. Rather than new stage inputs and outputs (a
second communication plan), the cache stays beside the stage as state of the call: each
attention ``sdpa(q, k, v, is_causal=True)`` becomes :func:`cached_attention`, which appends this
step's ``k`` and ``v`` to the slot the runtime binds for the (stage, microbatch) it runs
(``PipelineRuntime.forward(override=...)`` or ``run_program``) and attends over all of them; each position table
lookup ``arange(0, T)`` becomes :func:`cached_positions`, offset by the positions cached. The
stage's boundary values keep their planned symbolic shapes, with T = 1 in a decode step, so the
runtime allocates and orders messages as for any forward. Rows of a microbatch are the same at
every step (the split is by rows), so a slot always serves the same sequences.
Exact because: attention is the only op of these graphs that reads other positions, causal
attention of a position over positions 0..t is what a one-query ``sdpa`` without the causal flag
computes over the cached keys (top-left causal alignment would be wrong for one query over many
keys, hence the flag is dropped rather than kept), and the positions a row's tokens get are the
ones the full sequence gives them. Tokens equal the recompute path's; logits agree to rounding
(a one-query kernel sums in another order than the last row of a full one).
:func:`cache_refusal` says, in one line, why a plan cannot take this path, and generate then
recomputes ([Note: generation by recompute] in fxsplit.api.generate): an attention that is not a
causal ``sdpa`` without mask or dropout (explicit softmax attention; Hugging Face's masks), an
``arange`` that feeds anything but an embedding (rotary tables, masks built in the graph), an
attention mask among the inputs, or compiled stages. A sequence the trace fixed (torch.export
without ``dynamic_sequence``: every view holds T) takes fxsplit.api.kv_export's rewrite instead
([Note: KV cache for exported graphs]), which handles rotary tables and built masks too. Ops that mix positions other than attention
(a cumulative sum, a mean over the sequence) are not detected: such a model is not a causal
language model this module serves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from fxsplit.graph.ops import op_name, sdpa_arguments

__all__ = ["KVCache", "cache_refusal", "cached_attention", "cached_positions", "decode_module", "stage_refusal"]

_EMBEDDINGS = ("embedding", "vocab_parallel_embedding", "module:Embedding")


@dataclass
class _Slot:
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    past: int = 0  # positions cached before this call
    seen: int = 0  # attentions run in this call
    new: int = 0  # positions this call adds (from its attentions or position lookups)


_SLOT: ContextVar[_Slot | None] = ContextVar("fxsplit_kv_slot", default=None)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                     enable_gqa: bool = False) -> torch.Tensor:
    """``sdpa(q, k, v, is_causal=True)`` over the cached keys and values followed by ``k``, ``v``
    ([Note: generation with a KV cache]); outside a slot, exactly that sdpa."""
    slot = _SLOT.get()
    if slot is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    i, slot.seen, slot.new = slot.seen, slot.seen + 1, k.shape[-2]
    if i == len(slot.keys):  # prefill: the first call of this slot
        slot.keys.append(k)
        slot.values.append(v)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    keys = slot.keys[i] = torch.cat([slot.keys[i], k], dim=-2)  # (b, h, past + T, hs)
    values = slot.values[i] = torch.cat([slot.values[i], v], dim=-2)
    t, past = q.shape[-2], keys.shape[-2] - k.shape[-2]
    # query j (position past + j) sees keys 0..past + j: causal aligned bottom-right
    mask = None if t == 1 else torch.ones(t, past + t, dtype=torch.bool, device=q.device).tril(past)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


def cached_positions(start: Any, end: Any, **kwargs: Any) -> torch.Tensor:
    """``torch.arange(start, end)`` shifted by the positions cached in the bound slot."""
    slot = _SLOT.get()
    if slot is None:
        return torch.arange(start, end, **kwargs)
    slot.new = end - start  # a stage without attention (embeddings alone) still counts its positions
    return torch.arange(start + slot.past, end + slot.past, **kwargs)


class KVCache:
    """The slots of one generate call and the decode modules they run with: what
    ``PipelineRuntime.forward(override=...)`` reads (``modules``, ``context(stage, microbatch)`` and
    ``shapes``: None, or the metas of a graph traced at a fixed length, fxsplit.api.kv_export)."""

    def __init__(self, modules: Mapping[int, nn.Module], *, shapes: Any = None):
        self.modules = dict(modules)
        self.shapes = shapes  # the metas of a cached call where they differ from the plan's (kv_export)
        self._slots: dict[tuple[int, int], _Slot] = {}

    @contextlib.contextmanager
    def context(self, stage: int, microbatch: int) -> Iterator[None]:
        slot = self._slots.setdefault((stage, microbatch), _Slot())
        slot.seen = slot.new = 0
        token = _SLOT.set(slot)
        try:
            yield
        finally:
            _SLOT.reset(token)
            slot.past += slot.new


def _arange_bounds(node: fx.Node) -> tuple[Any, Any] | None:
    """(start, end) of ``arange(end)`` or ``arange(start, end)``; None for a step or bounds given
    by keyword (left to the recompute path)."""
    if any(k in node.kwargs for k in ("start", "end", "step")) or not 1 <= len(node.args) <= 2:
        return None
    return (0, node.args[0]) if len(node.args) == 1 else (node.args[0], node.args[1])


def _sdpa_parts(node: fx.Node) -> tuple[dict[str, Any], dict[str, Any]]:
    given = sdpa_arguments(node)
    return given, {k: given[k] for k in ("scale", "enable_gqa") if k in given}


def _attention_refusal(node: fx.Node) -> str | None:
    given, _ = _sdpa_parts(node)
    if given.get("attn_mask") is not None or given.get("dropout_p", 0.0) != 0.0 or given.get("is_causal") is not True:
        return (f"attention node {node.name!r} is not sdpa(is_causal=True) without a mask or dropout "
                f"(attn_mask={given.get('attn_mask')}, dropout_p={given.get('dropout_p', 0.0)}, "
                f"is_causal={given.get('is_causal', False)})")
    return None


def stage_refusal(stage: int, gm: fx.GraphModule) -> str | None:
    """None when :func:`decode_module` of ``gm`` (stage ``stage``) is exact, else why not."""
    for node in gm.graph.nodes:
        name = op_name(node, gm) if node.op in ("call_function", "call_method", "call_module") else ""
        if name == "scaled_dot_product_attention":
            why = _attention_refusal(node)
        elif name in ("softmax", "module:Softmax"):
            why = f"node {node.name!r} is a softmax (explicit attention: the cache covers sdpa only)"
        elif name == "arange":
            bad = [u.name for u in node.users if op_name(u, gm) not in _EMBEDDINGS]
            why = (f"arange node {node.name!r} feeds {bad}, not a position embedding (the cache offsets "
                   "positions only where they index a table)") if bad else None
            if why is None and _arange_bounds(node) is None:
                why = f"arange node {node.name!r} has a step or keyword bounds ({node.args}, {dict(node.kwargs)})"
        else:
            why = None
        if why:
            return f"stage {stage}: {why}"
    return None


def cache_refusal(plan: Any, *, traced_length: int | None, mask_input: bool, compiled: bool) -> str | None:
    """None when the KV cache is exact for every stage of ``plan`` ([Note: generation with a KV
    cache]), else one line saying why generate recomputes instead."""
    if compiled:
        return "the stages are compiled (parallelize(compile=True)); the cache runs uncompiled graphs only"
    if traced_length is not None:
        return (f"torch.export fixed the sequence at {traced_length} tokens, so a one-token step cannot run; "
                "plan with dynamic_sequence=True")
    if mask_input:
        return "the model takes an attention mask, which a one-token step would have to extend"
    modules = plan.stages.modules
    found = False
    for s in range(len(modules)):
        why = stage_refusal(s, modules[s])
        if why:
            return why
        found |= any(op_name(n, modules[s]) == "scaled_dot_product_attention" for n in modules[s].graph.nodes)
    return None if found else "no attention found in the plan's graphs"


def decode_module(module: fx.GraphModule) -> fx.GraphModule:
    """A stage's graph with each causal sdpa as :func:`cached_attention` and each ``arange`` as
    :func:`cached_positions`, on the same parameters (built per call, after FSDP gathers them)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(module.graph, env)
    graph.output(out)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        name = op_name(node, module)
        if name == "scaled_dot_product_attention":
            given, extra = _sdpa_parts(node)
            with graph.inserting_before(node):
                new = graph.call_function(cached_attention, (given["query"], given["key"], given["value"]), extra)
        elif name == "arange":
            with graph.inserting_before(node):
                new = graph.call_function(cached_positions, _arange_bounds(node), dict(node.kwargs))
        else:
            continue
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    graph.lint()
    return fx.GraphModule(module, graph, class_name="DecodeStage")

