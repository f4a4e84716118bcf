"""fp32 CPU matmuls of compiled graphs through oneDNN ([Note: CPU matmuls through oneDNN] in
fxsplit.runtime.compile.cpu_matmul): which nodes are routed, numerics against aten's, the switch, and a
compiled stage's F / I / W graphs routed against the same graphs unrouted."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fxsplit
from fxsplit.runtime.compile import cpu_matmul
from fxsplit.runtime.compile.compiling import CompiledGraph, compile_split
from fxsplit.runtime.compile.cpu_matmul import onednn_matmul_chosen, onednn_min_macs, onednn_mm, route_cpu_matmuls
from fxsplit.runtime.compile.split_graph import GraphSplit
from fxsplit.testing import zoo
from fxsplit.testing.stage_inputs import stage_inputs

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _f(x, w, b, dy, w64, small):
    y = torch.nn.functional.linear(x, w, b)  # addmm(b, x, w.t())
    gi = dy @ w  # mm, w not transposed
    gw = dy.t() @ x  # mm of a transposed view (a weight gradient)
    scaled = torch.addmm(b, x, w.t(), beta=2.0)  # beta != 1: aten's
    wide = w64 @ w64.t()  # float64: aten's
    tiny = small @ small  # 8 x 8 x 8
    return y, gi, gw, scaled, wide, tiny


def _inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(64, 48, generator=g), torch.randn(80, 48, generator=g) * 0.1, torch.randn(80, generator=g),
            torch.randn(64, 80, generator=g), torch.randn(32, 24, dtype=torch.float64, generator=g),
            torch.randn(8, 8, generator=g))


@needs_onednn
def test_routes_fp32_mm_and_linear_addmm_only_and_matches_aten():
    args = _inputs()
    gm = make_fx(_f, tracing_mode="fake")(*args)
    want = gm(*args)
    # a size threshold: linear's addmm and the two fp32 mm are 64 * 48 * 80 multiply-adds each
    assert route_cpu_matmuls(copy.deepcopy(gm), min_macs=64 * 48 * 80 + 1) == 0
    assert route_cpu_matmuls(gm, min_macs=64 * 48 * 80) == 3  # not the 8 x 8 x 8 one
    assert route_cpu_matmuls(gm, min_macs=0) == 1  # the 8 x 8 x 8 one
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(onednn_mm) == 4
    assert targets.count(torch.ops.aten.addmm.default) == 1 and targets.count(torch.ops.aten.mm.default) == 1
    got = gm(*args)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert route_cpu_matmuls(gm, min_macs=0) == 0  # nothing left to route


def test_the_switch(monkeypatch):
    monkeypatch.setenv("FXSPLIT_CPU_MATMUL", "aten")
    assert onednn_matmul_chosen() is False and onednn_min_macs() is None
    monkeypatch.setenv("FXSPLIT_CPU_MATMUL", "onednn")
    assert onednn_matmul_chosen() is torch.backends.mkldnn.is_available()
    assert onednn_min_macs() == (0 if torch.backends.mkldnn.is_available() else None)  # every size
    monkeypatch.setenv("FXSPLIT_CPU_MATMUL", "mkl")
    with pytest.raises(fxsplit.FxsplitError, match="FXSPLIT_CPU_MATMUL must be 'auto', 'onednn' or 'aten', got 'mkl'"):
        onednn_matmul_chosen()
    monkeypatch.setenv("FXSPLIT_CPU_MATMUL", "auto")  # a fact of the host, not the timing
    assert onednn_matmul_chosen() is (torch.backends.mkldnn.is_available() and cpu_matmul.mkl_on_non_intel_x86())
    assert onednn_min_macs() == (cpu_matmul.MIN_MACS if onednn_matmul_chosen() else None)
    faster, measured = cpu_matmul.probe()
    if torch.backends.mkldnn.is_available():
        assert isinstance(faster, bool) and "oneDNN" in measured and "aten" in measured  # both were timed


@pytest.mark.parametrize("machine, blas, cpuinfo, want", [
    ("x86_64", "BLAS_INFO=mkl", "vendor_id\t: AuthenticAMD\n", True),
    ("x86_64", "BLAS_INFO=mkl", "vendor_id\t: HygonGenuine\n", True),
    ("x86_64", "BLAS_INFO=mkl", "vendor_id\t: GenuineIntel\n", False),  # MKL's own kernels
    ("x86_64", "BLAS_INFO=open", "vendor_id\t: AuthenticAMD\n", False),  # not MKL
    ("aarch64", "BLAS_INFO=mkl", "vendor_id\t: AuthenticAMD\n", False),
    ("x86_64", "BLAS_INFO=mkl", None, False),  # no /proc/cpuinfo
])
def test_auto_is_mkl_on_a_non_intel_x86(monkeypatch, machine, blas, cpuinfo, want):
    import io

    def fake_open(path, *a, **k):
        assert path == "/proc/cpuinfo"
        if cpuinfo is None:
            raise FileNotFoundError(path)
        return io.StringIO("processor\t: 0\n" + cpuinfo)

    monkeypatch.setattr(cpu_matmul.platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.__config__, "show", lambda: f"  - Build settings: {blas}, BUILD_TYPE=Release")
    monkeypatch.setattr(cpu_matmul, "open", fake_open, raising=False)
    assert cpu_matmul.mkl_on_non_intel_x86.__wrapped__() is want


@needs_onednn
def test_compiled_graph_routes_a_copy_and_keeps_the_aten_graph_as_fallback(monkeypatch):
    args = _inputs()
    gm = make_fx(_f, tracing_mode="fake")(*args)
    monkeypatch.setenv("FXSPLIT_CPU_MATMUL", "onednn")
    fallbacks = []
    cg = CompiledGraph(gm, fallbacks.append)
    assert cg.onednn_matmuls == 4  # forced: every size
    assert not any(n.target is onednn_mm for n in gm.graph.nodes)  # the eager graph is untouched
    for g, w in zip(cg(*args), gm(*args)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert cg.compiled and fallbacks == []
    monkeypatch.setenv("FXSPLIT_CPU_MATMUL", "aten")
    assert CompiledGraph(gm, fallbacks.append).onednn_matmuls == 0


@needs_onednn
@pytest.mark.parametrize("mode", ["onednn", "aten"])
def test_compiled_stage_graphs_routed_match_the_eager_graphs(monkeypatch, mode):
    """The last stage of a two-layer GPT (a block, the head): its F, I and W graphs compiled
    with the matmuls routed (or not) against the same graphs run eagerly: outputs, input and
    weight gradients to rounding."""
    monkeypatch.setenv("FXSPLIT_CPU_MATMUL", mode)
    torch.manual_seed(0)
    model, args, kwargs = zoo.make("gpt", n_layer=2, batch_size=2, seq_len=16)
    plan = fxsplit.plan(model, args, kwargs, pp=2, schedule="1f1b", microbatches=2, split_points=("blocks.1",), cut_at="modules")
    gm = plan.stages.modules[-1]
    xs = stage_inputs(plan, args)[-1]
    params = [p for p in gm.parameters() if p.requires_grad]
    buffers = [b for _, b in gm.named_buffers()]
    eager, compiled = GraphSplit.trace(gm, xs), GraphSplit.trace(gm, xs)
    compile_split(compiled, lambda kind, why: pytest.fail(f"{kind} not compiled: {why}"))
    routed = {kind: r.onednn_matmuls for kind, r in compiled.runners.items()}
    if mode == "onednn":
        assert all(routed[k] > 0 for k in "FIW"), routed  # F: q/k/v, proj, MLP, head; I and W their gradients
    else:
        assert routed == {"F": 0, "I": 0, "W": 0}
    results = []
    for split in (eager, compiled):
        outs, state = split.forward(params, buffers, [t for t in xs if isinstance(t, torch.Tensor)])
        tangents = [torch.ones_like(outs[j]) for j in split.diff_outputs]
        results.append((outs[0], state.input_grads(params, buffers, tangents), state.weight_grads(params, buffers)))
    (out_e, ig_e, wg_e), (out_c, ig_c, wg_c) = results
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
    for a, b in zip(list(ig_c) + list(wg_c), list(ig_e) + list(wg_e), strict=True):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
