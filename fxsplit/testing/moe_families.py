"""The mixture-of-experts families transformers ships, as tiny configs for the expert-parallel
coverage test (tests/test_expert_parallel_families.py) and the table in docs/training.md.

Terms: **family** -- a transformers model type with routed experts, built as its ``*ForCausalLM``
from ``FIELDS`` (hidden 32, 1 layer, 4 heads, 4 experts, top-2, vocabulary 256) plus the
family's own fields in ``FAMILIES`` (2 layers where the first is dense by the family's rule, so that
one MoE layer remains); the config's fields that a family does not have are left out,
so one dict serves every family.

    model, args, kwargs = build("olmoe")      # dropout 0, no cache, default experts implementation

``transformers`` is imported inside :func:`build`, so importing this module does not need it.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch
from torch import nn

__all__ = ["FAMILIES", "FIELDS", "SLOW", "build"]

FIELDS: dict[str, Any] = dict(
    vocab_size=256, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
    num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    first_k_dense_replace=0, n_group=1, topk_group=1, sliding_window=None, use_cache=False, bos_token_id=0,
    eos_token_id=0, pad_token_id=0)

# the gated-delta-rule layers' widths (32 heads of 128 by default, whatever the hidden size)
_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
# family -> its own fields (over FIELDS)
FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": {}, "qwen2_moe": {}, "qwen3_moe": {}, "olmoe": {}, "flex_olmo": {}, "granitemoe": {},
    "granitemoeshared": {}, "minimax": {}, "minimax_m2": {}, "glm4_moe": {}, "hunyuan_v1_moe": {},
    "jetmoe": {}, "llama4": {}, "solar_open": {}, "qwen3_5_moe": _LINEAR, "qwen3_next": _LINEAR,
    "ernie4_5_moe": dict(num_hidden_layers=2),  # moe_layer_start_index=1: layer 0 is dense
    "jamba": dict(expert_layer_offset=0, expert_layer_period=1),  # by default layer 0 has no experts
    "granitemoehybrid": dict(mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16),  # heads x head = 2 x hidden
    "nemotron_h": {},
    "phimoe": dict(router_jitter_noise=0.0, input_jitter_noise=0.0),  # the jitter draws random numbers
    "deepseek_v2": dict(head_dim=None, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8,
                        v_head_dim=8),
    "deepseek_v3": dict(head_dim=None, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
                        v_head_dim=8),
    "gpt_oss": dict(sliding_window=8),
    "dots1": dict(sliding_window=8, n_shared_experts=1),
    # first_k_dense_replace is fixed at 1: layer 0 is dense
    "glm4_moe_lite": dict(num_hidden_layers=2, head_dim=None, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16,
                          qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8),
    # num_layers=1: two attention / MLP sublayers (num_hidden_layers is 2 * num_layers); head_dim is the rotary dim
    "longcat_flash": dict(num_layers=1, head_dim=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16,
                          qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, ffn_hidden_size=64,
                          expert_ffn_hidden_size=32, zero_expert_num=2),
    "cohere2_moe": dict(sliding_window=8),
    "exaone_moe": dict(sliding_window=8),
    "lfm2_moe": dict(num_dense_layers=0, layer_types=["full_attention"]),
    "dbrx": dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=64, attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2)),
}
# families whose other layers (Mamba, gated delta rule) run their slow reference kernels on the CPU,
# left out of the suite's per-family test: 4 to 10 s each for the five layouts of
# benchmarks/moe_coverage.py at the sizes above (qwen3_next / qwen3_5_moe took 26 to 230 s before
# their gated-delta-rule widths were set, 2026-12-04)
SLOW = ("qwen3_5_moe", "qwen3_next", "jamba", "granitemoehybrid", "nemotron_h")
_ZERO = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout",
         "activation_dropout", "router_aux_loss_coef_dropout", "ffn_dropout")


def build(family: str, seed: int = 0, batch: int = 2) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """(model, args, kwargs) for ``family``: dropout 0, no cache, sdpa attention (eager where the
    model has none), random weights from ``seed``, token ids of ``batch`` x 16."""
    module = importlib.import_module(f"transformers.models.{family}")
    model_cls = next(getattr(module, n) for n in module.__all__ if n.endswith("ForCausalLM"))
    cls = model_cls.config_class
    known = set(inspect.signature(cls.__init__).parameters) | set(getattr(cls, "attribute_map", {})) \
        | set(cls().to_dict())
    fields = {**FIELDS, **FAMILIES[family]}
    cfg = {k: v for k, v in fields.items() if k in known and v is not None}
    cfg.update({k: 0.0 for k in _ZERO if k in known})
    config = cls(**cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config._attn_implementation = "sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager"
        model = model_cls(config)
    ids = torch.randint(2, 256, (batch, 16), generator=torch.Generator().manual_seed(seed + 1))
    return model, (ids,), {}
