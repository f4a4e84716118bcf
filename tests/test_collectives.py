"""Tests for fxsplit.tp.collectives.

One process: unbound axes are identities, binding is per context, ops are single fx nodes.
Gloo (2 and 4 ranks, one launch each): forward values and every gradient of hand-built
tensor-parallel layers equal the unsplit layers (float32, rtol=1e-5, atol=1e-6).
"""

import copy
import pickle
import threading

import pytest
import torch
import torch.distributed as dist
import torch.fx
import torch.nn.functional as F

from fxsplit.tp import collectives as C
from fxsplit.tp.collectives import (
    all_reduce_sum,
    axis_rank,
    axis_size,
    bind_groups,
    copy_to_region,
    current_group,
    gather_for_sp,
    gather_from_region,
    gather_to_region,
    record_collectives,
    reduce_from_region,
    reduce_scatter_to_region,
    scatter_to_region,
)
from fxsplit.testing import run_distributed

TOL = dict(rtol=1e-5, atol=1e-6)
OPS_1ARG = [copy_to_region, reduce_from_region]
OPS_DIM = [gather_from_region, scatter_to_region, reduce_scatter_to_region, gather_to_region]


# ----------------------------------------------------------------------------- one process


def test_unbound_axis_is_identity_forward_and_backward():
    x = torch.randn(4, 6, requires_grad=True)
    for op in OPS_1ARG:
        assert op(x) is x
        assert op(x, axis="nope") is x
    for op in OPS_DIM:
        assert op(x, dim=1) is x
        assert op(x, dim=-1, axis="sp") is x
    assert axis_size("tp") == 1 and axis_rank("tp") == 0 and current_group("tp") is None
    with record_collectives() as log:
        y = reduce_from_region(gather_from_region(copy_to_region(x), dim=0))
        y.sum().backward()
    assert log == []
    torch.testing.assert_close(x.grad, torch.ones_like(x))
    with torch.no_grad():
        z = all_reduce_sum(x)
    assert z is not x and torch.equal(z, x)
    with torch.no_grad():
        assert all_reduce_sum(x, inplace=True) is x


def test_bind_groups_rejects_non_groups_and_nests_per_context():
    with pytest.raises(TypeError, match="axis 'tp' is bound to a str"):
        with bind_groups({"tp": "group0"}):
            pass
    with pytest.raises(TypeError, match="expected a mapping"):
        with bind_groups([("tp", None)]):
            pass
    with pytest.raises(TypeError, match="axis must be a mesh axis name"):
        copy_to_region(torch.ones(1), axis=0)
    # None unbinds; nested blocks restore the outer binding; other threads see no binding.
    with bind_groups({"tp": None, "dp": None}):
        assert current_group("tp") is None
        seen = []
        t = threading.Thread(target=lambda: seen.append(C._GROUPS.get()))
        t.start()
        t.join()
        assert dict(seen[0]) == {}
        assert set(C._GROUPS.get()) == {"tp", "dp"}
        with bind_groups({"sp": None}):
            assert set(C._GROUPS.get()) == {"tp", "dp", "sp"}
        assert set(C._GROUPS.get()) == {"tp", "dp"}
    assert dict(C._GROUPS.get()) == {}


def test_all_reduce_sum_refuses_tensors_that_need_grad():
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"shape \(3,\) requires grad.*reduce_from_region"):
        all_reduce_sum(x)


class _TPBlock(torch.nn.Module):
    """Column-parallel then row-parallel linear with the shard sizes given; calls the ops both
    through the module (patched by torch.fx.wrap) and by imported name (Proxy check)."""

    def __init__(self, d, h_local):
        super().__init__()
        self.up = torch.nn.Linear(d, h_local)
        self.down = torch.nn.Linear(h_local, d, bias=False)
        self.bias = torch.nn.Parameter(torch.zeros(d))

    def forward(self, x):
        h = self.up(C.copy_to_region(x, axis="tp"))
        y = reduce_from_region(self.down(F.gelu(h)), axis="tp")
        return gather_from_region(scatter_to_region(y + self.bias, dim=-1), dim=-1)


