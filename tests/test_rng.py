"""RNG streams ([Note: RNG streams] in fxsplit.tp.random): replicated regions draw alike on every
tp rank, tp-sharded regions and pipeline stages each draw their own, recomputation replays, and
one seed gives bit-identical losses."""

import pytest
import torch
from torch import nn

import fxsplit
from fxsplit.testing import run_distributed, zoo
from fxsplit.testing.data import replica_slice
from fxsplit.testing.trace_cache import SharedPlans, SharedTraces, shared_plans, shared_traces
from fxsplit.tp.random import derive_seed, is_random, stage_stream, tp_stream

GPT = dict(n_layer=4, dropout=0.2, attn_dropout=0.2, batch_size=4, seq_len=8)
V, B, T = 128, 4, 8


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


# ------------------------------------------------------------------------------------------------
# no process group: the pass marks the sharded random ops


def _stage_code(**options):
    model, args, _ = zoo.make("gpt", **GPT)
    p = fxsplit.plan(model, args, tp=2, pp=2, **options)
    return "\n".join(m.code for m in p.stages.modules)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_tp_pass_puts_sharded_dropout_on_the_tp_stream(method):
    code = _stage_code(method=method)
    n = GPT["n_layer"]
    if method == "fx":  # attention-probability dropout (head-sharded) -> the tp stream
        assert code.count("fxsplit_tp_random_call_in_tp_stream(") == n, code
        assert code.count(".attn.attn_drop\n") == n  # the module, read by get_attr
        # replicated: embedding and residual dropouts stay plain module calls (stage stream)
        assert code.count(".resid_drop(") == n and code.count(".mlp.drop(") == n and "self.drop(" in code
    else:
        assert code.count("fxsplit_tp_random_dropout(") == n, code
        assert code.count("torch.ops.aten.dropout.default(") == 2 * n + 1  # residuals + embedding


def test_sequence_parallel_dropout_is_on_the_tp_stream():
    # Megatron-3: the embedding and residual dropouts run on sequence shards: all tp streams
    code = _stage_code(method="fx", sequence_parallel=True)
    assert code.count("fxsplit_tp_random_call_in_tp_stream(") == 3 * GPT["n_layer"] + 1, code
    assert ".resid_drop(" not in code


def test_is_random():
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Dropout(0.1), nn.ReLU()))
    assert [is_random(n, gm) for n in gm.graph.nodes] == [False, True, False, False]
    gm = torch.fx.symbolic_trace(lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.0))
    assert not any(is_random(n, gm) for n in gm.graph.nodes)


def test_streams_are_pure_functions_of_their_keys():
    assert derive_seed(1, 0, 0, 0) == derive_seed(1, 0, 0, 0) != derive_seed(1, 1, 0, 0) != derive_seed(2, 0, 0, 0)
    before = torch.get_rng_state()
    with stage_stream(1, stage=0, microbatch=0, step=0):
        a = torch.rand(4)
        with tp_stream():
            s = torch.rand(4)
        b = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's RNG is not consumed
    with stage_stream(1, stage=0, microbatch=0, step=0):
        assert torch.equal(torch.rand(4), a)
        with tp_stream():
            assert torch.equal(torch.rand(4), s)
        assert torch.equal(torch.rand(4), b)  # the stage stream advanced alike
    with stage_stream(1, stage=1, microbatch=0, step=0):
        assert not torch.equal(torch.rand(4), a)


# ------------------------------------------------------------------------------------------------
# tp=2 x pp=2 on gloo


# a rank builds each model once and plans every parallelize of it from one trace
# ([Note: one model and trace per launch] in test_parallelize.py: parallelize never changes the
# model; the masks come from the seed given to parallelize, not from the trace)
_MODELS: dict = {}
_TRACES = SharedTraces()


def _model(key, build):
    if key not in _MODELS:
        _MODELS[key] = build()
    return _MODELS[key]


