"""Torch's attention modules traced as plain ops, so that tensor parallelism can shard them by heads.

Terms:
- **decomposed**: ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` and
  ``nn.TransformerEncoder`` traced through a forward of ours that computes what torch's own
  training path computes, from the same parameters (``self_attn.in_proj_weight``,
  ``self_attn.out_proj.weight``, ``linear1.weight``: the state dict is unchanged).
- **kept**: a call the decomposition does not cover (cross-attention, ``bias_k``,
  ``add_zero_attn``, separate q/k/v weights, an ``is_causal`` computed at run time):
  torch's module runs as it is (a ``call_module`` leaf under fx), and stays replicated under
  tensor parallelism; :attr:`Decomposition.kept` says where and why.

    with attention_as_ops(model) as dec:     # fx or export traces inside
        gm = ...
    dec.kept                                  # [(module path, why), ...]
    dec.not_leaves                            # ids of the modules fx must trace into

[Note: attention modules as ops]
torch.fx keeps every ``torch.nn`` module as a leaf, so an ``nn.TransformerEncoder`` is ONE
``call_module`` node: the planner sees no linear in it, nothing is sharded, and a pipeline stage
cannot cut inside it. Its own forward cannot be traced by fx either (mask canonicalization and the
fast-path checks branch on tensor dtypes and sizes), and torch.export traces
``F.multi_head_attention_forward``, whose ``q.view(L, B * H, hd)`` merges the batch into the heads,
which no sharding of the heads passes through. So while tracing (either frontend), the instances
whose class runs torch's own forward get ours (an instance attribute, removed afterwards) and fx
traces into them: the fused ``in_proj`` as one ``F.linear`` whose output is ``chunk(3)`` into q, k
and v (the planner shards it as blocks [q|k|v], each rank its own heads), heads by ``unflatten(-1,
(H, hd))`` in the batch-first layout, ``F.scaled_dot_product_attention`` with the masks merged as
``F.multi_head_attention_forward`` merges them (bool -> additive -inf; ``attn_mask`` [L, S] or
[B*H, L, S]; ``key_padding_mask`` [B, S]; ``is_causal`` dropping the mask exactly when torch does),
then ``out_proj`` (row-parallel). With ``need_weights=True`` (torch's default) the attention is
torch's explicit path (``softmax(q k^T / sqrt(hd) + mask)``, dropout, ``@ v``) and the weights
are returned as torch returns them (averaged over the heads unless ``average_attn_weights=False``);
an average nothing reads is erased after fx tracing (``Decomposition.prune``; export drops dead code
itself), and one that is read reduces over the heads, so the planner replicates that attention
and says why. The layer and the encoder are their training path (norm first or
last, dropout modules, activation), the encoder's data-dependent causal-mask detection replaced by
using the mask (the same numbers). The same forwards serve fx and export, so both graphs carry the
same ops. A call outside what is covered runs torch's module (a leaf call under fx, recorded with
its reason). The attention's own dropout (sdpa's ``dropout_p``) is read from ``module.training``
while tracing, as fx bakes ``F.dropout(x, p, self.training)`` in user code; the layer's dropout
modules stay modules (their mode is read at run time). Not the eval fast path: in eval with grad off, torch's nested-tensor encoder returns
zeros at padded positions, where this (its training path) returns the computed values.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

__all__ = ["Decomposition", "attention_as_ops", "decomposes"]


def _additive(mask: torch.Tensor | None, dtype: torch.dtype, name: str) -> torch.Tensor | None:
    """A mask as torch's ``F._canonical_mask`` makes it: bool -> 0 / -inf of ``dtype``; float as is."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))
    if not torch.is_floating_point(mask):
        raise AssertionError(f"only bool and floating types of {name} are supported")
    return mask


def _attention_mask(attn_mask: Any, key_padding_mask: Any, num_heads: int, dtype: torch.dtype) -> Any:
    """``attn_mask`` and ``key_padding_mask`` merged into one additive mask that broadcasts to
    [B, H, L, S], as ``F.multi_head_attention_forward`` merges them (its [B*H, L, S] laid out as
    [B, H, L, S]); a [L, S] mask stays [L, S] (or [B, 1, L, S] with the padding mask), one for every
    head, which is what lets the heads be sharded."""
    attn_mask = _additive(attn_mask, dtype, "attn_mask")
    key_padding_mask = _additive(key_padding_mask, dtype, "key_padding_mask")
    if attn_mask is not None and attn_mask.dim() == 3:
        attn_mask = attn_mask.unflatten(0, (-1, num_heads))
    if key_padding_mask is not None:
        kpm = key_padding_mask[:, None, None, :]
        attn_mask = kpm if attn_mask is None else attn_mask + kpm
    return attn_mask


