"""[Note: a static batch] (fxsplit.graph.examples): with a known microbatch size (``global_batch_size``
or ``microbatch_size``) torch.export traces the batch static at it; a step whose microbatches
differ is refused naming ``dynamic_batch=True``; the plan trains exactly like one process."""

import pytest
import torch

import fxsplit
from fxsplit.api.model import check_batch
from fxsplit.errors import PlanError
from fxsplit.graph.examples import example_at_batch
from fxsplit.graph.meta import to_expr
from fxsplit.testing import zoo


def _gpt(batch_size=4):
    return zoo.make_gpt(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16, batch_size=batch_size,
                        seq_len=8)


def _input_dims(gm):
    ph = next(n for n in gm.graph.nodes if n.op == "placeholder")
    return [to_expr(s) for s in ph.meta["val"].shape]


def test_example_at_batch_cuts_or_repeats_the_batch_only():
    x, mask, w = torch.arange(12).view(3, 4), torch.ones(3, 4), torch.zeros(5, 3)
    (a,), kw = example_at_batch((x,), {"mask": mask, "w": w}, 2)
    assert torch.equal(a, x[:2]) and kw["mask"].shape == (2, 4) and kw["w"] is w  # dim 0 of 5: not the batch
    (a,), kw = example_at_batch((x,), {"mask": mask}, 7)
    assert torch.equal(a, torch.cat([x, x, x])[:7]) and kw["mask"].shape == (7, 4)
    (a,), _ = example_at_batch((x.to("meta"),), {}, 5)
    assert a.is_meta and a.shape == (5, 4)
    assert example_at_batch((x,), {}, 3)[0][0] is x


def test_trace_static_batch_under_export_only():
    model, args, _ = _gpt()
    gm = fxsplit.trace(model, args, method="export", microbatch_size=2, dynamic_sequence=None)
    info = gm.meta["fxsplit"]
    assert _input_dims(gm) == [2, 8] and "batch" not in info.symbols and "static at 2" in info.reason
    assert all(not n.meta["fxsplit"].cost.free_symbols for n in gm.graph.nodes
               if n.meta.get("fxsplit") is not None and n.meta["fxsplit"].cost is not None)
    out = gm(args[0][:2])
    torch.testing.assert_close(out, model(args[0][:2]))
    gm = fxsplit.trace(model, args, method="fx", microbatch_size=2)  # fx reads sizes at run time: symbolic
    assert _input_dims(gm)[0] == gm.meta["fxsplit"].symbols["batch"]
    with pytest.raises(ValueError, match="microbatch_size must be"):
        fxsplit.trace(model, args, microbatch_size=0)
    # dynamic_batch as in ParallelConfig: False is static at the example's batch, True symbolic
    gm = fxsplit.trace(model, args, method="export", dynamic_batch=False, dynamic_sequence=None)
    assert _input_dims(gm) == [4, 8] and "batch" not in gm.meta["fxsplit"].symbols
    gm = fxsplit.trace(model, args, method="export", dynamic_batch=True, microbatch_size=2, dynamic_sequence=None)
    assert _input_dims(gm)[0] == gm.meta["fxsplit"].symbols["batch"]


def test_trace_old_spellings_warn_and_keep_their_meaning():
    model, args, _ = _gpt()
    with pytest.warns(FutureWarning, match="microbatch_size=b"):
        gm = fxsplit.trace(model, args, method="export", static_batch=2, dynamic_sequence=None)
    assert _input_dims(gm) == [2, 8]
    with pytest.warns(FutureWarning, match="dynamic_batch= and dynamic_sequence="):
        gm = fxsplit.trace(model, args, method="fx", dynamic=False)
    assert _input_dims(gm) == [4, 8] and not gm.meta["fxsplit"].symbols  # no symbol, fx included
    with pytest.raises(TypeError, match="unexpected keyword argument 'dynamc'"):
        fxsplit.trace(model, args, dynamc=False)
    with pytest.raises(ValueError, match="not both"), pytest.warns(FutureWarning):
        fxsplit.trace(model, args, static_batch=2, microbatch_size=2)


