"""Expert parallelism on real gloo ranks against one process: every case trains 3 optimizer steps
(SGD; AdamW for the ``STATE_CASES``), each data-parallel replica on its own slice of one global batch, and compares the loss of
every step, the whole model's gradient norm (``clip_grad_norm_``) and every gradient of the last
step (an expert weight's gradient on a rank is its block of experts, its tp shard with tp) with the
unsplit model on the whole batch (under mp_policy, the unsplit model under the same policy). The
``STATE_CASES`` also gather the full state dict and save a sharded checkpoint with AdamW's state,
loaded back, at another ep (which then trains ``MORE`` steps) and whole in the test's process (which
trains them too), each continued run against the unsplit model's steps 4 and 5; on two ranks one
rank's copy of it is damaged, and the load raises on both ranks, naming the file and the rank.
All cases run in ONE launch per world size: the zoo's torchtitan-style MoE and transformers' MoE
families (grouped_mm experts, built from configs)."""

import io

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import fxsplit
from fxsplit.testing import run_distributed, zoo
from fxsplit.testing.data import replica_index, replica_slice
from fxsplit.testing.trace_cache import SharedPlans, shared_plans

_HW = fxsplit.Hardware(link_bytes_per_s=float("inf"))
STEPS, LR, GLOBAL_BATCH = 3, 0.05, 8
MORE, ADAM_LR = 2, 1e-2  # the STATE_CASES: AdamW, and steps trained after a load
# AdamW moves each element by about lr whatever its gradient's size, so an element whose gradient is
# near zero moves by gradient noise (measured: 1.6e-5 on one element of 1536 after 3 steps); a missed
# expert block or optimizer state moves whole tensors by about lr
ADAM_ATOL = 1e-4
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# bfloat16 against the unsplit model under the same policy: the tolerances of tests/test_mixed_precision.py
# (per tensor relative to max(|g|, 1e-3 |whole gradient|), and over the whole gradient). The first step
# runs on the same parameters: its loss is compared tightly (equal to the reference's, 2.2e-4 from the
# float32 model's, so it tells a run that ignored the policy apart) and its gradients are the ones
# compared. After an update a bfloat16 MoE is as noisy as the reference itself: a rounding difference
# can send a token to another expert. Measured: the reference's second loss moves by 6.8e-4 between one
# and two threads (4.346408 vs 4.343464; the float32 model's 4.342556 lies in that band), and the last
# step's whole gradient differed from the one-thread reference by 3.2e-2 in a one-thread suite run
MP_GRAD_RTOL, MP_WHOLE_RTOL, MP_LOSS_RTOL, MP_FIRST_LOSS_RTOL = 3e-2, 1e-2, 2e-3, 5e-5

