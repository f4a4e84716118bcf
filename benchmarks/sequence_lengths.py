"""One plan, every sequence length: step time at L/4 against L of a small Llama at pp=2, from a plan that
pads shorter steps to the traced length L (``follow_sequence=False``, [Note: padding to the traced length]
in fxsplit.api.padding) and from one that follows each step's length (the default with real weights,
[Note: following the sequence from two static traces] in fxsplit.graph.sequence), on 2 gloo ranks in ONE
launch.

    .venv/bin/python benchmarks/sequence_lengths.py                    # L = 512, 6 rounds
    .venv/bin/python benchmarks/sequence_lengths.py --length 1024 --rounds 8

The model: LlamaForCausalLM from a config (hidden 256, 4 layers, 8 query / 4 key-value heads, vocabulary
1024, sdpa), batch 8 in 4 microbatches, 1F1B, each plan traced by torch.export at L with an attention mask.
Each round runs one step of every (plan, length) pair, the order reversed every other round, after a
barrier; a step's time is the slower rank's wall time, and its CPU time the larger of the two ranks'
process CPU seconds (what the step computed, which the other sessions' load on a shared machine
disturbs far less than the wall clock). The table gives medians over the rounds (the first round is
warm-up and not counted), the median of the per-round ratios L/4 : L, and the bytes rank 0 sent its
pipeline peer in that step (``PipelineRuntime.last_sent_bytes``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

PLANS = {"padded": dict(follow_sequence=False), "follows": {}}


def _llama(length: int):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=length,
                                   use_cache=False, attention_dropout=0.0, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _loss(output, target):
    return torch.nn.functional.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def _worker(rank: int, world: int, length: int, rounds: int) -> dict:
    import torch.distributed as dist

    import fxsplit

    model = _llama(length)
    ids = torch.randint(0, 1024, (8, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    pms, plan_s = {}, {}
    for name, opts in PLANS.items():
        t0 = time.perf_counter()
        pms[name] = fxsplit.parallelize(model, (ids,), {"attention_mask": mask}, loss_fn=_loss, pp=2,
                                        schedule="1f1b", microbatches=4, method="export", verify=False,
                                        timeout=600, **opts)
        plan_s[name] = time.perf_counter() - t0
    pairs = [(name, t) for name in PLANS for t in (length, length // 4)]
    times: dict = {p: [] for p in pairs}
    cpus: dict = {p: [] for p in pairs}
    sent: dict = {}
    for r in range(rounds + 1):
        for name, t in pairs if r % 2 == 0 else reversed(pairs):
            pm = pms[name]
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            pm.step(ids[:, :t], attention_mask=mask[:, :t], target=ids[:, :t])
            seconds = torch.tensor([time.perf_counter() - t0, time.process_time() - c0])
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            pm.zero_grad()
            if r > 0:
                times[(name, t)].append(float(seconds[0]))
                cpus[(name, t)].append(float(seconds[1]))
            sent[(name, t)] = pm.last_sent_bytes
    ratio = {(name, k): statistics.median(a / b for a, b in zip(d[(name, length // 4)], d[(name, length)]))
             for name in PLANS for k, d in (("wall", times), ("cpu", cpus))}
    return dict(times={p: statistics.median(v) for p, v in times.items()},
                cpus={p: statistics.median(v) for p, v in cpus.items()}, ratio=ratio, sent=sent, plan_s=plan_s,
                reason={n: next(x for x in str(pm.plan).splitlines() if x.startswith("sequence:"))
                        for n, pm in pms.items()})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=512, help="the traced length L")
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds (after one warm-up round)")
    ns = parser.parse_args(argv)
    from fxsplit.testing import run_distributed

    res = run_distributed(_worker, 2, ns.length, ns.rounds, timeout=3600)[0]
    L = ns.length
    print("| plan | step at L (wall / CPU) | step at L/4 (wall / CPU) | L/4 : L wall | L/4 : L CPU | "
          "bytes sent at L | at L/4 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in PLANS:
        w, c = res["times"], res["cpus"]
        print(f"| {name} | {w[(name, L)]:.3f} / {c[(name, L)]:.3f} s | {w[(name, L // 4)]:.3f} / "
              f"{c[(name, L // 4)]:.3f} s | {res['ratio'][(name, 'wall')]:.2f} | {res['ratio'][(name, 'cpu')]:.2f} | "
              f"{res['sent'][(name, L)] / 2**20:.1f} MiB | {res['sent'][(name, L // 4)] / 2**20:.1f} MiB |")
    print("plan time (the first includes the process's warm-up): " +
          ", ".join(f"{n} {s:.1f} s" for n, s in res["plan_s"].items()))
    for name, line in res["reason"].items():
        print(f"{name}: {line}")


if __name__ == "__main__":
    main()
