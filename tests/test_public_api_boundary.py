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
    """Every module of the installed fxsplit package (``fxsplit.pipeline.stage``, ``fxsplit.schedule.ir``...)."""
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
        # "fxsplit.graph.pass_api.PassResult" is an attribute of a module, not a module
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


KNOWN = {"fxsplit", "fxsplit.graph", "fxsplit.graph.pass_api", "fxsplit.graph.inspection", "fxsplit.pipeline",
         "fxsplit.pipeline.stage", "fxsplit.schedule", "fxsplit.schedule.ir", "fxsplit.passes", "fxsplit.passes.tp"}
PUBLIC = ("fxsplit.graph", "fxsplit.graph.pass_api", "fxsplit.graph.inspection", "fxsplit.pipeline")


def test_checker_accepts_public_imports():
    good = """
import torch
import fxsplit
import fxsplit.graph.pass_api as pa
from fxsplit import PassResult, __version__
from fxsplit.graph import pass_api
from fxsplit.graph.inspection import graph_diff
from . import tp
from .tp import column_parallel
from fxsplit.passes.tp import helper

def p(gm, ctx):
    return fxsplit.PassResult(gm, fxsplit.graph.inspection.graph_diff(gm, gm) is None)
"""
    assert boundary_violations(good, PUBLIC, KNOWN) == []


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from fxsplit.pipeline.stage import build_stages", "uses 'fxsplit.pipeline.stage', which is not a public"),
        ("import fxsplit.schedule.ir", "uses 'fxsplit.schedule.ir', which is not a public"),
        ("from fxsplit.pipeline import stage", "uses 'fxsplit.pipeline.stage', which is not a public"),
        ("from fxsplit.graph.pass_api import _failure_note", "imports private name '_failure_note'"),
        ("from fxsplit._impl import x", "uses private module 'fxsplit._impl'"),
        ("from ..pipeline.stage import build_stages", "uses 'fxsplit.pipeline.stage', which is not a public"),
        ("from fxsplit.graph.inspection import *", "star import from 'fxsplit.graph.inspection'"),
        ("import fxsplit\nfxsplit.pipeline.stage.build_stages(1, 2, 3)", "<source>:2: uses 'fxsplit.pipeline.stage'"),
        ("import fxsplit as fx\nfx.graph.pass_api._REGISTRY.clear()", "uses private name '_REGISTRY'"),
        ("from fxsplit.graph import inspection as i\ni._graph(1)", "uses private name '_graph'"),
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
            "the module names a pass may import (e.g. ('fxsplit.graph.pass_api', 'fxsplit.graph.inspection'))"
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


# --------------------------------------------------------------------------- the layer contract


PACKAGE_DIRS = {"fxsplit": Path(fxsplit.__file__).resolve().parent, "fxsplit.passes": PASSES_DIR}


def package_sources() -> dict[str, Path]:
    """Every module of fxsplit (passes/ as fxsplit.passes) -> its file."""
    out = {}
    for pkg, root in PACKAGE_DIRS.items():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


