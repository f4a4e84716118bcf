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

__all__ = ["format_grid", "time_scale", "timeline_figure", "timeline_png"]


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


_SECOND_SCALES = ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns"))
_MAX_WIDTH_IN = 20.0  # wider PNGs are scaled down by every viewer until nothing is legible
_MIN_WIDTH_IN = 6.0


def time_scale(makespan: float, unit: str) -> tuple[float, str]:
    """(divisor, axis label) for a time axis: seconds are shown in s, ms, µs or ns, whichever keeps
    the makespan between 1 and 1000; any other unit (e.g. "unit costs") is shown as is."""
    if unit != "s":
        return 1.0, f"time ({unit})"
    for scale, name in _SECOND_SCALES:
        if makespan >= scale or scale == _SECOND_SCALES[-1][0]:
            return scale, f"time ({name})"
    return 1.0, "time (s)"  # pragma: no cover - the loop always returns


def timeline_png(timeline, path: str | os.PathLike, *, title: str | None = None, unit: str = "unit costs",
                 labels: bool = True, dpi: int = 120) -> str:
    """Draw ``timeline`` (a ``Timeline`` from ``simulate``) to a PNG at ``path``; return the path.

    One row per rank (rank 0 on top), one bar per action colored by kind (F blue, B green,
    I orange, W purple) and lightened for later microbatches; ``labels`` writes ``2F0`` into each
    bar whose rendered label fits inside it. ``unit``: what the simulated times are in, "s" for
    seconds (shown in s, ms, µs or ns) or a name such as "unit costs" (the axis is labelled with
    it). The figure is at most 20 inches wide at ``dpi``, the time ticks spaced so that their
    labels never overlap. The title defaults to the makespan and the three bubble measures.
    """
    try:
        import matplotlib  # noqa: F401  (checked here so the error names the extra)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingDependencyError(
            "timeline_png needs matplotlib: pip install 'fxsplit[viz]' (or matplotlib>=3.7)"
        ) from exc

    fig = timeline_figure(timeline, title=title, unit=unit, labels=labels)
    try:
        fig.savefig(os.fspath(path), dpi=dpi)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return os.fspath(path)


def timeline_figure(timeline, *, title: str | None = None, unit: str = "unit costs", labels: bool = True):
    """The matplotlib Figure :func:`timeline_png` saves (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    p, makespan = timeline.num_ranks, timeline.makespan
    scale, xlabel = time_scale(makespan, unit)
    fig_w = _width_in(timeline)
    fig, ax = plt.subplots(figsize=(fig_w, 0.5 * p + 1.6))
    bars = _draw_bars(ax, timeline, p, scale)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {r}" for r in reversed(range(p))])
    ax.set_xlim(0, makespan / scale if makespan > 0 else 1)
    ax.set_ylim(-0.6, p - 0.4)
    # about one tick per inch: a label of 6 digits at 9 points is under half an inch
    ax.xaxis.set_major_locator(MaxNLocator(nbins=max(3, int(fig_w * 0.9)), steps=[1, 2, 2.5, 5, 10]))
    ax.ticklabel_format(axis="x", style="plain", useOffset=False)
    ax.set_xlabel(xlabel)
    used = sorted({e.action.kind.value for e in timeline.events}, key="FBIW".index)
    ax.legend(handles=[Patch(color=_KIND_COLORS[k], label=_KIND_NAMES[k]) for k in used],
              loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False,
              title="later microbatches\nlighter", title_fontsize=7)
    ax.set_title(title if title is not None else (
        f"makespan {makespan / scale:g} {xlabel[6:-1]}; bubble: {timeline.bubble_fraction:.1%} of total, "
        f"{timeline.bubble_ratio:.1%} of ideal, {timeline.bubble_active:.1%} in active windows"
    ), fontsize=9, loc="left")
    fig.tight_layout()
    if labels:
        _label_bars(ax, fig, bars)
    return fig


def _width_in(timeline) -> float:
    """Wide enough that a short bar (the 25th percentile of durations) is a quarter inch, room for
    a label such as ``3B1`` at 7 points, within 6 to 20 inches (the axes are about 80% of it)."""
    durations = sorted(e.end - e.start for e in timeline.events if e.end > e.start)
    short = durations[len(durations) // 4] if durations else 0.0
    by_labels = 0.25 * timeline.makespan / short / 0.8 if short > 0 else 0.0
    by_count = 0.35 * len(timeline.events) / max(timeline.num_ranks, 1)
    return min(max(_MIN_WIDTH_IN, by_labels, by_count), _MAX_WIDTH_IN)


def _draw_bars(ax, timeline, p: int, scale: float) -> list:
    """One bar per event; returns (event, y, color) for labelling once the layout is fixed."""
    bars = []
    for e in timeline.events:
        y = p - 1 - e.rank
        color = _shade(_KIND_COLORS[e.action.kind.value], e.action.microbatch, timeline.num_microbatches)
        ax.broken_barh([(e.start / scale, (e.end - e.start) / scale)], (y - 0.4, 0.8), facecolors=color,
                       edgecolors="black", linewidth=0.4)
        bars.append((e, y, color, scale))
    return bars


def _label_bars(ax, fig, bars) -> None:
    """Write each action's name into its bar, then remove every label wider than its bar as drawn
    (measured by the renderer at the final layout, so no label spills over a neighbour)."""
    renderer = fig.canvas.get_renderer()
    to_px = ax.transData
    for e, y, color, scale in bars:
        x0, _ = to_px.transform((e.start / scale, y))
        x1, _ = to_px.transform((e.end / scale, y))
        if x1 - x0 < 12:  # narrower than any label
            continue
        text = ax.text((e.start + e.end) / 2 / scale, y, str(e.action), ha="center", va="center", fontsize=7,
                       color="black" if sum(color) > 2.0 else "white")
        if text.get_window_extent(renderer).width > (x1 - x0) - 2:
            text.remove()
