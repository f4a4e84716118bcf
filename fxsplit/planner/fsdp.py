"""How sharded data parallelism (FSDP) spends a step: which parameters it holds gathered and
which of its collectives run under compute, by the runtime that ran it: :class:`FsdpPolicy`.

Terms as in :mod:`fxsplit.planner.score`; s = dp_shard, a *unit* the parameters FSDP gathers and
reduces together, *exposed* the seconds a collective adds to the step, *hidden* those it runs
under compute on another stream.

    policy = FSDP2_PER_LAYER                       # torchtitan's FSDP2 (fxsplit's own: FXSPLIT_STAGES)
    scorer = Scorer(workload, hardware, limit, fsdp=policy)
    exposed, hidden = overlap([Job(compute=..., before=..., after=...), ...])

[Note: FSDP policies]
fxsplit's runtime (``FXSPLIT_STAGES``) makes each stage one FSDP unit, gathers every stage before
the pipeline and reduce-scatters after it ([Note: FSDP collectives outside the pipeline] in
fxsplit.runtime.fsdp): its collectives are all exposed and a stage is held whole for the step.
Published runs were made with FSDP2 wrapped per transformer layer (``FSDP2_PER_LAYER``):
torchtitan's ``apply_fsdp`` (torchtitan/parallelisms/parallelize_llama.py, the version of its
2024-12 benchmarks) calls ``fully_shard`` on every block with ``reshard_after_forward = layer_id
< n_layers - 1`` without a pipeline (``False`` with one: "to avoid per-microbatch all-gathers"),
and once on the root module (embeddings, final norm, output) with ``reshard_after_forward = not
pp_enabled``; its mixed-precision policy reduces in float32 (``mixed_precision_reduce`` default
``"float32"``: the reduce-scatter moves 4 bytes per element where the gathers move the bf16
parameters). Llama 3 states the same of its FSDP (Dubey et al. 2024, arXiv:2407.21783, Sec.
3.3.2: DP is the outermost dimension "because it can tolerate longer network latency by
asynchronously prefetching sharded model weights and reducing gradients"; gradients
reduce-scattered in FP32, Sec. 3.3.2 "Numerical stability"). FSDP2 issues a unit's all-gather
one unit ahead of its compute (forward: implicit prefetch as the CPU runs ahead; backward:
explicit prefetch of the next unit in reverse order) and a unit's reduce-scatter right after its
backward, on streams beside the compute: the next unit's gather runs under this one's compute.

The policy's time ([Note: FSDP overlap]) and memory: without a pipeline a per-layer policy holds
the root unit and two layer units gathered at once (the one computing, the one prefetched), and
the unsharded gradients of two layers (the one being computed, the one being reduced), freed by
the reduce-scatter; with a pipeline it holds its stages whole, as fxsplit does (no resharding
after forward), and only the time differs.

[Note: FSDP overlap]
Per microbatch the rank's units form a sequence of jobs in execution order, each with its compute
seconds, the gather it needs before (0 when already gathered) and the reduction it issues after.
Compute runs jobs in order; one communication stream runs the collectives in the order they are
issued: a job's gather when the job before it starts (one unit ahead), its reduction when it
ends. The step's FSDP time is the makespan of both streams less the compute: the first gather,
the last reduction and whatever communication outlasts the compute it runs under. Without a
pipeline the sequence is the forward over the units (the root's gather first), then the backward
in reverse (the root gathered again, each layer but the last gathered again, each reduced after
its backward, the root reduced at the end), once per microbatch. With a pipeline it is the
rank's first forward of each stage (gathering each unit) and its last backward (reducing each),
and the all-reduce over the replicas of HSDP (dp > s) joins each unit's reduction. Gathers and
reductions share the link (one NCCL communicator per mesh axis), so they are serialized, and
the compute is not slowed by the communication running beside it (no SM contention modelled).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["FSDP2_PER_LAYER", "FXSPLIT_STAGES", "FsdpPolicy", "Job", "held_bytes", "overlap", "step_jobs", "unit_of"]


@dataclass(frozen=True)
class FsdpPolicy:
    """What the runtime does with FSDP ([Note: FSDP policies])."""

    name: str
    per_layer: bool  # units per transformer layer (else one per stage)
    overlapped: bool  # collectives prefetched / issued under compute (else all exposed)
    reduce_itemsize: float | None = None  # bytes per element of the reduce-scatter (None: the parameters')


FXSPLIT_STAGES = FsdpPolicy("fxsplit: one unit per stage, collectives outside the pipeline", False, False)
FSDP2_PER_LAYER = FsdpPolicy("FSDP2 per layer, prefetched, reduced in fp32 (torchtitan, Llama 3)", True, True, 4.0)


@dataclass(frozen=True)
class Job:
    """One unit's compute in a step, with the collective it needs before and the one it issues after."""

    compute: float
    before: float = 0.0
    after: float = 0.0


