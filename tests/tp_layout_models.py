"""Small hand-written attention/MLP blocks in the layouts tensor parallelism must shard
(tests/test_tp_rules_views.py): each a tiny classifier-free model mapping x (B, N, C) to y
(B, N, C), with a residual stream, so the loss is ``mse(model(x), target)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

C, H, HD, N, B = 32, 4, 8, 6, 2


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class ViTAttention(nn.Module):
    """timm: qkv(x).reshape(B, N, 3, heads, hd).permute(2, 0, 3, 1, 4); q, k, v = qkv.unbind(0)."""

    def __init__(self, heads=H):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
        attn = attn.softmax(dim=-1)
        y = (attn @ v).transpose(1, 2).reshape(b, n, c)
        return self.proj(y)


class NeoXAttention(nn.Module):
    """GPT-NeoX: the fused output viewed [B, N, heads, 3 * hd], q/k/v sliced off the last dim."""

    def __init__(self):
        super().__init__()
        self.query_key_value = nn.Linear(C, 3 * C)
        self.dense = nn.Linear(C, C)

    def forward(self, x):
        b, n, _ = x.shape
        qkv = self.query_key_value(x).view(b, n, H, 3 * HD)
        q = qkv[..., :HD].permute(0, 2, 1, 3)
        k = qkv[..., HD:2 * HD].permute(0, 2, 1, 3)
        v = qkv[..., 2 * HD:].permute(0, 2, 1, 3)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(y.permute(0, 2, 1, 3).reshape(b, n, C))


class GQASplitAttention(nn.Module):
    """[q heads | k heads | v heads] split by sizes; 4 query heads, 2 key/value heads."""

    def __init__(self, kv=2):
        super().__init__()
        self.kv = kv
        self.qkv = nn.Linear(C, C + 2 * kv * HD, bias=False)
        self.o = nn.Linear(C, C, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).split([C, self.kv * HD, self.kv * HD], dim=-1)
        q = q.view(b, n, H, HD).transpose(1, 2)
        k = k.view(b, n, self.kv, HD).transpose(1, 2).repeat_interleave(H // self.kv, dim=1)
        v = v.view(b, n, self.kv, HD).transpose(1, 2).repeat_interleave(H // self.kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, n, C))


class SlicedQKVAttention(GQASplitAttention):
    """Phi-3: [q heads | k heads | v heads] cut by slices of the fused output."""

    def forward(self, x):
        b, n, _ = x.shape
        qkv = self.qkv(x)
        kv = self.kv * HD
        q = qkv[..., :C].view(b, n, H, HD).transpose(1, 2)
        k = qkv[..., C:C + kv].view(b, n, self.kv, HD).transpose(1, 2).repeat_interleave(H // self.kv, dim=1)
        v = qkv[..., C + kv:].view(b, n, self.kv, HD).transpose(1, 2).repeat_interleave(H // self.kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, n, C))


class GQAGroupsAttention(nn.Module):
    """Falcon's new architecture: the fused output viewed [B, N, kv_groups, q_per_kv + 2, hd]."""

    def __init__(self, kv=2):
        super().__init__()
        self.kv = kv
        self.qkv = nn.Linear(C, C + 2 * kv * HD)
        self.o = nn.Linear(C, C)

    def forward(self, x):
        b, n, _ = x.shape
        per = H // self.kv
        qkv = self.qkv(x).view(b, n, self.kv, per + 2, HD)
        q = qkv[:, :, :, :per].reshape(b, n, H, HD).transpose(1, 2)
        k = qkv[:, :, :, per:per + 1].expand(b, n, self.kv, per, HD).reshape(b, n, H, HD).transpose(1, 2)
        v = qkv[:, :, :, per + 1:].expand(b, n, self.kv, per, HD).reshape(b, n, H, HD).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, n, C))


