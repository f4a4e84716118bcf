"""The speed section of ``make gpu-check`` ([Note: gpu check] in :mod:`fxsplit.testing.gpu_check`):
a Llama built from a ``transformers.LlamaConfig`` (no download) trained in bfloat16 on one device by
plain PyTorch (eager and ``torch.compile``) and by fxsplit (tp=1, pp=1; pp=1 with v=2 stages; and
``compile=True``), the modes alternated in one run.

Terms: **mode** -- one way of running a training step (forward, loss, backward; no optimizer, the
same work in every mode); **round** -- every mode run ``steps`` steps once, in turn; a mode's step
time is the median over rounds of its mean step time in a round (CUDA events on a GPU,
``time.perf_counter`` on the CPU); **MFU** -- model FLOPs per step / step time / the device's dense
bfloat16 peak (``PEAK_BF16``); **overhead** -- fxsplit's step time / the same mode of plain PyTorch - 1.

Model FLOPs per token, as in the PaLM paper's appendix B: 6 N (N: the parameters of every matrix
product, embedding table excluded, LM head included) + 12 L h s (attention scores and values,
L layers, hidden h, sequence s; causal masking not discounted).

    record = measure(device, on_result=print)   # writes partial results as each pass ends
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fxsplit.api.parallelize import parallelize

__all__ = ["GPU_LLAMA", "PEAK_BF16", "TINY_LLAMA", "measure"]

# dense bf16 peaks (FLOP/s) by a substring of torch.cuda.get_device_name(); vendors' datasheets
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}
# 1.27e9 parameters: head dim 128, grouped-query attention (4 kv heads), 16 layers (the trace and the
# inductor compile scale with the layer count, and the check must end within its minutes)
GPU_LLAMA = dict(hidden_size=2560, intermediate_size=6912, num_hidden_layers=16, num_attention_heads=20,
                 num_key_value_heads=4, vocab_size=32000, batch=4, seq=2048)
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, batch=2, seq=32)


def _llama(dims: dict, device: torch.device) -> nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=dims["hidden_size"], intermediate_size=dims["intermediate_size"],
        num_hidden_layers=dims["num_hidden_layers"], num_attention_heads=dims["num_attention_heads"],
        num_key_value_heads=dims["num_key_value_heads"], vocab_size=dims["vocab_size"],
        max_position_embeddings=dims["seq"], use_cache=False, attention_dropout=0.0,
        bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"  # as fxsplit.testing.hf_zoo sets it (the keyword differs across versions)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    return model.to(torch.bfloat16).train()


def _loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), target.flatten())


def flops_per_token(model: nn.Module, dims: dict) -> float:
    """6 N + 12 L h s (module docstring)."""
    n = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    return 6.0 * n + 12.0 * dims["num_hidden_layers"] * dims["hidden_size"] * dims["seq"]


class _Clock:
    """Seconds of a block of device work: CUDA events on a GPU (no host stalls inside the
    timed steps), ``time.perf_counter`` on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def time(self, fn: Callable[[], None], steps: int) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(steps):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / steps
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - t0) / steps


def _plain_step(model: Callable, params: list, x: torch.Tensor, y: torch.Tensor) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        loss = _loss(model(x), y)
        loss.backward()
        for p in params:
            p.grad = None
        return loss
    return step


def _fxsplit_step(pm: Any, x: torch.Tensor, y: torch.Tensor) -> Callable[[], torch.Tensor]:
    params = list(pm.parameters())

    def step() -> torch.Tensor:
        loss = pm.step(x, target=y)
        for p in params:
            p.grad = None
        return loss
    return step


