"""fxsplit.testing.trace_cache: plans from a shared trace are the plans of a fresh trace (stage
code, node metadata, shardings, schedule, every name of a tied weight), the cached trace is
never handed out, and a model changed between the plans is traced again; a plan kept by
SharedPlans is what parallelize would plan, handed out once per add."""

import importlib

import pytest

import torch

import fxsplit
from fxsplit.testing import zoo
from fxsplit.testing.trace_cache import SharedPlans, copy_graph_module, shared_plans, shared_traces

HW = fxsplit.Hardware(link_bytes_per_s=float("inf"))
LAYOUTS = [dict(tp=2, pp=2, microbatches=2, activation_checkpointing="selective"), dict(tp=2, sequence_parallel=True)]


def _summary(p):
    return ([gm.code for gm in p.stages.modules],
            [[(n.name, str(n.meta.get("fxsplit")), str(n.meta.get("val"))) for n in gm.graph.nodes] for gm in p.stages.modules],
            sorted(n for n, _ in p.graph.named_parameters(remove_duplicate=False)),
            repr(p.tp_plan.param_specs), str(p.schedule), str(p.stages.shared_params))


def test_plans_from_a_shared_trace_equal_fresh_plans():
    fresh = []
    for options in LAYOUTS:
        model, args, kwargs = zoo.make("gpt", batch_size=4)
        fresh.append(_summary(fxsplit.plan(model, args, kwargs, hardware=HW, **options)))
    model, args, kwargs = zoo.make("gpt", batch_size=4)
    with shared_traces() as cache:
        shared = [_summary(fxsplit.plan(model, args, kwargs, hardware=HW, **options)) for options in LAYOUTS]
    assert (cache.hits, cache.misses) == (1, 1)
    for options, a, b in zip(LAYOUTS, fresh, shared):
        assert a == b, options
    assert {"wte.weight", "lm_head.weight"} <= set(shared[0][2])


def test_a_changed_model_is_traced_again_and_the_trace_is_never_handed_out():
    model, args, kwargs = zoo.make("gpt", batch_size=4)
    with shared_traces() as cache:
        first = fxsplit.plan(model, args, kwargs, hardware=HW, pp=2, microbatches=2)
        (key, (_, cached, code)), = cache.entries.items()
        assert first.graph is not cached and code == cached.code
        model.eval()
        fxsplit.plan(model, args, kwargs, hardware=HW, pp=2, microbatches=2)
        model.train()
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untied
        untied = fxsplit.plan(model, args, kwargs, hardware=HW, pp=2, microbatches=2)
    assert (cache.hits, cache.misses) == (0, 3)
    assert untied.stages.shared_params == () and first.stages.shared_params


def test_the_copy_shares_tensors_and_keeps_every_module():
    model, args, kwargs = zoo.make("gpt", batch_size=4)
    gm = fxsplit.trace(model, args, kwargs)
    dup = copy_graph_module(gm)
    assert dup.graph is not gm.graph and dup.code == gm.code
    names = dict(gm.named_parameters(remove_duplicate=False))
    got = dict(dup.named_parameters(remove_duplicate=False))
    assert set(got) == set(names) and all(got[n] is names[n] for n in names)
    torch.testing.assert_close(dup(*args, **kwargs), gm(*args, **kwargs), rtol=0, atol=0)
    # what a pass rewrites in the copy (node metadata, a module's attributes) stays in the copy
    next(iter(dup.graph.nodes)).meta["seen"] = True
    path = next(n for n, m in dup.named_modules() if n and list(m.parameters(recurse=False)))
    dup.get_submodule(path).weight = torch.nn.Parameter(torch.zeros(1))
    assert "seen" not in next(iter(gm.graph.nodes)).meta
    assert gm.get_submodule(path).weight is names[f"{path}.weight"]


def test_a_kept_plan_is_parallelizes_own_plan_handed_out_once():
    """[Note: plans made before the fork]: ``add`` plans as parallelize does (its planning config:
    verify=None, the default, keys like verify=False), ``shared_plans`` hands that plan to
    parallelize's call once, and plans afresh for a second call or another model object."""
    from fxsplit.api.options import make_config
    from fxsplit.api.parallelize import planning_config

    par = importlib.import_module("fxsplit.api.parallelize")
    planner = importlib.import_module("fxsplit.api.plan").plan
    options = dict(pp=2, microbatches=2)
    model, args, kwargs = zoo.make("gpt", batch_size=4)
    other, _, _ = zoo.make("gpt", batch_size=4)
    config = planning_config(make_config(None, dict(hardware=HW, verify=None, **options), where="parallelize"), "cpu")
    cache = SharedPlans()
    kept = cache.add(model, args, kwargs, hardware=HW, verify=False, **options)
    with shared_plans(cache):
        first = par.plan(model, args, kwargs, config=config, global_batch_size=None)  # as parallelize calls it
        second = par.plan(model, args, kwargs, config=config, global_batch_size=None)
        elsewhere = par.plan(other, args, kwargs, config=config, global_batch_size=None)
    assert par.plan is planner  # restored
    assert first is kept and second is not kept and elsewhere is not kept and (cache.hits, cache.misses) == (1, 2)
    assert _summary(kept) == _summary(second) == _summary(planner(model, args, kwargs, config=config))


@pytest.mark.hf
def test_what_a_plan_learns_about_the_sizes_does_not_reach_the_next_plan():
    # [Note: the trace's shape environment]: a dp2 x ep2 x cp2 plan of Mixtral writes facts about
    # the batch and sequence symbols into the trace's ShapeEnv; before the restore the next plan
    # from the same trace failed ("Cannot convert symbols to int": its bindings missed the batch)
    from fxsplit.testing.moe_families import build

    model, args, kwargs = build("mixtral")
    layouts = [dict(dp=2, ep=2, cp=2), dict(dp=2, ep=2, cp=2, pp=2)]
    fresh = [_summary(fxsplit.plan(model, args, kwargs, hardware=HW, **o)) for o in layouts]
    with shared_traces() as cache:
        shared = [_summary(fxsplit.plan(model, args, kwargs, hardware=HW, **o)) for o in layouts]
    assert (cache.hits, cache.misses) == (1, 1)
    assert shared == fresh


def test_plans_with_and_without_tp_share_a_trace_unless_attention_is_decomposed():
    """tp traces with ``decompose_attention`` (torch's attention modules as ops); a model with none
    traces the same graph either way, so its tp plan takes the trace of its other plans
    (benchmarks/moe_coverage.py: one trace per family for five layouts) and equals a fresh plan."""
    from fxsplit.graph.decompose import decomposes

    layouts = [dict(pp=2, microbatches=2), dict(tp=2)]
    model, args, kwargs = zoo.make("gpt", batch_size=4)
    fresh = _summary(fxsplit.plan(model, args, kwargs, hardware=HW, **layouts[1]))
    model, args, kwargs = zoo.make("gpt", batch_size=4)
    with shared_traces() as cache:
        shared = [_summary(fxsplit.plan(model, args, kwargs, hardware=HW, **options)) for options in layouts]
    assert (cache.hits, cache.misses) == (1, 1)
    assert shared[1] == fresh
    assert not decomposes(model)
    assert decomposes(torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 2), 1, enable_nested_tensor=False))
