"""Pipeline step time: fxsplit against torch.distributed.pipelining (PTD) and one process.

Terms: p pipeline ranks, v stages per rank (S = p * v), m microbatches; T1 the single-process
step time (one thread, whole batch); ideal speedup m / (m + p - 1) * p (the 1F1B / GPipe bubble;
interleaving shrinks the bubble, but we quote the same ideal for both schedules, as the issue does).

    .venv/bin/python benchmarks/pipeline_vs_ptd.py                      # issue-4 GPT, m=4, 1f1b + interleaved
    .venv/bin/python benchmarks/pipeline_vs_ptd.py --microbatches 8 --steps 4 --schedules 1f1b
    .venv/bin/python benchmarks/pipeline_vs_ptd.py --schedules zb_h1,zbv     # PTD's ZB1P / ZBV
    .venv/bin/python benchmarks/pipeline_vs_ptd.py --ranks 4 --microbatches 8 --schedules zbv
    .venv/bin/python benchmarks/pipeline_vs_ptd.py --schedules zbv --checkpointing full
    .venv/bin/python benchmarks/pipeline_vs_ptd.py --schedules 1f1b,zbv --compile
    .venv/bin/python benchmarks/pipeline_vs_ptd.py --schedules 1f1b,zbv --compile --ptd-compile both

Schedules: fxsplit's 1f1b / interleaved_1f1b / zb_h1 / zbv against PTD's Schedule1F1B /
ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble (ZB1P, one stage per rank) /
ScheduleZBVZeroBubble; for zbv both place the stages in a V (rank r holds stages r and 2p-1-r);
fxsplit's zb_auto (built from the plan's per-stage estimates) runs against PTD's ZB1P.

Method: ``--ranks`` p ranks, default 2 (fxsplit.testing.run_distributed: gloo, one thread per rank). In ONE launch, for
each schedule, both ranks build the fxsplit ParallelModel and PTD's pipeline over the same weights
and the same split (fxsplit's plan split points, given to PTD as ``SplitPoint.BEGINNING`` at the
module path of each stage's first node), then alternate rounds of: fxsplit step, PTD step,
single-process step (rank 0 only; rank 1 waits in a barrier). The order inside a round flips every
round, because the machine is shared and drifts. Every timed step starts after a barrier; its time
is the slowest rank's. Steps are forward + backward over the whole batch (no optimizer step),
gradients zeroed between steps outside the timing. The first step's losses are compared.

Variants: ``--checkpointing full``: fxsplit with ``activation_checkpointing="full"``, PTD with
``torch.utils.checkpoint`` (non-reentrant) around each GPT block of its stage modules (the same
regions). ``--compile``: fxsplit with ``compile=True`` ([Note: compiled stages]: the F, I and W
graphs through inductor), PTD with each stage module compiled in place (``submod.compile()``,
inductor). Compiling happens in the warmup rounds. ``--ptd-compile both`` times PTD both ways in the
same rounds (``ptd``: eager stage modules, ``ptd-compiled``: compiled; each its own pipeline over
the same weights and split), whatever ``--compile`` does for fxsplit; section C then gives
fxsplit against each and against the faster of the two (PTD's best configuration); ``on`` /
``off`` compile PTD or not regardless of ``--compile`` (default ``same``: as fxsplit). Whatever PTD does with a variant is reported:
if a PTD step raises on any rank, the ranks agree on it (PTD's stages run on a process group of
their own with a timeout, 120 s, 900 s with ``--compile``: a peer blocked in a receive from the
failing rank fails at that timeout instead of hanging),
the error is printed and fxsplit is timed alone.

Simulator: ``plan.simulate()`` gives a makespan in the cost model's seconds; scaled by
T1 / (m * sum of estimated stage times) it predicts the step time ("pred(plan)": the plan's
estimated imbalance included); "pred(bal)" is the perfectly balanced makespan
``simulate(schedule, 1/3, 2/3)`` in units of one rank's share of one microbatch, times T1 / (m p).
Each schedule's notes also scale pred(plan) to the pipeline's own work (the sum of fxsplit's rank
CPU seconds, which runs above T1: two ranks computing at once, the runtime's per-action work) and
give the busiest rank's simulated and measured (B) bubble: that compares the schedule and the
plan's imbalance alone.
"""

