"""Pipeline split planning: turn a traced graph into a balanced, contiguous stage assignment.

Terms:
- **unit**: one compute node (call_function / call_method / call_module) of the traced graph, in
  topological order. Placeholders and parameters (get_attr) are not units: every stage that needs
  a model input or a parameter gets its own reference.
- **position k**: a cut before unit k. **cut bytes** of k: the bytes of every tensor produced
  before k and used at or after k (what crosses that cut, skips included).
- **layer key**: a unit's module path up to its first numeric component (``blocks.3``,
  ``model.layers.11``), else its first component. Stages start at layer boundaries unless a cut
  inside a layer lowers the bottleneck by more than 2% ([Note: layer cuts] in
  ``fxsplit.pipeline.cuts``).
- **recomputed value**: a boundary value every stage recomputes from its own inputs instead of
  receiving it (rotary tables, masks; [Note: recompute, don't ship] in
  ``fxsplit.pipeline.recomputable``); its bytes cross no cut.
- **S** stages on **p** ranks (stage s on rank s % p, or ``stage_ranks[s]``, the schedule's
  placement, e.g. ZB-V's V; v = S / p stages per rank).

    plan = plan_split(gm, num_stages=8, num_ranks=4)      # pure: no weights, no process group
    print(plan)                                           # one row per stage, balance ratio
    stages = plan.build(gm)                               # fxsplit.pipeline.stage.StageGraphs

The partition is exact (see ``fxsplit.pipeline.partition``): it minimizes the most loaded stage, counting
compute from the cost model plus the time to send and receive the stage's boundary bytes.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import sympy
import torch
import torch.fx

from fxsplit.graph.units import fmt_bytes, fmt_ms
from fxsplit.graph.profile import node_time
from fxsplit.graph.marker import find_pipe_splits
from fxsplit.graph.meta import node_info
from fxsplit.graph.recompute import layer_key
from fxsplit.graph.saved import first_saver_bytes, unit_saved
from fxsplit.pipeline.bindings import batch_bindings, concrete, example_bindings, resolve_bindings
from fxsplit.pipeline.bindings import cut_bytes as unit_cut_bytes
from fxsplit.pipeline.partition import (
    Partition,
    PartitionError,
    PartitionProblem,
    equal_layer_cuts,
    evaluate,
    parameter_count_cuts,
)
from fxsplit.pipeline.checkpointing import choose, unit_modes
from fxsplit.pipeline.cuts import CUT_AT, choose_cuts, cut_rules, outside_atomic
from fxsplit.pipeline.recomputable import recomputable
from fxsplit.pipeline.memory import StageHeld, message_buffers, schedule_peaks
from fxsplit.pipeline.memory import loss_key as _loss_key, with_loss as _with_loss
from fxsplit.pipeline.stage import StageGraphs, build_stages
from fxsplit.errors import SplitError
from fxsplit.hardware import Hardware
from fxsplit.schedule import schedule_spec

__all__ = ["Hardware", "StageSummary", "SplitPlan", "SplitRequest", "SplitError", "plan_split", "batch_bindings", "example_bindings", "layer_key"]

_COMPUTE = ("call_function", "call_method", "call_module")



@dataclass(frozen=True)
class StageSummary:
    index: int
    rank: int
    module_paths: tuple[str, ...]  # layer keys in order, e.g. ("wte", "wpe", "blocks.0", "blocks.1")
    num_nodes: int
    param_bytes: float
    flops: float  # forward, at the example sizes
    activation_bytes: float  # saved for backward per microbatch
    bytes_in: float
    bytes_out: float
    time: float  # estimated forward+backward seconds per microbatch, communication and recompute included
    forward_time: float = 0.0  # estimated compute seconds per microbatch: forward (F) ...
    input_grad_time: float = 0.0  # ... input-gradient half of the backward (I, recompute included) ...
    weight_grad_time: float = 0.0  # ... and weight-gradient half (W); see [Note: F, I, W estimates]
    comm_time: float = 0.0  # seconds to send this stage's output (bytes_out / link bandwidth)
    checkpointing: str = "none"  # the stage's activation checkpointing mode (fxsplit.graph.recompute)
    activation_bytes_unchecked: float | None = None  # act/mb without checkpointing (None: same)
    recompute_time: float = 0.0  # seconds of forward recomputed in backward per microbatch
    weight_bytes: float = 0.0  # what a split backward's W still needs after I (checkpointed: may exceed activation_bytes)
    recompute_bytes: float = 0.0  # checkpointed: the largest region's activations a backward holds while recomputing it


def _fmt_num(x: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.0f}"


def _compress_paths(paths: Sequence[str]) -> str:
    """("blocks.0", "blocks.1", "blocks.2", "ln_f") -> "blocks.0-2, ln_f"."""
    out: list[str] = []
    run: tuple[str, int, int] | None = None
    for p in paths:
        m = re.fullmatch(r"(.*\.)(\d+)", p)
        if m and run and run[0] == m.group(1) and int(m.group(2)) == run[2] + 1:
            run = (run[0], run[1], int(m.group(2)))
            continue
        if run:
            out.append(f"{run[0]}{run[1]}" + (f"-{run[2]}" if run[2] != run[1] else ""))
            run = None
        if m:
            run = (m.group(1), int(m.group(2)), int(m.group(2)))
        else:
            out.append(p or "<top>")
    if run:
        out.append(f"{run[0]}{run[1]}" + (f"-{run[2]}" if run[2] != run[1] else ""))
    return ", ".join(out)


def _read_later(units: list[torch.fx.Node], names: frozenset[str], cuts: Sequence[int]) -> tuple[str, ...]:
    """The nodes among ``names`` that a later stage reads (they would cross a cut if sent)."""
    stage = {}
    for s, (a, b) in enumerate(zip(cuts, cuts[1:])):
        stage.update((u, s) for u in units[a:b])
    return tuple(u.name for u in units if u.name in names
                 and any(stage.get(x, stage[u]) > stage[u] for x in u.users))


def _compress_names(names: Sequence[str], keep: int = 6) -> str:
    return ", ".join(names[:keep]) + (f" and {len(names) - keep} more" if len(names) > keep else "")


@dataclass(frozen=True)
class SplitPlan:
    """A contiguous assignment of the graph's compute nodes to ``num_stages`` stages.

    ``stage_of`` maps node names to stages; ``starts`` names the first node of each stage;
    ``partition`` is the solver's result (stage times, memory, ``exact``). ``baselines`` holds the
    balance of an equal-layer split and a parameter-count split of the same graph, for comparison.
    """

    num_stages: int
    num_ranks: int
    stage_of: Mapping[str, int]
    starts: tuple[str, ...]
    stages: tuple[StageSummary, ...]
    partition: Partition
    method: str  # "balanced", "user split points", "user split points + balanced"
    problem: PartitionProblem | None = None  # what the solver was given (for checks and tools)
    bindings: Mapping[str, int] = field(default_factory=dict)
    baselines: Mapping[str, float] = field(default_factory=dict)
    activation_checkpointing: str = "none"  # what was asked: "none", "selective", "full" or "auto"
    loss_bytes: float = 0.0  # the loss's input per microbatch (the model outputs), on the last stage
    schedule: str = "1f1b"  # the schedule the memory model walks ([Note: split backward memory])
    num_microbatches: int | None = None
    recomputed: tuple[str, ...] = ()  # tensor nodes a later stage recomputes instead of receiving (closures whole)
    recomputed_reads: tuple[str, ...] = ()  # those of them a later stage reads: the values no longer sent
    cut_reason: str = ""  # why a stage starts inside a layer ("" when every cut is at a layer boundary)

    @property
    def checkpointing(self) -> tuple[str, ...]:
        """Each stage's activation checkpointing mode."""
        return tuple(s.checkpointing for s in self.stages)

    def peak_activations(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per rank: the activation bytes held at the peak (in-flight microbatches x the rank's
        act/mb, the partition's memory model; on a zero-bubble schedule the schedule's order walked
        with each W's share: [Note: split backward memory] in fxsplit.pipeline.memory), plus its
        message buffers, with this plan's checkpointing and without ([Note: what a stage holds] in
        fxsplit.pipeline.memory)."""
        buffers = self.message_buffers()
        plain = [s.activation_bytes if s.activation_bytes_unchecked is None else s.activation_bytes_unchecked
                 for s in self.stages]
        spec = schedule_spec(self.schedule)
        if spec.order_decides_inflight and self.num_ranks > 1:  # walk the order with each W's share
            p, v = self.num_ranks, self.num_stages // self.num_ranks
            rows = spec.builder(p, self.num_microbatches or 2 * p, v)
            w = [s.weight_bytes for s in self.stages]
            with_ = schedule_peaks(rows, p, [s.activation_bytes for s in self.stages], w)
            without = schedule_peaks(rows, p, plain, w)
            return (tuple(x + b for x, b in zip(with_, buffers)), tuple(x + b for x, b in zip(without, buffers)))
        inflight = self.problem.inflight_per_rank() if self.problem is not None else (1.0,) * self.num_ranks
        with_, without = list(buffers), list(buffers)
        for s, x in zip(self.stages, plain):
            with_[s.rank] += inflight[s.rank] * s.activation_bytes
            without[s.rank] += inflight[s.rank] * x
        return tuple(with_), tuple(without)

    def message_buffers(self) -> tuple[float, ...]:
        """Per rank: the bytes of the pipeline messages it holds besides its in-flight
        microbatches ([Note: message buffers] in fxsplit.pipeline.memory)."""
        return message_buffers([s.rank for s in self.stages], [s.bytes_in for s in self.stages],
                               [s.bytes_out for s in self.stages], self.num_ranks)

    @property
    def bottleneck(self) -> float:
        return max(s.time for s in self.stages)

    @property
    def mean(self) -> float:
        return sum(s.time for s in self.stages) / len(self.stages)

    @property
    def balance(self) -> float:
        """bottleneck / mean stage time (1.0 is perfect)."""
        return self.bottleneck / self.mean if self.mean > 0 else 1.0

    def build(self, gm: torch.fx.GraphModule) -> StageGraphs:
        """The stage GraphModules (sharing ``gm``'s parameters) for this assignment."""
        return build_stages(gm, dict(self.stage_of), self.num_stages, recompute=frozenset(self.recomputed))

    def to_dot(self, gm: torch.fx.GraphModule, path: str | None = None) -> str:
        from fxsplit.graph.inspection import to_dot

        return to_dot(gm, path, color_by="stage", stage_of=dict(self.stage_of))

    def __str__(self) -> str:
        ckpt = self.activation_checkpointing != "none" or any(m != "none" for m in self.checkpointing)
        head = ("stage", "rank", "modules", "nodes", "params", "FLOPs", "act/mb", "in", "out", "time")
        if ckpt:
            head = head + ("ckpt", "act/mb no ckpt", "recompute")
        rows = [head]
        for s in self.stages:
            extra = () if not ckpt else (
                s.checkpointing,
                fmt_bytes(s.activation_bytes if s.activation_bytes_unchecked is None else s.activation_bytes_unchecked),
                fmt_ms(s.recompute_time))
            rows.append(
                (
                    str(s.index),
                    str(s.rank),
                    _compress_paths(s.module_paths),
                    str(s.num_nodes),
                    fmt_bytes(s.param_bytes),
                    _fmt_num(s.flops),
                    fmt_bytes(s.activation_bytes),
                    fmt_bytes(s.bytes_in),
                    fmt_bytes(s.bytes_out),
                    fmt_ms(s.time),
                    *extra,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        widths[2] = min(widths[2], 48)
        lines = [
            f"SplitPlan: {self.num_stages} stages on {self.num_ranks} ranks ({self.method}); "
            f"balance {self.balance:.3f} (bottleneck {fmt_ms(self.bottleneck)} / mean {fmt_ms(self.mean)})"
            + ("" if self.partition.exact else "; memory-capped, not proven optimal")
        ]
        for r in rows:
            cells = [c if i != 2 or len(c) <= 48 else c[:45] + "..." for i, c in enumerate(r)]
            lines.append("  ".join(c.ljust(w) if i == 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))))
        if ckpt:
            with_, without = self.peak_activations()
            lines.append(f"activation checkpointing {self.activation_checkpointing!r}: peak activations per rank "
                         f"{[fmt_bytes(x) for x in with_]} (without: {[fmt_bytes(x) for x in without]})")
        if self.cut_reason:
            lines.append(f"cuts inside layers: {self.cut_reason}")
        if self.recomputed_reads:
            lines.append(f"recomputed by each stage that reads them, not sent: {_compress_names(self.recomputed_reads)}")
        if self.baselines:
            lines.append("baselines (balance): " + ", ".join(f"{k} {v:.3f}" for k, v in self.baselines.items()))
        return "\n".join(lines)


def _split_point_positions(units: list[torch.fx.Node], split_points: Sequence[str]) -> list[int]:
    paths = [node_info(u).module_path for u in units]
    positions = []
    for sp in split_points:
        if not isinstance(sp, str):
            raise SplitError(f"split_points must be module paths (str), got {sp!r}")
        pos = next((i for i, p in enumerate(paths) if p == sp or p.startswith(sp + ".")), None)
        if pos is None:
            known = sorted({".".join(p.split(".")[: k + 1]) for p in paths if p for k in range(len(p.split(".")))})
            close = difflib.get_close_matches(sp, known, n=3, cutoff=0.5)
            raise SplitError(
                f"split point {sp!r} names no module of the traced graph"
                + (f"; did you mean {close}?" if close else f"; modules include {known[:8]}")
            )
        if pos == 0:
            raise SplitError(f"split point {sp!r} is the first module of the graph; a stage before it would be empty")
        positions.append(pos)
    for (a, pa), (b, pb) in zip(zip(split_points, positions), zip(split_points[1:], positions[1:])):
        if pb <= pa:
            raise SplitError(
                f"split points out of order: {b!r} (node {pb}) does not come after {a!r} (node {pa}) in "
                f"the graph; list them in execution order"
            )
    return positions


@dataclass(frozen=True)
class SplitRequest:
    """What ``plan_split`` is asked for (every option of the split, frozen).

    num_stages: S = p * v stages. num_ranks: p (default S, i.e. v = 1).
    split_points: module paths a stage must start at (before that module), in execution order;
        with S - 1 of them the balancer only checks them, with fewer it fills in the rest.
        ``fxsplit.pipe_split()`` markers in the model count as split points too.
    schedule / num_microbatches: how many microbatches' activations a rank holds (the schedule's
        ``ScheduleSpec.inflight``), for the memory cap.
    memory_limit: bytes per rank: parameters x ``state_bytes_per_param_byte`` (param, grad, Adam
        m and v) + in-flight activations, summed over the rank's stages.
    bindings: sizes for symbolic dims (``{"batch": 8}`` or ``{symbol: 8}``); default: the traced
        example's sizes.
    loss_seconds: time of the loss (not in the traced graph), charged to the last stage.
    cut_at: "layers" (layer boundaries unless a cut inside a layer lowers the bottleneck by more
        than 2%, the plan saying why), "any" (cuts inside a layer cost ``inner_cut_penalty`` x
        their bytes) or "modules" (a stage may only start where a module call begins, as
        ``pipeline()`` split points in torch.distributed.pipelining require); see
        ``fxsplit.pipeline.cuts``.
    activation_checkpointing: "none", "selective", "full" (every stage) or "auto" (per stage, the
        cheapest in time within ``memory_limit``, among ``checkpoint_modes``); recompute time and
        saved bytes per [Note: checkpointing cost model] in ``fxsplit.pipeline.checkpointing``.
    stage_ranks: the rank of every stage (``fxsplit.schedule.placement(schedule, p, v)``);
        default ``s % p``. Rank memory sums the stages placed on a rank.
    split_backward: how the runtime splits a backward into I and W on a zero-bubble schedule
        ("graph": a checkpointed region is recomputed once; "autograd": by I and again by W, so W
        is charged the recompute too).
    param_casts_free: a cast of a parameter holds no storage of its own (FSDP with a
        mixed-precision ``param_dtype`` gathers the parameters in that dtype already).
    kept_fraction: parameter name -> the part of it a rank holds (expert weights placed by ep:
        1 / ep); the stages' parameter bytes, and so the memory cap, count that part only.
    """

    num_stages: int
    num_ranks: int | None = None
    split_points: Sequence[str] | None = None
    schedule: str = "1f1b"
    num_microbatches: int | None = None
    memory_limit: float | None = None
    hardware: Hardware = field(default_factory=Hardware)
    bindings: Mapping[str | sympy.Symbol, int] | None = None
    inner_cut_penalty: float = 1.5
    state_bytes_per_param_byte: float = 4.0
    loss_seconds: float = 0.0
    cut_at: str = "layers"
    activation_checkpointing: str = "none"
    checkpoint_modes: Sequence[str] = ("none", "selective", "full")
    stage_ranks: Sequence[int] | None = None
    split_backward: str = "graph"
    param_casts_free: bool = False
    # (first, last) node names no stage boundary may fall between: values inside have sizes known
    # only at run time (expert-parallel token exchange, fxsplit.passes.expert_parallel)
    atomic: Sequence[tuple[str, str]] = ()
    kept_fraction: Mapping[str, float] = field(default_factory=dict)

    def checked(self) -> tuple[int, int]:
        """(p, v); SplitError for a request that cannot be split."""
        if self.cut_at not in CUT_AT:
            raise SplitError(f"cut_at must be one of {CUT_AT}, got {self.cut_at!r}")
        S = self.num_stages
        if not isinstance(S, int) or S < 1:
            raise SplitError(f"num_stages must be a positive int, got {S!r}")
        p = S if self.num_ranks is None else self.num_ranks
        if p < 1 or S % p:
            raise SplitError(f"num_stages ({S}) must be a multiple of num_ranks ({p}): each rank holds v = S / p stages")
        return p, S // p


def plan_split(gm: torch.fx.GraphModule, request: SplitRequest | None = None, /, **options: Any) -> SplitPlan:
    """Plan a balanced contiguous split of ``gm`` (traced by ``fxsplit.trace``) into stages, as
    ``request`` (a :class:`SplitRequest`) or its fields given as keywords
    (``plan_split(gm, num_stages=8, num_ranks=4)``) ask."""
    if request is None:
        try:
            request = SplitRequest(**options)
        except TypeError as exc:  # a misspelled or missing option
            raise SplitError(f"plan_split: {exc}; the options are SplitRequest's fields") from None
    elif options:
        request = replace(request, **options)
    r = request
    p, v = r.checked()
    binds = resolve_bindings(gm, r.bindings)
    units = [n for n in gm.graph.nodes if n.op in _COMPUTE]
    if not units:
        raise SplitError("the graph has no compute nodes to split")
    costs = _unit_costs(gm, units, binds, r.hardware, r.loss_seconds, r.kept_fraction)
    held = unit_saved(gm, units, binds, param_casts_free=r.param_casts_free)
    loss_key = _loss_key(gm, binds)
    costs.acts[:] = _with_loss(first_saver_bytes(held), loss_key)
    again = recomputable(gm, units, binds)
    cut_bytes = unit_cut_bytes(units, binds, skip=again)
    keys = [layer_key(node_info(u).module_path) for u in units]
    forced = _forced_cuts(gm, units, r.split_points, r.num_stages)
    problem = _problem(r, units, keys, costs, cut_bytes, forced, p, v)
    modes = {"none": None}
    if r.activation_checkpointing != "none":
        modes = unit_modes(gm, units, binds, r.hardware, held)
        if r.activation_checkpointing == "auto":
            modes = {m: um for m, um in modes.items() if m in r.checkpoint_modes}
    problems = {m: problem if um is None else replace(
        problem, compute=tuple(c + rc for c, rc in zip(costs.compute, um.recompute)),
        activation_bytes=_with_loss(um.acts, loss_key))
        for m, um in modes.items()}
    why = ""
    try:
        if r.cut_at == "layers":
            loose = outside_atomic([u.name for u in units], r.atomic, None)
            part, per_stage, why, free = choose_cuts(choose, problems, r.activation_checkpointing, keys, loose)
            problem = replace(problem, allowed=None if loose is None else tuple(loose)) if free else problem
        else:
            part, per_stage = choose(problems, r.activation_checkpointing)
    except PartitionError as exc:
        raise SplitError(str(exc)) from None
    S = r.num_stages
    method = "balanced"
    if forced:
        method = "user split points" if len(forced) == S - 1 else "user split points + balanced"
    return SplitPlan(
        num_stages=S,
        num_ranks=p,
        stage_of={u.name: s for s in range(S) for u in units[part.cuts[s]:part.cuts[s + 1]]},
        starts=tuple(units[part.cuts[s]].name for s in range(S)),
        stages=_summaries(part, problem, keys, costs, cut_bytes, per_stage, modes,
                          twice=r.split_backward == "autograd" and schedule_spec(r.schedule).splits_backward,
                          held=StageHeld(gm, units, binds, held, loss_key)),
        partition=part,
        method=method,
        problem=problem,
        bindings={str(k): val for k, val in binds.items()},
        baselines=_baselines(problem, keys),
        activation_checkpointing=r.activation_checkpointing,
        loss_bytes=sum(loss_key.values()),
        schedule=r.schedule,
        num_microbatches=r.num_microbatches,
        recomputed=tuple(u.name for u in units if u.name in again),
        recomputed_reads=_read_later(units, again, part.cuts),
        cut_reason=why,
    )


def _problem(r: SplitRequest, units: list[torch.fx.Node], keys: Sequence[str], costs: _UnitCosts,
             cut_bytes: Sequence[float], forced: Sequence[int], p: int, v: int) -> PartitionProblem:
    """The partition problem of ``r`` over ``units`` (no checkpointing: ``plan_split`` derives
    one per checkpointing mode from it)."""
    penalty, allowed = cut_rules([node_info(u).module_path for u in units], keys, r.cut_at, r.inner_cut_penalty)
    allowed = outside_atomic([u.name for u in units], r.atomic, allowed)
    return PartitionProblem(
        compute=tuple(costs.compute),
        param_bytes=tuple(costs.params),
        activation_bytes=tuple(costs.acts),
        cut_bytes=tuple(cut_bytes),
        num_stages=r.num_stages,
        num_ranks=p,
        forced=tuple(forced),
        allowed=tuple(allowed) if allowed is not None else None,
        cut_penalty=tuple(penalty),
        bandwidth=r.hardware.link_bytes_per_s,
        memory_limit=r.memory_limit,
        state_bytes_per_param_byte=r.state_bytes_per_param_byte,
        inflight=schedule_spec(r.schedule).inflight(p, v, r.num_microbatches),
        stage_ranks=None if r.stage_ranks is None else tuple(r.stage_ranks),
    )


# ------------------------------------------------------------------------------------------------
# the steps of plan_split


@dataclass(frozen=True)
class _UnitCosts:
    """[Note: F, I, W estimates] Per unit: ``compute`` is forward + backward seconds, ``forward``
    the forward alone (the cost model's forward roofline, or the measured profile). The backward's
    split into input gradient I and weight gradient W is estimated: a unit that reads parameters
    (a linear, an embedding; a tied copy too) spends half of its backward on the weight gradient (dX = dY W^T and
    dW = X^T dY cost the same), a unit without parameters none; I is the rest. The loss is charged
    to the last unit's I. The first stage is the exception: its inputs (the model's) need no
    gradient, so both backward splits give it an empty I and run its whole backward (the input
    path too, which only its weight gradients need) as W (the graph split's I graph has no output;
    the autograd split differentiates stage 0's parameters from the roots), and its estimate says
    so: I = 0, W = the whole backward. These feed the per-stage costs of ``Plan.simulate`` and
    ``zb_auto``."""

    compute: list[float]  # seconds (forward + backward)
    params: list[float]  # parameter bytes (a get_attr's parameter counts on its first user)
    acts: list[float]  # activation bytes saved for backward
    flops: list[float]
    forward: list[float]  # forward seconds
    weight: list[float]  # estimated weight-gradient seconds


def _unit_costs(gm: torch.fx.GraphModule, units: list[torch.fx.Node], binds: Mapping, hardware: Hardware,
                loss_seconds: float, kept_fraction: Mapping[str, float]) -> _UnitCosts:
    """Per-unit time, parameter bytes, saved activations and FLOPs from the cost model (a
    measured profile, ``fxsplit.graph.profile.apply_profile``, replaces the roofline estimate)."""
    n = len(units)
    index = {u: i for i, u in enumerate(units)}
    out = _UnitCosts([0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n)
    reads_params = {u for node in gm.graph.nodes if node.op == "get_attr" for u in node.users}
    # a tied parameter's bytes count on its first user only, but every user computes its weight
    # gradient: a tied LM head has a W half like an untied one
    trainable = {name for name, p in gm.named_parameters(remove_duplicate=False) if p.requires_grad}
    reads_params |= {u for u in units if any(name in trainable for name in node_info(u).params)}
    for i, u in enumerate(units):
        cost = node_info(u).cost
        c = cost.evaluate(binds) if cost.is_symbolic else cost
        speeds = dict(flops_per_s=hardware.flops_per_s, bytes_per_s=hardware.bytes_per_s, bindings=binds, cost=c)
        out.compute[i] = node_time(u, **speeds)
        out.forward[i] = min(node_time(u, backward=False, **speeds), out.compute[i])
        if c.param_bytes or u in reads_params:
            out.weight[i] = (out.compute[i] - out.forward[i]) / 2
        out.params[i] += float(c.param_bytes)
        out.acts[i] = float(c.saved_bytes)
        out.flops[i] = float(c.flops)
    out.compute[-1] += loss_seconds  # the loss runs on the last stage, after the graph's last node
    # parameters read through get_attr belong to the first unit that uses them
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.users:
            cost = node_info(node).cost
            if cost is not None and cost.param_bytes:
                first = min((index[u] for u in node.users if u in index), default=None)
                if first is not None:
                    out.params[first] += concrete(cost.param_bytes, binds) * kept_fraction.get(str(node.target), 1.0)
    return out


def _forced_cuts(gm: torch.fx.GraphModule, units: list[torch.fx.Node], split_points: Sequence[str] | None,
                 num_stages: int) -> list[int]:
    """Positions of the user's split points and ``pipe_split()`` markers, checked to fit S stages."""
    index = {u: i for i, u in enumerate(units)}
    forced = list(_split_point_positions(units, list(split_points or ())))
    markers = [index[m] for m in find_pipe_splits(gm) if m in index]
    forced = sorted(set(forced) | {m for m in markers if m > 0})
    if len(forced) > num_stages - 1:
        raise SplitError(
            f"{len(forced)} split points (user split points and pipe_split markers) make "
            f"{len(forced) + 1} stages, but num_stages={num_stages}; pass num_stages={len(forced) + 1} or fewer split points"
        )
    return forced


def _baselines(problem: PartitionProblem, keys: Sequence[str]) -> dict[str, float]:
    """Balance of the splits users write by hand (equal layers; DeepSpeed's parameter count), on
    the same problem without forced cuts or a memory cap."""
    baselines = {}
    free = PartitionProblem(**{**problem.__dict__, "forced": (), "memory_limit": None})
    try:
        baselines["equal layers"] = _layer_equal_balance(free, keys)
        baselines["parameter count"] = parameter_count_cuts(free).balance
    except (PartitionError, ValueError):
        pass
    return baselines


def _summaries(part: Partition, problem: PartitionProblem, keys: Sequence[str], costs: _UnitCosts,
               cut_bytes: Sequence[float], per_stage: Sequence[str],
               modes: Mapping[str, Any], twice: bool = False, held: StageHeld | None = None
               ) -> tuple[StageSummary, ...]:
    out = []
    link = problem.bandwidth
    for s in range(part.num_stages):
        a, b = part.cuts[s], part.cuts[s + 1]
        um = modes.get(per_stage[s])
        fwd, wgt = sum(costs.forward[a:b]), sum(costs.weight[a:b])
        recompute = 0.0 if um is None else sum(um.recompute[a:b])
        acts = sum(costs.acts[a:b] if um is None else um.acts[a:b])
        plain = sum(costs.acts[a:b])
        wbytes = rbytes = 0.0
        if held is not None:
            last = s == part.num_stages - 1
            local = [(part.cuts[t], part.cuts[t + 1]) for t in range(part.num_stages)
                     if t != s and problem.rank_of(t) == problem.rank_of(s)]
            plain = held.stage(None, a, b, last, local)
            acts = plain if um is None else held.stage(um.held, a, b, last, local)
            # what W needs after I: of the saved activations; under checkpointing with the graph
            # split backward, of the region I recomputed once (kept until W: may exceed ``acts``);
            # the autograd split's W recomputes again, so it holds no more than ``acts``
            wbytes = held.weight(a, b, costs.weight)
            if um is None or twice:
                wbytes = min(wbytes, acts)
            rbytes = 0.0 if um is None else held.recomputed(um.region, a, b)
        out.append(StageSummary(
            index=s,
            rank=problem.rank_of(s),
            module_paths=tuple(dict.fromkeys(keys[a:b])),
            num_nodes=b - a,
            param_bytes=sum(costs.params[a:b]),
            flops=sum(costs.flops[a:b]),
            activation_bytes=acts,
            bytes_in=cut_bytes[a],
            bytes_out=cut_bytes[b],
            time=part.stage_time[s],
            forward_time=fwd,
            input_grad_time=0.0 if a == 0 else max(sum(costs.compute[a:b]) + recompute - fwd - wgt, 0.0),
            # the autograd split's W recomputes again; stage 0's W is its whole backward
            weight_grad_time=(max(sum(costs.compute[a:b]) + recompute - fwd, 0.0) if a == 0
                              else wgt + (recompute if twice else 0.0)),
            comm_time=cut_bytes[b] / link if 0 < link < float("inf") else 0.0,
            checkpointing=per_stage[s],
            activation_bytes_unchecked=None if um is None else plain,
            recompute_time=recompute,
            weight_bytes=wbytes,
            recompute_bytes=rbytes,
        ))
    return tuple(out)


def _layer_equal_balance(problem: PartitionProblem, keys: Sequence[str]) -> float:
    """Balance of the split users write by hand: an equal number of layers per stage, cut at layer
    boundaries (what ``pipeline()`` split points on ``layers.{k}`` give)."""
    n = len(keys)
    layers, seen = [], set()
    for k, key in enumerate(keys):
        if key not in seen and k > 0 and re.search(r"\.\d+$", key):
            layers.append(k)
        seen.add(key)
    S = problem.num_stages
    if len(layers) < S:
        return equal_layer_cuts(problem).balance
    per = len(layers) / S
    cuts = [0] + [layers[round(i * per)] for i in range(1, S)] + [n]
    if len(set(cuts)) != len(cuts):
        return equal_layer_cuts(problem).balance
    return evaluate(problem, cuts, method="equal layers").balance
