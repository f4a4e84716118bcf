"""The mixed-precision pass: the graph computes in ``param_dtype`` while the parameters stay as
they are (float32, what the optimizer sees).

Written only against fxsplit's public API. Terms: a **parameter read** is a ``get_attr`` of a
floating ``nn.Parameter``; a **floating model input** is a placeholder whose value is a floating
tensor. The pass

1. turns ``nn.Linear`` / ``nn.LayerNorm`` / ``nn.Embedding`` module calls into their functions
   over ``get_attr`` parameters (so every parameter read is a node), and refuses any other module
   call that owns floating parameters (name it in ``leaf_modules`` of nothing: trace into it);
2. casts every parameter read and every floating model input to ``param_dtype``
   (``weight.to(torch.bfloat16)`` in the graph dumps; its backward casts the gradient back, so
   gradients arrive in the parameter's own dtype);
3. casts every floating model output to ``output_dtype`` (float32: the loss is computed in float32);
4. propagates the values' dtypes again (``meta["val"]``), so the plan's boundary values
   (``ValueMeta``) travel in ``param_dtype``.

    PassManager([partial(mixed_precision, param_dtype=torch.bfloat16)])(gm, ctx)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from fxsplit.errors import PlanError
from fxsplit.graph.meta import annotate_node, keeping_symbols
from fxsplit.graph.pass_api import PassContext, PassResult

__all__ = ["mixed_precision"]


def _floating(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _functional(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """A Linear / LayerNorm / Embedding module call as its function over get_attr parameters."""
    mod = gm.get_submodule(str(node.target))
    graph = gm.graph
    with graph.inserting_before(node):
        w = graph.get_attr(f"{node.target}.weight")
        b = graph.get_attr(f"{node.target}.bias") if getattr(mod, "bias", None) is not None else None
        if isinstance(mod, nn.Linear):
            new = graph.call_function(F.linear, (node.args[0], w, b))
        elif isinstance(mod, nn.LayerNorm):
            new = graph.call_function(F.layer_norm, (node.args[0], tuple(mod.normalized_shape), w, b, mod.eps))
        else:
            new = graph.call_function(F.embedding, (node.args[0], w, mod.padding_idx, mod.max_norm,
                                                    mod.norm_type, mod.scale_grad_by_freq, mod.sparse))
    new.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace", "val")})
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def _cast(graph: torch.fx.Graph, node: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    users = [u for u in node.users]
    with graph.inserting_after(node):
        cast = graph.call_method("to", (node, dtype))
    cast.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")})
    for u in users:
        u.replace_input_with(node, cast)
    return cast


def _cast_at_each_use(graph: torch.fx.Graph, node: torch.fx.Node, dtype: torch.dtype,
                      users: list[torch.fx.Node]) -> None:
    """A cast of parameter ``node`` right before each of ``users``: a parameter read at the top
    of the graph and cast there would be cut into the first pipeline stage, and its bf16 copy sent
    to every later stage as an activation (with all parameters left on the first rank); cast at
    the use, the cast goes where the use goes (tagged with the user's module)."""
    for u in users:
        with graph.inserting_before(u):
            cast = graph.call_method("to", (node, dtype))
        cast.meta.update({k: v for k, v in u.meta.items() if k in ("nn_module_stack", "stack_trace")})
        u.replace_input_with(node, cast)


def _fake_mode(gm: torch.fx.GraphModule) -> Any:
    for n in gm.graph.nodes:
        mode = getattr(n.meta.get("val"), "fake_mode", None)
        if mode is not None:
            return mode
    return None


def _propagate_dtypes(gm: torch.fx.GraphModule) -> None:
    """Recompute ``meta["val"]`` node by node in the fake mode the trace used, from the values the
    inputs and parameter reads already have (so their shapes, TP-local and symbolic, are kept).
    A node that cannot run on them (a tensor-parallel op, which needs its process group; an op
    over sequence-parallel stand-ins) keeps its shape and takes the dtype of its first floating
    input, which is what elementwise and linear ops do."""
    mode = _fake_mode(gm)
    if mode is None:
        raise PlanError("mixed_precision needs fake-tensor values (meta['val']) on the graph's nodes; "
                        "trace with fxsplit.trace (fx or export), which propagates them")
    env: dict[torch.fx.Node, Any] = {}

    device = next(v.device for n in gm.graph.nodes if getattr(v := n.meta.get("val"), "fake_mode", None) is mode)

    def value(n: torch.fx.Node) -> Any:
        if n not in env:
            val = n.meta.get("val")
            if val is None and n.op == "get_attr" and _is_param(gm, str(n.target)):  # a parameter read the pass made
                p = gm.get_parameter(str(n.target))
                val = n.meta["val"] = torch.empty(p.shape, dtype=p.dtype, device=device).requires_grad_(p.requires_grad)
            env[n] = val
        return env[n]

    with mode, keeping_symbols():  # [Note: symbolic matmul on torch 2.11]
        for n in gm.graph.nodes:
            if n.op in ("placeholder", "get_attr", "output"):
                value(n)
                continue
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), value)
            if n.op == "call_function" and getattr(n.target, "__module__", "").startswith("fxsplit.tp"):
                # tensor-parallel ops need their process group to run; they keep shapes (TP-local
                # already) and compute in the dtype of their floating inputs
                env[n] = n.meta["val"] = _with_dtype(n.meta.get("val"), _floating_dtype((args, kwargs)))
                continue
            try:
                if n.op == "call_function":
                    out = n.target(*args, **kwargs)
                elif n.op == "call_method":
                    out = getattr(args[0], n.target)(*args[1:], **kwargs)
                else:
                    out = gm.get_submodule(str(n.target))(*args, **kwargs)
            except Exception:  # noqa: BLE001 -- values the TP pass left as shape-only stand-ins
                # (sequence-parallel shards): keep the shape, take the dtype of the floating inputs
                out = _with_dtype(n.meta.get("val"), _floating_dtype((args, kwargs)))
            env[n] = out
            n.meta["val"] = out


