"""The KV cache's decode graphs kept per model, so that a second :meth:`ParallelModel.generate`
builds none.

Terms
- **decode graphs**: the stage graphs a cached call runs (fxsplit.api.kv_cache's
  ``decode_module`` for a symbolic sequence, fxsplit.api.kv_export's rewrite for a graph traced at
  a fixed length), with, for the latter, the metas of a cached call.
- **reads** of a decode module: the objects its ``get_attr`` and ``call_module`` nodes resolve to
  in the stage module it was built on (parameters, buffers, constants, leaf modules).

Representative use (inside :mod:`fxsplit.api.generate`)::

    why = export_refusal_kept(pm, length)      # None: the export cache is exact (analysed once)
    cache = kv_cache_kept(pm, length, mask)    # a fresh KVCache over kept decode modules

[Note: decode graphs kept per model]
Building the decode graphs is the cost of a cached call's first token (the export rewrite follows
the sequence dims through every stage: fxsplit.api.seq_dims), and they depend only on the plan's
stage graphs, the traced length and which input is the attention mask. So they are built at the
first cached ``generate`` of a model and kept beside it (a weak map keyed by the ParallelModel;
an entry is rebuilt if the plan's stage graphs are no longer the ones it was built from), with
the refusal (one analysis answers both "is it exact" and "the graphs"). A decode module refers to
the tensors its ``get_attr`` nodes read when it is built (``fx.GraphModule`` copies those
references), and FSDP swaps a stage's parameter objects between sharded and gathered from call to
call; so a kept module is reused only while every object it reads is the one its stage module
holds now (checked by identity at each call), else it is rebuilt on them from the kept graph, with
no analysis. The KVCache itself (the slots) is new for every call. The metas of a cached call are
the same objects from call to call, and the runtime keys the symbol bindings of a call by the
metas it binds with (fxsplit.runtime.executor), so two overrides with different shapes and the
same input shapes never share an entry.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import fx, nn

from fxsplit.api.kv_cache import KVCache, decode_module
from fxsplit.api.kv_export import ExportDecode, ExportGraphs, export_graphs
from fxsplit.api.seq_dims import SeqDimsError
from fxsplit.errors import UsageError

__all__ = ["export_refusal_kept", "kv_cache_kept"]


@dataclass
class _Kept:
    """One model's decode graphs: by (traced length, mask input), the export graphs and metas (or
    the refusal); by (that key, stage), the stage module, what its decode module reads, the module."""

    graphs: tuple[fx.GraphModule, ...]  # the plan's stage graphs these were built from
    export: dict[tuple[int, int | None], ExportGraphs | str] = field(default_factory=dict)
    modules: dict[tuple[Any, int], tuple[nn.Module, tuple, nn.Module]] = field(default_factory=dict)


_KEPT: weakref.WeakKeyDictionary[Any, _Kept] = weakref.WeakKeyDictionary()


def _kept(pm: Any) -> _Kept:
    graphs = tuple(pm.plan.stages.modules)
    kept = _KEPT.get(pm)
    if kept is None or len(kept.graphs) != len(graphs) or any(a is not b for a, b in zip(kept.graphs, graphs)):
        kept = _KEPT[pm] = _Kept(graphs)
    return kept


def _analysis(pm: Any, length: int, mask_input: int | None) -> ExportGraphs | str:
    kept = _kept(pm)
    key = (length, mask_input)
    if key not in kept.export:
        try:
            kept.export[key] = export_graphs(pm.plan.stages.modules, pm.runtime.io, pm.plan.stages.input_meta,
                                             length, mask_input=mask_input)
        except SeqDimsError as exc:
            kept.export[key] = f"{exc} (graph traced by torch.export at {length} tokens)"
    return kept.export[key]


def export_refusal_kept(pm: Any, length: int, mask_input: int | None) -> str | None:
    """``export_refusal`` of ``pm``'s plan traced at ``length``, analysed once per model (the
    graphs kept for :func:`kv_cache_kept`, a refusal kept as well)."""
    found = _analysis(pm, length, mask_input)
    return found if isinstance(found, str) else None


def _reads(module: nn.Module, graph: fx.Graph) -> tuple:
    out = []
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            obj: Any = module
            for part in str(node.target).split("."):
                obj = getattr(obj, part, None)
            out.append(obj)
    return tuple(out)


def _module(kept: _Kept, key: Any, stage: int, source: nn.Module, build: Callable[[], nn.Module]) -> nn.Module:
    """The kept decode module of ``stage`` for ``key`` while it reads what ``source`` holds now,
    else a new one ([Note: decode graphs kept per model])."""
    have = kept.modules.get((key, stage))
    if have is not None and have[0] is source:
        now = _reads(source, have[2].graph)
        if len(now) == len(have[1]) and all(a is b for a, b in zip(now, have[1])):
            return have[2]
    built = build()
    kept.modules[(key, stage)] = (source, _reads(source, built.graph), built)
    return built


def kv_cache_kept(pm: Any, length: int | None, mask_input: int | None) -> KVCache:
    """A KVCache of one call over the stages this rank holds, on kept decode modules: [Note:
    generation with a KV cache] for a graph with a symbolic sequence (``length`` None), [Note:
    KV cache for exported graphs] for one traced at ``length``."""
    runtime, kept = pm.runtime, _kept(pm)
    held: Mapping[int, nn.Module] = runtime.modules
    if length is None:
        return KVCache({s: _module(kept, "symbolic", s, g, lambda g=g: decode_module(g)) for s, g in held.items()})
    found = _analysis(pm, length, mask_input)
    if isinstance(found, str):  # generate asks export_refusal_kept first: it then recomputes instead
        raise UsageError(f"generate(): the KV cache is not exact for this plan: {found}; pass use_cache=False")
    modules = {s: _module(kept, (length, mask_input), s, mod, lambda s=s, mod=mod: found.on({s: mod}).modules[s])
               for s, mod in held.items()}
    return KVCache(modules, shapes=ExportDecode(modules, found.input_meta, found.stage_input_meta))
