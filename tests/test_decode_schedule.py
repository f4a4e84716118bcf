"""Decode schedules as data ([Note: decode schedules] in fxsplit.schedule.decode): prefill and
one-token steps of m' microbatches as virtual microbatches, the token dependency, validation with
the grid, and the idle share against today's stepwise program; no process group."""

import pytest

import fxsplit
from fxsplit.pipeline.comm import plan_all_communication
from fxsplit.schedule import ScheduleError, format_schedule, parse
from fxsplit.schedule.decode import decode, decode_dependencies, idle_fraction, validate_decode
from fxsplit.schedule.ir import Action, ActionKind
from fxsplit.testing import zoo

F = ActionKind.FORWARD


def test_overlapped_and_stepwise_programs_golden():
    overlapped = decode((0, 1), microbatches=2, steps=3)
    assert format_schedule(overlapped) == "0F0 0F1 0F2 0F3 0F4 0F5 -\n-   1F0 1F1 1F2 1F3 1F4 1F5"
    stepwise = decode((0, 1), microbatches=2, steps=3, overlap=False)
    assert format_schedule(stepwise) == ("0F0 0F1 -   0F2 0F3 -   0F4 0F5 -\n"
                                         "-   1F0 1F1 -   1F2 1F3 -   1F4 1F5")
    interleaved = decode((0, 1, 0, 1), microbatches=2, steps=2)  # v=2: stages 0, 2 on rank 0
    assert format_schedule(interleaved) == "0F0 0F1 2F0 2F1 0F2 0F3 2F2 2F3 -\n-   1F0 1F1 3F0 3F1 1F2 1F3 3F2 3F3"
    for rows, n_s in ((overlapped, 2), (stepwise, 2), (interleaved, 4)):
        validate_decode(rows, num_stages=n_s, microbatches=2)


@pytest.mark.parametrize("p, m, steps", [(2, 2, 8), (4, 4, 8), (4, 8, 4), (2, 1, 6), (4, 2, 6)])
def test_overlap_idles_less_once_microbatches_cover_the_pipeline(p, m, steps):
    ranks = tuple(range(p))
    on, off = idle_fraction(decode(ranks, m, steps)), idle_fraction(decode(ranks, m, steps, overlap=False))
    # stepwise: every step idles (p - 1) ticks per rank out of (m + p - 1)
    assert off == pytest.approx((p - 1) / (m + p - 1))
    if m == 1:
        assert on == pytest.approx(off)  # one microbatch: each token waits for the whole pipeline
    elif m >= p:
        assert on == pytest.approx((p - 1) / (m * steps + p - 1))  # only the fill and the drain
    else:
        assert on < off


def test_token_dependency_and_validation_errors():
    assert decode_dependencies(Action(0, F, 3), 2, 2) == (Action(1, F, 1),)  # the token of step 1
    assert decode_dependencies(Action(0, F, 1), 2, 2) == ()  # a prefill
    assert decode_dependencies(Action(1, F, 3), 2, 2) == (Action(0, F, 3),)
    with pytest.raises(ScheduleError, match=r"(?s)deadlock.*rank 0 step 1: 0F2 waits for \['1F0'\]"):
        validate_decode(parse("0F0 0F2 0F1 0F3\n1F1 1F0 1F2 1F3"), num_stages=2, microbatches=2)
    with pytest.raises(ScheduleError, match="only forwards run in a decode program"):
        validate_decode(parse("0F0 0B0\n1F0"), num_stages=2, microbatches=1)
    with pytest.raises(ScheduleError, match=r"stage 1 runs on ranks \[1\] and misses virtual microbatches \[1\]"):
        validate_decode(parse("0F0 0F1\n1F0"), num_stages=2, microbatches=1)
    with pytest.raises(ScheduleError, match="steps=0 must be an int >= 1"):
        decode((0, 1), 2, 0)


def test_decode_program_lowers_to_the_communication_plan():
    """The activations of a decode program are ordered by the same lowering as any forward."""
    model, args, kwargs = zoo.make("gpt")
    p = fxsplit.plan(model, args, kwargs, pp=2, microbatches=2)
    rows = [[a for a in row if a is not None] for row in decode(p.stage_ranks, 2, 3)]
    plans = plan_all_communication(rows, p.rank_plan(0).io, num_ranks=2, rank_of_stage=p.stage_ranks.__getitem__,
                                   forward_only=True)
    assert [str(ac.action) for ac in plans[1].actions] == [str(a) for a in rows[1]]
    ranks = p.stage_ranks
    crossings = sum(ranks[s] == 0 and ranks[s + 1] == 1 for s in range(len(ranks) - 1))
    sends = [op for op in plans[0].peer_ops[1] if op.is_send]
    recvs = [op for op in plans[1].peer_ops[0] if not op.is_send]
    # one activation per virtual microbatch and boundary from rank 0 to rank 1, each received there
    assert crossings >= 1 and len(sends) == len(recvs) == 6 * crossings
    assert sorted(op.message.microbatch for op in sends) == sorted(op.message.microbatch for op in recvs)


def test_token_messages_are_planned_with_the_activations():
    """[Note: token messages]: each decode step's token is a message of the program's plan, from the
    last stage's forward of virtual microbatch j to the first stage's of j + m', in the one
    per-peer order both ranks compute (what NCCL needs); without the feedback the program would
    not even be a valid plan for the token dependency."""
    from fxsplit.pipeline.comm import TOKEN, Feedback

    model, args, kwargs = zoo.make("gpt")
    p = fxsplit.plan(model, args, kwargs, pp=2, microbatches=2)
    ranks, io = p.stage_ranks, p.rank_plan(0).io
    rows = [[a for a in row if a is not None] for row in decode(ranks, 2, 3)]
    plans = plan_all_communication(rows, io, num_ranks=2, rank_of_stage=ranks.__getitem__, forward_only=True,
                                   feedback=Feedback(0, 0, 2))
    last = len(ranks) - 1
    sent = [(str(ac.action), m.microbatch) for ac in plans[ranks[last]].actions for m in ac.sends if m.kind == TOKEN]
    got = [(str(ac.action), m.microbatch) for ac in plans[0].actions for m in ac.recvs if m.kind == TOKEN]
    assert sent == [(f"{last}F{j}", j + 2) for j in range(4)]  # steps 0 and 1 feed steps 1 and 2
    assert got == [(f"0F{j}", j) for j in range(2, 6)]
    # the token sends and receives take the same places in both ranks' orders, as activations do
    theirs = [(op.message, op.key) for op in plans[ranks[last]].peer_ops[0] if op.message.kind == TOKEN]
    mine = [(op.message, op.key) for op in plans[0].peer_ops[ranks[last]] if op.message.kind == TOKEN]
    assert theirs == mine and len(mine) == 4
    tags = {op.message.tag for plan in plans for ops in plan.peer_ops.values() for op in ops}
    assert len(tags) == len({op.message for plan in plans for ops in plan.peer_ops.values() for op in ops})
