"""Zero-bubble schedules end to end on gloo (ZB-H1, ZB-V, zb_auto): the loss and every gradient
after each of a few AdamW steps equal the unsplit model's in one process, with a tied-weight GPT,
a long skip, checkpointing and an HF model. The backward is split into I and W as graphs
(split_backward="graph", the default: [Note: graph split backward]); every case checks that no
stage fell back to the autograd split, tp stages included (their collectives trace as functional
collectives: [Note: traced collectives] in fxsplit.tp.collectives)."""

import os

import pytest
import torch

import fxsplit
from fxsplit.testing import run_distributed, zoo
from fxsplit.testing.data import local_grads, replica_slice
from fxsplit.testing.trace_cache import SharedPlans, SharedTraces, shared_plans, shared_traces

STEPS = 3
INF_LINK = fxsplit.Hardware(link_bytes_per_s=float("inf"))


def _batch(args, i):
    g = torch.Generator().manual_seed(100 + i)
    x = args[0]
    return torch.randint(0, int(x.max()) + 1, x.shape, generator=g)


def _reference(overrides):
    """Per step: the loss and {name: gradient} (tied names under both) of the unsplit GPT under AdamW."""
    model, args, _ = zoo.make("gpt", **overrides)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    params = dict(model.named_parameters(remove_duplicate=False))
    out = []
    for i in range(STEPS):
        x = _batch(args, i)
        y = zoo.make_target("gpt", model(x), seed=i)
        loss = zoo.cross_entropy_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        out.append((loss.item(), {n: p.grad.detach().clone() for n, p in params.items()}))
        opt.step()
    return out


# Per rank process: the layouts of one launch parallelize one model object per configuration and
# plan it from one trace ([Note: sharing a trace between plans] in fxsplit.testing.trace_cache;
# parallelize materializes its stages from the model, which itself is never trained).
_TRACES = SharedTraces()
_MODELS: dict = {}
# and a launch that prepares ([Note: preparing once per launch] in fxsplit.testing.harness) plans each
# layout once before its ranks fork; every rank takes its copy ([Note: plans made before the fork])
_PLANS = SharedPlans()


def _model_of(overrides):
    key = repr(sorted(overrides.items()))
    if key not in _MODELS:
        _MODELS[key] = zoo.make("gpt", **overrides)
    return _MODELS[key]


def _prepare(layouts):
    """Plan every ``(overrides, options)`` of a launch as :func:`_train` will, once, before the ranks fork."""
    with shared_traces(_TRACES):
        for overrides, options in layouts:
            model, args, kwargs = _model_of(overrides)
            _PLANS.add(model, args, kwargs, hardware=INF_LINK, verify=False, **options)


def _all_prepared(out):
    """``out``, once every parallelize of this rank took a plan made before the fork."""
    assert _PLANS.misses == 0, f"{_PLANS.misses} layout(s) planned on a rank: a plan made before the fork went unused"
    return out


def _verify_here():
    """parallelize's verify on this rank: every case compares with one process, and every rank
    computes the same plan, so rank 0 verifies it (the default, auto) and the others skip the
    repeat ([Note: one model and trace per launch] in tests/test_parallelize.py)."""
    import torch.distributed as dist

    return None if dist.get_rank() == 0 else False


