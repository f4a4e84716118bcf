"""This rank's part of a parallelized model: :class:`ParallelModel` (training step, inference,
gradient synchronization, full state dicts and sharded checkpoints).

Terms as in :mod:`fxsplit.api` (d, t, p; stages; microbatches). Built by :func:`fxsplit.parallelize`;
its parameters are this rank's local shards, so any torch optimizer works on ``pm.parameters()``.
Failures are agreed on by every rank ([Note: failures] at :meth:`ParallelModel._agree`).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx
from torch import nn

from fxsplit.api import agreement, checkpoint
from fxsplit.api.checkpoint import alias_groups, like_param, load_full_checkpoint
from fxsplit.api.inputs import check_batch, inference_microbatches
from fxsplit.api.padding import outputs_cut, pad_to_traced
from fxsplit.errors import (ArgumentTypeError, MissingKeyError, PlanError, RankFailedError, RunError, ShardingError,
                            UsageError)
from torch.distributed.device_mesh import DeviceMesh

from fxsplit.runtime import PipelineRuntime
from fxsplit.runtime.data_parallel import DataParallelGrads
from fxsplit.runtime.failures import exchange_errors
from fxsplit.runtime.fsdp import ShardedGradSync
from fxsplit.runtime.mesh import Groups
from fxsplit.runtime.timing import StepTimer
from fxsplit.runtime.watch import Watch, group_wait
from fxsplit.graph.trace import flatten_inputs

if TYPE_CHECKING:
    from fxsplit.api import Plan

__all__ = ["ParallelModel", "check_batch", "load_full_checkpoint"]

log = logging.getLogger(__name__)


class ParallelModel(nn.Module):
    """This rank's part of a parallelized model: its stages' modules (local shards) and the
    pipeline runtime. ``parameters()`` are the local shards, so any torch optimizer works."""

    def __init__(self, *, plan_: Plan, stages: Mapping[int, nn.Module], runtime: PipelineRuntime, mesh: DeviceMesh,
                 coords: Mapping[str, int], groups: Groups, loss_fn: Callable | None, grads: DataParallelGrads,
                 log_every: int | None = None, sharded: ShardedGradSync | None = None, watch: Watch | None = None):
        super().__init__()
        self._watch = watch  # when world size > 1 ([Note: failure protocol])
        if watch is not None:
            weakref.finalize(self, watch.close)  # its thread stops with this model
        self.plan = plan_
        self.stage_modules = nn.ModuleDict({str(s): m for s, m in stages.items()})
        self._runtime: PipelineRuntime = runtime
        self.mesh = mesh
        self.coords = dict(coords)
        self._groups = groups
        self.loss_fn = loss_fn
        self._grads = grads  # the data-parallel mean, the runtime's hooks (fxsplit.runtime.data_parallel)
        self._log_every = log_every
        self._steps = 0
        self._timer: StepTimer | None = None  # the last step's ([Note: step timing] in fxsplit.runtime.timing)
        self._waited = 0.0  # host seconds the last step spent blocked on its peers
        # dp_shard > 1: FSDP2 units, gathered before and reduced after the pipeline ([Note: FSDP
        # collectives outside the pipeline] in fxsplit.runtime.fsdp)
        self._fsdp = sharded
        self._wait = group_wait(watch, polled=self._polled())

    # -- inspection
    def local_stage_graphs(self) -> dict[int, torch.fx.GraphModule]:
        return {int(s): m for s, m in self.stage_modules.items()}

    @property
    def runtime(self) -> PipelineRuntime:
        """This rank's pipeline runtime (read it, do not set its attributes): its public API serves
        instrumentation, e.g. ``pm.runtime.probe(before=...)`` or ``pm.runtime.traced_graphs()``."""
        return self._runtime

    @property
    def compile_fallbacks(self) -> dict[tuple[int, str], str]:
        """With ``compile=True``: ``(stage, "F" | "I" | "W" | "B" | "inference" | "loss")`` -> why
        that graph of this rank runs uncompiled ([Note: compiled stages]); empty when all compiled."""
        return dict(self._runtime.compile_fallbacks)

    @property
    def split_fallbacks(self) -> dict[int, str]:
        """Stage -> why the graph split refused this rank's stage, which then runs its split backward
        (I, W) on autograd (``split_backward="graph"``); empty when every split stage is traced."""
        return dict(self._runtime.split_fallbacks)

    # -- running
    def _bound(self) -> contextlib.ExitStack:
        from fxsplit.tp.collectives import bind_groups, bind_waiter

        stack = contextlib.ExitStack()
        stack.enter_context(bind_groups(self._groups.axes()))
        if self._polled():
            stack.enter_context(bind_waiter(self._watch.wait))
        return stack

    def _polled(self) -> bool:
        """Waits go through the watch only where they block the host (gloo): NCCL's waits only order
        streams, and a timed NCCL wait is not a harmless poll (its watchdog bounds them)."""
        return self._watch is not None and self._runtime.blocking_waits

    def _flat(self, args: tuple, kwargs: dict) -> list:
        return flatten_inputs(self.plan.graph, args, kwargs)

    # [Note: failures] set when a step failed inside the runtime on some rank; the pipeline group
    # of that rank is destroyed then, so this model cannot run again.
    _failure: str | None = None

    def step(self, *args: Any, target: Any = None, scaler: torch.amp.GradScaler | None = None,
             **kwargs: Any) -> torch.Tensor:
        """Forward + backward over all microbatches; returns the full-batch loss on every rank
        (averaged over data-parallel replicas). Gradients land in ``self.parameters()``.

        ``scaler``: a ``torch.amp.GradScaler`` (float16 training): backward runs from the loss
        times the scaler's scale (what ``scaler.scale(loss).backward()`` does in one process;
        the returned loss is unscaled), and the inf check is agreed over all ranks so that
        ``scaler.step(optimizer)`` skips on every rank or on none ([Note: one skip decision for a
        GradScaler] in :mod:`fxsplit.api.grad_norm`). Then, as usual: ``scaler.unscale_(opt)``
        (before :meth:`clip_grad_norm_`), ``scaler.step(opt)``, ``scaler.update()``.

        Any batch size B >= m and any sequence length the model allows run without re-planning
        (batch and sequence are traced as symbols; torch.export fixes the sequence, and shorter ones
        are padded to it: [Note: padding to the traced length] in fxsplit.api.padding), except
        that a plan with a known microbatch size (``global_batch_size=`` / ``microbatch_size=``) traced
        by torch.export takes microbatches of that size only (``dynamic_batch=True`` for any:
        [Note: a static batch] in fxsplit.graph.examples).
        B need not divide by m: the microbatches differ by at most one sample and microbatch i's
        loss is weighted by b_i / B ([Note: loss weighting] in fxsplit.runtime.microbatch), which
        equals the full-batch loss and gradients for a loss that is a mean over samples. Errors: [Note: failures].
        """
        if self.loss_fn is None:
            raise RunError(
                "step() needs a loss: this model was parallelized without loss_fn (inference only); "
                "call pm(inputs) for inference, or pass fxsplit.parallelize(..., loss_fn=...) to train"
            )
        self._check_usable("step")
        timer = StepTimer(self._runtime.device)
        error, loss, loss_scale = None, None, None
        try:
            flat = self._flat(args, kwargs)
            run_flat, length = pad_to_traced(flat, self.plan)  # [Note: padding to the traced length]
            check_batch(run_flat, self.plan, "step")
            if target is None and self.plan.config.num_stages - 1 in self.local_stage_graphs():
                raise UsageError(
                    "step(): this rank holds the last stage, which computes the loss, and needs the "
                    "target: pass step(inputs, target=...) (on every rank is simplest)"
                )
            loss_scale = self._loss_scale(scaler)
        except Exception as exc:  # noqa: BLE001 -- re-raised on every rank by _agree
            error = exc
        sig = self._input_signature(flat, target, "step") if error is None else (self._replica(), None, None)
        self._agree(error, False, "step", sig, lambda spans: self._check_inputs(spans, "step", flat, target))
        try:
            if self._fsdp is not None:
                self._fsdp.begin()
            with self._bound():
                loss = self._runtime.step(run_flat, target=target, loss_scale=loss_scale,
                                          cut_outputs=outputs_cut(self.plan, length))
        except Exception as exc:  # noqa: BLE001 -- re-raised on every rank by _agree
            error = exc
            self._post(exc)
        # the loss's hash travels only where another rank compares it: reading the loss to the host
        # waits for the whole step on a GPU, and one process need not (the host may run ahead)
        sig = agreement.loss_signature(loss, replica=self._replica()) if self._groups.errors is not None else ()
        self._agree(error, True, "step", sig, lambda spans: self._check_losses(spans, loss))
        try:
            loss = self._finish_step(loss, loss_scale, error)
        except RankFailedError:
            self._give_up("step")
            raise
        timer.stop()
        self._timer, self._waited = timer, self._runtime.last_wait_seconds
        self._steps += 1
        if self._log_every and self._steps % self._log_every == 0:
            log.info(
                "step %d: loss %.6f, %.3fs, measured bubble %.1f%% (time blocked on pipeline peers)",
                self._steps, float(loss), self.last_step_seconds, 100 * self.last_bubble,
            )
        return loss

    @property
    def last_step_seconds(self) -> float:
        """Seconds of the last ``step()``: host time on the CPU, the device's (CUDA events) on a GPU,
        which reading waits for ([Note: step timing] in fxsplit.runtime.timing)."""
        return self._timer.seconds if self._timer is not None else 0.0

    @property
    def last_wait_seconds(self) -> float:
        """Host seconds the last ``step()`` spent blocked on pipeline peers (gloo's waits; NCCL's only
        order streams and count nothing)."""
        return self._waited

    @property
    def last_sent_bytes(self) -> int:
        """Bytes this rank sent its pipeline peers in the last ``step()`` or ``forward()``."""
        return self._runtime.last_sent_bytes

    @property
    def last_bubble(self) -> float:
        """Share of the last step this rank's host spent blocked on its pipeline peers (waits that block
        the host: gloo's; NCCL's only order streams and count nothing)."""
        seconds = self.last_step_seconds
        return self._waited / seconds if seconds > 0 else 0.0

    def _finish_step(self, loss: torch.Tensor, loss_scale: Any, error: Exception | None) -> torch.Tensor:
        """After the pipeline: data-parallel gradients, tied sums, the inf agreement, the loss mean."""
        self._doing("reducing gradients after step()")
        self._grads.finish()
        # every rank agrees here or none does: a rank holding no tied copy still joins (with ZB-V
        # both copies of a tied weight can sit on one pipeline rank, so the tied copies held differ by rank)
        if self._fsdp is not None and self._runtime.plan.shared_params:
            try:  # tied copies: summed over their pipeline ranks once FSDP reduced each
                self._runtime.sum_tied_grads()
            except Exception as exc:  # noqa: BLE001 -- re-raised on every rank by _agree
                error = exc
            self._agree(error, True, "step")
        if loss_scale is not None:
            from fxsplit.api.grad_norm import agree_nonfinite

            agree_nonfinite(self.parameters(), group=dist.group.WORLD if dist.is_initialized() else None,
                            device=self._runtime.device)
        dp = self._groups.data if self._fsdp is not None else self._groups.dp
        if dp is not None and dist.get_world_size(dp) > 1:
            loss = loss.detach().clone()
            self._wait(dist.all_reduce(loss, group=dp, async_op=True), "in the data-parallel mean of the loss", dp)
            loss /= dist.get_world_size(dp)
        self._doing("between fxsplit calls (after step())")
        return loss

    def _loss_scale(self, scaler: Any) -> torch.Tensor | None:
        """The scale backward starts from: ``scaler.scale(1)`` on this rank's device (which also
        initializes the scaler's state, as ``scaler.scale(loss)`` would), None without a scaler."""
        if scaler is None:
            return None
        if not isinstance(scaler, torch.amp.GradScaler):
            raise ArgumentTypeError(f"step(scaler=...) takes a torch.amp.GradScaler, got {type(scaler).__name__}")
        if not scaler.is_enabled():
            return None
        return scaler.scale(torch.ones((), dtype=torch.float32, device=self._runtime.device))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Inference through the pipeline; the output in the model's own structure, on every rank.
        Other batch sizes and sequence lengths run without re-planning, as in :meth:`step`; a batch
        of B < m samples runs in B microbatches ([Note: fewer microbatches for inference] in
        :mod:`fxsplit.api.generate`)."""
        def prepare() -> list:
            flat = self._flat(args, kwargs)
            padded, _ = pad_to_traced(flat, self.plan)  # [Note: padding to the traced length]
            check_batch(padded, self.plan, "forward", microbatches=inference_microbatches(padded, self.plan))
            return flat

        def body(flat: list) -> Any:
            padded, length = pad_to_traced(flat, self.plan)
            return self._runtime.forward(padded, all_ranks=True, microbatches=inference_microbatches(padded, self.plan),
                                         cut_outputs=outputs_cut(self.plan, length))

        return self._inference("forward", prepare, body)

    def generate(self, input_ids: torch.Tensor, *, max_new_tokens: int, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int | None = None, eos_token_id: int | None = None,
                 seed: int | None = None, use_cache: bool = True, overlap_steps: bool = True) -> torch.Tensor:
        """Continue each prompt of ``input_ids`` (B, T) by up to ``max_new_tokens`` tokens; returns
        (B, T + n) on every rank, as Hugging Face's ``model.generate`` does. Greedy, or sampled with
        ``temperature`` / ``top_k`` from ``seed``; any B >= 1. Call on every rank of a replica with the
        same arguments. With a KV cache where it is exact (``use_cache=False``: never), else one
        forward over the whole sequence per token (``fxsplit.api.generate.cache_path(pm)`` says why);
        with the cache, ``overlap_steps`` runs the steps of microbatches as one pipelined program.
        Design, terms and limits: :mod:`fxsplit.api.generate`."""
        from fxsplit.api.generate import generate

        return generate(self, input_ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                        do_sample=do_sample, temperature=temperature, top_k=top_k, seed=seed,
                        use_cache=use_cache, overlap_steps=overlap_steps)

    def _inference(self, what: str, prepare: Callable[[], list], body: Callable[[list], Any], *,
                   signature: Callable[[list], tuple] | None = None,
                   check: Callable[[list, list], None] | None = None) -> Any:
        """One inference call under [Note: failures]: ``prepare()`` (this rank's checks; returns the
        flat inputs), the agreement on them (``signature(flat)`` and ``check(spans, flat)``; default:
        the inputs' shapes), ``body(flat)`` without autograd with the groups bound and FSDP units
        gathered, and the agreement on its outcome. Returns what ``body`` returned."""
        self._check_usable(what)
        error, out, flat = None, None, None
        try:
            flat = prepare()
        except Exception as exc:  # noqa: BLE001 -- re-raised on every rank by _agree
            error = exc
        if error is not None:
            sig = (self._replica(), None)
        else:
            sig = signature(flat) if signature is not None else self._input_signature(flat, None, what)
        self._agree(error, False, what, sig, lambda spans: check(spans, flat) if check is not None
                    else self._check_inputs(spans, what, flat, None))
        try:
            if self._fsdp is not None:
                self._fsdp.gather()
            with self._bound(), torch.no_grad():
                out = body(flat)
        except Exception as exc:  # noqa: BLE001 -- re-raised on every rank by _agree
            error = exc
            self._post(exc)
        if self._fsdp is not None:
            self._fsdp.reshard()
        self._agree(error, True, what)
        self._doing(f"between fxsplit calls (after {what}())")
        return out

    # [Note: inputs that must agree] in fxsplit.api.agreement: the values ride in the exchanges
    def _replica(self) -> int:
        return self.coords.get("dp", 0) * self.plan.config.dp_shard + self.coords.get("dp_shard", 0)

    def _describe(self, rank: int) -> str:
        return self._watch.describe(rank) if self._watch is not None else f"global rank {rank}"

    def _holds_last(self) -> bool:
        return self.plan.config.num_stages - 1 in self.local_stage_graphs()

    def _input_signature(self, flat: Sequence[Any], target: Any, what: str) -> tuple[int | None, ...]:
        return agreement.input_signature(flat, target, replica=self._replica(), holds_last=self._holds_last(),
                                         with_target=what == "step")

    def _check_inputs(self, spans: list, what: str, flat: Sequence[Any], target: Any) -> None:
        agreement.check_inputs(spans, what, flat, target, replica=self._replica(), holds_last=self._holds_last(),
                               group=self._groups.errors, describe=self._describe)

    def _check_losses(self, spans: list, loss: Any) -> None:
        problem = agreement.losses_disagree(spans, loss, replica=self._replica(), group=self._groups.errors,
                                            describe=self._describe)
        if problem is not None:
            self._give_up("step")  # the gradients of this step disagree across ranks too
            raise RunError(problem)

    def _post(self, exc: Exception) -> None:
        """This rank's own code raised inside a call: post it for the ranks it leaves waiting."""
        from fxsplit.errors import PipelineError

        if self._watch is not None and not isinstance(exc, (RankFailedError, PipelineError)):
            self._watch.post_raised(exc)

    def _doing(self, text: str) -> None:
        if self._watch is not None:
            self._watch.doing = text

    def _check_usable(self, what: str) -> None:
        if self._failure is not None:
            raise RunError(
                f"{what}(): this ParallelModel cannot run again: {self._failure}. Its process groups "
                "were given up after the failure (they may hold transfers no peer completes); build a "
                "new one with fxsplit.parallelize(...)"
            )
        self._doing(f"in {what}() (call after {self._steps} step(s))")

    def _agree(self, error: Exception | None, in_runtime: bool, what: str, signature: Sequence[int | None] = (),
               check: Callable[[list], None] | None = None) -> None:
        """[Note: failures] Every rank learns whether any rank failed, and all raise together.

        Called twice per step: after the input checks (so that no rank enters the pipeline while a
        peer it waits for refused its inputs) and after the runtime. Each is one small MAX
        all-reduce over every rank on the happy path (gloo), carrying the outcome code and the
        values ranks must agree on ([Note: inputs that must agree] in fxsplit.api.agreement), waited
        through the watch ([Note: failure protocol] in fxsplit.runtime.watch: it ends at once when
        a rank is known lost). When some rank failed, every rank gathers the error texts: a rank
        whose own code raised re-raises its exception (same type) with a note naming the other
        failed ranks; every other rank raises :class:`RankFailedError` naming the failed global
        rank(s), their mesh coordinates, stages, action and errors. A failure inside the pipeline
        runtime with tp > 1 or pp > 1, or a lost rank, abandons this model's groups (they may hold
        transfers no peer completes) and it refuses to run again; errors found before the runtime
        (bad batch, missing target) leave it usable.
        """
        group = self._groups.errors
        if group is None:  # one process: nobody to tell
            if error is not None:
                raise error
            return
        spans: list = []
        failure = exchange_errors(group, error, in_runtime, timeout=self._runtime.timeout,
                                   coords=self.coords, what=what, watch=self._watch, signature=signature,
                                   replicas=self.plan.config.dp * self.plan.config.dp_shard, spans=spans)
        if failure is None:
            if check is not None:
                check(spans)  # the same spans on every rank: the same answer everywhere
            return
        worst, exc = failure
        self._name_what_it_did(exc)
        report = getattr(exc, "report", None)
        lost = report is not None and report.kind != "raised"
        cfg = self.plan.config
        if lost or (in_runtime and (cfg.tp > 1 or cfg.pp > 1)):
            # a rank that will not come back, or collectives that may be left half done: this
            # model's groups are abandoned ([Note: failure protocol] point 4) and it cannot run again
            self._give_up(what, exc)
            raise exc
        if self._fsdp is not None and in_runtime and self._failure is None:
            # the FSDP units hold gathered parameters and unreduced gradients of the failed step
            self._failure = f"an earlier {what}() failed while its sharded (FSDP) stages were gathered"
        if self._grads.in_flight:
            # all-reduces this rank started during the failed step have no partner on a rank that
            # failed before starting its own: drop the data-parallel group so they end, and refuse
            # to run again (a new fxsplit.parallelize builds fresh groups)
            self._grads.drop()
            self._abort_group("dp")
            if self._failure is None:
                self._failure = f"an earlier {what}() failed while data-parallel gradients were in flight"
        if worst >= 2 and self.plan.config.pp > 1:
            if isinstance(exc, RankFailedError):
                cause = f"on global rank(s) {sorted(exc.failed)}"
            else:
                first = (str(exc).splitlines() or [""])[0]
                cause = f"on this rank ({type(exc).__name__}: {first[:120]}{'...' if len(first) > 120 else ''})"
            self._failure = f"an earlier {what}() failed in the pipeline runtime {cause}"
        if self._failure is None and self._watch is not None:
            self._watch.recovered()  # every rank agreed and nothing is left in flight: a fresh board
        raise exc

    def _name_what_it_did(self, exc: BaseException) -> None:
        """A failure agreed in the exchange names ranks by coordinates; the board also knows the first
        failed rank's stages and what it was running ([Note: failure protocol]): say it too."""
        if self._watch is None or not isinstance(exc, RankFailedError) or hasattr(exc, "report"):
            return
        cause = self._watch.cause()
        if cause is not None and cause.kind == "raised" and cause.suspect in exc.failed and exc.args:
            exc.args = (f"{exc.args[0]} First to fail: {cause.where}, while {cause.doing}.", *exc.args[1:])

    def _give_up(self, what: str, exc: BaseException | None = None) -> None:
        """Abandon every group this model uses (they may hold operations no peer completes) and
        refuse to run again."""
        from fxsplit.runtime.watch import abandon

        for group in self._groups.all():
            if group is not dist.group.WORLD:
                abandon(group)
        self._runtime.give_up_group()
        self._grads.drop()
        if self._failure is None:
            if isinstance(exc, RankFailedError):
                cause = f"on global rank(s) {sorted(exc.failed)}"
            else:
                first = "" if exc is None else (str(exc).splitlines() or [""])[0]
                cause = (f"on this rank ({type(exc).__name__ if exc else 'error'}: {first[:120]}"
                         f"{'...' if len(first) > 120 else ''})")
            self._failure = f"an earlier {what}() failed {cause}"
        if self._watch is not None:
            self._watch.doing = f"stopped: an earlier {what}() failed"

    def _abort_group(self, axis: str) -> None:
        group = getattr(self._groups, axis)
        if group is None or group is dist.group.WORLD:
            return
        if self._watch is not None:  # it may hold transfers no peer completes ([Note: failure protocol])
            from fxsplit.runtime.watch import abandon

            abandon(group)
            self._groups = self._groups.without(axis)
            return
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 -- best effort; the original error is what gets raised
            pass
        self._groups = self._groups.without(axis)

    # -- gradient clipping
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the gradients by the norm of the WHOLE model's gradient; returns that norm.

        The norm is the one ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` returns
        on the unsplit model: over every parameter of every stage, tp shard and replica, each
        counted once ([Note: counting each parameter once] in :mod:`fxsplit.api.grad_norm`), as
        a float32 0-dim tensor equal on every rank. When it exceeds ``max_norm``, every local
        gradient is multiplied by ``max_norm / (norm + 1e-6)``, exactly as torch does.
        ``norm_type`` is any p > 0 or ``float("inf")`` (the largest absolute value).

        Call it on every rank (it is one collective: an all-reduce of one number over all ranks),
        after :meth:`step` and before ``optimizer.step()``. Do NOT use
        ``torch.nn.utils.clip_grad_norm_(pm.parameters(), ...)``: it sees one rank's shards and
        copies only, so every rank would compute a different norm (missing the other stages and
        shards) and clip by its own factor: wrong for the whole model, and the copies of a
        tp-replicated or tied parameter would silently drift apart.
        """
        from fxsplit.api.grad_norm import check_norm_type, global_norm, norm_parameters, scale_grads
        from fxsplit.runtime.fsdp import local_tensor

        p = check_norm_type(norm_type)
        specs = self.plan.tp_plan.param_specs
        c, coords = self.plan.config, self.coords
        # the first ep group: data index < ep at cp rank 0 ([Note: expert-parallel groups]); FSDP shards over
        # the cp ranks too ([Note: FSDP over cp]), so with dp_shard every cp rank counts its own shards
        first_experts = coords.get("dp", 0) * c.dp_shard + coords.get("dp_shard", 0) < c.ep and coords.get("cp", 0) == 0
        counted = norm_parameters(
            {int(s): m for s, m in self.stage_modules.items()}, shared_params=self.plan.stages.shared_params,
            sharded=specs, coords={k: v for k, v in coords.items() if k != "cp" or c.dp_shard == 1},
            experts=set(self.plan.ep_plan.expert_params) if c.ep > 1 else set(), first_expert_group=first_experts)
        world = dist.group.WORLD if dist.is_initialized() else None
        total = global_norm([local_tensor(q.grad) for q in counted if q.grad is not None], p, group=world,
                            device=self._runtime.device)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RunError(
                f"clip_grad_norm_: the total norm of order {p} of the gradients is {float(total)}, so "
                "they cannot be clipped (raised on every rank); pass error_if_nonfinite=False to scale "
                "them by it anyway"
            )
        scale_grads(self.parameters(), max_norm, total)
        return total

    # -- state
    def _local_state(self, *, gather: bool = False) -> dict[str, torch.Tensor]:
        """This rank's tensors by name; FSDP-sharded ones as DTensors, or with ``gather`` whole
        (this rank's tp shard; an all-gather over the FSDP mesh, every rank in the same order)."""
        from torch.distributed.tensor import DTensor

        out: dict[str, torch.Tensor] = {}
        for mod in self.stage_modules.values():
            for k, v in mod.state_dict(keep_vars=False).items():
                if k not in out:
                    out[k] = v.full_tensor() if gather and isinstance(v, DTensor) else v
        return out

    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor] | None:
        """The original model's state dict (original names and shapes, CPU tensors), gathered from
        every rank's shards; on every rank, or only on global rank 0 with ``rank0_only``."""
        from fxsplit.tp.sharding import unshard_state_dict

        specs = self.plan.tp_plan.param_specs
        local = {k: v.detach().cpu() for k, v in self._local_state(gather=True).items()}
        tp = self._groups.tp
        if tp is not None and dist.get_world_size(tp) > 1:
            per_rank: list = [None] * dist.get_world_size(tp)
            dist.all_gather_object(per_rank, local, group=tp)
            local = unshard_state_dict(per_rank, {k: s for k, s in specs.items() if k in local})
        local = self._joined_experts(local)
        pp = self._groups.pp
        merged = dict(local)
        if pp is not None and dist.get_world_size(pp) > 1:
            parts: list = [None] * dist.get_world_size(pp)
            dist.all_gather_object(parts, local, group=pp)
            merged = {}
            for part in parts:
                for k, v in part.items():
                    merged.setdefault(k, v)
        if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
            return None
        return _with_aliases(merged, self.plan.graph)

    def _joined_experts(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``local`` with every expert weight placed by ep whole: the ep group's blocks joined on dim 0
        (every rank of an ep group holds the same stages, so all call this alike)."""
        group = self._groups.ep
        names = [k for k in self.plan.ep_plan.expert_params if k in local] if self.plan.config.ep > 1 else []
        if group is None or not names:
            return local
        blocks: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(blocks, {k: local[k] for k in names}, group=group)
        return {**local, **{k: torch.cat([b[k] for b in blocks]) for k in names}}

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
        """Load a full (unsharded) state dict with the original names; each rank keeps its shards."""
        specs = self.plan.tp_plan.param_specs
        tp_rank = self.coords.get("tp", 0)
        experts = set(self.plan.ep_plan.expert_params) if self.plan.config.ep > 1 else set()
        ep_rank = self._groups.ep.rank() if experts else 0
        missing = []
        for mod in self.stage_modules.values():
            # what state_dict() holds: parameters and persistent buffers (non-persistent ones,
            # e.g. rotary inv_freq, are never saved and keep the values the model gave them)
            for name, t in mod.state_dict(keep_vars=True).items():
                if name not in state_dict:
                    missing.append(name)
                    continue
                src = state_dict[name]
                if name in specs:
                    src = specs[name].shard(src, tp_rank)
                if name in experts:  # this rank's block of experts
                    src = src.chunk(self.plan.config.ep)[ep_rank]
                if tuple(src.shape) != tuple(t.shape):
                    raise ShardingError(f"load_full_state_dict: {name!r} has shape {tuple(src.shape)}, expected {tuple(t.shape)} (after sharding)")
                _copy_into(t, src)
        if strict and missing:
            raise MissingKeyError(f"load_full_state_dict: missing {sorted(set(missing))[:10]}")

    def _named_local_params(self) -> dict[str, nn.Parameter]:
        out: dict[str, nn.Parameter] = {}
        for mod in self.stage_modules.values():
            for name, param in mod.named_parameters(remove_duplicate=False):
                out.setdefault(name, param)
        return out

    # -- checkpoints ([Note: checkpoint layout] in fxsplit.api.checkpoint)
    def save_checkpoint(self, path: str, *, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Sharded save through ``torch.distributed.checkpoint``, on every rank: each rank writes
        only its own tensors (and, with ``optimizer``, its per-parameter optimizer state, sharded
        like the parameter), a checksum of each, and the training state (:attr:`step_count`, the
        RNG streams' seed and counter). Atomic: ``path`` appears, or replaces an earlier checkpoint,
        only once every rank finished. A checkpoint loads under any (dp, tp, pp) with
        :meth:`load_checkpoint`, or whole in one process with :func:`load_full_checkpoint`.
        Errors: :class:`~fxsplit.errors.CheckpointError` on every rank."""
        checkpoint.save_checkpoint(self, path, optimizer=optimizer)

    def load_checkpoint(self, path: str, *, optimizer: torch.optim.Optimizer | None = None,
                        allow_nonfinite: bool = False) -> None:
        """Load a checkpoint written by :meth:`save_checkpoint` under any (dp, tp, pp): each rank
        reads only the tensors its stages need and keeps its own shards; with ``optimizer`` (built
        over ``self.parameters()``), also its per-parameter state, cut to this rank's shards. The
        training state comes back too (:attr:`step_count`, the RNG streams: a resume at the same
        layout draws the same dropout masks). Each tensor read is checked against its checksum and
        for NaN/inf (unless ``allow_nonfinite``); a failure on any rank raises on every rank
        (:class:`~fxsplit.errors.CheckpointError` where it failed)."""
        checkpoint.load_checkpoint(self, path, optimizer=optimizer, allow_nonfinite=allow_nonfinite)

    @property
    def step_count(self) -> int:
        """Completed :meth:`step` calls, counted across a :meth:`load_checkpoint` resume."""
        return self._steps


def _with_aliases(state: dict[str, torch.Tensor], graph: nn.Module) -> dict[str, torch.Tensor]:
    """``state`` with every name of a tied tensor, as ``model.state_dict()`` gives them.

    A stage graph reads a tied tensor through one name (torch.export keeps one ``get_attr`` per
    tensor: HF GPT-2's ``lm_head.weight`` and not ``transformer.wte.weight``), so the stages'
    state dicts name it once; the traced graph (``plan.graph``) still holds the model's modules
    at every name, and the names that resolve to one tensor there are its aliases."""
    out = dict(state)
    for group in alias_groups(graph):
        have = next((n for n in group if n in state), None)
        if have is not None:
            for n in group:
                out.setdefault(n, state[have])
    return out


def _copy_into(t: torch.Tensor, src: torch.Tensor) -> None:
    from fxsplit.runtime.fsdp import local_tensor

    local_tensor(t).copy_(local_tensor(like_param(t, src.to(local_tensor(t).device))))