# label -> (model builder, options); the world size is dp * dp_shard * pp * tp
CASES_2 = {
    "moe/dp2-ep2": ("moe", dict(dp=2, ep=2)),
    "moe-noshared/dp2-ep2": ("moe-noshared", dict(dp=2, ep=2)),
    "mixtral/dp2-ep2": ("mixtral", dict(dp=2, ep=2)),
    "qwen2_moe/dp2-ep2": ("qwen2_moe", dict(dp=2, ep=2)),
    "moe/ds2-ep2": ("moe", dict(dp_shard=2, ep=2)),
    # compiled: the all-to-alls are opaque ops inside the compiled graphs ([Note: traced exchange])
    "moe/dp2-ep2-compile": ("moe", dict(dp=2, ep=2, compile=True)),
}
# full state dicts gathered / loaded; a sharded checkpoint saved, loaded back, loaded at another ep
# (label -> the other layout's options) and, in the test's process, whole (ep = 1)
STATE_CASES = {"moe/dp2-ep2": dict(dp=2), "moe/dp4-ep2": dict(dp=4, ep=4)}
CASES_4 = {
    "moe/dp2-ep2-pp2": ("moe", dict(dp=2, ep=2, pp=2, microbatches=2, schedule="1f1b")),
    "moe/dp4-ep4": ("moe", dict(dp=4, ep=4)),
    "moe/dp4-ep2": ("moe", dict(dp=4, ep=2)),
    "moe/dp2-ep2-pp2-zbv": ("moe", dict(dp=2, ep=2, pp=2, microbatches=4, schedule="zbv")),
    "moe/dp2-ep2-pp2-interleaved": ("moe", dict(dp=2, ep=2, pp=2, microbatches=2)),
    "qwen2_moe/dp2-ep2-pp2": ("qwen2_moe", dict(dp=2, ep=2, pp=2, microbatches=2, schedule="1f1b")),
    "mixtral/dp4-ep4": ("mixtral", dict(dp=4, ep=4)),
    "moe/dp2-ds2-ep2": ("moe", dict(dp=2, dp_shard=2, ep=2)),
    "moe/dp2-ep2-pp2-dualpipev": ("moe", dict(dp=2, ep=2, pp=2, microbatches=4, schedule="dualpipev")),
    "moe/dp2-ep2-pp2-full-checkpointing": ("moe", dict(dp=2, ep=2, pp=2, microbatches=2, schedule="1f1b",
                                                        activation_checkpointing="full")),
    "moe/dp2-ep2-pp2-zbh1": ("moe", dict(dp=2, ep=2, pp=2, microbatches=2, schedule="zb_h1")),
    "moe/dp2-ep2-pp2-selective-checkpointing": ("moe", dict(dp=2, ep=2, pp=2, microbatches=2, schedule="1f1b",
                                                             activation_checkpointing="selective")),
    "moe/dp2-ep2-pp2-bf16": ("moe", dict(dp=2, ep=2, pp=2, microbatches=2, schedule="1f1b", mp_policy=BF16)),
    # ep x tp: each rank's block of experts split over tp (w1 / w3 by columns, w2 by rows)
    "moe/dp2-ep2-tp2": ("moe", dict(dp=2, ep=2, tp=2)),
    # ... and transformers' families (fxsplit.testing.moe_families: one MoE layer; DeepSeek-V3's MLA attention)
    "qwen2_moe/dp2-ep2-tp2": ("qwen2_moe", dict(dp=2, ep=2, tp=2)),
    "qwen3_moe/dp2-ep2-tp2": ("qwen3_moe", dict(dp=2, ep=2, tp=2)),
    "olmoe/dp2-ep2-tp2": ("olmoe", dict(dp=2, ep=2, tp=2)),
    "deepseek_v3/dp2-ep2-tp2": ("deepseek_v3", dict(dp=2, ep=2, tp=2)),
}


def _model(name):
    if name in ("mixtral", "qwen2_moe"):  # transformers' grouped_mm experts, 4 experts, top-2
        from fxsplit.testing import tp_coverage

        model, _, _ = tp_coverage.build(name)
        return model
    if name in ("qwen3_moe", "olmoe", "deepseek_v3"):
        from fxsplit.testing import moe_families

        return moe_families.build(name)[0]
    if name == "moe-noshared":
        model, _, _ = zoo.make("moe", shared_expert=False, num_experts=8, top_k=2, seed=1)
    else:
        model, _, _ = zoo.make("moe", seed=0)
    return model


# what _prepare built and planned once per launch, before the ranks fork ([Note: preparing once per launch]
# in fxsplit.testing.harness): label (or (label, "other") for a STATE_CASES reload) -> (model, x, y, example)
_PREPARED: dict = {}
_PLANS = SharedPlans()


def _prepare(cases):
    """Every case's model, batch and plan, made once; each rank takes its copy instead of planning the same
    layout itself ([Note: plans made before the fork] in fxsplit.testing.trace_cache)."""
    for label, (name, options) in cases.items():
        layouts = [(label, options)] + ([((label, "other"), STATE_CASES[label])] if label in STATE_CASES else [])
        for key, opts in layouts:
            model = _model(name)
            x, y = _batch(model)
            example = x[:GLOBAL_BATCH // (opts.get("dp", 1) * opts.get("dp_shard", 1))]
            _PREPARED[key] = model, x, y, example
            _PLANS.add(model, (example,), hardware=_HW, verify=False, **opts)


def _loss(out, y):
    logits = out.logits if hasattr(out, "logits") else out
    return zoo.cross_entropy_loss(logits, y)


def _batch(model):
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, vocab, (GLOBAL_BATCH, 8), generator=g)
    return x, torch.randint(0, vocab, (GLOBAL_BATCH, 8), generator=g)


def _whole(grad):
    """An FSDP-sharded gradient gathered whole (a collective over its mesh, in the same order on every rank)."""
    from torch.distributed.tensor import DTensor

    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _optimizer(params, label):
    return torch.optim.AdamW(params, lr=ADAM_LR) if label in STATE_CASES else torch.optim.SGD(params, lr=LR)


