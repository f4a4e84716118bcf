"""Point-to-point messages per step of a plan: with recomputed values ([Note: recompute, don't
ship] in fxsplit.pipeline.recomputable) and, on the same cuts, with every boundary value sent.

    python benchmarks/boundary_messages.py                # Llama-3-70B dims on meta, auto plan for 64 H100s
    python benchmarks/boundary_messages.py --tiny         # a tiny HF Llama, pp=2 (seconds)

Prints the plan's stage cuts, the values no longer sent and the message counts (sends over all
pipeline ranks per step: activations forward, gradients backward).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import fxsplit
from fxsplit.pipeline.comm import plan_all_communication
from fxsplit.pipeline.stage import build_stages


def _sends(plan, stages) -> tuple[int, Counter]:
    comm = plan_all_communication(plan.schedule, stages.io, num_ranks=plan.config.pp,
                                  rank_of_stage=plan.stage_ranks.__getitem__)
    names = Counter()
    total = 0
    for cp in comm:
        for ops in cp.peer_ops.values():
            for op in ops:
                if op.is_send:
                    total += 1
                    names[stages.io[op.message.stage].input_meta[op.message.input].name] += 1
    return total, names


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="a tiny HF Llama at pp=2 instead of 70B")
    a = ap.parse_args()
    from fxsplit.testing import hf_zoo

    t0 = time.perf_counter()
    if a.tiny:
        model, args, kwargs = hf_zoo.tiny_llama(num_hidden_layers=4)
        plan = fxsplit.plan(model, args, kwargs, pp=2, microbatches=4, schedule="1f1b")
    else:
        model, args, kwargs = hf_zoo.meta_llama_70b(seq_len=4096)
        plan = fxsplit.plan(model, args, kwargs, strategy="auto", world_size=64, global_batch_size=64,
                            hardware=fxsplit.Hardware.preset("h100-sxm"))
    c = plan.config
    print(f"planned in {time.perf_counter() - t0:.0f}s: tp={c.tp} pp={c.pp} dp={c.dp} dp_shard={c.dp_shard} "
          f"{c.num_stages} stages, {c.schedule}, m={c.microbatches}")
    split = plan.split
    print("stage starts:", ", ".join(s.module_paths[0] for s in split.stages))
    print("cut reason:", split.cut_reason or "(every stage starts at a layer boundary)")
    print("recomputed, not sent:", ", ".join(split.recomputed_reads) or "-")
    after, names_after = _sends(plan, plan.stages)
    before, names_before = _sends(plan, build_stages(plan.graph, dict(split.stage_of), split.num_stages))
    print(f"point-to-point messages per step: {before} sending every boundary value, {after} recomputing")
    print("  sent before:", dict(names_before.most_common(8)))
    print("  sent after: ", dict(names_after.most_common(8)))


if __name__ == "__main__":
    main()
