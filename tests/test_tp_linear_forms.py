"""Linears written as ``x @ W.T`` (Falcon's ``FalconLinear``, and its spellings ``W.t()``,
``W.transpose(0, 1)``, ``W.permute(1, 0)``) are found as linears and sharded as nn.Linear is;
checked by ``fxsplit.verify`` (every gradient vs one process), fx and export."""

import pytest
import torch
from torch import nn

import fxsplit
from fxsplit.tp.plan import find_linears, find_tp_plan

_HW = fxsplit.Hardware(link_bytes_per_s=float("inf"))
_FORMS = {
    "T": lambda w: w.T,
    "t": lambda w: w.t(),
    "transpose": lambda w: w.transpose(0, 1),
    "permute": lambda w: w.permute(1, 0),
}


class _MatmulLinear(nn.Linear):
    def __init__(self, i, o, form):
        super().__init__(i, o, bias=False)
        self.form = form

    def forward(self, x):
        return x @ _FORMS[self.form](self.weight)


class _MLP(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.up = _MatmulLinear(32, 64, form)
        self.down = _MatmulLinear(64, 32, form)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("form", sorted(_FORMS))
def test_x_matmul_w_transposed_is_a_linear(form, method):
    torch.manual_seed(0)
    model, args = nn.Sequential(_MLP(form), _MLP(form)), (torch.randn(2, 6, 32),)
    gm = fxsplit.trace(model, args, method=method)
    kinds = {l.module_path: l.kind for l in find_linears(gm).values()}
    assert kinds.get("0.up") == "matmul", kinds
    plan = find_tp_plan(gm, 2)
    assert plan.styles["0.up"] == "colwise" and plan.styles["0.down"] == "rowwise", plan
    the_plan = fxsplit.plan(model, args, tp=2, hardware=_HW, method=method)
    report = fxsplit.verify(model, args, the_plan)
    assert report.max_gradient_error < 1e-4 and report.max_output_error < 1e-4, report
