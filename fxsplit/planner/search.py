"""The search: score every candidate of the space, simulate the best, pick the fastest that fits.

Terms as in :mod:`fxsplit.planner.space` and :mod:`fxsplit.planner.score`.

    w = analyze(gm, world_size=64, hardware=hw)           # the workload, traced once (gm given)
    result = search(w, world_size=64, global_batch=512, hardware=hw)
    print(result)                                          # the candidate table, best first
    result.best.candidate.config_fields()                  # the ParallelConfig keywords
    result.split_points(w)                                 # where the chosen stages start

[Note: search strategy]
Every candidate of the space is scored with the closed-form makespan (cheap: per-unit arrays are
cached per (t, SP, b, checkpointing) and cuts per (t, SP, checkpointing, S, placement)); those
that do not fit the memory limit are rejected with their numbers (after a re-partition under the
limit where the balanced cuts were over it: [Note: partition under the memory limit]). The
partition is most of a score's cost, so candidates are scored in the order of a lower bound that
needs none (``Scorer.lower_bound``: the work spread evenly over the pipeline ranks, no bubble, no
messages), in two passes: first every candidate by its time-balanced cuts alone (the solves
shared by candidates of one shape), then those over the memory limit by those cuts again with
the re-partition under the limit, while they could still matter: once ``top_k`` fitting ones are
known, one whose bound is over the ``top_k``-th fastest is not re-partitioned
(``SearchResult.pruned``; it stays rejected with its balanced cuts' memory): it could not have
been among the ``top_k``, so the pick and the simulated rows are those of scoring everything. The ``top_k`` fastest fitting
ones are then re-scored with the schedule simulator (within ``SIMULATION_BUDGET`` actions in all:
a very long pipeline keeps its closed form, and the table says which), and the fastest is the pick
(ties: fewer ranks per pipeline, then fewer tensor ranks, then fewer expert ranks, then less recompute: the simpler
layout). Candidates are only ever rejected for memory or structure, never for time, so the pick
is the fastest fitting candidate the simulator saw, and a plan that does not fit is never
returned: when nothing fits, PlanError names the tightest candidate and what it needs.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import torch.fx

from fxsplit.errors import PlanError
from fxsplit.graph.units import fmt_bytes, fmt_ms
from fxsplit.hardware import Hardware
from fxsplit.planner.fsdp import FXSPLIT_STAGES, FsdpPolicy
from fxsplit.planner.score import SIMULATION_BUDGET, Calibration, Score, Scorer
from fxsplit.planner.space import candidates
from fxsplit.planner.workload import Workload
from fxsplit.tp.plan import find_tp_plan
from fxsplit.tp.propagate import TPPlanError

__all__ = ["SearchResult", "analyze", "search"]

_CKPT_ORDER = {"none": 0, "selective": 1, "full": 2}
TOP_K = 8  # fitting candidates re-scored with the simulator
TABLE_ROWS = 12  # fitting candidates print(result) shows ...
REJECTED_ROWS = 8  # ... and rejected ones: with the header and summaries at most 30 lines


def analyze(gm: torch.fx.GraphModule, *, world_size: int, hardware: Hardware, tp: int | None = None) -> Workload:
    """The workload of a traced graph: its TP structure at the largest degree <= the node size
    that divides the world size and the model's sizes (tried downwards; ``tp``: that degree,
    for scoring one given layout), with sequence parallelism when the plan can start a
    sequence-sharded stream."""
    tp_plan, sp_plan = None, None
    t = 1
    while 2 * t <= min(hardware.devices_per_node, world_size) and world_size % (2 * t) == 0:
        t *= 2
    t = t if tp is None else tp
    while t > 1 and tp_plan is None:
        try:
            found = find_tp_plan(gm, t)
            tp_plan = found if found.regions else None
        except TPPlanError:
            pass
        if tp_plan is None:
            t //= 2
    if tp_plan is not None:
        try:
            sp_plan = find_tp_plan(gm, tp_plan.tp, sequence_parallel=True)
            if not sp_plan.sequence_plan.sharded:
                sp_plan = None
        except (TPPlanError, PlanError, ValueError):
            sp_plan = None
    return Workload.build(gm, tp_plan=tp_plan, sp_plan=sp_plan)


@dataclass(frozen=True)
class SearchResult:
    """The searched candidates: ``scores`` fitting ones best first, ``rejected`` the rest with why."""

    best: Score
    scores: tuple[Score, ...]
    rejected: tuple[tuple[str, str], ...]  # (candidate or group of candidates, reason)
    world_size: int
    global_batch: int
    hardware: str
    memory_limit: float
    seconds: float
    num_candidates: int
    group_paths: tuple[str, ...] = field(default=(), repr=False)
    repartitioned: tuple[int, int] = (0, 0)  # layouts re-partitioned under the limit, and skipped (budget)
    picked_from: tuple[str, int] | None = None  # set by with_pick: the built pick and its rank in the search
    pruned: int = 0  # not re-partitioned: their lower bound is over the top_k-th fastest ([Note: search strategy])

    def with_pick(self, k: int, memory: Any, how: str, passed: Mapping[int, str] | None = None) -> "SearchResult":
        """This result with ``scores[k]`` as the pick (first), its memory the built plan's
        (``Plan.memory()``'s busiest rank: [Note: the pick's memory is its plan's] in
        fxsplit.api.auto); the candidates it passed over for memory move to ``rejected``, with
        ``passed[i]`` as candidate i's reason when it was not built."""
        s = self.scores[k]
        c = s.candidate
        pick = replace(s, memory=memory, method=f"{s.method}; {how}: memory is its plan's")
        passed = passed or {}
        skipped = tuple((o.candidate.short(), passed.get(i, f"memory: its built plan is over the limit "
                                                           f"{fmt_bytes(self.memory_limit)}"))
                        for i, o in enumerate(self.scores[:k]))
        if s.cuts and how.endswith("re-split"):
            pick = replace(pick, cuts=())
        return replace(self, best=pick, scores=(pick,) + self.scores[k + 1:], rejected=skipped + self.rejected,
                       picked_from=(c.short(), k))

    def split_points(self) -> tuple[str, ...]:
        """Module paths where the chosen plan's stages 2..S start (``ParallelConfig.split_points``)."""
        return tuple(self.group_paths[k] for k in self.best.cuts[1:-1])

    def table(self, limit: int | None = TABLE_ROWS, rejected_limit: int | None = REJECTED_ROWS) -> str:
        """The candidate table, best first, and the rejected ones closest to fitting first: at most
        ``limit`` and ``rejected_limit`` rows of each (None: all), so ``print(result)`` stays within
        30 lines by default; ``table(None, None)`` is everything."""
        head = ("#", "dp", "tp", "sp", "pp", "v", "schedule", "m", "b", "ckpt", "step", "memory/rank", "how / why not")
        rows = [head]
        for i, s in enumerate(self.scores[:limit]):
            rows.append(_row(str(i + 1), s, s.method))
        lines = []
        lines.append(f"auto plan for {self.world_size} ranks, global batch {self.global_batch}, {self.hardware}, "
                     f"memory limit {fmt_bytes(self.memory_limit)}/rank: {self.num_candidates} candidates scored "
                     f"({len(self.scores)} fit) in {self.seconds:.2f}s; best first; memory/rank is the search's "
                     f"estimate{', the pick' + chr(39) + 's its built plan' + chr(39) + 's (Plan.memory())' if self.picked_from else ''}")
        if self.pruned:
            lines[-1] += f"; {self.pruned} over the limit not re-partitioned (slower than the {TOP_K}th by a bound)"
        if any(self.repartitioned):
            done, skipped = self.repartitioned
            lines[-1] += (f"; {done} layouts re-partitioned under the memory limit"
                          + (f", {skipped} more judged by their balanced split (MAX_CAPPED_SOLVES)" if skipped else ""))
        widths = [max(len(r[k]) for r in rows) for k in range(len(head))]
        for r in rows:
            lines.append("  ".join(c.rjust(wd) for c, wd in zip(r[:-1], widths)) + "  " + r[-1])
        if len(self.scores) > (limit or len(self.scores)):
            lines.append(f"... {len(self.scores) - limit} more fitting candidates (.table(limit=None, rejected_limit=None) "
                         "lists every candidate)")
        rej = list(self.rejected)
        if rej:
            lines.append(f"rejected ({len(rej)}), closest to fitting first:")
        for desc, why in rej[:rejected_limit]:
            lines.append(f"  x {' '.join(x for x in desc.split(chr(9)) if x)}: {why}")
        if len(rej) > (rejected_limit or len(rej)):
            counts = Counter(_reason_kind(w) for _, w in rej)
            lines.append(f"  ... {len(rej) - rejected_limit} more: "
                         + ", ".join(f"{n} {k}" for k, n in counts.most_common()))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _reason_kind(why: str) -> str:
    return why.split(" ")[0] if why.startswith("memory") else why.split(":")[0][:40]


