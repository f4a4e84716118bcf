"""How a small gloo all-reduce's time grows with its element count (why the input agreement packs
the outcome code into the hashes' int64s: [Note: inputs that must agree] in fxsplit.api.agreement).

    python benchmarks/allreduce_sizes.py

4 local gloo ranks; per size, the median of 100 MAX all-reduces of that many int64, each started
right after a barrier; one line per rank (microseconds).
"""

from __future__ import annotations

import statistics
import time


def _rank(rank, world):
    import torch
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")
    out = {}
    for n in (1, 2, 3, 4, 5, 7):
        times = []
        for _ in range(100):
            dist.barrier(group=group)
            t = torch.zeros(n, dtype=torch.int64)
            t0 = time.perf_counter()
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            times.append(time.perf_counter() - t0)
        out[n] = round(1e6 * statistics.median(times))
    return out


def main() -> None:
    from fxsplit.testing import run_distributed

    for rank, sizes in enumerate(run_distributed(_rank, 4, timeout=300)):
        print(f"rank {rank}: " + ", ".join(f"{n} int64: {us} us" for n, us in sizes.items()))


if __name__ == "__main__":
    main()