def test_ops_are_single_call_function_nodes_under_symbolic_trace():
    gm = torch.fx.symbolic_trace(_TPBlock(4, 8))
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in C.COLLECTIVE_OPS]
    assert [n.target.__name__ for n in calls] == [
        "copy_to_region", "reduce_from_region", "scatter_to_region", "gather_from_region"]
    assert [n.kwargs.get("axis", "tp") for n in calls] == ["tp"] * 4
    assert calls[2].kwargs == {"dim": -1, "axis": "tp"}
    # no collective internals leaked into the graph
    assert not any("all_reduce" in str(n.target) or "chunk" in str(n.target) for n in gm.graph.nodes)
    assert "copy_to_region" in gm.code
    # sequence-parallel ops and the contract alias trace the same way
    sp = torch.fx.symbolic_trace(
        lambda x: C.reduce_scatter_to_region(gather_for_sp(x, dim=1), dim=1, axis="tp"))
    assert [n.target for n in sp.graph.nodes if n.op == "call_function"] == [
        gather_to_region, reduce_scatter_to_region]
    x = torch.randn(2, 4)
    ref = _TPBlock(4, 8)
    ref.load_state_dict(gm.state_dict())
    torch.testing.assert_close(gm(x), ref(x), rtol=0, atol=0)
    # plan graphs hold no ProcessGroup, so they pickle and copy (e.g. to ship a stage to a rank)
    for clone in (pickle.loads(pickle.dumps(gm)), copy.deepcopy(gm)):
        assert [n.target for n in clone.graph.nodes if n.op == "call_function" and n.target in
                C.COLLECTIVE_OPS] == [n.target for n in calls]
        torch.testing.assert_close(clone(x), ref(x), rtol=0, atol=0)


# ----------------------------------------------------------------------------- gloo


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def _check_tp_mlp(n, r, done):
    """Column-parallel up, row-parallel down (f and g) equal the unsplit MLP: output and every grad."""
    torch.manual_seed(0)
    B, d, h = 3, 4, 8
    x = torch.randn(B, d, requires_grad=True)
    w1, b1 = torch.randn(h, d, requires_grad=True), torch.randn(h, requires_grad=True)
    w2, b2 = torch.randn(d, h, requires_grad=True), torch.randn(d, requires_grad=True)
    target = torch.randn(B, d)
    y = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    ((y - target) ** 2).sum().backward()

    xp = x.detach().clone().requires_grad_()
    w1s = w1.detach().chunk(n, 0)[r].clone().requires_grad_()
    b1s = b1.detach().chunk(n, 0)[r].clone().requires_grad_()
    w2s = w2.detach().chunk(n, 1)[r].clone().requires_grad_()
    b2p = b2.detach().clone().requires_grad_()
    with bind_groups({"tp": dist.group.WORLD}), record_collectives() as log:
        yp = reduce_from_region(F.linear(F.gelu(F.linear(copy_to_region(xp), w1s, b1s)), w2s)) + b2p
        loss = ((yp - target) ** 2).sum()
    loss.backward()  # outside the block: the group (and the log) were captured in forward
    # Megatron MLP: exactly one all-reduce forward (g) and one backward (f)
    assert [str(c) for c in log] == [
        f"forward all_reduce[tp] [{B}, {d}] (reduce_from_region)",
        f"backward all_reduce[tp] [{B}, {d}] (copy_to_region)"], log
    _close(yp, y, "tp mlp output")
    _close(xp.grad, x.grad, "tp mlp input grad (f backward all-reduce)")
    _close(w1s.grad, w1.grad.chunk(n, 0)[r], "column weight grad")
    _close(b1s.grad, b1.grad.chunk(n, 0)[r], "column bias grad")
    _close(w2s.grad, w2.grad.chunk(n, 1)[r], "row weight grad")
    _close(b2p.grad, b2.grad, "row bias grad")
    done.append("tp_mlp")


