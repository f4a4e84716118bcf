"""The per-rank memory model: what one rank holds at rest and at the peak of a training step,
and what a pipeline stage holds per microbatch in flight. One function for both consumers:
``Plan.memory()`` (fxsplit.api.memory, from a built plan's parameters) and the auto-planner's
score (fxsplit.planner.score, from its per-group arrays).

    m = rank_memory(shard_bytes=..., numel=..., shard_numel=..., grad_itemsize=4,
                    gather_itemsize=4, optimizer_bytes_per_param=8, dp=2, dp_shard=1, activations=a)
    m.peak, m.at_rest, m.as_dict()

    held = StageHeld(gm, units, binds, unit_saved(gm, units, binds), loss_key(gm, binds))
    held.stage(None, a, b, last)      # bytes per microbatch of the stage [a, b) (mode "none")
    held.weight(a, b, weight_time)    # of those, what a split backward's W still needs after I

[Note: memory model]
Terms: d = dp (replicas), s = dp_shard (FSDP shards); a rank's parameters are those of its
pipeline rank's stages at their tp-local shapes (``numel`` elements), of which
FSDP leaves it ``shard_numel`` elements, ``shard_bytes`` (the whole with s = 1).
- at rest (between steps): the parameter shards, their gradients (same bytes) and the optimizer
  state, ``optimizer_bytes_per_param`` per shard element (Adam/AdamW: two float32 tensors, 8;
  plus a float32 master copy, 12, when the parameters themselves are 16-bit);
- during a step with s > 1, FSDP also holds each stage whole (one unit per stage,
  ``reshard_after_forward=False``: [Note: FSDP units and reshard_after_forward] in
  fxsplit.runtime.fsdp): the gathered parameters in the mixed-precision param dtype
  (``gather_itemsize``), and the unsharded gradients accumulated over the microbatches in the
  reduce dtype (``grad_itemsize``), freed by the reduce-scatter at the end of the step;
- a backward's working memory (``backward``): on the rank of the last stage, the loss's
  gradients, ``_LOSS_GRADIENTS`` = 2 tensors the size of its input at once (cross-entropy's
  gradient of the log-probabilities and of the logits, while the saved log-softmax is still
  held: measured, tests/test_memory_model.py); other working memory (one op's gradients) is not
  modelled;
- activations: the pipeline's in-flight microbatches times what each stage holds per
  microbatch, plus the rank's posted receive buffers (``SplitPlan.peak_activations``, [Note:
  what a stage holds] below); ``recompute``: under checkpointing, the one
  region's activations a backward holds while it recomputes it (a built plan: the largest
  ``StageSummary.recompute_bytes`` of the rank's stages; the planner: its own estimate; 0 when
  not estimated); the loss's gradients and a recompute are not live at once (the ops after the
  last region, LM head and loss, are differentiated first), so the larger of the two counts;
- the peak of a step: parameters + optimizer state at rest, FSDP's gathered parameters, and the
  larger of two moments. During the pipeline: the activations (+ the larger backward transient), plus the gradients
  live at that moment: for a built plan (``Plan.memory()``) ``grads_at_peak`` from a walk of its
  schedule ([Note: the schedule's walk]: each stage's gradients from its first backward on);
  for the planner's estimate the whole (tp-local) gradients once a backward has filled them while
  later forwards still run (``grads_during_forwards``: the rank runs more microbatches than it
  holds in flight; with one microbatch in flight at a time backward frees the activations while
  it fills the gradients, so they are not summed). After the pipeline: the whole gradients plus their flat copy for the reduction (``buckets``):
  with plain data parallelism (d > 1, s = 1) the flat buckets of fxsplit's all-reduce, with
  s > 1 FSDP's reduce-scatter input (it copies the unsharded gradients into one flat tensor),
  allocated when the activations are gone (measured: benchmarks/fsdp_memory.py at 2x64 tokens,
  where this moment is the peak). Gradients are None before the step (``zero_grad``'s
  default). The sharded gradients FSDP writes are a 1/s part, not modelled.
Measured with ``benchmarks/fsdp_memory.py`` (peak / predicted per rank in its README section).

[Note: what a stage holds]
Per microbatch in flight, a stage holds (each storage once, ``fxsplit.graph.saved.union_bytes``):
what its units save for backward under its checkpointing mode (``mode_held`` in
fxsplit.pipeline.checkpointing); the values it received (the executor keeps them as the leaves
of the backward); the values it sent on (kept as the backward's roots until the gradient comes
back); on the last stage, what the loss keeps, the size of the model's outputs (cross-entropy
keeps the log-softmax of the logits, MSE the difference). Measured against a stage's forward in
one process (tests/test_memory_model.py, within 15% in every mode) and over gloo at a backward's
start (tests/test_runtime_memory.py, benchmarks/activation_memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.fx

from fxsplit.graph.saved import base, node_bytes, union_bytes

__all__ = ["EXPERT_LOAD_MARGIN", "RankMemory", "rank_memory", "message_buffers", "schedule_peaks",
           "optimizer_bytes_per_element", "state_bytes_per_param_byte", "schedule_walk", "loss_gradient_bytes", "worst", "StageHeld",
           "loss_key", "with_loss", "expert_rows_factor", "expert_memory", "exchange_bytes"]

# [Note: expert memory] With expert parallelism (ep > 1) the busiest ep rank's experts get more
# than its even share of the routed rows, dropless. Eagerly the exchange holds what arrives:
# ``EXPERT_LOAD_MARGIN`` times the share (a top-k router trained with a load-balancing loss keeps the
# per-expert load near the mean; 1.25 is the capacity factor GShard / Switch train with, so a
# rank whose load stays under it would not have dropped a token). A stage that runs as graphs (the
# graph split: compile=True, or a schedule that splits the backward) holds the padded exchange of
# [Note: traced exchange] in fxsplit.tp.experts: ep times the share, whatever the routing.
# ``expert_memory`` gives both terms from the same inputs for ``Plan.memory()`` and the planner's
# score: the extra saved bytes of the expert FFNs (``imbalance``, per microbatch in flight) and the
# exchange buffers of the largest MoE layer (``exchange``: its dispatched rows and combined outputs,
# ``exchange_bytes``), once per rank.
EXPERT_LOAD_MARGIN = 1.25


def expert_rows_factor(ep: int, traced: bool = False) -> float:
    """The busiest ep rank's routed rows over its even share ([Note: expert memory])."""
    if ep == 1:
        return 1.0
    return float(ep) if traced else EXPERT_LOAD_MARGIN


