"""Published large-scale training runs and what the planner predicts for them.

Terms: t, p, d the tensor-, pipeline- and data-parallel degrees of a run; B its global batch
(sequences per optimizer step), s its sequence length; *TFLOP/s per GPU* the run's model FLOPs
per step over its step time and GPU count, as each source reports it.

    run = RUNS["gpt-145.6b"]
    row = predict(run)               # the published layout scored, the planner's pick, breakdowns
    row.predicted / run.tflops       # within 15% ([Note: published runs])

[Note: published runs]
Each run is a model shape, a GPU count and kind, a global batch and the layout its authors ran,
with the throughput they measured; every figure is cited where it is written below. The planner
sees the model as it sees any: traced on the meta device (with 2 layers, the workload then
extended to the run's layer count by ``fxsplit.planner.workload.repeat_layers``: a transformer's
layers are identical, and the trace of a 126-layer model costs minutes here) and scored on the
hardware preset of the run's GPU, with the run's software's FSDP (``PublishedRun.fsdp``: fxsplit's
own by default; torchtitan's and Llama 3's per-layer, prefetched FSDP2, [Note: FSDP policies] in
fxsplit.planner.fsdp). ``predict`` scores the published layout (its t, p, d; what the
source does not state, the microbatch size and the pipeline schedule, is the best the planner
finds among the schedules the source's software ran then: 1F1B and interleaved 1F1B), and runs
the search for the same GPUs and batch; ``benchmarks/planner.py paper`` prints the table and
``tests/test_planner_published.py`` holds every row's prediction within 15% of the published
figure (and torchtitan's published peak memory within 10%).
Throughput is the source's own formula over the predicted step: Megatron-LM's eq. (3), which
counts the recomputed forward (full activation recomputation), and for Llama 3 the 6 N + attention
count of model FLOPs per token that MFU is quoted by.
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from fxsplit.hardware import Hardware
from fxsplit.planner import Candidate, Score, Scorer, analyze, search
from fxsplit.planner.fsdp import FSDP2_PER_LAYER, FXSPLIT_STAGES, FsdpPolicy
from fxsplit.planner.workload import Workload, repeat_layers

__all__ = ["PublishedRun", "Prediction", "RUNS", "model_flops", "predict", "published_score", "run_hardware",
           "workload"]


@dataclass(frozen=True)
class PublishedRun:
    """One published run ([Note: published runs])."""

    name: str
    source: str
    family: str  # "gpt" (Megatron-LM's GPT) or "llama" (Hugging Face LlamaForCausalLM)
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    gpus: int
    global_batch: int
    t: int
    p: int
    tflops: float  # published TFLOP/s per GPU
    hardware: str  # Hardware.preset name
    ffn: int = 0  # feed-forward width (0: 4 x hidden)
    kv_heads: int = 0  # key/value heads (0: heads)
    shard: bool = False  # the data-parallel degree is FSDP (parameters and state sharded)
    checkpointing: tuple[str, ...] = ("full",)  # modes the published layout is scored with (fastest that fits)
    # (schedule, v) the published layout is scored with: the source's software's, v unstated
    schedules: tuple[tuple[str, int], ...] = (("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3),
                                              ("interleaved_1f1b", 4))
    sequence_parallel: tuple[bool, ...] = (False,)  # Megatron-LM 2021 had none (Korthikanti et al. 2022)
    # dropout on the residual stream and the attention probabilities: Megatron-LM's GPT default,
    # 0.1 (``--hidden-dropout``, ``--attention-dropout`` in megatron/arguments.py): the attention
    # then materializes its scores (softmax and dropout over b x heads x s x s), as Megatron-LM's
    # fused scale-mask-softmax did before FlashAttention
    dropout: float = 0.1
    tokens_per_gpu_s: float = 0.0  # published tokens per second per GPU (torchtitan's figure; 0: not published)
    memory_gib: float = 0.0  # the GPUs' memory when it is not the preset's (0: the preset's)
    fsdp: FsdpPolicy = FXSPLIT_STAGES  # what the run's software did with FSDP ([Note: FSDP policies])
    peak_gib: float = 0.0  # published peak memory per GPU, GiB (0: not published)

    @property
    def d(self) -> int:
        return self.gpus // (self.t * self.p)


# Megatron-LM: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
# Clusters Using Megatron-LM" (arXiv:2104.04473), Table 1: GPT with vocabulary 51,200 and sequence
# 2048 on Selene (DGX A100 80GB); per row (parameters in billions, attention heads, hidden size,
# layers, t, p, GPUs, batch size, achieved TFLOP/s per GPU). Every row trains with activation
# recomputation (its eq. (3) counts the recomputed forward).
_TABLE1 = (
    ("1.7", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("3.6", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("18.4", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("76.1", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145.6", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("310.1", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("529.6", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    ("1008", 160, 25600, 128, 8, 64, 3072, 3072, 163),
)
_MEGATRON = "Megatron-LM, arXiv:2104.04473 Table 1"

# Llama 3: Dubey et al. 2024, "The Llama 3 Herd of Models" (arXiv:2407.21783). The 405B model of its
# Table 3 (126 layers, model dimension 16,384, FFN 53,248, 128 attention heads, 8 key/value heads,
# vocabulary 128,256) and the 8K-context rows of its Table 4 (GPUs, TP, PP, DP, sequence 8,192,
# 16M tokens per batch = 2,048 sequences, BF16 TFLOP/s per GPU) on H100 80GB (Grand Teton, 8 per
# server on NVLink). Their DP is FSDP (parameters, gradients and optimizer state sharded).
_LLAMA3 = (
    (8192, 8, 16, 430),
    (16384, 8, 16, 400),
)
_LLAMA = "Llama 3, arXiv:2407.21783 Tables 3 and 4"

# torchtitan (PyTorch's own trainer), the rows in bf16 without Float8 or torch.compile, sequence 8,192,
# data parallelism FSDP2 over the GPUs not in TP (t), no pipeline; figures are tokens per second per
# GPU (torchtitan's "WPS" / "TPS/GPU"). Per row: (model, GPUs, t, global batch, checkpointing,
# tokens/s/GPU, hardware preset, GPU memory GiB (0: the preset's), published peak memory GiB (0: not
# published), source). The runs' FSDP is FSDP2 per layer, prefetched ([Note: FSDP policies] in
# fxsplit.planner.fsdp); their H100s are the 500 W HBM2e ones of the ``h100-hbm2e`` preset.
# - docs/performance.md at commit 4d88a8a44 (2024-12-03): "Llama 3 performance numbers" on 64 A100
#   80GB, local batch 1: 8B selective op AC 2973 WPS (MFU 58.2%), 70B full AC 331 WPS (MFU 51.7%);
#   "Llama 3.1 performance numbers" on 128 H100 (95 GB HBM2e): 405B, FSDP 16 x TP 8, local batch 2
#   (global 32), full AC, no optimizations: 109 WPS (MFU 29.0%).
# - benchmarks/llama3_h100_202412_torchtitan.md (torchtitan 9dec370, 2024-12-26; H100 96GB HBM2e at
#   the default 500 W): Table 1, Llama 3.1 8B, 8 GPUs, local batch 2 (global 16), selective AC, FSDP:
#   5,762 TPS/GPU, memory 82.4 GiB; Table 3, the same on 128 GPUs (global 256): 5,605 TPS/GPU,
#   67.0 GiB (the maximum over the GPUs, its footnote 1). Its 70B (Table 4) and
#   405B (Table 5) rows run Float8 and torch.compile, which the planner's bf16 model does not
#   describe: left out.
_TORCHTITAN_DOC = "torchtitan docs/performance.md @4d88a8a44"
_TORCHTITAN_BENCH = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
_LLAMA_SHAPES = {  # layers, hidden, FFN, heads, kv heads (Llama 3 / 3.1, vocabulary 128,256)
    "8b": (32, 4096, 14336, 32, 8), "70b": (80, 8192, 28672, 64, 8), "405b": (126, 16384, 53248, 128, 8)}
_TORCHTITAN = (
    ("8b", 64, 1, 64, "selective", 2973, "a100-80gb", 0, 0, _TORCHTITAN_DOC),
    ("70b", 64, 1, 64, "full", 331, "a100-80gb", 0, 0, _TORCHTITAN_DOC),
    ("405b", 128, 8, 32, "full", 109, "h100-hbm2e", 95, 0, _TORCHTITAN_DOC),
    ("8b", 8, 1, 16, "selective", 5762, "h100-hbm2e", 96, 82.4, _TORCHTITAN_BENCH),
    ("8b", 128, 1, 256, "selective", 5605, "h100-hbm2e", 96, 67.0, _TORCHTITAN_BENCH),
)

RUNS: dict[str, PublishedRun] = {}
for _n, _heads, _h, _l, _t, _p, _gpus, _b, _tf in _TABLE1:
    RUNS[f"gpt-{_n}b"] = PublishedRun(name=f"GPT {_n}B", source=_MEGATRON, family="gpt", layers=_l, hidden=_h,
                                      heads=_heads, seq=2048, vocab=51200, gpus=_gpus, global_batch=_b, t=_t,
                                      p=_p, tflops=_tf, hardware="a100-80gb")
for _gpus, _t, _p, _tf in _LLAMA3:
    RUNS[f"llama3-405b-{_gpus}"] = PublishedRun(
        name=f"Llama 3 405B, {_gpus} GPUs", source=_LLAMA, family="llama", layers=126, hidden=16384, heads=128,
        seq=8192, vocab=128256, gpus=_gpus, global_batch=2048, t=_t, p=_p, tflops=_tf, hardware="h100-sxm",
        ffn=53248, kv_heads=8, shard=True, dropout=0.0, checkpointing=("none", "selective", "full"),
        sequence_parallel=(False, True), fsdp=FSDP2_PER_LAYER,
        schedules=(("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4), ("interleaved_1f1b", 8)))


for _m, _gpus, _t, _b, _ckpt, _tps, _hw, _gib, _peak, _src in _TORCHTITAN:
    _l, _h, _ffn, _heads, _kv = _LLAMA_SHAPES[_m]
    RUNS[f"torchtitan-llama3-{_m}-{_gpus}"] = PublishedRun(
        name=f"torchtitan Llama 3 {_m.upper()}, {_gpus} GPUs", source=_src, family="llama", layers=_l, hidden=_h,
        heads=_heads, seq=8192, vocab=128256, gpus=_gpus, global_batch=_b, t=_t, p=1, tflops=0.0, hardware=_hw,
        ffn=_ffn, kv_heads=_kv, shard=True, dropout=0.0, checkpointing=(_ckpt,), sequence_parallel=(False, True),
        tokens_per_gpu_s=float(_tps), memory_gib=float(_gib), peak_gib=float(_peak), fsdp=FSDP2_PER_LAYER)


def _model(run: PublishedRun, layers: int) -> tuple[Any, tuple, dict]:
    """The run's model with ``layers`` layers on the meta device, in bf16, and example inputs."""
    if run.family == "gpt":
        from fxsplit.testing import zoo

        with torch.device("meta"):
            model = zoo.GPT(zoo.GPTConfig(n_layer=layers, n_embd=run.hidden, n_head=run.heads, vocab_size=run.vocab,
                                          block_size=run.seq, tie_weights=True, bias=True, dropout=run.dropout,
                                          attn_dropout=run.dropout)).to(torch.bfloat16)
        return model, (torch.zeros(1, run.seq, dtype=torch.long, device="meta"),), {}
    from fxsplit.testing import hf_zoo

    return hf_zoo.meta_llama_70b(seq_len=run.seq, vocab_size=run.vocab, num_hidden_layers=layers,
                                 hidden_size=run.hidden, intermediate_size=run.ffn, num_attention_heads=run.heads,
                                 num_key_value_heads=run.kv_heads or run.heads, max_position_embeddings=run.seq)


