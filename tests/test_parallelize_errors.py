"""fxsplit.parallelize on bad input and failures (issue 6), and runs it must handle without re-planning.

Every bad input must give a clear error on EVERY rank (naming the numbers and the fix), fast, never
a hang. Each launch batches many checks: a rank catches each expected exception and returns its
type and text, so one process-group launch checks many errors ([Note: failures] in fxsplit.api.model).
Numerical checks compare with the unsplit model in one process (float32, tight tolerances):
a batch that the microbatch count does not divide (unequal microbatches weighted by size), other
batch sizes and sequence lengths than the traced ones, inference output structure, and
full_state_dict after training with dp=2 x pp=2, and loss and gradients with dp=2 x pp=1, on different
data per replica.
"""

import time

import pytest
import torch
from torch import nn

import fxsplit
from fxsplit.testing import zoo
from fxsplit.api import RankFailedError
from fxsplit.testing import run_distributed
from fxsplit.testing.trace_cache import SharedPlans, SharedTraces, shared_plans, shared_traces

HW = fxsplit.Hardware(link_bytes_per_s=float("inf"))  # tiny models: split by compute alone
GPT = {"n_layer": 2, "batch_size": 4, "seq_len": 16}
FAST = 20.0  # seconds: any error must arrive well before a timeout


class DictOut(nn.Module):
    """Output in a nested structure, with a value made on the first stage and returned by the last."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.l2 = nn.Linear(16, 16)
        self.l3 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.l1(x))
        h2 = torch.tanh(self.l2(h))
        h3 = torch.tanh(self.l3(h2))
        return {"logits": self.head(h3), "hidden": (h, h3 * 2)}


class FixedBatch(nn.Module):
    """A batch size of 4 fixed in the code (a view): only microbatches of 4 can run."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.a(x)).view(4, 2, 4).flip(1).reshape(4, 8)
        return self.c(torch.tanh(self.b(h)))


def _fixed_model():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    return FixedBatch(), torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


def _dict_model():
    torch.manual_seed(0)
    return DictOut(), torch.randn(6, 8, generator=torch.Generator().manual_seed(1))


def _catch(fn):
    """(exception type name, text with notes, seconds) of fn(), or ("ok", repr of result, s)."""
    t0 = time.perf_counter()
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 -- the test inspects it
        text = "\n".join([str(exc), *getattr(exc, "__notes__", [])])
        return type(exc).__name__, text, time.perf_counter() - t0
    return "ok", repr(value)[:200], time.perf_counter() - t0


def _gpt_batch(seed, b, t):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (b, t), generator=g), torch.randint(0, 128, (b, t), generator=g)


def _local_grads(pm):
    """{original parameter name: grad} of this rank's shards (pp only here, so full tensors)."""
    out = {}
    for mod in pm.stage_modules.values():
        for name, p in mod.named_parameters(remove_duplicate=False):
            if p.grad is not None:
                out.setdefault(name, p.grad.detach().clone())
    return out


# Each launch prepares ([Note: preparing once per launch] in fxsplit.testing.harness): its models, and the plan of
# every parallelize of them that plans (a request refused before planning plans nothing), made once before the
# ranks fork; each rank takes its copy instead of planning the same layout itself ([Note: plans made before the
# fork] in fxsplit.testing.trace_cache). A plan is handed out once per process: a layout parallelized n times in a
# launch is prepared n times.
_BUILT: dict = {}  # "gpt" -> (model, args); the two-rank launch's "fixed" -> (model, x, y, example), "dict" -> (model, x)
_PLANS = SharedPlans()


def _gpt_layout(**options):
    return {"pp": 2, "schedule": "1f1b", "microbatches": 2, "hardware": HW, **options}


def _prepare_gpt(*layouts):
    """The launch's GPT, planned with each of ``layouts`` (``_gpt_pm``'s options) from one trace."""
    model, args, _ = zoo.make("gpt", **GPT)
    _BUILT["gpt"] = model, args
    with shared_traces(SharedTraces()):
        for options in layouts:
            _PLANS.add(model, args, verify=False, **_gpt_layout(**options))


