"""The ``parallelize`` cases of ``make gpu-check`` ([Note: gpu check] in :mod:`fxsplit.testing.gpu_check`):
each trains the zoo GPT through :func:`fxsplit.parallelize` on one device and compares it with the
unsplit model on the same device, in the same process.

Terms: **case** -- one named configuration (``CASES``) run by :func:`run_case`; **record** -- the
plain dict a case returns: ``status`` ("pass", "fail" or "skip"), ``checks`` (what was compared:
measured gap, tolerance), ``memory`` (``plan.memory()`` against the measured peak) and ``seconds``.

    with world_of_one(device):                 # a process group of one rank (NCCL on CUDA, else gloo)
        record = run_case("zbv", device)       # {"status": "pass", "checks": [...], "memory": {...}}

Every case compares the loss and every gradient (by full name, gathered through
``full_state_dict``) with the unsplit model: float32 cases within ``FP32_RTOL``, bfloat16 and
float16 ones within the tolerances measured in tests/test_mixed_precision.py and
tests/test_grad_scaler.py. A gradient's gap is ``|a - b| / max(|b|, floor)`` with ``floor`` 1e-3 of
the whole gradient's norm (the key biases' gradients are zero up to rounding: softmax ignores them).
"""

from __future__ import annotations

import contextlib
import copy
import math
import datetime
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fxsplit.api.model import ParallelModel
from fxsplit.api.parallelize import parallelize
from fxsplit.errors import UsageError
from fxsplit.hardware import Hardware
from fxsplit.testing import zoo
from fxsplit.testing.memory import LiveBytes

__all__ = ["CASES", "LAYOUTS", "SIZED_CASES", "run_case", "run_layout", "run_sized", "world_of_one"]

FP32_RTOL = 1e-5  # loss and per-tensor gradient gap, float32 (tests/test_parallelize.py: 1e-5)
BF16_GRAD_RTOL, BF16_WHOLE_RTOL, BF16_LOSS_RTOL = 3e-2, 1e-2, 1e-4  # tests/test_mixed_precision.py
FP16_PARAM_RTOL, FP16_LOSS_RTOL = 2e-2, 1e-3  # tests/test_grad_scaler.py
MICRO, M = 2, 2  # samples per microbatch, microbatches per step (a batch of MICRO * M)
GPT = dict(n_layer=4, seq_len=16)
_FREE_LINKS = dict(hardware=Hardware(link_bytes_per_s=float("inf")))  # tiny stages: split by compute


@contextlib.contextmanager
def world_of_one(device: torch.device) -> Iterator[None]:
    """A default process group of one rank over a TCPStore on a free port: NCCL on a CUDA device
    (after ``torch.cuda.set_device``, so nothing lands on another GPU), gloo on the CPU."""
    if device.type == "cuda":
        # torch 2.11 refuses set_device(torch.device("cuda")) (no index): name the current GPU
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=60))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120), device_id=device if backend == "nccl" else None)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# comparisons


def _gap(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return float((a - b).norm() / max(float(b.norm()), floor, 1e-30))


def _check(what: str, gap: float, tol: float) -> dict:
    return {"what": what, "gap": gap, "tol": tol, "ok": bool(gap <= tol)}


def _grad_checks(grads: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor], tol: float,
                 whole_tol: float | None = None) -> list[dict]:
    """The worst per-tensor gradient gap (and, with ``whole_tol``, the whole gradient's), plus one
    failing check per gradient missing from ``grads``."""
    floor = 1e-3 * float(torch.cat([g.detach().float().cpu().flatten() for g in ref.values()]).norm())
    missing = sorted(set(ref) - set(grads))
    checks = [{"what": f"gradient {n} present", "gap": None, "tol": None, "ok": False} for n in missing]
    gaps = {n: _gap(grads[n], g, floor) for n, g in ref.items() if n in grads}
    worst = max(gaps, key=gaps.get)
    checks.append(_check(f"worst gradient ({worst})", gaps[worst], tol))
    if whole_tol is not None:
        names = [n for n in ref if n in grads]
        whole = _gap(torch.cat([grads[n].float().cpu().flatten() for n in names]),
                     torch.cat([ref[n].float().cpu().flatten() for n in names]))
        checks.append(_check("whole gradient", whole, whole_tol))
    return checks


