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
linears become ONE ``fxsplit.tp.functional.column_parallel_linear`` node (outputs read by getitem) whose
backward starts f's all-reduce before the weight gradients and waits after them (Megatron's
async tensor-model-parallel all-reduce); not under sequence parallelism. Row linear: the linear without bias,
``reduce_from_region`` (g), then the bias. Shape arguments carrying heads or width are the local
counts. Vocabulary embedding: ``fxsplit.tp.functional.vocab_parallel_embedding``. LM head: f, the column linear
on the vocabulary, then ``fxsplit.tp.functional.gather_logits`` -- or, with ``vocab_parallel_loss=True``, the
model returns the local logits and the loss must be ``fxsplit.tp.functional.vocab_parallel_cross_entropy``.
With ``sequence_parallel=True`` (Megatron-3) the activations between regions are sharded along
the sequence (dim 1 of [B, T, C]; T must divide by t at run time), as ``plan.rewrite.sequence_plan``
records (``fxsplit.tp.sequence``): see ``_sequence_parallel``.
Random ops on a shard (dropout on head-sharded attention probabilities, on column-parallel
outputs, on sequence shards) run under ``fxsplit.tp.random``'s tp stream, so each tp rank draws
its own mask; random ops on replicated values are untouched ([Note: RNG streams]).
Written only against fxsplit's public API.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from fxsplit.tp.collectives import (COLLECTIVE_OPS, copy_to_region, gather_from_region, gather_to_region,
                                   reduce_from_region, reduce_scatter_to_region, scatter_to_region)
from fxsplit.graph.meta import annotate_graph, fake_like
from fxsplit.graph.ops import op_name, resolve_path
from fxsplit.graph.pass_api import PassContext, PassResult
from fxsplit.tp.plan import SequenceParallelPlan
from fxsplit.tp.sharding import unshard_state_dict
from fxsplit.tp.functional import column_parallel_linear, gather_logits, vocab_parallel_embedding
from fxsplit.tp.plan import TPPlan, TPPlanError, find_tp_plan
from fxsplit.tp.random import call_in_tp_stream, in_tp_stream, is_random
from fxsplit.passes.tp_local_shapes import local_shapes, local_val as _local_val
from fxsplit.passes.tp_operands import (grouped_weights, matmuls_as_linears, new_node as _new, partial_sums,
                                       scatter_operands, sum_grads, whole_blocks)

__all__ = ["tensor_parallel", "apply_tp_plan", "full_state_dict", "tp_graph_diff"]


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
    """Step 2: replace every sharded parameter by a meta parameter of its local shape (tied stay
    tied); the metadata of get_attr nodes reading them is refilled with the local shape last."""
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
    for n in gm.graph.nodes:
        if n.op == "get_attr" and str(n.target) in plan.param_specs:
            n.meta["val"] = None  # refilled with the local shape by _finish