def overlap(jobs: Sequence[Job]) -> tuple[float, float]:
    """(exposed, hidden) communication seconds of ``jobs`` run in order ([Note: FSDP overlap])."""
    comm_free = compute_free = 0.0
    ready = jobs[0].before if jobs else 0.0  # the first gather: nothing to run under
    comm_free = ready
    total_comm = sum(j.before + j.after for j in jobs)
    for k, job in enumerate(jobs):
        start = max(compute_free, ready)
        if k + 1 < len(jobs):  # the next unit's gather, issued as this one starts
            comm_free = max(comm_free, start) + jobs[k + 1].before
            ready = comm_free
        compute_free = start + job.compute
        if job.after:
            comm_free = max(comm_free, compute_free) + job.after
    end = max(compute_free, comm_free)
    exposed = max(end - sum(j.compute for j in jobs), 0.0)
    return exposed, max(total_comm - exposed, 0.0)


def unit_of(path: str) -> str:
    """The FSDP unit of a layer group of this module path under a per-layer policy: the numbered
    container entry it is in (``model.layers.7`` for ``model.layers.7`` and ``model.layers.7.mlp``),
    what torchtitan wraps; "" (the root unit) for the rest: the embeddings, the final norm, the
    output."""
    parts = path.split(".")
    for k, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:k + 1])
    return ""


def held_bytes(units: Sequence[str], params: Sequence[float]) -> float:
    """Parameter bytes a per-layer policy holds gathered at once without a pipeline ([Note: FSDP
    policies]): the root unit and the two largest layer units (the one computing, the one
    prefetched); per group its unit (``unit_of`` its path) and parameter bytes."""
    total: dict[str, float] = {}
    for key, b in zip(units, params):
        total[key] = total.get(key, 0.0) + float(b)
    root = total.pop("", 0.0)
    return root + sum(sorted(total.values(), reverse=True)[:2])


def step_jobs(units: Sequence[str], forward: Sequence[float], backward: Sequence[float],
              gather: Sequence[float], reduce: Sequence[float], stages: Sequence[tuple[int, int]],
              pipeline: bool) -> list[Job]:
    """One microbatch's jobs without a pipeline, or a pipeline rank's first forwards and last
    backwards, in execution order ([Note: FSDP overlap]). Per group: its unit (``unit_of`` its
    path), forward and backward seconds, and the seconds to gather and to reduce its parameters;
    ``stages``: the group ranges [a, b) of the rank's stages in order."""
    layers = [k for k in units if k]
    last_layer = layers[-1] if layers else None
    forwards: list[Job] = []
    backwards: list[Job] = []
    for a, b in stages:
        g_sum: dict[str, float] = {}
        r_sum: dict[str, float] = {}
        for g in range(a, b):
            g_sum[units[g]] = g_sum.get(units[g], 0.0) + gather[g]
            r_sum[units[g]] = r_sum.get(units[g], 0.0) + reduce[g]
        root_g, root_r = g_sum.get("", 0.0), r_sum.get("", 0.0)
        # forward: each unit gathered before its first group, the root's before the stage's first
        jobs = [Job(forward[g], (g_sum[units[g]] if units[g] and (g == a or units[g - 1] != units[g]) else 0.0)
                    + (root_g if g == a else 0.0)) for g in range(a, b)]
        forwards += jobs
        # backward, in reverse: gathered again unless kept (the last layer; every unit under a
        # pipeline), each unit reduced after its first group, the root after the stage's first group
        back = []
        for g in reversed(range(a, b)):
            key = units[g]
            starts = bool(key) and (g == b - 1 or units[g + 1] != key)
            need = g_sum[key] if starts and not pipeline and key != last_layer else 0.0
            ends = bool(key) and (g == a or units[g - 1] != key)
            back.append(Job(backward[g], need + (root_g if g == b - 1 and not pipeline else 0.0),
                            (r_sum[key] if ends else 0.0) + (root_r if g == a else 0.0)))
        backwards = back + backwards  # the rank's later stages run their backward first
    return forwards + backwards
