"""The fused column-parallel linear (``fxsplit.tp.functional.column_parallel_linear``): f plus the column linears
sharing its input as one op whose backward all-reduce overlaps the weight gradients.

On 2 gloo ranks: outputs and every gradient equal the unfused ``copy_to_region`` + ``F.linear``;
the all-reduce of the input gradient is started before the weight-gradient matmuls and waited
for after them; a tensor-parallel GPT issues one forward all-reduce per attention block and per
MLP and one (fused) backward all-reduce per region. Without a process group: plain linears, one
fx node, and where the pass fuses (not under sequence parallelism).
"""

from __future__ import annotations

import copy

import pytest
import sympy
import torch
import torch.fx
import torch.nn.functional as F

import fxsplit
from fxsplit.testing import zoo
from fxsplit.tp.collectives import copy_to_region, gather_to_region, reduce_from_region
from fxsplit.testing import run_distributed
from fxsplit.tp.functional import column_parallel_linear

B, T, C = 2, 5, 8  # B * T rows: not one of OUTS, so no other mm has a weight's shape
OUTS = (4, 6, 2)  # distinct from C so the weight-gradient matmuls are recognizable by shape
SMALL = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)


def _params(rank: int, biases: tuple[bool, ...]):
    g = torch.Generator().manual_seed(100 + rank)  # each rank holds different shards
    ws = [torch.randn(o, C, generator=g).requires_grad_() for o in OUTS[:len(biases)]]
    bs = [torch.randn(o, generator=g).requires_grad_() if b else None for o, b in zip(OUTS, biases)]
    x = torch.randn(B, T, C, generator=torch.Generator().manual_seed(1)).requires_grad_()  # replicated
    r = [torch.randn(B, T, o, generator=g) for o in OUTS[:len(biases)]]  # this rank's loss weights
    return x, ws, bs, r


def _grads(fused: bool, rank: int, biases: tuple[bool, ...]):
    x, ws, bs, r = _params(rank, biases)
    if fused:
        ys = column_parallel_linear(x, ws, bs)
    else:
        h = copy_to_region(x)
        ys = [F.linear(h, w, b) for w, b in zip(ws, bs)]
    sum((y * ri).sum() for y, ri in zip(ys, r)).backward()
    return ([y.detach() for y in ys], x.grad, [w.grad for w in ws], [b.grad if b is not None else None for b in bs])


