"""The failure protocol under real faults ([Note: failure protocol] in fxsplit.runtime.watch):
a rank killed with -9, stopped with SIGSTOP, or raising in its loss_fn ends every other rank
within 2 x timeout, each naming the rank at fault, and every survivor's process exits.

Each case is 4 gloo processes of the quickstart GPT launched by fxsplit.testing.faults (which,
unlike the test harness, lets each survivor end on its own). Without the protocol these hang:
the tp peer of a rank whose loss_fn raised waits in its all-reduce for the group's 30-minute
default, a SIGSTOPped rank's peers never exit (checked by disabling it: the tp2pp2 raise case
ran past the launcher's limit)."""

from __future__ import annotations

import pytest

from fxsplit.testing.faults import run_case

TIMEOUT = 4.0


@pytest.mark.dist
@pytest.mark.parametrize("case", ["tp2pp2-raise-loss", "pp4-kill-F", "tp2pp2-stop"])
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
