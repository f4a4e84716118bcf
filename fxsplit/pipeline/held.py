"""What a pipeline stage holds per microbatch in flight, for the split's memory model.

    held = StageHeld(gm, units, binds, unit_saved(gm, units, binds), loss_key(gm, binds))
    held.stage(None, a, b, last)      # bytes per microbatch of the stage [a, b) (mode "none")
    held.weight(a, b, weight_time)    # of those, what a split backward's W still needs after I

[Note: what a stage holds]
Per microbatch in flight, a stage holds (each storage once, ``fxsplit.graph.saved.union_bytes``):
what its units save for backward under its checkpointing mode (``mode_held`` in
fxsplit.pipeline.checkpointing); the values it received (the executor keeps them as the leaves
of the backward); the values it sent on (kept as the backward's roots until the gradient comes
back); on the last stage, what the loss keeps, the size of the model's outputs (cross-entropy
keeps the log-softmax of the logits, MSE the difference). Measured against a stage's forward in
one process (tests/test_memory_model.py, within 15% in every mode) and over gloo at a backward's
start (tests/test_runtime_memory.py, benchmarks/activation_memory.py).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.fx

from fxsplit.graph.saved import base, node_bytes, union_bytes

__all__ = ["StageHeld", "loss_key", "with_loss"]


def loss_key(gm: torch.fx.GraphModule, binds: Mapping) -> dict[Any, float]:
    """What the loss keeps for backward, keyed by the graph's output node: the size of the model's
    outputs (cross-entropy keeps the log-softmax of the logits, MSE the difference), held by the
    last stage ([Note: what a stage holds])."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    nodes = _flat_nodes(out.args)
    total = sum(node_bytes(n, binds) for n in nodes)
    return {out: total} if total else {}


def _flat_nodes(x: Any) -> list[torch.fx.Node]:
    if isinstance(x, torch.fx.Node):
        return [x]
    if isinstance(x, (tuple, list)):
        return [n for a in x for n in _flat_nodes(a)]
    if isinstance(x, dict):
        return [n for a in x.values() for n in _flat_nodes(a)]
    return []


def with_loss(acts: Sequence[float], key: Mapping) -> tuple[float, ...]:
    """``acts`` with the loss's saved bytes (``loss_key``) added to the last unit."""
    out = list(acts)
    out[-1] += sum(key.values())
    return tuple(out)


class StageHeld:
    """Per microbatch in flight, a stage holds (each storage once,
    ``fxsplit.graph.saved.union_bytes``): what its units save for backward under its checkpointing
    mode; the values it received (the executor keeps them as the leaves of the backward) and the
    values it sent on (kept as the backward's roots until the gradient comes back); on the last
    stage, what the loss keeps (the model outputs' size: ``loss_key``)."""

    def __init__(self, gm: torch.fx.GraphModule, units: list[torch.fx.Node], binds: Mapping,
                 held: Sequence, loss_key: Mapping) -> None:
        self.gm, self.units, self.binds, self.held, self.loss = gm, units, binds, held, loss_key
        self.index = {u: i for i, u in enumerate(units)}

    def boundary(self, a: int, b: int) -> dict[Any, float]:
        """Bases of the values stage [a, b) receives and sends on, with their bytes."""
        out: dict[Any, float] = {}
        n = len(self.units)
        for i in range(a, b):
            u = self.units[i]
            ins = [x for x in u.all_input_nodes if self.index.get(x, n) < a]
            sends = [u] if any(a <= i < b <= self.index.get(x, -1) for x in u.users) else []
            for x in ins + sends:
                key = base(x, self.gm)
                if key is not None:
                    out[key] = max(out.get(key, 0.0), node_bytes(x, self.binds))
        return out

    def weight(self, a: int, b: int, weight_time: Sequence[float]) -> float:
        """What a split backward's W needs of stage [a, b) after I: for every unit with a weight
        gradient, its saved inputs and its output's gradient ([Note: split backward memory])."""
        units = [i for i in range(a, b) if weight_time[i] > 0]
        grads = {("grad", self.units[i]): node_bytes(self.units[i], self.binds) for i in units}
        return union_bytes([(self.held[i][0], 0.0) for i in units], grads)

    def recomputed(self, region: Sequence[int], a: int, b: int) -> float:
        """The most a backward of stage [a, b) holds at once while it recomputes a checkpointed
        region (``region``: per unit its region, -1 when not recomputed): the largest region part's
        activations as mode "none" saves them."""
        parts: dict[int, list] = {}
        for i in range(a, min(b, len(region))):
            if region[i] >= 0:
                parts.setdefault(region[i], []).append(self.held[i])
        return max((union_bytes(p) for p in parts.values()), default=0.0)

    def stage(self, held: Sequence | None, a: int, b: int, last: bool) -> float:
        extra = self.boundary(a, b)
        if last:
            extra.update(self.loss)
        return union_bytes((self.held if held is None else held)[a:b], extra)
