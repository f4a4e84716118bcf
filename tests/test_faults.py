"""The failure protocol under real faults ([Note: failure protocol] in fxsplit.runtime.watch):
a rank killed with -9 (in training or in ``generate``), stopped with SIGSTOP, or raising in its loss_fn ends every other rank
within 2 x timeout, each naming the rank at fault, and every survivor's process exits.

Each case is 4 gloo processes of the quickstart GPT (2 of the zoo's MoE for ep: the survivor waits
in the experts' all-to-all; 2 at cp=2: a rank killed inside the ring exchange of keys and values, or
stopped while its peer waits in the all-gather of them) launched by fxsplit.testing.faults (which,
unlike the test harness, lets each survivor end on its own). Checked by breaking the protocol on
purpose (parallelize without its watch, the groups' timeouts kept): all three cases failed, no
survivor named the rank at fault, two survivors died by SIGABRT and the SIGSTOP case ran past 2 x T (at T = 6)."""

from __future__ import annotations

import math
import re

import pytest

from fxsplit.testing.faults import run_case
from fxsplit.testing.trace_cache import SharedPlans, shared_plans

TIMEOUT = 10.0  # a stop is found at T + the heartbeat check; exits under a loaded suite take seconds more


@pytest.mark.dist
@pytest.mark.parametrize("case", ["tp2pp2-raise-loss", "pp4-kill-F", "tp2pp2-stop", "ep2-stop", "cp2ring-kill-cp",
                                  "cp2ag-stop", "tp2pp2-kill-generate"])
def test_a_fault_ends_every_rank_fast_naming_the_rank_at_fault(case):
    row = run_case(case, TIMEOUT)
    detail = f"{case}: {row}"
    assert not row["hung"], detail
    assert row["seconds"] is not None and row["seconds"] <= 2 * TIMEOUT, detail
    assert row["named"], detail  # every survivor's error says "global rank <fault rank> "
    assert all(code == 1 for code in row["exit_codes"]), detail  # raised, then exited
    assert row["kinds"] == ["RankFailedError"], detail


def _slow_but_healthy(rank, world):
    import time

    import torch

    import fxsplit
    from fxsplit.testing import zoo

    model, args, _ = zoo.make("gpt", n_layer=2, batch_size=4, seq_len=16)
    x, = args
    y = x.roll(-1, 1)

    def slow_loss(out, target):  # every wait on the last stage lasts ~4 slices of a polled wait
        time.sleep(0.4)
        return zoo.cross_entropy_loss(out, target)

    pm = fxsplit.parallelize(model, args, loss_fn=slow_loss, pp=2, tp=1, microbatches=2, timeout=5.0,
                             schedule="1f1b")
    loss = float(pm.step(x, target=y))
    want = float(zoo.cross_entropy_loss(model(x), y))
    return loss, want


@pytest.mark.dist
def test_a_slow_but_healthy_rank_is_not_a_fault():
    # waits far longer than a slice (0.1 s) but shorter than the timeout end normally: a timed-out
    # slice of a point-to-point wait would close gloo's connection, so those wait in one piece
    from fxsplit.testing import run_distributed

    for loss, want in run_distributed(_slow_but_healthy, 2, timeout=120):
        assert loss == pytest.approx(want, rel=1e-5)


# _mismatched's models (zoo GPT overrides) and layouts; its subject is the checks of each call, not
# planning, so each model is built and planned once per launch, before the ranks fork ([Note:
# preparing once per launch] in fxsplit.testing.harness), and every rank takes its copy of the plan
# ([Note: plans made before the fork] in fxsplit.testing.trace_cache)
MISMATCHED = {
    "inputs": (dict(n_layer=4, batch_size=8, seq_len=16), dict(pp=4, microbatches=4)),
    "losses_differ": (dict(n_layer=2, batch_size=4, seq_len=16), dict(tp=2, pp=2, microbatches=2)),
    "nonfinite": (dict(n_layer=2, batch_size=4, seq_len=16), dict(dp=2, pp=2, microbatches=2)),
}
_MODELS: dict = {}  # label of MISMATCHED -> (model, x)
_PLANS = SharedPlans()


def _prepare_mismatched():
    from fxsplit.testing import zoo

    for label, (overrides, options) in MISMATCHED.items():
        model, (x,), _ = zoo.make("gpt", **overrides)
        _MODELS[label] = model, x
        _PLANS.add(model, (x,), **options)


