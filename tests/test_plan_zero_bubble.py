"""ZB-V and zb_auto through plan() and the CLI: the schedule chooses the placement, the plan carries
it (split, communication plans, rank plans), and the simulator gets the split's per-stage costs."""

import pytest

import fxsplit
from fxsplit import schedule as schedules
from fxsplit.cli import main
from fxsplit.errors import PlanError
from fxsplit.testing import zoo

INF_LINK = fxsplit.Hardware(link_bytes_per_s=float("inf"))


@pytest.fixture(scope="module")
def zbv_plan():
    model, args, kwargs = zoo.make("gpt")
    return fxsplit.plan(model, args, kwargs, pp=2, schedule="zbv", microbatches=4, hardware=INF_LINK)


def test_zbv_plan_carries_the_v_placement(zbv_plan):
    p = zbv_plan
    assert p.config.stages_per_rank == 2 and p.config.num_stages == 4
    assert p.stage_ranks == schedules.v_placement(2) == (0, 1, 1, 0)
    assert schedules.validate(p.schedule).stage_ranks == p.stage_ranks
    assert [s.rank for s in p.split.stages] == [0, 1, 1, 0]
    assert p.split.problem.stage_ranks == (0, 1, 1, 0)
    assert p.stages_of(0) == (0, 3) and p.stages_of(1) == (1, 2)
    for r in range(2):
        rp = p.rank_plan(r)
        assert rp.stages == p.stages_of(r) and rp.stage_ranks == p.stage_ranks
        # the loss is on rank 0 now: rank 1 sends the last stage's inputs back to rank 0
    sends = [op.message for op in p.comm[1].peer_ops[0] if op.is_send]
    assert any(msg.dst_stage == 3 for msg in sends)
    recvs = [op.message for op in p.comm[0].peer_ops[1] if not op.is_send]
    assert sends == recvs
    # the tied wte / lm_head are on stages 0 and 3, both on rank 0
    assert {s for grp in p.stages.shared_params for s, _ in grp} == {0, 3}
    # rank memory sums the stages placed on the rank
    part = p.split.partition
    assert part.rank_memory[0] == pytest.approx(part.stage_memory[0] + part.stage_memory[3])
    assert "zbv" in str(p)


def test_plan_simulates_with_per_stage_costs(zbv_plan):
    costs = zbv_plan.stage_costs()
    assert all(len(v) == 4 for v in costs.values())
    assert all(f > 0 for f in costs["forward"])
    # stage 0's inputs (token ids) need no gradient: both backward splits run its whole backward as
    # W, and the estimate says so; every later stage has an input-gradient half
    assert costs["backward_input"][0] == 0.0
    assert all(i > 0 for i in costs["backward_input"][1:])
    st0 = zbv_plan.split.stages[0]
    assert costs["backward_weight"][0] == pytest.approx(st0.time - st0.forward_time)
    assert costs["backward"] == pytest.approx([i + w for i, w in zip(costs["backward_input"], costs["backward_weight"])])
    # every stage's F + I + W is its estimated compute time (the infinite link adds no comm)
    for st, f, b in zip(zbv_plan.split.stages, costs["forward"], costs["backward"]):
        assert f + b == pytest.approx(st.time)
        assert st.weight_grad_time > 0  # every GPT stage holds linear layers
    t = zbv_plan.simulate()
    by_action = {e.action: e.end - e.start for e in t.events}
    for s in range(4):
        assert by_action[schedules.Action(s, "F", 0)] == pytest.approx(costs["forward"][s])
        assert by_action[schedules.Action(s, "W", 0)] == pytest.approx(costs["backward_weight"][s])


