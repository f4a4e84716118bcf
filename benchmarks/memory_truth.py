"""Predicted vs measured peak memory per rank (``Plan.memory()`` against the tensors a training
step really holds), on 4 gloo ranks of this machine, for the layouts of issue 28:
tp2 x pp2, pp4 interleaved 1F1B, pp4 ZB-V, dp_shard2 x pp2, each without and with full
activation checkpointing, and with ``mp_policy`` bf16 (parameters float32, compute bfloat16).

    .venv/bin/python benchmarks/memory_truth.py                  # every layout (~5 min on 2 cores)
    .venv/bin/python benchmarks/memory_truth.py --layouts tp2xpp2,zbv

Measured: ``fxsplit.testing.memory.measured_step_peak``: the parameters and AdamW state held
before the step (one warm-up step creates the state; gradients are set to None), plus the peak of
the bytes every op allocates during ``step()`` and ``optimizer.step()`` (``LiveBytes``, a
``TorchDispatchMode``: activations, gradients, messages, FSDP's reduce-scatter input), plus
FSDP's gathered parameters (read off FSDP's records). AdamW runs with ``foreach=False``: the
foreach kernels' temporaries (a copy of every gradient at once) are not in the memory model.
Predicted: ``pm.plan.memory()[pp_rank].peak``, the one model ``print(plan)``, the partition's
cap and the auto-planner use ([Note: memory model] in fxsplit.pipeline.memory). The model is a
zoo GPT with tied embedding and LM head; each layout is planned with ``global_batch_size`` so the
trace is at the microbatch size. Exit code 1 when a rank is off by more than ``--tolerance``.
"""

from __future__ import annotations

import argparse
import sys
import time

from fxsplit.testing import run_distributed
from fxsplit.testing.memory import LAYOUTS, cases, measure_case


def _rank(rank, world, args):
    return {label: measure_case(options, args.gpt, args.batch) for label, options in args.cases.items()}


def table(results: list[dict], cases_: dict) -> tuple[list[str], float]:
    lines = ["| layout | rank | predicted MiB | measured MiB | measured / predicted |", "| --- | --- | --- | --- | --- |"]
    worst = 0.0
    for label in cases_:
        for rank, res in enumerate(results):
            meas, pred, _ = res[label]
            ratio = meas / pred
            worst = max(worst, abs(ratio - 1))
            lines.append(f"| {label} | {rank} | {pred / 2**20:.2f} | {meas / 2**20:.2f} | {ratio:.3f} |")
    return lines, worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--batch", type=int, default=8, help="samples per replica per step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--no-bf16", action="store_true", help="leave out the mp_policy bf16 cases")
    ap.add_argument("--detail", action="store_true", help="print both sides' terms (MiB) per rank")
    args = ap.parse_args()
    args.cases = cases(args.layouts.split(","), bf16=not args.no_bf16)
    args.gpt = dict(seq_len=args.seq, n_embd=args.n_embd, n_layer=args.n_layer, n_head=4, vocab_size=args.vocab,
                    block_size=args.seq)
    t0 = time.perf_counter()
    results = run_distributed(_rank, 4, args, timeout=1800)
    lines, worst = table(results, args.cases)
    print(f"zoo GPT (tied) n_embd={args.n_embd} n_layer={args.n_layer} vocab={args.vocab}, {args.batch}x{args.seq} "
          f"tokens per replica, 4 gloo ranks, AdamW(foreach=False) ({time.perf_counter() - t0:.0f}s)")
    print("\n".join(lines))
    if args.detail:
        for label in args.cases:
            for rank, res in enumerate(results):
                d = res[label][2]
                print(label, rank, {k: round(v / 2**20, 2) for k, v in {**d["measured"], **d["predicted"]}.items()})
    print(f"largest |measured / predicted - 1|: {worst:.3f} (goal <= {args.tolerance})")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
