"""Scoring one candidate: per-stage F / I / W and link times, memory per rank, step time.

Terms as in :mod:`fxsplit.planner.space` and :mod:`fxsplit.planner.workload`; a rank's *share*
is the sum over the stages it holds.

    scorer = Scorer(workload, hardware, memory_limit)
    s = scorer.score(candidate)             # Score: step_time, memory, stage costs, cuts
    s = scorer.score(candidate, simulate=True)

[Note: planner cost model]
Per unit, at microbatch size b, tensor degree t (the unit's work divided by t when TP shards it,
and by t under sequence parallelism when SP runs it on a sequence shard; a sharded linear's
parameter reads divided by t): forward ``F = max(flops / FLOP/s, bytes / B/s)``, backward
``max((flops + matmul flops) / FLOP/s, backward bytes / B/s)``, split into W (half, for a unit
reading parameters) and I (the rest): the cost model's roofline and [Note: F, I, W estimates].
TP collectives are ring all-reduces over the tp group on the intra-node link ([Note: collective
time formulas]): the forward's g added to F, the backward's f to I. Recompute (checkpointing) adds
the recomputed units' F, their collectives included, to I. The loss is charged to the last
stage's I. Stage 0's I moves to its W (its inputs need no gradient; as in the split's estimate). Units are summed per group; the stages' cuts are those of the exact partitioner
(``fxsplit.pipeline.partition.solve``) over the groups, solved once per (t, SP, checkpointing, S,
placement) at the first microbatch size seen and reused for the others (cut positions barely
move with b), and re-solved under the memory limit when those cuts do not fit ([Note: partition
under the memory limit]). A stage's message (activations forward, gradients back) costs one ``p2p_time`` of
its boundary bytes, intra- or inter-node by where the two pipeline ranks sit (ranks packed
devices_per_node to a node, tp innermost, then pp, then dp: ``fxsplit.runtime.mesh``'s order).

Step time = the pipeline's makespan + the data-parallel gradient reduction + the optimizer step:
- makespan: with p = 1, m x (F + I + W); else the schedule simulated with the per-stage costs
  (``fxsplit.schedule.simulate``; above ``MAX_SIMULATED_ACTIONS`` the schedule is simulated at
  m' >= p and m' + p microbatches and extended linearly: the steady state repeats every p),
  or, for ranking many candidates fast, the closed form ``m * R_max + bubble`` (R_max the busiest
  rank's share of F + I + W; bubble (p-1)(F+I+W)/v for 1F1B / interleaved, (p-1)(F+I-W) for ZB-H1,
  max((p-1)(F+I-2W), (p-1)F/2) for ZB-V, at the largest stage's F, I, W) plus 2(S-1) messages.
- gradient reduction: a ring all-reduce of the rank's gradient bytes over d (intra-node when the
  dp group fits in one node), not overlapped with the pipeline (fxsplit's runtime reduces after
  it); with dp_shard s a reduce-scatter plus two all-gathers (forward and backward re-gather) over
  s, and an all-reduce of the 1/s shard over the d / s replicas. That is fxsplit's FSDP (the
  Scorer's default ``fsdp=FXSPLIT_STAGES``); a published run's per-layer FSDP2 gathers and reduces
  each layer under its neighbours' compute, only what the compute does not cover exposed, and
  holds two layers gathered where fxsplit holds the stage ([Note: FSDP policies], [Note: FSDP
  overlap] in ``fxsplit.planner.fsdp``).
- optimizer ([Note: optimizer cost]): Adam reads parameter, gradient, m and v and writes
  parameter, m and v: 7 x 4 bytes per parameter element through memory (1/s of them with
  dp_shard); plain SGD reads parameter and gradient and writes the parameter: 3 x 4.
- ranks sharing one host's cores (``Calibration.host_cores`` finite): the simulated pipeline
  under processor sharing ([Note: host sharing] in ``fxsplit.planner.host``); without a pipeline,
  every rank busy: the compute and the optimizer step at the shared rate.

Expert parallelism ([Note: planner experts] in ``fxsplit.planner.workload``): each rank keeps 1/ep
of the expert weights (and 1/tp of those with tp, which splits them too); the busiest ep rank runs
its experts on ``EXPERT_LOAD_MARGIN`` times its share of the rows (their time and exchanged bytes
scaled by it); each MoE layer's exchange is three all-to-alls forward (the
per-expert counts, the rows dispatched, the outputs combined) and two backward
(``Hardware.all_to_all_time`` over the ep group, whose ranks are pp * tp apart: intra-node when
they fit in one), added to F and I. Under a schedule that pairs one microbatch's forward with
another's backward on a rank (DualPipeV, ``ScheduleSpec.paired_fraction``) the exchanges of the
paired actions run under the other action's compute: that share of the all-to-all time, up to the
paired compute, leaves F and I and is reported as hidden (``ep_overlapped``). The memory's expert
terms (the busiest rank's extra expert activations, the largest layer's exchange buffers) are
``Plan.memory()``'s, from one function ([Note: expert memory] in fxsplit.pipeline.memory; a
schedule that splits the backward runs the graph split, whose exchange is padded).

Memory per rank (the largest peak decides the fit) is the split's model, one function for both
(``fxsplit.pipeline.memory.rank_memory``, [Note: memory model]): parameters, gradients (the
parameter dtype), Adam m and v (fp32) plus an fp32 master copy when parameters are 16-bit, each
divided by dp_shard, FSDP's gathered stage, the all-reduce buckets of plain dp, and the larger of
activations and whole gradients at the peak. Activations: in-flight microbatches (the schedule's
peak: ``fxsplit.schedule.spec.inflight_1f1b`` for 1F1B and interleaved; p on every rank for ZB-H1
and ZB-V, what their orders hold when simulated with m >= 2p) times what the rank's stages hold per
microbatch under its checkpointing mode (each saved storage once, [Note: saved tensors by
storage]; the stage's received and sent values; the loss's saved tensor on the last stage), plus
its message buffers ([Note: message buffers]); recompute: with checkpointing, one group's full
activations live while it is recomputed.

[Note: partition under the memory limit]
The time-balanced cuts can put too much on one rank (1F1B's first rank holds p microbatches'
activations, the embedding's stage the vocabulary's parameters) where another split of the same
layout fits. So when the balanced cuts' rank memory is over the limit, the partitioner is run
again with ``memory_limit``: the limit less what the memory model charges outside the stages
(the recompute transient, dp_shard's gathered largest group), ``state_bytes_per_param_byte``
the training state per parameter byte over dp_shard, and ``inflight`` the schedule's in-flight
microbatches per rank: the memory model's main terms, so the partitioner's rank memory
approximates the score's (boundary messages, message buffers, the loss and buckets left out: when
the capped cuts' score is still over the limit, the stages' limit is tightened by the excess and
the partitioner runs again, up to ``_CAP_TIGHTENINGS`` times).
It returns the fastest cuts within the limit (for v > 1 within
``PARTITION_BUDGET`` search steps: sound, maybe not the fastest). It is skipped when the average
rank is over the limit whatever the split, and past ``MAX_CAPPED_SOLVES`` re-partitions per
search (the search time stays bounded: the 1T GPT for 3072 GPUs; ``Scorer.capped_skipped``
counts the layouts then judged by their balanced cuts). The score's own memory is
still what decides the fit, so a mismatch between the two can only reject, never admit, a layout.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from fxsplit import schedule as _schedules
from fxsplit.errors import PartitionError, UsageError
from fxsplit.graph.units import fmt_bytes
from fxsplit.hardware import Hardware
from fxsplit.pipeline.memory import (EXPERT_LOAD_MARGIN, RankMemory, expert_memory, message_buffers,
                                     optimizer_bytes_per_element, rank_memory)
from fxsplit.pipeline.partition import PartitionProblem, solve
from fxsplit.planner.breakdown import Breakdown
from fxsplit.planner.fsdp import FXSPLIT_STAGES, FsdpPolicy, held_bytes, overlap, step_jobs, unit_of
from fxsplit.planner.host import shared_makespan, shared_rate
from fxsplit.planner.space import Candidate
from fxsplit.planner.workload import Workload

__all__ = ["Calibration", "EXPERT_LOAD_MARGIN", "Memory", "OPTIMIZERS", "Score", "Scorer", "MAX_SIMULATED_ACTIONS", "SIMULATION_BUDGET",
           "calibrate"]

MAX_SIMULATED_ACTIONS = 6000  # one schedule longer than this is simulated shorter and extended
SIMULATION_BUDGET = 60000  # actions the search simulates in all ([Note: search strategy])
_CAP_TIGHTENINGS = 3  # capped solves per layout when the score's memory exceeds the partitioner's
MAX_CAPPED_SOLVES = 400  # memory-capped re-partitions per Scorer ([Note: partition under the memory limit])
PARTITION_BUDGET = 20000  # search steps of one memory-capped v > 1 partition (partition.solve's exact_budget)
# EXPERT_LOAD_MARGIN: rows the busiest expert-parallel rank gets over its even share, dropless: a
# top-k router trained with a load-balancing loss keeps the per-expert load near the mean, and 1.25 is
# the capacity factor Switch Transformer (arXiv 2101.03961) and GShard train with, i.e. the load they
# found sufficient for all but a few tokens; a dropless run must hold those few too, so this is a
# margin, not a bound. Defined with the memory model ([Note: expert memory] in fxsplit.pipeline.memory).

# [Note: optimizer cost] name -> (bytes one step moves through memory per parameter element,
# fp32 state bytes per element). Adam: reads p, g, m, v, writes p, m, v (7 x 4 bytes), holds m
# and v; SGD without momentum: reads p and g, writes p (3 x 4), holds nothing. A 16-bit model's
# fp32 master copy is counted by the memory model on top of either.
OPTIMIZERS = {"adam": (28.0, 8.0), "sgd": (12.0, 0.0)}


@dataclass(frozen=True)
class Calibration:
    """[Note: calibration] The roofline assumes every op runs at the device's matmul rate and
    bandwidth and costs nothing to launch; small ops on a CPU (or a GPU kernel launch) do not.
    ``compute_scale`` multiplies every unit's roofline time, ``node_overhead_s`` is added per unit
    to its forward and to its backward (interpreter / launch cost of one fx node), and
    ``action_overhead_s`` per pipeline action (F, I, W) of a stage. ``calibrate`` fits the first
    two from one process's measured forward + backward times of the unsplit model at two batch
    sizes; the default (1, 0, 0) is the bare roofline. ``host_cores``: when every rank runs on
    one host with that many cores between them (gloo ranks on a CPU machine), the busy ranks
    share them (processor sharing: [Note: host sharing] in ``fxsplit.planner.host``; the closed
    form, for ranking, bounds the step below by the total compute over the cores). inf
    (default): each rank has its own device."""

    compute_scale: float = 1.0
    node_overhead_s: float = 0.0
    action_overhead_s: float = 0.0
    host_cores: float = math.inf


def calibrate(workload: Workload, hardware: Hardware, measured: dict, *,
              action_overhead_s: float = 0.0, host_cores: float = math.inf) -> Calibration:
    """``Calibration`` from ``measured = {batch size: seconds of one forward + backward of the
    unsplit model}`` (two sizes): the slope fits ``compute_scale``, the intercept the per-node
    overhead ([Note: calibration])."""
    (b1, t1), (b2, t2) = sorted(measured.items())[:2]
    s = Scorer(workload, hardware, math.inf)
    p1, p2 = (float(u.F.sum() + u.I.sum() + u.W.sum()) for u in (s.units(1, False, b1, "none"),
                                                                   s.units(1, False, b2, "none")))
    scale = max((t2 - t1) / (p2 - p1), 1e-3) if p2 > p1 else 1.0
    overhead = max(t1 - scale * p1, 0.0) / (2 * workload.num_units)
    return Calibration(scale, overhead, action_overhead_s, host_cores)


Memory = RankMemory  # bytes on the most loaded rank ([Note: memory model] in fxsplit.pipeline.memory)


@dataclass(frozen=True)
class Score:
    candidate: Candidate
    step_time: float  # seconds per optimizer step
    pipeline_time: float
    dp_time: float
    optimizer_time: float
    memory: Memory
    fits: bool
    reason: str = ""  # why it was rejected ("" if it fits)
    method: str = "closed form"  # "closed form", "simulated", "simulated at m'=..., extended"
    cuts: tuple[int, ...] = ()  # group positions of the stage boundaries
    stage_costs: dict = field(default_factory=dict)  # forward / backward_input / backward_weight / comm
    breakdown: Breakdown = field(default_factory=Breakdown)  # [Note: step breakdown]


@dataclass
class _Units:
    F: np.ndarray  # per group seconds
    I: np.ndarray
    W: np.ndarray
    params: np.ndarray  # per group bytes (this tp rank's shard)
    saved: np.ndarray  # per group bytes per microbatch
    transient: float  # largest group's un-checkpointed activations (recompute peak)
    cut: np.ndarray  # bytes crossing each group position
    tp: np.ndarray  # per group seconds of TP collectives (in F and I)
    rec: np.ndarray  # per group seconds of recomputed forwards (in I)
    a2a_F: np.ndarray  # per group seconds of ep all-to-alls in F, and in I
    a2a_I: np.ndarray
    a2a_buffer: float  # the largest layer's exchange buffers (bytes)
    imbalance: np.ndarray  # per group: of ``saved``, the busiest ep rank's extra expert rows ([Note: expert memory])
    experts: np.ndarray  # per group: of ``params``, the expert blocks (FSDP leaves them whole under dp_shard)


class Scorer:
    """Scores candidates for one workload on one hardware ([Note: planner cost model])."""

    def __init__(self, workload: Workload, hardware: Hardware, memory_limit: float,
                 calibration: Calibration | None = None, optimizer: str = "adam",
                 fsdp: FsdpPolicy = FXSPLIT_STAGES):
        if optimizer not in OPTIMIZERS:
            raise UsageError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
        self.w, self.hw, self.limit = workload, hardware, memory_limit
        self.fsdp = fsdp  # what the runtime does with dp_shard ([Note: FSDP policies] in fxsplit.planner.fsdp)
        self._fsdp_units = tuple(unit_of(p) for p in workload.group_paths)
        self.cal = calibration if calibration is not None else Calibration()
        self.optimizer_traffic, self.optimizer_state = OPTIMIZERS[optimizer]
        self._units: dict = {}
        self._cuts: dict = {}
        self.capped_solves = 0  # memory-capped re-partitions run, and skipped past MAX_CAPPED_SOLVES
        self.capped_skipped = 0
        G = workload.num_groups
        self.allowed = tuple([True] + [bool(workload.group_paths[g]) for g in range(1, G)] + [True])

    # -- per-unit times, summed per group
    def units_of(self, c: Candidate) -> _Units:
        """:meth:`units` of candidate ``c`` (its ep group intra-node when its ranks, pp * tp apart, share one)."""
        intra = self.hw.same_node(0, (c.ep - 1) * c.pp * c.tp)
        traced = _schedules.schedule_spec(c.schedule).splits_backward  # the graph split: [Note: expert memory]
        return self.units(c.tp, c.sequence_parallel, c.microbatch_size, c.activation_checkpointing, c.ep, intra, traced)

    def units(self, tp: int, sp: bool, b: int, ckpt: str, ep: int = 1, ep_intra: bool = True,
              traced: bool = False) -> _Units:
        key = (tp, sp, b, ckpt, ep, ep_intra, traced)
        if key in self._units:
            return self._units[key]
        w, hw = self.w, self.hw
        div = np.where(w.tp_sharded | (sp & w.sp_sharded), tp, 1).astype(float)
        pdiv = np.where(w.tp_params_sharded, tp, 1).astype(float)
        load = np.where(w.expert_units, EXPERT_LOAD_MARGIN, 1.0) if ep > 1 else np.ones(w.num_units)
        fl = w.flops.at(b) * load / div
        mm = w.matmul_flops.at(b) * load / div
        rw = w.bytes_rw.const / pdiv + w.bytes_rw.lin * b * load / div
        bb = w.bytes_bwd.const / pdiv + w.bytes_bwd.lin * b * load / div
        fw = np.maximum(fl / hw.flops_per_s, rw / hw.bytes_per_s)
        bwd = np.maximum((fl + mm) / hw.flops_per_s, bb / hw.bytes_per_s)
        cal = self.cal
        fw, bwd = fw * cal.compute_scale + cal.node_overhead_s, bwd * cal.compute_scale
        W = np.where(w.reads_params, bwd / 2, 0.0)
        I = bwd - W + cal.node_overhead_s
        tp_f = tp_i = np.zeros(w.num_units)
        if tp > 1:
            a0 = hw.allreduce_time(0.0, tp, True)
            slope = hw.allreduce_time(1.0, tp, True) - a0
            tp_f = w.tp_fwd_count * a0 + slope * w.tp_fwd_bytes.at(b)
            tp_i = w.tp_bwd_count * a0 + slope * w.tp_bwd_bytes.at(b)
            fw, I = fw + tp_f, I + tp_i
        a2a_f = a2a_i = np.zeros(w.num_units)
        exchanged = w.a2a_bytes.at(b) * (EXPERT_LOAD_MARGIN if ep > 1 else 1.0)  # on the busiest rank's time
        if ep > 1:
            a0 = hw.all_to_all_time(0.0, ep, ep_intra)
            slope = hw.all_to_all_time(1.0, ep, ep_intra) - a0
            layer = exchanged > 0
            a2a_f = np.where(layer, 3 * a0 + slope * exchanged, 0.0)  # counts, dispatch, combine
            a2a_i = np.where(layer, 2 * a0 + slope * exchanged, 0.0)  # their gradients back
            fw, I = fw + a2a_f, I + a2a_i
        rec = np.where(w.recompute[ckpt], fw, 0.0)
        I = I + rec
        saved = w.saved[ckpt].at(b) / div
        imbalance, buffer = expert_memory(np.where(w.expert_units, saved, 0.0), w.a2a_bytes.at(b), ep, traced)
        saved = saved + imbalance
        gs = w.group_sum
        F_g, I_g, W_g = gs(fw), gs(I), gs(W)
        loss = max(w.loss_flops_per_sample * b / hw.flops_per_s, w.loss_bytes_per_sample * b / hw.bytes_per_s)
        I_g[-1] += loss
        transient = float(gs(w.saved["none"].at(b) / div).max()) if ckpt != "none" else 0.0
        cut = w.cut.at(b) / (tp if sp else 1)
        expert_div = ep * (tp if w.experts_tp_sharded else 1)
        params = (w.params - w.expert_params) / pdiv + w.expert_params / expert_div
        out = _Units(F_g, I_g, W_g, gs(params), gs(saved), transient, cut, gs(tp_f + tp_i), gs(rec),
                     gs(a2a_f), gs(a2a_i), float(buffer), gs(np.asarray(imbalance) + np.zeros(w.num_units)),
                     gs(w.expert_params / expert_div if ep > 1 else np.zeros(w.num_units)))
        self._units[key] = out
        return out

    # -- placement and links
    def stage_ranks(self, c: Candidate) -> tuple[int, ...]:
        return _schedules.placement(c.schedule, c.pp, c.stages_per_rank)

    def _pp_intra(self, c: Candidate, a: int, b: int) -> bool:
        return self.hw.same_node(a * c.tp, b * c.tp)

    def cuts(self, c: Candidate, u: _Units, capped: bool = True) -> tuple[int, ...] | None:
        """The partitioner's cuts over the groups ([Note: partition under the memory limit]): the
        time-balanced cuts when their rank memory fits the limit, else the fastest cuts that do
        (``capped=False``: the balanced cuts whatever their memory)."""
        S = c.num_stages
        if S == 1:
            return (0, self.w.num_groups)
        balanced = self._solve(c, u, None)
        if balanced is None or not math.isfinite(self.limit) or not capped:
            return balanced
        cap = self._partition_cap(c, u)
        if cap is None or self._memory(c, u, balanced)[0].total <= self.limit:
            return balanced
        left, state, inflight = cap
        if (state * float(u.params.sum()) + min(inflight) * float(u.saved.sum())) / c.pp > left:
            return balanced  # no split fits: the average rank is over the limit (skip the solve)
        if self.capped_solves >= MAX_CAPPED_SOLVES:
            self.capped_skipped += 1
            return balanced
        self.capped_solves += 1
        for _ in range(_CAP_TIGHTENINGS):
            capped = self._solve(c, u, cap)
            if capped is None:
                return balanced  # rejected for memory by the score
            over = self._memory(c, u, capped)[0].total - self.limit
            if over <= 0:
                return capped
            # the score charges terms the partitioner does not see (boundary messages, message
            # buffers, the loss, dp buckets): tighten the stages' limit by the excess and solve again
            cap = (cap[0] - over, *cap[1:])
            if cap[0] <= 0:
                break
        return balanced

    def _partition_cap(self, c: Candidate, u: _Units) -> tuple[float, float, tuple[float, ...]] | None:
        """(limit left for the stages, training-state bytes per parameter byte, in-flight
        microbatches per rank): the memory model's terms in the partitioner's form (None: the
        terms outside the stages alone exceed the limit)."""
        sh = c.dp_shard
        outside = u.transient + (float(u.params.max()) if sh > 1 else 0.0)
        left = self.limit - outside
        if left <= 0:
            return None
        return left, self._state_factor() / sh, self.inflight(c)

    def _solve(self, c: Candidate, u: _Units, cap) -> tuple[int, ...] | None:
        """One ``solve``, memoized. Uncapped: by the shape of the problem (the group times and
        boundary-message times as fractions of the total, 4 digits, S, p and the placement), so
        candidates whose costs differ only by a common factor (another t, b or checkpointing mode
        scaling every layer alike) share one solve. Capped: by the exact problem."""
        S = c.num_stages
        ranks = self.stage_ranks(c)
        intra = all(self._pp_intra(c, x, y) for x, y in zip(ranks, ranks[1:]))
        bw = self.hw.intra_node_bytes_per_s if intra else self.hw.inter_node_bytes_per_s
        compute = u.F + u.I + u.W
        total = float(compute.sum()) or 1.0
        if cap is None:
            key = (S, c.pp, ranks, np.round(compute / total, 4).tobytes(), np.round(u.cut / bw / total, 4).tobytes())
        else:
            key = (S, c.pp, ranks, compute.tobytes(), u.cut.tobytes(), u.params.tobytes(), u.saved.tobytes(), cap)
        if key in self._cuts:
            return self._cuts[key]
        limit, state, inflight = cap if cap is not None else (None, 4.0, None)
        try:
            cuts = solve(PartitionProblem(
                compute=tuple(compute), param_bytes=tuple(u.params), activation_bytes=tuple(u.saved),
                cut_bytes=tuple(u.cut), num_stages=S, num_ranks=c.pp, allowed=self.allowed, bandwidth=bw,
                stage_ranks=ranks, memory_limit=limit, state_bytes_per_param_byte=state, inflight=inflight,
                exact_budget=PARTITION_BUDGET)).cuts
        except PartitionError:
            cuts = None
        self._cuts[key] = cuts
        return cuts

    def inflight(self, c: Candidate) -> tuple[float, ...]:
        return _schedules.schedule_spec(c.schedule).inflight_bound(c.pp, c.stages_per_rank, c.microbatches)

    # -- bounds ([Note: search strategy]: what lets the search skip candidates it need not score)
    def state_rejection(self, c: Candidate) -> Score | None:
        """The rejection of ``c`` when its rank's share of the training state alone, evenly split,
        is over the limit (a memory lower bound; None: it may fit)."""
        experts = float(self.w.expert_params.sum()) * (1 - 1 / c.ep)  # a rank keeps 1/ep of them
        state = (self.w.param_bytes_total - experts) * self._state_factor() / (c.tp * c.pp * c.dp_shard)
        if state <= self.limit:
            return None
        return Score(c, math.inf, math.inf, 0.0, 0.0, Memory(params=state), False,
                     f"memory: the training state alone, {fmt_bytes(state)} per rank (params, grads, optimizer "
                     f"over tp x pp{' x dp_shard' if c.dp_shard > 1 else ''}), > limit {fmt_bytes(self.limit)}")

    def lower_bound(self, c: Candidate) -> float:
        """A step time the closed-form ``score(c)`` cannot be under, without the partition: the
        work spread evenly over the pipeline ranks, the schedule's bubble at the mean stage's
        costs where it grows with every cost (1F1B, interleaved, GPipe: (p-1)(F+I+W); ZB-V and
        DualPipeV: (p-1)F/2 of a rank's share; ZB-H1's falls as W grows: none), no messages, and
        the data-parallel reduction and optimizer step of an even share of the parameters (both
        grow with the busiest rank's share). With ranks sharing one host's cores the closed form
        is only ever larger."""
        u = self.units_of(c)
        share = float(u.params.sum()) / c.pp
        total = float(u.F.sum() + u.I.sum() + u.W.sum() - u.a2a_F.sum() - u.a2a_I.sum())  # (some may hide)
        bubble, p, S = 0.0, c.pp, c.num_stages
        if p > 1:
            v = c.stages_per_rank  # a rank's share of the work is v mean stages
            bubble = _schedules.schedule_spec(c.schedule).bubble_floor(p, v, float(u.F.sum()) / S * v, total / S * v)
        opt = self.hw.memory_time(self.optimizer_traffic * share / self.w.param_itemsize / c.dp_shard)
        experts = float(u.experts.sum()) / c.pp
        dp = 0.0 if self.fsdp.overlapped and c.dp_shard > 1 else self._dp_time(c, share, experts)  # may all hide
        return c.microbatches * total / p + bubble + dp + opt

    # -- the score
    def score(self, c: Candidate, *, simulate: bool = False, capped: bool = True) -> Score:
        """``c`` scored; ``capped=False`` judges it by its time-balanced cuts alone (no re-partition
        under the memory limit: [Note: search strategy]'s first pass)."""
        w, hw = self.w, self.hw
        rejected = self.state_rejection(c)  # a lower bound first
        if rejected is not None:
            return rejected
        u = self.units_of(c)
        cuts = self.cuts(c, u, capped)
        if cuts is None:
            return Score(c, math.inf, math.inf, 0.0, 0.0, Memory(), False,
                         f"no partition of {w.num_groups} layer groups into {c.num_stages} stages")
        S, p = c.num_stages, c.pp
        csum = lambda x: np.concatenate(([0.0], np.cumsum(x)))  # noqa: E731
        cF, cI, cW = csum(u.F), csum(u.I), csum(u.W)
        idx = np.asarray(cuts)
        a = self.cal.action_overhead_s
        F = np.diff(cF[idx]) + a; I = np.diff(cI[idx]) + a; W = np.diff(cW[idx]) + a  # noqa: E702
        F, I, hidden = self._hide_exchanges(c, u, cuts, F, I, W)
        W[0], I[0] = W[0] + I[0] - a, a  # stage 0's inputs need no gradient: its backward is all W
        ranks = self.stage_ranks(c)
        comm = np.zeros(S)
        for s in range(S - 1):
            intra = self._pp_intra(c, ranks[s], ranks[s + 1])
            comm[s] = hw.p2p_time(float(u.cut[cuts[s + 1]]), intra)
        sh = c.dp_shard
        mem, rank_P, rank_E = self._memory(c, u, cuts)
        fits = mem.total <= self.limit
        # time; with ranks sharing one host's cores, [Note: host sharing] in fxsplit.planner.host
        cores = self.cal.host_cores
        shared = math.isfinite(cores)
        copies = c.dp * c.tp  # processes that run each pipeline rank's actions at once
        method, free = "closed form", None  # free: the makespan with free messages (None: no pipeline)
        if p == 1:
            pipe = c.microbatches * float(F.sum() + I.sum() + W.sum())
            if shared:
                pipe, method = pipe / shared_rate(copies, cores), "closed form, host-shared"
        elif simulate:
            pipe, method = self._simulate(c, F, I, W, comm, ranks, cores=cores, copies=copies)
            if not shared:  # an extension from a short schedule that is not yet steady can fall under
                pipe = max(pipe, c.microbatches * self._busiest_share(F, I, W, ranks, p))  # the rank's own work
            free = pipe - 2 * (S - 1) * float(comm.max(initial=0.0))  # [Note: step breakdown]
        else:
            pipe = self._closed_form(c, F, I, W, comm, ranks)
            free = pipe - 2 * (S - 1) * float(comm.max(initial=0.0))
            work = copies * c.microbatches * float(F.sum() + I.sum() + W.sum())
            if shared and work / cores > pipe:  # the closed form: at least the total work over the cores
                pipe, free, method = work / cores, work / cores, "closed form, host-bound"
        busiest = int(np.argmax(rank_P))
        dp_time, dp_hidden = self._dp_time(c, float(rank_P[busiest]), float(rank_E[busiest])), 0.0
        if self.fsdp.overlapped and c.dp_shard > 1:
            dp_time, dp_hidden = self._fsdp_overlap(c, u, cuts, ranks, int(np.argmax(rank_P)))
        opt_time = hw.memory_time(self.optimizer_traffic * float(rank_P.max()) / w.param_itemsize / sh)
        if shared:
            opt_time /= shared_rate(c.world_size, cores)  # every rank's optimizer step at once
        reason = "" if fits else (f"memory {fmt_bytes(mem.total)} > limit {fmt_bytes(self.limit)} (params {fmt_bytes(mem.params)}, "
                                  f"grads {fmt_bytes(mem.grads)}, optimizer {fmt_bytes(mem.optimizer)}, activations "
                                  f"{fmt_bytes(mem.activations)}, recompute {fmt_bytes(mem.recompute)})")
        costs = dict(forward=tuple(F), backward_input=tuple(I), backward_weight=tuple(W), comm=tuple(comm))
        step = pipe + dp_time + opt_time
        parts = self._breakdown(c, u, cuts, F, I, W, comm, ranks, pipe, free, dp_time, opt_time, hidden)
        parts = dataclasses.replace(parts, dp_overlapped=dp_hidden)
        return Score(c, step, pipe, dp_time, opt_time, mem, fits, reason, method,
                     tuple(cuts), costs, parts)

    @staticmethod
    def _busiest_share(F, I, W, ranks, p: int) -> float:
        """The busiest pipeline rank's F + I + W per microbatch."""
        share = np.zeros(p)
        for s in range(len(F)):
            share[ranks[s]] += F[s] + I[s] + W[s]
        return float(share.max())

    def _hide_exchanges(self, c: Candidate, u: _Units, cuts, F, I, W):
        """(F, I, hidden all-to-all seconds per stage) with the exchanges of paired actions moved off
        the stages' times (the [Note: planner cost model]'s DualPipeV overlap)."""
        paired = _schedules.schedule_spec(c.schedule).paired_fraction(c.pp, c.microbatches)
        if c.ep == 1 or paired == 0.0:
            return F, I, np.zeros(len(F))
        per_stage = lambda x: np.diff(np.concatenate(([0.0], np.cumsum(x)))[np.asarray(cuts)])  # noqa: E731
        a2a = per_stage(u.a2a_F) + per_stage(u.a2a_I)
        hidden = np.minimum(paired * a2a, paired * (F + I + W - a2a))  # under the paired action's compute
        share = np.where(a2a > 0, hidden / np.where(a2a > 0, a2a, 1.0), 0.0)
        return F - share * per_stage(u.a2a_F), I - share * per_stage(u.a2a_I), hidden

    def _breakdown(self, c: Candidate, u: _Units, cuts, F, I, W, comm, ranks, pipe: float, free: float | None,
                   dp_time: float, opt_time: float, hidden) -> Breakdown:
        """[Note: step breakdown] of one score, on the busiest pipeline rank."""
        idx, m = np.asarray(cuts), c.microbatches
        per_stage = lambda x: np.diff(np.concatenate(([0.0], np.cumsum(x)))[idx])  # noqa: E731
        tp_s, rec_s = per_stage(u.tp), per_stage(u.rec)
        a2a_s = per_stage(u.a2a_F) + per_stage(u.a2a_I) - hidden
        share, tpw, recw, msgs = np.zeros(c.pp), np.zeros(c.pp), np.zeros(c.pp), np.zeros(c.pp)
        epw, eph = np.zeros(c.pp), np.zeros(c.pp)
        S = len(F)
        for s in range(S):
            r = ranks[s]
            share[r] += F[s] + I[s] + W[s]
            tpw[r] += tp_s[s]
            recw[r] += rec_s[s]
            epw[r] += a2a_s[s]
            eph[r] += hidden[s]
            msgs[r] += (comm[s] if s < S - 1 else 0.0) + (comm[s - 1] if s > 0 else 0.0)
        r = int(np.argmax(share))
        work = m * float(share[r])
        exposed = 0.0 if free is None else max(pipe - free, 0.0)
        if pipe - work - exposed < 0:  # host-shared closed forms: the step is the work over the cores
            exposed = max(pipe - work, 0.0)
        return Breakdown(compute=work - m * float(tpw[r] + recw[r] + epw[r]), recompute=m * float(recw[r]),
                         tp_comm=m * float(tpw[r]), ep_comm=m * float(epw[r]), ep_overlapped=m * float(eph[r]),
                         pp_comm=exposed, bubble=pipe - work - exposed, dp_comm=dp_time,
                         optimizer=opt_time, pp_overlapped=max(m * float(msgs[r]) - exposed, 0.0))

    def _memory(self, c: Candidate, u: _Units, cuts) -> tuple[Memory, np.ndarray]:
        """The busiest rank's memory under ``cuts`` by the split's model ([Note: memory model] in
        fxsplit.pipeline.memory), each pipeline rank's parameter bytes and, of those, its expert blocks."""
        w, S, p = self.w, c.num_stages, c.pp
        idx = np.asarray(cuts)
        P = np.diff(np.concatenate(([0.0], np.cumsum(u.params)))[idx])
        A = np.diff(np.concatenate(([0.0], np.cumsum(u.saved)))[idx])
        ranks, inflight = self.stage_ranks(c), self.inflight(c)
        rank_P, rank_A, rank_I = np.zeros(p), np.zeros(p), np.zeros(p)
        I = np.diff(np.concatenate(([0.0], np.cumsum(u.imbalance)))[idx])
        E = np.diff(np.concatenate(([0.0], np.cumsum(u.experts)))[idx])
        rank_E = np.zeros(p)
        cut_in = np.array([float(u.cut[cuts[s]]) for s in range(S)])
        cut_out = np.array([float(u.cut[cuts[s + 1]]) for s in range(S)])
        A = A + cut_in + cut_out  # received and sent values ([Note: what a stage holds] in fxsplit.pipeline.memory)
        A[-1] += w.loss_saved_per_sample * c.microbatch_size  # what the loss keeps
        for s in range(S):
            rank_P[ranks[s]] += P[s]
            rank_A[ranks[s]] += A[s]
            rank_I[ranks[s]] += I[s]
            rank_E[ranks[s]] += E[s]
        acts = np.asarray(inflight) * rank_A + np.asarray(message_buffers(ranks, cut_in, cut_out, p))
        loss = w.loss_saved_per_sample * c.microbatch_size
        mems = [self._rank_memory(c, rank_P[r], float(acts[r]), u.transient, inflight[r], r, loss if r == ranks[-1] else 0.0,
                                  experts=float(rank_E[r]), exchange=u.a2a_buffer, imbalance=float(inflight[r] * rank_I[r]))
                for r in range(p)]
        return max(mems, key=lambda m: m.total), rank_P, rank_E

    def _rank_memory(self, c: Candidate, param_bytes: float, acts: float, recompute: float, inflight: float,
                     r: int, loss: float, *, experts: float = 0.0, exchange: float = 0.0, imbalance: float = 0.0) -> Memory:
        """One pipeline rank's memory by the shared model (``fxsplit.pipeline.memory.rank_memory``);
        ``experts``: of ``param_bytes``, the expert blocks placed by ep, which FSDP leaves whole."""
        it, sh = self.w.param_itemsize, c.dp_shard
        numel = param_bytes / it
        held = None  # [Note: FSDP policies]: per layer without a pipeline, the root and two layers
        if self.fsdp.per_layer and c.pp == 1 and sh > 1:
            held = held_bytes(self._fsdp_units, self.units_of(c).params) / it
        shard = (param_bytes - experts) / sh + experts
        return rank_memory(shard_bytes=shard, numel=numel, shard_numel=shard / it, grad_itemsize=it,
                           gather_itemsize=it, optimizer_bytes_per_param=optimizer_bytes_per_element(it, self.optimizer_state),
                           dp=max(c.dp // sh, 1), dp_shard=sh, activations=acts, recompute=recompute,
                           microbatches=c.microbatches, inflight=inflight, loss_bytes=loss, pp_rank=r, exchange=exchange,
                           imbalance=imbalance, held_numel=held)

    def _state_factor(self) -> float:
        """Bytes of params + grads + optimizer state per parameter byte."""
        it = self.w.param_itemsize
        return 2.0 + optimizer_bytes_per_element(it, self.optimizer_state) / it

    def _dp_time(self, c: Candidate, grad_bytes: float, experts: float = 0.0) -> float:
        """The data-parallel reduction of a rank's ``grad_bytes`` of gradients, of which ``experts``
        are expert blocks placed by ep: the rest is reduced over all ``dp`` data ranks (reduce-scatter
        and the parameters' all-gathers over dp_shard, all-reduce over its replicas), an expert block
        only over the dp / ep ranks that hold the same experts, by all-reduce (FSDP leaves it whole)."""
        if c.dp == 1:
            return 0.0
        hw, step = self.hw, c.pp * c.tp
        dense = grad_bytes - experts
        t = 0.0
        reps, intra_e = self._expert_replicas(c)
        if experts > 0 and reps > 1:
            t += hw.allreduce_time(experts, reps, intra_e)
        if c.dp_shard > 1:
            s = c.dp_shard
            intra_s = hw.same_node(0, (s - 1) * step)
            t += hw.reduce_scatter_time(dense, s, intra_s) + 2 * hw.allgather_time(dense, s, intra_s)
            rep = c.dp // s
            if rep > 1:
                t += hw.allreduce_time(dense / s, rep, hw.same_node(0, (rep - 1) * s * step))
            return t
        return t + hw.allreduce_time(dense, c.dp, hw.same_node(0, (c.dp - 1) * step))

    def _expert_replicas(self, c: Candidate) -> tuple[int, bool]:
        """(how many data ranks hold each expert block: every ep-th one, dp / ep; whether they share
        a node): the group an expert block's gradient is all-reduced over."""
        reps = c.dp // c.ep
        return reps, self.hw.same_node(0, (reps - 1) * c.ep * c.pp * c.tp)

    def _fsdp_overlap(self, c: Candidate, u: _Units, cuts, ranks, r: int) -> tuple[float, float]:
        """(exposed, hidden) seconds of dp_shard's collectives on pipeline rank ``r`` under an
        overlapping policy ([Note: FSDP overlap] in fxsplit.planner.fsdp)."""
        hw, s, step = self.hw, c.dp_shard, c.pp * c.tp
        intra_s = hw.same_node(0, (s - 1) * step)
        rep = c.dp // s
        sharded = u.params - u.experts  # FSDP leaves the expert blocks whole (all-reduced below)
        per_byte = (self.fsdp.reduce_itemsize or self.w.param_itemsize) / self.w.param_itemsize
        reduced = sharded * per_byte
        a0, a1 = hw.allgather_time(0.0, s, intra_s), hw.allgather_time(1.0, s, intra_s)
        r0, r1 = hw.reduce_scatter_time(0.0, s, intra_s), hw.reduce_scatter_time(1.0, s, intra_s)
        has = sharded > 0
        gather = np.where(has, a0 + (a1 - a0) * sharded, 0.0)
        reduce = np.where(has, r0 + (r1 - r0) * reduced, 0.0)
        if rep > 1:
            intra_r = hw.same_node(0, (rep - 1) * s * step)
            x0, x1 = hw.allreduce_time(0.0, rep, intra_r), hw.allreduce_time(1.0, rep, intra_r)
            reduce = reduce + np.where(has, x0 + (x1 - x0) * reduced / s, 0.0)
        reps, intra_e = self._expert_replicas(c)
        if reps > 1 and u.experts.any():
            e0, e1 = hw.allreduce_time(0.0, reps, intra_e), hw.allreduce_time(1.0, reps, intra_e)
            reduce = reduce + np.where(u.experts > 0, e0 + (e1 - e0) * u.experts * per_byte, 0.0)
        stages = [(cuts[k], cuts[k + 1]) for k in range(c.num_stages) if ranks[k] == r]
        jobs = step_jobs(self._fsdp_units, u.F, u.I + u.W, gather, reduce, stages, pipeline=c.pp > 1)
        exposed, hidden = overlap(jobs)
        times = 1 if c.pp > 1 else c.microbatches  # without a pipeline every microbatch gathers and reduces
        return exposed * times, hidden * times

    def _closed_form(self, c: Candidate, F, I, W, comm, ranks) -> float:
        p, v, m = c.pp, c.stages_per_rank, c.microbatches
        share = np.zeros(p)
        for s in range(len(F)):
            share[ranks[s]] += F[s] + I[s] + W[s]
        f, i, wg = float(F.max()) * v, float(I.max()) * v, float(W.max()) * v  # a rank's share, largest stage
        bubble = _schedules.schedule_spec(c.schedule).bubble(p, v, f, i, wg)
        return m * float(share.max()) + bubble + 2 * (len(F) - 1) * float(comm.max(initial=0.0))

    @staticmethod
    def simulated_actions(c: Candidate) -> int:
        """Actions ``score(c, simulate=True)`` simulates (0 without a pipeline)."""
        p, v, m = c.pp, c.stages_per_rank, c.microbatches
        if p == 1:
            return 0
        m_a = max(p, MAX_SIMULATED_ACTIONS // (3 * p * v))
        return 3 * p * v * (m if m_a + p >= m else 2 * m_a + p)

    def _simulate(self, c: Candidate, F, I, W, comm, ranks, *, cores: float = math.inf,
                  copies: int = 1) -> tuple[float, str]:
        """The schedule simulated with the per-stage costs (under processor sharing when ``cores``
        is finite: [Note: host sharing]), extended linearly past ``MAX_SIMULATED_ACTIONS``."""
        p, v, m = c.pp, c.stages_per_rank, c.microbatches
        m_a = max(p, MAX_SIMULATED_ACTIONS // (3 * p * v))
        if math.isfinite(cores):
            span = lambda mb: shared_makespan(  # noqa: E731
                _schedules.build(c.schedule, p, mb, stages_per_rank=v), list(F), list(I), list(W), list(comm),
                cores=cores, copies=copies)
        else:
            span = lambda mb: _schedules.simulate(  # noqa: E731
                _schedules.build(c.schedule, p, mb, stages_per_rank=v), forward=list(F), backward=None,
                backward_input=list(I), backward_weight=list(W), comm=list(comm)).makespan
        how = "simulated" + (", host-shared" if math.isfinite(cores) else "")
        if m_a + p >= m:
            return span(m), how
        t_a, t_b = span(m_a), span(m_a + p)  # the steady state repeats every p microbatches
        return t_b + (m - m_a - p) * (t_b - t_a) / p, f"{how} at m={m_a} and {m_a + p}, extended"
