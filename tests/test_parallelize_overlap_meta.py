"""fxsplit.parallelize on 4 gloo ranks, two things the other end-to-end tests do not look at
(one process-group launch serves both, spawning costs seconds):

1. dp=2 x pp=2 (interleaved 1F1B, two stages per rank): the data-parallel gradient all-reduces
   overlap the pipeline. `DataParallelGrads.stage_grads_ready` (fxsplit.runtime.data_parallel) starts a stage's bucketed
   asynchronous all-reduce as soon as that stage's last backward of the step ran, so on each
   rank the all-reduce of the stage whose last backward comes first is started while the
   pipeline still has actions to run on that rank. Observed by recording, in order, every
   pipeline action (start and end) and every ``torch.distributed.all_reduce`` call.
2. tp=2 x pp=2 on a model built under ``torch.device("meta")`` (the tied-weight GPT of
   `fxsplit.testing.zoo`): each rank initializes its own shards (no meta tensor left, finite values,
   local shapes), replicated tensors agree across tp ranks, sharded ones differ, training steps
   run with a finite loss, and tied tensors agree across the stages that hold them; and
   dp=2 x tp=2 from the meta device: the replicas start alike and train as one process.
"""

from __future__ import annotations

import math
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import fxsplit
from fxsplit.testing import zoo
from fxsplit.testing import run_distributed
from fxsplit.testing.data import replica_slice
from fxsplit.testing.trace_cache import SharedPlans, shared_plans

HW = fxsplit.Hardware(link_bytes_per_s=float("inf"))  # tiny models: split by compute alone
GPT = {"n_layer": 2, "batch_size": 4, "seq_len": 16}
STEPS, LR = 2, 0.05


def _gpt_batch(seed, b, t, vocab):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t), generator=g), torch.randint(0, vocab, (b, t), generator=g)


# ------------------------------------------------------------------------------------------------
# rank side


# The launch prepares ([Note: preparing once per launch] in fxsplit.testing.harness): the GPT of _overlap and
# its plan, made once before the ranks fork; each rank takes its copy of the plan ([Note: plans made before the
# fork] in fxsplit.testing.trace_cache). The meta-device models are built and planned on each rank, as a user's
# ranks would: that is what the meta tests are about.
_OVERLAP: list = []  # (model, args)
_PLANS = SharedPlans()
OVERLAP = dict(dp=2, pp=2, microbatches=2, schedule="interleaved_1f1b", stages_per_rank=2, hardware=HW)


def _prepare():
    model, args, _ = zoo.make("gpt", **GPT)
    _OVERLAP.extend((model, args))
    _PLANS.add(model, args, verify=False, **OVERLAP)


def _overlap(rank):
    """Events of each step on this rank: ("start"|"end", action) around every pipeline action and
    ("all_reduce", on the dp group, async) for every torch.distributed.all_reduce call."""
    model, args = _OVERLAP
    with shared_plans(_PLANS) as plans:
        pm = fxsplit.parallelize(model, args, loss_fn=zoo.cross_entropy_loss, timeout=60, **OVERLAP)
    assert plans.misses == 0, f"rank {rank} planned dp=2 x pp=2 itself: the plan made before the fork went unused"
    rt, dp_group = pm.runtime, pm._groups.dp
    events: list = []
    # around every action, before the runtime tells the data-parallel hooks a stage is done
    rt.probe(before=lambda step, a: events.append(("start", str(a))),
             after=lambda step, a: events.append(("end", str(a))))
    real_all_reduce = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        events.append(("all_reduce", group is dp_group, bool(kwargs.get("async_op", False))))
        return real_all_reduce(tensor, *args, **kwargs)

    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    steps = []
    dist.all_reduce = spy  # fxsplit.api.model and fxsplit.runtime.data_parallel call dist.all_reduce(...) through the module
    try:
        for step in range(STEPS):
            x, y = _gpt_batch(10 + 2 * step + pm.coords["dp"], 4, 16, 128)  # replicas: own data
            events.clear()
            loss = pm.step(x, target=y)
            steps.append((list(events), float(loss)))
            opt.step()
            opt.zero_grad()
    finally:
        dist.all_reduce = real_all_reduce
    return dict(coords=dict(pm.coords), stages=sorted(int(s) for s in pm.stage_modules),
                num_stages=pm.plan.config.num_stages, steps=steps)


def _tensor_info(t):
    meta = t.is_meta
    return dict(meta=meta, device=str(t.device), dtype=t.dtype, shape=tuple(t.shape),
                value=None if meta else t.detach().clone(),
                finite=(not meta) and bool(torch.isfinite(t).all()))


