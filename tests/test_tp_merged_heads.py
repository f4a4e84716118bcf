"""Heads merged as the INNER factor of a dim ([Note: heads merged as an inner factor] in
``fxsplit.tp.merged``): BLOOM's attention reshapes q / k / v ``[B, heads, T, hd]`` to ``(B *
heads, T, hd)`` for ``baddbmm`` (with ALiBi's ``[B * heads, 1, T]`` bias) and ``bmm``, then splits
the merged dim back. Sharded by heads, each rank its strided rows of ``B * heads``, the bias read
through a strided scatter; checked by ``fxsplit.verify`` (every gradient vs one process), fx and
export. What the rule cannot do exactly stays replicated with the op named."""

import math

import pytest
import torch
from torch import nn

import fxsplit
from fxsplit.testing import run_distributed
from fxsplit.tp.plan import find_tp_plan

B, T, C, H = 2, 6, 32, 4
HD = C // H
_HW = fxsplit.Hardware(link_bytes_per_s=float("inf"))


class _MergedHeads(nn.Module):
    """BLOOM's layout: fused qkv viewed ``[B, T, H, 3, hd]``, heads merged into ``B * H``."""

    def __init__(self, bias: str = "alibi", merge_back: str = "size"):
        super().__init__()
        self.bias, self.merge_back = bias, merge_back
        self.qkv, self.o = nn.Linear(C, 3 * C), nn.Linear(C, C)
        if merge_back == "row":
            self.o2 = nn.Linear(B * H, B * H)
        self.register_buffer("slopes", torch.tensor([2.0 ** (-(i + 1)) for i in range(H)]))

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, H, 3, HD)
        q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))
        q = q.reshape(b * H, -1, HD)
        k = k.reshape(b * H, -1, HD).transpose(-1, -2)
        v = v.reshape(b * H, -1, HD)
        if self.bias == "alibi":  # [B * H, 1, T] from replicated slopes
            pos = torch.arange(t, dtype=x.dtype)
            bias = (self.slopes[:, None] * pos[None, :]).expand(b, H, t).reshape(b * H, 1, t)
        else:  # broadcast over every head
            bias = torch.zeros(1, 1, t, dtype=x.dtype)
        scores = bias.baddbmm(q, k, beta=1.0, alpha=1 / math.sqrt(HD))
        mask = torch.full((t, t), float("-inf")).triu(1)
        probs = torch.softmax(scores.view(b, H, t, -1) + mask, dim=-1).view(b * H, t, -1)
        ctx = torch.bmm(probs, v)
        if self.merge_back == "size":  # BLOOM's _merge_heads: batch_size = x.shape[0] // num_heads
            bh, tt, _ = ctx.shape
            ctx = ctx.view(bh // H, H, tt, HD)
        elif self.merge_back == "regroup":  # [B*H, T, hd] -> [B, H*T, hd]: not a split at the heads
            ctx = ctx.reshape(b, H * t, HD).view(b, H, t, HD)
        elif self.merge_back == "size_by_batch":  # the merged size read other than as // H
            bh = ctx.shape[0]
            ctx = ctx.view(b, bh // b, t, HD)
        elif self.merge_back == "row":  # a linear reading the merged dim as its features
            ctx = self.o2(ctx.transpose(0, 2)).transpose(0, 2).view(b, H, t, HD)
        else:
            ctx = ctx.view(b, H, t, HD)
        return x + self.o(ctx.permute(0, 2, 1, 3).reshape(b, t, C))


def _model(**kw):
    torch.manual_seed(0)
    return nn.Sequential(_MergedHeads(**kw), _MergedHeads(**kw)), (torch.randn(B, T, C),)


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("bias,merge_back", [("alibi", "size"), ("broadcast", "view")])
def test_heads_merged_as_inner_factor_are_sharded(bias, merge_back, method):
    model, args = _model(bias=bias, merge_back=merge_back)
    gm = fxsplit.trace(model, args, method=method)
    plan = find_tp_plan(gm, 2)
    assert plan.styles["0.qkv"] == "colwise" and plan.styles["0.o"] == "rowwise", plan
    assert plan.param_specs["0.qkv.weight"].blocks is None, plan  # heads outer in [H, 3, hd]: one range each
    assert plan.merged, plan  # values on a merged dim were recorded
    strided = [s for s in plan.rewrite.scatters if s.heads]
    assert len(strided) == (2 if bias == "alibi" else 0), plan.rewrite.scatters
    the_plan = fxsplit.plan(model, args, tp=2, hardware=_HW, method=method)
    report = fxsplit.verify(model, args, the_plan)
    assert report.max_gradient_error < 1e-4 and report.max_output_error < 1e-4, report


@pytest.mark.parametrize("merge_back,method,why", [
    ("regroup", "export", "regroups a dim whose heads are merged as its inner factor"),  # -> [B, H*T, hd]
    # bh // b: the local size over the global b (export folds (4*s0) // s0 to the constant 4: exact)
    ("size_by_batch", "fx", "other than as // 4"),
    ("row", "export", "a linear reads a value whose heads are merged"),
])
def test_what_a_merged_dim_cannot_do_stays_replicated(merge_back, method, why):
    """No wrong number: a use of the merged dim that is not exact on each rank's strided rows
    leaves the attention replicated, and the plan names the node."""
    model, args = _model(merge_back=merge_back)
    plan = find_tp_plan(fxsplit.trace(model, args, method=method), 2)
    assert plan.styles["0.qkv"] == "replicate", plan
    assert why in dict(plan.replicated)["0.qkv"], plan.replicated


STEPS, LR = 3, 0.1


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(B, T, C, generator=g), torch.randn(B, T, C, generator=g)) for _ in range(STEPS)]


def _train(rank, world):
    model, args = _model()
    pm = fxsplit.parallelize(model, args, loss_fn=_mse, tp=2, timeout=60, hardware=_HW, method="export")
    assert any(s.heads for s in pm.plan.tp_plan.rewrite.scatters)  # the strided ALiBi scatter runs for real
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    losses = []
    for x, y in _batches():
        losses.append(float(pm.step(x, target=y)))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "state": pm.full_state_dict()}


@pytest.mark.dist
def test_merged_heads_train_like_one_process_over_gloo():
    """tp=2 on 2 gloo ranks, 3 SGD steps: every loss and every parameter after the steps (so
    every gradient) as one process."""
    model, _ = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref = []
    for x, y in _batches():
        loss = _mse(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref.append(loss.item())
    for r in run_distributed(_train, 2, timeout=300):
        assert r["losses"] == pytest.approx(ref, rel=1e-5), (r["losses"], ref)
        for name, value in model.state_dict().items():
            assert torch.allclose(r["state"][name], value, rtol=1e-5, atol=1e-6), name