def _train(overrides, options, states=False):
    """Trains a parallelized GPT for STEPS AdamW steps; ``states``: also gather the full parameters
    before each step (for :func:`_grads_at`)."""
    torch.manual_seed(0)
    model, args, kwargs = _model_of(overrides)
    ref, _, _ = zoo.make("gpt", **overrides)  # targets from the reference's outputs, as in _reference
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with shared_traces(_TRACES), shared_plans(_PLANS):
        pm = fxsplit.parallelize(model, args, kwargs, loss_fn=zoo.cross_entropy_loss, timeout=60,
                                 hardware=INF_LINK, verify=_verify_here(), **options)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    steps, before = [], []
    for i in range(STEPS):
        if states:
            before.append(pm.full_state_dict())
        x = _batch(args, i)
        y = zoo.make_target("gpt", ref(x), seed=i)
        # the global batch; each data-parallel replica trains on its own slice of it
        loss = pm.step(replica_slice(pm, x), target=replica_slice(pm, y))
        grads = local_grads(pm)
        steps.append((float(loss), grads))
        opt.step()
        opt.zero_grad()
        rl = zoo.cross_entropy_loss(ref(x), y)
        ref_opt.zero_grad()
        rl.backward()
        ref_opt.step()
    peak = None
    if "global_batch_size" in options and not options.get("compile"):  # a dispatch mode counts: no compile
        # one more step, counted: [Note: memory model]'s peak against the bytes the rank holds
        from fxsplit.testing.memory import measured_step_peak

        x = _batch(args, STEPS)
        peak = (measured_step_peak(pm, opt, x, target=zoo.make_target("gpt", ref(x), seed=STEPS)),
                pm.plan.memory()[pm.coords["pp"]].peak)
        opt.zero_grad()
    return dict(steps=steps, stages=sorted(int(s) for s in pm.stage_modules), stage_ranks=pm.plan.stage_ranks, peak=peak,
                grads=[g for _, g in steps], states=before, coords=dict(pm.coords), specs=dict(pm.plan.tp_plan.param_specs),
                full_state=pm.full_state_dict(), fallbacks=pm.split_fallbacks,
                compile_fallbacks=pm.compile_fallbacks, onednn=_onednn_matmuls(pm),
                held=sum(p.numel() * p.element_size() for p in pm.parameters()),  # distinct Parameters only
                predicted=pm.plan.memory()[pm.coords["pp"]].params)


def _onednn_matmuls(pm):
    """How many matmuls this rank's compiled graphs run through oneDNN."""
    return sum(r.onednn_matmuls for _, split in pm.runtime.traced_graphs() for r in split.runners.values())


def _check(results, want, rtol=1e-5, atol=1e-6):
    for step, (ref_loss, ref_grads) in enumerate(want):
        seen = set()
        for rank, res in enumerate(results):
            loss, grads = res["steps"][step]
            assert loss == pytest.approx(ref_loss, rel=rtol, abs=atol), f"step {step} rank {rank}"
            for n, g in grads.items():
                torch.testing.assert_close(g, ref_grads[n], rtol=rtol, atol=atol, msg=f"step {step} rank {rank} {n}")
            seen |= set(grads)
        assert seen == set(ref_grads), f"step {step}: no gradient for {sorted(set(ref_grads) - seen)}"


CASES = {
    # global_batch_size: the plan's memory is costed at the microbatch the step runs ([Note: memory model])
    2: [("zbv", {"batch_size": 4}, dict(pp=2, schedule="zbv", microbatches=4, global_batch_size=4)),
        ("zb_h1", {"batch_size": 4}, dict(pp=2, schedule="zb_h1", microbatches=4)),
        ("zb_auto", {"batch_size": 4}, dict(pp=2, schedule="zb_auto", microbatches=4)),
        ("dualpipev", {"batch_size": 4}, dict(pp=2, schedule="dualpipev", microbatches=4, global_batch_size=4))],
    4: [("zbv", {"batch_size": 8, "n_layer": 4}, dict(pp=4, schedule="zbv", microbatches=8, global_batch_size=8)),
        ("dualpipev", {"batch_size": 8, "n_layer": 4},
         dict(pp=4, schedule="dualpipev", microbatches=8, global_batch_size=8)),
        ("zb_auto", {"batch_size": 8, "n_layer": 4}, dict(pp=4, schedule="zb_auto", microbatches=8))],
}


