"""Cost model: FLOPs, bytes and memory of each fx node, from node metadata only.

Terms:
    node metadata   ``node.meta["val"]``: a FakeTensor (or tuple/list of them, or int/SymInt/None);
                    ``node.meta["tensor_meta"]`` (ShapeProp) is accepted when "val" is absent.
    Number          ``int | float | sympy.Expr``. Shapes that are symbolic (``torch.SymInt``)
                    become sympy expressions in the tracer's symbols (e.g. batch ``s0``, sequence
                    ``s1``), so one cost serves every batch size and sequence length;
                    ``NodeCost.evaluate(bindings)`` turns it into numbers.
    FLOPs           forward floating-point operations, a multiply-add counting 2.
    matmul-like     linear, matmul/mm/bmm/addmm/baddbmm/einsum, convolution and the two products
                    of attention. Their FLOPs are also kept in ``NodeCost.matmul_flops``.
    owner           the node that counts a parameter's bytes: a ``get_attr`` node whose value is an
                    ``nn.Parameter``, or a ``call_module`` node (its module's parameters). A
                    parameter reachable from several nodes (tied weights, a module called twice)
                    is owned by the FIRST such node in graph order only. Buffers are never owned.

    node_cost(node, gm=None) -> NodeCost
    graph_costs(gm) -> dict[str, NodeCost]   # every node, parameter ownership resolved in one pass
    graph_cost(gm) -> NodeCost               # their sum

The per-op half (number helpers, tensor metadata, cost tables, per-kind formulas, leaf modules)
is the internal module ``fxsplit.graph.cost_ops``; op names and op classes are
``fxsplit.graph.ops``'s ([Note: op names]). This module owns ``NodeCost``, parameter ownership
and the graph sums, and re-exports ``Number`` and ``to_expr`` (``fxsplit.graph.shapes``), ``op_name``
(``fxsplit.graph.ops``) and ``value_bytes``.

[Note: cost conventions]
  * FLOPs of matmul-like ops are exact for the contraction (2 * output elements * contracted
    size); a bias adds 1 FLOP per output element. Attention counts the full (not causal-halved)
    ``q @ k^T`` and ``p @ v`` plus ``5`` FLOPs per score for the softmax, as the explicit graph does.
  * Other ops are estimated per element (``cost_ops._PER_ELEMENT_FLOPS``, default 1 per output element;
    reductions and losses count their first input): layer_norm 5 (+1 per affine tensor),
    rms_norm 4 (+1), softmax 5, gelu 8, silu/sigmoid/tanh 4. Views, getitem and shape arithmetic
    cost nothing; copies (cat, clone, contiguous, dtype casts) move bytes but do no FLOPs, and
    a cast or ``contiguous`` that returns its input unchanged costs nothing;
    an embedding lookup does no FLOPs and reads only the gathered rows plus the indices.
  * ``bytes_read`` counts every tensor input, parameters and buffers included (a call_module node
    reads its module's parameters and buffers); ``bytes_written`` counts every tensor output.
  * ``saved_bytes`` estimates the activations autograd keeps for backward, by op kind: inputs
    that are not parameters (matmul-like, mul/div, gelu, norms, unknown ops), the output (softmax,
    relu, sigmoid, tanh, exp), a one-byte mask (dropout), nothing (add, views, copies, reductions
    such as sum). Attention keeps q, k, v, the output and a float32 log-sum-exp per query row
    (flash-style); layer_norm keeps its input and float32 mean and rstd per row.
  * Backward FLOPs: 2x forward for matmul-like work (gradients of both operands), 1x for the rest
    (``NodeCost.backward_flops``). Backward bytes: the output gradient and saved activations are
    read, an input gradient is written for every input (``NodeCost.backward_bytes``).
  * An op the model does not know is costed as elementwise from its output size and never raises;
    an unknown leaf module is run once under ``FlopCounterMode`` on fake inputs of the node's
    shapes (symbolic dims replaced by their hints), its count scaled to the symbolic output size.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx
from torch import nn

# cost_ops is this module's internal half: its underscore helpers are shared with this module only
from fxsplit.errors import ArgumentTypeError, UsageError
from fxsplit.graph.cost_ops import (
    _clean,
    _is_symbolic,
    _mul,
    _sum,
    op_cost,
    value_bytes,
)
from fxsplit.graph.shapes import Number, substitute, to_expr
from fxsplit.graph.ops import op_name, resolve_path

__all__ = [
    "Number",
    "NodeCost",
    "ZERO_COST",
    "to_expr",
    "op_name",
    "node_cost",
    "graph_costs",
    "graph_cost",
    "estimate_time",
    "value_bytes",
]

_FIELDS = ("flops", "bytes_read", "bytes_written", "param_bytes", "saved_bytes", "matmul_flops")


# ---------------------------------------------------------------------------------------------
# NodeCost


@dataclass(frozen=True)
class NodeCost:
    """Cost of one node (or of a sum of nodes). Terms and conventions: module docstring.

    flops          forward FLOPs (multiply-add = 2).
    bytes_read     tensor bytes read in forward (inputs, parameters, buffers).
    bytes_written  tensor bytes written in forward (outputs).
    param_bytes    bytes of the parameters this node owns (counted once per parameter).
    saved_bytes    activation bytes kept for backward.
    matmul_flops   the part of ``flops`` that is matmul-like (backward costs 2x of it).
    """

    flops: Number = 0
    bytes_read: Number = 0
    bytes_written: Number = 0
    param_bytes: Number = 0
    saved_bytes: Number = 0
    matmul_flops: Number = 0

    def __post_init__(self) -> None:
        for name in _FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, sympy.Expr)):
                raise ArgumentTypeError(
                    f"NodeCost.{name} must be an int, float or sympy expression, got {value!r} "
                    f"(type {type(value).__name__}); convert SymInts with fxsplit.graph.cost.to_expr"
                )
            if not _is_symbolic(value) and value < 0:
                raise UsageError(f"NodeCost.{name} must be >= 0, got {value}")
        if not _is_symbolic(self.flops) and not _is_symbolic(self.matmul_flops):
            if self.matmul_flops > self.flops * (1 + 1e-9):
                raise UsageError(
                    f"NodeCost.matmul_flops ({self.matmul_flops}) exceeds flops ({self.flops}); "
                    "matmul_flops is the matmul-like part of flops"
                )

    @property
    def backward_flops(self) -> Number:
        """Estimated backward FLOPs: 2x the matmul-like part plus 1x the rest of ``flops``."""
        return self.flops + self.matmul_flops

    @property
    def backward_bytes(self) -> Number:
        """Estimated backward bytes: read grad-output and saved values, write input gradients."""
        return self.bytes_written + self.saved_bytes + self.bytes_read

    @property
    def is_symbolic(self) -> bool:
        return any(_is_symbolic(getattr(self, name)) for name in _FIELDS)

    @property
    def free_symbols(self) -> frozenset[sympy.Symbol]:
        out: set[sympy.Symbol] = set()
        for name in _FIELDS:
            value = getattr(self, name)
            if isinstance(value, sympy.Basic):
                out |= value.free_symbols
        return frozenset(out)

    def __add__(self, other: NodeCost) -> NodeCost:
        if not isinstance(other, NodeCost):
            return NotImplemented
        return NodeCost(**{n: _sum((getattr(self, n), getattr(other, n))) for n in _FIELDS})

    def __radd__(self, other: Any) -> NodeCost:
        if isinstance(other, int) and other == 0:  # sum(costs) starts from 0
            return self
        return NotImplemented

    def scale(self, factor: Number) -> NodeCost:
        """Every field multiplied by ``factor`` (e.g. a microbatch fraction)."""
        return NodeCost(**{n: _mul(getattr(self, n), factor) for n in _FIELDS})

    def evaluate(self, bindings: Mapping[sympy.Symbol | str, int | float]) -> NodeCost:
        """Substitute symbol values (keyed by symbol or symbol name) and return plain numbers.

        Raises UsageError (a ValueError) naming the symbols that ``bindings`` leaves unbound.
        """
        by_name = {(k if isinstance(k, str) else k.name): v for k, v in bindings.items()}
        missing = sorted(s.name for s in self.free_symbols if s.name not in by_name)
        if missing:
            raise UsageError(
                f"NodeCost.evaluate: no value for symbol(s) {missing}; bound: {sorted(by_name)}. "
                "Pass every symbol of the cost, e.g. evaluate({'s0': batch, 's1': seq_len}); "
                "the symbols are the tracer's names for dynamic dims (see NodeCost.free_symbols)"
            )
        values = {}
        for name in _FIELDS:
            value = getattr(self, name)
            if isinstance(value, sympy.Basic):
                subs = {s: by_name[s.name] for s in value.free_symbols}
                value = to_expr(sympy.sympify(substitute(value, subs)))
                if _is_symbolic(value):
                    raise UsageError(f"NodeCost.evaluate: {name} = {value} did not reduce to a number")
            values[name] = value
        return NodeCost(**values)

    def __str__(self) -> str:
        parts = ", ".join(f"{n}={_fmt(getattr(self, n))}" for n in _FIELDS)
        return f"NodeCost({parts})"


def _fmt(x: Number) -> str:
    if isinstance(x, int) and x >= 10_000:
        return f"{x:.3e}"
    return str(x)


ZERO_COST = NodeCost()


def estimate_time(
    cost: NodeCost, *, flops_per_s: float, bytes_per_s: float, backward: bool = True
) -> float:
    """Roofline seconds: ``max(flops / flops_per_s, bytes / bytes_per_s)`` for forward, plus the
    same for backward (``cost.backward_flops``, ``cost.backward_bytes``) when ``backward``.

    ``cost`` must be concrete: call ``cost.evaluate(bindings)`` first for a symbolic cost.
    """
    if flops_per_s <= 0 or bytes_per_s <= 0:
        raise UsageError(
            f"estimate_time: flops_per_s ({flops_per_s}) and bytes_per_s ({bytes_per_s}) must be > 0"
        )
    if cost.is_symbolic:
        raise UsageError(
            f"estimate_time: the cost is symbolic in {sorted(s.name for s in cost.free_symbols)}; "
            "call cost.evaluate({symbol: value, ...}) first"
        )
    t = max(cost.flops / flops_per_s, (cost.bytes_read + cost.bytes_written) / bytes_per_s)
    if backward:
        t += max(cost.backward_flops / flops_per_s, cost.backward_bytes / bytes_per_s)
    return float(t)


# ---------------------------------------------------------------------------------------------
# Node cost


def _owned_params(node: torch.fx.Node, gm: nn.Module | None) -> list[nn.Parameter]:
    """Parameters this node references directly (get_attr of a Parameter, call_module's params)."""
    if node.op == "get_attr":
        attr = resolve_path(gm, str(node.target), default=None)
        return [attr] if isinstance(attr, nn.Parameter) else []
    if node.op == "call_module":
        module = resolve_path(gm, str(node.target), default=None)
        return list(module.parameters()) if isinstance(module, nn.Module) else []
    return []


def _param_bytes(params: Iterable[nn.Parameter], seen: set[int]) -> int:
    total = 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def _related(a: str, b: str) -> bool:
    """Targets that can reach the same parameter by name: equal, or one a submodule of the other."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _seen_before(node: torch.fx.Node, gm: nn.Module | None) -> set[int]:
    """Ids of ``node``'s parameters that an earlier node already owns.

    Only earlier nodes whose target is related by name are resolved, unless one of the node's
    parameters is reachable under several names (tied), so costing every node stays near-linear.
    """
    mine = _owned_params(node, gm)
    if not mine or gm is None:
        return set()
    ids = {id(p) for p in mine}
    counts: dict[int, int] = {}
    for _, p in gm.named_parameters(remove_duplicate=False):
        if id(p) in ids:
            counts[id(p)] = counts.get(id(p), 0) + 1
    tied = any(c > 1 for c in counts.values())
    target = str(node.target)
    seen: set[int] = set()
    for other in node.graph.nodes:
        if other is node:
            break
        if other.op in ("get_attr", "call_module") and (tied or _related(str(other.target), target)):
            seen.update(id(p) for p in _owned_params(other, gm) if id(p) in ids)
    return seen


def node_cost(node: torch.fx.Node, gm: torch.fx.GraphModule | None = None) -> NodeCost:
    """Cost of one node from its metadata (module docstring: conventions).

    ``gm`` is the graph's module (default ``node.graph.owning_module``); it resolves get_attr and
    call_module targets. Never raises for an unknown op. Costing every node of a graph is
    quicker with ``graph_costs(gm)``, which resolves parameter ownership in one pass.
    """
    gm = gm if gm is not None else node.graph.owning_module
    seen = _seen_before(node, gm) if node.op in ("get_attr", "call_module") else set()
    return _node_cost(node, gm, seen)


def _node_cost(node: torch.fx.Node, gm: nn.Module | None, seen: set[int]) -> NodeCost:
    if node.op in ("placeholder", "output"):
        return ZERO_COST
    param_bytes = _param_bytes(_owned_params(node, gm), seen)
    return NodeCost(param_bytes=param_bytes, **op_cost(node, gm))


def graph_costs(gm: torch.fx.GraphModule) -> dict[str, NodeCost]:
    """Node name -> ``NodeCost`` for every node, in graph order (parameters owned once)."""
    seen: set[int] = set()
    return {node.name: _node_cost(node, gm, seen) for node in gm.graph.nodes}


def graph_cost(gm: torch.fx.GraphModule) -> NodeCost:
    """Sum of ``graph_costs(gm)``; symbolic where the graph's shapes are."""
    costs = list(graph_costs(gm).values())
    return NodeCost(**{n: _clean(_sum(getattr(c, n) for c in costs)) for n in _FIELDS})
