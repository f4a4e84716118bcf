"""The package installs as declared: fxsplit.passes is mapped from passes/, in a wheel too."""

import pathlib
import subprocess
import sys
import zipfile

import pytest

import fxsplit

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_editable_install_maps_passes_folder():
    import fxsplit.passes
    import fxsplit.passes.pipeline_split

    assert pathlib.Path(fxsplit.passes.__file__).parent == ROOT / "passes"
    assert fxsplit.passes.pipeline_split.pipeline_split.__name__ == "pipeline_split"


def test_every_subpackage_is_declared_in_pyproject():
    import tomllib

    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"fxsplit"} | {
        "fxsplit." + p.parent.relative_to(ROOT / "fxsplit").as_posix().replace("/", ".")
        for p in (ROOT / "fxsplit").rglob("__init__.py")
        if p.parent != ROOT / "fxsplit"
    } | {"fxsplit.passes"}
    assert found == declared, f"pyproject packages {sorted(declared)} != found {sorted(found)}"


@pytest.mark.slow
def test_built_wheel_contains_passes_as_subpackage(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )
    wheel = next(tmp_path.glob("fxsplit-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "fxsplit/passes/pipeline_split.py" in names
    assert "fxsplit/schedule/builders.py" in names and "fxsplit/runtime/executor.py" in names
    assert not any(n.startswith("passes/") for n in names)
    # the wheel imports: install it into a throwaway target and import from there
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    code = "import fxsplit, fxsplit.passes.pipeline_split as p; print(fxsplit.__file__)"
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert str(target) in out.stdout
