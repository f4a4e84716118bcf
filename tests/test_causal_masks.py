"""[Note: causal masks as is_causal] in passes/causal_masks.py: a mask that is exactly causal at every
size the graph runs at becomes ``is_causal=True``; every other mask stays, with its reason."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxsplit
from fxsplit.graph.pass_api import PassContext
from fxsplit.passes.causal_masks import causal_masks

pytestmark = pytest.mark.hf


def _sdpa_calls(gm):
    return [n for n in gm.graph.nodes if "scaled_dot_product_attention" in str(n.target)]


def _masks_and_flags(gm):
    out = []
    for n in _sdpa_calls(gm):
        mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
        out.append((mask is not None, bool(n.kwargs.get("is_causal", n.args[5] if len(n.args) > 5 else False))))
    return out


def _run(model, args, kwargs=None, **trace_options):
    gm = fxsplit.trace(model, args, kwargs or {}, **trace_options)
    want = gm(*args, **(kwargs or {}))
    ctx = PassContext()
    result = causal_masks(gm, ctx)
    got = result.graph_module(*args, **(kwargs or {}))
    return result, ctx.report["causal_masks"], want, got


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def test_hf_llama_mask_becomes_is_causal_and_the_outputs_stay():
    from fxsplit.testing import hf_zoo

    model, args, _ = hf_zoo.make_hf("llama")  # no attention_mask: the traced mask is built from sizes alone
    result, report, want, got = _run(model, args, dynamic_sequence=False)
    assert result.modified and report.startswith("2 of 2 attention masks are causal"), report
    assert _masks_and_flags(result.graph_module) == [(False, True)] * 2
    torch.testing.assert_close(_logits(got), _logits(want), rtol=1e-5, atol=1e-6)


def test_masks_that_are_not_exactly_causal_stay_with_their_reason():
    from fxsplit.testing import hf_zoo

    # a padding mask given as an input: the mask reads it
    model, args, kwargs = hf_zoo.make_hf("llama")
    result, report, _, _ = _run(model, args, kwargs, dynamic_sequence=False)
    assert not result.modified and "reads the model input 'attention_mask'" in report, report
    # a sliding window shorter than the sequence: sizes alone, but not causal
    model, args, _ = hf_zoo.make_hf("mistral", sliding_window=4)
    result, report, want, got = _run(model, args, dynamic_sequence=False)
    assert not result.modified and "not the causal mask" in report, report
    torch.testing.assert_close(_logits(got), _logits(want))
    # a symbolic sequence: checked at one length, it would run at others
    model, args, _ = hf_zoo.make_hf("llama")
    result, report, _, _ = _run(model, args, dynamic_sequence=True)
    assert not result.modified and "sequence length is symbolic" in report, report


class _FloatMask(nn.Module):
    """Additive float masks built from sizes: -inf or the dtype's lowest value above the diagonal
    (both exp to 0: causal), and an off-by-one diagonal (not causal)."""

    def __init__(self, fill, diagonal=0):
        super().__init__()
        self.fill, self.diagonal = fill, diagonal
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
        keep = torch.ones(s, s, dtype=torch.bool, device=x.device).tril(self.diagonal)
        mask = torch.zeros(s, s, device=x.device).masked_fill(~keep, self.fill)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class _RandomMask(_FloatMask):
    """A mask drawn at random, which happens to be causal when the threshold is 2 (rand < 1 always)."""

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
        keep = torch.ones(s, s, dtype=torch.bool, device=x.device).tril() & (torch.rand(s, s, device=x.device) < 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def test_a_mask_drawn_at_random_stays():
    gm = fxsplit.trace(_RandomMask(float("-inf")), (torch.randn(2, 6, 8),), dynamic_sequence=False, method="export")
    ctx = PassContext()
    assert not causal_masks(gm, ctx).modified and "draws random numbers" in ctx.report["causal_masks"]


@pytest.mark.parametrize("fill, diagonal, causal", [(float("-inf"), 0, True), (torch.finfo(torch.float32).min, 0, True),
                                                    (float("-inf"), 1, False), (-1e4, 0, False)],
                         ids=["-inf", "lowest", "diagonal+1", "-1e4"])
def test_float_masks(fill, diagonal, causal):
    x = torch.randn(2, 6, 8)
    result, report, want, got = _run(_FloatMask(fill, diagonal), (x,), dynamic_sequence=False, method="export")
    assert result.modified == causal, report
    assert _masks_and_flags(result.graph_module) == [(not causal, causal)]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_parallelize_plans_run_flash_attention_exactly():
    """The plan's stages get is_causal=True (no mask crosses a pipeline cut) and the plan's report says so."""
    from fxsplit.testing import hf_zoo

    model, args, _ = hf_zoo.make_hf("llama")
    plan = fxsplit.plan(model, args, {}, pp=2)
    assert plan.pass_report["causal_masks"].startswith("2 of 2"), plan.pass_report["causal_masks"]
    assert all(flags == (False, True) for gm in plan.stages.modules for flags in _masks_and_flags(gm))
    report = fxsplit.verify(model, args, plan, loss_fn=lambda out, target: out.logits.square().mean())
    assert report.max_output_error < 1e-5 and report.gradients > 0, report
