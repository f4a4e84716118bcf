"""One stage's actions in one process: fxsplit's F, I, W graphs against the stage module's
forward + autograd backward (what PTD runs), same inputs, alternating.

    .venv/bin/python benchmarks/stage_actions.py                       # the pipeline_vs_ptd GPT, ZB-V split
    .venv/bin/python benchmarks/stage_actions.py --stages 1,3 --reps 30
    .venv/bin/python benchmarks/stage_actions.py --seq 2 --micro-batch 1    # per-action fixed cost
    .venv/bin/python benchmarks/stage_actions.py --compile     # fx's graphs and loss compiled, as compile=True
    .venv/bin/python benchmarks/stage_actions.py --compile --stages 0,3 --profile   # fx's ops, by self CPU

Method: the GPT of benchmarks/pipeline_vs_ptd.py (8 layers, width 256, vocab 4096, seq 128,
untied head), planned for ZB-V at p=2 with the README's split (blocks.2, blocks.4, blocks.6);
each stage's inputs are one microbatch (``--micro-batch`` samples, batch 16 / m 8 = 2) run
through the stages before it. Per repetition and stage, in alternating order: "fx" = the graph
split as the executor runs it (F graph under no_grad; on the last stage the loss from a leaf
standing for the logits and ``autograd.grad`` of it, as ``_graph_backward`` does; I graph; W
graph and ``accumulate_grads``), "ag" = the stage GraphModule called with autograd, the loss
on its output, ``autograd.backward`` (PTD's stage runs its submodule the same way). Gradients
accumulate across repetitions (7 of the pipeline's 8 microbatches add into ``.grad``).
Main-thread CPU milliseconds, medians; one thread. The other cores' load moves both alike:
read the difference within a run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fxsplit
from fxsplit.runtime.compile.compiling import INDUCTOR_OPTIONS, compile_split
from fxsplit.runtime.compile.split_graph import GraphSplit, accumulate_grads
from fxsplit.testing import zoo
from fxsplit.testing.stage_inputs import stage_inputs


def time_stage(gm, xs, y, last: bool, reps: int, compile: bool = False,
               profile: bool = False) -> dict[str, list[float]]:
    split = GraphSplit.trace(gm, xs)
    loss_fn = zoo.cross_entropy_loss
    if compile:  # what PipelineRuntime(compile=True) runs: [Note: compiled stages], [Note: compiled loss]
        compile_split(split, lambda kind, why: print(f"not compiled: {kind}: {why}"))
        loss_fn = torch.compile(zoo.cross_entropy_loss, options=INDUCTOR_OPTIONS)
    params = [p for p in gm.parameters() if p.requires_grad]
    buffers = [b for _, b in gm.named_buffers()]
    tensors = [t for t in xs if isinstance(t, torch.Tensor)]

    def fx():
        t0 = time.thread_time()
        outs, state = split.forward(params, buffers, tensors)
        t1 = time.thread_time()
        if last:
            leaf = outs[0].detach().requires_grad_()
            tangents = list(torch.autograd.grad(loss_fn(leaf, y), [leaf]))
        else:
            tangents = [torch.ones_like(outs[j]) for j in split.diff_outputs]
        t2 = time.thread_time()
        state.input_grads(params, buffers, tangents)
        t3 = time.thread_time()
        accumulate_grads(params, state.weight_grads(params, buffers))
        t4 = time.thread_time()
        return {"F": t1 - t0, "loss": t2 - t1, "I": t3 - t2, "W": t4 - t3}

    def ag():
        t0 = time.thread_time()
        outs = gm(*xs)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        t1 = time.thread_time()
        if last:
            loss = zoo.cross_entropy_loss(outs[0], y)
            t2 = time.thread_time()
            torch.autograd.backward([loss])
        else:
            t2 = t1
            torch.autograd.backward([outs[j] for j in split.diff_outputs],
                                    [torch.ones_like(outs[j]) for j in split.diff_outputs])
        return {"F": t1 - t0, "loss": t2 - t1, "B": time.thread_time() - t2}

    res: dict[str, list[dict]] = {"fx": [], "ag": []}
    for r in range(reps + 2):  # 2 warm-up repetitions
        for name, fn in ((("fx", fx), ("ag", ag)) if r % 2 else (("ag", ag), ("fx", fx))):
            got = fn()
            if r >= 2:
                res[name].append(got)
    if profile:  # fx's actions only, after the timed repetitions (warm)
        from torch.profiler import ProfilerActivity
        with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                fx()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=50))
    for t in tensors:
        t.grad = None
    for p in params:
        p.grad = None
    return {name: {k: statistics.median(d[k] for d in rows) * 1e3 for k in rows[0]} for name, rows in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="fx: compiled F, I, W graphs and loss; autograd stays eager")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's table of 5 fx repetitions per stage")
    a = ap.parse_args()
    torch.set_num_threads(1)
    model, (x,), kw = zoo.make_gpt(n_layer=8, n_embd=256, n_head=8, vocab_size=4096, block_size=128,
                                   seq_len=128, batch_size=16, tie_weights=False, seed=0)
    y = torch.randint(0, 4096, (16, 128), generator=torch.Generator().manual_seed(7))
    plan = fxsplit.plan(model, (x,), kw, pp=2, schedule="zbv", stages_per_rank=2, microbatches=8,
                        split_points=("blocks.2", "blocks.4", "blocks.6"), cut_at="modules",
                        hardware=fxsplit.Hardware.cpu())
    xm, ym = x[:a.micro_batch, :a.seq], y[:a.micro_batch, :a.seq]
    inputs = stage_inputs(plan, (xm,))
    last = len(plan.stages.modules) - 1
    costs = plan.stage_costs()
    print(f"ms per microbatch ({a.micro_batch} x {a.seq} tokens), medians of {a.reps}; est = the plan's "
          f"F / I / W estimate (Hardware.cpu(), whole batch) / m")
    for s in (int(v) for v in a.stages.split(",")):
        r = time_stage(plan.stages.modules[s], inputs[s], ym, s == last, a.reps, a.compile, a.profile)
        fx, ag = r["fx"], r["ag"]
        est = [costs[k][s] * 1e3 / 8 for k in ("forward", "backward_input", "backward_weight")]
        print(f"stage {s}: fx F {fx['F']:.1f} loss {fx['loss']:.1f} I {fx['I']:.1f} W {fx['W']:.1f} = "
              f"{sum(fx.values()):.1f} | autograd F {ag['F']:.1f} loss {ag['loss']:.1f} B {ag['B']:.1f} = "
              f"{sum(ag.values()):.1f} | fx/autograd {sum(fx.values()) / sum(ag.values()):.3f} | "
              f"est F {est[0]:.1f} I {est[1]:.1f} W {est[2]:.1f}")


if __name__ == "__main__":
    main()
