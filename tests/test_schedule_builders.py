"""Schedule builders: every schedule validates for many (p, v, m); inline golden grids.

Golden grids: run with FXSPLIT_UPDATE_GOLDENS=1 to rewrite the GOLDEN block of this file.
"""

import os
import re

import pytest

from fxsplit import schedule as schedules
from fxsplit.schedule import Action, ActionKind, align_steps, build, format_schedule, validate

NAMES_V1 = ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"]


@pytest.mark.parametrize("name, stages_per_rank", [("gpipe", (1, 2, 3, 4)), ("1f1b", (1,)),
                                                   ("interleaved_1f1b", (2, 3, 4))])
def test_builders_validate_for_many_sizes(name, stages_per_rank):
    # "1f1b" with v > 1 and "interleaved_1f1b" with v == 1 are the other builder (tested below)
    checked = 0
    for p in range(1, 9):
        for v in stages_per_rank:
            for m in range(p, 3 * p + 1):
                s = build(name, p, m, v)
                info = validate(s, num_stages=p * v, num_microbatches=m)
                assert len(s) == p
                assert info.stage_ranks == tuple(st % p for st in range(p * v))
                # every action exactly once, nothing else
                seen = [a for row in s for a in row if a is not None]
                assert len(seen) == len(set(seen)) == 2 * p * v * m
                checked += 1
    assert checked == sum(len(stages_per_rank) * (2 * p + 1) for p in range(1, 9))


def test_zb_h1_validates_and_uses_split_backward():
    for p in range(1, 9):
        for m in range(1, 3 * p + 1):
            info = validate(build("zb_h1", p, m), num_stages=p, num_microbatches=m)
            assert info.split_backward


def test_small_microbatch_counts_are_supported():
    # m < p: gpipe / 1f1b / zb_h1 directly; interleaved by padding (see builders' Note).
    for name in NAMES_V1:
        validate(build(name, 4, 1), num_stages=4, num_microbatches=1)
    for v in (2, 3):
        for m in (1, 2, 3):
            validate(build("interleaved_1f1b", 4, m, v), num_stages=4 * v, num_microbatches=m)


def test_interleaved_pad_remainder_validates():
    # "front" (the default) is covered by test_builders_validate_for_many_sizes
    for p in range(2, 7):
        for v in (2, 3, 4):
            for m in range(p + 1, 3 * p):
                if m % p:
                    s = schedules.interleaved_1f1b(p, m, v, remainder="pad")
                    validate(s, num_stages=p * v, num_microbatches=m)


def test_megatron_order_with_short_last_group_deadlocks():
    # Why the builder does not simply make the LAST group short: Megatron's order then deadlocks.
    from fxsplit.schedule.builders import B, F
    p, v, m = 4, 3, 5
    fwd, bwd = [], []
    for start in range(0, m, p):
        group = range(start, min(start + p, m))
        fwd += [(c, mb) for c in range(v) for mb in group]
        bwd += [(c, mb) for c in reversed(range(v)) for mb in group]
    s = []
    for r in range(p):
        w = min(2 * (p - r - 1) + (v - 1) * p, m * v)
        order = fwd[:w] + [x for i in range(m * v - w) for x in (fwd[w + i], bwd[i])] + bwd[m * v - w:]
        kinds = [F] * w + [F, B] * (m * v - w) + [B] * w
        s.append([Action(c * p + r, k, mb) for (c, mb), k in zip(order, kinds)])
    with pytest.raises(schedules.ScheduleError, match="deadlock"):
        validate(s)


def test_1f1b_with_several_stages_is_interleaved_and_gpipe_loops():
    for p, m, v in [(3, 4, 2), (4, 9, 3), (2, 2, 4)]:
        assert build("1f1b", p, m, v) == build("interleaved_1f1b", p, m, v)
    for p, m in [(3, 4), (5, 12), (1, 1)]:
        assert build("interleaved_1f1b", p, m, 1) == build("1f1b", p, m)
    s = build("gpipe", 2, 2, 2)
    assert format_schedule(s) == "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1\n1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1"


def test_build_errors():
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'; valid names: gpipe, 1f1b, "
                                         "interleaved_1f1b, zb_h1, zbv, dualpipev, zb_auto"):
        build("pipedream", 2, 2)
    with pytest.raises(ValueError, match="num_microbatches must be an int >= 1, got 0"):
        build("1f1b", 2, 0)
    with pytest.raises(ValueError, match="num_ranks must be an int >= 1, got True"):
        build("gpipe", True, 2)
    with pytest.raises(ValueError, match="zb_h1 supports stages_per_rank=1 only, got 2"):
        build("zb_h1", 2, 4, 2)
    with pytest.raises(ValueError, match="remainder must be one of"):
        build("interleaved_1f1b", 2, 3, 2, remainder="back")
    assert build("Interleaved-1F1B", 2, 2, 2) == build("interleaved_1f1b", 2, 2, 2)
    assert schedules.NAMES == ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev", "zb_auto")
    with pytest.raises(ValueError, match="zbv places exactly 2 stages per rank in a V, got stages_per_rank=3"):
        build("zbv", 2, 4, 3)
    with pytest.raises(ValueError, match="zbv places exactly 2 stages per rank"):
        schedules.placement("zbv", 2, 1)


