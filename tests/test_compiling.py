"""torch.compile of stage graphs ([Note: compiled stages] in fxsplit.runtime.compile.compiling), in one
process: what a compile leaves behind for later tracing, and the runners' shapes."""

import inspect

import pytest
import torch
import torch.fx
from torch import nn
from torch._dynamo.utils import counters
from torch.fx._symbolic_trace import Tracer

from fxsplit.graph.marker import find_pipe_splits, pipe_split
from fxsplit.runtime.compile.compiling import (compile_split, full_backward, fused_backward_graph, inference_graph,
                                       inference_runner)
from fxsplit.runtime.options import RuntimeOptions
from fxsplit.runtime.runners import CompiledRunner
from fxsplit.runtime.compile.split_graph import GraphSplit
from fxsplit.testing import zoo
from test_split_graph import TwiceOnOnePath  # a weight used twice on one path, plus a bias only W reaches


class _Marked(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        x = self.a(x)
        pipe_split()
        return self.b(x)


def test_pipe_split_is_traced_after_a_compile():
    """[Note: Tracer.trace under dynamo]: after a torch.compile has run in the process, dynamo has
    wrapped Tracer.trace for good; a pipe_split() under symbolic tracing is still one marker node."""
    f = torch.compile(lambda x: x.sin() + 1, backend="eager", fullgraph=True)
    torch.testing.assert_close(f(torch.ones(3)), torch.ones(3).sin() + 1)
    assert Tracer.trace is not inspect.unwrap(Tracer.trace)  # the state the test is about
    gm = torch.fx.symbolic_trace(_Marked())
    assert len(find_pipe_splits(gm)) == 1


def _stages():
    """(module, inputs): a weight used twice on one path, and one GPT block (zoo)."""
    torch.manual_seed(0)
    model, _, _ = zoo.make("gpt", n_layer=1, n_embd=32, n_head=4, seq_len=8, batch_size=2)
    return [(TwiceOnOnePath(), [torch.randn(4, 8, requires_grad=True)]),
            (model.blocks[0], [torch.randn(2, 8, 32, requires_grad=True)])]


def _split_run(split, module, inputs, tangents, *, fused):
    params = [p for p in module.parameters() if p.requires_grad]
    buffers = [b for _, b in module.named_buffers()]
    outs, state = split.forward(params, buffers, inputs)
    if fused:
        ins, ws = full_backward(state, params, buffers, tangents)
    else:
        ins, ws = state.input_grads(params, buffers, tangents), state.weight_grads(params, buffers)
    return outs + ins + ws


def test_fused_backward_is_i_then_w():
    """[Note: fused backward]: the one backward graph computes what I then W compute, bit for bit
    uncompiled, and compiled (inductor) to rounding; its carry never leaves the graph."""
    for module, inputs in _stages():
        split = GraphSplit.trace(module, inputs)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            outs = module(*inputs)
        tangents = [torch.randn(outs.shape, generator=g)]
        want = _split_run(split, module, inputs, tangents, fused=False)
        gm, sources = fused_backward_graph(split)
        assert not any(kind == "c" for kind, _ in sources)
        split.b_inputs, split.b_calls, split.runners = sources, [], {"B": gm}
        got = _split_run(split, module, inputs, tangents, fused=True)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert (a is None and b is None) or torch.equal(a, b)
        fallbacks = {}
        split = GraphSplit.trace(module, inputs)
        compile_split(split, lambda kind, why: fallbacks.setdefault(kind, why), fused=True)
        assert sorted(split.runners) == ["B", "F"]
        got = _split_run(split, module, inputs, tangents, fused=True)
        assert fallbacks == {} and all(r.compiled for r in split.runners.values()), fallbacks
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_inference_graph_is_the_forward():
    """[Note: compiled inference]: the F graph cut to the stage outputs computes the module's
    output (bit for bit uncompiled, to rounding compiled) without the saved values; a stage that
    draws random numbers has no compiled inference graph, with the reason."""
    for module, inputs in _stages():
        inputs = [x.detach() for x in inputs]
        split = GraphSplit.trace(module, inputs)
        gm = inference_graph(split)
        params = [p for p in module.parameters() if p.requires_grad]
        with torch.no_grad():
            want = module(*inputs)
            got = gm(*params, *inputs)
        assert len(got) == 1 and torch.equal(got[0], want)
        assert split.n_saved > 0 and len(list(gm.graph.nodes)) < len(list(split.forward_graph.graph.nodes))
        run = inference_runner(split, lambda why: pytest.fail(why))
        before = dict(counters["stats"])
        torch.testing.assert_close(run(params, [], inputs)[0], want, rtol=1e-5, atol=1e-6)
        for _ in range(2):  # compiled once: no recompile, no graph break on later calls
            torch.testing.assert_close(run(params, [], inputs)[0], want, rtol=1e-5, atol=1e-6)
        assert run.compiled.compiled
        assert counters["stats"]["unique_graphs"] - before.get("unique_graphs", 0) == 1
    refused = []
    drop = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1))
    assert inference_runner(GraphSplit.trace(drop, [torch.randn(4, 8)]), refused.append) is None
    assert "draws random numbers" in refused[0]


