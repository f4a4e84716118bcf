"""The built-in passes (``passes/*.py``, shipped as ``fxsplit.passes``) use only fxsplit's public
API, exactly as a user's pass would: they may import ``fxsplit``, the modules listed in
``fxsplit.PUBLIC_MODULES`` and each other, and never a name starting with "_"."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from collections.abc import Iterable
from pathlib import Path

import pytest

import fxsplit

PASSES_DIR = Path(__file__).resolve().parents[1] / "passes"
PASSES_PACKAGE = "fxsplit.passes"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def fxsplit_module_names() -> set[str]:
    """Every module of the installed fxsplit package (``fxsplit.stage``, ``fxsplit.schedule.ir``...)."""
    names = {"fxsplit"}
    for info in pkgutil.walk_packages(fxsplit.__path__, prefix="fxsplit.", onerror=lambda _: None):
        names.add(info.name)
    return names


def boundary_violations(
    source: str,
    public_modules: Iterable[str],
    known_modules: Iterable[str],
    *,
    filename: str = "<source>",
    package: str = PASSES_PACKAGE,
) -> list[str]:
    """Lines ``file:line: what`` for every way ``source`` reaches past fxsplit's public API.

    Allowed: ``fxsplit`` itself, ``public_modules``, modules of ``package`` (sibling passes,
    which are checked too). Forbidden: other fxsplit modules from ``known_modules`` (by import,
    ``from fxsplit import module`` or attribute access ``fxsplit.module``), star imports from
    fxsplit, and any imported or accessed name starting with a single "_".
    """
    public = set(public_modules) | {"fxsplit"}
    known = set(known_modules)
    tree = ast.parse(source, filename)
    found: dict[tuple[int, str], str] = {}
    aliases: dict[str, str] = {}  # local name -> fxsplit module it is bound to

    def flag(line: int, key: str, text: str) -> None:
        found.setdefault((line, key), f"{filename}:{line}: {text}")

    def is_fxsplit(module: str) -> bool:
        return module == "fxsplit" or module.startswith("fxsplit.")

    def check_module(line: int, module: str) -> None:
        parts = module.split(".")
        if any(_private(p) for p in parts):
            flag(line, module, f"uses private module {module!r}; use the public API instead")
        elif module in public or module == package or module.startswith(package + "."):
            return
        elif module in known or not _is_attribute_of_known(module):
            flag(
                line, module,
                f"uses {module!r}, which is not a public fxsplit module; import from fxsplit or "
                f"one of fxsplit.PUBLIC_MODULES {sorted(public)}, or ask for it to be made public",
            )

    def _is_attribute_of_known(module: str) -> bool:
        # "fxsplit.pass_api.PassResult" is an attribute of a module, not a module
        return module.rpartition(".")[0] in known

    def resolve(node: ast.ImportFrom) -> str | None:
        if node.level == 0:
            return node.module
        base = package.split(".")
        if node.level > 1:
            base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if is_fxsplit(a.name):
                    check_module(node.lineno, a.name)
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        aliases[a.name.split(".")[0]] = "fxsplit"
        elif isinstance(node, ast.ImportFrom):
            module = resolve(node)
            if module is None or not is_fxsplit(module):
                continue
            check_module(node.lineno, module)
            for a in node.names:
                if a.name == "*":
                    flag(node.lineno, module + ".*", f"star import from {module!r}; import names")
                    continue
                full = f"{module}.{a.name}"
                if _private(a.name):
                    flag(node.lineno, full, f"imports private name {a.name!r} from {module!r}")
                elif full in known:
                    check_module(node.lineno, full)
                    aliases[a.asname or a.name] = full
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain = []
        cur: ast.AST = node
        while isinstance(cur, ast.Attribute):
            chain.append(cur.attr)
            cur = cur.value
        if not isinstance(cur, ast.Name) or cur.id not in aliases:
            continue
        chain.reverse()
        dotted = aliases[cur.id]
        for attr in chain:
            if _private(attr):
                flag(node.lineno, f"{dotted}.{attr}", f"uses private name {attr!r} of {dotted!r}")
                break
            dotted = f"{dotted}.{attr}"
            if dotted in known:
                check_module(node.lineno, dotted)
            else:
                break
    return [found[k] for k in sorted(found)]


# --------------------------------------------------------------------------- the checker itself


KNOWN = {"fxsplit", "fxsplit.pass_api", "fxsplit.inspection", "fxsplit.stage",
         "fxsplit.schedule", "fxsplit.schedule.ir", "fxsplit.passes", "fxsplit.passes.tp"}
PUBLIC = ("fxsplit.pass_api", "fxsplit.inspection")


def test_checker_accepts_public_imports():
    good = """
