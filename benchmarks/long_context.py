"""Long context: peak activation memory per rank and step time of a small Llama at growing sequence
lengths, cp = 1 / 2 / 4 (context parallelism, ``parallelize(..., cp=C)``), keys and values by all-gather and
by ring (``cp_kv``), on 4 gloo ranks in ONE launch; then torch's own
``torch.distributed.tensor.experimental.context_parallel`` on the same model and ranks.

    .venv/bin/python benchmarks/long_context.py                              # 2k and 4k tokens
    .venv/bin/python benchmarks/long_context.py --lengths 2048,4096,8192,16384 --repeats 3
    .venv/bin/python benchmarks/long_context.py --lengths 16384 --layouts cp=4 --skip-torch   # cp=4 only

Layouts, 4 ranks each, each data-parallel replica training on ``--sequences`` sequences (default 2): cp=1
is dp=4 (each rank whole sequences), cp=2 is dp=2 x cp=2, cp=4 is cp=4 (each rank a quarter of each
sequence), the cp layouts once with K/V all-gathered and once passed around the ring. The model:
LlamaForCausalLM from a config (hidden 64, 2 layers, 4 query / 2 key-value heads of 16, vocabulary 256,
sdpa), its loss from ``labels=`` (the mean over every token of every cp rank). **peak** is the most bytes
the ops of one training step held at once on a rank (``fxsplit.testing.memory.LiveBytes``: activations,
their gradients, temporaries; parameters and their gradients, allocated before the step, are not
counted), the largest over the 4 ranks; **step** is the median wall time of ``pm.step`` over
``--repeats`` steps, the layouts alternated step by step (one of each, then again) so that machine
load hits them alike. CPU figures on a shared machine: the ratios between layouts are the result.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

LAYOUTS = {  # name -> parallelize options
    "cp=1 (dp=4)": dict(dp=4),
    "cp=2 all-gather (dp=2)": dict(dp=2, cp=2, cp_kv="allgather"),
    "cp=2 ring (dp=2)": dict(dp=2, cp=2, cp_kv="ring"),
    "cp=4 all-gather": dict(cp=4, cp_kv="allgather"),
    "cp=4 ring": dict(cp=4, cp_kv="ring"),
}
TORCH_TIMEOUT_S = 60


def _llama(seq_len: int):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len,
                                   use_cache=False, attention_dropout=0.0, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _loss(output, target):  # the model's own loss (labels= in the inputs)
    return output["loss"]


def _worker(rank: int, world: int, lengths: list[int], repeats: int, sequences: int, layouts: dict,
            with_torch: bool) -> dict:
    import fxsplit
    from fxsplit.testing.data import replica_slice
    from fxsplit.testing.memory import LiveBytes

    hw = fxsplit.Hardware.cpu()
    rows = {}
    for S in lengths:
        model = _llama(S)
        g = torch.Generator().manual_seed(S)
        ids = torch.randint(0, 256, (4 * sequences, S), generator=g)
        pms, data = {}, {}
        for name, layout in layouts.items():
            dp = layout.get("dp", 1)
            batch = ids[:sequences * dp]  # `sequences` per data-parallel replica
            pm = fxsplit.parallelize(model, (batch[:sequences],), {"labels": batch[:sequences]}, loss_fn=_loss,
                                     hardware=hw, timeout=600, verify=False, **layout)
            x = replica_slice(pm, batch)
            pms[name], data[name] = pm, x
            pm.step(x, labels=x, target=x)  # warm-up: allocates the parameter gradients
        times = {name: [] for name in layouts}
        peaks = {}
        for r in range(repeats):
            for name, pm in pms.items():
                x = data[name]
                if r == 0:
                    with LiveBytes() as mem:
                        pm.step(x, labels=x, target=x)
                    peaks[name] = mem.peak
                else:
                    t0 = time.perf_counter()
                    pm.step(x, labels=x, target=x)
                    times[name].append(time.perf_counter() - t0)
        rows[S] = {name: (peaks[name], statistics.median(times[name]) if times[name] else float("nan"))
                   for name in layouts}
        if rank == 0:  # this rank's figures as each length ends (the table, over every rank, comes at the end)
            for name, (peak, step) in rows[S].items():
                print(f"rank 0: {S} tokens, {name}: peak {peak / 2**20:.1f} MiB, step {step:.3f} s", flush=True)
        del pms
    rows["torch"] = _torch_cp(rank, world, min(lengths)) if with_torch else "not attempted (--skip-torch)"
    return rows


def _torch_cp(rank: int, world: int, seq_len: int) -> str:
    """One step of torch's context_parallel (cp=4) on the same model, or why it does not run here."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel

    model = _llama(seq_len)
    ids = torch.randint(0, 256, (1, seq_len), generator=torch.Generator().manual_seed(seq_len))
    pos = torch.arange(seq_len).unsqueeze(0)
    # a group of its own with a short timeout: a wait that never completes ends the attempt, not the run
    group = dist.new_group(timeout=datetime.timedelta(seconds=TORCH_TIMEOUT_S))
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("cp",))
    try:
        t0 = time.perf_counter()
        with context_parallel(mesh, buffers=[ids, pos], buffer_seq_dims=[1, 1]):
            loss = model(ids, position_ids=pos, labels=ids).loss
            loss.backward()
        return f"ran: {time.perf_counter() - t0:.2f} s"
    except Exception as exc:  # noqa: BLE001 -- the table says why it does not run
        return f"does not run: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,4096", help="sequence lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="steps per layout (the first measures memory)")
    parser.add_argument("--sequences", type=int, default=2, help="sequences per data-parallel replica (>= 2: export traces a batch of 1 static)")
    parser.add_argument("--layouts", default="", help="run only the layouts whose name contains one of these "
                        "comma-separated words (e.g. 'cp=4': a length whose cp=1 layout does not fit in memory)")
    parser.add_argument("--skip-torch", action="store_true", help="do not attempt torch's context_parallel")
    ns = parser.parse_args(argv)
    lengths = [int(x) for x in ns.lengths.split(",")]
    words = [w for w in ns.layouts.split(",") if w]
    layouts = {name: opts for name, opts in LAYOUTS.items() if not words or any(w in name for w in words)}
    from fxsplit.testing import run_distributed

    results = run_distributed(_worker, 4, lengths, max(ns.repeats, 2), ns.sequences, layouts,
                              not ns.skip_torch, timeout=4 * 3600)
    print("| tokens | layout | peak activation memory per rank | vs cp=1 | step (median) |")
    print("| --- | --- | --- | --- | --- |")
    first = next(iter(LAYOUTS))
    for S in lengths:
        base = max(r[S][first][0] for r in results) if first in layouts else None
        for name in layouts:
            peak = max(r[S][name][0] for r in results)
            step = max(r[S][name][1] for r in results)
            ratio = f"{peak / base:.2f}" if base else "not run"
            print(f"| {S} | {name} | {peak / 2**20:.1f} MiB | {ratio} | {step:.3f} s |")
    print(f"\ntorch context_parallel (cp=4, {min(lengths)} tokens, rank 0): {results[0]['torch']}")


if __name__ == "__main__":
    main()
