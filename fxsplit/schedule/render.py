"""Pictures of schedules: a text grid (rank rows x step columns) and a timeline PNG.

Terms: see ``fxsplit.schedule.ir`` (actions, schedules) and ``fxsplit.schedule.simulate``
(``Timeline``). matplotlib is imported only by ``timeline_png`` (extra ``fxsplit[viz]``).

Representative use::

    print(format_grid(build("1f1b", 4, 8)))           # time-aligned, unit steps
    timeline_png(simulate(schedule), "pipeline.png")   # one row per rank
"""

from __future__ import annotations

import os

from fxsplit.errors import MissingDependencyError
from fxsplit.schedule.ir import format_marked_grid
from fxsplit.schedule.simulate import align_steps

__all__ = ["format_grid", "timeline_png"]


def format_grid(schedule, *, align: bool = True) -> str:
    """Text grid of ``schedule``: one row per rank, one column per step, ``-`` for idle.

    With ``align`` (default) the schedule is first time-aligned as if every action took one step
    (``fxsplit.schedule.simulate.align_steps``), so a column is a moment in time; otherwise the
    lists are shown as given.
    """
    if align:
        schedule = align_steps(schedule)
    return format_marked_grid(schedule)


_KIND_COLORS = {"F": "#1f77b4", "B": "#2ca02c", "I": "#ff7f0e", "W": "#9467bd"}
_KIND_NAMES = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}


def _shade(color: str, microbatch: int, num_microbatches: int) -> tuple[float, float, float]:
    """``color`` lightened towards white for later microbatches (up to 55%)."""
    base = tuple(int(color[i:i + 2], 16) / 255 for i in (1, 3, 5))
    frac = 0.55 * microbatch / max(num_microbatches - 1, 1)
    return tuple(c + (1 - c) * frac for c in base)


def timeline_png(timeline, path: str | os.PathLike, *, title: str | None = None,
                 labels: bool = True, dpi: int = 120) -> str:
    """Draw ``timeline`` (a ``Timeline`` from ``simulate``) to a PNG at ``path``; return the path.

    One row per rank (rank 0 on top), one bar per action colored by kind (F blue, B green,
    I orange, W purple) and lightened for later microbatches; ``labels`` writes ``2F0`` into bars
    wide enough to hold it. The title defaults to the makespan and the three bubble measures.
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingDependencyError(
            "timeline_png needs matplotlib: pip install 'fxsplit[viz]' (or matplotlib>=3.7)"
        ) from exc

    p, makespan = timeline.num_ranks, timeline.makespan
    fig_w = min(max(6.0, 0.35 * len(timeline.events) / max(p, 1)), 40.0)
    fig, ax = plt.subplots(figsize=(fig_w, 0.6 * p + 1.4))
    # A 7-point character is about 4.3 points wide; the axes span about 85% of the figure.
    char_width = 4.3 / (fig_w * 72 * 0.85) * max(makespan, 1e-12)
    try:
        for e in timeline.events:
            kind = e.action.kind.value
            y = p - 1 - e.rank
            color = _shade(_KIND_COLORS[kind], e.action.microbatch, timeline.num_microbatches)
            ax.broken_barh([(e.start, e.end - e.start)], (y - 0.4, 0.8), facecolors=color,
                           edgecolors="black", linewidth=0.4)
            if labels and (e.end - e.start) >= len(str(e.action)) * char_width:
                ax.text((e.start + e.end) / 2, y, str(e.action), ha="center", va="center",
                        fontsize=7, color="black" if sum(color) > 2.0 else "white")
        ax.set_yticks(range(p))
        ax.set_yticklabels([f"rank {r}" for r in reversed(range(p))])
        ax.set_xlim(0, makespan if makespan > 0 else 1)
        ax.set_ylim(-0.6, p - 0.4)
        ax.set_xlabel("time")
        used = sorted({e.action.kind.value for e in timeline.events}, key="FBIW".index)
        ax.legend(handles=[Patch(color=_KIND_COLORS[k], label=_KIND_NAMES[k]) for k in used],
                  loc="upper left", bbox_to_anchor=(1.005, 1.0),
                  fontsize=8, frameon=False)
        ax.set_title(title if title is not None else (
            f"makespan {makespan:g}; bubble: {timeline.bubble_fraction:.1%} of total, "
            f"{timeline.bubble_ratio:.1%} of ideal, {timeline.bubble_active:.1%} in active windows"
        ), fontsize=9, loc="left")
        fig.tight_layout()
        fig.savefig(os.fspath(path), dpi=dpi)
    finally:
        plt.close(fig)
    return os.fspath(path)
