"""What a time estimate assumes about one device, its node and its links: :class:`Hardware`.

Terms:
    peak: a vendor's datasheet rate (dense, no sparsity); never reached by real kernels.
    efficiency: the fraction of peak a real workload achieves (``matmul_efficiency``,
        ``memory_efficiency``), from public measurements.
    achievable: peak x efficiency; the rates every estimate divides by.
    alpha, beta: a message of ``b`` bytes takes ``alpha + b / bandwidth`` seconds (alpha: latency).
    node: ``devices_per_node`` devices joined by the intra-node link (NVLink/NVSwitch); nodes are
        joined by the inter-node link (InfiniBand), per device.

Signature::

    hw = Hardware()                      # a generic datacenter GPU: 100 TFLOP/s, 1.5 TB/s, 25 GB/s
    hw = Hardware.cpu(cores=2)           # a CPU rank on gloo
    hw = Hardware.preset("h100-sxm")     # a DGX H100 node, every number cited below
    hw = Hardware.measure(cache=True)    # this machine, profiled in about a second, cached as JSON
    hw.flops_per_s, hw.bytes_per_s, hw.link_bytes_per_s   # what the roofline estimate divides by
    hw.matmul_time(flops, dtype)  hw.memory_time(nbytes)  hw.p2p_time(nbytes, intra_node=True)
    hw.allreduce_time(nbytes, n, intra_node)  hw.allgather_time(...)  hw.reduce_scatter_time(...)
    seconds = fxsplit.graph.cost.estimate_time(cost, flops_per_s=hw.flops_per_s, bytes_per_s=hw.bytes_per_s)

[Note: collective time formulas]
Every link time is alpha-beta: ``p2p_time(b) = alpha + b / bw`` for one message of ``b`` bytes
between two devices, with (alpha, bw) the intra-node pair when both ends share a node and the
inter-node pair otherwise. Collectives over ``n`` devices use the bandwidth-optimal ring (what
NCCL and gloo pick for large messages), ``b`` being the full (unsharded) tensor's bytes on every
rank:

    reduce_scatter_time(b, n) = (n - 1) * alpha + (n - 1) / n * b / bw
    allgather_time(b, n)      = (n - 1) * alpha + (n - 1) / n * b / bw
    allreduce_time(b, n)      = 2 (n - 1) * alpha + 2 (n - 1) / n * b / bw   (= RS then AG)
    all_to_all_time(b, n)     = (n - 1) * alpha + (n - 1) / n * b / bw       (pairwise exchange)

For an all-to-all ``b`` is what each rank sends in all (its own share stays); the pairwise
exchange (n - 1 steps, one peer each) is what gloo and NCCL run, at the same per-step cost as a
ring step, so the measured ring figures below apply to it too.

A ring is as slow as its slowest hop, so a ring that spans nodes (``intra_node=False``) is charged
the inter-node pair for every step: conservative for hierarchical algorithms, exact for a flat ring.
``n == 1`` costs 0. Where ``measure()`` fitted an all-reduce (``ring_latency_s``,
``ring_bytes_per_s``), those per-step figures replace the link pair for collectives in the scope
they were measured in: gloo's collectives do not run at its point-to-point speed.
``bw`` is the per-device, per-direction bandwidth (a datasheet's bidirectional
NVLink figure is halved). Compute: ``matmul_time(f, dtype) = f / (peak[dtype] * matmul_efficiency)``
and ``memory_time(b) = b / (peak_bytes_per_s * memory_efficiency)``; both are what
``flops_per_s`` / ``bytes_per_s`` hold for the default dtype.

[Note: the rates an estimate divides by]
``flops_per_s``, ``bytes_per_s`` and ``link_bytes_per_s`` (and ``Hardware.cpu``) are the
achievable matmul rate (the cost model's roofline divides by it), the achievable memory
bandwidth, and the point-to-point bandwidth between pipeline ranks. Left unset they are derived
(peak x efficiency; ``link_bytes_per_s`` = the inter-node bandwidth, since pipeline stages usually
cross nodes) or, with no peak given either, take the defaults of a generic datacenter GPU
(100 TFLOP/s, 1.5 TB/s, 25 GB/s). Given both a rate and its peak, they must agree.
``flops_per_s`` is the rate at the preset's training dtype: bf16 for the GPU presets, the default
dtype (fp32) for ``measure()`` and ``cpu()``.

May import: ``fxsplit.errors``, ``fxsplit.config``; torch only inside ``measure`` (``measure()``
times matmuls, memory traffic and, on a process group the caller already initialized,
torch.distributed collectives).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from fxsplit.errors import UsageError

__all__ = ["Hardware", "PRESETS"]

_DEFAULT_FLOPS, _DEFAULT_BYTES, _DEFAULT_LINK = 100e12, 1.5e12, 25e9


@dataclass(frozen=True)
class Hardware:
    """One device, its node and its links; see the module docstring and [Note: the rates an estimate divides by]."""

    flops_per_s: float | None = None  # achievable matmul FLOP/s at the default dtype; None: derived
    bytes_per_s: float | None = None  # achievable memory bandwidth; None: derived
    link_bytes_per_s: float | None = None  # p2p bandwidth between pipeline ranks; None: inter-node
    name: str = "generic"
    peak_bf16_flops_per_s: float | None = None  # dense bf16 (= fp16) peak; None: flops_per_s / eff
    peak_fp32_flops_per_s: float | None = None  # fp32 peak; None: same as bf16 (one rate)
    peak_bytes_per_s: float | None = None  # memory bandwidth peak; None: bytes_per_s / eff
    matmul_efficiency: float = 1.0  # achievable / peak matmul FLOP/s
    memory_efficiency: float = 1.0  # achievable / peak memory bandwidth
    memory_bytes: float = math.inf  # device memory capacity; inf: unknown
    devices_per_node: int = 1
    intra_node_bytes_per_s: float | None = None  # per device, per direction; None: link_bytes_per_s
    intra_node_latency_s: float = 0.0  # alpha inside a node; 0: unknown
    inter_node_bytes_per_s: float | None = None  # per device, per direction; None: link_bytes_per_s
    inter_node_latency_s: float = 0.0  # alpha between nodes; 0: unknown
    # Measured ring figures (an all-reduce fit, see measure()); when set they replace the link pair
    # in collectives of the scope they were measured in (ring_intra_node). None: the link pair.
    ring_latency_s: float | None = None
    ring_bytes_per_s: float | None = None
    ring_intra_node: bool = True
    compute_dtype: str = "bf16"  # the dtype flops_per_s is the rate of: "bf16" or "fp32"
    source: str = "fxsplit defaults"  # where the numbers came from

    def __post_init__(self) -> None:
        for field in ("matmul_efficiency", "memory_efficiency"):
            value = getattr(self, field)
            if not 0 < value <= 1:
                raise UsageError(f"Hardware.{field} must be in (0, 1], got {value}")
        if self.compute_dtype not in ("bf16", "fp32"):
            raise UsageError(f"Hardware.compute_dtype must be 'bf16' or 'fp32', got {self.compute_dtype!r}")
        if self.devices_per_node < 1:
            raise UsageError(f"Hardware.devices_per_node must be >= 1, got {self.devices_per_node}")
        set_ = lambda k, v: object.__setattr__(self, k, float(v))  # noqa: E731  (frozen dataclass)
        eff = self.matmul_efficiency
        peak_default = self.peak_bf16_flops_per_s if self.compute_dtype == "bf16" else self.peak_fp32_flops_per_s
        if self.flops_per_s is None:
            set_("flops_per_s", peak_default * eff if peak_default is not None else _DEFAULT_FLOPS)
        elif peak_default is not None and not math.isclose(self.flops_per_s, peak_default * eff, rel_tol=1e-6):
            raise UsageError(
                f"Hardware: flops_per_s ({self.flops_per_s:.4g}) != peak {self.compute_dtype} "
                f"({peak_default:.4g}) x matmul_efficiency ({eff}); give one or make them agree")
        if self.peak_bf16_flops_per_s is None:
            set_("peak_bf16_flops_per_s", self.flops_per_s / eff)
        if self.peak_fp32_flops_per_s is None:
            set_("peak_fp32_flops_per_s", self.peak_bf16_flops_per_s)
        meff = self.memory_efficiency
        if self.bytes_per_s is None:
            set_("bytes_per_s", self.peak_bytes_per_s * meff if self.peak_bytes_per_s is not None else _DEFAULT_BYTES)
        elif self.peak_bytes_per_s is not None and not math.isclose(
                self.bytes_per_s, self.peak_bytes_per_s * meff, rel_tol=1e-6):
            raise UsageError(
                f"Hardware: bytes_per_s ({self.bytes_per_s:.4g}) != peak_bytes_per_s "
                f"({self.peak_bytes_per_s:.4g}) x memory_efficiency ({meff}); give one or make them agree")
        if self.peak_bytes_per_s is None:
            set_("peak_bytes_per_s", self.bytes_per_s / meff)
        if self.link_bytes_per_s is None:
            set_("link_bytes_per_s", self.inter_node_bytes_per_s
                 if self.inter_node_bytes_per_s is not None else _DEFAULT_LINK)
        if self.intra_node_bytes_per_s is None:
            set_("intra_node_bytes_per_s", self.link_bytes_per_s)
        if self.inter_node_bytes_per_s is None:
            set_("inter_node_bytes_per_s", self.link_bytes_per_s)
        for field in ("flops_per_s", "bytes_per_s", "link_bytes_per_s", "intra_node_bytes_per_s",
                      "inter_node_bytes_per_s", "peak_bf16_flops_per_s", "peak_fp32_flops_per_s", "memory_bytes"):
            if not getattr(self, field) > 0:
                raise UsageError(f"Hardware.{field} must be > 0, got {getattr(self, field)}")
        for field in ("intra_node_latency_s", "inter_node_latency_s"):
            if not getattr(self, field) >= 0:
                raise UsageError(f"Hardware.{field} must be >= 0, got {getattr(self, field)}")

    # -- constructors ------------------------------------------------------------------------

    @classmethod
    def cpu(cls, cores: int = 1) -> "Hardware":
        """A CPU rank (gloo): ~50 GFLOP/s and ~10 GB/s per core, ~5 GB/s between processes."""
        return cls(flops_per_s=50e9 * cores, bytes_per_s=10e9 * cores, link_bytes_per_s=5e9,
                   name=f"cpu-{cores}", compute_dtype="fp32", source="fxsplit rough CPU defaults")

    @classmethod
    def preset(cls, name: str) -> "Hardware":
        """A published node: ``"a100-80gb"`` (DGX A100), ``"h100-sxm"`` (DGX H100) or ``"h100-hbm2e"``
        (the 500 W, 96 GB HBM2e H100 of torchtitan's runs); see PRESETS."""
        key = name.strip().lower()
        if key not in PRESETS:
            raise UsageError(f"Hardware.preset: unknown name {name!r}; presets: {', '.join(sorted(PRESETS))}")
        return cls(**PRESETS[key])

    @classmethod
    def measure(cls, cache: bool = True, *, budget_s: float = 0.25) -> "Hardware":
        """Profile this machine; ``cache=False`` re-measures (and rewrites the cache).

        Measures matmul FLOP/s (fp32, and bf16 where the device runs it), memory bandwidth (a large
        copy) and, when ``torch.distributed`` is initialized, point-to-point (rank 0 <-> 1) and
        all-reduce times by message size over the current backend, fitted to alpha-beta. Without a
        process group the link figures keep :class:`Hardware`'s defaults (``source`` says so).
        Under a process group every rank must call it (it is collective): the cache hit is agreed
        by all ranks and rank 0's figures are broadcast, so ranks never disagree or hang.
        ``budget_s`` bounds each timing loop. The cache is JSON under ``FXSPLIT_CACHE_DIR`` (default
        ``~/.cache/fxsplit``), keyed by host, device, torch version and, under a process group, the
        backend and world size.
        """
        from fxsplit.hardware import measure as m

        return m.measure(cls, cache=cache, budget_s=budget_s)

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-friendly (``inf`` memory as None); ``Hardware(**d)`` round-trips."""
        d = dataclasses.asdict(self)
        if math.isinf(d["memory_bytes"]):
            d["memory_bytes"] = None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Hardware":
        d = dict(d)
        if d.get("memory_bytes") is None:
            d["memory_bytes"] = math.inf
        return cls(**{k: v for k, v in d.items() if k in _FIELDS})

    # -- what the cost model and the planner call ---------------------------------------------

    def peak_flops_per_s(self, dtype: Any = None) -> float:
        """Peak matmul FLOP/s at ``dtype`` (torch dtype or "bf16"/"fp16"/"fp32"; None: compute_dtype)."""
        kind = _dtype_kind(dtype if dtype is not None else self.compute_dtype)
        return self.peak_bf16_flops_per_s if kind == "bf16" else self.peak_fp32_flops_per_s

    def matmul_time(self, flops: float, dtype: Any = None) -> float:
        """Seconds for ``flops`` matmul FLOPs at ``dtype``: flops / (peak[dtype] x matmul_efficiency)."""
        return flops / (self.peak_flops_per_s(dtype) * self.matmul_efficiency)

    def memory_time(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` through device memory at the achievable bandwidth."""
        return nbytes / self.bytes_per_s

    def _link(self, intra_node: bool) -> tuple[float, float]:
        if intra_node:
            return self.intra_node_latency_s, self.intra_node_bytes_per_s
        return self.inter_node_latency_s, self.inter_node_bytes_per_s

    def p2p_time(self, nbytes: float, intra_node: bool = True) -> float:
        """One message between two devices: alpha + nbytes / bw ([Note: collective time formulas])."""
        alpha, bw = self._link(intra_node)
        return alpha + nbytes / bw

    def _ring(self, nbytes: float, n: int, intra_node: bool, passes: int) -> float:
        if n < 1:
            raise UsageError(f"Hardware: a collective needs n >= 1 devices, got {n}")
        if n == 1:
            return 0.0
        alpha, bw = self._link(intra_node)
        if self.ring_bytes_per_s is not None and intra_node == self.ring_intra_node:
            alpha, bw = self.ring_latency_s or 0.0, self.ring_bytes_per_s
        return passes * ((n - 1) * alpha + (n - 1) / n * nbytes / bw)

    def allreduce_time(self, nbytes: float, n: int, intra_node: bool = True) -> float:
        """Ring all-reduce of ``nbytes`` over ``n``: 2(n-1) alpha + 2(n-1)/n nbytes / bw."""
        return self._ring(nbytes, n, intra_node, passes=2)

    def allgather_time(self, nbytes: float, n: int, intra_node: bool = True) -> float:
        """Ring all-gather of ``nbytes`` (the full tensor, on each of ``n``): (n-1) alpha + (n-1)/n nbytes / bw."""
        return self._ring(nbytes, n, intra_node, passes=1)

    def reduce_scatter_time(self, nbytes: float, n: int, intra_node: bool = True) -> float:
        """Ring reduce-scatter of ``nbytes`` (the full tensor) over ``n``: (n-1) alpha + (n-1)/n nbytes / bw."""
        return self._ring(nbytes, n, intra_node, passes=1)

    def all_to_all_time(self, nbytes: float, n: int, intra_node: bool = True) -> float:
        """All-to-all of ``nbytes`` per rank over ``n`` (each keeps 1/n): (n-1) alpha + (n-1)/n nbytes / bw."""
        return self._ring(nbytes, n, intra_node, passes=1)

    def same_node(self, rank_a: int, rank_b: int) -> bool:
        """Whether two global ranks share a node, ranks being packed ``devices_per_node`` to a node."""
        return rank_a // self.devices_per_node == rank_b // self.devices_per_node


_FIELDS = {f.name for f in dataclasses.fields(Hardware)}


def _dtype_kind(dtype: Any) -> str:
    text = str(dtype).lower().removeprefix("torch.")
    if text in ("bf16", "bfloat16", "fp16", "float16", "half"):
        return "bf16"  # A100/H100 tensor cores run fp16 and bf16 at the same dense rate
    if text in ("fp32", "float32", "float"):
        return "fp32"
    raise UsageError(f"Hardware: no matmul rate for dtype {dtype!r}; known: bf16, fp16, fp32")


# Every number below is per GPU, dense (no 2:4 sparsity), and per direction for links.
PRESETS: dict[str, dict[str, Any]] = {
    "a100-80gb": dict(
        name="a100-80gb",
        # NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM): BF16 Tensor Core 312 TFLOPS
        # (624 with sparsity), FP32 19.5 TFLOPS (torch's default fp32 matmul is not TF32).
        peak_bf16_flops_per_s=312e12,
        peak_fp32_flops_per_s=19.5e12,
        # Same datasheet: 80 GB HBM2e at 2,039 GB/s.
        peak_bytes_per_s=2039e9,
        memory_bytes=80e9,
        # Fitted to Megatron-LM's Table 1 (Narayanan et al. 2021, arXiv:2104.04473: ten GPT runs,
        # 1.7B to 1T parameters on 32 to 3072 A100s, 135-163 TFLOP/s per GPU end to end): the
        # efficiency at which fxsplit's model of each published layout (its bubble, recompute, TP,
        # pipeline and data-parallel communication, the attention scores Megatron materialized)
        # comes closest to every published figure (benchmarks/planner.py paper; within -10% .. +8%,
        # tests/test_planner_published.py). An end-to-end figure (the 1T run's 163/312 = 0.52)
        # would count the bubble and communication twice. Below the 80-90% of peak that
        # optimized GEMMs reach on A100 (Dao 2023, FlashAttention-2, arXiv:2307.08691, Sec. 1):
        # it also covers the non-matmul ops' launch and fusion losses the roofline leaves out.
        matmul_efficiency=0.70,
        # NVIDIA's A100 product page claims 95% DRAM utilization efficiency; 0.85 is a
        # conservative margin under it (not a measurement of ours).
        memory_efficiency=0.85,
        # DGX A100 user guide / datasheet: 8 A100 SXM4 GPUs per node on 6 NVSwitches.
        devices_per_node=8,
        # A100 datasheet: NVLink 600 GB/s (third-generation, 12 links, bidirectional) -> 300 GB/s
        # per direction.
        intra_node_bytes_per_s=300e9,
        # NCCL src/graph/tuning.cc: hwLat[NVLINK] Ring/Simple = 3.4 us per ring step.
        intra_node_latency_s=3.4e-6,
        # DGX A100 datasheet: 8 single-port ConnectX-6 200 Gb/s HDR InfiniBand for compute, one per
        # GPU -> 25 GB/s per GPU per direction.
        inter_node_bytes_per_s=200e9 / 8,
        # Not confirmed from a source: a conservative 10 us per inter-node message (IB verbs
        # latency is a few us; NCCL adds protocol overhead).
        inter_node_latency_s=10e-6,
        compute_dtype="bf16",
        source="preset: NVIDIA A100/DGX A100 datasheets, Megatron-LM (arXiv:2104.04473), NCCL tuning.cc",
    ),
    "h100-sxm": dict(
        name="h100-sxm",
        # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): BF16 Tensor Core 1,979 TFLOPS with
        # sparsity -> 989.4 dense; FP32 67 TFLOPS.
        peak_bf16_flops_per_s=989.4e12,
        peak_fp32_flops_per_s=67e12,
        # Same datasheet: 80 GB HBM3 at 3.35 TB/s.
        peak_bytes_per_s=3.35e12,
        memory_bytes=80e9,
        # Fitted to Llama 3 405B's 8K-context runs (Dubey et al. 2024, "The Llama 3 Herd of
        # Models", arXiv:2407.21783, Table 4: 430 and 400 BF16 TFLOP/s per GPU, 38-43% MFU, on
        # 8192 and 16384 H100s): the efficiency at which fxsplit's model of the published layout
        # (TP 8, PP 16, FSDP over DP, its gathers and reductions under compute as the paper's Sec.
        # 3.3.2 states: [Note: FSDP policies] in fxsplit.planner.fsdp) comes closest to both: -10%
        # and +10% (benchmarks/planner.py paper, tests/test_planner_published.py holds them within
        # 15%; the 16K row is scored fastest with selective recomputation, which fits its
        # interleaved schedule by the memory model, the 8K row's interleaved schedules fit only
        # full recomputation, and the paper states neither). Their 38-43% MFU is end to end (bubble,
        # recompute and communication included); taken as the matmul rate it would count those
        # twice. Not checked against a GEMM benchmark of ours (no H100 here): a fit, like the
        # A100's, whose every published figure the test holds within 15%.
        matmul_efficiency=0.69,
        # No public H100 figure confirmed here; the same conservative 0.85 as the A100 preset.
        memory_efficiency=0.85,
        # DGX H100 user guide: 8 H100 SXM5 GPUs per node on 4 third-generation NVSwitches.
        devices_per_node=8,
        # H100 datasheet: NVLink 900 GB/s (fourth-generation, 18 links, bidirectional) -> 450 GB/s
        # per direction.
        intra_node_bytes_per_s=450e9,
        # NCCL src/graph/tuning.cc: hwLat[NVLINK] Ring/Simple = 3.4 us per ring step.
        intra_node_latency_s=3.4e-6,
        # DGX H100 user guide: 8 ConnectX-7 400 Gb/s NDR InfiniBand ports for compute, one per GPU
        # -> 50 GB/s per GPU per direction.
        inter_node_bytes_per_s=400e9 / 8,
        # Not confirmed from a source: the same conservative 10 us as the A100 preset.
        inter_node_latency_s=10e-6,
        compute_dtype="bf16",
        source="preset: NVIDIA H100/DGX H100 datasheets, Llama 3 paper (arXiv:2407.21783), NCCL tuning.cc",
    ),
    "h100-hbm2e": dict(
        name="h100-hbm2e",
        # The H100s of torchtitan's published runs (benchmarks/llama3_h100_202412_torchtitan.md,
        # "Hardware", and docs/performance.md @4d88a8a44, footnote 1): Grand Teton hosts of 8 SXM
        # H100s with 96 GB HBM2e (95 GB usable, 94 GB in its text) at 2.4 TB/s peak, "the default
        # 500W power limit" (a lower TDP than the 700 W H100 SXM), "the actual peak TFLOPs number is
        # between SXM and NVL, and we don't know its exact value". So the peak is the SXM datasheet's
        # (989.4 dense BF16, what the source's own MFU divides by), and the efficiency is fitted:
        # to torchtitan's three bf16 H100 rows without torch.compile or Float8 (Llama 3.1 8B on 8
        # and 128 GPUs: 5,762 and 5,605 tokens/s/GPU; 405B on 128: 109), with FSDP2's per-layer
        # prefetch modelled ([Note: FSDP policies] in fxsplit.planner.fsdp): +4%, +1%, -2%
        # (benchmarks/planner.py paper; tests/test_planner_published.py). It is lower than the 700 W
        # preset's (0.44 against 0.69) by what the fit lumps together: the power-capped clock,
        # eager mode's unfused RMSNorm / rotary / SwiGLU kernels (torchtitan's own tables: +16% with
        # torch.compile), and attention at FlashAttention-2's rate on H100 ("only 35% utilization",
        # Shah et al. 2024, FlashAttention-3, arXiv:2407.08608, Sec. 1), which the roofline prices
        # as a matmul.
        peak_bf16_flops_per_s=989.4e12,
        peak_fp32_flops_per_s=67e12,
        peak_bytes_per_s=2.4e12,
        memory_bytes=96 * 2**30,
        matmul_efficiency=0.44,
        # The same conservative 0.85 as the other presets.
        memory_efficiency=0.85,
        # "Each host has 8 NVIDIA H100 GPUs fully connected with NVLink": H100 SXM's fourth-generation
        # NVLink, 900 GB/s bidirectional -> 450 GB/s per direction.
        devices_per_node=8,
        intra_node_bytes_per_s=450e9,
        # NCCL src/graph/tuning.cc: hwLat[NVLINK] Ring/Simple = 3.4 us per ring step.
        intra_node_latency_s=3.4e-6,
        # "Hosts are inter-connected with backend RDMA network with 400 Gb/s per GPU" -> 50 GB/s.
        inter_node_bytes_per_s=400e9 / 8,
        # Not confirmed from a source: the same conservative 10 us as the other presets.
        inter_node_latency_s=10e-6,
        compute_dtype="bf16",
        source="preset: torchtitan's Grand Teton H100 96GB HBM2e at 500 W (benchmarks/llama3_h100_202412_torchtitan.md), "
               "fitted on its bf16 runs",
    ),
}


