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