def _gpt_pm(timeout=FAST, **options):
    model, args = _BUILT["gpt"]
    with shared_plans(_PLANS):
        return model, fxsplit.parallelize(model, args, loss_fn=zoo.cross_entropy_loss, timeout=timeout,
                                          **_gpt_layout(**options))


def _all_prepared(rank, out):
    assert _PLANS.misses == 0, f"rank {rank} planned {_PLANS.misses} layout(s) itself: a plan made before the fork went unused"
    return out


# ------------------------------------------------------------------------------------------------
# launch 1: two ranks, pp=2


DP2 = dict(dp=2, pp=1, microbatches=1)


def _prepare_two():
    """The GPT at pp=2 (_gpt_pm() three times, the failing loss once) and at dp=2 (twice), the fixed-batch
    model and the dict-output model, as _two_ranks parallelizes them."""
    _prepare_gpt({}, {}, {}, {}, DP2, DP2)
    fmodel, fx, fy = _fixed_model()
    example = fx[:4]  # the object the rank passes: the plan's key holds an input tensor by identity
    _BUILT["fixed"] = fmodel, fx, fy, example
    _PLANS.add(fmodel, (example,), pp=2, schedule="1f1b", microbatches=2, hardware=HW, verify=False)
    dmodel, dx = _BUILT["dict"] = _dict_model()
    _PLANS.add(dmodel, (dx,), pp=2, schedule="1f1b", microbatches=3, hardware=HW, verify=False)


