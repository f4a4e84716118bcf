"""Generation through the pipeline (issue 31): ``ParallelModel.generate`` against the unsplit model
generating in one process, tokens per second and time to first token, as ratios.

    .venv/bin/python benchmarks/generate.py                       # pp=2, m=2, batch 4 (~2 min)
    .venv/bin/python benchmarks/generate.py --tp 2 --pp 2 --batch 1

Setup: the zoo GPT (``--layers/--width/--heads/--vocab``, block size ``--seq``) on ``tp * pp``
gloo ranks, one thread each. Every rank builds the model from seed 0 and ``parallelize``s it; the
one-process reference is ``fxsplit.api.generate.generate_unsplit`` on rank 0 (the same decoding:
a full forward per new token, no KV cache: [Note: generation by recompute]), the other ranks wait
in the barrier. Rounds alternate the two (order flipped every round), each variant twice: with
``--new`` new tokens (tokens/s = batch * new / wall seconds) and with one (time to first token:
the prompt's forward and the token's broadcast). Each timed call starts after a barrier and counts
the slowest rank. The greedy tokens of both are compared (they must be equal) and printed.

Ratios are fxsplit over one process, the median of per-round ratios: tokens/s above 1 means the
pipeline generates faster. On CPU ranks sharing cores the pipeline cannot beat one process (the
ranks compete for the same cores, and every token waits for every stage in turn: steps do not
overlap), so read the ratio as the cost of the split, not a speedup.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from _common import alternate_rounds, launch, load_note, make_gpt, parse_setup, per_round_line, round_ratio, rounds_note

import fxsplit
from fxsplit.api.generate import generate_unsplit


@dataclass(frozen=True)
class Setup:
    layers: int = 8
    width: int = 256
    heads: int = 8
    vocab: int = 4096
    seq: int = 128  # block size; the prompt plus the new tokens must fit
    batch: int = 4
    prompt: int = 32
    new: int = 32
    tp: int = 1
    pp: int = 2
    microbatches: int = 2
    warmup: int = 1
    rounds: int = 3


def _rank(rank: int, world: int, s: Setup) -> dict:
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    model, args, _ = make_gpt(s)
    model.eval()
    pm = fxsplit.parallelize(model, args, tp=s.tp, pp=s.pp, microbatches=s.microbatches, timeout=120)
    setup_s = time.perf_counter() - t0
    prompt = torch.randint(0, s.vocab, (s.batch, s.prompt), generator=torch.Generator().manual_seed(1))
    out: dict = {}

    def fx(n):
        return lambda: out.__setitem__(("fxsplit", n), pm.generate(prompt, max_new_tokens=n))

    def one(n):
        return lambda: out.__setitem__(("one process", n), generate_unsplit(model, prompt, max_new_tokens=n))

    runs = [("fxsplit", fx(s.new), True), ("one process", one(s.new), rank == 0),
            ("fxsplit first token", fx(1), True), ("one process first token", one(1), rank == 0)]
    times, _, _ = alternate_rounds(runs, s.warmup, s.rounds, lambda: None)
    same = rank != 0 or torch.equal(out[("fxsplit", s.new)], out[("one process", s.new)])
    return {"times": times, "same": same, "tokens": out[("fxsplit", s.new)][:, s.prompt:].tolist(),
            "setup_s": setup_s}


def main(argv: list[str] | None = None) -> int:
    _, s = parse_setup(Setup, argv, __doc__.splitlines()[0])
    if s.prompt + s.new > s.seq:
        raise SystemExit(f"--prompt {s.prompt} + --new {s.new} exceeds the block size --seq {s.seq}")
    results, load, wall = launch(_rank, s.tp * s.pp, s, timeout=1800)
    r0 = results[0]
    t = r0["times"]
    tok_ratio = round_ratio(t["one process"], t["fxsplit"])  # tokens/s: the inverse of the time ratio
    ttft_ratio = round_ratio(t["fxsplit first token"], t["one process first token"])
    n = s.batch * s.new
    print(f"generate: GPT {s.layers} layers, width {s.width}, {s.heads} heads, vocab {s.vocab}, block {s.seq}; "
          f"batch {s.batch}, prompt {s.prompt}, {s.new} new tokens; tp={s.tp} x pp={s.pp}, microbatches "
          f"{s.microbatches} (used: {min(s.batch, s.microbatches)})")
    print(f"  {rounds_note(s.warmup, s.rounds)}; {load_note(load)}; launch {wall:.0f} s, setup on rank 0 "
          f"{r0['setup_s']:.1f} s")
    print(f"  tokens/s: fxsplit {n / min(t['fxsplit']):.1f}, one process {n / min(t['one process']):.1f} "
          f"(best rounds); ratio fxsplit / one process {tok_ratio:.3f} (median of per-round ratios)")
    print(f"  time to first token: fxsplit {1e3 * min(t['fxsplit first token']):.1f} ms, one process "
          f"{1e3 * min(t['one process first token']):.1f} ms; ratio fxsplit / one process {ttft_ratio:.3f}")
    print(f"  greedy tokens equal to one process: {all(r['same'] for r in results)}; first row "
          f"{r0['tokens'][0][:12]}...")
    print("  " + per_round_line(t))
    return 0 if all(r["same"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
