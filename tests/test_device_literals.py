"""[Note: device literals] in fxsplit.api.materialize: the devices a trace baked into a stage's graph
become the device the stage runs on (an HF model traced on the CPU and run on a GPU)."""

import pytest
import torch

import fxsplit
from fxsplit.api.materialize import materialize_stage, on_device, structural_copy


def _literals(gm):
    found = []
    for node in gm.graph.nodes:
        torch.fx.node.map_aggregate((node.args, node.kwargs),
                                    lambda a: found.append(a) if isinstance(a, torch.device) else a)
    return found


def test_baked_devices_become_the_stage_device():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    r = graph.call_function(torch.ops.aten.arange.default, (4,), {"device": torch.device("meta")})
    moved = graph.call_function(torch.ops.aten.to.device, (x, torch.device("meta"), torch.float32))
    graph.output(graph.call_function(torch.ops.aten.add.Tensor, (moved, r)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert on_device(gm, "cpu") == 2
    assert _literals(gm) == [torch.device("cpu")] * 2
    out = gm(torch.ones(4))  # real tensors now, not meta ones
    assert not out.is_meta and out.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert on_device(gm, "cpu") == 0  # nothing left to change


def test_devices_inside_higher_order_subgraphs_change_too():
    """torch 2.11's export puts HF Llama's rotary no_grad block in a wrap_with_set_grad_enabled
    subgraph (a GraphModule attribute of the stage): its device literals run on the stage's device
    too (gpu-check 2026-12-04 found them left on the CPU)."""
    inner = torch.fx.Graph()
    y = inner.placeholder("y")
    r = inner.call_function(torch.ops.aten.arange.default, (4,), {"device": torch.device("meta")})
    inner.output(inner.call_function(torch.ops.aten.add.Tensor, (y, r)))
    outer = torch.fx.Graph()
    x = outer.placeholder("x")
    outer.output(outer.call_module("submod_1", (x,)))
    root = torch.nn.Module()
    root.submod_1 = torch.fx.GraphModule(torch.nn.Module(), inner)
    gm = torch.fx.GraphModule(root, outer)
    assert on_device(gm, "cpu") == 1
    assert _literals(gm.submod_1) == [torch.device("cpu")]
    assert gm(torch.ones(4)).tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.hf
def test_hf_llama_stages_keep_no_trace_device():
    from fxsplit.testing import hf_zoo

    model, args, kwargs = hf_zoo.make_hf("llama")
    plan = fxsplit.plan(model, args, kwargs, pp=2)
    baked = [d for gm in plan.stages.modules for d in _literals(gm)]
    assert baked and set(baked) == {torch.device("cpu")}, baked  # export wrote the trace's device
    # a later stage that builds its own tables (positions, masks: recomputed there, not sent)
    later = next(s for s in range(1, len(plan.stages.modules)) if _literals(plan.stages.modules[s]))
    stage = structural_copy(plan.stages.modules[later])
    assert on_device(stage, "meta") == len(_literals(stage)) > 0
    assert set(_literals(stage)) == {torch.device("meta")}
    assert set(_literals(plan.stages.modules[later])) == {torch.device("cpu")}
    local = materialize_stage(plan, later, tp_rank=0, source=model, device="cpu")  # the device it was traced on
    assert set(_literals(local)) <= {torch.device("cpu")}
