"""fp32 CPU matmuls: aten's (MKL in torch's CPU wheel) against ``fxsplit::onednn_mm`` (oneDNN)
on the F, I and W products of benchmarks/pipeline_vs_ptd.py's GPT ([Note: CPU matmuls through
oneDNN] in fxsplit/runtime/compile/cpu_matmul.py).

    .venv/bin/python benchmarks/cpu_matmul.py                 # one thread, 256-token microbatch
    .venv/bin/python benchmarks/cpu_matmul.py --threads 2 --tokens 512
    MKL_VERBOSE=1 .venv/bin/python benchmarks/cpu_matmul.py --reps 1 2>&1 | grep -m1 MKL_VERBOSE
    .venv/bin/python benchmarks/cpu_matmul.py --small          # small products: oneDNN's fixed cost

Method: for each linear of the GPT (width 256: q/k/v 256 -> 768, proj 256 -> 256, MLP up
256 -> 1024, down 1024 -> 256, head 256 -> 4096) and each of its products -- F ``x @ w.T``, I
``dy @ w``, W ``dy.T @ x`` (a transposed view, as the W graph has it) -- both kernels on the same
tensors, alternating, ``--reps`` timed calls each after two warmup calls; medians in ms, and the
largest difference relative to the largest entry of aten's result. Last: fxsplit's one-shape
probe, and what ``FXSPLIT_CPU_MATMUL=auto`` chooses here (a fact of the host, not a timing).
``--small``: square-ish products from 16 x 16 x 16 to 256 x 256 x 256 instead (in microseconds),
where oneDNN's own cost per call shows: what ``MIN_MACS`` (the smallest product ``auto`` routes)
is set from.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fxsplit.runtime.compile import cpu_matmul

SHAPES = {"qkv": (256, 768), "proj": (256, 256), "up": (256, 1024), "down": (1024, 256), "head": (256, 4096)}


def _time(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=256, help="rows of a microbatch (2 x 128 in pipeline_vs_ptd)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--small", action="store_true", help="small (m, k, n), in microseconds")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.small:
        return small(a.reps * 10)
    g = torch.Generator().manual_seed(0)
    print(f"{a.threads} thread(s), {a.tokens} tokens; ms per call, medians of {a.reps}")
    print(f"{'linear':<6} {'product':<7} {'aten':>7} {'oneDNN':>7} {'oneDNN/aten':>11} {'max rel diff':>12}")
    ratios = []
    for name, (din, dout) in SHAPES.items():
        x = torch.randn(a.tokens, din, generator=g)
        w = torch.randn(dout, din, generator=g) * din ** -0.5
        dy = torch.randn(a.tokens, dout, generator=g)
        for product, (p, q) in {"F": (x, w.t()), "I": (dy, w), "W": (dy.t(), x)}.items():
            ref = torch.mm(p, q)
            got = cpu_matmul.onednn_mm(p, q)
            rel = float((got - ref).abs().max() / ref.abs().max())
            for _ in range(2):
                torch.mm(p, q), cpu_matmul.onednn_mm(p, q)
            t_aten, t_dnn = [], []
            for _ in range(a.reps):  # alternate: the machine's speed drifts
                t_aten += _time(lambda: torch.mm(p, q), 1)
                t_dnn += _time(lambda: cpu_matmul.onednn_mm(p, q), 1)
            ma, md = statistics.median(t_aten), statistics.median(t_dnn)
            ratios.append(md / ma)
            print(f"{name:<6} {product:<7} {ma:7.3f} {md:7.3f} {md / ma:11.3f} {rel:12.1e}")
    print(f"oneDNN/aten: {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} products")
    faster, measured = cpu_matmul.probe()
    print(f"fxsplit's probe: {measured} (oneDNN <= 0.8x aten: {faster}); FXSPLIT_CPU_MATMUL=auto chooses "
          f"{'oneDNN' if cpu_matmul.mkl_on_non_intel_x86() else 'aten'} (MKL on a non-Intel x86-64: "
          f"{cpu_matmul.mkl_on_non_intel_x86()})")


def small(reps: int) -> None:
    print(f"microseconds per call, medians of {reps}; MIN_MACS = {cpu_matmul.MIN_MACS}")
    print(f"{'m x k x n':<16} {'macs':>9} {'aten':>7} {'oneDNN':>7} {'oneDNN/aten':>11}")
    for m, k, n in [(16, 16, 16), (32, 64, 64), (64, 64, 64), (64, 128, 128), (128, 128, 128), (128, 256, 256),
                    (256, 256, 256)]:
        x, y = torch.randn(m, k), torch.randn(k, n)
        for _ in range(10):
            torch.mm(x, y), cpu_matmul.onednn_mm(x, y)
        t_aten, t_dnn = [], []
        for _ in range(reps):
            t_aten += _time(lambda: torch.mm(x, y), 1)
            t_dnn += _time(lambda: cpu_matmul.onednn_mm(x, y), 1)
        ma, md = statistics.median(t_aten) * 1e3, statistics.median(t_dnn) * 1e3
        print(f"{f'{m} x {k} x {n}':<16} {m * k * n:9d} {ma:7.1f} {md:7.1f} {md / ma:11.2f}")


if __name__ == "__main__":
    main()