def test_zb_auto_plan_uses_the_stage_estimates():
    model, args, kwargs = zoo.make("gpt")
    p = fxsplit.plan(model, args, kwargs, pp=2, schedule="zb_auto", microbatches=4, hardware=INF_LINK)
    costs = p.stage_costs()
    want = schedules.zb_auto(2, 4, forward=costs["forward"], backward_input=costs["backward_input"],
                             backward_weight=costs["backward_weight"], comm=costs["comm"], max_inflight=2)
    assert p.schedule == want and p.stage_ranks == (0, 1)
    h1 = fxsplit.plan(model, args, kwargs, pp=2, schedule="zb_h1", microbatches=4, hardware=INF_LINK)
    assert p.simulate().makespan <= h1.simulate().makespan * (1 + 1e-12)
    # a schedule with full backwards prices each B as its stage's I + W
    f1 = fxsplit.plan(model, args, kwargs, pp=2, schedule="1f1b", microbatches=4, hardware=INF_LINK)
    t, c = f1.simulate(), f1.stage_costs()
    for e in t.events:
        if e.action.kind is schedules.ActionKind.BACKWARD:
            assert e.end - e.start == pytest.approx(c["backward"][e.action.stage])
    assert t.makespan < 4 * sum(st.time for st in f1.split.stages)
    with pytest.raises(PlanError, match="zb_auto runs one stage per rank"):
        fxsplit.plan(model, args, kwargs, pp=2, schedule="zb_auto", stages_per_rank=2)
    with pytest.raises(PlanError, match="zbv places exactly 2 stages per rank"):
        fxsplit.plan(model, args, kwargs, pp=2, schedule="zbv", stages_per_rank=1)


def test_schedule_command_prints_zbv(capsys):
    assert main(["schedule", "zbv", "--pp", "2", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert "zbv: p=2 v=2 m=4; 4 stages, stage -> rank [0, 1, 1, 0], backward as I and W; valid" in out
    assert "3F0" in out and "makespan" in out
    assert main(["schedule", "zb_auto", "--pp", "2", "--microbatches", "4"]) == 0
    assert "backward as I and W" in capsys.readouterr().out


def test_partition_sums_memory_by_the_placement():
    from fxsplit.errors import PartitionError
    from fxsplit.pipeline.partition import PartitionProblem, brute_force, solve

    n = 12
    base = dict(compute=[1.0 + (i % 3) for i in range(n)], param_bytes=[10.0 * (i + 1) for i in range(n)],
                activation_bytes=[5.0] * n, cut_bytes=[0.0] * (n + 1), num_stages=4, num_ranks=2,
                inflight=(2.0, 2.0))
    v = PartitionProblem(**base, stage_ranks=(0, 1, 1, 0))
    free = solve(v)
    assert free.stage_ranks == (0, 1, 1, 0) and "stage   3 (rank 0)" in str(free)
    assert free.rank_memory[0] == pytest.approx(free.stage_memory[0] + free.stage_memory[3])
    assert free.rank_memory[1] == pytest.approx(free.stage_memory[1] + free.stage_memory[2])
    # a memory cap on the V's ranks: the exact search agrees with brute force over all cuts
    capped = PartitionProblem(**base, stage_ranks=(0, 1, 1, 0), memory_limit=0.56 * sum(free.rank_memory))
    got, want = solve(capped), brute_force(capped)
    assert got.cuts == want.cuts and max(got.rank_memory) <= capped.memory_limit
    with pytest.raises(PartitionError, match="stage_ranks"):
        PartitionProblem(**base, stage_ranks=(0, 0, 0, 1))


def test_zb_auto_in_flight_limit_from_the_memory_limit():
    from fxsplit.api.plan import _schedule_options

    model, args, kwargs = zoo.make("gpt")
    p = fxsplit.plan(model, args, kwargs, pp=2, schedule="zb_auto", microbatches=6, hardware=INF_LINK,
                     memory_limit=1e9)
    opts = _schedule_options(p.config, p.split)
    assert opts["max_inflight"] == (6, 6)  # everything fits: up to m in flight (ZB-2p and beyond)
    assert all(x <= 6 for x in p.simulate().peak_inflight)
    tight = fxsplit.plan(model, args, kwargs, pp=2, schedule="zb_auto", microbatches=6, hardware=INF_LINK)
    assert _schedule_options(tight.config, tight.split)["max_inflight"] == (2, 2)  # ZB-1p: p
    assert max(tight.simulate().peak_inflight) <= 2