def _meta_model(rank):
    with torch.device("meta"):
        model, args, _ = zoo.make("gpt", **GPT)
    assert all(p.is_meta for p in model.parameters()) and args[0].is_meta
    assert model.lm_head.weight is model.wte.weight  # tied
    full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = fxsplit.parallelize(model, args, loss_fn=zoo.cross_entropy_loss, tp=2, pp=2, microbatches=2,
                                 hardware=HW, timeout=60)
    fresh = [str(w.message) for w in caught if "FRESH random values" in str(w.message)]
    local = {}
    for s, mod in pm.stage_modules.items():
        for n, t in [*mod.named_parameters(remove_duplicate=False), *mod.named_buffers(remove_duplicate=False)]:
            local[(int(s), n)] = _tensor_info(t)
    vocab = model.config.vocab_size
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    losses, grads_finite = [], []
    for step in range(STEPS):
        x, y = _gpt_batch(20 + step, 4, 16, vocab)
        losses.append(float(pm.step(x, target=y)))
        grads_finite.append(all(bool(torch.isfinite(p.grad).all()) for p in pm.parameters() if p.grad is not None))
        opt.step()
        opt.zero_grad()
    return dict(coords=dict(pm.coords), local=local, full_shapes=full_shapes,
                specs=dict(pm.plan.tp_plan.param_specs), shared=pm.plan.stages.shared_params,
                num_pp=pm.plan.config.pp, losses=losses, grads_finite=grads_finite, fresh=fresh)


def _meta_dp(rank):
    """dp=2 x tp=2 on a meta-device GPT: the full parameters each rank starts from, and the losses
    and full parameters after STEPS SGD steps, each replica on its half of the global batch."""
    with torch.device("meta"):
        model, args, _ = zoo.make("gpt", **GPT)
    pm = fxsplit.parallelize(model, args, loss_fn=zoo.cross_entropy_loss, dp=2, tp=2, hardware=HW, timeout=60)
    init = pm.full_state_dict()
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _gpt_batch(40 + step, 4, 16, model.config.vocab_size)
        losses.append(float(pm.step(replica_slice(pm, x), target=replica_slice(pm, y))))
        opt.step()
        opt.zero_grad()
    return dict(coords=dict(pm.coords), init=init, losses=losses, final=pm.full_state_dict())


def _four_ranks(rank, world):
    return {"overlap": _overlap(rank), "meta": _meta_model(rank), "meta_dp": _meta_dp(rank)}


@pytest.fixture(scope="module")
def four():
    t0 = time.perf_counter()
    results = run_distributed(_four_ranks, 4, timeout=300, prepare=(_prepare, ()))
    print(f"four-rank launch: {time.perf_counter() - t0:.1f}s")
    return results


# ------------------------------------------------------------------------------------------------
# 1. data-parallel all-reduces overlap the pipeline


@pytest.mark.dist
def test_data_parallel_all_reduce_starts_before_the_pipeline_ends(four):
    for rank, res in enumerate(four):
        r = res["overlap"]
        assert r["num_stages"] == 4 and len(r["stages"]) == 2, r["stages"]  # two stages per rank
        for step, (events, loss) in enumerate(r["steps"]):
            tag = f"rank {rank} (stages {r['stages']}) step {step}"
            assert math.isfinite(loss), f"{tag}: loss {loss}"
            starts = [i for i, e in enumerate(events) if e[0] == "start"]
            ends = [i for i, e in enumerate(events) if e[0] == "end"]
            assert starts and len(starts) == len(ends), f"{tag}: {events}"
            dp_async = [i for i, e in enumerate(events) if e[0] == "all_reduce" and e[1] and e[2]]
            assert dp_async, f"{tag}: no asynchronous all-reduce on the dp group: {events}"
            # overlap: some dp all-reduce started while this rank still had pipeline actions to
            # run (before its last action started, hence before it finished)
            early = [i for i in dp_async if i < starts[-1]]
            assert early, (f"{tag}: every data-parallel all-reduce started after the pipeline's last "
                           f"action {events[starts[-1]][1]}: {events}")


# ------------------------------------------------------------------------------------------------
# 2. a model on the meta device


def _by_cell(results):
    """{(pp, tp): rank's meta result}; tp=2 x pp=2 on 4 ranks, dp=1."""
    out = {}
    for res in results:
        m = res["meta"]
        assert m["coords"]["dp"] == 0
        out[(m["coords"]["pp"], m["coords"]["tp"])] = m
    assert sorted(out) == [(0, 0), (0, 1), (1, 0), (1, 1)], sorted(out)
    return out


@pytest.mark.dist
def test_meta_model_warns_once_that_its_weights_are_fresh(four):
    fresh = [res["meta"]["fresh"] for res in four]  # results in global rank order
    assert [len(f) for f in fresh] == [1, 0, 0, 0], fresh
    assert "parameters are on the meta device" in fresh[0][0] and "pm.load_checkpoint" in fresh[0][0]


