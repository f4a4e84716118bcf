"""``plan.to_dot(level="module")``: a plan drawn as stages and module calls, readable at 70B.

Terms
- **box**: one module call of a stage, or a run of numbered layers folded into one
  (``model.layers.0-19``, "20 layers"): a unit's box key is its layer key when the layer is
  numbered, else its module path cut to two components (``model.embed_tokens``, ``lm_head``).
  Top-level ops (no module path) join the box before them (the first box, at a stage's start).
- **collectives**: the tensor-parallel collectives the TP pass put in a box
  (``fxsplit.tp.collectives`` and ``fxsplit.tp.functional``: ``reduce_from_region`` is g, a
  forward all-reduce; ``copy_to_region`` and ``column_parallel_linear`` carry f, a backward
  all-reduce; gathers, scatters and the vocabulary-parallel ops as named), counted per layer; the data-parallel gradient reduction of the layout is named in the title.
- **boundary edge**: a bold edge from a stage to a later one, labelled with the values it sends
  per microbatch and their bytes; values the stage recomputes instead ([Note: recompute, don't
  ship] in fxsplit.pipeline.recomputable) are named in the receiving stage's label.

The node count grows with stages and distinct modules, not with depth: a Llama-70B plan at pp=8
is a few dozen boxes.

    text = module_dot(plan, "plan.png")     # also Plan.to_dot("plan.png", level="module")
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import sympy
import torch.fx

from fxsplit.graph.inspection import PALETTE, dot_quote, module_path, write_dot
from fxsplit.graph.recompute import layer_key
from fxsplit.graph.shapes import substitute
from fxsplit.graph.units import fmt_bytes, fmt_ms

__all__ = ["module_dot"]

_COMPUTE = ("call_function", "call_method", "call_module")
_NUMBERED = re.compile(r"^(.*?)\.?(\d+)$")
_COLLECTIVES = {  # fxsplit.tp.collectives function -> how the picture names it
    "reduce_from_region": "all-reduce fwd (g)",
    "copy_to_region": "all-reduce bwd (f)",
    "gather_from_region": "all-gather",
    "scatter_to_region": "split",
    "reduce_scatter_to_region": "reduce-scatter",
    "gather_to_region": "all-gather",
    "column_parallel_linear": "all-reduce bwd (f)",  # fxsplit.tp.functional: f fused with the linears
    "vocab_parallel_embedding": "all-reduce fwd (vocab)",
    "vocab_parallel_cross_entropy": "all-reduce fwd (loss)",
    "gather_logits": "all-gather (logits)",
}


def _box_key(path: str) -> str:
    key = layer_key(path)
    if _NUMBERED.match(key):
        return key
    return ".".join(path.split(".")[:2])


def _collective(node: torch.fx.Node) -> str | None:
    t = node.target
    if node.op != "call_function" or not str(getattr(t, "__module__", "")).startswith("fxsplit.tp"):
        return None
    return _COLLECTIVES.get(getattr(t, "__name__", ""))


class _Box:
    def __init__(self, key: str) -> None:
        self.keys = [key]
        self.nodes = 0
        self.collectives: Counter = Counter()
        self.recomputed = True

    def label(self) -> str:
        first, last = self.keys[0], self.keys[-1]
        m, n = _NUMBERED.match(first), _NUMBERED.match(last)
        if len(self.keys) > 1 and m and n:
            name, count = f"{m[1]}.{m[2]}-{n[2]}", f"{len(self.keys)} layers, "
        else:
            name, count = first or "<top>", ""
        lines = [name, f"{count}{self.nodes} ops" + (", recomputed here" if self.recomputed else "")]
        per = len(self.keys)
        for what, k in sorted(self.collectives.items()):
            lines.append(f"TP {what} x{k // per if k % per == 0 else f'{k}/{per}'}" + (" per layer" if per > 1 else ""))
        return "\n".join(lines)


def _signature(box: _Box) -> tuple:
    return tuple(sorted(box.collectives.items()))


def _stage_boxes(gm: torch.fx.GraphModule, stage: int, stage_of: Any) -> list[_Box]:
    """The stage's module calls in order, consecutive numbered layers of one container folded."""
    boxes: list[_Box] = []
    layer: dict[str, tuple] = {}  # box key of a numbered layer -> its collectives, to fold alike layers
    for node in gm.graph.nodes:
        if node.op not in _COMPUTE:
            continue
        path = module_path(node)
        key = _box_key(path) if path else (boxes[-1].keys[-1] if boxes else "")
        if boxes and boxes[-1].keys == [""] and key:  # leading top-level ops join the first module
            boxes[-1].keys = [key]
        if not boxes or boxes[-1].keys[-1] != key:
            boxes.append(_Box(key))
        box = boxes[-1]
        box.nodes += 1
        what = _collective(node)
        if what is not None:
            box.collectives[what] += 1
        box.recomputed &= stage_of.get(node.name, stage) != stage  # copied from an earlier stage
    folded: list[_Box] = []
    for box in boxes:
        prev = folded[-1] if folded else None
        m, n = _NUMBERED.match(box.keys[0]), _NUMBERED.match(prev.keys[-1]) if prev else None
        if prev and m and n and m[1] == n[1] and int(m[2]) == int(n[2]) + 1 and not prev.recomputed \
                and _signature(box) == layer.get(prev.keys[-1]) and prev.nodes % len(prev.keys) == 0 \
                and prev.nodes // len(prev.keys) == box.nodes:
            prev.keys.append(box.keys[0])
            prev.nodes += box.nodes
            prev.collectives.update(box.collectives)
            layer[box.keys[0]] = _signature(box)
            continue
        layer[box.keys[0]] = _signature(box)
        folded.append(box)
    return folded