INF_LINK = fxsplit.Hardware(link_bytes_per_s=float("inf"))
# and a launch plans every layout its ranks parallelize once, before they fork ([Note: preparing once
# per launch] in fxsplit.testing.harness); each rank takes its copy ([Note: plans made before the
# fork]). The seed is a plan option; seed=None follows torch.manual_seed in the rank, not in the plan.
_PLANS = SharedPlans()


def _gpt():
    return _model("gpt", lambda: zoo.make("gpt", **GPT))


def _hf_gpt2_model():
    from fxsplit.testing import hf_zoo

    model, args, kwargs = _model("hf-gpt2", lambda: hf_zoo.make_hf("gpt2", resid_pdrop=0.2, attn_pdrop=0.2,
                                                                    embd_pdrop=0.2))
    model.train()
    return model, args, kwargs


def _gpt_options(seed, **options):
    return dict(hardware=INF_LINK, tp=2, pp=2, seed=seed, **options)


def _prepare(gpt_layouts, hf_layouts):
    """Plan each GPT layout (parallelize's options) and each Hugging Face GPT-2 layout."""
    with shared_traces(_TRACES):
        model, args, _ = _gpt()
        for options in gpt_layouts:
            _PLANS.add(model, args, **options)
        for options in hf_layouts:
            torch.manual_seed(0)  # as _hf_gpt2 builds it
            model, args, kwargs = _hf_gpt2_model()
            _PLANS.add(model, args, kwargs, hardware=INF_LINK, **options)


def _all_prepared(rank, out):
    assert _PLANS.misses == 0, f"rank {rank} planned {_PLANS.misses} layout(s) itself: a plan made before the fork went unused"
    return out


def _parallel(seed, **options):
    model, args, _ = _gpt()
    with shared_traces(_TRACES), shared_plans(_PLANS):
        return fxsplit.parallelize(model, args, loss_fn=zoo.loss_fn("gpt"), timeout=60, **_gpt_options(seed, **options))


def _losses(pm, batches=(0, 1)):
    out = []
    for i in batches:
        x, y = _batch(i)
        out.append(pm.step(x, target=y).item())
    return out


def _record_masks(pm):
    masks = {}
    for s, sm in pm.local_stage_graphs().items():
        for name, mod in sm.named_modules():
            if isinstance(mod, nn.Dropout):
                mod.register_forward_hook(
                    lambda m, i, o, key=(s, name): masks.setdefault(key, []).append((o != 0).clone()))
    return masks


def _grads(pm):
    return {n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None}


def _checkpoint_replays(pm):
    """Stage 0 under torch.utils.checkpoint: recomputation in backward must draw the same masks
    (replicated and tp-sharded); with preserve_rng_state=False it does not (the control)."""
    from torch.utils.checkpoint import checkpoint

    mod = pm.local_stage_graphs()[0]
    x, _ = _batch(0)
    grads = []
    for how in ("plain", "checkpoint", "no-replay"):
        mod.zero_grad()
        with pm._bound():
            with stage_stream(7, stage=0, microbatch=0, step=0):
                if how == "plain":
                    out = mod(x)
                else:
                    out = checkpoint(mod, x, use_reentrant=False, preserve_rng_state=how == "checkpoint")
            out[0].float().pow(2).sum().backward()  # outside the stream, as the runtime's B
        grads.append({n: p.grad.clone() for n, p in mod.named_parameters() if p.grad is not None})
    same = all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    control = all(torch.equal(grads[0][n], grads[2][n]) for n in grads[0])
    return same, control


