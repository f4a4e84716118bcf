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
import os
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
    warmup: int = 1
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


def _timed(fn, active: bool) -> tuple[float, float]:
    """(slowest rank's wall seconds, this rank's main-thread CPU seconds) of one step."""
    dist.barrier()
    c0, t0 = time.thread_time(), time.perf_counter()
    if active:
        fn()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    cpu = time.thread_time() - c0
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt), cpu


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

        def single_mb_step():  # the same m microbatches, one after the other (gradient accumulation)
            total = 0.0
            for xs, ys in zip(x.chunk(setup.microbatches), y.chunk(setup.microbatches)):
                loss = zoo.cross_entropy_loss(single(xs), ys) / setup.microbatches
                loss.backward()
                total += float(loss.detach())
            losses["single_mb"] = total

        def zero():
            pm.zero_grad(set_to_none=True)
            single.zero_grad(set_to_none=True)
            for st in stages:
                st.submod.zero_grad(set_to_none=True)

        runs = [("fxsplit", fx_step, True), ("ptd", ptd_step, True), ("single", single_step, rank == 0),
                ("single_mb", single_mb_step, rank == 0)]
        times: dict[str, list[float]] = {k: [] for k, _, _ in runs}
        waits: list[float] = []  # fxsplit: seconds this rank blocked in receives (bubble + transfers)
        cpus: dict[str, list[float]] = {k: [] for k, _, _ in runs}
        first_losses = None
        for i in range(setup.warmup + setup.steps):
            order = runs if i % 2 == 0 else runs[::-1]
            for name, fn, active in order:
                dt, cpu = _timed(fn, active)
                if name == "fxsplit" and i >= setup.warmup:
                    waits.append(pm._runtime._channels[True].wait_seconds)
                zero()
                if i >= setup.warmup:
                    times[name].append(dt)
                    cpus[name].append(cpu)
            if i == 0:
                first_losses = dict(losses)
        sim_plan = pm.plan.simulate()
        est_work = setup.microbatches * sum(s.time for s in pm.plan.split.stages)
        sim_bal = schedules.simulate(pm.plan.schedule, forward=1 / 3, backward=2 / 3)
        out[label] = {
            "times": times, "cpu": cpus, "waits": waits, "losses": first_losses, "paths": paths, "setup_s": (t_fx, t_ptd),
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


def _med(xs) -> float:
    return statistics.median(xs)


def cpu_single_mb(results: list[dict], label: str) -> list[float]:
    return results[0][label]["cpu"]["single_mb"]


def report(results: list[dict], setup: Setup, load: tuple[float, float]) -> str:
    """Medians over the timed rounds; ratios are per round (same round, same machine load)."""
    p = len(results)
    m = setup.microbatches
    ideal = m / (m + p - 1) * p
    lines = [
        f"GPT {setup.layers} layers, width {setup.width}, vocab {setup.vocab}, seq {setup.seq}, batch {setup.batch}; "
        f"p={p}, m={m}, gloo, 1 thread per rank; {setup.warmup} warmup + {setup.steps} timed rounds; "
        f"ideal speedup m/(m+p-1)*p = {ideal:.3f}; 1-min load average {load[0]:.1f} -> {load[1]:.1f} "
        f"on {os.cpu_count()} cores",
        f"{'schedule':<15} {'T1 s':>6} {'fx s':>6} {'PTD s':>6} {'fx/PTD':>6} {'fx %id':>6} {'PTD %id':>7} "
        f"{'pred plan':>9} {'pred bal':>8} {'fx cpu':>6} {'PTD cpu':>7} {'cpu eff fx':>10} {'cpu eff PTD':>11}",
    ]
    for label in setup.schedules:
        r0 = results[0][label]
        w = r0["times"]
        n = len(w["single"])
        t1 = _med(w["single"])
        ratio = _med([w["fxsplit"][i] / w["ptd"][i] for i in range(n)])
        fx_id = _med([w["single"][i] / w["fxsplit"][i] / ideal for i in range(n)])
        ptd_id = _med([w["single"][i] / w["ptd"][i] / ideal for i in range(n)])
        cpu_single = results[0][label]["cpu"]["single"]
        cpu_rank = {k: [max(r[label]["cpu"][k][i] for r in results) for i in range(n)] for k in ("fxsplit", "ptd")}
        eff = {k: _med([cpu_single[i] / (p * cpu_rank[k][i]) for i in range(n)]) for k in cpu_rank}
        lines.append(
            f"{label + ' v=' + str(SCHEDULES[label][1]):<15} {t1:6.3f} {_med(w['fxsplit']):6.3f} {_med(w['ptd']):6.3f} "
            f"{ratio:6.3f} {fx_id:6.3f} {ptd_id:7.3f} {r0['sim_plan_ratio'] * t1:9.3f} {r0['sim_bal_ratio'] * t1:8.3f} "
            f"{_med(cpu_rank['fxsplit']):6.3f} {_med(cpu_rank['ptd']):7.3f} {eff['fxsplit']:10.3f} {eff['ptd']:11.3f}"
        )
        t1mb = _med(w["single_mb"])
        mb_ideal = _med([w["single_mb"][i] / w["fxsplit"][i] / ideal for i in range(n)])
        per_rank = lambda k: [round(_med(r[label]["cpu"][k]), 3) for r in results]  # noqa: E731
        lines.append(
            f"    single process over the m microbatches: {t1mb:.3f} s (CPU {_med(cpu_single_mb(results, label)):.3f} s); "
            f"fx %ideal against it {mb_ideal:.3f}; CPU s per rank: fxsplit {per_rank('fxsplit')}, "
            f"PTD {per_rank('ptd')}; fxsplit blocked in receives per rank "
            f"{[round(_med(r[label]['waits']), 3) for r in results]} s"
        )
        rel = _losses_agree([r[label]["losses"] for r in results])
        lines.append(
            f"    split at {r0['paths']}; first-step losses agree to {rel:.1e} (fxsplit, PTD, single); "
            f"setup s rank 0 (fxsplit, PTD) {tuple(round(t, 1) for t in r0['setup_s'])}"
        )
        lines.append("    wall s per round: " + "; ".join(
            f"{k} " + " ".join(f"{t:.3f}" for t in v) for k, v in w.items()))
    lines.append(
        "columns (all times wall s unless CPU): medians over rounds; fx/PTD, %id (speedup T1/step over the ideal) and cpu eff are "
        "medians of per-round ratios; pred = simulator makespan scaled to T1 (plan: estimated stage "
        "costs; bal: balanced); cpu = slowest rank's main-thread CPU s per step; cpu eff = T1 CPU / "
        "(p * that): 1.0 = no per-rank work beyond an even split of the single process")
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
    load0 = os.getloadavg()[0]
    results = run_distributed(_rank_main, 2, setup, timeout=900)
    print(report(results, setup, (load0, os.getloadavg()[0])))
    print(f"wall {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
