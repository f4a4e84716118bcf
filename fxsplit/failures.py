"""Errors agreed on by every rank: a failure on one rank of a ``step()``/``forward()`` reaches all
of them, named ([Note: failures] in :meth:`fxsplit.parallel_model.ParallelModel._agree`), and input
checks that run before any communication.

Terms as in :mod:`fxsplit.api`.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .api import Plan

__all__ = ["RankFailedError"]


class RankFailedError(RuntimeError):
    """Another rank failed a ``step()`` or ``forward()`` call; raised on every rank whose own code
    did not fail ([Note: failures]). ``failed`` maps each failed global rank to its error text."""

    def __init__(self, message: str, *, failed: Mapping[int, str]):
        super().__init__(message)
        self.failed = dict(failed)


# codes of a rank's outcome in the error exchange ([Note: failures]); higher wins
_OK, _BAD_INPUT, _RAISED, _PEER_FAILED = 0, 1, 2, 3


def _exchange_errors(group: Any, error: Exception | None, in_runtime: bool, *, timeout: float,
                     coords: Mapping[str, int], what: str) -> tuple[int, Exception] | None:
    """All-reduce this rank's outcome code over ``group``; None when every rank succeeded, else
    (the highest code, the exception this rank must raise). Waits at most ``timeout`` seconds."""
    from .runtime import PipelineError

    if error is None:
        code = _OK
    elif isinstance(error, PipelineError):
        code = _PEER_FAILED  # waited for a rank that failed: an echo, not a cause
    else:
        code = _RAISED if in_runtime else _BAD_INPUT
    flag = torch.tensor([code], dtype=torch.int32)
    try:
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
        work.wait(datetime.timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001 -- a rank never arrived
        text = (f"{what}(): the end-of-call error check with the other ranks failed or timed out after "
                f"{timeout:g} s ({type(exc).__name__}); some rank crashed, hangs, or did not call "
                f"{what}() (every rank must)")
        if error is not None:
            error.add_note(f"fxsplit: {text}")
            return (_RAISED, error)
        return (_RAISED, RankFailedError(text, failed={}))
    worst = int(flag.item())
    if worst == _OK:
        return None
    me = dist.get_rank()
    report = (me, code, dict(coords), "" if error is None else f"{type(error).__name__}: {error}")
    reports: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, report, group=group)
    causes = [r for r in reports if r[1] in (_BAD_INPUT, _RAISED)] or [r for r in reports if r[1] != _OK]

    def where(r: tuple) -> str:
        return f"global rank {r[0]} ({', '.join(f'{k} {v}' for k, v in r[2].items())})"

    lines = [f"{where(r)}: {r[3]}" for r in causes]
    echoes = [r[0] for r in reports if r[1] == _PEER_FAILED and r not in causes]
    tail = (f"; rank(s) {echoes} stopped waiting for them" if echoes else "")
    if error is not None and code in (_BAD_INPUT, _RAISED):
        mine = report[3]
        same = [r[0] for r in causes if r[0] != me and r[3] == mine]
        others = [line for r, line in zip(causes, lines) if r[0] != me and r[3] != mine]
        if same:
            error.add_note(f"fxsplit: {what}() failed the same way on global rank(s) {same}")
        if others:
            error.add_note(f"fxsplit: {what}() also failed on " + "; ".join(others))
        return (worst, error)
    text = (f"{what}() failed on {len(causes)} rank(s), so it fails on every rank (this is global rank "
            f"{me}): " + "; ".join(lines) + tail + "; their own tracebacks say where.")
    exc = RankFailedError(text, failed={r[0]: r[3] for r in causes})
    if error is not None:
        exc.__cause__ = error
    return (worst, exc)


def _check_batch(flat: Sequence[Any], plan_: Plan, what: str) -> None:
    """Raise ValueError naming the sizes, on the rank that was given them and before any
    communication, when the inputs cannot be split into the plan's microbatches: a batch (dim 0
    of the first tensor input that has one, as fxsplit.runtime.microbatch splits it) smaller than
    m, or microbatch shapes the traced graph does not accept (a size fixed at trace time)."""
    from .runtime.microbatch import bind_symbols, split_microbatches

    config = plan_.config
    m = config.microbatches
    batch = next((x.shape[0] for x in flat if isinstance(x, torch.Tensor) and x.dim() > 0), None)
    if batch is not None and batch < m:
        fix = (f"parallelize(..., microbatches=k) with {config.pp} <= k <= {batch}" if batch >= config.pp
               else f"fewer pipeline ranks (microbatches must be >= pp={config.pp})")
        raise ValueError(
            f"{what}(): batch size {batch} (dim 0 of the inputs) is smaller than microbatches={m}, so a "
            f"microbatch would be empty; pass a batch of at least {m} samples, or use {fix}. (A batch "
            f"size that {m} does not divide is fine: the microbatches then differ by one sample and their "
            "losses are weighted by their sizes.)"
        )
    if len(flat) != len(plan_.stages.input_meta):
        return  # the runtime names the inputs it expected
    split = split_microbatches(flat, m)
    try:  # microbatch sizes differ by at most one: the first and last cover every shape (~20 us)
        for inputs in (split.inputs[0], split.inputs[-1]) if m > 1 else split.inputs:
            bind_symbols(plan_.stages.input_meta, inputs)
    except ValueError as exc:
        raise ValueError(f"{what}(): a batch of {batch} in microbatches={m} gives microbatches of "
                         f"{sorted(set(split.sizes))} samples, which the plan does not accept: {exc}") from None
