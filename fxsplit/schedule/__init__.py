"""Pipeline schedules as data: IR, builders, validation, simulation and pictures.

No processes and no torch: everything here runs on the host before any process group exists.
Modules: ``ir`` (Action, Schedule, string form), ``builders`` (gpipe, 1f1b, interleaved_1f1b,
zb_h1, zbv), ``dualpipe`` (DualPipeV), ``spec`` (``ScheduleSpec``: what each schedule is, ``build``, ``placement``), ``auto`` (zb_auto, from per-stage
costs and a memory limit), ``validate`` (rules and deadlock check), ``simulate`` (Timeline, bubbles, memory),
``render`` (text grid, PNG). The public facade is ``fxsplit.schedule``.

Representative use::

    from fxsplit import schedule
    s = schedule.build("interleaved_1f1b", num_ranks=4, num_microbatches=6, stages_per_rank=2)
    schedule.validate(s)                      # ScheduleInfo, or ScheduleError with the grid
    t = schedule.simulate(s, forward=1.0, backward=2.0, comm=0.05)
    print(t); print(schedule.format_grid(s)); schedule.timeline_png(t, "pp.png")
    mine = schedule.parse('''0F0 0F1 0B0 0B1
                             -   1F0 1B0 1F1 1B1''')   # a user's own schedule

``SPECS`` is the one registry of schedules: ``fxsplit.plan``, ``parallelize``, the planner, the
split, the CLI and the runtime ask a schedule's ``ScheduleSpec`` (``schedule_spec(name)``) what it
does instead of comparing names (``NAMES`` is its keys).

May import: ``fxsplit.errors`` and the standard library only (no torch, no other layer).
"""

from fxsplit.schedule.builders import gpipe, interleaved_1f1b, one_f_one_b, v_placement, zb_auto, zb_h1, zbv
from fxsplit.schedule.dualpipe import dualpipev
from fxsplit.schedule.ir import (
    Action,
    ActionKind,
    Schedule,
    format_marked_grid,
    format_schedule,
    parse_schedule,
    stage_to_rank,
)
from fxsplit.schedule.render import format_grid, timeline_png
from fxsplit.schedule.simulate import Event, Timeline, align_steps, simulate
from fxsplit.schedule.spec import SCHEDULE_BUILDERS, SPECS, ScheduleSpec, build, placement, schedule_spec
from fxsplit.schedule.validate import ScheduleError, ScheduleInfo, dependencies, validate

parse = parse_schedule
"""Alias of ``parse_schedule``: a ``Schedule`` from its string form or per-rank lists."""

NAMES = tuple(SPECS)
"""Schedule names accepted by ``build`` (and by ``plan`` / ``parallelize`` / the CLI)."""

__all__ = [
    "Action",
    "ActionKind",
    "Event",
    "NAMES",
    "SCHEDULE_BUILDERS",
    "SPECS",
    "ScheduleSpec",
    "Schedule",
    "ScheduleError",
    "ScheduleInfo",
    "Timeline",
    "align_steps",
    "build",
    "dependencies",
    "dualpipev",
    "format_grid",
    "format_marked_grid",
    "format_schedule",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "parse",
    "parse_schedule",
    "placement",
    "schedule_spec",
    "simulate",
    "stage_to_rank",
    "timeline_png",
    "v_placement",
    "validate",
    "zb_auto",
    "zb_h1",
    "zbv",
]
