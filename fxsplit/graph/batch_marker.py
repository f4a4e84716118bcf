"""Every batch size from one static trace at a marker batch.

[Note: a marker batch]
With the batch symbolic, torch.export makes a symbolic fake tensor per node and pays sympy for every
size the model computes: an 80-layer Llama export is 1.8x the static one, and everything after it
(costs, TP's local values) pays for the symbol again (benchmarks/README.md, issue 28 part 5).
Propagating symbolic values through a static graph afterwards costs as much (5.6 s of a 6.2 s
export), so the symbol is kept out of the graph's fake values altogether:

- the model is exported static at a *marker* batch ``P``: a prime (97 first, then the primes above it,
  then those below) that divides no size of a parameter, buffer or example input (the batch dims left
  out), no integer attribute of a module or of a Hugging Face config (a pad id compared with the token
  ids) and no sentinel integer (2**63 - 1);
- every integer argument of the graph that is a multiple of ``P`` is the batch times something
  (``P`` is prime: a product of the model's own sizes is never a multiple of it), so it is
  replaced by ``sym_size(input, 0) * k``: the graph runs at any batch, reading it from its input,
  as a symbolic export's graph does;
- the fake values stay static at ``P``; fxsplit's own size reading (``TensorMeta`` of a value:
  ``fxsplit.graph.shapes.tensor_metas``) reads a size that is a multiple of ``P`` as ``k * batch``
  (the graph's fake-tensor mode carries the marker, so values that passes make in that mode are
  read the same way), which is all that costs, memory, boundaries and the runtime's symbol
  binding see. The Llama-70B plan with no global batch: 1.34-1.43x a bare export (2.29-2.34x with
  symbolic fake values, ``dynamic_batch=True``, which keeps them).

What the marker cannot tell apart, it refuses and the batch is traced symbolic as before: a float
literal that may be computed from the batch (``k * P``, or ``k / P`` when not a multiple of 1/1024:
a mean written as ``x * (1 / b)``), a constant tensor of the graph with a dim that is a multiple of
``P``, a value with two sizes that are multiples of ``P`` (an in-batch similarity ``[b, b]``, or a
sum of the model's sizes that happens to be one: ``50 + 47``), no input at batch ``P``, an export at
``P`` that fails. A size computed from the batch in a way that is not a multiple of it (``b // 2``)
would stay static at its value for ``P``; such a graph fails at another batch with a shape error (a
view or expand of the wrong size), and ``fxsplit.verify`` runs every plan at the user's own example
batch, which is not ``P``. Passes that write sizes into the graph from the static values (a view's
shape, a new full tensor) write multiples of ``P``: ``rebatch`` runs again before the split
(``batch_literals`` in fxsplit.api.plan) and rewrites those too. Checked on every architecture of
the TP coverage matrix and every MoE family torch.export traces (``benchmarks/batch_marker.py``): all take the marker,
outputs equal to the model's at batches 1, 3 and 5.

    P = choose_marker(model, args, kwargs, batch)    # 97, or None when no prime is free
    why = mark_batch(gm, P, batch)                   # None: done; else why the marker cannot serve
    batch_dims(val)                                  # (fxsplit.graph.shapes) multiples of P read as k * batch
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from fxsplit.graph.meta import annotate_node
from fxsplit.graph.ops import resolve_path
from fxsplit.graph.shapes import EXAMPLE_ATTR, MARKER_ATTR, graph_marker

__all__ = ["MARKERS", "choose_marker", "mark_batch", "rebatch"]


def _primes(lo: int, hi: int) -> tuple[int, ...]:
    return tuple(n for n in range(lo, hi) if all(n % d for d in range(2, int(n ** 0.5) + 1)))


# 97 first (small enough that an example of real tensors repeated to it stays small), then the
# primes above it (a model of 126 layers has integer attributes up to 125), then the ones below
MARKERS = _primes(97, 1000) + tuple(reversed(_primes(11, 97)))
_SENTINELS = (2 ** 63 - 1, 2 ** 31 - 1, 2 ** 32, 2 ** 16)
_LIMIT = 2 ** 40  # a larger integer is a sentinel or an address, never a size of one microbatch
_sym_size = torch.ops.aten.sym_size.int


def choose_marker(model: torch.nn.Module, args: Any, kwargs: Any, batch: int | None) -> int | None:
    """The first prime of ``MARKERS`` dividing no size of ``model``'s parameters and buffers, of the
    example's tensors (dim 0 of those whose dim 0 is the example's ``batch`` left out) and no
    sentinel integer; None when every one does."""
    sizes: set[int] = set()
    for t in list(model.parameters()) + list(model.buffers()):
        sizes.update(int(s) for s in t.shape)
    sizes.update(_integers(model))
    for x in pytree.tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor):
            shape = [int(s) for s in x.shape]
            sizes.update(shape[1:] if shape and batch is not None and shape[0] == batch else shape)
    sizes.discard(0)
    for p in MARKERS:
        if not any(s % p == 0 for s in sizes) and not any(s % p == 0 for s in _SENTINELS):
            return p
    return None


def _integers(model: torch.nn.Module) -> set[int]:
    """The integers a model's code may compare or compute with: its modules' integer attributes
    (``padding_idx``, head counts) and its config's (token ids: an ``input_ids == pad_token_id``
    with the pad id a multiple of the marker would be rewritten as a size)."""
    out: set[int] = set()

    def add(v: Any, depth: int = 0) -> None:
        if type(v) is int:
            out.add(abs(v))
        elif isinstance(v, (list, tuple, set)) and depth < 2:
            for x in v:
                add(x, depth + 1)
        elif isinstance(v, dict) and depth < 2:
            for x in v.values():
                add(x, depth + 1)

    for m in model.modules():
        for v in vars(m).values():
            add(v)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        try:
            add(config.to_dict())
        except Exception:  # noqa: BLE001 -- a config that cannot list itself: its module attributes still count
            pass
    return out


def _is_marker_float(x: float, p: int) -> bool:
    """A float that may be computed from the batch: a multiple ``k * p`` (``float(b)``), or ``k / p``
    that is not a multiple of ``1 / 1024`` (``1 / b``; 0.5 is ``48.5 / 97``). Only sizes of one
    microbatch count: not a dtype's smallest value (-3.4e38) or an epsilon (1e-12)."""
    if not math.isfinite(x) or x == 0 or abs(x) > _LIMIT:
        return False
    q = x / p
    if abs(q) >= 1 and q == round(q):
        return True
    m = x * p
    return 1 <= abs(m) < 2 ** 20 and abs(m - round(m)) <= 1e-9 * abs(m) and x * 1024 != round(x * 1024)


