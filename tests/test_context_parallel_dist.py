"""Context parallelism on real gloo ranks, in ONE launch of 4 processes: cp=2 x dp=2, cp=4 (K/V by ring, the
plan's own choice), cp=2 x tp=2 with sequence parallelism (ring), cp=2 x tp=2 with the vocabulary-parallel loss,
cp=2 x pp=2 (1F1B, interleaved 1F1B with two stages per rank, ZB-H1 by ring: its traced graph split runs the
ring's functional all-to-all and flash kernels) and cp=2 x dp=2 with compile=True by ring
(every stage graph through inductor, none falling back) on the zoo GPT, three SGD steps each,
and Llama with its own loss at cp=2 x dp=2 (a second step at 27 tokens, which 2 * cp does not divide: padded to
the traced 32 and masked) and at cp=2 x tp=2 by ring, every data-parallel replica fed its own slice of the global
batch; the loss of every step and every gradient (tp shards reassembled) against one process on the whole
batch. In the same launch: mp_policy (bf16 parameters, fp32 reductions) at cp=2 x dp=2 against the same
casts in one process, to bf16's tolerance (test_mixed_precision.py), and a checkpoint saved at cp=2 x dp=2
after the three steps, loaded at tp=2 x pp=2 and read whole in this process (cp=1), equal to the one-process
model after three steps. The one-process checks (verify, emulated) are in test_context_parallel.py."""

import copy

import pytest
import torch

import fxsplit
from fxsplit.testing import run_distributed, zoo
from fxsplit.testing.data import local_grads, replica_slice
from fxsplit.testing.trace_cache import SharedPlans, SharedTraces, shared_plans, shared_traces

_HW = fxsplit.Hardware(link_bytes_per_s=float("inf"))
_AG = dict(cp_kv="allgather")  # the zoo GPT's attention is is_causal: the plan's rule would take the ring
CASES = [dict(cp=2, dp=2, **_AG), dict(cp=4), dict(cp=2, tp=2, sequence_parallel=True, cp_kv="ring"),
         dict(cp=2, tp=2, vocab_parallel_loss=True, **_AG), dict(cp=2, pp=2, microbatches=2, **_AG),
         dict(cp=2, pp=2, schedule="interleaved_1f1b", stages_per_rank=2, microbatches=4, **_AG),
         dict(cp=2, pp=2, schedule="zb_h1", microbatches=4, cp_kv="ring"),
         dict(cp=2, dp=2, compile=True, cp_kv="ring")]
RING = (1, 2, 6, 7)  # the cases whose attention runs by ring (cp=4 by the plan's rule: no mask to read)
SAVED = 0  # the case whose state after the last step is saved: cp=2 x dp=2
STEPS, LR = 3, 0.1


def _loss_of(opts):
    return _vocab_parallel_loss if opts.get("vocab_parallel_loss") else zoo.cross_entropy_loss


def _vocab_parallel_loss(logits_shard, target):
    """The cross-entropy on this tp rank's vocabulary columns (every token's: cp gathered the sequence)."""
    from fxsplit.tp.functional import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits_shard, target, zoo.GPTConfig().vocab_size)


def _example():
    # two layers: every layout still gets all its stages (interleaved 1F1B's four, cut by cost inside
    # the blocks); four layers made every graph of the compiled case twice as long (its launch from a
    # cold inductor cache: 110 -> 84 CPU-s)
    model, (idx,), _ = zoo.make_gpt(seq_len=16, n_kv_head=2, batch_size=4, seed=3, n_layer=2)
    target = torch.randint(0, model.config.vocab_size, idx.shape, generator=torch.Generator().manual_seed(4))
    return model, idx, target


_TRACES = SharedTraces()
_PLANS = SharedPlans()
_SHARED: list = []  # the example every GPT layout (CASES, mp_policy, the reload) is planned for: built once per process


def _shared_example():
    if not _SHARED:
        _SHARED.extend(_example())
    return _SHARED


