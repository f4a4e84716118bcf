"""Values a stage recomputes instead of receiving: rotary tables, masks, position ids.

Terms
- **free input**: a value every stage already has without a message: a model input (placeholders
  are read locally on every rank, [Note: values across a cut] in :mod:`fxsplit.pipeline.stage`),
  a buffer or constant (``get_attr`` of a tensor that is not an ``nn.Parameter``, shared by
  reference), or a non-tensor value.
- **recomputable node**: a compute node whose inputs are all free inputs or
  recomputable nodes, that reads no parameter, is no module call and draws no random numbers
  and has no side effects. Its **closure** is it and the recomputable nodes it reads,
  transitively, back to the free inputs. An in-place op, and a value an in-place op changes, is
  never recomputable (a copy elsewhere would miss the change).
- **cheap**: the closure's forward FLOPs are at most ``flops_per_byte`` times the bytes of the
  value (at least ``MESSAGE_FLOOR_BYTES``: a message's latency), so recomputing it costs about what receiving it costs to write into memory (a rotary
  table ``b x T x d`` costs about ``b x T x d`` FLOPs; a causal mask ``T x T`` a few per element).

[Note: recompute, don't ship]
A boundary value that a stage can recompute from its own free inputs at negligible cost is
recomputed on every stage that reads it instead of being sent there point to point for every
microbatch (and its gradient, which it never has: it depends on no parameter). The split plans
with it (its bytes are not part of any cut: ``fxsplit.pipeline.bindings.cut_bytes``) and the stage
builder copies the closure into the consumer (``build_stages(..., recompute=...)``), so the
communication plan never carries it. Exact: the closure is deterministic and reads the same
inputs on every stage (the same microbatch of the model inputs, the same buffers), so it
computes the same tensor bit for bit. A value whose closure reads a parameter (even a frozen
one: a frozen encoder would be recomputed whole), a module call or a random op is sent as before.

    names = recomputable(gm, units, bindings)     # frozenset of node names
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.fx

from fxsplit.graph.meta import node_info, substitute
from fxsplit.graph.ops import is_random, resolve_path

__all__ = ["FLOPS_PER_BYTE", "MESSAGE_FLOOR_BYTES", "recomputable"]

FLOPS_PER_BYTE = 16.0  # closure FLOPs per byte of the value at most: an fp32 element at 64 FLOPs
# a message costs at least its latency, about what 64 KiB take on a link (10 us at 6.5 GB/s): a
# small value (a 0-d flag, a short position table) is "cheap" up to 16 x 64 KiB = 1 MFLOP
MESSAGE_FLOOR_BYTES = 65536.0

def _free_attr(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """A get_attr of a buffer or constant (not a parameter, not a module)."""
    obj = resolve_path(gm, str(node.target), default=None)
    return isinstance(obj, torch.Tensor) and not isinstance(obj, torch.nn.Parameter)


def _is_tensor_value(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _flops(node: torch.fx.Node, bindings: Mapping) -> float:
    info = node.meta.get("fxsplit")
    cost = getattr(info, "cost", None)
    if cost is None:  # a size or a dtype costs nothing; a tensor of unknown cost is never cheap
        return float("inf") if _is_tensor_value(node) else 0.0
    value = substitute(cost.flops, bindings) if not isinstance(cost.flops, (int, float)) else cost.flops
    try:
        return float(value)
    except TypeError:  # a symbol left unbound: cannot say it is cheap
        return float("inf")


def _mutates(node: torch.fx.Node) -> bool:
    """An in-place op (``x.add_(y)``, ``aten.fill_``): recomputing its input elsewhere would miss it."""
    t = node.target
    schema = getattr(t, "_schema", None)
    if schema is not None and getattr(schema, "is_mutable", False):
        return True
    name = t if isinstance(t, str) else getattr(t, "__name__", "")
    return node.op in ("call_method", "call_function") and name.endswith("_") and not name.endswith("__")


def recomputable(gm: torch.fx.GraphModule, units: Sequence[torch.fx.Node], bindings: Mapping,
                 *, flops_per_byte: float = FLOPS_PER_BYTE) -> frozenset[str]:
    """Names of the cheap recomputable tensor nodes among ``units`` (see Terms); the split leaves
    them out of its cuts and the stage builder recomputes them where they are read."""
    ok: dict[torch.fx.Node, frozenset[torch.fx.Node]] = {}  # recomputable node -> its closure
    for u in units:
        if u.op == "call_module" or is_random(u, gm) or u.is_impure() or _mutates(u) \
                or any(_mutates(x) for x in u.users):
            continue
        closure: set[torch.fx.Node] = {u}
        for m in u.all_input_nodes:
            if m.op == "placeholder" or (m.op == "get_attr" and _free_attr(gm, m)):
                continue
            if m not in ok:
                break
            closure |= ok[m]
        else:
            ok[u] = frozenset(closure)
    flops = {n: _flops(n, bindings) for n in ok}
    out = set()
    for u, closure in ok.items():
        if not _is_tensor_value(u):
            continue
        size = max(node_info(u).output_bytes(bindings), MESSAGE_FLOOR_BYTES)
        if sum(flops[n] for n in closure) <= flops_per_byte * size:
            out.add(u.name)
    return frozenset(out)