def _worker(rank, world):
    out = {}
    torch.manual_seed(1)  # the default seed follows torch.manual_seed
    pm = _parallel(None)
    masks = _record_masks(pm)
    out["default"] = _losses(pm)
    out["masks"] = masks
    out["grads"] = _grads(pm)
    out["replicated"] = [n for n, _ in pm.named_parameters() if "ln" in n or "wpe" in n or "proj.bias" in n
                         or "down.bias" in n]
    if pm.coords["pp"] == 0:
        out["checkpoint"] = _checkpoint_replays(pm)
    pm = _parallel(1)
    out["seed1"] = _losses(pm)
    pm.runtime.resume_rng(2, 0)
    out["seed2"] = _losses(pm)
    out["steps"] = _losses(pm, batches=(0, 0))
    pm_1f1b = _parallel(1, schedule="1f1b")
    out["1f1b"], out["1f1b_grads"] = _losses(pm_1f1b), _grads(pm_1f1b)
    pm_zb = _parallel(1, schedule="zb_h1")
    out["zb_h1"] = _losses(pm_zb)
    out["zb_h1_grads"], out["zb_h1_fallbacks"] = _grads(pm_zb), pm_zb.split_fallbacks
    out["coords"] = pm.coords
    return _all_prepared(rank, out)


WORKER_LAYOUTS = [_gpt_options(None), _gpt_options(1), _gpt_options(1, schedule="1f1b"),
                  _gpt_options(1, schedule="zb_h1")]


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_worker, 4, timeout=300, prepare=(_prepare, (WORKER_LAYOUTS, [])))


def _by(ranks, pp, tp):
    return next(r for r in ranks if r["coords"]["pp"] == pp and r["coords"]["tp"] == tp)


@pytest.mark.dist
def test_replicated_regions_draw_alike_on_every_tp_rank(ranks):
    for pp in (0, 1):
        a, b = _by(ranks, pp, 0), _by(ranks, pp, 1)
        keys = [k for k in a["masks"] if "attn_drop" not in k[1]]
        assert keys
        for k in keys:
            assert all(torch.equal(x, y) for x, y in zip(a["masks"][k], b["masks"][k], strict=True)), k
        # the replicas' gradients stay bit-identical: TP-replicated parameters never diverge
        for n in a["replicated"]:
            assert torch.equal(a["grads"][n], b["grads"][n]), n


@pytest.mark.dist
def test_sharded_regions_draw_their_own_per_tp_rank(ranks):
    for pp in (0, 1):
        a, b = _by(ranks, pp, 0), _by(ranks, pp, 1)
        keys = [k for k in a["masks"] if "attn_drop" in k[1]]
        assert keys
        for k in keys:
            for x, y in zip(a["masks"][k], b["masks"][k], strict=True):
                assert x.shape == y.shape and not torch.equal(x, y), k
                causal = torch.ones(T, T, dtype=torch.bool).tril().expand_as(x)  # probabilities > 0
                assert 0.7 < x[causal].float().mean() < 0.9 and not x[~causal].any()  # dropout 0.2


@pytest.mark.dist
def test_stages_and_microbatches_draw_differently(ranks):
    first = {}
    for pp in (0, 1):
        for (s, name), ms in _by(ranks, pp, 0)["masks"].items():
            if "resid_drop" in name:
                first.setdefault(s, ms)
                assert not torch.equal(ms[0], ms[1])  # microbatches 0 and 1
    assert sorted(first) == [0, 1, 2, 3]  # interleaved: v=2 stages per pipeline rank
    for s in first:
        for q in first:
            if s < q:
                assert not torch.equal(first[s][0], first[q][0]), (s, q)


@pytest.mark.dist
def test_same_seed_same_losses(ranks):
    r = ranks[0]
    assert r["default"] == r["seed1"]  # seed=None after torch.manual_seed(1) is seed 1
    assert r["seed2"] != r["seed1"]
    assert r["steps"][0] != r["steps"][1]  # the same batch again: a new step draws new masks
    assert all(q["seed1"] == r["seed1"] for q in ranks)
    # the streams depend on (stage, microbatch, step), not on the schedule: zero-bubble's I/W
    # split draws nothing again
    assert r["1f1b"] == r["zb_h1"]


