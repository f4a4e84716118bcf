"""The text form of a ``make gpu-check`` report ([Note: gpu check] in :mod:`fxsplit.testing.gpu_check`):
one header line (machine, torch, commit), then each section's status, time against its budget and
its records as rows.

    print(render(json.load(open("gpu-check-report.json"))))
"""

from __future__ import annotations

from typing import Any

__all__ = ["render"]

_TITLES = {"gpu_tests": "(a) gpu test tier", "parallelize": "(b) parallelize, one rank", "memory": "(c) memory",
           "speed": "(d) speed, bf16 Llama", "multi_gpu": "(e) 2+ GPUs over NCCL"}


def _num(x: Any, fmt: str = ".3g") -> str:
    return "-" if x is None else format(x, fmt)


def _checks(record: dict) -> str:
    parts = []
    for c in record.get("checks", []):
        if c.get("gap") is None:
            parts.append(f"{c['what']}: {'ok' if c['ok'] else 'NO'}")
        else:
            parts.append(f"{c['what']} {c['gap']:.2g}{'<=' if c['ok'] else ' > '}{c['tol']:.0e}")
    return "; ".join(parts)


def _case_lines(records: list[dict]) -> list[str]:
    lines = []
    for r in records:
        head = f"    {r['status']:<5} {r['name']:<44} {_num(r.get('seconds'), '6.1f')} s"
        text = r.get("reason") or _checks(r) or ""
        if r["status"] == "error":
            text = r.get("error", "")
        if r.get("backend"):
            text = f"over {r['backend']}"
        lines.append(f"{head}  {text}"[:400])
        for rank in r.get("ranks", []):
            lines.append(f"          rank {rank['rank']}: {rank['status']} {rank.get('error') or _checks(rank)}"[:400])
    return lines


def _memory_lines(records: list[dict]) -> list[str]:
    lines = ["    case                   pp rank  predicted MiB  measured MiB  measured/predicted  how"]
    for r in records:
        if "measured_bytes" not in r:  # a sized run that was skipped or failed: say why
            lines.append(f"    {r['name']:<22} {r['status']}: {r.get('reason') or r.get('error', '')}"[:400])
            continue
        lines.append(f"    {r['name']:<22} {r['pp_rank']:>7}  {r['predicted_bytes'] / 2**20:>13.2f}  "
                     f"{r['measured_bytes'] / 2**20:>12.2f}  {_num(r.get('ratio'), '>18.3f')}  {r['how']}")
    return lines


def _speed_lines(records: list[dict]) -> list[str]:
    if not records:
        return []
    r = records[-1]  # the last pass holds every mode measured
    m = r.get("model", {})
    lines = [f"    Llama {m.get('parameters', 0) / 1e9:.2f}B (hidden {m.get('hidden_size')}, {m.get('num_hidden_layers')} "
             f"layers), batch {m.get('batch')} x seq {m.get('seq')}, bf16 on {r.get('device')}; peak "
             f"{_num(r.get('peak_bf16_flops'), '.3g')} FLOP/s; {r.get('flops_per_step', 0):.3g} FLOPs per step",
             "    mode              step ms   tokens/s     MFU  overhead  set-up s  loss gap"]
    for mode, row in r.get("modes", {}).items():
        mfu = row.get("mfu")
        over = row.get("overhead")
        lines.append(f"    {mode:<16} {_num(row.get('step_seconds') and row['step_seconds'] * 1e3, '8.2f')} "
                     f"{_num(row.get('tokens_per_s'), '10.0f')} {'-' if mfu is None else f'{100 * mfu:6.1f}%'} "
                     f"{'-' if over is None else f'{100 * over:+8.2f}%'} {_num(row.get('setup_seconds'), '9.1f')} "
                     f"{_num(row.get('loss_gap'), '9.1e')}")
    for mode, why in r.get("skipped", {}).items():
        lines.append(f"    {mode:<16} not run: {why}"[:400])
    return lines


def render(report: dict) -> str:
    env = report["environment"]
    gpu = f"{env['gpus']} x {env['gpu']}" if env.get("gpus") else "no CUDA device (CPU forms)"
    lines = [f"fxsplit gpu-check {env['date']} on {env['host']}: {gpu}; torch {env['torch']} (CUDA {env['cuda']}), "
             f"python {env['python']}, commit {env['commit']}{'  [--quick]' if report.get('quick') else ''}"]
    for name, section in report["sections"].items():
        timing = f"{section.get('seconds', 0):.0f}/{section.get('budget', 0):.0f} s" if section.get("budget") else ""
        lines.append(f"{_TITLES.get(name, name):<28} {section['status']:<12} {timing}")
        for key in ("skip", "error", "note"):
            if section.get(key):
                lines.append(f"    {key}: {section[key]}")
        records = section.get("records", [])
        if name == "memory":
            lines += _memory_lines(records)
        elif name == "speed":
            lines += _speed_lines(records)
        else:
            lines += _case_lines(records)
        if section.get("log_tail") and section["status"] == "FAIL":
            lines.append("    log tail: " + section["log_tail"][-1500:].replace("\n", "\n    | "))
    return "\n".join(lines)
