"""``make gpu-check``: one prepared check of fxsplit's CUDA path, written to one report.

[Note: gpu check]
Terms: **section** -- one part of the check, run in a child process of its own with a time budget
(a section that crashes, hangs or runs out of time is recorded, and the next one still runs);
**record** -- one case's result (``status`` "pass", "fail", "error" or "skip", with what was compared);
**report** -- the JSON file of every section's records, plus the same as a text table (``.txt``
beside it), printed at the end.

    python scripts/gpu_check.py [--out gpu-check-report.json] [--quick] [--sections a,b,c,d,e]

Sections, on a CUDA device (one GPU; NCCL in a process group of one rank):
  (a) ``gpu_tests``   the ``gpu`` test tier (``pytest -m gpu`` over the test files that carry the mark);
  (b) ``parallelize`` :mod:`fxsplit.testing.gpu_cases`: interleaved 1F1B with v=2, ZB-V, compile=True,
                      mp_policy bf16, torch.autocast, fp16 with a GradScaler, activation checkpointing,
                      dropout streams, a checkpoint saved and resumed, an HF Llama traced on the CPU,
                      each against the unsplit model on the same GPU;
  (c) ``memory``      ``plan.memory()`` against the measured peak: of (b)'s and (e)'s runs, and of its
                      own at a ~130M-parameter GPT (``SIZED_CASES``: 1F1B, interleaved, ZB-V, full
                      checkpointing, mp_policy bf16), where the allocator's rounding is noise;
  (d) ``speed``       :mod:`fxsplit.testing.gpu_speed`: a 1.3B Llama in bf16, fxsplit against plain PyTorch
                      eager and torch.compile, alternated: step time, tokens/s, MFU, fxsplit's overhead;
  (e) ``multi_gpu``   tp=2, pp=2, ZB-V at pp=2, dp=2, dp_shard=2 and cp=2 on 2 GPUs over NCCL, each rank
                      against the unsplit model on its GPU; skipped, with the reason, under 2 GPUs.
Without CUDA every section runs its CPU form (gloo, the same cases on the CPU, a tiny Llama; the
CPU's memory from :class:`fxsplit.testing.memory.LiveBytes`) or says that it needs a GPU; ``--quick``
runs a small subset of each, which is what tests/test_gpu_check.py checks. The budgets add up to
under 9 minutes on one GPU (``BUDGETS``); the whole run stops at ``--total-budget`` seconds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from fxsplit.errors import RunError

__all__ = ["BUDGETS", "SECTIONS", "main"]

ROOT = Path(__file__).resolve().parents[2]  # the checkout: tests/ and scripts/ live beside fxsplit/
SECTIONS = {"a": "gpu_tests", "b": "parallelize", "c": "memory", "d": "speed", "e": "multi_gpu"}
# seconds per section: (full run on a GPU, --quick)
BUDGETS = {"gpu_tests": (75, 60), "parallelize": (150, 60), "memory": (60, 45), "speed": (240, 90),
           "multi_gpu": (150, 90)}
QUICK_CASES = ("zbv",)
QUICK_LAYOUTS = ("tp2",)
QUICK_SIZED = ("zbv",)
GRACE_S = 30.0  # of a section's budget, kept for the case running when its deadline passes
SPEED_LOSS_RTOL = 2e-2  # bf16: the first step's loss of every mode against plain eager's


# ------------------------------------------------------------------------------------------------
# child side: one section, each record written as a JSON line as soon as it exists


def _emit(lines: Path, record: dict) -> None:
    with open(lines, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")


def _gpu_tests(lines: Path, deadline: float) -> None:
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                   if "mark.gpu" in p.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={xml}", *files]
        # pytest is one long case: it may use the grace too (the parent kills this process after it)
        left = deadline + GRACE_S - 5 - time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(1.0, left))
        if not xml.exists():
            raise RunError(f"gpu-check (a): pytest wrote no JUnit report (exit code {proc.returncode}), so no test ran; "
                           f"its output ends: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        for case in ET.parse(xml).getroot().iter("testcase"):
            record = {"name": f"{case.get('classname')}::{case.get('name')}", "seconds": float(case.get("time", 0))}
            outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
            if outcome is None:
                record["status"] = "pass"
            else:
                record["status"] = {"failure": "fail", "error": "error", "skipped": "skip"}[outcome.tag]
                text = outcome.get("message") or outcome.text or ""
                record["reason" if outcome.tag == "skipped" else "error"] = text[:4000]
            _emit(lines, record)


def _parallelize(lines: Path, deadline: float, device: Any, quick: bool) -> None:
    from fxsplit.testing.gpu_cases import CASES, run_case, world_of_one

    with world_of_one(device):
        for name in (QUICK_CASES if quick else CASES):
            if time.monotonic() > deadline:
                _emit(lines, {"name": name, "status": "skip", "reason": "the section's budget ran out"})
                continue
            _emit(lines, run_case(name, device))


def _memory(lines: Path, deadline: float, device: Any, quick: bool) -> None:
    from fxsplit.testing.gpu_cases import SIZED_CASES, SIZED_GPT, SIZED_SMALL, run_sized, world_of_one

    with world_of_one(device):
        for name in (QUICK_SIZED if quick else SIZED_CASES):
            if time.monotonic() > deadline:
                _emit(lines, {"name": f"sized_{name}", "status": "skip", "reason": "the section's budget ran out"})
                continue
            _emit(lines, run_sized(name, device, SIZED_GPT if device.type == "cuda" else SIZED_SMALL))


def _speed(lines: Path, deadline: float, device: Any, quick: bool) -> None:
    from fxsplit.testing.gpu_cases import world_of_one
    from fxsplit.testing.gpu_speed import measure

    def result(record: dict) -> None:
        # fail: a mode that could not run, or one whose first loss is not plain PyTorch's (other work)
        bad = [m for m, why in record["skipped"].items() if why.startswith("failed")] + [
            m for m, row in record["modes"].items() if row.get("loss_gap", 0.0) > SPEED_LOSS_RTOL]
        _emit(lines, {"name": "speed", "status": "fail" if bad else "pass", "failed_modes": bad, **record})

    with world_of_one(device):
        measure(device, quick=quick, deadline=deadline, on_result=result)


def _multi_gpu(lines: Path, deadline: float, device: Any, quick: bool, ranks_on_cpu: bool) -> None:
    from fxsplit.testing import run_distributed
    from fxsplit.testing.gpu_cases import LAYOUTS, run_layout

    backend = "gloo" if ranks_on_cpu else "nccl"
    for name in (QUICK_LAYOUTS if quick else LAYOUTS):
        left = deadline - time.monotonic()
        if left < 10:
            _emit(lines, {"name": name, "status": "skip", "reason": "the section's budget ran out"})
            continue
        start = time.perf_counter()
        try:
            ranks = run_distributed(run_layout, 2, name, backend=backend, timeout=left)
        except Exception as exc:  # noqa: BLE001 -- the launch failed: one record says why
            _emit(lines, {"name": name, "status": "error", "error": f"{type(exc).__name__}: {exc}"[:6000]})
            continue
        worst = "pass" if all(r["status"] == "pass" for r in ranks) else (
            "error" if any(r["status"] == "error" for r in ranks) else "fail")
        _emit(lines, {"name": name, "status": worst, "what": ranks[0]["what"], "ranks": ranks,
                      "seconds": time.perf_counter() - start, "backend": backend})


def _child(args: argparse.Namespace) -> int:
    import torch

    device = torch.device(args.device)
    deadline = time.monotonic() + args.budget
    lines = Path(args.lines)
    try:
        if args.section == "gpu_tests":
            _gpu_tests(lines, deadline)
        elif args.section == "parallelize":
            _parallelize(lines, deadline, device, args.quick)
        elif args.section == "memory":
            _memory(lines, deadline, device, args.quick)
        elif args.section == "speed":
            _speed(lines, deadline, device, args.quick)
        elif args.section == "multi_gpu":
            _multi_gpu(lines, deadline, device, args.quick, args.ranks_on_cpu)
    except Exception as exc:  # noqa: BLE001 -- recorded; the parent goes on with the next section
        import traceback

        _emit(lines, {"name": f"{args.section} (section)", "status": "error",
                      "error": f"{type(exc).__name__}: {exc}"[:4000], "traceback": traceback.format_exc()[-6000:]})
        return 1
    return 0


# ------------------------------------------------------------------------------------------------
# parent side: the sections in turn, then the report


def _environment() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    try:  # a copied tree may have no .git, a bare machine no git
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "gpus": torch.cuda.device_count() if cuda else 0,
            "gpu": torch.cuda.get_device_name(0) if cuda else None, "commit": commit or None}


def _run_child(section: str, budget: float, device: str, quick: bool, ranks_on_cpu: bool) -> dict:
    """Run one section in a child process for at most ``budget`` seconds; its records and status."""
    with tempfile.TemporaryDirectory() as tmp:
        lines = Path(tmp) / "records.jsonl"
        lines.touch()
        # the child starts no case past budget - GRACE_S (it checks between cases); past the whole
        # budget it is killed mid-case, so a section never outlasts its budget
        cmd = [sys.executable, "-m", "fxsplit.testing.gpu_check", "--section", section, "--lines", str(lines),
               "--device", device, "--budget", str(max(1.0, budget - GRACE_S))] + (["--quick"] if quick else []) + (
               ["--ranks-on-cpu"] if ranks_on_cpu else [])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               "PYTHONUNBUFFERED": "1"}
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=budget)
            code, out, timed_out = proc.returncode, proc.stdout + proc.stderr, False
        except subprocess.TimeoutExpired as exc:
            out, code, timed_out = _text(exc.stdout) + _text(exc.stderr), None, True
        records = [json.loads(line) for line in lines.read_text().splitlines() if line.strip()]
    result = {"seconds": time.perf_counter() - start, "budget": budget, "exit_code": code, "records": records}
    if timed_out:
        result["error"] = f"killed at its budget of {budget:g} s inside a case; the records before it are kept"
    if code != 0:
        result["log_tail"] = out[-4000:]
    return result


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def _status(section: dict) -> str:
    records = section.get("records", [])
    if "error" in section or any(r["status"] in ("fail", "error") for r in records):
        return "FAIL"
    if records and all(r["status"] == "skip" for r in records):
        return "needs a GPU" if all("CUDA" in r.get("reason", "") for r in records) else "skip"
    if section.get("skip"):
        return "skip"
    return "pass" if records else "FAIL"


def _memory_view(sections: dict) -> dict:
    """(c): the memory figures of its own runs, of (b)'s and of every rank of (e)'s."""
    own = sections.get("memory", {})
    rows = [r for r in own.get("records", []) if not r.get("memory")]  # skips and errors stay as they are
    rows += [{"name": r["name"], "status": r["status"], **r["memory"]} for r in own.get("records", []) if r.get("memory")]
    rows += [{"name": r["name"], **r["memory"]} for r in sections.get("parallelize", {}).get("records", [])
            if r.get("memory")]
    rows += [{"name": f"{r['name']} rank {rank['rank']}", **rank["memory"]}
             for r in sections.get("multi_gpu", {}).get("records", []) for rank in r.get("ranks", []) if rank.get("memory")]
    return {**{k: v for k, v in own.items() if k != "records"}, "records": [{"status": "pass", **row} for row in rows],
            "note": "sized_* rows: (c)'s own runs; the others from the runs of (b) and (e): predicted = plan.memory(optimizer_bytes_per_param=0).peak; "
                    "measured = this rank's parameters + the step's peak above what was allocated before it"}


def run(*, sections: str = "abcde", quick: bool = False, total_budget: float = 540.0,
        ranks_on_cpu: bool = False) -> dict:
    """Every section named in ``sections`` (letters of ``SECTIONS``), in order; the report dict."""
    import torch

    env = _environment()
    device = "cuda:0" if torch.cuda.is_available() else "cpu"  # an index: torch 2.11's set_device needs one
    report: dict = {"environment": env, "device": device, "quick": quick, "sections": {}}
    end = time.monotonic() + total_budget
    for letter in sections:
        name = SECTIONS[letter]
        if name == "multi_gpu" and env["gpus"] < 2 and not ranks_on_cpu:
            report["sections"][name] = {"skip": f"needs 2 CUDA devices for NCCL (found {env['gpus']}); "
                                                "--ranks-on-cpu runs its layouts over gloo on the CPU", "records": []}
            continue
        budget = min(BUDGETS[name][1 if quick else 0], end - time.monotonic())
        if budget < 5:
            report["sections"][name] = {"skip": "the whole check's budget ran out", "records": []}
            continue
        report["sections"][name] = _run_child(name, budget, device, quick, ranks_on_cpu)
    if "memory" in report["sections"]:
        report["sections"]["memory"] = _memory_view(report["sections"])
    for section in report["sections"].values():
        section["status"] = _status(section)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu-check-report.json", help="the JSON report; the text table goes beside it (.txt)")
    parser.add_argument("--quick", action="store_true", help="a small subset of every section (the CPU test's mode)")
    parser.add_argument("--sections", default="abcde", help="letters of the sections to run (default: abcde)")
    parser.add_argument("--total-budget", type=float, default=540.0, help="seconds for the whole check (default 540)")
    parser.add_argument("--ranks-on-cpu", action="store_true", help="run (e)'s layouts over gloo on the CPU")
    parser.add_argument("--section", help=argparse.SUPPRESS)  # child side
    parser.add_argument("--lines", help=argparse.SUPPRESS)
    parser.add_argument("--device", help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.section:
        return _child(args)
    bad = sorted(set(args.sections) - set(SECTIONS))
    if bad:
        parser.error(f"--sections: unknown letter(s) {bad}; choose from {''.join(SECTIONS)}")
    from fxsplit.testing.gpu_report import render

    report = run(sections=args.sections, quick=args.quick, total_budget=args.total_budget,
                 ranks_on_cpu=args.ranks_on_cpu)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    text = render(report)
    out.with_suffix(".txt").write_text(text + "\n")
    print(text)
    print(f"\nreport: {out} (and {out.with_suffix('.txt')})")
    return 0 if all(s["status"] != "FAIL" for s in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
