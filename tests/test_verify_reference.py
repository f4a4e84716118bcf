"""fxsplit.verify compares with the model the user gave and names the passes that changed its
meaning ([Note: which reference] in fxsplit/api/verify.py); reference="graph" checks the split
alone; success prints one line."""

import pytest
import torch.nn.functional as F

import fxsplit
from fxsplit.errors import UsageError, VerificationError
from fxsplit.graph.meta import annotate_node
from fxsplit.graph.pass_api import PassResult
from fxsplit.testing import zoo


def gelu_to_silu(gm, ctx):  # keeps the metadata contract, changes what the model computes
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is F.gelu]:
        with gm.graph.inserting_after(node):
            new = gm.graph.call_function(F.silu, node.args)
        new.meta["val"] = node.meta["val"]
        annotate_node(new, gm, module_path=node.meta["fxsplit"].module_path)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    return PassResult(gm, True)


def count_nodes(gm, ctx):  # reads only
    ctx.report["count_nodes"] = len(gm.graph.nodes)
    return PassResult(gm, False)


@pytest.fixture(scope="module")
def example():
    return zoo.make("gpt", n_layer=1, seed=0)


def test_a_pass_that_changes_meaning_is_named(example, capsys):
    model, args, kwargs = example
    plan = fxsplit.plan(model, args, kwargs, passes=[count_nodes, gelu_to_silu])
    with pytest.raises(VerificationError) as info:
        fxsplit.verify(model, args, plan, kwargs)
    msg = str(info.value)
    assert "'gelu_to_silu' (outputs move by" in msg and "count_nodes" not in msg, msg
    assert "reference='graph'" in msg
    report = fxsplit.verify(model, args, plan, kwargs, reference="graph")  # the split itself is exact
    assert report.max_output_error < 1e-4
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fxsplit.verify: OK, verified:") and \
        lines[0].endswith("against the model after the plan's passes"), lines


def test_a_pass_that_keeps_meaning_verifies_against_the_model(example, capsys):
    model, args, kwargs = example
    plan = fxsplit.plan(model, args, kwargs, passes=[count_nodes])
    fxsplit.verify(model, args, plan, kwargs)
    assert capsys.readouterr().out.strip().endswith("against the model you gave")
    fxsplit.verify(model, args, plan, kwargs, quiet=True)
    assert capsys.readouterr().out == ""


def test_unknown_reference_is_a_usage_error(example):
    model, args, kwargs = example
    plan = fxsplit.plan(model, args, kwargs)
    with pytest.raises(UsageError, match="reference='weights'.*'model'"):
        fxsplit.verify(model, args, plan, kwargs, reference="weights")
