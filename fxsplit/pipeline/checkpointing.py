"""Activation checkpointing in the partition: what each unit saves and recomputes per mode, and
the per-stage choice of ``activation_checkpointing="auto"``.

Terms: unit, position, stage, rank, v as in :mod:`fxsplit.pipeline.partition`; region, mode and
kept node as in :mod:`fxsplit.graph.recompute` (the same regions the checkpointing pass outlines).

    modes = unit_modes(gm, units, binds, hardware, base_held)   # mode -> UnitMode(acts, recompute, held)
    part, per_stage = choose(problems, "auto")                  # problems: mode -> PartitionProblem

[Note: checkpointing cost model]
Per microbatch, per unit, for a region R (its units in the graph):
- "none": the unit's ``saved_bytes`` (the cost model's estimate of what autograd keeps), each
  storage counted once ([Note: saved tensors by storage] in fxsplit.graph.saved).
- "full": R's input bytes (values from outside R that R reads; parameters excluded: they are
  not activations), charged to R's first unit; nothing else of R. Backward recomputes R's whole
  forward: each unit's forward time is added to its compute (``recompute``).
- "selective": R's input bytes plus the output bytes of R's kept nodes; the forward time of
  R's other units is added as recompute.
Units outside every region (the model's top-level ops) are "none" in every mode. A stage cut
inside a region makes two regions at run time; the model charges the region's inputs once, at its
first unit. A backward holds one region's recomputed activations at a time on top of what is saved
(transient: ``StageSummary.recompute_bytes``, the stage's largest region part at mode "none",
added to a rank's peak by [Note: memory model]). The recompute is part of the stage's I estimate
(``StageSummary.input_grad_time``), so the simulator's B = I + W and I both pay it. A split
backward on graphs (``split_backward="graph"``, fxsplit.runtime.compile.split_graph) recomputes a region
once (what W needs of it is carried from I, or recomputed by W alone), so it is charged once, in I;
on autograd (two autograd calls) it recomputes twice, so W is charged the recompute again
(``StageSummary.weight_grad_time``). Stage 0 is the exception on both: it has no I (its inputs
need no gradient), so its one recompute is in its W. The balancer's stage time charges it once
either way.
- Stage time and memory per mode are those of the partition cost model over the mode's units;
  the whole chain of a uniform mode is one `PartitionProblem` (``problems[mode]``).

"auto": the cheapest in time that fits ``memory_limit``, per stage. The cuts of each uniform
mode's optimal partition (none, selective, full: each exact, see ``partition.solve``) are
candidates; on each candidate's cuts every rank picks the modes of its v stages by enumeration
(3^v; ranks are independent once the cuts are fixed): the smallest largest stage time, then the
least total time, within the limit. The best candidate wins (smallest bottleneck, then least
recompute). Without a limit that is "none" everywhere. Exact per cut tuple, not over all cut
tuples with mixed modes (``Partition.exact`` is False for a mixed result).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch.fx

from fxsplit.errors import PartitionError
from fxsplit.hardware import Hardware
from fxsplit.graph.meta import node_info
from fxsplit.graph.profile import node_time
from fxsplit.graph.saved import base, first_saver_bytes
from fxsplit.graph.recompute import MODES, keeps_output, regions, worth_checkpointing
from fxsplit.pipeline.partition.chain import Chain, Partition, PartitionProblem
from fxsplit.pipeline.partition import solve

__all__ = ["UnitMode", "unit_modes", "mode_held", "choose", "REQUESTS"]

REQUESTS = (*MODES, "auto")
_MAX_ENUMERATED_V = 6  # 3^6 = 729 assignments per rank; above that a rank's stages share one mode


@dataclass(frozen=True)
class UnitMode:
    acts: tuple[float, ...]  # activation bytes saved per microbatch, per unit (each storage at its first saver)
    recompute: tuple[float, ...]  # seconds of forward recomputed in backward, per unit
    held: tuple = ()  # per unit: ({base node: bytes}, own bytes), fxsplit.graph.saved ([Note: saved tensors by storage])
    region: tuple[int, ...] = ()  # per unit: the region a backward recomputes it in (-1: not recomputed)


def _out_bytes(node: torch.fx.Node, binds: Mapping) -> float:
    info = node.meta.get("fxsplit")
    return 0.0 if info is None else info.output_bytes(binds)


def mode_held(gm: torch.fx.GraphModule, units: Sequence[torch.fx.Node], binds: Mapping, base_held: Sequence,
              mode: str) -> tuple[list, list[bool]]:
    """Per unit under ``mode``: what it saves (``({base node: bytes}, own bytes)``, as
    ``fxsplit.graph.saved.unit_saved``; ``base_held`` is mode "none") and whether backward
    recomputes it ([Note: checkpointing cost model]). The planner's workload uses it too."""
    held, rec, _ = _mode_regions(gm, units, binds, base_held, mode)
    return held, rec