def workload(run: PublishedRun, cache: dict | None = None) -> Workload:
    """The planner's workload of ``run``'s model: traced with 2 layers, extended to ``run.layers``
    ([Note: published runs]); ``cache`` keyed by the model's shape and GPU count."""
    from fxsplit.graph.trace import trace

    key = (run.family, run.hidden, run.heads, run.seq, run.vocab, run.ffn, run.kv_heads, run.layers, run.gpus)
    if cache is not None and key in cache:
        return cache[key]
    model, args, kwargs = _model(run, 2)
    gm = trace(model, args, kwargs)
    w = repeat_layers(analyze(gm, world_size=run.gpus, hardware=Hardware.preset(run.hardware)), run.layers)
    if cache is not None:
        cache[key] = w
    return w


def model_flops(run: PublishedRun, w: Workload) -> float:
    """Model FLOPs per optimizer step by the source's own count ([Note: published runs])."""
    B, s, l, h, V = run.global_batch, run.seq, run.layers, run.hidden, run.vocab
    if run.family == "gpt":  # Megatron-LM eq. (3)
        return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    return B * s * (6 * w.param_numel + 12 * l * h * s)  # every weight's 6 FLOPs per token, plus attention


def tflops_per_gpu(run: PublishedRun, w: Workload, step_time: float) -> float:
    return model_flops(run, w) / (step_time * run.gpus) / 1e12