def expert_memory(expert_saved: float, exchanged: Sequence[float], ep: int, traced: bool = False) -> tuple[float, float]:
    """(imbalance, exchange) of [Note: expert memory]: ``expert_saved`` the expert FFNs' saved
    bytes per microbatch at the even share, ``exchanged`` each MoE layer's ``exchange_bytes``."""
    if ep == 1:
        return 0.0, 0.0
    f = expert_rows_factor(ep, traced)
    return (f - 1.0) * expert_saved, f * max(exchanged, default=0.0)


def exchange_bytes(rows: torch.fx.Node, last: torch.fx.Node, binds: Mapping) -> float:
    """Bytes one exchange of a MoE layer moves at the even share: the rows dispatched (the first
    grouped matmul's input ``rows``) and the expert outputs combined (the last one's output)."""
    return node_bytes(rows, binds) + node_bytes(last, binds)

_LOSS_GRADIENTS = 2  # tensors the size of the loss's input live at the start of the last stage's backward


def loss_gradient_bytes(loss_bytes: float) -> float:
    """The loss's gradients as the last stage's backward starts ([Note: memory model])."""
    return _LOSS_GRADIENTS * loss_bytes


_MASTER_COPY = 4.0  # a float32 master copy of a 16-bit parameter, per element


def optimizer_bytes_per_element(param_itemsize: float, state_bytes: float = 8.0) -> float:
    """Optimizer bytes per parameter element: ``state_bytes`` of float32 state (Adam/AdamW's m and
    v: 8; SGD without momentum: 0), plus a float32 master copy when the parameters themselves are
    16-bit ([Note: memory model]). The one rule for ``Plan.memory()``, the partition's cap and the
    auto-planner's score."""
    return state_bytes + (_MASTER_COPY if param_itemsize < 4 else 0.0)


