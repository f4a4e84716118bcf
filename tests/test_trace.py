"""fxsplit.trace: both frontends, metadata contract, meta-device models, errors."""

import sympy
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxsplit
import fxsplit.graph.symbolic
import fxsplit.graph.trace
from fxsplit.testing import zoo
from fxsplit.graph.meta import NodeInfo, TensorMeta, TraceInfo, tensor_metas


def _outputs_equal(a, b):
    fa, sa = torch.utils._pytree.tree_flatten(a)
    fb, sb = torch.utils._pytree.tree_flatten(b)
    assert len(fa) == len(fb)
    for x, y in zip(fa, fb):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
        else:
            assert x == y


def _check_metadata(gm):
    info = gm.meta["fxsplit"]
    assert isinstance(info, TraceInfo)
    for node in gm.graph.nodes:
        ni = node.meta["fxsplit"]
        assert isinstance(ni, NodeInfo), node
        assert ni.cost is not None, node
        if isinstance(node.meta.get("val"), torch.Tensor):
            assert len(ni.outputs) == 1 and ni.outputs[0].dtype == node.meta["val"].dtype


def test_tensor_meta_validates_and_counts_symbolically():
    s = sympy.Symbol("s0", positive=True, integer=True)
    m = TensorMeta((s, 4), torch.float16, True)
    assert m.numel == 4 * s and m.nbytes == 8 * s and m.is_symbolic and str(m) == "float16[s0, 4]"
    assert m.concrete_shape({"s0": 3}) == (3, 4)
    assert TensorMeta((2, 3), torch.int64).nbytes == 48
    with pytest.raises(ValueError, match=r"requires_grad=True needs a floating or complex dtype, got dtype=torch.int64"):
        TensorMeta((2,), torch.int64, True)
    with pytest.raises(TypeError, match=r"shape\[1\] must be an int or a sympy expression, got 2.5"):
        TensorMeta((2, 2.5), torch.float32)
    with pytest.raises(TypeError, match="must be a tuple"):
        TensorMeta([2], torch.float32)
    with pytest.raises(ValueError, match=r"shape\[0\] must be >= 0, got -1"):
        TensorMeta((-1,), torch.float32)
    with pytest.raises(TypeError, match="torch.dtype"):
        TensorMeta((2,), "float32")
    # a node value: tensors in lists, tuples and dicts; ShapeProp's TensorMetadata; non-tensors skipped
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(3, 2)))
    torch.fx.passes.shape_prop.ShapeProp(gm).propagate(torch.randn(4, 3))
    (out,) = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert tensor_metas(out.meta["tensor_meta"]) == (TensorMeta((4, 2), torch.float32, True),)
    val = {"a": torch.zeros(2), "b": [torch.zeros(1, dtype=torch.int64), 3], "c": None}
    assert tensor_metas(val) == (TensorMeta((2,), torch.float32), TensorMeta((1,), torch.int64))


@pytest.mark.parametrize("name", zoo.ZOO_NAMES)
@pytest.mark.parametrize("method", ["fx", "export"])
def test_zoo_models_trace_and_reproduce(name, method):
    model, args, kwargs = zoo.make(name)
    gm = fxsplit.trace(model, args, kwargs, method=method)
    assert gm.meta["fxsplit"].method == method
    _check_metadata(gm)
    _outputs_equal(gm(*args, **kwargs), model(*args, **kwargs))


def test_fx_metadata_module_paths_and_params():
    model, args, kwargs = zoo.make("gpt")
    gm = fxsplit.trace(model, args, kwargs, method="fx")
    by_name = {n.target: n for n in gm.graph.nodes if n.op == "call_module"}
    q = by_name["blocks.0.attn.q"]
    info = q.meta["fxsplit"]
    assert info.module_path == "blocks.0.attn.q"
    assert set(info.params) == {"blocks.0.attn.q.weight", "blocks.0.attn.q.bias"}
    # nodes inside a block's forward (not modules themselves) carry the block's path
    paths = {n.meta["fxsplit"].module_path for n in gm.graph.nodes if n.op == "call_function"}
    assert any(p.startswith("blocks.1.attn") for p in paths)
    # output shape is symbolic in batch and sequence
    sym = gm.meta["fxsplit"].symbols
    assert set(sym) >= {"batch", "seq"}
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    shape = out.meta["fxsplit"].outputs[0].shape
    assert shape[0] == sym["batch"] and shape[1] == sym["seq"]