torch.fx.wrap("_attention_mask")  # one call_function node under fx: its branches read dtypes and dims


@dataclass
class Decomposition:
    """What :func:`attention_as_ops` did: the modules fx traces into, and the calls kept whole."""

    not_leaves: frozenset[int] = frozenset()
    kept: list[tuple[str, str]] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)
    droppable: list[list[torch.fx.Node]] = field(default_factory=list)
    attention_paths: frozenset[str] = frozenset()

    def prune(self, gm: torch.fx.GraphModule) -> None:
        """Erase the attention-weight averages traced that nothing reads (``attn(x, x, x)[0]``
        with torch's default ``need_weights=True``): a mean over the heads would stop them being
        sharded. Only these: the nodes fx recorded for them, and under export the dead pure ATen
        ops whose innermost module is a decomposed attention; the rest of the graph is the user's."""
        doomed = {n for nodes in self.droppable for n in nodes}
        erased = False
        for n in reversed(list(gm.graph.nodes)):
            if n.users or n.op not in ("call_function", "call_method"):
                continue
            stack = n.meta.get("nn_module_stack") or {}
            inner = list(stack.values())[-1][0] if stack else None
            pure_aten = isinstance(n.target, torch._ops.OpOverload) and not n.target._schema.is_mutable
            if n in doomed or (inner in self.attention_paths and pure_aten):
                gm.graph.erase_node(n)
                erased = True
        if erased:
            gm.recompile()


def _keep(dec: Decomposition, mod: nn.Module, why: str, args: tuple, kwargs: dict) -> Any:
    """Run torch's own forward: a leaf ``call_module`` node under fx, a plain call otherwise."""
    path = dec.names.get(id(mod), "?")
    if (path, why) not in dec.kept:
        dec.kept.append((path, why))
    proxy = next((a for a in args if isinstance(a, torch.fx.Proxy)), None)
    if proxy is not None:
        tracer = proxy.tracer
        return tracer.create_proxy("call_module", tracer.path_of_module(mod), args, kwargs)
    return type(mod).forward(mod, *args, **kwargs)


def _is_tensor_3d(x: Any) -> bool:
    return isinstance(x, torch.fx.Proxy) or (isinstance(x, torch.Tensor) and x.dim() == 3)


def _mha_unsupported(mod: nn.MultiheadAttention, query, key, value, need_weights, attn_mask, is_causal) -> str:
    if not isinstance(need_weights, bool):
        return "need_weights computed at run time"
    if not (query is key and key is value):
        return "query, key and value are not one tensor (cross-attention)"
    if not mod._qkv_same_embed_dim or mod.in_proj_weight is None:
        return "separate q/k/v projection weights (kdim/vdim)"
    if mod.bias_k is not None or mod.add_zero_attn:
        return "bias_k/bias_v or add_zero_attn"
    if not isinstance(is_causal, bool):
        return "is_causal computed at run time"
    if is_causal and attn_mask is None:
        return "is_causal=True without attn_mask (torch raises)"
    if not _is_tensor_3d(query):
        return "unbatched input"
    return ""


