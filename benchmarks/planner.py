"""The auto-planner (fxsplit.planner, strategy="auto"): predicted vs measured here, and at scale on paper.

1. here: a small GPT on 4 gloo ranks of this machine, >= 12 layouts (pp in {1, 2, 4}, tp in {1, 2},
   dp, m, 1F1B / interleaved / ZB-H1 / ZB-V, with and without checkpointing) plus the planner's
   own pick. Hardware is ``Hardware.measure()`` (collective over the 4 ranks). The machine is
   shared with other jobs, so everything is measured in alternating rounds: every layout is built
   first (with the planner's stage boundaries, split_points), then each round times one step of
   every layout (the order flipping every round, after one warmup step each; the slowest rank)
   and one calibration round; each layout's figure is its median. The calibration ([Note:
   calibration] in fxsplit.planner.score) comes from the median calibration round: compute scale
   and per-node overhead from rank 0 alone timing the unsplit model's forward + backward at batch
   1 and 4 (the others waiting), and ``host_cores``, the cores the 4 ranks get between them, from
   the 4 ranks running the same at once (4 x alone / together); then the runtime's factor on the
   compute (a pipelined step runs slower than the unsplit model) and the per-action overhead,
   fitted on three more layouts timed in the same rounds (``PROBES``, not among the evaluated). A first
   calibration of 3 rounds only chooses the pick to build; the pick reported is the search's with
   the final calibration (timed against the best layout in rounds of its own if it is another).
   Reported: mean absolute error of the predicted step time, Kendall tau of the ranking, the
   pick's measured time vs the best measured.
2. paper: published large-scale runs (fxsplit.testing.published: Megatron-LM's Table 1, GPT 1.7B to
   1T on A100s, arXiv:2104.04473; Llama 3 405B on 8K and 16K H100s, arXiv:2407.21783 Table 4;
   torchtitan's bf16 Llama 3 8B / 70B / 405B rows, in tokens/s per GPU), each figure cited there: the planner's prediction for the published layout next to the
   published TFLOP/s per GPU, the search's own pick for the same GPUs and batch, and where each
   step goes (the breakdown of [Note: step breakdown]).
3. speed: the search time of the 1T GPT for 3072 GPUs (its workload from 2 traced layers,
   ``repeat_layers``, timed with the search), and a Llama-70B config planned for tp=8 x pp=8 vs a bare torch.export of it: 1F1B,
   m = 16, global batch 16 (so one sample per microbatch, and the plan traces the batch static
   at it: [Note: a static batch] in fxsplit.graph.examples; ``--dynamic-batch`` times the plan
   with no global batch too, which takes any batch (traced at a marker batch: [Note: a marker
   batch] in fxsplit.graph.batch_marker), and with ``dynamic_batch=True`` (symbolic fake values); ``--dynamic-sequence`` times it with the sequence symbolic, which
   the default plan does not need: it serves every length up to 4096 padded, [Note: padding to
   the traced length] in fxsplit.api.padding). A 2-layer config is exported first, so that neither
   timed call pays torch's one-time warm-up.

    .venv/bin/python benchmarks/planner.py here [--steps 5]
    .venv/bin/python benchmarks/planner.py paper [--runs gpt-145.6b,llama3-405b-8192]
    .venv/bin/python benchmarks/planner.py speed [--skip-70b] [--skip-1t] [--dynamic-batch] [--dynamic-sequence]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
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
OPTIMIZER = "sgd"  # every layout trains with torch.optim.SGD (no momentum); the model prices the same


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


# layouts timed only to fit the runtime's share of the step (not evaluated): few and many actions
PROBES = [_c(2, 1, 2, 1, "1f1b", 2), _c(2, 1, 2, 1, "1f1b", 8), _c(1, 1, 4, 2, "interleaved_1f1b", 4)]
assert not set(PROBES) & set(LAYOUTS)


def _fit_runtime(w, hw, cal, measured: dict):
    """``cal`` with the runtime's factor k (on compute scale and per-node overhead: a pipelined
    step runs slower than the unsplit model it was timed on) and the per-action overhead fitted to
    the probe layouts: the (k, a) of a grid with the least mean absolute relative error."""
    best = None
    for k in [0.6 + 0.05 * i for i in range(21)]:
        for a in [0.0] + [2e-4 * (150 ** (j / 29)) for j in range(30)]:
            c = dataclasses.replace(cal, compute_scale=cal.compute_scale * k, node_overhead_s=cal.node_overhead_s * k,
                                    action_overhead_s=a)
            sc = Scorer(w, hw, math.inf, c, optimizer=OPTIMIZER)
            err = statistics.mean(abs(sc.score(p, simulate=True).step_time - t) / t for p, t in measured.items())
            if best is None or err < best[0]:
                best = (err, c)
    return best[1]


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
    x = torch.randint(0, GPT_HERE["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, GPT_HERE["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(2))

    def calibration_round() -> tuple[float, float, float]:
        """(rank 0 alone: fwd + bwd of the unsplit model at batch 1, at batch 4; all ranks at once
        at batch 4, the slowest): timed like a layout, inside the rounds."""
        dist.barrier()  # rank 0 alone (the others wait)
        a1, a4 = (_fwd_bwd_seconds(model, 1, 2), _fwd_bwd_seconds(model, 4, 2)) if rank == 0 else (0.0, 0.0)
        dist.barrier()
        together = torch.tensor([_fwd_bwd_seconds(model, 4, 2)], dtype=torch.float64)
        dist.all_reduce(together, op=dist.ReduceOp.MAX)
        box = [(a1, a4)]
        dist.broadcast_object_list(box, src=0)
        return box[0][0], box[0][1], float(together)

    def calibration(rounds: list) -> "fxsplit.planner.Calibration":
        """[Note: calibration] from the median calibration round: compute scale and per-node overhead
        from rank 0 alone at two batch sizes; ``host_cores`` the cores the 4 ranks get between them
        (the machine is shared with other jobs): 4 x alone / together, within [1, core count]."""
        a1, a4, tg = (statistics.median(r[k] for r in rounds) for k in range(3))
        cores = min(max(world * a4 / tg, 1.0), float(os.cpu_count() or 1))
        return calibrate(w, hw, {1: a1, 4: a4}, host_cores=cores)

    def build(c, scorer):
        s = scorer.score(c, simulate=True)
        split = tuple(w.group_paths[k] for k in s.cuts[1:-1]) or None
        pm = fxsplit.parallelize(model, args, loss_fn=zoo.cross_entropy_loss, timeout=120, verify=False,
                                 hardware=hw, split_points=split, **c.config_fields())
        opt = torch.optim.SGD(pm.parameters(), lr=1e-3)
        d, D = pm.coords["dp"], c.dp
        xs, ys = x[d * BATCH // D:(d + 1) * BATCH // D], y[d * BATCH // D:(d + 1) * BATCH // D]
        return pm, opt, xs, ys

    def one_step(built) -> float:
        pm, opt, xs, ys = built
        dist.barrier()
        t0 = time.perf_counter()
        pm.step(xs, target=ys)
        opt.step()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        opt.zero_grad()
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank
        return float(dt)

    def alternate(built: list, n: int) -> tuple[list[float], list]:
        """Medians over ``n`` rounds of one step of every layout and one calibration round, the
        order flipping every round (the machine is shared: a burst of others' load hits every
        layout and the calibration alike); also the calibration rounds."""
        for b in built:
            one_step(b)  # warmup
        times, cal_rounds = [[] for _ in built], []
        for r in range(n):
            if r % 2 == 0:
                cal_rounds.append(calibration_round())
            order = range(len(built)) if r % 2 == 0 else reversed(range(len(built)))
            for k in order:
                times[k].append(one_step(built[k]))
            if r % 2 == 1:
                cal_rounds.append(calibration_round())
        return [statistics.median(t) for t in times], cal_rounds

    # a first calibration (3 rounds) only to choose which layouts to build: the planner's pick
    first = calibration([calibration_round() for _ in range(3)])
    pick0 = search(w, world_size=world, global_batch=BATCH, hardware=hw, calibration=first,
                   optimizer=OPTIMIZER).best.candidate
    layouts = list(LAYOUTS) + ([pick0] if pick0 not in LAYOUTS else [])
    plain = Scorer(w, hw, math.inf, first, optimizer=OPTIMIZER)
    built = [build(c, plain) for c in PROBES + layouts]
    measured, cal_rounds = alternate(built, steps)
    # the calibration of the rounds, then the runtime's factor and per-action overhead from the probes
    cal = _fit_runtime(w, hw, calibration(cal_rounds), dict(zip(PROBES, measured)))
    measured = measured[len(PROBES):]
    scorer = Scorer(w, hw, math.inf, cal, optimizer=OPTIMIZER)
    pick = search(w, world_size=world, global_batch=BATCH, hardware=hw, calibration=cal,
                  optimizer=OPTIMIZER).best.candidate
    times = dict(zip(layouts, measured))
    if pick not in times:  # measured against the best layout in rounds of its own
        best = min(times, key=times.get)
        pair, _ = alternate([build(pick, scorer), built[len(PROBES) + layouts.index(best)]], steps)
        times[pick] = times[best] * pair[0] / pair[1]
        layouts.append(pick)
    rows = [dict(layout=c.short(), predicted=scorer.score(c, simulate=True).step_time, measured=times[c],
                 pick=c == pick, method=scorer.score(c, simulate=True).method) for c in layouts]
    spread = [statistics.pstdev(r[k] for r in cal_rounds) / statistics.mean(r[k] for r in cal_rounds)
              for k in range(3)]
    return dict(rows=rows, hardware=hw.source, calibration=cal, calibration_spread=spread)


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
    print(f"calibration: {res['calibration']}; spread (std/mean) over the rounds of rank 0 alone at b=1, "
          f"b=4, all at once: " + ", ".join(f"{100 * x:.0f}%" for x in res["calibration_spread"]))
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


# -- at scale, on paper: the runs and their cited figures are fxsplit.testing.published ([Note: published runs])
def _layout(c) -> str:
    shard = f" (dp_shard {c.dp_shard})" if c.dp_shard > 1 else ""
    return (f"t={c.tp}{'+sp' if c.sequence_parallel else ''}, p={c.pp}, d={c.dp}{shard}, v={c.stages_per_rank} "
            f"{c.schedule}, b={c.microbatch_size}, ckpt {c.activation_checkpointing}")


def paper(runs) -> None:
    from fxsplit.testing.published import RUNS, predict

    print("| run | GPUs | batch | published t, p, d | published TFLOP/s/GPU (or tokens/s/GPU) | predicted for the published layout "
          "| planner's pick | predicted for the pick | search s |")
    print("| --- | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: |")
    cache: dict = {}  # one workload per model shape
    explained = []
    for name in runs:
        run = RUNS[name]
        row = predict(run, cache=cache)
        pub, pick = row.published, row.pick
        same = (pick.candidate.tp, pick.candidate.pp, pick.candidate.dp) == (run.t, run.p, run.d)
        tokens = run.tokens_per_gpu_s > 0  # torchtitan publishes tokens/s per GPU
        published_fig = f"{run.tokens_per_gpu_s:g} tokens/s" if tokens else f"{run.tflops:g}"
        predicted_fig = f"{row.tokens_per_gpu_s:.0f} tokens/s" if tokens else f"{row.predicted:.0f}"
        print(f"| {run.name} ({run.source}) | {run.gpus} | {run.global_batch} | t={run.t}, p={run.p}, d={run.d}"
              f"{' (FSDP)' if run.shard else ''} | {published_fig} | {predicted_fig} ({100 * row.error:+.0f}%; "
              f"{_layout(pub.candidate)}) | {_layout(pick.candidate)}{' (the published t, p, d)' if same else ''} "
              f"| {row.pick_tflops:.0f} | {row.search_seconds:.1f} |")
        explained.append(f"- {run.name}: published layout {pub.breakdown}\n  pick {pick.breakdown}")
        sys.stdout.flush()
    print("\nWhere each step goes (busiest rank; [Note: step breakdown] in fxsplit.planner.breakdown):")
    print("\n".join(explained))


def speed(skip_70b: bool, skip_1t: bool, dynamic_batch: bool = False, dynamic_sequence: bool = False) -> None:
    if not skip_1t:
        _speed_1t()
    if not skip_70b:
        _speed_70b(dynamic_batch, dynamic_sequence)


def _speed_1t() -> None:
    from fxsplit.testing.published import RUNS, workload

    run = RUNS["gpt-1008b"]
    n, B = run.gpus, run.global_batch
    hw = fxsplit.Hardware.preset(run.hardware)
    # the workload of 2 traced layers extended to 128 (repeat_layers: the layers are identical; a
    # trace of all 128 on the meta device takes minutes here and gives the same arrays)
    t0 = time.perf_counter()
    w = workload(run)
    trace_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    r = search(w, world_size=n, global_batch=B, hardware=hw)
    search_s = time.perf_counter() - t0
    print(f"1T GPT (128 layers, h 25600) for {n} GPUs: trace of 2 layers + analysis + extension {trace_s:.1f}s, "
          f"search {search_s:.1f}s ({r.num_candidates} candidates, {r.pruned} not scored by their bound); "
          f"searched in {trace_s + search_s:.1f}s; "
          f"peak RSS {peak_rss_mb():.0f} MB; pick {r.best.candidate.short()}; re-partitioned under the memory limit "
          f"{r.repartitioned[0]} (skipped past the cap {r.repartitioned[1]})")


def _speed_70b(dynamic_batch: bool = False, dynamic_sequence: bool = False) -> None:
    from fxsplit.api.padding import traced_length
    from fxsplit.testing import hf_zoo

    hw = fxsplit.Hardware.preset("a100-80gb")
    small, sargs, skwargs = hf_zoo.meta_llama_70b(seq_len=4096, num_hidden_layers=2)
    torch.export.export(small, sargs, skwargs, strict=False)  # torch's one-time warm-up, timed by neither
    model, args, kwargs = hf_zoo.meta_llama_70b(seq_len=4096)
    # each timed call starts without the one before's garbage: an export leaves ~5.6k nodes in
    # reference cycles, and the next call would pay their collection (~2 s of the plan's export)
    gc.collect()
    t0 = time.perf_counter()
    torch.export.export(model, args, kwargs, strict=False)
    export_s = time.perf_counter() - t0
    gc.collect()
    t0 = time.perf_counter()
    p = fxsplit.plan(model, args, kwargs, tp=8, pp=8, schedule="1f1b", microbatches=16, global_batch_size=16,
                     hardware=hw)
    plan_s = time.perf_counter() - t0
    info = p.graph.meta["fxsplit"]
    print(f"Llama-70B on meta: bare torch.export {export_s:.1f}s; fxsplit.plan tp=8 x pp=8, global batch 16 in "
          f"16 microbatches {plan_s:.1f}s = {plan_s / export_s:.2f}x (traced with {info.method}, batch "
          f"{'symbolic' if 'batch' in info.symbols else f'static at {p.config.microbatch_size}'}; serves every "
          f"sequence length up to {traced_length(p)}); peak RSS {peak_rss_mb():.0f} MB")
    if dynamic_batch:
        gc.collect()
        t0 = time.perf_counter()
        any_batch = fxsplit.plan(model, args, kwargs, tp=8, pp=8, schedule="1f1b", microbatches=16, hardware=hw)
        dyn_s = time.perf_counter() - t0
        how = "marker batch" if "marker batch" in any_batch.graph.meta["fxsplit"].reason else "batch symbolic"
        print(f"  the same with no global batch (any batch runs; {how}): {dyn_s:.1f}s = {dyn_s / export_s:.2f}x; "
              f"peak RSS {peak_rss_mb():.0f} MB")
        del any_batch
        gc.collect()
        t0 = time.perf_counter()
        fxsplit.plan(model, args, kwargs, tp=8, pp=8, schedule="1f1b", microbatches=16, hardware=hw,
                     dynamic_batch=True)
        sym_s = time.perf_counter() - t0
        print(f"  the same with dynamic_batch=True (symbolic fake values): {sym_s:.1f}s = {sym_s / export_s:.2f}x; "
              f"peak RSS {peak_rss_mb():.0f} MB")
    if dynamic_sequence:
        gc.collect()
        t0 = time.perf_counter()
        fxsplit.plan(model, args, kwargs, tp=8, pp=8, schedule="1f1b", microbatches=16, global_batch_size=16,
                     hardware=hw, dynamic_sequence=True)
        seq_s = time.perf_counter() - t0
        print(f"  the same with the sequence symbolic (dynamic_sequence=True): {seq_s:.1f}s = {seq_s / export_s:.2f}x; "
              f"peak RSS {peak_rss_mb():.0f} MB")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("here", "paper", "speed"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--runs", default="", help="names of fxsplit.testing.published.RUNS (default: all)")
    ap.add_argument("--skip-70b", action="store_true")
    ap.add_argument("--skip-1t", action="store_true")
    ap.add_argument("--dynamic-batch", action="store_true")
    ap.add_argument("--dynamic-sequence", action="store_true")
    ns = ap.parse_args()
    if ns.what == "here":
        here(ns.steps)
    elif ns.what == "paper":
        from fxsplit.testing.published import RUNS

        paper([r for r in ns.runs.split(",") if r] or list(RUNS))
    else:
        speed(ns.skip_70b, ns.skip_1t, ns.dynamic_batch, ns.dynamic_sequence)