def _cases(rank, world):
    return _all_prepared({label: _train(overrides, options) for label, overrides, options in CASES[world]})


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_zero_bubble_schedules_match_single_process(world):
    results = run_distributed(_cases, world, timeout=400,
                              prepare=(_prepare, ([(overrides, options) for _, overrides, options in CASES[world]],)))
    for label, overrides, options in CASES[world]:
        res = [r[label] for r in results]
        if options["schedule"] in ("zbv", "dualpipev"):  # the V: rank r holds stages r and 2p-1-r; the loss on rank 0
            p = options["pp"]
            assert [r["stages"] for r in res] == [[q, 2 * p - 1 - q] for q in range(p)]
            # rank 0 holds the tied embedding and LM head (stages 0 and 2p-1) as one Parameter,
            # the bytes Plan.memory() counts ([Note: memory model])
            assert [r["held"] for r in res] == [r["predicted"] for r in res]
            # and each rank's measured peak within 10% of Plan.memory()'s (benchmarks/memory_truth.py)
            assert all(abs(r["peak"][0] / r["peak"][1] - 1) <= 0.10 for r in res), [r["peak"] for r in res]
        _check(res, _reference(overrides))
        assert all(r["fallbacks"] == {} for r in res), [r["fallbacks"] for r in res]


# ZB-V composed with tensor and data parallelism (4 ranks): the loss and every gradient of every
# step (tp shards reassembled; each dp replica trained on its own slice of the global batch)
# against one process, and the full parameters after the last step (gathered over tp shards).
COMPOSED = {"zbv-tp2": dict(tp=2, pp=2, schedule="zbv", microbatches=4),
            "zbv-dp2": dict(dp=2, pp=2, schedule="zbv", microbatches=4)}
COMPOSED_GPT = {"batch_size": 8}


def _final_state_reference():
    """Losses, final parameters, and the names whose gradient is zero up to
    rounding at every step (the key biases: softmax ignores them; AdamW turns their ~1e-9 rounding
    noise into full-size updates of random sign, so their final values are not comparable)."""
    torch.manual_seed(0)
    model, args, _ = zoo.make("gpt", **COMPOSED_GPT)
    per_step = _reference(COMPOSED_GPT)
    losses = [loss for loss, _ in per_step]
    noise = {n for n in per_step[0][1] if all(float(g[n].abs().max()) < 1e-6 for _, g in per_step)}
    torch.manual_seed(0)
    model, args, _ = zoo.make("gpt", **COMPOSED_GPT)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(STEPS):
        x = _batch(args, i)
        loss = zoo.cross_entropy_loss(model(x), zoo.make_target("gpt", model(x), seed=i))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, noise


def _grads_at(overrides, states):
    """Per step: {name: gradient} (tied names under both) of the unsplit GPT at ``states[step]``
    (the split's own full parameters before that step) on that step's global batch. Two runs that
    start equal drift apart under AdamW (it turns rounding noise in near-zero gradients into
    lr-sized updates), so later steps' gradients are compared where the split itself stands."""
    model, args, _ = zoo.make("gpt", **overrides)
    params = dict(model.named_parameters(remove_duplicate=False))
    out = []
    for i, state in enumerate(states):
        model.load_state_dict(state)
        x = _batch(args, i)
        logits = model(x)
        loss = zoo.cross_entropy_loss(logits, zoo.make_target("gpt", logits, seed=i))
        model.zero_grad()
        loss.backward()
        out.append({n: p.grad.detach().clone() for n, p in params.items()})
    return out


def _composed(rank, world):
    out = {}
    for label, options in COMPOSED.items():
        res = _train(COMPOSED_GPT, options, states=True)
        out[label] = dict(losses=[loss for loss, _ in res["steps"]], state=res["full_state"], states=res["states"],
                          fallbacks=res["fallbacks"], grads=res["grads"], coords=res["coords"], specs=res["specs"])
    return _all_prepared(out)