def test_export_metadata_same_kind_as_fx():
    model, args, kwargs = zoo.make("gpt")
    gm = fxsplit.trace(model, args, kwargs, method="export")
    linears = [n for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    assert linears
    q = [n for n in linears if n.meta["fxsplit"].module_path == "blocks.0.attn.q"]
    assert len(q) == 1
    assert "blocks.0.attn.q.weight" in q[0].meta["fxsplit"].params
    flops = q[0].meta["fxsplit"].cost.flops
    assert isinstance(flops, sympy.Expr) and flops.free_symbols


def test_symbolic_graph_serves_other_batch_sizes():
    model, args, kwargs = zoo.make("gpt")
    for method in ("fx", "export"):
        gm = fxsplit.trace(model, args, kwargs, method=method)
        idx = torch.randint(0, model.config.vocab_size, (args[0].shape[0] + 3, args[0].shape[1] - 2))
        torch.testing.assert_close(gm(idx), model(idx))
        info = gm.meta["fxsplit"]
        b = info.symbols["batch"]
        assert info.bindings(batch=7) == {b: 7}


def test_auto_prefers_fx_and_says_why():
    model, args, kwargs = zoo.make("mlp")
    gm = fxsplit.trace(model, args, kwargs)
    assert gm.meta["fxsplit"].method == "fx"
    assert "fx" in gm.meta["fxsplit"].reason


def test_leaf_modules_stay_single_nodes():
    model, args, kwargs = zoo.make("gpt")
    gm = fxsplit.trace(model, args, kwargs, method="fx", leaf_modules=["blocks.0"])
    targets = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert "blocks.0" in targets and not any(str(t).startswith("blocks.0.") for t in targets)
    _outputs_equal(gm(*args), model(*args))


def test_meta_model_traces_without_compute():
    with torch.device("meta"):
        model, args, kwargs = zoo.make("gpt")
    assert all(p.is_meta for p in model.parameters())
    args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
    for method in ("fx", "export"):
        gm = fxsplit.trace(model, args, kwargs, method=method)
        assert gm.meta["fxsplit"].on_meta
        _check_metadata(gm)


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), _Branchy())

    def forward(self, x):
        return self.inner(x)


class _Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return x * 2
        return x


def test_untraceable_model_error_names_module_line_and_fix():
    model = _DataDependent()
    with pytest.raises(fxsplit.TraceError) as ei:
        fxsplit.trace(model, (torch.randn(2, 4),), method="fx")
    msg = str(ei.value)
    assert "'inner.1'" in msg and "if x.sum() > 0" in msg
    assert "leaf_modules=['inner.1']" in msg and 'method="export"' in msg
    with pytest.raises(fxsplit.TraceError) as ei:
        fxsplit.trace(model, (torch.randn(2, 4),), method="auto")
    assert "torch.fx could not trace" in str(ei.value) and "torch.export could not trace" in str(ei.value)
    assert 'Fix: trace with method="fx" and leaf_modules=[...] naming the module' in str(ei.value)  # no cache hint: no "or"
    # the fix the message suggests works
    gm = fxsplit.trace(model, (torch.randn(2, 4),), method="fx", leaf_modules=["inner.1"])
    x = torch.randn(2, 4)
    torch.testing.assert_close(gm(x), model(x))


def test_bad_inputs_get_clear_errors():
    model, args, kwargs = zoo.make("mlp")
    with pytest.raises(TypeError, match="expects a torch.nn.Module"):
        fxsplit.trace(lambda x: x, args)
    with pytest.raises(TypeError, match="do not match MLP.forward"):
        fxsplit.trace(model, (args[0], args[0]))
    with pytest.raises(ValueError, match="method must be one of"):
        fxsplit.trace(model, args, method="jit")
    with pytest.raises(ValueError, match="no module named 'layer.0'"):
        fxsplit.trace(model, args, method="fx", leaf_modules=["layer.0"])
    with pytest.raises(TypeError, match="example_kwargs"):
        fxsplit.trace(model, args, example_kwargs=[1])