@pytest.mark.dist
def test_meta_model_each_rank_materializes_its_own_shards_and_trains(four):
    cells = _by_cell(four)
    ref = next(iter(cells.values()))
    specs, full_shapes = ref["specs"], ref["full_shapes"]
    assert specs, "tp=2 sharded nothing"
    losses = None
    for (pp, tp), m in sorted(cells.items()):
        assert m["local"], f"pp {pp} tp {tp} holds no tensors"
        for (s, n), info in sorted(m["local"].items()):
            tag = f"pp {pp} tp {tp} stage {s} {n}"
            assert s % m["num_pp"] == pp, tag
            assert not info["meta"] and info["device"] == "cpu", f"{tag}: {info['device']}"
            assert info["finite"], f"{tag}: not finite"
            assert info["dtype"] == torch.float32, f"{tag}: {info['dtype']}"
            if n in full_shapes:  # a parameter: this rank's shard shape, or the full one
                want = specs[n].local_shape(full_shapes[n]) if n in specs else full_shapes[n]
                assert info["shape"] == tuple(want), f"{tag}: shape {info['shape']}, want {tuple(want)}"
        assert m["grads_finite"] == [True] * STEPS, (pp, tp)
        assert len(m["losses"]) == STEPS and all(math.isfinite(x) for x in m["losses"]), m["losses"]
        losses = losses or m["losses"]
        assert m["losses"] == losses, f"pp {pp} tp {tp}: loss {m['losses']} != {losses}"
    # every parameter of the model is held somewhere
    held = {n for m in cells.values() for (_, n) in m["local"]}
    assert set(full_shapes) <= held, sorted(set(full_shapes) - held)
    # across the two tp ranks of each pipeline rank: replicated tensors equal, random shards
    # their own (a rank that copied its peer's shard, or left zeros, fails), full shapes back
    for pp in (0, 1):
        a, b = cells[(pp, 0)]["local"], cells[(pp, 1)]["local"]
        assert set(a) == set(b), set(a) ^ set(b)
        for key in sorted(a):
            s, n = key
            va, vb = a[key]["value"], b[key]["value"]
            if n not in specs:
                assert torch.equal(va, vb), f"pp {pp} stage {s} {n}: replicated tensor differs across tp ranks"
                continue
            assert tuple(specs[n].unshard([va, vb]).shape) == full_shapes[n], (s, n)
            if va.dim() >= 2:  # randomly initialized matrices
                assert va.std() > 0 and vb.std() > 0, (s, n)
                assert not torch.equal(va, vb), f"pp {pp} stage {s} {n}: both tp ranks hold the same shard"


@pytest.mark.dist
def test_meta_model_tied_weights_agree_across_the_stages_that_hold_them(four):
    cells = _by_cell(four)
    shared = next(iter(cells.values()))["shared"]
    groups = [g for g in shared if len({n for _, n in g}) > 1]
    assert groups, f"no tied weight under two names across stages: {shared}"
    bad = []
    for group in shared:
        for tp in (0, 1):
            values = [(s, n, cells[(s % 2, tp)]["local"][(s, n)]["value"]) for s, n in group]
            s0, n0, v0 = values[0]
            for s, n, v in values[1:]:
                if not torch.equal(v, v0):
                    bad.append(f"tp {tp}: stage {s0} {n0} != stage {s} {n} "
                               f"(max diff {(v - v0).abs().max().item():.3g})")
    assert not bad, "\n".join(bad)


@pytest.mark.dist
def test_meta_model_with_data_parallel_replicas_trains_as_one_process(four):
    """dp=2 x tp=2 from a meta-device model: every rank starts from the same full parameters (the
    replicas materialize alike), and one process started from them on the global batch gives
    the same losses and parameters after the steps."""
    runs = [r["meta_dp"] for r in four]
    assert sorted((r["coords"]["dp"], r["coords"]["tp"]) for r in runs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    init = runs[0]["init"]
    for r in runs[1:]:
        assert set(r["init"]) == set(init), set(r["init"]) ^ set(init)
        for k, v in init.items():
            assert torch.equal(r["init"][k], v), f"{r['coords']}: {k} starts differently on this rank"
    model, _, _ = zoo.make("gpt", **GPT)
    model.load_state_dict(init)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _gpt_batch(40 + step, 4, 16, model.config.vocab_size)
        loss = zoo.cross_entropy_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    for r in runs:
        assert r["losses"] == pytest.approx(losses, rel=1e-5), (r["coords"], r["losses"], losses)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(r["final"][k], v, rtol=1e-5, atol=1e-6, msg=f"{r['coords']} {k}")
