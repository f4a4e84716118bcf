"""Runtime pieces that need no process group: microbatch split/merge, symbolic shapes, the
message plan, and the whole runtime on threads over a fake transport that enforces NCCL's rule
(operations between two ranks match in posting order, each completes only after every earlier
one on that pair) so the [Note: message order] is checked for every schedule without GPUs."""

from __future__ import annotations

import threading
from collections import defaultdict

import pytest
import sympy
import torch
import torch.distributed as dist

from fxsplit.runtime import (
    PipelineRuntime,
    bind_symbols,
    concrete_shape,
    merge_microbatches,
    split_microbatches,
    split_target,
)
from fxsplit.pipeline.comm import plan_communication
from fxsplit.pipeline.rank_plan import RankPlan
from fxsplit.schedule import build
from fxsplit.schedule.ir import parse_schedule
from fxsplit.pipeline.stage import ValueMeta

from test_runtime_cases import make_batch, skip_model, skip_stages

b, t = sympy.symbols("b t", integer=True, positive=True)


# ---------------------------------------------------------------------------------------------
# microbatches and shapes
# ---------------------------------------------------------------------------------------------


def test_split_unequal_chunks_weights_and_unbatched_inputs():
    x = torch.arange(14.0).reshape(7, 2)
    mask = torch.ones(3, 3)  # dim 0 is not the batch: passed whole
    mb = split_microbatches((x, mask, 5), 3)
    assert mb.sizes == (3, 2, 2) and mb.batch_size == 7 and mb.batched == (True, False, False)
    assert mb.weights == pytest.approx((3 / 7, 2 / 7, 2 / 7))
    assert torch.equal(mb.inputs[1][0], x[3:5]) and mb.inputs[1][1] is mask and mb.inputs[2][2] == 5
    assert mb.inputs[0][0].data_ptr() == x.data_ptr()  # a view, not a copy
    y = {"a": torch.arange(7), "k": 3}
    parts = split_target(y, mb.sizes)
    assert [p["a"].tolist() for p in parts] == [[0, 1, 2], [3, 4], [5, 6]] and parts[2]["k"] == 3
    merged = merge_microbatches([[p["a"], 1.0] for p in parts])
    assert torch.equal(merged[0], torch.arange(7)) and merged[1] == [1.0, 1.0, 1.0]


def test_split_along_other_dim_and_errors():
    x = torch.randn(4, 6)
    mb = split_microbatches((x,), 3, dim=1)
    assert [t_[0].shape[1] for t_ in mb.inputs] == [2, 2, 2]
    with pytest.raises(ValueError, match="cannot be split into 5 microbatches"):
        split_microbatches((x,), 5)
    with pytest.raises(ValueError, match="marked batched"):
        split_microbatches((x, torch.randn(3)), 2, batched=(True, True))


def test_bind_symbols_and_concrete_shape():
    metas = (ValueMeta("idx", True, (b, t), torch.int64, False),
             ValueMeta("n", False, None, None, False),
             ValueMeta("pos", True, (2 * t,), torch.int64, False))
    binding = bind_symbols(metas, (torch.zeros(3, 5), 7, torch.zeros(10)))
    assert binding == {b: 3, t: 5}
    assert concrete_shape((b, t, 16, b * t), binding) == (3, 5, 16, 15)
    with pytest.raises(ValueError, match=r"input 2 \(pos\) dim 0"):
        bind_symbols(metas, (torch.zeros(3, 5), 7, torch.zeros(9)))
    with pytest.raises(ValueError, match="traced with size 4"):
        bind_symbols((ValueMeta("x", True, (4, 2), torch.float32, False),), (torch.zeros(3, 2),))
    with pytest.raises(ValueError, match="no model input binds"):
        concrete_shape((b, sympy.Symbol("s")), {b: 2})
    # a dim given only as an expression is solved for its symbol
    assert bind_symbols((ValueMeta("x", True, (2 * b,), torch.float32, False),), (torch.zeros(6),)) == {b: 3}


# ---------------------------------------------------------------------------------------------
# message plan
# ---------------------------------------------------------------------------------------------


def _plans(schedule, ios, p):
    return [plan_communication(schedule, ios, rank=r, num_ranks=p, rank_of_stage=lambda s: s % p)
            for r in range(p)]


@pytest.mark.parametrize("name,p,v,m", [("gpipe", 2, 2, 3), ("1f1b", 4, 1, 5),
                                        ("interleaved_1f1b", 2, 2, 3), ("zb_h1", 3, 1, 4)])
