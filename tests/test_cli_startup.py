"""The command line starts fast and fails early: ``fxsplit --help`` and ``fxsplit schedule`` import
no torch ([Note: lazy package attributes] in fxsplit/__init__.py); a missing optional dependency
is reported before the model is loaded."""

import subprocess
import sys
from pathlib import Path

import fxsplit.cli as cli

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import sys
from fxsplit.cli import main
import fxsplit
code = main(sys.argv[1:])
print("exit", code, "torch imported:", "torch" in sys.modules)
"""


def _probe(*argv):
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[-1]


def test_help_and_schedule_import_no_torch():
    assert _probe("--help") == "exit 0 torch imported: False"
    assert _probe("plan", "--help") == "exit 0 torch imported: False"
    assert _probe("schedule", "1f1b", "--pp", "2", "--microbatches", "4") == "exit 0 torch imported: False"


def test_python_dash_m_help_imports_no_torch():
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "fxsplit", "--help"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and "usage: fxsplit" in done.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert "fxsplit.cli" in imported and "torch" not in imported


def test_missing_matplotlib_is_reported_before_the_model_loads(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec -> None: not installed
    # the factory file does not exist: reaching it would be a usage error (exit 2), not this one
    code = cli.main(["plan", str(tmp_path / "absent.py:build"), "--timeline", str(tmp_path / "t.png")])
    err = capsys.readouterr().err
    assert code == cli.EXIT_FAILURE, err
    assert "--timeline needs matplotlib" in err and "pip install -e '.[viz]'" in err
    assert not (tmp_path / "t.png").exists()
    code = cli.main(["schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--timeline", str(tmp_path / "t.png")])
    assert code == cli.EXIT_FAILURE and "matplotlib" in capsys.readouterr().err


def test_package_attributes_load_on_first_use():
    code = ("import sys, fxsplit; a = 'torch' in sys.modules; names = fxsplit.schedule.NAMES; "
            "b = 'torch' in sys.modules; fxsplit.plan; c = 'torch' in sys.modules; "
            "print(a, b, c, hasattr(fxsplit, 'no_such_name'), set(fxsplit.__all__) <= set(dir(fxsplit)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.stdout.split() == ["False", "False", "True", "False", "True"], done.stderr
