"""The graph split backward (fxsplit.runtime.compile.split_graph) in one process: a stage's forward, I and
W graphs give exactly the outputs and gradients of the stage run with autograd (bit for bit), with
activation checkpointing (full, selective: the recomputation runs once), with a weight used twice
on one path, with dropout (the same masks); a random recomputation is refused; and the graphs
are plain GraphModules torch.compile accepts."""

from collections import Counter

import pytest
import torch
from torch import nn

import fxsplit
from fxsplit.graph.ops import is_random
from fxsplit.runtime.compile.split_graph import GraphSplit, UnsupportedStage, accumulate_grads
from fxsplit.testing import zoo
from fxsplit.testing.stage_inputs import stage_inputs

GPT = dict(n_layer=2, batch_size=2, seq_len=8)


def _plan(mode, **overrides):
    model, args, kwargs = zoo.make("gpt", **GPT, **overrides)
    plan = fxsplit.plan(model, args, kwargs, pp=2, schedule="zb_h1", microbatches=2, activation_checkpointing=mode,
                        hardware=fxsplit.Hardware(link_bytes_per_s=float("inf")))
    return plan, stage_inputs(plan, args)


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


def test_a_selective_split_leaves_later_compiles_untagged():
    """[Note: selective checkpoint tags leak]: tracing a selectively checkpointed stage leaves
    torch.fx's global node meta as it was, so a torch.compile after it in the process still
    partitions its backward (it raised "'>' not supported between instances of 'NoneType' and
    'NoneType'" in AOTAutograd, and compile=True fell back to eager)."""
    before = dict(torch.fx.traceback.current_meta)
    plan, inputs = _plan("selective")
    GraphSplit.trace(plan.stages.modules[0], inputs[0])
    assert torch.fx.traceback.current_meta == before
    torch._dynamo.reset()
    fn = torch.compile(lambda x: (x.sin() * 3).sum(), backend="aot_eager", fullgraph=True)
    x = torch.randn(4, requires_grad=True)
    fn(x).backward()
    torch.testing.assert_close(x.grad, 3 * x.detach().cos())


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


class _AliasedGrad(nn.Module):
    """A parameter whose gradient is the tangent itself (added at the output), beside a linear's
    and a layer norm's (whose weight gradients reach W as elements of I's carry)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.full = nn.Parameter(torch.randn(3, 4))
        self.ln = nn.LayerNorm(4)

    def forward(self, x):
        return self.ln(self.lin(x)) + self.full


def test_weight_grads_kept_without_a_copy_only_where_the_graph_owns_them():
    """[Note: stolen gradients]: the linear's W outputs become ``.grad`` as they are; the
    tangent-aliasing gradient and the carried layer-norm ones are copied; the values are
    autograd's bit for bit, and a second accumulation adds in place."""
    torch.manual_seed(0)
    m, x = _AliasedGrad(), torch.randn(3, 4, requires_grad=True)
    split = GraphSplit.trace(m, [x])
    names = [n for n, p in m.named_parameters()]
    assert dict(zip(names, split.w_owned)) == {"full": False, "lin.weight": True, "lin.bias": True,
                                               "ln.weight": False, "ln.bias": False}
    params = list(m.parameters())
    want = torch.autograd.grad(m(x), params, torch.ones(3, 4))
    for rep in (1, 2):
        _, state = split.forward(params, [], [x])
        tangent = torch.ones(3, 4)
        state.input_grads(params, [], [tangent])
        grads = state.weight_grads(params, [])
        accumulate_grads(params, grads, split.w_owned)
        if rep == 1:
            assert [p.grad is g for p, g in zip(params, grads)] == split.w_owned
            assert m.full.grad.data_ptr() != tangent.data_ptr()
            tangent.add_(1.0)  # the caller's tangent changing does not reach .grad
        for p, w in zip(params, want):
            assert torch.equal(p.grad, rep * w)


def test_selective_checkpointing_with_cpu_dropout_is_refused():
    """CPU dropout writes its mask in place (bernoulli_), which torch's selective checkpoint
    refuses under tracing: the stage is refused with the reason (the executor then raises for a
    selective stage rather than run each region's backward twice)."""
    plan, inputs = _plan("selective", dropout=0.1)
    with pytest.raises(UnsupportedStage, match="selective activation checkpoint has been mutated"):
        GraphSplit.trace(plan.stages.modules[0], inputs[0])


