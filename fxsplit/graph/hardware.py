"""What a stage-time estimate assumes about one device and its links: :class:`Hardware`.

    hw = Hardware()              # a datacenter GPU: 100 TFLOP/s, 1.5 TB/s, 25 GB/s between ranks
    hw = Hardware.cpu(cores=2)   # a CPU rank on gloo
    seconds = fxsplit.graph.cost.estimate_time(cost, flops_per_s=hw.flops_per_s, bytes_per_s=hw.bytes_per_s)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Hardware"]


@dataclass(frozen=True)
class Hardware:
    """What the estimate of a stage's time assumes about one device and its links."""

    flops_per_s: float = 100e12  # sustained matmul throughput
    bytes_per_s: float = 1.5e12  # memory bandwidth
    link_bytes_per_s: float = 25e9  # point-to-point bandwidth between pipeline ranks

    @classmethod
    def cpu(cls, cores: int = 1) -> "Hardware":
        """A CPU rank (gloo): ~50 GFLOP/s and ~10 GB/s per core, ~5 GB/s between processes."""
        return cls(flops_per_s=50e9 * cores, bytes_per_s=10e9 * cores, link_bytes_per_s=5e9)