def test_both_sides_of_every_pair_post_the_same_sequence(name, p, v, m):
    _, ios, _, _ = skip_stages(skip_model(), p * v)
    plans = _plans(build(name, p, m, v), ios, p)
    pairs = 0
    for r, plan in enumerate(plans):
        for q, ops in plan.peer_ops.items():
            mirror = plans[q].peer_ops[r]
            assert [(op.message, op.is_send) for op in ops] == [(op.message, not op.is_send) for op in mirror]
            pairs += 1
        sent = [m_ for ac in plan.actions for m_ in ac.sends]
        assert len(set(m_.tag for m_ in sent)) == len(sent)  # distinct tags
    assert pairs >= 2
    # the skip h0: stage 0 -> last stage directly, once per microbatch
    skip = [op for op in plans[0].peer_ops.get((p * v - 1) % p, ()) if op.message.stage == p * v - 1
            and op.message.input == 1 and op.message.kind == "activation"]
    assert len(skip) == m and all(op.is_send for op in skip)


def test_plan_golden_order_two_ranks():
    _, ios, _, _ = skip_stages(skip_model(), 2)
    plans = _plans(build("1f1b", 2, 2), ios, 2)
    assert str(plans[0]) == (
        "CommPlan rank 0: 4 actions\n"
        "  peer 1: Sa1.0@0 Sa1.1@0 Sa1.0@1 Sa1.1@1 Rg1.0@0 Rg1.1@0 Rg1.0@1 Rg1.1@1")


def test_plan_rejects_deadlock_missing_action_and_wrong_rank():
    _, ios, _, _ = skip_stages(skip_model(), 2)
    dead = parse_schedule("0F0 0B0 0F1 0B1\n1F1 1B1 1F0 1B0")
    with pytest.raises(ValueError, match=r"deadlocks.*rank 0 at 0B0 waits for 1B0") as err:
        _plans(dead, ios, 2)
    assert "[0B0]" in str(err.value)  # the grid marks where each rank is stuck
    with pytest.raises(ValueError, match="0B1 needs 1B1 or|neither 1B1 nor 1I1"):
        _plans(parse_schedule("0F0 0F1 0B0 0B1\n1F0 1B0 1F1"), ios, 2)
    with pytest.raises(ValueError, match="lives on rank 1"):
        _plans(parse_schedule("0F0 1F0 0B0 1B0\n-"), ios, 2)


# ---------------------------------------------------------------------------------------------
# whole runtime on threads over a strict in-order fake transport
# ---------------------------------------------------------------------------------------------


class _StrictNet:
    """Fake isend/irecv/broadcast for threads: per pair of ranks the k-th operation posted by one
    side must be the mirror of the k-th posted by the other (NCCL), and completes only when both
    sides have posted k+1 operations on that pair."""

    def __init__(self, timeout: float = 20.0):
        self.cv = threading.Condition()
        self.ops: dict[tuple[int, int], list] = defaultdict(list)  # (me, peer) -> [(is_send, tag, tensor)]
        self.errors: list[str] = []
        self.bcast: dict[int, torch.Tensor] = {}
        self.bcast_count: dict[int, int] = defaultdict(int)
        self.local = threading.local()
        self.timeout = timeout

    def _post(self, is_send, tensor, peer, tag):
        me = self.local.rank
        with self.cv:
            k = len(self.ops[(me, peer)])
            self.ops[(me, peer)].append((is_send, tag, tensor))
            self.cv.notify_all()
        return _Work(self, me, peer, k)

    def isend(self, tensor, dst, group=None, tag=0):
        return self._post(True, tensor, dst, tag)

    def irecv(self, tensor, src, group=None, tag=0):
        return self._post(False, tensor, src, tag)

    def broadcast(self, tensor, src, group=None, async_op=False):
        me = self.local.rank
        with self.cv:
            n = self.bcast_count[me]
            self.bcast_count[me] += 1
            if me == src:
                self.bcast[n] = tensor.clone()
                self.cv.notify_all()
            elif not self.cv.wait_for(lambda: n in self.bcast, self.timeout):
                raise RuntimeError(f"rank {me}: broadcast {n} timed out")
            else:
                tensor.copy_(self.bcast[n])
        return _Work(self, me, None, None)


class _Work:
    def __init__(self, net, me, peer, k):
        self.net, self.me, self.peer, self.k = net, me, peer, k

    def _matched(self):
        return self.peer is None or len(self.net.ops[(self.peer, self.me)]) > self.k

    def is_completed(self):
        with self.net.cv:
            return self._matched()

    def wait(self, timeout=None):
        net = self.net
        with net.cv:
            if not net.cv.wait_for(self._matched, net.timeout):
                msg = f"rank {self.me}: operation {self.k} with rank {self.peer} never matched (deadlock)"
                net.errors.append(msg)
                raise RuntimeError(msg)
            if self.peer is None:
                return True
            mine = net.ops[(self.me, self.peer)][self.k]
            theirs = net.ops[(self.peer, self.me)][self.k]
            if mine[0] == theirs[0] or mine[1] != theirs[1] or mine[2].shape != theirs[2].shape:
                msg = (f"rank {self.me} op {self.k} with rank {self.peer}: posted {mine[:2]} "
                       f"{tuple(mine[2].shape)} but the peer posted {theirs[:2]} {tuple(theirs[2].shape)}")
                net.errors.append(msg)
                raise RuntimeError(msg)
            if not mine[0]:
                mine[2].copy_(theirs[2])
        return True