def _check_composed(results, label, ref_losses, ref_state, noise, rtol=1e-5):
    """Per step, the loss and every gradient of every replica (AdamW hides a gradient's scale from
    the parameters: a mean taken as a sum moves each element by the same ~lr); the gradients
    against one process at the split's own parameters of that step (:func:`_grads_at`; the
    first step's are the common initial ones); then the final parameters."""
    from test_parallelize import check_grads

    first = results[0]["states"]
    for rank, r in enumerate(results):
        assert r["fallbacks"] == {}, (label, rank, r["fallbacks"])  # tp stages too: [Note: traced collectives]
        assert r["losses"] == pytest.approx(ref_losses, rel=rtol), (label, rank, r["losses"], ref_losses)
        for step, state in enumerate(r["states"]):  # the full parameters are the same on every rank
            assert all(torch.equal(v, first[step][k]) for k, v in state.items()), (label, rank, step)
    check_grads(results, _grads_at(COMPOSED_GPT, first), rtol=rtol, atol=1e-6)
    for rank, r in enumerate(results):
        for k, v in ref_state.items():
            if k in noise:
                continue
            # AdamW moves each element by about lr = 1e-2 a step whatever the gradient's size,
            # so a wrong gradient shows as ~1e-2; rounding on tiny gradients as up to ~1e-4
            torch.testing.assert_close(r["state"][k], v, rtol=1e-4, atol=1e-3,
                                       msg=lambda m, k=k: f"{label} rank {rank} {k}: {m}")


@pytest.mark.dist
def test_zbv_with_tp_and_dp_matches_single_process():
    ref_losses, ref_state, noise = _final_state_reference()
    assert all(".k.bias" in n for n in noise), noise
    results = run_distributed(_composed, 4, timeout=400,
                              prepare=(_prepare, ([(COMPOSED_GPT, options) for options in COMPOSED.values()],)))
    for label in COMPOSED:
        _check_composed([r[label] for r in results], label, ref_losses, ref_state, noise)


# The graph split with what the autograd split gets wrong or cannot run: a skip across every layer
# (zbv), full checkpointing (zbv), an HF model (zbv). Checkpointing with zb_h1 (full, selective):
# tests/test_activation_checkpointing_dist.py.
OTHER = {"skip-zbv": ("skip", {}, dict(pp=2, schedule="zbv", microbatches=4)),
         "gpt-zbv-full": ("gpt", dict(n_layer=4, batch_size=4, seq_len=8),
                          dict(pp=2, schedule="zbv", microbatches=4, activation_checkpointing="full"))}


HF_OTHER = dict(pp=2, schedule="zbv", microbatches=2)


def _other_layouts():
    """The parallelize calls of :func:`_other`, as test_parallelize's ``_prepare`` plans them before the ranks fork."""
    from test_parallelize import HF_BATCH, _hf_make

    return [*((zoo.make, name, ov, opts) for name, ov, opts in OTHER.values()),
            (_hf_make, "tiny_gpt2", {"batch_size": HF_BATCH}, HF_OTHER)]


def _other(rank, world):
    from test_parallelize import _all_prepared as _all_prepared_named, _hf_train, _train as _train_named

    made = []
    inner = fxsplit.parallelize
    fxsplit.parallelize = lambda *a, **k: made.append(inner(*a, **k)) or made[-1]
    try:
        out = {label: _train_named(rank, world, name, ov, dict(opts)) for label, (name, ov, opts) in OTHER.items()}
        out["hf"] = _hf_train(rank, world, "tiny_gpt2", dict(HF_OTHER))
    finally:
        fxsplit.parallelize = inner
    out["fallbacks"] = [pm.split_fallbacks for pm in made]
    return _all_prepared_named(rank, out)


@pytest.mark.dist
@pytest.mark.hf
def test_graph_split_with_skips_checkpointing_and_hf():
    from test_parallelize import _check as _check_named, _hf_reference, _prepare as _prepare_named
    from test_parallelize import _reference as _reference_named

    results = run_distributed(_other, 2, timeout=600, prepare=(_prepare_named, (_other_layouts(),)))
    assert all(r["fallbacks"] == [{}] * 3 for r in results), [r["fallbacks"] for r in results]
    for label, (name, ov, _) in OTHER.items():
        _check_named([r[label] for r in results], *_reference_named(name, ov))
    ref = _hf_reference("tiny_gpt2")
    for rank, r in enumerate(results):
        assert r["hf"] == pytest.approx(ref, rel=1e-5, abs=1e-6), f"rank {rank}"


