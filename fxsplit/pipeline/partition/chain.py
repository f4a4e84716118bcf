"""The chain model of a partition problem and the exact bottleneck search, shared by ``solve``
(`solve`, `brute_force`, the baselines) and ``memory_caps`` (the memory-coupled search).

Terms and the cost model: [Note: partition cost model] in :mod:`fxsplit.pipeline.partition`.

    ch = Chain(problem)                # prefix sums, allowed cuts, memory per stage
    check_counts(ch)                   # PartitionError when S exceeds the possible cuts
    cuts = min_bottleneck(ch, caps)    # the optimal cut tuple, or None when no cut tuple fits caps
    part = evaluate_cuts(ch, cuts, "solve", exact=True)
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass
from itertools import accumulate, combinations
from operator import sub
from typing import Callable, Sequence
from fxsplit.errors import PartitionError
from fxsplit.schedule.spec import inflight_1f1b, inflight_gpipe  # re-exported: the partition's callers use them

__all__ = [
    "PartitionProblem", "Partition", "inflight_1f1b", "inflight_gpipe", "Chain", "check_counts", "forward",
    "reconstruct", "evaluate_cuts", "search", "min_bottleneck", "all_cuts", "INF", "NEG",
]

INF = math.inf
NEG = -math.inf
_MAXF = 1.7976931348623157e308  # a finite stand-in for an infinite bottleneck


def _floats(name: str, values: Sequence[float], length: int, what: str) -> tuple[float, ...]:
    out = tuple(float(x) for x in values)
    if len(out) != length:
        raise PartitionError(f"{name} has {len(out)} entries; it needs {length} ({what})")
    for i, x in enumerate(out):
        if not (math.isfinite(x) and x >= 0):
            raise PartitionError(f"{name}[{i}] = {x!r}; it must be finite and >= 0")
    return out


@dataclass(frozen=True)
class PartitionProblem:
    """A chain of ``n`` units to cut into ``num_stages`` stages; see [Note: partition cost model].

    ``cut_bytes``, ``allowed`` and ``cut_penalty`` are indexed by position (length ``n + 1``);
    ``allowed[0]`` and ``allowed[n]`` are ignored (the ends are always cuts). ``inflight`` is
    per rank: a tuple of length ``num_ranks``, a callable ``r -> float``, or None for
    `inflight_1f1b`. ``stage_ranks`` is the rank of every stage (the schedule's placement,
    ``fxsplit.schedule.placement``); None is ``s % num_ranks``. Every rank must hold
    ``num_stages // num_ranks`` stages.
    """

    compute: tuple[float, ...]
    param_bytes: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    cut_bytes: tuple[float, ...]
    num_stages: int
    num_ranks: int
    allowed: tuple[bool, ...] | None = None
    forced: tuple[int, ...] = ()
    cut_penalty: tuple[float, ...] | None = None
    bandwidth: float = INF
    memory_limit: float | None = None
    state_bytes_per_param_byte: float = 4.0
    inflight: Callable[[int], float] | tuple[float, ...] | None = None
    exact_budget: int = 300_000  # search steps of the exact v > 1 memory-capped search (~0.3 s)
    stage_ranks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.compute)
        if n < 1:
            raise PartitionError("compute is empty; a partition needs at least one unit")
        put = lambda k, x: object.__setattr__(self, k, x)  # noqa: E731 (frozen dataclass)
        put("compute", _floats("compute", self.compute, n, "one per unit"))
        put("param_bytes", _floats("param_bytes", self.param_bytes, n, "one per unit"))
        put("activation_bytes", _floats("activation_bytes", self.activation_bytes, n, "one per unit"))
        put("cut_bytes", _floats("cut_bytes", self.cut_bytes, n + 1, "one per position 0..n"))
        if self.cut_penalty is not None:
            put("cut_penalty", _floats("cut_penalty", self.cut_penalty, n + 1, "one per position 0..n"))
        if self.allowed is not None:
            allowed = tuple(bool(x) for x in self.allowed)
            if len(allowed) != n + 1:
                raise PartitionError(
                    f"allowed has {len(allowed)} entries; it needs {n + 1} (one per position 0..n)")
            put("allowed", allowed)
        for name in ("num_stages", "num_ranks"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise PartitionError(f"{name} = {x!r}; it must be an int >= 1")
        if self.num_stages % self.num_ranks:
            raise PartitionError(
                f"num_stages = {self.num_stages} is not a multiple of num_ranks = {self.num_ranks}; "
                f"every rank holds num_stages // num_ranks stages")
        forced = tuple(self.forced)
        for k in forced:
            if isinstance(k, bool) or not isinstance(k, int) or not 0 < k < n:
                raise PartitionError(
                    f"forced cut {k!r} is not a position strictly inside the chain (1..{n - 1})")
        for x, y in zip(forced, forced[1:]):
            if y <= x:
                raise PartitionError(
                    f"forced cuts {forced} are {'duplicated' if x == y else 'out of order'} at "
                    f"{x}, {y}; pass them strictly increasing")
        put("forced", forced)
        if not (self.bandwidth > 0):
            raise PartitionError(f"bandwidth = {self.bandwidth!r}; it must be > 0 bytes/s (inf: free)")
        if self.memory_limit is not None and not (0 < self.memory_limit < INF):
            raise PartitionError(f"memory_limit = {self.memory_limit!r}; it must be finite and > 0 (or None)")
        if not (0 <= self.state_bytes_per_param_byte < INF):
            raise PartitionError(
                f"state_bytes_per_param_byte = {self.state_bytes_per_param_byte!r}; "
                f"it must be finite and >= 0")
        if isinstance(self.inflight, (tuple, list)):
            put("inflight", _floats("inflight", self.inflight, self.num_ranks, "one per rank"))
        if self.stage_ranks is not None:
            ranks = tuple(self.stage_ranks)
            counts = [sum(1 for r in ranks if r == q) for q in range(self.num_ranks)]
            if len(ranks) != self.num_stages or any(c != self.num_stages // self.num_ranks for c in counts):
                raise PartitionError(
                    f"stage_ranks = {ranks} must name a rank in 0..{self.num_ranks - 1} for each of the "
                    f"{self.num_stages} stages, {self.num_stages // self.num_ranks} stages per rank")
            put("stage_ranks", ranks)

    def rank_of(self, stage: int) -> int:
        """The rank that holds ``stage`` (``stage_ranks``, default ``stage % num_ranks``)."""
        return stage % self.num_ranks if self.stage_ranks is None else self.stage_ranks[stage]

    @property
    def n(self) -> int:
        return len(self.compute)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.num_ranks

    def inflight_per_rank(self) -> tuple[float, ...]:
        """The in-flight microbatch count of every rank (see [Note: partition cost model])."""
        if self.inflight is None:
            return inflight_1f1b(self.num_ranks, self.stages_per_rank)
        if callable(self.inflight):
            return _floats("inflight(r)", [self.inflight(r) for r in range(self.num_ranks)],
                           self.num_ranks, "one per rank")
        return self.inflight

    def cut_ok(self) -> tuple[bool, ...]:
        """Per position: may a stage end there (allowed or forced, and always at n)."""
        n = self.n
        ok = [True] * (n + 1) if self.allowed is None else list(self.allowed)
        for k in self.forced:
            ok[k] = True
        ok[0], ok[n] = False, True
        return tuple(ok)


@dataclass(frozen=True)
class Partition:
    """Stage s holds units ``[cuts[s], cuts[s+1])``; costs per [Note: partition cost model].

    ``exact``: the bottleneck is proven minimal (see `solve`'s guarantees). ``method`` names the
    routine that chose the cuts. ``balance = bottleneck / mean`` (1.0 is perfect).
    """

    cuts: tuple[int, ...]
    stage_time: tuple[float, ...]
    stage_memory: tuple[float, ...]
    rank_memory: tuple[float, ...]
    bottleneck: float
    mean: float
    balance: float
    fits_memory: bool
    exact: bool = True
    method: str = "solve"

    @property
    def num_stages(self) -> int:
        return len(self.cuts) - 1

    stage_ranks: tuple[int, ...] | None = None  # None: stage s on rank s % p

    def __str__(self) -> str:
        lines = [f"Partition({self.method}, exact={self.exact}): bottleneck {self.bottleneck:.6g} s, "
                 f"mean {self.mean:.6g} s, balance {self.balance:.4f}, fits memory: {self.fits_memory}"]
        p = len(self.rank_memory)
        for s, (a, b) in enumerate(zip(self.cuts, self.cuts[1:])):
            rank = s % p if self.stage_ranks is None else self.stage_ranks[s]
            lines.append(f"  stage {s:3d} (rank {rank}): units [{a}, {b})  time {self.stage_time[s]:.6g} s"
                         f"  memory {self.stage_memory[s]:.6g} B")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- internals


class Chain:
    """Prefix sums and position tables of one problem (read-only after construction)."""

    def __init__(self, pb: PartitionProblem) -> None:
        n, S, p = pb.n, pb.num_stages, pb.num_ranks
        self.pb, self.n, self.S, self.p, self.v = pb, n, S, p, S // p
        self.P = P = [0.0, *accumulate(pb.compute)]
        if math.isinf(pb.bandwidth):
            c = [0.0] * (n + 1)
        else:
            pen = pb.cut_penalty or (1.0,) * (n + 1)
            c = [x * y / pb.bandwidth for x, y in zip(pb.cut_bytes, pen)]
        self.c = c
        self.E = [x + y for x, y in zip(P, c)]
        self.K = [x - y for x, y in zip(P, c)]
        self.Q = [0.0, *accumulate(pb.param_bytes)]
        self.A = [0.0, *accumulate(pb.activation_bytes)]
        self.state = pb.state_bytes_per_param_byte
        self.inflight = pb.inflight_per_rank()
        self.rank = [pb.rank_of(s) for s in range(S)]
        self.factor = [self.inflight[self.rank[s]] for s in range(S)]
        self.ok = pb.cut_ok()
        self.Eok = [e if ok else INF for e, ok in zip(self.E, self.ok)]
        bounds = [0, *pb.forced, n]
        self.segs = list(zip(bounds, bounds[1:]))
        self.bounds = bounds
        self.num_cut_points = sum(self.ok[1:n])

    def seg_start(self, b: int) -> int:
        """The first position of the forced-cut segment a stage ending at b must start in."""
        return self.bounds[bisect_right(self.bounds, b - 1) - 1]

    def time(self, a: int, b: int) -> float:
        return self.E[b] - self.K[a]

    def mem(self, s: int, a: int, b: int) -> float:
        return self.state * (self.Q[b] - self.Q[a]) + self.factor[s] * (self.A[b] - self.A[a])


def check_counts(ch: Chain) -> None:
    pb, S, m = ch.pb, ch.S, ch.num_cut_points
    if S - 1 > m:
        raise PartitionError(
            f"num_stages = {S} needs {S - 1} cuts but the graph has only {m} possible cut points; "
            f"use at most {m + 1} stages (or allow more cuts)")
    if len(pb.forced) > S - 1:
        raise PartitionError(
            f"{len(pb.forced)} forced cuts {pb.forced} make at least {len(pb.forced) + 1} stages; "
            f"num_stages = {S}: raise num_stages or drop forced cuts")


_SLACK = 1e-9  # relative slack of the compute-only pruning bounds (they must never cut a real path)


def forward(ch: Chain, B: float, caps: Sequence[float] | None):
    """Reachability layers for bottleneck B (and per-stage memory caps).

    ``layers[s][b]`` is ``K[b]`` when position b can end stage s-1 (s stages covering units
    ``[0, b)``, each with time <= B and memory <= caps[stage]) and can still be completed, else
    -inf. Returns ``(feasible, layers, next_B, next_L)``: when infeasible, every bottleneck below
    ``next_B`` is infeasible as well (with the same caps), and with ``B = inf`` and one cap for
    all stages every cap below ``next_L`` is infeasible too.

    Only a band of positions is examined per layer: b must lie within ``B`` of compute after the
    last reachable start (stage time >= its compute), and the remaining ``S - s`` stages must be
    able to hold the compute after b. Positions outside the band cannot lie on a feasible path;
    the bounds at which the band would grow enter next_B, so the search stays exact.
    """
    n, S, E, K, P = ch.n, ch.S, ch.E, ch.K, ch.P
    Bc = min(B, _MAXF)
    grow = Bc * (1 + _SLACK)
    first = [NEG] * (n + 1)
    first[0] = K[0]
    layers = [first]
    next_b = next_l = INF
    pf = pl = 0  # first and last reachable position of the previous layer
    for s in range(1, S + 1):
        prev = layers[-1]
        # forward bound: the first b past it has compute from pl alone above B
        hi = min(n, bisect_right(P, P[pl] + grow) - 1)
        while hi < n and P[hi + 1] - P[pl] <= Bc:
            hi += 1
        if hi < n:
            next_b = min(next_b, P[hi + 1] - P[pl])
        # backward bound: S - s stages of at most B must hold the compute after b
        lo = pf + 1
        if s < S and Bc < _MAXF:
            rest = (S - s) * (1 + _SLACK)
            lo = max(lo, bisect_left(P, P[n] - rest * Bc))
            while lo > pf + 1 and (P[n] - P[lo - 1]) / rest * (1 - _SLACK) <= Bc:
                lo -= 1
            if lo > pf + 1:
                next_b = min(next_b, (P[n] - P[lo - 1]) / rest * (1 - _SLACK))
        if caps is not None:
            hi, lo, next_l = _memory_band(ch, s, caps, pf, pl, hi, lo, next_l)
        cur = [NEG] * (n + 1)
        if lo > hi:
            reach = []
        elif caps is None:
            mk = [NEG] * (n + 1)
            for f, g in ch.segs:
                a0, a1 = max(f, pf), min(g, hi)
                if a0 < a1:
                    mk[a0 + 1:a1 + 1] = accumulate(prev[a0:a1], max)
            d = list(map(sub, ch.Eok[lo:hi + 1], mk[lo:hi + 1]))
            reach = [b for b, x in zip(range(lo, hi + 1), d) if x <= Bc]
            next_b = min(next_b, min(filter(Bc.__lt__, d), default=INF))
        else:
            reach, nb, nl = _layer_capped(ch, prev, s - 1, Bc, caps[s - 1], pf, lo, hi)
            next_b, next_l = min(next_b, nb), min(next_l, nl)
        for b in reach:
            cur[b] = K[b]
        layers.append(cur)
        if not reach:
            break
        pf, pl = reach[0], reach[-1]
    feasible = len(layers) == S + 1 and layers[S][n] != NEG
    return feasible, layers, next_b, next_l


def _memory_band(ch: Chain, s: int, caps: Sequence[float], pf: int, pl: int, hi: int, lo: int,
                 next_l: float) -> tuple[int, int, float]:
    """Narrow layer s's band [lo, hi] by memory: stage s-1 starting at pl or later must fit its
    cap, and the remaining stages' caps must hold the memory after b (counted at the smallest
    in-flight factor among them). Returns (hi, lo, next_L) with the caps at which it would widen."""
    n, S, Q, A, st = ch.n, ch.S, ch.Q, ch.A, ch.state
    cap, fa = caps[s - 1], ch.factor[s - 1]
    qa, aa = Q[pl], A[pl]
    mhi = bisect_right(range(n + 1), cap, lo=pl + 1, key=lambda b: st * (Q[b] - qa) + fa * (A[b] - aa)) - 1
    if mhi < n:
        next_l = min(next_l, st * (Q[mhi + 1] - qa) + fa * (A[mhi + 1] - aa))
    hi = min(hi, mhi)
    if s < S:
        room = sum(caps[s:]) * (1 + _SLACK)
        fmin, qn, an = min(ch.factor[s:]), Q[n], A[n]
        rest = lambda b: st * (qn - Q[b]) + fmin * (an - A[b])  # noqa: E731 (nonincreasing in b)
        mlo = bisect_left(range(n + 1), -room, lo=pf + 1, key=lambda b: -rest(b))
        share = (S - s) * (1 + _SLACK)
        while mlo > pf + 1 and rest(mlo - 1) / share * (1 - _SLACK) <= cap:
            mlo -= 1
        if mlo > pf + 1:
            next_l = min(next_l, rest(mlo - 1) / share * (1 - _SLACK))
        lo = max(lo, mlo)
    return hi, lo, next_l


def _layer_capped(ch: Chain, prev: list, s: int, Bc: float, cap: float, pf: int, lo_b: int, hi_b: int):
    """One layer of `forward` with a memory cap on stage s, for ends b in [lo_b, hi_b]: a
    sliding-window maximum of K over the reachable starts whose stage memory fits (the window
    start only moves right). Returns (reachable ends, next_B, next_L)."""
    E, Q, A, ok = ch.E, ch.Q, ch.A, ch.ok
    st, fa = ch.state, ch.factor[s]
    reach = []
    nb = nl = INF
    for f, g in ch.segs:
        dq: deque[int] = deque()
        lo, last = max(f, pf), -1
        for b in range(lo + 1, min(g, hi_b) + 1):
            ka = prev[b - 1]
            if ka != NEG:
                while dq and prev[dq[-1]] <= ka:
                    dq.pop()
                dq.append(b - 1)
                last = b - 1
            if b < lo_b or not ok[b]:
                continue
            qb, ab = Q[b], A[b]
            while lo < b and st * (qb - Q[lo]) + fa * (ab - A[lo]) > cap:
                lo += 1
            while dq and dq[0] < lo:
                dq.popleft()
            if dq:
                x = E[b] - prev[dq[0]]
                if x <= Bc:
                    reach.append(b)
                elif x < nb:
                    nb = x
            elif last >= 0:
                y = st * (qb - Q[last]) + fa * (ab - A[last])
                if y < nl:
                    nl = y
    return reach, nb, nl


def reconstruct(ch: Chain, layers: list, B: float, caps: Sequence[float] | None) -> tuple[int, ...]:
    """Cuts of a feasible layer table: the smallest last cut, then the smallest one before it..."""
    Bc = min(B, _MAXF)
    b, cuts = ch.n, [ch.n]
    for s in range(ch.S, 0, -1):
        prev = layers[s - 1]
        for a in range(ch.seg_start(b), b):
            if prev[a] != NEG and ch.E[b] - ch.K[a] <= Bc and (
                    caps is None or ch.mem(s - 1, a, b) <= caps[s - 1]):
                break
        else:  # pragma: no cover - a feasible table always has a start
            raise AssertionError(f"no start for stage {s - 1} ending at {b}")
        cuts.append(a)
        b = a
    assert b == 0, cuts
    return tuple(reversed(cuts))


def evaluate_cuts(ch: Chain, cuts: Sequence[int], method: str, exact: bool) -> Partition:
    pb = ch.pb
    times = tuple(ch.time(a, b) for a, b in zip(cuts, cuts[1:]))
    mems = tuple(ch.mem(s, a, b) for s, (a, b) in enumerate(zip(cuts, cuts[1:])))
    rank = [0.0] * ch.p
    for s, x in enumerate(mems):
        rank[ch.rank[s]] += x
    bott = max(times)
    mean = sum(times) / len(times)
    fits = pb.memory_limit is None or max(rank) <= pb.memory_limit
    return Partition(tuple(cuts), times, mems, tuple(rank), bott, mean,
                     bott / mean if mean > 0 else 1.0, fits, exact, method, pb.stage_ranks)


def search(check, first: float, top: float):
    """The smallest feasible value of a monotone check over a finite set of event values.

    ``check(x)`` returns ``(feasible, result, achieved, next_event)``: a feasible result has
    ``achieved <= x`` and is itself feasible at ``achieved``; when infeasible, every value below
    ``next_event`` (> x) is infeasible too. ``lo`` is a proven lower bound and ``hi`` the best
    achieved value; probes gallop up from ``first`` until one is feasible, then bisect. Every
    probe moves lo or hi strictly onto an event value, so the loop ends with lo == hi. Values at
    or above ``top`` are all equivalent to inf. Returns ``(result, optimum, probe it was found
    at)`` or None when even inf is infeasible.
    """
    lo, hi, best, best_at = 0.0, INF, None, INF
    probe, step = first, 0.0
    while lo < hi:
        feasible, res, val, nxt = check(probe)
        if feasible:
            best, best_at, hi = res, probe, val
        elif probe == INF:
            return None
        else:
            lo = nxt
        if hi == INF:
            step = step * 4 if step else max(lo, top * 1e-9) / 128
            probe = lo + step if lo + step < top else INF
        else:
            probe = lo + (hi - lo) / 2
            if not lo < probe < hi:
                probe = lo
    return (best, hi, best_at) if best is not None else None


def min_bottleneck(ch: Chain, caps: Sequence[float] | None) -> tuple[int, ...] | None:
    """Exact minimum-bottleneck cuts under per-stage caps (tie rule of the module docstring),
    or None when the caps allow no partition. A `search` over stage-time values."""

    def check(B: float):
        feasible, layers, next_b, _ = forward(ch, B, caps)
        if not feasible:
            return False, None, None, next_b
        cuts = reconstruct(ch, layers, B, caps)
        return True, cuts, max(ch.time(a, b) for a, b in zip(cuts, cuts[1:])), None

    pb = ch.pb
    lower = max(max(pb.compute), ch.P[-1] / ch.S) * (1 - 1e-9)
    found = search(check, lower, (ch.P[-1] + 2 * max(ch.c)) * (1 + 1e-6) + 1e-300)
    if found is None:
        return None
    # best was reconstructed under some probe B >= the optimum; it is the smallest (from the end)
    # cut tuple with stage times <= B, so also the smallest among those <= the optimum
    return found[0]


# ----------------------------------------------------------------------------- public solvers


def all_cuts(ch: Chain):
    forced = set(ch.pb.forced)
    free = [k for k in range(1, ch.n) if ch.ok[k] and k not in forced]
    for pick in combinations(free, ch.S - 1 - len(forced)):
        yield (0, *sorted((*pick, *forced)), ch.n)
