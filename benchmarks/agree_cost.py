"""Cost of the per-step input agreement ([Note: inputs that must agree] in fxsplit.api.agreement)
against the quickstart step, on 4 local gloo ranks (tp=2 x pp=2).

    python benchmarks/agree_cost.py

Per rank: the median quickstart step (interleaved 1F1B, m=4, batch 8); the median of each exchange
as it runs now (step()'s start: a MAX all-reduce of 4 int64, the outcome code in the top bits of
two hashes' (v, M - v) pairs, plus computing them; its end: 2 int64, the loss hash) and of the
4-byte flag all-reduce each replaced; alternating (which goes first changes every time), 200
times, over the same group, each started right after a barrier.
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
    group = pm._groups.errors
    new, old = [], []

    def timed(fn):
        dist.barrier(group=group)  # every rank starts together: the op's own latency, not the skew
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def now():  # step()'s start: 2 values (inputs, target) x (v, M - v) for 1 replica, code in the top bits
        row = torch.zeros(4, dtype=torch.int64)
        dist.all_reduce(row, op=dist.ReduceOp.MAX, group=group)

    def now_end():  # step()'s end: the loss hash
        row = torch.zeros(2, dtype=torch.int64)
        dist.all_reduce(row, op=dist.ReduceOp.MAX, group=group)

    def before():
        dist.all_reduce(torch.zeros(1, dtype=torch.int32), op=dist.ReduceOp.MAX, group=group)

    end = []
    for i in range(200):  # alternate which goes first
        if i % 2:
            new.append(timed(now))
            end.append(timed(now_end))
            old.append(timed(before))
        else:
            old.append(timed(before))
            end.append(timed(now_end))
            new.append(timed(now))
    t0 = time.perf_counter()
    for _ in range(1000):
        pm._input_signature([x], x, "step")
    sig = (time.perf_counter() - t0) / 1000
    return (statistics.median(steps[2:]), statistics.median(new) + sig, statistics.median(end),
            statistics.median(old))


def main() -> None:
    from fxsplit.testing import run_distributed

    for rank, (step, new, end, old) in enumerate(run_distributed(_rank, 4, timeout=300)):
        added = (new - old) + (end - old)
        print(f"rank {rank}: step {1e3 * step:.1f} ms; exchanges now {1e6 * new:.0f} us (start, with the "
              f"signature) + {1e6 * end:.0f} us (end), each a {1e6 * old:.0f} us flag all-reduce before; added "
              f"{1e6 * added:+.0f} us = {100 * added / step:+.2f}% of the step")


if __name__ == "__main__":
    main()
