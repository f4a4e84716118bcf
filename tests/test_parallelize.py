"""fxsplit.parallelize end to end on gloo: losses over optimizer steps equal the single process."""

import os
import tempfile

import pytest
import torch

import fxsplit
from fxsplit.testing import zoo
from fxsplit.testing import run_distributed
from fxsplit.testing.data import replica_slice
from fxsplit.testing.trace_cache import SharedPlans, SharedTraces, shared_plans, shared_traces

STEPS = 3
LR = 0.05


def _reference(name, overrides, steps=STEPS, batch_seeds=(0, 1, 2)):
    """Losses, per-step gradients (every name, tied ones under both) and the final state dict of
    the unsplit model trained on the whole (global) batch of each step."""
    model, args, kwargs = zoo.make(name, **overrides)
    loss_fn = zoo.loss_fn(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    params = dict(model.named_parameters(remove_duplicate=False))
    losses, grads = [], []
    for i in range(steps):
        x = _batch(name, model, args, i)
        y = zoo.make_target(name, model(x), seed=i)
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None})
        opt.step()
        losses.append(loss.item())
    return losses, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _batch(name, model, args, i):
    g = torch.Generator().manual_seed(100 + i)
    x = args[0]
    if x.dtype == torch.long:
        return torch.randint(0, int(x.max()) + 1, x.shape, generator=g)
    return torch.randn(x.shape, generator=g)


def _local_grads(pm):
    """{stage-local parameter name: gradient} of this rank's shards."""
    out = {}
    for mod in pm.stage_modules.values():
        for n, p in mod.named_parameters(remove_duplicate=False):
            if p.grad is not None:
                out.setdefault(n, p.grad.detach().clone())
    return out


# [Note: one model and trace per launch]
# A rank trains several layouts of the same model in one launch. parallelize never changes the
# model it is given (each rank trains materialized copies; builders are seeded without touching
# the global RNG), so a rank builds each (model, overrides) once and every layout plans it from
# one trace (fxsplit.testing.trace_cache: tracing was most of a layout's planning). Every rank
# computes the same plan, so rank 0 verifies it (verify=None, parallelize's default: the plan
# against the unsplit model in one process) and the others do not repeat that check.
_MODELS: dict = {}
_TRACES = SharedTraces()


def _model(make, name, overrides):
    key = (name, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        _MODELS[key] = make(name, **overrides)
    return _MODELS[key]


def _parallelize(rank, model, args, kwargs, **options):
    options.setdefault("verify", None if rank == 0 else False)
    with shared_traces(_TRACES), shared_plans(_PLANS):
        return fxsplit.parallelize(model, args, kwargs, **options)


# A launch that prepares ([Note: preparing once per launch] in fxsplit.testing.harness) builds its
# models and plans every layout once, before the ranks fork; each rank takes its copy of the plan
# ([Note: plans made before the fork] in fxsplit.testing.trace_cache).
_PLANS = SharedPlans()
_INF_LINK = fxsplit.Hardware(link_bytes_per_s=float("inf"))


def _prepare(layouts):
    """``layouts``: ``(make, name, overrides, options)`` per parallelize of the launch, as _train and
    _hf_train call it (``loss_fn`` in the options is the step's, not the plan's)."""
    with shared_traces(_TRACES):
        for make, name, overrides, options in layouts:
            model, args, kwargs = _model(make, name, overrides)
            planned = {k: v for k, v in options.items() if k != "loss_fn"}
            _PLANS.add(model, args, kwargs, verify=False, **{"hardware": _INF_LINK, **planned})


def _all_prepared(rank, out):
    assert _PLANS.misses == 0, f"rank {rank} planned {_PLANS.misses} layout(s) itself: a plan made before the fork went unused"
    return out


def _train(rank, world, name, overrides, options, steps=STEPS):
    torch.manual_seed(0)
    model, args, kwargs = _model(zoo.make, name, overrides)
    loss_fn = zoo.loss_fn(name)
    # tiny models: score stages by compute alone (at a real link bandwidth, sending a boundary
    # costs more than these layers compute, and the balancer rightly keeps them on one stage)
    options.setdefault("hardware", fxsplit.Hardware(link_bytes_per_s=float("inf")))
    pm_loss = options.pop("loss_fn", loss_fn)  # the split's own loss (vocab_parallel_loss); the reference's is loss_fn
    pm = _parallelize(rank, model, args, kwargs, loss_fn=pm_loss, timeout=60, **options)
    forward = None
    if not pm.plan.config.vocab_parallel_loss:  # pm(x) before training: this replica's slice, as one process
        x0 = replica_slice(pm, _batch(name, model, args, 0))
        with torch.no_grad():
            forward = (pm(x0), zoo.make(name, **overrides)[0](x0))
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    # data-parallel all-reduces start per stage as soon as its last backward ran (overlap)
    ready = []
    inner = pm._grads.stage_grads_ready  # the runtime's hook (fxsplit.runtime.data_parallel)
    pm._grads.stage_grads_ready = lambda s: (ready.append((s, pm._grads.in_flight)), inner(s))
    # targets are computed from the single-process model's outputs, as in _reference
    ref_model, _, _ = zoo.make(name, **overrides)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=LR)
    losses, grads = [], []
    for i in range(steps):
        x = _batch(name, model, args, i)  # the global batch; each dp replica trains on its slice
        y = zoo.make_target(name, ref_model(x), seed=i)
        loss = pm.step(replica_slice(pm, x), target=replica_slice(pm, y))
        assert 0.0 <= pm.last_bubble < 1.0 and pm.last_step_seconds > 0
        grads.append(_local_grads(pm))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        assert sorted(s for s, _ in ready) == sorted(int(s) for s in pm.stage_modules), ready
        ready.clear()
        # keep the reference model in step so targets match _reference exactly
        rl = loss_fn(ref_model(x), y)
        ref_opt.zero_grad()
        rl.backward()
        ref_opt.step()
    full = pm.full_state_dict()
    specs = dict(getattr(pm.plan.tp_plan, "param_specs", {}) or {})
    return dict(losses=losses, grads=grads, state={k: v.clone() for k, v in full.items()}, forward=forward,
                coords=dict(pm.coords), specs=specs)


