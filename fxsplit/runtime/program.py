"""Forward-only programs given as data: a `CommPlan` over any number of microbatches whose inputs
are given per microbatch (``PipelineRuntime.run_program``), for generation's decode program
([Note: decode schedules] in fxsplit.schedule.decode).

Terms
- **program**: this rank's forward-only `CommPlan` (``plan_all_communication(rows, io,
  forward_only=True)``), its microbatches numbered as the rows number them.
- **inputs[j]**: the flat model inputs of microbatch j, tensors whose shapes are final before the
  program starts (the symbols of every message's shape bind from them); a token message ([Note:
  token messages] in fxsplit.pipeline.comm) writes its value into the model input it stands for
  before the stage that reads it runs (``override.token(j)``: the value the producing rank sends).

The stages run as ``override.modules[s]`` inside ``override.context(s, j)``, which consume the
outputs themselves: nothing is gathered (microbatches of one program may differ in length).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from fxsplit.errors import ArgumentTypeError
from fxsplit.pipeline.comm import TOKEN, ActionComm, CommPlan
from fxsplit.runtime.microbatch import MicrobatchSplit, bind_symbols
from fxsplit.runtime.p2p import P2PChannel

__all__ = ["ProgramRun"]


class ProgramRun:
    """Mixed into `PipelineRuntime`: ``run_program``, and the metas a call with an override runs with."""

    def _model_metas(self) -> Sequence[Any]:
        """The model inputs' metas of this call: an override's ``shapes`` where it has them (a KV
        cache of a graph traced at a fixed length, [Note: KV cache for exported graphs] in
        fxsplit.api.kv_export: the traced length replaced by the symbols of a cached call), else the plan's."""
        rt: Any = self
        shapes = rt._override.shapes if rt._override is not None else None
        return rt.input_meta if shapes is None else shapes.input_meta

    def _bind(self, inputs: Sequence[Any]) -> dict:
        """The sizes of the symbols in the metas of this call (:meth:`_model_metas`), from ``inputs``."""
        rt: Any = self
        metas = self._model_metas()
        # by the metas themselves, not "an override's or the plan's": overrides of other shapes differ
        key = (tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in inputs), tuple(metas))
        if key not in rt._binding_cache:
            rt._binding_cache[key] = bind_symbols(metas, inputs)
        return rt._binding_cache[key]

    def _stage_meta(self, stage: int, index: int) -> Any:
        """The meta of input ``index`` of ``stage`` in this call (as :meth:`_model_metas`)."""
        rt: Any = self
        shapes = rt._override.shapes if rt._override is not None else None
        return rt.io[stage].input_meta[index] if shapes is None else shapes.stage_input_meta[stage][index]

    def run_program(self, program: CommPlan, inputs: Sequence[Sequence[Any]], *, override: Any) -> None:
        """Run ``program`` without autograd over ``inputs`` (one flat input list per microbatch) with
        the stages of ``override``; raises `PipelineError` naming the peer as ``forward`` does."""
        self._guarded(lambda: self._run_program(program, inputs, override))  # type: ignore[attr-defined]

    def _run_program(self, program: CommPlan, inputs: Sequence[Sequence[Any]], override: Any) -> None:
        rt: Any = self
        for j, flat in enumerate(inputs):
            if len(flat) != len(rt.input_meta):
                raise ArgumentTypeError(f"run_program: microbatch {j} has {len(flat)} flat inputs, the plan "
                                        f"takes {len(rt.input_meta)} ({[m.name for m in rt.input_meta]})")
        sizes = tuple(int(flat[0].shape[0]) for flat in inputs)
        rt._mb = MicrobatchSplit(inputs=tuple(tuple(f) for f in inputs), sizes=sizes,
                                 weights=tuple(1.0 for _ in sizes), batch_size=sum(sizes),
                                 batched=tuple(True for _ in inputs[0]))
        rt._override = override
        rt._bindings = [rt._bind(flat) for flat in inputs]
        rt._binding_keys = [tuple(sorted((str(k), v) for k, v in b.items())) for b in rt._bindings]
        rt._training = False
        rt._rng_step, rt.rng_step = rt.rng_step, rt.rng_step + 1
        rt._saved, rt._mailbox, rt._outputs = {}, {}, {}
        rt._channel = P2PChannel(program, group=rt.pp_group, timeout_s=rt.timeout, alloc=rt._alloc,
                                 blocking_waits=rt.blocking_waits, watch=rt.watch)
        rt._channel.reset()
        acts = program.actions
        with torch.no_grad():
            for i, ac in enumerate(acts):
                rt._current = ac.action
                if rt.watch is not None:
                    rt.watch.doing = ac.action
                for nxt in acts[i + 1: i + 1 + rt.prefetch_depth]:
                    rt._channel.prefetch(nxt.recvs, ac.action)
                rt._forward(self._tokens_in(ac, inputs))
                self._tokens_out(ac, inputs, override)
                rt._channel.reap()
            rt._current = None
            rt._channel.finish()
        rt.last_wait_seconds = rt._channel.wait_seconds
        rt._channel, rt._outputs, rt._override = None, {}, None

    def _tokens_in(self, ac: ActionComm, inputs: Sequence[Sequence[Any]]) -> ActionComm:
        """Write the token messages ``ac`` receives into the model inputs they stand for ([Note:
        token messages] in fxsplit.pipeline.comm); ``ac`` without its token messages."""
        rt: Any = self
        for msg in ac.recvs:
            if msg.kind == TOKEN:
                inputs[msg.microbatch][rt.io[msg.stage].inputs[msg.input].index].copy_(rt._take(msg, False, ac.action))
        if not any(m.kind == TOKEN for m in ac.recvs + ac.sends + ac.local_recvs + ac.local_sends):
            return ac
        keep = lambda msgs: tuple(m for m in msgs if m.kind != TOKEN)  # noqa: E731
        return dataclasses.replace(ac, recvs=keep(ac.recvs), sends=keep(ac.sends), local_recvs=keep(ac.local_recvs),
                                   local_sends=keep(ac.local_sends))

    def _tokens_out(self, ac: ActionComm, inputs: Sequence[Sequence[Any]], override: Any) -> None:
        """Send the tokens ``ac`` chose (``override.token(microbatch)``: the ids that microbatch
        reads), or write them in place when the reading stage is on this rank."""
        rt: Any = self
        for msg in ac.sends:
            if msg.kind == TOKEN:
                rt._give(msg, override.token(msg.microbatch), False, ac.action)
        for msg in ac.local_sends:
            if msg.kind == TOKEN:
                inputs[msg.microbatch][rt.io[msg.stage].inputs[msg.input].index].copy_(override.token(msg.microbatch))