from __future__ import annotations

import copy
import datetime
import functools
import os
import re
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import fxsplit
from fxsplit import schedule as schedules
from fxsplit.testing import zoo

from _common import (
    alternate_rounds, gpt_note, launch, load_note, make_gpt, med, parse_setup, per_round_line, ptd_pipe,
    ptd_schedule, ptd_step, round_ratio, rounds_note, single_step, targets)

SCHEDULES = {"1f1b": ("1f1b", 1), "interleaved": ("interleaved_1f1b", 2), "zb_h1": ("zb_h1", 1), "zbv": ("zbv", 2),
             "zb_auto": ("zb_auto", 1)}
# "<schedule>_autograd": the same schedule with split_backward="autograd" (the default is "graph")
SCHEDULES.update({f"{k}_autograd": SCHEDULES[k] for k in ("zb_h1", "zbv", "zb_auto")})
# "<schedule>_unfused" (with --compile): B runs as the I then the W graph, not one backward graph
# ([Note: fused backward] in fxsplit.runtime.compile.compiling), to measure what fusing them gives
SCHEDULES.update({f"{k}_unfused": SCHEDULES[k] for k in ("1f1b", "interleaved")})
PTD_OF = {"1f1b_unfused": "1f1b", "interleaved_unfused": "interleaved", "zb_auto": "zb_h1", "zb_auto_autograd": "zb_h1", "zb_h1_autograd": "zb_h1", "zbv_autograd": "zbv"}
# PTD has no cost-driven schedule: zb_auto runs against its ZB1P


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
    ranks: int = 2  # pipeline ranks p (processes)
    checkpointing: str = "none"  # "none" or "full": fxsplit's activation_checkpointing, PTD's blocks checkpointed
    compile: bool = False  # fxsplit compile=True; PTD's stage modules torch.compile'd
    # PTD's variants: "same" (compiled as fxsplit is, label ptd), "on" / "off" (label ptd either way),
    # "both": uncompiled (ptd) and compiled (ptd-compiled) in the same rounds, fxsplit against the best
    ptd_compile: str = "same"
    # fxsplit's balanced split unless given, e.g. "1f1b=blocks.4;interleaved=blocks.2,blocks.4,blocks.6"
    split_points: str = ""

    def split_points_of(self, label: str) -> tuple[str, ...] | None:
        for item in filter(None, self.split_points.split(";")):
            key, _, paths = item.partition("=")
            if key.strip() == label:
                return tuple(p.strip() for p in paths.split(",") if p.strip())
        return None


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
        path = stack[-1][0] if stack else None
        first = next((n for n in plan.graph.graph.nodes
                      if path is not None and path in [p for p, _ in (n.meta.get("nn_module_stack") or {}).values()]),
                     None)
        if first is not node:
            raise ValueError(
                f"stage start {name!r} ({node.op} {node.target}) is not the first node of a module "
                f"(innermost module {path!r}); PTD's split_spec can only cut before a module call, so "
                "the two splits would differ: give fxsplit module paths with --split-points")
        paths.append(path)
    return paths


def ptd_variants(setup: Setup) -> list[tuple[str, bool]]:
    """(label, compiled) of each PTD pipeline a run times (``--ptd-compile``)."""
    if setup.ptd_compile == "both":
        return [("ptd", False), ("ptd-compiled", True)]
    return [("ptd", {"same": setup.compile, "on": True, "off": False}[setup.ptd_compile])]


def _ptd(model, x, paths, setup: Setup, sched_name: str, v: int, rank: int, world: int, group,
         compiled: bool | None = None):
    num_stages = world * v
    pipe = ptd_pipe(model, x, paths, setup.microbatches, num_stages)
    mine = schedules.placement(SCHEDULES[sched_name][0], world, v)
    stages = [pipe.build_stage(s, torch.device("cpu"), group=group) for s in range(num_stages) if mine[s] == rank]
    for st in stages:  # see [Note: PTD ZBV on gloo]
        _no_self_warmup(st, rank)
        if setup.checkpointing == "full":
            _checkpoint_blocks(st.submod)
        if setup.compile if compiled is None else compiled:
            st.submod.compile()  # in place: the stage keeps its module (parameters, grads)
    sched, first, last = ptd_schedule(PTD_OF.get(sched_name, sched_name), stages, setup.microbatches)
    return sched, stages, first, last


