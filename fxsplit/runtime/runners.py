"""Per-stage runners: how one stage of this rank computes its forward, its backward and its loss.

Terms as in fxsplit.runtime.executor (stage s, microbatch i, action kinds F, B, I, W). The
executor moves values (receives, sends, saved activations, all on the `Step`); a runner computes:

- `EagerRunner`: the stage module on autograd. F runs the module (or an override's stage, a KV
  cache), B ``autograd.backward``, I the input gradients only (``autograd.grad``, graph kept), W
  the weight gradients from what I captured ([Note: split backward] in fxsplit.runtime.split_backward).
- `GraphRunner`: a stage whose backward the schedule splits (I, W: zero bubble) with
  ``split_backward="graph"``: a training F runs the graph split's forward graph, I and W its
  input- and weight-gradient graphs ([Note: graph split backward] in
  fxsplit.runtime.compile.split_graph); a stage the split refuses runs as `EagerRunner` and
  ``fallback`` says why.
- `CompiledRunner`: ``compile=True``: every training F runs as the F graph, compiled; B is one
  compiled graph where the schedule never splits the stage ([Note: fused backward]), else I then W;
  a forward-only call runs a compiled inference graph ([Note: compiled inference]); the last
  stage's loss is compiled ([Note: compiled loss]). ``compile_fallbacks[kind]`` says why a graph
  runs uncompiled (fxsplit.runtime.compile.compiling).

    runner = make_runner(s, module, options, splits=s in split_stages, last=s == last_stage)
    out, graph = runner.forward(step, i, args)              # graph: a SplitState, or None
    input_grads = runner.backward(saved, grads, wanted, full=kind is B)
    runner.weight(saved)                                    # W, or the rest of a B
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fxsplit.errors import PlanError
from fxsplit.runtime.compile.compiling import CompiledGraph, compile_split, full_backward, inference_runner
from fxsplit.runtime.compile.split_graph import (GraphSplit, SplitState, UnsupportedStage, accumulate_grads,
                                                 has_selective_region, signature)
from fxsplit.runtime.options import RuntimeOptions
from fxsplit.runtime.split_backward import SplitBackward
from fxsplit.runtime.step import Saved, Step

__all__ = ["CompiledRunner", "EagerRunner", "GraphRunner", "make_runner"]


def make_runner(stage: int, module: nn.Module, options: RuntimeOptions, *, splits: bool, last: bool) -> EagerRunner:
    """The runner of ``stage``: compiled with ``options.compile``; as graphs where the schedule
    splits its backward (``splits``) and ``options.split_backward == "graph"``; else eager."""
    if options.compile:
        return CompiledRunner(stage, module, options, splits=splits, last=last)
    if splits and options.split_backward == "graph":
        return GraphRunner(stage, module, options, splits=splits, last=last)
    return EagerRunner(stage, module, options, splits=splits, last=last)


def _tensors(args: Sequence[Any]) -> list[torch.Tensor]:
    return [x for x in args if isinstance(x, torch.Tensor)]


class EagerRunner:
    """Stage ``stage`` run as its module on autograd (``splits``: the schedule splits its backward
    into I and W; ``last``: the last stage, whose F computes the loss)."""

    def __init__(self, stage: int, module: nn.Module, options: RuntimeOptions, *, splits: bool, last: bool):
        self.stage = stage
        self.module = module
        self.options = options
        self.splits = splits
        self.last = last
        self.fallback: str | None = None  # why the graph split refused this stage (it runs here)
        self.compile_fallbacks: dict[str, str] = {}  # graph kind -> why it runs uncompiled

    def state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The trainable parameters and the buffers, in the order the graphs take them."""
        return ([p for p in self.module.parameters() if p.requires_grad],
                [b for _, b in self.module.named_buffers()])

    def graphs(self) -> list[GraphSplit]:
        """The graph splits traced for training (one per input signature)."""
        return []

    def forward(self, step: Step, mb: int, args: list[Any]) -> tuple[Any, SplitState | None]:
        """The stage on ``args`` (microbatch ``mb``): its outputs, and the graph state a graph F saved."""
        if step.override is not None:
            with step.override.context(self.stage, mb):
                return step.override.modules[self.stage](*args), None
        return self.module(*args), None

    def loss(self, model_out: Any, target: Any, *, training: bool) -> Any:
        """``loss_fn(model_out, target)`` (the last stage)."""
        return self.options.loss_fn(model_out, target)

    def backward(self, saved: Saved, grads: dict[int, torch.Tensor], wanted: list[int], *,
                 full: bool) -> dict[int, torch.Tensor | None]:
        """B (``full``) or I of ``saved`` given the gradients received per output (``grads``): the
        gradients of the inputs ``wanted`` (None: no path to the outputs)."""
        roots, root_grads = _roots(saved, grads)
        if full:
            if roots:
                torch.autograd.backward(roots, root_grads)
            return {k: saved.inputs[k].grad for k in wanted}
        # I: input gradients only, keep the graph for W ([Note: split backward])
        leaves = [saved.inputs[k] for k in wanted]
        split = SplitBackward(roots, root_grads, leaves, self.state()[0])
        with split.capturing():
            got = (torch.autograd.grad(roots, leaves, root_grads, retain_graph=True, allow_unused=True)
                   if roots and leaves else [None] * len(leaves))
        saved.split = split
        return dict(zip(wanted, got))

    def weight(self, saved: Saved) -> None:
        """W of ``saved`` after its I, or what a B leaves after its input gradients are sent."""
        if saved.split is not None:
            saved.split.weight_grads()