def _loss_check(loss: float, ref: float, tol: float) -> dict:
    return _check("loss", abs(loss - ref) / max(abs(ref), 1e-30), tol)


def _pm_grads(pm: ParallelModel) -> dict[str, torch.Tensor]:
    """Every gradient under the model's full names: each shard's gradient written over its
    parameter, then gathered by ``full_state_dict`` (this overwrites the weights: call last)."""
    with torch.no_grad():
        for p in pm.parameters():
            if p.grad is not None:
                p.copy_(p.grad)
    return pm.full_state_dict()


# ------------------------------------------------------------------------------------------------
# data and the unsplit reference


def _model(dropout: float = 0.0) -> tuple[nn.Module, tuple, dict]:
    """The zoo GPT, traced at one microbatch (``plan.memory()`` counts activations per traced
    microbatch: [Note: memory model])."""
    return zoo.make("gpt", batch_size=MICRO, dropout=dropout, attn_dropout=dropout, **GPT)


def _batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 128, (MICRO * M, GPT["seq_len"]), generator=g)
    y = torch.randint(0, 128, (MICRO * M, GPT["seq_len"]), generator=g)
    return x.to(device), y.to(device)


def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
               forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None) -> tuple[float, dict]:
    """Loss and {name: gradient} of one step of the unsplit ``model`` (already on the device)."""
    params = dict(model.named_parameters())
    out = forward(model, x) if forward is not None else model(x)
    loss = zoo.cross_entropy_loss(out.float(), y)
    grads = torch.autograd.grad(loss, list(params.values()))
    return float(loss.detach()), dict(zip(params, grads))


def _cast_forward(dtype: torch.dtype) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """The unsplit forward under ``MixedPrecisionPolicy(param_dtype=dtype)``: every parameter read
    cast to ``dtype`` (float32 master weights get the gradients), as in tests/test_mixed_precision.py."""
    def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        cast = {k: p.to(dtype) for k, p in model.named_parameters()}
        return torch.func.functional_call(model, cast, (x,), tie_weights=True)
    return forward


# ------------------------------------------------------------------------------------------------
# memory: plan.memory() against the measured peak


@contextlib.contextmanager
def _measured(device: torch.device, pm: ParallelModel, out: dict, *, compiled: bool = False) -> Iterator[None]:
    """The peak bytes of the block on top of what was allocated before it, plus this rank's
    parameters: the figure ``plan.memory()``'s ``peak`` predicts without optimizer state. On CUDA
    from the caching allocator's statistics; on the CPU from :class:`LiveBytes` (tensors the ops
    allocate; collective buffers unseen), except for compiled graphs (not measured there)."""
    params = sum(p.numel() * p.element_size() for p in pm.parameters())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield
        torch.cuda.synchronize(device)
        step_peak, how = torch.cuda.max_memory_allocated(device) - base, "torch.cuda.max_memory_allocated"
    elif compiled:  # torch.compile refuses to run under a dispatch mode such as LiveBytes
        yield
        return
    else:
        with LiveBytes() as mem:
            yield
        step_peak, how = mem.peak, "LiveBytes (CPU: op allocations only)"
    rank = pm.coords["pp"]
    predicted = pm.plan.memory(optimizer_bytes_per_param=0.0)[rank]
    out.update(pp_rank=rank, measured_bytes=float(params + step_peak), predicted_bytes=float(predicted.peak),
               predicted_activations=float(predicted.activations), params_bytes=float(params), how=how)
    out["ratio"] = out["measured_bytes"] / out["predicted_bytes"] if out["predicted_bytes"] else None


# ------------------------------------------------------------------------------------------------
# the cases


def _parallelize(model: nn.Module, args: tuple, kwargs: dict, device: torch.device, **options: Any):
    opts = {**_FREE_LINKS, "verify": False, "microbatches": M, **options}
    return parallelize(model, args, kwargs, loss_fn=zoo.cross_entropy_loss, device=device, timeout=120, **opts)


