"""Float16 training with ``torch.amp.GradScaler``: ``pm.step(x, target=y, scaler=scaler)``.

Checked against the unsplit model under the same float16 policy and the same scaler in one
process (loss, scale and parameters after a few SGD-with-momentum steps; AdamW would turn the
near-zero, pure-rounding gradients of the key biases (softmax ignores them) into full-size
updates of random sign, which no tolerance separates from a bug), and the skip decision: an
overflow on one rank's weight gradient only (its input gradients stay finite, so nothing else
carries it) makes EVERY rank skip the step and halve its scale ([Note: one skip decision for a
GradScaler] in fxsplit.api.grad_norm).

Tolerance: float16 parameters round each product to 11 bits. The parameter UPDATES after 3 steps
are compared (relative error norm per tensor, floor 1e-3 of the whole update's norm); measured
worst: see PARAM_RTOL.
"""

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils._python_dispatch import TorchDispatchMode

import fxsplit
from fxsplit.testing import run_distributed, zoo
from fxsplit.testing.data import replica_slice
from fxsplit.testing.trace_cache import SharedPlans, shared_plans

FP16 = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
# a global batch of 4: each of the 2 data-parallel replicas trains on its own 2 samples
# (fxsplit.testing.data), so only a correct data-parallel mean matches one process
GPT = dict(batch_size=4)
LAYOUTS = {"tp2-pp2": dict(tp=2, pp=2, microbatches=2), "dp2-pp2": dict(dp=2, pp=2, microbatches=2)}
STEPS = 4
PARAM_RTOL = 2e-2
LOSS_RTOL = 1e-3


def _batches(model, args):
    out = []
    for i in range(STEPS):
        torch.manual_seed(100 + i)
        x = torch.randint(0, int(args[0].max()) + 1, args[0].shape)
        out.append((x, zoo.make_target("gpt", model(x), seed=i)))
    return out


