"""The options of a plan: :class:`ParallelConfig`, one typed, validated dataclass that
``plan``, ``parallelize`` and the CLI share.

Terms as in :mod:`fxsplit.api.plan` (d, t, p, v, m).

    config = ParallelConfig(tp=2, pp=4, microbatches=8)       # validated on creation
    plan = fxsplit.plan(model, (x,), config=config)            # or fxsplit.plan(model, (x,), tp=2, pp=4, ...)
    plan.config                                                # the resolved config: every default filled in

``microbatches`` and ``stages_per_rank`` may be left ``None`` (their defaults depend on ``pp`` and
the schedule); :meth:`ParallelConfig.resolved` fills them in, and ``Plan.config`` is always resolved.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fxsplit import config
from fxsplit.errors import ArgumentTypeError, PlanError
from fxsplit.hardware import Hardware
from fxsplit.schedule import NAMES as SCHEDULES
from fxsplit.schedule import schedule_spec

__all__ = ["ParallelConfig", "SCHEDULES", "make_config"]

_CUT_AT = ("layers", "any", "modules")
_METHODS = config.TRACE_METHODS
_CHECKPOINTING = ("none", "selective", "full", "auto")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Every option of a plan (validated on creation; see the module docstring)."""

    dp: int = 1  # data-parallel replicas
    # data-parallel ranks that shard parameters, gradients and optimizer state among themselves
    # (torch FSDP2's fully_shard over the "dp_shard" mesh axis; HSDP with dp > 1)
    dp_shard: int = 1
    tp: int = 1  # tensor-parallel degree
    # expert-parallel degree: ranks carved out of the dp * dp_shard data-parallel ranks that each hold
    # E / ep experts of every MoE layer and exchange tokens by all_to_all (fxsplit.passes.expert_parallel)
    ep: int = 1
    # context-parallel degree: each cp rank keeps 2 of 2*cp chunks of every sequence, attention reads
    # the other ranks' keys and values by all-gather or ring (cp_kv) ([Note: context parallelism by
    # propagation] in fxsplit.passes.context_parallel); traced by torch.export with a static sequence
    cp: int = 1
    # how the local queries read every rank's keys and values under cp > 1: "allgather", "ring", or
    # None (per attention, by a memory rule: [Note: all-gather or ring] in fxsplit.passes.cp_attention)
    cp_kv: str | None = None
    pp: int = 1  # pipeline ranks
    microbatches: int | None = None  # m per step; default 2 * pp (1 without a pipeline)
    # samples per microbatch, when known (plan(..., global_batch_size=B) sets B / (dp * dp_shard * m)):
    # torch.export then traces the batch static at that size ([Note: a static batch] in
    # fxsplit.graph.examples); None: the batch is symbolic
    microbatch_size: int | None = None
    # the batch (dim 0) traced as a symbol under torch.export: None (static when microbatch_size is
    # known, else symbolic), True (always symbolic: any batch size runs), False (static, at
    # microbatch_size or else the example's batch). torch.fx keeps it symbolic.
    dynamic_batch: bool | None = None
    schedule: str = "interleaved_1f1b"  # one of fxsplit.schedule.NAMES
    stages_per_rank: int | None = None  # v; default 2 for interleaved_1f1b with pp > 1 and for zbv, else 1
    passes: tuple[Callable, ...] = ()  # user passes (gm, ctx) -> PassResult, run first
    split_points: tuple[str, ...] | None = None  # module paths where stages must start
    tp_plan: Mapping[str, str] | None = None  # module-path pattern -> style overrides
    memory_limit: float | None = None  # bytes per rank the split must respect
    sequence_parallel: bool = False  # Megatron-3 sequence parallelism inside TP regions
    vocab_parallel_loss: bool = False  # LM head stays vocab-parallel into a parallel cross-entropy
    method: str = "auto"  # tracing: "fx", "export" or "auto" (fx, then export)
    # the sequence (dim 1 of integer inputs) traced as a symbol: True (fx and export), None (fx
    # only; export traces the example's length, several times faster: [Note: a static sequence
    # for export] in fxsplit.graph.trace), False (neither). The batch: dynamic_batch.
    dynamic_sequence: bool | None = None
    # a plan traced by torch.export at a fixed length serves shorter sequences padded to it on the
    # right and cut back ([Note: padding to the traced length] in fxsplit.api.padding): None or True
    # (pad; verify checks it is exact), False (only the traced length runs)
    pad_sequence: bool | None = None
    # a plan traced by torch.export at a fixed length takes every shorter length as it is (no padding: the
    # stage boundaries follow each step's length) after a second static trace one position shorter
    # ([Note: following the sequence from two static traces] in fxsplit.graph.sequence): True, False
    # (pad), None (follow for a model with real weights, pad on the meta device, where a plan is for
    # planning and the second trace would double the plan time; pad with cp > 1, which cuts a static length)
    follow_sequence: bool | None = None
    leaf_modules: tuple[Any, ...] = ()  # module paths or classes fx keeps as single nodes
    hardware: Hardware | None = None  # what stage times are estimated for; None: Hardware()
    cut_at: str = "layers"  # layer boundaries unless a cut inside one pays (fxsplit.pipeline.cuts); "any"; "modules"
    debug: str | None = None  # folder for per-pass dumps (else FXSPLIT_DEBUG_DIR)
    seed: int | None = None  # RNG streams ([Note: RNG streams]); None: torch.initial_seed() of global rank 0
    # torch.distributed.fsdp.MixedPrecisionPolicy: the graph computes (and stages exchange
    # activations) in param_dtype, gradients are reduced in reduce_dtype, parameters stay fp32
    mp_policy: Any = None
    # fxsplit.verify ([Note: plan-time verification]): True checks the plan against the unsplit
    # model in one process (plan() and parallelize()); False never; None (auto) lets parallelize
    # check a model with real weights under 1e8 parameters and no random ops
    verify: bool | None = None
    # recompute activations in backward: "none", "selective" (keep matmul outputs), "full" (keep
    # each layer's inputs) or "auto" (per stage, the cheapest in time within memory_limit);
    # fxsplit.pipeline.checkpointing's [Note: checkpointing cost model]
    activation_checkpointing: str = "none"
    # how a split backward (I, W) runs: "graph" (three fx graphs; fxsplit.runtime.compile.split_graph) or "autograd"
    split_backward: str = "graph"
    # torch.compile (inductor) of what each rank runs: every training forward as the graph
    # split's F graph, and the F, I and W graphs compiled once per input signature
    # and the loss through torch.compile ([Note: compiled stages], [Note: compiled loss] in
    # fxsplit.runtime.compile.compiling)
    compile: bool = False
    # with compile=True, a B of a stage the schedule never splits runs as one fused backward graph
    # ([Note: fused backward] in fxsplit.runtime.compile.compiling); False runs I then W there too (to measure it)
    fuse_backward: bool = True

    def __post_init__(self) -> None:
        for name in ("dp", "dp_shard", "cp", "tp", "pp", "ep", "microbatches", "stages_per_rank", "microbatch_size"):
            value = getattr(self, name)
            if value is None and name in ("microbatches", "stages_per_rank", "microbatch_size"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name} must be an int >= 1, got {value!r}")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.pp > 1 and self.microbatches is not None and self.microbatches < self.pp:
            raise PlanError(
                f"microbatches={self.microbatches} < pp={self.pp}: every pipeline rank needs at least "
                f"one microbatch in flight; use microbatches >= {self.pp} (2 * pp = {2 * self.pp} is a good start)"
            )
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise PlanError(f"seed must be an int >= 0 or None (follow torch.manual_seed), got {self.seed!r}")
        if self.verify is not None and not isinstance(self.verify, bool):
            raise PlanError(f"verify must be True, False or None (auto), got {self.verify!r}")
        if self.activation_checkpointing not in _CHECKPOINTING:
            raise PlanError(f"activation_checkpointing must be one of {_CHECKPOINTING}, got "
                            f"{self.activation_checkpointing!r}")
        if self.split_backward not in ("graph", "autograd"):
            raise PlanError(f"split_backward must be 'graph' or 'autograd', got {self.split_backward!r}")
        if not isinstance(self.compile, bool):
            raise PlanError(f"compile must be True or False, got {self.compile!r}")
        if not isinstance(self.fuse_backward, bool):
            raise PlanError(f"fuse_backward must be True or False, got {self.fuse_backward!r}")
        if self.compile and self.split_backward != "graph":
            raise PlanError("compile=True compiles the graph split's F, I and W graphs; split_backward='autograd' "
                            "runs autograd's own graph, which it cannot compile: use split_backward='graph'")
        if self.compile and self.dp_shard > 1:
            raise PlanError("compile=True with dp_shard > 1 (FSDP units) is not supported yet: the compiled "
                            "graphs have not been checked against FSDP's gathered parameters; use compile=False")
        self._check_ep()
        if self.cp_kv not in (None, "allgather", "ring"):
            raise PlanError(f"cp_kv must be 'allgather', 'ring' or None (chosen per attention), got {self.cp_kv!r}")
        if self.cp > 1:
            self._check_cp()
        if self.cut_at not in _CUT_AT:
            raise PlanError(f"cut_at must be one of {_CUT_AT}, got {self.cut_at!r}")
        if self.dynamic_sequence not in (True, False, None):
            raise PlanError(f"dynamic_sequence must be True, False or None (symbolic with fx only), got "
                            f"{self.dynamic_sequence!r}")
        if self.pad_sequence not in (True, False, None):
            raise PlanError(f"pad_sequence must be True, False or None (pad shorter sequences to the traced length), "
                            f"got {self.pad_sequence!r}")
        if self.follow_sequence not in (True, False, None):
            raise PlanError(f"follow_sequence must be True, False or None (None: as False, shorter steps padded), got "
                            f"{self.follow_sequence!r}")
        if self.follow_sequence and (self.cp > 1 or self.pad_sequence is False):
            why = "cp > 1 cuts a static length" if self.cp > 1 else "pad_sequence=False runs the traced length only"
            raise PlanError(f"follow_sequence=True with {'cp > 1' if self.cp > 1 else 'pad_sequence=False'}: {why}; "
                            "drop follow_sequence (shorter steps are then padded to the traced length)")
        if self.dynamic_batch not in (True, False, None):
            raise PlanError(f"dynamic_batch must be True, False or None (static when microbatch_size is known), got "
                            f"{self.dynamic_batch!r}")
        if self.method not in _METHODS:
            raise PlanError(f"method must be one of {_METHODS}, got {self.method!r}")
        if self.hardware is not None and not isinstance(self.hardware, Hardware):
            raise PlanError(f"hardware must be a fxsplit.Hardware, got {type(self.hardware).__name__}")
        for name in ("passes", "leaf_modules", "split_points"):  # sequences are stored as tuples
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                if isinstance(value, str) or not isinstance(value, Sequence):
                    raise PlanError(f"{name} must be a sequence, got {value!r}")
                object.__setattr__(self, name, tuple(value))
        if self.tp_plan is not None:
            object.__setattr__(self, "tp_plan", dict(self.tp_plan))
        if self.mp_policy is not None:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            if not isinstance(self.mp_policy, MixedPrecisionPolicy):
                raise PlanError(f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got "
                                f"{type(self.mp_policy).__name__}")
            for name in ("param_dtype", "reduce_dtype"):
                dtype = getattr(self.mp_policy, name)
                if dtype is not None and not dtype.is_floating_point:
                    raise PlanError(f"mp_policy.{name} must be a floating dtype or None, got {dtype}")

    def _check_ep(self) -> None:
        """ep is carved out of the data-parallel ranks ([Note: expert-parallel groups] in fxsplit.runtime.mesh)."""
        if self.ep == 1:
            return
        data = self.dp * self.dp_shard
        if data % self.ep:
            raise PlanError(f"ep={self.ep} must divide the data-parallel ranks dp * dp_shard = {self.dp} * "
                            f"{self.dp_shard} = {data} (expert-parallel ranks are carved out of them; the world "
                            f"size stays dp * dp_shard * tp * pp): use ep in {_divisors(data)}, or raise dp")

    def _check_cp(self) -> None:
        """cp > 1 needs a static sequence under torch.export (the rewrite cuts a known length)."""
        if self.method == "fx":
            raise PlanError("cp > 1 rewrites the graph torch.export traces (aten ops with a static sequence); "
                            "use method='export' or 'auto' (which then traces with export)")
        if self.dynamic_sequence is True:
            raise PlanError("cp > 1 cuts a sequence length known at plan time; use dynamic_sequence=None or False "
                            "(plan with the length you train at, divisible by 2 * cp)")

    def static_batch(self, example_batch: int | None) -> int | None:
        """The microbatch size torch.export traces the batch at, or None for a symbolic batch
        ([Note: a static batch] in fxsplit.graph.examples); ``example_batch``: the example's."""
        from fxsplit.graph.examples import static_batch_size

        return static_batch_size(dynamic_batch=self.dynamic_batch, microbatch_size=self.microbatch_size,
                                 example_batch=example_batch)

    @property
    def num_stages(self) -> int:
        return self.pp * self.resolved().stages_per_rank

    @property
    def world_size(self) -> int:
        return self.dp * self.dp_shard * self.cp * self.tp * self.pp

    def resolved(self) -> ParallelConfig:
        """This config with every default filled in (``microbatches``, ``stages_per_rank``, the
        schedule for one pipeline rank); raises PlanError for a combination that cannot run."""
        m = self.microbatches if self.microbatches is not None else (1 if self.pp == 1 else 2 * self.pp)
        spec = schedule_spec(self.schedule)
        v = self.stages_per_rank
        if v is None:
            v = spec.default_stages_per_rank(self.pp)
        schedule = self.schedule
        if self.pp == 1 and spec.single_rank is not None:
            schedule, spec = spec.single_rank, schedule_spec(spec.single_rank)  # nothing to interleave
        reason = spec.check_stages_per_rank(v)
        if reason is not None:
            raise PlanError(f"{schedule} {reason} (got stages_per_rank={v}); {spec.stages_fix}")
        if (m, v, schedule) == (self.microbatches, self.stages_per_rank, self.schedule):
            return self
        return dataclasses.replace(self, microbatches=m, stages_per_rank=v, schedule=schedule)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


_FIELDS = tuple(f.name for f in dataclasses.fields(ParallelConfig))


def make_config(config: ParallelConfig | None, options: Mapping[str, Any], *, where: str) -> ParallelConfig:
    """``config`` (default ``ParallelConfig()``) with ``options`` (keyword arguments of ``where``)
    applied; an unknown keyword raises an ArgumentTypeError (a TypeError) naming the closest option."""
    unknown = [k for k in options if k not in _FIELDS]
    if unknown:
        hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, _FIELDS, 1)) else repr(k)
                 for k in unknown]
        raise ArgumentTypeError(f"{where}() got unknown option(s) {', '.join(hints)}; the options are the fields of "
                                f"fxsplit.ParallelConfig: {', '.join(_FIELDS)}")
    if config is not None and not isinstance(config, ParallelConfig):
        raise ArgumentTypeError(f"{where}(config=...) must be a fxsplit.ParallelConfig, got {type(config).__name__}")
    base = config if config is not None else ParallelConfig()
    return dataclasses.replace(base, **options) if options else base