def _mode_regions(gm: torch.fx.GraphModule, units: Sequence[torch.fx.Node], binds: Mapping, base_held: Sequence,
                  mode: str) -> tuple[list, list[bool], list[int]]:
    """``mode_held`` and, per unit, the index of the region a backward recomputes it in (-1: none)."""
    index = {u: i for i, u in enumerate(units)}
    held, rec, region = list(base_held), [False] * len(units), [-1] * len(units)
    if mode == "none":
        return held, rec, region
    for k, (_, nodes) in enumerate(regions(gm.graph)):
        if not worth_checkpointing(nodes) or any(x not in index for x in nodes):
            continue
        inside = set(nodes)
        inputs = {a for x in nodes for a in x.all_input_nodes if a not in inside and a.op != "get_attr"}
        for x in nodes:
            i = index[x]
            kept = mode == "selective" and keeps_output(x, gm)
            held[i] = ({x: _out_bytes(x, binds)}, 0.0) if kept else ({}, 0.0)
            rec[i] = not kept
            region[i] = -1 if kept else k
        first = index[nodes[0]]
        keys = dict(held[first][0])
        for a in inputs:
            b = base(a, gm)
            if b is not None:
                keys[b] = max(keys.get(b, 0.0), _out_bytes(a, binds))
        held[first] = (keys, held[first][1])
    return held, rec, region


def unit_modes(gm: torch.fx.GraphModule, units: Sequence[torch.fx.Node], binds: Mapping, hardware: Hardware,
               base_held: Sequence) -> dict[str, UnitMode]:
    """Per mode, each unit's saved storages, saved bytes and recompute seconds ([Note: checkpointing
    cost model]); ``base_held`` is ``fxsplit.graph.saved.unit_saved`` of the units (mode "none")."""
    fwd = [node_time(u, flops_per_s=hardware.flops_per_s, bytes_per_s=hardware.bytes_per_s, backward=False,
                     bindings=binds) for u in units]
    out = {}
    for mode in MODES:
        held, rec, region = _mode_regions(gm, units, binds, base_held, mode)
        out[mode] = UnitMode(tuple(first_saver_bytes(held)), tuple(f if r else 0.0 for f, r in zip(fwd, rec)),
                             tuple(held), tuple(region))
    return out


def _evaluate(chains: Mapping[str, Chain], cuts: Sequence[int], modes: Sequence[str], exact: bool) -> Partition:
    any_ch = next(iter(chains.values()))
    p, L = any_ch.p, any_ch.pb.memory_limit
    times = tuple(chains[m].time(a, b) for m, a, b in zip(modes, cuts, cuts[1:]))
    mems = tuple(chains[m].mem(s, a, b) for s, (m, a, b) in enumerate(zip(modes, cuts, cuts[1:])))
    rank = [0.0] * p
    for s, x in enumerate(mems):
        rank[any_ch.rank[s]] += x
    bott, mean = max(times), sum(times) / len(times)
    return Partition(tuple(cuts), times, mems, tuple(rank), bott, mean, bott / mean if mean > 0 else 1.0,
                     L is None or max(rank) <= L, exact, "solve+checkpointing")


def _assign(chains: Mapping[str, Chain], cuts: Sequence[int]) -> tuple[str, ...] | None:
    """Per rank, the modes of its stages with the smallest (largest time, total time) within the
    limit; None when some rank fits in no assignment."""
    ch = next(iter(chains.values()))
    p, S, L = ch.p, ch.S, ch.pb.memory_limit
    modes = ["none"] * S
    for r in range(p):
        stages = [s for s in range(S) if ch.rank[s] == r]
        allowed = [m for m in MODES if m in chains]
        options = (itertools.product(allowed, repeat=len(stages)) if len(stages) <= _MAX_ENUMERATED_V
                   else ((m,) * len(stages) for m in allowed))
        best, best_key = None, None
        for pick in options:
            t = [chains[m].time(cuts[s], cuts[s + 1]) for m, s in zip(pick, stages)]
            mem = sum(chains[m].mem(s, cuts[s], cuts[s + 1]) for m, s in zip(pick, stages))
            if L is not None and mem > L:
                continue
            key = (max(t), sum(t))
            if best_key is None or key < best_key:
                best, best_key = pick, key
        if best is None:
            return None
        for s, m in zip(stages, best):
            modes[s] = m
    return tuple(modes)


def choose(problems: Mapping[str, PartitionProblem], request: str) -> tuple[Partition, tuple[str, ...]]:
    """The partition and each stage's mode for ``request`` ("none", "selective", "full" or
    "auto"; [Note: checkpointing cost model]); "auto" chooses among the modes ``problems`` holds.
    Raises `PartitionError` when nothing fits (for "auto": the error of "full", the least memory)."""
    if request not in REQUESTS:
        raise PartitionError(f"activation_checkpointing must be one of {REQUESTS}, got {request!r}")
    if request != "auto":
        part = solve(problems[request])
        return part, (request,) * part.num_stages
    chains = {m: Chain(pb) for m, pb in problems.items()}
    found: dict[tuple[int, ...], Partition] = {}
    error: PartitionError | None = None
    for m in problems:
        try:
            part = solve(problems[m])
        except PartitionError as exc:
            error = exc
            continue
        found.setdefault(part.cuts, part)
    if not found:
        assert error is not None
        raise error
    best: tuple[tuple, Partition, tuple[str, ...]] | None = None
    for cuts, uniform in found.items():
        modes = _assign(chains, cuts)
        if modes is None:  # pragma: no cover - the uniform mode of these cuts fits
            continue
        exact = uniform.exact and chains["none"].pb.memory_limit is None  # then: "none" everywhere
        part = _evaluate(chains, cuts, modes, exact)
        recompute = sum(chains[m].time(a, b) - chains["none"].time(a, b) for m, a, b in zip(modes, cuts, cuts[1:]))
        key = (part.bottleneck, recompute, cuts[::-1])
        if best is None or key < best[0]:
            best = (key, part, modes)
    assert best is not None
    return best[1], best[2]