def _prepare():
    """Once per launch, before the ranks fork ([Note: preparing once per launch] in fxsplit.testing.harness):
    every GPT layout (CASES, mp_policy's and the reload's) planned from shared traces, and both Llama layouts;
    each rank takes its copy of these plans instead of planning the same layouts itself ([Note: plans made
    before the fork])."""
    from test_mixed_precision import POLICY

    model, idx, _ = _shared_example()
    with shared_traces(_TRACES):
        for opts in CASES:
            _PLANS.add(model, (idx,), hardware=_HW, verify=False, **opts)
        _PLANS.add(model, (idx,), hardware=_HW, verify=False, mp_policy=POLICY, **MP)
        _PLANS.add(model, (idx,), hardware=_HW, verify=False, **RELOAD)
    model, _, _, _, half, whole = _shared_llama()
    _PLANS.add(model, *half, hardware=_HW, verify=False, **LLAMA_DP)
    _PLANS.add(model, *whole, hardware=_HW, verify=False, **LLAMA_TP)


def _train(rank, world, ckpt):
    # one model object (the one _prepare planned), its weights restored in place before each layout;
    # verify=False: this test compares every step with one process itself (each layout's verify runs
    # in test_context_parallel.py)
    model, idx, target = _shared_example()
    initial = copy.deepcopy(model.state_dict())
    out = []
    for k, opts in enumerate(CASES):
        model.load_state_dict(initial)
        with shared_traces(_TRACES), shared_plans(_PLANS) as plans:
            pm = fxsplit.parallelize(model, (idx,), loss_fn=_loss_of(opts), hardware=_HW, timeout=60,
                                     verify=False, **opts)
        assert plans.misses == 0, f"rank {rank} planned {opts} itself: the plan made before the fork was not used"
        opt = torch.optim.SGD(pm.parameters(), lr=LR)
        x, y = replica_slice(pm, idx), replica_slice(pm, target)
        losses, grads = [], []
        for _ in range(STEPS):
            opt.zero_grad()
            losses.append(float(pm.step(x, target=y)))
            grads.append(local_grads(pm))
            opt.step()
        if k == SAVED:
            pm.save_checkpoint(ckpt, optimizer=opt)
        ring = sum("ring attention" in a for a in pm.plan.pass_report["context_parallel"].attention)
        out.append(dict(losses=losses, grads=grads, coords=dict(pm.coords), specs=dict(pm.plan.tp_plan.param_specs),
                        ring=ring, **_compiled(pm)))
    out.append(_train_llama())
    out.append(_train_llama_tp())
    out.append(_mp_step(initial))
    out.append(_reload(ckpt, initial))
    assert _PLANS.misses == 0, f"rank {rank} planned {_PLANS.misses} layout(s) itself: a plan made before the fork went unused"
    return out


def _compiled(pm):
    """What compile=True compiled (stage, graph) and what fell back to eager, with why."""
    rt = pm.runtime
    return dict(compiled=sorted((s, kind) for s, split in rt.traced_graphs()
                                for kind, r in split.runners.items() if r.compiled),
                fallbacks={**pm.split_fallbacks, **pm.compile_fallbacks})


RELOAD = dict(tp=2, pp=2, microbatches=2)  # the layout the cp=2 x dp=2 checkpoint is loaded at
MP = dict(cp=2, dp=2)  # the layout of mp_policy


def _reload(ckpt, initial):
    """The cp=2 x dp=2 checkpoint loaded at another layout without cp: its full state dict."""
    model, idx, _ = _shared_example()
    model.load_state_dict(initial)
    with shared_plans(_PLANS):
        pm = fxsplit.parallelize(model, (idx,), loss_fn=zoo.cross_entropy_loss, hardware=_HW, timeout=60, **RELOAD)
    pm.load_checkpoint(ckpt, optimizer=torch.optim.SGD(pm.parameters(), lr=LR))
    return dict(steps=pm.step_count, state=pm.full_state_dict())


def _mp_step(initial):
    """One step under mp_policy at cp=2 x dp=2: the loss and the full gradients (as a state dict)."""
    from test_mixed_precision import POLICY

    model, idx, target = _shared_example()
    model.load_state_dict(initial)
    with shared_plans(_PLANS):
        pm = fxsplit.parallelize(model, (idx,), loss_fn=zoo.cross_entropy_loss, hardware=_HW, timeout=60,
                                 mp_policy=POLICY, **MP)
    loss = float(pm.step(replica_slice(pm, idx), target=replica_slice(pm, target)))
    fp32 = all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in pm.parameters())
    with torch.no_grad():
        for p in pm.parameters():
            p.copy_(p.grad)
    return dict(loss=loss, grads=pm.full_state_dict(), fp32=fp32)


