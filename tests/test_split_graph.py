"""The graph split backward (fxsplit.runtime.split_graph) in one process: a stage's forward, I and
W graphs give exactly the outputs and gradients of the stage run with autograd (bit for bit), with
activation checkpointing (full, selective: the recomputation runs once), with a weight used twice
on one path, with dropout (the same masks); a random recomputation is refused; and the graphs
are plain GraphModules torch.compile accepts."""

import pytest
import torch
from torch import nn

import fxsplit
from fxsplit.graph.ops import is_random
from fxsplit.runtime.split_graph import GraphSplit, UnsupportedStage
from fxsplit.testing import zoo

GPT = dict(n_layer=2, batch_size=2, seq_len=8)


def _stage_inputs(plan, args):
    """Each stage's inputs, run in order from the model inputs (received values: leaves that
    require a gradient where the plan says so, as the executor makes them)."""
    outs, inputs = {}, []
    for s, (gm, sio) in enumerate(zip(plan.stages.modules, plan.stages.io)):
        xs = [args[src.index] if src.stage is None else
              outs[src.stage][src.index].detach().requires_grad_(meta.requires_grad)
              for src, meta in zip(sio.inputs, sio.input_meta)]
        with torch.no_grad():
            o = gm(*xs)
        outs[s] = list(o) if isinstance(o, (tuple, list)) else [o]
        inputs.append(xs)
    return inputs


def _plan(mode, **overrides):
    model, args, kwargs = zoo.make("gpt", **GPT, **overrides)
    plan = fxsplit.plan(model, args, kwargs, pp=2, schedule="zb_h1", microbatches=2, activation_checkpointing=mode,
                        hardware=fxsplit.Hardware(link_bytes_per_s=float("inf")))
    return plan, _stage_inputs(plan, args)


def _split_vs_autograd(gm, inputs, seed=0):
    """Outputs, input and parameter gradients of the graph split and of autograd (each forward
    from RNG state ``seed``); the split."""
    split = GraphSplit.trace(gm, inputs)
    params = [p for p in gm.parameters() if p.requires_grad]
    buffers = [b for _, b in gm.named_buffers()]
    torch.manual_seed(seed)
    outs, state = split.forward(params, buffers, [x for x in inputs if isinstance(x, torch.Tensor)])
    torch.manual_seed(seed)
    ref = gm(*inputs)
    ref = list(ref) if isinstance(ref, (tuple, list)) else [ref]
    g = torch.Generator().manual_seed(7)
    tangents = [torch.randn(outs[j].shape, generator=g) for j in split.diff_outputs]
    got = state.input_grads(params, buffers, tangents) + state.weight_grads(params, buffers)
    want = torch.autograd.grad([ref[j] for j in split.diff_outputs], [inputs[k] for k in split.grad_inputs] + params,
                               tangents, allow_unused=True)
    return outs, [r.detach() for r in ref], got, list(want), split


def _assert_equal(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert torch.equal(a, b), f"gradient {i}: max diff {(a - b).abs().max()}"


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_gpt_stages_bit_equal_to_autograd(mode):
    plan, inputs = _plan(mode)
    assert set(plan.split.checkpointing) == {mode}
    for s, gm in enumerate(plan.stages.modules):
        outs, ref, got, want, split = _split_vs_autograd(gm, inputs[s])
        _assert_equal(outs, ref)
        _assert_equal(got, want)
        if s == 0:  # the first stage's input (token ids) takes no gradient: all of it is W
            assert split.grad_inputs == [] and len(split.input_graph.graph.nodes) == 1
        else:  # I hands W the gradients reaching the weights
            assert split.grad_inputs and split.n_carry > 0
        # the recomputation is in the backward graphs, once: I and W hold at most as many layer
        # norms as the forward (every block's two; recomputed by both halves would be twice that)
        norms = [sum(n.target is torch.ops.aten.native_layer_norm.default for n in g.graph.nodes)
                 for g in (split.forward_graph, split.input_graph, split.weight_graph)]
        assert (0 < norms[1] + norms[2] <= norms[0]) if mode != "none" else norms[1] + norms[2] == 0, norms


class TwiceOnOnePath(nn.Module):
    """``W`` used twice on the input's path (pytorch#180952), plus a bias only W reaches."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.b = nn.Parameter(torch.randn(8))

    def forward(self, x):
        h = torch.tanh(x @ self.w + self.b)
        return (h @ self.w).sin()


def test_weight_used_twice_on_one_path_counted_once():
    m = TwiceOnOnePath()
    x = torch.randn(4, 8, requires_grad=True)
    outs, ref, got, want, split = _split_vs_autograd(m, [x])
    _assert_equal(outs, ref)
    _assert_equal(got, want)
    assert split.param_ids == [0, 1]


def test_random_recomputation_is_refused():
    """Dropout inside a full-checkpointed region: the recomputation would draw new numbers in a
    graph, so the stage is refused (the executor then runs it on the autograd split)."""
    plan, inputs = _plan("full", dropout=0.1)
    with pytest.raises(UnsupportedStage, match="recomputes a random op"):
        GraphSplit.trace(plan.stages.modules[1], inputs[1])


def test_forward_i_and_w_graphs_compile():
    """The three graphs are plain aten GraphModules: torch.compile (inductor, CPU) runs them to the
    same numbers (within fp reassociation: inductor fuses and reorders). In a process of its own:
    dynamo's state after a compile breaks later fx tracing in the same process (pipe_split), and
    earlier tests' state breaks the compile."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    code = "import tests.test_split_graph as t; t._compile_check()"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _compile_check():
    m = TwiceOnOnePath()
    x = torch.randn(4, 8, requires_grad=True)
    split = GraphSplit.trace(m, [x])
    params = [m.w, m.b]
    tangents = [torch.randn(4, 8)]
    for compiled in (False, True):
        graphs = (split.forward_graph, split.input_graph, split.weight_graph)
        if compiled:
            graphs = tuple(torch.compile(g, backend="inductor", fullgraph=True) for g in graphs)
        with torch.no_grad():
            res = graphs[0](*params, x)
            saved = list(res[split.n_outputs:])
            src = {"p": params, "x": [x], "t": tangents, "s": saved}
            i_out = graphs[1](*[src[k][i] for k, i in split.i_inputs])
            src["c"] = list(i_out[len(split.grad_inputs):])
            w_out = graphs[2](*[src[k][i] for k, i in split.w_inputs])
        got = [res[0], *i_out[:len(split.grad_inputs)], *w_out]
        if not compiled:
            eager = got
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_forward_graph_draws_the_modules_dropout_masks():
    """Without checkpointing, dropout runs in the forward graph only (its mask is saved): from one
    RNG state the graph draws what the module draws, so the stage streams replay alike."""
    plan, inputs = _plan("none", dropout=0.2, attn_dropout=0.2)
    for s, gm in enumerate(plan.stages.modules):
        outs, ref, got, want, split = _split_vs_autograd(gm, inputs[s], seed=5)
        assert any(is_random(n) for n in split.forward_graph.graph.nodes)
        _assert_equal(outs, ref)
        _assert_equal(got, want)
