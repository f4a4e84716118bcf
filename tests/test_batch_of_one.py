"""An example input of ONE sample does not fix the batch size ([Note: batch of one] in
fxsplit.graph.examples): the traced graph keeps a batch symbol, so one plan runs batches of any size
>= microbatches, split unevenly."""

import pytest
import sympy
import torch

import fxsplit
from fxsplit.graph.shapes import batch_dims
from fxsplit.testing import run_distributed, zoo


def _placeholder_batch_dims(gm):
    return [batch_dims(n.meta["val"])[0] for n in gm.graph.nodes
            if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() >= 1]


def _assert_symbolic_batch(p):
    info = p.graph.meta["fxsplit"]
    assert "batch" in info.symbols, info
    # fx widens the one sample to two; export traces at a marker batch ([Note: a marker batch])
    assert ("traced as 2" if info.method == "fx" else "marker batch") in info.reason, info.reason
    for d in _placeholder_batch_dims(p.graph):
        assert isinstance(d, sympy.Symbol), d
    # the stage inputs are expressions in the batch symbol, not the constant 1
    batch = info.symbols["batch"]
    first = p.stages.input_meta[0]
    assert first.shape[0] == batch, first


@pytest.mark.parametrize("method", ["fx", "export"])
def test_plan_of_one_sample_has_symbolic_batch_zoo_gpt(method):
    model, args, kwargs = zoo.make("gpt", batch_size=1)
    p = fxsplit.plan(model, args, kwargs, pp=2, microbatches=2, method=method)
    assert p.graph.meta["fxsplit"].method == method
    _assert_symbolic_batch(p)


@pytest.mark.hf
def test_plan_of_one_sample_has_symbolic_batch_hf_llama():
    from fxsplit.testing import hf_zoo

    model, args, kwargs = hf_zoo.tiny_llama(batch_size=1)
    assert args[0].shape[0] == 1 and kwargs["attention_mask"].shape[0] == 1
    p = fxsplit.plan(model, args, kwargs, pp=2, microbatches=2, method="export")
    _assert_symbolic_batch(p)
    assert len(_placeholder_batch_dims(p.graph)) == 2  # ids and mask: both symbolic (checked above)


def test_batch_of_two_is_traced_as_given():
    model, args, kwargs = zoo.make("gpt", batch_size=2)
    info = fxsplit.trace(model, args, kwargs, method="fx").meta["fxsplit"]
    assert "batch" in info.symbols and "traced as 2" not in info.reason


def _batches(rank, world):
    torch.manual_seed(0)
    out = {}
    model, args, _ = zoo.make("gpt", batch_size=1)
    loss_fn = zoo.loss_fn("gpt")
    for batch, m in ((8, 6), (7, 2)):
        pm = fxsplit.parallelize(model, args, loss_fn=loss_fn, pp=2, microbatches=m, timeout=60,
                                 verify=None if rank == 0 else False,
                                 hardware=fxsplit.Hardware(link_bytes_per_s=float("inf")))
        x, y = _data(model, batch)
        loss = pm.step(x, target=y)
        grads = {name: p.grad.clone() for mod in pm.stage_modules.values()
                 for name, p in mod.named_parameters() if p.grad is not None}
        out[(batch, m)] = (float(loss), grads)
    return out


def _data(model, batch):
    g = torch.Generator().manual_seed(batch)
    V = model.config.vocab_size
    return torch.randint(0, V, (batch, 16), generator=g), torch.randint(0, V, (batch, 16), generator=g)


@pytest.mark.dist
def test_example_of_one_sample_trains_other_batch_sizes():
    results = run_distributed(_batches, 2, timeout=240)
    for batch, m in ((8, 6), (7, 2)):
        model, _, _ = zoo.make("gpt", batch_size=1)
        x, y = _data(model, batch)
        loss = zoo.loss_fn("gpt")(model(x), y)
        loss.backward()
        ref = dict(model.named_parameters(remove_duplicate=False))
        seen = set()
        for rank, r in enumerate(results):
            got_loss, grads = r[(batch, m)]
            assert got_loss == pytest.approx(loss.item(), rel=1e-5), (batch, m, rank)
            for name, g in grads.items():
                torch.testing.assert_close(g, ref[name].grad, rtol=1e-5, atol=1e-6,
                                           msg=f"batch {batch} m={m} rank {rank} {name}")
            seen |= set(grads)
        assert seen == {n for n, p in ref.items() if p.grad is not None}