def _checkpoint_blocks(submod) -> int:
    """Run every GPT block (``blocks.N``) of a PTD stage module under ``torch.utils.checkpoint``
    (non-reentrant), the regions fxsplit's ``activation_checkpointing="full"`` recomputes."""
    from torch.utils.checkpoint import checkpoint

    n = 0
    for name, mod in submod.named_modules():
        if re.fullmatch(r"(.*\.)?blocks\.\d+", name):
            mod.forward = functools.partial(checkpoint, mod.forward, use_reentrant=False)
            n += 1
    if n == 0:
        raise RuntimeError(f"no GPT block (blocks.N) in PTD's stage module: {[k for k, _ in submod.named_modules()]}")
    return n


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {' | '.join(lines[:4])[:400]}"


def _no_self_warmup(stage, rank: int) -> None:
    """[Note: PTD ZBV on gloo] torch 2.13's schedules warm up the p2p links of every stage with a
    dummy send and receive to its neighbour stages' ranks. In ZBV's V, stages p-1 and p are
    neighbours on the same rank, so the warm-up sends to itself, which gloo refuses ("Pair is not
    connected ... <--> [none]"), and ScheduleZBVZeroBubble fails before its first step. The
    benchmark drops those self-addressed warm-up messages (the schedule's own transfers between
    stages of one rank are local in PTD); nothing else of PTD is changed."""
    make = stage._get_init_p2p_neighbors_ops
    stage._get_init_p2p_neighbors_ops = lambda: [op for op in make() if getattr(op, "group_peer", None) != rank]


class ActionClock:
    """Main-thread CPU seconds of each pipeline action of one step on this rank: from the action's
    start to the next one's start (the loss and bookkeeping after an action count to it; time
    blocked in a receive uses no CPU); what precedes the first action counts to the first."""

    def __init__(self) -> None:
        self.marks: list[tuple[int, str, int, float]] = []
        self.t0 = time.thread_time()

    def reset(self) -> None:
        self.marks, self.t0 = [], time.thread_time()

    def mark(self, stage: int, kind: str, mb: int) -> None:
        self.marks.append((stage, kind, mb, time.thread_time()))

    def actions(self) -> list[tuple[int, str, int, float]]:
        end = time.thread_time()
        starts = [t for *_, t in self.marks] + [end]
        out = [(s, k, mb, starts[i + 1] - starts[i]) for i, (s, k, mb, _) in enumerate(self.marks)]
        if out:
            s, k, mb, d = out[0]
            out[0] = (s, k, mb, d + starts[0] - self.t0)
        return out


def _clock_fxsplit(rt, clock: ActionClock) -> None:
    """Instrumentation only: mark the start of each action of this runtime (F, B, I or W)."""
    rt.probe(before=lambda step, a: clock.mark(a.stage, a.kind.value, a.microbatch))


def _clock_ptd(stage, clock: ActionClock) -> None:
    fwd, bwd, wgt = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

    def forward_one_chunk(chunk, *a, **k):
        clock.mark(stage.stage_index, "F", chunk)
        return fwd(chunk, *a, **k)

    def backward_one_chunk(chunk, *a, **k):
        clock.mark(stage.stage_index, "B" if k.get("full_backward", True) else "I", chunk)
        return bwd(chunk, *a, **k)

    def backward_weight_one_chunk(chunk, *a, **k):
        clock.mark(stage.stage_index, "W", chunk)
        return wgt(chunk, *a, **k)

    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