def _llama():
    from fxsplit.testing import hf_zoo

    model, (ids,), kwargs = hf_zoo.make_hf("llama", seq_len=32, batch_size=4)
    labels = torch.randint(2, 256, ids.shape, generator=torch.Generator().manual_seed(5))
    labels[0, :3] = -100  # ignored tokens: the loss is the mean over the counted tokens of every cp rank
    return model, ids, kwargs["attention_mask"], labels


SHORT = 27  # not a multiple of 2 * cp = 4


def _model_loss(output, target):
    return output["loss"]


LLAMA_DP = dict(cp=2, dp=2)
LLAMA_TP = dict(cp=2, tp=2, cp_kv="ring")
_LLAMA: list = []


def _shared_llama():
    """``(model, ids, mask, labels, half, whole)``, built once per process: the Llama both layouts plan
    (neither trains it: one step each, no optimizer), its batch, and the examples they plan for,
    each ``(args, kwargs)``: a data-parallel replica's half of the batch (cp=2 x dp=2) and the whole."""
    if not _LLAMA:
        model, ids, mask, labels = _llama()
        half = ((ids[:2],), {"attention_mask": mask[:2], "labels": labels[:2]})
        _LLAMA.extend((model, ids, mask, labels, half, ((ids,), {"attention_mask": mask, "labels": labels})))
    return _LLAMA


def _train_llama():
    """Llama's own loss (labels= in the graph: shifted before the cut, a global mean), cp=2 x dp=2."""
    model, ids, mask, labels, half, _ = _shared_llama()
    with shared_plans(_PLANS) as plans:
        pm = fxsplit.parallelize(model, *half, loss_fn=_model_loss, hardware=_HW, timeout=120, verify=False,
                                 **LLAMA_DP)
    assert plans.misses == 0, "Llama cp2 x dp2 planned on a rank: the plan made before the fork went unused"
    out = []
    for length in (32, SHORT):  # SHORT: padded to the traced 32 ([Note: padding to the traced length])
        x, m, y = (replica_slice(pm, t[:, :length]) for t in (ids, mask, labels))
        for p in pm.parameters():
            p.grad = None
        loss = float(pm.step(x, attention_mask=m, labels=y, target=y))
        out.append(dict(loss=loss, grads=local_grads(pm)))
    return out


def _train_llama_tp():
    """Llama's own loss at cp=2 x tp=2, K/V by ring: one step on the whole batch."""
    model, ids, mask, labels, _, whole = _shared_llama()
    with shared_plans(_PLANS) as plans:
        pm = fxsplit.parallelize(model, *whole, loss_fn=_model_loss, hardware=_HW, timeout=120, verify=False,
                                 **LLAMA_TP)
    assert plans.misses == 0, "Llama cp2 x tp2 planned on a rank: the plan made before the fork went unused"
    loss = float(pm.step(ids, attention_mask=mask, labels=labels, target=labels))
    return dict(loss=loss, grads=local_grads(pm), tp=pm.coords["tp"], specs=dict(pm.plan.tp_plan.param_specs))


def _check_llama_tp(per_rank):
    """Every rank: the whole batch's loss; the tp shards of each cp rank, put together, the full gradient."""
    model, ids, mask, labels = _llama()
    model = copy.deepcopy(model)
    loss = model(ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    want = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
    specs = per_rank[0]["specs"]
    for rank, res in enumerate(per_rank):
        assert abs(res["loss"] - loss.item()) <= 1e-5 * max(1.0, abs(loss.item())), (rank, res["loss"], loss.item())
    for cp_rank in range(2):  # ranks (cp, tp): cp 0 holds global ranks 0 and 1
        pair = sorted((per_rank[r] for r in (2 * cp_rank, 2 * cp_rank + 1)), key=lambda res: res["tp"])
        assert pair[0]["grads"], cp_rank
        for n in pair[0]["grads"]:
            shards = [res["grads"][n] for res in pair]
            got = specs[n].unshard(shards) if n in specs else shards[0]
            torch.testing.assert_close(got, want[n], rtol=1e-4, atol=1e-6, msg=f"llama cp2xtp2 ring cp {cp_rank} grad {n}")


def _reference(state=None):
    model, idx, target = _example()
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = zoo.cross_entropy_loss(model(idx), target)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)})
        opt.step()
    if state is not None:
        state.update({k: v.detach().clone() for k, v in model.state_dict().items()})
    return losses, grads


