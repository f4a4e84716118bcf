"""``fxsplit.verify`` emulates the tp ranks' collectives in one process (fxsplit.tp.emulate); this
runs the same plans on 2 real gloo ranks, one launch for every layout family verify covers in
its own test file (MoE experts, multi-query and cross-attention, per-head score biases; merged
heads: tests/test_tp_merged_heads.py, already over gloo): the loss, the output and every gradient
(tp shards reassembled) of one real tp=2 step against one process, next to verify's own report on
the same model and plan, so the emulation and the real collectives are held to the same answer."""

import pytest
import torch
from torch import nn

import fxsplit
from fxsplit.testing import run_distributed
from fxsplit.testing.data import local_grads
from fxsplit.testing.trace_cache import SharedPlans, shared_plans

_HW = fxsplit.Hardware(link_bytes_per_s=float("inf"))


def _case(label):
    """(model, args, method) of one family case, built from its own test module, seeded."""
    family, variant, method = label.split("/")
    torch.manual_seed(0)
    if family == "moe":
        import test_tp_moe as m

        model = (m._MoE if variant.startswith("grouped") else m._BatchedMoE)(variant.endswith("transposed"))
        return model, (torch.randn(m.B, m.T, m.C),), method
    if family == "mqa":
        import test_tp_mqa as m

        return nn.Sequential(m._MultiQuery(variant), m._MultiQuery(variant)), (torch.randn(m.B, m.T, m.C),), method
    if family == "cross":
        import test_tp_cross_attention as m

        return m._EncoderDecoder(variant == "sdpa"), (torch.randn(m.B, m.S, m.C), torch.randn(m.B, m.T, m.C)), method
    import test_tp_score_bias as m

    return nn.Sequential(m._BiasedAttention(variant), m._BiasedAttention(variant)), (torch.randn(m.B, m.T, m.C),), method


CASES = ["moe/grouped/export", "moe/batched-transposed/fx", "mqa/expand/fx", "mqa/reshape/export",
         "cross/matmul/fx", "cross/sdpa/export", "bias/added/fx", "bias/sdpa_mask/export", "bias/alibi/export"]


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _target(out):
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(7))


# The launch prepares ([Note: preparing once per launch] in fxsplit.testing.harness): every case's model and
# its tp=2 plan, made once before the ranks fork; each rank takes its copy of the plans ([Note: plans made
# before the fork] in fxsplit.testing.trace_cache)
_BUILT: dict = {}  # label -> (model, args, method)
_PLANS = SharedPlans()


def _prepare():
    for label in CASES:
        model, args, method = _BUILT[label] = _case(label)
        _PLANS.add(model, args, tp=2, method=method, hardware=_HW, verify=False)


def _real_steps(rank, world):
    out = {}
    for label in CASES:
        model, args, method = _BUILT[label]
        y = _target(model(*args))
        with shared_plans(_PLANS) as plans:
            pm = fxsplit.parallelize(model, args, loss_fn=_mse, tp=2, method=method, hardware=_HW, timeout=60)
        assert plans.misses == 0, f"rank {rank} planned {label} itself: the plan made before the fork went unused"
        with torch.no_grad():
            output = pm(*args)
        loss = float(pm.step(*args, target=y))
        grads = local_grads(pm)
        out[label] = dict(loss=loss, output=output, grads=[grads], coords=dict(pm.coords),
                          specs=dict(pm.plan.tp_plan.param_specs), sharded=len(pm.plan.tp_plan.param_specs))
    return out


@pytest.mark.dist
def test_verified_families_train_alike_over_gloo():
    from test_parallelize import check_grads

    results = run_distributed(_real_steps, 2, timeout=400, prepare=(_prepare, ()))
    for label in CASES:
        model, args, method = _case(label)
        report = fxsplit.verify(model, args, fxsplit.plan(model, args, tp=2, hardware=_HW, method=method))
        assert report.max_gradient_error < 1e-4 and report.max_output_error < 1e-4, (label, report)
        ref_out = model(*args)
        ref_loss = _mse(ref_out, _target(ref_out))
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
        res = [r[label] for r in results]
        assert all(r["sharded"] > 0 for r in res), label  # tensor parallelism sharded something
        for rank, r in enumerate(res):
            assert r["loss"] == pytest.approx(float(ref_loss), rel=1e-5), (label, rank)
            torch.testing.assert_close(r["output"], ref_out.detach(), rtol=1e-5, atol=1e-6, msg=f"{label} rank {rank}")
        check_grads(res, [ref_grads], rtol=1e-5, atol=1e-6)
