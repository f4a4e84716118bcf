"""The tensor-parallel pass: rewrite a traced graph into one tp rank's graph (Megatron-style).

Terms (see ``fxsplit.tp.plan``): t, column / row / vocab / replicate, region, blocks. The
rewritten graph is the SAME for every tp rank: sharded parameters become parameters of the local
shape on the meta device (same FQNs), and every rank-dependent offset is read at run time from the
group the axis name is bound to (``fxsplit.tp.collectives.bind_groups``).

    plan = find_tp_plan(gm, 2)                          # inspect first (pure)
    gm = apply_tp_plan(gm, plan)                        # rewrite
    materialize_module(gm, plan.param_specs, tp_rank, source=model)   # real shards on this rank
    with bind_groups({"tp": tp_group}):
        logits = gm(idx)

    PassManager([partial(tensor_parallel, tp=2)])(gm, ctx)   # as a pass; plan in ctx.report

Rewrites (one forward all-reduce per region, collectives are graph nodes in f/g pairs):
column linear: its input goes through ``copy_to_region`` (f) once per region input; weight and
bias are the local shard (by blocks for fused projections). Where every reader of a region's f
is a plain [out, in] linear (nn.Linear, F.linear, aten.linear: q/k/v, gate/up, up), f and those
linears become ONE ``tp_ops.column_parallel_linear`` node (outputs read by getitem) whose
backward starts f's all-reduce before the weight gradients and waits after them (Megatron's
async tensor-model-parallel all-reduce); not under sequence parallelism. Row linear: the linear without bias,
``reduce_from_region`` (g), then the bias. Shape arguments carrying heads or width are the local
counts. Vocabulary embedding: ``tp_ops.vocab_parallel_embedding``. LM head: f, the column linear
on the vocabulary, then ``tp_ops.gather_logits`` -- or, with ``vocab_parallel_loss=True``, the
model returns the local logits and the loss must be ``tp_ops.vocab_parallel_cross_entropy``.
With ``sequence_parallel=True`` (Megatron-3) the activations between regions are sharded along
the sequence (dim 1 of [B, T, C]; T must divide by t at run time): see ``_sequence_parallel``.
Random ops on a shard (dropout on head-sharded attention probabilities, on column-parallel
outputs, on sequence shards) run under ``fxsplit.tp.random``'s tp stream, so each tp rank draws
its own mask; random ops on replicated values are untouched ([Note: RNG streams]).
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

from fxsplit.tp.collectives import (copy_to_region, gather_from_region, gather_to_region, reduce_from_region,
                                 reduce_scatter_to_region, scatter_to_region)
from fxsplit.graph.meta import annotate_node
from fxsplit.graph.pass_api import PassContext, PassResult
from fxsplit.tp.sharding import unshard_state_dict
from fxsplit.tp.functional import column_parallel_linear, gather_logits, vocab_parallel_embedding
from fxsplit.tp.plan import TPPlan, TPPlanError, find_tp_plan, op_name
from fxsplit.tp.random import call_in_tp_stream, in_tp_stream, is_random

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
    sharded_random = [n for n in graph.nodes if n.name in plan.sharded_nodes and is_random(n, gm)]
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
    region_fs: list[torch.fx.Node] = []
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
                    region_fs.append(fs[src.name])
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

    if plan.sequence_parallel:
        on_sequence = _sequence_parallel(gm, plan, axis)
        sharded_random += [n for n in on_sequence if n not in sharded_random and is_random(n, gm)]
    else:
        for f in region_fs:
            _fuse_columns(gm, plan, f, axis)
    for n in sharded_random:
        _to_tp_stream(gm, n, axis)
    graph.lint()
    gm.recompile()
    for n in graph.nodes:  # metadata contract: every node annotated
        if n.op == "get_attr" and n.meta.get("val") is None and isinstance(_attr(gm, n), torch.Tensor):
            n.meta["val"] = _param_val(gm, n, nodes)
        elif n.target is copy_to_region and n.meta.get("val") is None:
            n.meta["val"] = n.args[0].meta.get("val")
        annotate_node(n, gm)
    for n in list(graph.nodes):
        if n.target is column_parallel_linear:
            _cost_as_linears(gm, n)
    gm.meta["fxsplit_tp"] = plan
    return gm


def _attr(gm: torch.fx.GraphModule, n: torch.fx.Node) -> Any:
    owner, leaf = _owner(gm, str(n.target))
    return getattr(owner, leaf)


def _to_tp_stream(gm: torch.fx.GraphModule, node: torch.fx.Node, axis: str) -> None:
    """[Note: RNG streams] in fxsplit.tp.random: a random op on a tp shard draws from this tp
    rank's own stream: ``f(x)`` becomes ``in_tp_stream(f)(x, tp_axis=axis)``, a leaf module call
    ``drop(x)`` becomes ``call_in_tp_stream(drop, x, tp_axis=axis)`` (the module read by get_attr,
    so it keeps its ``training`` flag)."""
    graph = gm.graph
    if node.op == "call_module":
        with graph.inserting_before(node):
            mod = graph.get_attr(str(node.target))
            new = _new(graph, call_in_tp_stream, (mod, *node.args), {**node.kwargs, "tp_axis": axis}, like=node,
                       val=node.meta.get("val"))
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    elif node.op == "call_function":
        node.target = in_tp_stream(node.target)
        node.kwargs = {**node.kwargs, "tp_axis": axis}
    else:  # a random call_method (x.bernoulli_()): left on the stage stream
        return


def _cost_as_linears(gm: torch.fx.GraphModule, fused: torch.fx.Node) -> None:
    """The cost model does not know ``column_parallel_linear``: give the node the cost of its
    linears (each costed as an F.linear node at the fused node's place)."""
    from fxsplit.graph.cost import node_cost

    graph, total = gm.graph, None
    x, ws, bs = fused.args[:3]
    for i, (w, b) in enumerate(zip(ws, bs)):
        with graph.inserting_before(fused):
            tmp = graph.call_function(F.linear, (x, w, b))
        tmp.meta["val"] = fused.meta["val"][i]
        try:
            cost = node_cost(tmp, gm)
        finally:
            graph.erase_node(tmp)
        total = cost if total is None else total + cost
    fused.meta["fxsplit"] = fused.meta["fxsplit"].replace(cost=total)


def _fuse_columns(gm: torch.fx.GraphModule, plan: TPPlan, f: torch.fx.Node, axis: str) -> None:
    """Replace f and the column linears reading it by one ``tp_ops.column_parallel_linear`` node
    (one output per linear, read by getitem), whose backward overlaps f's all-reduce with the
    weight gradients. Only when every user of f is a plain [out, in] linear reading f as its
    input (nn.Linear module, F.linear or aten.linear); otherwise f and the linears stay."""
    graph = gm.graph
    users = list(f.users)
    if not users:
        return
    for u in users:
        info = plan.linears.get(u.name)
        if info is None or info.out_dim != 0 or info.kind not in ("module", "linear") or u.kwargs:
            return
        if info.kind == "module":
            mod = gm.get_submodule(str(u.target))
            if type(mod) is not nn.Linear or u.args != (f,):
                return
        elif u.args[0] is not f or f in u.args[1:] or len(u.args) > 3:
            return
    order = {n: i for i, n in enumerate(graph.nodes)}
    users.sort(key=order.__getitem__)
    weights = [plan.linears[u.name].weight for u in users]
    biases = [plan.linears[u.name].bias for u in users]
    stacks = [list((u.meta.get("nn_module_stack") or {}).items()) for u in users]
    common = stacks[0][:-1] if stacks[0] else []
    for st in stacks[1:]:
        k = 0
        while k < min(len(common), len(st)) and common[k][0] == st[k][0]:
            k += 1
        common = common[:k]
    with graph.inserting_before(f.next):
        ws = [graph.get_attr(w) for w in weights]
        bs = [graph.get_attr(b) if b is not None else None for b in biases]
        fused = _new(graph, column_parallel_linear, (f.args[0], ws, bs), {"axis": axis}, like=f,
                     val=tuple(u.meta.get("val") for u in users))
        fused.meta["nn_module_stack"] = dict(common)
        fused.meta.pop("stack_trace", None)
        outs = [_new(graph, operator.getitem, (fused, i), like=u, val=u.meta.get("val")) for i, u in enumerate(users)]
    for u, out in zip(users, outs):
        old_attrs = [a for a in u.all_input_nodes if a.op == "get_attr"]
        u.replace_all_uses_with(out)
        graph.erase_node(u)
        for a in old_attrs:
            if not a.users:
                graph.erase_node(a)
    graph.erase_node(f)


# ------------------------------------------------------------------------------------------------
# sequence parallelism (Megatron-3)

_SP_REDUCTIONS = ("mean", "sum", "amax", "var")


def _sequence_parallel(gm: torch.fx.GraphModule, plan: TPPlan, axis: str) -> list[torch.fx.Node]:
    """Shard the activations between regions along the sequence (dim 1 of [B, T, C]).

    The residual stream after the vocabulary embedding is scattered along the sequence; f before
    a region becomes an all-gather along the sequence (``gather_to_region``: backward
    reduce-scatter), g after a region a reduce-scatter (``reduce_scatter_to_region``); norms,
    dropout, pointwise ops, per-token linears and reductions over other dims run on the shard.
    Parameters read on the shard (norm weights, row biases) go through ``copy_to_region`` so
    their gradients are summed over the tp ranks; a replicated operand that spans the sequence
    is scattered too. Any other consumer gets the value all-gathered first (``gather_from_region``),
    so nothing downstream changes: e.g. the model output. Returns the nodes left on a sequence
    shard (their random ops then draw from the tp stream).
    """
    graph, t = gm.graph, plan.tp
    seq: dict[torch.fx.Node, int] = {}  # node -> sequence dim of its local shard
    shape_of: dict[torch.fx.Node, int] = {}  # fx getattr(x, "shape") of a sharded x
    orig = {n: n.meta.get("val") for n in graph.nodes}
    for n in graph.nodes:  # parameters read by get_attr nodes added above (no val yet)
        if n.op == "get_attr" and orig[n] is None:
            owner, leaf = _owner(gm, str(n.target))
            orig[n] = getattr(owner, leaf)
    gathered: list[torch.fx.Node] = []
    params = {id(p) for p in gm.parameters()}

    def insert(target, args, kwargs, before, like):
        with graph.inserting_before(before):
            return _new(graph, target, args, kwargs, like=like)

    def is_grad_param(x) -> bool:
        if not isinstance(x, torch.fx.Node) or x.op != "get_attr":
            return False
        owner, leaf = _owner(gm, str(x.target))
        return id(getattr(owner, leaf)) in params and getattr(owner, leaf).requires_grad

    def summed(node, x):  # f on a replicated operand read by the shard: gradients summed over tp
        if not isinstance(x, torch.fx.Node):
            return
        if x.op == "get_attr" and not is_grad_param(x):
            return  # a buffer or constant: no gradient
        if x.op != "get_attr" and not isinstance(orig.get(x, x.meta.get("val")), torch.Tensor):
            return
        c = insert(copy_to_region, (x,), {"axis": axis}, node, x)
        orig[c] = orig.get(x, x.meta.get("val"))
        node.replace_input_with(x, c)

    def gather_input(node, x):
        g = insert(gather_from_region, (x,), {"dim": seq[x], "axis": axis}, node, x)
        orig[g] = orig.get(x)
        gathered.append(g)
        node.replace_input_with(x, g)

    for node in list(graph.nodes):
        name = op_name(node, gm)
        if node.op == "call_function" and node.target is vocab_parallel_embedding:
            with graph.inserting_after(node):
                sc = _new(graph, scatter_to_region, (node,), {"dim": 1, "axis": axis}, like=node)
            node.replace_all_uses_with(sc, delete_user_cb=lambda u: u is not sc)
            orig[sc] = orig[node]
            seq[sc] = 1
            continue
        if node.op == "call_function" and node.target is reduce_from_region:
            v = orig.get(node.args[0])
            if isinstance(v, torch.Tensor) and v.dim() >= 3:
                node.target = reduce_scatter_to_region
                node.kwargs = {"dim": 1, "axis": axis}
                seq[node] = 1
            continue
        if node in shape_of or any(a in shape_of for a in node.all_input_nodes):
            src = next(a for a in node.all_input_nodes if a in shape_of)
            if name == "getitem" and node.args[1] == shape_of[src]:
                _times_t(graph, node, t)
            continue
        ins = [a for a in node.all_input_nodes if a in seq]
        if not ins:
            continue
        x = node.args[0] if node.args else None
        if node.op == "call_function" and node.target is copy_to_region:
            node.target, node.kwargs = gather_to_region, {"dim": seq[x], "axis": axis}
            continue
        if name == "getattr" and node.args[1] == "shape":
            shape_of[node] = seq[x]
            continue
        if name in ("size", "sym_size") and len(node.args) > 1:
            if _norm_dim(node.args[1], orig[x].dim()) == seq[x]:
                _times_t(graph, node, t)
            continue
        out = orig.get(node)
        if not isinstance(out, torch.Tensor):
            for a in ins:
                gather_input(node, a)
            continue
        n = out.dim()
        if node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), (nn.LayerNorm, nn.Linear)):
            node = _module_to_function(gm, node)
            name = op_name(node, gm)
            orig[node] = out
        ok = False
        if (_pointwise(node, name)) and all(a in seq for a in ins):
            dims = {seq[a] + n - orig[a].dim() for a in ins}
            if len(dims) == 1:
                (d,) = dims
                for a in list(node.all_input_nodes):
                    va = orig.get(a, a.meta.get("val"))
                    if a in seq or not isinstance(va, torch.Tensor):
                        continue
                    pos = d - (n - va.dim())
                    if pos >= 0 and va.shape[pos] != 1:
                        sc = insert(scatter_to_region, (a,), {"dim": pos, "axis": axis}, node, a)
                        orig[sc] = va
                        node.replace_input_with(a, sc)
                    else:
                        summed(node, a)
                seq[node], ok = d, True
        elif name in ("layer_norm", "native_layer_norm", "linear") and x in seq and seq[x] < orig[x].dim() - 1:
            for a in node.args[1:]:
                if isinstance(a, torch.fx.Node):
                    summed(node, a)
            seq[node], ok = seq[x], True
        elif name in _SP_REDUCTIONS and x in seq and len(node.args) > 1 and isinstance(node.args[1], (list, tuple)):
            keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
            dims = [_norm_dim(d, orig[x].dim()) for d in node.args[1]]
            if keep and seq[x] not in dims:
                seq[node], ok = seq[x], True
        if not ok:
            for a in ins:
                gather_input(node, a)
    for node, d in seq.items():
        v = orig.get(node)
        if isinstance(v, torch.Tensor):
            node.meta["val"] = _local_val(v, d, v.shape[d] // t)
    for node in graph.nodes:
        if node.op != "get_attr" and node.meta.get("val") is None and isinstance(orig.get(node), torch.Tensor):
            node.meta["val"] = orig[node]
    return list(seq)


def _norm_dim(d: int, n: int) -> int:
    return d % n if n else d


def _pointwise(node: torch.fx.Node, name: str) -> bool:
    if node.op == "call_function" and node.target in (copy_to_region, gather_from_region):
        return False
    if name in ("dropout", "gelu", "silu", "relu", "tanh", "sigmoid", "alias", "add", "sub", "mul", "div", "neg",
                "pow", "to", "float", "type_as", "contiguous", "clone", "_to_copy", "rsqrt", "sqrt", "exp"):
        return True
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags


def _times_t(graph: torch.fx.Graph, node: torch.fx.Node, t: int) -> None:
    """A size read from a sequence shard means the whole sequence: multiply it by t."""
    with graph.inserting_after(node):
        m = graph.call_function(operator.mul, (node, t))
    m.meta["val"] = node.meta.get("val")
    node.replace_all_uses_with(m, delete_user_cb=lambda u: u is not m)


def _module_to_function(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.Node:
    """nn.LayerNorm / nn.Linear call_module -> F.layer_norm / F.linear with get_attr parameters."""
    graph, mod = gm.graph, gm.get_submodule(str(node.target))
    with graph.inserting_before(node):
        w = graph.get_attr(f"{node.target}.weight") if mod.weight is not None else None
        b = graph.get_attr(f"{node.target}.bias") if getattr(mod, "bias", None) is not None else None
        if isinstance(mod, nn.LayerNorm):
            new = _new(graph, F.layer_norm, (node.args[0], tuple(mod.normalized_shape), w, b, mod.eps), like=node,
                       val=node.meta.get("val"))
        else:
            new = _new(graph, F.linear, (node.args[0], w, b), like=node, val=node.meta.get("val"))
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


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
