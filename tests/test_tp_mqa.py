"""Multi-query attention in one fused projection (GPTBigCode's ``c_attn``: ``[q | k | v]`` with
H query heads and ONE k / v head): q sharded by heads, the k / v head kept whole on every rank
(``ShardSpec.whole``) and its expand to the heads made local ([Note: whole blocks] in
``fxsplit.tp.regions``). Checked by ``fxsplit.verify`` (outputs and every gradient, the whole
blocks' included, vs the unsplit model), fx and export, both expand spellings."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxsplit
from fxsplit.tp.plan import find_tp_plan
from fxsplit.tp.sharding import ShardSpec

B, T, C, H = 2, 6, 32, 4
HD = C // H
_HW = fxsplit.Hardware(link_bytes_per_s=float("inf"))


class _MultiQuery(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.c_attn, self.c_proj = nn.Linear(C, C + 2 * HD), nn.Linear(C, C)

    def forward(self, x):
        q, k, v = self.c_attn(x).split([C, HD, HD], dim=-1)
        q = q.view(B, T, H, HD).transpose(1, 2)
        if self.how in ("expand", "k_read_elsewhere"):  # [B, 1, T, hd] -> [B, H, T, hd]
            k, v = (a.unsqueeze(1).expand(B, H, T, HD) for a in (k, v))
        else:  # GPTBigCode: [B, 1, 1, T, hd] -> [B, 1, H, T, hd] -> [B, H, T, hd]
            k, v = (a.unsqueeze(1).unsqueeze(2).expand(B, 1, H, T, HD).reshape(B, H, T, HD) for a in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = x + self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return out + k.mean() if self.how == "k_read_elsewhere" else out


@pytest.mark.parametrize("how,method", [("expand", "fx"), ("reshape", "export")])
def test_q_sharded_by_heads_and_the_kv_head_whole(how, method):
    torch.manual_seed(0)
    model, args = nn.Sequential(_MultiQuery(how), _MultiQuery(how)), (torch.randn(B, T, C),)
    plan = find_tp_plan(fxsplit.trace(model, args, method=method), 2)
    want = ShardSpec(0, 2, (C, HD, HD), whole=(1, 2))
    assert plan.param_specs["0.c_attn.weight"] == want and plan.param_specs["0.c_attn.bias"] == want, plan
    assert plan.styles["0.c_proj"] == "rowwise"
    the_plan = fxsplit.plan(model, args, tp=2, hardware=_HW, method=method)
    report = fxsplit.verify(model, args, the_plan)
    assert report.max_gradient_error < 1e-4 and report.max_output_error < 1e-4, report


def test_a_whole_block_read_elsewhere_is_not_kept_whole():
    """k also read by a replicated op: its gradient there is whole, not partial, so the layout
    would be wrong: the projection stays replicated, with the reason."""
    torch.manual_seed(0)
    model, args = _MultiQuery("k_read_elsewhere"), (torch.randn(B, T, C),)
    plan = find_tp_plan(fxsplit.trace(model, args), 2)
    assert plan.style_of("c_attn") == "replicate", plan
    report = fxsplit.verify(model, args, fxsplit.plan(model, args, tp=2, hardware=_HW))
    assert report.max_gradient_error < 1e-4, report
