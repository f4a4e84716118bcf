"""Plans that read: ``print(plan)`` on one screen for any model ([Note: a plan on one screen]).

[Note: a plan on one screen]
``str(plan)`` is at most ``MAX_LINES`` (60) lines whatever the model's depth or the layout: the
tensor-parallel plan folds layers with the same sharding into one row (``model.layers.0-79:
q/k/v colwise, o rowwise, gate/up colwise, down rowwise``), the stage table keeps its first and
last rows past ``STAGE_ROWS`` stages, and the memory rows fold pipeline ranks with equal figures.
The full tables are ``plan.tp_table()``, ``plan.stage_table()`` and ``plan.memory()``. One unit
family throughout (``fxsplit.graph.units``: binary sizes, milliseconds), and the first line names
the hardware every time in it assumes (``Hardware()``'s "generic" when none was given).

    lines = plan_lines(plan)          # what Plan.__str__ joins
    tp_summary(plan.tp_plan)          # the folded TP rows
"""

from __future__ import annotations

import re
from typing import Any

from fxsplit.api.padding import sequence_summary
from fxsplit.graph.units import UNITS, fmt_bytes, fmt_ms

__all__ = ["MAX_LINES", "STAGE_ROWS", "fold_layers", "memory_summary", "plan_lines", "stage_summary", "tp_summary"]

MAX_LINES = 60
STAGE_ROWS = 16  # stage rows printed in full; past this the first and last few
MEMORY_ROWS = 8  # memory rows (after folding equal ranks) printed; past this the busiest
_LAYER = re.compile(r"^(.*?)\.(\d+)\.(.+)$")


def _short(name: str) -> str:
    leaf = name.rsplit(".", 1)[-1]
    return leaf[:-5] if leaf.endswith("_proj") else leaf


def _describe(items: list[tuple[str, str]]) -> str:
    """``[("q_proj", "colwise"), ("k_proj", "colwise"), ("o_proj", "rowwise")]`` -> "q/k colwise, o rowwise"."""
    runs: list[tuple[list[str], str]] = []
    for name, style in items:
        short = _short(name)
        if runs and runs[-1][1] == style:
            if short not in runs[-1][0]:
                runs[-1][0].append(short)
        else:
            runs.append(([short], style))
    return ", ".join(f"{'/'.join(names)} {style}" for names, style in runs)


def fold_layers(rows: dict[str, str]) -> list[str]:
    """``{module path: style}`` folded: paths under a numbered container (``model.layers.7.mlp``)
    grouped per layer, consecutive layers with the same description in one row, the rest by style."""
    layers: dict[str, dict[int, list[tuple[str, str]]]] = {}
    other: dict[str, list[str]] = {}
    for path, style in rows.items():
        m = _LAYER.match(path)
        if m:
            layers.setdefault(m[1], {}).setdefault(int(m[2]), []).append((m[3], style))
        else:
            other.setdefault(style, []).append(path)
    out = []
    for prefix, per in layers.items():
        idx = sorted(per)
        start = prev = idx[0]
        desc = _describe(per[start])
        for i in idx[1:] + [None]:
            d = _describe(per[i]) if i is not None else None
            if i is not None and i == prev + 1 and d == desc:
                prev = i
                continue
            out.append(f"{prefix}.{start}" + (f"-{prev}" if prev != start else "") + f": {desc}")
            if i is not None:
                start = prev = i
                desc = d
    out += [f"{style}: {', '.join(paths)}" for style, paths in other.items()]
    return out


def tp_summary(tp_plan: Any) -> list[str]:
    """The TP plan in folded rows (the full table is ``str(tp_plan)``, ``Plan.tp_table()``)."""
    if tp_plan.is_identity:
        return []
    head = (f"tensor parallel t={tp_plan.tp}: {len(tp_plan.styles)} modules in {len(tp_plan.regions)} regions"
            + (", sequence parallel" if tp_plan.sequence_parallel else "")
            + (", vocabulary-parallel loss" if tp_plan.vocab_parallel_loss else "")
            + "; plan.tp_table() lists each with its shards")
    lines = [head] + [f"  {row}" for row in fold_layers(dict(tp_plan.styles))]
    if tp_plan.replicated:
        lines.append(f"  {len(tp_plan.replicated)} linear/embedding modules left whole (plan.tp_table() says why)")
    return lines


def stage_summary(split: Any, max_rows: int = STAGE_ROWS) -> list[str]:
    """The split's table, its first and last rows only past ``max_rows`` stages."""
    lines = str(split).splitlines()
    S = split.num_stages
    if S <= max_rows:
        return lines
    head, rows, tail = lines[:2], lines[2:2 + S], lines[2 + S:]
    keep = max_rows // 2
    return head + rows[:keep] + [f"  ... {S - 2 * keep + 1} more stages (plan.stage_table() lists every one)"] \
        + rows[S - keep + 1:] + tail