def _title(plan: Any) -> str:
    c = plan.config
    grads = ("FSDP all-gather / reduce-scatter over dp_shard" if c.dp_shard > 1 else "")
    if c.dp > 1:
        grads = (grads + "; " if grads else "") + "gradient all-reduce over dp per step"
    return (f"fxsplit plan: dp={c.dp} dp_shard={c.dp_shard} tp={c.tp} pp={c.pp}, {c.num_stages} stages, "
            f"{c.schedule}, m={c.microbatches}" + (f"\n{grads}" if grads else "")
            + "\nbold edges: point-to-point per microbatch (activation forward, gradient backward)"
            + (f"\n{plan.split.cut_reason}" if plan.split.cut_reason else ""))


def module_dot(plan: Any, path: str | Path | None = None) -> str:
    """DOT text of ``plan`` by stage and module call (see Terms); ``path`` as
    ``fxsplit.graph.inspection.to_dot`` (``.png``/``.svg``/``.pdf`` rendered when graphviz is installed)."""
    split, stages = plan.split, plan.stages
    lines = ["digraph fxsplit_plan {", "  rankdir=TB; compound=true; fontname=\"monospace\";",
             f"  label={dot_quote(_title(plan))}; labelloc=t;",
             '  node [shape=box, style="rounded,filled", fontname="monospace", fontsize=10];',
             '  edge [fontname="monospace", fontsize=9];']
    ends: list[tuple[str, str]] = []
    for s, (gm, io) in enumerate(zip(stages.modules, stages.io)):
        st = split.stages[s]
        boxes = _stage_boxes(gm, s, split.stage_of)
        again = [n for n in split.recomputed_reads if split.stage_of.get(n, s) < s
                 and any(node.name == n for node in gm.graph.nodes)]
        label = (f"stage {s} (pp rank {st.rank}): {fmt_ms(st.time)} per microbatch, params {fmt_bytes(st.param_bytes)}"
                 + (f"\nrecomputes, not received: {', '.join(again)}" if again else ""))
        lines += [f"  subgraph cluster_{s} {{", f"    label={dot_quote(label)}; style=filled; "
                  f"fillcolor=\"{PALETTE[s % len(PALETTE)]}40\";"]
        names = [f"s{s}_{k}" for k in range(len(boxes))]
        for name, box in zip(names, boxes):
            fill = "#eeeeee" if box.recomputed else PALETTE[s % len(PALETTE)]
            lines.append(f"    {name} [label={dot_quote(box.label())}, fillcolor=\"{fill}\"];")
        lines += [f"    {a} -> {b};" for a, b in zip(names, names[1:])]
        lines.append("  }")
        ends.append((names[0], names[-1]))
    lines += _boundary_edges(stages, ends, split.bindings)
    lines.append("}")
    text = "\n".join(lines) + "\n"
    if path is not None:
        write_dot(text, Path(path))
    return text


def _boundary_edges(stages: Any, ends: list[tuple[str, str]], bindings: Any) -> list[str]:
    per_pair: dict[tuple[int, int], list] = {}
    for c, io in enumerate(stages.io):
        for src, meta in zip(io.inputs, io.input_meta):
            if src.stage is not None:
                per_pair.setdefault((src.stage, c), []).append(meta)
    out = []
    for (t, c), metas in sorted(per_pair.items()):
        size = sum(_bytes(m, bindings) for m in metas)
        shown = ", ".join(m.name for m in metas[:3]) + (f" +{len(metas) - 3}" if len(metas) > 3 else "")
        grads = sum(m.requires_grad for m in metas)
        label = f"{len(metas)} sent: {shown}\n{fmt_bytes(size)}" + (f", {grads} gradients back" if grads else "")
        out.append(f"  {ends[t][1]} -> {ends[c][0]} [label={dot_quote(label)}, style=bold, color=\"#1f4e99\", "
                   f"ltail=cluster_{t}, lhead=cluster_{c}];")
    return out


def _bytes(meta: Any, bindings: Any) -> float:
    """A boundary value's bytes per microbatch (symbolic sizes at the split's bindings, by name)."""
    if meta.tensor is None:
        return 0.0
    size = meta.tensor.nbytes
    if isinstance(size, sympy.Basic):
        size = substitute(size, {x: bindings[str(x)] for x in size.free_symbols if str(x) in bindings})
    try:
        return float(size)
    except TypeError:  # a symbol the split has no size for
        return 0.0
