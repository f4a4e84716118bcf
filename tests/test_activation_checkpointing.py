"""Activation checkpointing (issue 11): the pass (numerics identical to no checkpointing, dropout
masks replayed, fewer saved bytes), the planner's memory model ("auto" per stage within
memory_limit), the plan table, the simulator's recompute charge and the CLI flag."""

import functools

import pytest
import torch

import fxsplit
from fxsplit.pipeline.memory import worst
from fxsplit.cli import main
from fxsplit.graph.pass_api import PassContext, PassManager
from fxsplit.graph.recompute import keeps_output, layer_key
from fxsplit.passes.activation_checkpointing import activation_checkpointing
from fxsplit.testing import zoo
from fxsplit.testing.memory import LiveBytes

MODES = ("selective", "full")


def _checkpointed(gm, mode):
    ctx = PassContext()
    out = PassManager([functools.partial(activation_checkpointing, mode=mode)], debug=False)(gm, ctx)
    return out.graph_module, ctx.report["activation_checkpointing"][0]


def _held_after_forward(gm, args):
    """Bytes a forward leaves alive for backward (and its output): everything autograd,
    checkpoint and the selective cache hold."""
    with LiveBytes() as mode:
        out = gm(*args)
        return mode.live


def _run(gm, args, target, loss_fn, seed=3):
    torch.manual_seed(seed)
    for p in gm.parameters():
        p.grad = None
    out = gm(*args)
    out = out[0] if isinstance(out, (tuple, list)) else out
    loss = loss_fn(out, target)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in gm.named_parameters() if p.grad is not None}


def _assert_same(ref, got):
    assert torch.equal(ref[0], got[0]), (ref[0], got[0])
    assert set(ref[1]) == set(got[1])
    for name in ref[1]:
        assert torch.equal(ref[1][name], got[1][name]), name


@pytest.mark.parametrize("name", ["gpt", "gpt_dropout", "cnn", "unet", "kwargs"])
@pytest.mark.parametrize("mode", MODES)
def test_pass_is_exact_on_the_zoo(name, mode):
    # (the zoo's MLP and skip model have one-node layers: nothing to checkpoint)
    over = dict(n_layer=2, dropout=0.2, attn_dropout=0.2) if name == "gpt_dropout" else {}
    over = dict(n_layer=2) if name == "gpt" else over
    model, args, _ = zoo.make("gpt" if name == "gpt_dropout" else name, **over)
    gm = fxsplit.plan(model, args).stage_graph(0)  # one stage: the traced graph, fxsplit metadata on
    base = "gpt" if name.startswith("gpt") else name
    out = gm(*args)
    target = zoo.make_target(base, out[0] if isinstance(out, (tuple, list)) else out)
    loss_fn = zoo.loss_fn(base)
    ref = _run(gm, args, target, loss_fn)
    ck, report = _checkpointed(gm, mode)
    _assert_same(ref, _run(ck, args, target, loss_fn))  # dropout masks replayed: bit-identical
    if name.startswith("gpt"):
        assert [k for k, *_ in report] == [f"blocks.{i}" for i in range(model.config.n_layer)]
        assert "ckpt_blocks_0" in ck.code and f"'{mode}'" in ck.code
        assert ("keep_call_module(" in ck.ckpt_blocks_0.code) == (mode == "selective")
    assert report, f"{name}: no region checkpointed"
    assert set(ck.state_dict()) == set(model.state_dict())  # parameter names unchanged


def test_held_bytes_drop_as_the_plan_says():
    model, args, _ = zoo.make("gpt", n_layer=4, n_embd=64, attn_dropout=0.1, seq_len=32, batch_size=4)
    plans = {m: fxsplit.plan(model, args, activation_checkpointing=m) for m in ("none", *MODES)}
    measured = {m: _held_after_forward(plans[m].stage_graph(0), args) for m in plans}
    predicted = {m: plans[m].split.stages[0].activation_bytes for m in plans}
    assert measured["full"] < measured["selective"] < measured["none"], measured
    assert predicted["full"] < predicted["selective"] < predicted["none"], predicted
    for m in plans:  # the cost model's estimate within 25% of what the forward holds (logits included)
        assert abs(measured[m] - predicted[m]) <= 0.25 * measured[m], (m, measured, predicted)
    assert plans["full"].split.stages[0].activation_bytes_unchecked == predicted["none"]


