"""Cost of the per-step input agreement ([Note: inputs that must agree] in fxsplit.api.model)
against the quickstart step, on 4 local gloo ranks (tp=2 x pp=2).

    python benchmarks/agree_cost.py

Per rank: the median quickstart step (interleaved 1F1B, m=4, batch 8), the median start-of-call
exchange as it runs now (an all-gather of 6 int64 per rank: outcome code + five integers), and
plus computing this rank's five integers, and the 4-byte flag all-reduce it replaced, each over the same group, alternating A/B 200 times.
"""

from __future__ import annotations

import statistics
import time


def _rank(rank, world):
    import torch
    import torch.distributed as dist

    import fxsplit
    from fxsplit.testing.zoo import GPT, GPTConfig, cross_entropy_loss

    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=4, n_head=4, n_embd=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    x = torch.randint(0, 128, (8, 32))
    pm = fxsplit.parallelize(model, (x,), loss_fn=cross_entropy_loss, tp=2, pp=2, schedule="interleaved_1f1b")
    steps = []
    for _ in range(12):
        t0 = time.perf_counter()
        pm.step(x, target=x.roll(-1, 1))
        steps.append(time.perf_counter() - t0)
    group = pm._groups["errors"]
    new, old = [], []
    for _ in range(200):
        t0 = time.perf_counter()
        rows = torch.zeros(world * 6, dtype=torch.int64)
        dist.all_gather_single(rows, torch.zeros(6, dtype=torch.int64), group=group)
        new.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dist.all_reduce(torch.zeros(1, dtype=torch.int32), op=dist.ReduceOp.MAX, group=group)
        old.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(1000):
        pm._input_signature([x], x)
    sig = (time.perf_counter() - t0) / 1000
    return statistics.median(steps[2:]), statistics.median(new) + sig, statistics.median(old)


def main() -> None:
    from fxsplit.testing import run_distributed

    for rank, (step, new, old) in enumerate(run_distributed(_rank, 4, timeout=300)):
        print(f"rank {rank}: step {1e3 * step:.1f} ms; exchange now {1e6 * new:.0f} us, flag all-reduce before "
              f"{1e6 * old:.0f} us; added {1e6 * (new - old):+.0f} us = {100 * (new - old) / step:+.2f}% of the step")


if __name__ == "__main__":
    main()