def _two_ranks(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    r = {}
    model, args = _BUILT["gpt"]
    loss = zoo.cross_entropy_loss
    par = lambda **kw: fxsplit.parallelize(model, args, loss_fn=loss, hardware=HW, timeout=FAST, **kw)  # noqa: E731
    # -- requests that cannot be met: each raised on every rank before any collective
    r["world"] = _catch(lambda: par(pp=4, microbatches=4))
    r["world_dp"] = _catch(lambda: par(dp=2, pp=2))
    mesh_1d = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    r["mesh_names"] = _catch(lambda: par(pp=2, mesh=mesh_1d))
    mesh_dp = init_device_mesh("cpu", (2, 1, 1), mesh_dim_names=("dp", "pp", "tp"))
    r["mesh_shape"] = _catch(lambda: par(pp=2, mesh=mesh_dp))
    r["few_microbatches"] = _catch(lambda: par(pp=2, microbatches=1))
    r["timeout"] = _catch(lambda: fxsplit.parallelize(model, args, loss_fn=loss, pp=2, timeout=0))
    r["loss_not_callable"] = _catch(lambda: fxsplit.parallelize(model, args, loss_fn="mean", pp=2))

    # -- a working model: bad batches are refused on every rank and leave it usable
    _, pm = _gpt_pm()
    plan0, stages0 = pm.plan, dict(pm.stage_modules)
    x, y = _gpt_batch(0, 1, 16)
    r["small_batch"] = _catch(lambda: pm.step(x, target=y))
    r["small_batch_fwd"] = pm(x).detach().clone()  # inference needs no more microbatches than samples
    r["no_target"] = _catch(lambda: pm.step(_gpt_batch(0, 4, 16)[0], target=None if rank == 1 else y))
    # other batch sizes (5 and 3 do not divide by m=2) and sequence lengths, no re-planning
    r["runs"] = {}
    for b, t in [(5, 16), (4, 8), (3, 12), (6, 5)]:
        x, y = _gpt_batch(b * 100 + t, b, t)
        for p in pm.parameters():
            p.grad = None
        step_loss = float(pm.step(x, target=y))
        r["runs"][(b, t)] = (step_loss, _local_grads(pm), pm(x).detach().clone())
    r["same_plan"] = pm.plan is plan0 and all(pm.stage_modules[k] is v for k, v in stages0.items())

    # -- a batch size fixed in the model: the wrong microbatch size is refused before the pipeline
    fmodel, fx, fy, example = _BUILT["fixed"]
    with shared_plans(_PLANS):
        pm_fixed = fxsplit.parallelize(fmodel, (example,), loss_fn=zoo.mse_loss, pp=2, schedule="1f1b",
                                       microbatches=2, hardware=HW, timeout=FAST)
    r["fixed_wrong"] = _catch(lambda: pm_fixed.step(fx[:4], target=fy[:4]))
    r["fixed_right"] = _catch(lambda: float(pm_fixed.step(fx, target=fy)))

    # -- inference only: step() refused; pm(x) gives the model's own output structure
    dmodel, dx = _BUILT["dict"]
    with shared_plans(_PLANS):
        pm_inf = fxsplit.parallelize(dmodel, (dx,), pp=2, schedule="1f1b", microbatches=3, hardware=HW,
                                     timeout=FAST)
    r["step_inference"] = _catch(lambda: pm_inf.step(dx, target=dx))
    r["dict_out"] = pm_inf(dx)
    r["dict_out_odd"] = pm_inf(dx[:5])

    # -- failures on the last stage only: every rank raises fast, the others name the failed rank
    x, y = _gpt_batch(1, 4, 16)
    with shared_plans(_PLANS):
        bad = fxsplit.parallelize(model, args, loss_fn=_nonscalar_loss_ce, pp=2, schedule="1f1b",
                                  microbatches=2, hardware=HW, timeout=FAST)
    r["nonscalar"] = _catch(lambda: bad.step(x, target=y))
    r["after_failure"] = _catch(lambda: bad.step(x, target=y))
    _, pm = _gpt_pm()
    r["bad_target"] = _catch(lambda: pm.step(x, target=y[:, :7]))

    # -- dp=2, pp=1: one replica fails in its loss; the world group survives, the model too
    _, pm = _gpt_pm(**DP2)
    r["dp_bad_target"] = _catch(lambda: pm.step(x, target=y[:, :7] if rank == 1 else y))
    r["dp_after"] = _catch(lambda: float(pm.step(x, target=y)))
    # -- dp=2, pp=1 training on different data per replica (a fresh model): every gradient goes
    #    in the one data-parallel all-reduce after the step (no pipeline stage to overlap with)
    _, pm = _gpt_pm(**DP2)
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    r["dp_train"] = []
    for step in range(STEPS):
        x, y = _replica_batch(step, pm.coords["dp"])
        step_loss = float(pm.step(x, target=y))
        r["dp_train"].append((step_loss, _local_grads(pm)))
        opt.step()
        opt.zero_grad()

    # -- a rank that never calls step(): its peer gives up after `timeout`, naming the cause
    _, pm = _gpt_pm(timeout=3)
    if rank == 0:
        r["absent_peer"] = _catch(lambda: pm.step(x, target=y))
    else:
        time.sleep(4.5)
    return _all_prepared(rank, r)


def _nonscalar_loss_ce(logits, y):
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none")


@pytest.fixture(scope="module")
def two():
    t0 = time.perf_counter()
    results = run_distributed(_two_ranks, 2, timeout=150, prepare=(_prepare_two, ()))
    print(f"two-rank launch: {time.perf_counter() - t0:.1f}s")
    return results


def _same_error(results, key, kind, *needles):
    for rank, res in enumerate(results):
        got, text, seconds = res[key]
        assert got == kind, f"rank {rank} {key}: expected {kind}, got {got}: {text}"
        for needle in needles:
            assert needle in text, f"rank {rank} {key}: {needle!r} not in {text!r}"
        assert seconds < FAST / 2, f"rank {rank} {key}: took {seconds:.1f}s"


@pytest.mark.dist
def test_world_size_and_mesh_errors_on_every_rank(two):
    _same_error(two, "world", "PlanError", "1*4*1 = 4", "world size 2", "dp=1, pp=2, tp=1", "launch 4 processes")
    _same_error(two, "world_dp", "PlanError", "2*2*1 = 4", "world size 2")
    _same_error(two, "mesh_names", "UsageError", "('pp',)", "shape (2,)", "('dp', 'pp', 'tp')", "(1, 2, 1)",
                "build_mesh(dp=1, pp=2, tp=1)")
    _same_error(two, "mesh_shape", "UsageError", "shape (2, 1, 1)", "(1, 2, 1)")
    _same_error(two, "few_microbatches", "PlanError", "microbatches=1 < pp=2", "microbatches >= 2")
    _same_error(two, "timeout", "UsageError", "timeout", "got 0")
    _same_error(two, "loss_not_callable", "ArgumentTypeError", "loss_fn must be callable", "str")


@pytest.mark.dist
def test_bad_batches_refused_on_every_rank_and_model_stays_usable(two):
    _same_error(two, "small_batch", "PlanError", "batch size 1", "smaller than microbatches=2",
                "at least 2 samples", "fewer pipeline ranks")
    x, _ = _gpt_batch(0, 1, 16)
    want = zoo.make("gpt", **GPT)[0](x).detach()
    for res in two:  # a batch of one runs forward at pp=2 (one microbatch) and matches one process
        torch.testing.assert_close(res["small_batch_fwd"], want, rtol=1e-5, atol=1e-5)
    for rank in (0, 1):  # each also says the other rank refused the same batch
        assert f"failed the same way on global rank(s) [{1 - rank}]" in two[rank]["small_batch"][1]
    # only rank 1 (last stage) lacks the target: it says so, rank 0 names it instead of hanging
    kind, text, _ = two[1]["no_target"]
    assert kind == "UsageError" and "needs the target" in text, text
    kind, text, s = two[0]["no_target"]
    assert kind == "RankFailedError" and "global rank 1 (dp 0, pp 1, tp 0)" in text and "needs the target" in text, text
    assert s < FAST / 2
    assert all(res["same_plan"] for res in two)


@pytest.mark.dist
def test_microbatch_size_fixed_at_trace_time_is_refused_before_the_pipeline(two):
    _same_error(two, "fixed_wrong", "PlanError", "step(): a batch of 4 in microbatches=2",
                "microbatches of [2] samples", "traced with size 4")
    # still usable: batches of 8 give microbatches of 4, the mean of the two halves' losses
    model, x, y = _fixed_model()
    want = (zoo.mse_loss(model(x[:4]), y[:4]) + zoo.mse_loss(model(x[4:]), y[4:])).item() / 2
    for rank, res in enumerate(two):
        kind, value, _ = res["fixed_right"]
        assert kind == "ok" and float(value) == pytest.approx(want, rel=1e-5, abs=1e-6), f"rank {rank}: {value}"


def _gpt_reference(b, t):
    model, _, _ = zoo.make("gpt", **GPT)
    x, y = _gpt_batch(b * 100 + t, b, t)
    out = model(x)
    loss = zoo.cross_entropy_loss(out, y)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    return loss.item(), grads, out.detach()


@pytest.mark.dist
def test_other_batch_sizes_and_lengths_match_one_process_without_replanning(two):
    # (5, 16) and (3, 12): the batch does not divide by m=2; microbatches of 3+2 and 2+1 samples,
    # weighted 3/5, 2/5 and 2/3, 1/3, give the full-batch mean loss and gradients
    for (b, t) in two[0]["runs"]:
        ref_loss, ref_grads, ref_out = _gpt_reference(b, t)
        seen = set()
        for rank, res in enumerate(two):
            loss, grads, out = res["runs"][(b, t)]
            assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6), f"rank {rank} {(b, t)}"
            torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {(b, t)}")
            for name, g in grads.items():
                torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name} {(b, t)}")
                seen.add(name)
        assert seen == set(ref_grads), set(ref_grads) - seen


