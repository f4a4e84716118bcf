"""Every expert's load in a step of a ParallelModel: the rows each expert received, gathered from
the ranks' exchange statistics ([Note: exchange statistics] in ``fxsplit.tp.experts``).

    with exchange_stats() as st:
        pm.step(x, target=y)
    rows = expert_rows(pm, st)        # collective: every rank calls it; [rows of expert 0, 1, ...]
    expert_load(rows)                 # {"min": ..., "mean": ..., "max": ...}

A rank's ``st.rows`` holds its k = E / ep experts' rows, summed over the MoE layers of its stages
and the step's microbatches. Rank e of an ep group holds experts ``[e * k, (e + 1) * k)``, so one
group's rows joined in ep-rank order are every expert's for that group's data; the ep groups
(expert replicas, each on its own data) and the pipeline ranks (each its own MoE layers) add up.
The tp ranks of an ep rank route alike, so tp rank 0 speaks for them.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from fxsplit.tp.experts import ExchangeStats, expert_load

__all__ = ["expert_load", "expert_rows"]


def expert_rows(pm: Any, stats: ExchangeStats) -> list[int] | None:
    """Rows per expert over the whole world's step (None without ep); collective over the world."""
    c = pm.plan.config
    if c.ep == 1:
        return None
    coords = pm.coords
    data = coords.get("dp", 0) * c.dp_shard + coords.get("dp_shard", 0)
    mine = (data // c.ep, coords.get("pp", 0), coords.get("tp", 0), data % c.ep,
            stats.rows.tolist() if stats.rows is not None else [])
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    groups: dict = {}
    for group, pp, tp, e, rows in every:
        if tp == 0:
            groups.setdefault((group, pp), {})[e] = rows
    total: list[int] = []
    for blocks in groups.values():
        joined = [v for e in sorted(blocks) for v in blocks[e]]
        if joined:
            total = joined if not total else [a + b for a, b in zip(total, joined)]
    return total or None
