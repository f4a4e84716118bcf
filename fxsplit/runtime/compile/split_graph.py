"""Split backward at the graph level: a stage's forward, input-gradient (I) and weight-gradient
(W) halves as three plain fx graphs of aten ops.

Terms (fxsplit.runtime.split_backward, fxsplit.schedule.ir): **joint graph** -- one aten graph of
a stage's forward and its backward, traced with ``make_fx`` (fake tensors) from
``(params, buffers, inputs, tangents)`` to ``(outputs, input grads, param grads)``;
**tangents** -- the gradients of the stage's differentiable outputs; **saved** -- forward values
the backward reads (what autograd would save); **carry** -- values I computes that W reads
(e.g. the gradient reaching a linear layer's output, a recomputed activation).

Representative use (a graph runner's F, I and W actions on a zero-bubble schedule,
fxsplit.runtime.runners)::

    split = GraphSplit.trace(module, inputs)          # once per input signature (cached)
    outs, state = split.forward(params, buffers, inputs)        # F: no autograd graph
    input_grads = state.input_grads(params, buffers, tangents)  # I: frees what only I read
    param_grads = state.weight_grads(params, buffers)           # W

[Note: graph split backward]
The autograd method (fxsplit.runtime.split_backward) walks autograd's graph and re-enters it
from captured gradients; it cannot tell which saved values W still needs, it runs torch's
selective checkpoint twice over a region (refused by torch), and its walk mis-assigns a weight
used twice on one path (pytorch#180952). Here the split is made on data flow instead, as
aot_autograd's partitioners do for forward/backward (``torch._functorch.partitioners``: the
joint graph is traced once, "forward" is what was traced before the backward started, as in
``default_partition``'s "respect the original placement", and the forward's outputs are the
stage outputs plus every forward value the backward reads). torch has no partitioner that
splits a backward into input and weight gradients, so that step is ours: **I** is the set of
backward nodes some input gradient depends on, **W** every other backward node some parameter
gradient depends on. I outputs the input gradients plus the carry; W reads only the saved
values W uses, the carry and the tangents it needs; everything only I read is freed after I.
Every node runs exactly once, in the order it was traced, so the gradients are those of the
full backward bit for bit (the ops and their order are autograd's own); a weight used twice is
one placeholder whose gradient autograd sums into one output, counted once.

Tensor-parallel stages compose: fxsplit.tp.collectives trace as torch's functional collectives
([Note: traced collectives]), pure nodes (``all_reduce`` then ``wait_tensor``) that data flow
orders like any op, so they land in F, I or W by what they feed (f's backward all-reduce in I,
with the input gradient). Every tp rank traces the same graphs and runs the same actions in the
same order, so the collectives match across ranks. Each collective node carries the call
``record_collectives`` would have logged eagerly (attributed in issue order), and each graph
logs its calls when it runs. An in-place c10d collective from elsewhere still refuses the stage.

Activation checkpointing composes: ``torch.utils.checkpoint`` (non-reentrant) runs inside the
trace, so the recomputation shows up in the backward part of the joint graph (full: the whole
region; selective: all but the kept nodes, whose forward outputs become saved values). A
recomputed value both halves need is computed once, in I, and carried to W: the region is
recomputed once per backward, not once per half. A recomputation that draws random numbers
replays the forward's draw: [Note: random recomputation].

[Note: random recomputation]
``torch.utils.checkpoint`` replays a region's dropout masks by restoring the generator state at
the region's forward before recomputing. In a traced graph that restore is gone (it is Python
outside the graph), so each random op the backward recomputes is paired with the forward op it
recomputes, and the generator state is saved as a graph value just before the forward draw
(`rng_state`: the CPU generator, or the tensor's CUDA one: 5 KB on CPU, 16 bytes on CUDA) and
restored around the recomputed one (`replay_rng`: set, draw, put the caller's state back), the
idea of aot_autograd's ``functionalize_rng_ops`` (``run_and_save_rng_state`` /
``run_with_rng_state``) in eager form. The masks are therefore the forward's bit for bit, as
with no checkpointing, and the generator is left as the forward left it. Pairing: selective
checkpointing leaves the recomputation to us (tagged nodes copied into the backward, so the copy
knows its original); full checkpointing under tracing recomputes for real, and a recomputed node
is matched to the forward node with the same target and arguments once recomputed arguments are
replaced by their originals (forward duplicates, like one view per q/k/v projection, are merged
first; uninitialized buffers and random ops never are). A random op with no single match
refuses the stage. A recomputed CPU dropout writes its fresh mask buffer in place
(``bernoulli_``, ``div_``); an in-place op in the backward is allowed when what it writes is a
backward node nothing else reads. torch's selective checkpoint refuses CPU dropout under
tracing (its cached mask is mutated): such a stage is refused. A random op on a tp rank's own
stream (a tp-sharded dropout, fxsplit.tp.random) is seeded in Python around the op; traced, the
block's nodes are recorded and `enter_tp_stream` / `exit_tp_stream` nodes put around them in the
forward graph ([Note: RNG streams] 3), so its masks are the eager block's; recomputed in the
backward, it replays like any other draw.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx.node import has_side_effect
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.utils.checkpoint import CheckpointPolicy

from fxsplit.errors import exception_text
from fxsplit.graph.ops import is_random
from fxsplit.graph.recompute import checkpointed, fx_meta_kept
from fxsplit.tp.collectives import note_calls, traced_collectives
from fxsplit.tp.random import TracedStream, enter_tp_stream, exit_tp_stream, traced_tp_streams

has_side_effect(enter_tp_stream)  # kept by dead-code elimination: they seed generators
has_side_effect(exit_tp_stream)

__all__ = ["GraphSplit", "SplitState", "UnsupportedStage", "has_selective_region", "signature"]


# [Note: one fx trace at a time]
# make_fx is an fx Tracer: while it traces, torch.fx patches the module globals of every function
# registered with torch.fx.wrap (fxsplit.tp.collectives' ops) with wrappers, and puts the saved
# value back when it ends. That patching is process-global and not thread-safe: two ranks tracing
# on threads (ranks as threads, torch's threaded process group) can interleave so that one saves
# the other's wrapper as "the original" and restores it, leaving fxsplit.tp.collectives.<op>
# a wrapper for the rest of the process (graphs then hold targets that are not the module's
# functions: counting nodes by identity finds none). Traces in this module take this lock.
_TRACE_LOCK = threading.Lock()


class UnsupportedStage(Exception):
    """The stage cannot be split at the graph level exactly; the message says why."""


def has_selective_region(module: nn.Module) -> bool:
    """Whether ``module``'s graph runs a selectively checkpointed region (fxsplit.graph.recompute)."""
    graph = getattr(module, "graph", None)
    return isinstance(graph, fx.Graph) and any(
        n.op == "call_function" and n.target is checkpointed and "selective" in n.args for n in graph.nodes)


