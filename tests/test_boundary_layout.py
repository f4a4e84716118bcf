"""Values crossing a pipeline stage boundary keep the layout the next stage's code needs
([Note: boundary layouts] in fxsplit.pipeline.layout): the plan records each boundary value's dim
order, the runtime sends the dense permuted form and restores the strides, and ``fxsplit.verify``
hands values over exactly as the transfer does (so it fails where the runtime computes something
else, and passes where the runtime runs)."""

from __future__ import annotations

import pytest
import sympy
import torch
from torch import nn

import fxsplit
from fxsplit.errors import VerificationError
from fxsplit.pipeline.layout import dim_order_of, from_wire, hand_over, to_wire, wire_shape
from fxsplit.testing import run_distributed, zoo


def test_dim_order_of_dense_permutations_only():
    a = torch.randn(2, 3, 4, 5)
    assert dim_order_of(a) is None  # row-major
    assert dim_order_of(a.transpose(1, 2)) == (0, 2, 1, 3)
    assert dim_order_of(a.permute(3, 0, 1, 2)) == (1, 2, 3, 0)
    assert dim_order_of(a[:, :, ::2]) is None  # not dense: crosses contiguous
    assert dim_order_of(torch.randn(3, 1).expand(3, 4)) is None  # overlapping
    assert dim_order_of(torch.randn(1, 4, 3).transpose(1, 2)) == (0, 2, 1)  # size-1 dims do not decide
    assert dim_order_of(torch.randn(4, 1, 3)[:, :, :].transpose(0, 1)) is None  # only a unit dim moved


def test_dim_order_of_symbolic_strides():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv, DimDynamic
    from torch._dynamo.source import ConstantSource

    mode = FakeTensorMode(shape_env=ShapeEnv())
    env = mode.shape_env
    b = env.create_symintnode(env.create_symbol(4, ConstantSource("b"), dynamic_dim=DimDynamic.DYNAMIC), hint=4)
    t = env.create_symintnode(env.create_symbol(6, ConstantSource("t"), dynamic_dim=DimDynamic.DYNAMIC), hint=6)
    with mode:
        x = torch.empty(b, 2, t, 8)  # (B, nh, T, hs)
        assert dim_order_of(x.transpose(1, 2)) == (0, 2, 1, 3)
        assert dim_order_of(x) is None


def test_hand_over_restores_strides_without_a_copy():
    y = torch.randn(2, 3, 4, 5).transpose(1, 2)
    order = dim_order_of(y)
    wire = to_wire(y, order)
    assert wire.is_contiguous() and wire.data_ptr() == y.data_ptr()  # no copy: already dense
    assert tuple(wire.shape) == wire_shape(tuple(y.shape), order)
    back = from_wire(wire.clone(), order)  # as a receive buffer
    assert back.stride() == y.stride() and torch.equal(back, y)
    sliced = torch.randn(4, 6)[:, ::2]
    got = hand_over(sliced, dim_order_of(sliced))
    assert got.is_contiguous() and torch.equal(got, sliced)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_plan_records_the_layout_and_verify_passes(method):
    model, args, _ = zoo.make("layout")
    plan = fxsplit.plan(model, args, pp=2, schedule="1f1b", split_points=("mix",), method=method)
    (meta,) = [m for m in plan.stages.io[1].input_meta if m.name in {v.name for v in plan.stages.io[0].outputs}]
    assert meta.dim_order == (0, 2, 1, 3), plan.stages
    assert "{order 0,2,1,3}" in str(plan.stages)
    fxsplit.verify(model, args, plan)
    out = plan.stages.run_sequential(*args)  # the in-process reference executor hands over alike
    torch.testing.assert_close(out[0], model(*args))


class StrideReader(nn.Module):
    """A boundary value that is a strided slice (not dense: it crosses contiguous), read in the
    next stage through its stride: the split model computes something else than the unsplit one,
    and verify must say so, as the runtime's transfer would make it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        y = self.a(x)[:, ::2]  # (B, 8), stride 2 in dim 1
        fxsplit.pipe_split()
        return self.b(y * y.stride(1))


def test_verify_models_the_transfer():
    torch.manual_seed(0)
    model, x = StrideReader(), torch.randn(4, 8)
    plan = fxsplit.plan(model, (x,), pp=2, schedule="1f1b", method="fx")
    assert plan.stages.num_stages == 2
    with pytest.raises(VerificationError, match="diverges"):
        fxsplit.verify(model, (x,), plan)


def _run_layout(rank, world, method):
    torch.manual_seed(0)
    model, args, _ = zoo.make("layout")
    ref, _, _ = zoo.make("layout")
    (x,) = args
    y = zoo.make_target("layout", ref(x))
    pm = fxsplit.parallelize(model, args, pp=2, schedule="1f1b", microbatches=2, split_points=("mix",),
                             method=method, loss_fn=zoo.mse_loss, verify=False, timeout=60)
    loss = pm.step(x, target=y)
    ref_loss = zoo.mse_loss(ref(x), y)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    bad = [] if torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6) else [f"loss {float(loss)} != {float(ref_loss)}"]
    names = set()
    for mod in pm.stage_modules.values():
        for name, p in mod.named_parameters():
            names.add(name)
            if p.grad is None or not torch.allclose(p.grad, ref_grads[name], rtol=1e-5, atol=1e-6):
                bad.append(f"rank {rank} {method}: gradient of {name}")
    return bad, names


@pytest.mark.dist
def test_runtime_pp2_equals_unsplit_layout_model():
    for method in ("fx", "export"):
        results = run_distributed(_run_layout, 2, method, timeout=180)
        assert not [b for bad, _ in results for b in bad], results
        held = set().union(*(names for _, names in results))
        assert held == {n for n, _ in zoo.make("layout")[0].named_parameters()}, held