def _row(tag: str, s: Score, how: str) -> tuple[str, ...]:
    c = s.candidate
    ckpt = c.activation_checkpointing
    return (tag, str(c.dp) + (f"/{c.dp_shard}" if c.dp_shard != 1 else "") + (f" ep{c.ep}" if c.ep != 1 else ""), str(c.tp),
            "y" if c.sequence_parallel else "", str(c.pp), str(c.stages_per_rank), c.schedule, str(c.microbatches),
            str(c.microbatch_size), ckpt, fmt_ms(s.step_time), fmt_bytes(s.memory.total), how)


def search(workload: Workload, *, world_size: int, global_batch: int, hardware: Hardware,
           memory_limit: float | None = None, top_k: int = TOP_K, shard: bool = False,
           calibration: Calibration | None = None, optimizer: str = "adam",
           fsdp: FsdpPolicy = FXSPLIT_STAGES) -> SearchResult:
    """Search the space for ``workload`` ([Note: search strategy]); raises PlanError when no
    candidate fits ``memory_limit`` (default ``hardware.memory_bytes``), naming the tightest.
    ``optimizer``: what each step's update costs and holds (``fxsplit.planner.score.OPTIMIZERS``);
    ``fsdp``: what the runtime does with dp_shard (fxsplit's own by default; a published run's
    software otherwise: [Note: FSDP policies] in fxsplit.planner.fsdp)."""
    t0 = time.perf_counter()
    _check_request(world_size, global_batch)
    limit = hardware.memory_bytes if memory_limit is None else float(memory_limit)
    scorer = Scorer(workload, hardware, limit, calibration, optimizer, fsdp)
    structural: list[tuple[str, str]] = []
    space = list(candidates(world_size=world_size, global_batch=global_batch, hardware=hardware,
                            num_groups=workload.num_groups, max_tp=workload.max_tp,
                            sequence_parallel=workload.sequence_parallel, cuttable=sum(scorer.allowed[1:-1]),
                            shard=shard, num_experts=workload.num_experts, rejected=structural))
    fitting, over, pruned = _score_space(scorer, space, top_k, structural)
    if not fitting:
        raise _nothing_fits(world_size, global_batch, limit, over, structural)
    scores = _simulate_fastest(scorer, fitting, top_k)
    over.sort(key=lambda s: s.memory.total)
    rejected = tuple((_desc(s), s.reason) for s in over) + tuple(structural)
    return SearchResult(best=scores[0], scores=scores, rejected=rejected, world_size=world_size,
                        global_batch=global_batch, hardware=hardware.name, memory_limit=limit,
                        seconds=time.perf_counter() - t0, num_candidates=len(space), group_paths=workload.group_paths,
                        repartitioned=(scorer.capped_solves, scorer.capped_skipped), pruned=pruned)


