"""Checkpoints: save at (tp=2, pp=2), reload at (pp=4) and in one process, continue: same losses as an
uninterrupted run; full_state_dict equals the single-process model's state dict; load_full_checkpoint
(whole, with the optimizer state, or names=) equals the single process in names, shapes and values."""

import pytest
import torch

import fxsplit
from fxsplit.testing import zoo
from fxsplit.testing import run_distributed
from fxsplit.testing.trace_cache import SharedPlans, shared_plans

LR = 0.05
NAME, OVERRIDES = "gpt", {"batch_size": 4}
HW = fxsplit.Hardware(link_bytes_per_s=float("inf"))


def _optimizer(params):
    # Adam: its per-parameter state (step, exp_avg, exp_avg_sq) must survive the change of layout.
    # eps=1e-3: the key bias gets no gradient mathematically (softmax ignores it), only float noise
    # that differs between layouts, and Adam with a tiny eps would amplify that noise to lr
    return torch.optim.Adam(params, lr=1e-2, eps=1e-3)


def _batch(i, like):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(0, 128, like.shape, generator=g)


def _target(i, like):
    g = torch.Generator().manual_seed(200 + i)
    return torch.randint(0, 128, like.shape, generator=g)


def _reference(steps):
    """Losses, state dict and optimizer state ({"optim/<name>/<key>": tensor}, every parameter
    name, tied ones under both) of the unsplit model after `steps` steps."""
    model, args, _ = zoo.make(NAME, **OVERRIDES)
    opt = _optimizer(model.parameters())
    losses = []
    for i in range(steps):
        x = _batch(i, args[0])
        loss = zoo.cross_entropy_loss(model(x), _target(i, args[0]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    optim = {f"optim/{n}/{k}": v.detach().clone()
             for n, p in model.named_parameters(remove_duplicate=False) for k, v in opt.state[p].items()}
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, optim


# Each launch builds the GPT and plans its layout once, before the ranks fork ([Note: preparing once
# per launch] in fxsplit.testing.harness); every rank takes its copy of the plan ([Note: plans made
# before the fork] in fxsplit.testing.trace_cache).
_MODEL: list = []  # (model, args, kwargs), built once per process
_PLANS = SharedPlans()


def _example():
    if not _MODEL:
        _MODEL.extend(zoo.make(NAME, **OVERRIDES))
    return _MODEL


def _prepare(options):
    model, args, kwargs = _example()
    _PLANS.add(model, args, kwargs, hardware=HW, **options)


def _run(rank, world, options, start, stop, load_from, save_to):
    model, args, kwargs = _example()
    # verify is no planning option (ranks plan with verify=False): rank 0 verifies the plan it takes
    with shared_plans(_PLANS) as plans:
        pm = fxsplit.parallelize(model, args, kwargs, loss_fn=zoo.cross_entropy_loss, timeout=60,
                                 verify=None if rank == 0 else False, hardware=HW, **options)
    assert plans.misses == 0, f"rank {rank} planned {options} itself: the plan made before the fork went unused"
    opt = _optimizer(pm.parameters())
    if load_from:
        pm.load_checkpoint(load_from, optimizer=opt)
        assert pm.step_count == start  # the training state comes back at any layout
    losses = []
    for i in range(start, stop):
        loss = pm.step(_batch(i, args[0]), target=_target(i, args[0]))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    if save_to:
        pm.save_checkpoint(save_to, optimizer=opt)
    return losses, pm.full_state_dict()


@pytest.mark.dist
def test_checkpoint_reloads_under_other_layouts(tmp_path):
    ref_losses, ref_state, _ = _reference(3)
    ckpt = str(tmp_path / "ckpt")
    saved = dict(tp=2, pp=2, microbatches=2)
    first = run_distributed(_run, 4, saved, 0, 2, None, ckpt, timeout=240, prepare=(_prepare, (saved,)))
    for losses, _ in first:
        assert losses == pytest.approx(ref_losses[:2], rel=1e-5)
    # reload at pp=4 (4 ranks) and at 1 process; both continue exactly like the uninterrupted run
    pp4 = dict(pp=4, schedule="1f1b", microbatches=4)
    second = run_distributed(_run, 4, pp4, 2, 3, ckpt, None, timeout=240, prepare=(_prepare, (pp4,)))
    single = run_distributed(_run, 1, dict(), 2, 3, ckpt, None, timeout=240, prepare=(_prepare, ({},)))
    for losses, state in second + single:
        assert losses == pytest.approx(ref_losses[2:], rel=1e-5, abs=1e-6)
        assert set(state) == set(ref_state)
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-5, msg=k)
    # a torch.distributed.checkpoint folder; alone it gives the full state dict (no process group)
    assert (tmp_path / "ckpt" / ".metadata").is_file()
    _check_full_checkpoint(ckpt, *_reference(2)[1:])


def _kind(key):
    return key.split("/")[2] if key.startswith("optim/") else "param"


def _scales(*tensor_dicts):
    """The largest magnitude of each kind of tensor (parameters, and each optimizer state key)."""
    out = {}
    for d in tensor_dicts:
        for k, v in d.items():
            out[_kind(k)] = max(out.get(_kind(k), 0.0), float(v.abs().max()))
    return out


def _close(got, want, what, scale):
    """Same shape and dtype, and values within a tolerance relative to the tensor's own magnitude,
    floored at 1e-6 of the largest tensor of its kind (Adam's exp_avg_sq is ~1e-7, so a fixed
    absolute tolerance would accept anything; the key bias is float noise, see _optimizer)."""
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    atol = 1e-5 * float(want.abs().max()) + 1e-6 * scale
    torch.testing.assert_close(got, want, rtol=1e-4, atol=atol, msg=lambda m: f"{what}: {m}")


def _check_full_checkpoint(ckpt, ref_state, ref_optim):
    """The checkpoint written after 2 steps at (tp=2, pp=2), read whole in this process: every
    parameter (tp shards reassembled) and every optimizer state entry equals the single process
    after 2 steps, in name, shape, dtype and value; ``names=`` reads exactly the named ones."""
    scale = _scales(ref_state, ref_optim)
    full = fxsplit.load_full_checkpoint(ckpt)
    assert set(full) == set(ref_state), set(full) ^ set(ref_state)
    for k, v in ref_state.items():
        _close(full[k], v, k, scale[_kind(k)])
    with_optim = fxsplit.load_full_checkpoint(ckpt, include_optimizer=True)
    assert set(with_optim) == set(ref_state) | set(ref_optim), set(with_optim) ^ (set(ref_state) | set(ref_optim))
    assert {k.split("/")[2] for k in ref_optim} == {"step", "exp_avg", "exp_avg_sq"}
    for k, v in {**ref_state, **ref_optim}.items():
        _close(with_optim[k], v, k, scale[_kind(k)])
    # names=: only those tensors; a tp-sharded parameter (reassembled), a replicated one, and
    # the optimizer state of a sharded parameter by its "optim/<name>" prefix
    sharded = ["wte.weight", "blocks.0.attn.q.weight"]
    replicated = "ln_f.weight"
    optim_of = f"optim/{sharded[1]}"
    got = fxsplit.load_full_checkpoint(ckpt, names={*sharded, replicated, optim_of})
    want = {k: v for k, v in {**ref_state, **ref_optim}.items()
            if k in (*sharded, replicated) or k.startswith(optim_of + "/")}
    assert len(want) == 3 + 3, sorted(want)
    assert set(got) == set(want), set(got) ^ set(want)
    for k, v in want.items():
        _close(got[k], v, f"names= {k}", scale[_kind(k)])
        torch.testing.assert_close(got[k], with_optim[k], rtol=0, atol=0)
    assert fxsplit.load_full_checkpoint(ckpt, names={replicated}).keys() == {replicated}
    assert fxsplit.load_full_checkpoint(ckpt, names=set()) == {}
