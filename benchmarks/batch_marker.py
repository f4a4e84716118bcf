"""Every architecture of the TP coverage matrix traced the way a plan with no global batch traces it
([Note: a marker batch] in fxsplit.graph.batch_marker): torch.export at the marker batch, made to
take any batch. For each, how it was traced (the marker, or the batch symbolic and why), the trace
time next to the same trace with ``dynamic_batch=True`` (symbolic fake values), and the largest
output difference from the model at batches 1, 3 and 5 (the example has 2). No process group; CPU.

    .venv/bin/python benchmarks/batch_marker.py                # every arch
    .venv/bin/python benchmarks/batch_marker.py llama t5 vit
    .venv/bin/python benchmarks/batch_marker.py --moe          # every MoE family of fxsplit.testing.moe_families

Prints a markdown table (the one in benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import time

import torch

import fxsplit
from fxsplit.testing import moe_families as mf
from fxsplit.testing import tp_coverage as tc


def _at(x, b):
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != 2:
        return x
    return x.repeat(-(-b // 2), *([1] * (x.dim() - 1)))[:b]


def _out(y):
    if isinstance(y, torch.Tensor):
        return y
    for k in ("logits", "last_hidden_state", "prediction_logits", "start_logits"):
        v = getattr(y, k, None) if not isinstance(y, dict) else y.get(k)
        if isinstance(v, torch.Tensor):
            return v
    return torch.utils._pytree.tree_leaves(y)[0]


def row(arch: str, moe: bool = False) -> str:
    model, args, kwargs = mf.build(arch) if moe else tc.build(arch)
    model.eval()
    t0 = time.perf_counter()
    gm = fxsplit.trace(model, args, kwargs, dynamic_sequence=None, method="export")
    marked_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fxsplit.trace(model, args, kwargs, dynamic_sequence=None, method="export", dynamic_batch=True)
    sym_s = time.perf_counter() - t0
    reason = gm.meta["fxsplit"].reason
    if "marker batch" in reason and "cannot serve" not in reason:
        how = f"marker {reason.split('marker batch ')[1].split(',')[0]}"
    elif "cannot serve" in reason:
        how = "symbolic: " + reason.split("cannot serve: ")[1].rstrip(")")
    else:
        how = "symbolic: no marker free"
    errs = []
    with torch.no_grad():
        for b in (1, 3, 5):
            a = tuple(_at(x, b) for x in args)
            k = {n: _at(x, b) for n, x in kwargs.items()}
            want, got = _out(model(*a, **k)), _out(gm(*a, **k))
            errs.append(float((want - got).abs().max()) if want.shape == got.shape else float("nan"))
    return (f"| {arch} | {how} | {marked_s:.2f} | {sym_s:.2f} | {sym_s / marked_s:.2f}x | "
            f"{max(errs):.1e} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("archs", nargs="*")
    ap.add_argument("--moe", action="store_true", help="the MoE families instead of the TP coverage archs")
    ns = ap.parse_args()
    archs = ns.archs or list(mf.FAMILIES if ns.moe else tc.ARCHS)
    for warm in ("gpt2", "vit"):  # torch's first export of a text and of an image model pay a warm-up
        m, a, k = tc.build(warm)
        torch.export.export(m, a, k, strict=False)
    print("| arch | traced | trace s | `dynamic_batch=True` s | ratio | max error at batches 1, 3, 5 |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for arch in archs:
        try:
            print(row(arch, ns.moe), flush=True)
        except Exception as exc:  # noqa: BLE001 -- a row says what failed; the table goes on
            print(f"| {arch} | failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]} | | | | |", flush=True)


if __name__ == "__main__":
    main()
