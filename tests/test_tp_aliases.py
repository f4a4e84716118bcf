"""A parameter reachable under two names is ONE parameter for tensor parallelism
([Note: one parameter, two names] in fxsplit.tp.plan): uses that agree shard it alike, uses that
disagree leave every module reading it whole, and the plan names the parameter. Checked in one
process by fxsplit.verify (outputs and every gradient against the unsplit model)."""

from __future__ import annotations

import pytest

import fxsplit
from fxsplit.testing import zoo
from fxsplit.tp.plan import TPPlanError


@pytest.mark.parametrize("method", ["fx", "export"])
def test_aliased_parameters_at_tp2(method):
    model, args, _ = zoo.make("alias")
    plan = fxsplit.plan(model, args, tp=2, method=method)
    tp = plan.tp_plan
    # one Linear registered twice, a column both times: sharded alike under every name it has
    assert tp.param_specs["shared.weight"].dim == 0
    assert all(tp.param_specs[n] == tp.param_specs["shared.weight"] for n in tp.param_specs if n.endswith(".weight")
               and n.split(".")[0] in ("shared", "shared2"))
    # down3.weight IS up4.weight: row in one MLP, column in the next: both whole, the reason names it
    why = dict(tp.replicated)
    for path in ("down3", "up4"):
        assert tp.styles[path] == "replicate"
        assert "'down3.weight'" in why[path] and "up4.weight" in why[path] and "two ways" in why[path], why[path]
    assert "down3.weight" not in tp.param_specs and "up4.weight" not in tp.param_specs
    report = fxsplit.verify(model, args, plan)  # loss and every gradient equal the unsplit model
    assert report.gradients == len(list(model.parameters())), report


def test_override_sharding_an_aliased_parameter_names_it():
    model, args, _ = zoo.make("alias")
    with pytest.raises(TPPlanError, match=r"'up4' is set to 'colwise'.*'down3.weight'"):
        fxsplit.plan(model, args, tp=2, method="fx", tp_plan={"up4": "colwise"})
