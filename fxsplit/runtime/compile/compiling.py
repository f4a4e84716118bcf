"""torch.compile of the graphs a pipeline rank runs ([Note: compiled stages]).

Terms (fxsplit.runtime.compile.split_graph): F, I and W graphs -- a stage's forward, input-gradient and
weight-gradient aten graphs for one input signature; **runner** -- what the split calls to run one
of them (the GraphModule itself, or its compiled form).

    compile_split(split, on_fallback=lambda graph, why: ...)   # once per traced GraphSplit
    outs, state = split.forward(params, buffers, inputs)          # runs the compiled F graph
    compile_split(split, on_fallback, fused=True)   # a stage the schedule never splits: F and B
    in_grads, w_grads = full_backward(state, params, buffers, tangents)   # B: one compiled graph
    run = inference_runner(split, on_fallback)      # forward only (pm(...)), or None: eager

[Note: compiled stages]
``PipelineRuntime(compile=True)`` (``parallelize(..., compile=True)``) compiles what the runtime
executes. Every training forward then runs as the graph split's F graph whatever the schedule (a
B action runs the one backward graph B where the schedule never splits the stage, [Note: fused
backward], else I then W), so zero-bubble and plain schedules take one path, and each of the F,
I and W (or F and B) graphs is given to ``torch.compile`` (inductor) on its own. This is where the graph split
composes by construction: PTD splits the backward with autograd hooks on the stage module's own
autograd graph, which a compiled module hides (one compiled autograd node for the whole stage;
reported refused under zero bubble in pytorch#143599; a brief run of
benchmarks/pipeline_vs_ptd.py --compile with torch 2.13 here did run PTD's ZBV with
``submod.compile()``, losses agreeing, gradients not checked); here the split is made before
compiling, on plain aten graphs, and each half is compiled on its own.
- Once per signature: the split is traced once per input signature already (shapes, dtypes,
  requires_grad, autocast: `signature`), so each graph is compiled with ``dynamic=False`` for the
  one shape it ever sees; each GraphModule has its own code object, so dynamo's per-code
  recompile limit is never shared between graphs.
- ``fullgraph=True``: a graph compiles whole or not at all. One that dynamo or inductor refuses
  (the error is raised while compiling, before any op has run) runs as the plain GraphModule and
  ``on_fallback`` gets the reason (the runtime keeps it in ``compile_fallbacks``). Never compiled,
  with that reason: a graph that draws random numbers or calls Python between ops (the generator
  reads and writes that replay a recomputed dropout, ``rng_state`` / ``replay_rng``, and the tp
  stream's seeding): inductor orders ops by data flow only, so a generator state read, set or
  consumed between two ops has no order it must keep; and with inductor's own RNG (the default)
  a dropout draws other numbers than aten's from the same generator, so the masks would no longer
  be the eager model's (the stage streams of [Note: RNG streams] define them).
- Numerics: inductor fuses and reorders floating-point work, so a compiled graph equals its
  GraphModule to rounding (about 1e-6 relative in fp32), not bit for bit; what is computed, and in
  which graph, is the same.
- One backward graph where the schedule has no reason to split it ([Note: fused backward]).
- On CPU, what is compiled is a copy of the graph whose fp32 matmuls run through oneDNN where
  torch's MKL is slow ([Note: CPU matmuls through oneDNN] in fxsplit.runtime.compile.cpu_matmul); the
  graph itself stays the eager fallback.
- The loss: ``loss_fn`` runs through ``torch.compile`` ([Note: compiled loss]).
- Inference (``pm(...)``, forward only) runs the F graph cut to the stage outputs, compiled on
  its own ([Note: compiled inference]).
- Collectives: a tp stage's traced functional collectives ([Note: traced collectives]) are ops of
  the graph like any other; every tp rank compiles the same graph, so they run in the same order
  on every rank.

[Note: fused backward]
A stage whose backward the schedule never splits into I and W (every stage of 1F1B, GPipe and
interleaved 1F1B) runs its B as one graph: the I graph's nodes, then the W graph's, the carry
read from I's outputs inside the graph (`fused_backward_graph`). That is one compiled call per
microbatch instead of two (one guard check, one launch of the runtime wrappers), no carry
tensors handed across a graph boundary, and inductor sees the whole backward: it can fuse the
weight-gradient matmuls' producers with the input-gradient ones and free what only I read as
soon as it is dead. What runs is what I then W run: the same aten nodes in the same order
(compiled, equal to rounding, as every compiled graph). A stage with an I or W action anywhere
in the schedule keeps the separate I and W graphs (a B there runs I then W).

[Note: compiled loss]
The last stage's loss is a user function, not a part of the traced stage, so the graphs above
do not hold it; eagerly, a cross-entropy over a (tokens x vocab) logits tensor is several full
passes over it (log-softmax written out, the backward's one-hot and softmax gradient), about a
tenth of the last stage's time in benchmarks/pipeline_vs_ptd.py (7.3 of 66 ms per microbatch).
Under ``compile=True`` a training step calls ``torch.compile(loss_fn)`` instead (dynamo, not
our trace: a loss that reads Python state, a closure's value or a global that changes between
steps, is guarded and recompiled by dynamo, where a graph traced once would keep a stale value;
Python it cannot compile is a graph break, not a failure). Its backward is the compiled
autograd function's, run by the ``autograd.grad`` that differentiates the loss (I, or B): one
fused kernel for the softmax gradient (2.9 ms against 7.3 there). The multiplications by the
microbatch weight and a loss scale stay outside. If dynamo raises, the loss runs eagerly from
then on and ``compile_fallbacks[(last stage, "loss")]`` says why (an error of ``loss_fn``
itself is then raised by the eager call, as without ``compile``). Numerics: equal to the eager
loss to rounding, as every compiled graph.

[Note: compiled inference]
A forward-only call (``PipelineRuntime.forward``, ``pm(...)``) under ``compile=True`` runs each
stage as the F graph of its own signature (traced with the inputs as they come: no gradient)
cut to the stage outputs: the saved values, which only a backward reads, are not outputs, and
dead-code elimination drops what computed only them. It is compiled like every graph, once per
signature. A graph that must run uncompiled ([Note: compiled stages]) is not run as a graph at
all: the stage runs as its module, eagerly, as without ``compile`` (``on_fallback`` says why),
and so does a stage the graph split cannot trace.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from fxsplit.errors import exception_text
from fxsplit.graph.ops import is_random
from fxsplit.runtime.compile.cpu_matmul import onednn_min_macs, route_cpu_matmuls
from fxsplit.tp.collectives import note_calls

__all__ = ["INDUCTOR_OPTIONS", "CompiledGraph", "compile_split", "full_backward", "fused_backward_graph",
           "inference_graph", "inference_runner", "why_not_compiled"]

# inductor options for every compiled graph ([Note: compiled stages])
INDUCTOR_OPTIONS: dict[str, Any] = {"fallback_random": True}


def why_not_compiled(gm: fx.GraphModule) -> str | None:
    """Why ``gm`` must run uncompiled ([Note: compiled stages]), or None."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        if not isinstance(n.target, torch._ops.OpOverload):
            name = getattr(n.target, "__name__", repr(n.target))
            return (f"it calls Python between its ops ({name}, node {n.name}): inductor orders ops by data "
                    "flow only and would not keep its place")
        if is_random(n):
            return (f"it draws random numbers ({n.target}, node {n.name}): compiled, the draws would not keep "
                    "their order on the generator the stage streams seed")
    return None


