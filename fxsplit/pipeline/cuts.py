"""Where a stage may start: layer boundaries by default, a cut inside a layer only when it pays.

Terms (as in :mod:`fxsplit.pipeline.split`): a **unit** is a compute node, **position k** a cut
before unit k, a unit's **layer key** its module path up to the first numbered component
(``model.layers.7``).
- **layer boundary**: a position k where the layer key changes and that lies inside no numbered
  layer's span (from its first unit to its last): a top-level op the trace placed between two ops
  of ``model.layers.7`` does not make a boundary inside that layer.
- **cut_at**: ``"layers"`` (the default) cuts at layer boundaries unless a cut inside a layer lowers
  the bottleneck stage by more than ``INNER_GAIN`` ([Note: layer cuts]); ``"any"`` lets the solver
  cut anywhere, a cut inside a layer costing ``inner_cut_penalty`` times its bytes; ``"modules"``
  only where a module call begins (as ``pipeline()`` split points in torch.distributed.pipelining
  require).

[Note: layer cuts]
A stage that starts inside a layer splits the layer's residual stream, its attention's q/k/v or
its MLP's hidden activations across ranks: the plan reads worse ("model.layers.4-8" and
"model.layers.8-12" share layer 8), the boundary usually carries more than one hidden state, and
checkpointing and stage tables speak of layers. So the split solves the partition twice: at layer
boundaries only, and anywhere (every cut at its true cost). It keeps the layer cuts unless the
free cuts make the bottleneck more than ``INNER_GAIN`` (2%) lower, and when it does cut inside a
layer (or must: fewer layer boundaries than stages, or no layer split within the memory limit)
the plan says why (``SplitPlan.cut_reason``, printed under the stage table).

    allowed = layer_boundaries(keys)                  # per position 0..n
    part, per_stage, why, free = choose_cuts(checkpointing.choose, problems, request, keys)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from fxsplit.graph.units import fmt_ms
from fxsplit.pipeline.partition import Partition, PartitionProblem
from fxsplit.errors import PartitionError

__all__ = ["CUT_AT", "INNER_GAIN", "choose_cuts", "cut_rules", "layer_boundaries", "outside_atomic"]

CUT_AT = ("layers", "any", "modules")
INNER_GAIN = 0.02  # a cut inside a layer must lower the bottleneck by more than this share

_NUMBERED = re.compile(r"(^|\.)\d+$")


def layer_boundaries(keys: Sequence[str]) -> list[bool]:
    """Per position 0..n: is it a layer boundary (see Terms); the ends are True."""
    n = len(keys)
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, key in enumerate(keys):
        if _NUMBERED.search(key):
            first.setdefault(key, i)
            last[key] = i
    inside = [0] * (n + 2)  # difference array over positions first+1 .. last
    for key, a in first.items():
        if last[key] > a:
            inside[a + 1] += 1
            inside[last[key] + 1] -= 1
    out, run = [True], 0
    for k in range(1, n):
        run += inside[k]
        out.append(keys[k - 1] != keys[k] and run == 0)
    return out + [True]


def cut_rules(paths: Sequence[str], keys: Sequence[str], cut_at: str,
              inner_cut_penalty: float) -> tuple[list[float], list[bool] | None]:
    """(penalty per position, allowed positions or None) for ``cut_at`` (see Terms): "any"
    charges a cut inside a layer ``inner_cut_penalty`` x its bytes; "layers" allows layer
    boundaries at their true cost; "modules" positions where a module call begins."""
    n = len(keys)
    if cut_at == "layers":
        return [1.0] * (n + 1), layer_boundaries(keys)
    penalty = [1.0] + [1.0 if keys[k - 1] != keys[k] else inner_cut_penalty for k in range(1, n)] + [1.0]
    if cut_at != "modules":
        return penalty, None
    allowed = [True] + [
        bool(paths[k]) and paths[k] != paths[k - 1] and not (paths[k - 1] + ".").startswith(paths[k] + ".")
        for k in range(1, n)
    ] + [True]
    return penalty, allowed


def outside_atomic(names: Sequence[str], atomic: Sequence[tuple[str, str]],
                   allowed: list[bool] | None) -> list[bool] | None:
    """``allowed`` (per position; None: all) with the cuts inside every ``atomic`` span of unit
    names (after its first unit, up to its last) removed: values inside have sizes known only at
    run time (expert-parallel token exchange, ``fxsplit.passes.expert_parallel``)."""
    if not atomic:
        return allowed
    index = {name: i for i, name in enumerate(names)}
    allowed = list(allowed) if allowed is not None else [True] * (len(names) + 1)
    for first, last in atomic:
        if first in index and last in index:
            for k in range(index[first] + 1, index[last] + 1):
                allowed[k] = False
    return allowed


Choose = Callable[[Mapping[str, PartitionProblem], str], tuple[Partition, tuple[str, ...]]]


def _inside(cuts: Sequence[int], ok: Sequence[bool], keys: Sequence[str]) -> str:
    return ", ".join(f"stage {s} starts inside {keys[k] or '<top>'}"
                     for s, k in enumerate(cuts[:-1]) if s and not ok[k])


def choose_cuts(choose: Choose, problems: Mapping[str, PartitionProblem], request: str, keys: Sequence[str],
                loose: Sequence[bool] | None = None) -> tuple[Partition, tuple[str, ...], str, bool]:
    """The partition, each stage's checkpointing mode, why a cut lies inside a layer ("" when
    none does) and whether the partition is the free problem's (``allowed=loose``: the problem the
    plan records), for ``problems`` built with ``cut_at="layers"`` ([Note: layer cuts]); ``loose``
    is what the free problem allows (None: every position; spans that must not be cut removed).
    ``choose`` is the checkpointing choice (``fxsplit.pipeline.checkpointing.choose``)."""
    free = {m: replace(pb, allowed=None if loose is None else tuple(loose)) for m, pb in problems.items()}
    loose, loose_modes = choose(free, request)
    ok = next(iter(problems.values())).cut_ok()
    inner = _inside(loose.cuts, ok, keys)
    if not inner:  # the free optimum cuts at layers already (and is the layer optimum, ties alike)
        return loose, loose_modes, "", True
    try:
        layered, modes = choose(problems, request)
    except PartitionError as exc:
        return loose, loose_modes, f"{inner}: no split at layer boundaries only ({exc})", True
    gain = 1.0 - loose.bottleneck / layered.bottleneck if layered.bottleneck > 0 else 0.0
    if gain > INNER_GAIN:
        return loose, loose_modes, (
            f"{inner}: bottleneck {fmt_ms(loose.bottleneck)} against "
            f"{fmt_ms(layered.bottleneck)} at layer boundaries ({100 * gain:.1f}% lower, more than "
            f"{100 * INNER_GAIN:.0f}%)"), True
    return layered, modes, "", False
