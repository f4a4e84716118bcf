"""DualPipeV as data ([Note: DualPipeV] in fxsplit.schedule.dualpipe): the order torch's
ScheduleDualPipeV computes, action for action; valid; simulated bubbles against the closed form
the planner scores with; refused where it cannot run. Its runs on gloo are in
tests/test_zero_bubble_dist.py (pp=2 and pp=4 against one process)."""

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import ScheduleDualPipeV
from torch.distributed.pipelining.schedules import _ComputationType as C

from fxsplit import schedule as schedules
from fxsplit.errors import PlanError, ScheduleError

_KIND = {C.FORWARD: "F", C.FULL_BACKWARD: "B", C.BACKWARD_INPUT: "I", C.BACKWARD_WEIGHT: "W"}


def _torch_order(p: int, m: int) -> list[list[str]]:
    """torch's per-rank DualPipeV actions (computed without a process group: the method reads
    only the group size and the microbatch count), each overlapped pair expanded forward first."""
    rows = []
    for r in range(p):
        acts = ScheduleDualPipeV._calculate_single_rank_operations(SimpleNamespace(pp_group_size=p, _n_microbatches=m), r)
        row = []
        for a in acts:
            for b in (a.sub_actions if a.computation_type == C.OVERLAP_F_B else (a,)):
                row.append(f"{b.stage_index}{_KIND[b.computation_type]}{b.microbatch_index}")
        rows.append(row)
    return rows


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
def test_order_equals_torchs_and_validates(p):
    for m in range(2 * p, 4 * p + 3):
        mine = schedules.build("dualpipev", p, m)
        assert [[str(a) for a in row] for row in mine] == _torch_order(p, m), (p, m)
        info = schedules.validate(mine, num_stages=2 * p, num_microbatches=m)
        assert info.stage_ranks == schedules.v_placement(p) == schedules.placement("dualpipev", p)
        assert max(schedules.simulate(mine).peak_inflight) <= p + 1, (p, m)  # the docstring's memory bound


@pytest.mark.parametrize("costs", [(1, 1, 1), (2, 1, 1), (1, 0.5, 1.5), (1, 1.5, 0.5), (1, 2, 1)])
def test_simulated_bubble_against_the_planners_closed_form(costs):
    """The planner's ``bubble`` is exact where F <= W or I <= W (every rank's share), and a lower
    bound otherwise (under by less than a third at p <= 8: the tail's deferred W's leave I's exposed)."""
    F, I, W = costs
    spec = schedules.schedule_spec("dualpipev")
    for p in (2, 3, 4, 8):
        m = 4 * p
        t = schedules.simulate(schedules.build("dualpipev", p, m), forward=[F] * 2 * p, backward=None,
                               backward_input=[I] * 2 * p, backward_weight=[W] * 2 * p)
        idle = t.makespan - m * 2 * (F + I + W)
        closed = spec.bubble(p, 2, 2 * F, 2 * I, 2 * W)
        if I <= W:
            assert idle == pytest.approx(closed), (costs, p)
        else:
            assert closed <= idle < 1.5 * closed, (costs, p, idle, closed)
        # no slower than ZB-V's order on the same costs where the forward dominates
        if F > I:
            zbv = schedules.simulate(schedules.build("zbv", p, m), forward=[F] * 2 * p, backward=None,
                                     backward_input=[I] * 2 * p, backward_weight=[W] * 2 * p)
            assert t.makespan <= zbv.makespan


def test_refusals_name_the_fix():
    with pytest.raises(ScheduleError, match="at least 2 \\* num_ranks = 8 microbatches.*schedule='zbv'"):
        schedules.build("dualpipev", 4, 7)
    with pytest.raises(ScheduleError, match="dualpipev places exactly 2 stages per rank"):
        schedules.build("dualpipev", 2, 4, 3)
    from fxsplit.api.options import ParallelConfig

    with pytest.raises(PlanError, match="dualpipev places exactly 2 stages per rank.*leave stages_per_rank unset"):
        ParallelConfig(pp=2, schedule="dualpipev", stages_per_rank=1).resolved()
    assert ParallelConfig(pp=2, schedule="dualpipev").resolved().stages_per_rank == 2
    assert schedules.schedule_spec("DualPipe-V").name == "dualpipev"