def _damaged_load(pm, path):
    """Rank 1 loads a copy of ``path`` with bytes of an expert block overwritten, rank 0 a good copy:
    (exception type, text) on each rank (every rank must raise, none may hang)."""
    import shutil

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    mine = f"{path}-copy{dist.get_rank()}"
    shutil.copytree(path, mine)
    if dist.get_rank() == 1:
        meta = dcp.FileSystemReader(mine).read_metadata()
        key = next(k for k in pm.plan.ep_plan.expert_params if k in meta.state_dict_metadata)
        info = next(s for i, s in meta.storage_data.items() if i.fqn == key and i.offset[0] > 0)  # ep rank 1's block
        with open(f"{mine}/{info.relative_path}", "r+b") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
            raw = torch.load(io.BytesIO(blob), weights_only=True).contiguous().view(-1).view(torch.uint8)
            f.seek(info.offset + blob.index(raw.numpy().tobytes()) + 4)
            f.write(b"\x5a" * 16)
    try:
        pm.load_checkpoint(mine, optimizer=None)
    except Exception as exc:  # noqa: BLE001 -- the test looks at its type and text
        return type(exc).__name__, str(exc)
    return None


def _continue(pm, opt, x, y):
    losses = []
    for _ in range(MORE):
        opt.zero_grad()
        losses.append(float(pm.step(replica_slice(pm, x), target=replica_slice(pm, y))))
        opt.step()
    return losses


def _state_checks(pm, opt, label, name, x, y, path, other):
    """The trained full state dict (expert blocks joined over ep), a damaged copy refused, a
    reload of fresh weights, the sharded checkpoint loaded back, and loaded with the optimizer state
    by the same model at the ``other`` layout, which trains on."""
    trained = {k: v.clone() for k, v in pm.full_state_dict().items()}  # on the CPU it shares the live tensors
    pm.save_checkpoint(path, optimizer=opt)
    damaged = _damaged_load(pm, path) if pm.plan.config.world_size == 2 else None
    fresh = _model(name).state_dict()
    pm.load_full_state_dict(fresh)
    reloaded = pm.full_state_dict()  # (sharing the live tensors: compared before the next load)
    reloaded_equal = all(torch.equal(reloaded[k], v) for k, v in fresh.items())
    pm.load_checkpoint(path)
    restored = pm.full_state_dict()
    model2, _, _, example2 = _PREPARED[(label, "other")]  # a fresh model of ``name``, planned at ``other``
    pm2 = fxsplit.parallelize(model2, (example2,), loss_fn=_loss, hardware=_HW, timeout=60, verify=False, **other)
    opt2 = torch.optim.AdamW(pm2.parameters(), lr=ADAM_LR)
    pm2.load_checkpoint(path, optimizer=opt2)
    same = lambda got: all(torch.equal(got[k], v) for k, v in trained.items())  # noqa: E731
    other_equal = same(pm2.full_state_dict())
    return dict(trained=trained, reloaded_equal=reloaded_equal, restored_equal=same(restored), other_equal=other_equal,
                path=path, damaged=damaged, continued=_continue(pm2, opt2, x, y),
                continued_state={k: v.clone() for k, v in pm2.full_state_dict().items()})


def _train(rank, world, cases, tmp=None):
    with shared_plans(_PLANS) as plans:
        out = _train_cases(cases, tmp)
    assert plans.misses == 0, f"rank {rank} planned {plans.misses} layout(s) itself: a plan made before the fork went unused"
    return out


