"""[Note: following the sequence from two static traces] (fxsplit.graph.sequence): a plan traced by
torch.export at a fixed length takes every shorter length as it is, its stage boundaries following
the step's length; a graph with a value that depends on the length in another way stays static and
pads, saying why; verify stops a plan following the length where it differs from the model. One
process; the gloo runs (bytes sent per step, tp2 x pp2, dp2 x pp2, ZB-V, cp2 padded) are in
tests/test_sequence_lengths_dist.py."""

import functools
from types import SimpleNamespace

import pytest
import sympy
import torch
from torch import nn

import fxsplit
from fxsplit.api.generate import cache_path
from fxsplit.api.padding import check_padding, follows, pad_to_traced, traced_length
from fxsplit.errors import PlanError
from fxsplit.testing import hf_zoo


@functools.cache
def _llama():
    return hf_zoo.make_hf("llama", batch_size=2, seq_len=16)


def _lm_loss(out, y):
    return nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def test_a_plan_follows_every_length_up_to_the_traced_one():
    model, args, kwargs = _llama()
    p = fxsplit.plan(model, args, kwargs, tp=2, pp=2, microbatches=2, schedule="zbv", method="export",
                     follow_sequence=True)
    info = p.graph.meta["fxsplit"]
    assert info.follows_sequence and info.traced_length == 16 and follows(p) and traced_length(p) == 16, info.reason
    seq = info.symbols["seq"]
    boundaries = [m for io in p.stages.io[1:] for m in io.input_meta if m.requires_grad]
    assert boundaries and all(m.shape[1] == seq for m in boundaries), [str(m) for m in boundaries]
    assert "every length 2..16 runs as it is" in str(p)
    # generate recomputes, saying why the KV cache of an exported graph cannot serve one length symbol
    why = cache_path(SimpleNamespace(plan=p, runtime=SimpleNamespace(compile=None)))
    assert "follow_sequence=True" in why and "needs two" in why and "follow_sequence=False" in why, why
    ids, mask = args[0][:, :9], kwargs["attention_mask"][:, :9]
    assert pad_to_traced([ids, mask], p) == ([ids, mask], None)  # no padding
    flat, t = pad_to_traced([args[0][:, :1], kwargs["attention_mask"][:, :1]], p)  # one position pads
    assert t == 1 and flat[0].shape == (2, 16)
    with pytest.raises(PlanError, match="traced at 16"):
        pad_to_traced([torch.zeros(2, 17, dtype=torch.long)] * 2, p)
    for t in (9, 13):  # outputs, loss and every gradient against the model at t, unpadded
        y = torch.randint(0, 256, (2, t), generator=torch.Generator().manual_seed(t))
        report = fxsplit.verify(model, (args[0][:, :t],), p, {"attention_mask": kwargs["attention_mask"][:, :t]},
                                loss_fn=_lm_loss, target=y, quiet=True)
        assert report.gradients > 0
    assert follows(p)


class _Attention(nn.Module):
    """sdpa over the whole row; ``scale_by_length`` multiplies by 1/T (a float the trace bakes in)."""

    def __init__(self, causal=False, scale_by_length=False):
        super().__init__()
        self.causal, self.scale_by_length = causal, scale_by_length
        self.emb = nn.Embedding(32, 16)
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 32)

    def forward(self, ids):
        q, k, v = self.qkv(self.emb(ids)).chunk(3, dim=-1)
        h = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        if self.scale_by_length:
            h = h * (1.0 / ids.shape[1])
        return self.out(h)


def test_a_model_padding_would_change_runs_every_length_exactly():
    # every position attends to every other without a mask: padding changes it, following does not
    torch.manual_seed(0)
    model, ids = _Attention(), torch.randint(0, 32, (2, 8))
    p = fxsplit.plan(model, (ids,), pp=2, microbatches=2, schedule="1f1b", method="export", follow_sequence=True)
    assert follows(p), p.graph.meta["fxsplit"].reason
    fxsplit.verify(model, (ids,), p, quiet=True)
    fxsplit.verify(model, (ids[:, :5],), p, loss_fn=lambda out, y: nn.functional.mse_loss(out, y),
                   target=torch.randn(2, 5, 32), quiet=True)


def test_a_value_that_depends_on_the_length_keeps_the_plan_static():
    torch.manual_seed(0)
    model, ids = _Attention(causal=True, scale_by_length=True), torch.randint(0, 32, (2, 8))
    p = fxsplit.plan(model, (ids,), pp=2, microbatches=2, schedule="1f1b", method="export", follow_sequence=True)
    info = p.graph.meta["fxsplit"]
    assert not info.follows_sequence and not follows(p) and traced_length(p) == 8
    assert "depends on the length" in info.follow_refused and "stays static at 8" in info.reason
    assert "shorter steps padded to it" in str(p) and "depends on the length" in str(p)
    flat, t = pad_to_traced([ids[:, :5]], p)
    assert t == 5 and flat[0].shape == (2, 8)
    with pytest.raises(PlanError, match="follow_sequence=True with cp > 1"):
        fxsplit.ParallelConfig(cp=2, follow_sequence=True)
    on_meta = fxsplit.plan(_meta_model(), (ids,), pp=2, microbatches=2, schedule="1f1b", method="export",
                           follow_sequence=True)
    assert not on_meta.graph.meta["fxsplit"].follows_sequence and "meta device" in str(on_meta)


def _meta_model():
    with torch.device("meta"):
        return _Attention(causal=True)


def test_verify_stops_following_where_the_plan_differs():
    torch.manual_seed(0)
    model, ids = _Attention(causal=True), torch.randint(0, 32, (2, 8))
    p = fxsplit.plan(model, (ids,), pp=2, microbatches=2, schedule="1f1b", method="export", follow_sequence=True)
    assert follows(p)

    def run_plan(flat):  # right at the traced length, wrong at any other
        return [model(flat[0]) + (flat[0].shape[1] != 8)]

    def close(x, ref):
        err = float((x - ref).abs().max() / ref.abs().max())
        return err < 1e-5, err

    check_padding(model, (ids,), {}, p, run_plan, close)
    assert not follows(p) and "at 4 positions" in p._following_refused
    flat, t = pad_to_traced([ids[:, :5]], p)  # the padding was checked in turn, and is exact
    assert t == 5 and flat[0].shape == (2, 8) and getattr(p, "_padding_refused", None) is None
    assert "shorter steps padded to it (at 4 positions" in str(p)
    assert isinstance(p.stages.input_meta[0].shape[1], sympy.Expr)  # the graph itself still takes any length
