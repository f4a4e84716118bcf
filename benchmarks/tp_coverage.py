"""The TP coverage matrix as a table: for each architecture of
``fxsplit.testing.tp_coverage.ARCHS`` (plus ``nn.TransformerEncoder`` and the timm-layout ViT
of tests/tp_layout_models.py) at t=2 (and t=4 where asked), the share of parameters the largest
rank holds next to the bound (matrices / t + norms, biases, small tables), the tp collectives per
layer (forward / backward) next to Megatron's 2 / 2, what stays replicated and why, what is
neither sharded nor reported, and whether ``fxsplit.verify`` passes (all ranks in one process,
outputs and every gradient vs the unsplit model). No process group; CPU.

    .venv/bin/python benchmarks/tp_coverage.py                 # every arch at t=2, + t=4 for a few
    .venv/bin/python benchmarks/tp_coverage.py llama bert --tp 2 4
    .venv/bin/python benchmarks/tp_coverage.py --reasons       # also every replicated module and why

Prints a markdown table (the one in benchmarks/README.md). tests/test_tp_coverage.py asserts it.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fxsplit.testing import tp_coverage as tc  # noqa: E402

T4 = ("gpt2", "gpt_neox", "bert", "vit", "timm_vit", "bloom")
EXTRA = ("torch_encoder", "timm_vit")


def build(arch):
    if arch == "timm_vit":
        from tp_layout_models import make_layout

        return make_layout("vit")
    if arch == "torch_encoder":
        return tc.transformer_encoder_lm()
    return tc.build(arch)


def _short(why: str) -> str:
    """A reason without its node names: ``mean_2 (mean): mean over ...`` -> ``mean: mean over ...``."""
    why = re.sub(r"^\S+ \((\w+)\): ", r"\1: ", why)
    return re.sub(r"\b(\w+?)_\d+\b", r"\1", why)


def _replicated(row: tc.Coverage) -> str:
    counts: dict[str, int] = {}
    for _, why in row.replicated:
        counts[_short(why)] = counts.get(_short(why), 0) + 1
    parts = [f"{n}x {why}" for why, n in counts.items()]
    if row.unreported:
        leaves = sorted({re.split(r"\.\d+\.", n)[-1] for n in row.unreported})
        parts.append(f"not seen as linears ({len(row.unreported)}): {', '.join(leaves[:4])}")
    if row.dead:
        parts.append(f"dead collective nodes (no users): {', '.join(row.dead)}")
    return "; ".join(parts) or "-"


def _verdict(row: tc.Coverage) -> str:
    if row.error is not None:
        return f"**{type(row.error).__name__}**: {str(row.error)[:160]}"
    m = re.search(r"max rel. error ([\d.e+-]+).*?gradients \(max ([\d.e+-]+)\)", row.verified)
    return f"pass (out {m.group(1)}, grad {m.group(2)})" if m else row.verified


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("archs", nargs="*", help=f"default: all ({', '.join([*tc.ARCHS, *tc.EXPERTS, *EXTRA])})")
    ap.add_argument("--tp", type=int, nargs="+", default=None, help="tp degrees (default 2, and 4 for a few)")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--reasons", action="store_true", help="print every replicated module and why")
    a = ap.parse_args()
    archs = a.archs or [*tc.ARCHS, *tc.EXPERTS, *EXTRA]
    print("| architecture | t | largest rank's share (bound) | tp collectives per layer fwd / bwd (Megatron 2 / 2) "
          "| replicated and why | verify |")
    print("|---|---|---|---|---|---|")
    t0, failures = time.perf_counter(), 0
    for arch in archs:
        for t in a.tp or ((2, 4) if arch in T4 else (2,)):
            try:
                model, args, kwargs = build(arch)
                row = tc.measure(model, args, kwargs, tp=t, pp=a.pp, arch=arch)
            except Exception as e:  # a plan that raises is a row too
                failures += 1
                print(f"| {arch} | {t} | - | - | - | **{type(e).__name__}**: {str(e)[:200]} |", flush=True)
                continue
            failures += row.error is not None
            per_layer = (f"{row.fwd_per_layer:g} / {row.bwd_per_layer:g}" if row.layers
                         else "- (no layer in the graph: a leaf module)")
            print(f"| {arch} | {t} | {row.share:.3f} ({row.bound:.3f}) | {per_layer} "
                  f"| {_replicated(row)} | {_verdict(row)} |", flush=True)
            if a.reasons:
                for path, why in row.replicated:
                    print(f"    {path}: {why}", file=sys.stderr)
    print(f"\n{len(archs)} architectures in {time.perf_counter() - t0:.0f}s; {failures} not verified", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
