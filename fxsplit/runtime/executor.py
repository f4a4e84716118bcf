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

A call follows its microbatches by arguments: ``step()`` / ``forward()`` / ``run_program()`` make
a `Step` (fxsplit.runtime.step: the microbatch inputs and targets, what F saved, values handed
over, outputs, the loss) and run ``_run(step)`` -> ``_act(step, ac)`` -> ``_forward(step, ac)`` /
``_backward(step, ac)`` / ``_backward_weight(step, ac)``; the stage's runner
(fxsplit.runtime.runners: eager, graph split, compiled) computes, the step moves the values.

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
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from fxsplit.errors import (ArgumentTypeError, PlanError, RankFailedError, ScheduleError, StageBuildError,
                            UsageError)
from fxsplit.pipeline.comm import TOKEN, ActionComm, CommPlan, Message
from fxsplit.pipeline.rank_plan import RankPlan
from fxsplit.pipeline.stage import StageGraphs, StageIO, ValueMeta
from fxsplit.runtime.compile.split_graph import GraphSplit
from fxsplit.runtime.microbatch import (MicrobatchSplit, bind_symbols, merge_microbatches, split_microbatches,
                                        split_target)
from fxsplit.runtime.options import GradHooks, RuntimeOptions
from fxsplit.runtime.p2p import P2PChannel, PipelineError
from fxsplit.runtime.pipe_group import PipeGroup
from fxsplit.runtime.runners import CompiledRunner, EagerRunner, make_runner
from fxsplit.runtime.step import Probe, ProbeHandle, Saved, Step
from fxsplit.runtime.tied import TiedGrads
from fxsplit.runtime.watch import Watch, host_blocking
from fxsplit.schedule.ir import Action, ActionKind
from fxsplit.tp.random import stage_stream

__all__ = ["GradHooks", "PipelineRuntime", "RuntimeOptions"]

F = ActionKind.FORWARD
B = ActionKind.BACKWARD
BI = ActionKind.BACKWARD_INPUT
BW = ActionKind.BACKWARD_WEIGHT

