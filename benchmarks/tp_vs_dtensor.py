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

import argparse
import copy
import ctypes
import functools
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import fxsplit
from fxsplit.testing import zoo
from fxsplit.tp.collectives import record_collectives
from fxsplit.testing import run_distributed
from fxsplit.tp.functional import vocab_parallel_cross_entropy

MATCHED_PLAN = {"wte": "replicate", "lm_head": "replicate"}


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


def build_model(s: Setup):
    """The zoo GPT with separate q/k/v, untied head (DTensor's tutorial plan has no tied weights)."""
    return zoo.make_gpt(n_layer=s.layers, n_embd=s.width, n_head=s.heads, vocab_size=s.vocab,
                        block_size=s.seq, seq_len=s.seq, batch_size=s.batch, tie_weights=False, seed=0)


def batch_of(s: Setup, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return x, torch.randint(0, s.vocab, (s.batch, s.seq), generator=g)


# ----------------------------------------------------------------------------- measuring


def release_freed_memory() -> None:
    """glibc: serve every block over 64 KiB with mmap and unmap it when freed (M_MMAP_THRESHOLD)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)
    except OSError:  # not glibc: the peak then includes memory the allocator kept
        pass


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


class PeakRSS:
    """Bytes by which resident memory rose above its level at ``start()``, up to ``stop()``."""

    def start(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current VmRSS
        self.base = _status_kb("VmRSS")

    def stop(self) -> int:
        return (_status_kb("VmHWM") - self.base) * 1024


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


def timed(fn, active: bool = True, cpu: list | None = None) -> float:
    """The slowest rank's wall seconds for ``fn()``, started after a barrier; this rank's
    main-thread CPU seconds are appended to ``cpu`` (gloo's own threads are not counted)."""
    dist.barrier()
    c0, t0 = time.thread_time(), time.perf_counter()
    if active:
        fn()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    if cpu is not None:
        cpu.append(time.thread_time() - c0)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt)


def summarize_calls(calls: list[tuple[str, int]]) -> dict:
    kinds: dict[str, list[int]] = {}
    for name, nbytes in calls:
        kinds.setdefault(name, []).append(nbytes)
    return {"count": len(calls), "bytes": sum(b for _, b in calls),
            "by_kind": {k: (len(v), sum(v)) for k, v in sorted(kinds.items())}}


def megatron_bytes(s: Setup, layers: int | None = None) -> int:
    return 4 * (s.layers if layers is None else layers) * s.batch * s.seq * s.width * 4


# ----------------------------------------------------------------------------- frameworks


def dtensor_tp(model: torch.nn.Module, mesh, tp: int, prefix: str = "blocks") -> None:
    """Apply the tutorial TP plan to every block of ``model`` in place, with local head counts."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    blocks = model.get_submodule(prefix)
    for name, _ in blocks.named_children():
        p = f"{prefix}.{name}"
        plan.update({f"{p}.attn.q": ColwiseParallel(), f"{p}.attn.k": ColwiseParallel(),
                     f"{p}.attn.v": ColwiseParallel(), f"{p}.attn.proj": RowwiseParallel(),
                     f"{p}.mlp.up": ColwiseParallel(), f"{p}.mlp.down": RowwiseParallel()})
    parallelize_module(model, mesh, plan)
    for block in blocks.children():
        attn = block.attn
        if hasattr(attn, "n_head"):
            if attn.n_head % tp or attn.n_kv_head % tp:
                raise ValueError(f"n_head={attn.n_head}, n_kv_head={attn.n_kv_head} must divide by tp={tp}")
            attn.n_head //= tp
            attn.n_kv_head //= tp


def full_grads_dtensor(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def full_grads_fxsplit(pm) -> dict[str, torch.Tensor]:
    """Every gradient of ``pm`` under the original names and shapes (collective over tp and pp)."""
    from fxsplit.tp.sharding import unshard_state_dict

    specs = pm.plan.tp_plan.param_specs
    local: dict[str, torch.Tensor] = {}
    for mod in pm.stage_modules.values():
        for name, p in mod.named_parameters():
            if p.grad is not None:
                local.setdefault(name, p.grad.detach().clone())
    tp = pm._groups.get("tp")
    if tp is not None and dist.get_world_size(tp) > 1:
        per_rank: list = [None] * dist.get_world_size(tp)
        dist.all_gather_object(per_rank, local, group=tp)
        local = unshard_state_dict(per_rank, {k: v for k, v in specs.items() if k in local})
    pp = pm._groups.get("pp")
    if pp is not None and dist.get_world_size(pp) > 1:
        parts: list = [None] * dist.get_world_size(pp)
        dist.all_gather_object(parts, local, group=pp)
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            for k, v in part.items():
                merged.setdefault(k, v)
        local = merged
    return local


def compare_grads(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], *, rtol: float = 1e-5,
                  atol: float = 1e-6) -> dict:
    """Largest |diff| over every gradient, and the names failing ``allclose(rtol, atol)`` or missing."""
    bad = sorted(set(ref) ^ set(got))
    worst = 0.0
    for k in sorted(set(ref) & set(got)):
        a, b = got[k], ref[k]
        if a.shape != b.shape:
            bad.append(f"{k} shape {tuple(a.shape)} != {tuple(b.shape)}")
            continue
        worst = max(worst, float((a - b).abs().max()))
        if not torch.allclose(a, b, rtol=rtol, atol=atol):
            bad.append(k)
    return {"n": len(ref), "max_abs": worst, "bad": bad, "tol": (rtol, atol)}


# ----------------------------------------------------------------------------- one rank


def _rank_main(rank: int, world: int, setup: Setup) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    release_freed_memory()
    model, (x,), _ = build_model(setup)
    x, y = batch_of(setup, x)
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
    peak = PeakRSS()
    peaks: dict[str, list[int]] = {}

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

    def single_step():
        loss = zoo.cross_entropy_loss(single(x), y)
        loss.backward()
        losses["single"] = float(loss.detach())

    def zero():
        for pm in pms.values():
            pm.zero_grad(set_to_none=True)
        dt_model.zero_grad(set_to_none=True)
        single.zero_grad(set_to_none=True)

    runs = [(k, fx_step(k), True) for k in pms] + [("dtensor", dt_step, True), ("single", single_step, rank == 0)]
    times: dict[str, list[float]] = {k: [] for k, _, _ in runs}
    cpus: dict[str, list[float]] = {k: [] for k, _, _ in runs}
    check = {}
    for i in range(setup.warmup + setup.steps):
        order = runs if i % 2 == 0 else runs[::-1]
        for name, fn, active in order:
            peak.start()
            cpu: list[float] = []
            dt = timed(fn, active, cpu)
            if active and i >= setup.warmup:
                peaks.setdefault(name, []).append(peak.stop())
                cpus[name].extend(cpu)
            if i == 0:  # numerics: every gradient against the single process
                grads = (full_grads_dtensor(dt_model) if name == "dtensor" else
                         full_grads_fxsplit(pms[name]) if name in pms else
                         {k: p.grad.detach().clone() for k, p in single.named_parameters()} if active else {})
                check[name] = grads
            zero()
            if i >= setup.warmup:
                times[name].append(dt)
    ref = check.get("single", {})
    numerics = {k: compare_grads(ref, v) for k, v in check.items() if k != "single"} if rank == 0 else {}
    params = {k: sum(p.numel() * p.element_size() for p in pm.parameters()) for k, pm in pms.items()}
    params["dtensor"] = sum(_local(p).numel() * p.element_size() for p in dt_model.parameters())
    params["single"] = sum(p.numel() * p.element_size() for p in single.parameters())
    return {"times": times, "cpu": cpus, "losses": losses, "comm": {k: summarize_calls(v) for k, v in comm.items()},
            "peaks": peaks, "params": params, "numerics": numerics, "setup_s": setup_s}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _local(p):
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


# ----------------------------------------------------------------------------- report


def _med(xs) -> float:
    return statistics.median(xs)


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def report(results: list[dict], setup: Setup, load: tuple[float, float], wall: float) -> str:
    t = len(results)
    r0 = results[0]
    w = r0["times"]
    n = len(w["single"])
    names = [k for k in w if k != "single"]
    lines = [
        f"GPT {setup.layers} layers, width {setup.width}, {setup.heads} heads, vocab {setup.vocab}, "
        f"seq {setup.seq}, batch {setup.batch}; t={t}, gloo, 1 thread per rank; {setup.warmup} warmup + "
        f"{n} timed rounds; 1-min load average {load[0]:.1f} -> {load[1]:.1f} on {os.cpu_count()} cores; "
        f"wall {wall:.0f}s",
        f"{'step':<9} {'median s':>8} {'x single':>8} {'x dtensor':>9} {'colls':>5} {'MiB moved':>9} "
        f"{'x Megatron':>10} {'peak MiB r0/r1':>15} {'param MiB':>9} {'CPU s r0/r1':>11} {'CPU x dt':>8}",
    ]
    mega = megatron_bytes(setup)
    for k in [*names, "single"]:
        ratio_single = _med([w[k][i] / w["single"][i] for i in range(n)])
        ratio_dt = _med([w[k][i] / w["dtensor"][i] for i in range(n)])
        c = r0["comm"].get(k)
        pk = "/".join(mib(_med(r["peaks"][k])) for r in results if k in r["peaks"])
        cpu = [_med(r["cpu"][k]) for r in results if r["cpu"][k]]
        dt_cpu = max(_med(r["cpu"]["dtensor"]) for r in results)
        lines.append(
            f"{k:<9} {_med(w[k]):8.3f} {ratio_single:8.3f} {ratio_dt:9.3f} "
            f"{(c['count'] if c else 0):5d} {mib(c['bytes']) if c else '0':>9} "
            f"{(c['bytes'] / mega if c else 0):10.3f} {pk:>15} {mib(r0['params'][k]):>9} "
            f"{'/'.join(f'{x:.2f}' for x in cpu):>11} {max(cpu) / dt_cpu:8.3f}")
    lines.append(f"Megatron count: 4 all-reduces x {setup.layers} layers x b*s*h = "
                 f"{4 * setup.layers} x {mib(setup.batch * setup.seq * setup.width * 4)} MiB = "
                 f"{mib(mega)} MiB per step")
    for k in names:
        c = r0["comm"][k]
        lines.append(f"  {k}: " + ", ".join(f"{kind} {cnt} x = {mib(b)} MiB"
                                             for kind, (cnt, b) in c["by_kind"].items()))
    for k, v in r0["numerics"].items():
        lines.append(f"  step-0 numerics {k} vs single: loss {r0['losses'].get(k, float('nan')):.6f} vs "
                     f"{r0['losses'].get('single', float('nan')):.6f}; {v['n']} gradients, max |diff| "
                     f"{v['max_abs']:.2e}; " +
                     (f"NOT allclose(rtol={v['tol'][0]:g}, atol={v['tol'][1]:g}): {v['bad']}" if v["bad"] else
                      f"all allclose(rtol={v['tol'][0]:g}, atol={v['tol'][1]:g})"))
    lines.append("  setup s on rank 0: " + ", ".join(f"{k} {v:.1f}" for k, v in r0["setup_s"].items()))
    lines.append("  wall s per round: " + "; ".join(f"{k} " + " ".join(f"{x:.3f}" for x in v) for k, v in w.items()))
    lines.append(
        "ratios are medians of per-round ratios; MiB moved = payload bytes of this rank's collectives "
        "in one step (forward + backward); peak = rise of resident memory during one step (median); CPU = "
        "main-thread CPU seconds per step (median; compute and framework overhead, not waits), "
        "CPU x dt = slowest rank's CPU / DTensor's slowest rank's CPU.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f, val in asdict(Setup()).items():
        if isinstance(val, bool):
            ap.add_argument(f"--no-{f}", dest=f, action="store_false")
        else:
            ap.add_argument(f"--{f.replace('_', '-')}", dest=f, type=type(val), default=val)
    setup = Setup(**vars(ap.parse_args(argv)))
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    results = run_distributed(_rank_main, 2, setup, timeout=600)
    print(report(results, setup, (load0, os.getloadavg()[0]), time.perf_counter() - t0))
    bad = [k for k, v in results[0]["numerics"].items() if v["bad"]]
    if bad:
        print(f"NUMERICS MISMATCH: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
