"""A sum or mean over the sharded dim ([Note: reductions over the sharded dim] in
``fxsplit.tp.rules``): OLMo 2's q/k RMSNorm normalizes the whole q projection, not each head.
The statistic is all-reduced (g), its gradient summed (f), the norm's weight read by each rank
for its features (``scatter_to_region``); checked by ``fxsplit.verify``, fx and export."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxsplit
from fxsplit.tp.plan import find_tp_plan

B, T, C, H = 2, 6, 32, 4
HD = C // H
_HW = fxsplit.Hardware(link_bytes_per_s=float("inf"))


class _RMSNorm(nn.Module):
    def __init__(self, n, how):
        super().__init__()
        self.how = how
        self.weight = nn.Parameter(1 + 0.3 * torch.randn(n))

    def forward(self, x):
        if self.how == "mean":
            var = x.pow(2).mean(-1, keepdim=True)
        else:
            var = x.pow(2).sum(-1, keepdim=True) / C
        return self.weight * (x * torch.rsqrt(var + 1e-6))


class _FullQKNorm(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(C, C) for _ in range(4))
        self.q_norm, self.k_norm = _RMSNorm(C, how), _RMSNorm(C, how)

    def forward(self, x):
        q, k = self.q_norm(self.q(x)), self.k_norm(self.k(x))
        q, k, v = (t.view(B, T, H, HD).transpose(1, 2) for t in (q, k, self.v(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(B, T, C))


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("how", ["mean", "sum"])
def test_norm_over_the_whole_projection_is_sharded(how, method):
    torch.manual_seed(0)
    model, args = nn.Sequential(_FullQKNorm(how), _FullQKNorm(how)), (torch.randn(B, T, C),)
    gm = fxsplit.trace(model, args, method=method)
    plan = find_tp_plan(gm, 2)
    assert plan.styles["0.q"] == "colwise" and plan.styles["0.o"] == "rowwise", plan
    assert len(plan.rewrite.partial_sums) == 4 and len(plan.rewrite.scatters) == 4, (plan.rewrite.partial_sums, plan.rewrite.scatters)
    the_plan = fxsplit.plan(model, args, tp=2, hardware=_HW, method=method)
    report = fxsplit.verify(model, args, the_plan)
    assert report.max_gradient_error < 1e-4 and report.max_output_error < 1e-4, report