def test_plan_with_a_global_batch_is_static_and_refuses_another_batch_naming_the_switch():
    model, args, _ = _gpt()
    # the example has 4 samples; 8 per step in 2 microbatches: traced (and verified) at 4
    p = fxsplit.plan(model, args, pp=2, microbatches=2, schedule="1f1b", method="export", global_batch_size=8,
                     verify=True)
    assert p.config.microbatch_size == 4 and "batch" not in p.graph.meta["fxsplit"].symbols
    assert [to_expr(s) for s in p.stages.input_meta[0].shape] == [4, 8]
    check_batch([torch.zeros(8, 8, dtype=torch.long)], p, "step")
    with pytest.raises(ValueError, match=r"microbatch_size=4.*dynamic_batch=True"):
        check_batch([torch.zeros(6, 8, dtype=torch.long)], p, "step")
    # dynamic_batch=True keeps the symbol: any batch runs
    p = fxsplit.plan(model, args, pp=2, microbatches=2, schedule="1f1b", method="export", global_batch_size=8,
                     dynamic_batch=True)
    assert "batch" in p.graph.meta["fxsplit"].symbols
    check_batch([torch.zeros(6, 8, dtype=torch.long)], p, "step")
    # microbatch_size directly; dynamic_batch=False: the example is one microbatch
    assert fxsplit.plan(model, args, microbatch_size=3, method="export").stages.input_meta[0].shape[0] == 3
    p = fxsplit.plan(model, args, dynamic_batch=False, method="export")
    assert p.config.microbatch_size == 4 and "batch" not in p.graph.meta["fxsplit"].symbols


def test_verify_cuts_the_loss_target_with_the_example():
    # a plan static at 2 samples per microbatch, verified on the whole 4-sample example with a
    # loss: the example and its target are both cut to one microbatch
    model, args, _ = _gpt()
    target = torch.randint(0, 64, args[0].shape, generator=torch.Generator().manual_seed(0))
    p = fxsplit.plan(model, args, pp=2, microbatches=2, schedule="1f1b", method="export", global_batch_size=4)
    assert p.config.microbatch_size == 2
    report = fxsplit.verify(model, args, p, loss_fn=zoo.cross_entropy_loss, target=target)
    assert report.gradients > 0 and report.max_gradient_error < 1e-5, report


def test_static_batch_errors():
    model, args, _ = _gpt()
    with pytest.raises(PlanError, match="does not divide into dp \\* dp_shard \\* microbatches"):
        fxsplit.plan(model, args, pp=2, microbatches=2, global_batch_size=7)
    with pytest.raises(PlanError, match="disagrees with global_batch_size"):
        fxsplit.plan(model, args, microbatch_size=3, global_batch_size=4)
    with pytest.raises(PlanError, match="dynamic_batch must be"):
        fxsplit.ParallelConfig(dynamic_batch="yes")
    with pytest.raises(PlanError, match="microbatch_size must be"):
        fxsplit.ParallelConfig(microbatch_size=0)
    with pytest.raises(PlanError, match="chooses microbatch_size"):
        fxsplit.plan(model, args, strategy="auto", world_size=2, global_batch_size=4, microbatch_size=2)


def _static_cases(rank, world):
    from test_parallelize import _train

    # a global batch of 4: pp=2 in 2 microbatches of 2; dp=2, one microbatch of 2 per replica;
    # tp=2, one of 4 (untied weights: test_parallelize's check names a tied export parameter once)
    return {label: _train(rank, world, "gpt", dict(_OVERRIDES), dict(opts, method="export", global_batch_size=4))
            for label, opts in _LAYOUTS.items()}


_OVERRIDES = {"batch_size": 4, "tie_weights": False}
_LAYOUTS = {"pp2": dict(pp=2, schedule="1f1b", microbatches=2), "dp2": dict(dp=2, microbatches=1),
            "tp2": dict(tp=2, microbatches=1)}


@pytest.mark.dist
def test_static_batch_plans_match_single_process():
    from fxsplit.testing import run_distributed
    from test_parallelize import _check, _reference

    results = run_distributed(_static_cases, 2, timeout=240)
    ref = _reference("gpt", dict(_OVERRIDES))
    for label in _LAYOUTS:
        _check([r[label] for r in results], *ref)