def _is_view(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and op_name(node) in ("view", "reshape")


def _linear_input(node: torch.fx.Node, plan: TPPlan) -> torch.fx.Node:
    info = plan.rewrite.linears[node.name]
    return node.args[0] if info.kind == "module" else node.args[info.x_index]


def apply_tp_plan(gm: torch.fx.GraphModule, plan: TPPlan, *, axis: str = "tp") -> torch.fx.GraphModule:
    """Rewrite ``gm`` in place into the graph every tp rank runs; returns it.

    Steps, in order: local shapes (``passes.tp_local_shapes.local_shapes``), local parameters
    (:func:`_shard_params`), f before each region (:func:`_insert_fs`), row linears and g
    (:func:`_rewrite_rows`), vocabulary embeddings (:func:`_rewrite_vocab_embeddings`), LM heads
    (:func:`_rewrite_lm_heads`); then sequence parallelism (:func:`_sequence_parallel`) or the
    fused column linears (:func:`_fuse_columns`); random ops on a shard onto the tp stream
    (:func:`_to_tp_stream`); last the metadata contract (:func:`_finish`).
    """
    nodes = _check_applicable(gm, plan)
    sharded_random = [n for n in gm.graph.nodes if n.name in plan.rewrite.sharded_nodes and is_random(n, gm)]
    head_inputs = {h: _linear_input(nodes[h], plan).name for h in plan.rewrite.lm_heads}  # as traced
    matmuls_as_linears(gm, plan, nodes)
    local_shapes(gm, plan, nodes)
    _shard_params(gm, plan)
    grouped_weights(plan, nodes, _local_val)
    whole_blocks(gm, plan, nodes, axis, _module_to_function)
    sum_grads(gm, plan, nodes, axis, _module_to_function)
    scatter_operands(gm, plan, nodes, axis, _local_val)
    partial_sums(gm, plan, nodes, axis)
    region_fs = _insert_fs(gm, plan, nodes, axis)
    rows = _rewrite_rows(gm, plan, nodes, axis)
    embeddings = _rewrite_vocab_embeddings(gm, plan, nodes, axis)
    heads = _rewrite_lm_heads(gm, plan, nodes, axis)
    if plan.sequence_parallel:
        done = _Rewritten(region_fs, rows, embeddings, {h: (head_inputs[h], *fg) for h, fg in heads.items()})
        on_sequence = _sequence_parallel(gm, plan, axis, done)
        sharded_random += [n for n in on_sequence if n not in sharded_random and is_random(n, gm)]
    else:
        for _, f in region_fs:
            _fuse_columns(gm, plan, f, axis)
    for n in sharded_random:
        _to_tp_stream(gm, n, axis)
    _finish(gm, plan, nodes)
    return gm


def _check_applicable(gm: torch.fx.GraphModule, plan: TPPlan) -> dict[str, torch.fx.Node]:
    """The graph's nodes by name, once the plan is known to fit this graph as traced."""
    if gm.meta.get("fxsplit_tp") is not None:
        raise TPPlanError("apply_tp_plan: this graph is already tensor parallel (gm.meta['fxsplit_tp'] is set); "
                          "apply a plan to the graph as traced")
    nodes = {n.name: n for n in gm.graph.nodes}
    missing = [n for n in (*plan.rewrite.linears, *plan.rewrite.embeddings) if n not in nodes]
    if missing:
        raise TPPlanError(f"apply_tp_plan: the plan names nodes {missing[:3]} that this graph lacks; find the "
                          "plan on this graph (find_tp_plan(gm, tp))")
    return nodes


def _insert_fs(gm: torch.fx.GraphModule, plan: TPPlan, nodes: Mapping[str, torch.fx.Node],
               axis: str) -> list[tuple[str, torch.fx.Node]]:
    """Step 3: f before the column linears of each region, once per source (placed before views
    of the source, so that under sequence parallelism the gather sees [B, T, C]); (source, f)."""
    graph = gm.graph
    region_fs: list[tuple[str, torch.fx.Node]] = []
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
                    region_fs.append((src.name, fs[src.name]))
            consumer.replace_input_with(src, fs[src.name])
    return region_fs


def _rewrite_rows(gm: torch.fx.GraphModule, plan: TPPlan, nodes: dict[str, torch.fx.Node],
                  axis: str) -> dict[str, tuple[str, torch.fx.Node, torch.fx.Node]]:
    """Step 4: each row linear becomes the linear without bias, (views back to [B, T, C]), g, bias.
    Returns row -> (the traced name of the value g reduces, g, the node its readers now read)."""
    graph = gm.graph
    done: dict[str, tuple[str, torch.fx.Node, torch.fx.Node]] = {}
    aten = torch.ops.aten
    is_export = any(isinstance(n.target, torch._ops.OpOverload) for n in graph.nodes)
    add = aten.add.Tensor if is_export else operator.add
    for region in plan.regions:
        for r in region.rows:
            node, info = nodes[r], plan.rewrite.linears[r]
            x = _linear_input(node, plan)
            val = node.meta.get("val")
            if info.kind in ("grouped", "batched"):  # no bias: the expert matmul stays, g after it
                y = node
            else:
                y = _row_without_bias(graph, node, info, x, val)
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
            done[r] = (r if end is y else end.name, g, out)
    return done


def _row_without_bias(graph: torch.fx.Graph, node: torch.fx.Node, info, x, val) -> torch.fx.Node:
    """A row linear's replacement: the same product, its bias left for after g."""
    aten = torch.ops.aten
    with graph.inserting_before(node):
        w = graph.get_attr(info.weight)
        w.meta["val"] = None
        if info.kind == "module":
            return _new(graph, F.linear, (x, w), like=node, val=val)
        if info.kind in ("linear", "matmul"):  # matmul: made a linear in step 0
            return _new(graph, aten.linear.default, (x, w), like=node, val=val)
        return _new(graph, aten.mm.default, (x, w), like=node, val=val)


def _rewrite_vocab_embeddings(gm: torch.fx.GraphModule, plan: TPPlan, nodes: Mapping[str, torch.fx.Node],
                              axis: str) -> dict[str, torch.fx.Node]:
    """Step 5: each vocabulary embedding becomes ``fxsplit.tp.functional.vocab_parallel_embedding``
    (returned by name)."""
    graph = gm.graph
    done: dict[str, torch.fx.Node] = {}
    for name in plan.rewrite.vocab_embeddings:
        node, e = nodes[name], plan.rewrite.embeddings[name]
        ids = node.args[0] if e.kind == "module" else node.args[1]
        with graph.inserting_before(node):
            w = graph.get_attr(e.weight)
            emb = _new(graph, vocab_parallel_embedding, (ids, w, e.num_embeddings),
                       {"axis": axis, "padding_idx": e.padding_idx}, like=node, val=node.meta.get("val"))
        node.replace_all_uses_with(emb)
        graph.erase_node(node)
        done[name] = emb
    return done


def _rewrite_lm_heads(gm: torch.fx.GraphModule, plan: TPPlan, nodes: Mapping[str, torch.fx.Node],
                      axis: str) -> dict[str, tuple[torch.fx.Node, torch.fx.Node | None]]:
    """Step 6: LM heads: f, column on the vocabulary, gather (unless the loss is vocabulary-parallel).
    Returns head -> (f, the gather or None)."""
    graph, t = gm.graph, plan.tp
    done: dict[str, tuple[torch.fx.Node, torch.fx.Node | None]] = {}
    for name in plan.rewrite.lm_heads:
        node = nodes[name]
        info = plan.rewrite.linears[name]
        x = _linear_input(node, plan)
        with graph.inserting_before(node):
            f = _new(graph, copy_to_region, (x,), {"axis": axis}, like=node, val=x.meta.get("val"))
        node.replace_input_with(x, f)
        val = node.meta.get("val")
        spec = plan.param_specs[info.weight]
        local = (spec.pad_to or info.out_features) // t
        if isinstance(val, torch.Tensor):
            node.meta["val"] = _local_val(val, val.dim() - 1, local)
        gl = None
        if not plan.vocab_parallel_loss:
            with graph.inserting_after(node):
                gl = _new(graph, gather_logits, (node, plan.vocab_size), {"axis": axis}, like=node, val=val)
            node.replace_all_uses_with(gl, delete_user_cb=lambda u: u is not gl)
        done[name] = (f, gl)
    return done


def _finish(gm: torch.fx.GraphModule, plan: TPPlan, nodes: Mapping[str, torch.fx.Node]) -> None:
    """Last: lint and recompile, every node annotated (the metadata contract, local shapes), the
    fused column linears costed as their linears, the plan recorded in ``gm.meta["fxsplit_tp"]``."""
    graph = gm.graph
    graph.lint()
    gm.recompile()
    for n in graph.nodes:  # metadata contract: every node annotated
        if (n.op == "get_attr" and n.meta.get("val") is None
                and isinstance(resolve_path(gm, str(n.target)), torch.Tensor)):
            n.meta["val"] = _param_val(gm, n, nodes)
        elif n.target is copy_to_region and n.meta.get("val") is None:
            n.meta["val"] = n.args[0].meta.get("val")
    annotate_graph(gm)  # one pass (parameter ownership resolved once)
    for n in list(graph.nodes):
        if n.target is column_parallel_linear:
            _cost_as_linears(gm, n)
        elif n.target in COLLECTIVE_OPS:
            _saves_nothing(n)
    gm.meta["fxsplit_tp"] = plan


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
    # a random call_method (x.bernoulli_()) stays on the stage stream


def _saves_nothing(node: torch.fx.Node) -> None:
    """A region collective keeps nothing for backward (its backward is the conjugate collective
    of the incoming gradient, or the identity); the cost model does not know it and would charge
    its input as saved, as for an unknown elementwise op."""
    info = node.meta["fxsplit"]
    if info.cost is not None and info.cost.saved_bytes != 0:
        node.meta["fxsplit"] = info.replace(cost=dataclasses.replace(info.cost, saved_bytes=0))


def _cost_as_linears(gm: torch.fx.GraphModule, fused: torch.fx.Node) -> None:
    """The cost model does not know ``column_parallel_linear``: give the node the cost of its
    linears (each costed as an F.linear node at the fused node's place), saving their one shared
    input once (``_ColumnParallelLinear`` saves ``x`` and the weights)."""
    from fxsplit.graph.cost import node_cost

    graph, total, saved = gm.graph, None, 0.0
    x, ws, bs = fused.args[:3]
    for i, (w, b) in enumerate(zip(ws, bs)):
        with graph.inserting_before(fused):
            tmp = graph.call_function(F.linear, (x, w, b))
        tmp.meta["val"] = fused.meta["val"][i]
        try:
            cost = node_cost(tmp, gm)
        finally:
            graph.erase_node(tmp)
        saved = cost.saved_bytes if total is None else saved  # each linear saves the same x
        total = cost if total is None else total + cost
    fused.meta["fxsplit"] = fused.meta["fxsplit"].replace(cost=dataclasses.replace(total, saved_bytes=saved))


def _fuse_columns(gm: torch.fx.GraphModule, plan: TPPlan, f: torch.fx.Node, axis: str) -> None:
    """Replace f and the column linears reading it by one ``fxsplit.tp.functional.column_parallel_linear`` node
    (one output per linear, read by getitem), whose backward overlaps f's all-reduce with the
    weight gradients. Only when every user of f is a plain [out, in] linear reading f as its
    input (nn.Linear module, F.linear or aten.linear); otherwise f and the linears stay."""
    graph = gm.graph
    users = list(f.users)
    if not users:
        return
    for u in users:
        info = plan.rewrite.linears.get(u.name)
        if info is None or info.out_dim != 0 or info.kind not in ("module", "linear", "matmul") or u.kwargs:
            return
        if u.op != "call_module" and any(isinstance(a, torch.fx.Node) and a.op != "get_attr" for a in u.args[1:]):
            return  # a weight read through whole_blocks' f
        if info.kind == "module":
            mod = gm.get_submodule(str(u.target))
            if type(mod) is not nn.Linear or u.args != (f,):
                return
        elif u.args[0] is not f or f in u.args[1:] or len(u.args) > 3:
            return
    order = {n: i for i, n in enumerate(graph.nodes)}
    users.sort(key=order.__getitem__)
    weights = [plan.rewrite.linears[u.name].weight for u in users]
    biases = [plan.rewrite.linears[u.name].bias for u in users]
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

@dataclass(frozen=True)
class _Rewritten:
    """The nodes steps 3-6 made, keyed by the traced-graph names the sequence plan uses: (source,
    f) per region f; row -> (the value g reduces, g, the node its readers now read); vocabulary
    embedding -> its new node; LM head -> (its input, f, the gather or None)."""

    fs: list[tuple[str, torch.fx.Node]]
    rows: dict[str, tuple[str, torch.fx.Node, torch.fx.Node]]
    embeddings: dict[str, torch.fx.Node]
    heads: dict[str, tuple[str, torch.fx.Node, torch.fx.Node | None]]


def _sequence_parallel(gm: torch.fx.GraphModule, plan: TPPlan, axis: str, done: _Rewritten) -> list[torch.fx.Node]:
    """Apply ``plan.rewrite.sequence_plan``: shard the activations between regions along the sequence.

    The residual stream after the vocabulary embedding is scattered along the sequence; f before
    a region becomes an all-gather along the sequence (``gather_to_region``: backward
    reduce-scatter), g after a region a reduce-scatter (``reduce_scatter_to_region``); then the
    recorded edges: ``copy_to_region`` on parameters read by the shard (gradients summed over the
    tp ranks), ``scatter_to_region`` on replicated operands spanning the sequence,
    ``gather_from_region`` before any other consumer (e.g. the model output). Every decision is
    the plan's ([Note: sequence-parallel plan] in ``fxsplit.tp.sequence``). Returns the nodes
    left on a sequence shard (their random ops then draw from the tp stream).
    """
    sp = plan.rewrite.sequence_plan
    _check_sequence_plan(sp, done)
    orig = _vals_before(gm)
    seq: dict[torch.fx.Node, int] = {}  # node -> sequence dim of its local shard
    value = _sp_collectives(gm, plan, axis, done, orig, seq)
    _sp_on_shard(gm, sp, value, orig, seq)
    _sp_edges(gm, sp, axis, value, orig, plan.tp)
    for name in sp.size_reads:
        _times_t(gm.graph, value[name], plan.tp)
    for node, d in seq.items():
        v = orig.get(node)
        if isinstance(v, torch.Tensor):
            node.meta["val"] = _local_val(v, d, v.shape[d] // plan.tp)
    return list(seq)


def _check_sequence_plan(sp: SequenceParallelPlan, done: _Rewritten) -> None:
    """The sequence plan names what this rewrite made (it was found on this graph)."""
    if not sp.scatters:
        raise TPPlanError("apply_tp_plan: plan.sequence_parallel is True but plan.rewrite.sequence_plan records no "
                          "decisions; find the plan with find_tp_plan(gm, tp, sequence_parallel=True)")
    sources = {s for s, _ in done.fs} | {x for x, _, _ in done.heads.values()}
    unknown = ([e for e in sp.scatters if e not in done.embeddings] + [r for r in sp.reduce_scatters if r not in done.rows]
               + [s for s in sp.all_gathers if s not in sources])
    if unknown:
        raise TPPlanError(f"apply_tp_plan: the sequence plan names {unknown[:3]}, which this rewrite did not make "
                          "(no such embedding, row linear or f); find the plan on this graph")


def _vals_before(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, Any]:
    """Every node's value before sequence parallelism (parameters read by get_attr nodes added by
    the rewrite have no metadata yet: the parameter itself)."""
    orig = {n: n.meta.get("val") for n in gm.graph.nodes}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and orig[n] is None:
            orig[n] = resolve_path(gm, str(n.target))
    return orig


def _sp_collectives(gm: torch.fx.GraphModule, plan: TPPlan, axis: str, done: _Rewritten,
                    orig: dict, seq: dict) -> dict[str, torch.fx.Node]:
    """The conjugate collectives: scatter after the token embeddings, reduce-scatter for the
    recorded g's, all-gather for the recorded f's. Returns traced-graph name -> the node its
    consumers now read (the scatter, the row's reduced output, the gathered logits)."""
    graph, sp = gm.graph, plan.rewrite.sequence_plan
    value = {n.name: n for n in graph.nodes}
    for row, (end, g, out) in done.rows.items():
        value[row] = value[end] = out
    for name, (_, _, gl) in done.heads.items():
        if gl is not None:
            value[name] = gl
    for e in sp.scatters:
        emb = done.embeddings[e]
        with graph.inserting_after(emb):
            sc = _new(graph, scatter_to_region, (emb,), {"dim": 1, "axis": axis}, like=emb)
        emb.replace_all_uses_with(sc, delete_user_cb=lambda u: u is not sc)
        orig[sc] = orig[emb]
        value[e] = sc
        seq[sc] = 1
    for r in sp.reduce_scatters:
        _, g, out = done.rows[r]
        g.target, g.kwargs = reduce_scatter_to_region, {"dim": 1, "axis": axis}
        seq[g] = seq[out] = 1
    for src, f in [*done.fs, *((x, f) for x, f, _ in done.heads.values())]:
        if src in sp.all_gathers:
            f.target, f.kwargs = gather_to_region, {"dim": sp.all_gathers[src], "axis": axis}
    return value


def _sp_on_shard(gm: torch.fx.GraphModule, sp: SequenceParallelPlan, value: dict, orig: dict, seq: dict) -> None:
    """The nodes recorded as running on the shard; nn.LayerNorm / nn.Linear calls among them
    become function calls, so that their parameters are get_attr nodes an edge can sum."""
    for name, (_, d) in sp.sharded.items():
        node = value[name]
        if node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), (nn.LayerNorm, nn.Linear)):
            new = _module_to_function(gm, node)
            orig[new] = orig[node]
            value[name] = node = new
        seq[node] = d