def _train_cases(cases, tmp):
    out = {}
    for label, (name, options) in cases.items():
        model, x, y, example = _PREPARED[label]
        # the zoo's model is verified on every rank first (ep emulated in one process: verify=None, auto)
        pm = fxsplit.parallelize(model, (example,), loss_fn=_loss, hardware=_HW,
                                 timeout=60, verify=None if label == "moe/dp2-ep2" else False, **options)
        opt = _optimizer(pm.parameters(), label)
        losses = []
        for i in range(STEPS):
            opt.zero_grad()
            losses.append(float(pm.step(replica_slice(pm, x), target=replica_slice(pm, y))))
            norm_i = float(pm.clip_grad_norm_(1e9))  # the whole model's norm (nothing clipped)
            if i == 0 or "mp_policy" not in options:  # bfloat16: the first step's ([see MP_LOSS_RTOL])
                norm = norm_i
                grads = {n: _whole(p.grad).detach().clone() for m in pm.stage_modules.values()
                         for n, p in m.named_parameters() if p.grad is not None}
            opt.step()
        d, _ = replica_index(pm)
        out[label] = dict(losses=losses, grads=grads, norm=norm, ep_rank=d % options["ep"], tp_rank=pm.coords.get("tp", 0),
                          experts=set(pm.plan.ep_plan.expert_params), specs=dict(pm.plan.tp_plan.param_specs),
                          fallbacks=dict(pm.compile_fallbacks), splits=pm.split_fallbacks)
        if label in STATE_CASES:
            out[label].update(_state_checks(pm, opt, label, name, x, y, f"{tmp}/{label.replace('/', '-')}",
                                            STATE_CASES[label]))
    return out


def _reference(name, param_dtype=None, label=None):
    """The unsplit model on the whole batch; under ``param_dtype`` its forward reads every parameter
    cast to it (the float32 parameters get the gradients) and the logits go to the loss in float32.
    For a ``STATE_CASES`` label: AdamW, and ``MORE`` steps after (their losses and the state then)."""
    model = _model(name)
    x, y = _batch(model)
    opt = _optimizer(model.parameters(), label)
    losses = []
    for _ in range(STEPS + (MORE if label in STATE_CASES else 0)):
        if len(losses) == STEPS:
            state = {k: v.clone() for k, v in model.state_dict().items()}
        opt.zero_grad()
        if param_dtype is None:
            out = model(x)
        else:
            cast = {k: p.to(param_dtype) for k, p in model.named_parameters()}
            out = torch.func.functional_call(model, cast, (x,), tie_weights=True).float()
        loss = _loss(out, y)
        loss.backward()
        losses.append(float(loss.detach()))
        if len(losses) <= (1 if param_dtype is not None else STEPS):  # bfloat16: the first step's
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    if label not in STATE_CASES:
        return losses, grads, model.state_dict()
    return (losses[:STEPS], losses[STEPS:]), grads, (state, model.state_dict())


