"""Expert parallelism over every mixture-of-experts family transformers ships, in every layout of
issue 29: each family of ``fxsplit.testing.moe_families`` (tiny config, batch 4 x 16) is traced
once and planned in each layout from that one trace (``fxsplit.testing.trace_cache.shared_traces``;
stderr gives the traces made per family: 1, unless a trace fails and each layout tries again),
then ``fxsplit.verify`` runs the plan in this process (every ep / tp rank in lockstep, the
all-to-all and the tp collectives emulated, each ep rank on its own slice of the batch) against the
unsplit model: the loss and every parameter gradient. No process group; CPU.

Terms:
    layout: the options given to ``fxsplit.plan`` (``LAYOUTS``); the names read dp / ep / pp / tp /
        ds (dp_shard) degrees.
    exact: ``verify`` passes; the cell shows the worst relative gradient error.
    kept: the plan keeps one or more MoE layers as traced (``plan.ep_plan.skipped``: no token
        exchange, the experts replicated over the ep ranks) and ``verify`` passes; the cell shows
        the reason the plan gives.
    fails: ``plan`` or ``verify`` raises (the cell shows the exception's first line), or the plan
        finds no MoE layer at all (none placed, none kept).

    .venv/bin/python benchmarks/moe_coverage.py                         # every family but moe_families.SLOW
    .venv/bin/python benchmarks/moe_coverage.py --families mixtral,olmoe --layouts dp2-ep2,dp2-ep2-pp2
    .venv/bin/python benchmarks/moe_coverage.py --include-slow          # also the Mamba / linear-attention hybrids

``ds2-ep2`` (``dp_shard=2, ep=2``): ``verify`` does not emulate FSDP's gather / reduce-scatter;
numerically the sharded data-parallel ranks are data-parallel ranks (each parameter whole when it
is used, its gradient summed over the ranks), so this checks that the plan for that mesh (the ep
groups drawn from the dp_shard ranks) places and exchanges as dp=2 x ep=2 does. The FSDP
collectives themselves are tested with gloo ranks (tests/test_expert_parallel.py, ``moe/ds2-ep2``).

``dp2-ep2-pp2``: the partitioner picks the split (most families have one decoder layer: the cut
falls between the embedding / attention and the MoE block, or after it); ``verify`` runs the two
stages in order on the whole example (no microbatches: numerically the same step).

Prints a markdown table (the one in benchmarks/README.md, "MoE families x layouts") and, on
stderr, each family's seconds. tests/test_expert_parallel_families.py checks the four layouts
beyond dp2-ep2 on four families of different forms.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import warnings

import fxsplit
from fxsplit.testing import moe_families
from fxsplit.testing.trace_cache import SharedTraces, shared_traces

LAYOUTS: dict[str, dict] = {
    "dp2-ep2": dict(dp=2, ep=2),
    "dp2-ep2-pp2": dict(dp=2, ep=2, pp=2, microbatches=2, schedule="1f1b"),
    "dp4-ep4": dict(dp=4, ep=4),
    "dp2-ep2-tp2": dict(dp=2, ep=2, tp=2),
    "ds2-ep2": dict(dp_shard=2, ep=2),
}
BATCH = 4  # splits into ep=4 slices
HARDWARE = fxsplit.Hardware(link_bytes_per_s=float("inf"))
warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)  # torch's pytree, once per copy


def first_line(e: BaseException) -> str:
    """The exception's type and the first line of its last paragraph (a TraceError's last one is
    torch.export's reason, after fx's)."""
    last = re.sub(r"\S*/site-packages/", "", str(e).strip().split("\n\n")[-1])
    return f"{type(e).__name__}: {(last.splitlines() or [''])[0][:240]}"


def cell(model, args, kwargs, options: dict) -> tuple[str, str]:
    """(verdict, text) of one family in one layout: verdict is "exact", "kept" or "fails"."""
    try:
        plan = fxsplit.plan(model, args, kwargs, hardware=HARDWARE, **options)
    except Exception as e:  # a plan that raises is a cell too
        return "fails", f"plan: {first_line(e)}"
    kept = sorted({why for _, why in plan.ep_plan.skipped})
    placed = len(plan.ep_plan.layers)
    try:
        report = fxsplit.verify(model, args, plan, kwargs, quiet=True)
    except Exception as e:
        return "fails", f"verify: {first_line(e)}" + (f" (kept: {'; '.join(kept)})" if kept else "")
    err = f"{report.max_gradient_error:.1e}"
    if not placed and not kept:  # ep did nothing and said nothing: counted as a failure
        return "fails", f"no MoE layer found (0 placed, none kept); verify {err}"
    if kept:
        return "kept", f"kept ({placed} placed): {'; '.join(kept)}; verify {err}"
    return "exact", f"exact, {placed} placed ({err})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=None,
                    help="comma list (default: every family of moe_families.FAMILIES but SLOW)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {', '.join(LAYOUTS)}")
    ap.add_argument("--include-slow", action="store_true",
                    help=f"also {', '.join(moe_families.SLOW)} (30 s to minutes each on CPU)")
    a = ap.parse_args(argv)
    families = (a.families.split(",") if a.families else
                [f for f in moe_families.FAMILIES if a.include_slow or f not in moe_families.SLOW])
    layouts = a.layouts.split(",")
    for name, known in [*((f, moe_families.FAMILIES) for f in families), *((x, LAYOUTS) for x in layouts)]:
        if name not in known:
            ap.error(f"unknown name {name!r}: choose from {', '.join(known)}")
    print("| family | " + " | ".join(layouts) + " |")
    print("|---" * (len(layouts) + 1) + "|")
    counts = {layout: {"exact": 0, "kept": 0, "fails": 0} for layout in layouts}
    t0 = time.perf_counter()
    for family in families:
        t1 = time.perf_counter()
        try:
            model, args, kwargs = moe_families.build(family, batch=BATCH)
        except Exception as e:
            print(f"| {family} | " + " | ".join([f"build: {first_line(e)}"] * len(layouts)) + " |", flush=True)
            for layout in layouts:
                counts[layout]["fails"] += 1
            continue
        model.eval()  # dropout is 0 everywhere; phimoe's sparsemixer router draws random numbers in training mode
        cells = []
        with shared_traces(SharedTraces()) as cache:
            for layout in layouts:
                verdict, text = cell(model, args, kwargs, LAYOUTS[layout])
                counts[layout][verdict] += 1
                cells.append(text.replace("|", "/"))
        print(f"| {family} | " + " | ".join(cells) + " |", flush=True)
        print(f"{family}: {time.perf_counter() - t1:.1f}s, {cache.misses} trace(s)", file=sys.stderr, flush=True)
    print()
    for layout in layouts:
        c = counts[layout]
        print(f"{layout}: {c['exact']} exact, {c['kept']} kept, {c['fails']} fail")
    print(f"\n{len(families)} families in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
