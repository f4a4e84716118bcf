"""Mixtures of experts with fused 3-D expert weights (transformers' ``grouped_mm`` experts, and
its ``batched_mm`` experts: ``bmm(W[ids], x[..., None])``): each expert's FFN column /
row-parallel as one grouped (batched) linear ([Note: experts as grouped linears] in
``fxsplit.tp.linears``), gate and up as two blocks of the fused ``gate_up``, the router
replicated. Checked by ``fxsplit.verify`` (all ranks in one process, outputs and every gradient
vs the unsplit model), fx and export, both weight layouts."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxsplit
from fxsplit.tp.plan import find_tp_plan

B, T, C, E, I, K = 2, 6, 32, 4, 16, 2
_HW = fxsplit.Hardware(link_bytes_per_s=float("inf"))


@torch.library.custom_op("fxsplit_test::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [S, in] @ w[e] [in, out] for the rows of group e (ends ``offs``): torch's grouped_mm
    in float32 on CPU (its own needs bf16), as transformers' ``grouped_mm_fallback``."""
    out, start = x.new_zeros(x.shape[0], w.shape[-1]), 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[e]
        start = end
    return out


@grouped_mm.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[-1])


def _grouped_mm_backward(ctx, grad):
    x, w, offs = ctx.saved_tensors
    gx, gw, start = grouped_mm(grad, w.transpose(-2, -1).contiguous(), offs), torch.zeros_like(w), 0
    for e, end in enumerate(offs.tolist()):
        gw[e] = x[start:end].T @ grad[start:end]
        start = end
    return gx, gw, None


grouped_mm.register_autograd(_grouped_mm_backward,
                             setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


class _MoE(nn.Module):
    """Router (softmax, top-k, renormalized), tokens sorted by expert, two grouped matmuls,
    the routing weights applied and the top-k summed, as ``grouped_mm_experts_forward``."""

    def __init__(self, transposed: bool):
        super().__init__()
        self.transposed = transposed
        self.norm = nn.LayerNorm(C)
        self.router = nn.Linear(C, E, bias=False)
        shape_gu, shape_d = ((E, C, 2 * I), (E, I, C)) if transposed else ((E, 2 * I, C), (E, C, I))
        self.gate_up = nn.Parameter(torch.randn(shape_gu) * 0.2)
        self.down = nn.Parameter(torch.randn(shape_d) * 0.2)

    def forward(self, x):
        h = self.norm(x).view(-1, C)
        probs = torch.softmax(self.router(h), dim=-1)
        top, idx = torch.topk(probs, K, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        ids, perm = torch.sort(idx.reshape(-1))
        rows = h[perm // K]
        offs = torch.cumsum(torch.histc(ids.float(), bins=E, min=0, max=E - 1), 0).to(torch.int32)
        w1, w2 = (self.gate_up, self.down) if self.transposed else (self.gate_up.transpose(-2, -1),
                                                                   self.down.transpose(-2, -1))
        gate, up = grouped_mm(rows, w1, offs).chunk(2, dim=-1)
        y = grouped_mm(F.silu(gate) * up, w2, offs) * top.reshape(-1)[perm].unsqueeze(-1)
        back = torch.empty_like(perm).index_put_((perm,), torch.arange(perm.numel()))
        return x + y[back].view(B * T, K, C).sum(1).view(B, T, C)


class _BatchedMoE(_MoE):
    """As ``batched_mm_experts_forward``: every row repeated top-k times, its expert's weight
    gathered (``W[ids]``) and applied by ``bmm``, the routing weights applied, the top-k summed."""

    def forward(self, x):
        h = self.norm(x).view(-1, C)
        probs = torch.softmax(self.router(h), dim=-1)
        top, idx = torch.topk(probs, K, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        ids, rows = idx.reshape(-1), h.repeat_interleave(K, dim=0)

        def linear(a, w):
            if self.transposed:  # w [E, in, out]
                return torch.bmm(a.unsqueeze(1), w[ids]).squeeze(1)
            return torch.bmm(w[ids], a.unsqueeze(-1)).squeeze(-1)

        gate, up = linear(rows, self.gate_up).chunk(2, dim=-1)
        y = linear(F.silu(gate) * up, self.down) * top.reshape(-1).unsqueeze(-1)
        return x + y.view(B * T, K, C).sum(1).view(B, T, C)


@pytest.mark.parametrize("impl,transposed,method", [("grouped", False, "export"), ("grouped", True, "fx"),
                                                    ("batched", False, "export"), ("batched", True, "fx")],
                         ids=["E_out_in-export", "E_in_out-fx", "batched-E_out_in-export", "batched-E_in_out-fx"])
def test_experts_are_column_row_parallel_and_the_router_replicated(impl, transposed, method):
    torch.manual_seed(0)
    model, args = (_MoE if impl == "grouped" else _BatchedMoE)(transposed), (torch.randn(B, T, C),)
    gm = fxsplit.trace(model, args, method=method)
    plan = find_tp_plan(gm, 2)
    out_dim, in_dim = (2, 1) if transposed else (1, 2)
    gu, d = plan.param_specs["gate_up"], plan.param_specs["down"]
    assert (gu.dim, gu.blocks, d.dim, d.blocks) == (out_dim, (I, I), in_dim, None), plan
    assert plan.style_of("router") == "replicate" and "a router's scores" in dict(plan.replicated)["router"], plan
    the_plan = fxsplit.plan(model, args, tp=2, hardware=_HW, method=method)
    report = fxsplit.verify(model, args, the_plan)
    assert report.max_gradient_error < 1e-4 and report.max_output_error < 1e-4, report


def test_rank_holds_its_slice_of_each_expert():
    """Rank r's gate_up is, for every expert, the r-th half of gate then the r-th half of up."""
    torch.manual_seed(0)
    model, args = _MoE(False), (torch.randn(B, T, C),)
    spec = find_tp_plan(fxsplit.trace(model, args), 2).param_specs["gate_up"]
    w = model.gate_up.detach()
    for r in range(2):
        want = torch.cat([w[:, r * I // 2:(r + 1) * I // 2], w[:, I + r * I // 2:I + (r + 1) * I // 2]], dim=1)
        assert torch.equal(spec.shard(w, r), want)
    assert torch.equal(spec.unshard([spec.shard(w, r) for r in range(2)]), w)