# torch.compile of the stage graphs ([Note: compiled stages] in fxsplit.runtime.compile.compiling): 1f1b
# (B as one graph: [Note: fused backward]) and zbv (F, I and W) at p=2, a one-layer tied GPT,
# every graph compiled; before training, pm(x) runs the compiled inference graphs ([Note:
# compiled inference]) against the unsplit model; the loss runs through torch.compile ([Note:
# compiled loss]). Inductor reorders fp32 work, hence 1e-5 relative. The fp32 matmuls run through
# oneDNN (FXSPLIT_CPU_MATMUL=onednn in the ranks, whatever this host's probe says: [Note: CPU
# matmuls through oneDNN]): every compiled forward graph has some.
COMPILED = {"1f1b": dict(pp=2, schedule="1f1b", microbatches=2, compile=True),
            "zbv": dict(pp=2, schedule="zbv", microbatches=2, compile=True),
            # fuse_backward=False: a schedule that never splits B still runs it as I then W ([Note: fused backward])
            "1f1b-unfused": dict(pp=2, schedule="1f1b", microbatches=2, compile=True, fuse_backward=False)}
COMPILED_GRAPHS = {"1f1b": "BF", "zbv": "FIW", "1f1b-unfused": "FIW"}
COMPILED_GPT = {"batch_size": 4, "n_layer": 1, "seq_len": 8}


def _compiled(rank, world):
    os.environ["FXSPLIT_CPU_MATMUL"] = "onednn" if torch.backends.mkldnn.is_available() else "aten"
    built = {}
    for label, options in COMPILED.items():
        torch.manual_seed(0)
        model, args, kwargs = zoo.make("gpt", **COMPILED_GPT)
        ref, _, _ = zoo.make("gpt", **COMPILED_GPT)
        built[label] = (fxsplit.parallelize(model, args, kwargs, loss_fn=zoo.cross_entropy_loss, timeout=300,
                                            hardware=INF_LINK, verify=_verify_here(), **options), args, ref)
    out = {}
    for label, (pm, args, ref) in built.items():
        with torch.no_grad():
            x = _batch(args, 99)
            inference = (pm(x), ref(x))
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        steps = []
        for i in range(STEPS):
            x = _batch(args, i)
            loss = pm.step(x, target=zoo.make_target("gpt", ref(x), seed=i))
            grads = local_grads(pm)
            steps.append((float(loss), grads))
            opt.step()
            opt.zero_grad()
        rt = pm.runtime
        out[label] = dict(steps=steps, fallbacks=pm.split_fallbacks, not_compiled=pm.compile_fallbacks,
                          compiled=sorted((s, kind) for s, split in rt.traced_graphs()
                                          for kind, r in split.runners.items() if r.compiled),
                          onednn=sorted((s, kind) for s, split in rt.traced_graphs()
                                        for kind, r in split.runners.items() if r.onednn_matmuls),
                          stages=sorted(int(s) for s in pm.stage_modules), inference=inference,
                          inference_compiled=[run is not None and run.compiled.compiled
                                              for run in rt.inference_runners()],
                          loss_compiled=rt.loss_compiled, holds_last=rt.last_stage in rt.modules)
    return out


@pytest.mark.dist
@pytest.mark.slow
def test_compiled_stage_graphs_match_single_process():
    results = run_distributed(_compiled, 2, timeout=900)
    want = _reference(COMPILED_GPT)
    for label in COMPILED:
        res = [r[label] for r in results]
        for r in res:
            assert r["fallbacks"] == {} and r["not_compiled"] == {}, (label, r["fallbacks"], r["not_compiled"])
            assert r["compiled"] == [(s, kind) for s in r["stages"] for kind in COMPILED_GRAPHS[label]], (
                label, r["compiled"])
            assert r["inference_compiled"] and all(r["inference_compiled"]), (label, r["inference_compiled"])
            assert r["loss_compiled"] == r["holds_last"], label  # [Note: compiled loss]
            if torch.backends.mkldnn.is_available():
                assert {(s, "F") for s in r["stages"]} <= set(r["onednn"]), (label, r["onednn"])
            torch.testing.assert_close(*r["inference"], rtol=1e-5, atol=1e-6)
        _check(res, want)

