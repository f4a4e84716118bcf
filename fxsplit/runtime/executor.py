"""Pipeline executor: one pipeline rank runs its action list with its stage modules.

Terms (DESIGN.md, fxsplit.pipeline.stage, fxsplit.pipeline.comm): p pipeline ranks, S stages, m
microbatches; rank r holds the stages with ``stage_ranks[s] == r`` (default ``s % p``); an
action ``sKi`` is kind K (F, B, I, W) of microbatch i on stage s.

Representative signature::

    rt = PipelineRuntime(plan.rank_plan(r), {s: module for s in ...}, group=pp_group,
                         loss_fn=lambda out, y: F.cross_entropy(...), device=dev)
    rt = PipelineRuntime.from_stage_graphs(graphs, schedule=build("1f1b", p, m), pp_group=None,
                                           loss_fn=lambda out, y: F.cross_entropy(...), device=dev)
    loss = rt.step((idx,), target=y)   # every pp rank gets the full-batch loss; grads in .grad
    out = rt.forward((idx,))           # inference: merged flat outputs on the last stage's rank

Launch one process per rank with ``torchrun --nproc-per-node=N train.py``; in each, after
``dist.init_process_group("nccl" or "gloo")``, take the pipeline group from a DeviceMesh
(``group=mesh.get_group("pp")``, rank ``mesh.get_local_rank("pp")``) so the same code
composes with TP and DP; the runtime only ever talks to ``pp_group`` (point-to-point, one
broadcast of the loss), never creates groups, so no collective group creation is needed.

[Note: pipeline step]
1. The flat model inputs are split into m microbatches (fxsplit.runtime.microbatch); every rank
   passes the same full inputs (ranks read model inputs locally, only boundary values travel),
   the target is needed only on the rank of the last stage. A rank whose stages read no model
   input may pass meta tensors of the right shapes (``torch.empty(shape, device="meta")``): their
   shapes bind the symbols of the boundary shapes, no data is needed.
2. Each action runs in order. F: take the inputs (model inputs, values handed over on this rank,
   or received), run the stage, hand outputs to their consumers (sent straight to each consumer
   stage, skip connections included), and on the last stage compute ``w_i * loss_fn(out, y_i)``
   ([Note: loss weighting]). Received inputs are leaves with ``requires_grad`` from the plan.
   B: sum the gradients received for each output, ``autograd.backward`` from the outputs (or the
   weighted loss), send each input's ``.grad`` back, free what F saved. On a stage whose
   backward the schedule splits (I, W), F runs the stage's traced forward graph instead (no
   autograd graph; the last stage's loss differentiates from leaves standing for its outputs),
   I runs the input-gradient graph and W the weight-gradient graph ([Note: graph split
   backward] in fxsplit.runtime.compile.split_graph); with ``split_backward="autograd"`` (or a stage the
   graph split refuses) F runs the module, I the input gradients only (``autograd.grad``, graph
   kept) and W the weight gradients from what I captured ([Note: split backward]).
3. After the last action: wait for every send, sum the gradients of tied parameters across the
   ranks (and stages) that hold them, broadcast the loss from the last stage's rank.
Gradients ACCUMULATE into ``.grad`` like ``loss.backward()``: zero them between steps.

[Note: boundary dtypes]
Every value crosses between stages in the dtype of its ValueMeta in the plan (``StageIO``), in
both directions: an activation is cast to it before it is sent (or handed over on this rank), a
receive buffer is allocated in it, and a gradient is sent back in it (the gradient of a received
input has its dtype already). Both sides read the dtype from the same plan, so no handshake is
needed, whatever ran inside the stage. This is what makes a user's own
``torch.autocast("cpu", dtype=torch.bfloat16)`` around ``step()`` / ``forward()`` work: a stage
may produce bfloat16 where the plan traced float32, and it is cast back to the planned float32
on the way out (exact: every bfloat16 is a float32; it costs float32 bytes on the wire, use
``mp_policy`` for bfloat16 boundaries). The next stage's autocast casts it down again where an
op wants bfloat16, just as in one process; an op outside autocast's lists (an add) then computes
in float32 where one process would have added in bfloat16, one rounding fewer. A gradient that
arrives for a stage output is cast to the dtype that output has before ``backward``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from fxsplit.errors import (ArgumentTypeError, PlanError, RankFailedError, ScheduleError, StageBuildError,
                            UsageError)
from fxsplit.runtime.microbatch import (
    concrete_shape,
    merge_microbatches,
    split_microbatches,
    split_target,
)
from fxsplit.pipeline.comm import ACT, Message
from fxsplit.pipeline.layout import from_wire, to_wire, wire_shape
from fxsplit.tp.random import stage_stream
from fxsplit.pipeline.rank_plan import RankPlan
from fxsplit.runtime.p2p import P2PChannel, PipelineError
from fxsplit.runtime.pipe_group import PipeGroup
from fxsplit.runtime.tied import TiedGrads
from fxsplit.runtime.watch import Watch, host_blocking
from fxsplit.runtime.split_backward import SplitBackward
from fxsplit.runtime.graph_actions import GraphActions
from fxsplit.runtime.program import ProgramRun
from fxsplit.runtime.compile.split_graph import SplitState
from fxsplit.schedule.ir import Action, ActionKind
from fxsplit.pipeline.stage import StageGraphs, ValueMeta

__all__ = ["GradHooks", "PipelineRuntime"]

F = ActionKind.FORWARD
B = ActionKind.BACKWARD
BI = ActionKind.BACKWARD_INPUT
BW = ActionKind.BACKWARD_WEIGHT



class GradHooks(Protocol):
    """What the runtime tells about gradients during a step (fxsplit.runtime.data_parallel)."""

    def stage_grads_ready(self, stage: int) -> None: ...


@dataclass
class _Saved:
    """What F keeps for the backward of one (stage, microbatch)."""

    inputs: list[Any]
    outputs: tuple[Any, ...]
    loss: torch.Tensor | None = None  # weighted loss (last stage)
    split: SplitBackward | None = None  # set by I for W
    graph: SplitState | None = None  # the forward ran as a graph ([Note: graph split backward])


class PipelineRuntime(GraphActions, ProgramRun):
    """Runs one pipeline rank's share of a schedule over ``torch.distributed`` point-to-point.

    Arguments (keyword-only):
    - ``stages``: this rank's stages, ``{stage: (module, StageIO)}``.
    - ``stage_io``: the StageIO of ALL stages (``StageGraphs.io``); every rank derives the global
      message order from it ([Note: message order]). May be omitted when ``stages`` has them all.
    - ``schedule``: one action list per pipeline rank (``fxsplit.schedule``).
    - ``pp_group`` / ``pp_rank`` / ``num_ranks``: the pipeline process group (None = default
      group; e.g. ``mesh.get_group("pp")``), this rank's index in it and its size.
    - ``input_meta``: the flat model inputs' metas (``StageGraphs.input_meta``): their symbolic
      shapes bind the symbols of boundary shapes, so receive buffers need no handshake.
    - ``loss_fn(output, target) -> scalar``: a mean over the microbatch; ``output`` is the model
      output rebuilt with ``output_spec`` (a tensor or tuple of flat outputs when None).
    - ``shared_params``: groups of (stage, fqn) holding the same parameter (tied weights).
    - ``timeout``: seconds any wait may take before a `PipelineError` names the peer.
    - ``split_dim`` / ``batched``: microbatch split (fxsplit.runtime.microbatch).
    - ``abort_on_error``: on any failure, destroy ``pp_group`` (or the default group when it is
      None) so that peers blocked on this rank fail at once instead of at their timeout; the
      group is unusable afterwards.
    - ``prefetch``: how many actions ahead receives are posted.
    - ``blocking_waits``: see `P2PChannel`; default True on gloo, False on NCCL.
    - ``seed``: run each forward of microbatch i on stage s on the stage stream of
      (seed, s, i, k), k counting this runtime's step()/forward() calls from 0 ([Note: RNG
      streams] in fxsplit.tp.random): random ops draw the same on every tp rank, differently per
      stage and microbatch, independently of the schedule's order. None: the global RNG as is.
    - ``reduce_dtype``: the dtype tied parameters' gradients are summed in (mp_policy); None: theirs.
    - ``split_backward``: how a stage whose backward the schedule splits into I and W runs:
      "graph" (forward, I and W as three fx graphs, [Note: graph split backward]; a stage that
      cannot be traced that way falls back to "autograd" and ``split_fallbacks[stage]`` says
      why) or "autograd" ([Note: split backward]).
    - ``watch``: the failure board every wait polls ([Note: failure protocol] in
      fxsplit.runtime.watch); None: waits bounded by ``timeout`` alone.
    - ``grad_hooks``: told ``stage_grads_ready(stage)`` once a stage's last backward of the step has
      run (its gradients are complete, except tied parameters, summed after all actions), so
      data-parallel all-reduces start while later stages still compute (fxsplit.runtime.data_parallel).
    - ``defer_tied_grads``: step() leaves tied gradients unsummed for sum_tied_grads() once final
      (FSDP reduces after the step: [Note: FSDP collectives outside the pipeline] in fxsplit.runtime.fsdp).
    - ``compile``: every training forward runs as the graph split's F graph (whatever the
      schedule; B is one graph where the schedule never splits the stage, else I then W) and
      the graphs are compiled with ``torch.compile`` (inductor), once per input signature; a
      forward-only call runs compiled inference graphs; ``compile_fallbacks[(stage, "F" | "I" |
      "W" | "B" | "inference")]`` says why a graph runs uncompiled ([Note: compiled stages] in
      fxsplit.runtime.compile.compiling).
    """

    def __init__(
        self,
        plan: RankPlan,
        modules: Mapping[int, nn.Module],
        *,
        group: dist.ProcessGroup | None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        device: torch.device | str,
        timeout: float = 300.0,
        split_dim: int = 0,
        batched: Sequence[bool] | None = None,
        abort_on_error: bool = True,
        prefetch: int = 2,
        blocking_waits: bool | None = None,
        seed: int | None = None,
        reduce_dtype: torch.dtype | None = None,
        split_backward: str = "graph",
        compile: bool = False,
        watch: Watch | None = None,
        grad_hooks: GradHooks | None = None,
        defer_tied_grads: bool = False,
    ):
        """Run ``plan`` (this rank's :class:`~fxsplit.pipeline.rank_plan.RankPlan`) with ``modules``
        (stage index -> module, exactly the stages ``plan.stages``) over the pipeline ``group``."""
        if sorted(modules) != list(plan.stages):
            raise PlanError(
                f"pipeline rank {plan.rank} was given stages {sorted(modules)} but holds stages "
                f"{list(plan.stages)} (stage_ranks {list(plan.stage_ranks)}); pass exactly those"
            )
        if not 0 <= split_dim:
            raise UsageError(f"split_dim must be >= 0, got {split_dim}")
        self.plan = plan
        self.rank_of_stage = plan.rank_of_stage
        self.device = torch.device(device)
        self.modules = dict(modules)
        self.io = plan.io
        self.num_stages = plan.num_stages
        self.pp_rank = plan.rank
        self.num_ranks = plan.num_ranks
        self.input_meta = plan.input_meta
        self.loss_fn = loss_fn
        self.output_spec = plan.output_spec
        self.timeout = float(timeout)
        self.split_dim = split_dim
        self.batched = batched
        self.abort_on_error = abort_on_error
        self.watch = watch  # [Note: failure protocol]
        self.prefetch_depth = max(0, int(prefetch))
        self.seed = seed
        self.rng_step = 0  # k of the stage streams: step()/forward() calls so far
        self.reduce_dtype = reduce_dtype
        self._init_graph_actions(split_backward, compile)
        self._loss_scale: torch.Tensor | None = None  # set for one step() (GradScaler)
        self._cut_outputs: Callable[[list[Any]], list[Any]] | None = None  # set for one call (padded sequence)
        self.last_stage = self.num_stages - 1
        self.last_rank = self.rank_of_stage(self.last_stage)
        self.blocking_waits = host_blocking(group) if blocking_waits is None else blocking_waits
        self._pipe = PipeGroup(group, rank=plan.rank, timeout=self.timeout, watch=watch,
                               blocking_waits=self.blocking_waits)
        self.train_plan = plan.train
        self.forward_plan = plan.forward
        self.num_microbatches = self.train_plan.num_microbatches
        self._split_stages = {ac.action.stage for ac in self.train_plan.actions if ac.action.kind is BI}
        self._tied = TiedGrads.of(plan, self.modules)
        self._shape_cache: dict[tuple, tuple[int, ...]] = {}
        self._binding_cache: dict[tuple, dict] = {}
        self._channels: dict[bool, P2PChannel] = {}
        self.last_wait_seconds = 0.0  # host time the last step/forward spent blocked on peers
        self._grad_hooks = grad_hooks
        self.defer_tied_grads = defer_tied_grads
        self.last_sent_bytes = 0  # bytes this rank sent its pipeline peers in the last step/forward

    # ------------------------------------------------------------------ construction helpers

    @classmethod
    def from_stage_graphs(
        cls,
        graphs: StageGraphs,
        *,
        schedule: Sequence[Sequence[Action | None]],
        pp_group: dist.ProcessGroup | None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        device: torch.device | str,
        pp_rank: int | None = None,
        num_ranks: int | None = None,
        stage_ranks: Sequence[int] | None = None,
        **options: Any,
    ) -> PipelineRuntime:
        """Build this rank's runtime from a full `StageGraphs` (stage modules moved to ``device``)."""
        if pp_rank is None:
            pp_rank = dist.get_rank(pp_group)
        if num_ranks is None:
            num_ranks = dist.get_world_size(pp_group)
        plan = RankPlan.from_stage_graphs(graphs, schedule, rank=pp_rank, num_ranks=num_ranks,
                                          stage_ranks=stage_ranks)
        return cls(plan, {s: graphs.modules[s].to(device) for s in plan.stages}, group=pp_group,
                   loss_fn=loss_fn, device=device, **options)

    # ------------------------------------------------------------------ public API

    def step(self, flat_inputs: Sequence[Any], target: Any = None, *,
             loss_scale: torch.Tensor | None = None,
             cut_outputs: Callable[[list[Any]], list[Any]] | None = None) -> torch.Tensor:
        """One training step over all microbatches ([Note: pipeline step]).

        Returns the full-batch loss (float32 scalar) on every pipeline rank; gradients are left
        (accumulated) in the stage parameters' ``.grad``. ``target`` is only read on the rank of
        the last stage. ``loss_scale`` (a 0-dim tensor, a GradScaler's scale): backward starts
        from ``loss * loss_scale``, so every gradient is scaled; the returned loss is not.
        ``cut_outputs``: applied to each microbatch's flat model outputs before ``loss_fn`` ([Note:
        padding to the traced length] in fxsplit.api.padding).
        Raises `PipelineError` naming the peer, action and microbatch when a peer fails or times
        out.
        """
        if self.loss_fn is None:
            raise UsageError("PipelineRuntime.step needs loss_fn; use forward() for inference")
        self._loss_scale, self._cut_outputs = loss_scale, cut_outputs
        try:
            return self._guarded(lambda: self._run(flat_inputs, target, training=True))
        finally:
            self._loss_scale, self._cut_outputs = None, None

    def forward(self, flat_inputs: Sequence[Any], *, all_ranks: bool = False, microbatches: int | None = None,
                override: Any = None, cut_outputs: Callable[[list[Any]], list[Any]] | None = None) -> Any:
        """Inference: run only the F actions without autograd; return the merged model outputs
        (flat list, or rebuilt with ``output_spec``) on the last stage's rank, None elsewhere,
        or on every rank with ``all_ranks`` (pickled broadcast, for convenience not speed).
        ``microbatches``: split into that many (1..m, ``RankPlan.forward_with``) instead of m.
        ``override``: run stage s as ``override.modules[s]`` inside ``override.context(s, microbatch)``
        (a KV cache: fxsplit.api.kv_cache), for this call only. ``cut_outputs``: as in :meth:`step`."""
        self._cut_outputs = cut_outputs
        try:
            return self._guarded(lambda: self._run(flat_inputs, None, training=False, all_ranks=all_ranks,
                                                   microbatches=microbatches, override=override))
        finally:  # per call, like _loss_scale
            self._cut_outputs = None

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The pipeline group (None: the default group, or given up after a failure)."""
        return self._pipe.group

    def give_up_group(self) -> None:
        """Abandon the pipeline group after a failure elsewhere ([Note: failure protocol] point 4):
        it may hold transfers no peer completes, and this runtime never runs again."""
        self._pipe.give_up()

    def sum_tied_grads(self) -> None:
        """Sum tied gradients across the stages and ranks holding them (what step() does last
        unless ``defer_tied_grads``); raises `PipelineError` naming a peer that fails."""
        self._guarded(self._sum_tied_grads)

    def _sum_tied_grads(self) -> None:
        tag_base = 2 * self.num_microbatches * self.num_stages * max(len(s.inputs) for s in self.io) + 1
        self._tied.sum(self._pipe, tag_base=tag_base, reduce_dtype=self.reduce_dtype)

    # ------------------------------------------------------------------ execution

    def _guarded(self, fn: Callable[[], Any]) -> Any:
        self._current: Action | None = None
        try:
            return fn()
        except (PipelineError, RankFailedError):
            self._abort()
            raise
        except Exception as exc:
            if self.watch is not None:  # first: the peers this rank leaves waiting read the cause
                self.watch.post_raised(exc)
            a = self._current
            where = (f"while running action {a} (stage {a.stage}, microbatch {a.microbatch})"
                     if a is not None else "outside any action")
            exc.add_note(
                f"fxsplit: pipeline rank {self.pp_rank} failed {where}"
                + ("; the pipeline process group was destroyed so that its peers fail at once"
                   if self.abort_on_error else "")
            )
            self._abort()
            raise

    def _abort(self) -> None:
        self._saved, self._mailbox, self._channel, self._channels = {}, {}, None, {}
        if not self.abort_on_error or not dist.is_initialized():
            return
        if self.watch is not None:  # peers learn of the failure from the board; the group may
            self._pipe.give_up()    # hold posted transfers ([Note: failure protocol] point 4)
        else:
            self._pipe.destroy()
        self.abort_on_error = False  # only once

    def _to_device(self, x: Any) -> Any:
        """``x`` on this rank's device; a batch in pinned memory (``DataLoader(pin_memory=True)``) is
        copied asynchronously (``non_blocking``), behind the work already queued on the stream."""
        if not isinstance(x, torch.Tensor) or x.is_meta:
            return x
        return x.to(self.device, non_blocking=True)

    def _run(self, flat_inputs: Sequence[Any], target: Any, *, training: bool, all_ranks: bool = False,
             microbatches: int | None = None, override: Any = None) -> Any:
        if len(flat_inputs) != len(self.input_meta):
            raise ArgumentTypeError(f"expected {len(self.input_meta)} flat model inputs "
                                    f"{[m.name for m in self.input_meta]}, got {len(flat_inputs)}")
        flat = [self._to_device(x) for x in flat_inputs]
        m = self.num_microbatches if training or microbatches is None else microbatches
        mbs = split_microbatches(flat, m, dim=self.split_dim, batched=self.batched)
        self._mb = mbs
        self._override = override  # before binding: its shapes bind the symbols of a cached call
        self._bindings = [self._bind(inp) for inp in mbs.inputs]
        self._binding_keys = [tuple(sorted((str(k), v) for k, v in b.items())) for b in self._bindings]
        holds_last = self.last_stage in self.modules
        if training and holds_last:
            if target is None:
                raise UsageError(f"pipeline rank {self.pp_rank} holds the last stage and needs the "
                                 "target: pass step(inputs, target=...)")
            # the target goes where the outputs are, as the inputs do: a CPU target beside CUDA logits
            # would fail inside the user's loss_fn
            self._targets = split_target(pytree.tree_map(self._to_device, target), mbs.sizes, dim=self.split_dim)
        self._training = training
        self._rng_step, self.rng_step = self.rng_step, self.rng_step + 1
        self._saved: dict[tuple[int, int], _Saved] = {}
        self._mailbox: dict[Message, torch.Tensor] = {}
        self._outputs: dict[int, list[Any]] = {}
        self._loss = torch.zeros((), dtype=torch.float32, device=self.device)
        key = (training, m)  # one channel per program
        if key not in self._channels:
            plan = self.train_plan if training else self.plan.forward_with(m)
            self._channels[key] = P2PChannel(plan, group=self.pp_group, timeout_s=self.timeout,
                                             alloc=self._alloc, blocking_waits=self.blocking_waits,
                                             watch=self.watch)
        self._channel = self._channels[key]
        plan = self._channel.plan
        self._channel.reset()
        acts = plan.actions
        # the index of each local stage's last gradient-producing action (its weight grads are final then)
        last_grad = {}
        if training:
            for i, ac in enumerate(acts):
                if ac.action.kind is not F and ac.action.kind is not BI:
                    last_grad[ac.action.stage] = i
        with torch.set_grad_enabled(training):
            for i, ac in enumerate(acts):
                self._current = ac.action
                if self.watch is not None:
                    self.watch.doing = ac.action
                for nxt in acts[i + 1: i + 1 + self.prefetch_depth]:
                    self._channel.prefetch(nxt.recvs, ac.action)
                if ac.action.kind is F:
                    self._forward(ac)
                elif ac.action.kind is BW:
                    self._backward_weight(ac)
                else:
                    self._backward(ac)
                self._channel.reap()
                if self._grad_hooks is not None and last_grad.get(ac.action.stage) == i:
                    self._grad_hooks.stage_grads_ready(ac.action.stage)
            self._current = None
            self._channel.finish()
        self.last_wait_seconds, self.last_sent_bytes = self._channel.wait_seconds, self._channel.sent_bytes
        self._channel = None
        if training:
            if self._saved:
                left = ", ".join(f"{s}F{mb}" for s, mb in sorted(self._saved))
                raise ScheduleError(f"pipeline rank {self.pp_rank}: forwards {left} never had their "
                                    "backward (B, or I then W) in the schedule")
            if not self.defer_tied_grads:
                self._sum_tied_grads()
            return self._broadcast_loss()
        return self._gather_outputs(all_ranks)

    # ------------------------------------------------------------------ messages

    def _meta(self, msg: Message) -> ValueMeta:
        return self._stage_meta(msg.stage, msg.input)

    def _order(self, msg: Message) -> tuple[int, ...] | None:
        """The dim order ``msg`` travels in: an activation's planned layout ([Note: boundary
        layouts] in fxsplit.pipeline.layout); gradients travel contiguous."""
        return self._meta(msg).dim_order if msg.kind == ACT else None

    def _alloc(self, msg: Message) -> torch.Tensor:
        meta = self._meta(msg)
        key = (meta.shape, self._binding_keys[msg.microbatch])
        shape = self._shape_cache.get(key)
        if shape is None:
            shape = self._shape_cache[key] = concrete_shape(meta.shape, self._bindings[msg.microbatch])
        return torch.empty(wire_shape(shape, self._order(msg)), dtype=meta.dtype, device=self.device)

    def _as_planned(self, msg: Message, value: torch.Tensor) -> torch.Tensor:
        """``value`` in the dtype the plan gives its message ([Note: boundary dtypes])."""
        dtype = self._meta(msg).dtype
        if dtype is not None and value.dtype != dtype and value.is_floating_point():
            return value.to(dtype)
        return value

    def _take(self, msg: Message, local: bool, action: Action) -> torch.Tensor:
        wire = self._mailbox.pop(msg) if local else self._channel.wait(msg, action)
        return from_wire(wire, self._order(msg))

    def _give(self, msg: Message, value: torch.Tensor, local: bool, action: Action) -> None:
        # local handovers take the wire form too, so a stage sees the same strides whichever
        # rank its producer ran on ([Note: boundary layouts])
        value = to_wire(self._as_planned(msg, value), self._order(msg))
        if local:
            self._mailbox[msg] = value
        else:
            self._channel.send(msg, value.detach(), action)

    # ------------------------------------------------------------------ actions

    def _forward(self, ac: Any) -> None:
        a = ac.action
        s, mb = a.stage, a.microbatch
        sio = self.io[s]
        received = {(m.stage, m.input): (m, False) for m in ac.recvs}
        received.update({(m.stage, m.input): (m, True) for m in ac.local_recvs})
        args: list[Any] = []
        for k, (src, meta) in enumerate(zip(sio.inputs, sio.input_meta)):
            if src.stage is None:
                x = self._mb.inputs[mb][src.index]
                if isinstance(x, torch.Tensor) and x.is_meta:
                    raise UsageError(
                        f"pipeline rank {self.pp_rank}: stage {s} reads model input {src.index} "
                        f"({self.input_meta[src.index].name}) but this rank was given a meta tensor; "
                        "pass the real input on every rank whose stages read it")
                args.append(x)
                continue
            msg, local = received[(s, k)]
            x = self._take(msg, local, a)
            if local:
                x = x.detach()
            if self._training and meta.requires_grad:
                x.requires_grad_(True)
            args.append(x)
        stream = (contextlib.nullcontext() if self.seed is None else
                  stage_stream(self.seed, stage=s, microbatch=mb, step=self._rng_step, device=self.device))
        split = self._graph_split(s, args) if self._runs_as_graph(s) else None
        with stream:
            if split is not None:
                out, state = split.forward(*self._state(s), [x for x in args if isinstance(x, torch.Tensor)])
                if s == self.last_stage:  # the loss differentiates from leaves standing for the outputs
                    out = [o.detach().requires_grad_() if j in split.diff_outputs else o for j, o in enumerate(out)]
            elif self._override is not None:
                with self._override.context(s, mb):
                    out = self._override.modules[s](*args)
            else:
                out = self._stage_call(s, args)  # the module, or compiled inference ([Note: compiled inference])
        if not isinstance(out, (tuple, list)):
            out = (out,)
        if len(out) != len(sio.outputs):
            raise StageBuildError(f"stage {s} returned {len(out)} values but its StageIO lists "
                                  f"{len(sio.outputs)} outputs ({[m.name for m in sio.outputs]})")
        # the last stage differentiates from its loss: do not keep its outputs (logits) alive
        keep = tuple(out) if any(sio.consumers) else ()
        saved = _Saved(args, keep) if self._training else None
        if split is not None:
            saved.graph, saved.outputs = state, tuple(out) if s == self.last_stage else keep
        if s == self.last_stage:
            flat_out = [out[local] for _, local in sorted(sio.model_outputs)]
            if self._cut_outputs is not None:
                flat_out = self._cut_outputs(flat_out)
            if self._training:
                model_out = (pytree.tree_unflatten(flat_out, self.output_spec) if self.output_spec
                             is not None else flat_out[0] if len(flat_out) == 1 else tuple(flat_out))
                loss = self._call_loss(model_out, self._targets[mb])
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise UsageError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                                     f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
                saved.loss = loss.reshape(()) * self._mb.weights[mb]
                self._loss += saved.loss.detach().float()
                if self._loss_scale is not None:
                    saved.loss = saved.loss * self._loss_scale.to(saved.loss.dtype)
            else:
                self._outputs[mb] = [x.detach() if isinstance(x, torch.Tensor) else x for x in flat_out]
        if saved is not None:
            self._saved[(s, mb)] = saved
        for msg in ac.local_sends:
            self._give(msg, out[self.io[msg.stage].inputs[msg.input].index], True, a)
        for msg in ac.sends:
            self._give(msg, out[self.io[msg.stage].inputs[msg.input].index], False, a)

    def _roots(self, ac: Any, saved: _Saved) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Tensors to differentiate from and their incoming gradients (summed per output)."""
        a = ac.action
        grads = self._received_grads(ac)
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
                # dtype the forward produced ([Note: boundary dtypes])
                g = grads[j]
                root_grads.append(g if g.dtype == o.dtype else g.to(o.dtype))
        return roots, root_grads

    def _send_input_grads(self, ac: Any, saved: _Saved, input_grads: Mapping[int, torch.Tensor | None]) -> None:
        a = ac.action
        for msgs, local in ((ac.local_sends, True), (ac.sends, False)):
            for msg in msgs:
                g = input_grads.get(msg.input)
                if g is None:  # no path from this input to the outputs: its gradient is zero
                    g = torch.zeros_like(saved.inputs[msg.input])
                self._give(msg, g, local, a)

    def _backward(self, ac: Any) -> None:
        a = ac.action
        key = (a.stage, a.microbatch)
        saved = self._saved[key] if a.kind is BI else self._saved.pop(key)
        if saved.graph is not None:
            return self._graph_backward(ac, saved)
        roots, root_grads = self._roots(ac, saved)
        wanted = sorted({m.input for m in ac.sends + ac.local_sends})
        if a.kind is B:
            if roots:
                torch.autograd.backward(roots, root_grads)
            input_grads = {k: saved.inputs[k].grad for k in wanted}
        else:  # I: input gradients only, keep the graph for W ([Note: split backward])
            leaves = [saved.inputs[k] for k in wanted]
            params = [p for p in self.modules[a.stage].parameters() if p.requires_grad]
            split = SplitBackward(roots, root_grads, leaves, params)
            with split.capturing():
                got = (torch.autograd.grad(roots, leaves, root_grads, retain_graph=True, allow_unused=True)
                       if roots and leaves else [None] * len(leaves))
            input_grads = dict(zip(wanted, got))
            saved.split = split
        self._send_input_grads(ac, saved, input_grads)

    def _backward_weight(self, ac: Any) -> None:
        a = ac.action
        saved = self._saved.pop((a.stage, a.microbatch))
        if saved.graph is not None:
            self._accumulate(a.stage, saved.graph)
        elif saved.split is not None:
            saved.split.weight_grads()

    # ------------------------------------------------------------------ end of step

    def _broadcast_loss(self) -> torch.Tensor:
        loss = self._loss
        if self.num_ranks > 1:
            work = dist.broadcast(loss, self._pipe.global_rank(self.last_rank), group=self.pp_group, async_op=True)
            self._pipe.wait(work, "broadcasting the loss", self.last_rank, p2p=False)
        return loss

    def _gather_outputs(self, all_ranks: bool) -> Any:
        merged = None
        if self.last_stage in self.modules:
            merged = merge_microbatches([self._outputs[i] for i in range(len(self._mb.inputs))],
                                        dim=self.split_dim)
            if self.output_spec is not None:
                merged = pytree.tree_unflatten(merged, self.output_spec)
        self._outputs = {}
        if all_ranks and self.num_ranks > 1:
            box = [merged]
            dist.broadcast_object_list(box, self._pipe.global_rank(self.last_rank), group=self.pp_group)
            merged = box[0]
        return merged
