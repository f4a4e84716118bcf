"""Values the ranks of one data-parallel replica must agree on, checked at the cost of a few
integers per rank in exchanges that already run ([Note: inputs that must agree]).

Terms: **replica** -- the ranks with the same (dp, dp_shard) coordinates (every tp and pp rank of
one data-parallel slice); **row** -- the integers one rank contributes (its *signature*); every
rank receives every row, so every rank reaches the same verdict.

    sig = input_signature(flat, target, replica=r, holds_last=True)   # rides the start-of-call exchange
    check_inputs(rows, "step", flat, target, group=errors, describe=describe)   # raises UsageError

[Note: inputs that must agree]
The ranks of one replica split one batch into the same microbatches, and the ranks holding the
last stage read the same target. The transfers between them carry shapes the plan fixed from the
batch each rank was given, and gloo accepts a message shorter than its buffer: a rank given 6
samples where its peers got 8 would return rows nobody computed (or abort in backward). So every
step() and forward() carries five integers per rank in the start-of-call error exchange
(fxsplit.runtime.failures.exchange_errors, an all-gather): (replica, batch, CRC-32 of every input's
shape, holds the last stage, CRC-32 of the target's shapes). A replica that disagrees makes every
rank raise the same UsageError, naming the ranks and their shapes, before the pipeline; the model
stays usable. At the end of step() the rows carry the bits of the loss (before the data-parallel
mean): the ranks of one replica must return one loss, or loss_fn is not the same function of the
same output on every rank (with tensor parallelism every tp rank of the last stage runs it).
Data-parallel replicas may differ from each other.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from fxsplit.errors import UsageError

__all__ = ["check_inputs", "input_signature", "loss_signature", "losses_disagree"]


def _shapes(values: Sequence[Any]) -> list:
    return [tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in values]


def input_signature(flat: Sequence[Any], target: Any, *, replica: int, holds_last: bool) -> tuple[int, ...]:
    """This rank's five integers for the start-of-call exchange."""
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    batch = next((x.shape[0] for x in tensors if x.dim() > 0), -1)
    tshape = -1 if target is None else zlib.crc32(repr(_shapes(pytree.tree_leaves(target))).encode())
    return (replica, int(batch), zlib.crc32(repr(_shapes(tensors)).encode()), int(holds_last), tshape)


def check_inputs(rows: Sequence[tuple[int, ...]], what: str, flat: Sequence[Any], target: Any, *,
                 group: Any, describe: Callable[[int], str]) -> None:
    """Raise UsageError on every rank when a replica's rows disagree; ``rows[g]`` is global rank
    g's signature. On a mismatch every rank gathers the shapes (all ranks are here) to name them."""
    bad_in = {r[0] for r in rows if {s[1:3] for s in rows if s[0] == r[0]} != {r[1:3]}}
    bad_t = {r[0] for r in rows if r[3] and {s[4] for s in rows if s[0] == r[0] and s[3]} != {r[4]}}
    if what != "step":
        bad_t = set()
    if not bad_in and not bad_t:
        return
    mine = (_shapes([x for x in flat if isinstance(x, torch.Tensor)]),
            None if target is None else _shapes(pytree.tree_leaves(target)))
    every: list = [None] * len(rows)
    dist.all_gather_object(every, mine, group=group)
    lines = []
    for g, (shapes, tshapes) in enumerate(every):
        if rows[g][0] in bad_in:
            lines.append(f"{describe(g)}: inputs {shapes}")
        elif rows[g][0] in bad_t and rows[g][3]:
            lines.append(f"{describe(g)}: target {tshapes}")
    kind = "inputs" if bad_in else "targets"
    raise UsageError(
        f"{what}(): the ranks of one data-parallel replica were given {kind} of different shapes, so their "
        "microbatches would not match (a transfer would carry rows nobody computed): " + "; ".join(lines)
        + ". Every tensor- and pipeline-parallel rank of a replica must get the same batch (and the ranks "
        "holding the last stage the same target); only data-parallel replicas may differ. Raised on every "
        "rank; this model stays usable."
    )


def loss_signature(loss: Any, *, replica: int) -> tuple[int, int]:
    """(replica, the loss's float64 bits) for the end-of-step exchange."""
    if not isinstance(loss, torch.Tensor):
        return (replica, 0)
    bits = loss.detach().to(torch.float64).cpu().reshape(1).view(torch.int64)
    return (replica, int(bits[0]))


def losses_disagree(rows: Sequence[tuple[int, int]], *, describe: Callable[[int], str]) -> str | None:
    """The error text when the ranks of a replica returned different losses, else None."""
    by_replica: dict[int, set[int]] = {}
    for r in rows:
        by_replica.setdefault(r[0], set()).add(r[1])
    bad = {k for k, v in by_replica.items() if len(v) > 1}
    if not bad:
        return None

    def as_float(bits: int) -> float:
        return torch.tensor([bits], dtype=torch.int64).view(torch.float64).item()

    lines = [f"{describe(g)}: {as_float(r[1])!r}" for g, r in enumerate(rows) if r[0] in bad]
    return ("step(): the ranks of one data-parallel replica computed different losses from the same model "
            "output: " + "; ".join(lines) + ". loss_fn must be the same function on every rank (no "
            "rank-dependent state, randomness or inputs): with tensor parallelism each tensor-parallel rank "
            "of the last stage runs it. Raised on every rank; this step's gradients are not consistent and "
            "the model cannot run again.")