def free_machine_makespan(per_rank: list[list[tuple[int, str, int, float]]]) -> float:
    """Step time on idle cores: every rank runs its recorded actions in their recorded order, each
    as soon as its rank is free and its dependency is done (F(s, i) after F(s-1, i); B or I (s, i)
    after B or I (s+1, i), the last stage's after its own F; W(s, i) after I(s, i)), taking its
    measured CPU time; transfers free."""
    num_stages = 1 + max(s for acts in per_rank for s, *_ in acts)
    grad = {(s, mb): k for acts in per_rank for s, k, mb, _ in acts if k in ("B", "I")}
    done: dict[tuple[int, str, int], float] = {}
    nxt, free = [0] * len(per_rank), [0.0] * len(per_rank)
    remaining = sum(len(a) for a in per_rank)
    while remaining:
        progressed = False
        for r, acts in enumerate(per_rank):
            while nxt[r] < len(acts):
                s, k, mb, d = acts[nxt[r]]
                if k == "F":
                    dep = (s - 1, "F", mb) if s > 0 else None
                elif k == "W":
                    dep = (s, "I", mb)
                else:
                    dep = (s + 1, grad[(s + 1, mb)], mb) if s < num_stages - 1 else (s, "F", mb)
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done[dep] if dep is not None else 0.0)
                free[r] = done[(s, k, mb)] = start + d
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("recorded action orders deadlock: instrumentation bug")
    return max(free)


def _rank_main(rank: int, world: int, setup: Setup) -> dict:
    torch.set_num_threads(1)
    # untied LM head: PTD's pipeline() does not handle a weight shared by two stages, and fxsplit's
    # tied-gradient sum would be extra work PTD does not do
    model, (x,), _ = make_gpt(setup)
    y = targets(setup)
    single = copy.deepcopy(model)
    out: dict = {}
    for label in setup.schedules:
        sched_name, v = SCHEDULES[label]
        t0 = time.perf_counter()
        pm = fxsplit.parallelize(model, (x,), loss_fn=zoo.cross_entropy_loss, pp=world,
                                 microbatches=setup.microbatches, schedule=sched_name,
                                 stages_per_rank=v, split_points=setup.split_points_of(label), timeout=120,
                                 cut_at="modules",  # cuts PTD's split_spec can reproduce
                                 split_backward="autograd" if label.endswith("_autograd") else "graph",
                                 activation_checkpointing=setup.checkpointing, compile=setup.compile,
                                 fuse_backward=not label.endswith("_unfused"))
        t_fx = time.perf_counter() - t0
        paths = split_paths(pm.plan)
        variants = ptd_variants(setup)
        ptds: dict[str, tuple] = {}  # label -> (sched, stages, first, last, group)
        t_ptd = 0.0
        for name, compiled in variants:
            t0 = time.perf_counter()
            # PTD's own group: destroyed if a PTD step fails, and with a timeout, so that a peer blocked
            # in a receive from the failing rank fails too (gloo does not wake it on destroy)
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=900 if compiled else 120))
            ptds[name] = (*_ptd(copy.deepcopy(model), x, paths, setup, label, v, rank, world, group, compiled), group)
            t_ptd += time.perf_counter() - t0
        losses: dict[str, float] = {}
        clocks = {"fxsplit": ActionClock()} | {name: ActionClock() for name in ptds}
        _clock_fxsplit(pm.runtime, clocks["fxsplit"])  # for the life of this runtime
        for name, (_, stages, *_rest) in ptds.items():
            for st in stages:
                _clock_ptd(st, clocks[name])
        actions: dict[str, list] = {k: [] for k in clocks}

        def fx_step():
            clocks["fxsplit"].reset()
            losses["fxsplit"] = float(pm.step(x, target=y))
            actions["fxsplit"].append(clocks["fxsplit"].actions())

        def ptd_run_of(name):
            sched, _, first, last, _ = ptds[name]

            def ptd_run():
                clocks[name].reset()
                loss = ptd_step(sched, x, y, first=first, last=last)
                if loss is not None:
                    losses[name] = loss
                actions[name].append(clocks[name].actions())
            return ptd_run

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
            for _, stages, *_rest in ptds.values():
                for st in stages:
                    st.submod.zero_grad(set_to_none=True)

        ptd_errors = {name: _probe(ptd_run_of(name), ptds[name][4]) for name in ptds}
        zero()
        for name in ptds:
            actions[name].clear()
        runs = [("fxsplit", fx_step, True)] + [(name, ptd_run_of(name), True) for name in ptds
                                               if ptd_errors[name] is None] + [
                ("single", single_step(single, x, y, losses), rank == 0), ("single_mb", single_mb_step, rank == 0)]
        waits: list[float] = []  # fxsplit: seconds this rank blocked in receives (bubble + transfers)
        first_losses: dict[str, float] = {}

        def read_wait(i, name, active):
            if name == "fxsplit" and i >= setup.warmup:
                waits.append(pm.last_wait_seconds)

        def end_round(i):
            if i == 0:
                first_losses.update(losses)
            if i < setup.warmup:
                for acts in actions.values():
                    acts.clear()

        times, cpus, _ = alternate_rounds(runs, setup.warmup, setup.steps, zero, after_step=read_wait,
                                          after_round=end_round)
        sim_plan = pm.plan.simulate()
        est_work = setup.microbatches * sum(s.time for s in pm.plan.split.stages)
        sim_bal = schedules.simulate(pm.plan.schedule, forward=1 / 3, backward=2 / 3)
        out[label] = {
            "ptd_error": ptd_errors["ptd"], "ptd_errors": ptd_errors,
            "compile_fallbacks": {f"{s}{k}": why for (s, k), why in pm.compile_fallbacks.items()},
            "times": times, "cpu": cpus, "waits": waits, "actions": actions, "losses": first_losses,
            "paths": paths, "setup_s": (t_fx, t_ptd),
            "sim_plan_ratio": sim_plan.makespan / est_work,  # predicted step / T1
            # idle share of the busiest rank in the simulation (1 - its busy time / makespan)
            "sim_bubble": 1 - max(sum(e.end - e.start for e in sim_plan.events if e.rank == q)
                                  for q in range(world)) / sim_plan.makespan,
            "sim_bal_ratio": sim_bal.makespan / (setup.microbatches * world),
            "stage_est": [s.time for s in pm.plan.split.stages],
            # where fxsplit's compiled fp32 matmuls ran ([Note: CPU matmuls through oneDNN])
            "cpu_matmul": _cpu_matmul_note() if setup.compile else None,
        }
    return out


