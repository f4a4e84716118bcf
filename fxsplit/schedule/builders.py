"""Schedule builders: GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZB-V as per-rank action lists.

Terms (see DESIGN.md): p = ``num_ranks``, m = ``num_microbatches``, v = ``stages_per_rank``; the
model is cut into p*v stages and rank r holds stages r, r+p, ..., r+(v-1)p ("chunk" c of rank r is
stage c*p + r), except where a schedule places its stages otherwise: ``placement(name, p, v)`` is
the stage -> rank tuple every schedule name implies (ZB-V's V: see [Note: ZB-V]). Every builder returns a ``Schedule`` with no idle entries (each rank's actions in
execution order); ``fxsplit.schedule.render.format_grid`` aligns them in time for a picture.

Representative use::

    build("interleaved_1f1b", num_ranks=4, num_microbatches=6, stages_per_rank=2)

| name               | v    | m          | order on rank r                                          |
| ------------------ | ---- | ---------- | -------------------------------------------------------- |
| "gpipe"            | any  | any m >= 1 | all forwards (chunk by chunk), then all backwards        |
| "1f1b"             | 1    | any m >= 1 | p-r-1 warm-up forwards, then F/B pairs, then backwards   |
| "1f1b" (v >= 2)    | >= 2 | any m >= 1 | same as "interleaved_1f1b" (depth-first 1F1B)            |
| "interleaved_1f1b" | any  | any m >= 1 | Megatron's interleaving, extended to m % p != 0 below    |
| "zb_h1"            | 1    | any m >= 1 | 1F1B with the backward split into I and W; W's fill the  |
|                    |      |            | cool-down bubbles (ZB-H1, Qi et al. 2023)                |
| "zbv"              | 2    | any m >= 1 | ZB-V: two stages per rank in a V, split backward         |
| "zb_auto"          | 1    | any m >= 1 | greedy zero-bubble order from per-stage F/I/W/comm costs |
|                    |      |            | and a memory limit (``fxsplit.schedule.auto``)           |

[Note: interleaving for any m >= p] Megatron orders a rank's forwards in groups of microbatches:
a group runs chunk 0 on its microbatches, then chunk 1 on the same ones, ..., chunk v-1; the
backwards use the same groups with the chunks reversed. Rank r runs ``2(p-r-1) + (v-1)G``
warm-up forwards (G = size of the first group), then alternates one forward and one backward,
then drains the backwards. Megatron uses groups of p and asks m % p == 0, because a group smaller
than p reaches a chunk boundary before the previous chunk came around the ring of p ranks (a
short LAST group makes Megatron's order deadlock, e.g. p=4, v=3, m=5). For m = q*p + g, 0 < g < p:
  "front" (default): the FIRST group holds p+g microbatches, the others p. No group is shorter
      than p, so the bubble time is (p-1)(F+B)/v exactly as for m % p == 0 (checked by
      ``simulate`` in the tests); the price is a longer warm-up: rank 0 holds up to g(v-1)/v more
      microbatches (peak ``p + (p-1)/v + g(v-1)/v``, never more than m).
  "pad": build Megatron's order for ceil(m/p)*p microbatches and delete the actions of the
      padding microbatches. Dependencies only link actions of the same microbatch, so deleting
      whole microbatches from a deadlock-free schedule leaves it deadlock-free, and it can only
      make every action start earlier: memory never exceeds Megatron's and the makespan never
      exceeds the padded one's. The bubble is larger than with "front" (p=4, v=2, m=5, F=1,
      B=2: 7.5 idle time units per rank instead of 4.5).
m < p with v >= 2 always uses "pad" (the same argument makes it correct; its bubble is large).
Deadlock-freedom of "front" has no such proof: ``validate`` checks it in the tests for every
p <= 8, v <= 4, p <= m <= 3p, and hypothesis for random m up to p+12 (once, by hand: every
p <= 8, v <= 6, p <= m <= 6p).

[Note: ZB-V] Qi et al.'s ZB-V (arXiv 2401.10241, section "memory efficient zero bubble"; the
order torch's ScheduleZBVZeroBubble also runs) cuts the model into 2p stages placed in a V: rank r
holds stage r (descending) and stage 2p-1-r (ascending), so a microbatch goes down the ranks
and back up, and the loss is computed on rank 0. Rank r runs
    warm-up     2(p-r)-1 forwards of its descending stage, then r pairs (F up, F down), then
                p-r triples (F up, I up, W up): the ascending stage's backward starts at once;
    steady      per round: F down (while any are left), I down, W down, F up, I up, W up;
    cool-down   r pairs (I down, I up), then p-r pairs (I down, W down), then the W's left
                (ascending stage first).
The pattern needs m >= 2p-1 microbatches for its warm-up; for fewer it is built for 2p-1 and
the actions of the extra microbatches deleted (exact, per the "pad" argument above: the
dependencies only link actions of one microbatch). Why the V: both stages of a rank sit at the
same depth from the loss, so every rank keeps the same number of activations (p microbatches of
its share, 1F1B's rank 0) and the gradient turns round on rank 0 without crossing a link.
``validate`` checks the order for every p <= 8, m <= 4p in the tests; ``simulate`` its makespan
against the closed form in ``zbv``'s docstring. For m >= 2p-1 the order is action for action the
one torch 2.13's ScheduleZBVZeroBubble computes (compared by hand for p <= 5; not a test, as that
method is private).
"""

