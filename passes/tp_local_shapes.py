"""Step 1 of the tensor-parallel pass (``passes/tensor_parallel.py``): shape arguments carrying
heads or width become the local counts, and every value the plan shards gets the metadata of its
local shape (``meta["val"]``), so the PassManager's metadata check ([Note: metadata check after a
pass] in fxsplit.graph.pass_check) holds after the pass: a t-th of the sharded dim, but the whole
blocks of a multi-query projection kept in full, and each piece of a split or unbind on its own
dim. Written only against fxsplit's public API.
"""

from __future__ import annotations

import operator
from typing import Any, Mapping

import torch
import torch.fx

from fxsplit.graph.meta import fake_like
from fxsplit.graph.ops import op_name
from fxsplit.passes.tp_operands import new_node as _new
from fxsplit.tp.plan import LocalSize, TPPlan

__all__ = ["local_shapes", "local_val"]


def local_val(val: Any, dim: int, size: int) -> Any:
    """A fake tensor like ``val`` with ``size`` on ``dim`` (same fake mode, dtype, device)."""
    shape = list(val.shape)
    shape[dim] = size
    out = fake_like(val, shape)  # [Note: fake tensors without dispatch] in fxsplit.graph.meta
    if getattr(val, "fake_mode", None) is None:
        return out.requires_grad_(val.requires_grad)
    return out.requires_grad_(val.requires_grad) if val.requires_grad and val.is_floating_point() else out


def _set_arg(node: torch.fx.Node, path: tuple, value: int) -> None:
    args = list(node.args)
    if len(path) == 1:
        args[path[0]] = value
    else:
        inner = list(args[path[0]])
        inner[path[1]] = value
        args[path[0]] = type(node.args[path[0]])(inner) if isinstance(node.args[path[0]], tuple) else inner
    node.args = tuple(args)


def local_shapes(gm: torch.fx.GraphModule, plan: TPPlan, nodes: Mapping[str, torch.fx.Node]) -> None:
    """Step 1: shape arguments and metadata of sharded values become local."""
    t = plan.tp
    for arg in plan.rewrite.shape_args:
        name, path, value = arg.node, arg.path, arg.value
        if isinstance(value, LocalSize):  # a size computed at run time: divide it there
            node = nodes[name]
            full = node.args[path[0]] if len(path) == 1 else node.args[path[0]][path[1]]
            with gm.graph.inserting_before(node):
                value = _new(gm.graph, operator.floordiv, (full, value.divisor), like=node,
                             val=full.meta.get("val") // value.divisor)
        _set_arg(nodes[name], path, value)
    fused = _whole_layouts(plan, nodes)
    for name, sharded in plan.rewrite.sharded_nodes.items():
        n, dim, size = nodes[name], sharded.dim, sharded.size
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):  # size -1: symbolic (a merged B * heads), from the traced shape
            local = fused[name] if name in fused else (size if size >= 0 else val.shape[dim]) // t
            n.meta["val"] = local_val(val, dim, local)
        elif isinstance(val, (list, tuple)):  # a split: its pieces kept whole keep their size
            whole = {u.args[1] for u in n.users if u.target is operator.getitem and u.name not in plan.rewrite.sharded_nodes}
            d = _piece_dim(n, dim)
            n.meta["val"] = type(val)(v if i in whole else local_val(v, d, int(v.shape[d]) // t)
                                      for i, v in enumerate(val))


def _piece_dim(node: torch.fx.Node, dim: int) -> int:
    """The sharded dim of each piece of a split (the input's ``dim``) or of an unbind (one dim fewer
    after the unbound one), where the plan records the input's."""
    x = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    if op_name(node) != "unbind" or not isinstance(x, torch.Tensor):
        return dim
    unbound = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    dim, unbound = dim % x.dim(), unbound % x.dim()
    return dim - 1 if dim > unbound else dim


def _whole_layouts(plan: TPPlan, nodes: Mapping[str, torch.fx.Node]) -> dict[str, int]:
    """The local size of the sharded dim of each value holding a fused projection whose weight
    keeps blocks whole (a multi-query k / v head, ``ShardSpec.whole``): the linear and the values
    that carry its layout on to its split (views, unsqueezes). Their sharded blocks are a t-th,
    the whole blocks full, as in the local weight; every other sharded value is a t-th."""
    out: dict[str, int] = {}
    for name, info in plan.rewrite.linears.items():
        spec = plan.param_specs.get(info.weight)
        if spec is None or not spec.whole or name not in nodes or info.weight not in plan.full_shapes:
            continue
        full = plan.full_shapes[info.weight]
        d = spec.dim % len(full)
        todo = [nodes[name]]
        while todo:
            n = todo.pop()
            sharded, val = plan.rewrite.sharded_nodes.get(n.name), n.meta.get("val")
            if (n.name in out or sharded is None or not isinstance(val, torch.Tensor)
                    or val.shape[sharded.dim] != full[d]):
                continue
            out[n.name] = spec.local_shape(full)[d]
            todo.extend(n.users)
    return out