# compile=True composed (2 ranks, the matmuls forced through oneDNN: [Note: CPU matmuls through
# oneDNN]): tp=2 (losses and full parameters after the last step against one process, as
# test_zbv_with_tp_and_dp_matches_single_process), and an HF model (tiny GPT-2) under ZB-V with full
# checkpointing: the loss and every gradient of every SGD step against one process (1e-4 relative:
# inductor's rounding through a recomputed backward; a four-layer zoo GPT there reached 8e-5 of a
# gradient's largest entry at step 1 under AdamW, with or without oneDNN). One HF run carries both
# the checkpointing and the HF model (two runs before: each pipeline's graphs compiled from a cold
# inductor cache cost ~25 CPU-s in a fresh clone). Nothing falls back; every rank routes some matmuls.
COMPILED_COMPOSED = ((COMPOSED_GPT, dict(tp=2, microbatches=2, compile=True)),)
HF_CKPT = dict(pp=2, schedule="zbv", microbatches=2, activation_checkpointing="full", compile=True)


def _compiled_composed(rank, world):
    from test_parallelize import _hf_train

    os.environ["FXSPLIT_CPU_MATMUL"] = "onednn" if torch.backends.mkldnn.is_available() else "aten"
    ((tp_gpt, tp_options),) = COMPILED_COMPOSED
    tp = _train(tp_gpt, tp_options, states=True)
    made = []
    inner = fxsplit.parallelize
    fxsplit.parallelize = lambda *a, **k: made.append(inner(*a, **k)) or made[-1]
    try:
        hf = _hf_train(rank, world, "tiny_gpt2", HF_CKPT, grads=True)
    finally:
        fxsplit.parallelize = inner
    tp_res = dict(losses=[loss for loss, _ in tp["steps"]], state=tp["full_state"], fallbacks=tp["fallbacks"],
                  grads=tp["grads"], states=tp["states"], coords=tp["coords"], specs=tp["specs"])
    return dict(tp=tp_res, tp_not_compiled=tp["compile_fallbacks"],
                hf=(hf, made[0].compile_fallbacks, made[0].split_fallbacks),
                hf_checkpointing=sorted(set(made[0].plan.split.checkpointing)),
                onednn=(tp["onednn"], _onednn_matmuls(made[0])))


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.hf
def test_compiled_with_tp_checkpointing_and_hf_match_single_process():
    from test_parallelize import HF_BATCH, _hf_reference, check_grads, tied_names
    from fxsplit.testing import hf_zoo

    ref_losses, ref_state, noise = _final_state_reference()
    results = run_distributed(_compiled_composed, 2, timeout=900, prepare=(_prepare, (COMPILED_COMPOSED,)))
    # tolerances as in test_zbv_with_tp_and_dp_matches_single_process
    _check_composed([r["tp"] for r in results], "compiled tp2", ref_losses, ref_state, noise)
    hf_ref, hf_ref_grads = _hf_reference("tiny_gpt2", grads=True)
    for rank, r in enumerate(results):
        assert r["tp_not_compiled"] == {}, (rank, r["tp_not_compiled"])
        hf, hf_not_compiled, hf_fallbacks = r["hf"]
        assert hf_not_compiled == {} and hf_fallbacks == {}, (rank, hf_not_compiled, hf_fallbacks)
        assert r["hf_checkpointing"] == ["full"], (rank, r["hf_checkpointing"])
        assert hf["losses"] == pytest.approx(hf_ref, rel=1e-5, abs=1e-6), f"hf rank {rank}"
        if torch.backends.mkldnn.is_available():
            assert all(r["onednn"]), (rank, r["onednn"])
    check_grads([r["hf"][0] for r in results], hf_ref_grads, rtol=1e-4, atol=1e-5,
                tied=tied_names(hf_zoo.tiny_gpt2(batch_size=HF_BATCH)[0]))


