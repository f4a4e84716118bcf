"""Where fxsplit's eager step differs from plain PyTorch's on one device: the speed section's Llama
(:mod:`fxsplit.testing.gpu_speed`) stepped by both under ``torch.profiler``, the ops and kernels of
each side summed and set against each other.

Terms: **side** -- plain PyTorch eager (``eager``) or fxsplit at pp=1, one microbatch (``fxsplit``);
**op** -- a profiler event of the PyTorch dispatcher (``aten::...``) counted on the host, with its
host time; **kernel** -- a device event (CUDA), with its device time; **step** -- forward, loss,
backward, as the speed section times it.

    python -m fxsplit.testing.gpu_profile [--steps 3] [--top 25] [--out profile.json]

Prints, per side, the host and device time per step, then the ops and kernels whose count or time
per step differ most between the sides (the difference is what fxsplit adds or removes). On the
CPU it runs the speed section's tiny Llama (a smoke run: the figures mean nothing there).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from typing import Any

import torch

from fxsplit.testing.gpu_speed import GPU_LLAMA, TINY_LLAMA, _llama, _setup

__all__ = ["profile", "main"]


def _events(step: Any, steps: int, cuda: bool) -> tuple[dict, dict, float]:
    """(op name -> [count, host us], kernel name -> [count, device us], host seconds) per step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        host = (time.perf_counter() - t0) / steps
    ops: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name][0] += 1 / steps
            kernels[e.name][1] += e.device_time / steps
        elif e.name.startswith("aten::"):
            ops[e.name][0] += 1 / steps
            ops[e.name][1] += e.self_cpu_time_total / steps
    return dict(ops), dict(kernels), host


def _diff(a: dict, b: dict, top: int) -> list[dict]:
    """The names whose per-step (count, time) differ most between side ``a`` (eager) and ``b``."""
    rows = []
    for name in set(a) | set(b):
        ca, ta = a.get(name, (0, 0.0))
        cb, tb = b.get(name, (0, 0.0))
        if round(ca, 3) != round(cb, 3) or abs(tb - ta) > 0.02 * max(ta, tb, 1e-9):
            rows.append({"name": name[:120], "eager_count": ca, "fxsplit_count": cb, "eager_us": ta, "fxsplit_us": tb,
                         "delta_us": tb - ta})
    rows.sort(key=lambda r: -abs(r["delta_us"]))
    return rows[:top]


def profile(device: torch.device, *, steps: int = 3, top: int = 25) -> dict:
    """Both sides' profiles on ``device`` and their differences (module docstring)."""
    from fxsplit.testing.trace_cache import SharedTraces

    cuda = device.type == "cuda"
    dims = GPU_LLAMA if cuda else TINY_LLAMA
    model = _llama(dims, device)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, dims["vocab_size"], (dims["batch"], dims["seq"]), generator=g).to(device)
    y = torch.randint(0, dims["vocab_size"], (dims["batch"], dims["seq"]), generator=g).to(device)
    traces = SharedTraces()
    sides = {}
    for name in ("eager", "fxsplit"):
        step, _, _ = _setup(name, model, x, y, device, traces)
        step()  # warm
        ops, kernels, host = _events(step, steps, cuda)
        sides[name] = {"ops": ops, "kernels": kernels, "host_s": host,
                       "device_s": sum(t for _, t in kernels.values()) / 1e6,
                       "op_count": sum(c for c, _ in ops.values()), "kernel_count": sum(c for c, _ in kernels.values())}
    e, f = sides["eager"], sides["fxsplit"]
    return {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "model": dims, "steps": steps,
            "summary": {k: {m: v[m] for m in ("host_s", "device_s", "op_count", "kernel_count")} for k, v in sides.items()},
            "ops": _diff(e["ops"], f["ops"], top), "kernels": _diff(e["kernels"], f["kernels"], top)}


def _print(report: dict) -> None:
    print(f"profile on {report['device']}, {report['steps']} steps per side")
    for side, s in report["summary"].items():
        print(f"  {side:<8} host {s['host_s'] * 1e3:9.2f} ms/step  device {s['device_s'] * 1e3:9.2f} ms/step  "
              f"ops {s['op_count']:8.0f}  kernels {s['kernel_count']:8.0f}")
    for what in ("ops", "kernels"):
        print(f"  {what} that differ (per step: count eager -> fxsplit, us eager -> fxsplit):")
        for r in report[what]:
            print(f"    {r['delta_us']:+10.1f} us  {r['eager_count']:6.1f} -> {r['fxsplit_count']:6.1f}  "
                  f"{r['eager_us']:10.1f} -> {r['fxsplit_us']:10.1f}  {r['name']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", help="also write the report as JSON")
    args = parser.parse_args(argv)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    from fxsplit.testing.gpu_cases import world_of_one

    with world_of_one(device):
        report = profile(device, steps=args.steps, top=args.top)
    _print(report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