def _reference(scaler_kw: dict):
    """The unsplit GPT, every parameter read cast to float16 (float32 master weights), outputs
    cast to float32 for the loss, under GradScaler + SGD: losses, scales, final parameters."""
    torch.manual_seed(0)
    model, args, _ = zoo.make("gpt", **GPT)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batches = _batches(model, args)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", **scaler_kw)
    losses, scales = [], []
    for x, y in batches:
        params = dict(model.named_parameters())
        cast = {k: p.to(torch.float16) for k, p in params.items()}
        loss = zoo.loss_fn("gpt")(torch.func.functional_call(model, cast, (x,), tie_weights=True).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(float(loss))
        scales.append(scaler.get_scale())
    return losses, scales, init, {k: v.detach().clone() for k, v in model.state_dict().items()}


# A launch builds a fresh GPT per layout (each rank trains it: at tp=1 its parameters are the model's own)
# and plans them all once, before the ranks fork ([Note: preparing once per launch] in
# fxsplit.testing.harness); each rank takes its copy ([Note: plans made before the fork]).
_PREPARED: dict = {}  # layout label (or "overflow") -> (model, args, kwargs)
_PLANS = SharedPlans()
INF_LINK = fxsplit.Hardware(link_bytes_per_s=float("inf"))


def _prepare(options):
    for label, opts in LAYOUTS.items():
        model, args, kwargs = _PREPARED[label] = zoo.make("gpt", **GPT)
        _PLANS.add(model, args, kwargs, hardware=INF_LINK, **options, **opts)


def _prepared(rank, label, **options):
    """``(model, args, kwargs, pm)``: the GPT prepared for ``label`` (its batches taken from the model
    before the parallelized model trains it), parallelized from its plan."""
    model, args, kwargs = _PREPARED[label]
    batches = _batches(model, args)
    with shared_plans(_PLANS) as plans:
        pm = fxsplit.parallelize(model, args, kwargs, loss_fn=zoo.loss_fn("gpt"), timeout=60, hardware=INF_LINK,
                                 **options)
    assert plans.misses == 0, f"rank {rank} planned {label} itself: the plan made before the fork went unused"
    return batches, pm


def _train(rank, world, scaler_kw):
    out = {}
    for label, opts in LAYOUTS.items():
        torch.manual_seed(0)
        batches, pm = _prepared(rank, label, mp_policy=FP16, **opts)
        opt = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", **scaler_kw)
        losses, scales = [], []
        for x, y in batches:
            loss = pm.step(replica_slice(pm, x), target=replica_slice(pm, y), scaler=scaler)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(float(loss))
            scales.append(scaler.get_scale())
        out[label] = (losses, scales, pm.full_state_dict())
    return out


def _gap(a, b, floor):
    return float((a.float() - b.float()).norm() / max(float(b.float().norm()), floor))


@pytest.mark.dist
@pytest.mark.parametrize("scaler_kw", [dict(init_scale=2.0**10), dict(init_scale=2.0**36, backoff_factor=2.0**-13)],
                         ids=["finite", "overflow-then-backoff"])
def test_fp16_grad_scaler_matches_one_process(scaler_kw):
    """2**36 and 2**23 overflow float16 in backward by far (both steps skipped, the scale backs
    off to 2**10, which trains; both are 8x or more from the measured threshold, ~2**19: near it a split and one process may round either way,
    as microbatches accumulate weight gradients in float32), 2**10 trains from the first step;
    both match one process step for step."""
    init_scale = scaler_kw["init_scale"]
    ref_losses, ref_scales, init, ref_params = _reference(scaler_kw)
    ref_updates = {k: v - init[k] for k, v in ref_params.items()}
    # updates are compared, relative to their own size with a floor of 1e-3 of the whole update:
    # the key biases' gradients are zero up to rounding (softmax ignores them), their updates ~1e-8
    floor = 1e-3 * float(torch.cat([u.flatten() for u in ref_updates.values()]).norm())
    if init_scale > 2.0**18:
        assert ref_scales == [2.0**23, 2.0**10, 2.0**10, 2.0**10], ref_scales
    else:
        assert ref_scales[0] == init_scale, "the finite case overflowed in one process"
    results = run_distributed(_train, 4, scaler_kw, timeout=300, prepare=(_prepare, (dict(mp_policy=FP16),)))
    for label in LAYOUTS:
        for rank, r in enumerate(results):
            losses, scales, params = r[label]
            where = f"{label} rank {rank}"
            assert scales == ref_scales, (where, scales, ref_scales)
            for got, want in zip(losses, ref_losses):
                assert abs(got - want) <= LOSS_RTOL * abs(want), (where, losses, ref_losses)
            gaps = {k: _gap(params[k] - init[k], u, floor) for k, u in ref_updates.items()}
            worst = max(gaps, key=gaps.get)
            assert gaps[worst] <= PARAM_RTOL, f"{where}: parameter {worst} off by {gaps[worst]:.3g}"


# _one_rank_overflows's layout, parallelize's defaults otherwise (Hardware.cpu(), every rank verifying)
OVERFLOW = dict(mp_policy=FP16, dp=2, pp=2, microbatches=2)


def _prepare_overflow():
    model, args, kwargs = _PREPARED["overflow"] = zoo.make("gpt", **GPT)
    _PLANS.add(model, args, kwargs, **OVERFLOW)


def _one_rank_overflows(rank, world):
    torch.manual_seed(0)
    model, args, kwargs = _PREPARED["overflow"]
    (x, y), = _batches(model, args)[:1]
    with shared_plans(_PLANS) as plans:
        pm = fxsplit.parallelize(model, args, kwargs, loss_fn=zoo.loss_fn("gpt"), timeout=60, **OVERFLOW)
    assert plans.misses == 0, f"rank {rank} planned itself: the plan made before the fork went unused"
    with pytest.raises(TypeError, match="GradScaler"):  # checked on every rank, before the pipeline
        pm.step(x, target=y, scaler=object())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    last = pm.plan.config.num_stages - 1
    if last in pm.local_stage_graphs() and pm.coords["dp"] == 0:
        # one weight gradient of the last stage, on one dp replica, overflows; its input
        # gradients (sent to the first stage) and the other replica's gradients stay finite
        weight = next(p for p in pm.local_stage_graphs()[last].parameters() if p.dim() == 2)
        weight.register_hook(lambda g: g * float("inf"))
    before = [p.detach().clone() for p in pm.parameters()]
    pm.step(x, target=y, scaler=scaler)
    scaler.step(opt)
    scaler.update()
    unchanged = all(torch.equal(a, p.detach()) for a, p in zip(before, pm.parameters()))
    return unchanged, scaler.get_scale()


@pytest.mark.dist
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    results = run_distributed(_one_rank_overflows, 4, timeout=240, prepare=(_prepare_overflow, ()))
    for rank, (unchanged, scale) in enumerate(results):
        assert unchanged, f"rank {rank} applied the step although another rank's gradients overflowed"
        assert scale == 2.0**7, f"rank {rank}: scale {scale}, not backed off to 2**7 with the others"


# ------------------------------------------------------------------------------------------------
# float16 through the user's own torch.autocast around pm.step (no mp_policy)

AUTOCAST_SCALER = dict(init_scale=2.0**10)


class _MatmulDtypes(TorchDispatchMode):
    """The dtypes every matrix product ran in on this rank (forward and backward)."""

    OPS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu"}

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.OPS:
            self.dtypes.add(args[0].dtype)
        return func(*args, **(kwargs or {}))


def _autocast_reference():
    """The unsplit GPT in one process under ``torch.autocast("cpu", dtype=torch.float16)`` with
    the same GradScaler + SGD: losses, scales, initial and final parameters."""
    torch.manual_seed(0)
    model, args, _ = zoo.make("gpt", **GPT)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batches = _batches(model, args)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", **AUTOCAST_SCALER)
    losses, scales = [], []
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = zoo.loss_fn("gpt")(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(float(loss))
        scales.append(scaler.get_scale())
    return losses, scales, init, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _autocast_train(rank, world):
    out = {}
    for label, opts in LAYOUTS.items():
        torch.manual_seed(0)
        batches, pm = _prepared(rank, label, **opts)
        opt = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", **AUTOCAST_SCALER)
        losses, scales = [], []
        for x, y in batches:
            with torch.autocast("cpu", dtype=torch.float16), _MatmulDtypes() as seen:
                loss = pm.step(replica_slice(pm, x), target=replica_slice(pm, y), scaler=scaler)
            assert seen.dtypes == {torch.float16}, (label, seen.dtypes)  # autocast reached every stage
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(float(loss.detach()))
            scales.append(scaler.get_scale())
        out[label] = (losses, scales, pm.full_state_dict())
    return out


@pytest.mark.dist
def test_fp16_user_autocast_with_grad_scaler_matches_one_process():
    """The user's own ``torch.autocast(dtype=torch.float16)`` around ``pm.step(..., scaler=...)``
    at tp2-pp2 and dp2-pp2: the same scales, losses within LOSS_RTOL and parameter updates within
    PARAM_RTOL of one process under the same autocast and scaler (values cross stages in float32,
    [Note: boundary dtypes] in fxsplit.runtime.executor, one rounding fewer than one process)."""
    ref_losses, ref_scales, init, ref_params = _autocast_reference()
    assert ref_scales[0] == AUTOCAST_SCALER["init_scale"], "overflowed in one process"
    ref_updates = {k: v - init[k] for k, v in ref_params.items()}
    floor = 1e-3 * float(torch.cat([u.flatten() for u in ref_updates.values()]).norm())
    results = run_distributed(_autocast_train, 4, timeout=300, prepare=(_prepare, ({},)))
    for label in LAYOUTS:
        for rank, r in enumerate(results):
            losses, scales, params = r[label]
            where = f"{label} rank {rank}"
            assert scales == ref_scales, (where, scales, ref_scales)
            for got, want in zip(losses, ref_losses):
                assert abs(got - want) <= LOSS_RTOL * abs(want), (where, losses, ref_losses)
            gaps = {k: _gap(params[k] - init[k], u, floor) for k, u in ref_updates.items()}
            worst = max(gaps, key=gaps.get)
            assert gaps[worst] <= PARAM_RTOL, f"{where}: parameter {worst} off by {gaps[worst]:.3g}"
