"""What each registered schedule is, asked by every other layer instead of comparing names.

A :class:`ScheduleSpec` holds a schedule's builder and the facts the planner, the split, the
config and the CLI need about it: how many stages a rank holds by default and which counts it
accepts, where its stages sit (``placement``), whether its backward is split into I and W, whether
it is built from the split's per-stage costs (``zb_auto``, after the split), how many
microbatches' activations a rank holds at its peak (``inflight``: exact, simulated where the
schedule's order decides; ``inflight_bound``: the closed form the planner scores with), and the
closed-form bubble the planner adds to a rank's busy time.

    spec = schedule_spec("interleaved")          # aliases and case are accepted
    v = spec.default_stages_per_rank(pp=4)       # 2
    spec.check_stages_per_rank(1)                # a message, or None when v is fine
    spec.splits_backward                         # False

Registering a schedule (``SPECS``) is the one place a name is known; ``NAMES`` and
``SCHEDULE_BUILDERS`` are derived from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from fxsplit.schedule.builders import (check_sizes, gpipe, interleaved_1f1b, one_f_one_b, v_placement, zb_auto,
                                      zb_h1, zbv)
from fxsplit.schedule.dualpipe import dualpipev
from fxsplit.schedule.ir import Schedule
from fxsplit.errors import ScheduleError

__all__ = ["ScheduleSpec", "SPECS", "SCHEDULE_BUILDERS", "schedule_spec", "build", "placement", "inflight_1f1b",
           "inflight_gpipe"]


def inflight_1f1b(num_ranks: int, stages_per_rank: int = 1) -> tuple[float, ...]:
    """Peak in-flight microbatches per rank for 1F1B (``v == 1``: ``p - r``) and Megatron's
    interleaved 1F1B (``v > 1``: ``((p-r-1)*2 + (v-1)*p + 1) / v``), in units of the rank's share."""
    p, v = num_ranks, stages_per_rank
    if v == 1:
        return tuple(float(p - r) for r in range(p))
    return tuple(((p - r - 1) * 2 + (v - 1) * p + 1) / v for r in range(p))


def inflight_gpipe(num_ranks: int, num_microbatches: int) -> tuple[float, ...]:
    """GPipe keeps every microbatch's activations until the backward pass: ``m`` on every rank."""
    return tuple(float(num_microbatches) for _ in range(num_ranks))


def _one(v: int) -> str | None:
    return None if v == 1 else "runs one stage per rank"


def _two(v: int) -> str | None:
    return None if v == 2 else "places exactly 2 stages per rank in a V"


def _at_least_two(v: int) -> str | None:
    return None if v >= 2 else "needs stages_per_rank >= 2"


def _any(v: int) -> str | None:
    return None if v >= 1 else "needs stages_per_rank >= 1"