def _replica(pm: ParallelModel, t: torch.Tensor) -> torch.Tensor:
    """This data-parallel replica's slice of the global batch (the reference sees all of it)."""
    c = pm.plan.config
    n, i = c.dp * c.dp_shard, pm.coords["dp"] * c.dp_shard + pm.coords.get("dp_shard", 0)
    size = t.shape[0] // n
    return t[i * size:(i + 1) * size]


def _one_step(device: torch.device, options: Mapping[str, Any], *, autocast: torch.dtype | None = None,
              cast: torch.dtype | None = None) -> dict:
    """One step through ``parallelize(**options)`` against the unsplit model: float32, under
    ``torch.autocast(dtype=autocast)``, or with parameters read in ``cast`` (``mp_policy``)."""
    model, args, kwargs = _model()
    ref_model = copy.deepcopy(model).to(device)
    x, y = _batch(0, device)
    amp = (torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext())
    with amp:
        ref_loss, ref_grads = _reference(ref_model, x, y, _cast_forward(cast) if cast is not None else None)
    pm = _parallelize(model, args, kwargs, device, **options)
    with amp:  # a warm-up step (compilation, cuBLAS workspaces, lazy state), its gradients dropped
        pm.step(_replica(pm, x), target=_replica(pm, y))
    pm.zero_grad(set_to_none=True)
    memory: dict = {}
    with _measured(device, pm, memory, compiled=bool(options.get("compile"))), amp:
        loss = float(pm.step(_replica(pm, x), target=_replica(pm, y)))
    if autocast is None and cast is None:
        checks = [_loss_check(loss, ref_loss, FP32_RTOL)] + _grad_checks(_pm_grads(pm), ref_grads, FP32_RTOL)
    else:
        checks = [_loss_check(loss, ref_loss, BF16_LOSS_RTOL)] + _grad_checks(
            _pm_grads(pm), ref_grads, BF16_GRAD_RTOL, BF16_WHOLE_RTOL)
    extra = {"compile_fallbacks": {f"{s}{k}": why for (s, k), why in pm.compile_fallbacks.items()}}
    if options.get("compile"):
        checks.append({"what": "every graph compiled", "gap": None, "tol": None, "ok": not extra["compile_fallbacks"]})
    return {"checks": checks, "memory": memory, **extra}