@pytest.mark.parametrize("mode", ["full"])
def test_random_recomputation_replays_the_forward_draw(mode):
    """Dropout inside a checkpointed region: the backward's recomputation draws from the
    generator state the forward drew from ([Note: random recomputation]), so outputs and every
    gradient equal autograd's (whose checkpoint restores the RNG state) and, stage by stage, the
    same stage without checkpointing, bit for bit; the caller's generator is left as it was."""
    drop = dict(dropout=0.1, attn_dropout=0.1)
    plan, inputs = _plan(mode, **drop)
    plain, _ = _plan("none", **drop)
    assert [len(io.outputs) for io in plain.stages.io] == [len(io.outputs) for io in plan.stages.io]
    for s, gm in enumerate(plan.stages.modules):
        outs, ref, got, want, split = _split_vs_autograd(gm, inputs[s], seed=5)
        _assert_equal(outs, ref)
        _assert_equal(got, want)
        replays = [n for n in split.input_graph.graph.nodes if "replay_rng" in str(n.target)]
        replays += [n for n in split.weight_graph.graph.nodes if "replay_rng" in str(n.target)]
        assert replays, f"stage {s}: no dropout recomputed"
        torch.manual_seed(11)
        before = torch.get_rng_state()
        params = [p for p in gm.parameters() if p.requires_grad]
        _, state = split.forward(params, [], [x for x in inputs[s] if isinstance(x, torch.Tensor)])
        after_forward = torch.get_rng_state()
        state.input_grads(params, [], [torch.ones_like(o) for o in outs])
        state.weight_grads(params, [])
        assert torch.equal(torch.get_rng_state(), after_forward) and not torch.equal(before, after_forward)
        p_outs, _, p_got, _, _ = _split_vs_autograd(plain.stages.modules[s], inputs[s], seed=5)  # same inputs
        _assert_equal(outs, p_outs)
        _assert_equal(got, p_got)


def test_forward_i_and_w_graphs_compile():
    """The runtime's compiled graphs ([Note: compiled stages]): compile_split gives the F, I and W
    graphs torch.compile'd runners (inductor, CPU) that run to the uncompiled split's outputs and
    gradients (within fp reassociation: inductor fuses and reorders); a graph that draws random
    numbers or calls Python between its ops is not compiled, with the reason. In process: a
    compile no longer breaks later fx tracing ([Note: Tracer.trace under dynamo] in
    fxsplit.graph.marker; tests/test_compiling.py)."""
    _compile_check()


def _compile_check():
    from fxsplit.runtime.compile.compiling import compile_split

    m = TwiceOnOnePath()
    x = torch.randn(4, 8, requires_grad=True)
    params = [m.w, m.b]
    tangents = [torch.randn(4, 8)]
    results, fallbacks = [], {}
    for compiled in (False, True):
        split = GraphSplit.trace(m, [x])
        if compiled:
            compile_split(split, lambda kind, why: fallbacks.setdefault(kind, why))
        outs, state = split.forward(params, [], [x])
        results.append(outs + state.input_grads(params, [], tangents) + state.weight_grads(params, []))
    assert fallbacks == {} and sorted(split.runners) == ["F", "I", "W"], fallbacks
    assert all(r.compiled for r in split.runners.values())
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for module, want in ((nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1)), {"F": "draws random numbers"}),
                         (TPStreamDropout(True), {"F": "enter_tp_stream", "I": "replay_rng"})):
        refused = {}
        compile_split(GraphSplit.trace(module, [x]), lambda kind, why: refused.setdefault(kind, why))
        for kind, text in want.items():
            assert text in refused.get(kind, ""), refused


def test_forward_graph_draws_the_modules_dropout_masks():
    """Without checkpointing, dropout runs in the forward graph only (its mask is saved): from one
    RNG state the graph draws what the module draws, so the stage streams replay alike."""
    plan, inputs = _plan("none", dropout=0.2, attn_dropout=0.2)
    for s, gm in enumerate(plan.stages.modules):
        outs, ref, got, want, split = _split_vs_autograd(gm, inputs[s], seed=5)
        assert any(is_random(n) for n in split.forward_graph.graph.nodes)
        _assert_equal(outs, ref)
        _assert_equal(got, want)


class TPBlock(nn.Module):
    """Every tp collective in one stage (2 ranks, different shards per rank): f, the fused column
    linears, g, gather / scatter on a non-zero dim, and sequence parallelism's pair."""

    def __init__(self, rank):
        super().__init__()
        g = torch.Generator().manual_seed(10 + rank)
        self.wq, self.wk = (nn.Parameter(torch.randn(4, 8, generator=g) / 3) for _ in range(2))
        self.w1 = nn.Parameter(torch.randn(4, 8, generator=g) / 3)
        self.w2 = nn.Parameter(torch.randn(8, 4, generator=g) / 3)
        self.w3 = nn.Parameter(torch.randn(8, 8, generator=g) / 3)

    def forward(self, x):
        from fxsplit.tp import collectives as C
        from fxsplit.tp.functional import column_parallel_linear

        q, k = column_parallel_linear(x, [self.wq, self.wk], [None, None])  # (B, T, 4) shards
        h = torch.tanh(C.copy_to_region(x) @ self.w1.t()) * q + k
        y = C.reduce_from_region(h @ self.w2.t())  # (B, T, 8) replicated
        z = C.gather_from_region(torch.sin(C.scatter_to_region(y, dim=-1)), dim=-1)
        s = C.reduce_scatter_to_region(z @ self.w3, dim=1)  # sequence-sharded (B, T/2, 8)
        return C.gather_to_region(torch.cos(s), dim=1) + y