@pytest.mark.dist
def test_cp_layouts_train_like_one_process_over_gloo(tmp_path):
    ckpt = str(tmp_path / "cp-ckpt")
    results = run_distributed(_train, 4, ckpt, timeout=900, prepare=(_prepare, ()))
    for k, length in enumerate((32, SHORT)):
        _check_llama([r[len(CASES)][k] for r in results], length)
    _check_llama_tp([r[len(CASES) + 1] for r in results])
    _check_mp([r[len(CASES) + 2] for r in results])
    ref_state: dict = {}
    ref_losses, ref_grads = _reference(ref_state)
    _check_reload([r[len(CASES) + 3] for r in results], fxsplit.load_full_checkpoint(ckpt), ref_state)
    for k, opts in enumerate(CASES):
        per_rank = [r[k] for r in results]
        assert all((res["ring"] > 0) == (k in RING) for res in per_rank), (opts, [res["ring"] for res in per_rank])
        for rank, res in enumerate(per_rank):
            torch.testing.assert_close(res["losses"], ref_losses, rtol=1e-5, atol=1e-6,
                                       msg=f"{opts} rank {rank}: losses")
        cells: dict = {}  # (dp, cp, pp) -> [(tp, rank)]
        for rank, res in enumerate(per_rank):
            c = res["coords"]
            cells.setdefault((c["dp"], c.get("cp", 0), c["pp"]), []).append((c["tp"], rank))
        if opts.get("schedule") == "zb_h1":  # the ring's exchange traced into the graph split, no fallback
            assert all(res["fallbacks"] == {} for res in per_rank), [res["fallbacks"] for res in per_rank]
        if opts.get("compile"):  # every stage graph through inductor, nothing left eager
            for rank, res in enumerate(per_rank):
                assert res["fallbacks"] == {} and {kind for _, kind in res["compiled"]} == {"F", "B"}, (
                    rank, res["fallbacks"], res["compiled"])
        specs = per_rank[0]["specs"]
        for step in range(STEPS):
            seen = set()
            for cell, members in sorted(cells.items()):
                ranks = [r for _, r in sorted(members)]
                for n in per_rank[ranks[0]]["grads"][step]:
                    shards = [per_rank[r]["grads"][step][n] for r in ranks]
                    got = specs[n].unshard(shards) if n in specs else shards[0]
                    torch.testing.assert_close(got, ref_grads[step][n], rtol=1e-4, atol=1e-6,
                                               msg=f"{opts} step {step} {cell} grad {n}")
                    seen.add(n)
            missing = set(ref_grads[step]) - seen
            tied = {"wte.weight", "lm_head.weight"}  # one tensor: an exported graph reads it by one name
            assert missing <= tied and not tied <= missing, (opts, step, sorted(missing))


def _check_llama(per_rank, length):
    """Every rank: the loss of the whole batch (the replicas' mean of their global token means, as the
    model's loss of each replica's slice averaged) and, after the all-reduce over dp x cp, the gradient
    of that loss; at ``length`` tokens, the one-process model run at that length."""
    model, ids, mask, labels = _llama()
    model = copy.deepcopy(model)
    ids, mask, labels = ids[:, :length], mask[:, :length], labels[:, :length]
    halves = [model(ids[i:i + 2], attention_mask=mask[i:i + 2], labels=labels[i:i + 2]).loss for i in (0, 2)]
    loss = (halves[0] + halves[1]) / 2  # dp=2: each replica's mean, averaged
    loss.backward()
    want = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
    for rank, res in enumerate(per_rank):
        assert abs(res["loss"] - loss.item()) <= 1e-5 * max(1.0, abs(loss.item())), (rank, res["loss"], loss.item())
        assert res["grads"], rank
        for n, g in res["grads"].items():
            torch.testing.assert_close(g, want[n], rtol=1e-4, atol=1e-6,
                                       msg=f"llama cp2xdp2 at {length} tokens rank {rank} grad {n}")


