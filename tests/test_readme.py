"""README and docs/ name only what exists: every repository path they mention (``examples/x.py``,
``fxsplit/api/verify.py``, ``docs/passes.md``, ...), every ``[...](#anchor)`` link, and every
``fxsplit plan MODULE:FACTORY`` of their commands (placeholders are written in capitals:
``FILE.py:FACTORY``)."""

import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
PATH = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.(?:py|md|toml|sh|json|txt|cfg))(?![\w-])")
FACTORY = re.compile(r"fxsplit plan ([\w./-]+:\w+)")


def _paths(text):
    for match in PATH.finditer(text):
        path = match.group(1)
        if path.split("/")[-1].split(".")[0].isupper() and "/" not in path:
            continue  # a placeholder such as FILE.py; README.md itself is a real file below
        yield path


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_named_exists(doc):
    text = (ROOT / doc).read_text()
    named = set(_paths(text))
    assert len(named) >= (5 if doc == "README.md" else 1), f"the scan found nothing in {doc}: {named}"
    ignored = [g for g in (ROOT / ".gitignore").read_text().split() if not g.startswith(("!", "#"))]
    outputs = {p for p in named if any(fnmatch.fnmatch(p, g) for g in ignored)}  # what a command writes, e.g. a report
    missing = sorted(p for p in named if not (ROOT / p).exists() and p not in outputs)
    assert not missing, f"{doc} names files that do not exist: {missing}"


def _anchor(heading):
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_anchors_point_at_headings():
    text = (ROOT / "README.md").read_text()
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
    links = set(re.findall(r"\]\(#([\w-]+)\)", text))
    assert links and not links - anchors, sorted(links - anchors)


def test_readme_keeps_the_sections_other_work_appends_to():
    headings = re.findall(r"^## (.+)$", (ROOT / "README.md").read_text(), re.M)
    for name in ("Install", "When a rank fails", "Tests", "Benchmarks"):
        assert name in headings, headings


def test_factories_in_commands_load():
    from fxsplit.cli import load_factory

    specs = {m for doc in DOCS for m in FACTORY.findall((ROOT / doc).read_text()) if not m.split(":")[0].isupper()
             and not m.startswith("FILE")}
    assert specs, "README shows at least one runnable `fxsplit plan` command"
    for spec in specs:
        fn, _ = load_factory(spec)
        assert callable(fn), spec


def test_readme_first_example_is_the_file_it_names():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"`examples/first_steps.py`, run with .*?```python\n(.*?)```", text, re.S).group(1)
    assert block == (ROOT / "examples" / "first_steps.py").read_text()
