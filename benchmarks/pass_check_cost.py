"""The PassManager's metadata check on a Llama-70B plan (meta device, tp=8 x pp=8): the seconds it
spends (snapshot before each pass, check after it) as a share of the same ``fxsplit.plan`` call,
built-in passes included ([Note: cached fake values] in fxsplit.graph.pass_check).

    .venv/bin/python benchmarks/pass_check_cost.py              # 80 layers (~2-6 min)
    .venv/bin/python benchmarks/pass_check_cost.py --layers 8

The share is measured inside one call, so it holds on a loaded machine better than two plan times
compared; the plan's own time is printed beside it.
"""

from __future__ import annotations

import argparse
import functools
import gc
import time

import fxsplit
from fxsplit.graph import pass_api, pass_check
from fxsplit.testing import hf_zoo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=80)
    layers = ap.parse_args().layers
    spent = {"snapshot": 0.0, "check": 0.0}

    def timed(fn, key):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t0
        return wrapper

    pass_api.take_snapshot = timed(pass_check.take_snapshot, "snapshot")
    pass_api.check_after = timed(pass_check.check_after, "check")
    model, args, kwargs = hf_zoo.meta_llama_70b(seq_len=4096, num_hidden_layers=layers)
    gc.collect()
    t0 = time.perf_counter()
    p = fxsplit.plan(model, args, kwargs, tp=8, pp=8, schedule="1f1b", microbatches=16, global_batch_size=16,
                     hardware=fxsplit.Hardware.preset("a100-80gb"))
    plan_s = time.perf_counter() - t0
    check_s = spent["snapshot"] + spent["check"]
    print(f"Llama-70B config, {layers} layers, tp=8 x pp=8 ({len(p.graph.graph.nodes)} nodes): plan {plan_s:.1f} s, "
          f"metadata check {check_s:.2f} s (snapshots {spent['snapshot']:.2f} s) = {100 * check_s / plan_s:.1f}% "
          "of the plan")


if __name__ == "__main__":
    main()