def _check_mp(per_rank):
    from test_mixed_precision import GRAD_RTOL, LOSS_RTOL, WHOLE_RTOL, _gap, _whole_gap, mixed_precision_reference

    model, idx, target = _example()
    ref_loss, ref_grads = mixed_precision_reference(model, (idx,), target, zoo.cross_entropy_loss)
    floor = 1e-3 * float(torch.cat([g.flatten() for g in ref_grads.values()]).norm())
    for rank, res in enumerate(per_rank):
        where = f"mp_policy cp2xdp2 rank {rank}"
        assert res["fp32"], f"{where}: optimizer-visible parameters or their grads are not float32"
        assert abs(res["loss"] - ref_loss) <= LOSS_RTOL * abs(ref_loss), (where, res["loss"], ref_loss)
        gaps = {k: _gap(res["grads"][k], g, floor) for k, g in ref_grads.items()}
        worst = max(gaps, key=gaps.get)
        assert gaps[worst] <= GRAD_RTOL, f"{where}: gradient {worst} off by {gaps[worst]:.3g}"
        assert _whole_gap(res["grads"], ref_grads) <= WHOLE_RTOL, where


def _check_reload(per_rank, full, ref_state):
    """The checkpoint of cp=2 x dp=2 after STEPS steps: loaded at tp=2 x pp=2 on every rank, and read whole
    in one process, it is the one-process model after STEPS steps."""
    for where, state in [*((f"tp2xpp2 rank {r}", res["state"]) for r, res in enumerate(per_rank)),
                         ("load_full_checkpoint", full)]:
        assert set(ref_state) <= set(state), (where, sorted(set(ref_state) - set(state)))
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=f"{where}: {k}")
    assert all(res["steps"] == STEPS for res in per_rank), [res["steps"] for res in per_rank]


# cp with the data ranks sharded by FSDP2 (over dp_shard x cp) and with experts placed by ep (carved out of
# dp or dp_shard at every cp rank): label -> (model, options); world size 4 each
SHARDED_CASES = {
    "gpt/cp2-ds2": ("gpt", dict(cp=2, dp_shard=2)),
    "mixtral/cp2-dp2-ep2": ("mixtral", dict(cp=2, dp=2, ep=2)),
    "mixtral/cp2-ds2-ep2": ("mixtral", dict(cp=2, dp_shard=2, ep=2)),
}


def _sharded_example(name):
    if name == "gpt":
        return _example()
    from fxsplit.testing import tp_coverage

    model, _, _ = tp_coverage.build("mixtral")  # 2 layers, 4 experts, top-2, GQA
    g = torch.Generator().manual_seed(6)
    x = torch.randint(0, model.config.vocab_size, (4, 8), generator=g)
    return model, x, torch.randint(0, model.config.vocab_size, (4, 8), generator=g)


def _logits_loss(out, y):
    return zoo.cross_entropy_loss(out.logits if hasattr(out, "logits") else out, y)


def _whole(grad):
    """An FSDP-sharded gradient gathered whole (a collective over its mesh, the same order on every rank)."""
    from torch.distributed.tensor import DTensor

    return grad.full_tensor() if isinstance(grad, DTensor) else grad


_SHARDED: dict = {}  # label -> (model, x, y, example): built once per process