def _sp_edges(gm: torch.fx.GraphModule, sp: SequenceParallelPlan, axis: str, value: dict, orig: dict,
              t: int) -> None:
    """The recorded edges, in graph order: scatter, sum (copy_to_region) or gather in front of
    one input of a consumer."""
    graph = gm.graph
    for consumer, operand, action, dim in sp.edges:
        node = value[consumer]
        x = _operand(node, operand, value)
        if action == "scatter":  # the operand spans the whole sequence, its scatter this rank's shard
            target, kwargs, v = scatter_to_region, {"dim": dim, "axis": axis}, orig.get(x, x.meta.get("val"))
            if isinstance(v, torch.Tensor):
                v = _local_val(v, dim, v.shape[dim] // t)
        elif action == "sum":
            target, kwargs, v = copy_to_region, {"axis": axis}, orig.get(x, x.meta.get("val"))
        else:
            target, kwargs, v = gather_from_region, {"dim": dim, "axis": axis}, orig.get(x)
        with graph.inserting_before(node):
            new = _new(graph, target, (x,), kwargs, like=x, val=v if isinstance(v, torch.Tensor) else None)
        node.replace_input_with(x, new)


def _operand(node: torch.fx.Node, operand: str, value: Mapping[str, torch.fx.Node]) -> torch.fx.Node:
    """The input of ``node`` an edge names: a value by its traced-graph name, or a parameter by FQN."""
    x = value.get(operand)
    if x is not None and x in node.all_input_nodes:
        return x
    for a in node.all_input_nodes:
        if a.op == "get_attr" and str(a.target) == operand:
            return a
    raise TPPlanError(f"apply_tp_plan: the sequence plan puts an edge on input {operand!r} of {node.name!r}, "
                      "which reads no such value; find the plan on this graph")


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
        elif isinstance(mod, getattr(nn, "RMSNorm", ())):
            new = _new(graph, F.rms_norm, (node.args[0], tuple(mod.normalized_shape), w, mod.eps), like=node,
                       val=node.meta.get("val"))
        else:
            new = _new(graph, F.linear, (node.args[0], w, b), like=node, val=node.meta.get("val"))
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


def _param_val(gm, n, nodes):
    p = resolve_path(gm, str(n.target))
    ref = next((m.meta.get("val") for m in nodes.values() if isinstance(m.meta.get("val"), torch.Tensor)
                and getattr(m.meta["val"], "fake_mode", None) is not None), None)
    if getattr(ref, "fake_mode", None) is None:
        return torch.empty(p.shape, dtype=p.dtype, device="meta")
    return fake_like(ref, p.shape, p.dtype)


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
