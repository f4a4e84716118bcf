"""Every buffer and graph constant of every stage module, on every tp and pp rank, keeps the
original model's value ([Note: every buffer keeps its value] in fxsplit.tp.sharding): constants
torch.export lifts (``lifted_tensor_*``), fx's ``_tensor_constant*``, plain tensor attributes,
non-persistent buffers (rotary ``inv_freq``); a meta model whose constant has no real value raises.
Plus a gloo run of a model with lifted constants: losses and gradients equal one process."""

import pytest
import torch
from torch import nn

import fxsplit
from fxsplit.api.materialize import materialize_stage
from fxsplit.errors import ShardingError
from fxsplit.graph.ops import resolve_path
from fxsplit.testing import hf_zoo, run_distributed, zoo


class LiftedConstants(nn.Module):
    """A forward that creates tensor constants (export lifts them), a plain tensor attribute
    (not a buffer), a non-persistent buffer and a persistent one, around a column/row MLP."""

    def __init__(self, d=8, h=16):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)
        self.head = nn.Linear(d, d)
        self.register_buffer("inv_freq", 1.0 / (10000.0 ** (torch.arange(d).float() / d)), persistent=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))
        self.plain = torch.linspace(2.0, 3.0, d)  # a plain attribute: no buffer, in no state dict

    def forward(self, x):
        c = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])  # lifted by torch.export
        h = x * c * self.inv_freq
        h = h + self.down(torch.relu(self.up(h))) * self.scale
        return self.head(h * self.plain)


class Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.register_buffer("inv_freq", torch.arange(8.0) + 1, persistent=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return self.down(torch.relu(self.up(x * self.inv_freq))) * self.scale


def _example(seed=0):
    torch.manual_seed(seed)
    return LiftedConstants(), (torch.randn(4, 8),), {}


def _originals(model, the_plan):
    """Name -> the value the model computes with: its own tensors, and the trace's constants as
    recorded from the model itself (for export, ep.constants holds the real lifted values)."""
    out = {n: t.detach() for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]}
    out.setdefault("plain", getattr(model, "plain", None))
    return {k: v for k, v in out.items() if v is not None}


def _check_every_stage(model, args, kwargs, *, tp, pp, method="auto", expect_constants=()):
    the_plan = fxsplit.plan(model, args, kwargs, tp=tp, pp=pp, method=method,
                            hardware=fxsplit.Hardware(link_bytes_per_s=float("inf")))
    originals = _originals(model, the_plan)
    specs = the_plan.tp_plan.param_specs
    seen = set()
    for s in range(the_plan.config.num_stages):
        plan_mod = the_plan.stages.modules[s]
        for r in range(tp):
            local = materialize_stage(the_plan, s, tp_rank=r, source=model)
            for name, value in [*local.named_buffers(), *local.named_parameters()]:
                assert not value.is_meta, name
                if isinstance(value, nn.Parameter):
                    expect = originals[name]
                else:  # a buffer or a constant of the trace: the model's, else the plan's real one
                    expect = originals.get(name, resolve_path(plan_mod, name).detach())
                    assert not expect.is_meta, name
                    seen.add(name)
                if name in specs:
                    expect = specs[name].shard(expect, r)
                assert torch.equal(value, expect), f"stage {s} tp rank {r}: {name} lost its value"
    for name in expect_constants:
        assert any(name in n for n in seen), (name, sorted(seen))
    return seen


@pytest.mark.parametrize("method", ["fx", "export"])
def test_lifted_constants_keep_their_values(method):
    model, args, kwargs = _example()
    seen = _check_every_stage(model, args, kwargs, tp=2, pp=2, method=method,
                              expect_constants=("inv_freq", "scale", "plain"))
    constants = [n for n in seen if n.startswith(("lifted_tensor", "_tensor_constant"))]
    assert constants, f"the trace created no constant: {sorted(seen)}"


def test_lifted_constant_values_are_not_zero_after_materialization():
    """The bug this guards: lifted_tensor_0 came out as zeros on every rank."""
    model, args, kwargs = _example()
    the_plan = fxsplit.plan(model, args, kwargs, tp=2, pp=1, method="export")
    local = materialize_stage(the_plan, 0, tp_rank=1, source=model)
    lifted = {n: b for n, b in local.named_buffers() if n.startswith("lifted_tensor")}
    assert lifted and all(torch.equal(b, torch.arange(1.0, 9.0)) for b in lifted.values()), lifted
    assert torch.equal(local.plain, model.plain)


@pytest.mark.parametrize("name", zoo.ZOO_NAMES)
def test_zoo_buffers_on_every_rank(name):
    model, args, kwargs = zoo.make(name)
    tp = 1 if name in ("cnn", "unet") else 2
    _check_every_stage(model, args, kwargs, tp=tp, pp=2)


@pytest.mark.hf
@pytest.mark.parametrize("name", ["llama", "bert"])
def test_hf_buffers_on_every_rank(name):
    pytest.importorskip("transformers")
    model, args, kwargs = hf_zoo.make_hf(name)
    seen = _check_every_stage(model, args, kwargs, tp=2, pp=2)
    assert seen, "HF models hold buffers (rotary inv_freq, position ids)"


def test_meta_model_buffer_without_a_value_raises():
    """On the meta device a buffer has no value anywhere: materialization says so, never zeros."""
    with torch.device("meta"):
        model = Rotary()
    the_plan = fxsplit.plan(model, (torch.empty(4, 8, device="meta"),), tp=2, method="fx")
    with pytest.raises(ShardingError, match=r"no source holds a real value.*init_empty_weights"):
        materialize_stage(the_plan, 0, tp_rank=0, source=model)


# ------------------------------------------------------------------------------------------------
# numerics over gloo: tp=2 x pp=2 on a model with lifted constants

STEPS, LR = 3, 0.05


def _batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(STEPS)]


def _mse(out, y):
    return torch.nn.functional.mse_loss(out, y)


def _train(rank, world, method):
    model, args, kwargs = _example()
    pm = fxsplit.parallelize(model, args, kwargs, loss_fn=_mse, tp=2, pp=2, method=method, timeout=60,
                             verify=None if rank == 0 else False,
                             microbatches=2, schedule="1f1b",
                             hardware=fxsplit.Hardware(link_bytes_per_s=float("inf")))
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    losses = []
    for x, y in _batches():
        losses.append(pm.step(x, target=y))
        opt.step()
        opt.zero_grad()
    return {"losses": [None if l is None else float(l) for l in losses], "state": pm.full_state_dict()}


@pytest.mark.dist
@pytest.mark.parametrize("method", ["export"])
def test_lifted_constants_train_like_one_process(method):
    model, _, _ = _example()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref = []
    for x, y in _batches():
        loss = _mse(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref.append(loss.item())
    results = run_distributed(_train, 4, method, timeout=240)
    got = [r["losses"] for r in results if r["losses"][0] is not None]
    assert got, "no rank reported the loss"
    for losses in got:
        assert losses == pytest.approx(ref, rel=1e-5), (losses, ref)
    state = results[0]["state"]
    for name, value in model.state_dict().items():
        assert torch.allclose(state[name], value, rtol=1e-5, atol=1e-6), name