def signature(inputs: Sequence[Any]) -> tuple:
    """Cache key of a stage call: tensor shapes, dtypes, requires_grad; other values as is; autocast."""
    key = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            key.append((tuple(x.shape), x.dtype, x.device, x.requires_grad))
        else:
            key.append(("const", repr(x)))
    key.append(("autocast", torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
    if torch.cuda.is_available():
        key.append(("autocast_cuda", torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")))
    return tuple(key)


def _call(module: nn.Module, args: Sequence[Any]) -> Any:
    """``module(*args)``; an FSDP unit without its hooks: they gather and reduce parameters, which
    fxsplit.runtime.fsdp does outside the pipeline ([Note: FSDP collectives outside the
    pipeline]), and under tracing would run FSDP's state machine on fake tensors."""
    from torch.distributed.fsdp import FSDPModule

    return module.forward(*args) if isinstance(module, FSDPModule) else module(*args)


class _Joint(nn.Module):
    """The stage's forward then ``autograd.grad``, as one module for ``functional_call`` (so the
    parameters stay swapped in while checkpoint regions recompute inside the backward)."""

    def __init__(self, stage: nn.Module, consts: dict[int, Any], n_inputs: int):
        super().__init__()
        self.stage = stage
        self.consts, self.n_inputs = consts, n_inputs
        self.boundary = -1
        self.diff_outputs: list[int] = []
        self.n_outputs = 0

    def forward(self, tensor_inputs: list[torch.Tensor], tangents: list[torch.Tensor], grad_inputs: list[int]):
        it = iter(tensor_inputs)
        args = [self.consts[k] if k in self.consts else next(it) for k in range(self.n_inputs)]
        outs = _call(self.stage, args)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        self.n_outputs = len(outs)
        self.boundary = len(get_proxy_mode().tracer.graph.nodes)  # everything so far is the forward
        diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        self.diff_outputs = [j for j, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
        params = [p for p in self.stage.parameters() if p.requires_grad]
        wrt = [args[k] for k in grad_inputs] + params
        grads = (torch.autograd.grad(diff, wrt, tangents[:len(diff)], allow_unused=True)
                 if diff and wrt else [None] * len(wrt))
        return outs, list(grads)


def _subgraph(joint: fx.GraphModule, nodes: list[fx.Node], inputs: list[fx.Node],
              outputs: list[fx.Node | None]) -> fx.GraphModule:
    """A graph of ``nodes`` (in joint order) reading ``inputs`` as placeholders, returning ``outputs``."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, n in enumerate(inputs):
        env[n] = g.placeholder(f"in_{i}_{n.name}")
        env[n].meta = dict(n.meta)
    for n in nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[o] if o is not None else None for o in outputs))
    gm = fx.GraphModule(joint, g)
    gm.graph.lint()
    return gm


def _check_backward(compute: list[fx.Node], bwd_set: set[fx.Node]) -> None:
    """Refuse (`UnsupportedStage`) a joint graph that cannot run as separate F, I and W graphs: an
    in-place collective anywhere, or a backward (``bwd_set``) that draws random numbers it does not
    replay or mutates a tensor other nodes read."""
    for n in compute:
        t = n.target
        if t is replay_rng and n in bwd_set and not _mutates_only_its_own(n, bwd_set):
            raise UnsupportedStage(f"the backward's replayed random op ({n.args[1]}) writes a tensor "
                                   "other nodes read")
        if not isinstance(t, torch._ops.OpOverload):
            continue
        if t.namespace in ("c10d", "c10d_functional"):
            # an in-place c10d collective (dist.all_reduce & co. outside fxsplit.tp.collectives,
            # which trace functional ones: [Note: traced collectives]) is waited on outside
            # the graph: data flow does not order its readers and the graph would not wait
            raise UnsupportedStage(f"the stage runs a collective ({t}); in-place c10d collectives "
                                   "are not data flow in a traced graph")
        if n in bwd_set and is_random(n):
            raise UnsupportedStage(f"the backward draws random numbers ({t}) that are not the "
                                   "recomputation of a forward draw")
        if n in bwd_set and t._schema.is_mutable and not _mutates_only_its_own(n, bwd_set):
            raise UnsupportedStage(f"the backward mutates a tensor in place ({t})")


def _ancestors(roots: list[fx.Node | None], within: set[fx.Node]) -> set[fx.Node]:
    out: set[fx.Node] = set()
    stack = [r for r in roots if r is not None and r in within]
    while stack:
        n = stack.pop()
        if n in out:
            continue
        out.add(n)
        stack.extend(a for a in n.all_input_nodes if a in within and a not in out)
    return out


def _externals(nodes: list[fx.Node], outputs: list[fx.Node | None], local: set[fx.Node]) -> list[fx.Node]:
    """Nodes outside ``local`` that ``nodes`` read or ``outputs`` name, in first-use order."""
    seen: dict[fx.Node, None] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in local:
                seen.setdefault(a)
    for o in outputs:
        if o is not None and o not in local:
            seen.setdefault(o)
    return list(seen)


_FC = torch.ops._c10d_functional
_ISSUE = (_FC.all_reduce.default, _FC.all_gather_into_tensor.default, _FC.reduce_scatter_tensor.default,
          _FC.all_to_all_single.default)  # the last: context parallelism's ring exchange (fxsplit.tp.ring)
_RECOMPUTE = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)
_ALIASES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)
# uninitialized buffers: two alike are not interchangeable (each is written in place after)
_EMPTY = (torch.ops.aten.empty_like.default, torch.ops.aten.empty.memory_format,
          torch.ops.aten.new_empty.default, torch.ops.aten.empty_strided.default)


def _recompute_tagged(gm: fx.GraphModule, fwd: list[fx.Node], bwd: list[fx.Node]) -> list[fx.Node]:
    """Selective checkpointing under tracing: torch's selective checkpoint does not recompute
    when a proxy mode is active; it tags each forward op ``meta["recompute"]`` with the policy's
    answer and leaves the recomputation to the partitioner (aot_autograd's do it the same way).
    Here every forward value the backward reads that is tagged recompute (or is the detached
    copy the checkpoint caches of one, or a getitem of one) is copied into the backward, before its first node,
    with its own recomputable inputs, recursively; the backward reads the copies. Returns the
    backward nodes, copies included, in graph order."""
    if not bwd:
        return bwd
    fwd_set = set(fwd)
    memo: dict[fx.Node, bool] = {}

    def recomputable(n: fx.Node) -> bool:
        if n not in memo:
            pol = n.meta.get("recompute")
            if n not in fwd_set or n.op != "call_function":
                memo[n] = False
            elif pol is not None:
                memo[n] = pol in _RECOMPUTE
            else:
                memo[n] = ((n.target in _ALIASES or n.target is operator.getitem)
                           and isinstance(n.args[0], fx.Node) and recomputable(n.args[0]))
        return memo[n]

    clones: dict[fx.Node, fx.Node] = {}
    states: list[fx.Node] = []  # forward nodes added: the generator state before each random op

    def clone(n: fx.Node) -> fx.Node:
        if n not in clones:
            args = {a: clone(a) for a in n.all_input_nodes if recomputable(a)}
            if is_random(n):  # [Note: random recomputation]
                tensors = [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
                if n.op != "call_function" or not tensors:
                    raise UnsupportedStage(f"the backward recomputes a random op ({n.target}) whose device "
                                           "cannot be read from a tensor argument; its draw cannot be replayed")
                with gm.graph.inserting_before(n):
                    states.append(gm.graph.call_function(rng_state, (tensors[0],)))
                with gm.graph.inserting_before(bwd[0]):
                    clones[n] = gm.graph.call_function(
                        replay_rng, (states[-1], n.target, *fx.map_arg(n.args, lambda a: args.get(a, a))),
                        fx.map_arg(n.kwargs, lambda a: args.get(a, a)))
                clones[n].meta = {k: v for k, v in n.meta.items() if k != "recompute"}
            else:
                with gm.graph.inserting_before(bwd[0]):
                    clones[n] = gm.graph.node_copy(n, lambda a: args.get(a, a))
                clones[n].meta.pop("recompute", None)
        return clones[n]

    for b in bwd:
        for a in list(b.all_input_nodes):
            if recomputable(a):
                b.replace_input_with(a, clone(a))
    fwd.extend(states)
    fwd_keep = set(fwd)
    fwd[:] = [n for n in gm.graph.nodes if n in fwd_keep]
    keep = set(bwd) | set(clones.values())
    return [n for n in gm.graph.nodes if n in keep]


def _replay_recomputed_draws(gm: fx.GraphModule, fwd: list[fx.Node], bwd: list[fx.Node]) -> None:
    """Full checkpointing under tracing recomputes for real: the region's ops run again inside
    the backward. Each random op there is matched to the forward op it recomputes (same target,
    same arguments once every recomputed argument is replaced by its forward original; a
    detached input stands for itself) and replaced by a replay of that op's generator state
    ([Note: random recomputation]). An ambiguous or unmatched draw refuses the stage."""
    if not any(is_random(b) for b in bwd):
        return
    def key(n: fx.Node, canon: dict) -> str:
        return repr((n.op, n.target, fx.map_arg((n.args, n.kwargs), lambda a: canon.get(a, a))))

    table: dict[str, list[fx.Node]] = {}
    canon: dict[fx.Node, fx.Node] = {}  # a node -> the first forward node computing the same
    for f in fwd:
        k = key(f, canon)
        if k in table and not is_random(f) and f.target not in _EMPTY:
            canon[f] = table[k][0]  # e.g. q, k and v each view the same input alike
        table.setdefault(k, []).append(f)
    fwd_set = set(fwd)
    for b in bwd:
        hits = table.get(key(b, canon), [])
        if len(hits) == 1 or (hits and not is_random(b) and b.target not in _EMPTY):
            canon[b] = hits[0]  # identical computations (an arange per layer): any one stands for all
        elif not hits and b.target in _ALIASES and isinstance(b.args[0], fx.Node):
            src = canon.get(b.args[0], b.args[0])
            src = canon.get(src, src)
            if src in fwd_set:
                canon[b] = src
        if is_random(b):
            if len(hits) != 1 or b.op != "call_function":
                raise UnsupportedStage(f"the backward draws random numbers ({b.target}) that cannot be matched "
                                       f"to one forward draw ({len(hits)} candidates)")
            f = canon.get(hits[0], hits[0])
            tensors = [a for a in f.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
            if not tensors:
                raise UnsupportedStage(f"the recomputed random op {b.target} has no tensor argument to read "
                                       "its device from")
            with gm.graph.inserting_before(f):
                st = gm.graph.call_function(rng_state, (tensors[0],))
            fwd.append(st)
            with gm.graph.inserting_before(b):
                r = gm.graph.call_function(replay_rng, (st, b.target, *b.args), dict(b.kwargs))
            r.meta = dict(b.meta)
            b.replace_all_uses_with(r)
            gm.graph.erase_node(b)
            bwd[bwd.index(b)] = r
            canon[r] = f
    keep = set(fwd)
    fwd[:] = [n for n in gm.graph.nodes if n in keep]


def _seed_tp_streams(gm: fx.GraphModule, fwd: list[fx.Node], streams: Sequence[TracedStream]) -> None:
    """Each forward tp-stream block ([Note: RNG streams] 3 in fxsplit.tp.random) becomes an
    `enter_tp_stream` node before its first node and an `exit_tp_stream` node after its last (an
    empty block: both after the node before it), added to ``fwd``; the graph then draws r and
    seeds where the eager block does, in the same order. Blocks the backward traced (a
    checkpointed region recomputed) get none: their draws replay the forward's generator state
    ([Note: random recomputation]), and entering would draw r from the caller's generator.
    Inserted last block first, so that blocks one after the other keep their order."""
    added = []
    for st in reversed(streams):
        where = (gm.graph.inserting_before(st.nodes[0]) if st.nodes else gm.graph.inserting_after(st.before))
        with where:
            enter = gm.graph.call_function(enter_tp_stream, (st.axis, st.device))
        with gm.graph.inserting_after(st.nodes[-1] if st.nodes else enter):
            leave = gm.graph.call_function(exit_tp_stream, (enter, st.device))
        added += [enter, leave]
    if added:
        keep = set(fwd) | set(added)
        fwd[:] = [n for n in gm.graph.nodes if n in keep]


def rng_state(x: torch.Tensor) -> torch.Tensor:
    """The state of the default generator of ``x``'s device ([Note: random recomputation])."""
    if x.device.type == "cuda":
        return torch.cuda.get_rng_state(x.device)
    return torch.get_rng_state()


def replay_rng(state: torch.Tensor, op: Any, *args: Any, **kwargs: Any) -> Any:
    """``op(*args, **kwargs)`` drawn from generator ``state``; the generator is left as it was."""
    dev = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    get, put = ((lambda: torch.cuda.get_rng_state(dev)), (lambda t: torch.cuda.set_rng_state(t, dev))) \
        if dev.type == "cuda" else (torch.get_rng_state, torch.set_rng_state)
    before = get()
    put(state)
    try:
        return op(*args, **kwargs)
    finally:
        put(before)


def _mutates_only_its_own(n: fx.Node, local: set[fx.Node]) -> bool:
    """Whether every tensor ``n`` writes in place is a node of ``local`` read by ``n`` alone (a
    recomputed dropout's fresh mask buffer): such a write is invisible to every other node."""
    op = n.args[1] if n.target is replay_rng else n.target
    args = n.args[2:] if n.target is replay_rng else n.args
    if not isinstance(op, torch._ops.OpOverload):
        return False
    for a, v in zip(op._schema.arguments, args):
        if a.alias_info is not None and a.alias_info.is_write:
            if not (isinstance(v, fx.Node) and v in local and len(v.users) == 1):
                return False
    return True


@dataclass
class GraphSplit:
    """The three graphs of one stage for one input signature ([Note: graph split backward]).

    ``forward(params, buffers, tensor_inputs) -> (outputs..., saved...)``;
    ``input_grad(*[saved or tangent for each of i_inputs]) -> (input grads..., carry...)``;
    ``weight_grad(*[saved, tangent or carry for each of w_inputs]) -> param grads``.
    Sources are ("p", k) parameter, ("b", k) buffer, ("x", k) tensor input, ("t", k) tangent,
    ("s", k) forward output k (saved), ("c", k) carry k.
    """

    forward_graph: fx.GraphModule
    input_graph: fx.GraphModule
    weight_graph: fx.GraphModule
    n_outputs: int
    diff_outputs: list[int]  # stage outputs that take a gradient (tangent k is for diff_outputs[k])
    grad_inputs: list[int]  # stage inputs whose gradient I computes
    param_ids: list[int]  # indices into [p for p in module.parameters() if p.requires_grad] with a gradient
    i_inputs: list[tuple[str, int]]
    w_inputs: list[tuple[str, int]]
    n_saved: int
    n_carry: int
    w_saved: list[int] = field(default_factory=list)  # saved outputs W still reads
    # per W output: the graph makes it and returns it once ([Note: stolen gradients])
    w_owned: list[bool] = field(default_factory=list)
    # what runs each graph ("F", "I", "W"): the graph itself unless set (compiled forms:
    # fxsplit.runtime.compile.compiling, [Note: compiled stages])
    runners: dict[str, Any] = field(default_factory=dict)

    def run(self, kind: str, *args: Any) -> Any:
        """Run graph ``kind`` ("F", "I" or "W") on ``args`` with its runner."""
        gm = {"F": self.forward_graph, "I": self.input_graph, "W": self.weight_graph}[kind]
        return self.runners.get(kind, gm)(*args)

    @classmethod
    def trace(cls, module: nn.Module, inputs: Sequence[Any]) -> GraphSplit:
        """Trace and partition ``module`` for ``inputs`` (tensors with the requires_grad I must
        differentiate; only shapes, dtypes and flags are read). Raises `UnsupportedStage`."""
        with traced_tp_streams() as streams:  # tp streams as graph nodes ([Note: RNG streams] 3)
            return cls._trace(module, inputs, streams)

    @classmethod
    def _trace(cls, module: nn.Module, inputs: Sequence[Any], streams: list[TracedStream]) -> GraphSplit:
        consts = {k: x for k, x in enumerate(inputs) if not isinstance(x, torch.Tensor)}
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        grad_inputs = [k for k, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
        joint = _Joint(module, consts, len(inputs))
        pnames = [n for n, p in joint.named_parameters() if p.requires_grad]
        frozen = {n: p for n, p in joint.named_parameters() if not p.requires_grad}
        bnames = [n for n, _ in joint.named_buffers()]
        try:  # the output shapes, for the tangents: one forward on fake tensors
            with torch.enable_grad(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
                fake_in = [mode.from_tensor(x).requires_grad_(x.requires_grad) for x in tensors]
                it = iter(fake_in)
                outs = _call(module, [consts[k] if k in consts else next(it) for k in range(len(inputs))])
                outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
                tan_meta = [(o.shape, o.dtype) for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        except Exception as exc:  # noqa: BLE001 - any failure means: not this way
            raise UnsupportedStage(f"the stage does not run on fake tensors ({exception_text(exc)})") from exc
        tangents = [torch.zeros(s, dtype=d, device=tensors[0].device if tensors else "cpu") for s, d in tan_meta]

        def fn(params, buffers, xs, tans):
            state = dict(zip(pnames, params)) | dict(zip(bnames, buffers)) | frozen
            return torch.func.functional_call(joint, state, (xs, tans, grad_inputs), tie_weights=True)

        p_in = [joint.get_parameter(n).detach().requires_grad_() for n in pnames]
        b_in = [joint.get_buffer(n) for n in bnames]
        x_in = [x.detach().requires_grad_(x.requires_grad) for x in tensors]
        try:
            with _TRACE_LOCK, fx_meta_kept(), torch.enable_grad(), traced_collectives() as calls:  # [Note: one fx trace at a time]
                gm = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(p_in, b_in, x_in, tangents)
        except Exception as exc:  # noqa: BLE001 - any tracing failure means: not this way
            raise UnsupportedStage(f"make_fx could not trace the stage's forward and backward "
                                   f"({exception_text(exc)})") from exc
        issued = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _ISSUE]
        if len(issued) != len(calls):
            raise UnsupportedStage(f"the trace issued {len(calls)} fxsplit collectives but holds {len(issued)} "
                                   "functional collective nodes; they cannot be attributed for counting")
        for n, call in zip(issued, calls):  # node_copy keeps meta: recomputed copies count too
            n.meta["fxsplit_collective"] = call
        return cls._partition(gm, joint, len(p_in), len(b_in), len(x_in), len(tangents), grad_inputs, streams)

    @classmethod
    def _partition(cls, gm: fx.GraphModule, joint: _Joint, n_p: int, n_b: int, n_x: int, n_t: int,
                   grad_inputs: list[int], streams: Sequence[TracedStream] = ()) -> GraphSplit:
        nodes = list(gm.graph.nodes)
        phs = [n for n in nodes if n.op == "placeholder"]
        if len(phs) != n_p + n_b + n_x + n_t or len(joint.diff_outputs) != n_t:
            raise UnsupportedStage(f"the joint graph has {len(phs)} inputs and {len(joint.diff_outputs)} differentiable "
                                   f"outputs, expected {n_p + n_b + n_x + n_t} and {n_t}")
        source = {}
        for k, n in enumerate(phs):
            kind = "p" if k < n_p else "b" if k < n_p + n_b else "x" if k < n_p + n_b + n_x else "t"
            source[n] = (kind, k - {"p": 0, "b": n_p, "x": n_p + n_b, "t": n_p + n_b + n_x}[kind])
        out_node = nodes[-1]
        flat = list(out_node.args[0])
        k_out = joint.n_outputs
        fw_outs, igrads, pgrads = flat[:k_out], flat[k_out:k_out + len(grad_inputs)], flat[k_out + len(grad_inputs):]
        for v in flat:
            if v is not None and not isinstance(v, fx.Node):
                raise UnsupportedStage(f"joint graph returns a constant {v!r}")
        index = {n: i for i, n in enumerate(nodes)}
        compute = [n for n in nodes if n.op not in ("placeholder", "output")]
        fwd = [n for n in compute if index[n] < joint.boundary]
        bwd = [n for n in compute if index[n] >= joint.boundary]
        _seed_tp_streams(gm, fwd, [st for st in streams if st.start < joint.boundary])
        bwd = _recompute_tagged(gm, fwd, bwd)
        _replay_recomputed_draws(gm, fwd, bwd)
        bwd_set = set(bwd)
        _check_backward([n for n in gm.graph.nodes if n.op not in ("placeholder", "output")], bwd_set)
        for o in fw_outs:
            if o in bwd_set:
                raise UnsupportedStage("a stage output is computed in the traced backward")
        i_set = _ancestors(igrads, bwd_set)
        w_set = _ancestors(pgrads, bwd_set) - i_set
        i_nodes = [n for n in bwd if n in i_set]
        w_nodes = [n for n in bwd if n in w_set]
        i_ext = _externals(i_nodes, igrads, i_set)
        w_ext = _externals(w_nodes, pgrads, w_set)
        carry = [n for n in w_ext if n in i_set]
        saved: list[fx.Node] = []
        for n in i_ext + w_ext:
            if n not in source and n not in i_set and n not in saved:
                saved.append(n)
        fwd_gm = _subgraph(gm, fwd, phs[:n_p + n_b + n_x], fw_outs + saved)
        fwd_gm.graph.eliminate_dead_code()
        fwd_gm.recompile()

        def src(n: fx.Node) -> tuple[str, int]:
            if n in source:
                return source[n]
            if n in i_set:
                return ("c", carry.index(n))
            return ("s", saved.index(n))

        i_gm = _subgraph(gm, i_nodes, i_ext, igrads + carry)
        w_gm = _subgraph(gm, w_nodes, w_ext, pgrads)
        w_in = [src(n) for n in w_ext]
        for g in (fwd_gm, i_gm, w_gm):  # what each graph issues, for record_collectives
            g.meta["fxsplit_collectives"] = [n.meta["fxsplit_collective"] for n in g.graph.nodes
                                              if "fxsplit_collective" in n.meta]
        return cls(
            forward_graph=fwd_gm, input_graph=i_gm, weight_graph=w_gm, n_outputs=k_out, w_owned=_owned_outputs(w_gm),
            diff_outputs=list(joint.diff_outputs), grad_inputs=grad_inputs,
            param_ids=[k for k, g in enumerate(pgrads) if g is not None],
            i_inputs=[src(n) for n in i_ext], w_inputs=w_in, n_saved=len(saved), n_carry=len(carry),
            w_saved=sorted({k for kind, k in w_in if kind == "s"}),
        )

    def forward(self, params: list[torch.Tensor], buffers: list[torch.Tensor],
                tensor_inputs: list[torch.Tensor]) -> tuple[list[Any], SplitState]:
        """Run the forward graph (no autograd graph is recorded); the outputs and the saved state."""
        with torch.no_grad():
            res = self.run("F", *params, *buffers, *tensor_inputs)
        note_calls(self.forward_graph.meta["fxsplit_collectives"])
        outs = list(res[:self.n_outputs])
        return outs, SplitState(self, list(res[self.n_outputs:]), tensor_inputs)


@dataclass
class SplitState:
    """What one forward saved for its I and W ([Note: graph split backward])."""

    split: GraphSplit
    saved: list[Any]
    inputs: list[torch.Tensor]
    tangents: list[torch.Tensor] | None = None
    carry: list[Any] | None = None
    # the last stage's ([Note: the loss's gradients under the graph split] in fxsplit.runtime.runners)
    output_grads: dict[int, torch.Tensor] | None = None
    output_metas: dict[int, tuple] | None = None

    def _value(self, src: tuple[str, int], params: list, buffers: list) -> Any:
        kind, k = src
        if kind == "p":
            return params[k]
        if kind == "b":
            return buffers[k]
        if kind == "x":
            return self.inputs[k]
        if kind == "t":
            return self.tangents[k]
        if kind == "s":
            return self.saved[k]
        return self.carry[k]

    def input_grads(self, params: list, buffers: list, tangents: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """The I action: gradients of ``split.grad_inputs`` (None: no path); keeps what W needs."""
        sp = self.split
        self.tangents = tangents
        with torch.no_grad():
            res = sp.run("I", *[self._value(s, params, buffers) for s in sp.i_inputs])
        note_calls(sp.input_graph.meta["fxsplit_collectives"])
        n = len(sp.grad_inputs)
        self.carry = list(res[n:])
        keep = set(sp.w_saved)
        self.saved = [v if k in keep else None for k, v in enumerate(self.saved)]  # free what only I read
        return list(res[:n])

    def weight_grads(self, params: list, buffers: list) -> list[torch.Tensor | None]:
        """The W action: one gradient per trainable parameter (None: unused); frees everything."""
        sp = self.split
        with torch.no_grad():
            res = sp.run("W", *[self._value(s, params, buffers) for s in sp.w_inputs])
        note_calls(sp.weight_graph.meta["fxsplit_collectives"])
        self.saved, self.carry, self.tangents, self.inputs = [], [], [], []
        return list(res)


def _owned_outputs(gm: fx.GraphModule) -> list[bool]:
    """Per output of ``gm``: whether its storage is made by the graph and returned once, so the
    caller may keep the tensor itself ([Note: stolen gradients])."""
    def root(n: Any) -> Any:
        while isinstance(n, fx.Node) and n.op == "call_function":
            t = n.target
            if t is operator.getitem:
                src = n.args[0]
                op = src.target if isinstance(src, fx.Node) and src.op == "call_function" else None
                if not isinstance(op, torch._ops.OpOverload):
                    return None  # an element of an input tuple (a carry): held elsewhere too
                if not any(r.alias_info is not None for r in op._schema.returns):
                    return n  # one output of a multi-output op that makes its own tensors
                n = src.args[0]
            elif isinstance(t, torch._ops.OpOverload) and any(r.alias_info is not None for r in t._schema.returns):
                n = n.args[0]  # a view: the storage is its input's
            elif isinstance(t, torch._ops.OpOverload):
                return n
            else:
                return None  # anything else (a Python function): not known to make a fresh tensor
        return None  # a placeholder (an input, a tangent) or a constant

    outs = list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    roots = [root(o) if isinstance(o, fx.Node) else None for o in outs]
    return [r is not None and roots.count(r) == 1 for r in roots]


# [Note: stolen gradients]
# autograd's AccumulateGrad keeps the first gradient of a parameter as its ``.grad`` without a
# copy when nothing else holds it ("steals" it) and adds later ones in place. The W graph's
# outputs are plain tensors the caller alone holds once W returns, unless one aliases an input
# (a tangent, a saved value) or another output: `_owned_outputs` reads that from the graph (view
# ops by their schema's alias annotation), and `accumulate_grads` takes an owned gradient whose
# strides are the parameter's as is, and clones the others (and a compiled W's outputs, which the
# graph does not describe). The values are the same either way: only the copy goes.


def accumulate_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                     owned: Sequence[bool] | None = None) -> None:
    """Add the W graph's ``grads`` into ``params``' ``.grad``, like ``AccumulateGrad``; the
    first gradient of a parameter is kept without a copy where ``owned`` says the tensor is the
    caller's alone and its layout is the parameter's ([Note: stolen gradients])."""
    for k, (p, g) in enumerate(zip(params, grads)):
        if g is None:
            continue
        if p.grad is None:
            steal = owned is not None and owned[k] and g.shape == p.shape and g.stride() == p.stride() \
                and g.dtype == p.dtype and g.device == p.device
            p.grad = g if steal else g.clone()  # an output may alias another (or a tangent): own it
        else:
            p.grad.add_(g)
