"""The planner's formula for ranks sharing one host's cores ([Note: host sharing] in
fxsplit.planner.host), checked against a hand calculation and its exact limits; no model trace,
no process group. Its use in the score is tested in test_planner.py."""

import pytest

from fxsplit import schedule
from fxsplit.planner import shared_makespan
from fxsplit.planner.host import shared_rate


def _costs(n, f=1.0, i=1.0, w=1.0):
    return [f] * n, [i] * n, [w] * n, [0.0] * n


def test_1f1b_on_fewer_cores_than_ranks_by_hand():
    # 1F1B, p=2, m=2, F = I = W = 1 per stage (B = 2), no message latency. Alone (2 cores):
    # (m + p - 1)(F + B) = 9. On 1.5 cores, traced by hand: rank 0's F0 alone [0, 1]; F1 on rank 0
    # with F0 on rank 1 at 0.75 each until 2.33; rank 1's B0 alone until 4.33; rank 0's B0 with
    # rank 1's F1 at 0.75 (F1 done at 5.67, B0 half done); B0 with rank 1's B1 (B0 done at 7,
    # B1 half done); B1 alone until 8; rank 0's B1 alone until 10.
    sched = schedule.build("1f1b", 2, 2)
    F, I, W, comm = _costs(2)
    assert shared_makespan(sched, F, I, W, comm, cores=2.0) == pytest.approx(9.0)
    assert shared_makespan(sched, F, I, W, comm, cores=1.5) == pytest.approx(10.0)
    # one core: some rank is always busy, so the makespan is the total work, 2 ranks x 2 x 3
    assert shared_makespan(sched, F, I, W, comm, cores=1.0) == pytest.approx(12.0)


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 8, 1), ("interleaved_1f1b", 2, 4, 2), ("zb_h1", 4, 8, 1),
                                        ("zbv", 2, 4, 2), ("gpipe", 3, 5, 1)])
def test_limits_are_the_plain_simulation_and_the_total_work(name, p, m, v):
    sched = schedule.build(name, p, m, stages_per_rank=v)
    S = p * v
    F = [1.0 + 0.3 * s for s in range(S)]
    I = [1.5 + 0.1 * s for s in range(S)]
    W = [0.7] * S
    comm = [0.05] * S
    plain = schedule.simulate(sched, forward=F, backward=None, backward_input=I, backward_weight=W,
                              comm=comm).makespan
    # as many cores as processes: each runs as if alone
    assert shared_makespan(sched, F, I, W, comm, cores=float(p)) == pytest.approx(plain, rel=1e-9)
    # one core and no latency: never idle, so exactly the total work; with latency at least it
    work = m * (sum(F) + sum(I) + sum(W))
    zero = [0.0] * S
    assert shared_makespan(sched, F, I, W, zero, cores=1.0) == pytest.approx(work, rel=1e-9)
    assert shared_makespan(sched, F, I, W, comm, cores=1.0) >= work * (1 - 1e-12)
    # in between: at least the plain simulation (no action runs faster than alone) and the
    # total work over the cores (the busy processes never get more than the cores)
    mid = shared_makespan(sched, F, I, W, comm, cores=p / 2)
    assert mid >= max(plain, work / (p / 2)) * (1 - 1e-12)


def test_copies_share_the_cores_too():
    # dp x tp copies of each pipeline rank run their actions at the same time: 2 copies of a
    # 2-rank pipeline on 2 cores is the 1-copy pipeline on 1 core
    sched = schedule.build("1f1b", 2, 4)
    F, I, W, comm = _costs(2, 1.0, 2.0, 0.5)
    assert shared_makespan(sched, F, I, W, comm, cores=2.0, copies=2) == pytest.approx(
        shared_makespan(sched, F, I, W, comm, cores=1.0))
    assert shared_rate(4, 2.0) == 0.5 and shared_rate(1, 1.7) == 1.0
    with pytest.raises(ValueError, match="cores"):
        shared_makespan(sched, F, I, W, comm, cores=0.0)