def memory_summary(rows: list, dp_shard: int, max_rows: int = MEMORY_ROWS) -> list[str]:
    """One line per pipeline rank of ``Plan.memory()``, equal consecutive ranks folded."""
    def body(m: Any) -> str:
        extra = f", gathered {fmt_bytes(m.gathered)}" if m.gathered else ""
        extra += f", whole gradients {fmt_bytes(m.whole_grads)}"
        extra += f", buckets {fmt_bytes(m.buckets)}" if m.buckets else ""
        extra += f", loss gradients {fmt_bytes(m.backward)}" if m.backward else ""
        return (f"params {fmt_bytes(m.params)}, grads {fmt_bytes(m.grads)}, optimizer {fmt_bytes(m.optimizer)}, "
                f"activations {fmt_bytes(m.activations)}{extra}; peak {fmt_bytes(m.peak)}")

    groups: list[list] = []
    for m in rows:
        text = body(m)
        if groups and groups[-1][1] == text:
            groups[-1][0].append(m.pp_rank)
        else:
            groups.append([[m.pp_rank], text])
    lines = [f"expected memory per rank (Adam; Plan.memory(), [Note: memory model] in fxsplit.pipeline.memory"
             f"{f'; dp_shard={dp_shard}' if dp_shard > 1 else ''}):"]
    for ranks, text in groups[:max_rows]:
        who = f"pp rank {ranks[0]}" if len(ranks) == 1 else f"pp ranks {ranks[0]}-{ranks[-1]}"
        lines.append(f"  {who}: {text}")
    if len(groups) > max_rows:
        top = max(rows, key=lambda m: m.peak)
        lines.append(f"  ... {len(groups) - max_rows} more rows (plan.memory() has every rank); the busiest is "
                     f"pp rank {top.pp_rank}, peak {fmt_bytes(top.peak)}")
    return lines


def plan_lines(plan: Any) -> list[str]:
    """``str(plan)``'s lines ([Note: a plan on one screen])."""
    c = plan.config
    hw = c.hardware.name if c.hardware is not None else "generic (Hardware(): no hardware= given)"
    info = plan.graph.meta.get("fxsplit")
    lines = [
        f"fxsplit plan: dp={c.dp}{f' dp_shard={c.dp_shard}' if c.dp_shard > 1 else ''}"
        f"{f' ep={c.ep}' if c.ep > 1 else ''}{f' cp={c.cp}' if c.cp > 1 else ''} tp={c.tp} pp={c.pp} "
        f"(world size {c.world_size}); {c.num_stages} stages (v={c.stages_per_rank}), {c.schedule}, "
        f"m={c.microbatches}; times for hardware {hw}; {UNITS}",
    ]
    if info is not None:
        lines.append(f"traced with {info.method}: {info.reason}")
    if (seq := sequence_summary(plan)) is not None:
        lines.append(seq)
    if "context_parallel" in plan.pass_report:
        lines.append(str(plan.pass_report["context_parallel"]))
    lines += tp_summary(plan.tp_plan)
    if c.ep > 1:
        lines += str(plan.ep_plan).splitlines()
    lines += stage_summary(plan.split)
    sim = plan.simulate()
    lines.append(f"simulated step: {fmt_ms(sim.makespan)}; bubble {100 * sim.bubble_fraction:.1f}% of the step "
                 f"(idle/ideal {100 * sim.bubble_ratio:.1f}%); peak in-flight microbatches per rank "
                 f"{_short_list(sim.peak_inflight)}")
    if c.pp > 1:
        sends = [sum(op.is_send for ops in cp.peer_ops.values() for op in ops) for cp in plan.comm]
        lines.append(f"point-to-point per step: {sum(sends)} messages (sends per rank {_short_list(sends)}); "
                     f"plan.rank_plan(r) prints rank r's in order")
    lines += memory_summary(plan.memory(), c.dp_shard)
    if plan.predicted_step_time is not None:
        mem = plan.predicted_memory or {}
        more = "; print(plan.search) has the candidate table" if plan.search is not None else ""
        lines.append(f"{'auto' if plan.search is not None else 'planner'}: predicted step {fmt_ms(plan.predicted_step_time)}, "
                     f"memory {fmt_bytes(mem.get('peak', 0))} on the busiest rank (this plan's, by Plan.memory()){more}")
        if plan.predicted_breakdown is not None:
            lines.append(f"  where the step goes (busiest rank): {plan.predicted_breakdown}")
    lines.append(f"planned in {plan.plan_seconds:.2f}s")
    return lines


def _short_list(xs: Any, keep: int = 16) -> str:
    xs = list(xs)
    if len(xs) <= keep:
        return str(xs)
    return "[" + ", ".join(str(x) for x in xs[:keep // 2]) + f", ... {len(xs) - keep} more ..., " \
        + ", ".join(str(x) for x in xs[-(keep // 2):]) + "]"