def _tp_split(rank, world):
    import torch.distributed as dist

    from fxsplit.tp.collectives import bind_groups, record_collectives

    m = TPBlock(rank)
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(3), requires_grad=True)
    with bind_groups({"tp": dist.group.WORLD}):
        split = GraphSplit.trace(m, [x])
        with record_collectives() as split_log:
            outs, ref, got, want, _ = _split_vs_autograd(m, [x])
        with record_collectives() as eager_log:
            r = m(x)
            torch.autograd.grad(r, [x, *m.parameters()], torch.randn(r.shape, generator=torch.Generator().manual_seed(7)))
    return dict(outs=outs, ref=ref, got=got, want=want, split_log=split_log, eager_log=eager_log,
                kinds=sorted({str(n.target) for g in (split.forward_graph, split.input_graph, split.weight_graph)
                              for n in g.graph.nodes if "c10d" in str(n.target)}),
                grad_inputs=split.grad_inputs, n_carry=split.n_carry)


@pytest.mark.dist
def test_tp_stage_splits_as_graphs_bit_equal_to_autograd():
    """A stage with every tp collective splits into F, I and W graphs of functional collectives
    ([Note: traced collectives]); outputs and every gradient equal autograd's bit for bit on each
    rank, and record_collectives counts the same collectives as the eager stage."""
    from fxsplit.testing import run_distributed

    for rank, r in enumerate(run_distributed(_tp_split, 2, timeout=120)):
        _assert_equal(r["outs"], r["ref"])
        _assert_equal(r["got"], r["want"])
        assert r["grad_inputs"] == [0] and r["n_carry"] > 0
        assert "_c10d_functional.all_reduce.default" in r["kinds"], r["kinds"]
        assert not any(k.startswith("c10d.") for k in r["kinds"]), r["kinds"]
        eager = Counter((c.op, c.kind, c.phase, c.shape) for c in r["eager_log"])
        both = Counter((c.op, c.kind, c.phase, c.shape) for c in r["split_log"])  # split + autograd's
        assert both - eager == eager and sum(eager.values()) == 9, (rank, both, eager)


class TPStreamDropout(nn.Module):
    """Dropouts on a tp stream ([Note: RNG streams] 2: a module call and a function, as the TP pass
    writes them), a replicated dropout between and after (stage stream), optionally in a
    checkpointed region (then recomputed in the backward)."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)
        self.checkpointed = checkpointed

    def region(self, x):
        from fxsplit.tp.random import call_in_tp_stream, in_tp_stream

        h = call_in_tp_stream(self.drop, self.lin(x))
        h = torch.nn.functional.dropout(h.sin(), 0.2, True)
        return in_tp_stream(torch.nn.functional.dropout)(h, 0.5, True) * 2

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.region, x, use_reentrant=False) if self.checkpointed else self.region(x)
        return torch.nn.functional.dropout(h.cos(), 0.4, True)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_tp_stream_dropout_splits_as_graphs_with_the_eager_masks(checkpointed):
    """A tp-stream block traced is seeded by enter_tp_stream / exit_tp_stream nodes in the forward
    graph (it used to refuse the stage: the eager block reads a random number as a Python int), so
    every mask, on the tp stream and on the stage stream after it, is the eager module's: outputs
    and gradients bit for bit; a recomputed block replays the forward's draws."""
    m = TPStreamDropout(checkpointed)
    x = torch.randn(4, 8, requires_grad=True)
    outs, ref, got, want, split = _split_vs_autograd(m, [x], seed=5)
    _assert_equal(outs, ref)
    _assert_equal(got, want)
    names = [getattr(n.target, "__name__", "") for n in split.forward_graph.graph.nodes]
    assert names.count("enter_tp_stream") == names.count("exit_tp_stream") == 2, names
    replays = [n for g in (split.input_graph, split.weight_graph) for n in g.graph.nodes if "replay_rng" in str(n.target)]
    assert len(replays) == (3 if checkpointed else 0)


class _FailsOnFakeTensors(nn.Module):
    """Runs eagerly; on fake tensors (the graph split's shape pass) raises a two-line error."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(x, FakeTensor):
            raise RuntimeError("data-dependent shape\nthe cause, on the second line")
        return self.lin(x)


def test_a_split_fallback_keeps_the_whole_exception_text():
    """split_fallbacks shows UnsupportedStage's text: the whole of the error that made the stage
    fall back, not its first line."""
    with pytest.raises(UnsupportedStage) as info:
        GraphSplit.trace(_FailsOnFakeTensors(), [torch.randn(4, 8)])
    assert "(RuntimeError: data-dependent shape\nthe cause, on the second line [raised at " in str(info.value), str(info.value)
    assert str(info.value).endswith(" in forward])"), str(info.value)  # _FailsOnFakeTensors.forward raised it