def _check(results, ref_losses, ref_grads, ref_state):
    """Every rank: losses and final full state equal the single process; gradients as
    :func:`check_grads`."""
    for rank, res in enumerate(results):
        assert res["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), f"rank {rank}"
        if res.get("forward") is not None:
            torch.testing.assert_close(*res["forward"], rtol=1e-5, atol=1e-6, msg=f"rank {rank}: pm(x)")
        assert set(res["state"]) == set(ref_state), f"rank {rank}: {set(res['state']) ^ set(ref_state)}"
        for k, v in ref_state.items():
            torch.testing.assert_close(res["state"][k], v, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {k}")
    check_grads(results, ref_grads)


def tied_names(model):
    """The groups of parameter names that are one tensor in ``model`` (``check_grads``' ``tied``)."""
    by_tensor = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(n)
    return [g for g in by_tensor.values() if len(g) > 1]


def check_grads(results, ref_grads, rtol=1e-5, atol=1e-6, tied=()):
    """Every data-parallel replica: each step's gradients (tp shards reassembled, replicated ones
    on every tp rank) equal the single process's on the global batch, and its ranks together hold
    a gradient for every parameter name of the model (``tied``: groups of names of one tensor, of
    which one is enough: an exported graph keeps one). ``results[rank]`` holds "grads" (one
    {stage-local name: gradient} per step), "coords" and "specs" (the tp plan's param_specs)."""
    specs = results[0]["specs"]
    cells: dict = {}  # (dp, pp) -> [(tp, rank)]
    for rank, res in enumerate(results):
        c = res["coords"]
        cells.setdefault((c["dp"], c["pp"]), []).append((c["tp"], rank))
    replicas = sorted({dp for dp, _ in cells})
    for step, want in enumerate(ref_grads):
        for dp in replicas:
            seen = set()
            for (d, pp), members in sorted(cells.items()):
                if d != dp:
                    continue
                ranks = [r for _, r in sorted(members)]
                names = set().union(*(results[r]["grads"][step] for r in ranks))
                for n in sorted(names):
                    tag = f"step {step} dp {dp} pp {pp} grad {n}"
                    assert n in want, f"{tag}: not a gradient of the single-process model"
                    assert all(n in results[r]["grads"][step] for r in ranks), f"{tag}: missing on some tp rank"
                    shards = [results[r]["grads"][step][n] for r in ranks]
                    if n in specs:
                        got = [specs[n].unshard(shards)]
                    else:
                        got = shards  # replicated: every tp rank holds the full gradient
                    for g in got:
                        torch.testing.assert_close(g, want[n], rtol=rtol, atol=atol, msg=tag)
                seen |= names
            missing = {n for n in set(want) - seen if not any(n in g and seen & set(g) for g in tied)}
            assert not missing, f"step {step} dp {dp}: no gradient for {sorted(missing)}"


def _cases_pp2(rank, world):
    out = {}
    for label, name, overrides, options in [
        ("gpt-1f1b", "gpt", {}, dict(pp=2, schedule="1f1b", microbatches=2)),
        ("gpt-interleaved-m3", "gpt", {"batch_size": 6}, dict(pp=2, schedule="interleaved_1f1b", microbatches=3)),
        ("skip-gpipe", "skip", {}, dict(pp=2, schedule="gpipe", microbatches=4)),
    ]:
        out[label] = _train(rank, world, name, overrides, options)
    return out


@pytest.mark.dist
def test_pipeline_parallel_matches_single_process():
    results = run_distributed(_cases_pp2, 2, timeout=240)
    for label, name, overrides in [("gpt-1f1b", "gpt", {}), ("gpt-interleaved-m3", "gpt", {"batch_size": 6}), ("skip-gpipe", "skip", {})]:
        _check([r[label] for r in results], *_reference(name, overrides))


def _vocab_parallel_loss(logits_shard, target):
    """The zoo GPT's cross-entropy on this tp rank's vocabulary columns (vocab_parallel_loss=True)."""
    from fxsplit.tp.functional import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits_shard, target, zoo.GPTConfig().vocab_size)


LAYOUTS_4 = {
    "dp2-pp2": dict(dp=2, pp=2, microbatches=2),
    "tp2-pp2": dict(tp=2, pp=2, microbatches=2),
    "dp2-tp2": dict(dp=2, tp=2),
    "dp4-pp1": dict(dp=4, microbatches=1),
    "tp2-pp2-sp": dict(tp=2, pp=2, microbatches=2, sequence_parallel=True),
    "tp2-pp2-vocab": dict(tp=2, pp=2, microbatches=2, vocab_parallel_loss=True, loss_fn=_vocab_parallel_loss),
}
# a global batch of 4: each of 2 (4) data-parallel replicas trains on its own 2 (1) samples
OVERRIDES_4 = {"batch_size": 4}


def _cases_4(rank, world):
    return _all_prepared(rank, {label: _train(rank, world, "gpt", dict(OVERRIDES_4), dict(opts))
                                for label, opts in LAYOUTS_4.items()})


@pytest.mark.dist
def test_3d_layouts_match_single_process():
    # each dp replica trains on its own slice of the global batch (see fxsplit.testing.data), so the
    # loss and gradients equal one process on the whole batch only through a correct
    # data-parallel mean over the dp group, with a pipeline (dp2-pp2) and without (dp2-tp2,
    # dp4-pp1, where every gradient goes in one all-reduce after the step);
    # full_state_dict() reassembles tp shards and pp stages into the original names and shapes
    results = run_distributed(_cases_4, 4, timeout=400,
                              prepare=(_prepare, ([(zoo.make, "gpt", OVERRIDES_4, opts) for opts in LAYOUTS_4.values()],)))
    ref = _reference("gpt", OVERRIDES_4)
    for label in LAYOUTS_4:
        _check([r[label] for r in results], *ref)


def _hf_loss(out, y):
    logits = out.logits if hasattr(out, "logits") else out[0]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _hf_make(builder, **overrides):
    from fxsplit.testing import hf_zoo

    return getattr(hf_zoo, builder)(**overrides)


def _hf_train(rank, world, builder, options, steps=STEPS, grads=False):
    """The losses of ``steps`` SGD steps; with ``grads``, a dict for :func:`check_grads` too."""
    model, args, kwargs = _model(_hf_make, builder, {"batch_size": HF_BATCH})
    options = dict(options)
    options.setdefault("hardware", fxsplit.Hardware(link_bytes_per_s=float("inf")))
    pm = _parallelize(rank, model, args, kwargs, loss_fn=_hf_loss, timeout=90, **options)
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    # each dp replica trains on its slice of the global batch (and of the attention mask)
    local_kwargs = {k: replica_slice(pm, v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    losses, step_grads = [], []
    for i in range(steps):
        ids, y = _hf_batch(model, args, i)
        loss = pm.step(replica_slice(pm, ids), target=replica_slice(pm, y), **local_kwargs)
        step_grads.append(_local_grads(pm))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    if not grads:
        return losses
    return dict(losses=losses, grads=step_grads, coords=dict(pm.coords), specs=dict(pm.plan.tp_plan.param_specs))


def _hf_batch(model, args, i):
    g = torch.Generator().manual_seed(300 + i)
    V = model.config.vocab_size
    return torch.randint(0, V, args[0].shape, generator=g), torch.randint(0, V, args[0].shape, generator=g)


def _hf_reference(builder, steps=STEPS, grads=False):
    """The losses of one process on the global batches; with ``grads``, (losses, per-step
    {name: gradient}, tied names under both)."""
    from fxsplit.testing import hf_zoo

    model, args, kwargs = getattr(hf_zoo, builder)(batch_size=HF_BATCH)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    params = dict(model.named_parameters(remove_duplicate=False))
    losses, step_grads = [], []
    for i in range(steps):
        ids, y = _hf_batch(model, args, i)
        loss = _hf_loss(model(ids, **kwargs), y)
        opt.zero_grad()
        loss.backward()
        step_grads.append({n: p.grad.clone() for n, p in params.items() if p.grad is not None})
        opt.step()
        losses.append(loss.item())
    return (losses, step_grads) if grads else losses


HF_BATCH = 4  # the global batch: 2 samples per data-parallel replica
HF_LAYOUTS = {"dp2-pp2": dict(dp=2, pp=2, microbatches=2), "tp2-pp2": dict(tp=2, pp=2, microbatches=2),
              "dp2-tp2": dict(dp=2, tp=2)}


HF_BUILDERS = ("tiny_gpt2", "tiny_llama")


def _hf_cases(rank, world):
    return _all_prepared(rank, {(b, label): _hf_train(rank, world, b, dict(opts), grads=True)
                                for b in HF_BUILDERS for label, opts in HF_LAYOUTS.items()})


@pytest.mark.dist
@pytest.mark.hf
def test_hf_models_in_3d_layouts():
    """Every step's loss and every gradient of every replica (tp shards reassembled) against one
    process on the global batch."""
    from fxsplit.testing import hf_zoo

    results = run_distributed(_hf_cases, 4, timeout=600, prepare=(_prepare, (
        [(_hf_make, b, {"batch_size": HF_BATCH}, opts) for b in HF_BUILDERS for opts in HF_LAYOUTS.values()],)))
    for builder in ("tiny_gpt2", "tiny_llama"):
        ref, ref_grads = _hf_reference(builder, grads=True)
        tied = tied_names(_model(lambda b, **ov: getattr(hf_zoo, b)(**ov), builder, {"batch_size": HF_BATCH})[0])
        for label in HF_LAYOUTS:
            for rank, r in enumerate(results):
                got = r[(builder, label)]["losses"]
                assert got == pytest.approx(ref, rel=1e-5, abs=1e-6), f"{builder} {label} rank {rank}"
            check_grads([r[(builder, label)] for r in results], ref_grads, tied=tied)


def _logged_steps(rank, world):
    import logging

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("fxsplit.api.model")
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    model, args, kwargs = zoo.make("gpt")
    pm = fxsplit.parallelize(model, args, kwargs, loss_fn=zoo.cross_entropy_loss, pp=2, microbatches=2,
                             schedule="1f1b", log_every=1, timeout=60)
    y = zoo.make_target("gpt", model(*args))
    for _ in range(2):
        pm.step(*args, target=y)
    return records


@pytest.mark.dist
def test_step_logging_reports_loss_time_and_measured_bubble():
    for records in run_distributed(_logged_steps, 2, timeout=120):
        assert len(records) == 2
        for i, msg in enumerate(records, 1):
            assert msg.startswith(f"step {i}: loss ") and "measured bubble" in msg and "s," in msg


def _cases_zero_bubble(rank, world):
    # ZB-H1 (backward split into I and W) through parallelize: one schedule registry for plan,
    # the CLI and the runtime
    return _train(rank, world, "gpt", {}, dict(pp=2, schedule="zb_h1", microbatches=2))


@pytest.mark.dist
def test_zero_bubble_schedule_matches_single_process():
    results = run_distributed(_cases_zero_bubble, 2, timeout=240)
    _check(results, *_reference("gpt", {}))
