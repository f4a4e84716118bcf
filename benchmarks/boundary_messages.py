"""Point-to-point messages per step of a plan: with recomputed values ([Note: recompute, don't
ship] in fxsplit.pipeline.recomputable) and, on the same cuts, with every boundary value sent.

    python benchmarks/boundary_messages.py                # Llama-3-70B dims on meta, auto plan for 64 H100s
    python benchmarks/boundary_messages.py --fixed        # the same 70B at tp=8 x pp=8, 1f1b, m=16 (no search)
    python benchmarks/boundary_messages.py --tiny         # a tiny HF Llama, pp=2 (seconds)
    python benchmarks/boundary_messages.py --time         # step time before/after, HF Llama, 2 gloo ranks

``--time``: one launch of 2 ranks (gloo, one thread each) builds two ParallelModels of the same
HF Llama over the same weights: "before" plans as fxsplit did without these changes (``cut_at="any"``
and every boundary value sent: the recompute set emptied for that plan only), "after" plans by
default; then alternates timed steps of both (order flipped every round: the machine is shared),
forward + backward over the whole batch, and reports the median per-round ratio after / before.
The first step's losses must agree.

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


def _loss(out, y):
    import torch

    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def _time_rank(rank: int, world: int, setup: dict) -> dict:
    import statistics

    import torch
    import torch.distributed as dist

    import fxsplit.pipeline.split as split_mod
    from fxsplit.testing import hf_zoo

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, args, kwargs = hf_zoo.tiny_llama(**setup["model"])
    y = torch.randint(0, model.config.vocab_size, args[0].shape, generator=torch.Generator().manual_seed(1))
    common = dict(loss_fn=_loss, pp=world, microbatches=setup["microbatches"], schedule="1f1b", timeout=300)
    keep = split_mod.recomputable
    split_mod.recomputable = lambda *a, **k: frozenset()  # "before": every boundary value is sent
    try:
        before = fxsplit.parallelize(model, args, kwargs, cut_at="any", **common)
    finally:
        split_mod.recomputable = keep
    after = fxsplit.parallelize(model, args, kwargs, **common)
    runs = {"before": before, "after": after}
    out = {"sends": {k: sum(op.is_send for cp in pm.plan.comm for ops in cp.peer_ops.values() for op in ops)
                     for k, pm in runs.items()},
           "starts": {k: [s.module_paths[0] for s in pm.plan.split.stages] for k, pm in runs.items()},
           "times": {k: [] for k in runs}, "losses": {}}
    for i in range(setup["warmup"] + setup["steps"]):
        for name in (("before", "after") if i % 2 == 0 else ("after", "before")):
            dist.barrier()
            t0 = time.perf_counter()
            loss = runs[name].step(*args, target=y, **kwargs)
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            runs[name].zero_grad()
            out["losses"].setdefault(name, float(loss))
            if i >= setup["warmup"]:
                out["times"][name].append(float(dt))
    r = [a / b for a, b in zip(out["times"]["after"], out["times"]["before"])]
    out["ratio"] = statistics.median(r)
    return out


def time_main(layers: int, steps: int) -> None:
    from fxsplit.testing import run_distributed

    setup = dict(model=dict(num_hidden_layers=layers, hidden_size=256, intermediate_size=688, num_attention_heads=8,
                            num_key_value_heads=4, vocab_size=2048, batch_size=8, seq_len=128, max_position_embeddings=128),
                 microbatches=4, warmup=2, steps=steps)
    res = run_distributed(_time_rank, 2, setup, timeout=1800)[0]
    med = {k: sorted(v)[len(v) // 2] for k, v in res["times"].items()}
    print(f"HF Llama {layers} layers, hidden 256, seq 128, batch 8 in 4 microbatches, pp=2 1f1b, gloo on CPU")
    for k in ("before", "after"):
        print(f"  {k}: stages start at {res['starts'][k]}; {res['sends'][k]} messages per step; "
              f"median step {1e3 * med[k]:.1f} ms; first loss {res['losses'][k]:.6f}")
    print(f"  after / before, median of {steps} alternating rounds: {res['ratio']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="a tiny HF Llama at pp=2 instead of 70B")
    ap.add_argument("--fixed", action="store_true", help="70B at tp=8 x pp=8, 1f1b, m=16 (no search)")
    ap.add_argument("--time", action="store_true", help="step time before/after on an HF Llama, 2 gloo ranks")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    if a.time:
        time_main(a.layers, a.steps)
        return
    from fxsplit.testing import hf_zoo

    t0 = time.perf_counter()
    if a.tiny:
        model, args, kwargs = hf_zoo.tiny_llama(num_hidden_layers=4)
        plan = fxsplit.plan(model, args, kwargs, pp=2, microbatches=4, schedule="1f1b")
    elif a.fixed:
        model, args, kwargs = hf_zoo.meta_llama_70b(seq_len=4096)
        plan = fxsplit.plan(model, args, kwargs, tp=8, pp=8, schedule="1f1b", microbatches=16, global_batch_size=16,
                            hardware=fxsplit.Hardware.preset("h100-sxm"))
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