@pytest.mark.dist
def test_sharded_dropout_takes_the_graph_split(ranks):
    """tp=2 x pp=2, ZB-H1: the stages with head-sharded attention dropout split as graphs (no
    fallback to autograd: the tp stream's seeding runs as graph nodes, [Note: RNG streams] 3), and
    the losses and every gradient equal 1F1B's (eager stages on the same streams) bit for bit, on
    every rank: the masks, replicated and sharded, are the eager ones."""
    for r in ranks:
        assert r["zb_h1_fallbacks"] == {}, r["zb_h1_fallbacks"]
        assert r["zb_h1"] == r["1f1b"]
        assert r["zb_h1_grads"].keys() == r["1f1b_grads"].keys() and r["zb_h1_grads"]
        for n, g in r["1f1b_grads"].items():
            assert torch.equal(r["zb_h1_grads"][n], g), n


@pytest.mark.dist
def test_checkpoint_recomputation_replays_the_masks(ranks):
    for tp in (0, 1):
        same, control = _by(ranks, 0, tp)["checkpoint"]
        assert same and not control


def _single(rank, world):
    x, y = _batch(0)
    loss_fn = zoo.loss_fn("gpt")
    out = []
    for dropout in (0.0, 0.2):
        model, args, _ = zoo.make("gpt", **{**GPT, "dropout": dropout, "attn_dropout": dropout})
        with stage_stream(5, stage=0, microbatch=0, step=0):
            ref = loss_fn(model(x), y).item()
        pm = fxsplit.parallelize(model, args, loss_fn=loss_fn, seed=5, timeout=60)
        out.append((ref, pm.step(x, target=y).item()))
    return out


@pytest.mark.dist
def test_one_process_equals_the_model_on_the_stage_stream():
    """tp=1, pp=1, m=1: the model run on the stage stream of (seed, stage 0, microbatch 0, step 0)
    is the reference, bit for bit; without dropout, the plain model."""
    (ref0, got0), (ref, got) = run_distributed(_single, 1, timeout=120)[0]
    assert got0 == ref0
    assert got == ref


# ------------------------------------------------------------------------------------------------
# more layouts: HF GPT-2 (export: aten.dropout, sdpa dropout_p), sequence parallelism, dp=2 x tp=2


def _hf_gpt2(seed, **options):
    torch.manual_seed(0)
    model, args, kwargs = _hf_gpt2_model()
    loss_fn = lambda out, y: nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())  # noqa: E731
    with shared_traces(_TRACES), shared_plans(_PLANS):
        pm = fxsplit.parallelize(model, args, kwargs, loss_fn=loss_fn, seed=seed, timeout=60, hardware=INF_LINK,
                                 **options)
    x, mask = args[0], kwargs["attention_mask"]
    g = torch.Generator().manual_seed(3)
    y = torch.randint(0, 256, x.shape, generator=g)
    losses = []
    for _ in range(2):
        pm.zero_grad()
        losses.append(pm.step(x, attention_mask=mask, target=y).item())
    return pm, losses


def _layouts_worker(rank, world):
    out = {}
    for label, opts in {"hf-tp2-pp2": HF_TP2_PP2}.items():
        pm, a = _hf_gpt2(3, **opts)
        _, b = _hf_gpt2(3, **opts)
        c = _hf_gpt2(4, **opts)[1] if opts.get("tp") else None
        out[label] = dict(losses=(a, b, c), coords=pm.coords, replicated=_replicated_grads(pm))
    pm = _parallel(1, **SP)
    a = _losses(pm)
    out["sp"] = dict(losses=(a, _losses(_parallel(1, **SP))), coords=pm.coords,
                     replicated=_replicated_grads(pm))
    out["dp2-tp2"] = _dp_masks()
    return _all_prepared(rank, out)


DP_MASKS = dict(dp=2, tp=2, seed=1, hardware=INF_LINK)


