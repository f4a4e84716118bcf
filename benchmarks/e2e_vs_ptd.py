"""End to end: the quickstart GPT at tp=2 x pp=2 on 4 processes, fxsplit against a PTD composition.

Terms: t, p tensor- and pipeline-parallel degrees (world t * p = 4, rank = pp_rank * t + tp_rank,
tp innermost as in fxsplit's mesh); v stages per pipeline rank (S = p * v); m microbatches.
"PTD composition" = ``torch.distributed.pipelining.pipeline()`` + ``PipelineStage`` +
``ScheduleInterleaved1F1B`` (or ``Schedule1F1B``) with DTensor ``parallelize_module`` applied to
each stage's submodule (ColwiseParallel on attn.q/k/v and mlp.up, RowwiseParallel on attn.proj
and mlp.down).

    .venv/bin/python benchmarks/e2e_vs_ptd.py                      # quickstart GPT, interleaved, v=2, m=4
    .venv/bin/python benchmarks/e2e_vs_ptd.py --layers 8 --width 256 --heads 8 --vocab 4096 --seq 128 --batch 16

What PTD cannot do by itself (found here, torch 2.13; the exact errors are printed per run):
  1. ``pipeline()`` unflattens each stage into ``InterpreterModule``s, so ``parallelize_module``
     refuses the linears ("ColwiseParallel currently only support nn.Linear and nn.Embedding!").
     Patch: each q/k/v/proj/up/down InterpreterModule is replaced by an ``nn.Linear`` holding the
     same Parameters.
  2. ``pipeline()`` traces with torch.export, which bakes the head count and width into the
     attention views (``view(mb, T, nh, hs)``, ``reshape(mb, T, C)``); the model's own ``n_head``
     attribute (the usual DTensor trick) no longer exists. Patch: those view/reshape shape
     arguments inside each ``attn`` graph are rewritten to nh / t and C / t.
  3. A weight shared by two stages (the quickstart's tied ``wte`` / ``lm_head``): see the run's
     note (``--tie`` on by default, as in the quickstart; ``--no-tie`` unties it).
fxsplit needs none of these: one ``parallelize(tp=2, pp=2)`` call. Its plan is the one DTensor
gets (``tp_plan`` keeps embedding and head replicated), at the same split points (module paths
given to both). Method as in ``pipeline_vs_ptd.py`` / ``tp_vs_dtensor.py``: one launch, warmup,
then rounds alternating fxsplit / PTD / one process (rank 0; the others wait in a barrier), order
flipped every round, every step after a barrier and timed as the slowest rank, forward + backward
(no optimizer), gradients zeroed outside the timing; step 0's loss and every gradient (shards
gathered) checked against the single process. Peak memory per rank: resident-memory rise during
one step (see ``_common.PeakRSS``).
"""

from __future__ import annotations

import copy
import logging
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import fxsplit
from fxsplit.testing import zoo

from _common import (
    MATCHED_PLAN, PeakRSS, alternate_rounds, compare_grads, dtensor_tp, full_grads_dtensor, full_grads_fxsplit,
    gpt_note, grads_of, launch, load_note, make_gpt, med, mib, numerics_exit_code, numerics_lines, param_bytes,
    parse_setup, per_round_line, ptd_pipe, ptd_schedule, ptd_step, rank_cpus, rank_peaks, release_freed_memory,
    round_ratio, rounds_note, setup_line, single_step, slash, targets)

SCHEDULES = {"interleaved": ("interleaved_1f1b", 2), "1f1b": ("1f1b", 1)}
TP, PP = 2, 2


@dataclass(frozen=True)
class Setup:
    # the quickstart's GPTConfig(vocab_size=128, block_size=32, n_layer=4, n_head=4, n_embd=64), batch 8
    layers: int = 4
    width: int = 64
    heads: int = 4
    vocab: int = 128
    seq: int = 32
    batch: int = 8
    microbatches: int = 4
    schedule: str = "interleaved"
    tie: bool = True
    warmup: int = 1
    steps: int = 5