class CompiledGraph:
    """A GraphModule run through ``torch.compile`` (compiled at the first call); if compiling
    fails, the GraphModule itself from then on, and ``on_fallback(reason)`` once. With
    ``whole=False`` any function (the loss, [Note: compiled loss]): graph breaks allowed, shapes
    dynamic where dynamo finds them so; ``name`` is what the reason calls it."""

    def __init__(self, gm: Callable, on_fallback: Callable[[str], None], *, whole: bool = True, name: str = "it"):
        self.gm = gm
        self.on_fallback = on_fallback
        self.name = name
        self.reason = why_not_compiled(gm) if isinstance(gm, fx.GraphModule) else None
        self.meta = getattr(gm, "meta", {})
        self._fn: Callable | None = None
        self.compiled = False  # True once a compiled call has run
        self.onednn_matmuls = 0  # how many matmuls the compiled graph runs through oneDNN
        if self.reason is not None:
            on_fallback(self.reason)
        else:
            target = gm
            min_macs = onednn_min_macs() if isinstance(gm, fx.GraphModule) else None
            if min_macs is not None:
                # [Note: CPU matmuls through oneDNN]; gm stays the fallback
                target, self.onednn_matmuls = _with_onednn_matmuls(gm, min_macs)
            self._fn = torch.compile(target, backend="inductor", fullgraph=whole, dynamic=False if whole else None,
                                     options=INDUCTOR_OPTIONS)

    def __call__(self, *args: Any) -> Any:
        if self._fn is None:
            return self.gm(*args)
        try:
            out = self._fn(*args)
        except torch._dynamo.exc.TorchDynamoException as exc:  # raised while (re)compiling: nothing ran
            self.reason = f"torch.compile refused {self.name} ({exception_text(exc)})"
            self._fn = None
            self.on_fallback(self.reason)
            return self.gm(*args)  # an error of the function itself is raised here, as without compile
        self.compiled = True
        return out


def _with_onednn_matmuls(gm: fx.GraphModule, min_macs: int) -> tuple[fx.GraphModule, int]:
    """(a copy of ``gm``, sharing its parameters and code's globals, whose fp32 CPU matmuls run
    through oneDNN, or ``gm`` itself if it has none; how many were routed)."""
    routed = fx.GraphModule(gm, copy.deepcopy(gm.graph))  # node metas copied shallowly: fake values shared
    routed.meta = gm.meta
    count = route_cpu_matmuls(routed, min_macs)
    return (routed if count else gm), count