def test_zbv_validates_with_its_v_placement():
    for p in range(1, 9):
        v_shape = tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))
        assert schedules.placement("zbv", p) == schedules.v_placement(p) == v_shape
        assert schedules.placement("1f1b", p) == tuple(range(p))
        assert schedules.placement("interleaved_1f1b", p, 2) == tuple(s % p for s in range(2 * p))
        for m in range(1, 4 * p + 1):
            s = build("zbv", p, m)
            info = validate(s, num_stages=2 * p, num_microbatches=m)
            assert info.stage_ranks == v_shape and info.split_backward, (p, m)
            assert all(a.kind is not ActionKind.BACKWARD for row in s for a in row)
            # the last stage (the loss) is on rank 0, next to the first
            assert info.stage_ranks[0] == info.stage_ranks[-1] == 0


def test_peak_order_properties_of_1f1b():
    # rank r runs p-r-1 forwards before its first backward
    p, m = 5, 7
    for r, row in enumerate(build("1f1b", p, m)):
        first_b = next(i for i, a in enumerate(row) if a.kind is ActionKind.BACKWARD)
        assert first_b == p - r


# BEGIN GOLDEN
GOLDEN = {
    '1f1b p=3 m=4': """
0F0 0F1 0F2 -   -   0B0 0F3 0B1 -   0B2 -   0B3
-   1F0 1F1 -   1B0 1F2 1B1 1F3 1B2 -   1B3
-   -   2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3
""",
    'gpipe p=2 m=3': """
0F0 0F1 0F2 -   -   0B0 0B1 0B2
-   1F0 1F1 1F2 1B0 1B1 1B2
""",
    'interleaved p=2 v=2 m=3': """
0F0 0F1 0F2 2F0 2F1 2F2 2B0 -   2B1 -   2B2 0B0 0B1 0B2
-   1F0 1F1 1F2 3F0 3B0 3F1 3B1 3F2 3B2 1B0 1B1 1B2
""",
    'zb_h1 p=3 m=3': """
0F0 0F1 0F2 -   -   0I0 0W0 0I1 0W1 0I2 0W2
-   1F0 1F1 -   1I0 1F2 1I1 1W0 1I2 1W1 1W2
-   -   2F0 2I0 2F1 2I1 2F2 2I2 2W0 2W1 2W2
""",
    'zbv p=2 m=4': """
0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3
-   1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3
""",
}
# END GOLDEN

GOLDEN_CASES = {
    "1f1b p=3 m=4": ("1f1b", 3, 4, 1),
    "gpipe p=2 m=3": ("gpipe", 2, 3, 1),
    "interleaved p=2 v=2 m=3": ("interleaved_1f1b", 2, 3, 2),
    "zb_h1 p=3 m=3": ("zb_h1", 3, 3, 1),
    "zbv p=2 m=4": ("zbv", 2, 4, 2),
}


def test_golden_grids():
    # time-aligned (unit steps) string form: one rank per line, "-" idle
    actual = {key: format_schedule(align_steps(build(*args))) for key, args in GOLDEN_CASES.items()}
    if os.environ.get("FXSPLIT_UPDATE_GOLDENS") == "1":
        path = os.path.abspath(__file__)
        src = open(path).read()
        body = "".join(f'    {k!r}: """\n{v}\n""",\n' for k, v in actual.items())
        block = "# BEGIN GOLDEN\nGOLDEN = {\n" + body + "}\n# END GOLDEN"
        src = re.sub(r"# BEGIN GOLDEN\n.*?# END GOLDEN", lambda _: block, src, flags=re.S)
        with open(path, "w") as f:
            f.write(src)
        return
    for key, text in actual.items():
        assert GOLDEN.get(key, "").strip("\n") == text, (
            f"golden grid {key!r} changed; new value:\n{text}\n(FXSPLIT_UPDATE_GOLDENS=1 rewrites it)"
        )


@pytest.mark.parametrize("name", schedules.NAMES)
def test_bubble_floor_is_the_least_closed_form_bubble_over_the_backward_split(name):
    """The planner's lower bound (``ScheduleSpec.bubble_floor``) is never above the closed-form
    ``bubble`` for any split of a rank's backward work into I and W, and ``bubble`` reaches it once
    W may be as large as the forward (I = 0): the floor leaves out only what a larger W cancels."""
    spec = schedules.schedule_spec(name)
    p = 4
    v = spec.default_stages_per_rank(p)
    f = 3.0
    for back in (0.0, 1.5, 3.0, 6.0, 12.0):
        floor = spec.bubble_floor(p, v, f, f + back)
        bubbles = [spec.bubble(p, v, f, back * k / 8, back * (8 - k) / 8) for k in range(9)]
        assert min(bubbles) >= floor - 1e-12, (name, back, bubbles, floor)
        if back >= f:
            assert min(bubbles) == pytest.approx(floor, abs=1e-12), (name, back, bubbles, floor)
