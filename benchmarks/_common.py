"""Scaffolding shared by the benchmark scripts in this folder; not a benchmark itself.

Each script keeps what it measures and how it reports it; what they all do the same way is here:

- command line: ``parse_setup`` (one flag per field of a script's frozen ``Setup`` dataclass);
- model and data: ``make_gpt`` (the zoo GPT sized by a Setup), ``targets`` (fixed labels);
- launching: ``launch`` (``run_distributed`` on fresh gloo ranks, with wall time and load);
- timing: ``timed`` (one step after a barrier: the slowest rank's wall seconds and this rank's
  main-thread CPU seconds) and ``alternate_rounds`` (warmup + timed rounds of every variant,
  the order flipping every round, gradients zeroed outside the timing); ``single_step`` and
  ``ptd_step`` (one step of the unsplit model / of a PTD pipeline schedule);
- memory: ``release_freed_memory``, ``PeakRSS`` (resident-memory rise during one step),
  ``peak_rss_mb`` (the process's peak so far), ``param_bytes``;
- frameworks built the same way by several scripts: ``MATCHED_PLAN``, ``dtensor_tp`` (DTensor's
  tutorial TP plan), ``ptd_pipe`` / ``ptd_schedule`` (torch.distributed.pipelining);
- numerics: every gradient of fxsplit / DTensor / one process (``full_grads_fxsplit``,
  ``full_grads_dtensor``, ``grads_of``), ``compare_grads``, ``numerics_lines``,
  ``numerics_exit_code``;
- report: ``med``, ``round_ratio`` (median of per-round ratios), ``mib``, ``gpt_note``,
  ``rounds_note``, ``load_note``, ``per_round_line``, ``setup_line``, ``rank_peaks``,
  ``rank_cpus``, ``slash``.

The scripts import it as a sibling module (``from _common import ...``): run them as
``.venv/bin/python benchmarks/<script>.py``; Python puts the script's folder on ``sys.path``
and the ranks ``run_distributed`` starts inherit it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import statistics
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from fxsplit.testing import zoo
from fxsplit.testing import run_distributed

# ----------------------------------------------------------------------------- command line


def parse_setup(cls, argv: list[str] | None, description: str, *, bools: str = "no",
                helps: dict[str, str] | None = None):
    """Parse ``argv`` into ``cls(...)``, a frozen dataclass whose defaults are the script's defaults.

    One flag per field, ``--field-name`` (underscores as dashes) of the default's type. A bool field
    is ``--no-field`` when ``bools="no"`` (it turns a default-on option off), ``--field`` /
    ``--no-field`` when ``bools="both"``; a tuple field is a comma list. ``helps`` adds help
    texts by field. Returns ``(parser, setup)``; the parser is for the script's own checks
    (``parser.error``)."""
    helps = helps or {}
    ap = argparse.ArgumentParser(description=description)
    for f, val in asdict(cls()).items():
        flag = f"--{f.replace('_', '-')}"
        if isinstance(val, bool):
            if bools == "both":
                ap.add_argument(flag, dest=f, action=argparse.BooleanOptionalAction, default=val, help=helps.get(f))
            else:
                ap.add_argument(f"--no-{f}", dest=f, action="store_false", help=helps.get(f))
        elif isinstance(val, tuple):
            ap.add_argument(flag, dest=f, default=",".join(val), help=helps.get(f))
        else:
            ap.add_argument(flag, dest=f, type=type(val), default=val, help=helps.get(f))
    kw = vars(ap.parse_args(argv))
    for f, val in asdict(cls()).items():
        if isinstance(val, tuple):
            kw[f] = tuple(s for s in kw[f].split(",") if s)
    return ap, cls(**kw)


# ----------------------------------------------------------------------------- model and data


def make_gpt(s, *, tie: bool = False):
    """The zoo GPT sized by a Setup's ``layers, width, heads, vocab, seq, batch`` (block size = seq),
    seed 0: ``(model, (x,), kwargs)``. ``tie`` ties the LM head to the token embedding."""
    return zoo.make_gpt(n_layer=s.layers, n_embd=s.width, n_head=s.heads, vocab_size=s.vocab,
                        block_size=s.seq, seq_len=s.seq, batch_size=s.batch, tie_weights=tie, seed=0)


def targets(s) -> torch.Tensor:
    """The labels every benchmark trains on: ``(batch, seq)`` token ids from a generator seeded 7."""
    return torch.randint(0, s.vocab, (s.batch, s.seq), generator=torch.Generator().manual_seed(7))


# ----------------------------------------------------------------------------- launching


def launch(rank_main, world: int, setup, *, timeout: float):
    """``run_distributed(rank_main, world, setup)`` (gloo, one thread per rank): returns
    ``(per-rank results, (1-minute load average before, after), wall seconds)``."""
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    results = run_distributed(rank_main, world, setup, timeout=timeout)
    return results, (load0, os.getloadavg()[0]), time.perf_counter() - t0


# ----------------------------------------------------------------------------- timing


def timed(fn, active: bool = True) -> tuple[float, float]:
    """One step: ``fn()`` (skipped where ``active`` is false: that rank only joins the barrier and
    the reduction), started after a barrier. Returns (the slowest rank's wall seconds, this rank's
    main-thread CPU seconds; gloo's own threads are not counted)."""
    dist.barrier()
    c0, t0 = time.thread_time(), time.perf_counter()
    if active:
        fn()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    cpu = time.thread_time() - c0
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt), cpu


