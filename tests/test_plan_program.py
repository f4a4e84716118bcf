"""The plan holds what the runtime runs: options as one typed dataclass, one schedule registry,
and every pipeline rank's communication plan, all printable and testable with no process group."""

import dataclasses

import pytest

import fxsplit
from fxsplit import schedule
from fxsplit.api import SCHEDULES, ParallelConfig
from fxsplit.cli import build_parser
from fxsplit.pipeline.comm import plan_communication
from fxsplit.pipeline.rank_plan import RankPlan
from fxsplit.testing import zoo

INF_LINK = fxsplit.Hardware(link_bytes_per_s=float("inf"))


def test_one_schedule_registry():
    assert SCHEDULES == schedule.NAMES == tuple(schedule.SCHEDULE_BUILDERS)
    assert "zb_h1" in SCHEDULES
    cli = build_parser()
    plan_action = next(a for a in cli._subparsers._group_actions[0].choices["plan"]._actions if a.dest == "schedule")
    assert tuple(plan_action.choices) == SCHEDULES
    model, args, kwargs = zoo.make("gpt")
    p = fxsplit.plan(model, args, kwargs, pp=2, schedule="zb_h1", microbatches=4, hardware=INF_LINK)
    kinds = {a.kind.value for row in p.schedule for a in row if a is not None}
    assert kinds == {"F", "I", "W"}, kinds


def test_plan_holds_every_ranks_communication_plan():
    model, args, kwargs = zoo.make("skip")
    p = fxsplit.plan(model, args, kwargs, pp=2, microbatches=4, schedule="interleaved_1f1b", hardware=INF_LINK)
    assert len(p.comm) == len(p.forward_comm) == 2
    for r in range(2):
        want = plan_communication(p.schedule, p.stages.io, rank=r, num_ranks=2, rank_of_stage=lambda s: s % 2)
        assert p.comm[r] == want
        fwd = plan_communication(p.schedule, p.stages.io, rank=r, num_ranks=2, rank_of_stage=lambda s: s % 2,
                                 forward_only=True)
        assert p.forward_comm[r] == fwd
        rp = p.rank_plan(r)
        assert isinstance(rp, RankPlan) and rp.train is p.comm[r] and rp.forward is p.forward_comm[r]
        assert rp.stages == tuple(s for s in range(p.config.num_stages) if s % 2 == r)
        text = str(rp)
        assert text.startswith(f"pipeline rank {r} of 2: stages {list(rp.stages)}") and "peer" in text
        # every message this rank sends is received by its peer, in the same order
        peer = 1 - r
        sends = [op.message for op in p.comm[r].peer_ops[peer] if op.is_send]
        recvs = [op.message for op in p.comm[peer].peer_ops[r] if not op.is_send]
        assert sends == recvs and sends
    assert "point-to-point per step:" in str(p)
    with pytest.raises(IndexError, match="pp_rank 2 out of range"):
        p.rank_plan(2)


def test_rank_plan_build_matches_the_plan():
    model, args, kwargs = zoo.make("gpt")
    p = fxsplit.plan(model, args, kwargs, pp=2, microbatches=2, schedule="1f1b", hardware=INF_LINK)
    g = p.stages
    built = RankPlan.build(g.io, p.schedule, rank=1, num_ranks=2, input_meta=g.input_meta,
                           shared_params=g.shared_params, output_spec=g.output_spec)
    assert built == p.rank_plan(1)
    with pytest.raises(ValueError, match="stage_ranks has 3 entries for 2 stages"):
        RankPlan.build(g.io, p.schedule, rank=0, num_ranks=2, input_meta=g.input_meta, stage_ranks=(0, 1, 0))


def test_options_are_one_typed_dataclass():
    model, args, kwargs = zoo.make("gpt")
    config = ParallelConfig(pp=2, schedule="1f1b", hardware=INF_LINK)
    a = fxsplit.plan(model, args, kwargs, config=config)
    b = fxsplit.plan(model, args, kwargs, pp=2, schedule="1f1b", hardware=INF_LINK)
    assert a.config == b.config == dataclasses.replace(config, microbatches=4, stages_per_rank=1)
    assert a.config.resolved() is a.config
    c = fxsplit.plan(model, args, kwargs, config=config, microbatches=2)  # keywords override config
    assert c.config.microbatches == 2 and c.config.pp == 2
    with pytest.raises(TypeError, match=r"unknown option\(s\) 'microbatch' \(did you mean 'microbatches'\?\)"):
        fxsplit.plan(model, args, kwargs, microbatch=2)
    with pytest.raises(fxsplit.PlanError, match="microbatches=1 < pp=2"):
        ParallelConfig(pp=2, microbatches=1)
    with pytest.raises(fxsplit.PlanError, match="schedule must be one of"):
        ParallelConfig(schedule="zb_v")
    with pytest.raises(fxsplit.PlanError, match="interleaved_1f1b needs stages_per_rank >= 2"):
        ParallelConfig(pp=2, stages_per_rank=1).resolved()
    assert ParallelConfig(split_points=["blocks.1"]).split_points == ("blocks.1",)


def test_every_error_shares_one_base():
    from fxsplit import errors

    classes = [getattr(errors, n) for n in errors.__all__ if isinstance(getattr(errors, n), type)]
    assert len(classes) >= 12 and all(issubclass(c, fxsplit.FxsplitError) for c in classes)
    for c in errors.REQUEST_ERRORS:
        assert issubclass(c, (ValueError, TypeError, LookupError, AttributeError)), c  # a request that names something wrong
    model, args, kwargs = zoo.make("gpt")
    with pytest.raises(fxsplit.FxsplitError):
        fxsplit.plan(model, args, kwargs, pp=2, split_points=["no.such.module"])