def compile_split(split: Any, on_fallback: Callable[[str, str], None], *, fused: bool = False) -> None:
    """Give ``split`` (a `GraphSplit`) compiled runners for its F, I and W graphs, or with
    ``fused`` for F and the one backward graph B ([Note: fused backward]); ``on_fallback(graph,
    reason)`` for each one that runs uncompiled ("F", "I", "W" or "B")."""
    graphs = [("F", split.forward_graph)]
    if fused:
        gm, sources = fused_backward_graph(split)
        split.b_inputs, split.b_calls = sources, gm.meta["fxsplit_collectives"]
        graphs.append(("B", gm))
    else:
        graphs += [("I", split.input_graph), ("W", split.weight_graph)]
    split.runners = {kind: CompiledGraph(gm, lambda why, kind=kind: on_fallback(kind, why)) for kind, gm in graphs}


def fused_backward_graph(split: Any) -> tuple[fx.GraphModule, list[tuple[str, int]]]:
    """One graph of ``split``'s I then W nodes ([Note: fused backward]): ``(gm, sources)``, where
    ``gm(*[value of each source]) -> (input grads..., param grads...)`` and sources are those of
    `GraphSplit` (never a carry: I's carry outputs feed W's nodes inside the graph)."""
    g = fx.Graph()
    sources: list[tuple[str, int]] = []
    placeholder: dict[tuple[str, int], fx.Node] = {}

    def read(src: tuple[str, int], like: fx.Node) -> fx.Node:
        if src not in placeholder:
            placeholder[src] = g.placeholder(f"{src[0]}{src[1]}_{like.name}")
            placeholder[src].meta = dict(like.meta)
            sources.append(src)
        return placeholder[src]

    def inline(gm: fx.GraphModule, srcs: list[tuple[str, int]], carry: list[fx.Node]) -> list[Any]:
        env: dict[fx.Node, fx.Node] = {}
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for n, src in zip(phs, srcs, strict=True):
            env[n] = carry[src[1]] if src[0] == "c" else read(src, n)
        out: list[Any] = []
        for n in gm.graph.nodes:
            if n.op == "output":
                out = [env[o] if isinstance(o, fx.Node) else o for o in n.args[0]]
            elif n.op != "placeholder":
                env[n] = g.node_copy(n, lambda a: env[a])
        return out

    i_out = inline(split.input_graph, split.i_inputs, [])
    n_in = len(split.grad_inputs)
    w_out = inline(split.weight_graph, split.w_inputs, i_out[n_in:])
    g.output(tuple(i_out[:n_in] + w_out))
    gm = fx.GraphModule(split.input_graph, g)
    gm.graph.lint()
    gm.meta["fxsplit_collectives"] = (split.input_graph.meta["fxsplit_collectives"]
                                      + split.weight_graph.meta["fxsplit_collectives"])
    return gm, sources


def full_backward(state: Any, params: list, buffers: list,
                  tangents: list[torch.Tensor]) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """B of a `SplitState` whose split was compiled ``fused``: one call of the B graph; (the
    input gradients of ``split.grad_inputs``, one gradient per trainable parameter). Frees the
    state, as W does."""
    sp = state.split
    state.tangents = tangents
    with torch.no_grad():
        res = sp.runners["B"](*[state._value(src, params, buffers) for src in sp.b_inputs])
    note_calls(sp.b_calls)
    state.saved, state.carry, state.tangents, state.inputs = [], [], [], []
    n = len(sp.grad_inputs)
    return list(res[:n]), list(res[n:])


def inference_graph(split: Any) -> fx.GraphModule:
    """``split``'s F graph returning the stage outputs only ([Note: compiled inference])."""
    gm = copy.deepcopy(split.forward_graph)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = (tuple(out.args[0][:split.n_outputs]),)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    gm.meta["fxsplit_collectives"] = [n.meta["fxsplit_collective"] for n in gm.graph.nodes
                                      if "fxsplit_collective" in n.meta]
    return gm


def inference_runner(split: Any, on_fallback: Callable[[str], None]) -> Callable[..., list[Any]] | None:
    """``run(params, buffers, tensor_inputs) -> outputs`` of ``split``'s compiled inference graph,
    or None (``on_fallback(reason)``): the stage runs eagerly ([Note: compiled inference])."""
    gm = inference_graph(split)
    why = why_not_compiled(gm)
    if why is not None:
        on_fallback(why)
        return None
    compiled = CompiledGraph(gm, on_fallback)
    calls = gm.meta["fxsplit_collectives"]

    def run(params: list, buffers: list, tensor_inputs: list) -> list[Any]:
        with torch.no_grad():
            res = compiled(*params, *buffers, *tensor_inputs)
        note_calls(calls)
        return list(res)

    run.compiled = compiled
    return run
