"""Every stage's inputs of a plan, computed in one process: what a test or a benchmark of a single
stage (its graph split, its F / I / W times) needs to call that stage as its rank would.

    from fxsplit.testing.stage_inputs import stage_inputs
    inputs = stage_inputs(plan, args)            # inputs[s]: stage s's positional inputs
    split = GraphSplit.trace(plan.stages.modules[s], inputs[s])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["stage_inputs"]


def stage_inputs(plan: Any, args: Sequence[Any]) -> list[list[Any]]:
    """Each stage's inputs for the model inputs ``args`` (positional, as the plan was traced),
    the stages run in order without gradients. A received value is a fresh leaf that requires a
    gradient where the plan says so, as the executor makes it."""
    outs: dict[int, list[Any]] = {}
    inputs: list[list[Any]] = []
    for s, (gm, sio) in enumerate(zip(plan.stages.modules, plan.stages.io)):
        xs = [args[src.index] if src.stage is None else
              outs[src.stage][src.index].detach().requires_grad_(meta.requires_grad)
              for src, meta in zip(sio.inputs, sio.input_meta)]
        with torch.no_grad():
            o = gm(*xs)
        outs[s] = list(o) if isinstance(o, (tuple, list)) else [o]
        inputs.append(xs)
    return inputs