def _floating_dtype(tree: Any) -> torch.dtype | None:
    for leaf in torch.utils._pytree.tree_leaves(tree):
        if _floating(leaf):
            return leaf.dtype
    return None


def _with_dtype(val: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return val
    return torch.utils._pytree.tree_map(
        lambda v: v.to(dtype) if _floating(v) and v.dtype != dtype else v, val)


def mixed_precision(gm: torch.fx.GraphModule, ctx: PassContext, *, param_dtype: torch.dtype,
                    output_dtype: torch.dtype = torch.float32) -> PassResult:
    """Compute in ``param_dtype`` (see the module docstring); the parameters are not touched."""
    if not param_dtype.is_floating_point:
        raise PlanError(f"mixed_precision: param_dtype must be a floating dtype, got {param_dtype}")
    graph = gm.graph
    for n in list(graph.nodes):
        if n.op != "call_module":
            continue
        mod = gm.get_submodule(str(n.target))
        if isinstance(mod, (nn.Linear, nn.LayerNorm, nn.Embedding)) and getattr(mod, "weight", None) is not None:
            _functional(gm, n)
        elif any(p.is_floating_point() for p in mod.parameters()):
            raise PlanError(
                f"mixed_precision: module call {n.name!r} ({n.target}, {type(mod).__name__}) owns parameters "
                "the pass cannot cast (only Linear, LayerNorm and Embedding calls are rewritten); trace into "
                "it: leave it out of leaf_modules, or use method='export'"
            )
    casts = 0
    for n in list(graph.nodes):
        if n.op == "get_attr":
            obj = gm.get_parameter(str(n.target)) if _is_param(gm, str(n.target)) else None
            if obj is not None and obj.is_floating_point() and obj.dtype != param_dtype and n.users:
                # a replicated parameter read through Megatron's f (sequence parallelism) has its
                # gradient summed over tp by f's backward: cast after f, so the sum runs in the
                # parameter's own dtype
                through_f = [u for u in n.users if getattr(u.target, "__name__", "") == "copy_to_region"]
                for u in through_f:
                    _cast(graph, u, param_dtype)
                _cast_at_each_use(graph, n, param_dtype, [u for u in n.users if u not in through_f])
                casts += 1
        elif n.op == "placeholder" and _floating(n.meta.get("val")) and n.meta["val"].dtype != param_dtype and n.users:
            _cast(graph, n, param_dtype)
            casts += 1
    out = next(n for n in reversed(graph.nodes) if n.op == "output")

    def to_output_dtype(a: torch.fx.Node) -> torch.fx.Node:
        if not _floating(a.meta.get("val")):
            return a
        with graph.inserting_before(out):
            return graph.call_method("to", (a, output_dtype))

    out.args = torch.fx.node.map_arg(out.args, to_output_dtype)
    graph.lint()
    gm.recompile()
    _propagate_dtypes(gm)
    for n in graph.nodes:
        annotate_node(n, gm)
    ctx.report["mixed_precision"] = f"{casts} casts to {param_dtype}; outputs in {output_dtype}"
    return PassResult(gm, True)


def _is_param(gm: torch.fx.GraphModule, target: str) -> bool:
    try:
        gm.get_parameter(target)
        return True
    except AttributeError:
        return False
