"""Tensor-parallel step time and bytes moved: fxsplit against PyTorch DTensor and one process.

Terms: t tensor-parallel degree (= world size here); L layers, b batch, s sequence, h width;
Megatron count = the all-reduces Megatron-LM needs per step, 4 per layer (attention and MLP, one
forward and one backward each) of b*s*h elements, i.e. 4 * L * b*s*h * 4 bytes in float32.
"Bytes" below are payload bytes, the size of the tensor each rank contributes to a collective
(a ring all-reduce sends 2(t-1)/t times that over each rank's link).

    .venv/bin/python benchmarks/tp_vs_dtensor.py                       # GPT 8 x 256, b16 s128, t=2
    .venv/bin/python benchmarks/tp_vs_dtensor.py --layers 4 --steps 3  # quicker

Method: 2 ranks (fxsplit.testing.run_distributed: gloo, one thread per rank). In ONE launch both
ranks build, over the same weights:
  fx       fxsplit.parallelize(tp=2) with the plan DTensor gets below (``tp_plan`` overrides keep
           the token embedding and LM head replicated; the pass finds q/k/v/up column-parallel and
           proj/down row-parallel itself);
  fx-auto  fxsplit.parallelize(tp=2) with its automatic plan (vocabulary-parallel embedding and LM
           head, logits gathered for the user's loss): more collectives, less memory;
  fx-vp    the automatic plan with ``vocab_parallel_loss=True`` and the loss
           ``fxsplit.tp.functional.vocab_parallel_cross_entropy`` (Megatron's parallel cross-entropy: the
           logits stay sharded, so the head and the loss are split too);
  dtensor  ``parallelize_module`` with ColwiseParallel on attn.q/k/v and mlp.up, RowwiseParallel on
           attn.proj and mlp.down of every block (the tutorial plan), embeddings, norms and head
           replicated. The zoo GPT reshapes with ``self.n_head`` read at run time, so each block's
           ``attn.n_head`` is set to n_head / t (the usual head-count trick);
  single   the unsplit model on rank 0 (rank 1 waits in a barrier).
Then rounds of one step each, the order flipping every round (the machine is shared and drifts).
Each step is forward + backward over the whole batch, no optimizer; every timed step starts after
a barrier and its time is the slowest rank's; gradients are zeroed outside the timing. Step 0 is
checked: loss and EVERY gradient (shards gathered) against the single process.

Collectives: fxsplit's via ``fxsplit.tp.collectives.record_collectives`` (plus 2 all-reduces of a
4-byte error flag per step); DTensor's with a TorchDispatchMode that logs the functional
collectives (``_c10d_functional``) DTensor issues, backward included. Peak memory per rank: the
kernel's high-water mark of resident memory (VmHWM, reset through /proc/self/clear_refs before
each step) minus the resident memory at the step's start; glibc is told to return every block
over 64 KiB to the kernel when freed (mallopt), so the mark follows tensor lifetimes.
"""

from __future__ import annotations

import copy
import functools
import sys
import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fxsplit
from fxsplit.testing import zoo
from fxsplit.tp.collectives import record_collectives
from fxsplit.tp.functional import vocab_parallel_cross_entropy

from _common import (
    MATCHED_PLAN, PeakRSS, alternate_rounds, compare_grads, dtensor_tp, full_grads_dtensor, full_grads_fxsplit,
    gpt_note, grads_of, launch, load_note, make_gpt, med, mib, numerics_exit_code, numerics_lines, param_bytes,
    parse_setup, per_round_line, rank_cpus, rank_peaks, release_freed_memory, round_ratio, rounds_note,
    setup_line, single_step, slash, targets)


@dataclass(frozen=True)
class Setup:
    layers: int = 8
    width: int = 256
    heads: int = 8
    vocab: int = 4096
    seq: int = 128
    batch: int = 16
    warmup: int = 1
    steps: int = 5
    auto: bool = True  # also time fxsplit's automatic (vocabulary-parallel) plan, and with the parallel loss


# ----------------------------------------------------------------------------- measuring


class FunctionalCollectives(TorchDispatchMode):
    """Log (op name, payload bytes) of every ``_c10d_functional`` collective dispatched inside."""

    COLLECTIVES = ("all_reduce", "all_reduce_", "all_gather_into_tensor", "reduce_scatter_tensor",
                   "all_to_all_single", "broadcast", "broadcast_")

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns = getattr(func, "namespace", "")
        name = func._schema.name.split("::")[-1]
        if ns in ("_c10d_functional", "c10d_functional") and name in self.COLLECTIVES:
            t = args[0] if isinstance(args[0], torch.Tensor) else args[0][0]
            self.calls.append((name, t.numel() * t.element_size()))
        return func(*args, **(kwargs or {}))


def summarize_calls(calls: list[tuple[str, int]]) -> dict:
    kinds: dict[str, list[int]] = {}
    for name, nbytes in calls:
        kinds.setdefault(name, []).append(nbytes)
    return {"count": len(calls), "bytes": sum(b for _, b in calls),
            "by_kind": {k: (len(v), sum(v)) for k, v in sorted(kinds.items())}}


def megatron_bytes(s: Setup, layers: int | None = None) -> int:
    return 4 * (s.layers if layers is None else layers) * s.batch * s.seq * s.width * 4


# ----------------------------------------------------------------------------- one rank


