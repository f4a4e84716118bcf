"""The units every printed plan uses: bytes in the binary family (B, KiB, MiB, GiB, TiB: powers of
1024, named as such) and times in milliseconds. One formatter each, so a split table, the memory
rows, the auto-planner's table and its errors never mix GB with MiB.

    fmt_bytes(96843.35 * 2**20) -> "94.57 GiB"      fmt_ms(0.1743) -> "174.30 ms"
"""

from __future__ import annotations

import math

__all__ = ["fmt_bytes", "fmt_ms", "UNITS"]

UNITS = "sizes in binary units (1 GiB = 2^30 bytes), times in ms"


def fmt_bytes(x: float) -> str:
    """``x`` bytes with a binary unit and two decimals ("0 B", "12.00 KiB", "94.57 GiB")."""
    if math.isinf(x):
        return "inf"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(x) < 1024:
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1024
    return f"{x:.2f} TiB"


def fmt_ms(seconds: float) -> str:
    """``seconds`` in milliseconds ("174.30 ms", "0.012 ms"; "-" for an infinite time)."""
    if math.isinf(seconds):
        return "-"
    ms = seconds * 1e3
    return f"{ms:.2f} ms" if ms >= 0.1 or ms == 0 else f"{ms:.4f} ms"
