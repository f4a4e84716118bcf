"""Errors agreed on by every rank: a failure on one rank of a ``step()``/``forward()`` reaches all
of them, named ([Note: failures] in :meth:`fxsplit.api.model.ParallelModel._agree`).

Terms as in :mod:`fxsplit.api`.
"""

from __future__ import annotations

import datetime
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from fxsplit.errors import PipelineError, RankFailedError

__all__ = ["RankFailedError", "exchange_errors"]


# codes of a rank's outcome in the error exchange ([Note: failures]); higher wins
_OK, _BAD_INPUT, _RAISED, _PEER_FAILED = 0, 1, 2, 3
# the agreement values ride below the outcome code in each int64 of the MAX all-reduce: a gloo
# all-reduce costs about one round per element on few ranks, so the code takes no element of its
# own; values are 60-bit hashes; a value with no say leaves its pair (code | 0, code | 0)
_SHIFT = 60
_MASK = (1 << _SHIFT) - 1


def exchange_errors(group: Any, error: Exception | None, in_runtime: bool, *, timeout: float,
                     coords: Mapping[str, int], what: str, watch: Any = None,
                     signature: Sequence[int | None] = (), replicas: int = 1,
                     spans: list | None = None) -> tuple[int, Exception] | None:
    """All-reduce this rank's outcome code over ``group``; None when every rank succeeded, else
    (the highest code, the exception this rank must raise). Waits at most ``timeout`` seconds;
    with ``watch`` (fxsplit.runtime.watch.Watch) a polled wait that ends as soon as a rank is known
    to be lost, naming it ([Note: failure protocol]).

    ``signature`` = (replica, v1, v2, ...): 60-bit values that ride in the same all-reduce so
    callers can check that the ranks of one replica agree ([Note: inputs that must agree] in
    fxsplit.api.agreement); a None value has no say. ``spans`` receives (when every rank
    succeeded), per replica, the (max, min) of each value over its ranks ((None, None) where no
    rank had a say)."""
    if error is None:
        code = _OK
    elif isinstance(error, (PipelineError, RankFailedError)):
        code = _PEER_FAILED  # waited for a rank that failed: an echo, not a cause
    else:
        code = _RAISED if in_runtime else _BAD_INPUT
    k = max(len(signature) - 1, 0)
    if not k:
        row = torch.tensor([code], dtype=torch.int64)
    else:  # [Note: inputs that must agree]: per replica and value, (code | v, code | M - v)
        row = torch.full((2 * k * replicas,), code << _SHIFT, dtype=torch.int64)
        base = 2 * k * signature[0]
        for i, v in enumerate(signature[1:]):
            if v is not None:
                row[base + 2 * i] |= v & _MASK
                row[base + 2 * i + 1] |= _MASK - (v & _MASK)
    failed = _reduce_flag(row, group, error, timeout=timeout, what=what, watch=watch,
                          when='at the end of' if in_runtime else 'at the start of')
    if failed is not None:
        return failed
    worst = int(row.max()) >> _SHIFT if k else int(row[0])
    if spans is not None and k and worst == _OK:
        vals = (row & _MASK).view(replicas, k, 2).tolist()
        spans[:] = [[(hi, _MASK - lo) if (hi, lo) != (0, 0) else (None, None) for hi, lo in fields]
                    for fields in vals]
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


def _reduce_flag(row: torch.Tensor, group: Any, error: Exception | None, *, timeout: float,
                 what: str, watch: Any, when: str) -> tuple[int, Exception] | None:
    """The MAX all-reduce of ``row`` (outcome code, agreement slots) in place; (code, exception)
    when it could not complete."""
    work = dist.all_reduce(row, op=dist.ReduceOp.MAX, group=group, async_op=True)
    try:
        if watch is not None:
            watch.wait(work, f"checking for errors with every rank {when} {what}()",
                       range(dist.get_world_size(group)), until_lost=True)
        else:
            work.wait(datetime.timedelta(seconds=timeout))
        return None
    except RankFailedError as exc:  # the watch named the rank that will not come
        found: Exception = exc
        text = str(exc)
    except Exception as exc:  # noqa: BLE001 -- a rank never arrived
        text = (f"{what}(): the end-of-call error check with the other ranks failed or timed out after "
                f"{timeout:g} s ({type(exc).__name__}); some rank crashed, hangs, or did not call "
                f"{what}() (every rank must)")
        found = RankFailedError(text, failed={})
    if error is not None and not isinstance(error, (PipelineError, RankFailedError)):
        error.add_note(f"fxsplit: {text}")
        return (_RAISED, error)
    return (_RAISED, found)