def _mha_forward(dec: Decomposition, mod: nn.MultiheadAttention, query, key, value, key_padding_mask=None,
                 need_weights=True, attn_mask=None, average_attn_weights=True, is_causal=False):
    why = _mha_unsupported(mod, query, key, value, need_weights, attn_mask, is_causal)
    if why:
        kwargs = dict(key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
                      average_attn_weights=average_attn_weights, is_causal=is_causal)
        return _keep(dec, mod, why, (query, key, value), kwargs)
    heads, embed = mod.num_heads, mod.embed_dim
    x = query if mod.batch_first else query.transpose(0, 1)  # [B, L, E]
    q, k, v = F.linear(x, mod.in_proj_weight, mod.in_proj_bias).chunk(3, -1)
    q, k, v = (t.unflatten(-1, (heads, embed // heads)).transpose(1, 2) for t in (q, k, v))  # [B, H, L, hd]
    dropout_p = mod.dropout if mod.training else 0.0
    if (is_causal and key_padding_mask is None and not need_weights) or (attn_mask is None and key_padding_mask is None):
        mask = None  # no mask, or torch drops it: the causal hint is the mask
    else:
        mask, is_causal = _attention_mask(attn_mask, key_padding_mask, heads, query.dtype), False
    weights = None
    if need_weights:  # torch's explicit path: softmax(q k^T / sqrt(hd) + mask), dropout, @ v
        scores = (q * (1.0 / (embed // heads)) ** 0.5) @ k.transpose(-2, -1)
        w = (scores if mask is None else scores + mask).softmax(-1)
        if dropout_p > 0.0:
            w = F.dropout(w, p=dropout_p)
        out = w @ v
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
    out = mod.out_proj(out.transpose(1, 2).flatten(2))  # [B, L, E]
    if need_weights:
        graph = q.tracer.graph if isinstance(q, torch.fx.Proxy) else None
        before = len(graph.nodes) if graph is not None else 0
        weights = w.mean(1) if average_attn_weights else w
        if graph is not None:  # the average over heads, dropped after tracing when nothing reads it
            dec.droppable.append(list(graph.nodes)[before:])
    return (out if mod.batch_first else out.transpose(0, 1)), weights


def _layer_forward(dec: Decomposition, mod: nn.TransformerEncoderLayer, src, src_mask=None,
                   src_key_padding_mask=None, is_causal=False):
    """``nn.TransformerEncoderLayer.forward`` on its training path (the masks go to self_attn,
    which canonicalizes them)."""
    x = src
    if mod.norm_first:
        x = x + mod._sa_block(mod.norm1(x), src_mask, src_key_padding_mask, is_causal=is_causal)
        x = x + mod._ff_block(mod.norm2(x))
    else:
        x = mod.norm1(x + mod._sa_block(x, src_mask, src_key_padding_mask, is_causal=is_causal))
        x = mod.norm2(x + mod._ff_block(x))
    return x


def _encoder_forward(dec: Decomposition, mod: nn.TransformerEncoder, src, mask=None, src_key_padding_mask=None,
                     is_causal=None):
    """``nn.TransformerEncoder.forward`` on its training path; ``is_causal=None`` (torch compares
    the mask with a causal one) becomes False: the mask itself is applied, the same numbers."""
    if is_causal is not None and not isinstance(is_causal, bool):
        return _keep(dec, mod, "is_causal computed at run time", (src,),
                     dict(mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal))
    out = src
    for layer in mod.layers:
        out = layer(out, src_mask=mask, is_causal=bool(is_causal), src_key_padding_mask=src_key_padding_mask)
    if mod.norm is not None:
        out = mod.norm(out)
    return out


def _runs_torch_forward(mod: nn.Module, cls: type, methods: tuple[str, ...]) -> bool:
    return "forward" not in vars(mod) and all(getattr(type(mod), m) is getattr(cls, m) for m in methods)


_FORWARDS: tuple[tuple[type, tuple[str, ...], Any], ...] = (
    (nn.MultiheadAttention, ("forward",), _mha_forward),
    (nn.TransformerEncoderLayer, ("forward", "_sa_block", "_ff_block"), _layer_forward),
    (nn.TransformerEncoder, ("forward",), _encoder_forward),
)


def decomposes(model: nn.Module) -> bool:
    """Whether :func:`attention_as_ops` would run any module of ``model`` as ops (without it, a
    trace with ``decompose_attention=True`` is the trace without it)."""
    return any(isinstance(m, cls) and _runs_torch_forward(m, cls, methods)
               for m in model.modules() for cls, methods, _ in _FORWARDS)


@contextlib.contextmanager
def attention_as_ops(model: nn.Module, leaf: Any = None) -> Iterator[Decomposition]:
    """Within the block, torch's attention modules of ``model`` run the forwards of this module
    ([Note: attention modules as ops]); ``leaf(module, path)`` -> True skips a module (the user
    asked fx to keep it whole). Yields the :class:`Decomposition`; the model is restored on exit."""
    dec = Decomposition(names={id(m): n for n, m in model.named_modules()})
    patched = []
    for path, m in model.named_modules():
        for cls, methods, fwd in _FORWARDS:
            if isinstance(m, cls) and _runs_torch_forward(m, cls, methods) and not (leaf and leaf(m, path)):
                m.forward = types.MethodType(lambda self, *a, _f=fwd, **k: _f(dec, self, *a, **k), m)
                patched.append(m)
                break
    dec.not_leaves = frozenset(id(m) for m in patched)
    dec.attention_paths = frozenset(dec.names[id(m)] for m in patched if isinstance(m, nn.MultiheadAttention))
    try:
        yield dec
    finally:
        for m in patched:
            vars(m).pop("forward", None)
