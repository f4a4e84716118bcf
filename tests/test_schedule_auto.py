"""zb_auto: a zero-bubble order from per-stage F, I, W, comm costs and a memory limit. Schedules
are data: validated and simulated here with no process group."""

import random

import pytest

from fxsplit import schedule as schedules
from fxsplit.schedule import ActionKind, build, simulate, validate, zb_auto


def _costs(rng, p):
    return dict(forward=[rng.uniform(0.5, 2.0) for _ in range(p)],
                backward_input=[rng.uniform(0.5, 2.0) for _ in range(p)],
                backward_weight=[rng.uniform(0.2, 2.0) for _ in range(p)],
                comm=[rng.choice([0.0, 0.05, 0.3]) for _ in range(p)])


def _span(s, costs):
    return simulate(s, forward=costs["forward"], backward=None, backward_input=costs["backward_input"],
                    backward_weight=costs["backward_weight"], comm=costs["comm"])


def test_zb_auto_is_valid_within_memory_and_never_slower_than_zb_h1_on_unequal_stages():
    rng = random.Random(0)
    gains = []
    for _ in range(25):
        p = rng.randint(1, 5)
        m = rng.randint(1, 3 * p)
        costs = _costs(rng, p)
        one_p = zb_auto(p, m, **costs)  # ZB-1p: p in flight, 1F1B's peak
        two_p = zb_auto(p, m, **costs, max_inflight=2 * p)
        for s, limit in ((one_p, p), (two_p, 2 * p)):
            info = validate(s, num_stages=p, num_microbatches=m)
            assert info.split_backward and info.stage_ranks == tuple(range(p))
            assert all(peak <= limit for peak in _span(s, costs).peak_inflight)
        t1, t2 = _span(one_p, costs).makespan, _span(two_p, costs).makespan
        h1 = _span(build("zb_h1", p, m), costs).makespan
        f1 = _span(build("1f1b", p, m), costs).makespan
        assert t1 <= h1 * (1 + 1e-12) and t1 <= f1 * (1 + 1e-12), (p, m, costs)
        assert t2 <= t1 * (1 + 1e-12)  # more memory never slower
        gains.append(t2 / h1)
    assert min(gains) < 0.97  # on some unequal stages the greedy order is clearly shorter than ZB-H1's


def test_zb_auto_with_zb2p_memory_hides_communication():
    # slow links: ZB-H1's fixed order waits for every message; with ZB-2p's memory the greedy
    # order runs more forwards ahead and fills the waits with them and with weight gradients
    p, m = 4, 8
    costs = dict(forward=[1.0] * 4, backward_input=[1.0] * 4, backward_weight=[1.0] * 4, comm=[0.5] * 4)
    h1 = _span(build("zb_h1", p, m), costs).makespan
    auto = _span(zb_auto(p, m, **costs, max_inflight=2 * p), costs).makespan
    assert h1 == pytest.approx(33.0) and auto == pytest.approx(28.5)
    # and a small W (cheaper than F and I) on unequal stages: the W's fit the gaps
    costs = dict(forward=[1.0, 1.2, 1.0, 1.0], backward_input=[1.0] * 4, backward_weight=[0.3] * 4, comm=[0.0] * 4)
    assert _span(zb_auto(p, m, **costs, max_inflight=2 * p), costs).makespan < \
        _span(build("zb_h1", p, m), costs).makespan


def test_zb_auto_memory_limit_is_respected_and_errors():
    p, m = 4, 8
    for limit in (1, 2, 3):
        s = zb_auto(p, m, max_inflight=limit)
        assert max(simulate(s).peak_inflight) <= limit
        validate(s)
    s = zb_auto(3, 6, max_inflight=(3, 1, 1))
    assert simulate(s).peak_inflight[1] <= 1
    assert build("zb_auto", 2, 4) == zb_auto(2, 4)
    assert "zb_auto" in schedules.NAMES
    assert all(a.kind is not ActionKind.BACKWARD for row in s for a in row)
    with pytest.raises(ValueError, match="zb_auto supports stages_per_rank=1 only"):
        zb_auto(2, 4, 2)
    with pytest.raises(ValueError, match="forward must be a number >= 0 or 2 of them"):
        zb_auto(2, 4, forward=[1.0])
    with pytest.raises(ValueError, match="max_inflight must be an int >= 1"):
        zb_auto(2, 4, max_inflight=0)
