"""Zoo models where a tensor's identity or memory layout, not only its values, decides whether a
split runs: registered in :mod:`fxsplit.testing.zoo` as ``layout`` and ``alias`` (see its table).

    TransposedBoundaryModel: a boundary value that must cross in its own strides ([Note:
        boundary layouts] in ``fxsplit.pipeline.layout``).
    AliasedParamModel: parameters reachable under two names ([Note: one parameter, two names]
        in ``fxsplit.tp.plan``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["AliasedParamModel", "HeadMix", "HeadsOut", "TransposedBoundaryModel"]


# ---------------------------------------------------------------------------------------------
# TransposedBoundaryModel
# ---------------------------------------------------------------------------------------------


class HeadsOut(nn.Module):
    """Self-attention that returns the heads as ``(B, T, nh, hs)``: a transpose of the
    contiguous ``att @ v`` (strides of ``(B, nh, T, hs)``), never made contiguous."""

    def __init__(self, dim: int, n_head: int):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.n_head = n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = F.softmax(q @ k.transpose(-2, -1) * (C // self.n_head) ** -0.5, dim=-1)
        return (att @ v).transpose(1, 2)  # (B, T, nh, hs), strides of (B, nh, T, hs)


class HeadMix(nn.Module):
    """Reads the heads back as ``(B * nh, T, hs)`` with ``.view``, valid only on the strides
    :class:`HeadsOut` gave them, then projects ``(B, T, C)``."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        B, T, nh, hs = y.shape
        z = y.transpose(1, 2).view(B * nh, T, hs)  # a view of the producer's layout
        z = z * torch.sigmoid(z)
        return self.proj(z.view(B, nh, T, hs).transpose(1, 2).reshape(B, T, nh * hs))


class TransposedBoundaryModel(nn.Module):
    """``forward(x: (B, T, dim)) -> (B, T, out_dim)``: ``head(mix(attn(x)) + x)``; cut between
    ``attn`` and ``mix`` (``split_points=("mix",)``) the boundary value is a transpose."""

    def __init__(self, dim: int = 16, n_head: int = 2, out_dim: int = 8):
        super().__init__()
        self.attn = HeadsOut(dim, n_head)
        self.mix = HeadMix(dim)
        self.head = nn.Linear(dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.attn(x)) + x)


# ---------------------------------------------------------------------------------------------
# AliasedParamModel
# ---------------------------------------------------------------------------------------------


class AliasedParamModel(nn.Module):
    """``forward(x: (B, T, dim)) -> (B, T, dim)``: four residual MLPs whose parameters are
    reachable under two names.

    - ``shared`` is one Linear registered twice (``self.shared2 = self.shared``): the up
      projection of MLPs 1 and 2, a column both times (one shard spec: sharded alike).
    - ``down3.weight`` IS ``up4.weight`` (an alias attribute, square ``[dim, dim]``): the row
      half of MLP 3 and the column half of MLP 4, which would shard it on different dims (so
      both stay whole under tensor parallelism, and the plan says why).
    """

    def __init__(self, dim: int = 16):
        super().__init__()
        self.shared = nn.Linear(dim, 2 * dim)
        self.down1 = nn.Linear(2 * dim, dim)
        self.shared2 = self.shared
        self.down2 = nn.Linear(2 * dim, dim)
        self.up3 = nn.Linear(dim, dim)
        self.down3 = nn.Linear(dim, dim)
        self.up4 = nn.Linear(dim, dim)
        self.up4.weight = self.down3.weight
        self.down4 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down1(F.gelu(self.shared(x)))
        x = x + self.down2(F.gelu(self.shared2(x)))
        x = x + self.down3(F.gelu(self.up3(x)))
        return x + self.down4(F.gelu(self.up4(x)))