def _dp_masks():
    """dp=2 x tp=2, each replica on its own half of the global batch: the dropout masks of two
    steps on this rank ([Note: RNG streams] 4: the replicas share the streams)."""
    model, args, _ = _gpt()
    with shared_traces(_TRACES), shared_plans(_PLANS):
        pm = fxsplit.parallelize(model, args, loss_fn=zoo.loss_fn("gpt"), timeout=60, **DP_MASKS)
    masks = _record_masks(pm)
    for i in (0, 1):
        x, y = _batch(i)
        pm.step(replica_slice(pm, x), target=replica_slice(pm, y))
    return dict(masks=masks, coords=pm.coords)


def _replicated_grads(pm):
    """The gradients of the parameters the TP plan leaves whole (the same on every tp rank if the
    replicated regions drew alike)."""
    sharded = set(pm.plan.tp_plan.param_specs)
    return {(s, n): p.grad.clone() for s, sm in pm.local_stage_graphs().items()
            for n, p in sm.named_parameters() if p.grad is not None and n not in sharded}


HF_TP2_PP2 = dict(tp=2, pp=2, microbatches=2)
SP = dict(sequence_parallel=True, microbatches=2)
# what _layouts_worker parallelizes, in order: each layout as often as it does
LAYOUTS_GPT = [_gpt_options(1, **SP), _gpt_options(1, **SP), DP_MASKS]
LAYOUTS_HF = [dict(seed=3, **HF_TP2_PP2), dict(seed=3, **HF_TP2_PP2), dict(seed=4, **HF_TP2_PP2)]


@pytest.fixture(scope="module")
def layouts():
    return run_distributed(_layouts_worker, 4, timeout=420, prepare=(_prepare, (LAYOUTS_GPT, LAYOUTS_HF)))


@pytest.mark.dist
def test_streams_on_hf_gpt2_and_sequence_parallel(layouts):
    ranks = layouts
    for label in ("hf-tp2-pp2",):
        for r in ranks:
            a, b, c = r[label]["losses"]
            assert a == b, (label, a, b)  # same seed: bit-identical losses
            assert c is None or a != c, label  # another seed: other masks
            assert a[0] != a[1], label  # the same batch at the next step draws new masks
        assert all(q[label]["losses"] == ranks[0][label]["losses"] for q in ranks), label
    for label in ("hf-tp2-pp2", "sp"):
        for pp in (0, 1):
            ga, gb = [r[label]["replicated"] for r in ranks if r[label]["coords"]["pp"] == pp]
            assert ga and set(ga) == set(gb), label
            for k in ga:  # the tp replicas of a replicated parameter never diverge
                assert torch.equal(ga[k], gb[k]), (label, pp, k)
    for r in ranks:
        a, b = r["sp"]["losses"]
        assert a == b and a[0] != a[1]


@pytest.mark.dist
def test_data_parallel_replicas_share_the_streams(layouts):
    """[Note: RNG streams] 4 and the README: data-parallel replicas draw the same masks (their data
    differs, their streams do not); within a replica the tp ranks draw the same masks in
    replicated regions and their own in tp-sharded ones (attention-probability dropout on heads);
    the next step draws new masks."""
    cells = {(r["dp2-tp2"]["coords"]["dp"], r["dp2-tp2"]["coords"]["tp"]): r["dp2-tp2"]["masks"] for r in layouts}
    assert sorted(cells) == [(0, 0), (0, 1), (1, 0), (1, 1)], sorted(cells)
    keys = set(cells[0, 0])
    assert any("attn_drop" in k[1] for k in keys) and any("attn_drop" not in k[1] for k in keys), keys
    for tp in (0, 1):  # across replicas: the same masks, every module, both steps
        assert set(cells[1, tp]) == keys
        for k in keys:
            assert len(cells[0, tp][k]) == 2, k
            assert all(torch.equal(a, b) for a, b in zip(cells[0, tp][k], cells[1, tp][k])), (tp, k)
    for k in keys:
        first, second = cells[0, 0][k]
        assert not torch.equal(first, second), k  # a new step draws new masks
        same_over_tp = all(torch.equal(a, b) for a, b in zip(cells[0, 0][k], cells[0, 1][k]))
        assert same_over_tp == ("attn_drop" not in k[1]), (k, same_over_tp)