def split_points(s: Setup) -> tuple[str, ...]:
    """Module paths starting stages 1..S-1: the blocks spread evenly over S stages."""
    S = PP * SCHEDULES[s.schedule][1]
    if s.layers % S:
        raise ValueError(f"--layers {s.layers} must divide by the {S} stages")
    return tuple(f"blocks.{i * s.layers // S}" for i in range(1, S))


# ----------------------------------------------------------------------------- PTD composition

LINEARS = ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.up", "mlp.down")
VIEW_OPS = ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default")


def linears_to_modules(stage_mod: nn.Module) -> int:
    """Patch 1: every q/k/v/proj/up/down InterpreterModule -> nn.Linear with the same Parameters."""
    n = 0
    for name, block in stage_mod.get_submodule("blocks").named_children():
        for path in LINEARS:
            parent_path, leaf = path.rsplit(".", 1)
            parent = block.get_submodule(parent_path)
            old = getattr(parent, leaf)
            if isinstance(old, nn.Linear):
                continue
            w, b = old.weight, getattr(old, "bias", None)
            lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")
            lin.weight = w
            if b is not None:
                lin.bias = b
            setattr(parent, leaf, lin)
            n += 1
    return n


def local_attention_shapes(stage_mod: nn.Module, *, heads: int, width: int, tp: int) -> int:
    """Patch 2: in each attn graph, view/reshape sizes nh -> nh/t (4-d head views) and C -> C/t."""
    n = 0
    for _, block in stage_mod.get_submodule("blocks").named_children():
        attn = block.attn
        for node in attn.graph.nodes:
            if node.op != "call_function" or str(node.target) not in VIEW_OPS:
                continue
            shape = list(node.args[1])
            if len(shape) == 4 and shape[2] == heads:
                shape[2] = heads // tp
            elif len(shape) == 3 and shape[2] == width:
                shape[2] = width // tp
            else:
                continue
            node.args = (node.args[0], shape, *node.args[2:])
            n += 1
        if hasattr(attn, "finalize"):
            attn.finalize()
    return n


def build_ptd(model, x, s: Setup, rank: int, mesh) -> dict:
    name, v = SCHEDULES[s.schedule]
    S = PP * v
    notes: list[str] = []
    pipe = ptd_pipe(model, x, split_points(s), s.microbatches, S)
    pp_rank = mesh.get_local_rank("pp")
    mine = list(range(pp_rank, S, PP))
    for st in mine:
        mod = pipe.get_stage_module(st)
        try:
            dtensor_tp(mod, mesh["tp"], TP)
            notes.append(f"stage {st}: parallelize_module on the stage module worked unpatched")
        except Exception as exc:  # noqa: BLE001 -- the point is to report it
            notes.append(f"stage {st}: parallelize_module on the stage module: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:160]}")
            n_lin = linears_to_modules(mod)
            n_view = local_attention_shapes(mod, heads=s.heads, width=s.width, tp=TP)
            dtensor_tp(mod, mesh["tp"], TP)
            notes.append(f"stage {st}: patched {n_lin} linears to nn.Linear, {n_view} attention view sizes; "
                         "then parallelize_module worked")
    pp_group = mesh["pp"].get_group()
    stages = [pipe.build_stage(st, torch.device("cpu"), group=pp_group) for st in mine]
    sched, first, last = ptd_schedule(name, stages, s.microbatches)
    return {"sched": sched, "stages": stages, "first": first, "last": last, "notes": notes}


