"""Every benchmark script with a command line starts: ``--help`` parses its arguments, which
evaluates their defaults and the module's imports (a benchmark that no test runs otherwise broke
that way: ``memory_truth.py``'s default read a name it no longer imported). One process, no run."""

import contextlib
import io
import runpy
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_") and "add_argument" in p.read_text())


def test_there_are_benchmarks_to_check():
    assert len(SCRIPTS) >= 10, [p.name for p in SCRIPTS]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_runs(script, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import their _common helpers
    out = io.StringIO()
    with pytest.raises(SystemExit) as exit_, contextlib.redirect_stdout(out):
        runpy.run_path(str(script), run_name="__main__")
    assert exit_.value.code in (0, None), out.getvalue()
    assert "usage:" in out.getvalue()


def test_gpu_profile_help_runs():
    # the GPU-only profiling entry (run on a lent device, not in the suite): it parses and imports
    from fxsplit.testing import gpu_profile

    out = io.StringIO()
    with pytest.raises(SystemExit) as exit_, contextlib.redirect_stdout(out):
        gpu_profile.main(["--help"])
    assert exit_.value.code == 0 and "--steps" in out.getvalue()
