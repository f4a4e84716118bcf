"""Zero-bubble schedules end to end on gloo (ZB-V, zb_auto): the loss and every gradient after
each of a few AdamW steps equal the unsplit model's in one process, with a tied-weight GPT."""

import pytest
import torch

import fxsplit
from fxsplit.testing import run_distributed, zoo

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


def _train(overrides, options):
    torch.manual_seed(0)
    model, args, kwargs = zoo.make("gpt", **overrides)
    ref, _, _ = zoo.make("gpt", **overrides)  # targets from the reference's outputs, as in _reference
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    pm = fxsplit.parallelize(model, args, kwargs, loss_fn=zoo.cross_entropy_loss, timeout=60,
                             hardware=INF_LINK, **options)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    steps = []
    for i in range(STEPS):
        x = _batch(args, i)
        y = zoo.make_target("gpt", ref(x), seed=i)
        loss = pm.step(x, target=y)
        grads = {}
        for mod in pm.stage_modules.values():
            for n, p in mod.named_parameters(remove_duplicate=False):
                if p.grad is not None:
                    grads.setdefault(n, p.grad.detach().clone())
        steps.append((float(loss), grads))
        opt.step()
        opt.zero_grad()
        rl = zoo.cross_entropy_loss(ref(x), y)
        ref_opt.zero_grad()
        rl.backward()
        ref_opt.step()
    return dict(steps=steps, stages=sorted(int(s) for s in pm.stage_modules), stage_ranks=pm.plan.stage_ranks)


def _check(results, want):
    for step, (ref_loss, ref_grads) in enumerate(want):
        seen = set()
        for rank, res in enumerate(results):
            loss, grads = res["steps"][step]
            assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6), f"step {step} rank {rank}"
            for n, g in grads.items():
                torch.testing.assert_close(g, ref_grads[n], rtol=1e-5, atol=1e-6, msg=f"step {step} rank {rank} {n}")
            seen |= set(grads)
        assert seen == set(ref_grads), f"step {step}: no gradient for {sorted(set(ref_grads) - seen)}"


CASES = {
    2: [("zbv", {"batch_size": 4}, dict(pp=2, schedule="zbv", microbatches=4)),
        ("zb_auto", {"batch_size": 4}, dict(pp=2, schedule="zb_auto", microbatches=4))],
    4: [("zbv", {"batch_size": 8, "n_layer": 4}, dict(pp=4, schedule="zbv", microbatches=8))],
}


def _cases(rank, world):
    return {label: _train(overrides, options) for label, overrides, options in CASES[world]}


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_zero_bubble_schedules_match_single_process(world):
    results = run_distributed(_cases, world, timeout=400)
    for label, overrides, options in CASES[world]:
        res = [r[label] for r in results]
        if options["schedule"] == "zbv":  # the V: rank r holds stages r and 2p-1-r; the loss on rank 0
            p = options["pp"]
            assert [r["stages"] for r in res] == [[q, 2 * p - 1 - q] for q in range(p)]
        _check(res, _reference(overrides))