@pytest.mark.parametrize("name,p,v,m,prefetch", [
    ("gpipe", 2, 2, 3, 2), ("1f1b", 4, 1, 6, 2), ("1f1b", 4, 1, 6, 0), ("interleaved_1f1b", 2, 2, 3, 2),
    ("interleaved_1f1b", 3, 2, 4, 2), ("interleaved_1f1b", 3, 2, 4, 100), ("zb_h1", 4, 1, 5, 2)])
def test_runtime_on_threads_with_in_order_matching(monkeypatch, name, p, v, m, prefetch):
    net = _StrictNet()
    for fn in ("isend", "irecv", "broadcast"):
        monkeypatch.setattr(dist, fn, getattr(net, fn))
    S = p * v
    ref = skip_model()
    (x,), y = make_batch("skip", 2 * m + 1)
    want = torch.nn.functional.mse_loss(ref(x), y)
    want.backward()
    results: dict[int, object] = {}
    built = [skip_stages(skip_model(), S) for _ in range(p)]  # seeding is global: not in threads

    def rank_main(r):
        net.local.rank = r
        try:
            mods, ios, meta, _ = built[r]
            rp = RankPlan.build(ios, build(name, p, m, v), rank=r, num_ranks=p, input_meta=meta)
            rt = PipelineRuntime(rp, {s: mods[s] for s in range(S) if s % p == r}, group=None,
                                 loss_fn=torch.nn.functional.mse_loss, device="cpu", prefetch=prefetch)
            loss = rt.step((x,), target=y)
            grads = {n: q.grad for s in range(S) if s % p == r for n, q in mods[s].named_parameters()}
            results[r] = (loss.item(), grads)
        except Exception as exc:  # noqa: BLE001 -- reported below
            results[r] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(p)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not net.errors, net.errors
    assert all(not isinstance(v_, Exception) for v_ in results.values()), results
    refp = dict(ref.named_parameters())
    checked = 0
    for loss, grads in results.values():
        assert loss == pytest.approx(want.item(), rel=1e-5)
        for n, g in grads.items():
            torch.testing.assert_close(g, refp[n].grad, rtol=1e-5, atol=1e-6)
            checked += 1
    assert checked == len(refp)
    # zb_h1's ranks trace their stages (make_fx) on these threads at the same time: torch.fx's
    # patching of fx-wrapped functions must not leave fxsplit's collectives replaced by wrappers
    # ([Note: one fx trace at a time] in fxsplit.runtime.compile.split_graph; graphs planned later in the
    # process held targets other than the module's functions)
    from fxsplit.tp import collectives as C
    assert {k: f for k, f in vars(C).items() if k in C._ORIGINALS and f is not C._ORIGINALS[k]} == {}


def test_split_backward_weight_pass_equals_full_backward():
    from fxsplit.runtime.split_backward import SplitBackward as _SplitBackward

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.LayerNorm(8),
                              torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    x = torch.randn(5, 8)
    g_out = torch.randn(5, 8)
    # reference: full backward, middle stage (its input needs a gradient)
    leaf = x.clone().requires_grad_(True)
    torch.autograd.backward([net(leaf)], [g_out])
    want_dx, want = leaf.grad, {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    # I then W
    leaf = x.clone().requires_grad_(True)
    out = net(leaf)
    split = _SplitBackward([out], [g_out], [leaf], list(net.parameters()))
    assert split.from_roots == [] and sum(len(ps) for _, ps in split.groups) == 8  # all split off
    with split.capturing():
        (dx,) = torch.autograd.grad([out], [leaf], [g_out], retain_graph=True)
    assert all(p.grad is None for p in net.parameters())  # I touched no weight gradient
    split.weight_grads()
    torch.testing.assert_close(dx, want_dx, rtol=0, atol=0)
    for n, p in net.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-7)
    # first stage: the input needs no gradient, so W differentiates from the roots
    net.zero_grad(set_to_none=True)
    out = net(x)
    split = _SplitBackward([out], [g_out], [], list(net.parameters()))
    assert len(split.from_roots) == 8 and split.groups == []
    split.weight_grads()
    for n, p in net.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-7)