def _rank_main(rank: int, world: int, setup: Setup) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    release_freed_memory()
    model, (x,), _ = make_gpt(setup)  # separate q/k/v, untied head (DTensor's tutorial plan has no tied weights)
    y = targets(setup)
    single = copy.deepcopy(model)
    setup_s = {}
    t0 = time.perf_counter()
    pms = {"fx": fxsplit.parallelize(model, (x,), loss_fn=zoo.cross_entropy_loss, tp=world,
                                     tp_plan=MATCHED_PLAN, timeout=300)}
    setup_s["fx"] = time.perf_counter() - t0
    if setup.auto:
        t0 = time.perf_counter()
        pms["fx-auto"] = fxsplit.parallelize(model, (x,), loss_fn=zoo.cross_entropy_loss, tp=world, timeout=300)
        setup_s["fx-auto"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        vp_loss = functools.partial(vocab_parallel_cross_entropy, vocab_size=setup.vocab)
        pms["fx-vp"] = fxsplit.parallelize(model, (x,), loss_fn=vp_loss, tp=world, vocab_parallel_loss=True,
                                           timeout=300)
        setup_s["fx-vp"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    dt_model = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    dtensor_tp(dt_model, mesh, world)
    setup_s["dtensor"] = time.perf_counter() - t0

    losses: dict[str, float] = {}
    comm: dict[str, list] = {}

    def fx_step(key):
        def run():
            with record_collectives() as log:
                losses[key] = float(pms[key].step(x, target=y))
            comm[key] = [(c.kind, c.dtype.itemsize * _numel(c.shape)) for c in log]
        return run

    def dt_step():
        with FunctionalCollectives() as mode:
            loss = zoo.cross_entropy_loss(dt_model(x), y)
            loss.backward()
        losses["dtensor"] = float(loss.detach())
        comm["dtensor"] = mode.calls

    def zero():
        for pm in pms.values():
            pm.zero_grad(set_to_none=True)
        dt_model.zero_grad(set_to_none=True)
        single.zero_grad(set_to_none=True)

    check = {}

    def gather_grads(i, name, active):
        if i == 0:  # numerics: every gradient against the single process
            check[name] = (full_grads_dtensor(dt_model) if name == "dtensor" else
                           full_grads_fxsplit(pms[name]) if name in pms else
                           grads_of(single) if active else {})

    runs = [(k, fx_step(k), True) for k in pms] + [("dtensor", dt_step, True),
                                                    ("single", single_step(single, x, y, losses), rank == 0)]
    times, cpus, peaks = alternate_rounds(runs, setup.warmup, setup.steps, zero, peak=PeakRSS(),
                                          after_step=gather_grads)
    ref = check.get("single", {})
    numerics = {k: compare_grads(ref, v) for k, v in check.items() if k != "single"} if rank == 0 else {}
    params = {k: param_bytes(pm.parameters()) for k, pm in pms.items()}
    params["dtensor"] = param_bytes(dt_model.parameters())
    params["single"] = param_bytes(single.parameters())
    return {"times": times, "cpu": cpus, "losses": losses, "comm": {k: summarize_calls(v) for k, v in comm.items()},
            "peaks": peaks, "params": params, "numerics": numerics, "setup_s": setup_s}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# ----------------------------------------------------------------------------- report


def report(results: list[dict], setup: Setup, load: tuple[float, float], wall: float) -> str:
    t = len(results)
    r0 = results[0]
    w = r0["times"]
    n = len(w["single"])
    names = [k for k in w if k != "single"]
    lines = [
        f"{gpt_note(setup, heads=True)}; t={t}, {rounds_note(setup.warmup, n)}; {load_note(load)}; "
        f"wall {wall:.0f}s",
        f"{'step':<9} {'median s':>8} {'x single':>8} {'x dtensor':>9} {'colls':>5} {'MiB moved':>9} "
        f"{'x Megatron':>10} {'peak MiB r0/r1':>15} {'param MiB':>9} {'CPU s r0/r1':>11} {'CPU x dt':>8}",
    ]
    mega = megatron_bytes(setup)
    for k in [*names, "single"]:
        c = r0["comm"].get(k)
        cpu = rank_cpus(results, k)
        lines.append(
            f"{k:<9} {med(w[k]):8.3f} {round_ratio(w[k], w['single']):8.3f} {round_ratio(w[k], w['dtensor']):9.3f} "
            f"{(c['count'] if c else 0):5d} {mib(c['bytes']) if c else '0':>9} "
            f"{(c['bytes'] / mega if c else 0):10.3f} {rank_peaks(results, k):>15} {mib(r0['params'][k]):>9} "
            f"{slash(cpu):>11} {max(cpu) / max(rank_cpus(results, 'dtensor')):8.3f}")
    lines.append(f"Megatron count: 4 all-reduces x {setup.layers} layers x b*s*h = "
                 f"{4 * setup.layers} x {mib(setup.batch * setup.seq * setup.width * 4)} MiB = "
                 f"{mib(mega)} MiB per step")
    for k in names:
        c = r0["comm"][k]
        lines.append(f"  {k}: " + ", ".join(f"{kind} {cnt} x = {mib(b)} MiB"
                                             for kind, (cnt, b) in c["by_kind"].items()))
    lines += numerics_lines(r0["numerics"], r0["losses"])
    lines.append(setup_line(r0["setup_s"]))
    lines.append("  " + per_round_line(w))
    lines.append(
        "ratios are medians of per-round ratios; MiB moved = payload bytes of this rank's collectives "
        "in one step (forward + backward); peak = rise of resident memory during one step (median); CPU = "
        "main-thread CPU seconds per step (median; compute and framework overhead, not waits), "
        "CPU x dt = slowest rank's CPU / DTensor's slowest rank's CPU.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    _, setup = parse_setup(Setup, argv, __doc__.split("\n")[0])
    results, load, wall = launch(_rank_main, 2, setup, timeout=600)
    print(report(results, setup, load, wall))
    return numerics_exit_code(results[0]["numerics"])


if __name__ == "__main__":
    sys.exit(main())
