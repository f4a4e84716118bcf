"""A mixture-of-experts GPT in torchtitan's grouped-experts form, registered in
:mod:`fxsplit.testing.zoo` as ``moe``.

Terms: **E** -- routed experts; **k** -- experts per token (top-k); **N** -- tokens (B * T);
**S** -- routed rows (N * k); **offs** -- the end row of each expert's group in the rows sorted by
expert (``cumsum`` of the per-expert counts, int32, length E).

    model, args, kwargs = fxsplit.testing.zoo.make("moe", num_experts=4, top_k=2, shared_expert=True)

Each MoE layer: a router (``nn.Linear(C, E)``, softmax scores, top-k), the routed rows sorted by
expert, the experts as fused 3-D weights ``w1`` / ``w3`` ``[E, H, C]`` and ``w2`` ``[E, C, H]``
run as grouped matmuls over ``offs`` (SwiGLU), the outputs weighted by their scores and summed back
per token, plus an optional shared expert (a dense SwiGLU every token goes through). The grouped
matmul is a custom op (``fxsplit_zoo::grouped_mm``) because ``torch._grouped_mm`` has no CPU
backward in torch 2.13 ("Invalid strides/sizes" in its backward); it runs one matmul per group,
and its fake kernel lets torch.fx and torch.export trace it as one node, as transformers' own
``grouped_mm_fallback`` does. Dropless: every routed row reaches its expert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fxsplit.errors import UsageError

__all__ = ["GroupedExperts", "MoEConfig", "MoEGPT", "MoELayer", "grouped_mm"]


@torch.library.custom_op("fxsplit_zoo::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x [S, in]`` rows sorted by group, ``w [G, in, out]``, ``offs [G]`` group ends -> ``[S, out]``."""
    out = x.new_zeros(x.shape[0], w.shape[-1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ w[g]
        start = end
    return out


@grouped_mm.register_fake
def _grouped_mm_fake(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("fxsplit_zoo::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                         grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dw = torch.zeros_like(x), torch.zeros_like(w)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            dx[start:end] = grad[start:end] @ w[g].t()
            dw[g] = x[start:end].t() @ grad[start:end]
        start = end
    return dx, dw


@_grouped_mm_backward.register_fake
def _grouped_mm_backward_fake(x, w, offs, grad):
    return torch.empty_like(x), torch.empty_like(w)


def _setup(ctx, inputs, output) -> None:
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, grad):
    x, w, offs = ctx.saved_tensors
    dx, dw = _grouped_mm_backward(x, w, offs, grad)
    return dx, dw, None


grouped_mm.register_autograd(_backward, setup_context=_setup)


@dataclass(frozen=True)
class MoEConfig:
    vocab_size: int = 64  # V
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32  # C
    num_experts: int = 4  # E
    top_k: int = 2  # k
    expert_hidden: int = 48  # H, each expert's SwiGLU width
    shared_expert: bool = True  # a dense SwiGLU beside the routed experts

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise UsageError(f"MoEConfig: top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.n_embd % self.n_head:
            raise UsageError(f"MoEConfig: n_embd={self.n_embd} must be divisible by n_head={self.n_head}")


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as fused 3-D weights ``[E, out, in]`` (torchtitan's layout)."""

    def __init__(self, dim: int, hidden: int, num_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden, dim) / math.sqrt(dim))  # gate
        self.w3 = nn.Parameter(torch.randn(num_experts, hidden, dim) / math.sqrt(dim))  # up
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, hidden) / math.sqrt(hidden))  # down

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:  # x (S, C) sorted by expert
        gate = grouped_mm(x, self.w1.transpose(-2, -1), offs)  # (S, H)
        up = grouped_mm(x, self.w3.transpose(-2, -1), offs)
        return grouped_mm(F.silu(gate) * up, self.w2.transpose(-2, -1), offs)  # (S, C)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoELayer(nn.Module):
    """Router (softmax, top-k), tokens sorted by expert, grouped experts, weighted sum back."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.router = nn.Linear(cfg.n_embd, cfg.num_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_embd, cfg.expert_hidden, cfg.num_experts)
        self.shared = SwiGLU(cfg.n_embd, cfg.expert_hidden) if cfg.shared_expert else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        B, T, C = x.shape
        flat = x.reshape(-1, C)  # (N, C)
        scores = F.softmax(self.router(flat), dim=-1)  # (N, E)
        top_w, top_i = torch.topk(scores, self.top_k, dim=-1)  # (N, k)
        ids = top_i.reshape(-1)  # (S,)
        order = torch.argsort(ids, stable=True)  # rows sorted by expert
        counts = torch.histc(ids.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        offs = torch.cumsum(counts, dim=0).to(torch.int32)  # (E,)
        token = order // self.top_k
        out = self.experts(flat[token], offs) * top_w.reshape(-1)[order].unsqueeze(-1)  # (S, C)
        y = torch.zeros_like(flat).index_add(0, token, out)  # (N, C)
        if self.shared is not None:
            y = y + self.shared(flat)
        return y.reshape(B, T, C)


class _Attention(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class _Block(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = _Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.moe = MoELayer(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class MoEGPT(nn.Module):
    """``forward(idx: (B, T) int64) -> logits (B, T, V)``; modules ``wte``, ``wpe``,
    ``blocks.{i}.{ln1, attn, ln2, moe.{router, experts.{w1, w2, w3}, shared}}``, ``ln_f``, ``lm_head``."""

    def __init__(self, cfg: MoEConfig = MoEConfig()):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))