def _fp16_scaler(device: torch.device) -> dict:
    """float16 parameters (``mp_policy``) with a ``GradScaler`` and SGD with momentum for 3 steps,
    against the unsplit model under the same policy and scaler: losses, scales, updates."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model, args, kwargs = _model()
    ref_model = copy.deepcopy(model).to(device)
    init = {k: v.detach().clone() for k, v in ref_model.state_dict().items()}
    pm = _parallelize(model, args, kwargs, device, schedule="1f1b",
                      mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32))
    runs = {}
    for label, net in (("ref", ref_model), ("pm", pm)):
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler(device.type, init_scale=2.0**12)
        losses, scales = [], []
        for i in range(3):
            x, y = _batch(i, device)
            if net is pm:
                loss = pm.step(x, target=y, scaler=scaler)
            else:
                loss = zoo.cross_entropy_loss(_cast_forward(torch.float16)(net, x).float(), y)
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(float(loss))
            scales.append(scaler.get_scale())
        runs[label] = (losses, scales)
    final, ref_final = pm.full_state_dict(), ref_model.state_dict()
    floor = 1e-3 * float(torch.cat([(ref_final[k] - v).float().cpu().flatten() for k, v in init.items()]).norm())
    # full_state_dict is on the CPU, the reference on the device
    gaps = {k: _gap(final[k].to(v.device) - v, ref_final[k] - v, floor) for k, v in init.items() if v.is_floating_point()}
    worst = max(gaps, key=gaps.get)
    checks = [_check(f"loss, step {i}", abs(a - b) / abs(b), FP16_LOSS_RTOL)
              for i, (a, b) in enumerate(zip(runs["pm"][0], runs["ref"][0]))]
    checks.append({"what": "scales", "gap": None, "tol": None, "ok": runs["pm"][1] == runs["ref"][1],
                   "detail": f"{runs['pm'][1]} against {runs['ref'][1]}"})
    checks.append(_check(f"worst update ({worst})", gaps[worst], FP16_PARAM_RTOL))
    return {"checks": checks}


def _dropout_streams(device: torch.device) -> dict:
    """tp=1, pp=1, m=1 with dropout: the unsplit model on the stage stream of (seed, stage 0,
    microbatch 0, step 0) draws the same masks ([Note: RNG streams] in fxsplit.tp.random)."""
    from fxsplit.tp.random import stage_stream

    model, args, kwargs = zoo.make("gpt", batch_size=MICRO * M, dropout=0.2, attn_dropout=0.2, **GPT)
    ref_model = copy.deepcopy(model).to(device)
    x, y = _batch(0, device)
    with stage_stream(5, stage=0, microbatch=0, step=0, device=device):
        ref_loss, ref_grads = _reference(ref_model, x, y)
    pm = _parallelize(model, args, kwargs, device, schedule="1f1b", microbatches=1, seed=5)
    loss = float(pm.step(x, target=y))
    return {"checks": [_loss_check(loss, ref_loss, FP32_RTOL)] + _grad_checks(_pm_grads(pm), ref_grads, FP32_RTOL)}


def _checkpoint_resume(device: torch.device) -> dict:
    """4 Adam steps uninterrupted against 2 steps, a checkpoint saved, a fresh model loaded from it
    and 2 more steps: the same losses and final state; the losses also equal the unsplit model's."""
    options = dict(schedule="zbv")

    def train(pm: Any, steps: range, opt: Any) -> list[float]:
        out = []
        for i in steps:
            x, y = _batch(i, device)
            out.append(float(pm.step(x, target=y)))
            opt.step()
            opt.zero_grad()
        return out

    def adam(params: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=1e-2, eps=1e-3)  # eps: see tests/test_checkpoint.py

    model, args, kwargs = _model()
    ref_model = copy.deepcopy(model).to(device)
    ref_opt = adam(ref_model.parameters())
    ref_losses = []
    for i in range(4):
        x, y = _batch(i, device)
        loss = zoo.cross_entropy_loss(ref_model(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(loss))
    pm = _parallelize(model, args, kwargs, device, **options)
    opt = adam(pm.parameters())
    straight = train(pm, range(4), opt)
    pm = _parallelize(model, args, kwargs, device, **options)
    opt = adam(pm.parameters())
    first = train(pm, range(2), opt)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/ckpt"
        pm.save_checkpoint(path, optimizer=opt)
        resumed = _parallelize(model, args, kwargs, device, **options)
        opt2 = adam(resumed.parameters())
        resumed.load_checkpoint(path, optimizer=opt2)
        second = train(resumed, range(2, 4), opt2)
    checks = [_check("resumed losses = uninterrupted", max(abs(a - b) / abs(b) for a, b in zip(first + second, straight)), 1e-6)]
    checks.append(_check("losses = unsplit model", max(abs(a - b) / abs(b) for a, b in zip(straight, ref_losses)), FP32_RTOL))
    state, ref_state = resumed.full_state_dict(), ref_model.state_dict()
    floats = {k: v for k, v in ref_state.items() if v.is_floating_point()}
    floor = 1e-3 * float(torch.cat([v.float().cpu().flatten() for v in floats.values()]).norm())
    gaps = {k: _gap(state[k], v, floor) for k, v in floats.items()}  # floor: zero-init biases
    worst = max(gaps, key=gaps.get)
    checks.append(_check(f"final state = unsplit model (worst: {worst})", gaps[worst], FP32_RTOL))
    return {"checks": checks}


def _hf_llama(device: torch.device) -> dict:
    """A Hugging Face Llama built and traced on the CPU (torch.export bakes ``device=cpu`` into its
    position ids and masks: [Note: device literals] in fxsplit.api.materialize), run on ``device``
    with interleaved 1F1B, v=2, against the unsplit model moved there."""
    from fxsplit.testing import hf_zoo

    model, args, kwargs = hf_zoo.make_hf("llama", batch_size=MICRO)
    ref_model = copy.deepcopy(model).to(device)
    x, y = _batch(0, device)
    x, y = x % model.config.vocab_size, y % model.config.vocab_size
    mask = torch.ones_like(x)

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        return zoo.cross_entropy_loss(out.logits.float(), target)

    params = dict(ref_model.named_parameters())
    ref_loss = loss_fn(ref_model(x, attention_mask=mask), y)
    ref_grads = dict(zip(params, torch.autograd.grad(ref_loss, list(params.values()))))
    pm = parallelize(model, args, kwargs, loss_fn=loss_fn, device=device, timeout=120, verify=False, microbatches=M,
                     schedule="interleaved_1f1b", stages_per_rank=2, **_FREE_LINKS)
    loss = float(pm.step(x, attention_mask=mask, target=y))
    return {"checks": [_loss_check(loss, float(ref_loss), FP32_RTOL)] + _grad_checks(_pm_grads(pm), ref_grads, FP32_RTOL)}


def _bf16(device: torch.device, policy: bool) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if policy:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return _one_step(device, dict(schedule="1f1b", mp_policy=mp), cast=torch.bfloat16)
    return _one_step(device, dict(schedule="1f1b"), autocast=torch.bfloat16)


# name -> (what it checks, run(device) -> partial record)
CASES: dict[str, tuple[str, Callable[[torch.device], dict]]] = {
    "interleaved_v2": ("interleaved 1F1B, v=2 stages on the one rank",
                       lambda d: _one_step(d, dict(schedule="interleaved_1f1b", stages_per_rank=2))),
    "zbv": ("ZB-V: two stages in a V on the one rank", lambda d: _one_step(d, dict(schedule="zbv"))),
    "compile_zbv": ("compile=True (inductor) with ZB-V's F, I and W graphs",
                    lambda d: _one_step(d, dict(schedule="zbv", compile=True))),
    "mp_policy_bf16": ("mp_policy bf16 params / fp32 reduce", lambda d: _bf16(d, policy=True)),
    "autocast_bf16": ("torch.autocast(bf16) around step()", lambda d: _bf16(d, policy=False)),
    "fp16_grad_scaler": ("fp16 mp_policy with a GradScaler, 3 SGD-momentum steps", _fp16_scaler),
    "checkpointing_full": ("activation_checkpointing='full' with ZB-V",
                           lambda d: _one_step(d, dict(schedule="zbv", activation_checkpointing="full"))),
    "dropout_streams": ("dropout on the RNG stage stream: the masks of the unsplit model", _dropout_streams),
    "checkpoint_resume": ("save_checkpoint / load_checkpoint with Adam, resumed = uninterrupted", _checkpoint_resume),
    "hf_llama_cpu_traced": ("HF Llama traced on the CPU, run on the device (interleaved, v=2)", _hf_llama),
    "dp_shard_fsdp2": ("dp_shard (FSDP2 units)", None),
}
# dp_shard=1 builds no FSDP units (nothing to shard over one rank), so FSDP2 runs at dp_shard >= 2 only
_NEEDS_RANKS = {"dp_shard_fsdp2": "dp_shard >= 2 needs 2 ranks (fxsplit builds FSDP2 units only when there is "
                                  "something to shard); run in the 2-GPU section as 'dp_shard2'"}

# the 2+ GPU layouts (NCCL, one GPU per rank), each against the unsplit model on the rank's GPU
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": dict(tp=2, schedule="1f1b"),
    "pp2": dict(pp=2, schedule="1f1b"),
    "pp2_zbv": dict(pp=2, schedule="zbv"),
    "dp2": dict(dp=2, schedule="1f1b"),
    "dp_shard2": dict(dp_shard=2, schedule="1f1b"),
    "cp2": dict(cp=2, schedule="1f1b"),  # on CUDA by all-gather ([Note: the ring on CUDA] in fxsplit.tp.ring)
}


