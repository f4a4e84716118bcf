"""Plan a 70B-parameter Llama for 64 GPUs (tensor parallel 8 x pipeline parallel 8) on a laptop.

Terms: tp, pp, dp the tensor-, pipeline- and data-parallel degrees; v stages per pipeline rank;
m microbatches per step.

    python examples/inspect_plan.py                       # tp=8, pp=8, interleaved 1F1B (v=2)
    python examples/inspect_plan.py --tp 8 --pp 4 --memory-limit 80GB --dot llama.dot --timeline pp.png
    python examples/inspect_plan.py --layers 8 --pp 4     # a shallower model, seconds instead of a minute

The model is ``transformers.LlamaForCausalLM`` with Llama-2-70B's shape (hidden 8192, 80 layers,
64 heads, 8 key/value heads) built on the meta device by ``fxsplit.testing.hf_zoo.meta_llama_70b``:
parameters and inputs are shapes only, so nothing is allocated. ``fxsplit.plan`` runs in this one
process with no process group: it exports the model, finds the tensor-parallel plan, balances the
pipeline stages with the cost model (FLOPs, bytes, activations at bfloat16) and builds the
schedule. The same call sits inside ``fxsplit.parallelize`` on each of the 64 ranks.

Printed: the tensor-parallel plan (one row per sharded module), the stage table (modules,
parameters, FLOPs, activation bytes per microbatch, boundary bytes, estimated time), the
simulated step with its bubble, and how long planning took.
"""

from __future__ import annotations

import argparse
import sys
import time

import fxsplit
from fxsplit.testing.hf_zoo import meta_llama_70b


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel degree (default 8)")
    p.add_argument("--pp", type=int, default=8, help="pipeline-parallel degree (default 8)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree (default 1)")
    p.add_argument("--microbatches", type=int, default=None, help="per step (default 2 * pp)")
    p.add_argument("--schedule", default="interleaved_1f1b", choices=("gpipe", "1f1b", "interleaved_1f1b"))
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: one per microbatch)")
    p.add_argument("--layers", type=int, default=80, help="decoder layers (80 in the real model)")
    p.add_argument("--memory-limit", default=None, help="per pipeline rank, e.g. 80GB (see fxsplit.cli.parse_size)")
    p.add_argument("--dot", default=None, help="write the graph colored by stage (Graphviz DOT) here")
    p.add_argument("--timeline", default=None, help="write the simulated schedule (PNG) here")
    p.add_argument("--full", action="store_true", help="also print the full tensor-parallel and stage tables (plan.tp_table(), plan.stage_table())")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    m = args.microbatches or (2 * args.pp if args.pp > 1 else 1)
    batch = args.batch_size or m
    t0 = time.perf_counter()
    model, example_args, example_kwargs = meta_llama_70b(seq_len=args.seq_len, batch_size=batch,
                                                         num_hidden_layers=args.layers)
    n_params = sum(p.numel() for p in model.parameters())
    built = time.perf_counter() - t0
    memory_limit = None
    if args.memory_limit is not None:
        from fxsplit.cli import parse_size

        memory_limit = parse_size(args.memory_limit)
    plan = fxsplit.plan(
        model, example_args, example_kwargs, tp=args.tp, pp=args.pp, dp=args.dp, microbatches=m,
        schedule=args.schedule, memory_limit=memory_limit,
    )
    world = args.dp * args.tp * args.pp
    print(f"LlamaForCausalLM on the meta device: {n_params / 1e9:.1f}e9 parameters, {args.layers} layers, "
          f"batch {batch} x seq {args.seq_len}, bfloat16; built in {built:.1f}s")
    print(plan)  # one screen: layers with the same sharding folded into one row
    if args.full:
        print(plan.tp_table())
        print(plan.stage_table())
    print(f"{world} GPUs: planned in {plan.plan_seconds:.1f}s (trace, tensor parallel, split, schedule), "
          f"{time.perf_counter() - t0:.1f}s in all")
    if args.dot:
        plan.to_dot(args.dot)
        print(f"wrote {args.dot}")
    if args.timeline:
        plan.timeline(args.timeline)
        print(f"wrote {args.timeline}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
