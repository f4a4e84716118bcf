"""The candidate space of the auto-planner: every (dp, dp_shard, ep, tp, pp, v, schedule, m, b,
checkpointing, sequence parallelism) a world size and a global batch allow, with the reason a
combination is left out before it is scored.

Terms as in :mod:`fxsplit.api.plan` (d, t, p, v, m) and :mod:`fxsplit.planner.workload`; B the
global batch (samples per optimizer step over all replicas), b = B / (d * m) the microbatch size.

    for cand in candidates(world_size=8, global_batch=32, hardware=hw, workload=w): ...
    rejected = list(structural_rejections(...))     # (description, reason) of pruned (t, p) pairs

[Note: candidate space]
Pruned before scoring, each for a stated reason: t must divide the world size and stay inside a
node (t <= devices_per_node: TP's per-layer all-reduces need the intra-node link) and divide the
degree the TP structure was found at; S = p * v stages need S layer groups to cut between; d must
divide B and m must divide B / d (no ragged microbatches), with m >= p under a pipeline. The
schedules are 1F1B, interleaved 1F1B (v = 2, and 4 and 8 where the layers allow), ZB-H1 and ZB-V;
GPipe (1F1B's time, more memory) and zb_auto (built from the split's costs after it) are not
searched. Checkpointing is "none", "selective" and "full"; a split backward (ZB-H1, ZB-V) cannot
run "selective" ([Note: checkpointing cost model]). Sequence parallelism is tried with t > 1 when
the TP plan can start a sequence-sharded stream. ``dp_shard`` (sharded data parallelism: params,
grads and optimizer state divided over the shard group) is searched only when ``ParallelConfig``
has the field (``shard_supported``); otherwise it is 1 throughout, and a plan never names it.
Expert parallelism ``ep`` (carved out of the data-parallel ranks) is searched over the divisors of
dp that divide the model's expert count (``Workload.num_experts``; none without a MoE layer), with
dp_shard = 1 and, where dp_shard is searched, dp_shard = dp (FSDP shards what the experts leave: the
memory model keeps the expert blocks whole, as FSDP's ignored parameters); DualPipeV (v = 2, m >= 2p) is searched with ep > 1, where its F&B pairs can hide the
all-to-alls ([Note: planner cost model]); without ep it is ZB-V's time at more memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from fxsplit.hardware import Hardware
from fxsplit.schedule import schedule_spec

__all__ = ["Candidate", "candidates", "divisors", "schedules_for"]


@dataclass(frozen=True, order=True)
class Candidate:
    """One point of the space; ``config_fields()`` are the ParallelConfig keywords it sets."""

    dp: int
    tp: int
    pp: int
    stages_per_rank: int
    schedule: str
    microbatches: int
    microbatch_size: int
    activation_checkpointing: str
    sequence_parallel: bool
    dp_shard: int = 1
    ep: int = 1  # expert-parallel ranks, carved out of dp

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def config_fields(self) -> dict:
        out = dict(dp=self.dp, tp=self.tp, pp=self.pp, stages_per_rank=self.stages_per_rank,
                   schedule=self.schedule, microbatches=self.microbatches,
                   activation_checkpointing=self.activation_checkpointing,
                   sequence_parallel=self.sequence_parallel)
        if self.dp_shard != 1:  # ``dp`` here is the whole data-parallel degree, ParallelConfig's the replicas
            out["dp"], out["dp_shard"] = self.dp // self.dp_shard, self.dp_shard
        if self.ep != 1:
            out["ep"] = self.ep
        return out

    def short(self) -> str:
        sp = "+sp" if self.sequence_parallel else ""
        shard = f" shard={self.dp_shard}" if self.dp_shard != 1 else ""
        shard += f" ep={self.ep}" if self.ep != 1 else ""
        return (f"dp={self.dp}{shard} tp={self.tp}{sp} pp={self.pp} v={self.stages_per_rank} {self.schedule} "
                f"m={self.microbatches} b={self.microbatch_size} ckpt={self.activation_checkpointing}")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def schedules_for(pp: int, num_groups: int, *, experts: bool = False) -> list[tuple[str, int]]:
    """(schedule, v) pairs searched for ``pp`` pipeline ranks over ``num_groups`` layer groups
    (``experts``: DualPipeV too, for the candidates with ep > 1)."""
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1), ("zb_h1", 1)]
    if 2 * pp <= num_groups:
        out += [("interleaved_1f1b", 2), ("zbv", 2)] + ([("dualpipev", 2)] if experts else [])
    if 4 * pp <= num_groups:
        out.append(("interleaved_1f1b", 4))
    if 8 * pp <= num_groups:  # deep models (Llama 3 405B: 126 layers on 16 ranks) gain from more chunks
        out.append(("interleaved_1f1b", 8))
    return out


def shard_supported(config_cls) -> bool:
    """Whether ParallelConfig has ``dp_shard`` (sharded data parallelism) to set."""
    return any(f.name == "dp_shard" for f in dataclasses.fields(config_cls))


def tp_degrees(world_size: int, hardware: Hardware, max_tp: int) -> tuple[list[int], list[tuple[int, str]]]:
    """(tp degrees searched, (tp, why not) for the powers of two left out)."""
    keep, why = [], []
    t = 1
    while t <= world_size:
        if world_size % t:
            why.append((t, f"tp={t} does not divide the world size {world_size}"))
        elif t > hardware.devices_per_node:
            why.append((t, f"tp={t} > {hardware.devices_per_node} devices per node (TP stays inside a node)"))
        elif t > 1 and (max_tp % t):
            why.append((t, f"tp={t}: the model's TP plan was found for tp={max_tp} (sizes indivisible by {t})"
                           if max_tp > 1 else f"tp={t}: the model has no tensor-parallel plan"))
        else:
            keep.append(t)
        t *= 2
    return keep, why


def candidates(*, world_size: int, global_batch: int, hardware: Hardware, num_groups: int, max_tp: int,
               sequence_parallel: bool, cuttable: int, shard: bool = False, num_experts: int = 0,
               rejected: list | None = None) -> Iterator[Candidate]:
    """Every candidate of [Note: candidate space]; the structural rejections are appended to
    ``rejected`` as (description, reason)."""
    rejected = rejected if rejected is not None else []
    tps, why = tp_degrees(world_size, hardware, max_tp)
    rejected += [(f"tp={t}", r) for t, r in why]
    for tp in tps:
        for pp in divisors(world_size // tp):
            dp = world_size // (tp * pp)
            if pp > 1 and pp > cuttable + 1:
                rejected.append((f"tp={tp} pp={pp}", f"pp={pp} stages > {cuttable + 1} layer groups to cut between"))
                continue
            if global_batch % dp:
                rejected.append((f"tp={tp} pp={pp} dp={dp}", f"global batch {global_batch} not divisible by dp={dp}"))
                continue
            per_replica = global_batch // dp
            ms = [m for m in divisors(per_replica) if m >= pp]
            if not ms:
                rejected.append((f"tp={tp} pp={pp} dp={dp}", f"batch per replica {per_replica} < pp={pp} "
                                 "microbatches (every pipeline rank needs one)"))
                continue
            eps = [e for e in divisors(dp) if e == 1 or (num_experts and num_experts % e == 0)]
            for schedule, v in schedules_for(pp, cuttable + 1, experts=len(eps) > 1):
                for m in ms:
                    for ckpt in ("none", "selective", "full"):
                        if ckpt == "selective" and schedule_spec(schedule).splits_backward:
                            continue  # split backward: two autograd passes, selective allows one
                        for sp in ((False, True) if tp > 1 and sequence_parallel else (False,)):
                            pairs = m >= 2 * pp if schedule_spec(schedule).pairs_f_and_b else None
                            for sh, ep in _data_layouts(dp, shard, eps, pairs):
                                yield Candidate(dp=dp, tp=tp, pp=pp, stages_per_rank=v, schedule=schedule,
                                                microbatches=m, microbatch_size=per_replica // m,
                                                activation_checkpointing=ckpt, sequence_parallel=sp, dp_shard=sh,
                                                ep=ep)


def _data_layouts(dp: int, shard: bool, eps: list[int], pairs: bool | None) -> list[tuple[int, int]]:
    """(dp_shard, ep) pairs of one data-parallel degree ([Note: candidate space]); ``pairs``:
    None for a schedule that pairs no F with a B, else whether m allows the pairing (m >= 2p;
    such a schedule, DualPipeV, is searched with ep > 1 only)."""
    sharded = [dp] if shard and dp > 1 else []
    plain = [(1, 1)] + [(sh, 1) for sh in sharded]
    experts = [(sh, e) for e in eps if e > 1 for sh in [1, *sharded]]
    if pairs is None:
        return plain + experts
    return experts if pairs else []