class QKNormRotaryAttention(nn.Module):
    """Separate q/k/v, per-head RMSNorm of q and k over head_dim (Qwen3), interleaved rotary
    (GPT-J: pairs rotated with stack + flatten)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(C, C), nn.Linear(C, C), nn.Linear(C, C)
        self.o = nn.Linear(C, C)
        self.q_norm = nn.Parameter(torch.rand(HD) + 0.5)
        self.k_norm = nn.Parameter(torch.rand(HD) + 0.5)
        inv = 1.0 / (10000 ** (torch.arange(0, HD, 2).float() / HD))
        ang = torch.arange(N).float()[:, None] * inv[None]
        self.register_buffer("cos", ang.cos().repeat_interleave(2, -1), persistent=False)
        self.register_buffer("sin", ang.sin().repeat_interleave(2, -1), persistent=False)

    @staticmethod
    def rotate_every_two(x):
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)

    def forward(self, x):
        b, n, _ = x.shape
        q = rms(self.q(x).view(b, n, H, HD), self.q_norm).transpose(1, 2)
        k = rms(self.k(x).view(b, n, H, HD), self.k_norm).transpose(1, 2)
        v = self.v(x).view(b, n, H, HD).transpose(1, 2)
        q = q * self.cos + self.rotate_every_two(q) * self.sin
        k = k * self.cos + self.rotate_every_two(k) * self.sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, n, C))


class GateUpMLP(nn.Module):
    """Phi-3: one fused gate_up projection, chunk(2) into gate and up, SwiGLU."""

    def __init__(self, hidden=64):
        super().__init__()
        self.gate_up = nn.Linear(C, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, C, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, attn: nn.Module, mlp: nn.Module | None = None):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.attn = attn
        self.mlp = mlp if mlp is not None else GateUpMLP()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


LAYOUTS = {
    "vit": lambda: Block(ViTAttention()),
    "neox": lambda: Block(NeoXAttention()),
    "gqa_split": lambda: Block(GQASplitAttention()),
    "gqa_sliced": lambda: Block(SlicedQKVAttention()),
    "gqa_groups": lambda: Block(GQAGroupsAttention()),
    "qknorm_rotary": lambda: Block(QKNormRotaryAttention()),
}


def make_layout(name: str, seed: int = 0):
    """(model, (x,), {}) for layout ``name``: two blocks, real random weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(LAYOUTS[name](), LAYOUTS[name]())
        x = torch.randn(B, N, C)
    return model, (x,), {}


# ------------------------------------------------------------------------------------------
# Hugging Face models with these layouts, from tiny configs (random weights)

TINY = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=32)

HF_CONFIGS = {
    # per-head q/k RMSNorm over head_dim
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(TINY, num_key_value_heads=2, head_dim=8)),
    # fused qkv split by sizes (qkv[..., :q] slices) and fused gate_up chunk(2)
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(TINY, num_key_value_heads=2, pad_token_id=0)),
    # fused qkv viewed [B, N, heads, 3 * hd]
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(TINY, rotary_pct=0.5)),
    # q/k norm over the whole projection (not per head): replicated with a reason
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", dict(TINY, num_key_value_heads=2)),
    # interleaved rotary (rotate_every_two with stack + flatten)
    "gptj": ("GPTJForCausalLM", "GPTJConfig", dict(vocab_size=128, n_embd=32, n_layer=2, n_head=4,
                                                   n_positions=32, rotary_dim=4, n_inner=64)),
    # fused qkv [kv_groups, q_per_kv + 2, hd] (new decoder architecture), parallel attention
    "falcon": ("FalconForCausalLM", "FalconConfig", dict(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                                         num_attention_heads=4, num_kv_heads=2,
                                                         new_decoder_architecture=True, bias=False,
                                                         max_position_embeddings=32)),
    # multi-query attention: c_attn [q heads | one k | one v]
    "gpt_bigcode": ("GPTBigCodeForCausalLM", "GPTBigCodeConfig", dict(vocab_size=128, n_embd=32, n_layer=2,
                                                                      n_head=4, n_positions=32, n_inner=64,
                                                                      multi_query=True)),
    "vit": ("ViTForImageClassification", "ViTConfig", dict(hidden_size=32, num_hidden_layers=2,
                                                           num_attention_heads=4, intermediate_size=64,
                                                           image_size=16, patch_size=8, num_labels=5)),
}


def make_hf_layout(name: str, seed: int = 0, **overrides):
    """(model, args, kwargs) for one of ``HF_CONFIGS``: dropout 0, no cache, sdpa attention;
    decoders get token ids (2, 8), the ViT pixel values (2, 3, 16, 16)."""
    import transformers

    model_cls, config_cls, cfg = HF_CONFIGS[name]
    cfg = dict(cfg, **overrides)
    cls = getattr(transformers, config_cls)
    known = set(cls().to_dict())
    for k in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
              "hidden_dropout_prob", "attention_probs_dropout_prob", "use_cache"):
        if k in known:
            cfg.setdefault(k, False if k == "use_cache" else 0.0)
    config = cls(**cfg)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_cls)(config)
        if name == "vit":
            args = (torch.randn(2, 3, 16, 16),)
        else:
            args = (torch.randint(0, 128, (2, 8)),)
    return model, args, {}