_SIMULATED = 3  # published-layout variants simulated after the closed form ranks them


def published_score(run: PublishedRun, w: Workload, scorer: Scorer) -> Score:
    """The published layout scored: the fastest that fits over the microbatch sizes, the
    schedules and checkpointing modes of ``run`` ([Note: published runs])."""
    d, out = run.d, []
    per_replica = run.global_batch // d
    # microbatch size: 1 under a pipeline (the smallest bubble), else the best of a few
    sizes = (1,) if run.p > 1 else tuple(b for b in (1, 2, 4, 8) if per_replica % b == 0)
    for sched, v in (run.schedules if run.p > 1 else (("1f1b", 1),)):
        if v * run.p > w.num_groups - 2:
            continue
        for b in sizes:
            m = per_replica // b
            if sched == "interleaved_1f1b" and m % run.p:
                continue  # Megatron's interleaved schedule needs m a multiple of p
            for ckpt in run.checkpointing:
                for sp in (run.sequence_parallel if run.t > 1 else (False,)):
                    c = Candidate(dp=d, tp=run.t, pp=run.p, stages_per_rank=v, schedule=sched, microbatches=m,
                                  microbatch_size=b, activation_checkpointing=ckpt, sequence_parallel=sp,
                                  dp_shard=d if run.shard else 1)
                    out.append(scorer.score(c))
    # ranked by the closed form, the best few simulated (as the search does: [Note: search strategy])
    out.sort(key=lambda s: (not s.fits, s.step_time))
    return min((scorer.score(s.candidate, simulate=True) for s in out[:_SIMULATED]),
               key=lambda s: (not s.fits, s.step_time))