def mark_batch(gm: torch.fx.GraphModule, p: int, example: int) -> str | None:
    """Make ``gm`` (exported static at batch ``p``) take any batch ([Note: a marker batch]), its batch
    symbol standing for ``example`` samples until bound; None when done, else why not (``gm`` is
    then unchanged)."""
    source = _batch_input(gm, p)
    if source is None:
        return f"no input has the marker batch {p} as its dim 0"
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            t = resolve_path(gm, str(node.target), default=None)
            if isinstance(t, torch.Tensor) and any(int(s) % p == 0 for s in t.shape if int(s)):
                return f"the constant {node.target} {tuple(t.shape)} has a dim of the batch"
        for x in pytree.tree_leaves((node.args, node.kwargs)):
            if type(x) is float and _is_marker_float(x, p):
                return f"node {node.name} ({node.target}) takes {x!r}, which may be computed from the batch"
        for v in pytree.tree_leaves(node.meta.get("val")):
            sizes = [s for s in v.shape if type(s) is int and s] if isinstance(v, torch.Tensor) else []
            if sum(1 for s in sizes if s % p == 0) > 1 or any(s % (p * p) == 0 for s in sizes):
                # the batch twice in one value (an in-batch similarity [b, b]), or a sum of the
                # model's sizes that is a multiple of p ([b, t, 50 + 47]): not told apart
                return f"node {node.name} has the value {tuple(v.shape)}, with the marker in more than one size"
    val = source.meta["val"]
    mode = getattr(val, "fake_mode", None)
    if mode is None:
        return "the graph's values are not fake tensors"
    rebatch(gm, p, source)
    if hasattr(gm, "validate_inputs"):  # export's input check would hold every call to batch p
        gm.validate_inputs = False
    setattr(mode, MARKER_ATTR, p)
    setattr(mode, EXAMPLE_ATTR, example)
    return None


def rebatch(gm: torch.fx.GraphModule, p: int | None = None, source: torch.fx.Node | None = None) -> int:
    """Replace every integer argument of ``gm`` that is a multiple of the marker ``p`` (the graph's
    own when None) by the batch times its factor, read from the batch input; returns how many."""
    p = graph_marker(gm) if p is None else p
    if p is None:
        return 0
    source = source or _batch_input(gm, p)
    if source is None:
        return 0
    made: dict[int, torch.fx.Node] = {}
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    anchor = [last]

    def expr(k: int) -> torch.fx.Node:  # the node of k * batch (k may be negative)
        if k not in made:
            with gm.graph.inserting_after(anchor[0]):
                if 1 not in made:
                    made[1] = gm.graph.call_function(_sym_size, (source, 0))
                    made[1].meta["val"] = p
                    anchor[0] = made[1]
            if k != 1:
                with gm.graph.inserting_after(anchor[0]):
                    made[k] = gm.graph.call_function(operator.mul, (made[1], k))
                    made[k].meta["val"] = p * k
                    anchor[0] = made[k]
        return made[k]

    existing = next((n for n in gm.graph.nodes if n.target is _sym_size and n.args == (source, 0)), None)
    if existing is not None:  # a second call (sizes a pass wrote): the batch read once
        made[1] = anchor[0] = existing
    count = 0
    for node in list(gm.graph.nodes):
        if node.op not in ("call_function", "call_method") or node in made.values():
            continue
        flat, spec = pytree.tree_flatten((node.args, node.kwargs))
        changed = False
        for i, x in enumerate(flat):
            if type(x) is int and x and abs(x) < _LIMIT and x % p == 0:
                flat[i] = expr(x // p)
                changed = True
        if changed:
            node.args, node.kwargs = pytree.tree_unflatten(flat, spec)
            count += 1
    if count:
        if "fxsplit" in source.meta:  # an annotated graph: the new size nodes carry metadata too
            for n in made.values():
                annotate_node(n, gm)
        gm.graph.lint()
        gm.recompile()
    return count


def _batch_input(gm: torch.fx.GraphModule, p: int) -> torch.fx.Node | None:
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if n.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == p:
            return n
    return None