@dataclass(frozen=True)
class ScheduleSpec:
    """One registered schedule; see the module docstring.

    ``inflight_rule`` names how a rank's peak of in-flight microbatches is found: ``"all"`` (every
    microbatch, GPipe), ``"1f1b"`` (Megatron's closed form), ``"simulated"`` (the schedule's own
    order, walked), ``"p"`` (``min(p, m)``: a cost-built zero-bubble schedule fitted to hold p).
    ``bubble_rule`` names the planner's closed-form bubble: ``"1f1b"`` ``(p-1)(f+i+w)/v``,
    ``"zb_h1"`` ``(p-1) max(f+i-w, 0)``, ``"zbv"`` ``max((p-1)(f+i-2w), (p-1) f/2)``, ``"dualpipev"``
    ``(p-1) max(f, f+i-w) / 2``, where f, i, w
    are a rank's share of the largest stage's forward, input-gradient and weight-gradient times.
    """

    name: str
    builder: Callable[..., Schedule]
    stages_rule: Callable[[int], str | None]  # a reason v does not fit, else None
    default_v: int  # stages per rank when the user gives none and pp > 1
    splits_backward: bool = False  # backward as I (input gradients) and W (weight gradients)
    built_from_costs: bool = False  # built after the split, from its per-stage costs
    inflight_rule: str = "1f1b"
    bubble_rule: str = "1f1b"
    single_rank: str | None = None  # the schedule it runs as with one pipeline rank, if another
    aliases: tuple[str, ...] = field(default=())
    v_placement: bool = False  # stage s on rank s for s < p and 2p-1-s after (a V), not s % p
    stages_fix: str = ""  # what to do when ``stages_rule`` refuses a count
    pairs_f_and_b: bool = False  # steady state pairs one microbatch's F with another's B on a rank

    def paired_fraction(self, p: int, m: int) -> float:
        """The share of a rank's forwards run in an F&B pair (0 for schedules that pair none): for
        DualPipeV, rank 0's m - 2p + 1 steps of two pairs over its 2m forwards ([Note: DualPipeV];
        rank 0 pairs the fewest, so the planner's overlap is not overstated on any rank)."""
        if not self.pairs_f_and_b or p < 2 or m <= 0:
            return 0.0
        return max(m - 2 * p + 1, 0) / m

    def default_stages_per_rank(self, pp: int) -> int:
        """Stages per rank when none is given: ``default_v`` with a pipeline, 1 without one (a
        V placement has 2 stages on one rank too)."""
        return self.default_v if (pp > 1 or self.v_placement) else 1

    def check_stages_per_rank(self, v: int) -> str | None:
        """Why ``v`` stages per rank cannot run this schedule (one phrase), or None."""
        return self.stages_rule(v)

    def placement(self, num_ranks: int, stages_per_rank: int) -> tuple[int, ...]:
        """The stage -> rank map: ``s % p`` (rank r holds r, r+p, ...), or the V."""
        if self.v_placement:
            reason = self.check_stages_per_rank(stages_per_rank)
            if reason:
                raise ScheduleError(f"{self.name} {reason}, got stages_per_rank={stages_per_rank}")
            return v_placement(num_ranks)
        return tuple(s % num_ranks for s in range(num_ranks * stages_per_rank))

    @property
    def order_decides_inflight(self) -> bool:
        """Whether a rank's peak of in-flight microbatches is found by walking this schedule's
        order (``inflight_rule == "simulated"``: the zero-bubble schedules), not by a formula."""
        return self.inflight_rule == "simulated"

    def inflight(self, p: int, v: int, m: int | None) -> tuple[float, ...]:
        """Peak in-flight microbatches per rank, in units of the rank's activation share per
        microbatch; the zero-bubble orders are simulated (m defaults to 2p there)."""
        if self.inflight_rule == "all":
            return inflight_gpipe(p, m or p)
        if self.inflight_rule == "p":
            return tuple(float(min(p, m or p)) for _ in range(p))
        if self.inflight_rule == "simulated":
            from fxsplit.schedule.simulate import simulate

            return simulate(self.builder(p, m or 2 * p, v)).peak_inflight
        return inflight_1f1b(p, v)

    def inflight_bound(self, p: int, v: int, m: int) -> tuple[float, ...]:
        """The planner's closed form of ``inflight`` (no simulation): 1F1B's formula capped at m,
        else ``min(p, m)`` on every rank (what ZB-H1's delayed W and ZB-V hold for m >= 2p)."""
        if p == 1:
            return (1.0,)
        if self.inflight_rule == "all":
            return inflight_gpipe(p, m)
        if self.inflight_rule == "1f1b":
            return tuple(min(x, m) for x in inflight_1f1b(p, v))
        return tuple(float(min(p, m)) for _ in range(p))

    def bubble(self, p: int, v: int, f: float, i: float, w: float) -> float:
        """The planner's closed-form idle time of the busiest rank; see the class docstring."""
        if self.bubble_rule == "zb_h1":
            return (p - 1) * max(f + i - w, 0.0)
        if self.bubble_rule == "zbv":
            return max((p - 1) * (f + i - 2 * w), (p - 1) * f / 2)
        if self.bubble_rule == "dualpipev":  # exact when I <= W; below the simulated idle by < 1/3 otherwise (tests)
            return (p - 1) * max(f, f + i - w) / 2
        return (p - 1) * (f + i + w) / v

    def bubble_floor(self, p: int, v: int, f: float, busy: float) -> float:
        """The least :meth:`bubble` can be for a rank whose share of the forward is ``f`` and of
        the forward and both backward halves ``busy``, however that work splits into I and W:
        ``bubble`` with the terms a larger W can cancel left out (ZB-H1's none, ZB-V's and
        DualPipeV's ``(p-1) f / 2``); a bubble that grows with every cost is ``bubble`` itself."""
        if self.bubble_rule == "zb_h1":
            return 0.0
        if self.bubble_rule in ("zbv", "dualpipev"):
            return (p - 1) * f / 2
        return (p - 1) * busy / v


