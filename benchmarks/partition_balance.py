"""Pipeline split balance and planning cost.

1. Balance: a GPT with vocab 50257 and 24 layers (h=1024, seq 1024, batch 8), planned on the meta
   device into S = 4 and 8 stages: bottleneck / mean stage time for fxsplit's exact balancer, an
   equal-layer split (what users do with torch.distributed.pipelining split points) and a
   parameter-count split (DeepSpeed's partition_method="parameters"), all scored by the same cost
   model (compute + boundary bytes at 25 GB/s).
2. Planning time and memory: Llama-70B config (80 layers) on the meta device, split into 8, 16 and
   64 stages; time and peak RSS of the split next to the bare trace.

    python benchmarks/partition_balance.py [--skip-70b]
"""

import argparse
import sys
import time

import torch

import fxsplit
from fxsplit.testing import zoo
from fxsplit.pipeline.split import plan_split

from _common import peak_rss_mb

def balance_table() -> None:
    with torch.device("meta"):
        model, args, kwargs = zoo.make(
            "gpt", n_layer=24, n_embd=1024, n_head=16, vocab_size=50257, block_size=1024, seq_len=1024, batch_size=8
        )
    args = tuple(a.to("meta") for a in args)
    t = time.perf_counter()
    gm = fxsplit.trace(model, args, kwargs, method="fx")
    print(f"GPT-24L vocab 50257 traced on meta in {time.perf_counter() - t:.1f}s")
    print(f"{'S':>3} {'fxsplit':>9} {'equal layers':>13} {'param count':>12}")
    for S in (4, 8):
        plan = plan_split(gm, num_stages=S)
        print(f"{S:>3} {plan.balance:>9.3f} {plan.baselines['equal layers']:>13.3f} {plan.baselines['parameter count']:>12.3f}")
    print(plan_split(gm, num_stages=8))


def llama_70b() -> None:
    from fxsplit.testing import hf_zoo

    model, args, kwargs = hf_zoo.meta_llama_70b(seq_len=4096)
    r0 = peak_rss_mb()
    t = time.perf_counter()
    gm = fxsplit.trace(model, args, kwargs)
    trace_s = time.perf_counter() - t
    print(f"Llama-70B: trace {trace_s:.1f}s ({len(gm.graph.nodes)} nodes, method {gm.meta['fxsplit'].method}), peak RSS {peak_rss_mb():.0f} MB (+{peak_rss_mb() - r0:.0f})")
    for S in (8, 16, 64):
        t = time.perf_counter()
        plan = plan_split(gm, num_stages=S)
        s = time.perf_counter() - t
        print(f"  split into {S:>2} stages: {s:.2f}s = {100 * s / trace_s:.0f}% of the trace time; balance {plan.balance:.3f}; peak RSS {peak_rss_mb():.0f} MB")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-70b", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    balance_table()
    if not a.skip_70b:
        llama_70b()
    sys.stdout.flush()
