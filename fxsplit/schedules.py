"""Public facade for pipeline schedules: build, validate, simulate and draw them.

Terms (see DESIGN.md): p pipeline ranks, v stages per rank (rank r holds stages r, r+p, ...),
m microbatches; an action ``2F0`` / ``2B0`` / ``2I0`` / ``2W0``; a schedule is one list of actions
per rank (``None`` idle). Everything is pure data: no processes, no torch.

Representative use::

    from fxsplit import schedules
    s = schedules.build("interleaved_1f1b", num_ranks=4, num_microbatches=6, stages_per_rank=2)
    schedules.validate(s)                      # ScheduleInfo, or ScheduleError with the grid
    t = schedules.simulate(s, forward=1.0, backward=2.0, comm=0.05)
    print(t); print(schedules.format_grid(s)); schedules.timeline_png(t, "pp.png")
    mine = schedules.parse('''0F0 0F1 0B0 0B1
                              -   1F0 1B0 1F1 1B1''')   # a user's own schedule

The implementation lives in ``fxsplit.schedule`` (ir, builders, validate, simulate, render).
"""

from fxsplit.schedule import (
    SCHEDULE_BUILDERS,
    Action,
    ActionKind,
    Event,
    Schedule,
    ScheduleError,
    ScheduleInfo,
    Timeline,
    align_steps,
    build,
    dependencies,
    format_grid,
    format_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    parse_schedule,
    simulate,
    stage_to_rank,
    timeline_png,
    validate,
    zb_h1,
)

parse = parse_schedule
"""Alias of ``parse_schedule``: a ``Schedule`` from its string form or per-rank lists."""

NAMES = tuple(SCHEDULE_BUILDERS)
"""Schedule names accepted by ``build``."""

__all__ = [
    "Action",
    "ActionKind",
    "Event",
    "NAMES",
    "Schedule",
    "ScheduleError",
    "ScheduleInfo",
    "Timeline",
    "align_steps",
    "build",
    "dependencies",
    "format_grid",
    "format_schedule",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "parse",
    "parse_schedule",
    "simulate",
    "stage_to_rank",
    "timeline_png",
    "validate",
    "zb_h1",
]