SPECS: dict[str, ScheduleSpec] = {s.name: s for s in (
    ScheduleSpec("gpipe", gpipe, _any, 1, inflight_rule="all", stages_fix="give stages_per_rank >= 1"),
    ScheduleSpec("1f1b", one_f_one_b, _any, 1, aliases=("one_f_one_b",), stages_fix="give stages_per_rank >= 1"),
    ScheduleSpec("interleaved_1f1b", interleaved_1f1b, _at_least_two, 2, single_rank="1f1b",
                 aliases=("interleaved",), stages_fix="use schedule='1f1b' for one stage per rank"),
    ScheduleSpec("zb_h1", zb_h1, _one, 1, splits_backward=True, inflight_rule="simulated", bubble_rule="zb_h1",
                 aliases=("zbh1",), stages_fix="use schedule='zbv' for two"),
    ScheduleSpec("zbv", zbv, _two, 2, splits_backward=True, inflight_rule="simulated", bubble_rule="zbv",
                 aliases=("zb_v",), v_placement=True, stages_fix="leave stages_per_rank unset"),
    ScheduleSpec("dualpipev", dualpipev, _two, 2, splits_backward=True, inflight_rule="simulated",
                 bubble_rule="dualpipev", aliases=("dualpipe_v",), v_placement=True,
                 stages_fix="leave stages_per_rank unset", pairs_f_and_b=True),
    ScheduleSpec("zb_auto", zb_auto, _one, 1, splits_backward=True, built_from_costs=True, inflight_rule="p",
                 bubble_rule="zb_h1", stages_fix="use schedule='zbv' for two"),
)}
"""Every schedule fxsplit knows, by canonical name."""

_ALIASES = {a: s.name for s in SPECS.values() for a in s.aliases}


def schedule_spec(name: str) -> ScheduleSpec:
    """The spec of schedule ``name`` (case-insensitive; ``-`` reads as ``_``; aliases such as
    ``interleaved`` and ``zb_v`` accepted); ScheduleError names the valid names otherwise."""
    key = name.lower().replace("-", "_") if isinstance(name, str) else name
    key = _ALIASES.get(key, key)
    if key not in SPECS:
        raise ScheduleError(f"unknown schedule {name!r}; valid names: {', '.join(SPECS)}")
    return SPECS[key]


SCHEDULE_BUILDERS: dict[str, Callable[..., Schedule]] = {name: s.builder for name, s in SPECS.items()}
"""Canonical name -> builder, derived from ``SPECS``."""


def placement(name: str, num_ranks: int, stages_per_rank: int | None = None) -> tuple[int, ...]:
    """The stage -> rank map schedule ``name`` runs with: ``s % p`` (rank r holds r, r+p, ...)
    for every schedule but ``zbv``, whose V puts stage s on rank s for s < p and on 2p-1-s after.
    The plan carries it (``Plan.stage_ranks``): the split balances rank memory with it, and the
    communication plan and the runtime place stages by it."""
    spec = schedule_spec(name)
    if stages_per_rank is None:
        stages_per_rank = spec.default_stages_per_rank(num_ranks)
    check_sizes(spec.name, num_ranks, 1, stages_per_rank)
    return spec.placement(num_ranks, stages_per_rank)


def build(name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int | None = None,
          **options) -> Schedule:
    """Build the named schedule; ``name`` is one of ``SPECS`` (case-insensitive, aliases accepted).

    ``stages_per_rank`` defaults to the spec's (2 for ``zbv``, its only value, else 1). ``options``
    go to the builder, e.g. ``remainder="pad"`` for ``interleaved_1f1b``.
    """
    spec = schedule_spec(name)
    if stages_per_rank is None:
        stages_per_rank = 2 if spec.v_placement else 1
    return spec.builder(num_ranks, num_microbatches, stages_per_rank, **options)