class _DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, x, scale: float = 1.0):
        y = self.a(x) * scale
        return {"y": y, "pair": (y.relu(), x)}


@pytest.mark.parametrize("method", ["fx", "export"])
def test_structured_outputs_and_default_arguments(method):
    model = _DictOut()
    x = torch.randn(2, 4)
    gm = fxsplit.trace(model, (x,), method=method)
    out = gm(x)
    assert isinstance(out, dict) and isinstance(out["pair"], tuple)
    _outputs_equal(out, model(x))
    assert gm.meta["fxsplit"].input_names == ("x",)
    flat = fxsplit.graph.trace.flatten_inputs(gm, (x,))
    assert len(flat) == 1


@pytest.mark.hf
@pytest.mark.parametrize("builder", ["tiny_gpt2", "tiny_llama", "tiny_bert", "tiny_qwen2"])
def test_hf_models_trace_with_export(builder):
    from fxsplit.testing import hf_zoo

    model, args, kwargs = getattr(hf_zoo, builder)()
    model.eval()
    gm = fxsplit.trace(model, args, kwargs)
    info = gm.meta["fxsplit"]
    assert info.method == "export" and "torch.fx failed" in info.reason
    _check_metadata(gm)
    out, ref = gm(*args, **kwargs), model(*args, **kwargs)
    assert type(out) is type(ref)  # HF ModelOutput structure comes back
    _outputs_equal(out, ref)


@pytest.mark.hf
def test_hf_cache_is_turned_off_for_export_and_restored():
    from fxsplit.testing import hf_zoo

    model, args, kwargs = hf_zoo.tiny_gpt2()
    model.config.use_cache = True
    gm = fxsplit.trace(model, args, kwargs, method="export")
    assert "use_cache=False" in gm.meta["fxsplit"].reason
    assert model.config.use_cache is True


def test_symbolic_batch_survives_a_matmul_that_loses_it(monkeypatch):
    """[Note: symbolic matmul on torch 2.11]: where the C++ matmul fixes the batch symbol (torch
    2.11, the GPU machines'), fake propagation routes matmul / @ / F.linear through torch's Python
    decomposition. Forced here (this torch's probe passes): the symbols stay and the shapes match."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(8, 16, bias=False)
            self.w = nn.Parameter(torch.randn(16, 4))

        def forward(self, x):
            h = self.up(x) @ self.w
            h = F.scaled_dot_product_attention(h, h, h, is_causal=True)  # 3-D: no heads dim
            return F.linear(h, torch.ones(3, 4), torch.zeros(3)) * x.shape[-1] ** -0.5

    x = torch.randn(2, 5, 8)
    plain = fxsplit.trace(Net(), (x,))
    monkeypatch.setattr(fxsplit.graph.symbolic, "_matmul_keeps_symbols", lambda: False)
    calls = []
    real = fxsplit.graph.symbolic._PythonMatmul.__torch_function__
    monkeypatch.setattr(fxsplit.graph.symbolic._PythonMatmul, "__torch_function__",
                        lambda self, func, *a, **k: calls.append(func) or real(self, func, *a, **k))
    routed = fxsplit.trace(Net(), (x,))
    assert {torch.nn.functional.linear, torch.Tensor.matmul, F.scaled_dot_product_attention} <= set(calls)  # `@`: Tensor.matmul
    assert set(routed.meta["fxsplit"].symbols) == {"batch"} == set(plain.meta["fxsplit"].symbols)
    shapes = lambda gm: [str(n.meta["val"].shape) if isinstance(n.meta.get("val"), torch.Tensor) else n.meta.get("val")
                         for n in gm.graph.nodes]
    assert shapes(routed) == shapes(plain)
    # a static size read off x.shape is recorded as a number (torch 2.11's FakeTensorProp records none)
    assert 8 in [n.meta.get("val") for n in routed.graph.nodes if isinstance(n.meta.get("val"), int)]
    assert fxsplit.graph.trace._numbers_kept((4, 8), (None, None)) == (4, 8)
    assert fxsplit.graph.trace._numbers_kept(8, None) == 8


class _Rotary(nn.Module):
    """A rotary table computed under ``@torch.no_grad()`` from a buffer and the positions, as
    transformers 5.17's rotary embeddings do, feeding a linear; ``on_activation`` puts a no_grad
    block over an activation instead (which must stay a block)."""

    def __init__(self, on_activation: bool = False):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (100 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)
        self.proj = nn.Linear(8, 8)
        self.on_activation = on_activation

    @torch.no_grad()
    def table(self, x):
        if self.on_activation:
            return (x * 2,)
        pos = torch.arange(x.shape[1], device=x.device).float()
        freqs = pos[:, None] * self.inv_freq[None, :]  # (T, 4)
        return torch.cat([freqs.cos(), freqs.sin()], -1), freqs

    def forward(self, x):
        h = self.proj(x)
        return h * self.table(h)[0]


@pytest.mark.parametrize("on_activation", [False, True], ids=["buffer-and-positions", "activation"])
def test_no_grad_blocks_over_gradient_free_inputs_are_inlined(on_activation):
    """[Note: no_grad blocks inlined]: export's ``wrap_with_set_grad_enabled`` over a buffer and the
    positions becomes the main graph's ops (the passes rewrite those); one over an activation stays;
    outputs and gradients equal the model's either way."""
    hop = torch.ops.higher_order.wrap_with_set_grad_enabled
    torch.manual_seed(0)
    model, x = _Rotary(on_activation), torch.randn(2, 6, 8)
    gm = fxsplit.trace(model, (x,), method="export")
    kept = [n for n in gm.graph.nodes if n.target is hop]
    assert len(kept) == (1 if on_activation else 0), gm.code
    if not on_activation:
        assert {"cos", "sin"} <= {str(n.target).split(".")[-2] for n in gm.graph.nodes if n.op == "call_function"}
    gm.graph.lint()
    out, ref = gm(x), model(x)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    out.sum().backward()
    got = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    ref.sum().backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(got[k], p.grad, rtol=0, atol=0)


