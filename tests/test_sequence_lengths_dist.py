"""Changing sequence lengths across steps, and packed documents, end to end on gloo (4 ranks, one
launch): a plan traced by torch.export at one length trains at every shorter one on a transformers
Llama (tp2 x pp2 1F1B, dp2 x pp2 interleaved 1F1B, tp2 x pp2 ZB-V) and the zoo GPT (dp2 x pp2 ZB-H1,
cp2 x pp2 1F1B), and rows packed with several documents (position ids restarting per document) at
tp2 x pp2; the loss and every gradient of each of three SGD steps equal the unsplit model's in one
process, each data-parallel replica fed its own slice of the global batch. Without cp the plans
follow each step's length ([Note: following the sequence from two static traces] in
fxsplit.graph.sequence): every rank sends its pipeline peers fewer bytes at a shorter step, in
proportion to the length; with cp the plan pads to the traced length ([Note: padding to the traced
length] in fxsplit.api.padding), and sends the same bytes at every step."""

import copy

import pytest
import torch

import fxsplit
from fxsplit.testing import hf_zoo, run_distributed, zoo
from fxsplit.testing.data import local_grads, replica_slice
from fxsplit.testing.trace_cache import SharedPlans, SharedTraces, shared_plans, shared_traces

TRACED = 16
LENGTHS = (16, 9, 13)  # one per step: the traced length, then shorter ones
BATCH = 8
PACKED = ((0, 5), (5, 12), (12, 16))  # documents of one row at the traced length
INF_LINK = fxsplit.Hardware(link_bytes_per_s=float("inf"))

CASES = {
    "llama-tp2-pp2-1f1b": ("llama", dict(tp=2, pp=2, schedule="1f1b", microbatches=2)),
    "llama-dp2-pp2-interleaved": ("llama", dict(dp=2, pp=2, schedule="interleaved_1f1b", microbatches=2)),
    "llama-tp2-pp2-zbv": ("llama", dict(tp=2, pp=2, schedule="zbv", microbatches=2)),
    "gpt-dp2-pp2-zbh1": ("gpt", dict(dp=2, pp=2, schedule="zb_h1", microbatches=2)),
    "llama-packed-tp2-pp2": ("packed", dict(tp=2, pp=2, schedule="1f1b", microbatches=2)),
    "gpt-cp2-pp2-1f1b-padded": ("gpt", dict(cp=2, pp=2, schedule="1f1b", microbatches=2)),
}


def _model(kind):
    if kind == "gpt":
        model, args, _ = zoo.make("gpt", batch_size=BATCH, seq_len=TRACED, block_size=TRACED)
        return model, args, {}
    model, args, kwargs = hf_zoo.make_hf("llama", batch_size=BATCH, seq_len=TRACED)
    if kind == "packed":  # no attention mask: transformers builds the per-document mask from position_ids
        return model, args, {"position_ids": _positions(TRACED, packed=True)}
    return model, args, kwargs


def _positions(length, packed):
    if not packed:
        return torch.arange(length).expand(BATCH, -1).clone()
    pos = torch.cat([torch.arange(b - a) for a, b in PACKED])
    return pos[:length].expand(BATCH, -1).clone()


def _loss(kind):
    if kind == "gpt":
        return zoo.cross_entropy_loss
    return lambda out, y: zoo.cross_entropy_loss(out.logits, y)


def _batch(kind, step, vocab):
    """Step ``step``'s global batch: (inputs kwargs, target), at LENGTHS[step] positions."""
    g = torch.Generator().manual_seed(10 + step)
    t = LENGTHS[step]
    ids = torch.randint(0, vocab, (BATCH, t), generator=g)
    y = torch.randint(0, vocab, (BATCH, t), generator=g)
    if kind == "gpt":
        return ids, {}, y
    if kind == "packed":
        return ids, {"position_ids": _positions(t, packed=True)}, y
    mask = torch.ones(BATCH, t, dtype=torch.long)
    mask[1, t - 3:] = 0  # a row that ends in padding of its own
    return ids, {"attention_mask": mask}, y


def _grads(named):
    return {n: p.grad.detach().clone() for n, p in named if p.grad is not None}


def _reference(kind):
    torch.manual_seed(0)
    model, args, _ = _model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    vocab = int(model.config.vocab_size) if kind != "gpt" else model.config.vocab_size
    out = []
    for step in range(len(LENGTHS)):
        ids, kwargs, y = _batch(kind, step, vocab)
        loss = _loss(kind)(model(ids, **kwargs), y)
        opt.zero_grad()
        loss.backward()
        out.append((loss.item(), _grads(model.named_parameters(remove_duplicate=False))))
        opt.step()
    return out


