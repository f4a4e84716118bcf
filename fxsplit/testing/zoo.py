"""Small reference models for trying and testing fxsplit.

Terms:
    B, T, C, V: batch, sequence length, embedding width, vocabulary size.
    nh, nkv, hs: query heads, key/value heads, head size (C == nh * hs).
    example inputs: ``(example_args, example_kwargs)``, the inputs a builder returns with its
        model so that ``model(*example_args, **example_kwargs)`` runs as is.

Representative use::

    model, args, kwargs = fxsplit.testing.zoo.make("gpt", n_layer=2, fused_qkv=True, seed=0)
    logits = model(*args, **kwargs)                      # (B, T, V)
    loss = cross_entropy_loss(logits, make_target("gpt", logits))

Every model here is plain PyTorch, traceable by ``torch.fx.symbolic_trace`` (no Python control
flow on tensor values; shapes are read with ``B, T = idx.shape`` and used in ``view``) and
exportable with ``torch.export.export(model, args, kwargs, strict=False)``. Each one exercises a
case a graph splitter must get right:

    ============  ==========================================================================
    name          what it exercises
    ============  ==========================================================================
    mlp           the simplest chain of layers
    gpt           transformer blocks, tied weights (``wte``/``lm_head``), optional fused qkv,
                  grouped-query attention and SwiGLU; ``dropout`` / ``attn_dropout`` (default 0)
    cnn           convolutions with residual blocks, GroupNorm, global pooling
    unet          skip connections crossing several blocks (encoder -> matching decoder)
    kwargs        keyword arguments, an integer attention mask and integer position ids used
                  by every layer (non-float tensors crossing stages), a float keyword argument
    skip          the output of layer 0 added after the last layer (a skip crossing every
                  stage) and a non-tensor value (a shape) computed first and used last
    layout        an attention block returning ``(att @ v).transpose(1, 2)`` (no
                  ``.contiguous()``) and a next block whose ``.view`` is valid only on those
                  strides: a boundary value that must cross in its own layout
                  ([Note: boundary layouts] in ``fxsplit.pipeline.layout``); split at ``mix``
    moe           a mixture of experts (torchtitan's grouped experts: softmax router, top-k,
                  tokens sorted by expert, fused 3-D expert weights run as grouped matmuls,
                  an optional shared expert; :mod:`fxsplit.testing.zoo_moe`)
    alias         parameters reachable under two names: one Linear registered twice and used
                  as a column both times (sharded alike), and a square weight aliased as the
                  row half of one MLP and the column half of the next (left whole under TP)
                  ([Note: one parameter, two names] in ``fxsplit.tp.plan``)
    ============  ==========================================================================

Builders are deterministic: ``make(name, seed=s)`` twice gives identical weights and inputs,
and the caller's global RNG state is left untouched (``torch.random.fork_rng``). All models
have no dropout by default and no BatchNorm (running statistics would differ between a whole
batch and its microbatches), so a split model can be compared with the unsplit one exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from fxsplit.errors import ArgumentTypeError, UsageError
from fxsplit.testing.zoo_identity import AliasedParamModel, TransposedBoundaryModel

__all__ = [
    "MLP",
    "GPT",
    "GPTConfig",
    "ResidualCNN",
    "UNet",
    "KwargsModel",
    "SkipModel",
    "TransposedBoundaryModel",
    "AliasedParamModel",
    "ZOO_NAMES",
    "make",
    "make_mlp",
    "make_gpt",
    "make_cnn",
    "make_unet",
    "make_kwargs_model",
    "make_skip_model",
    "make_layout_model",
    "make_alias_model",
    "make_target",
    "loss_fn",
    "cross_entropy_loss",
    "mse_loss",
]

Example = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]


# ---------------------------------------------------------------------------------------------
# MLP
# ---------------------------------------------------------------------------------------------


class MLP(nn.Module):
    """Linear layers with GELU between them (none after the last): ``layers.{i}`` are Linear."""

    def __init__(self, sizes: tuple[int, ...] = (32, 64, 64, 32)):
        super().__init__()
        if len(sizes) < 2:
            raise UsageError(f"MLP needs at least an input and an output size, got sizes={sizes!r}")
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, sizes[0]) -> (B, sizes[-1])
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:  # structural (loop index), not data dependent
                x = self.act(x)
        return x


# ---------------------------------------------------------------------------------------------
# GPT (nanoGPT style)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 128  # V
    block_size: int = 32  # longest sequence (size of the position table)
    n_layer: int = 4
    n_head: int = 4  # nh, query heads
    n_kv_head: int | None = None  # nkv; None = n_head; fewer = grouped-query attention
    n_embd: int = 32  # C
    fused_qkv: bool = False  # one `qkv` Linear instead of `q`, `k`, `v`
    tie_weights: bool = True  # lm_head.weight IS wte.weight (the same Parameter)
    bias: bool = True  # bias in Linear layers and LayerNorms
    dropout: float = 0.0  # embedding and residual dropout; keep 0.0 to compare split and unsplit models exactly
    attn_dropout: float = 0.0  # dropout on the attention probabilities (> 0: explicit softmax attention)
    mlp: str = "gelu"  # "gelu": up/down; "swiglu": gate/up/down

    def __post_init__(self) -> None:
        kv = self.kv_heads
        if self.n_embd % self.n_head != 0:
            raise UsageError(
                f"GPTConfig: n_embd={self.n_embd} must be divisible by n_head={self.n_head}; "
                "change one of them"
            )
        if kv < 1 or self.n_head % kv != 0:
            raise UsageError(
                f"GPTConfig: n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}; "
                "use a divisor of n_head (or None for plain multi-head attention)"
            )
        if self.mlp not in ("gelu", "swiglu"):
            raise UsageError(f"GPTConfig: mlp={self.mlp!r} must be 'gelu' or 'swiglu'")

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head


class CausalSelfAttention(nn.Module):
    """Causal self-attention; ``q``, ``k``, ``v`` (or fused ``qkv``) and ``proj`` Linears.

    Uses ``F.scaled_dot_product_attention(is_causal=True)``, which both fx and export trace.
    Grouped-query attention repeats each key/value head ``nh // nkv`` times with
    ``repeat_interleave`` on the head dimension, so query head h reads key/value head
    ``h // (nh // nkv)`` (contiguous groups: a tensor-parallel split by heads keeps groups whole).
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_size = cfg.n_head, cfg.kv_heads, cfg.head_size
        q_dim, kv_dim = cfg.n_head * cfg.head_size, cfg.kv_heads * cfg.head_size
        self.fused_qkv = cfg.fused_qkv
        if cfg.fused_qkv:
            self.qkv = nn.Linear(cfg.n_embd, q_dim + 2 * kv_dim, bias=cfg.bias)
        else:
            self.q = nn.Linear(cfg.n_embd, q_dim, bias=cfg.bias)
            self.k = nn.Linear(cfg.n_embd, kv_dim, bias=cfg.bias)
            self.v = nn.Linear(cfg.n_embd, kv_dim, bias=cfg.bias)
        self.proj = nn.Linear(q_dim, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.explicit = cfg.attn_dropout > 0
        if self.explicit:
            self.attn_drop = nn.Dropout(cfg.attn_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        nh, nkv, hs = self.n_head, self.n_kv_head, self.head_size
        if self.fused_qkv:
            q, k, v = self.qkv(x).split([nh * hs, nkv * hs, nkv * hs], dim=2)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        if nkv != nh:
            k = k.repeat_interleave(nh // nkv, dim=1)  # (B, nh, T, hs)
            v = v.repeat_interleave(nh // nkv, dim=1)
        if self.explicit:  # the probabilities are materialized for their dropout
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, T, T)
            pos = torch.arange(T, device=x.device)
            causal = pos.unsqueeze(0) <= pos.unsqueeze(1)  # (T, T): key j <= query i
            att = att.masked_fill(~causal, float("-inf"))
            att = self.attn_drop(F.softmax(att, dim=-1))
            y = att @ v  # (B, nh, T, hs)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, nh * hs)  # (B, T, C)
        return self.resid_drop(self.proj(y))


class GPTMLP(nn.Module):
    """``down(gelu(up(x)))`` or, for SwiGLU, ``down(silu(gate(x)) * up(x))``; hidden 4C."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        hidden = 4 * cfg.n_embd
        self.swiglu = cfg.mlp == "swiglu"
        if self.swiglu:
            self.gate = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        self.up = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        self.down = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        if self.swiglu:
            h = F.silu(self.gate(x)) * self.up(x)  # (B, T, 4C)
        else:
            h = F.gelu(self.up(x))  # (B, T, 4C)
        return self.drop(self.down(h))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = GPTMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    """A small decoder-only transformer: ``forward(idx: (B, T) int64) -> logits (B, T, V)``.

    Modules: ``wte``, ``wpe``, ``blocks.{i}.ln1``, ``blocks.{i}.attn.{q,k,v | qkv, proj}``,
    ``blocks.{i}.ln2``, ``blocks.{i}.mlp.{up, down[, gate]}``, ``ln_f``, ``lm_head``. With
    ``tie_weights`` the parameter ``lm_head.weight`` is the same object as ``wte.weight``
    (``named_parameters()`` lists it once, as ``wte.weight``).
    """

    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(_init_gpt_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return self.lm_head(x)  # (B, T, V)


def _init_gpt_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


# ---------------------------------------------------------------------------------------------
# ResidualCNN
# ---------------------------------------------------------------------------------------------


class ResBlock(nn.Module):
    """``relu(x + norm2(conv2(relu(norm1(conv1(x))))))``; GroupNorm, not BatchNorm (see module doc)."""

    def __init__(self, channels: int, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm1 = nn.GroupNorm(groups, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, ch, H, W)
        h = F.relu(self.norm1(self.conv1(x)))
        h = self.norm2(self.conv2(h))
        return F.relu(x + h)


class ResidualCNN(nn.Module):
    """``forward(x: (B, in_ch, H, W)) -> (B, num_classes)``: stem conv, residual blocks, pool, head.

    Modules: ``stem``, ``stem_norm``, ``blocks.{i}.{conv1,norm1,conv2,norm2}``, ``head``.
    """

    def __init__(self, in_channels: int = 3, channels: int = 16, num_blocks: int = 3,
                 num_classes: int = 10, groups: int = 4):
        super().__init__()
        self.stem = nn.Conv2d(in_channels, channels, 3, padding=1)
        self.stem_norm = nn.GroupNorm(groups, channels)
        self.blocks = nn.ModuleList(ResBlock(channels, groups) for _ in range(num_blocks))
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem_norm(self.stem(x)))  # (B, ch, H, W)
        for block in self.blocks:
            x = block(x)
        x = x.mean(dim=(2, 3))  # global average pooling: (B, ch)
        return self.head(x)  # (B, num_classes)


# ---------------------------------------------------------------------------------------------
# UNet
# ---------------------------------------------------------------------------------------------


class ConvBlock(nn.Module):
    """Two 3x3 convolutions, each followed by GroupNorm and SiLU: ``(B, c_in, H, W) -> (B, c_out, H, W)``."""

    def __init__(self, c_in: int, c_out: int, groups: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm1 = nn.GroupNorm(groups, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.norm1(self.conv1(x)))
        return F.silu(self.norm2(self.conv2(x)))


class UNet(nn.Module):
    """A 2D U-Net: ``forward(x: (B, in_ch, H, W)) -> (B, out_ch, H, W)``, H and W divisible by 2**depth.

    Encoder ``down.{i}`` (ConvBlock then 2x2 average pooling), ``mid``, decoder: ``upsample.{j}``
    (2x2 transposed convolution, stride 2), concatenation with the matching encoder output,
    ``up.{j}`` (ConvBlock); ``out`` (1x1 conv). The output of ``down.0`` is read by the last
    decoder block, so that skip value crosses every block between them. (Upsampling is a
    transposed convolution rather than ``F.interpolate``: fake-tensor propagation of
    ``F.interpolate`` specialises the batch size to the example's, which would make a traced
    plan static in the batch.)
    """

    def __init__(self, in_channels: int = 3, out_channels: int = 3, base: int = 8, depth: int = 2):
        super().__init__()
        widths = [base * 2**i for i in range(depth + 1)]  # e.g. [8, 16, 32]
        self.down = nn.ModuleList(
            ConvBlock(in_channels if i == 0 else widths[i - 1], widths[i]) for i in range(depth)
        )
        self.mid = ConvBlock(widths[depth - 1], widths[depth])
        # up.j handles level i = depth-1-j: input widths[i+1] upsampled, concat widths[i] skip
        self.upsample = nn.ModuleList(
            nn.ConvTranspose2d(widths[i + 1], widths[i + 1], 2, stride=2) for i in reversed(range(depth))
        )
        self.up = nn.ModuleList(
            ConvBlock(widths[i + 1] + widths[i], widths[i]) for i in reversed(range(depth))
        )
        self.out = nn.Conv2d(widths[0], out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)  # (B, w_i, H_i, W_i)
            skips.append(x)
            x = F.avg_pool2d(x, 2)  # (B, w_i, H_i/2, W_i/2)
        x = self.mid(x)  # (B, w_depth, H/2**depth, W/2**depth)
        for upsample, block in zip(self.upsample, self.up):
            skip = skips.pop()  # (B, w_i, H_i, W_i)
            x = upsample(x)  # (B, w_{i+1}, H_i, W_i)
            x = block(torch.cat([x, skip], dim=1))  # (B, w_i, H_i, W_i)
        return self.out(x)  # (B, out_ch, H, W)


# ---------------------------------------------------------------------------------------------
# KwargsModel
# ---------------------------------------------------------------------------------------------


class RotaryMaskedAttention(nn.Module):
    """Bidirectional attention with rotary position embedding and a padding mask.

    Reads the integer ``position_ids`` (B, T) and ``attention_mask`` (B, T) (1 = attend,
    0 = padding) itself, so a split model has to carry those integer tensors to every stage.
    Padding is an additive -1e9 (not -inf and not a bool mask), so a fully padded row stays
    finite.
    """

    def __init__(self, dim: int, n_head: int):
        super().__init__()
        self.n_head, self.head_size = n_head, dim // n_head
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        half = self.head_size // 2
        self.register_buffer("inv_freq", 1.0 / (10000.0 ** (torch.arange(half).float() / half)),
                             persistent=False)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)  # x: (B, nh, T, hs); cos, sin: (B, 1, T, hs/2)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, self.head_size).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_size).transpose(1, 2)
        angles = position_ids[:, None, :, None].to(x.dtype) * self.inv_freq  # (B, 1, T, hs/2)
        cos, sin = angles.cos(), angles.sin()
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        pad = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -1e9  # (B, 1, 1, T)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=pad)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class KwargsBlock(nn.Module):
    def __init__(self, dim: int, n_head: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = RotaryMaskedAttention(dim, n_head)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, attention_mask, position_ids):
        x = x + self.attn(self.ln1(x), attention_mask, position_ids)
        return x + self.mlp(self.ln2(x))


class KwargsModel(nn.Module):
    """An encoder taking keyword arguments: ``forward(input_ids, attention_mask=None,
    position_ids=None, scale=1.0) -> logits (B, T, V) * scale``.

    ``attention_mask`` (B, T) int64, 1 = token, 0 = padding; ``position_ids`` (B, T) int64.
    Both are read by every block. When left out they default to all ones and ``arange(T)``;
    those ``is None`` branches are Python on arguments, so a traced graph (fx or export) is
    specialised to the way it was traced: ``torch.fx.symbolic_trace`` takes every argument as
    given (the tensor branch), and the example kwargs from ``make("kwargs")`` pass all of them.
    """

    def __init__(self, vocab_size: int = 128, dim: int = 32, n_head: int = 4, n_layer: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(KwargsBlock(dim, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        B, T = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, T, dtype=torch.long, device=input_ids.device)
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)[None, :].expand(B, T)
        x = self.embed(input_ids)  # (B, T, C)
        for block in self.blocks:
            x = block(x, attention_mask, position_ids)
        return self.head(self.ln_f(x)) * scale  # (B, T, V)


# ---------------------------------------------------------------------------------------------
# SkipModel
# ---------------------------------------------------------------------------------------------


class SkipModel(nn.Module):
    """``forward(x: (B, dim)) -> (B, out_dim)``: a skip connection across all layers, plus a
    non-tensor value that crosses the stages.

    ``h0 = layers.0(x)``; the rest of ``layers`` run on it; then ``h = h + h0`` (the skip from
    layer 0 to after the last layer) and the output is ``head(h) * d ** -0.5`` where
    ``d = x.shape[-1]`` is read at the very start. Under ``torch.fx.symbolic_trace`` ``d`` is a
    graph value (``getattr``/``getitem`` nodes, an int, not a tensor) used after any split point;
    under export it is a constant.
    """

    def __init__(self, dim: int = 32, n_layer: int = 6, out_dim: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_layer))
        self.head = nn.Linear(dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]  # non-tensor, used at the end
        h0 = torch.tanh(self.layers[0](x))  # (B, dim)
        h = h0
        for layer in self.layers[1:]:
            h = torch.tanh(layer(h))
        h = h + h0  # skip from layer 0
        return self.head(h) * d ** -0.5  # (B, out_dim)


# ---------------------------------------------------------------------------------------------
# Builders and registry
# ---------------------------------------------------------------------------------------------


def _seeded(seed: int, build: Callable[[torch.Generator], Example]) -> Example:
    """Run ``build`` with the global RNG seeded (for weight init) without disturbing the caller."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(seed + 1)
        return build(gen)


def make_mlp(*, seed: int = 0, batch_size: int = 4, sizes: tuple[int, ...] = (32, 64, 64, 32)) -> Example:
    """MLP and an input ``x: (batch_size, sizes[0])``."""
    return _seeded(seed, lambda g: (MLP(tuple(sizes)), (torch.randn(batch_size, sizes[0], generator=g),), {}))


def make_gpt(*, seed: int = 0, batch_size: int = 2, seq_len: int = 16, **config: Any) -> Example:
    """GPT from ``GPTConfig(**config)`` and ``idx: (batch_size, seq_len)`` token ids."""
    cfg = GPTConfig(**config)
    if seq_len > cfg.block_size:
        raise UsageError(f"make_gpt: seq_len={seq_len} exceeds block_size={cfg.block_size}; "
                         "pass a larger block_size or a shorter seq_len")

    def build(g: torch.Generator) -> Example:
        model = GPT(cfg)
        return model, (torch.randint(0, cfg.vocab_size, (batch_size, seq_len), generator=g),), {}

    return _seeded(seed, build)


def make_cnn(*, seed: int = 0, batch_size: int = 2, image_size: int = 16, **kwargs: Any) -> Example:
    """ResidualCNN(**kwargs) and an input image batch ``(batch_size, in_channels, S, S)``."""
    def build(g: torch.Generator) -> Example:
        model = ResidualCNN(**kwargs)
        c = model.stem.in_channels
        return model, (torch.randn(batch_size, c, image_size, image_size, generator=g),), {}

    return _seeded(seed, build)


def make_unet(*, seed: int = 0, batch_size: int = 2, image_size: int = 16, **kwargs: Any) -> Example:
    """UNet(**kwargs) and an input ``(batch_size, in_channels, S, S)``, S divisible by 2**depth."""
    depth = kwargs.get("depth", 2)
    if image_size % 2**depth != 0:
        raise UsageError(f"make_unet: image_size={image_size} must be divisible by 2**depth={2**depth}")

    def build(g: torch.Generator) -> Example:
        model = UNet(**kwargs)
        c = model.down[0].conv1.in_channels
        return model, (torch.randn(batch_size, c, image_size, image_size, generator=g),), {}

    return _seeded(seed, build)


def make_kwargs_model(*, seed: int = 0, batch_size: int = 2, seq_len: int = 12, **kwargs: Any) -> Example:
    """KwargsModel(**kwargs), ``args=(input_ids,)`` and kwargs ``attention_mask`` (the second
    row's last quarter is padding), ``position_ids`` (arange per row) and ``scale=0.5``."""
    def build(g: torch.Generator) -> Example:
        model = KwargsModel(**kwargs)
        vocab = model.embed.num_embeddings
        input_ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
        mask = torch.ones(batch_size, seq_len, dtype=torch.long)
        if batch_size > 1:
            mask[1, seq_len - max(1, seq_len // 4):] = 0
        pos = torch.arange(seq_len)[None, :].repeat(batch_size, 1)
        return model, (input_ids,), {"attention_mask": mask, "position_ids": pos, "scale": 0.5}

    return _seeded(seed, build)


def make_skip_model(*, seed: int = 0, batch_size: int = 4, **kwargs: Any) -> Example:
    """SkipModel(**kwargs) and an input ``x: (batch_size, dim)``."""
    def build(g: torch.Generator) -> Example:
        model = SkipModel(**kwargs)
        dim = model.layers[0].in_features
        return model, (torch.randn(batch_size, dim, generator=g),), {}

    return _seeded(seed, build)


def make_layout_model(*, seed: int = 0, batch_size: int = 4, seq_len: int = 6, **kwargs: Any) -> Example:
    """TransposedBoundaryModel(**kwargs) and an input ``x: (batch_size, seq_len, dim)``."""
    def build(g: torch.Generator) -> Example:
        model = TransposedBoundaryModel(**kwargs)
        return model, (torch.randn(batch_size, seq_len, model.head.in_features, generator=g),), {}

    return _seeded(seed, build)


def make_alias_model(*, seed: int = 0, batch_size: int = 2, seq_len: int = 4, **kwargs: Any) -> Example:
    """AliasedParamModel(**kwargs) and an input ``x: (batch_size, seq_len, dim)``."""
    def build(g: torch.Generator) -> Example:
        model = AliasedParamModel(**kwargs)
        return model, (torch.randn(batch_size, seq_len, model.down1.out_features, generator=g),), {}

    return _seeded(seed, build)


def make_moe(*, seed: int = 0, batch_size: int = 4, seq_len: int = 8, **config: Any) -> Example:
    """MoEGPT from ``MoEConfig(**config)`` and ``idx: (batch_size, seq_len)`` token ids."""
    from fxsplit.testing.zoo_moe import MoEConfig, MoEGPT

    cfg = MoEConfig(**config)
    return _seeded(seed, lambda g: (MoEGPT(cfg), (torch.randint(0, cfg.vocab_size, (batch_size, seq_len), generator=g),), {}))


_BUILDERS: dict[str, Callable[..., Example]] = {
    "mlp": make_mlp,
    "gpt": make_gpt,
    "cnn": make_cnn,
    "unet": make_unet,
    "kwargs": make_kwargs_model,
    "skip": make_skip_model,
    "layout": make_layout_model,
    "alias": make_alias_model,
    "moe": make_moe,
}
ZOO_NAMES: tuple[str, ...] = tuple(_BUILDERS)
_LM_NAMES = frozenset({"gpt", "kwargs", "moe"})


def make(name: str, **overrides: Any) -> Example:
    """Build zoo model ``name`` and its example inputs: ``(model, example_args, example_kwargs)``.

    ``overrides`` go to the builder: ``seed``, ``batch_size``, sizes such as ``seq_len`` /
    ``image_size``, and the model's own constructor or config fields (``make("gpt", n_layer=2,
    fused_qkv=True)``). Same name and overrides give identical weights and inputs.
    """
    try:
        builder = _BUILDERS[name]
    except KeyError:
        raise UsageError(f"unknown zoo model {name!r}; choose one of {', '.join(ZOO_NAMES)}") from None
    try:
        return builder(**overrides)
    except TypeError as e:
        raise ArgumentTypeError(f"make({name!r}, ...): bad override in {sorted(overrides)}: {e}") from e


# ---------------------------------------------------------------------------------------------
# Losses and targets
# ---------------------------------------------------------------------------------------------


def cross_entropy_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy: logits (B, T, V), target (B, T) int64 -> scalar."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error; target has the output's shape."""
    return F.mse_loss(output, target)


def loss_fn(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss to train zoo model ``name`` with: cross-entropy for language models, else MSE."""
    if name not in _BUILDERS:
        raise UsageError(f"unknown zoo model {name!r}; choose one of {', '.join(ZOO_NAMES)}")
    return cross_entropy_loss if name in _LM_NAMES else mse_loss


def make_target(name: str, output: torch.Tensor, *, seed: int = 0) -> torch.Tensor:
    """A deterministic target for ``loss_fn(name)(output, target)``: token ids (B, T) in
    ``[0, V)`` for language models, else a standard normal tensor shaped like ``output``."""
    g = torch.Generator().manual_seed(seed + 2)
    if loss_fn(name) is cross_entropy_loss:
        return torch.randint(0, output.shape[-1], tuple(output.shape[:-1]), generator=g)
    return torch.randn(tuple(output.shape), generator=g, dtype=output.dtype)

