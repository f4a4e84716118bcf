"""A Hugging Face Llama built from a config, parallelized in one line and trained for a few steps.

Terms: dp, tp, pp the data-, tensor- and pipeline-parallel degrees (world size dp * tp * pp).

    torchrun --standalone --nproc-per-node 4 examples/hf_llama.py              # tp=2, pp=2
    torchrun --standalone --nproc-per-node 2 examples/hf_llama.py --tp 1       # pp=2 only

The model is ``transformers.LlamaForCausalLM`` from ``fxsplit.testing.hf_zoo.tiny_llama`` (RMSNorm, RoPE,
SwiGLU, grouped-query attention; random weights; ``use_cache=False`` so it can be exported).
fxsplit traces it with ``torch.export`` (transformers 5 has no fx tracer), shards the attention
and MLP projections (q/k/v, gate/up column-parallel; o/down row-parallel; embedding and LM head
by vocabulary), cuts it into pipeline stages and runs them::

    pm = fxsplit.parallelize(model, (input_ids,), {"attention_mask": mask}, loss_fn=lm_loss, tp=2, pp=2)

The loss function receives the model's own output (a ``CausalLMOutputWithPast``) for each
microbatch. Rank 0 also trains an unsplit copy and prints both losses; the exit status is 1 when
they differ by more than ``--rtol`` (relative).
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fxsplit
from fxsplit.testing.hf_zoo import tiny_llama


def lm_loss(output, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: ``output.logits`` (B, T, V), ``labels`` (B, T) int64."""
    logits = output["logits"]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default 2)")
    p.add_argument("--pp", type=int, default=2, help="pipeline-parallel degree (default 2)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree (default 1)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (every dp replica gets the same)")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--rtol", type=float, default=1e-4, help="largest relative loss difference accepted")
    p.add_argument("--quiet", action="store_true", help="do not print the plan")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if torch.cuda.is_available():  # compare float32 with float32, not TF32
        torch.backends.cuda.matmul.allow_tf32 = False
    model, (input_ids,), kwargs = tiny_llama(num_hidden_layers=args.layers, batch_size=args.batch_size,
                                             seq_len=args.seq_len, seed=0)
    mask = torch.ones_like(input_ids)  # no padding: every token counts in the loss
    reference = copy.deepcopy(model)

    pm = fxsplit.parallelize(model, (input_ids,), {"attention_mask": mask}, loss_fn=lm_loss,
                             tp=args.tp, pp=args.pp, dp=args.dp)

    rank = dist.get_rank()
    device = next(pm.parameters()).device
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr)
    if rank == 0:
        reference.to(device)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr)
        if not args.quiet:
            print(pm.plan, flush=True)

    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    for i in range(args.steps):
        tokens = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), generator=g)
        x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        m = mask.to(device)
        loss = pm.step(x, attention_mask=m, target=y)
        opt.step()
        opt.zero_grad()
        if rank == 0:
            ref_loss = lm_loss(reference(x, attention_mask=m), y)
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
            a, b = loss.item(), ref_loss.item()
            worst = max(worst, abs(a - b) / abs(b))
            print(f"step {i}: loss fxsplit {a:.6f}  single {b:.6f}", flush=True)

    verdict = torch.tensor([1 if worst > args.rtol else 0], device=device)
    dist.broadcast(verdict, src=0)
    if rank == 0:
        status = "MISMATCH" if verdict.item() else "OK"
        print(f"{status}: largest relative loss difference {worst:.2e} (tolerance {args.rtol:g}); "
              f"LlamaForCausalLM, dp={args.dp} tp={args.tp} pp={args.pp} {pm.plan.config.schedule}", flush=True)
    dist.destroy_process_group()
    return int(verdict.item())


if __name__ == "__main__":
    sys.exit(main())