_TRACES = SharedTraces()


_BUILT: dict = {}  # kind -> (model, args, kwargs, initial weights), one per rank process


def _fresh(kind):
    """``kind``'s model at its initial weights: one model object (and example inputs) per kind,
    its weights restored in place, so that the layouts of a kind plan from one shared trace."""
    if kind not in _BUILT:
        torch.manual_seed(0)
        model, args, kwargs = _model(kind)
        _BUILT[kind] = (model, args, kwargs, copy.deepcopy(model.state_dict()))
    model, args, kwargs, initial = _BUILT[kind]
    model.load_state_dict(initial)
    return model, args, kwargs


def _planned_as(options):
    """The planning options of a case besides its layout (what :func:`_train` gives parallelize)."""
    return dict(method="export", verify=False, hardware=INF_LINK, follow_sequence=options.get("cp", 1) == 1, **options)


_PLANS = SharedPlans()


def _prepare():
    """Once per launch, before the ranks fork ([Note: preparing once per launch] in fxsplit.testing.harness):
    every case planned; each rank takes its copy instead of planning it ([Note: plans made before the fork])."""
    with shared_traces(_TRACES):
        for kind, options in CASES.values():
            model, args, kwargs = _fresh(kind)
            _PLANS.add(model, args, kwargs, **_planned_as(options))


def _train(kind, options):
    model, args, kwargs = _fresh(kind)
    vocab = int(model.config.vocab_size) if kind != "gpt" else model.config.vocab_size
    with shared_traces(_TRACES), shared_plans(_PLANS):
        pm = fxsplit.parallelize(model, args, kwargs, loss_fn=_loss(kind), timeout=120, **_planned_as(options))
    info = pm.plan.graph.meta["fxsplit"]
    assert info.method == "export" and info.traced_length == TRACED
    assert info.follows_sequence == (options.get("cp", 1) == 1), info.reason
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    steps, sent = [], []
    for step in range(len(LENGTHS)):
        ids, kw, y = _batch(kind, step, vocab)
        loss = pm.step(replica_slice(pm, ids), target=replica_slice(pm, y),
                       **{k: replica_slice(pm, v) for k, v in kw.items()})
        grads = local_grads(pm)
        steps.append((float(loss), grads))
        sent.append(pm.last_sent_bytes)
        opt.step()
        opt.zero_grad()
    ids, kw, _ = _batch(kind, 1, vocab)  # inference at a shorter length: the outputs cut back
    out = pm(replica_slice(pm, ids), **{k: replica_slice(pm, v) for k, v in kw.items()})
    logits = out if kind == "gpt" else out.logits
    return dict(steps=steps, specs=dict(pm.plan.tp_plan.param_specs), coords=dict(pm.coords),
                inference_shape=tuple(logits.shape), sent=sent)


def _cases(rank, world):
    out = {label: _train(kind, options) for label, (kind, options) in CASES.items()}
    assert _PLANS.misses == 0, f"rank {rank} planned {_PLANS.misses} case(s) itself: a plan made before the fork went unused"
    return out


@pytest.mark.dist
def test_changing_lengths_and_packed_rows_match_one_process():
    from test_parallelize import check_grads

    results = run_distributed(_cases, 4, timeout=600, prepare=(_prepare, ()))
    refs = {kind: _reference(kind) for kind in {k for k, _ in CASES.values()}}
    for label, (kind, _) in CASES.items():
        res = [r[label] for r in results]
        ref_losses = [loss for loss, _ in refs[kind]]
        for rank, r in enumerate(res):
            assert [loss for loss, _ in r["steps"]] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), (label, rank)
            assert r["inference_shape"][1] == LENGTHS[1], (label, rank, r["inference_shape"])
            sent = r["sent"]  # bytes this rank sent its pipeline peers at each step
            assert sent[0] > 0, (label, rank, sent)
            if label.endswith("padded"):
                assert sent == [sent[0]] * len(LENGTHS), (label, rank, sent)
            else:  # every boundary value has the step's length in its shape: bytes in proportion to it
                assert [b * TRACED for b in sent] == [sent[0] * t for t in LENGTHS], (label, rank, sent)
        tied = [{"wte.weight", "lm_head.weight"}] if kind == "gpt" else ()  # the export graph keeps one name
        check_grads([dict(r, grads=[g for _, g in r["steps"]]) for r in res], [g for _, g in refs[kind]], tied=tied)