def _mismatched(rank, world):
    import torch

    import fxsplit
    from fxsplit.testing import zoo

    def parallelized(label, loss_fn):  # (model, x, this rank's ParallelModel) of MISMATCHED[label]
        model, x = _MODELS[label]
        with shared_plans(_PLANS):
            return model, x, fxsplit.parallelize(model, (x,), loss_fn=loss_fn, timeout=10.0, **MISMATCHED[label][1])

    model, x, pm = parallelized("inputs", zoo.cross_entropy_loss)
    y = x.roll(-1, 1)
    out = {}

    def catch(fn):
        try:
            value = fn()
            return ("ok", value)
        except Exception as exc:  # noqa: BLE001
            return (type(exc).__name__, str(exc))

    short = x[:6] if rank == 0 else x
    out["forward"] = catch(lambda: pm(short))
    out["step"] = catch(lambda: pm.step(short, target=y[: len(short)]))
    out["after"] = catch(lambda: float(pm.step(x, target=y)))
    out["want"] = float(zoo.cross_entropy_loss(model(x), y))

    # tp=2 x pp=2: the two tensor-parallel ranks of the last stage run loss_fns that differ (loss_fn
    # is no planning option: every rank takes the one plan)
    scale = 1.0 + 0.5 * (rank == 3)
    differ = lambda o, t: zoo.cross_entropy_loss(o, t) * scale  # noqa: E731
    _, x2, pm2 = parallelized("losses_differ", differ)
    y2 = x2.roll(-1, 1)
    out["losses_differ"] = catch(lambda: pm2.step(x2, target=y2))

    # a non-finite loss on one replica (dp=2 x pp=2): one value everywhere, and one norm
    nan_on_replica_1 = lambda o, t: zoo.cross_entropy_loss(o, t) * (float("nan") if rank >= 2 else 1.0)  # noqa: E731
    _, x3, pm3 = parallelized("nonfinite", nan_on_replica_1)
    y3 = x3.roll(-1, 1)
    loss3 = pm3.step(x3, target=y3)
    out["nonfinite"] = (float(loss3), float(pm3.clip_grad_norm_(1.0)))
    assert _PLANS.misses == 0, (f"rank {rank} planned {_PLANS.misses} model(s) itself: "
                                "a plan made before the fork went unused")
    return out


@pytest.mark.dist
def test_inputs_and_losses_that_must_agree_are_checked_on_every_rank():
    from fxsplit.testing import run_distributed

    results = run_distributed(_mismatched, 4, timeout=240, prepare=(_prepare_mismatched, ()))
    for rank, res in enumerate(results):
        for key in ("forward", "step"):
            kind, text = res[key]
            assert kind == "UsageError", (rank, key, text)  # never an output, never SIGABRT
            assert re.search(r"global rank 0 \(dp 0, pp 0, tp 0\) holding [^:]*: inputs \[\(6, 16\)\]", text), (rank, text)
            assert re.search(r"global rank 1 \(dp 0, pp 1, tp 0\) holding [^:]*: inputs \[\(8, 16\)\]", text), (rank, text)
        kind, value = res["after"]  # refused before the pipeline: the model stays usable
        assert kind == "ok" and value == pytest.approx(res["want"], rel=1e-5), (rank, res["after"])
        kind, text = res["losses_differ"]
        assert kind == "RunError" and "computed different losses" in text, (rank, text)
        assert "global rank 3 (dp 0, pp 1, tp 1)" in text, (rank, text)
        loss, norm = res["nonfinite"]  # replica 1's NaN loss: NaN on every rank of both replicas
        assert math.isnan(loss) and math.isnan(norm), (rank, res["nonfinite"])


def _recover_after_dp_failure(rank, world):
    import time

    import fxsplit
    from fxsplit.testing import zoo

    model, (x,), _ = zoo.make("gpt", n_layer=2, batch_size=4, seq_len=16)
    y = x.roll(-1, 1)
    calls = [0]

    def loss_fn(out, target):
        calls[0] += 1
        if rank == 1 and calls[0] == 1:
            raise ValueError("a bad batch on one replica")
        return zoo.cross_entropy_loss(out, target)

    pm = fxsplit.parallelize(model, (x,), loss_fn=loss_fn, dp=2, pp=1, tp=1, microbatches=2, timeout=10.0)
    if rank == 1:  # late into the gradient all-reduce: the other replica waits ~6 slices in it
        sync = pm._grads.finish
        pm._grads.finish = lambda: (time.sleep(0.6), sync())
    try:
        pm.step(x, target=y)
        first = "ok"
    except Exception as exc:  # noqa: BLE001
        first = type(exc).__name__
    return first, float(pm.step(x, target=y)), float(zoo.cross_entropy_loss(model(x), y))


@pytest.mark.dist
def test_a_model_left_usable_after_a_failure_reads_a_fresh_board():
    # pp = tp = 1: a failure inside one replica's loss leaves nothing in flight, so the model stays
    # usable; the report of that failure must not fail the next call's waits
    from fxsplit.testing import run_distributed

    results = run_distributed(_recover_after_dp_failure, 2, timeout=120)
    assert [r[0] for r in results] == ["RankFailedError", "ValueError"], results
    for first, loss, want in results:
        assert loss == pytest.approx(want, rel=1e-5), results
