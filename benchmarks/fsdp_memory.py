"""Sharded data parallelism (dp_shard, FSDP2) against plain data parallelism (dp, fxsplit's
bucketed all-reduce) on 4 gloo ranks: per-rank parameter bytes, Adam state bytes, step time and
peak memory, measured beside what ``plan()`` predicts (fxsplit.api.memory).

    .venv/bin/python benchmarks/fsdp_memory.py                 # dp=4 vs dp_shard=4 (~2 min)
    .venv/bin/python benchmarks/fsdp_memory.py --rounds 6 --n-embd 256

Both models are built in the same 4 processes and timed in alternating rounds (A B, then B A,
...), so load on this shared machine hits both alike; the step-time figure is the median of the
per-round ratios. Memory is counted, not sampled: parameter and Adam bytes are the local tensors'
sizes (DTensor shards for dp_shard), the step's peak is ``fxsplit.testing.memory.LiveBytes`` over
``step()`` + ``optimizer.step()`` (every storage an op allocates, gradients included: they are
set to None before the step) plus the parameters and optimizer state held before it, plus (with
dp_shard) FSDP's gathered parameters, read off FSDP's own records as each backward starts:
FSDP2 allocates them by resizing a storage in place, which LiveBytes cannot see.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import fxsplit
from fxsplit.schedule.ir import ActionKind
from fxsplit.testing import run_distributed, zoo

LAYOUTS = {"dp4": dict(dp=4), "dp_shard4": dict(dp_shard=4)}


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def _gathered_bytes(pm) -> int:
    """Bytes of FSDP's unsharded parameter storages now: FSDP2 allocates and frees them by resizing
    the storage in place (``untyped_storage().resize_``), which no dispatcher mode sees, so
    ``LiveBytes`` misses them; read them off FSDP's own parameter records."""
    total = 0
    for m in pm.runtime.modules.values():  # instrumentation only
        state = getattr(m, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        for fp in (group.fsdp_params if group is not None else ()):
            t = getattr(fp, "_unsharded_param", None)
            total += t.untyped_storage().nbytes() if t is not None else 0
    return total


def _rank(rank, world, args):
    from fxsplit.testing.memory import LiveBytes

    torch.manual_seed(0)
    model, ex, _ = zoo.make("gpt", batch_size=args.batch, seq_len=args.seq, n_embd=args.n_embd,
                            n_layer=args.n_layer, n_head=4, vocab_size=args.vocab, block_size=args.seq)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, args.vocab, ex[0].shape, generator=g)
    y = torch.randint(0, args.vocab, ex[0].shape, generator=g)
    runs = {}
    for label, opts in LAYOUTS.items():
        pm = fxsplit.parallelize(model, ex, loss_fn=zoo.cross_entropy_loss, verify=False, timeout=120,
                                 hardware=fxsplit.Hardware.cpu(), **opts)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        pm.step(x, target=y)  # warm-up; creates the Adam state
        opt.step()
        opt.zero_grad(set_to_none=True)
        runs[label] = dict(pm=pm, opt=opt, times=[], peaks=[], gathered=[0])
        seen = runs[label]["gathered"]

        def backward_starts(step, a, pm=pm, seen=seen):  # instrumentation only: what FSDP holds gathered
            if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT):
                seen[0] = max(seen[0], _gathered_bytes(pm))

        pm.runtime.probe(before=backward_starts)  # for the life of this runtime
    for r in range(args.rounds):
        order = list(LAYOUTS) if r % 2 == 0 else list(reversed(LAYOUTS))
        for label in order:
            run = runs[label]
            pm, opt = run["pm"], run["opt"]
            held = _local_bytes(pm.parameters()) + _local_bytes(
                v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim())
            dist.barrier()
            t0 = time.perf_counter()
            with LiveBytes() as mem:
                pm.step(x, target=y)
                opt.step()
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            opt.zero_grad(set_to_none=True)
            run["times"].append(float(dt))
            run["peaks"].append(held + mem.peak + run["gathered"][0])
    out = {}
    for label, run in runs.items():
        pm, opt = run["pm"], run["opt"]
        adam = _local_bytes(v for st in opt.state.values() for v in st.values()
                            if isinstance(v, torch.Tensor) and v.dim())
        pred = pm.plan.memory()[pm.coords["pp"]]
        out[label] = dict(params=_local_bytes(pm.parameters()), adam=adam, times=run["times"],
                          peak=max(run["peaks"]), pred=pred, total=sum(p.numel() for p in model.parameters()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    args = ap.parse_args()
    t0 = time.perf_counter()
    res = run_distributed(_rank, 4, args, timeout=1200)
    mib = lambda b: f"{b / 2**20:7.2f} MiB"  # noqa: E731
    print(f"zoo GPT n_embd={args.n_embd} n_layer={args.n_layer} vocab={args.vocab}, {args.batch}x{args.seq} "
          f"tokens per rank, 4 gloo ranks, {args.rounds} alternating rounds ({time.perf_counter() - t0:.0f}s)")
    print(f"{'layout':10} {'rank':>4} {'params':>12} {'pred':>12} {'Adam':>12} {'pred':>12} "
          f"{'peak':>12} {'pred':>12} {'peak/pred':>9}")
    for label in LAYOUTS:
        for rank, r in enumerate(res):
            m = r[label]
            p = m["pred"]
            print(f"{label:10} {rank:>4} {mib(m['params'])} {mib(p.params)} {mib(m['adam'])} {mib(p.optimizer)} "
                  f"{mib(m['peak'])} {mib(p.peak)} {m['peak'] / p.peak:9.3f}")
    total = res[0]["dp4"]["total"] * 4
    for label in LAYOUTS:
        print(f"{label}: rank 0 holds {res[0][label]['params'] / total:.3f} of the parameters, "
              f"step median {statistics.median(res[0][label]['times']) * 1e3:.1f} ms")
    ratios = [b / a for a, b in zip(res[0]["dp4"]["times"], res[0]["dp_shard4"]["times"])]
    print(f"step time dp_shard4 / dp4: median of per-round ratios {statistics.median(ratios):.3f} "
          f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()