@pytest.mark.dist
def test_inference_output_keeps_the_model_structure(two):
    model, x = _dict_model()
    with torch.no_grad():
        ref, ref_odd = model(x), model(x[:5])
    _same_error(two, "step_inference", "RunError", "without loss_fn", "loss_fn=...")
    for rank, res in enumerate(two):
        for got, want in ((res["dict_out"], ref), (res["dict_out_odd"], ref_odd)):
            assert isinstance(got, dict) and set(got) == {"logits", "hidden"}, f"rank {rank}: {type(got)}"
            assert isinstance(got["hidden"], tuple) and len(got["hidden"]) == 2
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"rank {rank}")


@pytest.mark.dist
def test_failure_on_last_stage_fails_every_rank_fast_naming_it(two):
    # the last stage's own error, with its type; the other rank names it instead of timing out
    kind, text, s = two[1]["nonscalar"]
    assert kind == "UsageError", text
    assert "got a tensor of shape (2, 16)" in text and ".mean()" in text, text
    assert "pipeline rank 1 failed while running action 1F0" in text, text
    kind, text, s0 = two[0]["nonscalar"]
    assert kind == "RankFailedError", text
    assert "global rank 1 (dp 0, pp 1, tp 0): UsageError: loss_fn must return a scalar" in text, text
    assert max(s, s0) < FAST / 2, (s, s0)
    # the failed pipeline cannot run again: said plainly on every rank
    _same_error(two, "after_failure", "RunError", "cannot run again", "fxsplit.parallelize")
    assert "on global rank(s) [1]" in two[0]["after_failure"][1]
    assert "on this rank (UsageError: loss_fn must return a scalar" in two[1]["after_failure"][1]
    kind, text, _ = two[1]["bad_target"]
    assert kind in ("ValueError", "RuntimeError") and "pipeline rank 1 failed" in text, text
    kind, text, s0 = two[0]["bad_target"]
    assert kind == "RankFailedError" and "global rank 1 (dp 0, pp 1, tp 0)" in text, text
    assert s0 < FAST / 2


