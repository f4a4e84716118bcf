"""Pipeline step time: fxsplit against torch.distributed.pipelining (PTD) and one process.

Terms: p pipeline ranks, v stages per rank (S = p * v), m microbatches; T1 the single-process
step time (one thread, whole batch); ideal speedup m / (m + p - 1) * p (the 1F1B / GPipe bubble;
interleaving shrinks the bubble, but we quote the same ideal for both schedules, as the issue does).

    .venv/bin/python benchmarks/pipeline_vs_ptd.py                      # issue-4 GPT, m=4, 1f1b + interleaved
    .venv/bin/python benchmarks/pipeline_vs_ptd.py --microbatches 8 --steps 4 --schedules 1f1b

Method: 2 ranks (fxsplit.testing.run_distributed: gloo, one thread per rank). In ONE launch, for
each schedule, both ranks build the fxsplit ParallelModel and PTD's pipeline over the same weights
and the same split (fxsplit's plan split points, given to PTD as ``SplitPoint.BEGINNING`` at the
module path of each stage's first node), then alternate rounds of: fxsplit step, PTD step,
single-process step (rank 0 only; rank 1 waits in a barrier). The order inside a round flips every
round, because the machine is shared and drifts. Every timed step starts after a barrier; its time
is the slowest rank's. Steps are forward + backward over the whole batch (no optimizer step),
gradients zeroed between steps outside the timing. The first step's losses are compared.

Simulator: ``plan.simulate()`` gives a makespan in the cost model's seconds; scaled by
T1 / (m * sum of estimated stage times) it predicts the step time ("pred(plan)": the plan's
estimated imbalance included); "pred(bal)" is the perfectly balanced makespan
``simulate(schedule, 1/3, 2/3)`` in units of one rank's share of one microbatch, times T1 / (m p).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

import fxsplit
from fxsplit import schedules, zoo
from fxsplit.testing import run_distributed

SCHEDULES = {"1f1b": ("1f1b", 1), "interleaved": ("interleaved_1f1b", 2)}


@dataclass(frozen=True)
class Setup:
    layers: int = 8
    width: int = 256
    heads: int = 8
    vocab: int = 4096
    seq: int = 128
    batch: int = 16
    microbatches: int = 4
    warmup: int = 2
    steps: int = 5
    schedules: tuple[str, ...] = ("1f1b", "interleaved")


def build_model(s: Setup):
    """The issue-4 GPT (untied LM head: PTD's pipeline() does not handle a weight shared by two
    stages, and fxsplit's tied-gradient sum would be extra work PTD does not do)."""
    return zoo.make_gpt(n_layer=s.layers, n_embd=s.width, n_head=s.heads, vocab_size=s.vocab,
                        block_size=s.seq, seq_len=s.seq, batch_size=s.batch, tie_weights=False, seed=0)


def split_paths(plan) -> list[str]:
    """Module path of the first node of every stage after the first (PTD split_spec keys)."""
    nodes = {n.name: n for n in plan.graph.graph.nodes}
    paths = []
    for name in plan.split.starts[1:]:
        node = nodes[name]
        if node.op == "call_module":
            paths.append(str(node.target))
            continue
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        if not stack:
            raise ValueError(f"stage start {name!r} ({node.op} {node.target}) has no module path; "
                             "PTD can only split at module boundaries: pass split_points to fxsplit")
        paths.append(stack[-1][0])
    return paths


def _ptd(model, x, paths, setup: Setup, sched_name: str, v: int, rank: int, world: int):
    from torch.distributed.pipelining import (
        Schedule1F1B, ScheduleInterleaved1F1B, SplitPoint, pipeline)

    m = setup.microbatches
    pipe = pipeline(model, mb_args=(x[: x.shape[0] // m],),
                    split_spec={p: SplitPoint.BEGINNING for p in paths})
    num_stages = world * v
    if pipe.num_stages != num_stages:
        raise RuntimeError(f"PTD made {pipe.num_stages} stages from split points {paths}, expected {num_stages}")
    stages = [pipe.build_stage(s, torch.device("cpu")) for s in range(rank, num_stages, world)]
    if sched_name == "1f1b":
        sched = Schedule1F1B(stages[0], m, loss_fn=zoo.cross_entropy_loss)
    else:
        sched = ScheduleInterleaved1F1B(stages, m, loss_fn=zoo.cross_entropy_loss)
    first = any(st.is_first for st in stages)
    last = any(st.is_last for st in stages)
    return sched, stages, first, last


def _timed(fn, active: bool) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    if active:
        fn()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt)


def _rank_main(rank: int, world: int, setup: Setup) -> dict:
    torch.set_num_threads(1)
    model, (x,), _ = build_model(setup)
    g = torch.Generator().manual_seed(7)
    y = torch.randint(0, setup.vocab, (setup.batch, setup.seq), generator=g)
    single = copy.deepcopy(model)
    out: dict = {}
    for label in setup.schedules:
        sched_name, v = SCHEDULES[label]
        t0 = time.perf_counter()
        pm = fxsplit.parallelize(model, (x,), loss_fn=zoo.cross_entropy_loss, pp=world,
                                 microbatches=setup.microbatches, schedule=sched_name,
                                 stages_per_rank=v, timeout=120)
        t_fx = time.perf_counter() - t0
        paths = split_paths(pm.plan)
        t0 = time.perf_counter()
        sched, stages, first, last = _ptd(copy.deepcopy(model), x, paths, setup, label, v, rank, world)
        t_ptd = time.perf_counter() - t0
        losses: dict[str, float] = {}

        def fx_step():
            losses["fxsplit"] = float(pm.step(x, target=y))

        def ptd_step():
            mb_losses: list = []
            args = (x,) if first else ()
            sched.step(*args, target=y if last else None, losses=mb_losses if last else None)
            if last:
                losses["ptd"] = float(torch.stack(mb_losses).detach().mean())

        def single_step():
            loss = zoo.cross_entropy_loss(single(x), y)
            loss.backward()
            losses["single"] = float(loss.detach())

        def zero():
            pm.zero_grad(set_to_none=True)
            single.zero_grad(set_to_none=True)
            for st in stages:
                st.submod.zero_grad(set_to_none=True)

        runs = [("fxsplit", fx_step, True), ("ptd", ptd_step, True), ("single", single_step, rank == 0)]
        times: dict[str, list[float]] = {k: [] for k, _, _ in runs}
        first_losses = None
        for i in range(setup.warmup + setup.steps):
            order = runs if i % 2 == 0 else runs[::-1]
            for name, fn, active in order:
                dt = _timed(fn, active)
                zero()
                if i >= setup.warmup:
                    times[name].append(dt)
            if i == 0:
                first_losses = dict(losses)
        sim_plan = pm.plan.simulate()
        est_work = setup.microbatches * sum(s.time for s in pm.plan.split.stages)
        sim_bal = schedules.simulate(pm.plan.schedule, forward=1 / 3, backward=2 / 3)
        out[label] = {
            "times": times, "losses": first_losses, "paths": paths, "setup_s": (t_fx, t_ptd),
            "sim_plan_ratio": sim_plan.makespan / est_work,  # predicted step / T1
            "sim_bal_ratio": sim_bal.makespan / (setup.microbatches * world),
            "stage_est": [s.time for s in pm.plan.split.stages],
        }
        del pm, sched, stages
    return out


def _losses_agree(all_losses: list[dict]) -> float:
    merged: dict[str, float] = {}
    for d in all_losses:
        merged.update(d)
    vals = list(merged.values())
    return max(abs(a - b) / abs(b) for a in vals for b in vals)


def report(results: list[dict], setup: Setup) -> str:
    p = len(results)
    m = setup.microbatches
    ideal = m / (m + p - 1) * p
    lines = [
        f"GPT {setup.layers} layers, width {setup.width}, vocab {setup.vocab}, seq {setup.seq}, batch {setup.batch}; "
        f"p={p}, m={m}, gloo, 1 thread per rank; {setup.warmup} warmup + {setup.steps} timed rounds; "
        f"ideal speedup m/(m+p-1)*p = {ideal:.3f}",
        f"{'schedule':<12} {'T1 s':>7} {'fxsplit s':>9} {'PTD s':>7} {'fx/PTD':>7} {'fx spd':>7} "
        f"{'PTD spd':>7} {'fx %ideal':>9} {'PTD %ideal':>10} {'pred(plan)':>10} {'pred(bal)':>9} "
        f"{'split':<20}",
    ]
    for label in setup.schedules:
        r0 = results[0][label]
        med = {k: statistics.median(v) for k, v in r0["times"].items()}
        t1, tf, tp_ = med["single"], med["fxsplit"], med["ptd"]
        sf, sp = t1 / tf, t1 / tp_
        lines.append(
            f"{label + ' v=' + str(SCHEDULES[label][1]):<12} {t1:7.3f} {tf:9.3f} {tp_:7.3f} {tf / tp_:7.3f} "
            f"{sf:7.3f} {sp:7.3f} {sf / ideal:9.3f} {sp / ideal:10.3f} "
            f"{r0['sim_plan_ratio'] * t1:10.3f} {r0['sim_bal_ratio'] * t1:9.3f} {','.join(r0['paths']):<20}"
        )
        rel = _losses_agree([r[label]["losses"] for r in results])
        lines.append(
            f"    first-step losses {results[-1][label]['losses']} | {results[0][label]['losses']}: "
            f"max rel diff {rel:.1e}; setup s (fxsplit, PTD) rank0 "
            f"{tuple(round(t, 1) for t in r0['setup_s'])}"
        )
        lines.append("    raw s: " + "; ".join(
            f"{k} " + " ".join(f"{t:.3f}" for t in v) for k, v in r0["times"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    d = Setup()
    for f, val in asdict(d).items():
        if f == "schedules":
            ap.add_argument("--schedules", default=",".join(val), help="comma list of 1f1b, interleaved")
        else:
            ap.add_argument(f"--{f}", type=type(val), default=val)
    a = ap.parse_args(argv)
    kw = vars(a)
    kw["schedules"] = tuple(s for s in kw["schedules"].split(",") if s)
    bad = [s for s in kw["schedules"] if s not in SCHEDULES]
    if bad:
        ap.error(f"unknown schedules {bad}; choose from {sorted(SCHEDULES)}")
    setup = Setup(**kw)
    t0 = time.perf_counter()
    results = run_distributed(_rank_main, 2, setup, timeout=900)
    print(report(results, setup))
    print(f"wall {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
