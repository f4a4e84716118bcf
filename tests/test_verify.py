"""fxsplit.verify: all tp ranks of every stage in one process, collectives emulated, outputs and
gradients vs the unsplit model; a wrong rewrite or a corrupted shard is caught and named."""

import pytest
import torch

import fxsplit
from fxsplit.api.materialize import materialize_stage
from fxsplit.errors import PlanError, VerificationError
from fxsplit.testing import hf_zoo, zoo
from fxsplit.tp.collectives import reduce_from_region

_HW = fxsplit.Hardware(link_bytes_per_s=float("inf"))


@pytest.mark.parametrize("name", zoo.ZOO_NAMES)
def test_verify_passes_on_the_zoo(name):
    model, args, kwargs = zoo.make(name)
    tp = 1 if name in ("cnn", "unet") else 2
    the_plan = fxsplit.plan(model, args, kwargs, tp=tp, pp=2, hardware=_HW)
    report = fxsplit.verify(model, args, the_plan, kwargs)
    assert report.gradients > 0 and report.max_gradient_error < 1e-4 and report.max_output_error < 1e-4, report


@pytest.mark.hf
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_verify_passes_on_hf_models(name):
    pytest.importorskip("transformers")
    model, args, kwargs = hf_zoo.make_hf(name)
    the_plan = fxsplit.plan(model, args, kwargs, tp=2, pp=2, hardware=_HW)
    report = fxsplit.verify(model, args, the_plan, kwargs)
    assert report.gradients > 0 and report.max_gradient_error < 1e-4, report


def test_plan_verify_true_and_the_model_is_left_alone():
    model, args, kwargs = zoo.make("gpt")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fxsplit.plan(model, args, kwargs, tp=2, verify=True)
    assert all(p.grad is None for p in model.parameters()), "verify must not touch the model's .grad"
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def _gpt_plan(tp=2, pp=1):
    model, args, kwargs = zoo.make("gpt")
    return model, args, kwargs, fxsplit.plan(model, args, kwargs, tp=tp, pp=pp, hardware=_HW)


def test_verify_names_the_consumer_of_a_removed_collective():
    model, args, kwargs, the_plan = _gpt_plan()
    gm = the_plan.stages.modules[0]
    reduce = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is reduce_from_region)
    consumer = next(iter(reduce.users))
    reduce.replace_all_uses_with(reduce.args[0])  # the partial sums go on as if they were the sum
    gm.graph.erase_node(reduce)
    gm.recompile()
    with pytest.raises(VerificationError) as info:
        fxsplit.verify(model, args, the_plan, kwargs)
    # the first node after the missing sum that the unsplit graph also holds (a bias add the TP
    # pass wrote has no counterpart there): the consumer or the node right after it
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    named = info.value.node
    assert info.value.stage == 0 and named in order, str(info.value)
    first_downstream = [u for u in consumer.users] + [consumer]
    assert named in {n.name for n in first_downstream}, (named, consumer.name, str(info.value))
    assert repr(named) in str(info.value)


def test_verify_names_the_node_reading_a_corrupted_shard():
    model, args, kwargs, the_plan = _gpt_plan()
    specs = the_plan.tp_plan.param_specs
    name = next(n for n, s in specs.items() if n.endswith("weight") and s.dim == 0 and "mlp" in n)
    mods = [[materialize_stage(the_plan, s, tp_rank=r, source=model) for r in range(2)]
            for s in range(the_plan.config.num_stages)]
    with torch.no_grad():
        mods[0][1].get_parameter(name).mul_(1.5)  # rank 1's shard only
    with pytest.raises(VerificationError) as info:
        fxsplit.verify(model, args, the_plan, kwargs, stage_modules=mods)
    gm = the_plan.stages.modules[0]
    readers = {u.name for n in gm.graph.nodes if n.op == "get_attr" and n.target == name for u in n.users}
    # the linear reading the weight, or within two nodes after it: the fused column-parallel node
    # and its getitem are the TP pass's own (the unsplit graph has no node of their name)
    nodes = {n.name: n for n in gm.graph.nodes}
    near = set(readers)
    for _ in range(2):
        near |= {u.name for n in near for u in nodes[n].users}
    assert info.value.node in near, (info.value.node, readers)
    assert "mlp" in str(info.value), str(info.value)


def test_verify_refuses_what_it_cannot_check():
    with torch.device("meta"):
        model, args, kwargs = zoo.make("mlp")
    the_plan = fxsplit.plan(model, args, kwargs, tp=2)
    with pytest.raises(PlanError, match="meta device"):
        fxsplit.verify(model, args, the_plan, kwargs)
    model, args, kwargs = zoo.make("gpt", dropout=0.1)
    the_plan = fxsplit.plan(model, args, kwargs, tp=2)
    with pytest.raises(PlanError, match="random numbers"):
        fxsplit.verify(model, args, the_plan, kwargs)
    from fxsplit.api.verify import auto_verify_reason

    assert "random" in auto_verify_reason(model, the_plan)


def test_tolerance_is_dtype_aware():
    from fxsplit.api.verify import tolerance

    assert tolerance(torch.float64) < tolerance(torch.float32) < tolerance(torch.float16) < tolerance(torch.bfloat16)
    assert tolerance(torch.int64) == 0.0


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_verify_sees_into_checkpointed_layers(mode):
    """Checkpointed layers (their collectives inside region graphs, the selective ``keep_*``
    wrappers around column-parallel linears) are run in lockstep like the rest: a plan passes,
    and a corrupted shard read inside a checkpointed layer is caught."""
    model, args, kwargs = zoo.make("gpt")
    the_plan = fxsplit.plan(model, args, kwargs, tp=2, pp=2, hardware=_HW, activation_checkpointing=mode)
    assert "checkpointed(" in the_plan.stages.modules[0].code
    fxsplit.verify(model, args, the_plan, kwargs)
    name = next(n for n, s in the_plan.tp_plan.param_specs.items() if "mlp" in n and n.endswith("weight"))
    mods = [[materialize_stage(the_plan, s, tp_rank=r, source=model) for r in range(2)]
            for s in range(the_plan.config.num_stages)]
    stage = next(s for s in range(the_plan.config.num_stages)
                 if name in dict(mods[s][1].named_parameters()))
    with torch.no_grad():
        mods[stage][1].get_parameter(name).mul_(1.5)
    with pytest.raises(VerificationError):
        fxsplit.verify(model, args, the_plan, kwargs, stage_modules=mods)
