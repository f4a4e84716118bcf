"""The tensor-parallel pass: rewrite a traced graph into one tp rank's graph (Megatron-style).

Terms (see ``fxsplit.tp_plan``): t, column / row / vocab / replicate, region, blocks. The
rewritten graph is the SAME for every tp rank: sharded parameters become parameters of the local
shape on the meta device (same FQNs), and every rank-dependent offset is read at run time from the
group the axis name is bound to (``fxsplit.collectives.bind_groups``).

    plan = find_tp_plan(gm, 2)                          # inspect first (pure)
    gm = apply_tp_plan(gm, plan)                        # rewrite
    materialize_module(gm, plan.param_specs, tp_rank, source=model)   # real shards on this rank
    with bind_groups({"tp": tp_group}):
        logits = gm(idx)

    PassManager([partial(tensor_parallel, tp=2)])(gm, ctx)   # as a pass; plan in ctx.report

Rewrites (one forward all-reduce per region, collectives are graph nodes in f/g pairs):
column linear: its input goes through ``copy_to_region`` (f) once per region input; weight and
bias are the local shard (by blocks for fused projections). Row linear: the linear without bias,
``reduce_from_region`` (g), then the bias. Shape arguments carrying heads or width are the local
counts. Vocabulary embedding: ``tp_ops.vocab_parallel_embedding``. LM head: f, the column linear
on the vocabulary, then ``tp_ops.gather_logits`` -- or, with ``vocab_parallel_loss=True``, the
model returns the local logits and the loss must be ``tp_ops.vocab_parallel_cross_entropy``.
Written only against fxsplit's public API.
"""

from __future__ import annotations

import copy
import operator
from typing import Any, Mapping

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

import fxsplit
from fxsplit.collectives import copy_to_region, reduce_from_region
from fxsplit.pass_api import PassContext, PassResult
from fxsplit.sharding import ShardSpec, unshard_state_dict
from fxsplit.tp_ops import gather_logits, vocab_parallel_embedding
from fxsplit.tp_plan import TPPlan, TPPlanError, find_tp_plan, op_name

__all__ = ["tensor_parallel", "apply_tp_plan", "full_state_dict", "tp_graph_diff"]


def _local_val(val: Any, dim: int, size: int) -> Any:
    """A fake tensor like ``val`` with ``size`` on ``dim`` (same fake mode, dtype, device)."""
    shape = list(val.shape)
    shape[dim] = size
    mode = getattr(val, "fake_mode", None)
    if mode is None:
        return torch.empty(shape, dtype=val.dtype, device="meta").requires_grad_(val.requires_grad)
    with mode:
        out = torch.empty(shape, dtype=val.dtype, device=val.device)
    return out.requires_grad_(val.requires_grad) if val.requires_grad and val.is_floating_point() else out