def _cpu_matmul_note() -> str:
    from fxsplit.runtime.compile import cpu_matmul

    mode = os.environ.get("FXSPLIT_CPU_MATMUL", "auto")
    chosen = cpu_matmul.onednn_matmul_chosen()
    measured = cpu_matmul.probe()[1]
    return (f"fxsplit's compiled fp32 matmuls: {'oneDNN' if chosen else 'aten (MKL)'} (FXSPLIT_CPU_MATMUL={mode}; "
            f"MKL on a non-Intel x86-64: {cpu_matmul.mkl_on_non_intel_x86()}; one timing: {measured})")


def _probe(ptd_run, group) -> str | None:
    """One PTD step before the timed rounds (its warm-up, and its compile under ``--compile``); if
    it raises on any rank: the error (the failing rank destroys PTD's group so that peers blocked
    on it fail too, and every rank learns of it in an all-reduce on the default group)."""
    error = None
    try:
        ptd_run()
    except Exception as exc:  # noqa: BLE001 - reported, not hidden: PTD's answer to this variant
        error = _first_line(exc)
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - already gone on this rank
            pass
    flag = torch.tensor([0.0 if error is None else 1.0 + dist.get_rank()])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() and error is None:
        error = f"failed on rank {int(flag.item()) - 1} (this rank: its peer's error)"
    return error


def _losses_agree(all_losses: list[dict]) -> float:
    merged: dict[str, float] = {}
    for d in all_losses:
        merged.update(d)
    vals = list(merged.values())
    return max(abs(a - b) / abs(b) for a in vals for b in vals)


