"""validate(): rejects broken schedules naming the rule and the action, with the marked grid."""

import re

import pytest

from fxsplit.schedule import ScheduleError, build, format_schedule, parse_schedule, validate

GOOD = """
0F0 0F1 0B0 0B1
1F0 1B0 1F1 1B1
"""


def _error(schedule, **kwargs) -> str:
    with pytest.raises(ScheduleError) as info:
        validate(schedule, **kwargs)
    return str(info.value)


def _grid_lines(message: str) -> list[str]:
    return [line for line in message.split("\n") if line.startswith("rank ")]


def test_good_schedule_info():
    info = validate(GOOD)
    assert (info.num_ranks, info.num_stages, info.num_microbatches) == (2, 2, 2)
    assert info.stage_ranks == (0, 1) and not info.split_backward
    assert info.stages_of(1) == (1,)
    assert isinstance(ScheduleError("x"), ValueError)


def test_missing_backward():
    msg = _error("""
        0F0 0F1 0B0 0B1
        1F0 1B0 1F1
    """)
    assert msg.startswith("missing backward: no backward for stage 1 microbatch 1: expected 1B1 (or 1I1 and 1W1)")
    assert "[1F1]" in _grid_lines(msg)[1]  # the forward whose backward is missing is marked


def test_duplicated_forward_marks_both():
    msg = _error("""
        0F0 0F1 0F0 0B0 0B1
        1F0 1B0 1F1 1B1
    """)
    assert msg.startswith("duplicate action: 0F0 appears at rank 0 step 0 and again at rank 0 step 2")
    row = _grid_lines(msg)[0]
    assert row.count("[0F0]") == 2


def test_wrong_order_on_one_rank():
    msg = _error("""
        0B0 0F0 0F1 0B1
        1F0 1B0 1F1 1B1
    """)
    assert msg.startswith("forward before backward: 0B0 at rank 0 step 0 runs before 0F0 (step 1)")
    assert "[0B0]" in _grid_lines(msg)[0] and "[0F0]" in _grid_lines(msg)[0]


def test_stage_order_on_one_rank():
    # stages 0 and 1 both on rank 0: F of stage 1 must follow F of stage 0
    msg = _error([["1F0", "0F0", "1B0", "0B0"]])
    assert msg.startswith("forward order (F of stage s before F of stage s+1): 1F0 at rank 0 step 0")
    msg = _error([["0F0", "1F0", "0B0", "1B0"]])
    assert msg.startswith("backward order (B of stage s+1 before B of stage s): 0B0 at rank 0 step 2")


def test_deadlocking_swap():
    # Swapping two actions of a valid 1F1B makes rank 0 wait for 1B0 while rank 1 waits for 0F1.
    good = build("1f1b", 2, 2)
    validate(good)
    bad = parse_schedule("""
        0F0 0B0 0F1 0B1
        1F0 1F1 1B0 1B1
    """)
    msg = _error(bad)
    assert msg.startswith("deadlock: no rank can progress")
    assert "rank 0 step 1: 0B0 waits for the gradient from 1B0 (rank 1 step 2" in msg
    assert "rank 1 step 1: 1F1 waits for the activation from 0F1 (rank 0 step 2" in msg
    rows = _grid_lines(msg)
    assert "[0B0]" in rows[0] and "[1F1]" in rows[1]
    assert re.search(r"^step\s+\|\s+0\s+1\s+2\s+3$", msg, re.M)  # the grid has a step header


def test_deadlock_across_three_ranks_of_builder_output():
    s = build("1f1b", 3, 3)
    s[2][0], s[2][1] = s[2][1], s[2][0]  # 2B0 before 2F0 on the last rank: same-rank rule
    assert _error(s).startswith("forward before backward: 2B0 at rank 2 step 0")
    s = build("1f1b", 3, 3)
    s[0] = [s[0][0], s[0][3], s[0][1], s[0][2], s[0][4], s[0][5]]  # 0B0 before 0F1 and 0F2
    msg = _error(s)
    assert msg.startswith("deadlock") and "[0B0]" in _grid_lines(msg)[0]


def test_split_backward_rules():
    ok = """
        0F0 -   -   0I0 0W0
        -   1F0 1I0 1W0
    """
    assert validate(ok).split_backward
    assert _error("""
        0F0 0I0 0B0
        1F0 1B0
    """).startswith("mixed backward: 0B0 and 0I0 both appear")
    assert _error("""
        0F0 0W0 0I0
        1F0 1B0
    """).startswith("split backward order (I before W): 0W0 at rank 0 step 1")
    assert _error("""
        0F0 0I0
        1F0 1B0
    """).startswith("missing backward: 0I0 appears without 0W0")


def test_stage_on_two_ranks_and_ranges():
    assert _error("""
        0F0 0B0
        1F0 0F1 1B0
    """).startswith("stage on two ranks: stage 0 has actions on rank 0 (step 0) and on rank 1 (0F1 at step 1)")
    assert _error(GOOD, num_microbatches=1).startswith("out of range: 0F1 at rank 0 step 1 is outside")
    assert _error(GOOD, num_microbatches=3).startswith("missing forward: 0F2 is not in the schedule")
    assert _error(GOOD, num_stages=3).startswith("missing stage: stage 2 has no actions")
    assert _error([[None], []]).startswith("empty schedule")


def test_idle_entries_wait_for_nothing():
    # None only aligns pictures; a grid with idle steps validates like the compact one
    s = build("1f1b", 3, 4)
    padded = [[None] * r + row for r, row in enumerate(s)]
    assert validate(padded) == validate(s)
    assert format_schedule(parse_schedule(format_schedule(padded))) == format_schedule(padded)