class PipelineRuntime:
    """Runs one pipeline rank's share of a schedule over ``torch.distributed`` point-to-point.

    ``PipelineRuntime(plan, modules, options)``: ``plan`` is this rank's `RankPlan` (its stages,
    the StageIO of all stages, the training and forward communication plans), ``modules`` maps
    each of its stages to a module, ``options`` a `RuntimeOptions` (or its fields as keywords).
    Each stage runs through its runner (fxsplit.runtime.runners), chosen from the options.
    """

    def __init__(self, plan: RankPlan, modules: Mapping[int, nn.Module], options: RuntimeOptions | None = None,
                 /, **fields: Any):
        """Run ``plan`` with ``modules`` (stage index -> module, exactly the stages ``plan.stages``)."""
        if sorted(modules) != list(plan.stages):
            raise PlanError(
                f"pipeline rank {plan.rank} was given stages {sorted(modules)} but holds stages "
                f"{list(plan.stages)} (stage_ranks {list(plan.stage_ranks)}); pass exactly those"
            )
        if options is not None and fields:
            raise UsageError(f"PipelineRuntime takes RuntimeOptions or their fields as keywords, not both "
                             f"(got options and {sorted(fields)})")
        self.options = options if options is not None else RuntimeOptions(**fields)
        opts = self.options
        self.plan = plan
        self.device = torch.device(opts.device)
        self.modules = dict(modules)
        splits = {ac.action.stage for ac in plan.train.actions if ac.action.kind is BI}
        last = plan.num_stages - 1
        self.runners: dict[int, EagerRunner] = {
            s: make_runner(s, m, opts, splits=s in splits, last=s == last) for s, m in self.modules.items()}
        blocking = host_blocking(opts.group) if opts.blocking_waits is None else opts.blocking_waits
        self._pipe = PipeGroup(opts.group, rank=plan.rank, timeout=opts.timeout, watch=opts.watch,
                               blocking_waits=blocking)
        self._may_abort = opts.abort_on_error  # destroys the group once, on the first failure
        self._tied = TiedGrads.of(plan, self.modules)
        self._shape_cache: dict[tuple, tuple[int, ...]] = {}
        self._binding_cache: dict[tuple, dict] = {}
        self._channels: dict[tuple[bool, int], P2PChannel] = {}  # one per (training, microbatches)
        self._probes: list[tuple[Probe | None, Probe | None]] = []
        self.rng_step = 0  # k of the stage streams: step()/forward() calls so far
        self.last_wait_seconds = 0.0  # host time the last call spent blocked on peers
        self.last_sent_bytes = 0  # bytes this rank sent its pipeline peers in the last call

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
        return cls(plan, {s: graphs.modules[s].to(device) for s in plan.stages},
                   RuntimeOptions(group=pp_group, loss_fn=loss_fn, device=device, **options))

    # ------------------------------------------------------------------ what the plan and options say

    @property
    def io(self) -> Sequence[StageIO]:
        """The StageIO of every stage."""
        return self.plan.io

    @property
    def num_stages(self) -> int:
        return self.plan.num_stages

    @property
    def last_stage(self) -> int:
        return self.plan.num_stages - 1

    @property
    def last_rank(self) -> int:
        """The pipeline rank of the last stage."""
        return self.plan.rank_of_stage(self.last_stage)

    @property
    def pp_rank(self) -> int:
        return self.plan.rank

    @property
    def num_ranks(self) -> int:
        return self.plan.num_ranks

    @property
    def input_meta(self) -> Sequence[ValueMeta]:
        """The flat model inputs' metas."""
        return self.plan.input_meta

    @property
    def output_spec(self) -> Any:
        """The pytree spec of the model output (None: flat outputs)."""
        return self.plan.output_spec

    @property
    def num_microbatches(self) -> int:
        return self.plan.train.num_microbatches

    @property
    def loss_fn(self) -> Callable[[Any, Any], torch.Tensor] | None:
        return self.options.loss_fn

    @property
    def timeout(self) -> float:
        return self.options.timeout

    @property
    def watch(self) -> Watch | None:
        return self.options.watch

    @property
    def compile(self) -> bool:
        """Whether the stages run compiled (``RuntimeOptions.compile``)."""
        return self.options.compile

    @property
    def blocking_waits(self) -> bool:
        """Whether waits block the host (``RuntimeOptions.blocking_waits``, resolved)."""
        return self._pipe.blocking_waits

    @property
    def fuse_backward(self) -> bool:
        """``RuntimeOptions.fuse_backward``."""
        return self.options.fuse_backward

    @property
    def seed(self) -> int | None:
        """The seed of the stage streams (``RuntimeOptions.seed``)."""
        return self.options.seed

    def resume_rng(self, seed: int | None, rng_step: int) -> None:
        """Continue the stage streams at call ``rng_step`` of ``seed`` (a checkpoint's position)."""
        self.options.seed, self.rng_step = seed, int(rng_step)

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The pipeline group (None: the default group, or given up after a failure)."""
        return self._pipe.group

    @property
    def split_fallbacks(self) -> dict[int, str]:
        """Stage -> why its graph split refused it (it runs on autograd)."""
        return {s: r.fallback for s, r in self.runners.items() if r.fallback is not None}

    @property
    def compile_fallbacks(self) -> dict[tuple[int, str], str]:
        """(stage, "F" | "I" | "W" | "B" | "inference" | "loss") -> why that graph runs uncompiled."""
        return {(s, kind): why for s, r in self.runners.items() for kind, why in r.compile_fallbacks.items()}

    def traced_graphs(self) -> list[tuple[int, GraphSplit]]:
        """(stage, graph split) of every training graph traced so far, one per input signature."""
        return [(s, split) for s, r in self.runners.items() for split in r.graphs()]

    def inference_runners(self) -> list[Any]:
        """The compiled inference graphs made so far (None: that signature runs eagerly)."""
        return [run for r in self.runners.values() if isinstance(r, CompiledRunner) for run in r.inference_runners()]

    @property
    def loss_compiled(self) -> bool:
        """Whether ``loss_fn`` runs through ``torch.compile`` (made at the first compiled step)."""
        r = self.runners.get(self.last_stage)
        return isinstance(r, CompiledRunner) and r.compiled_loss is not None

    def probe(self, before: Probe | None = None, after: Probe | None = None) -> ProbeHandle:
        """Call ``before(step, action)`` / ``after(step, action)`` around each action from now on
        (instrumentation: memory held as backwards start, time per action) until the handle's
        ``remove()``; ``with rt.probe(...):`` removes it at the end of the block."""
        return ProbeHandle(self._probes, (before, after))

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
        return self._guarded(self._train, lambda: self._begin(flat_inputs, target, training=True,
                                                              loss_scale=loss_scale, cut_outputs=cut_outputs))

    def forward(self, flat_inputs: Sequence[Any], *, all_ranks: bool = False, microbatches: int | None = None,
                override: Any = None, cut_outputs: Callable[[list[Any]], list[Any]] | None = None) -> Any:
        """Inference: run only the F actions without autograd; return the merged model outputs
        (flat list, or rebuilt with ``output_spec``) on the last stage's rank, None elsewhere,
        or on every rank with ``all_ranks`` (pickled broadcast, for convenience not speed).
        ``microbatches``: split into that many (1..m, ``RankPlan.forward_with``) instead of m.
        ``override``: run stage s as ``override.modules[s]`` inside ``override.context(s, microbatch)``
        (a KV cache: fxsplit.api.kv_cache), for this call only; its ``shapes``, when not None, are
        the metas of a graph traced at a fixed length ([Note: KV cache for exported graphs] in
        fxsplit.api.kv_export). ``cut_outputs``: as in :meth:`step`."""
        return self._guarded(lambda step: self._infer(step, all_ranks),
                             lambda: self._begin(flat_inputs, None, training=False, microbatches=microbatches,
                                                 override=override, cut_outputs=cut_outputs))

    def run_program(self, program: CommPlan, inputs: Sequence[Sequence[Any]], *, override: Any) -> None:
        """Run ``program`` (this rank's forward-only `CommPlan` over any number of microbatches,
        generation's decode program: [Note: decode schedules] in fxsplit.schedule.decode) without
        autograd over ``inputs`` (one flat input list per microbatch, shapes final before it starts)
        with the stages of ``override``, which consume the outputs themselves: nothing is gathered.
        A token message ([Note: token messages] in fxsplit.pipeline.comm) writes its value into the
        model input it stands for before the stage that reads it runs (``override.token(j)``: the
        value the producing rank sends). Raises `PipelineError` naming the peer as ``forward`` does."""
        self._guarded(self._run, lambda: self._begin_program(program, inputs, override))

    def give_up_group(self) -> None:
        """Abandon the pipeline group after a failure elsewhere ([Note: failure protocol] point 4):
        it may hold transfers no peer completes, and this runtime never runs again."""
        self._pipe.give_up()

    def sum_tied_grads(self) -> None:
        """Sum tied gradients across the stages and ranks holding them (what step() does last
        unless ``defer_tied_grads``); raises `PipelineError` naming a peer that fails."""
        self._guarded(lambda _: self._sum_tied_grads())

    def _sum_tied_grads(self) -> None:
        tag_base = 2 * self.num_microbatches * self.num_stages * max(len(s.inputs) for s in self.io) + 1
        self._tied.sum(self._pipe, tag_base=tag_base, reduce_dtype=self.options.reduce_dtype)

    # ------------------------------------------------------------------ failures

    def _guarded(self, run: Callable[[Step | None], Any], begin: Callable[[], Step] | None = None) -> Any:
        """``run(begin())``; on a failure, post it, name the action it stopped at, abort the group."""
        step = None
        try:
            step = begin() if begin is not None else None
            return run(step)
        except (PipelineError, RankFailedError):
            self._abort(step)
            raise
        except Exception as exc:
            if self.watch is not None:  # first: the peers this rank leaves waiting read the cause
                self.watch.post_raised(exc)
            a = step.current if step is not None else None
            where = (f"while running action {a} (stage {a.stage}, microbatch {a.microbatch})"
                     if a is not None else "outside any action")
            exc.add_note(
                f"fxsplit: pipeline rank {self.pp_rank} failed {where}"
                + ("; the pipeline process group was destroyed so that its peers fail at once"
                   if self._may_abort else "")
            )
            self._abort(step)
            raise

    def _abort(self, step: Step | None) -> None:
        if step is not None:
            step.drop()
        self._channels = {}
        if not self._may_abort or not dist.is_initialized():
            return
        if self.watch is not None:  # peers learn of the failure from the board; the group may
            self._pipe.give_up()    # hold posted transfers ([Note: failure protocol] point 4)
        else:
            self._pipe.destroy()
        self._may_abort = False  # only once

    # ------------------------------------------------------------------ a call's step

    def _to_device(self, x: Any) -> Any:
        """``x`` on this rank's device; a batch in pinned memory (``DataLoader(pin_memory=True)``) is
        copied asynchronously (``non_blocking``), behind the work already queued on the stream."""
        if not isinstance(x, torch.Tensor) or x.is_meta:
            return x
        return x.to(self.device, non_blocking=True)

    def _begin(self, flat_inputs: Sequence[Any], target: Any, *, training: bool, microbatches: int | None = None,
               override: Any = None, loss_scale: torch.Tensor | None = None,
               cut_outputs: Callable[[list[Any]], list[Any]] | None = None) -> Step:
        """The step of a ``step()`` (``training``) or ``forward()`` call: its inputs split into
        microbatches, their targets, the channel of its program."""
        if len(flat_inputs) != len(self.input_meta):
            raise ArgumentTypeError(f"expected {len(self.input_meta)} flat model inputs "
                                    f"{[m.name for m in self.input_meta]}, got {len(flat_inputs)}")
        flat = [self._to_device(x) for x in flat_inputs]
        m = self.num_microbatches if training or microbatches is None else microbatches
        mbs = split_microbatches(flat, m, dim=self.options.split_dim, batched=self.options.batched)
        key = (training, m)
        if key not in self._channels:
            plan = self.plan.train if training else self.plan.forward_with(m)
            self._channels[key] = self._new_channel(plan)
        step = self._new_step(mbs, self._channels[key], training=training, override=override,
                              loss_scale=loss_scale, cut_outputs=cut_outputs)
        if training and self.last_stage in self.modules:
            if target is None:
                raise UsageError(f"pipeline rank {self.pp_rank} holds the last stage and needs the "
                                 "target: pass step(inputs, target=...)")
            # the target goes where the outputs are, as the inputs do: a CPU target beside CUDA logits
            # would fail inside the user's loss_fn
            step.targets = split_target(pytree.tree_map(self._to_device, target), mbs.sizes,
                                        dim=self.options.split_dim)
        self.rng_step += 1
        return step

    def _begin_program(self, program: CommPlan, inputs: Sequence[Sequence[Any]], override: Any) -> Step:
        """The step of a ``run_program()`` call (a channel of its own: programs differ per call)."""
        for j, flat in enumerate(inputs):
            if len(flat) != len(self.input_meta):
                raise ArgumentTypeError(f"run_program: microbatch {j} has {len(flat)} flat inputs, the plan "
                                        f"takes {len(self.input_meta)} ({[m.name for m in self.input_meta]})")
        sizes = tuple(int(flat[0].shape[0]) for flat in inputs)
        mbs = MicrobatchSplit(inputs=tuple(tuple(f) for f in inputs), sizes=sizes,
                              weights=tuple(1.0 for _ in sizes), batch_size=sum(sizes),
                              batched=tuple(True for _ in inputs[0]))
        step = self._new_step(mbs, self._new_channel(program), training=False, override=override, tokens=True)
        self.rng_step += 1
        return step

    def _new_channel(self, plan: CommPlan) -> P2PChannel:
        return P2PChannel(plan, group=self.pp_group, timeout_s=self.timeout, blocking_waits=self.blocking_waits,
                          watch=self.watch)

    def _new_step(self, mbs: MicrobatchSplit, channel: P2PChannel, *, training: bool, override: Any,
                  **fields: Any) -> Step:
        """A step over ``mbs``: the metas of this call (an override's ``shapes`` where it has them:
        a KV cache of a graph traced at a fixed length, its traced length replaced by the symbols
        of a cached call; else the plan's) and their symbols bound per microbatch."""
        shapes = override.shapes if override is not None else None
        model_metas = self.input_meta if shapes is None else shapes.input_meta
        metas = [io.input_meta for io in self.io] if shapes is None else shapes.stage_input_meta
        bindings = [self._bind(model_metas, inp) for inp in mbs.inputs]
        step = Step(training=training, inputs=mbs, metas=metas, bindings=bindings, channel=channel,
                    device=self.device, shapes=self._shape_cache, rng_step=self.rng_step, override=override,
                    **fields)
        channel.reset(step.alloc)
        return step

    def _bind(self, metas: Sequence[ValueMeta], inputs: Sequence[Any]) -> dict:
        """The sizes of the symbols in ``metas`` from ``inputs`` (cached per input shapes)."""
        key = (tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in inputs),
               tuple(metas))  # keyed by the metas themselves: two overrides may share input shapes
        if key not in self._binding_cache:
            self._binding_cache[key] = bind_symbols(metas, inputs)
        return self._binding_cache[key]

    # ------------------------------------------------------------------ running a step

    def _train(self, step: Step) -> torch.Tensor:
        self._run(step)
        if step.saved:
            left = ", ".join(f"{s}F{mb}" for s, mb in sorted(step.saved))
            raise ScheduleError(f"pipeline rank {self.pp_rank}: forwards {left} never had their "
                                "backward (B, or I then W) in the schedule")
        if not self.options.defer_tied_grads:
            self._sum_tied_grads()
        return self._broadcast_loss(step)

    def _infer(self, step: Step, all_ranks: bool) -> Any:
        self._run(step)
        return self._gather_outputs(step, all_ranks)

    def _run(self, step: Step) -> None:
        """Every action of ``step``'s program in order, receives posted ``prefetch`` actions ahead."""
        acts = step.channel.plan.actions
        # the index of each local stage's last gradient-producing action (its weight grads are final then)
        last_grad = {ac.action.stage: i for i, ac in enumerate(acts)
                     if ac.action.kind is not F and ac.action.kind is not BI} if step.training else {}
        hooks, ahead = self.options.grad_hooks, self.options.prefetch
        with torch.set_grad_enabled(step.training):
            for i, ac in enumerate(acts):
                step.current = ac.action
                if self.watch is not None:
                    self.watch.doing = ac.action
                for nxt in acts[i + 1: i + 1 + ahead]:
                    step.channel.prefetch(nxt.recvs, ac.action)
                self._act(step, ac)
                step.channel.reap()
                if hooks is not None and last_grad.get(ac.action.stage) == i:
                    hooks.stage_grads_ready(ac.action.stage)
            step.current = None
            step.channel.finish()
        self.last_wait_seconds, self.last_sent_bytes = step.channel.wait_seconds, step.channel.sent_bytes

    def _act(self, step: Step, ac: ActionComm) -> None:
        """One action of ``step``: F, B, I or W of one (stage, microbatch)."""
        for before, _ in self._probes:
            if before is not None:
                before(step, ac.action)
        kind = ac.action.kind
        if kind is F and step.tokens:
            self._forward(step, self._tokens_in(step, ac))
            self._tokens_out(step, ac)
        elif kind is F:
            self._forward(step, ac)
        elif kind is BW:
            self._backward_weight(step, ac)
        else:
            self._backward(step, ac)
        for _, after in self._probes:
            if after is not None:
                after(step, ac.action)

    # ------------------------------------------------------------------ actions

    def _stage_args(self, step: Step, ac: ActionComm) -> list[Any]:
        """The inputs of ``ac``'s stage for its microbatch: model inputs, received values and values
        handed over on this rank (leaves that need a gradient where the plan says so)."""
        a = ac.action
        s, mb = a.stage, a.microbatch
        sio = self.io[s]
        received = {(m.stage, m.input): (m, False) for m in ac.recvs}
        received.update({(m.stage, m.input): (m, True) for m in ac.local_recvs})
        args: list[Any] = []
        for k, (src, meta) in enumerate(zip(sio.inputs, sio.input_meta)):
            if src.stage is None:
                x = step.inputs.inputs[mb][src.index]
                if isinstance(x, torch.Tensor) and x.is_meta:
                    raise UsageError(
                        f"pipeline rank {self.pp_rank}: stage {s} reads model input {src.index} "
                        f"({self.input_meta[src.index].name}) but this rank was given a meta tensor; "
                        "pass the real input on every rank whose stages read it")
                args.append(x)
                continue
            msg, local = received[(s, k)]
            x = step.take(msg, local, a)
            if local:
                x = x.detach()
            if step.training and meta.requires_grad:
                x.requires_grad_(True)
            args.append(x)
        return args

    def _forward(self, step: Step, ac: ActionComm) -> None:
        a = ac.action
        s, mb = a.stage, a.microbatch
        sio = self.io[s]
        args = self._stage_args(step, ac)
        stream = (contextlib.nullcontext() if self.seed is None else
                  stage_stream(self.seed, stage=s, microbatch=mb, step=step.rng_step, device=self.device))
        with stream:
            out, graph = self.runners[s].forward(step, mb, args)
        if not isinstance(out, (tuple, list)):
            out = (out,)
        if len(out) != len(sio.outputs):
            raise StageBuildError(f"stage {s} returned {len(out)} values but its StageIO lists "
                                  f"{len(sio.outputs)} outputs ({[m.name for m in sio.outputs]})")
        # the last stage differentiates from its loss: do not keep its outputs (logits) alive
        keep = tuple(out) if any(sio.consumers) else ()
        saved = Saved(args, keep) if step.training else None
        if graph is not None:
            saved.graph = graph  # the last stage's outputs are not kept: [Note: the loss's gradients under the graph split]
        if s == self.last_stage:
            self._model_outputs(step, mb, out, saved)
        if saved is not None:
            step.saved[(s, mb)] = saved
        for msg in ac.local_sends:
            step.give(msg, out[self.io[msg.stage].inputs[msg.input].index], True, a)
        for msg in ac.sends:
            step.give(msg, out[self.io[msg.stage].inputs[msg.input].index], False, a)

    def _model_outputs(self, step: Step, mb: int, out: Sequence[Any], saved: Saved | None) -> None:
        """The last stage's outputs of microbatch ``mb``: its weighted loss (training, kept in
        ``saved`` for the backward, [Note: loss weighting]) or its flat outputs."""
        flat_out = [out[local] for _, local in sorted(self.io[self.last_stage].model_outputs)]
        if step.cut_outputs is not None:
            flat_out = step.cut_outputs(flat_out)
        if saved is None:
            step.outputs[mb] = [x.detach() if isinstance(x, torch.Tensor) else x for x in flat_out]
            return
        model_out = (pytree.tree_unflatten(flat_out, self.output_spec) if self.output_spec
                     is not None else flat_out[0] if len(flat_out) == 1 else tuple(flat_out))
        loss = self.runners[self.last_stage].loss(model_out, step.targets[mb], training=True)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise UsageError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                             f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        saved.loss = loss.reshape(()) * step.inputs.weights[mb]
        step.loss += saved.loss.detach().float()
        if step.loss_scale is not None:
            saved.loss = saved.loss * step.loss_scale.to(saved.loss.dtype)

    def _source_index(self, msg: Message) -> int:
        """Where the value of ``msg`` comes from: the sending stage's output (an activation, and the
        gradient of one), or the model input a token stands for."""
        return self.io[msg.stage].inputs[msg.input].index

    def _backward(self, step: Step, ac: ActionComm) -> None:
        """B (the whole backward) or I (the input gradients) of one (stage, microbatch)."""
        a = ac.action
        key = (a.stage, a.microbatch)
        saved = step.saved[key] if a.kind is BI else step.saved.pop(key)
        grads = step.received_grads(ac, self._source_index)
        wanted = sorted({m.input for m in ac.sends + ac.local_sends})
        runner = self.runners[a.stage]
        input_grads = runner.backward(saved, grads, wanted, full=a.kind is B)
        for msgs, local in ((ac.local_sends, True), (ac.sends, False)):
            for msg in msgs:
                g = input_grads.get(msg.input)
                if g is None:  # no path from this input to the outputs: its gradient is zero
                    g = torch.zeros_like(saved.inputs[msg.input])
                step.give(msg, g, local, a)
        if a.kind is B:
            runner.weight(saved)

    def _backward_weight(self, step: Step, ac: ActionComm) -> None:
        """W: the weight gradients of one (stage, microbatch) after its I."""
        a = ac.action
        self.runners[a.stage].weight(step.saved.pop((a.stage, a.microbatch)))

    def _tokens_in(self, step: Step, ac: ActionComm) -> ActionComm:
        """Write the token messages ``ac`` receives into the model inputs they stand for ([Note:
        token messages] in fxsplit.pipeline.comm); ``ac`` without its token messages."""
        for msg in ac.recvs:
            if msg.kind == TOKEN:
                step.inputs.inputs[msg.microbatch][self._source_index(msg)].copy_(step.take(msg, False, ac.action))
        if not any(m.kind == TOKEN for m in ac.recvs + ac.sends + ac.local_recvs + ac.local_sends):
            return ac
        keep = lambda msgs: tuple(m for m in msgs if m.kind != TOKEN)  # noqa: E731
        return dataclasses.replace(ac, recvs=keep(ac.recvs), sends=keep(ac.sends), local_recvs=keep(ac.local_recvs),
                                   local_sends=keep(ac.local_sends))

    def _tokens_out(self, step: Step, ac: ActionComm) -> None:
        """Send the tokens ``ac`` chose (``override.token(microbatch)``: the ids that microbatch
        reads), or write them in place when the reading stage is on this rank."""
        for msg in ac.sends:
            if msg.kind == TOKEN:
                step.give(msg, step.override.token(msg.microbatch), False, ac.action)
        for msg in ac.local_sends:
            if msg.kind == TOKEN:
                step.inputs.inputs[msg.microbatch][self._source_index(msg)].copy_(step.override.token(msg.microbatch))

    # ------------------------------------------------------------------ end of a call

    def _broadcast_loss(self, step: Step) -> torch.Tensor:
        loss = step.loss
        if self.num_ranks > 1:
            work = dist.broadcast(loss, self._pipe.global_rank(self.last_rank), group=self.pp_group, async_op=True)
            self._pipe.wait(work, "broadcasting the loss", self.last_rank, p2p=False)
        return loss

    def _gather_outputs(self, step: Step, all_ranks: bool) -> Any:
        merged = None
        if self.last_stage in self.modules:
            merged = merge_microbatches([step.outputs[i] for i in range(len(step.inputs.inputs))],
                                        dim=self.options.split_dim)
            if self.output_spec is not None:
                merged = pytree.tree_unflatten(merged, self.output_spec)
        if all_ranks and self.num_ranks > 1:
            box = [merged]
            dist.broadcast_object_list(box, self._pipe.global_rank(self.last_rank), group=self.pp_group)
            merged = box[0]
        return merged