def alternate_rounds(runs, warmup: int, steps: int, zero, *, peak: PeakRSS | None = None,
                     after_step=None, after_round=None):
    """Time every variant of ``runs`` = ``[(name, step function, active on this rank), ...]`` in
    ``warmup + steps`` rounds of one ``timed`` step each, the order reversed every other round
    (the machine is shared and drifts). After each step: ``after_step(round, name, active)``
    (before the gradients are zeroed), then ``zero()``; after each round ``after_round(round)``.
    ``peak`` (a PeakRSS) measures each active step's memory rise.

    Returns ``(times, cpu, peaks)``, lists per name over the timed rounds only: wall seconds (every
    rank, the slowest rank's), this rank's CPU seconds and peak bytes (where it was active)."""
    times: dict[str, list[float]] = {k: [] for k, _, _ in runs}
    cpus: dict[str, list[float]] = {k: [] for k, _, _ in runs}
    peaks: dict[str, list[int]] = {}
    for i in range(warmup + steps):
        order = runs if i % 2 == 0 else runs[::-1]
        for name, fn, active in order:
            if peak is not None:
                peak.start()
            dt, cpu = timed(fn, active)
            if active and i >= warmup:
                if peak is not None:
                    peaks.setdefault(name, []).append(peak.stop())
                cpus[name].append(cpu)
            if after_step is not None:
                after_step(i, name, active)
            zero()
            if i >= warmup:
                times[name].append(dt)
        if after_round is not None:
            after_round(i)
    return times, cpus, peaks


def single_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, losses: dict, key: str = "single"):
    """A step function for ``alternate_rounds``: forward + backward of the unsplit ``model`` on the
    whole batch (no optimizer); its loss goes to ``losses[key]``."""
    def step():
        loss = zoo.cross_entropy_loss(model(x), y)
        loss.backward()
        losses[key] = float(loss.detach())
    return step


def ptd_step(sched, x: torch.Tensor, y: torch.Tensor, *, first: bool, last: bool) -> float | None:
    """One step of a torch.distributed.pipelining schedule on this rank (``first`` / ``last``: it
    holds the first / last stage, which takes the batch / the targets); returns the mean of the
    microbatch losses where it holds the last stage, else None."""
    mb_losses: list = []
    sched.step(*((x,) if first else ()), target=y if last else None, losses=mb_losses if last else None)
    return float(torch.stack(mb_losses).detach().mean()) if last else None


