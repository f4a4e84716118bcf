"""Per-head additive score biases are sharded with the heads ([Note: scattered operands] in
``fxsplit.tp.rules``): a learned relative-position table added to the scores, the same given to
sdpa as its mask (T5), and ALiBi slopes from a buffer. Each rank reads its heads' range of the
bias (``scatter_to_region``; the gradient of a learned table is all-gathered, not summed).
Checked by ``fxsplit.verify`` (every gradient vs one process), fx and export."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxsplit
from fxsplit.tp.plan import find_tp_plan

B, T, C, H = 2, 6, 32, 4
HD = C // H
_HW = fxsplit.Hardware(link_bytes_per_s=float("inf"))


class _BiasedAttention(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.q, self.k, self.v, self.o = (nn.Linear(C, C) for _ in range(4))
        self.table = nn.Parameter(torch.randn(H, T, T) * 0.3)  # relative position bias, per head
        self.register_buffer("slopes", torch.tensor([2.0 ** (-(i + 1)) for i in range(H)]).view(H, 1, 1))

    def forward(self, x):
        q, k, v = (f(x).view(B, T, H, HD).transpose(1, 2) for f in (self.q, self.k, self.v))
        if self.how == "sdpa_mask":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.table.unsqueeze(0))
        else:
            scores = q @ k.transpose(-1, -2) / math.sqrt(HD)
            if self.how == "added":
                scores = scores + self.table
            else:  # alibi: slopes [H, 1, 1] times the distance [T, T]
                pos = torch.arange(T, dtype=x.dtype)
                scores = scores - self.slopes * (pos[None, :] - pos[:, None]).abs()
            y = torch.softmax(scores, dim=-1) @ v
        return x + self.o(y.transpose(1, 2).reshape(B, T, C))


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("how", ["added", "sdpa_mask", "alibi"])
def test_per_head_score_bias_is_sharded_with_the_heads(how, method):
    torch.manual_seed(0)
    model, args = nn.Sequential(_BiasedAttention(how), _BiasedAttention(how)), (torch.randn(B, T, C),)
    gm = fxsplit.trace(model, args, method=method)
    plan = find_tp_plan(gm, 2)
    assert plan.styles["0.q"] == "colwise" and plan.styles["0.o"] == "rowwise", plan
    assert len(plan.rewrite.scatters) == 2, plan.rewrite.scatters  # one bias per layer
    the_plan = fxsplit.plan(model, args, tp=2, hardware=_HW, method=method)
    report = fxsplit.verify(model, args, the_plan)
    assert report.max_gradient_error < 1e-4 and report.max_output_error < 1e-4, report


def test_a_replicated_residual_on_the_features_is_not_scattered():
    """A full-size replicated activation added to a feature-sharded value ends the region (the
    scatter is for heads dims, and for parameters on the features): no region here."""

    class _Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(C, 64), nn.Linear(64, C)

        def forward(self, x):
            return self.down(self.up(x) + torch.cat([x, x], -1))

    gm = fxsplit.trace(_Residual(), (torch.randn(B, T, C),))
    plan = find_tp_plan(gm, 2)
    assert plan.styles["up"] == "replicate" and plan.rewrite.scatters == ()