def state_bytes_per_param_byte(*, param_itemsize: float, grad_itemsize: float, optimizer_bytes_per_param: float,
                               gather_itemsize: float, dp_shard: int) -> float:
    """What ``rank_memory`` charges per byte of a rank's tp-local parameters during the pipeline,
    at most (the partition's linear cap, ``PartitionProblem.state_bytes_per_param_byte``): the
    FSDP shard and its optimizer state (1/s of the elements), the whole gradients (held beside the
    activations when a rank runs more microbatches than it holds) and, with s > 1, the gathered
    stage. The partition cannot see the other terms (message buffers, the loss's gradients,
    buckets), so ``plan()`` checks the built plan with ``rank_memory`` itself afterwards."""
    s = max(dp_shard, 1)
    per_element = (param_itemsize + optimizer_bytes_per_param) / s + grad_itemsize
    if s > 1:
        per_element += gather_itemsize
    return per_element / param_itemsize


def worst(rows: Sequence["RankMemory"]) -> "RankMemory":
    """The rank with the largest peak (the figure a memory limit is checked against)."""
    return max(rows, key=lambda m: m.peak)


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank of pipeline rank ``pp_rank`` expects ([Note: memory model])."""

    pp_rank: int = 0
    params: float = 0.0  # at rest: this rank's shards
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0  # peak during a step
    gathered: float = 0.0  # during a step with dp_shard > 1: the whole (gathered) stage parameters
    whole_grads: float = 0.0  # during a step: the tp-local gradients before any reduction
    buckets: float = 0.0  # after the pipeline: the flat copy of the gradients a reduction makes (dp or dp_shard)
    recompute: float = 0.0  # during a checkpointed backward: one region's activations being recomputed
    grads_during_forwards: bool = False  # whole gradients live beside the activations (more microbatches than in flight)
    backward: float = 0.0  # a backward's working memory on top of the activations (the loss's gradients)
    grads_at_peak: float | None = None  # gradients live at the activation peak, from the schedule's walk (None: not walked)
    transient: float | None = None  # the walk's transient at its peak (None: not walked; max(recompute, backward) then)
    exchange: float = 0.0  # expert parallelism: the largest MoE layer's exchange buffers ([Note: expert memory])
    imbalance: float = 0.0  # of ``activations``: the busiest ep rank's extra expert rows ([Note: expert memory])

    @property
    def at_rest(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> float:
        """Bytes held at the peak of a step ([Note: memory model])."""
        if self.grads_at_peak is not None:
            grads = self.grads_at_peak
        else:
            grads = self.whole_grads if self.grads_during_forwards else 0.0
        # two transients of a backward, one after the other: the loss's gradients are freed by the
        # backward of the ops after the last checkpointed region before any region is recomputed
        transient = max(self.recompute, self.backward) if self.transient is None else self.transient
        pipeline = self.activations + self.exchange + transient + grads
        return self.params + self.optimizer + self.gathered + max(pipeline, self.whole_grads + self.buckets)

    @property
    def total(self) -> float:
        """The peak (the figure a memory limit is checked against)."""
        return self.peak

    def as_dict(self) -> dict:
        return dict(params=self.params, grads=self.grads, optimizer=self.optimizer, activations=self.activations,
                    gathered=self.gathered, whole_grads=self.whole_grads, buckets=self.buckets,
                    recompute=self.recompute, backward=self.backward, peak=self.peak, total=self.total,
                    **({"exchange": self.exchange, "imbalance": self.imbalance} if self.exchange or self.imbalance else {}),
                    **({} if self.grads_at_peak is None else {"grads_at_peak": self.grads_at_peak}))


def rank_memory(*, shard_bytes: float, numel: float, shard_numel: float,
                grad_itemsize: float, gather_itemsize: float, optimizer_bytes_per_param: float,
                dp: int, dp_shard: int, activations: float, recompute: float = 0.0,
                microbatches: int = 1, inflight: float = 1.0, loss_bytes: float = 0.0,
                pp_rank: int = 0, grads_at_peak: float | None = None, exchange: float = 0.0,
                imbalance: float = 0.0, held_numel: float | None = None,
                transient: float | None = None) -> RankMemory:
    """One rank's :class:`RankMemory` ([Note: memory model]); ``numel``: the
    rank's tp-local parameter elements, ``shard_bytes`` / ``shard_numel``: its FSDP shard of them;
    ``microbatches`` the rank runs per step, ``inflight`` the most it holds at once; ``loss_bytes``
    the loss's input (the model outputs of one microbatch) when the rank holds the last stage;
    ``exchange`` / ``imbalance`` ([Note: expert memory]): ``imbalance`` is already in ``activations``.
    ``held_numel``: the elements FSDP holds unsharded at once, gathered parameters and their
    gradients (None: all ``numel``, fxsplit's unit per stage; the planner's per-layer policy of
    published runs holds fewer: [Note: FSDP policies] in fxsplit.planner.fsdp)."""
    held = numel if held_numel is None else min(held_numel, numel)
    whole_grads = held * grad_itemsize
    return RankMemory(
        pp_rank=pp_rank, params=shard_bytes, grads=shard_bytes, optimizer=shard_numel * optimizer_bytes_per_param,
        activations=activations, gathered=held * gather_itemsize if dp_shard > 1 else 0.0,
        whole_grads=whole_grads, buckets=whole_grads if dp > 1 or dp_shard > 1 else 0.0, recompute=recompute,
        grads_during_forwards=microbatches > inflight, backward=loss_gradient_bytes(loss_bytes),
        grads_at_peak=None if grads_at_peak is None else min(grads_at_peak, whole_grads), exchange=exchange,
        imbalance=imbalance, transient=transient)


# [Note: message buffers]
# Besides its in-flight microbatches a pipeline rank holds messages: the receive buffers the
# runtime posts ahead (``prefetch``: the next two actions' receives, fxsplit.runtime.executor), the
# gradient a backward is consuming, and a sent message until the peer's next message releases
# it ([Note: releasing sends] in fxsplit.runtime.p2p). Measured at a backward's start with
# benchmarks/activation_memory.py (p=2, 1F1B, every checkpointing mode): two messages per
# direction the rank receives in (rank 0: two gradient messages; the last rank: the next
# forward's activations and the gradient it sent back). So each rank is charged
# ``_MESSAGES_IN_FLIGHT`` of its largest gradient message (when a stage of it has a successor) and
# of its largest activation message (when one has a predecessor).
_MESSAGES_IN_FLIGHT = 2


def message_buffers(stage_ranks: Sequence[int], bytes_in: Sequence[float], bytes_out: Sequence[float],
                    num_ranks: int) -> tuple[float, ...]:
    """Per rank: the message bytes it holds at a backward's start besides its in-flight
    microbatches ([Note: message buffers]); per stage its rank and the bytes it receives and sends."""
    S = len(stage_ranks)
    out = [0.0] * num_ranks
    if S <= 1:
        return tuple(out)
    for r in range(num_ranks):
        mine = [s for s in range(S) if stage_ranks[s] == r]
        # a neighbour on the same rank is handed its values in place: no message, no buffer
        grads = max((bytes_out[s] for s in mine if s < S - 1 and stage_ranks[s + 1] != r), default=0.0)
        acts = max((bytes_in[s] for s in mine if s > 0 and stage_ranks[s - 1] != r), default=0.0)
        out[r] = _MESSAGES_IN_FLIGHT * (grads + acts)
    return tuple(out)


def schedule_peaks(schedule: Sequence[Sequence], num_ranks: int, full: Sequence[float],
                   after_input_grad: Sequence[float]) -> tuple[float, ...]:
    """[Note: split backward memory] Per rank: the most activation bytes it holds, walking its
    actions in the schedule's order. A forward of stage s adds ``full[s]``; a full backward (B)
    frees it; a split backward's I frees all but ``after_input_grad[s]`` (what W still needs: the
    inputs of the weight-gradient matmuls and their output gradients) and its W frees the rest.
    So a zero-bubble schedule, whose W runs late, is charged for the W halves it keeps, not for
    whole microbatches (``Timeline.peak_inflight`` counts a microbatch whole until its W ends).
    ``after_input_grad`` may exceed ``full``: under checkpointing with the graph split backward, I
    recomputes the region once and keeps what W needs of it until W runs."""
    peaks = [0.0] * num_ranks
    for r, row in enumerate(schedule[:num_ranks]):
        live = 0.0
        for a in row:
            if a is None:
                continue
            kind, s = str(a.kind), a.stage
            if kind == "F":
                live += full[s]
                peaks[r] = max(peaks[r], live)
            elif kind == "B":
                live -= full[s]
            elif kind == "I":  # may grow: a checkpointed region recomputed by I keeps W's inputs
                live += after_input_grad[s] - full[s]
                peaks[r] = max(peaks[r], live)
            elif kind == "W":
                live -= after_input_grad[s]
    return tuple(peaks)


def schedule_walk(row: Sequence, full: Sequence[float], after_input_grad: Sequence[float],
                  grad_bytes: Sequence[float], start: Sequence[float] | None = None,
                  weight_transient: Sequence[float] | None = None) -> tuple[float, float, float]:
    """[Note: the schedule's walk] One rank's (activation bytes, gradient bytes, transient bytes)
    at the moment their sum peaks, walking its actions in order: a forward of stage s adds
    ``full[s]``; I leaves ``after_input_grad[s]`` of it ([Note: split backward memory]); the first
    backward of s that computes weight gradients (B, or W when split) allocates its gradients,
    ``grad_bytes[s]``, which stay until the step ends, while it frees its microbatch (B all of
    it, W the rest): a backward frees activations as it fills gradients (measured:
    tests/test_memory_model.py), so the sum is checked before and after, not with both whole.
    Transients, on top of what is held when they happen: ``start[s]`` as a B or I of s begins (the
    loss's gradients on the last stage; under checkpointing the region it recomputes, whole; the
    larger of the two, [Note: memory model]); ``weight_transient[s]``: a W of s whose gradients
    already exist computes all of its gradients before adding them in (the graph split's W,
    ``accumulate_grads``; a parameter it shares with another stage of the rank included): that
    much more until it returns.
    Follows the order the runtime runs, where the in-flight formulas (``inflight_1f1b``) bound
    interleaved orders."""
    live = grads = 0.0
    have: set = set()
    best = (0.0, 0.0, 0.0)

    def check(transient: float = 0.0) -> None:
        nonlocal best
        if live + grads + transient > sum(best):
            best = (live, grads, transient)

    for a in row:
        if a is None:
            continue
        kind, s = str(a.kind), a.stage
        if kind in ("B", "I") and start is not None:
            check(start[s])
        if kind == "W" and weight_transient is not None and s in have:
            check(weight_transient[s])
        if kind == "F":
            live += full[s]
        elif kind == "I":  # may grow: a checkpointed region recomputed by I keeps W's inputs
            live += after_input_grad[s] - full[s]
        check()
        if kind in ("B", "W"):  # the backward frees its microbatch as it fills the gradients
            if s not in have:
                have.add(s)
                grads += grad_bytes[s]
            live -= full[s] if kind == "B" else after_input_grad[s]
            check()
    return best


# ----------------------------------------------------------------------------- what a stage holds


def loss_key(gm: torch.fx.GraphModule, binds: Mapping) -> dict[Any, float]:
    """What the loss keeps for backward, keyed by the graph's output node: the size of the model's
    outputs (cross-entropy keeps the log-softmax of the logits, MSE the difference), held by the
    last stage ([Note: what a stage holds])."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    nodes = _flat_nodes(out.args)
    total = sum(node_bytes(n, binds) for n in nodes)
    return {out: total} if total else {}


def _flat_nodes(x: Any) -> list[torch.fx.Node]:
    if isinstance(x, torch.fx.Node):
        return [x]
    if isinstance(x, (tuple, list)):
        return [n for a in x for n in _flat_nodes(a)]
    if isinstance(x, dict):
        return [n for a in x.values() for n in _flat_nodes(a)]
    return []


def with_loss(acts: Sequence[float], key: Mapping) -> tuple[float, ...]:
    """``acts`` with the loss's saved bytes (``loss_key``) added to the last unit."""
    out = list(acts)
    out[-1] += sum(key.values())
    return tuple(out)


class StageHeld:
    """Per microbatch in flight, a stage holds (each storage once,
    ``fxsplit.graph.saved.union_bytes``): what its units save for backward under its checkpointing
    mode; the values it received (the executor keeps them as the leaves of the backward) and the
    values it sent on (kept as the backward's roots until the gradient comes back); on the last
    stage, what the loss keeps (the model outputs' size: ``loss_key``)."""

    def __init__(self, gm: torch.fx.GraphModule, units: list[torch.fx.Node], binds: Mapping,
                 held: Sequence, loss_key: Mapping) -> None:
        self.gm, self.units, self.binds, self.held, self.loss = gm, units, binds, held, loss_key
        self.index = {u: i for i, u in enumerate(units)}

    def boundary(self, a: int, b: int, local: Sequence[tuple[int, int]] = ()) -> dict[Any, float]:
        """Bases of the values stage [a, b) receives and sends on, with their bytes. ``local``: the
        unit ranges of the other stages on the same rank; a value received from one of them is
        handed over on the rank, the sender's kept output itself (the executor's ``detach``: one
        storage), so the sender counts it and this stage does not."""
        out: dict[Any, float] = {}
        n = len(self.units)
        for i in range(a, b):
            u = self.units[i]
            ins = [x for x in u.all_input_nodes if self.index.get(x, n) < a
                   and not any(lo <= self.index.get(x, n) < hi for lo, hi in local)]
            sends = [u] if any(a <= i < b <= self.index.get(x, -1) for x in u.users) else []
            for x in ins + sends:
                key = base(x, self.gm)
                if key is not None:
                    out[key] = max(out.get(key, 0.0), node_bytes(x, self.binds))
        return out

    def weight(self, a: int, b: int, weight_time: Sequence[float]) -> float:
        """What a split backward's W needs of stage [a, b) after I: for every unit with a weight
        gradient, its saved inputs and its output's gradient ([Note: split backward memory])."""
        units = [i for i in range(a, b) if weight_time[i] > 0]
        grads = {("grad", self.units[i]): node_bytes(self.units[i], self.binds) for i in units}
        return union_bytes([(self.held[i][0], 0.0) for i in units], grads)

    def recomputed(self, region: Sequence[int], a: int, b: int) -> float:
        """The most a backward of stage [a, b) holds at once while it recomputes a checkpointed
        region (``region``: per unit its region, -1 when not recomputed): the largest region part's
        activations as mode "none" saves them."""
        parts: dict[int, list] = {}
        for i in range(a, min(b, len(region))):
            if region[i] >= 0:
                parts.setdefault(region[i], []).append(self.held[i])
        return max((union_bytes(p) for p in parts.values()), default=0.0)

    def stage(self, held: Sequence | None, a: int, b: int, last: bool,
              local: Sequence[tuple[int, int]] = ()) -> float:
        extra = self.boundary(a, b, local)
        if last:
            extra.update(self.loss)
        units = (self.held if held is None else held)[a:b]
        if local:  # what it saves of a value handed over on the rank is the sender's storage, counted there
            n = len(self.units)
            units = [({k: v for k, v in keys.items() if not any(lo <= self.index.get(k, n) < hi for lo, hi in local)}, own)
                     for keys, own in units]
        return union_bytes(units, extra)