@pytest.mark.dist
def test_failure_in_one_data_parallel_replica_without_pipeline(two):
    kind, text, _ = two[1]["dp_bad_target"]
    assert kind == "ValueError" and "batch_size" in text, text
    kind, text, s0 = two[0]["dp_bad_target"]
    assert kind == "RankFailedError" and "global rank 1 (dp 1, pp 0, tp 0): ValueError" in text, text
    assert s0 < FAST / 2
    # pp=1: nothing was destroyed, both replicas train on with the same loss
    assert two[0]["dp_after"][0] == two[1]["dp_after"][0] == "ok", (two[0]["dp_after"], two[1]["dp_after"])
    assert two[0]["dp_after"][1] == two[1]["dp_after"][1]


@pytest.mark.dist
def test_absent_peer_times_out_instead_of_hanging(two):
    kind, text, s = two[0]["absent_peer"]
    assert kind == "RankFailedError" and "global rank 1 (dp 0, pp 1, tp 0)" in text, text
    assert "did not call step() or forward() like the other ranks within 3 s" in text, text
    assert 2.5 < s < 4.5, s


def _global_batch_reference(steps):
    """Losses and per-step gradients of one process trained with SGD on each step's whole batch."""
    model, _, _ = zoo.make("gpt", **GPT)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    params = dict(model.named_parameters(remove_duplicate=False))
    out = []
    for step in range(steps):
        x, y = _replica_batch(step)
        loss = zoo.cross_entropy_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        out.append((loss.item(), {n: p.grad.detach().clone() for n, p in params.items()}))
        opt.step()
    return out


@pytest.mark.dist
def test_data_parallel_without_pipeline_matches_one_process_on_the_global_batch(two):
    # replica d trains on samples 4d..4d+3 of each step's 8: only the data-parallel mean of the
    # gradients over the dp group gives one process's loss and gradients on all 8 samples
    ref = _global_batch_reference(STEPS)
    for rank, res in enumerate(two):
        assert len(res["dp_train"]) == STEPS
        for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(res["dp_train"], ref)):
            assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6), f"rank {rank} step {step}"
            assert set(grads) == set(ref_grads), f"rank {rank} step {step}: {set(grads) ^ set(ref_grads)}"
            for name, g in grads.items():
                torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6,
                                           msg=f"rank {rank} step {step} grad {name}")