# (c)'s own runs: plan.memory() against the measured peak at a size where the caching allocator's
# 512-byte rounding is noise (the cases above run a 0.2 MiB model, where it is most of the gap).
# A GPT of ~130M parameters, micro-batches of 4 x 1024 tokens; memory only (b) checks the numbers.
SIZED_GPT = dict(n_layer=8, n_embd=1024, n_head=16, seq_len=1024, block_size=1024, vocab_size=32000)
SIZED_SMALL = dict(n_layer=4, n_embd=64, n_head=4, seq_len=64, block_size=64, vocab_size=512)  # the CPU form of (c)
SIZED_MICRO = 4
SIZED_CASES: dict[str, dict[str, Any]] = {
    "1f1b": dict(schedule="1f1b"),
    "interleaved_v2": dict(schedule="interleaved_1f1b", stages_per_rank=2),
    "zbv": dict(schedule="zbv"),
    "checkpointing_full": dict(schedule="zbv", activation_checkpointing="full"),
    "mp_policy_bf16": dict(schedule="1f1b", mp_policy="bf16"),
}


def run_sized(name: str, device: torch.device, sizes: Mapping[str, int] = SIZED_GPT) -> dict:
    """One warm-up and one measured step of the GPT of ``sizes`` (the ~130M ``SIZED_GPT``; the
    CPU's form ``SIZED_SMALL``) under ``SIZED_CASES[name]`` on one rank: ``plan.memory()``'s peak
    against the measured one."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    def fn(_: torch.device) -> dict:
        model, args, kwargs = zoo.make("gpt", batch_size=SIZED_MICRO, **sizes)
        options = dict(SIZED_CASES[name])
        if options.get("mp_policy") == "bf16":
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        pm = _parallelize(model, args, kwargs, device, **options)
        g = torch.Generator().manual_seed(7)
        x, y = (torch.randint(0, sizes["vocab_size"], (SIZED_MICRO * M, sizes["seq_len"]), generator=g).to(device)
                for _ in range(2))
        first = float(pm.step(x, target=y))
        pm.zero_grad(set_to_none=True)
        memory: dict = {}
        with _measured(device, pm, memory):
            loss = float(pm.step(x, target=y))
        ok = all(map(math.isfinite, (first, loss)))
        return {"checks": [{"what": "finite losses", "gap": None, "tol": None, "ok": ok}], "memory": memory,
                "params": sum(p.numel() for p in pm.parameters())}

    return _timed({"name": f"sized_{name}", "what": f"{SIZED_CASES[name]} at {dict(sizes)}"},
                  lambda: fn(device), device)


def run_case(name: str, device: torch.device) -> dict:
    """Run case ``name`` on ``device`` inside a process group of one rank; never raises for a
    failure of the case itself (the record says ``status`` "error" with the exception)."""
    if name not in CASES:
        raise UsageError(f"unknown gpu-check case {name!r}; choose one of {', '.join(CASES)}")
    what, fn = CASES[name]
    record: dict = {"name": name, "what": what}
    if fn is None:
        return {**record, "status": "skip", "reason": _NEEDS_RANKS[name]}
    return _timed(record, lambda: fn(device), device)


def run_layout(rank: int, world: int, name: str) -> dict:
    """One rank of a 2+ GPU layout (``LAYOUTS[name]``; for :func:`fxsplit.testing.run_distributed`
    with backend "nccl", which sets this rank's device)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    record = {"name": name, "rank": rank, "what": f"{LAYOUTS[name]} on {world} ranks"}
    return _timed(record, lambda: _one_step(device, LAYOUTS[name]), device)


def _timed(record: dict, fn: Callable[[], dict], device: torch.device) -> dict:
    import traceback

    start = time.perf_counter()
    try:
        record.update(fn())
        record["status"] = "pass" if all(c["ok"] for c in record["checks"]) else "fail"
    except Exception as exc:  # noqa: BLE001 -- reported in the record, the next case still runs
        record.update(status="error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    record["seconds"] = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record
