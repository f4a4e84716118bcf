"""What a `PipelineRuntime` is told besides its plan and its modules: `RuntimeOptions`.

    options = RuntimeOptions(group=pp_group, loss_fn=loss_fn, device=dev, split_backward="graph")
    rt = PipelineRuntime(rank_plan, modules, options)
    rt = PipelineRuntime(rank_plan, modules, group=pp_group, loss_fn=loss_fn, device=dev)  # the same
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from fxsplit.errors import UsageError
from fxsplit.runtime.watch import Watch

__all__ = ["GradHooks", "RuntimeOptions"]


class GradHooks(Protocol):
    """What the runtime tells about gradients during a step (fxsplit.runtime.data_parallel)."""

    def stage_grads_ready(self, stage: int) -> None: ...


@dataclass
class RuntimeOptions:
    """The options of one rank's runtime.

    - ``group``: the pipeline process group (None = default group; e.g. ``mesh.get_group("pp")``).
    - ``loss_fn(output, target) -> scalar``: a mean over the microbatch; ``output`` is the model
      output rebuilt with the plan's ``output_spec`` (a tensor or tuple of flat outputs when None).
      None: forward only.
    - ``device``: where the stages run.
    - ``timeout``: seconds any wait may take before a `PipelineError` names the peer.
    - ``split_dim`` / ``batched``: microbatch split (fxsplit.runtime.microbatch).
    - ``abort_on_error``: on any failure, destroy ``group`` (or the default group when it is
      None) so that peers blocked on this rank fail at once instead of at their timeout; the
      group is unusable afterwards.
    - ``prefetch``: how many actions ahead receives are posted.
    - ``blocking_waits``: see `P2PChannel`; None: True on gloo, False on NCCL.
    - ``seed``: run each forward of microbatch i on stage s on the stage stream of
      (seed, s, i, k), k counting this runtime's step()/forward() calls from 0 ([Note: RNG
      streams] in fxsplit.tp.random): random ops draw the same on every tp rank, differently per
      stage and microbatch, independently of the schedule's order. None: the global RNG as is.
    - ``reduce_dtype``: the dtype tied parameters' gradients are summed in (mp_policy); None: theirs.
    - ``split_backward``: how a stage whose backward the schedule splits into I and W runs:
      "graph" (forward, I and W as three fx graphs, [Note: graph split backward]; a stage that
      cannot be traced that way falls back to "autograd" and ``split_fallbacks[stage]`` says
      why) or "autograd" ([Note: split backward]).
    - ``compile``: every training forward runs as the graph split's F graph (whatever the
      schedule; B is one graph where the schedule never splits the stage, else I then W) and
      the graphs are compiled with ``torch.compile`` (inductor), once per input signature; a
      forward-only call runs compiled inference graphs; ``compile_fallbacks[(stage, "F" | "I" |
      "W" | "B" | "inference" | "loss")]`` says why a graph runs uncompiled ([Note: compiled
      stages] in fxsplit.runtime.compile.compiling).
    - ``fuse_backward``: False: a B of a compiled stage runs I then W even where the schedule never
      splits it (for measuring [Note: fused backward]; ``ParallelConfig.fuse_backward``).
    - ``watch``: the failure board every wait polls ([Note: failure protocol] in
      fxsplit.runtime.watch); None: waits bounded by ``timeout`` alone.
    - ``grad_hooks``: told ``stage_grads_ready(stage)`` once a stage's last backward of the step has
      run (its gradients are complete, except tied parameters, summed after all actions), so
      data-parallel all-reduces start while later stages still compute (fxsplit.runtime.data_parallel).
    - ``defer_tied_grads``: step() leaves tied gradients unsummed for sum_tied_grads() once final
      (FSDP reduces after the step: [Note: FSDP collectives outside the pipeline] in fxsplit.runtime.fsdp).
    """

    group: dist.ProcessGroup | None
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    device: torch.device | str
    timeout: float = 300.0
    split_dim: int = 0
    batched: Sequence[bool] | None = None
    abort_on_error: bool = True
    prefetch: int = 2
    blocking_waits: bool | None = None
    seed: int | None = None
    reduce_dtype: torch.dtype | None = None
    split_backward: str = "graph"
    compile: bool = False
    fuse_backward: bool = True
    watch: Watch | None = None
    grad_hooks: GradHooks | None = None
    defer_tied_grads: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.split_dim:
            raise UsageError(f"split_dim must be >= 0, got {self.split_dim}")
        if self.split_backward not in ("graph", "autograd"):
            raise UsageError(f"split_backward must be 'graph' or 'autograd', got {self.split_backward!r}")
        if self.compile and self.split_backward != "graph":
            raise UsageError("compile=True compiles the graph split's F, I and W graphs ([Note: compiled "
                             "stages]); split_backward='autograd' runs autograd's graph, which it cannot compile: "
                             "use split_backward='graph'")
        self.timeout = float(self.timeout)
        self.prefetch = max(0, int(self.prefetch))
        self.compile = bool(self.compile)
