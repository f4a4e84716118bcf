"""The executor's actions on stages that run as graphs: F, I, W (and B as I then W) of a stage
whose forward ran as the graph split's F graph ([Note: graph split backward] in
fxsplit.runtime.compile.split_graph), and the per-signature cache of those graphs, compiled or not
([Note: compiled stages] in fxsplit.runtime.compile.compiling).

Terms as in fxsplit.runtime.executor (stage s, microbatch, action kinds F, B, I, W).

    class PipelineRuntime(GraphActions): ...     # the mixin reads the runtime's modules, io and
                                                 # messages (_take, _send_input_grads)
    split = self._graph_split(s, args)           # None: this stage runs on autograd
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fxsplit.errors import PlanError, UsageError
from fxsplit.runtime.compile.compiling import CompiledGraph, compile_split, full_backward, inference_runner
from fxsplit.runtime.compile.split_graph import GraphSplit, UnsupportedStage, accumulate_grads, has_selective_region, signature
from fxsplit.schedule.ir import ActionKind

__all__ = ["GraphActions"]


class GraphActions:
    """Graph-split actions of `PipelineRuntime` (a mixin: it owns ``_graph_splits``,
    ``split_fallbacks`` and ``compile_fallbacks``, set up by `_init_graph_actions`)."""

    def _init_graph_actions(self, split_backward: str, compile: bool) -> None:
        if split_backward not in ("graph", "autograd"):
            raise UsageError(f"split_backward must be 'graph' or 'autograd', got {split_backward!r}")
        if compile and split_backward != "graph":
            raise UsageError("compile=True compiles the graph split's F, I and W graphs ([Note: compiled "
                             "stages]); split_backward='autograd' runs autograd's graph, which it cannot compile: "
                             "use split_backward='graph'")
        self.split_backward = split_backward
        self.compile = bool(compile)
        self._graph_splits: dict[tuple, GraphSplit | None] = {}
        self.split_fallbacks: dict[int, str] = {}  # stage -> why its split backward runs on autograd
        # (stage, "F" | "I" | "W" | "B") -> why that graph runs uncompiled (compile=True); (stage,
        # "inference") -> why a forward-only call runs the stage eagerly ([Note: compiled inference])
        self.compile_fallbacks: dict[tuple[int, str], str] = {}
        self._inference_runners: dict[tuple, Any] = {}
        self._compiled_loss: CompiledGraph | None = None  # loss_fn compiled, made at the first compiled step
        # False: a B of a compiled stage runs I then W even where the schedule never splits it
        # (for measuring [Note: fused backward]; set before the first step)
        self.fuse_backward = True

    def _runs_as_graph(self, s: int) -> bool:
        """Whether a training forward of stage ``s`` runs as the F graph (if the split takes it)."""
        return self._training and (s in self._split_stages or self.compile)

    def _state(self, s: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The trainable parameters and the buffers of stage ``s``, in the order the graphs take them."""
        mod = self.modules[s]
        return [p for p in mod.parameters() if p.requires_grad], [b for _, b in mod.named_buffers()]

    def _graph_split(self, s: int, args: list[Any]) -> GraphSplit | None:
        """The traced graphs of stage ``s`` for inputs like ``args`` (cached; compiled with
        ``compile``), or None: autograd."""
        if self.split_backward != "graph" or s in self.split_fallbacks:
            return None
        key = (s, signature(args))
        if key not in self._graph_splits:
            try:
                split = GraphSplit.trace(self.modules[s], args)
            except UnsupportedStage as exc:
                if s in self._split_stages and has_selective_region(self.modules[s]):
                    # autograd would run each region's backward twice
                    raise PlanError(f"stage {s} has selective checkpointing, which runs with a split backward only "
                                    f"as graphs, and its graphs cannot be split: {exc}; use "
                                    "activation_checkpointing='full' or a schedule without a split backward") from exc
                self.split_fallbacks[s] = str(exc)
                if self.compile:
                    for kind in ("F", "I", "W") if s in self._split_stages or not self.fuse_backward else ("F", "B"):
                        self.compile_fallbacks[(s, kind)] = f"the stage runs on autograd, uncompiled: {exc}"
                split = None
            if split is not None and self.compile:
                # one backward graph where the schedule never splits this stage's ([Note: fused backward])
                compile_split(split, lambda kind, why, s=s: self.compile_fallbacks.setdefault((s, kind), why),
                              fused=self.fuse_backward and s not in self._split_stages)
            self._graph_splits[key] = split
        return self._graph_splits[key]

    def _stage_call(self, s: int, args: list[Any]) -> Any:
        """Stage ``s`` on ``args`` outside a training graph: with ``compile``, in a forward-only
        call, its compiled inference graph ([Note: compiled inference]); else its module."""
        if not self.compile or self._training:
            return self.modules[s](*args)
        key = (s, signature(args))
        if key not in self._inference_runners:
            def fallback(why: str, s: int = s) -> None:
                self.compile_fallbacks.setdefault((s, "inference"), why)
            try:
                split = GraphSplit.trace(self.modules[s], args)
            except UnsupportedStage as exc:
                fallback(f"the graph split cannot trace the stage: {exc}")
                split = None
            self._inference_runners[key] = None if split is None else inference_runner(split, fallback)
        run = self._inference_runners[key]
        if run is None:
            return self.modules[s](*args)
        return run(*self._state(s), [x for x in args if isinstance(x, torch.Tensor)])

    def _call_loss(self, model_out: Any, target: Any) -> Any:
        """``loss_fn(model_out, target)``; with ``compile``, in training, through
        ``torch.compile`` ([Note: compiled loss]), or eagerly once that fails (the reason in
        ``compile_fallbacks[(last stage, "loss")]``)."""
        if not (self.compile and self._training):
            return self.loss_fn(model_out, target)
        if self._compiled_loss is None:
            key = (self.last_stage, "loss")
            self._compiled_loss = CompiledGraph(self.loss_fn, lambda why: self.compile_fallbacks.setdefault(key, why),
                                                whole=False, name="loss_fn")
        return self._compiled_loss(model_out, target)

    def _received_grads(self, ac: Any) -> dict[int, torch.Tensor]:
        """The gradients ``ac`` receives (from peers and from this rank's own stages), summed per
        output index of the stage that sent them the forward values."""
        grads: dict[int, torch.Tensor] = {}
        for msg, local in [(m, False) for m in ac.recvs] + [(m, True) for m in ac.local_recvs]:
            g = self._take(msg, local, ac.action)
            j = self.io[msg.stage].inputs[msg.input].index
            grads[j] = g if j not in grads else grads[j] + g
        return grads

    def _graph_backward(self, ac: Any, saved: Any) -> None:
        """I (or B: I then W) of a microbatch whose forward ran as a graph."""
        a = ac.action
        state = saved.graph
        split = state.split
        grads = self._received_grads(ac)
        outs = [saved.outputs[j] for j in split.diff_outputs]
        if saved.loss is not None:
            got = torch.autograd.grad(saved.loss, outs, allow_unused=True)
            for j, g in zip(split.diff_outputs, got):
                if g is not None:
                    grads[j] = g if j not in grads else grads[j] + g
        tangents = []
        for j, o in zip(split.diff_outputs, outs):
            g = grads.get(j)
            tangents.append(torch.zeros_like(o) if g is None else g if g.dtype == o.dtype else g.to(o.dtype))
        saved.outputs, saved.loss = (), None
        params, buffers = self._state(a.stage)
        if a.kind is ActionKind.BACKWARD and "B" in split.runners:  # [Note: fused backward]
            got, weight_grads = full_backward(state, params, buffers, tangents)
            self._send_input_grads(ac, saved, dict(zip(split.grad_inputs, got)))
            accumulate_grads(params, weight_grads)  # a compiled graph's outputs: copied, never stolen
            return
        got = state.input_grads(params, buffers, tangents)
        self._send_input_grads(ac, saved, dict(zip(split.grad_inputs, got)))
        if a.kind is ActionKind.BACKWARD:
            self._accumulate(a.stage, state)

    def _accumulate(self, s: int, state: Any) -> None:
        """W of ``state`` (a `SplitState`) into stage ``s``'s ``.grad``; a compiled W's outputs
        are copied (its graph is not the one `_owned_outputs` read)."""
        params, buffers = self._state(s)
        split = state.split
        owned = None if "W" in split.runners else split.w_owned
        accumulate_grads(params, state.weight_grads(params, buffers), owned)