def _owner(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    path, _, leaf = fqn.rpartition(".")
    return (root.get_submodule(path) if path else root), leaf


def _own_copy(gm: torch.fx.GraphModule, path: str, memo: dict[str, nn.Module]) -> nn.Module:
    """The module at ``path``, shallow-copied along the whole path from ``gm`` (once), so that
    replacing its parameters never touches the user's model (fx graph modules share submodules
    with the model they were traced from)."""
    if path in memo:
        return memo[path]
    if not path:
        return gm
    parent_path, _, leaf = path.rpartition(".")
    parent = _own_copy(gm, parent_path, memo)
    mod = copy.copy(parent._modules[leaf])
    mod._modules = dict(mod._modules)
    mod._parameters = dict(mod._parameters)
    mod._buffers = dict(mod._buffers)
    parent._modules[leaf] = mod
    memo[path] = mod
    return mod


def _shard_params(gm: torch.fx.GraphModule, plan: TPPlan) -> None:
    """Replace every sharded parameter by a meta parameter of its local shape (tied stay tied)."""
    done: dict[int, nn.Parameter] = {}
    memo: dict[str, nn.Module] = {}
    for fqn, spec in plan.param_specs.items():
        path, _, leaf = fqn.rpartition(".")
        owner = _own_copy(gm, path, memo)
        old = owner._parameters.get(leaf)
        if old is None:
            raise TPPlanError(f"apply_tp_plan: the plan shards {fqn!r}, which is not a parameter of this graph "
                              "module; apply a plan to the graph it was found on")
        new = done.get(id(old))
        if new is None:
            full = plan.full_shapes.get(fqn, tuple(old.shape))
            if tuple(old.shape) != tuple(full):
                raise TPPlanError(f"apply_tp_plan: {fqn!r} has shape {tuple(old.shape)}, the plan expects the full "
                                  f"shape {full}; was the plan applied already?")
            local = spec.local_shape(full)
            new = nn.Parameter(torch.empty(local, dtype=old.dtype, device="meta"), requires_grad=old.requires_grad)
            done[id(old)] = new
        owner._parameters[leaf] = new
        if isinstance(owner, nn.Linear) and leaf == "weight":
            owner.out_features, owner.in_features = new.shape[0], new.shape[1]


def _set_arg(node: torch.fx.Node, path: tuple, value: int) -> None:
    args = list(node.args)
    if len(path) == 1:
        args[path[0]] = value
    else:
        inner = list(args[path[0]])
        inner[path[1]] = value
        args[path[0]] = type(node.args[path[0]])(inner) if isinstance(node.args[path[0]], tuple) else inner
    node.args = tuple(args)


def _new(graph: torch.fx.Graph, target, args, kwargs=None, *, like: torch.fx.Node, val=None) -> torch.fx.Node:
    n = graph.call_function(target, tuple(args), dict(kwargs or {}))
    for key in ("nn_module_stack", "stack_trace"):
        if key in like.meta:
            n.meta[key] = like.meta[key]
    if val is not None:
        n.meta["val"] = val
    return n


def _is_view(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and op_name(node) in ("view", "reshape", "_unsafe_view")


def _linear_input(node: torch.fx.Node, plan: TPPlan) -> torch.fx.Node:
    info = plan.linears[node.name]
    return node.args[0] if info.kind == "module" else node.args[info.x_index]


def apply_tp_plan(gm: torch.fx.GraphModule, plan: TPPlan, *, axis: str = "tp") -> torch.fx.GraphModule:
    """Rewrite ``gm`` in place into the graph every tp rank runs; returns it."""
    if gm.meta.get("fxsplit_tp") is not None:
        raise TPPlanError("apply_tp_plan: this graph is already tensor parallel (gm.meta['fxsplit_tp'] is set); "
                          "apply a plan to the graph as traced")
    graph = gm.graph
    nodes = {n.name: n for n in graph.nodes}
    missing = [n for n in (*plan.linears, *plan.embeddings) if n not in nodes]
    if missing:
        raise TPPlanError(f"apply_tp_plan: the plan names nodes {missing[:3]} that this graph lacks; find the "
                          "plan on this graph (find_tp_plan(gm, tp))")
    t = plan.tp
    aten = torch.ops.aten
    is_export = any(isinstance(n.target, torch._ops.OpOverload) for n in graph.nodes)
    add = aten.add.Tensor if is_export else operator.add

    # 1. shape arguments and metadata of sharded values
    for name, path, value in plan.rewrites:
        _set_arg(nodes[name], path, value)
    for name, (dim, size) in plan.sharded_nodes.items():
        n = nodes[name]
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            n.meta["val"] = _local_val(val, dim, size // t)
        elif isinstance(val, (list, tuple)):
            n.meta["val"] = type(val)(_local_val(v, dim, int(v.shape[dim]) // t) for v in val)

    # 2. parameters -> local meta shapes; get_attr metadata follows
    _shard_params(gm, plan)
    for n in graph.nodes:
        if n.op == "get_attr" and str(n.target) in plan.param_specs:
            n.meta["val"] = None  # refilled with the local shape below

    # 3. f before the column linears of each region, once per source (placed before views of
    #    the source, so that under sequence parallelism the gather sees [B, T, C])
    for region in plan.regions:
        fs: dict[str, torch.fx.Node] = {}
        for c in region.columns:
            consumer, src = nodes[c], _linear_input(nodes[c], plan)
            while _is_view(src) and len(src.users) == 1 and isinstance(src.args[0], torch.fx.Node):
                consumer, src = src, src.args[0]
            if src.name not in fs:
                with graph.inserting_after(src):
                    fs[src.name] = _new(graph, copy_to_region, (src,), {"axis": axis}, like=src,
                                        val=src.meta.get("val"))
            consumer.replace_input_with(src, fs[src.name])

    # 4. row linears: linear without bias, (views back to [B, T, C]), g, bias
    for region in plan.regions:
        for r in region.rows:
            node, info = nodes[r], plan.linears[r]
            x = _linear_input(node, plan)
            val = node.meta.get("val")
            with graph.inserting_before(node):
                w = graph.get_attr(info.weight)
                w.meta["val"] = None
                if info.kind == "module":
                    y = _new(graph, F.linear, (x, w), like=node, val=val)
                elif info.kind == "linear":
                    y = _new(graph, aten.linear.default, (x, w), like=node, val=val)
                else:
                    y = _new(graph, aten.mm.default, (x, w), like=node, val=val)
            node.replace_all_uses_with(y)
            graph.erase_node(node)
            nodes.pop(r)
            end = y
            while len(end.users) == 1 and _is_view(next(iter(end.users))):
                end = next(iter(end.users))
            with graph.inserting_after(end):
                g = _new(graph, reduce_from_region, (end,), {"axis": axis}, like=node, val=end.meta.get("val"))
            out = g
            if info.bias is not None:
                with graph.inserting_after(g):
                    b = graph.get_attr(info.bias)
                with graph.inserting_after(b):
                    out = _new(graph, add, (g, b), like=node, val=end.meta.get("val"))
            end.replace_all_uses_with(out, delete_user_cb=lambda u: u is not g)

    # 5. vocabulary embeddings
    for name in plan.vocab_embeddings:
        node, e = nodes[name], plan.embeddings[name]
        ids = node.args[0] if e.kind == "module" else node.args[1]
        with graph.inserting_before(node):
            w = graph.get_attr(e.weight)
            emb = _new(graph, vocab_parallel_embedding, (ids, w, e.num_embeddings),
                       {"axis": axis, "padding_idx": e.padding_idx}, like=node, val=node.meta.get("val"))
        node.replace_all_uses_with(emb)
        graph.erase_node(node)

    # 6. LM heads: f, column on the vocabulary, gather (unless the loss is vocabulary-parallel)
    for name in plan.lm_heads:
        node = nodes[name]
        info = plan.linears[name]
        x = _linear_input(node, plan)
        with graph.inserting_before(node):
            f = _new(graph, copy_to_region, (x,), {"axis": axis}, like=node, val=x.meta.get("val"))
        node.replace_input_with(x, f)
        val = node.meta.get("val")
        spec = plan.param_specs[info.weight]
        local = (spec.pad_to or info.out_features) // t
        if isinstance(val, torch.Tensor):
            node.meta["val"] = _local_val(val, val.dim() - 1, local)
        if not plan.vocab_parallel_loss:
            with graph.inserting_after(node):
                gl = _new(graph, gather_logits, (node, plan.vocab_size), {"axis": axis}, like=node, val=val)
            node.replace_all_uses_with(gl, delete_user_cb=lambda u: u is not gl)

    graph.lint()
    gm.recompile()
    for n in graph.nodes:  # metadata contract: every node annotated
        if n.op == "get_attr" and n.meta.get("val") is None:
            n.meta["val"] = _param_val(gm, n, nodes)
        fxsplit.annotate_node(n, gm)
    gm.meta["fxsplit_tp"] = plan
    return gm


def _param_val(gm, n, nodes):
    owner, leaf = _owner(gm, str(n.target))
    p = getattr(owner, leaf)
    ref = next((m.meta.get("val") for m in nodes.values() if isinstance(m.meta.get("val"), torch.Tensor)
                and getattr(m.meta["val"], "fake_mode", None) is not None), None)
    mode = getattr(ref, "fake_mode", None)
    if mode is None:
        return torch.empty(p.shape, dtype=p.dtype, device="meta")
    with mode:
        return torch.empty(p.shape, dtype=p.dtype, device=ref.device)


def tensor_parallel(
    gm: torch.fx.GraphModule,
    ctx: PassContext,
    *,
    tp: int,
    plan: TPPlan | None = None,
    overrides: Mapping[str, str] | None = None,
    sequence_parallel: bool = False,
    vocab_parallel_loss: bool = False,
    axis: str = "tp",
) -> PassResult:
    """The pass: find (or take) the plan, record it in ``ctx.report["tensor_parallel"]`` and
    ``gm.meta["fxsplit_tp"]``, and rewrite ``gm`` into one tp rank's graph."""
    if plan is None:
        plan = find_tp_plan(gm, tp, overrides=overrides, sequence_parallel=sequence_parallel,
                            vocab_parallel_loss=vocab_parallel_loss)
    elif plan.tp != tp:
        raise TPPlanError(f"tensor_parallel: tp={tp} but the plan was found for t={plan.tp}")
    ctx.report["tensor_parallel"] = plan
    ctx.logger.info("tensor_parallel:\n%s", plan)
    if tp == 1:
        gm.meta["fxsplit_tp"] = plan
        return PassResult(gm, False)
    apply_tp_plan(gm, plan, axis=axis)
    return PassResult(gm, True)


def full_state_dict(per_rank: list[Mapping[str, torch.Tensor]], plan: TPPlan) -> dict[str, torch.Tensor]:
    """The original tensors with their original names from every tp rank's state dict."""
    return unshard_state_dict(per_rank, plan.param_specs)


def tp_graph_diff(before: torch.fx.GraphModule, after: torch.fx.GraphModule) -> str:
    """A unified diff of the generated code of the original graph and a tp rank's graph."""
    import difflib

    return "".join(difflib.unified_diff(before.code.splitlines(True), after.code.splitlines(True),
                                        "original", "tp rank"))
