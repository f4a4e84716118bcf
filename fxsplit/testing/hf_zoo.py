"""Tiny Hugging Face transformers models built from configs (random weights), and a meta-device
Llama-70B for planning without memory.

Terms:
    example: ``(model, example_args, example_kwargs)``; ``model(*example_args, **example_kwargs)``
        runs as is and returns a transformers ``ModelOutput`` (a registered pytree) whose only
        entry is ``logits`` (B, T, V) because ``use_cache=False`` (see below).
    tiny: hidden 64, 2 layers, 4 heads, vocab 256, intermediate 128; inputs batch 2, seq 16.

Representative use::

    model, args, kwargs = fxsplit.testing.hf_zoo.tiny_llama(num_hidden_layers=4)
    ep = torch.export.export(model, args, kwargs, strict=False)

``overrides`` are config fields (``hidden_size=128``) plus ``seed``, ``batch_size``, ``seq_len``
and ``attn_implementation``. ``transformers`` is imported inside the functions, so importing
fxsplit does not need it.

Findings (torch 2.13, transformers 5.24; each checked by tests/test_zoo.py):
    * ``torch.export.export(model, args, kwargs, strict=False)`` accepts GPT-2, Llama, BERT,
      Qwen2 and Mistral built from these configs, with attention "eager" and "sdpa", and the
      exported module reproduces the logits exactly.
    * The decoder models need ``use_cache=False``: with the cache on, forward returns a
      ``DynamicCache`` in ``past_key_values``, which is not a registered pytree type, so export
      fails ("Found <class 'transformers.cache_utils.DynamicCache'> in output, which is not a
      known type"). BERT exports either way (no cache returned by ``BertForMaskedLM``).
    * ``torch.fx.symbolic_trace`` does not work on transformers 5 models (transformers 5 has no
      fx tracer of its own); use export.
    * An ``attention_mask`` with padding (the examples pad the end of the second row) exports
      too: the 2D integer mask becomes a graph input that the mask-building code reads.
    * Dropout probabilities are 0 in every config, so train mode (the default after building;
      ``model.eval()`` is not called) is deterministic.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from fxsplit.errors import ArgumentTypeError, UsageError

__all__ = [
    "HF_ZOO_NAMES",
    "make_hf",
    "tiny_gpt2",
    "tiny_llama",
    "tiny_bert",
    "tiny_qwen2",
    "tiny_mistral",
    "meta_llama_70b",
    "llama_70b_config",
]

Example = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]

_TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=128, max_position_embeddings=64)


def _example_inputs(vocab_size: int, batch_size: int, seq_len: int, seed: int,
                    device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, T) and an int64 attention mask (B, T) whose second row ends in padding."""
    if str(device) == "meta":
        return (torch.empty(batch_size, seq_len, dtype=torch.long, device="meta"),
                torch.empty(batch_size, seq_len, dtype=torch.long, device="meta"))
    g = torch.Generator().manual_seed(seed + 1)
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)
    mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    if batch_size > 1:
        mask[1, seq_len - max(1, seq_len // 4):] = 0
    return input_ids, mask


def _build(model_cls_name: str, config_cls_name: str, config: dict[str, Any], overrides: dict[str, Any]) -> Example:
    import transformers

    seed = overrides.pop("seed", 0)
    batch_size = overrides.pop("batch_size", 2)
    seq_len = overrides.pop("seq_len", 16)
    attn = overrides.pop("attn_implementation", "sdpa")
    config = {**config, **overrides}
    config_cls = getattr(transformers, config_cls_name)
    # Configs accept and store any keyword, so a misspelt field would pass silently: check.
    known = (set(inspect.signature(config_cls.__init__).parameters)
             | set(getattr(config_cls, "attribute_map", {})) | set(config_cls().to_dict()))
    unknown = sorted(k for k in overrides if k not in known)
    if unknown:
        raise ArgumentTypeError(f"{config_cls_name} has no field(s) {unknown}; check the spelling "
                                f"against transformers.{config_cls_name}")
    cfg = config_cls(**config)
    cfg._attn_implementation = attn
    max_pos = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if max_pos is not None and seq_len > max_pos:
        raise UsageError(f"{model_cls_name}: seq_len={seq_len} exceeds the config's "
                         f"{max_pos} positions; pass max_position_embeddings (n_positions for GPT-2)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_cls_name)(cfg)
    input_ids, mask = _example_inputs(cfg.vocab_size, batch_size, seq_len, seed)
    return model, (input_ids,), {"attention_mask": mask}


def tiny_gpt2(**overrides: Any) -> Example:
    """``GPT2LMHeadModel``: learned positions, GELU MLP, ``Conv1D`` projections (weight stored
    [in, out]), ``lm_head`` tied to ``transformer.wte``."""
    cfg = dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=64,
               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
               bos_token_id=0, eos_token_id=0)
    return _build("GPT2LMHeadModel", "GPT2Config", cfg, dict(overrides))


def tiny_llama(**overrides: Any) -> Example:
    """``LlamaForCausalLM``: RMSNorm, RoPE, SwiGLU, grouped-query attention (4 query heads,
    2 key/value heads), untied ``lm_head``."""
    cfg = dict(_TINY, num_key_value_heads=2, attention_dropout=0.0, use_cache=False,
               bos_token_id=0, eos_token_id=0)
    return _build("LlamaForCausalLM", "LlamaConfig", cfg, dict(overrides))


def tiny_mixtral(**overrides: Any) -> Example:
    """``MixtralForCausalLM``: Llama's attention with a mixture of experts in place of its MLP (4
    SwiGLU experts, top-2 softmax router, transformers' default ``grouped_mm`` experts, which
    expert parallelism places: ``fxsplit.tp.moe``)."""
    cfg = dict(_TINY, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
               attention_dropout=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    return _build("MixtralForCausalLM", "MixtralConfig", cfg, dict(overrides))


def tiny_bert(**overrides: Any) -> Example:
    """``BertForMaskedLM``: bidirectional encoder, post-LayerNorm, the MLM decoder tied to the
    word embeddings. (``token_type_ids`` are left out: all zeros.)"""
    cfg = dict(_TINY, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, use_cache=False)
    return _build("BertForMaskedLM", "BertConfig", cfg, dict(overrides))


def tiny_qwen2(**overrides: Any) -> Example:
    """``Qwen2ForCausalLM``: like Llama with biases on q, k, v; GQA 4/2 heads."""
    cfg = dict(_TINY, num_key_value_heads=2, attention_dropout=0.0, use_cache=False,
               bos_token_id=0, eos_token_id=0)
    return _build("Qwen2ForCausalLM", "Qwen2Config", cfg, dict(overrides))


def tiny_mistral(**overrides: Any) -> Example:
    """``MistralForCausalLM``: Llama-like, GQA 4/2 heads; ``sliding_window=None`` (full causal)."""
    cfg = dict(_TINY, num_key_value_heads=2, attention_dropout=0.0, use_cache=False,
               sliding_window=None, bos_token_id=0, eos_token_id=0)
    return _build("MistralForCausalLM", "MistralConfig", cfg, dict(overrides))


_HF_BUILDERS = {
    "gpt2": tiny_gpt2,
    "llama": tiny_llama,
    "bert": tiny_bert,
    "qwen2": tiny_qwen2,
    "mistral": tiny_mistral,
}
HF_ZOO_NAMES: tuple[str, ...] = tuple(_HF_BUILDERS)


def make_hf(name: str, **overrides: Any) -> Example:
    """Build tiny Hugging Face model ``name`` (one of ``HF_ZOO_NAMES``) with its example inputs."""
    try:
        builder = _HF_BUILDERS[name]
    except KeyError:
        raise UsageError(f"unknown HF zoo model {name!r}; choose one of {', '.join(HF_ZOO_NAMES)}") from None
    return builder(**overrides)


def llama_70b_config(*, vocab_size: int = 32000, **overrides: Any):
    """A ``LlamaConfig`` shaped like Llama-2-70B (vocab 32000; pass 128256 for Llama-3-70B):
    hidden 8192, 80 layers, 64 heads, 8 key/value heads, intermediate 28672, ``use_cache=False``,
    attention "sdpa". About 69.0e9 parameters (70.6e9 with vocab 128256)."""
    import transformers

    cfg = dict(vocab_size=vocab_size, hidden_size=8192, intermediate_size=28672,
               num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
               max_position_embeddings=8192 if vocab_size == 128256 else 4096,
               rms_norm_eps=1e-5, tie_word_embeddings=False, use_cache=False,
               attention_dropout=0.0, bos_token_id=1, eos_token_id=2)
    cfg.update(overrides)
    config = transformers.LlamaConfig(**cfg)
    config._attn_implementation = "sdpa"
    return config


def meta_llama_70b(*, seq_len: int = 4096, batch_size: int = 1, vocab_size: int = 32000,
                   dtype: torch.dtype = torch.bfloat16, **overrides: Any) -> Example:
    """A 70B-parameter ``LlamaForCausalLM`` on the meta device, with meta example inputs
    ``input_ids`` (batch_size, seq_len) int64 and ``attention_mask`` (same shape, int64).

    Nothing is allocated: parameters, buffers and inputs are meta tensors (shapes and dtypes
    only), so this builds in about a second and is meant for tracing, cost models and
    partition plans. Export of it (``torch.export.export(..., strict=False)``) works on meta
    tensors (16 to 26 s and under 0.5 GB peak on a 2-core CPU machine). Note the RoPE ``inv_freq`` buffer
    is a meta tensor too: the model cannot produce numbers until real weights are loaded.
    ``overrides`` are ``LlamaConfig`` fields (e.g. ``num_hidden_layers=2`` for a quick test).
    """
    import transformers

    config = llama_70b_config(vocab_size=vocab_size, **overrides)
    if seq_len > config.max_position_embeddings:
        raise UsageError(f"meta_llama_70b: seq_len={seq_len} exceeds max_position_embeddings="
                         f"{config.max_position_embeddings}; pass max_position_embeddings=...")
    config.dtype = dtype
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    input_ids, mask = _example_inputs(vocab_size, batch_size, seq_len, 0, device="meta")
    return model, (input_ids,), {"attention_mask": mask}