def ptd_full_grads(stages, tied: dict[str, str]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Every gradient of the PTD stages under the original names, gathered over tp (full tensors)
    then over pp. A name held by two stages (a tied weight copied into both) gets the sum of their
    gradients, which is what the one shared weight receives; ``tied`` maps alias -> kept name.
    Returns (gradients, notes on the copies found)."""
    local: dict[str, torch.Tensor] = {}
    for st in stages:
        for k, g in full_grads_dtensor(st.submod).items():
            local[f"{st.stage_index}:{k}"] = g
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local if dist.get_rank() % TP == 0 else {})
    merged: dict[str, torch.Tensor] = {}
    copies: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for part in parts:
        for key, g in part.items():
            st, k = key.split(":", 1)
            copies.setdefault(tied.get(k, k), []).append((f"stage {st} as {k}", g))
    notes = []
    for k, held in copies.items():
        merged[k] = sum((g for _, g in held[1:]), held[0][1].clone())
        if len(held) > 1:
            whole = [w for w, g in held if torch.allclose(g, merged[k], rtol=1e-5, atol=1e-6)]
            notes.append(f"{k} is held by {', '.join(w for w, _ in held)}: separate copies; " +
                         (f"{whole} hold the summed gradient" if whole else
                          "each holds only its own stage's part of the gradient (PTD does not sum them, "
                          "so the copies drift apart after an optimizer step); compared here as their sum"))
    return merged, notes


# ----------------------------------------------------------------------------- one rank


def _rank_main(rank: int, world: int, s: Setup) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    release_freed_memory()
    model, (x,), _ = make_gpt(s, tie=s.tie)
    y = targets(s)
    single = copy.deepcopy(model)
    sched_name, v = SCHEDULES[s.schedule]
    tied = {"lm_head.weight": "wte.weight"} if s.tie else {}
    fx_notes: list[str] = []
    logging.getLogger("torch.distributed.pipelining").setLevel(logging.ERROR)  # per-module device notes
    setup_s: dict[str, float] = {}

    t0 = time.perf_counter()
    pm = fxsplit.parallelize(model, (x,), loss_fn=zoo.cross_entropy_loss, tp=TP, pp=PP, schedule=sched_name,
                             stages_per_rank=v, microbatches=s.microbatches, split_points=split_points(s),
                             tp_plan=MATCHED_PLAN, timeout=300)
    setup_s["fxsplit"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    mesh = init_device_mesh("cpu", (PP, TP), mesh_dim_names=("pp", "tp"))
    ptd_error = None
    try:
        ptd = build_ptd(copy.deepcopy(model), x, s, rank, mesh)
    except Exception as exc:  # noqa: BLE001 -- reported, fxsplit still measured
        import traceback

        ptd_error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"
        ptd = None
    setup_s["ptd"] = time.perf_counter() - t0
    flags = torch.tensor([0 if ptd is not None else 1])
    dist.all_reduce(flags)
    if int(flags) and ptd is not None:  # some rank failed: nobody runs PTD
        ptd = None
        ptd_error = ptd_error or "another rank failed to build the PTD composition"

    losses: dict[str, float] = {}

    def fx_step():
        losses["fxsplit"] = float(pm.step(x, target=y))

    def ptd_run():
        loss = ptd_step(ptd["sched"], x, y, first=ptd["first"], last=ptd["last"])
        if loss is not None:
            losses["ptd"] = loss

    def zero():
        pm.zero_grad(set_to_none=True)
        single.zero_grad(set_to_none=True)
        if ptd is not None:
            for st in ptd["stages"]:
                st.submod.zero_grad(set_to_none=True)

    runs = [("fxsplit", fx_step, True)] + ([("ptd", ptd_run, True)] if ptd is not None else []) + \
        [("single", single_step(single, x, y, losses), rank == 0)]
    check: dict[str, dict] = {}
    step_losses: dict[str, float] = {}

    def gather_grads(i, name, active):
        if i != 0:
            return
        if name == "fxsplit":
            check[name] = full_grads_fxsplit(pm)
            for alias, kept in tied.items():  # fxsplit: each stage's copy holds the summed gradient
                if alias in check[name]:
                    same = kept in check[name] and torch.equal(check[name].pop(alias), check[name][kept])
                    fx_notes.append(f"tied {kept} / {alias}: the two stages' copies hold "
                                    f"{'the same summed gradient' if same else 'DIFFERENT gradients'}")
        elif name == "ptd":
            check[name], tie_notes = ptd_full_grads(ptd["stages"], tied)
            ptd["notes"].extend(tie_notes)
        elif active:
            check[name] = grads_of(single)

    def first_losses(i):
        if i == 0:
            step_losses.update(losses)

    times, cpus, peaks = alternate_rounds(runs, s.warmup, s.steps, zero, peak=PeakRSS(),
                                          after_step=gather_grads, after_round=first_losses)
    all_losses: list = [None] * world
    dist.all_gather_object(all_losses, step_losses)
    numerics = {}
    if rank == 0:
        merged = {}
        for d in all_losses:
            merged.update(d)
        step_losses = merged
        numerics = {k: compare_grads(check["single"], v) for k, v in check.items() if k != "single"}
    params = {"fxsplit": param_bytes(pm.parameters())}
    if ptd is not None:
        params["ptd"] = param_bytes(p for st in ptd["stages"] for p in st.submod.parameters())
    params["single"] = param_bytes(single.parameters())
    return {"times": times, "cpu": cpus, "peaks": peaks, "params": params, "losses": step_losses, "numerics": numerics,
            "setup_s": setup_s, "ptd_error": ptd_error, "notes": ptd["notes"] if ptd else [],
            "fx_plan_s": pm.plan.plan_seconds, "fx_notes": fx_notes}


# ----------------------------------------------------------------------------- report


def report(results: list[dict], s: Setup, load: tuple[float, float], wall: float) -> str:
    r0 = results[0]
    w = r0["times"]
    n = len(w["single"])
    name, v = SCHEDULES[s.schedule]
    lines = [
        f"{gpt_note(s, heads=True)}, "
        f"{'tied' if s.tie else 'untied'} head; tp={TP} x pp={PP} (4 ranks), {name} v={v}, m={s.microbatches}, "
        f"split at {list(split_points(s))}; {rounds_note(s.warmup, n)}; {load_note(load)}; wall {wall:.0f}s",
        f"{'step':<8} {'median s':>8} {'x single':>8} {'x PTD':>6} {'peak MiB per rank':>26} "
        f"{'param MiB per rank':>26} {'CPU s per rank':>23} {'CPU x PTD':>9}",
    ]
    for k in w:
        xp = round_ratio(w[k], w["ptd"]) if "ptd" in w else float("nan")
        pa = "/".join(mib(r["params"][k]) for r in results) if k != "single" else mib(r0["params"][k])
        cpu = rank_cpus(results, k)
        cpu_ptd = max(rank_cpus(results, "ptd")) if "ptd" in w else float("nan")
        lines.append(f"{k:<8} {med(w[k]):8.3f} {round_ratio(w[k], w['single']):8.3f} {xp:6.3f} "
                     f"{rank_peaks(results, k):>26} {pa:>26} {slash(cpu):>23} {max(cpu) / cpu_ptd:9.3f}")
    lines += numerics_lines(r0["numerics"], r0["losses"])
    for r_i, r in enumerate(results):
        if r["ptd_error"]:
            lines.append(f"  rank {r_i}: PTD composition FAILED: {r['ptd_error']}")
            break
    notes = sorted({note for r in results for note in r["notes"]})
    lines += [f"  PTD: {note}" for note in notes]
    lines += [f"  fxsplit: {note}" for note in r0["fx_notes"]]
    lines.append(setup_line(r0["setup_s"]) + f" (fxsplit plan {r0['fx_plan_s']:.1f})")
    lines.append("  " + per_round_line(w))
    lines.append("ratios are medians of per-round ratios; peak = rise of resident memory during one step "
                 "(median; ranks 0/1/2/3); param = this rank's parameter shards; CPU = main-thread CPU seconds per "
                 "step (compute and framework overhead, not waits; gloo's threads not counted), CPU x PTD = "
                 "slowest rank's / PTD's slowest rank's.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap, s = parse_setup(Setup, argv, __doc__.split("\n")[0], bools="both")
    if s.schedule not in SCHEDULES:
        ap.error(f"--schedule must be one of {sorted(SCHEDULES)}")
    split_points(s)
    results, load, wall = launch(_rank_main, TP * PP, s, timeout=600)
    print(report(results, s, load, wall))
    return numerics_exit_code(results[0]["numerics"])


if __name__ == "__main__":
    sys.exit(main())