def report(results: list[dict], setup: Setup, load: tuple[float, float]) -> str:
    """Medians over the timed rounds; every ratio is taken within a round (same machine load)."""
    p = len(results)
    m = setup.microbatches
    ideal = m / (m + p - 1) * p
    head = (f"{gpt_note(setup)}; p={p}, m={m}, checkpointing {setup.checkpointing}, "
            f"{'compiled' if setup.compile else 'eager'}; {rounds_note(setup.warmup, setup.steps)}; "
            f"ideal speedup m/(m+p-1)*p = {ideal:.3f}; {load_note(load)}")
    matmul = next((r["cpu_matmul"] for r in results[0].values() if r.get("cpu_matmul")), None)
    if matmul:
        head += f"\n{matmul}"
    wall = [f"{'A. wall clock':<16} {'T1':>6} {'T1 mb':>6} {'fxsplit':>7} {'PTD':>6} {'fx/PTD':>6} "
            f"{'fx/ideal':>8} {'PTD/ideal':>9}"]
    free = [f"{'B. free cores':<16} {'T1 CPU':>6} {'fxsplit':>7} {'PTD':>6} {'fx/PTD':>6} {'fx/ideal':>8} "
            f"{'PTD/ideal':>9} {'sim plan':>8} {'sim bal':>7} {'fx rank CPU':>13} {'PTD rank CPU':>13}"]
    notes = []
    best = [f"{'C. best PTD':<16} {'variant':>12} {'wall':>6} {'fx/it':>6} {'free':>6} {'fx/it':>6} "
            f"{'PTD rank CPU':>13}"]
    for label in setup.schedules:
        name = f"{label} v={SCHEDULES[label][1]}"
        r0 = results[0][label]
        w = r0["times"]
        n = len(w["single"])
        rounds = range(n)
        has_ptd = "ptd" in w

        def num(fn, width, *keys):  # a PTD figure, or "-" where PTD did not run
            return f"{fn():{width}.3f}" if has_ptd or "ptd" not in keys else f"{'-':>{width}}"

        wall.append(
            f"{name:<16} {med(w['single']):6.3f} {med(w['single_mb']):6.3f} {med(w['fxsplit']):7.3f} "
            f"{num(lambda: med(w['ptd']), 6, 'ptd')} {num(lambda: round_ratio(w['fxsplit'], w['ptd']), 6, 'ptd')} "
            f"{round_ratio(w['single'], w['fxsplit'], ideal):8.3f} "
            f"{num(lambda: round_ratio(w['single'], w['ptd'], ideal), 9, 'ptd')}")
        t1cpu = r0["cpu"]["single"]
        kinds = ("fxsplit", *(k for k, _ in ptd_variants(setup) if k in w))
        est = {k: [free_machine_makespan([r[label]["actions"][k][i] for r in results]) for i in rounds]
               for k in kinds}
        rank_cpu = {k: [round(med(r[label]["cpu"][k]), 3) for r in results] for k in est}
        free.append(
            f"{name:<16} {med(t1cpu):6.3f} {med(est['fxsplit']):7.3f} {num(lambda: med(est['ptd']), 6, 'ptd')} "
            f"{num(lambda: round_ratio(est['fxsplit'], est['ptd']), 6, 'ptd')} "
            f"{round_ratio(t1cpu, est['fxsplit'], ideal):8.3f} "
            f"{num(lambda: round_ratio(t1cpu, est['ptd'], ideal), 9, 'ptd')} "
            f"{r0['sim_plan_ratio'] * med(t1cpu):8.3f} {r0['sim_bal_ratio'] * med(t1cpu):7.3f} "
            f"{str(rank_cpu['fxsplit']):>13} {str(rank_cpu.get('ptd', '-')):>13}")
        # the prediction scaled to the work the pipeline's actions measured, not to one process's
        # T1: what is left between the two is the schedule's bubble and the split's imbalance
        work = sum(rank_cpu["fxsplit"])
        sim_work = r0["sim_plan_ratio"] * work
        notes.append(
            f"{name}: sim plan scaled to fxsplit's own work (sum of rank CPU {work:.3f} s = "
            f"{work / med(t1cpu):.2f} x T1 CPU): {sim_work:.3f} s, B fxsplit / that {med(est['fxsplit']) / sim_work:.3f}; "
            f"bubble on the busiest rank: measured {1 - max(rank_cpu['fxsplit']) / med(est['fxsplit']):.3f}, "
            f"simulated {r0['sim_bubble']:.3f}")
        if len(ptd_variants(setup)) > 1:
            best.extend(_best_rows(name, w, est, rank_cpu, [k for k in kinds if k != "fxsplit"]))
        rel = _losses_agree([r[label]["losses"] for r in results])
        notes.append(
            f"{name}: split at {r0['paths']}; first-step losses (fxsplit, PTD, single, single over "
            f"microbatches) agree to {rel:.1e}; fxsplit blocked in receives per rank "
            f"{[round(med(r[label]['waits']), 3) for r in results]} s; setup s on rank 0 (fxsplit, PTD) "
            f"{tuple(round(t, 1) for t in r0['setup_s'])}")
        for k, _ in ptd_variants(setup):
            if k not in w:
                notes.append(f"    PTD ({k}) failed with this variant (not timed): "
                             + "; ".join(f"rank {q}: {r[label]['ptd_errors'][k]}" for q, r in enumerate(results)))
        fallbacks = {q: r[label]["compile_fallbacks"] for q, r in enumerate(results) if r[label]["compile_fallbacks"]}
        if fallbacks:
            notes.append(f"    fxsplit graphs run uncompiled (rank: stage+graph -> why): {fallbacks}")
        notes.append("    " + per_round_line(w))
    legend = (
        "A: medians of wall seconds per step (slowest rank); T1 = one process, whole batch; T1 mb = "
        "one process, the m microbatches in turn; ratios are medians of per-round ratios, x/ideal = "
        "(T1 / step) / ideal speedup. B: the step on idle cores, estimated from each action's "
        "measured main-thread CPU seconds (each rank runs its recorded order, each action after its "
        "dependency; transfers free); x/ideal against T1 CPU; sim = plan.simulate() makespan scaled "
        "to T1 CPU (plan: the cost model's stage estimates; bal: balanced stages); rank CPU = "
        "main-thread CPU seconds per step on each rank."
        + (" C (--ptd-compile both): A's and B's medians for each PTD variant (ptd: stage modules "
           "eager, ptd-compiled: submod.compile()), fx/it the median per-round ratio; 'best' is the "
           "variant with the lower median (by wall for A, by free cores for B), and fxsplit against it."
           if len(ptd_variants(setup)) > 1 else ""))
    return "\n".join([head, *wall, *free, *(best if len(best) > 1 else []), *notes, legend])


