"""Plain data parallelism: torch's ``replicate`` (torch.distributed._composable, DDP's bucketed,
backward-overlapped all-reduce) against fxsplit's own bucketed all-reduce (``parallelize(dp=N)``),
same model and data, on N gloo ranks (issue 12: keep whichever is faster).

    .venv/bin/python benchmarks/replicate_vs_dp.py                  # dp=2 and dp=4 (~2 min)
    .venv/bin/python benchmarks/replicate_vs_dp.py --dps 4 --rounds 8

Per round, in alternating order (load on this shared machine hits every variant alike), one
training step (forward, loss, backward, gradient reduction; no optimizer step) of:
- **fxsplit**: ``pm.step(x, target=y)`` of ``fxsplit.parallelize(model, dp=N)`` (the traced
  graph run by fxsplit's runtime; gradients all-reduced in 25 MiB flat buckets, launched as the
  backward finishes);
- **replicate**: ``replicate(model)`` (torch's composable DDP) on an eager copy of the model:
  ``loss_fn(model(x), y).backward()``, DDP all-reducing its buckets during the backward;
- **local**: the same eager step without any reduction (replicate's compute floor);
- **fxsplit_local**: fxsplit's step with its gradient reduction skipped (fxsplit's floor).
The two frameworks run different forwards (the traced graph under fxsplit's runtime, the eager
module), so besides the step times the script prints each reduction's own cost: the median of
per-round differences step - floor.
Every rank gets its own batch (seeded by rank); the reduced gradients of fxsplit and replicate
are compared (largest difference over all parameters, relative to the largest gradient) so the
two are known to compute the same step. The time is the slowest rank's wall time of the step
after a barrier; the figure is the median of per-round ratios replicate / fxsplit.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist

import fxsplit
from fxsplit.testing import run_distributed, zoo

from _common import full_grads_fxsplit


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dt = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt)


def _rank(rank, world, args):
    from torch.distributed._composable import replicate

    torch.manual_seed(0)
    model, ex, _ = zoo.make("gpt", batch_size=args.batch, seq_len=args.seq, n_embd=args.n_embd,
                            n_layer=args.n_layer, n_head=4, vocab_size=args.vocab, block_size=args.seq)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randint(0, args.vocab, ex[0].shape, generator=g)
    y = torch.randint(0, args.vocab, ex[0].shape, generator=g)
    eager = copy.deepcopy(model)
    local = copy.deepcopy(model)
    pm = fxsplit.parallelize(model, ex, loss_fn=zoo.cross_entropy_loss, dp=world, verify=False, timeout=120,
                             hardware=fxsplit.Hardware.cpu())
    replicate(eager)

    def eager_step(m):
        def run():
            out = m(x)
            zoo.cross_entropy_loss(out[0] if isinstance(out, (tuple, list)) else out, y).backward()
        return run

    def fxsplit_local():  # instrumentation: the same step with the gradient reduction skipped
        sync, pm._grads.finish = pm._grads.finish, lambda: None
        try:
            pm.step(x, target=y)
        finally:
            pm._grads.finish = sync

    variants = {"fxsplit": lambda: pm.step(x, target=y), "replicate": eager_step(eager), "local": eager_step(local),
                "fxsplit_local": fxsplit_local}
    params = {"fxsplit": list(pm.parameters()), "replicate": list(eager.parameters()), "local": list(local.parameters()),
              "fxsplit_local": list(pm.parameters())}

    def zero(label):
        for p in params[label]:
            p.grad = None

    for label in ("fxsplit_local", "local", "replicate", "fxsplit"):  # warm-up; fxsplit last: its grads are compared
        zero(label)
        variants[label]()
    # the reduced gradients agree, under the model's names (tied weights once)
    fx = full_grads_fxsplit(pm)
    rp = {n.removeprefix("module."): p.grad for n, p in eager.named_parameters() if p.grad is not None}
    common = sorted(set(fx) & set(rp))
    if not common:
        raise RuntimeError(f"no parameter names in common: fxsplit {sorted(fx)[:4]}, replicate {sorted(rp)[:4]}")
    scale = max(float(rp[n].abs().max()) for n in common)
    diff = max(float((fx[n] - rp[n]).abs().max()) for n in common) / scale
    lp = {n: p.grad for n, p in local.named_parameters() if p.grad is not None}  # this rank's own, unreduced
    unreduced = max(float((lp[n] - rp[n]).abs().max()) for n in common if n in lp) / scale
    times = {label: [] for label in variants}
    order = list(variants)
    for r in range(args.rounds):
        for label in (order if r % 2 == 0 else list(reversed(order))):
            zero(label)
            times[label].append(_timed(variants[label]))
    return dict(times=times, diff=diff, unreduced=unreduced, compared=len(common), of=len(rp))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dps", default="2,4")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    args = ap.parse_args()
    print(f"zoo GPT n_embd={args.n_embd} n_layer={args.n_layer} vocab={args.vocab}, {args.batch}x{args.seq} tokens "
          f"per rank, gloo, {args.rounds} alternating rounds; 1-min load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")
    for dp in (int(s) for s in args.dps.split(",") if s):
        t0 = time.perf_counter()
        res = run_distributed(_rank, dp, args, timeout=1200)[0]
        t = res["times"]
        ratio = statistics.median(b / a for a, b in zip(t["fxsplit"], t["replicate"]))
        med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
        cost_fx = statistics.median(a - b for a, b in zip(t["fxsplit"], t["fxsplit_local"])) * 1e3
        cost_rep = statistics.median(a - b for a, b in zip(t["replicate"], t["local"])) * 1e3
        print(f"dp={dp}: step median fxsplit {med['fxsplit']:.1f} ms (without its reduction "
              f"{med['fxsplit_local']:.1f} ms), replicate {med['replicate']:.1f} ms (eager without DDP "
              f"{med['local']:.1f} ms); the reduction's cost, median of per-round differences: fxsplit "
              f"{cost_fx:.1f} ms, replicate {cost_rep:.1f} ms; replicate / fxsplit median of per-round ratios "
              f"{ratio:.3f}; gradients agree to {res['diff']:.1e} (relative, {res['compared']} of {res['of']} "
              f"parameters compared; the rank's unreduced gradients differ by {res['unreduced']:.1e}) "
              f"({time.perf_counter() - t0:.0f}s)")
        for k, v in t.items():
            print(f"    {k:10s} ms per round: " + " ".join(f"{x * 1e3:.0f}" for x in v))


if __name__ == "__main__":
    main()