def unit_of(module: str, units: Iterable[str]) -> str | None:
    """The layer unit (a key of fxsplit.LAYERS) holding ``module``: the longest matching prefix."""
    best = None
    for u in units:
        if (module == u or module.startswith(u + ".")) and (best is None or len(u) > len(best)):
            best = u
    return best


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported fxsplit module or name) for every import in the file, TYPE_CHECKING and
    function-level imports included, relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "fxsplit"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                if not is_pkg:
                    parts = parts[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != "fxsplit":
                continue
            out += [(node.lineno, f"{base}.{a.name}" if base == "fxsplit" else base) for a in node.names]
    return out


def allowed_units(layers: dict[str, tuple[str, ...]]) -> dict[str, set[str]]:
    """unit -> every unit it may import (its own and everything below it, transitively)."""
    out: dict[str, set[str]] = {}

    def below(u: str, seen: tuple[str, ...] = ()) -> set[str]:
        assert u not in seen, f"fxsplit.LAYERS has a cycle: {' -> '.join(seen + (u,))}"
        if u not in out:
            acc = {u}
            for d in layers[u]:
                acc |= below(d, seen + (u,))
            out[u] = acc
        return out[u]

    for u in layers:
        below(u)
    return out


def layer_violations(sources: dict[str, Path], layers: dict[str, tuple[str, ...]]) -> list[str]:
    allowed = allowed_units(layers)
    problems = []
    for module, path in sources.items():
        if module == "fxsplit":
            continue  # the package itself is the top: it re-exports every layer
        mine = unit_of(module, layers)
        if mine is None:
            problems.append(f"{module}: not in any unit of fxsplit.LAYERS (add its subpackage there)")
            continue
        for line, target in imports_of(path, module):
            where = f"{path.name}:{line}"
            if target == "fxsplit" or (target.startswith("fxsplit.") and target.count(".") == 1
                                       and target not in sources and unit_of(target, layers) is None):
                problems.append(f"{where}: imports the top-level package fxsplit ({target}); import the "
                                f"module that defines the name instead")
                continue
            theirs = unit_of(target, layers)
            if theirs is not None and theirs not in allowed[mine]:
                problems.append(f"{where}: {module} ({mine}) imports {target} ({theirs}), which "
                                f"[Note: layer contract] puts above or beside it")
    return problems


def import_cycles(sources: dict[str, Path]) -> list[list[str]]:
    """Module-level import cycles (a package's __init__ re-exporting its children excluded)."""
    edges: dict[str, set[str]] = {m: set() for m in sources}
    for module, path in sources.items():
        for _, target in imports_of(path, module):
            t = target
            while t and t not in sources:
                t = t.rpartition(".")[0]
            if t and t != module and t != "fxsplit" and not module.startswith(t + "."):
                edges[module].add(t)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 and not all(m == min(comp) or m.startswith(min(comp) + ".") for m in comp):
                cycles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return cycles


def test_layer_contract_holds():
    sources = package_sources()
    problems = layer_violations(sources, fxsplit.LAYERS)
    assert not problems, "imports against [Note: layer contract]:\n" + "\n".join(problems)


def test_no_import_cycles():
    cycles = import_cycles(package_sources())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_package_shape():
    """At most 8 modules directly in fxsplit/, every subpackage says what it owns and may import,
    and no module has grown past 700 lines (a second responsibility)."""
    root = PACKAGE_DIRS["fxsplit"]
    top = sorted(p.name for p in root.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 8, f"{len(top)} modules directly in fxsplit/ (at most 8): {top}"
    for init in sorted(root.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import" in doc, f"{init.relative_to(root.parent)}: its docstring must say what it may import"
    long = {m: n for m, p in package_sources().items() if (n := len(p.read_text().splitlines())) > 700}
    assert not long, f"modules over 700 lines: {long}"


@pytest.mark.parametrize(
    "files, expected",
    [
        ({"fxsplit/graph/a.py": "from fxsplit.tp.b import x"}, "fxsplit.graph.a (fxsplit.graph) imports fxsplit.tp.b"),
        ({"fxsplit/tp/a.py": "from fxsplit.pipeline import b"}, "imports fxsplit.pipeline (fxsplit.pipeline)"),
        ({"fxsplit/schedule/a.py": "def f():\n    from fxsplit.graph import meta"}, "fxsplit.schedule.a (fxsplit.schedule) imports"),
        ({"fxsplit/graph/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fxsplit.api import Plan"},
         "imports fxsplit.api (fxsplit.api)"),
        ({"fxsplit/graph/a.py": "from .. import api"}, "imports fxsplit.api"),
        ({"fxsplit/graph/a.py": "import fxsplit"}, "imports the top-level package fxsplit"),
        ({"fxsplit/graph/a.py": "from fxsplit import plan"}, "imports the top-level package fxsplit"),
        ({"fxsplit/extra/a.py": "x = 1"}, "not in any unit of fxsplit.LAYERS"),
    ],
)
def test_layer_checker_flags(tmp_path, files, expected):
    sources = {}
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        sources[rel[:-3].replace("/", ".")] = path
    for rel in ("fxsplit/tp/b.py", "fxsplit/api/__init__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1")
        sources.setdefault(rel[:-3].replace("/", ".").removesuffix(".__init__"), tmp_path / rel)
    found = layer_violations(sources, fxsplit.LAYERS)
    assert len(found) == 1 and expected in found[0], found


def test_cycle_checker_finds_a_cycle(tmp_path):
    (tmp_path / "a.py").write_text("from fxsplit.graph.b import x")
    (tmp_path / "b.py").write_text("def f():\n    from fxsplit.graph.a import y")
    (tmp_path / "c.py").write_text("from fxsplit.graph.a import y")
    sources = {f"fxsplit.graph.{n}": tmp_path / f"{n}.py" for n in "abc"}
    assert import_cycles(sources) == [["fxsplit.graph.a", "fxsplit.graph.b"]]