@dataclass(frozen=True)
class Prediction:
    """The planner on one published run: ``published`` is the published layout's score, ``pick``
    the search's; ``predicted`` / ``pick_tflops`` their TFLOP/s per GPU."""

    run: PublishedRun
    published: Score
    predicted: float
    pick: Score | None = None
    pick_tflops: float = math.nan
    search_seconds: float = 0.0
    notes: tuple[str, ...] = field(default=())

    @property
    def tokens_per_gpu_s(self) -> float:
        """Predicted tokens per second per GPU of the published layout."""
        run = self.run
        return run.global_batch * run.seq / (self.published.step_time * run.gpus)

    @property
    def error(self) -> float:
        """(predicted - published) / published, for the published layout: in tokens per second per
        GPU where the source publishes those (torchtitan), else in TFLOP/s per GPU."""
        if self.run.tokens_per_gpu_s:
            return self.tokens_per_gpu_s / self.run.tokens_per_gpu_s - 1.0
        return self.predicted / self.run.tflops - 1.0


def run_hardware(run: PublishedRun) -> Hardware:
    """The preset of ``run``'s GPU, with the run's GPU memory where it differs from the preset's."""
    hw = Hardware.preset(run.hardware)
    return dataclasses.replace(hw, memory_bytes=run.memory_gib * 2**30) if run.memory_gib else hw


def predict(run: PublishedRun, *, cache: dict | None = None, search_layouts: bool = True,
            hardware: Hardware | None = None) -> Prediction:
    """The planner's prediction for ``run``'s published layout and (``search_layouts``) its own
    pick, on ``hardware`` (default: the run's preset)."""
    import time

    hw = hardware if hardware is not None else run_hardware(run)
    w = workload(run, cache)
    pub = published_score(run, w, Scorer(w, hw, hw.memory_bytes, fsdp=run.fsdp))
    pred = tflops_per_gpu(run, w, pub.step_time)
    if not search_layouts:
        return Prediction(run, pub, pred)
    t0 = time.perf_counter()
    found = search(w, world_size=run.gpus, global_batch=run.global_batch, hardware=hw, shard=run.shard,
                   fsdp=run.fsdp)
    return Prediction(run, pub, pred, found.best, tflops_per_gpu(run, w, found.best.step_time),
                      time.perf_counter() - t0)
