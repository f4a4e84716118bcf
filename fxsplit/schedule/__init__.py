"""Pipeline schedules as data: IR, builders, validation, simulation and pictures.

No processes and no torch: everything here runs on the host before any process group exists.
Modules: ``ir`` (Action, Schedule, string form), ``builders`` (gpipe, 1f1b, interleaved_1f1b,
zb_h1), ``validate`` (rules and deadlock check), ``simulate`` (Timeline, bubbles, memory),
``render`` (text grid, PNG). The public facade is ``fxsplit.schedules``.
"""

from fxsplit.schedule.builders import (
    SCHEDULE_BUILDERS,
    build,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zb_h1,
)
from fxsplit.schedule.ir import (
    Action,
    ActionKind,
    Schedule,
    format_schedule,
    parse_schedule,
    stage_to_rank,
)
from fxsplit.schedule.render import format_grid, format_marked_grid, timeline_png
from fxsplit.schedule.simulate import Event, Timeline, align_steps, simulate
from fxsplit.schedule.validate import ScheduleError, ScheduleInfo, dependencies, validate

__all__ = [
    "Action",
    "ActionKind",
    "Event",
    "SCHEDULE_BUILDERS",
    "Schedule",
    "ScheduleError",
    "ScheduleInfo",
    "Timeline",
    "align_steps",
    "build",
    "dependencies",
    "format_grid",
    "format_marked_grid",
    "format_schedule",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "parse_schedule",
    "simulate",
    "stage_to_rank",
    "timeline_png",
    "validate",
    "zb_h1",
]
