"""Replicated operands of sharded nodes get their gradients summed over the tp ranks ([Note:
partial gradients of replicated operands] in ``fxsplit.tp.plan``), however the parameter reaches
the sharded node: read directly, through a cast, a view, an expand, an add with a constant (Gemma
3's ``1 + w``), a pointwise function of it, or as a replicated activation (a gate computed from
the hidden state). Each case is checked by ``fxsplit.verify`` (every gradient vs one process)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxsplit
from fxsplit.tp.plan import find_tp_plan

B, T, C, H = 2, 6, 32, 4
HD = C // H
_HW = fxsplit.Hardware(link_bytes_per_s=float("inf"))


class _Attention(nn.Module):
    """Attention whose sharded (per-head) values are combined with replicated operands that
    carry gradients, one per way a parameter can reach them."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.ln = nn.LayerNorm(C)
        self.q, self.k, self.v, self.o = (nn.Linear(C, C) for _ in range(4))
        self.w = nn.Parameter(torch.randn(HD) * 0.5)
        self.s = nn.Parameter(torch.randn(()) * 0.5)

    def _scale(self, x):
        how, w = self.how, self.w
        if how == "direct":
            return w
        if how == "one_plus":  # Gemma 3's q/k norm: (1 + w.float())
            return 1.0 + w.float()
        if how == "cast":
            return w.double().float()
        if how == "view":
            return w.view(1, 1, 1, HD)
        if how == "expand":
            return w.view(1, 1, 1, HD).expand(B, 1, T, HD)
        if how == "function":
            return torch.sigmoid(self.s) * torch.exp(w)
        if how == "activation":  # a per-token gate from the (replicated) hidden state
            return torch.sigmoid(x.mean(-1, keepdim=True)).unsqueeze(1)
        raise ValueError(how)

    def forward(self, x):
        h = self.ln(x)
        q, k, v = (f(h).view(B, T, H, HD).transpose(1, 2) for f in (self.q, self.k, self.v))
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * self._scale(h)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(B, T, C))


HOWS = ["direct", "one_plus", "cast", "view", "expand", "function", "activation"]


def _model(how):
    torch.manual_seed(0)
    return nn.Sequential(_Attention(how), _Attention(how)), (torch.randn(B, T, C),)


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("how", HOWS)
def test_replicated_operand_gradients_are_summed(how, method):
    model, args = _model(how)
    gm = fxsplit.trace(model, args, method=method)
    plan = find_tp_plan(gm, 2)
    assert plan.styles["0.q"] == "colwise" and plan.styles["0.o"] == "rowwise", plan
    the_plan = fxsplit.plan(model, args, tp=2, hardware=_HW, method=method)
    report = fxsplit.verify(model, args, the_plan)
    assert report.max_gradient_error < 1e-4, report
    assert len(plan.rewrite.grad_sums) >= 2, plan.rewrite.grad_sums  # one f per layer at least


def test_operands_without_a_gradient_get_no_sum():
    """A rotary-like table computed from a buffer carries no gradient: no f (no extra collective)."""

    class _Buffered(_Attention):
        def __init__(self):
            super().__init__("direct")
            self.register_buffer("table", torch.randn(T, HD))

        def _scale(self, x):
            return torch.cos(self.table).float()

    torch.manual_seed(0)
    gm = fxsplit.trace(nn.Sequential(_Buffered()), (torch.randn(B, T, C),))
    assert find_tp_plan(gm, 2).rewrite.grad_sums == ()
