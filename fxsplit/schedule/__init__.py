"""Pipeline schedules as data: IR, builders, validation, simulation and pictures.

No processes and no torch: everything here runs on the host before any process group exists.
"""

from fxsplit.schedule.ir import (
    Action,
    ActionKind,
    Schedule,
    format_schedule,
    parse_schedule,
    stage_to_rank,
)

__all__ = [
    "Action",
    "ActionKind",
    "Schedule",
    "format_schedule",
    "parse_schedule",
    "stage_to_rank",
]
