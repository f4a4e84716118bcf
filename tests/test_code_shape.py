"""The package's rooms stay small: no function over 80 lines, and no class that is not a
dataclass holding more than 20 attributes, in every folder of fxsplit/ and passes/ (a dataclass
of options or data, such as ``ParallelConfig`` or ``Workload``, may hold more: its fields are
its meaning). A long function is split by what its parts mean, not at line 80 (STYLE.md,
"Small rooms")."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80
MAX_ATTRIBUTES = 20


def _sources():
    for folder in ("fxsplit", "passes"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text()


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for dec in cls.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "dataclass":
            return True
    return False


def _attributes(cls: ast.ClassDef) -> set[str]:
    """``self.x = ...`` anywhere in the class, and the class body's annotated names."""
    stored = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
              and isinstance(n.value, ast.Name) and n.value.id == "self"}
    annotated = {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    return stored | annotated


def shape_violations(rel: str, source: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source, rel)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                out.append(f"{rel}:{node.lineno} {node.name}() is {lines} lines (at most {MAX_FUNCTION_LINES}): "
                           "split it by what its parts mean")
        elif isinstance(node, ast.ClassDef) and not _is_dataclass(node):
            attrs = _attributes(node)
            if len(attrs) > MAX_ATTRIBUTES:
                out.append(f"{rel}:{node.lineno} class {node.name} holds {len(attrs)} attributes (at most "
                           f"{MAX_ATTRIBUTES} outside a dataclass): split it into the parts it holds")
    return out


def test_no_long_function_and_no_crowded_class_in_the_package():
    found = [v for rel, src in _sources() for v in shape_violations(rel, src)]
    assert not found, "\n".join(found)


def test_the_check_catches_what_it_names():
    long_fn = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    assert shape_violations("a.py", long_fn) == [
        f"a.py:1 f() is {MAX_FUNCTION_LINES + 1} lines (at most {MAX_FUNCTION_LINES}): split it by what its parts mean"]
    assert shape_violations("a.py", "def f():\n" + "    x = 1\n" * (MAX_FUNCTION_LINES - 1)) == []
    body = "".join(f"        self.a{i} = {i}\n" for i in range(MAX_ATTRIBUTES + 1))
    crowded = "class C:\n    def __init__(self):\n" + body
    assert len(shape_violations("a.py", crowded)) == 1 and "21 attributes" in shape_violations("a.py", crowded)[0]
    fields = "".join(f"    a{i}: int = {i}\n" for i in range(MAX_ATTRIBUTES + 1))
    assert shape_violations("a.py", "@dataclass(frozen=True)\nclass D:\n" + fields) == []
    assert len(shape_violations("a.py", "class E:\n" + fields)) == 1


def test_every_folder_is_read():
    """The check reads both trees, the runtime and the api among them (nothing is left out)."""
    read = {rel for rel, _ in _sources()}
    for rel in ("fxsplit/runtime/executor.py", "fxsplit/runtime/compile/split_graph.py", "fxsplit/api/model.py"):
        assert rel in read, rel
    assert any(rel.startswith("passes/") for rel in read)