def _setup(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device,
           traces: Any) -> tuple[Callable, float, float]:
    """Mode ``name``'s step function, its set-up seconds (planning, compiling: the first step) and
    the first step's loss."""
    from fxsplit.testing.trace_cache import shared_traces

    t0 = time.perf_counter()
    if name in ("eager", "compile"):
        run = torch.compile(model) if name == "compile" else model
        step = _plain_step(run, list(model.parameters()), x, y)
    else:
        options = {"fxsplit": dict(schedule="1f1b"),
                   "fxsplit_v2": dict(schedule="interleaved_1f1b", stages_per_rank=2),
                   "fxsplit_compile": dict(schedule="1f1b", compile=True)}[name]
        with shared_traces(traces):
            pm = parallelize(model, (x,), loss_fn=_loss, device=device, microbatches=1, verify=False,
                                     timeout=600, **options)
        step = _fxsplit_step(pm, x, y)
    first = float(step())  # compiles, warms the allocator; the losses of the modes are compared
    if device.type == "cuda":
        torch.cuda.synchronize()
    return step, time.perf_counter() - t0, first


def _alternate(steps: dict[str, Callable], clock: _Clock, rounds: int, per_round: int) -> dict[str, float]:
    """Median over ``rounds`` of each mode's mean step time, the modes run in turn in each round."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(clock.time(step, per_round))
    return {name: statistics.median(t) for name, t in times.items()}


def measure(device: torch.device, *, quick: bool, deadline: float, on_result: Callable[[dict], None]) -> dict:
    """Run the speed comparison; ``on_result`` gets the record after each pass (eager modes, then
    with the compiled ones), so a run stopped at its budget still reports the first pass."""
    dims = GPU_LLAMA if device.type == "cuda" and not quick else TINY_LLAMA
    model = _llama(dims, device)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, dims["vocab_size"], (dims["batch"], dims["seq"]), generator=g).to(device)
    y = torch.randint(0, dims["vocab_size"], (dims["batch"], dims["seq"]), generator=g).to(device)
    tokens = dims["batch"] * dims["seq"]
    flops = flops_per_token(model, dims) * tokens
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    record: dict = {"model": {**dims, "parameters": sum(p.numel() for p in model.parameters()), "dtype": "bfloat16"},
                    "device": name, "peak_bf16_flops": peak, "flops_per_step": flops, "modes": {}, "skipped": {}}
    from fxsplit.testing.trace_cache import SharedTraces

    traces, clock, steps = SharedTraces(), _Clock(device), {}
    rounds, per_round = (1, 1) if quick else (5, 3)
    passes = [("eager", "fxsplit", "fxsplit_v2"), ("compile", "fxsplit_compile")]
    for i, names in enumerate(passes):
        added = 0
        for mode in names:
            if quick and mode == "fxsplit_v2":
                record["skipped"][mode] = "--quick: v=2 is checked in (b)"
                continue
            if quick and "compile" in mode:
                record["skipped"][mode] = "--quick: no inductor compile (minutes on a CPU)"
                continue
            if time.monotonic() > deadline:
                record["skipped"][mode] = "the section's budget ran out before its set-up"
                continue
            try:
                steps[mode], setup, first = _setup(mode, model, x, y, device, traces)
                record["modes"][mode] = {"setup_seconds": setup, "first_loss": first}
                added += 1
            except Exception as exc:  # noqa: BLE001 -- reported; the other modes still run
                record["skipped"][mode] = f"failed: {type(exc).__name__}: {exc}"[:2000]
        if added:  # every mode again, alternated with the new ones
            _report(record, _alternate(steps, clock, rounds, per_round), tokens, flops, peak)
            record["passes"] = i + 1
            on_result(record)
    return record


def _report(record: dict, times: dict[str, float], tokens: int, flops: float, peak: float | None) -> None:
    base = {"fxsplit": "eager", "fxsplit_v2": "eager", "fxsplit_compile": "compile"}
    ref_loss = record["modes"].get("eager", {}).get("first_loss")
    for mode, seconds in times.items():
        row = record["modes"][mode]
        row.update(step_seconds=seconds, tokens_per_s=tokens / seconds,
                   mfu=flops / seconds / peak if peak else None)
        if mode in base and base[mode] in times:
            row["overhead"] = seconds / times[base[mode]] - 1.0
        if ref_loss is not None:  # the same work: the first step's loss equals eager's (bf16 rounding)
            row["loss_gap"] = abs(row["first_loss"] - ref_loss) / abs(ref_loss)
