"""[Note: lazy recompile] (fxsplit.graph.lazy_code): an exported graph generates its code at first
use, and every use (running it, its code, a copy) sees the graph as last edited. (Pickling a
GraphModule fails in torch 2.13 with or without it: a string among the generated code's globals.)"""

import copy
import operator

import torch
from torch.fx._lazy_graph_module import _LazyGraphModule

import fxsplit
from fxsplit.graph.lazy_code import lazily_recompiled
from fxsplit.testing import zoo


def _double_output(gm):
    """Edit ``gm``'s graph: its (single tensor) output times two; returns the new node's name."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    val = out.args[0]
    val = val[0] if isinstance(val, (tuple, list)) else val
    with gm.graph.inserting_before(out):
        doubled = gm.graph.call_function(operator.mul, (val, 2))
    out.replace_input_with(val, doubled)
    gm.recompile()
    return doubled.name


def test_exported_graph_is_lazy_and_every_use_sees_the_last_edit():
    model, args, kwargs = zoo.make("mlp")
    want = model(*args)
    gm = fxsplit.trace(model, args, kwargs, method="export")
    assert isinstance(gm, _LazyGraphModule)
    torch.testing.assert_close(gm(*args), want)
    name = _double_output(gm)  # recompile() after the first run: marks the code stale only
    assert type(gm)._needs_recompile()
    assert name in gm.code  # the code property generates it
    torch.testing.assert_close(gm(*args), 2 * want)
    name2 = _double_output(gm)  # stale again, and run before any code is read
    torch.testing.assert_close(gm(*args), 4 * want)
    assert name2 in gm.code and name2 in str(gm)
    twin = copy.deepcopy(gm)
    torch.testing.assert_close(twin(*args), 4 * want)
    _double_output(twin)  # a copy's edits are its own
    torch.testing.assert_close(twin(*args), 8 * want)
    torch.testing.assert_close(gm(*args), 4 * want)


def test_lazily_recompiled_keeps_a_module_as_it_is():
    model, args, _ = zoo.make("mlp")
    gm = torch.fx.symbolic_trace(model)
    kind = type(gm).__mro__[1]
    same = lazily_recompiled(gm)
    assert same is gm and isinstance(gm, _LazyGraphModule) and isinstance(gm, kind)
    assert lazily_recompiled(gm) is gm and type(gm).__mro__.count(_LazyGraphModule) == 1
    torch.testing.assert_close(gm(*args), model(*args))
    _double_output(gm)
    torch.testing.assert_close(gm(*args), 2 * model(*args))


def test_a_plan_traced_with_export_runs_exactly():
    model, args, kwargs = zoo.make("gpt", n_layer=2)
    plan = fxsplit.plan(model, args, kwargs, tp=2, pp=2, microbatches=2, method="export")
    assert isinstance(plan.graph, _LazyGraphModule)
    report = fxsplit.verify(model, args, plan, kwargs)  # raises on any mismatch
    assert report.gradients > 0 and report.max_gradient_error < 1e-4, report