def _check_gather_scatter(n, r, done):
    """Column-parallel with gathered output; scatter into a row-parallel layer."""
    torch.manual_seed(1)
    B, d, h = 2, 6, 4 * n
    x = torch.randn(B, d, requires_grad=True)
    w = torch.randn(h, d, requires_grad=True)
    t = torch.randn(B, h)
    y = F.linear(x, w)
    (y * t).sum().backward()
    xp, ws = x.detach().clone().requires_grad_(), w.detach().chunk(n, 0)[r].clone().requires_grad_()
    with bind_groups({"tp": dist.group.WORLD}):
        yp = gather_from_region(F.linear(copy_to_region(xp), ws), dim=-1)
        (yp * t).sum().backward()
    _close(yp, y, "gathered column output")
    _close(xp.grad, x.grad, "gathered column input grad")
    _close(ws.grad, w.grad.chunk(n, 0)[r], "gathered column weight grad")

    # scatter_to_region: full replicated input -> row-parallel linear -> g
    h_in = 2 * n
    u = torch.randn(B, h_in, requires_grad=True)
    v = torch.randn(d, h_in, requires_grad=True)
    z = F.linear(u, v)
    (z * z).sum().backward()
    up, vs = u.detach().clone().requires_grad_(), v.detach().chunk(n, 1)[r].clone().requires_grad_()
    with bind_groups({"tp": dist.group.WORLD}):
        zp = reduce_from_region(F.linear(scatter_to_region(up, dim=1), vs))
        (zp * zp).sum().backward()
    _close(zp, z, "scattered row output")
    _close(up.grad, u.grad, "scatter backward all-gather")
    _close(vs.grad, v.grad.chunk(n, 1)[r], "scattered row weight grad")

    # plain forward values along dim 0 and a middle dim
    with bind_groups({"tp": dist.group.WORLD}):
        a = torch.full((2, 3), float(r))
        g0 = gather_from_region(a, dim=0)
        assert torch.equal(g0, torch.cat([torch.full((2, 3), float(i)) for i in range(n)], 0))
        b = torch.arange(2 * 2 * n * 3, dtype=torch.float32).reshape(2, 2 * n, 3)
        assert torch.equal(scatter_to_region(b, dim=1), b[:, 2 * r: 2 * r + 2])
        assert torch.equal(gather_from_region(scatter_to_region(b, dim=-2), dim=1), b)
        rs = reduce_scatter_to_region(b * (r + 1), dim=1)
        assert torch.equal(rs, b[:, 2 * r: 2 * r + 2] * (n * (n + 1) // 2))
        assert axis_size("tp") == n and axis_rank("tp") == r
        with torch.no_grad():
            s = torch.tensor([float(r)])
            assert all_reduce_sum(s, "tp").item() == n * (n - 1) / 2 and s.item() == r
            assert all_reduce_sum(s, "tp", inplace=True) is s and s.item() == n * (n - 1) / 2
        try:
            scatter_to_region(torch.ones(2, n + 1), dim=1)
        except ValueError as e:
            assert f"size {n + 1}" in str(e) and "'tp' (size" in str(e), str(e)
        else:
            raise AssertionError("scatter_to_region accepted an uneven split")
    done.append("gather_scatter")


def _check_sequence_parallel(n, r, done):
    """Megatron-3 block: all-gather(seq) -> column -> gelu -> row -> reduce-scatter(seq) + bias."""
    torch.manual_seed(2)
    B, S, d, h = 2, 2 * n, 4, 2 * n
    x = torch.randn(B, S, d, requires_grad=True)
    w1 = torch.randn(h, d, requires_grad=True)
    w2 = torch.randn(d, h, requires_grad=True)
    b2 = torch.randn(d, requires_grad=True)
    t = torch.randn(B, S, d)
    y = F.linear(F.gelu(F.linear(x, w1)), w2) + b2
    (y * t).sum().backward()

    xs = x.detach().chunk(n, 1)[r].clone().requires_grad_()
    w1s = w1.detach().chunk(n, 0)[r].clone().requires_grad_()
    w2s = w2.detach().chunk(n, 1)[r].clone().requires_grad_()
    b2p = b2.detach().clone().requires_grad_()
    with bind_groups({"tp": dist.group.WORLD}), record_collectives() as log:
        full = gather_to_region(xs, dim=1)
        ys = reduce_scatter_to_region(F.linear(F.gelu(F.linear(full, w1s)), w2s), dim=1) + b2p
        (ys * t.chunk(n, 1)[r]).sum().backward()
        with torch.no_grad():  # a replicated parameter applied on a sequence shard: sum its grad
            all_reduce_sum(b2p.grad, "tp", inplace=True)
    s_loc = S // n
    assert [str(c) for c in log] == [
        f"forward all_gather[tp] [{B}, {s_loc}, {d}] (gather_to_region)",
        f"forward reduce_scatter[tp] [{B}, {S}, {d}] (reduce_scatter_to_region)",
        f"backward all_gather[tp] [{B}, {s_loc}, {d}] (reduce_scatter_to_region)",
        f"backward reduce_scatter[tp] [{B}, {S}, {d}] (gather_to_region)",
        f"no_grad all_reduce[tp] [{d}] (all_reduce_sum)"], log
    _close(ys, y.chunk(n, 1)[r], "sp output shard")
    _close(xs.grad, x.grad.chunk(n, 1)[r], "sp input grad (gather backward reduce-scatter)")
    _close(w1s.grad, w1.grad.chunk(n, 0)[r], "sp column weight grad")
    _close(w2s.grad, w2.grad.chunk(n, 1)[r], "sp row weight grad")
    _close(b2p.grad, b2.grad, "sp replicated bias grad")
    done.append("sequence_parallel")


def _check_traced_graph_and_size_one_group(n, r, done):
    """A graph traced in one process runs distributed once the axis is bound; size-1 => identity."""
    torch.manual_seed(3)
    d, h = 4, 2 * n
    full = _TPBlock(d, h)
    shard = _TPBlock(d, h // n)
    with torch.no_grad():
        shard.up.weight.copy_(full.up.weight.chunk(n, 0)[r])
        shard.up.bias.copy_(full.up.bias.chunk(n, 0)[r])
        shard.down.weight.copy_(full.down.weight.chunk(n, 1)[r])
        shard.bias.copy_(full.bias)
    gm = torch.fx.symbolic_trace(shard)
    x = torch.randn(3, d)
    ref = full(x)
    ref.sum().backward()
    with bind_groups({"tp": dist.group.WORLD}):
        out = gm(x)
    out.sum().backward()
    _close(out, ref, "traced tp block output")
    _close(gm.up.weight.grad, full.up.weight.grad.chunk(n, 0)[r], "traced up weight grad")
    _close(gm.down.weight.grad, full.down.weight.grad.chunk(n, 1)[r], "traced down weight grad")
    _close(gm.bias.grad, full.bias.grad, "traced bias grad")

    singles = [dist.new_group([i]) for i in range(n)]  # every rank must create every group
    with bind_groups({"tp": singles[r]}):
        assert axis_size("tp") == 1 and axis_rank("tp") == 0
        y = torch.randn(2, 2)
        assert copy_to_region(y) is y and reduce_from_region(y) is y
        assert scatter_to_region(y, dim=0) is y and reduce_scatter_to_region(y, dim=0) is y
    done.append("traced_and_size_one")


def _all_checks(rank, world_size):
    done = []
    _check_tp_mlp(world_size, rank, done)
    _check_gather_scatter(world_size, rank, done)
    _check_sequence_parallel(world_size, rank, done)
    _check_traced_graph_and_size_one_group(world_size, rank, done)
    return done


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_layers_match_unsplit(world_size):
    results = run_distributed(_all_checks, world_size, timeout=120)
    assert results == [["tp_mlp", "gather_scatter", "sequence_parallel", "traced_and_size_one"]] * world_size
