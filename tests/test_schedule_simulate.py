"""simulate(): closed forms of GPipe, 1F1B, interleaved 1F1B and ZB-H1; random schedules and costs."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxsplit.schedule import (
    ActionKind,
    ScheduleError,
    align_steps,
    build,
    dependencies,
    simulate,
    validate,
)

approx = lambda x: pytest.approx(x, rel=1e-9, abs=1e-9)  # noqa: E731


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_closed_forms(name):
    for p in range(1, 7):
        for m in range(1, 3 * p + 1):
            for f, b in [(1.0, 2.0), (0.7, 1.9)]:
                t = simulate(build(name, p, m), forward=f, backward=b)
                assert t.makespan == approx((m + p - 1) * (f + b)), (p, m)
                assert t.busy == approx((m * (f + b),) * p)
                assert t.bubble_fraction == approx((p - 1) / (m + p - 1))
                assert t.bubble_ratio == approx((p - 1) / m)
            want = [m] * p if name == "gpipe" else [min(p - r, m) for r in range(p)]
            assert list(t.peak_inflight) == approx(want), (p, m)


def test_gpipe_comm_closed_form():
    # the forward and backward chains each cross p-1 rank boundaries
    for p in range(1, 6):
        for m in range(p, 2 * p + 1):
            t = simulate(build("gpipe", p, m), forward=1.3, backward=2.1, comm=0.4)
            assert t.makespan == approx((m + p - 1) * 3.4 + 2 * (p - 1) * 0.4)


def test_interleaved_closed_forms_for_any_m():
    # bubble time per rank (p-1)(F+B)/v, also for m % p != 0 ("front" remainder, the default)
    for p in range(1, 7):
        for v in range(1, 5):
            for m in range(p, 3 * p + 1):
                f, b = 0.9, 2.3
                t = simulate(build("interleaved_1f1b", p, m, v), forward=f, backward=b)
                assert t.makespan == approx(m * (f + b) + (p - 1) * (f + b) / v), (p, v, m)
                assert t.bubble_ratio == approx((p - 1) / (v * m))
                g = m % p
                for r in range(p):
                    warm = p - r - 1 if v == 1 else 2 * (p - r - 1) + (v - 1) * (p + g)
                    assert t.peak_inflight[r] == approx(min((warm + 1) / v, m)), (p, v, m, r)
                if m % p == 0 and v > 1 and m > p:
                    assert t.peak_inflight[0] == approx(p + (p - 1) / v)  # DESIGN.md's "about p + (p-1)/v"


def test_interleaved_pad_remainder_is_slower_but_lighter():
    p, v, m = 4, 2, 9
    front = simulate(build("interleaved_1f1b", p, m, v))
    pad = simulate(build("interleaved_1f1b", p, m, v, remainder="pad"))
    assert front.idle == approx((4.5,) * 4) and pad.idle == approx((7.5,) * 4)
    assert pad.peak_inflight[0] == approx(p + (p - 1) / v)  # Megatron's, for ceil(m/p)*p microbatches
    assert front.peak_inflight[0] == approx(p + (p - 1) / v + (m % p) * (v - 1) / v)
    one_f_one_b = simulate(build("1f1b", p, m))
    assert pad.makespan < one_f_one_b.makespan


def test_zb_h1_closed_form_and_memory():
    for p in range(1, 7):
        for m in range(p, 3 * p + 1):
            c = 1.5
            t = simulate(build("zb_h1", p, m), forward=c, backward=2 * c, backward_input=c, backward_weight=c)
            assert t.makespan == approx(m * 3 * c + (p - 1) * c), (p, m)  # 1F1B: + (p-1) * 3c
            assert list(t.peak_inflight) == approx([p] * p)


def test_bubble_measures_by_hand():
    t = simulate(build("1f1b", 3, 3), forward=1.0, backward=2.0)
    p, span = 3, t.makespan
    busy = [sum(e.end - e.start for e in t.events_of(r)) for r in range(p)]
    assert t.busy == approx(tuple(busy))
    windows = [t.events_of(r)[-1].end - t.events_of(r)[0].start for r in range(p)]
    idle_in = [w - b for w, b in zip(windows, busy)]
    assert t.idle_active == approx(tuple(idle_in))
    assert t.bubble_fraction == approx((p * span - sum(busy)) / (p * span))
    assert t.bubble_ratio == approx((p * span - sum(busy)) / sum(busy))
    assert t.bubble_active == approx(sum(idle_in) / sum(windows))
    assert t.bubble_active < t.bubble_fraction  # idle before a rank starts / after it ends is excluded
    assert t.idle == approx(tuple(span - b for b in busy))
    text = str(t)
    assert "makespan 15" in text and "bubble_ratio 0.6667" in text and "[3, 2, 1]" in text


def test_virtual_stage_costs_are_a_share():
    t = simulate(build("interleaved_1f1b", 2, 2, 4), forward=2.0, backward=4.0)
    durations = {e.action.kind: e.end - e.start for e in t.events}
    assert durations == {ActionKind.FORWARD: 0.5, ActionKind.BACKWARD: 1.0}
    assert t.stages_per_rank == (4, 4)


def test_cost_arguments():
    s = build("zb_h1", 2, 2)
    t = simulate(s, forward=1.0, backward=3.0, backward_input=1.0)  # W = 3 - 1
    dur = {e.action.kind: e.end - e.start for e in t.events}
    assert dur[ActionKind.BACKWARD_INPUT] == 1.0 and dur[ActionKind.BACKWARD_WEIGHT] == 2.0
    assert dict(t.costs) == {"F": 1.0, "I": 1.0, "W": 2.0}
    with pytest.raises(ValueError, match="the cost of BACKWARD_WEIGHT \\(W\\) must be >= 0, got -1"):
        simulate(s, backward=1.0, backward_input=2.0)
    with pytest.raises(ValueError, match="comm must be >= 0"):
        simulate(s, comm=-0.1)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate("0F0 0B0 0F1 0B1\n1F0 1F1 1B0 1B1")


def test_align_steps_places_actions_at_unit_start_times():
    s = build("1f1b", 3, 3)
    aligned = align_steps(s)
    assert [[a for a in row if a is not None] for row in aligned] == s
    assert validate(aligned) == validate(s)
    assert [str(a) if a else "-" for a in aligned[2]] == ["-", "-", "2F0", "2B0", "2F1", "2B1", "2F2", "2B2"]


SCHEDULES = st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"])


@settings(max_examples=40, deadline=None)
@given(
    name=SCHEDULES,
    p=st.integers(1, 6),
    v=st.integers(1, 3),
    extra=st.integers(0, 12),
    f=st.floats(0.1, 3.0),
    i=st.floats(0.1, 3.0),
    w=st.floats(0.0, 3.0),
    comm=st.floats(0.0, 1.0),
)
def test_random_schedules_and_costs(name, p, v, extra, f, i, w, comm):
    if name == "zb_h1":
        v = 1
    m = p + extra
    s = build(name, p, m, v)
    info = validate(s, num_stages=p * v, num_microbatches=m)
    t = simulate(s, forward=f, backward=i + w, comm=comm, backward_input=i, backward_weight=w)
    # every action simulated exactly once, on its rank, in list order, after its dependencies
    assert sorted(e.action for e in t.events) == sorted(a for row in s for a in row)
    end = {e.action: e for e in t.events}
    for r, row in enumerate(s):
        ev = [end[a] for a in row]
        assert all(e.rank == r == info.stage_ranks[e.action.stage] for e in ev)
        assert all(x.end <= y.start + 1e-9 for x, y in zip(ev, ev[1:]))
    for e in t.events:
        for d in dependencies(e.action, info.num_stages):
            if d in end:
                lag = comm if end[d].rank != e.rank else 0.0
                assert e.start >= end[d].end + lag - 1e-9
    ideal = m * (f + i + w)
    assert t.busy == approx((ideal,) * p)
    assert t.makespan >= ideal - 1e-9
    assert 0.0 <= t.bubble_active <= t.bubble_fraction + 1e-12 and t.bubble_fraction < 1.0
    assert t.makespan == approx(max(e.end for e in t.events))
    if name == "zb_h1":  # splitting the backward never makes ZB-H1 slower than 1F1B
        base = simulate(build("1f1b", p, m), forward=f, backward=i + w, comm=comm)
        assert t.makespan <= base.makespan + 1e-9


def test_zbv_closed_form_and_memory():
    # Qi et al.'s ZB-V with F = I = W: no rank idles inside its active window; the only bubble is
    # the last rank's start, (p-1) forwards of one stage (half a rank share) -- half of ZB-H1's.
    for p in range(1, 7):
        for m in range(2 * p - 1, 3 * p + 2):
            c = 1.5  # a rank's share (two stages of c/2 each) costs c for each of F, I, W
            kw = dict(forward=c, backward=2 * c, backward_input=c, backward_weight=c)
            t = simulate(build("zbv", p, m), **kw)
            assert t.makespan == approx(m * 3 * c + (p - 1) * c / 2), (p, m)
            assert t.idle_active == approx((0.0,) * p), (p, m)
            assert list(t.peak_inflight) == approx([p] * p)  # 1F1B's rank 0, on every rank
            if p > 1:
                assert t.makespan < simulate(build("zb_h1", p, m), **kw).makespan
    # fewer microbatches than the warm-up needs: still valid, never slower than ZB-H1
    for p in range(2, 6):
        for m in range(1, 2 * p - 1):
            kw = dict(forward=1.0, backward=2.0)
            assert simulate(build("zbv", p, m), **kw).makespan <= simulate(build("zb_h1", p, m), **kw).makespan


def test_per_stage_costs():
    s = build("zbv", 3, 6)
    scalar = simulate(s, forward=2.0, backward=4.0, comm=0.25, backward_input=1.5)
    per_stage = simulate(s, forward=[1.0] * 6, backward=[2.0] * 6, comm=[0.25] * 6, backward_input=[0.75] * 6)
    assert [(e.rank, e.action, e.start, e.end) for e in per_stage.events] == \
        [(e.rank, e.action, e.start, e.end) for e in scalar.events]
    assert per_stage.costs == () and "per-stage costs" in str(per_stage)
    assert dict(scalar.costs) == {"F": 2.0, "I": 1.5, "W": 2.5}
    assert dict(per_stage.stage_costs[4]) == {"F": 1.0, "I": 0.75, "W": 1.25}
    # one slow stage: by hand for 1F1B, p = 2, m = 1 (F0 F1 B1 B0 in a chain, two messages)
    t = simulate(build("1f1b", 2, 1), forward=[1.0, 3.0], backward=[2.0, 5.0], comm=[0.5, 0.25])
    assert t.makespan == approx(1.0 + 0.5 + 3.0 + 5.0 + 0.25 + 2.0)
    # I and W per stage, B from them
    t = simulate(build("zb_h1", 2, 2), forward=[1.0, 1.0], backward=None, backward_input=[1.0, 2.0],
                 backward_weight=[0.5, 3.0])
    assert dict(t.stage_costs[1]) == {"F": 1.0, "I": 2.0, "W": 3.0}
    with pytest.raises(ValueError, match="forward has 3 values for 2 stages"):
        simulate(build("1f1b", 2, 2), forward=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="comm must be >= 0"):
        simulate(build("1f1b", 2, 2), comm=[0.0, -1.0])
