"""Pictures: the text grid and the timeline PNG; the public facade fxsplit.schedule."""

from fxsplit import schedule as schedules
from fxsplit.schedule import build, format_grid, format_marked_grid, simulate, timeline_png


def test_format_grid_aligned_and_raw():
    s = build("1f1b", 2, 2)
    assert format_grid(s) == (
        "step   |   0     1     2     3     4     5\n"
        "--------------------------------------------\n"
        "rank 0 |  0F0   0F1    -    0B0    -    0B1\n"
        "rank 1 |   -    1F0   1B0   1F1   1B1"
    )
    raw = format_grid(s, align=False).split("\n")
    assert raw[2] == "rank 0 |  0F0   0F1   0B0   0B1"
    assert format_marked_grid(s, [(1, 2)]).split("\n")[3] == "rank 1 |  1F0   1B0  [1F1]  1B1"


def test_timeline_png_is_written(tmp_path):
    for name, v in [("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2), ("zb_auto", 1)]:
        t = simulate(build(name, 3, 4, v), comm=0.05)
        path = tmp_path / f"{name}.png"
        assert timeline_png(t, path) == str(path)
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_facade():
    s = schedules.parse("0F0 0B0\n1F0 1B0")
    assert schedules.validate(s).num_stages == 2
    assert schedules.simulate(s).makespan == 6.0
    assert schedules.format_schedule(s) == "0F0 0B0\n1F0 1B0"
    assert str(schedules.Action.parse("2F0")) == "2F0"
    assert schedules.build("gpipe", 2, 2) == schedules.gpipe(2, 2)
    assert schedules.stage_to_rank(5, 2) == 1
    assert schedules.build("zbv", 2, 4) == schedules.zbv(2, 4)
    grid = format_grid(schedules.zbv(2, 3)).split("\n")
    assert grid[2].startswith("rank 0 |  0F0   0F1   0F2   3F0   3I0   3W0")


def test_time_axis_units():
    from fxsplit.schedule.render import time_scale

    assert time_scale(1.5e-6, "s") == (1e-6, "time (µs)")
    assert time_scale(0.25, "s") == (1e-3, "time (ms)")
    assert time_scale(12.0, "s") == (1.0, "time (s)")
    assert time_scale(3e-11, "s") == (1e-9, "time (ns)")
    assert time_scale(40.0, "unit costs") == (1.0, "time (unit costs)")


def _scaled(timeline, factor):
    """``timeline`` with every time multiplied by ``factor`` (simulated seconds)."""
    import dataclasses

    events = [dataclasses.replace(e, start=e.start * factor, end=e.end * factor) for e in timeline.events]
    return dataclasses.replace(timeline, events=events, makespan=timeline.makespan * factor)


def test_timeline_ticks_do_not_overlap_and_labels_fit_at_every_size():
    """A small and a large plan, in seconds: the axis names its unit, tick labels never overlap,
    every bar label lies inside its bar, the figure is at most 20 inches wide."""
    import matplotlib.pyplot as plt

    from fxsplit.schedule.render import timeline_figure

    cases = [(simulate(build("1f1b", 2, 2)), 1.3e-7),
             (simulate(build("interleaved_1f1b", 8, 32, 2), comm=0.05), 2e-4)]
    for timeline, factor in cases:
        scaled = _scaled(timeline, factor)
        fig = timeline_figure(scaled, unit="s")
        try:
            fig.canvas.draw()
            renderer = fig.canvas.get_renderer()
            ax = fig.axes[0]
            assert fig.get_size_inches()[0] <= 20.0
            assert ax.get_xlabel() in ("time (µs)", "time (ms)"), ax.get_xlabel()
            scale = 1e-6 if ax.get_xlabel() == "time (µs)" else 1e-3
            ticks = sorted((t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()),
                           key=lambda b: b.x0)
            assert len(ticks) >= 3
            assert all(a.x1 < b.x0 for a, b in zip(ticks, ticks[1:])), [(b.x0, b.x1) for b in ticks]
            assert not ax.xaxis.get_offset_text().get_text()  # no "1e-6" floating at the axis end
            bars = {str(e.action): e for e in scaled.events}
            for text in ax.texts:  # each label inside its own bar
                box, e = text.get_window_extent(renderer), bars[text.get_text()]
                x0 = ax.transData.transform((e.start / scale, 0))[0]
                x1 = ax.transData.transform((e.end / scale, 0))[0]
                assert x0 <= box.x0 and box.x1 <= x1, (text.get_text(), box.x0, box.x1, x0, x1)
        finally:
            plt.close(fig)
