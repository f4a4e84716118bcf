"""Train a Llama-style model the way a real run does: bf16 mixed precision with fp32 master
weights, AdamW, linear warmup + cosine decay, global gradient clipping, activation
checkpointing, a checkpoint saved and resumed, a log line per step.

Terms: dp, tp, pp the data-, tensor- and pipeline-parallel degrees (world size dp * tp * pp).

    torchrun --standalone --nproc-per-node 4 examples/train_llama.py                 # tp=2 x pp=2
    torchrun --standalone --nproc-per-node 4 examples/train_llama.py --tp 1 --dp 2   # dp=2 x pp=2
    torchrun --standalone --nproc-per-node 4 examples/train_llama.py --steps 20 --save ckpt --save-every 10
    torchrun --standalone --nproc-per-node 4 examples/train_llama.py --steps 20 --resume ckpt/step-10  # 10..19
    torchrun --standalone --nproc-per-node 4 examples/train_llama.py --experts 4 --tp 1 --dp 2 --ep 2  # MoE, ep=2

The model is ``transformers.LlamaForCausalLM`` from a small config (``fxsplit.testing.hf_zoo``:
RMSNorm, RoPE, SwiGLU, grouped-query attention). The data is synthetic but learnable: each
sequence counts up from a random start (token t+1 follows token t), so the loss falls fast; the
global batch of step k is drawn from a generator seeded with k and split over the dp replicas, so
a resumed run, at any (dp, tp, pp), sees exactly the batches the uninterrupted run would have. Per step, rank 0 prints::

    step 3 | loss 4.812317 | lr 1.50e-03 | grad norm 2.314052 | 5120 tokens/s | 0.081 s | bubble 21.4%

(tokens/s over the whole world's batch; bubble is the measured share of the step the rank spent
blocked on its pipeline peers). ``--experts E`` trains transformers' Mixtral instead (E experts,
top-2, same sizes) and, with ``--ep``, places its experts by expert parallelism; the line then
ends with the step's expert load, the rows each expert received (summed over the layers), and the
all-to-all time (``fxsplit.api.expert_load``)::

    step 3 | ... | bubble 21.4% | expert rows min 212 / mean 256.0 / max 301 | all-to-all 0.012 s
 ``--save DIR`` writes ``DIR/step-N``: a torch.distributed.checkpoint
of the model and optimizer (each rank its own shards) plus ``trainer.json`` (the step); ``--resume DIR/step-N``
reloads them, also at another (dp, tp, pp), and continues from that step, with the learning-rate
schedule where it was.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy

import fxsplit
from fxsplit.api.expert_load import expert_load, expert_rows
from fxsplit.testing.hf_zoo import tiny_llama, tiny_mixtral
from fxsplit.tp.experts import exchange_stats


def lm_loss(output, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, in float32 whatever the compute dtype."""
    logits = output["logits"].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--experts", type=int, default=0, help="a Mixtral with this many experts (0: a dense Llama)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks, carved out of dp")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=12, help="total optimizer steps of the run")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (global: split over dp)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-2, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=1e-3, help="learning rate at the end of the cosine")
    p.add_argument("--warmup", type=int, default=3, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="max global gradient norm")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--checkpointing", choices=("none", "full", "selective", "auto"), default="selective",
                   help="activation checkpointing (recompute in backward)")
    p.add_argument("--save", help="folder to save the training state in (as DIR/step-N)")
    p.add_argument("--save-every", type=int, default=0, help="save every N steps (0: at the end only)")
    p.add_argument("--resume", help="a DIR/step-N folder to resume the training state from")
    return p.parse_args(argv)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr`` at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup - 1)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def batch(step: int, args: argparse.Namespace, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This dp replica's rows of step ``step``'s global batch: counting sequences from random
    starts, drawn from a generator seeded by the step (so any dp degree sees the same batch)."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, args.vocab, (args.batch_size, 1), generator=g)
    tokens = (start + torch.arange(args.seq_len + 1)) % args.vocab
    rows = tokens.chunk(args.dp)[dp_rank]
    return rows[:, :-1], rows[:, 1:]


def save(pm, opt, folder: str, step: int) -> None:
    pm.save_checkpoint(folder, optimizer=opt)
    if dist.get_rank() == 0:
        with open(os.path.join(folder, "trainer.json"), "w") as f:
            json.dump({"step": step}, f)
    dist.barrier()


def main(argv=None) -> int:
    args = parse_args(argv)
    build, extra = (tiny_mixtral, dict(num_local_experts=args.experts)) if args.experts else (tiny_llama, {})
    model, (input_ids,), _ = build(num_hidden_layers=args.layers, hidden_size=args.hidden,
                                   intermediate_size=4 * args.hidden, vocab_size=args.vocab,
                                   batch_size=args.batch_size // args.dp, seq_len=args.seq_len, seed=0, **extra)
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if args.precision == "bf16" else None)
    pm = fxsplit.parallelize(model, (input_ids,), loss_fn=lm_loss, tp=args.tp, pp=args.pp, dp=args.dp, ep=args.ep,
                             microbatches=args.microbatches, mp_policy=policy,
                             activation_checkpointing=args.checkpointing)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = next(pm.parameters()).device
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    first = 0
    if args.resume:
        pm.load_checkpoint(args.resume, optimizer=opt)
        with open(os.path.join(args.resume, "trainer.json")) as f:
            first = json.load(f)["step"]
    if rank == 0:
        print(pm.plan, flush=True)
        print(f"training steps {first}..{args.steps - 1}: {args.precision}, activation checkpointing "
              f"{args.checkpointing}, AdamW, warmup {args.warmup} + cosine, clip {args.clip}", flush=True)

    tokens_per_step = args.batch_size * args.seq_len
    dp_rank = pm.coords.get("dp", 0)
    for step in range(first, args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        x, y = (t.to(device) for t in batch(step, args, dp_rank))
        t0 = time.perf_counter()
        with exchange_stats() as exchanged:
            loss = pm.step(x, target=y)
        norm = pm.clip_grad_norm_(args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        rows = expert_rows(pm, exchanged)  # collective (None without ep)
        if rank == 0:
            load = expert_load(torch.tensor(rows)) if rows else None
            experts = (f" | expert rows min {load['min']:.0f} / mean {load['mean']:.1f} / max {load['max']:.0f} | "
                       f"all-to-all {exchanged.seconds:.3f} s" if load else "")
            print(f"step {step} | loss {loss.item():.6f} | lr {lr_at(step, args):.2e} | grad norm {norm.item():.6f} | "
                  f"{tokens_per_step / seconds:.0f} tokens/s | {seconds:.3f} s | bubble {100 * pm.last_bubble:.1f}%"
                  f"{experts}", flush=True)
        done = step + 1
        if args.save and ((args.save_every and done % args.save_every == 0) or done == args.steps):
            folder = os.path.join(args.save, f"step-{done}")
            save(pm, opt, folder, done)
            if rank == 0:
                print(f"saved step {done} to {folder}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