# ZB-V with dropout (graph split, p=2): the masks are those of the unsplit model run on the stage
# streams ([Note: RNG streams] 1 in fxsplit.tp.random): one process runs the GPT microbatch by
# microbatch, reseeding the generator at each stage's first module as the runtime seeds each
# stage's forward (derive_seed(seed, stage, microbatch, step)); dropout draws nothing in backward.
DROP_GPT = dict(n_layer=4, batch_size=4, seq_len=8, dropout=0.2, attn_dropout=0.2)
DROP_SPLIT = ("blocks.1", "blocks.2", "blocks.3")  # stage s > 0 starts at blocks.s
DROP_SEED, DROP_M = 5, 4
DROP_OPTIONS = dict(pp=2, schedule="zbv", microbatches=DROP_M, seed=DROP_SEED, split_points=DROP_SPLIT,
                    cut_at="modules")


def _dropout_reference():
    from fxsplit.tp.random import derive_seed

    model, args, _ = zoo.make("gpt", **DROP_GPT)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    params = dict(model.named_parameters(remove_duplicate=False))
    at = {}

    def reseed(stage):
        def hook(module, inputs):
            torch.manual_seed(derive_seed(DROP_SEED, stage, at["mb"], at["step"]))
        return hook

    for s, path in enumerate(DROP_SPLIT, start=1):
        model.get_submodule(path).register_forward_pre_hook(reseed(s))
    out = []
    for step in range(STEPS):
        x = _batch(args, step)
        y = zoo.make_target("gpt", torch.empty(*x.shape, 128), seed=step)
        total = 0.0
        opt.zero_grad()
        for mb, (xs, ys) in enumerate(zip(x.chunk(DROP_M), y.chunk(DROP_M))):
            at.update(mb=mb, step=step)
            torch.manual_seed(derive_seed(DROP_SEED, 0, mb, step))
            loss = zoo.cross_entropy_loss(model(xs), ys) / DROP_M
            loss.backward()
            total += float(loss.detach())
        out.append((total, {n: p.grad.detach().clone() for n, p in params.items()}))
        opt.step()
    return out


def _dropout_zbv(rank, world):
    model, args, kwargs = _model_of(DROP_GPT)
    with shared_plans(_PLANS):
        pm = fxsplit.parallelize(model, args, kwargs, loss_fn=zoo.cross_entropy_loss, timeout=60, hardware=INF_LINK,
                                 **DROP_OPTIONS)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    steps = []
    for i in range(STEPS):
        x = _batch(args, i)
        loss = pm.step(x, target=zoo.make_target("gpt", torch.empty(*x.shape, 128), seed=i))
        grads = local_grads(pm)
        steps.append((float(loss), grads))
        opt.step()
        opt.zero_grad()
    return _all_prepared(dict(steps=steps, fallbacks=pm.split_fallbacks))


@pytest.mark.dist
def test_zbv_with_dropout_draws_the_unsplit_models_masks():
    results = run_distributed(_dropout_zbv, 2, timeout=300, prepare=(_prepare, ([(DROP_GPT, DROP_OPTIONS)],)))
    assert all(r["fallbacks"] == {} for r in results), [r["fallbacks"] for r in results]
    want = _dropout_reference()
    _check(results, want)
    assert want[0][0] != _reference(dict(DROP_GPT, dropout=0.0, attn_dropout=0.0))[0][0]  # dropout drew


def test_compile_option_is_checked():
    """compile=True needs the graph split, is refused with FSDP units until checked there; it and
    fuse_backward are bools."""
    with pytest.raises(fxsplit.PlanError, match="split_backward='autograd'"):
        fxsplit.ParallelConfig(compile=True, split_backward="autograd")
    with pytest.raises(fxsplit.PlanError, match="dp_shard > 1"):
        fxsplit.ParallelConfig(compile=True, dp_shard=2)
    with pytest.raises(fxsplit.PlanError, match="True or False"):
        fxsplit.ParallelConfig(compile=1)
    assert fxsplit.ParallelConfig(compile=True).compile
    with pytest.raises(fxsplit.PlanError, match="fuse_backward must be True or False"):
        fxsplit.ParallelConfig(compile=True, fuse_backward="no")
