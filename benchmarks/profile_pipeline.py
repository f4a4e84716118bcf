"""Where one pipeline rank's step time goes: cProfile over fxsplit's runtime, grouped.

    .venv/bin/python benchmarks/profile_pipeline.py                    # 1f1b, the pipeline_vs_ptd GPT, m=8
    .venv/bin/python benchmarks/profile_pipeline.py --schedule zbv --width 64

Method: 2 gloo ranks (fxsplit.testing.run_distributed, one thread each), the zoo GPT of
benchmarks/pipeline_vs_ptd.py (8 layers, vocab 4096, seq 128, batch 16; width as given),
``parallelize(pp=2, schedule=..., microbatches=m)``, 2 warm-up steps, then ``steps`` steps under
cProfile on every rank (each after a barrier). Every function's own time (tottime) is put in one
group: backward compute (the autograd engine's C++ call: the kernels of the backward), forward
compute (torch's C ops), c10d send / recv / wait (transfers and time blocked on the peer: the
bubble), fx's generated stage forward (Python), torch Python (nn.Module calls, functional
wrappers), and fxsplit's own Python (the runtime: actions, messages, buffers). Reports ms per
step per group and the top functions. cProfile adds its own cost per Python call, so the Python
groups read high, not low.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import fxsplit
from fxsplit.testing import run_distributed, zoo


def _group(fn: str, name: str) -> str:
    if "fxsplit" in fn:
        return "fxsplit python (runtime)"
    if "run_backward" in name:
        return "backward compute (autograd engine)"
    if "c10d" in name:
        return "c10d send / recv / wait"
    if "eval_with_key" in fn:
        return "fx generated stage forward (python)"
    if fn == "~" and "torch" in name:
        return "forward compute (torch C ops)"
    if "torch" in fn:
        return "torch python (nn.Module, F, fx)"
    return "other python"


def rank_main(rank: int, world: int, schedule: str, width: int, m: int, steps: int):
    torch.set_num_threads(1)
    model, (x,), kw = zoo.make_gpt(n_layer=8, n_embd=width, n_head=8, vocab_size=4096, block_size=128,
                                   seq_len=128, batch_size=16, seed=0)
    y = torch.randint(0, 4096, (16, 128), generator=torch.Generator().manual_seed(7))
    pm = fxsplit.parallelize(model, (x,), kw, loss_fn=zoo.cross_entropy_loss, pp=world, schedule=schedule,
                             microbatches=m, hardware=fxsplit.Hardware(link_bytes_per_s=float("inf")), timeout=300)
    for _ in range(2):
        pm.step(x, target=y)
        for p in pm.parameters():
            p.grad = None
    prof, wall = cProfile.Profile(), 0.0
    for _ in range(steps):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        prof.enable()
        pm.step(x, target=y)
        prof.disable()
        wall += time.perf_counter() - t0
        for p in pm.parameters():
            p.grad = None
    stats = pstats.Stats(prof, stream=io.StringIO())
    groups: dict[str, float] = {}
    for (fn, _, name), (_, _, tt, _, _) in stats.stats.items():
        g = _group(fn, name)
        groups[g] = groups.get(g, 0.0) + tt
    out = io.StringIO()
    stats.stream = out
    stats.sort_stats("tottime").print_stats(15)
    return wall / steps, {g: t / steps for g, t in groups.items()}, out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", action="store_true", help="also print each rank's top functions")
    a = ap.parse_args()
    res = run_distributed(rank_main, 2, a.schedule, a.width, a.microbatches, a.steps, timeout=1200)
    for r, (wall, groups, top) in enumerate(res):
        total = sum(groups.values())
        print(f"rank {r}: step {wall * 1e3:.0f} ms (profiled)")
        for g, t in sorted(groups.items(), key=lambda kv: -kv[1]):
            print(f"  {g:40s} {t * 1e3:8.1f} ms  {100 * t / total:5.1f}%")
        if a.top:
            print(top)


if __name__ == "__main__":
    main()
