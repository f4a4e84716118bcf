"""Peak activation memory per pipeline rank: GPipe vs 1F1B vs interleaved 1F1B, against the formulas.

Terms: p pipeline ranks (rank r), v stages per rank, m microbatches; a rank's **share** of one
microbatch is what its stages save for backward in one forward of that microbatch (all v stages).
Formulas (DESIGN.md), peak in-flight microbatches on rank r in units of its share: GPipe m,
1F1B p - r, interleaved 1F1B (2(p-r-1) + (v-1)p + 1) / v, which is p + (p-1)/v on rank 0
(Megatron, m % p == 0).

    .venv/bin/python benchmarks/activation_memory.py              # p=2 and p=4, m=8, then checkpointing at p=2
    .venv/bin/python benchmarks/activation_memory.py --ranks 2 --microbatches 6
    .venv/bin/python benchmarks/activation_memory.py --ranks "" --checkpointing-ranks 2   # checkpointing only

Method: each rank trains one step of fxsplit.parallelize under ``saved_tensors_hooks`` that count
the bytes of every distinct storage autograd saves (parameter storages excluded: a weight saved by
a matmul is not an activation), minus what is freed when its graph is released; the peak of that
count is the rank's peak activation memory. The share is measured on the same rank: the count's
growth over each local stage's forward of microbatch 0 (the loss' saved log-softmax included on
the last stage). Peak / share is the measured in-flight number, printed next to the formula and the
simulator's ``Timeline.peak_inflight``; "held" is the peak number of (stage, microbatch) forwards
the runtime held (weight 1/v each), read from its state after every action.

Activation checkpointing (``activation_checkpointing`` none / selective / full, 1F1B, on
``--checkpointing-ranks`` ranks): saved-tensor hooks cannot see what ``torch.utils.checkpoint``
keeps (its inputs, the selective cache), so each rank measures with
``fxsplit.testing.memory.LiveBytes``: every storage an op allocates during the step, counted until
it is freed (activations, their gradients, temporaries and received messages; not the
collectives' internal buffers). Parameter gradients exist before the timed step (a first step
allocates them, kept with ``zero_grad(set_to_none=False)``), so they are not in the count. The
rank's **peak** of that count is printed next to the plan's prediction of its peak activations
(in-flight microbatches x the rank's act/mb, ``SplitPlan.peak_activations``; the model is traced
with an example of one microbatch, so act/mb is evaluated at the microbatch's size), and both
savings against "none". **held** is the count as each backward starts (its maximum over the step): the
activations in flight with the stage inputs and outputs the runtime keeps and its message
buffers, which is what the plan predicts ([Note: what a stage holds] in fxsplit.pipeline.memory,
[Note: message buffers] in fxsplit.pipeline.memory). The **peak** also holds the working memory
of a backward and, under checkpointing, the layer being recomputed, which the prediction does
not count.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass

import torch

import fxsplit
from fxsplit import schedule as schedules
from fxsplit.schedule.ir import ActionKind
from fxsplit.testing import zoo

from _common import gpt_note, launch, make_gpt, parse_setup, targets

SCHEDULES = {"gpipe": ("gpipe", 1), "1f1b": ("1f1b", 1), "interleaved": ("interleaved_1f1b", 2)}


@dataclass(frozen=True)
class Setup:
    layers: int = 8
    width: int = 128
    heads: int = 4
    vocab: int = 1024
    seq: int = 64
    batch: int = 16
    microbatches: int = 8
    ranks: str = "2,4"
    checkpointing_ranks: str = "2"


class SavedBytes:
    """Live and peak bytes of distinct non-parameter storages saved for backward."""

    def __init__(self, params):
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def _release(self, key: int, nbytes: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= nbytes

    def pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.param_ptrs or st.nbytes() == 0:
            return t
        if key not in self.refs:
            self.refs[key] = 0
            self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        box = _Box(t)
        weakref.finalize(box, self._release, key, st.nbytes())
        return box

    @staticmethod
    def unpack(x):
        return x.t if isinstance(x, _Box) else x

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Box:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor):
        self.t = t


def formula(schedule: str, p: int, r: int, m: int, v: int) -> float:
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, p - r))
    # Megatron's warm-up: rank r runs 2(p-r-1) + (v-1)p forwards before its first backward and
    # holds one more when that backward starts: (2(p-r-1) + (v-1)p + 1) / v shares; p + (p-1)/v on rank 0
    return float(min(m, (2 * (p - r - 1) + (v - 1) * p + 1) / v))


def _rank_main(rank: int, world: int, setup: Setup) -> dict:
    model, (x,), _ = make_gpt(setup)
    y = targets(setup)
    out = {}
    for label, (name, v) in SCHEDULES.items():
        pm = fxsplit.parallelize(model, (x,), loss_fn=zoo.cross_entropy_loss, pp=world,
                                 microbatches=setup.microbatches, schedule=name, stages_per_rank=v,
                                 hardware=fxsplit.Hardware(link_bytes_per_s=float("inf")), timeout=120)
        counter = SavedBytes(pm.parameters())
        share: dict[int, int] = {}
        held = {"now": 0.0, "peak": 0.0, "before": 0}

        def before(step, a):
            held["before"] = counter.live

        def after(step, a):  # after each F, B and I: what the step holds for later backwards
            if a.kind is ActionKind.BACKWARD_WEIGHT:
                return
            if a.kind is ActionKind.FORWARD and a.microbatch == 0:
                share[a.stage] = counter.live - held["before"]
            held["now"] = len(step.saved) / v
            held["peak"] = max(held["peak"], held["now"])

        with pm.runtime.probe(before=before, after=after), counter.hooks():
            loss = pm.step(x, target=y)
        if counter.live != 0:
            raise RuntimeError(f"rank {rank} {label}: {counter.live} saved bytes still live after the step")
        sim = schedules.simulate(pm.plan.schedule, forward=1.0, backward=2.0)
        out[label] = {"peak": counter.peak, "share": sum(share.values()), "held": held["peak"],
                      "sim": sim.peak_inflight[rank], "loss": float(loss), "v": v}
    return out


CHECKPOINTING = ("none", "selective", "full")


def _rank_checkpointing(rank: int, world: int, setup: Setup) -> dict:
    from fxsplit.testing.memory import LiveBytes

    model, (x,), _ = make_gpt(setup)
    y = targets(setup)
    out = {}
    mb = x[: setup.batch // setup.microbatches]  # traced at one microbatch: the plan's act/mb is per microbatch
    for mode in CHECKPOINTING:
        pm = fxsplit.parallelize(model, (mb,), loss_fn=zoo.cross_entropy_loss, pp=world,
                                 microbatches=setup.microbatches, schedule="1f1b", activation_checkpointing=mode,
                                 hardware=fxsplit.Hardware(link_bytes_per_s=float("inf")), timeout=120)
        pm.step(x, target=y)  # allocates the parameter gradients
        for p in pm.parameters():
            p.grad.zero_()
        held = [0]

        def backward_starts(step, a):  # what the rank holds as a backward (B or I) starts
            if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT):
                held[0] = max(held[0], mem.live)

        with pm.runtime.probe(before=backward_starts), LiveBytes() as mem:
            loss = pm.step(x, target=y)
        with_, without = pm.plan.split.peak_activations()
        out[mode] = {"peak": mem.peak, "held": held[0], "predicted": with_[rank], "predicted_none": without[rank],
                     "loss": float(loss), "stages": [s.checkpointing for s in pm.plan.split.stages if s.rank == rank]}
    return out


def report_checkpointing(p: int, results: list[dict], setup: Setup) -> list[str]:
    lines = [f"activation checkpointing, 1f1b, p={p}, m={setup.microbatches}: {gpt_note(setup)} "
             f"(microbatch {setup.batch // setup.microbatches})",
             f"{'mode':<10} {'rank':>4} {'peak MiB':>9} {'saved':>6} {'held MiB':>9} {'saved':>6} "
             f"{'plan MiB':>9} {'saved':>6} {'loss':>9}"]
    for mode in CHECKPOINTING:
        for r, res in enumerate(results):
            d, none = res[mode], res["none"]
            lines.append(f"{mode:<10} {r:>4} {d['peak'] / 2**20:9.2f} {(none['peak'] - d['peak']) / 2**20:6.2f} "
                         f"{d['held'] / 2**20:9.2f} {(none['held'] - d['held']) / 2**20:6.2f} "
                         f"{d['predicted'] / 2**20:9.2f} {(d['predicted_none'] - d['predicted']) / 2**20:6.2f} "
                         f"{d['loss']:9.6f}")
    losses = {res[m]["loss"] for res in results[-1:] for m in CHECKPOINTING}
    lines.append(f"last-rank losses equal across modes: {len(losses) == 1}")
    return lines


def report(p: int, results: list[dict], setup: Setup) -> list[str]:
    m = setup.microbatches
    lines = [f"p={p}, m={m}: {gpt_note(setup)} (microbatch {setup.batch // m})",
             f"{'schedule':<14} {'rank':>4} {'peak MiB':>9} {'share MiB':>9} {'measured':>8} "
             f"{'held':>6} {'simulated':>9} {'formula':>8}"]
    for label in SCHEDULES:
        for r, res in enumerate(results):
            d = res[label]
            f = formula(label, p, r, m, d["v"])
            lines.append(
                f"{label + ' v=' + str(d['v']):<14} {r:>4} {d['peak'] / 2**20:9.2f} {d['share'] / 2**20:9.2f} "
                f"{d['peak'] / d['share']:8.2f} {d['held']:6.2f} {d['sim']:9.2f} "
                f"{f:8.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    _, setup = parse_setup(Setup, argv, __doc__.split("\n")[0])
    for p in (int(s) for s in setup.ranks.split(",") if s):
        if setup.microbatches % p:
            raise SystemExit(f"--microbatches {setup.microbatches} must be a multiple of p={p} "
                             "(Megatron's interleaving formula assumes m % p == 0)")
        results, _, wall = launch(_rank_main, p, setup, timeout=600)
        print("\n".join(report(p, results, setup)))
        print(f"({wall:.0f}s)")
    for p in (int(s) for s in setup.checkpointing_ranks.split(",") if s):
        results, _, wall = launch(_rank_checkpointing, p, setup, timeout=900)
        print("\n".join(report_checkpointing(p, results, setup)))
        print(f"({wall:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
