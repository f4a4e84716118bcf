"""Activation checkpointing over gloo (issue 11): tp=2 x pp=2 and dp=2 x pp=2 train to the same
losses, gradients and weights as one process; with dropout on, checkpointed runs are bit-identical
to the same layout without checkpointing (recomputation replays every mask, on the stage and tp
streams)."""

import pytest
import torch

import fxsplit
from fxsplit.testing import run_distributed, zoo
from test_parallelize import _all_prepared, _check, _prepare, _reference, _train

pytestmark = pytest.mark.dist

GPT = dict(n_layer=4, batch_size=4, seq_len=8)
DROPOUT = dict(GPT, dropout=0.2, attn_dropout=0.2)


def _recording(fn):
    """Run ``fn()`` with fxsplit.parallelize recording each model's stage code (what _train builds)."""
    codes = []
    inner = fxsplit.parallelize

    def recording(*args, **kwargs):
        pm = inner(*args, **kwargs)
        codes.append("".join(m.code for m in pm.stage_modules.values()))
        return pm

    fxsplit.parallelize = recording
    try:
        return fn(), codes
    finally:
        fxsplit.parallelize = inner


def _has(codes, mode):
    return [f"checkpointed(ckpt_blocks_" in c and f"'{mode}'" in c for c in codes]


def _runs_of(layout, mode):
    """label -> (overrides, options) of each run, in order; a launch plans them all before its ranks
    fork (``_prepare`` of tests/test_parallelize.py)."""
    return {"ref": (GPT, dict(layout, activation_checkpointing=mode, seed=7)),
            "plain": (DROPOUT, dict(layout, activation_checkpointing="none", seed=7)),
            "ckpt": (DROPOUT, dict(layout, activation_checkpointing=mode, seed=7))}


def _runs(rank, world, layout, mode):
    out, codes = _recording(lambda: {label: _train(rank, world, "gpt", overrides, dict(options))
                                     for label, (overrides, options) in _runs_of(layout, mode).items()})
    out["checkpointed"] = _has(codes, mode)
    return _all_prepared(rank, out)


@pytest.mark.parametrize("layout, mode", [(dict(tp=2, pp=2), "selective"), (dict(dp=2, pp=2, microbatches=2), "full")])
def test_checkpointed_training_matches(layout, mode):
    results = run_distributed(_runs, 4, layout, mode, timeout=600, prepare=(_prepare, (
        [(zoo.make, "gpt", overrides, options) for overrides, options in _runs_of(layout, mode).values()],)))
    assert all(r["checkpointed"] == [True, False, True] for r in results), [r["checkpointed"] for r in results]
    _check([r["ref"] for r in results], *_reference("gpt", GPT))
    # the recompute changes stage times, so the two plans may cut the stages elsewhere: every
    # rank compares the gradients both of its runs hold, and the whole trained model
    for rank, r in enumerate(results):
        plain, ckpt = r["plain"], r["ckpt"]
        assert plain["losses"] == ckpt["losses"], f"rank {rank}"
        for step, (a, b) in enumerate(zip(plain["grads"], ckpt["grads"])):
            assert set(a) & set(b), f"rank {rank} step {step}: no gradient in common"
            for n in set(a) & set(b):
                assert torch.equal(a[n], b[n]), f"rank {rank} step {step} {n}"
        assert set(plain["state"]) == set(ckpt["state"])
        for k, v in plain["state"].items():
            assert torch.equal(v, ckpt["state"][k]), f"rank {rank} {k}"


ZB_MODES = {m: dict(pp=2, schedule="zb_h1", activation_checkpointing=m.split("-")[0], **extra)
            for m, extra in {"none": {}, "full": {}, "selective": {}, "full-autograd": dict(split_backward="autograd")}.items()}


def _zb(rank, world):
    # ZB-H1 splits the backward into I and W graphs: each region is recomputed once, in the
    # backward traced as one ([Note: graph split backward]); the autograd split recomputes it
    # in I and again in W, and cannot run selective checkpointing at all
    out, codes = _recording(lambda: {m: _train(rank, world, "gpt", GPT, dict(options)) for m, options in ZB_MODES.items()})
    out["checkpointed"] = [_has([c], m.split("-")[0])[0] for c, m in zip(codes, ZB_MODES)]
    return _all_prepared(rank, out)


def test_checkpointing_with_split_backward():
    results = run_distributed(_zb, 2, timeout=600,
                              prepare=(_prepare, ([(zoo.make, "gpt", GPT, options) for options in ZB_MODES.values()],)))
    assert all(r["checkpointed"] == [False, True, True, True] for r in results), [r["checkpointed"] for r in results]
    ref = _reference("gpt", GPT)
    for mode in ("none", "full", "selective", "full-autograd"):
        _check([r[mode] for r in results], *ref)
