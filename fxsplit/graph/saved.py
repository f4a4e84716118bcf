"""What backward keeps, by storage: each saved tensor counted once, however many ops save it.

Terms: unit as in :mod:`fxsplit.pipeline.split` (a compute node, in graph order); the **base** of a
node is the node whose storage its value lives in (a view, a reshape or a cast that changes
nothing has its input's base; anything else is its own base); a parameter or buffer has no base
(it is not an activation).

    held = unit_saved(gm, units, binds)    # per unit: ({base node: bytes}, own bytes)
    acts = first_saver_bytes(held)         # per unit: bytes, each base charged at its first saver
    nbytes = union_bytes(held[a:b], extra) # one stage: every base once, plus the units' own bytes

[Note: saved tensors by storage]
The cost model's ``saved_bytes`` is per op ([Note: cost conventions] in fxsplit.graph.cost): a
layer norm output read by three projections is in the ``saved_bytes`` of each of them, but
autograd keeps the one tensor (the three saved references share a storage). Here every saved
operand is keyed by its base node, so a stage holds each storage once: ``cost_ops.saved_operands``
says which operands (and whether the output) an op's ``saved_bytes`` counts; what is left of
``saved_bytes`` (norm statistics, a dropout mask, attention's log-sum-exp) is the op's own and is
never shared. ``union_bytes`` is exact for one stage; the partition's chain model needs a sum per
unit, so ``first_saver_bytes`` charges a base to the first unit that saves it (exact for a stage
that holds all of a base's savers; a stage cut between two savers of one tensor undercounts the
later stage, which then holds its own received copy).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch
import torch.fx
from torch import nn

from fxsplit.graph.cost_ops import _is_noop_copy, saved_operands, value_bytes
from fxsplit.graph.meta import node_info, substitute
from fxsplit.graph.ops import CASTS, VIEWS, op_name, resolve_path

__all__ = ["base", "unit_saved", "first_saver_bytes", "union_bytes", "node_bytes"]

Held = tuple[dict[torch.fx.Node, float], float]


def node_bytes(node: torch.fx.Node, binds: Mapping) -> float:
    """Bytes of ``node``'s tensor value(s) at the sizes ``binds``."""
    info = node.meta.get("fxsplit")
    if info is not None and info.outputs:
        return info.output_bytes(binds)
    return float(substitute(value_bytes(node.meta.get("val")), binds))


def base(node: torch.fx.Node, gm: nn.Module | None, *, param_casts_free: bool = False) -> torch.fx.Node | None:
    """The node whose storage ``node``'s value is (None for a parameter or buffer; with
    ``param_casts_free`` also for a cast of a parameter: under FSDP with a mixed-precision
    ``param_dtype`` the parameters arrive gathered in that dtype, so the graph's cast of them
    (the mixed-precision pass's) returns the gathered parameter itself)."""
    if param_casts_free and node.op in ("call_function", "call_method") and node.args \
            and isinstance(node.args[0], torch.fx.Node) and node.args[0].op == "get_attr" \
            and op_name(node, gm) in CASTS \
            and isinstance(resolve_path(gm, str(node.args[0].target), default=None), torch.Tensor):
        return None
    seen = 0
    while seen < 64:
        seen += 1
        if node.op == "get_attr":
            attr = resolve_path(gm, str(node.target), default=None)
            return None if isinstance(attr, torch.Tensor) else node
        if node.op not in ("call_function", "call_method") or not node.args:
            return node
        src = node.args[0]
        if not isinstance(src, torch.fx.Node):
            return node
        name = op_name(node, gm)
        if name in VIEWS or _is_noop_copy(node, name):
            node = src
            continue
        return node
    return node


def unit_saved(gm: torch.fx.GraphModule, units: Sequence[torch.fx.Node], binds: Mapping, *,
               param_casts_free: bool = False) -> list[Held]:
    """Per unit: the bases of what its ``saved_bytes`` counts (with their bytes) and its own bytes
    ([Note: saved tensors by storage]); ``param_casts_free`` as in :func:`base`."""
    out: list[Held] = []
    for u in units:
        cost = node_info(u).cost
        total = 0.0 if cost is None else cost.saved_bytes
        total = float(substitute(total, binds))
        if total == 0:  # the op keeps nothing (a collective, a dropout of p=0), whatever its operands
            out.append(({}, 0.0))
            continue
        ins, own_out = saved_operands(u, gm)
        keys: dict[torch.fx.Node, float] = {}
        shared = 0.0
        for n in ([*ins, u] if own_out else ins):
            nb = node_bytes(n, binds)
            shared += nb
            b = base(n, gm, param_casts_free=param_casts_free)
            if b is not None:
                keys[b] = max(keys.get(b, 0.0), node_bytes(b, binds) if b is not n else nb)
        out.append((keys, max(total - shared, 0.0)))
    return out


def first_saver_bytes(held: Sequence[Held]) -> list[float]:
    """Per unit: its own bytes plus the bases it is the first to save."""
    seen: set[torch.fx.Node] = set()
    out = []
    for keys, own in held:
        fresh = [k for k in keys if k not in seen]
        seen.update(fresh)
        out.append(own + sum(keys[k] for k in fresh))
    return out


def union_bytes(held: Iterable[Held], extra: Mapping[torch.fx.Node, float] = {}) -> float:  # noqa: B006
    """Bytes of every base in ``held`` and ``extra`` once, plus the own bytes of ``held``."""
    keys: dict[torch.fx.Node, float] = dict(extra)
    own = 0.0
    for k, o in held:
        own += o
        for n, b in k.items():
            keys[n] = max(keys.get(n, 0.0), b)
    return own + sum(keys.values())