def _whole_continued(name, path):
    """The checkpoint at ``path`` loaded whole in this process, model and AdamW state, trained
    ``MORE`` steps on the whole batch: their losses."""
    full = fxsplit.load_full_checkpoint(path, include_optimizer=True)
    model = _model(name)
    model.load_state_dict({k: v for k, v in full.items() if not k.startswith("optim/")})
    opt = torch.optim.AdamW(model.parameters(), lr=ADAM_LR)
    for n, p in model.named_parameters():
        opt.state[p] = {k.rsplit("/", 1)[1]: v for k, v in full.items() if k.startswith(f"optim/{n}/")}
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}, (n, sorted(opt.state[p]))
    x, y = _batch(model)
    losses = []
    for _ in range(MORE):
        opt.zero_grad()
        loss = _loss(model(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
    return losses


def _check(cases, results):
    for label, (name, options) in cases.items():
        mp = options.get("mp_policy")
        losses, grads, state = _reference(name, mp and mp.param_dtype, label)
        if label in STATE_CASES:
            (losses, more), (state, final) = losses, state
        seen = set()
        for rank, res in enumerate(r[label] for r in results):
            tag = f"{label} rank {rank}"
            assert res["experts"], f"{tag}: no MoE layer was placed by ep"
            if options.get("schedule") in ("zbv", "zb_h1", "dualpipev"):  # the graph split takes every stage
                assert not res["splits"], (tag, res["splits"])  # ([Note: traced exchange])
            if options.get("compile"):  # every graph compiled: the exchange is an extern op inside them
                assert not res["fallbacks"] and not res["splits"], (tag, res["fallbacks"], res["splits"])
            if options.get("tp", 1) > 1:
                assert res["experts"] <= set(res["specs"]), f"{tag}: the experts are not split over tp"
            assert res["losses"] == pytest.approx(losses, rel=MP_LOSS_RTOL if mp else 1e-5), tag
            if mp:  # the first step runs on the same parameters: as tight as float32 ([see MP_LOSS_RTOL])
                assert res["losses"][0] == pytest.approx(losses[0], rel=MP_FIRST_LOSS_RTOL), tag
            whole_norm = float(torch.cat([g.flatten() for g in grads.values()]).norm())  # every expert once
            # (the gradients' own tolerance: a missed or doubled expert block moves it by far more)
            assert res["norm"] == pytest.approx(whole_norm, rel=MP_GRAD_RTOL if mp else 1e-4), tag
            got, wanted = {}, {}
            for n, g in res["grads"].items():
                want = grads[n]
                if n in res["specs"]:  # this tp rank's shard (of every expert, for an expert weight)
                    want = res["specs"][n].shard(want, res["tp_rank"])
                if n in res["experts"]:
                    k = want.shape[0] // options["ep"]
                    assert g.shape[0] == k, f"{tag}: {n} holds {g.shape[0]} experts, not {k}"
                    want = want[res["ep_rank"] * k:(res["ep_rank"] + 1) * k]
                got[n], wanted[n] = g, want
                if not mp:
                    torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6, msg=f"{tag} grad {n}")
                seen.add(n)
            if mp:
                _check_mixed_precision(got, wanted, tag)
        assert seen == set(grads), f"{label}: gradients missing: {sorted(set(grads) - seen)}"
        if label in STATE_CASES:
            for res in (r[label] for r in results):
                assert set(res["trained"]) == set(state), label
                for k, v in state.items():
                    torch.testing.assert_close(res["trained"][k], v, rtol=1e-4, atol=ADAM_ATOL,
                                               msg=lambda m, k=k: f"{label} state {k}: {m}")
                assert res["reloaded_equal"] and res["restored_equal"], label
                assert res["other_equal"], f"{label}: loaded at {STATE_CASES[label]}"
            whole = fxsplit.load_full_checkpoint(results[0][label]["path"])  # one process, no ep
            for k, v in state.items():
                torch.testing.assert_close(whole[k], v, rtol=1e-4, atol=ADAM_ATOL, msg=lambda m, k=k: f"{label} checkpoint {k}: {m}")
            _check_continued(label, results, more, final)


def _check_continued(label, results, more, final):
    """The runs continued from the checkpoint (AdamW state included) against the unsplit model's
    steps after ``STEPS``: at the other layout on the ranks, and whole in this process."""
    name = CASES_2.get(label, CASES_4.get(label))[0]
    for rank, res in enumerate(r[label] for r in results):
        assert res["continued"] == pytest.approx(more, rel=1e-5), f"{label} rank {rank} at {STATE_CASES[label]}"
        for k, v in final.items():
            torch.testing.assert_close(res["continued_state"][k], v, rtol=1e-4, atol=ADAM_ATOL,
                                       msg=lambda m, k=k: f"{label} continued {k}: {m}")
    assert _whole_continued(name, results[0][label]["path"]) == pytest.approx(more, rel=1e-5), label
    damaged = [r[label]["damaged"] for r in results]
    if len(results) == 2:  # rank 1 read a damaged expert block; rank 0 a good copy: both raise
        assert damaged[1][0] == "CheckpointError" and "checksum" in damaged[1][1], damaged[1]
        assert "-copy1" in damaged[1][1] and ".distcp" in damaged[1][1], damaged[1]
        assert damaged[0] is not None and damaged[0][0] == "RankFailedError", damaged[0]
        assert "rank 1" in damaged[0][1] and "checksum" in damaged[0][1], damaged[0]


def _check_mixed_precision(got, want, tag):
    whole = torch.cat([g.flatten() for g in want.values()])
    diff = torch.cat([(got[n] - g).flatten() for n, g in want.items()])
    assert float(diff.norm() / whole.norm()) < MP_WHOLE_RTOL, tag
    floor = 1e-3 * float(whole.norm())
    for n, g in want.items():
        gap = float((got[n] - g).norm()) / max(float(g.norm()), floor)
        assert gap < MP_GRAD_RTOL, (tag, n, gap)


@pytest.mark.dist
@pytest.mark.hf
def test_expert_parallel_two_ranks(tmp_path):
    _check(CASES_2, run_distributed(_train, 2, CASES_2, str(tmp_path), timeout=300, prepare=(_prepare, (CASES_2,))))


@pytest.mark.dist
@pytest.mark.hf
def test_expert_parallel_four_ranks(tmp_path):
    _check(CASES_4, run_distributed(_train, 4, CASES_4, str(tmp_path), timeout=800, prepare=(_prepare, (CASES_4,))))