# ----------------------------------------------------------------------------- memory


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


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (getrusage's ru_maxrss)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def local(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def param_bytes(params) -> int:
    """Bytes of the parameters this rank holds (a DTensor's local shard only)."""
    return sum(local(p).numel() * p.element_size() for p in params)


# ----------------------------------------------------------------------------- frameworks

# fxsplit's tp_plan override that gives it DTensor's tutorial sharding: embedding and head replicated
MATCHED_PLAN = {"wte": "replicate", "lm_head": "replicate"}


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


def ptd_pipe(model: torch.nn.Module, x: torch.Tensor, paths, microbatches: int, num_stages: int):
    """PTD's ``pipeline()`` of ``model`` traced on one microbatch of ``x``, cut before each module
    path in ``paths`` (``SplitPoint.BEGINNING``); raises unless it made ``num_stages`` stages."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    pipe = pipeline(model, mb_args=(x[: x.shape[0] // microbatches],),
                    split_spec={p: SplitPoint.BEGINNING for p in paths})
    if pipe.num_stages != num_stages:
        raise RuntimeError(f"PTD made {pipe.num_stages} stages from split points {list(paths)}, "
                           f"expected {num_stages}")
    return pipe


def ptd_schedule(schedule: str, stages: list, microbatches: int):
    """PTD's ``Schedule1F1B`` over this rank's one stage (``schedule == "1f1b"``),
    ``ScheduleInterleavedZeroBubble`` (``"zb_h1"``: ZB1P) or ``ScheduleZBVZeroBubble`` (``"zbv"``,
    stages placed in a V), else ``ScheduleInterleaved1F1B`` over its stages, with the zoo's
    cross-entropy loss. Returns ``(schedule, holds the first stage, holds the last stage)``."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble

    if schedule == "1f1b":
        sched = Schedule1F1B(stages[0], microbatches, loss_fn=zoo.cross_entropy_loss)
    elif schedule == "zb_h1":
        sched = ScheduleInterleavedZeroBubble(stages, microbatches, loss_fn=zoo.cross_entropy_loss)
    elif schedule == "zbv":
        sched = ScheduleZBVZeroBubble(stages, microbatches, loss_fn=zoo.cross_entropy_loss)
    else:
        sched = ScheduleInterleaved1F1B(stages, microbatches, loss_fn=zoo.cross_entropy_loss)
    return sched, any(st.is_first for st in stages), any(st.is_last for st in stages)


# ----------------------------------------------------------------------------- numerics


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the gradients of an unsplit model, by parameter name."""
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def full_grads_dtensor(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient of a DTensor-parallel ``model`` as a full tensor (collective over its mesh)."""
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
    local_grads: dict[str, torch.Tensor] = {}
    for mod in pm.stage_modules.values():
        for name, p in mod.named_parameters():
            if p.grad is not None:
                local_grads.setdefault(name, p.grad.detach().clone())
    tp = pm._groups.tp
    if tp is not None and dist.get_world_size(tp) > 1:
        per_rank: list = [None] * dist.get_world_size(tp)
        dist.all_gather_object(per_rank, local_grads, group=tp)
        local_grads = unshard_state_dict(per_rank, {k: v for k, v in specs.items() if k in local_grads})
    pp = pm._groups.pp
    if pp is not None and dist.get_world_size(pp) > 1:
        parts: list = [None] * dist.get_world_size(pp)
        dist.all_gather_object(parts, local_grads, group=pp)
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            for k, v in part.items():
                merged.setdefault(k, v)
        local_grads = merged
    return local_grads


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


def numerics_lines(numerics: dict[str, dict], losses: dict[str, float]) -> list[str]:
    """One report line per variant: its step-0 loss and ``compare_grads`` result against the single process."""
    lines = []
    for k, v in numerics.items():
        lines.append(f"  step-0 numerics {k} vs single: loss {losses.get(k, float('nan')):.6f} vs "
                     f"{losses.get('single', float('nan')):.6f}; {v['n']} gradients, max |diff| "
                     f"{v['max_abs']:.2e}; " +
                     (f"NOT allclose(rtol={v['tol'][0]:g}, atol={v['tol'][1]:g}): {v['bad']}" if v["bad"] else
                      f"all allclose(rtol={v['tol'][0]:g}, atol={v['tol'][1]:g})"))
    return lines


def numerics_exit_code(numerics: dict[str, dict]) -> int:
    """1 after printing ``NUMERICS MISMATCH: [...]`` if any variant's gradients failed, else 0."""
    bad = [k for k, v in numerics.items() if v["bad"]]
    if bad:
        print(f"NUMERICS MISMATCH: {bad}")
        return 1
    return 0


# ----------------------------------------------------------------------------- report


def med(xs) -> float:
    return statistics.median(xs)


def round_ratio(a: list[float], b: list[float], scale: float = 1.0) -> float:
    """Median over rounds of ``a[i] / b[i] / scale``: ratios taken within a round (same machine load)."""
    return med([x / y / scale for x, y in zip(a, b)])


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def slash(xs, fmt: str = ".2f") -> str:
    """Numbers joined with '/', one per rank."""
    return "/".join(format(x, fmt) for x in xs)


def gpt_note(s, *, heads: bool = False) -> str:
    """``GPT L layers, width h[, n heads], vocab V, seq T, batch B`` of a Setup."""
    return (f"GPT {s.layers} layers, width {s.width}, " + (f"{s.heads} heads, " if heads else "") +
            f"vocab {s.vocab}, seq {s.seq}, batch {s.batch}")


def rounds_note(warmup: int, rounds: int) -> str:
    return f"gloo, 1 thread per rank; {warmup} warmup + {rounds} timed rounds"


def load_note(load: tuple[float, float]) -> str:
    """The machine's 1-minute load average before and after the launch, and its core count."""
    return f"1-min load average {load[0]:.1f} -> {load[1]:.1f} on {os.cpu_count()} cores"


def per_round_line(times: dict[str, list[float]]) -> str:
    """``wall s per round: name t0 t1 ...; ...``: the raw wall seconds behind the medians."""
    return "wall s per round: " + "; ".join(f"{k} " + " ".join(f"{t:.3f}" for t in v) for k, v in times.items())


def setup_line(setup_s: dict[str, float]) -> str:
    return "  setup s on rank 0: " + ", ".join(f"{k} {v:.1f}" for k, v in setup_s.items())


def rank_peaks(results: list[dict], name: str) -> str:
    """Median peak MiB of ``name`` on each rank that ran it, '/'-joined."""
    return "/".join(mib(med(r["peaks"][name])) for r in results if name in r["peaks"])


def rank_cpus(results: list[dict], name: str) -> list[float]:
    """Median CPU seconds per step of ``name`` on each rank that ran it."""
    return [med(r["cpu"][name]) for r in results if r["cpu"][name]]
