"""The lockstep interpreter of :func:`fxsplit.verify`: one stage graph run node by node for every
tp rank at once in this process, a collective evaluated over the ranks' values together by
:mod:`fxsplit.tp.emulate` ([Note: plan-time verification] in :mod:`fxsplit.api.verify`).

    outs = run_lockstep(gm, mods, inputs, record)   # mods[r], inputs[r]: rank r's tensors and inputs
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

from fxsplit.errors import VerificationError
from fxsplit.graph.ops import resolve_path
from fxsplit.graph.recompute import checkpointed
from fxsplit.tp.emulate import as_ranks, emulate, is_emulated

__all__ = ["run_lockstep"]


def _eval(node: torch.fx.Node, mod: nn.Module, args: tuple, kwargs: dict) -> Any:
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        self_, *rest = args
        return getattr(self_, node.target)(*rest, **kwargs)
    return mod.get_submodule(str(node.target))(*args, **kwargs)


def _unwrapped(target: Any) -> Any:
    """The function a graph wrapper calls (``keep(op)`` of selective checkpointing,
    ``in_tp_stream(op)``): collectives wrapped so are still emulated."""
    while hasattr(target, "__wrapped__"):
        target = target.__wrapped__
    return target


def run_lockstep(gm: torch.fx.GraphModule, mods: Sequence[nn.Module], inputs: Sequence[Sequence[Any]],
                 record: dict[str, list[Any]] | None, ranks: Sequence[Mapping[str, tuple[int, int]]] | None = None
                 ) -> list[tuple]:
    """Run ``gm``'s graph for the t ranks (``mods[r]`` holds rank r's tensors, ``inputs[r]`` its
    stage inputs); returns each rank's outputs; ``record`` gets every node's per-rank values.
    ``ranks[r]``: rank r's (rank, size) along each mesh axis (default: tp rank r of t), for
    several axes at once (cp x tp: [Note: emulated collectives over several axes])."""
    t = len(mods)
    if ranks is None:
        ranks = [{"tp": (r, t)} for r in range(t)]
    env: list[dict[torch.fx.Node, Any]] = [{} for _ in range(t)]
    placeholders = iter(range(len(inputs[0])))
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            i = next(placeholders)
            vals = [inputs[r][i] for r in range(t)]
        elif node.op == "get_attr":
            vals = [resolve_path(mods[r], node.target) for r in range(t)]
        elif node.op == "output":
            return [torch.fx.node.map_arg(node.args[0], lambda n, r=r: env[r][n]) for r in range(t)]
        else:
            args = [torch.fx.node.map_arg(node.args, lambda n, r=r: env[r][n]) for r in range(t)]
            kwargs = [torch.fx.node.map_arg(node.kwargs, lambda n, r=r: env[r][n]) for r in range(t)]
            base = _unwrapped(node.target) if node.op == "call_function" else None
            if base is not None and is_emulated(base):
                # one axis: every rank takes part; several (cp x tp): the ranks sharing the other coordinates
                vals = emulate(base, args, kwargs, ranks if len(ranks[0]) > 1 else None)
            elif base is checkpointed:
                # an activation-checkpointed layer: its region graph, in lockstep (recomputation
                # changes no number: the region is run once, without checkpointing)
                regions = [a[0] for a in args]
                if not isinstance(regions[0], torch.fx.GraphModule):
                    raise VerificationError(f"verify: node {node.name!r} checkpoints a region that is not a graph")
                vals = run_lockstep(regions[0], regions, [a[2:] for a in args], None, ranks)
            else:
                vals = []
                for r in range(t):
                    with as_ranks(ranks[r]):
                        vals.append(_eval(node, mods[r], args[r], kwargs[r]))
        for r in range(t):
            env[r][node] = vals[r]
        if record is not None:
            record[node.name] = vals
    raise AssertionError("graph without an output node")
