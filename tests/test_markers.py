"""[Note: the dist marker] in tests/conftest.py, read from the source: every test that reaches a
launch (``run_distributed``, a ``torchrun`` / ``torch.distributed.run`` command, a non-threaded
``init_process_group``; tp ranks as threads, tests/tp_threaded.py, are no launch), directly, through a function of its own module or through a fixture of
its module, is marked ``dist``. Catches what the run-time guard cannot see: tests that skip here
(no GPU) or that a ``-k`` filter left out."""

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
LAUNCH_NAMES = {"run_distributed", "init_process_group"}
LAUNCH_STRINGS = ("torch.distributed.run", "torchrun")


def _marks(decorators) -> set[str]:
    out = set()
    for d in decorators:
        node = d.func if isinstance(d, ast.Call) else d
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "mark":
            out.add(node.attr)
    return out


def _module_marks(tree) -> set[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            return {v.attr for v in values if isinstance(v, ast.Attribute)}
    return set()


def _launches_directly(fn) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and node.id in LAUNCH_NAMES:
            return True
        if isinstance(node, ast.Attribute) and node.attr in LAUNCH_NAMES:
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.rsplit("/", 1)[-1] in LAUNCH_STRINGS:
            return True  # a command word of a launcher (not a message that mentions one)
    return False


def _names_used(fn) -> set[str]:
    out = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
    return out | {a.arg for a in fn.args.args}  # fixtures arrive as arguments


def unmarked_launches(path: Path) -> list[str]:
    """Test functions of ``path`` that reach a launch and carry no dist marker."""
    tree = ast.parse(path.read_text())
    if "dist" in _module_marks(tree):
        return []
    funcs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    launching = {name for name, fn in funcs.items() if _launches_directly(fn)}
    changed = True
    while changed:  # a module function or fixture that calls (or asks for) a launching one launches
        changed = False
        for name, fn in funcs.items():
            if name not in launching and _names_used(fn) & launching:
                launching.add(name)
                changed = True
    return [f"{path.name}::{name}" for name, fn in funcs.items()
            if name.startswith("test_") and name in launching and "dist" not in _marks(fn.decorator_list)]


def test_every_test_that_launches_is_marked_dist():
    found = [t for path in sorted(TESTS.glob("test_*.py")) if path.name != "test_markers.py"
             for t in unmarked_launches(path)]
    assert not found, f"tests that start a process group without @pytest.mark.dist: {found}"


def test_the_scan_sees_a_launch_through_a_fixture(tmp_path):
    src = ("import pytest\nfrom fxsplit.testing import run_distributed\n"
           "@pytest.fixture(scope='module')\ndef ranks():\n    return run_distributed(f, 2)\n"
           "def test_a(ranks):\n    pass\n"
           "@pytest.mark.dist\ndef test_b(ranks):\n    pass\n"
           "def test_c():\n    import subprocess\n    subprocess.run(['python', '-m', 'torch.distributed.run', 'x.py'])\n"
           "def test_d():\n    pass\n")
    (tmp_path / "test_x.py").write_text(src)
    assert unmarked_launches(tmp_path / "test_x.py") == ["test_x.py::test_a", "test_x.py::test_c"]


def _rank(rank, world):
    return rank


def test_a_launch_in_an_unmarked_test_fails_at_run_time():
    """This test has no dist marker: tests/conftest.py refuses each entry point before it starts
    anything (were the guard gone, the launch would run and pytest.raises fail)."""
    import subprocess
    import sys

    import torch.distributed as dist

    from fxsplit.testing import run_distributed

    refused = pytest.raises(pytest.fail.Exception, match="is not marked @pytest.mark.dist")
    with refused:
        run_distributed(_rank, 2, timeout=60)
    with refused:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--help"], capture_output=True, timeout=60)
    try:
        with refused:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
