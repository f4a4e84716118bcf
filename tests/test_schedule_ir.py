"""Schedule IR: Action text form, schedule string form, stage placement."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxsplit.schedule.ir import (
    Action,
    ActionKind,
    format_schedule,
    parse_schedule,
    stage_to_rank,
)


def test_action_str_and_parse():
    a = Action(2, ActionKind.FORWARD, 0)
    assert str(a) == "2F0"
    assert Action.parse("2F0") == a
    assert Action.parse("11B3") == Action(11, ActionKind.BACKWARD, 3)
    assert Action.parse("0I7").kind is ActionKind.BACKWARD_INPUT
    assert Action.parse("0W7").kind is ActionKind.BACKWARD_WEIGHT
    assert Action(1, "B", 2) == Action(1, ActionKind.BACKWARD, 2)  # kind letters are coerced
    assert repr(Action(1, "B", 2)) == "Action(1, 'B', 2)"
    assert eval(repr(Action(3, "W", 4))) == Action(3, "W", 4)


@pytest.mark.parametrize("text", ["2X0", "F0", "2F", "-1F0", "2 F 0 x", "", "2f0"])
def test_action_parse_rejects_bad_text(text):
    with pytest.raises(ValueError, match="cannot parse action"):
        Action.parse(text)


def test_action_rejects_bad_fields():
    with pytest.raises(ValueError, match="stage must be a non-negative int"):
        Action(-1, "F", 0)
    with pytest.raises(ValueError, match="microbatch must be a non-negative int"):
        Action(0, "F", 1.5)
    with pytest.raises(ValueError, match="kind 'Q' is not one of"):
        Action(0, "Q", 0)


def test_action_ordering_and_hash():
    assert Action(0, "F", 1) < Action(1, "F", 0)
    assert len({Action(0, "F", 0), Action.parse("0F0")}) == 1


def test_parse_schedule_string_and_lists():
    text = """
        0F0 0F1 0B0 0B1
        -   1F0 1B0 .   1F1 1B1
    """
    s = parse_schedule(text)
    assert [str(a) if a else None for a in s[1]] == [None, "1F0", "1B0", None, "1F1", "1B1"]
    assert parse_schedule([["0F0", None, Action(0, "B", 0)], ["-", "1F0"]]) == [
        [Action(0, "F", 0), None, Action(0, "B", 0)],
        [None, Action(1, "F", 0)],
    ]
    assert parse_schedule("") == []


def test_parse_schedule_errors_name_rank_and_step():
    with pytest.raises(ValueError, match="rank 1, step 2: cannot parse action '1Z0'"):
        parse_schedule("0F0 0B0\n1F0 1B0 1Z0")
    with pytest.raises(ValueError, match="rank 0, step 1: expected an Action"):
        parse_schedule([["0F0", 3]])
    with pytest.raises(ValueError, match="rank 0: expected a list of actions"):
        parse_schedule(["0F0 0B0"])


def test_format_schedule_aligns_and_round_trips():
    s = parse_schedule([["0F0", "0F10", None], [], ["2B3"]])
    text = format_schedule(s)
    assert text.split("\n")[0] == "0F0  0F10 -"
    assert text.split("\n")[1] == ""  # an empty rank between others stays an empty line
    assert parse_schedule(text) == s


actions = st.builds(
    Action,
    st.integers(0, 30),
    st.sampled_from(list(ActionKind)),
    st.integers(0, 200),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.one_of(st.none(), actions), min_size=1, max_size=12), min_size=1, max_size=6))
def test_round_trip_random(rows):
    assert parse_schedule(format_schedule(rows)) == rows
    for row in rows:
        for a in row:
            if a is not None:
                assert Action.parse(str(a)) == a


def test_stage_to_rank():
    assert [stage_to_rank(s, 4) for s in range(9)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    with pytest.raises(ValueError, match="num_ranks must be >= 1"):
        stage_to_rank(0, 0)