def _loss_runner(loss_fn):
    """The last stage's compiled runner alone ([Note: compiled loss])."""
    options = RuntimeOptions(group=None, loss_fn=loss_fn, device="cpu", compile=True)
    return CompiledRunner(3, nn.Identity(), options, splits=False, last=True)


def test_compiled_loss_follows_python_state_and_differentiates():
    """[Note: compiled loss]: a loss reading a Python value that changes between steps gives the
    eager loss and gradient at every step (dynamo's guards), through the compiled function."""
    scale = {"w": 1.0}

    def loss_fn(out, y):
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)) * scale["w"]

    caller = _loss_runner(loss_fn)
    torch.manual_seed(0)
    out, y = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    for w in (1.0, 3.0):
        scale["w"] = w
        leaf = out.detach().requires_grad_()
        got = caller.loss(leaf, y, training=True)
        (g,) = torch.autograd.grad(got, [leaf])
        ref_leaf = out.detach().requires_grad_()
        want = loss_fn(ref_leaf, y)
        want.backward()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(g, ref_leaf.grad, rtol=1e-6, atol=1e-7)
    assert caller.compiled_loss is not None and caller.compile_fallbacks == {}


def test_compiled_loss_error_is_the_eager_one():
    """An error inside loss_fn: dynamo's exception is not what the user sees; the loss falls back to
    eager (reason recorded) and the eager call raises loss_fn's own error."""
    caller = _loss_runner(lambda out, y: torch.nn.functional.cross_entropy(out, y))
    with pytest.raises((RuntimeError, ValueError)) as info:
        caller.loss(torch.randn(4, 7, requires_grad=True), torch.zeros(5, dtype=torch.long), training=True)
    assert not isinstance(info.value, torch._dynamo.exc.TorchDynamoException), type(info.value)
    assert "loss_fn" in caller.compile_fallbacks["loss"]
    # outside training (or compile=False) the loss is never compiled
    assert caller.loss(torch.randn(4, 7), torch.zeros(4, dtype=torch.long), training=False).ndim == 0


def test_a_compile_fallback_keeps_the_whole_exception_text(monkeypatch):
    """compile_fallbacks keeps dynamo's whole message: inductor's first line often says only that
    compiling failed, and the cause follows on later lines; and names where the innermost cause was
    raised (inductor's wrapper says "raised: TypeError ..." and not where)."""
    from fxsplit.runtime.compile.compiling import CompiledGraph

    def deep_in_the_compiler():
        return None > None

    def refusing_compile(fn, **kwargs):
        def run(*args):
            try:
                deep_in_the_compiler()
            except TypeError as exc:
                raise torch._dynamo.exc.TorchRuntimeError("backend='inductor' raised:\nthe cause, on line two\nand three") from exc
        return run

    monkeypatch.setattr(torch, "compile", refusing_compile)
    why = []
    graph = CompiledGraph(lambda x: x * 2, why.append, whole=False, name="loss_fn")
    assert torch.equal(graph(torch.ones(2)), torch.full((2,), 2.0))  # eagerly, as without compile
    line = deep_in_the_compiler.__code__.co_firstlineno + 1
    assert why == ["torch.compile refused loss_fn (TorchRuntimeError: backend='inductor' raised:\n"
                   "the cause, on line two\nand three [TypeError raised at "
                   f"{__file__}:{line} in deep_in_the_compiler])"], why
