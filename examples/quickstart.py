"""Quickstart: train a small GPT split over 4 processes (tensor parallel 2 x pipeline parallel 2,
interleaved 1F1B) and check every step's loss against the same model trained in one process.

Terms: dp, tp, pp the data-, tensor- and pipeline-parallel degrees (world size dp * tp * pp);
m microbatches per step; a "replica" is one dp slice, which trains on its own rows of the batch.

    torchrun --standalone --nproc-per-node 4 examples/quickstart.py               # tp=2, pp=2
    torchrun --standalone --nproc-per-node 4 examples/quickstart.py --tp 1 --dp 2 # dp=2, pp=2

Runs unchanged on GPUs (NCCL, one GPU per process) and on CPUs (gloo). The whole of fxsplit's
part is one call::

    pm = fxsplit.parallelize(model, (idx,), loss_fn=cross_entropy_loss, tp=2, pp=2,
                             schedule="interleaved_1f1b")
    loss = pm.step(idx, target=targets); opt.step(); opt.zero_grad()

Rank 0 also trains an unsplit copy of the model on the whole batch (the dp replicas' rows
together) and prints both losses per step; the script exits with status 1 when they differ by
more than ``--rtol`` (relative), so it doubles as an end-to-end check.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.distributed as dist

import fxsplit
from fxsplit.testing.zoo import GPT, GPTConfig, cross_entropy_loss


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default 2)")
    p.add_argument("--pp", type=int, default=2, help="pipeline-parallel degree (default 2)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree (default 1)")
    p.add_argument("--schedule", default="interleaved_1f1b", choices=("gpipe", "1f1b", "interleaved_1f1b"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=None, help="per step (default 2 * pp)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per dp replica and step")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--rtol", type=float, default=1e-4, help="largest relative loss difference accepted")
    p.add_argument("--quiet", action="store_true", help="do not print the plan")
    return p.parse_args(argv)


def batches(cfg: GPTConfig, *, steps: int, rows: int, seed: int = 0):
    """``steps`` batches of ``rows`` windows of a fixed token stream: inputs (rows, T) and
    next-token targets (rows, T), T = block_size. The same on every rank. The stream follows a
    fixed random successor table 90% of the time, so there is something to learn."""
    g = torch.Generator().manual_seed(seed)
    successor = torch.randperm(cfg.vocab_size, generator=g)
    noise = torch.randint(0, cfg.vocab_size, (4096,), generator=g)
    keep = torch.rand(4096, generator=g) < 0.9
    stream = noise.clone()
    for t in range(1, stream.numel()):
        if keep[t]:
            stream[t] = successor[stream[t - 1]]
    T = cfg.block_size
    for _ in range(steps):
        starts = torch.randint(0, stream.numel() - T - 1, (rows,), generator=g)
        windows = torch.stack([stream[s: s + T + 1] for s in starts.tolist()])  # (rows, T + 1)
        yield windows[:, :-1], windows[:, 1:]


def main(argv=None) -> int:
    args = parse_args(argv)
    if torch.cuda.is_available():  # compare float32 with float32, not TF32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=4, n_head=4, n_embd=64)  # tied wte / lm_head
    torch.manual_seed(0)
    model = GPT(cfg)
    reference = copy.deepcopy(model)  # the single-process copy (parallelize leaves `model` untouched)

    example = torch.zeros(args.batch_size, cfg.block_size, dtype=torch.long)  # (B, T) token ids
    pm = fxsplit.parallelize(
        model, (example,), loss_fn=cross_entropy_loss,
        tp=args.tp, pp=args.pp, dp=args.dp, schedule=args.schedule, microbatches=args.microbatches,
    )
    rank = dist.get_rank()
    device = next(pm.parameters()).device
    dp_rank = pm.coords["dp"]
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr)
    if rank == 0:
        reference.to(device)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr)
        if not args.quiet:
            print(pm.plan, flush=True)

    worst = 0.0
    rows = args.batch_size
    for i, (x, y) in enumerate(batches(cfg, steps=args.steps, rows=rows * args.dp)):
        mine = slice(dp_rank * rows, (dp_rank + 1) * rows)  # this replica's rows of the batch
        loss = pm.step(x[mine].to(device), target=y[mine].to(device))
        opt.step()
        opt.zero_grad()
        if rank == 0:
            ref_loss = cross_entropy_loss(reference(x.to(device)), y.to(device))
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
            a, b = loss.item(), ref_loss.item()
            worst = max(worst, abs(a - b) / abs(b))
            print(f"step {i}: loss fxsplit {a:.6f}  single {b:.6f}", flush=True)

    verdict = torch.tensor([1 if worst > args.rtol else 0], device=device)
    dist.broadcast(verdict, src=0)  # every rank exits with the same status
    if rank == 0:
        status = "MISMATCH" if verdict.item() else "OK"
        print(f"{status}: largest relative loss difference {worst:.2e} (tolerance {args.rtol:g}); "
              f"dp={args.dp} tp={args.tp} pp={args.pp} {pm.plan.config.schedule}", flush=True)
    dist.destroy_process_group()
    return int(verdict.item())


if __name__ == "__main__":
    sys.exit(main())
