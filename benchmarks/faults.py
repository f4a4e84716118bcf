"""Faults: kill, stop or break one rank in the middle of training and measure how the job ends.

    python benchmarks/faults.py                      # the whole matrix, timeout 10 s
    python benchmarks/faults.py --cases tp2pp2-raise-loss,pp4-kill-F --timeout 6

The cases and the launcher are in :mod:`fxsplit.testing.faults`. Per case it prints the seconds
from the fault to the last survivor's exit, the survivors' exit codes, and whether every
survivor's error names the fault rank ("global rank N "); the goal is every case <= 2 x timeout
with every survivor naming it ([Note: failure protocol] in fxsplit.runtime.watch).
"""

from __future__ import annotations

import argparse
import json
import sys

from fxsplit.testing.faults import cases, run_case


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(cases()), help="comma-separated; default: the whole matrix")
    p.add_argument("--timeout", type=float, default=10.0, help="parallelize(timeout=...) in seconds")
    p.add_argument("--json", help="also write the rows as JSON to this file")
    args = p.parse_args(argv)
    rows = []
    print(f"timeout {args.timeout:g} s; goal: every case ends <= {2 * args.timeout:g} s after the fault, "
          "every survivor naming the fault rank and exiting with code 1 (its error, then a normal exit)")
    print(f"{'case':<22} {'fault->last exit':>16} {'exit codes':<12} {'named':<6} survivors raised")
    for case in args.cases.split(","):
        row = run_case(case, args.timeout)
        rows.append(row)
        secs = "HUNG " + str(row["hung"]) if row["hung"] else (
            f"{row['seconds']:.1f} s" if row["seconds"] is not None else "no fault")
        print(f"{case:<22} {secs:>16} {str(row['exit_codes']):<12} {str(row['named']):<6} {', '.join(row['kinds'])}",
              flush=True)
    ok = all(r["seconds"] is not None and r["seconds"] <= 2 * args.timeout and r["named"] and not r["hung"]
             and all(code == 1 for code in r["exit_codes"]) for r in rows)  # raised, then exited normally
    print("all cases met the goal" if ok else "SOME CASES MISSED THE GOAL")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