def test_meta_model_read_by_cpu_indices_exports_where_fake_embedding_refuses_the_pair(monkeypatch):
    """[Note: a meta model read by CPU indices] in fxsplit.graph.export: forced here (this torch's fake
    embedding accepts the pair): the export of a meta model runs preferring meta outputs, and an
    embedding of the meta weight with CPU ids traces to a meta value of the right shape."""
    import fxsplit.graph.export as export

    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 4))
    monkeypatch.setattr(export, "_meta_embedding_refused", lambda: True)
    seen = []
    real = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: seen.append(
        torch._functorch.config.fake_tensor_prefer_device_type) or real(*a, **k))
    gm = fxsplit.trace(model, (torch.randint(0, 32, (2, 5)),), method="export")
    assert seen and set(seen) == {"meta"}, seen
    assert torch._functorch.config.fake_tensor_prefer_device_type is None
    emb = next(n for n in gm.graph.nodes if "embedding" in str(n.target))
    assert emb.meta["val"].device.type == "meta" and tuple(emb.meta["val"].shape)[1:] == (5, 8)


def test_export_keeps_source_lines_only_when_asked():
    """[Note: no stack traces by default]: torch.export's per-node source lines are left out of
    fxsplit's exports (a quarter of an export's time), kept with ``stack_traces=True``; torch's
    own setting is as it was after either."""
    model, args, _ = zoo.make("gpt", n_layer=2, batch_size=2, seq_len=8)
    before = torch.fx.config.do_not_emit_stack_traces

    def sourced(gm):
        return [n for n in gm.graph.nodes if n.op == "call_function" and "fxsplit/testing/zoo.py" in (n.meta.get("stack_trace") or "")]

    plain = fxsplit.trace(model, args, method="export")
    assert torch.fx.config.do_not_emit_stack_traces == before
    kept = fxsplit.trace(model, args, method="export", stack_traces=True)
    assert torch.fx.config.do_not_emit_stack_traces == before
    assert not sourced(plain), [n.meta["stack_trace"] for n in sourced(plain)][:2]
    lines = sourced(kept)
    assert len(lines) > len(kept.graph.nodes) // 2
