"""Values the ranks of one data-parallel replica must agree on, checked at the cost of a few
integers per rank in exchanges that already run ([Note: inputs that must agree]).

Terms: **replica** -- the ranks with the same (dp, dp_shard) coordinates (every tp and pp rank of
one data-parallel slice); **signature** -- the integers one rank contributes; **spans** -- per
replica, the (max, min) of each integer over its ranks, which every rank receives from one MAX
all-reduce, so every rank reaches the same verdict.

    sig = input_signature(flat, target, replica=r, holds_last=True, with_target=True)  # rides the exchange
    check_inputs(spans, "step", flat, target, replica=r, holds_last=True, group=errors, describe=describe)

[Note: inputs that must agree]
The ranks of one replica split one batch into the same microbatches, and the ranks holding the
last stage read the same target. The transfers between them carry shapes the plan fixed from the
batch each rank was given, and gloo accepts a message shorter than its buffer: a rank given 6
samples where its peers got 8 would return rows nobody computed (or abort in backward). So every
step() and forward() carries a 60-bit hash of its inputs' shapes (and, on ranks holding the last
stage in step(), one of the target's shapes) in the start-of-call error exchange
(fxsplit.runtime.failures.exchange_errors, the MAX all-reduce that already ran), each as
(v, M - v) in its replica's slots below the outcome code, so one reduction gives the code and
every replica's max and min of each value. A replica
whose max and min differ makes every rank raise the same UsageError, naming the ranks and their
shapes (gathered only then), before the pipeline; the model stays usable. At the end of step()
the slots carry the bits of the loss (before the data-parallel mean): the ranks of one replica
must return one loss, or loss_fn is not the same function of the same output on every rank
(with tensor parallelism every tp rank of the last stage runs it). Data-parallel replicas may
differ from each other. Cost: ``benchmarks/agree_cost.py``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from fxsplit.errors import UsageError

__all__ = ["check_inputs", "input_signature", "loss_signature", "losses_disagree"]


def _shapes(values: Sequence[Any]) -> list:
    return [tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in values]


def _disagree(spans: Sequence[Sequence[tuple[Any, Any]]]) -> set[int]:
    """The replicas where some value's max and min differ."""
    return {r for r, fields in enumerate(spans) if any(hi != lo for hi, lo in fields)}


def _h60(value: Any) -> int:
    """A 60-bit hash of ``repr(value)`` (the width of an agreement value in the exchange)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 4


def input_signature(flat: Sequence[Any], target: Any, *, replica: int, holds_last: bool,
                    with_target: bool) -> tuple[int | None, ...]:
    """(replica, hash of the inputs' shapes, hash of the target's shapes or None where this rank
    does not read the target; only in step())."""
    shapes = _shapes([x for x in flat if isinstance(x, torch.Tensor)])
    if not with_target:
        return (replica, _h60(shapes))
    tshape = None
    if holds_last:
        tshape = _h60(None if target is None else _shapes(pytree.tree_leaves(target)))
    return (replica, _h60(shapes), tshape)


def check_inputs(spans: Sequence[Sequence[tuple[Any, Any]]], what: str, flat: Sequence[Any], target: Any, *,
                 replica: int, holds_last: bool, group: Any, describe: Callable[[int], str]) -> None:
    """Raise UsageError on every rank when a replica's ranks disagree (``spans``: per replica, the
    (max, min) of each signature value). On a mismatch every rank gathers the shapes (all ranks are
    in the exchange) to name them."""
    bad = _disagree(spans)
    if not bad:
        return
    inputs_differ = {r for r in bad if spans[r][0][0] != spans[r][0][1]}
    mine = (replica, holds_last, _shapes([x for x in flat if isinstance(x, torch.Tensor)]),
            None if target is None else _shapes(pytree.tree_leaves(target)))
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    lines = []
    for g, (rep, last, shapes, tshapes) in enumerate(every):
        if rep in inputs_differ:
            lines.append(f"{describe(g)}: inputs {shapes}")
        elif rep in bad and last:
            lines.append(f"{describe(g)}: target {tshapes}")
    kind = "inputs" if inputs_differ else "targets"
    raise UsageError(
        f"{what}(): the ranks of one data-parallel replica were given {kind} of different shapes, so their "
        "microbatches would not match (a transfer would carry rows nobody computed): " + "; ".join(lines)
        + ". Every tensor- and pipeline-parallel rank of a replica must get the same batch (and the ranks "
        "holding the last stage the same target); only data-parallel replicas may differ. Raised on every "
        "rank; this model stays usable."
    )


def loss_signature(loss: Any, *, replica: int) -> tuple[int | None, ...]:
    """(replica, a 60-bit hash of the loss's float64 bits)."""
    if not isinstance(loss, torch.Tensor):
        return (replica, None)
    return (replica, _h60(float(loss.detach().to(torch.float64).cpu()).hex()))


def losses_disagree(spans: Sequence[Sequence[tuple[Any, Any]]], loss: Any, *, replica: int, group: Any,
                    describe: Callable[[int], str]) -> str | None:
    """The error text when the ranks of a replica returned different losses, else None."""
    bad = _disagree(spans)
    if not bad:
        return None
    value = float(loss) if isinstance(loss, torch.Tensor) else None
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (replica, value), group=group)
    lines = [f"{describe(g)}: {v!r}" for g, (rep, v) in enumerate(every) if rep in bad]
    return ("step(): the ranks of one data-parallel replica computed different losses from the same model "
            "output: " + "; ".join(lines) + ". loss_fn must be the same function on every rank (no "
            "rank-dependent state, randomness or inputs): with tensor parallelism each tensor-parallel rank "
            "of the last stage runs it. Raised on every rank; this step's gradients are not consistent and "
            "the model cannot run again.")