def _best_rows(name: str, w: dict, est: dict, rank_cpu: dict, ptds: list[str]) -> list[str]:
    """Section C: every PTD variant's wall and free-core step, fxsplit's ratio to each, and to the best."""
    rows = [f"{name:<16} {k:>12} {med(w[k]):6.3f} {round_ratio(w['fxsplit'], w[k]):6.3f} {med(est[k]):6.3f} "
            f"{round_ratio(est['fxsplit'], est[k]):6.3f} {str(rank_cpu[k]):>13}" for k in ptds]
    if ptds:
        bw = min(ptds, key=lambda k: med(w[k]))
        bf = min(ptds, key=lambda k: med(est[k]))
        rows.append(f"{name:<16} {'best':>12} {med(w[bw]):6.3f} {round_ratio(w['fxsplit'], w[bw]):6.3f} "
                    f"{med(est[bf]):6.3f} {round_ratio(est['fxsplit'], est[bf]):6.3f}   (wall: {bw}; free cores: {bf})")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap, setup = parse_setup(Setup, argv, __doc__.split("\n")[0], bools="both",
                            helps={"schedules": "comma list of 1f1b, interleaved, zb_h1, zbv, zb_auto (+ _autograd: that split backward)"})
    bad = [s for s in setup.schedules if s not in SCHEDULES]
    if bad:
        ap.error(f"unknown schedules {bad}; choose from {sorted(SCHEDULES)}")
    if setup.checkpointing not in ("none", "full"):
        ap.error(f"--checkpointing must be none or full, got {setup.checkpointing!r}")
    if setup.ptd_compile not in ("same", "on", "off", "both"):
        ap.error(f"--ptd-compile must be same, on, off or both, got {setup.ptd_compile!r}")
    if setup.ranks < 2:
        ap.error(f"--ranks must be >= 2, got {setup.ranks}")
    results, load, wall = launch(_rank_main, setup.ranks, setup, timeout=1800 if setup.compile else 900)
    print(report(results, setup, load))
    print(f"wall {wall:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