def _roots(saved: Saved, grads: dict[int, torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Tensors to differentiate from and their incoming gradients."""
    roots: list[torch.Tensor] = []
    root_grads: list[torch.Tensor | None] = []
    if saved.loss is not None:
        roots.append(saved.loss)
        root_grads.append(None)
    for j in sorted(grads):
        o = saved.outputs[j]
        if isinstance(o, torch.Tensor) and o.requires_grad:
            roots.append(o)
            # the gradient of a value travels in its planned dtype; autograd wants the
            # dtype the forward produced ([Note: boundary dtypes] in fxsplit.runtime.executor)
            g = grads[j]
            root_grads.append(g if g.dtype == o.dtype else g.to(o.dtype))
    return roots, root_grads


# [Note: the loss's gradients under the graph split]
# The last stage's graph forward runs under no_grad, so the loss (on autograd) needs tensors that
# stand for the stage's outputs, and I needs the loss's gradient for each. Leaves would do, but
# ``autograd.grad(loss, leaves)`` needs the leaves kept to the end, and a leaf is the output
# itself: the logits, the largest tensor of a language model, held per microbatch in flight beside
# what the loss saves (measured: ZB-V's last stage 16 MiB over 1F1B's at a 4 x 256 x 4096 batch).
# Each output goes through ``_HandOver`` instead: an identity whose backward puts the gradient in
# the forward's ``SplitState.output_grads`` (the output a view, unsaved), made differentiable by
# one shared scalar leaf (``_anchor``) that the backward runs to. Only what the loss itself saves
# stays (cross-entropy: its log-softmax), as on autograd (``EagerRunner``).


class _HandOver(torch.autograd.Function):
    """The identity on ``x``; its backward stores the gradient in ``box[j]`` and passes nothing on."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, x: torch.Tensor, box: dict, j: int) -> torch.Tensor:
        ctx.box, ctx.j = box, j
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None]:
        ctx.box[ctx.j] = grad
        return None, None, None, None


@functools.cache
def _anchor() -> torch.Tensor:
    """The scalar leaf every ``_HandOver`` hangs from: one for all (nothing flows into it, and
    ``autograd.grad`` with it as input writes no ``.grad``), on the CPU whatever the default device."""
    return torch.zeros((), device="cpu", requires_grad=True)


class GraphRunner(EagerRunner):
    """A stage whose training forward runs as the graph split's F graph, I and W as its graphs."""

    def __init__(self, stage: int, module: nn.Module, options: RuntimeOptions, *, splits: bool, last: bool):
        super().__init__(stage, module, options, splits=splits, last=last)
        self._splits: dict[tuple, GraphSplit | None] = {}

    def graphs(self) -> list[GraphSplit]:
        return [split for split in self._splits.values() if split is not None]

    def split_for(self, args: list[Any]) -> GraphSplit | None:
        """The traced graphs for inputs like ``args`` (cached per signature), or None: autograd."""
        if self.fallback is not None:
            return None
        key = signature(args)
        if key not in self._splits:
            try:
                split = GraphSplit.trace(self.module, args)
            except UnsupportedStage as exc:
                if self.splits and has_selective_region(self.module):
                    # autograd would run each region's backward twice
                    raise PlanError(f"stage {self.stage} has selective checkpointing, which runs with a split "
                                    f"backward only as graphs, and its graphs cannot be split: {exc}; use "
                                    "activation_checkpointing='full' or a schedule without a split backward") from exc
                self.fallback = str(exc)
                self._refused(exc)
                split = None
            if split is not None:
                self._prepare(split)
            self._splits[key] = split
        return self._splits[key]

    def _refused(self, exc: UnsupportedStage) -> None:
        """The graph split refused the stage (it runs on autograd from now on)."""

    def _prepare(self, split: GraphSplit) -> None:
        """A newly traced split, before its first run."""

    def forward(self, step: Step, mb: int, args: list[Any]) -> tuple[Any, SplitState | None]:
        split = self.split_for(args) if step.training else None
        if split is None:
            return super().forward(step, mb, args)
        out, state = split.forward(*self.state(), _tensors(args))
        if self.last:  # [Note: the loss's gradients under the graph split]
            state.output_grads = box = {}
            state.output_metas = {j: (out[j].shape, out[j].dtype, out[j].device) for j in split.diff_outputs}
            out = [_HandOver.apply(_anchor(), o, box, j) if j in split.diff_outputs else o for j, o in enumerate(out)]
        return out, state

    def backward(self, saved: Saved, grads: dict[int, torch.Tensor], wanted: list[int], *,
                 full: bool) -> dict[int, torch.Tensor | None]:
        if saved.graph is None:  # the forward ran on autograd
            return super().backward(saved, grads, wanted, full=full)
        state = saved.graph
        split = state.split
        if state.output_metas is not None:  # the last stage: the outputs are gone, their metas kept
            metas = [state.output_metas[j] for j in split.diff_outputs]
        else:
            metas = [(o.shape, o.dtype, o.device) for o in (saved.outputs[j] for j in split.diff_outputs)]
        if saved.loss is not None:
            torch.autograd.grad(saved.loss, [_anchor()], allow_unused=True)  # fills state.output_grads
            for j, g in state.output_grads.items():
                grads[j] = g if j not in grads else grads[j] + g
            state.output_grads = {}
        tangents = []
        for j, (shape, dtype, device) in zip(split.diff_outputs, metas):
            g = grads.get(j)
            tangents.append(torch.zeros(shape, dtype=dtype, device=device) if g is None
                            else g if g.dtype == dtype else g.to(dtype))
        saved.outputs, saved.loss = (), None
        params, buffers = self.state()
        if full and "B" in split.runners:  # [Note: fused backward]
            got, saved.weight_grads = full_backward(state, params, buffers, tangents)
        else:
            got = state.input_grads(params, buffers, tangents)
        return dict(zip(split.grad_inputs, got))

    def weight(self, saved: Saved) -> None:
        if saved.graph is None:
            return super().weight(saved)
        params, buffers = self.state()
        if saved.weight_grads is not None:  # a fused backward's: copied, never stolen
            accumulate_grads(params, saved.weight_grads)
            return None
        # a compiled W's outputs are copied (``split.w_owned`` describes the traced W graph, not the compiled one)
        split = saved.graph.split
        owned = None if "W" in split.runners else split.w_owned
        accumulate_grads(params, saved.graph.weight_grads(params, buffers), owned)
        return None


class CompiledRunner(GraphRunner):
    """A stage whose graphs run compiled with ``torch.compile`` ([Note: compiled stages])."""

    def __init__(self, stage: int, module: nn.Module, options: RuntimeOptions, *, splits: bool, last: bool):
        super().__init__(stage, module, options, splits=splits, last=last)
        self._inference: dict[tuple, Any] = {}
        self.compiled_loss: CompiledGraph | None = None  # loss_fn compiled, made at the first compiled step

    def inference_runners(self) -> list[Any]:
        """The compiled inference graphs made so far (None: that signature runs eagerly)."""
        return list(self._inference.values())

    def _fused(self) -> bool:
        return self.options.fuse_backward and not self.splits

    def _refused(self, exc: UnsupportedStage) -> None:
        for kind in ("F", "B") if self._fused() else ("F", "I", "W"):
            self.compile_fallbacks[kind] = f"the stage runs on autograd, uncompiled: {exc}"

    def _prepare(self, split: GraphSplit) -> None:
        # one backward graph where the schedule never splits this stage's ([Note: fused backward])
        compile_split(split, self.compile_fallbacks.setdefault, fused=self._fused())

    def forward(self, step: Step, mb: int, args: list[Any]) -> tuple[Any, SplitState | None]:
        if step.training or step.override is not None:
            return super().forward(step, mb, args)
        run = self._inference_runner(args)  # [Note: compiled inference]
        if run is None:
            return self.module(*args), None
        return run(*self.state(), _tensors(args)), None

    def _inference_runner(self, args: list[Any]) -> Any:
        key = signature(args)
        if key not in self._inference:
            def fallback(why: str) -> None:
                self.compile_fallbacks.setdefault("inference", why)
            try:
                split = GraphSplit.trace(self.module, args)
            except UnsupportedStage as exc:
                fallback(f"the graph split cannot trace the stage: {exc}")
                split = None
            self._inference[key] = None if split is None else inference_runner(split, fallback)
        return self._inference[key]

    def loss(self, model_out: Any, target: Any, *, training: bool) -> Any:
        """Through ``torch.compile`` in training ([Note: compiled loss]), or eagerly once that
        fails (the reason in ``compile_fallbacks["loss"]``)."""
        if not training:
            return super().loss(model_out, target, training=training)
        if self.compiled_loss is None:
            self.compiled_loss = CompiledGraph(self.options.loss_fn,
                                               lambda why: self.compile_fallbacks.setdefault("loss", why),
                                               whole=False, name="loss_fn")
        return self.compiled_loss(model_out, target)
