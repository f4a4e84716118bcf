"""Generation through the pipeline (issue 31): ``ParallelModel.generate`` against the unsplit model
generating in one process, each with and without a KV cache: tokens per second and time to first
token, as ratios.

    .venv/bin/python benchmarks/generate.py                       # pp=2, m=2, batch 4 (~3 min)
    .venv/bin/python benchmarks/generate.py --tp 2 --pp 2 --batch 1

Setup: the zoo GPT (``--layers/--width/--heads/--vocab``, block size ``--seq``) on ``tp * pp``
gloo ranks, one thread each. Every rank builds the model from seed 0 and ``parallelize``s it. The
one-process references run on rank 0 (the other ranks wait in the barrier):
``fxsplit.api.generate.generate_unsplit`` with ``use_cache=True`` (the unsplit model traced once by
``torch.fx`` and run with the same KV cache, [Note: generation with a KV cache] in
fxsplit.api.kv_cache: the zoo GPT has no Hugging Face ``generate``, and this is its cached decoding
in one process) and with ``use_cache=False`` (one full forward per token), and a Hugging Face GPT-2
of the same size running ``generate(use_cache=True)`` (HF's own cache; its own weights, so its
tokens are not compared). fxsplit runs with the cache (``pm.generate``: steps overlapped across
microbatches), with the cache and one pipeline forward per step (``overlap_steps=False``, tokens/s
only) and without the cache (``use_cache=False``). Rounds alternate them (order flipped every
round), each with ``--new`` new tokens (tokens/s = batch * new / wall seconds) and, but for the
stepwise one, with one (time to first token: the prompt's forward and the token's broadcast). Each
timed call starts after a barrier and counts the slowest rank. The greedy tokens of the five zoo
GPT variants are compared (they must be equal) and printed.

``--model llama``: a Hugging Face Llama of the same size (key/value heads half the heads, MLP
twice the width), traced by torch.export at ``--seq`` tokens, so fxsplit's cache is [Note: KV cache
for exported graphs] (fxsplit.api.kv_export); the one-process references are then the unsplit
model's own ``generate`` with Hugging Face's cache and without it (``use_cache=False``), and all
five token outputs must be equal.

Ratios are medians of per-round ratios: tokens/s of fxsplit over one process (above 1: the pipeline
generates faster), each with the cache and each without, and the cache's own speedup. On CPU ranks
sharing cores the pipeline cannot beat one process (the ranks compete for the same cores), so read
the ratio as the cost of the split, not a speedup.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from _common import alternate_rounds, launch, load_note, make_gpt, parse_setup, per_round_line, round_ratio, rounds_note

import fxsplit
from fxsplit.api.generate import cache_path, generate_unsplit


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
    model: str = "gpt"  # "gpt" (the zoo GPT, fx-traced) or "llama" (Hugging Face, torch.export-traced)
    tp: int = 1
    pp: int = 2
    microbatches: int = 2
    warmup: int = 1
    rounds: int = 3


def _hf_gpt2(s: Setup):
    """A Hugging Face GPT-2 of the zoo GPT's size (layers, width, heads, vocab, block), its own
    random weights: the speed of HF's ``generate`` with its own cache on the same shapes."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=s.layers, n_embd=s.width, n_head=s.heads, vocab_size=s.vocab, n_positions=s.seq,
                     bos_token_id=0, eos_token_id=None)
    return GPT2LMHeadModel(cfg).eval()