from __future__ import annotations

from collections.abc import Sequence

from fxsplit.errors import ScheduleError
from fxsplit.schedule.auto import search
from fxsplit.schedule.ir import Action, ActionKind, Schedule

__all__ = ["gpipe", "one_f_one_b", "interleaved_1f1b", "zb_h1", "zbv", "zb_auto", "v_placement"]

F = ActionKind.FORWARD
B = ActionKind.BACKWARD
BI = ActionKind.BACKWARD_INPUT
BW = ActionKind.BACKWARD_WEIGHT


def check_sizes(name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int) -> None:
    for arg, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches),
                       ("stages_per_rank", stages_per_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} schedule: {arg} must be an int >= 1, got {value!r}")


def gpipe(num_ranks: int, num_microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """GPipe (looping breadth-first when ``stages_per_rank`` > 1): all forwards, then all backwards.

    Forwards run chunk by chunk (chunk 0 on every microbatch, then chunk 1, ...); backwards run
    in the reverse chunk order, microbatches in increasing order. Peak in-flight: m microbatches.
    """
    check_sizes("gpipe", num_ranks, num_microbatches, stages_per_rank)
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    schedule: Schedule = []
    for r in range(p):
        row: list[Action | None] = [Action(c * p + r, F, mb) for c in range(v) for mb in range(m)]
        row += [Action(c * p + r, B, mb) for c in reversed(range(v)) for mb in range(m)]
        schedule.append(row)
    return schedule


def _group_sizes(p: int, m: int, v: int, remainder: str) -> tuple[list[int], int]:
    """Microbatch group sizes and the padded count, per [Note: interleaving for any m >= p]."""
    if v == 1:
        return [m], m
    q, g = divmod(m, p)
    if g == 0:
        return [p] * q, m
    if remainder == "front" and q >= 1:
        return [p + g] + [p] * (q - 1), m
    padded = (q + 1) * p  # "pad", and m < p whatever the choice
    return [p] * (q + 1), padded


def _one_forward_one_backward(p: int, m: int, v: int, remainder: str = "front") -> Schedule:
    """1F1B / interleaved 1F1B order on every rank, per [Note: interleaving for any m >= p]."""
    groups, padded = _group_sizes(p, m, v, remainder)
    fwd: list[tuple[int, int]] = []  # (chunk, microbatch) in forward order
    bwd: list[tuple[int, int]] = []
    start = 0
    for size in groups:
        group = range(start, start + size)
        fwd += [(c, mb) for c in range(v) for mb in group]
        bwd += [(c, mb) for c in reversed(range(v)) for mb in group]
        start += size
    total = padded * v
    schedule: Schedule = []
    for r in range(p):
        warmup = p - r - 1 if v == 1 else 2 * (p - r - 1) + (v - 1) * groups[0]
        w = min(warmup, total)
        order = list(fwd[:w])
        for i in range(total - w):
            order += [fwd[w + i], bwd[i]]
        order += bwd[total - w:]
        kinds = [F] * w + [F, B] * (total - w) + [B] * w
        schedule.append([Action(c * p + r, k, mb) for (c, mb), k in zip(order, kinds) if mb < m])
    return schedule


_REMAINDERS = ("front", "pad")


def interleaved_1f1b(num_ranks: int, num_microbatches: int, stages_per_rank: int = 2, *,
                     remainder: str = "front") -> Schedule:
    """Interleaved 1F1B (Megatron virtual pipeline) for any m; see [Note: interleaving for any m >= p].

    ``remainder`` chooses how m % p != 0 is handled: ``"front"`` (default; bubble as for m % p == 0,
    slightly more memory) or ``"pad"`` (memory as Megatron's, a larger bubble). With
    ``stages_per_rank`` == 1 this is plain 1F1B. Peak in-flight on rank 0 for m % p == 0:
    ``2(p-1) + (v-1)p + 1`` virtual stages, i.e. ``p + (p-1)/v`` microbatches.
    """
    check_sizes("interleaved_1f1b", num_ranks, num_microbatches, stages_per_rank)
    if remainder not in _REMAINDERS:
        raise ScheduleError(f"interleaved_1f1b: remainder must be one of {_REMAINDERS}, got {remainder!r}")
    return _one_forward_one_backward(num_ranks, num_microbatches, stages_per_rank, remainder)


def one_f_one_b(num_ranks: int, num_microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """1F1B (PipeDream-flush): p-r-1 warm-up forwards on rank r, then F/B pairs, then backwards.

    Peak in-flight on rank r: ``min(p - r, m)`` microbatches. With ``stages_per_rank`` > 1 this is
    the depth-first (interleaved) 1F1B of ``interleaved_1f1b``.
    """
    check_sizes("1f1b", num_ranks, num_microbatches, stages_per_rank)
    p, m = num_ranks, num_microbatches
    if stages_per_rank > 1:
        return interleaved_1f1b(p, m, stages_per_rank)
    return _one_forward_one_backward(p, m, 1)


def zb_h1(num_ranks: int, num_microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """ZB-H1 (Qi et al. 2023): 1F1B with the backward split into I (input grad) and W (weight grad).

    Rank r runs 1F1B's order with I in place of B and keeps r W's pending: after each I, the
    oldest pending W runs once more than r are pending; the last r run at the end. The input
    gradients (the critical path) thus move up the pipeline sooner and the deferred W's fill the
    cool-down, where rank r would wait for the next rank. With m >= p and F = I = W the makespan
    is ``m(F+I+W) + (p-1)(F+I-W)`` (1F1B: ``+ (p-1)(F+I+W)``); every rank holds up to p
    microbatches' activations (until their W). Only ``stages_per_rank`` == 1.
    """
    check_sizes("zb_h1", num_ranks, num_microbatches, stages_per_rank)
    if stages_per_rank != 1:
        raise ScheduleError(
            f"zb_h1 supports stages_per_rank=1 only, got {stages_per_rank}; use 'interleaved_1f1b' "
            "for several stages per rank"
        )
    p, m = num_ranks, num_microbatches
    schedule: Schedule = []
    for r in range(p):
        w = min(p - r - 1, m)
        row: list[Action | None] = [Action(r, F, mb) for mb in range(w)]
        pending: list[int] = []

        def backward(mb: int) -> None:
            row.append(Action(r, BI, mb))
            pending.append(mb)
            if len(pending) > r:
                row.append(Action(r, BW, pending.pop(0)))

        for i in range(m - w):
            row.append(Action(r, F, w + i))
            backward(i)
        for mb in range(m - w, m):
            backward(mb)
        row += [Action(r, BW, mb) for mb in pending]
        schedule.append(row)
    return schedule


def zb_auto(num_ranks: int, num_microbatches: int, stages_per_rank: int = 1, *,
            forward: float | Sequence[float] = 1.0, backward_input: float | Sequence[float] = 1.0,
            backward_weight: float | Sequence[float] = 1.0, comm: float | Sequence[float] = 0.0,
            max_inflight: int | Sequence[int] | None = None) -> Schedule:
    """A zero-bubble schedule for these per-stage costs ([Note: zb_auto heuristic] in
    ``fxsplit.schedule.auto``), never slower in ``simulate`` than ZB-H1 or 1F1B on them.

    ``forward`` / ``backward_input`` / ``backward_weight`` / ``comm``: seconds per microbatch of each
    stage (a number for all; ``comm[s]`` is a message stage s sends). ``max_inflight``:
    microbatches a rank may hold in flight (a number or one per rank); default p on every rank,
    1F1B's peak (ZB-1p); 2p is ZB-2p's. Only ``stages_per_rank`` == 1.
    """
    check_sizes("zb_auto", num_ranks, num_microbatches, stages_per_rank)
    if stages_per_rank != 1:
        raise ScheduleError(f"zb_auto supports stages_per_rank=1 only, got {stages_per_rank}; use 'zbv' for two")
    p, m = num_ranks, num_microbatches
    return search(p, m, forward=forward, backward_input=backward_input, backward_weight=backward_weight,
                  comm=comm, max_inflight=max_inflight, baselines=(zb_h1(p, m), one_f_one_b(p, m)))


def v_placement(num_ranks: int) -> tuple[int, ...]:
    """ZB-V's stage -> rank map for 2p stages: stage s on rank s for s < p, on rank 2p-1-s after."""
    p = num_ranks
    return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))


def zbv(num_ranks: int, num_microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """ZB-V (Qi et al., arXiv 2401.10241): 2 stages per rank in a V, backward split into I and W.

    See [Note: ZB-V]. Stage s lives on rank ``v_placement(p)[s]``: rank r holds stages r and
    2p-1-r, so the last stage (the loss) is on rank 0. With m >= 2p-1 and per-stage costs
    F = I = W = c (a rank's share: 2c each) no rank idles inside its active window, the makespan
    is ``m(F+I+W) + (p-1)F/2`` in rank-share costs, i.e. ``6mc + (p-1)c`` (ZB-H1:
    ``6mc + 2(p-1)c`` for the same rank-share costs), and every rank holds at most p microbatches
    of its share in flight (1F1B's rank 0). Only ``stages_per_rank`` == 2.
    """
    check_sizes("zbv", num_ranks, num_microbatches, stages_per_rank)
    if stages_per_rank != 2:
        raise ScheduleError(f"zbv places exactly 2 stages per rank in a V, got stages_per_rank={stages_per_rank}")
    p, m = num_ranks, num_microbatches
    n = max(m, 2 * p - 1)  # the pattern's warm-up needs 2p-1 microbatches; extra ones are dropped
    schedule: Schedule = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r  # the V's descending and ascending stage on rank r
        row: list[tuple[int, ActionKind, int]] = []
        nf = {down: 0, up: 0}  # next forward / input-gradient / weight-gradient microbatch per stage
        ni = {down: 0, up: 0}
        nw = {down: 0, up: 0}

        def take(stage: int, kind: ActionKind) -> None:
            counter = nf if kind is F else ni if kind is BI else nw
            row.append((stage, kind, counter[stage]))
            counter[stage] += 1

        for _ in range(2 * (p - r) - 1):  # warm-up: fill the descending half of the V
            take(down, F)
        for _ in range(r):
            take(up, F)
            take(down, F)
        for _ in range(p - r):  # the ascending stage's first backwards start the steady state
            take(up, F)
            take(up, BI)
            take(up, BW)
        while nf[up] < nf[down] or nf[down] < n:  # steady state: F I W on each stage in turn
            if nf[down] < n:
                take(down, F)
            take(down, BI)
            take(down, BW)
            take(up, F)
            take(up, BI)
            take(up, BW)
        for _ in range(r):  # cool-down: input gradients first (the critical path), W's fill in
            take(down, BI)
            take(up, BI)
        for _ in range(p - r):
            take(down, BI)
            take(down, BW)
        while nw[up] < ni[up]:
            take(up, BW)
        while nw[down] < ni[down]:
            take(down, BW)
        schedule.append([Action(s, k, mb) for s, k, mb in row if mb < m])
    return schedule