def test_hf_llama_checkpointed_is_exact():
    pytest.importorskip("transformers")
    from fxsplit.testing import hf_zoo

    model, args, kwargs = hf_zoo.make_hf("llama")
    plan = fxsplit.plan(model, args, kwargs, activation_checkpointing="selective")
    gm = plan.stage_graph(0)
    plain = fxsplit.plan(model, args, kwargs).stage_graph(0)
    flat = [a for a in (*args, *kwargs.values())]
    target = torch.randint(0, model.config.vocab_size, flat[0].shape)
    ref = _run(plain, flat, target, zoo.cross_entropy_loss)
    got = _run(gm, flat, target, zoo.cross_entropy_loss)
    _assert_same(ref, got)
    assert "model_layers_0" in gm.code and "keep_" in gm.ckpt_model_layers_0.code


def test_selective_keeps_linear_outputs_not_attention_scores():
    model, args, _ = zoo.make("gpt", n_layer=1, attn_dropout=0.1)
    gm = fxsplit.plan(model, args).stage_graph(0)
    kept = {n.name for n in gm.graph.nodes if keeps_output(n, gm)}
    assert {"blocks_0_attn_q", "blocks_0_attn_proj", "blocks_0_mlp_up", "blocks_0_mlp_down", "lm_head"} <= kept
    assert not any(n.startswith(("matmul", "softmax", "gelu")) for n in kept), kept
    assert layer_key("model.layers.11.mlp") == "model.layers.11" and layer_key("ln_f") == "ln_f"


def test_auto_picks_per_stage_the_cheapest_that_fits():
    model, args, _ = zoo.make("gpt", n_layer=4, attn_dropout=0.1)
    opts = dict(pp=2, schedule="1f1b")
    none, full = (fxsplit.plan(model, args, activation_checkpointing=m, **opts) for m in ("none", "full"))
    free = fxsplit.plan(model, args, activation_checkpointing="auto", **opts)
    assert free.split.checkpointing == ("none", "none")  # no limit: no recompute
    # rank 0 holds 2 microbatches (1F1B), rank 1 one: a limit between both needs it on rank 0 only
    # (the limit is checked by Plan.memory(): [Note: one memory model] in fxsplit.api.plan)
    (n0, n1), (f0, _) = ([m.peak for m in p.memory()] for p in (none, full))
    assert n0 > max(n1, f0)
    limit = (n0 + max(n1, f0)) / 2
    auto = fxsplit.plan(model, args, activation_checkpointing="auto", memory_limit=limit, **opts)
    modes = auto.split.checkpointing
    assert modes[0] != "none" and modes[1] == "none", modes
    assert worst(auto.memory()).peak <= limit
    assert auto.split.bottleneck < full.split.bottleneck  # cheaper in time than full everywhere
    assert "act/mb no ckpt" in str(auto) and "peak activations per rank" in str(auto)
    with pytest.raises(fxsplit.FxsplitError, match="memory"):
        fxsplit.plan(model, args, activation_checkpointing="auto", memory_limit=1e3, **opts)


