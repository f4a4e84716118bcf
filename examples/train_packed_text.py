"""Train a small Hugging Face Llama on real text, packed: the Python standard library's own source
files (no download), byte-level tokens, several documents per row.

Terms: a **document** is one top-level statement of a source file (a function, a class, an
import; docstrings left out; median about 130 bytes); a **row** holds several documents back to back, with
``position_ids`` that restart at 0 for each document (and at each row: a document cut at a row's
end goes on at position 0 in the next), so attention stays inside each document (packed rows in
docs/training.md); the target of a document's last byte is -100 (ignored), so no document is
trained to predict the next one.

    torchrun --standalone --nproc-per-node 4 examples/train_packed_text.py               # tp=2, pp=2
    torchrun --standalone --nproc-per-node 4 examples/train_packed_text.py --dp 2 --tp 1

The plan is traced once at ``--seq-len``; the steps cycle through that length, three quarters and
half of it (a shorter step runs at its own length: the plan follows it, exactly). Each
step prints its length, the documents in the batch, the loss of fxsplit and of an unsplit copy
trained alongside on rank 0, and the tokens per second; the exit status is 1 when the losses differ
by more than ``--rtol`` (relative).
"""

from __future__ import annotations

import argparse
import ast
import copy
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fxsplit
from fxsplit.api.packing import position_ids_from_documents
from fxsplit.testing.data import replica_slice
from fxsplit.testing.hf_zoo import tiny_llama

IGNORE = -100


def lm_loss(output, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy over the bytes that have a next byte in their document."""
    logits = output["logits"]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE)


def documents(limit: int) -> list[bytes]:
    """Every top-level statement (a function, a class, an import, an assignment) of the first
    ``limit`` ``.py`` files of the standard library, by name, as one document each (in UTF-8)."""
    docs = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:limit]:
        src = f.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(src)
        except SyntaxError:  # a file for another Python version: skipped
            continue
        docs += [seg.encode() for node in tree.body  # docstrings left out: code only
                 if not isinstance(node, ast.Expr) and (seg := ast.get_source_segment(src, node))]
    return docs


def pack(docs: list[bytes], rows: int, length: int, start: int) -> tuple[torch.Tensor, ...]:
    """``rows`` rows of ``length`` bytes from the stream of documents beginning at byte ``start``
    of the concatenation: (tokens, targets, position_ids, documents touched, next start)."""
    stream = torch.tensor(list(b"".join(docs)), dtype=torch.long)
    doc_id = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])
    need = rows * length
    idx = (start + torch.arange(need + 1)) % len(stream)
    tok, ids = stream[idx], doc_id[idx]
    x, nxt, d = tok[:-1].view(rows, length), tok[1:].view(rows, length), ids[:-1].view(rows, length)
    same = ids[1:].view(rows, length) == d
    y = torch.where(same, nxt, torch.full_like(nxt, IGNORE))
    pos = position_ids_from_documents(d)  # positions restart where a document (or a row) begins
    return x, y, pos, int(d.unique().numel()), (start + need) % len(stream)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=8, help="rows per step (the global batch)")
    p.add_argument("--seq-len", type=int, default=128, help="bytes per row at the longest (the traced length)")
    p.add_argument("--files", type=int, default=40, help="standard-library files in the corpus")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--rtol", type=float, default=1e-4)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    docs = documents(args.files)
    model, _, _ = tiny_llama(vocab_size=256, num_hidden_layers=args.layers, max_position_embeddings=args.seq_len,
                             batch_size=args.batch_size, seq_len=args.seq_len, seed=0)
    x, _, pos, _, _ = pack(docs, args.batch_size, args.seq_len, 0)
    reference = copy.deepcopy(model)
    pm = fxsplit.parallelize(model, (x,), {"position_ids": pos}, loss_fn=lm_loss, tp=args.tp, pp=args.pp,
                             dp=args.dp, microbatches=max(2, args.pp))
    rank = dist.get_rank()
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr)
    m = pm.plan.config.microbatches
    lengths = (args.seq_len, args.seq_len * 3 // 4, args.seq_len // 2)
    start, worst = 0, 0.0
    for i in range(args.steps):
        t = lengths[i % len(lengths)]
        x, y, pos, n_docs, start = pack(docs, args.batch_size, t, start)
        t0 = time.perf_counter()
        loss = pm.step(replica_slice(pm, x), position_ids=replica_slice(pm, pos), target=replica_slice(pm, y))
        opt.step()
        opt.zero_grad()
        seconds = time.perf_counter() - t0
        if rank == 0:  # the same microbatch weighting as fxsplit's: the mean of per-microbatch means
            ref_opt.zero_grad()
            ref_loss = sum(lm_loss(reference(xs, position_ids=ps), ys) for xs, ps, ys in
                           zip(x.tensor_split(m * args.dp), pos.tensor_split(m * args.dp), y.tensor_split(m * args.dp)))
            ref_loss = ref_loss / (m * args.dp)
            ref_loss.backward()
            ref_opt.step()
            a, b = loss.item(), ref_loss.item()
            worst = max(worst, abs(a - b) / abs(b))
            print(f"step {i}: length {t}, {n_docs} documents, loss fxsplit {a:.6f}  single {b:.6f} (diff {a - b:.1e}), "
                  f"{x.numel() / seconds:.0f} tokens/s", flush=True)
    verdict = torch.tensor([1 if worst > args.rtol else 0])
    dist.broadcast(verdict, src=0)
    if rank == 0:
        print(f"{'MISMATCH' if verdict.item() else 'OK'}: largest relative loss difference {worst:.2e} "
              f"(tolerance {args.rtol:g}); {len(docs)} documents from {args.files} standard-library files, dp={args.dp} tp={args.tp} pp={args.pp}",
              flush=True)
    dist.destroy_process_group()
    return int(verdict.item())


if __name__ == "__main__":
    sys.exit(main())