import torch
import fxsplit
import fxsplit.pass_api as pa
from fxsplit import PassResult, pass_api, __version__
from fxsplit.inspection import graph_diff
from . import tp
from .tp import column_parallel
from fxsplit.passes.tp import helper

def p(gm, ctx):
    return fxsplit.PassResult(gm, fxsplit.inspection.graph_diff(gm, gm) is None)
"""
    assert boundary_violations(good, PUBLIC, KNOWN) == []


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from fxsplit.stage import build_stages", "uses 'fxsplit.stage', which is not a public"),
        ("import fxsplit.schedule.ir", "uses 'fxsplit.schedule.ir', which is not a public"),
        ("from fxsplit import stage", "uses 'fxsplit.stage', which is not a public"),
        ("from fxsplit.pass_api import _failure_note", "imports private name '_failure_note'"),
        ("from fxsplit._impl import x", "uses private module 'fxsplit._impl'"),
        ("from ..stage import build_stages", "uses 'fxsplit.stage', which is not a public"),
        ("from fxsplit.inspection import *", "star import from 'fxsplit.inspection'"),
        ("import fxsplit\nfxsplit.stage.build_stages(1, 2, 3)", "<source>:2: uses 'fxsplit.stage'"),
        ("import fxsplit as fx\nfx.pass_api._REGISTRY.clear()", "uses private name '_REGISTRY'"),
        ("from fxsplit import inspection as i\ni._graph(1)", "uses private name '_graph'"),
    ],
)
def test_checker_flags_reaching_past_the_api(source, expected):
    found = boundary_violations(source, PUBLIC, KNOWN)
    assert len(found) == 1 and expected in found[0], found


# --------------------------------------------------------------------------- the real passes


def public_modules() -> tuple[str, ...]:
    public = getattr(fxsplit, "PUBLIC_MODULES", None)
    if public is None:
        pytest.fail(
            "fxsplit.PUBLIC_MODULES is missing: define it in fxsplit/__init__.py as a tuple of "
            "the module names a pass may import (e.g. ('fxsplit.pass_api', 'fxsplit.inspection'))"
        )
    if not isinstance(public, tuple) or not all(isinstance(m, str) for m in public):
        pytest.fail(f"fxsplit.PUBLIC_MODULES must be a tuple of module names, got {public!r}")
    return public


def test_public_modules_are_importable_and_not_private():
    for name in public_modules():
        assert name.startswith("fxsplit"), f"PUBLIC_MODULES entry {name!r} is not an fxsplit module"
        assert not any(_private(p) for p in name.split(".")), f"{name!r} is private"
        importlib.import_module(name)


def test_builtin_passes_use_only_the_public_api():
    public = public_modules()
    known = fxsplit_module_names()
    files = sorted(PASSES_DIR.glob("*.py"))
    assert files, f"no pass modules found under {PASSES_DIR}"
    problems = []
    for path in files:
        problems += boundary_violations(
            path.read_text(), public, known, filename=str(path.relative_to(PASSES_DIR.parent))
        )
    assert not problems, "built-in passes reach past the public API:\n" + "\n".join(problems)


def test_example_user_pass_uses_only_the_public_api():
    path = PASSES_DIR.parent / "examples" / "custom_pass.py"
    problems = boundary_violations(
        path.read_text(), public_modules(), fxsplit_module_names(), filename=str(path.name),
        package="examples",
    )
    assert not problems, "\n".join(problems)