class _Order(torch.utils._python_dispatch.TorchDispatchMode):
    """Logs the weight-gradient matmuls ([out, C] results) next to the all-reduce events."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and tuple(out.shape) in {
                (o, C) for o in OUTS}:
            self.events.append(("weight_grad", tuple(out.shape)))
        return out


def _order(rank: int):
    import torch.distributed as dist

    events: list = []
    real = dist.all_reduce

    class _Work:
        def __init__(self, work):
            self.work = work

        def wait(self, *a, **k):
            events.append(("wait",))
            return self.work.wait(*a, **k)

    def all_reduce(t, *a, async_op=False, **k):
        events.append(("all_reduce", tuple(t.shape), async_op))
        work = real(t, *a, async_op=async_op, **k)
        return _Work(work) if async_op else work

    x, ws, bs, r = _params(rank, (True, True, True))
    ys = column_parallel_linear(x, ws, bs)
    loss = sum((y * ri).sum() for y, ri in zip(ys, r))
    dist.all_reduce = all_reduce
    try:
        with _Order(events):
            loss.backward()
    finally:
        dist.all_reduce = real
    return events


def _gpt_counts(rank: int, world: int):
    import torch.distributed as dist

    from fxsplit.tp.collectives import bind_groups, record_collectives
    from fxsplit.passes.tensor_parallel import apply_tp_plan
    from fxsplit.tp.sharding import materialize_module
    from fxsplit.tp.plan import find_tp_plan

    model, args, kwargs = zoo.make("gpt", **SMALL)
    gm = fxsplit.trace(model, args, kwargs)
    plan = find_tp_plan(gm, world, overrides={"wte": "replicate", "lm_head": "replicate"})
    apply_tp_plan(gm, plan)
    materialize_module(gm, plan.param_specs, rank, source=model)
    with bind_groups({"tp": dist.group.WORLD}), record_collectives() as log:
        gm(*args, **kwargs).float().pow(2).mean().backward()
    return [(c.op, c.kind, c.phase) for c in log]


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from fxsplit.tp.collectives import bind_groups, record_collectives

    out: dict = {"cases": {}}
    with bind_groups({"tp": dist.group.WORLD}):
        for biases in [(True, True, True), (False,), (True, False)]:
            with record_collectives() as log:
                fused = _grads(True, rank, biases)
            out["cases"][biases] = (_grads(False, rank, biases), fused, [(c.op, c.kind, c.phase) for c in log])
        out["order"] = _order(rank)
    out["gpt"] = _gpt_counts(rank, world)
    return out


@pytest.fixture(scope="module")
def dist_results():
    return run_distributed(_worker, 2, timeout=240)


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.dist
def test_fused_equals_unfused_on_two_ranks(dist_results):
    for rank, res in enumerate(dist_results):
        for biases, (ref, got, log) in res["cases"].items():
            (ys_r, gx_r, gw_r, gb_r), (ys, gx, gw, gb) = ref, got
            for a, b in zip(ys, ys_r, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)  # forward: the same linears
            _close(gx, gx_r)
            for a, b in zip(gw, gw_r, strict=True):
                _close(a, b)
            for a, b in zip(gb, gb_r, strict=True):
                assert (a is None) == (b is None)
                if a is not None:
                    _close(a, b)
            # one backward all-reduce however many linears share the input
            assert log == [("column_parallel_linear", "all_reduce", "backward")], (rank, biases, log)
    # the input gradient is summed over the ranks: equal on both
    for biases in dist_results[0]["cases"]:
        torch.testing.assert_close(dist_results[0]["cases"][biases][1][1], dist_results[1]["cases"][biases][1][1],
                                   rtol=0, atol=0)


@pytest.mark.dist
def test_all_reduce_starts_before_weight_grads_and_is_waited_after(dist_results):
    for res in dist_results:
        ev = res["order"]
        kinds = [e[0] for e in ev]
        assert kinds.count("all_reduce") == 1 and kinds.count("wait") == 1, ev
        ar, wait = kinds.index("all_reduce"), kinds.index("wait")
        assert ev[ar][1] == (B, T, C) and ev[ar][2] is True, ev  # the input gradient, async
        wg = [i for i, k in enumerate(kinds) if k == "weight_grad"]
        assert len(wg) == len(OUTS), ev
        assert ar < min(wg) and max(wg) < wait, ev


@pytest.mark.dist
def test_gpt_one_forward_all_reduce_per_block_and_one_fused_backward_per_region(dist_results):
    n = SMALL["n_layer"]
    for res in dist_results:
        log = res["gpt"]
        fwd = [c for c in log if c[2] == "forward"]
        bwd = [c for c in log if c[2] == "backward"]
        assert fwd == [("reduce_from_region", "all_reduce", "forward")] * (2 * n), log
        assert bwd == [("column_parallel_linear", "all_reduce", "backward")] * (2 * n), log


def test_unbound_is_plain_linear_and_one_fx_node():
    x, ws, bs, _ = _params(0, (True, False))
    ys = column_parallel_linear(x, ws, bs)
    assert isinstance(ys, tuple) and len(ys) == 2
    for y, w, b in zip(ys, ws, bs):
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=0, atol=0)
    with pytest.raises(ValueError, match="one bias"):
        column_parallel_linear(x, ws, bs[:1])

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = torch.nn.Linear(C, 4), torch.nn.Linear(C, 4)

        def forward(self, x):
            q, k = [column_parallel_linear(x, [self.q.weight, self.k.weight], [self.q.bias, self.k.bias])[i]
                    for i in range(2)]
            return q + k

    gm = torch.fx.symbolic_trace(M())
    assert sum(n.target is column_parallel_linear for n in gm.graph.nodes) == 2


def test_pass_fuses_regions_not_under_sequence_parallelism():
    from fxsplit.passes.tensor_parallel import apply_tp_plan
    from fxsplit.tp.plan import find_tp_plan

    model, args, kwargs = zoo.make("gpt", **SMALL, mlp="swiglu")
    traced = fxsplit.trace(model, args, kwargs)
    gm = copy.deepcopy(traced)
    apply_tp_plan(gm, find_tp_plan(gm, 2))
    fused = [n for n in gm.graph.nodes if n.target is column_parallel_linear]
    assert len(fused) == 2 * SMALL["n_layer"]
    assert [len(n.args[1]) for n in fused] == [3, 2] * SMALL["n_layer"]  # q/k/v, gate/up
    assert fused[0].meta["fxsplit"].module_path == "blocks.0.attn"
    # the cost model sees the node's linears: q/k/v on half the heads each, gate/up on half the width
    full = {n.target: n.meta["fxsplit"].cost.flops for n in traced.graph.nodes if n.op == "call_module"}
    assert sympy.simplify(fused[0].meta["fxsplit"].cost.flops - 3 * full["blocks.0.attn.q"] / 2) == 0
    assert sympy.simplify(fused[1].meta["fxsplit"].cost.flops - full["blocks.0.mlp.up"]) == 0
    assert sum(n.target is reduce_from_region for n in gm.graph.nodes) == 2 * SMALL["n_layer"]
    assert not any(n.op == "call_module" and n.target in ("blocks.0.attn.q", "blocks.0.mlp.up") for n in gm.graph.nodes)
    assert gm.get_submodule("blocks.0.attn.q").weight.shape == (SMALL["n_embd"] // 2, SMALL["n_embd"])
    gm_sp = copy.deepcopy(traced)
    apply_tp_plan(gm_sp, find_tp_plan(gm_sp, 2, sequence_parallel=True))
    assert not any(n.target is column_parallel_linear for n in gm_sp.graph.nodes)
    assert sum(n.target is gather_to_region for n in gm_sp.graph.nodes) == 2 * SMALL["n_layer"] + 1