def test_recompute_is_charged_to_the_backward():
    model, args, _ = zoo.make("gpt", n_layer=4)
    none, full = (fxsplit.plan(model, args, pp=2, schedule="1f1b", activation_checkpointing=m) for m in ("none", "full"))
    assert all(s.recompute_time > 0 for s in full.split.stages)
    for s, t in zip(full.split.stages, none.split.stages):  # same cuts here: the backward grows by the recompute
        assert (s.module_paths, s.forward_time) == (t.module_paths, t.forward_time)
        if s.index == 0:  # its inputs need no gradient: the whole backward is W, the recompute too
            assert s.input_grad_time == t.input_grad_time == 0.0
            assert s.weight_grad_time == pytest.approx(t.weight_grad_time + s.recompute_time)
        else:
            assert s.weight_grad_time == t.weight_grad_time
            assert s.input_grad_time == pytest.approx(t.input_grad_time + s.recompute_time)
        assert s.time == pytest.approx(t.time + s.recompute_time)
    assert full.simulate().makespan > none.simulate().makespan
    with pytest.raises(fxsplit.PlanError, match="activation_checkpointing must be one of"):
        fxsplit.ParallelConfig(activation_checkpointing="some")


def test_cli_flag(tmp_path, capsys):
    path = tmp_path / "m.py"
    path.write_text("from fxsplit.testing import zoo\n\ndef gpt():\n    return zoo.make('gpt', n_layer=2)\n")
    assert main(["plan", f"{path}:gpt", "--pp", "2", "--activation-checkpointing", "full"]) == 0
    out = capsys.readouterr().out
    assert "act/mb no ckpt" in out and " full " in out


def test_split_backward_on_autograd_refuses_selective():
    """Selective checkpointing with I and W: refused on the autograd split (two backward passes per
    region), planned on the graph split (one traced backward, split afterwards: the default)."""
    model, args, _ = zoo.make("gpt", n_layer=2)
    with pytest.raises(fxsplit.PlanError, match="torch's selective checkpoint allows one"):
        fxsplit.plan(model, args, pp=2, schedule="zb_h1", activation_checkpointing="selective", split_backward="autograd")
    plan = fxsplit.plan(model, args, pp=2, schedule="zb_h1", activation_checkpointing="auto", memory_limit=1e12,
                        split_backward="autograd")
    assert set(plan.split.checkpointing) <= {"none", "full"}
    plan = fxsplit.plan(model, args, pp=2, schedule="zb_h1", activation_checkpointing="selective")
    assert set(plan.split.checkpointing) == {"selective"}
    with pytest.raises(fxsplit.PlanError, match="split_backward must be"):
        fxsplit.ParallelConfig(split_backward="hooks")


def test_with_mixed_precision_policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model, args, _ = zoo.make("gpt", n_layer=2, dropout=0.1, attn_dropout=0.1)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    target = torch.randint(0, 128, args[0].shape, generator=torch.Generator().manual_seed(1))
    runs = {m: _run(fxsplit.plan(model, args, mp_policy=mp, activation_checkpointing=m).stage_graph(0), args,
                    target, zoo.cross_entropy_loss) for m in ("none", *MODES)}
    for m in MODES:  # the casts run inside the regions: recomputed (or kept) alike
        _assert_same(runs["none"], runs[m])


def test_split_backward_recompute_charged_as_the_runtime_runs_it():
    """[Note: checkpointing cost model]: the graph split recomputes a region once (charged in I),
    the autograd split twice (W pays it again); the cuts are the same. Stage 0 has no I (its
    inputs need no gradient): both run its whole backward, one recompute, as W."""
    model, args, _ = zoo.make("gpt", n_layer=2)
    graph = fxsplit.plan(model, args, pp=2, schedule="zb_h1", activation_checkpointing="full")
    auto = fxsplit.plan(model, args, pp=2, schedule="zb_h1", activation_checkpointing="full", split_backward="autograd")
    assert graph.split.starts == auto.split.starts
    for g, a in zip(graph.split.stages, auto.split.stages):
        assert g.recompute_time > 0
        assert a.input_grad_time == pytest.approx(g.input_grad_time)
        twice = 0.0 if g.index == 0 else g.recompute_time
        assert a.weight_grad_time == pytest.approx(g.weight_grad_time + twice)
    assert graph.split.stages[0].input_grad_time == 0.0
