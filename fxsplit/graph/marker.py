"""The `pipe_split()` marker: users call it inside `forward` to say "a new pipeline stage starts here".

Terms
- **marker node**: the one graph node a `pipe_split()` call becomes. Its target is the custom op
  `torch.ops.fxsplit.pipe_split.default` in graphs from both tracers (`torch.fx.symbolic_trace` and
  `torch.export.export(..., strict=False)`); it takes no argument, returns nothing and has no users.
- **cut node**: a compute node at which a new stage starts (it belongs to the new stage).
- **compute node**: a `call_function`, `call_method` or `call_module` node.

Representative use::

    class Net(nn.Module):
        def forward(self, x):
            x = self.block0(x)
            pipe_split()                 # stage 1 starts here
            return self.block1(x)

    gm = torch.fx.symbolic_trace(Net())          # or torch.export.export(...).module()
    assignment = assignment_from_cuts(gm, find_pipe_splits(gm))
    stages = build_stages(gm, assignment, num_stages=len(set(assignment.values())))

Outside tracing, `pipe_split()` is a no-op, so the marked model runs unchanged in eager mode.

How it stays one node: export records the custom op like any other operator; it is registered as
side-effectful (`torch.fx.node.has_side_effect`) so dead-code elimination keeps it even though
nothing uses its result. `torch.fx.symbolic_trace` would call a zero-argument function without
recording it (`torch.fx.wrap` only records calls that receive a Proxy), so during symbolic tracing
`pipe_split()` finds the active `Tracer` on the call stack and records the op itself.
"""

from __future__ import annotations

import inspect

import torch
import torch.fx
from torch.fx._symbolic_trace import Tracer, is_fx_symbolic_tracing

from fxsplit.errors import SplitError

__all__ = [
    "PIPE_SPLIT_OP",
    "assignment_from_cuts",
    "find_pipe_splits",
    "pipe_split",
    "strip_pipe_splits",
]

_COMPUTE_OPS = ("call_function", "call_method", "call_module")

_LIB = torch.library.Library("fxsplit", "FRAGMENT")
_LIB.define("pipe_split() -> ()")


def _pipe_split_impl() -> None:
    return None


for _key in ("CompositeExplicitAutograd", "Meta"):
    _LIB.impl("pipe_split", _pipe_split_impl, _key)

PIPE_SPLIT_OP = torch.ops.fxsplit.pipe_split.default
torch.fx.node.has_side_effect(PIPE_SPLIT_OP)


def pipe_split() -> None:
    """Mark a pipeline cut: the next operation starts a new stage. A no-op when run eagerly."""
    if is_fx_symbolic_tracing():
        tracer = _symbolic_tracer()
        if tracer is not None:
            tracer.create_proxy("call_function", PIPE_SPLIT_OP, (), {})
            return None
    PIPE_SPLIT_OP()
    return None


def _symbolic_tracer() -> Tracer | None:
    """The plain symbolic `Tracer` whose `trace` is on the call stack, or None. make_fx-based
    tracers (export) are skipped: they record the op when it is dispatched.

    [Note: Tracer.trace under dynamo]
    The first ``torch.compile`` in a process runs ``torch._dynamo.eval_frame.TorchPatcher.patch``,
    which replaces ``torch.fx.Tracer.trace`` with ``torch._dynamo.disable(Tracer.trace)`` for the
    rest of the process: a ``functools.wraps`` wrapper whose code object (``_fn``) is shared by
    every disabled function. Matched against ``Tracer.trace.__code__`` as is, the walk would find
    the wrapper's frame (no ``self``), never the real ``trace``'s, and every later ``pipe_split()``
    under symbolic tracing would be dropped silently (one stage fewer). So the walk matches the
    unwrapped function's code (``inspect.unwrap``), the same before and after any compile."""
    from torch.fx.experimental.proxy_tensor import PythonKeyTracer

    trace_code = inspect.unwrap(Tracer.trace).__code__  # [Note: Tracer.trace under dynamo]
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code is trace_code:
                tracer = frame.f_locals.get("self")
                if isinstance(tracer, Tracer) and not isinstance(tracer, PythonKeyTracer):
                    return tracer
                return None
            frame = frame.f_back
        return None
    finally:
        del frame


def _is_marker(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is PIPE_SPLIT_OP


def find_pipe_splits(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The marker nodes of `gm`, in graph order."""
    return [n for n in gm.graph.nodes if _is_marker(n)]


def strip_pipe_splits(gm: torch.fx.GraphModule) -> int:
    """Remove every marker node from `gm` in place (recompiling it); return how many were removed."""
    markers = find_pipe_splits(gm)
    for n in markers:
        if n.users:
            raise SplitError(f"pipe_split node {n.name!r} has users {list(n.users)}; it cannot be removed")
        gm.graph.erase_node(n)
    if markers:
        gm.recompile()
    return len(markers)


def assignment_from_cuts(
    gm: torch.fx.GraphModule, cut_nodes: list[torch.fx.Node] | list[str]
) -> dict[str, int]:
    """A contiguous assignment (compute node name -> stage) where a new stage starts at each cut.

    Compute nodes are taken in graph (topological) order; stage k+1 starts at the k-th cut in that
    order. A cut node that is a marker belongs to the new stage. Cuts are nodes of `gm` or their
    names; a repeated cut is an error, and so is a cut at the first compute node (it would leave
    stage 0 empty). A stage may hold just a marker (two `pipe_split()` calls in a row).
    """
    by_name = {n.name: n for n in gm.graph.nodes}
    cuts = []
    for c in cut_nodes:
        name = c.name if isinstance(c, torch.fx.Node) else c
        node = by_name.get(name)
        if node is None or (isinstance(c, torch.fx.Node) and node is not c):
            raise SplitError(f"cut node {name!r} is not a node of this graph")
        if node.op not in _COMPUTE_OPS:
            raise SplitError(
                f"cut node {name!r} is a {node.op} node; cuts are compute nodes "
                f"(call_function / call_method / call_module)"
            )
        cuts.append(node)
    if len(set(cuts)) != len(cuts):
        raise SplitError(f"cut nodes repeat: {[n.name for n in cuts]}")
    cut_set = set(cuts)
    assignment: dict[str, int] = {}
    stage, size = 0, 0
    for n in gm.graph.nodes:
        if n.op not in _COMPUTE_OPS:
            continue
        if n in cut_set:
            if size == 0:
                raise SplitError(
                    f"cut at {n.name!r} leaves stage {stage} empty; remove the cut or move it later"
                )
            stage, size = stage + 1, 0
        assignment[n.name] = stage
        size += 1
    return assignment