def _check_request(world_size: Any, global_batch: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PlanError(f"strategy='auto' needs world_size: an int >= 1, got {world_size!r}")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise PlanError(f"strategy='auto' needs global_batch_size: an int >= 1 (samples per optimizer step), "
                        f"got {global_batch!r}")


def _score_space(scorer: Scorer, space: list, top_k: int,
                 structural: list[tuple[str, str]]) -> tuple[list[Score], list[Score], int]:
    """``(fitting, over the memory limit, pruned)``: every candidate scored by its balanced cuts,
    then those over the limit re-partitioned under it while they could still reach the top_k
    ([Note: search strategy]); structural rejections are appended to ``structural``."""
    fitting: list[Score] = []
    over: list[Score] = []
    bounded = []  # (lower bound, candidate) of those the training state alone does not rule out
    for c in space:
        s = scorer.state_rejection(c)
        if s is None:
            bounded.append((scorer.lower_bound(c), c))
        else:
            over.append(s)
    bounded.sort(key=lambda x: x[0])
    kth: list[float] = []  # the top_k fastest fitting step times so far, sorted
    deferred = []  # over the limit by their balanced cuts: scored again with a re-partition

    def keep(s: Score, memory: list) -> None:
        if s.fits:
            fitting.append(s)
            bisect.insort(kth, s.step_time)
        elif s.reason.startswith("memory"):
            memory.append(s)
        else:
            structural.append((s.candidate.short(), s.reason))

    for bound, c in bounded:  # first pass: balanced cuts only (cheap, solves shared by shape)
        s = scorer.score(c, capped=False)
        if not s.fits and s.reason.startswith("memory"):
            deferred.append((bound, c))
        else:
            keep(s, over)
    for i, (bound, c) in enumerate(deferred):  # second pass: the re-partitions, while they could matter
        if len(kth) >= top_k and bound > kth[top_k - 1]:
            over += [scorer.score(c, capped=False) for _, c in deferred[i:]]
            return fitting, over, len(deferred) - i  # sorted: every one left is slower than the top_k by its bound
        keep(scorer.score(c), over)
    return fitting, over, 0


def _nothing_fits(world_size: int, global_batch: int, limit: float, over: list[Score],
                  structural: list[tuple[str, str]]) -> PlanError:
    if not over:
        return PlanError(f"strategy='auto': no candidate layout for world size {world_size} and global batch "
                         f"{global_batch}: " + "; ".join(f"{d}: {r}" for d, r in structural[:6]))
    tight = min(over, key=lambda s: s.memory.total)
    m = tight.memory
    return PlanError(
        f"strategy='auto': no layout of {world_size} ranks fits {fmt_bytes(limit)} per rank; the tightest, "
        f"{tight.candidate.short()}, needs {fmt_bytes(m.total)} (params {fmt_bytes(m.params)}, grads {fmt_bytes(m.grads)}, "
        f"optimizer {fmt_bytes(m.optimizer)}, activations {fmt_bytes(m.activations)}, recompute {fmt_bytes(m.recompute)}); "
        "use more ranks, a smaller global batch, or a larger memory_limit")


def _simulate_fastest(scorer: Scorer, fitting: list[Score], top_k: int) -> tuple[Score, ...]:
    """The fitting scores, the top_k fastest simulated (within SIMULATION_BUDGET) and ranked first."""
    fitting.sort(key=lambda s: s.step_time)
    simulated, budget = [], SIMULATION_BUDGET
    for s in fitting[:top_k]:
        cost = Scorer.simulated_actions(s.candidate)
        if cost <= budget:
            budget -= cost
            s = scorer.score(s.candidate, simulate=True)
        simulated.append(s)
    simulated.sort(key=lambda s: (round(s.step_time, 12), s.candidate.pp, s.candidate.tp, s.candidate.ep,
                                  _CKPT_ORDER[s.candidate.activation_checkpointing]))
    return tuple(simulated) + tuple(fitting[top_k:])


def _desc(s: Score) -> str:
    return s.candidate.short()