# ------------------------------------------------------------------------------------------------
# launch 2: four ranks, dp=2 x pp=2

STEPS, LR = 3, 0.05


def _replica_batch(step, dp_rank=None):
    """Full batch of step `step` (8 samples); replica d gets samples 4d..4d+3."""
    x, y = _gpt_batch(1000 + step, 8, 16)
    if dp_rank is None:
        return x, y
    return x[4 * dp_rank: 4 * dp_rank + 4], y[4 * dp_rank: 4 * dp_rank + 4]


def _four_ranks(rank, world):
    r = {}
    model, args = _BUILT["gpt"]
    r["world"] = _catch(lambda: fxsplit.parallelize(model, args, loss_fn=zoo.cross_entropy_loss, dp=2, pp=3))
    # training on different data per replica: the dp mean equals one process on the whole batch
    _, pm = _gpt_pm(dp=2)
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _replica_batch(step, pm.coords["dp"])
        losses.append(float(pm.step(x, target=y)))
        opt.step()
        opt.zero_grad()
    r["losses"] = losses
    r["state"] = pm.full_state_dict()
    # one replica's batch is bad: every rank of both replicas hears of it, none hangs
    x, y = _replica_batch(0, pm.coords["dp"])
    r["one_replica_small"] = _catch(lambda: pm.step(x[:1] if pm.coords["dp"] == 1 else x, target=y))
    r["usable_after"] = _catch(lambda: pm.step(x, target=y))
    # one replica's last stage fails inside the pipeline
    r["one_replica_target"] = _catch(lambda: pm.step(x, target=y[:, :5] if pm.coords["dp"] == 0 else y))
    return _all_prepared(rank, r)


@pytest.fixture(scope="module")
def four():
    t0 = time.perf_counter()
    results = run_distributed(_four_ranks, 4, timeout=150, prepare=(_prepare_gpt, (dict(dp=2),)))
    print(f"four-rank launch: {time.perf_counter() - t0:.1f}s")
    return results


@pytest.mark.dist
def test_full_state_dict_after_dp_pp_training_equals_one_process(four):
    model, _, _ = zoo.make("gpt", **GPT)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _replica_batch(step)
        loss = zoo.cross_entropy_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    ref = model.state_dict()
    for rank, res in enumerate(four):
        assert res["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6), f"rank {rank}"
        assert set(res["state"]) == set(ref), f"rank {rank}: {set(res['state']) ^ set(ref)}"
        for k, v in ref.items():
            torch.testing.assert_close(res["state"][k], v, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {k}")


@pytest.mark.dist
def test_errors_reach_every_rank_of_every_replica(four):
    _same_error(four, "world", "PlanError", "2*3*1 = 6", "world size 4", "dp=2, pp=2, tp=1")
    # replica 1 (global ranks 2, 3) passed a batch of 1: they say why, replica 0 names them
    for rank in (2, 3):
        kind, text, _ = four[rank]["one_replica_small"]
        assert kind == "PlanError" and "batch size 1" in text, text
    for rank in (0, 1):
        kind, text, s = four[rank]["one_replica_small"]
        assert kind == "RankFailedError" and "global rank 2 (dp 1, pp 0, tp 0)" in text, text
        assert "global rank 3 (dp 1, pp 1, tp 0)" in text and "batch size 1" in text, text
        assert s < FAST / 2
    for rank, res in enumerate(four):
        assert res["usable_after"][0] == "ok", f"rank {rank}: {res['usable_after']}"
    # replica 0's last stage (global rank 1) fails in its loss: all four ranks raise, naming it
    kind, text, _ = four[1]["one_replica_target"]
    assert "pipeline rank 1 failed" in text, text
    for rank in (0, 2, 3):
        kind, text, s = four[rank]["one_replica_target"]
        assert kind == "RankFailedError" and "global rank 1 (dp 0, pp 1, tp 0)" in text, f"rank {rank}: {text}"
        assert s < FAST / 2
