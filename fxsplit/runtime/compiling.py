"""torch.compile of the graphs a pipeline rank runs ([Note: compiled stages]).

Terms (fxsplit.runtime.split_graph): F, I and W graphs -- a stage's forward, input-gradient and
weight-gradient aten graphs for one input signature; **runner** -- what the split calls to run one
of them (the GraphModule itself, or its compiled form).

    compile_split(split, on_fallback=lambda graph, why: ...)   # once per traced GraphSplit
    outs, state = split.forward(params, buffers, inputs)          # runs the compiled F graph

[Note: compiled stages]
``PipelineRuntime(compile=True)`` (``parallelize(..., compile=True)``) compiles what the runtime
executes. Every training forward then runs as the graph split's F graph whatever the schedule (a
B action runs I then W), so zero-bubble and plain schedules take one path, and each of the F, I
and W graphs is given to ``torch.compile`` (inductor) on its own. This is where the graph split
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
- Collectives: a tp stage's traced functional collectives ([Note: traced collectives]) are ops of
  the graph like any other; every tp rank compiles the same graph, so they run in the same order
  on every rank.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from fxsplit.graph.ops import is_random

__all__ = ["INDUCTOR_OPTIONS", "CompiledGraph", "compile_split", "why_not_compiled"]

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
    fails, the GraphModule itself from then on, and ``on_fallback(reason)`` once."""

    def __init__(self, gm: fx.GraphModule, on_fallback: Callable[[str], None]):
        self.gm = gm
        self.on_fallback = on_fallback
        self.reason = why_not_compiled(gm)
        self.meta = gm.meta
        self._fn: Callable | None = None
        self.compiled = False  # True once a compiled call has run
        if self.reason is not None:
            on_fallback(self.reason)
        else:
            self._fn = torch.compile(gm, backend="inductor", fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS)

    def __call__(self, *args: Any) -> Any:
        if self._fn is None:
            return self.gm(*args)
        if self.compiled:
            return self._fn(*args)
        try:
            out = self._fn(*args)
        except torch._dynamo.exc.TorchDynamoException as exc:  # raised while compiling: nothing ran
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self.reason = f"torch.compile refused it ({type(exc).__name__}: {first[:300]})"
            self._fn = None
            self.on_fallback(self.reason)
            return self.gm(*args)
        self.compiled = True
        return out


def compile_split(split: Any, on_fallback: Callable[[str, str], None]) -> None:
    """Give ``split`` (a `GraphSplit`) compiled runners for its F, I and W graphs;
    ``on_fallback(graph, reason)`` for each one that runs uncompiled ("F", "I" or "W")."""
    split.runners = {
        kind: CompiledGraph(gm, lambda why, kind=kind: on_fallback(kind, why))
        for kind, gm in (("F", split.forward_graph), ("I", split.input_graph), ("W", split.weight_graph))
    }
