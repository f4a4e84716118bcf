"""The state of one call of the runtime (a training step, a forward, a program) and its messages.

Terms as in fxsplit.runtime.executor (stage s, microbatch i, action kinds F, B, I, W). A `Step`
is made by every ``step()`` / ``forward()`` / ``run_program()`` call and handed to each action as
an argument, so a microbatch is followed through the runtime by what the calls receive::

    step = runtime._begin(...)          # the inputs split into microbatches, their symbol bindings
    runtime._act(step, ac)              # -> _forward(step, ac) / _backward(step, ac) / _backward_weight(step, ac)
    x = step.take(msg, local, action)   # a received (or handed over) value, in the layout the stage reads
    step.give(msg, value, local, action)

What F saved for the backward (`Saved`), the values handed over on this rank, the outputs of a
forward and the loss all live here and go when the call returns. A `ProbeHandle` keeps an
instrumentation probe (``PipelineRuntime.probe``) called with the step around each action.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fxsplit.pipeline.comm import ACT, Message
from fxsplit.pipeline.layout import from_wire, to_wire, wire_shape
from fxsplit.pipeline.stage import ValueMeta
from fxsplit.runtime.compile.split_graph import SplitState
from fxsplit.runtime.microbatch import MicrobatchSplit, concrete_shape
from fxsplit.runtime.p2p import P2PChannel
from fxsplit.runtime.split_backward import SplitBackward
from fxsplit.schedule.ir import Action

__all__ = ["Probe", "ProbeHandle", "Saved", "Step"]


@dataclass
class Saved:
    """What F keeps for the backward of one (stage, microbatch)."""

    inputs: list[Any]
    outputs: tuple[Any, ...]
    loss: torch.Tensor | None = None  # weighted loss (last stage)
    split: SplitBackward | None = None  # set by I for W (autograd's graph)
    graph: SplitState | None = None  # the forward ran as a graph ([Note: graph split backward])
    weight_grads: list[Any] | None = None  # a fused backward's weight gradients, accumulated after its sends


@dataclass(eq=False)
class Step:
    """One call's microbatches and everything its actions make.

    - ``inputs``: the flat model inputs per microbatch; ``targets`` the target per microbatch
      (training, on the last stage's rank); ``training``: F builds autograd graphs, B / I / W run.
    - ``metas[s][k]``: the meta of input k of stage s in this call (the plan's, or an override's
      traced at a fixed length); ``bindings[i]`` the sizes of their symbols for microbatch i.
    - ``channel``: the point-to-point channel of this call's communication plan.
    - ``rng_step``: k of the stage streams ([Note: RNG streams] in fxsplit.tp.random).
    - ``override``: the stages to run instead (a KV cache, fxsplit.api.kv_cache), or None.
    - ``loss_scale`` / ``cut_outputs``: as ``PipelineRuntime.step`` takes them.
    - ``tokens``: the plan carries token messages ([Note: token messages] in fxsplit.pipeline.comm).
    """

    training: bool
    inputs: MicrobatchSplit
    metas: Sequence[Sequence[ValueMeta]]
    bindings: list[dict]
    channel: P2PChannel
    device: torch.device
    shapes: dict[tuple, tuple[int, ...]]  # (symbolic shape, binding) -> concrete shape, kept across calls
    rng_step: int
    targets: list[Any] | None = None
    override: Any = None
    loss_scale: torch.Tensor | None = None
    cut_outputs: Callable[[list[Any]], list[Any]] | None = None
    tokens: bool = False
    saved: dict[tuple[int, int], Saved] = field(default_factory=dict)
    mailbox: dict[Message, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, list[Any]] = field(default_factory=dict)
    loss: torch.Tensor | None = None
    current: Action | None = None  # the action running now (named by a failure)
    binding_keys: list[tuple] = field(init=False)

    def __post_init__(self) -> None:
        self.binding_keys = [tuple(sorted((str(k), v) for k, v in b.items())) for b in self.bindings]
        if self.loss is None:
            self.loss = torch.zeros((), dtype=torch.float32, device=self.device)

    def __repr__(self) -> str:  # a failure's traceback shows it: no tensors
        kind = "training" if self.training else "forward-only"
        return (f"Step({kind}, {len(self.inputs.inputs)} microbatches, at {self.current}, "
                f"{len(self.saved)} saved, {len(self.mailbox)} handed over)")

    def drop(self) -> None:
        """Let go of what the actions made (a failed call: its traceback keeps the step alive)."""
        self.saved, self.mailbox, self.outputs = {}, {}, {}

    # ------------------------------------------------------------------ messages

    def meta(self, msg: Message) -> ValueMeta:
        return self.metas[msg.stage][msg.input]

    def order(self, msg: Message) -> tuple[int, ...] | None:
        """The dim order ``msg`` travels in: an activation's planned layout ([Note: boundary
        layouts] in fxsplit.pipeline.layout); gradients travel contiguous."""
        return self.meta(msg).dim_order if msg.kind == ACT else None

    def alloc(self, msg: Message) -> torch.Tensor:
        """The receive buffer of ``msg``: its planned shape under its microbatch's binding."""
        meta = self.meta(msg)
        key = (meta.shape, self.binding_keys[msg.microbatch])
        shape = self.shapes.get(key)
        if shape is None:
            shape = self.shapes[key] = concrete_shape(meta.shape, self.bindings[msg.microbatch])
        return torch.empty(wire_shape(shape, self.order(msg)), dtype=meta.dtype, device=self.device)

    def as_planned(self, msg: Message, value: torch.Tensor) -> torch.Tensor:
        """``value`` in the dtype the plan gives its message ([Note: boundary dtypes] in
        fxsplit.runtime.executor)."""
        dtype = self.meta(msg).dtype
        if dtype is not None and value.dtype != dtype and value.is_floating_point():
            return value.to(dtype)
        return value

    def take(self, msg: Message, local: bool, action: Action) -> torch.Tensor:
        """The value of ``msg``: handed over on this rank (``local``) or received."""
        wire = self.mailbox.pop(msg) if local else self.channel.wait(msg, action)
        return from_wire(wire, self.order(msg))

    def give(self, msg: Message, value: torch.Tensor, local: bool, action: Action) -> None:
        """Hand ``value`` to the stage ``msg`` names: on this rank (``local``) or sent."""
        # local handovers take the wire form too, so a stage sees the same strides whichever
        # rank its producer ran on ([Note: boundary layouts])
        value = to_wire(self.as_planned(msg, value), self.order(msg))
        if local:
            self.mailbox[msg] = value
        else:
            self.channel.send(msg, value.detach(), action)

    def received_grads(self, ac: Any, stage_inputs: Callable[[Message], int]) -> dict[int, torch.Tensor]:
        """The gradients ``ac`` receives (from peers and from this rank's own stages), summed per
        output index (``stage_inputs(msg)``) of the stage that sent them the forward values."""
        grads: dict[int, torch.Tensor] = {}
        for msg, local in [(m, False) for m in ac.recvs] + [(m, True) for m in ac.local_recvs]:
            g = self.take(msg, local, ac.action)
            j = stage_inputs(msg)
            grads[j] = g if j not in grads else grads[j] + g
        return grads


# An instrumentation probe: called with the step and the action before (or after) each action runs.
Probe = Callable[[Step, Action], None]


class ProbeHandle:
    """A probe installed on a runtime (:meth:`PipelineRuntime.probe`): ``remove()`` takes it off."""

    def __init__(self, probes: list[tuple[Probe | None, Probe | None]], entry: tuple[Probe | None, Probe | None]):
        self._probes, self._entry = probes, entry
        probes.append(entry)

    def remove(self) -> None:
        if self._entry in self._probes:
            self._probes.remove(self._entry)

    def __enter__(self) -> ProbeHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
