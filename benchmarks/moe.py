"""Experts by tensor parallelism against experts by expert parallelism at the same world size (2
gloo ranks, the same global batch): the zoo's MoE GPT (8 experts, top-2, a shared expert), ``tp=2``
(every rank runs every expert on half of each expert's matrices, the whole batch) against
``dp=2, ep=2`` (every rank runs 4 whole experts on the rows routed to them, each rank half the
batch). Step time, peak memory, expert parameter bytes per rank, and tokens per expert per step.

    .venv/bin/python benchmarks/moe.py                   # ~2 min
    .venv/bin/python benchmarks/moe.py --rounds 6 --n-embd 256
    .venv/bin/python benchmarks/moe.py --schedules        # 4 ranks: dp=2 x ep=2 x pp=2, 1F1B / ZB-V / DualPipeV

``--schedules``: the pipeline schedules with ep at the same world size (4 gloo ranks, dp=2, ep=2,
pp=2, 4 microbatches), built in the same processes and alternated by round as above: step time,
peak memory, the all-to-all time per step (host seconds inside the exchanges, ``exchange_stats``:
[Note: exchange statistics] in fxsplit/tp/experts.py; the slowest rank's) and the tokens each
expert received in the step (the ep groups' counts joined, summed over the MoE layers and the
pipeline ranks). On CPU nothing overlaps a DualPipeV pair (its runtime runs the pair's two actions
one after the other), so its all-to-all time is not hidden here; the planner's model of the
overlap a GPU runtime gets is in docs/planning.md.

Both layouts are built in the same 2 processes and timed in alternating rounds (A B, then B A,
...), so load on this shared machine hits both alike; step time is the median of the per-round
ratios. The peak is ``fxsplit.testing.memory.LiveBytes`` over ``step()`` + ``optimizer.step()`` plus
the parameters and Adam state held before it. Tokens per expert are the routed rows each expert
receives in one step (summed over the MoE layers), read off the model's own routing of the global
batch (the split runs route every token the same way: exactness is tested in
tests/test_expert_parallel.py); min / mean / max show the imbalance ep must carry (dropless).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import fxsplit
from fxsplit.testing import run_distributed, zoo
from fxsplit.testing.data import replica_slice

LAYOUTS = {"experts by tp (tp=2)": dict(tp=2), "experts by ep (dp=2, ep=2)": dict(dp=2, ep=2)}
SCHEDULES = {name: dict(dp=2, ep=2, pp=2, microbatches=4, schedule=name) for name in ("1f1b", "zbv", "dualpipev")}


def _model(args):
    return zoo.make("moe", seed=0, batch_size=args.batch, seq_len=args.seq, n_embd=args.n_embd, n_layer=args.n_layer,
                    num_experts=8, top_k=2, expert_hidden=2 * args.n_embd, vocab_size=args.vocab, block_size=args.seq)


def _rank(rank, world, args, layouts):
    from fxsplit.testing.memory import LiveBytes
    from fxsplit.api.expert_load import expert_rows
    from fxsplit.tp.experts import exchange_stats

    model, (x,), _ = _model(args)
    y = torch.randint(0, args.vocab, x.shape, generator=torch.Generator().manual_seed(1))
    runs = {}
    for label, opts in layouts.items():
        pm = fxsplit.parallelize(model, (replica_slice_of(x, opts),), loss_fn=zoo.cross_entropy_loss, verify=False,
                                 timeout=120, hardware=fxsplit.Hardware.cpu(), **opts)
        xs, ys = replica_slice(pm, x), replica_slice(pm, y)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        pm.step(xs, target=ys)  # warm-up; creates the Adam state
        opt.step()
        opt.zero_grad(set_to_none=True)
        experts = sum(p.nbytes for n, p in ((n, p) for m in pm.stage_modules.values() for n, p in m.named_parameters())
                      if ".experts." in n)
        runs[label] = dict(pm=pm, opt=opt, xs=xs, ys=ys, times=[], peaks=[], experts=experts, a2a=[], rows=None)
    for r in range(args.rounds):
        for label in (list(layouts) if r % 2 == 0 else list(reversed(layouts))):
            run = runs[label]
            pm, opt = run["pm"], run["opt"]
            held = sum(p.nbytes for p in pm.parameters()) + sum(
                v.nbytes for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
            dist.barrier()
            t0 = time.perf_counter()
            with LiveBytes() as mem, exchange_stats() as st:
                pm.step(run["xs"], target=run["ys"])
                opt.step()
            dt = torch.tensor([time.perf_counter() - t0, st.seconds])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            opt.zero_grad(set_to_none=True)
            run["times"].append(float(dt[0]))
            run["a2a"].append(float(dt[1]))
            run["peaks"].append(held + mem.peak)
            run["rows"] = expert_rows(pm, st)
    return {label: dict(times=run["times"], peak=max(run["peaks"]), experts=run["experts"], a2a=run["a2a"],
                        rows=run["rows"]) for label, run in runs.items()}


def replica_slice_of(x, opts):
    """The example one rank traces: its replica's share of the global batch."""
    return x[: x.shape[0] // opts.get("dp", 1)]


def _tokens_per_expert(args) -> list[int]:
    """Rows each expert receives in one step of the global batch, summed over the MoE layers."""
    model, (x,), _ = _model(args)
    counts = torch.zeros(8, dtype=torch.long)

    def hook(module, inputs, output):
        top = torch.topk(torch.softmax(output, -1), 2, dim=-1).indices
        counts.add_(torch.bincount(top.reshape(-1), minlength=8))

    for block in model.blocks:
        block.moe.router.register_forward_hook(hook)
    with torch.no_grad():
        model(x)
    return counts.tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--schedules", action="store_true", help="1F1B / ZB-V / DualPipeV with dp=2 x ep=2 x pp=2 (4 ranks)")
    args = ap.parse_args()
    if args.schedules:
        return _schedules(args)
    t0 = time.perf_counter()
    res = run_distributed(_rank, 2, args, LAYOUTS, timeout=1200)
    tokens = _tokens_per_expert(args)
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    print(f"zoo MoE GPT: 8 experts, top-2, shared expert, n_embd={args.n_embd}, n_layer={args.n_layer}; global batch "
          f"{args.batch}x{args.seq} tokens; 2 gloo ranks; {args.rounds} alternating rounds "
          f"({time.perf_counter() - t0:.0f}s)")
    print("| layout | step (median) | peak memory, rank 0 | expert weights per rank |")
    print("| --- | --- | --- | --- |")
    for label in LAYOUTS:
        r = res[0][label]
        print(f"| {label} | {statistics.median(r['times']) * 1e3:.1f} ms | {mib(r['peak'])} | {mib(r['experts'])} |")
    a, b = list(LAYOUTS)
    ratios = [y / x for x, y in zip(res[0][a]["times"], res[0][b]["times"])]
    print(f"step time ep / tp: median of per-round ratios {statistics.median(ratios):.3f} "
          f"(rounds: {', '.join(f'{v:.2f}' for v in ratios)})")
    print(f"tokens per expert per step (both MoE layers): min {min(tokens)}, mean {sum(tokens) / len(tokens):.1f}, "
          f"max {max(tokens)} (each: {tokens})")


def _schedules(args) -> None:
    t0 = time.perf_counter()
    res = run_distributed(_rank, 4, args, SCHEDULES, timeout=1800)[0]
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    print(f"zoo MoE GPT: 8 experts, top-2, shared expert, n_embd={args.n_embd}, n_layer={args.n_layer}; global batch "
          f"{args.batch}x{args.seq} tokens; 4 gloo ranks, dp=2 x ep=2 x pp=2, 4 microbatches; {args.rounds} "
          f"alternating rounds ({time.perf_counter() - t0:.0f}s)")
    print("| schedule | step (median) | all-to-all per step (median) | peak memory, rank 0 | tokens per expert "
          "(min / mean / max) |")
    print("| --- | --- | --- | --- | --- |")
    for label in SCHEDULES:
        r = res[label]
        rows = r["rows"]
        load = f"{min(rows)} / {sum(rows) / len(rows):.1f} / {max(rows)}" if rows else "-"
        print(f"| {label} | {statistics.median(r['times']) * 1e3:.1f} ms | {statistics.median(r['a2a']) * 1e3:.1f} ms "
              f"| {mib(r['peak'])} | {load} |")
    base = res["1f1b"]["times"]
    for label in ("zbv", "dualpipev"):
        ratios = [y / x for x, y in zip(base, res[label]["times"])]
        print(f"step time {label} / 1f1b: median of per-round ratios {statistics.median(ratios):.3f} "
              f"(rounds: {', '.join(f'{v:.2f}' for v in ratios)})")


if __name__ == "__main__":
    main()
