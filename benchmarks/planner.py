"""The auto-planner (fxsplit.planner, strategy="auto"): predicted vs measured here, and at scale on paper.

1. here: a small GPT on 4 gloo ranks of this machine, >= 12 layouts (pp in {1, 2, 4}, tp in {1, 2},
   dp, m, 1F1B / interleaved / ZB-H1 / ZB-V, with and without checkpointing) plus the planner's
   own pick. Hardware is ``Hardware.measure()`` (collective over the 4 ranks); the roofline is
   calibrated from one forward + backward of the unsplit model at two batch sizes, timed by rank 0
   alone, and the 4 ranks share this host's cores (``host_cores``: a step takes at least the
   ranks' total compute over the cores; [Note: calibration] in fxsplit.planner.score); the
   per-action overhead is fitted on one more layout (dp=2 x pp=2, m=2, not among the evaluated ones).
   Each layout: the fastest of ``--steps`` timed steps after one warmup (the machine is shared). Each layout is built with the
   planner's stage boundaries (split_points) and timed for a few optimizer steps (median; the
   slowest rank). Reported: mean absolute error of the predicted step time, Kendall tau of the
   ranking, the pick's measured time vs the best measured.
2. paper: GPT configurations of Narayanan et al. 2021, "Efficient Large-Scale Language Model
   Training on GPU Clusters Using Megatron-LM" (arXiv:2104.04473), Table 1, on the a100-80gb
   preset: the planner's search for each run's GPU count and batch, next to the published layout
   (t, p) and throughput (TFLOP/s per GPU), with the published layout scored by the same model.
   Model FLOPs per step by the paper's eq. (3): 96 B s l h^2 (1 + s / 6h + V / (16 l h)).
3. speed: the search time (analysis + search, trace excluded and reported) of the 1T GPT for 3072
   GPUs, and a Llama-70B config planned for tp=8 x pp=8 vs a bare torch.export of it.

    .venv/bin/python benchmarks/planner.py here [--steps 3]
    .venv/bin/python benchmarks/planner.py paper [--runs 145.6B,1008B]
    .venv/bin/python benchmarks/planner.py speed [--skip-70b] [--skip-1t]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time

import torch

import fxsplit
from fxsplit.graph.trace import trace
from fxsplit.planner import Candidate, Scorer, analyze, calibrate, search
from fxsplit.testing import zoo

from _common import launch, peak_rss_mb

GPT_HERE = dict(n_layer=8, n_embd=128, n_head=4, vocab_size=256, block_size=64)
SEQ, BATCH = 64, 16  # global batch


def _c(dp, tp, pp, v, sched, m, ckpt="none"):
    return Candidate(dp=dp, tp=tp, pp=pp, stages_per_rank=v, schedule=sched, microbatches=m,
                     microbatch_size=BATCH // (dp * m), activation_checkpointing=ckpt, sequence_parallel=False)


LAYOUTS = [
    _c(4, 1, 1, 1, "1f1b", 1), _c(4, 1, 1, 1, "1f1b", 2, "full"), _c(2, 2, 1, 1, "1f1b", 1),
    _c(2, 1, 2, 1, "1f1b", 4), _c(2, 1, 2, 1, "zb_h1", 4), _c(2, 1, 2, 1, "1f1b", 4, "full"),
    _c(1, 2, 2, 1, "1f1b", 4), _c(1, 2, 2, 2, "zbv", 4), _c(1, 1, 4, 1, "1f1b", 8),
    _c(1, 1, 4, 1, "zb_h1", 8), _c(1, 1, 4, 2, "zbv", 8), _c(1, 1, 4, 2, "interleaved_1f1b", 8),
    _c(1, 1, 4, 1, "1f1b", 8, "full"), _c(1, 1, 4, 1, "1f1b", 4),
]


def _fwd_bwd_seconds(model, b: int, reps: int = 3) -> float:
    x = torch.randint(0, GPT_HERE["vocab_size"], (b, SEQ))
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        model(x).float().sum().backward()
        best = min(best, time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return best


def _here_rank(rank: int, world: int, steps: int):
    import torch.distributed as dist

    torch.manual_seed(0)
    hw = fxsplit.Hardware.measure()
    hw = dataclasses.replace(hw, devices_per_node=world)  # the 4 ranks share this host
    model, args, _ = zoo.make_gpt(**GPT_HERE, seq_len=SEQ, batch_size=BATCH)
    w = analyze(trace(model, args, decompose_attention=True), world_size=world, hardware=hw)
    dist.barrier()  # rank 0 alone times the unsplit model (the others wait): an uncontended core
    cal = calibrate(w, hw, {1: _fwd_bwd_seconds(model, 1), 4: _fwd_bwd_seconds(model, 4)},
                    host_cores=os.cpu_count() or 1) if rank == 0 else None
    dist.barrier()
    box = [cal]
    dist.broadcast_object_list(box, src=0)  # every rank predicts with rank 0's calibration
    cal = box[0]
    x = torch.randint(0, GPT_HERE["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, GPT_HERE["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(2))

    def measure(c, scorer):
        s = scorer.score(c, simulate=True)
        split = tuple(w.group_paths[k] for k in s.cuts[1:-1]) or None
        pm = fxsplit.parallelize(model, args, loss_fn=zoo.cross_entropy_loss, timeout=120, verify=False,
                                 hardware=hw, split_points=split, **c.config_fields())
        opt = torch.optim.SGD(pm.parameters(), lr=1e-3)
        d, D = pm.coords["dp"], c.dp
        xs, ys = x[d * BATCH // D:(d + 1) * BATCH // D], y[d * BATCH // D:(d + 1) * BATCH // D]
        times = []
        for i in range(steps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            pm.step(xs, target=ys)
            opt.step()
            opt.zero_grad()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if i:  # the first step warms up
                times.append(float(dt))
        return s, min(times)  # the least disturbed step: the machine is shared

    # the per-action overhead (runtime, p2p) from one pipeline layout outside the evaluated set
    probe = _c(2, 1, 2, 1, "1f1b", 2)
    s0, t0 = measure(probe, Scorer(w, hw, math.inf, cal))
    a = max(t0 - s0.step_time, 0.0) / (3 * (probe.microbatches + probe.pp - 1))
    cal = dataclasses.replace(cal, action_overhead_s=a)
    scorer = Scorer(w, hw, math.inf, cal)
    pick = search(w, world_size=world, global_batch=BATCH, hardware=hw, calibration=cal).best.candidate
    layouts = list(LAYOUTS) + ([pick] if pick not in LAYOUTS else [])
    rows = []
    for c in layouts:
        s, t = measure(c, scorer)
        rows.append(dict(layout=c.short(), predicted=s.step_time, measured=t, pick=c == pick, method=s.method))
    return dict(rows=rows, hardware=hw.source, calibration=cal)


def kendall_tau(a, b) -> float:
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            s += (1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1 if (a[i] - a[j]) * (b[i] - b[j]) < 0 else 0)
    return 2 * s / (n * (n - 1))


def here(steps: int) -> None:
    results, load, wall = launch(_here_rank, 4, steps, timeout=3000)
    res = results[0]
    rows = res["rows"]
    print(f"hardware: {res['hardware']}")
    print(f"calibration: {res['calibration']}")
    print(f"| layout | predicted | measured | error |")
    print("| --- | ---: | ---: | ---: |")
    for r in sorted(rows, key=lambda r: r["measured"]):
        err = (r["predicted"] - r["measured"]) / r["measured"]
        tag = " **(planner's pick)**" if r["pick"] else ""
        print(f"| {r['layout']}{tag} | {r['predicted'] * 1e3:.1f} ms | {r['measured'] * 1e3:.1f} ms | {100 * err:+.0f}% |")
    mae = statistics.mean(abs(r["predicted"] - r["measured"]) / r["measured"] for r in rows)
    tau = kendall_tau([r["predicted"] for r in rows], [r["measured"] for r in rows])
    best = min(r["measured"] for r in rows)
    pick = next(r for r in rows if r["pick"])
    print(f"\n{len(rows)} layouts; mean abs error {100 * mae:.1f}%; Kendall tau {tau:.2f}; planner's pick "
          f"{pick['measured'] * 1e3:.1f} ms measured = {100 * (pick['measured'] / best - 1):+.1f}% vs the best "
          f"measured ({best * 1e3:.1f} ms); load {load[0]:.1f} -> {load[1]:.1f}, wall {wall:.0f}s")


# -- at scale, on paper
# Narayanan et al. 2021 (arXiv:2104.04473) Table 1: (params, heads, hidden, layers, t, p, GPUs,
# global batch, achieved TFLOP/s per GPU). Sequence 2048, vocabulary 51200, A100 80GB (Selene).
TABLE1 = {
    "145.6B": (96, 12288, 80, 8, 8, 1536, 2304, 148),
    "529.6B": (128, 20480, 105, 8, 35, 2520, 2520, 163),
    "1008B": (160, 25600, 128, 8, 64, 3072, 3072, 163),
}
S_PAPER, V_PAPER = 2048, 51200


def _paper_gpt(heads: int, hidden: int, layers: int):
    with torch.device("meta"):
        model = zoo.GPT(zoo.GPTConfig(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=V_PAPER,
                                      block_size=S_PAPER, tie_weights=True, bias=True))
    return model, (torch.zeros(1, S_PAPER, dtype=torch.long, device="meta"),)


def _model_flops(B: int, l: int, h: int) -> float:
    return 96 * B * S_PAPER * l * h * h * (1 + S_PAPER / (6 * h) + V_PAPER / (16 * l * h))


def paper(runs) -> None:
    hw = fxsplit.Hardware.preset("a100-80gb")
    print(f"hardware: {hw.source}; matmul efficiency {hw.matmul_efficiency:.3f}")
    print("| run (Table 1) | GPUs | batch | published t, p, d | published TFLOP/s/GPU | predicted for the published layout "
          "| planner's pick | predicted for the pick | search s |")
    print("| --- | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: |")
    for name in runs:
        heads, h, l, t, p, n, B, tflops = TABLE1[name]
        model, args = _paper_gpt(heads, h, l)
        t0 = time.perf_counter()
        gm = trace(model, args)
        trace_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        w = analyze(gm, world_size=n, hardware=hw)
        r = search(w, world_size=n, global_batch=B, hardware=hw)
        search_s = time.perf_counter() - t0
        F = _model_flops(B, l, h)
        d = n // (t * p)
        scorer = Scorer(w, hw, hw.memory_bytes)
        published = []
        for sched, v in (("1f1b", 1), ("interleaved_1f1b", 2)):
            if v * p > w.num_groups - 2:
                continue
            c = Candidate(dp=d, tp=t, pp=p, stages_per_rank=v, schedule=sched, microbatches=B // d,
                          microbatch_size=1, activation_checkpointing="full", sequence_parallel=False)
            published.append(scorer.score(c, simulate=True))
        pub = min(published, key=lambda s: s.step_time)
        best = r.best
        tf = lambda s: F / (s.step_time * n) / 1e12  # noqa: E731
        c = best.candidate
        print(f"| {name} | {n} | {B} | t={t}, p={p}, d={d} | {tflops} | {tf(pub):.0f} ({pub.candidate.schedule}, "
              f"ckpt full, b=1{'' if pub.fits else ', does not fit'}) | t={c.tp}{'+sp' if c.sequence_parallel else ''}, "
              f"p={c.pp}, d={c.dp}, v={c.stages_per_rank} {c.schedule}, b={c.microbatch_size}, ckpt "
              f"{c.activation_checkpointing} | {tf(best):.0f} | {search_s:.1f} (trace {trace_s:.0f}) |")
        sys.stdout.flush()


def speed(skip_70b: bool, skip_1t: bool) -> None:
    if not skip_1t:
        _speed_1t()
    if not skip_70b:
        _speed_70b()


def _speed_1t() -> None:
    heads, h, l, _, _, n, B, _ = TABLE1["1008B"]
    model, args = _paper_gpt(heads, h, l)
    t0 = time.perf_counter()
    gm = trace(model, args)
    trace_s = time.perf_counter() - t0
    hw = fxsplit.Hardware.preset("a100-80gb")
    t0 = time.perf_counter()
    w = analyze(gm, world_size=n, hardware=hw)
    analyze_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    r = search(w, world_size=n, global_batch=B, hardware=hw)
    search_s = time.perf_counter() - t0
    print(f"1T GPT (128 layers, h 25600) for {n} GPUs: trace {trace_s:.1f}s (once), analysis {analyze_s:.1f}s, "
          f"search {search_s:.1f}s ({r.num_candidates} candidates); searched in {analyze_s + search_s:.1f}s; "
          f"peak RSS {peak_rss_mb():.0f} MB; pick {r.best.candidate.short()}")


def _speed_70b() -> None:
    from fxsplit.testing import hf_zoo

    hw = fxsplit.Hardware.preset("a100-80gb")
    model, args, kwargs = hf_zoo.meta_llama_70b(seq_len=4096)
    t0 = time.perf_counter()
    torch.export.export(model, args, kwargs, strict=False)
    export_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    p = fxsplit.plan(model, args, kwargs, tp=8, pp=8, schedule="1f1b", hardware=hw)
    plan_s = time.perf_counter() - t0
    print(f"Llama-70B on meta: bare torch.export {export_s:.1f}s; fxsplit.plan tp=8 x pp=8 {plan_s:.1f}s "
          f"= {plan_s / export_s:.2f}x (traced with {p.graph.meta['fxsplit'].method}); peak RSS {peak_rss_mb():.0f} MB")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("here", "paper", "speed"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--runs", default=",".join(TABLE1))
    ap.add_argument("--skip-70b", action="store_true")
    ap.add_argument("--skip-1t", action="store_true")
    ns = ap.parse_args()
    if ns.what == "here":
        here(ns.steps)
    elif ns.what == "paper":
        paper([r for r in ns.runs.split(",") if r])
    else:
        speed(ns.skip_70b, ns.skip_1t)