def _hf_llama(s: Setup):
    """A Hugging Face Llama of the Setup's size, seed 0, with its example (b, seq) inputs."""
    from fxsplit.testing import hf_zoo

    return hf_zoo.tiny_llama(hidden_size=s.width, num_hidden_layers=s.layers, num_attention_heads=s.heads,
                             num_key_value_heads=max(1, s.heads // 2), intermediate_size=2 * s.width,
                             vocab_size=s.vocab, max_position_embeddings=s.seq, seq_len=s.seq, batch_size=s.batch,
                             eos_token_id=None)


def _one_process(model, s: Setup, prompt: torch.Tensor):
    """``one(n, cache)``: the unsplit model generating n tokens in one process, with or without a cache."""
    if s.model == "gpt":
        return lambda n, cache: generate_unsplit(model, prompt, max_new_tokens=n, use_cache=cache)
    mask = torch.ones_like(prompt)
    return lambda n, cache: model.generate(prompt, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                           use_cache=cache, pad_token_id=0)


def _rank(rank: int, world: int, s: Setup) -> dict:
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    model, args, kwargs = make_gpt(s) if s.model == "gpt" else _hf_llama(s)
    model.eval()
    pm = fxsplit.parallelize(model, args, kwargs, tp=s.tp, pp=s.pp, microbatches=s.microbatches, timeout=120)
    setup_s = time.perf_counter() - t0
    prompt = torch.randint(0, s.vocab, (s.batch, s.prompt), generator=torch.Generator().manual_seed(1))
    out: dict = {}

    def fx(n, cache):
        return lambda: out.__setitem__(("fxsplit", cache, n), pm.generate(prompt, max_new_tokens=n, use_cache=cache))

    unsplit = _one_process(model, s, prompt)

    def one(n, cache):
        return lambda: out.__setitem__(("one process", cache, n), unsplit(n, cache))

    runs = []
    for cache in (True, False):
        tag = "" if cache else " recompute"
        runs += [(f"fxsplit{tag}", fx(s.new, cache), True), (f"one process{tag}", one(s.new, cache), rank == 0),
                 (f"fxsplit{tag} first token", fx(1, cache), True),
                 (f"one process{tag} first token", one(1, cache), rank == 0)]
    stepwise = lambda: out.__setitem__(("fxsplit stepwise", True, s.new),  # noqa: E731
                                       pm.generate(prompt, max_new_tokens=s.new, overlap_steps=False))
    runs.append(("fxsplit stepwise", stepwise, True))
    hf = _hf_gpt2(s) if rank == 0 and s.model == "gpt" else None

    def hf_generate(n):
        mask = torch.ones_like(prompt)
        return lambda: hf.generate(prompt, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                   do_sample=False, use_cache=True, pad_token_id=0)

    if hf is not None:
        runs += [("HF GPT-2 cache", hf_generate(s.new), True), ("HF GPT-2 cache first token", hf_generate(1), True)]
    times, _, _ = alternate_rounds(runs, s.warmup, s.rounds, lambda: None)
    ref = out[("fxsplit", True, s.new)]
    same = rank != 0 or all(torch.equal(v, ref) for k, v in out.items() if k[2] == s.new)
    return {"times": times, "same": same, "tokens": ref[:, s.prompt:].tolist(), "path": cache_path(pm),
            "setup_s": setup_s}


def main(argv: list[str] | None = None) -> int:
    _, s = parse_setup(Setup, argv, __doc__.splitlines()[0])
    if s.prompt + s.new > s.seq:
        raise SystemExit(f"--prompt {s.prompt} + --new {s.new} exceeds the block size --seq {s.seq}")
    results, load, wall = launch(_rank, s.tp * s.pp, s, timeout=1800)
    r0 = results[0]
    t = r0["times"]
    n = s.batch * s.new
    name = "zoo GPT (fx)" if s.model == "gpt" else "HF Llama (torch.export at --seq tokens)"
    print(f"generate: {name} {s.layers} layers, width {s.width}, {s.heads} heads, vocab {s.vocab}, block {s.seq}; "
          f"batch {s.batch}, prompt {s.prompt}, {s.new} new tokens; tp={s.tp} x pp={s.pp}, microbatches "
          f"{s.microbatches} (used: {min(s.batch, s.microbatches)}); fxsplit's cache path: "
          f"{'KV cache' if r0['path'] is None else r0['path']}")
    print(f"  {rounds_note(s.warmup, s.rounds)}; {load_note(load)}; launch {wall:.0f} s, setup on rank 0 "
          f"{r0['setup_s']:.1f} s")
    for tag, what in (("", "with the KV cache"), (" recompute", "recomputing every step")):
        fx, one = f"fxsplit{tag}", f"one process{tag}"
        print(f"  {what}: tokens/s fxsplit {n / min(t[fx]):.1f}, one process {n / min(t[one]):.1f} (best rounds), "
              f"ratio {round_ratio(t[one], t[fx]):.3f}; first token fxsplit {1e3 * min(t[fx + ' first token']):.1f} "
              f"ms, one process {1e3 * min(t[one + ' first token']):.1f} ms, ratio "
              f"{round_ratio(t[fx + ' first token'], t[one + ' first token']):.3f}")
    hf = "HF GPT-2 cache"
    print("  one process: " + ("generate_unsplit (the zoo GPT traced by torch.fx)" if s.model == "gpt" else
                               "the unsplit Llama's own generate, use_cache=True / False"))
    if hf in t:
        print(f"  Hugging Face GPT-2 of the same size, generate(use_cache=True) in one process: tokens/s "
              f"{n / min(t[hf]):.1f}, first token {1e3 * min(t[hf + ' first token']):.1f} ms; fxsplit with the "
              f"cache over it: tokens/s ratio {round_ratio(t[hf], t['fxsplit']):.3f}, first token ratio "
              f"{round_ratio(t['fxsplit first token'], t[hf + ' first token']):.3f}")
    print(f"  overlapped steps: tokens/s with the cache, steps overlapped {n / min(t['fxsplit']):.1f}, one pipeline "
          f"forward per step {n / min(t['fxsplit stepwise']):.1f}; ratio {round_ratio(t['fxsplit stepwise'], t['fxsplit']):.3f}")
    print(f"  the cache's speedup in tokens/s (recompute time / cache time): fxsplit "
          f"{round_ratio(t['fxsplit recompute'], t['fxsplit']):.3f}, one process "
          f"{round_ratio(t['one process recompute'], t['one process']):.3f}")
    print(f"  greedy tokens equal in all five: {all(r['same'] for r in results)}; first row "
          f"{r0['tokens'][0][:12]}...")
    print("  " + per_round_line(t))
    return 0 if all(r["same"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
