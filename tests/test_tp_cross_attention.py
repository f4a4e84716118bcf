"""Cross-attention sharded by heads ([Note: attention partners] in ``fxsplit.tp.regions``): q from
the decoder's stream, k and v from the encoder's output (read by every decoder layer), so no
group of linears sharing an input holds all three. Checked by ``fxsplit.verify`` (outputs and
every gradient vs the unsplit model), the scores written out (fx) and through sdpa (export)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxsplit
from fxsplit.tp.plan import find_tp_plan

B, S, T, C, H = 2, 5, 4, 32, 4
HD = C // H
_HW = fxsplit.Hardware(link_bytes_per_s=float("inf"))


class _CrossAttention(nn.Module):
    def __init__(self, sdpa: bool):
        super().__init__()
        self.sdpa = sdpa
        self.norm = nn.LayerNorm(C)
        self.q, self.k, self.v, self.o = (nn.Linear(C, C) for _ in range(4))

    def forward(self, x, memory):
        q = self.q(self.norm(x)).view(B, T, H, HD).transpose(1, 2)
        k, v = (f(memory).view(B, S, H, HD).transpose(1, 2) for f in (self.k, self.v))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v)
        else:
            y = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(HD), dim=-1) @ v
        return x + self.o(y.transpose(1, 2).reshape(B, T, C))


class _EncoderDecoder(nn.Module):
    def __init__(self, sdpa: bool):
        super().__init__()
        self.enc = nn.LayerNorm(C)  # the encoder's final norm
        self.dec = nn.ModuleList(_CrossAttention(sdpa) for _ in range(2))

    def forward(self, src, tgt):
        memory = self.enc(src)
        for layer in self.dec:
            tgt = layer(tgt, memory)
        return tgt


@pytest.mark.parametrize("sdpa,method", [(False, "fx"), (True, "export")], ids=["matmul-fx", "sdpa-export"])
def test_cross_attention_is_sharded_by_heads(sdpa, method):
    torch.manual_seed(0)
    model, args = _EncoderDecoder(sdpa), (torch.randn(B, S, C), torch.randn(B, T, C))
    plan = find_tp_plan(fxsplit.trace(model, args, method=method), 2)
    for i in range(2):
        assert [plan.style_of(f"dec.{i}.{p}") for p in "qkvo"] == ["colwise"] * 3 + ["rowwise"], plan
    the_plan = fxsplit.plan(model, args, tp=2, hardware=_HW, method=method)
    report = fxsplit.verify(model, args, the_plan)
    assert report.max_gradient_error < 1e-4 and report.max_output_error < 1e-4, report