def _sharded_case(label):
    if label not in _SHARDED:
        name, opts = SHARDED_CASES[label]
        model, x, y = _sharded_example(name)
        _SHARDED[label] = model, x, y, x[:x.shape[0] // (opts.get("dp", 1) * opts.get("dp_shard", 1))]
    return _SHARDED[label]


def _prepare_sharded():
    """Every SHARDED_CASES layout planned once per launch, before the ranks fork (as _prepare)."""
    for label, (_, opts) in SHARDED_CASES.items():
        model, _, _, example = _sharded_case(label)
        _PLANS.add(model, (example,), hardware=_HW, verify=False, **opts)


def _train_sharded(rank, world, tmp):
    from fxsplit.testing.data import replica_index

    out = {}
    for label, (name, opts) in SHARDED_CASES.items():
        model, x, y, example = _sharded_case(label)
        with shared_plans(_PLANS) as plans:
            pm = fxsplit.parallelize(model, (example,), loss_fn=_logits_loss, hardware=_HW, timeout=120, verify=False,
                                     **opts)
        assert plans.misses == 0, f"rank {rank} planned {label} itself: the plan made before the fork went unused"
        opt = torch.optim.SGD(pm.parameters(), lr=LR)
        losses, grads, norms = [], [], []
        for _ in range(STEPS):
            opt.zero_grad()
            losses.append(float(pm.step(replica_slice(pm, x), target=replica_slice(pm, y))))
            norms.append(float(pm.clip_grad_norm_(1e9)))  # the whole model's norm (nothing clipped)
            grads.append({n: _whole(p.grad).detach().clone() for m in pm.stage_modules.values()
                          for n, p in m.named_parameters() if p.grad is not None})
            opt.step()
        experts = set(pm.plan.ep_plan.expert_params) if opts.get("ep", 1) > 1 else set()
        out[label] = dict(losses=losses, grads=grads, norms=norms, experts=experts,
                          ep_rank=replica_index(pm)[0] % opts.get("ep", 1), cp=pm.coords["cp"])
        if opts.get("dp_shard", 1) > 1:  # a sharded checkpoint at cp x dp_shard: saved, damaged weights back
            path = f"{tmp}/{label.replace('/', '-')}"
            trained = {k: v.clone() for k, v in pm.full_state_dict().items()}
            pm.save_checkpoint(path)
            pm.load_full_state_dict({k: torch.zeros_like(v) for k, v in trained.items()})
            pm.load_checkpoint(path)
            back = pm.full_state_dict()
            out[label].update(path=path, restored=all(torch.equal(back[k], v) for k, v in trained.items()))
    return out


def _sharded_reference(name):
    model, x, y = _sharded_example(name)
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads, norms = [], [], []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = _logits_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)})
        norms.append(float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm()))  # tied: once
        opt.step()
    return losses, grads, norms, model.state_dict()


@pytest.mark.dist
@pytest.mark.hf
def test_cp_with_fsdp_and_experts_trains_like_one_process_over_gloo(tmp_path):
    """cp=2 x dp_shard=2 (FSDP2 over dp_shard x cp), cp=2 x dp=2 x ep=2 and cp=2 x dp_shard=2 x ep=2 on
    Mixtral: every step's loss, whole-model gradient norm and every gradient (FSDP shards gathered, each
    rank's block of experts) against one process on the whole batch, on every rank, ONE launch of 4.
    At cp x dp_shard the trained model's sharded checkpoint is saved, loaded back over zeroed weights,
    and loaded whole in this process against the one-process model."""
    results = run_distributed(_train_sharded, 4, str(tmp_path), timeout=900, prepare=(_prepare_sharded, ()))
    for label, (name, opts) in SHARDED_CASES.items():
        ref_losses, ref_grads, ref_norms, ref_state = _sharded_reference(name)
        if opts.get("dp_shard", 1) > 1:  # the checkpoint: restored on every rank, and whole in this process (cp = 1)
            assert all(r[label]["restored"] for r in results), label
            whole = fxsplit.load_full_checkpoint(results[0][label]["path"])
            assert set(whole) == set(ref_state), (label, sorted(set(whole) ^ set(ref_state)))
            for k, v in ref_state.items():
                torch.testing.assert_close(whole[k], v, rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{label} checkpoint {k}: {m}")
        ep = opts.get("ep", 1)
        assert {r[label]["cp"] for r in results} == {0, 1}, label
        for rank, res in enumerate(r[label] for r in results):
            tag = f"{label} rank {rank}"
            assert bool(res["experts"]) == (ep > 1), f"{tag}: experts placed {sorted(res['experts'])}"
            torch.testing.assert_close(res["losses"], ref_losses, rtol=1e-5, atol=1e-6, msg=f"{tag}: losses")
            assert res["norms"] == pytest.approx(ref_norms, rel=1e-4), f"{tag}: whole-model gradient norms"
            for step in range(STEPS):
                seen = set()
                for n, g in res["grads"][step].items():
                    want = ref_grads[step][n]
                    if n in res["experts"]:  # this rank's block of experts
                        k = want.shape[0] // ep
                        want = want[res["ep_rank"] * k:(res["ep_rank"] + 1) * k]
                    torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6, msg=f"{tag} step {step} grad {n}")
                    seen.add(n)
                missing = set(ref_grads[step]) - seen
                assert missing <= {"wte.weight", "lm_head.weight"}, (tag, step, sorted(missing))
