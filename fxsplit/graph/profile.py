"""Measured profile: time every node of a graph on real tensors; prefer it over the estimate.

Terms:
    profile      node name -> measured FORWARD seconds of that node (the fastest of ``repeats``
                 timed runs after one warm-up run), from ``profile_graph``.
    attached     ``apply_profile(gm, times)`` stores a node's seconds in
                 ``node.meta["fxsplit_profile"]`` (a float).
    node time    ``node_time(node, flops_per_s=..., bytes_per_s=...)``: the measured seconds when
                 attached, else the roofline estimate of ``fxsplit.graph.cost.estimate_time``; with
                 ``backward=True`` a measured forward time is scaled by the cost model's
                 (forward + backward) / forward ratio, or by 3 where the model estimates 0.

    profile_graph(gm, example_args, *, device=None, repeats=3) -> dict[str, float]
    apply_profile(gm, times) -> None
    node_time(node, *, flops_per_s, bytes_per_s, backward=True, bindings=None) -> float
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from typing import Any

import sympy
import torch
import torch.fx

from fxsplit.errors import UsageError
from fxsplit.graph.cost import NodeCost, estimate_time, node_cost

__all__ = ["PROFILE_KEY", "profile_graph", "apply_profile", "node_time"]

PROFILE_KEY = "fxsplit_profile"
_TIMED_OPS = ("call_function", "call_method", "call_module")


class _TimingInterpreter(torch.fx.Interpreter):
    """Runs the graph, adding each compute node's wall time to ``self.times`` (per run)."""

    def __init__(self, gm: torch.fx.GraphModule, synchronize: bool) -> None:
        super().__init__(gm)
        self.synchronize = synchronize
        self.times: dict[str, float] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op not in _TIMED_OPS:
            return super().run_node(n)
        if self.synchronize:
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = super().run_node(n)
        if self.synchronize:
            torch.cuda.synchronize()
        self.times[n.name] = time.perf_counter() - start
        return result


def _to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to_device(v, device) for k, v in x.items()}
    return x


def profile_graph(
    gm: torch.fx.GraphModule,
    example_args: Sequence[Any],
    *,
    device: torch.device | str | None = None,
    repeats: int = 3,
) -> dict[str, float]:
    """Node name -> measured forward seconds for every call_function/call_method/call_module node.

    ``example_args`` are real tensors, in placeholder order. With ``device``, a copy of ``gm`` and
    the arguments are moved there (``gm`` itself is left unchanged). CUDA is synchronized around
    every node. Runs once to warm up, then ``repeats`` times, keeping each node's fastest time.
    Forward only, under ``torch.no_grad()``.
    """
    if repeats < 1:
        raise UsageError(f"profile_graph: repeats must be >= 1, got {repeats}")
    if device is not None:
        device = torch.device(device)
        gm = copy.deepcopy(gm).to(device)
        example_args = _to_device(tuple(example_args), device)
    else:
        tensors = [t for t in list(gm.parameters()) + list(gm.buffers())]
        tensors += [a for a in example_args if isinstance(a, torch.Tensor)]
        device = tensors[0].device if tensors else torch.device("cpu")
    interp = _TimingInterpreter(gm, synchronize=device.type == "cuda")
    best: dict[str, float] = {}
    with torch.no_grad():
        for run in range(repeats + 1):
            interp.times = {}
            interp.run(*example_args)
            if run == 0:
                continue  # warm-up
            for name, seconds in interp.times.items():
                best[name] = min(seconds, best.get(name, float("inf")))
    return best


def apply_profile(gm: torch.fx.GraphModule, times: Mapping[str, float]) -> None:
    """Attach measured seconds to the nodes of ``gm`` (``node.meta[PROFILE_KEY]``).

    Every name in ``times`` must be a node of ``gm`` and every value a finite number >= 0.
    """
    nodes = {n.name: n for n in gm.graph.nodes}
    unknown = sorted(set(times) - set(nodes))
    if unknown:
        raise UsageError(
            f"apply_profile: {len(unknown)} name(s) in times are not nodes of this graph, e.g. "
            f"{unknown[:5]}; profile the same graph you attach to (node names change when a pass "
            "rewrites the graph)"
        )
    checked: dict[str, float] = {}
    for name, seconds in times.items():
        try:
            checked[name] = float(seconds)
        except (TypeError, ValueError):
            checked[name] = float("nan")
        if not 0 <= checked[name] < float("inf"):
            raise UsageError(f"apply_profile: time of node {name!r} must be a finite number >= 0, got {seconds!r}")
    for name, seconds in checked.items():
        nodes[name].meta[PROFILE_KEY] = seconds


def _cost_of(node: torch.fx.Node) -> NodeCost:
    info = node.meta.get("fxsplit")
    cost = getattr(info, "cost", None)  # NodeInfo from fxsplit.trace, when the graph has it
    return cost if isinstance(cost, NodeCost) else node_cost(node)


def node_time(
    node: torch.fx.Node,
    *,
    flops_per_s: float,
    bytes_per_s: float,
    backward: bool = True,
    bindings: Mapping[sympy.Symbol | str, int] | None = None,
    cost: NodeCost | None = None,
) -> float:
    """Seconds for ``node``: the attached measurement if any, else the roofline estimate.

    The cost is ``cost`` when given (the node's, evaluated already: callers that need it too
    evaluate it once), else ``node.meta["fxsplit"].cost`` when present, else
    ``fxsplit.graph.cost.node_cost(node)``; a symbolic cost needs ``bindings`` (see ``NodeCost.evaluate``).
    """
    cost = _cost_of(node) if cost is None else cost
    if cost.is_symbolic:
        if bindings is None:
            raise UsageError(
                f"node_time: the cost of node {node.name!r} is symbolic in "
                f"{sorted(s.name for s in cost.free_symbols)}; pass bindings={{symbol: value}}"
            )
        cost = cost.evaluate(bindings)
    measured = node.meta.get(PROFILE_KEY)
    if measured is None:
        return estimate_time(cost, flops_per_s=flops_per_s, bytes_per_s=bytes_per_s, backward=backward)
    if not backward:
        return float(measured)
    forward = estimate_time(cost, flops_per_s=flops_per_s, bytes_per_s=bytes_per_s, backward=False)
    both = estimate_time(cost, flops_per_s=flops_per_s, bytes_per_s=bytes_per_s, backward=True)
    ratio = both / forward if forward > 0 else 3.0
    return float(measured) * ratio
