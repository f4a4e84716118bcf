"""Per-pass debug dumps: what every pass did to the graph, written to a folder.

Terms:
    dump folder: the folder given as ``PassManager(debug=...)`` or ``FXSPLIT_DEBUG_DIR``.
    pass folder: ``<dump folder>/NN_<pass name>/``, NN the pass's position among the passes that
        ran (00, 01, ...), holding
            before.py       graph code before the pass (``gm.graph.python_code``)
            after.py        graph code after the pass (absent when the pass failed)
            op_counts.txt   op-count changes (``fxsplit.graph.inspection.format_op_count_diff``)
            diff.txt        node diff (``fxsplit.graph.inspection.graph_diff``)
            time.txt        seconds the pass took, node counts, the modified flag
            error.txt       the traceback, with fxsplit's notes, when the pass or a check failed
    summary.txt: one line per pass (folder, modified, seconds, nodes before -> after, status),
        plus disabled passes and warnings (a pass that said modified=False but changed the code).

Signature::

    PassDumper(root).begin(index, name, gm) -> PassDump; .end(dump, gm, record); .fail(dump, exc);
    .skip(name); .finish()

The PassManager drives a PassDumper; users read the folder. Writing the dumps copies the graph
(not the parameters) before each pass, so it costs time and memory proportional to graph size.
A new run in the same folder removes the pass folders its previous run listed, and nothing else.
"""

from __future__ import annotations

import copy
import logging
import re
import shutil
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.fx

from fxsplit.graph.inspection import format_op_count_diff, graph_diff, op_counts

__all__ = ["PassDump", "PassDumper"]

logger = logging.getLogger(__name__)

_MANIFEST = ".fxsplit_dump_dirs"


def _code(gm: torch.fx.GraphModule) -> str:
    return gm.graph.python_code(root_module="self").src


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "pass"


@dataclass
class PassDump:
    """The state kept between ``begin`` and ``end`` of one pass (its folder and 'before' copy)."""

    index: int
    name: str
    folder: Path
    before_code: str
    before_graph: torch.fx.Graph
    before_counts: Any
    status: str = "running"
    extra: dict[str, Any] = field(default_factory=dict)


class PassDumper:
    """Writes the dump folder for one PassManager run (see the module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_previous_run()
        self.dumps: list[PassDump] = []
        self.skipped: list[str] = []
        self.warnings: list[str] = []

    def _remove_previous_run(self) -> None:
        manifest = self.root / _MANIFEST
        if not manifest.exists():
            return
        for line in manifest.read_text().splitlines():
            folder = self.root / line.strip()
            if line.strip() and folder.is_dir() and (folder / "before.py").exists():
                shutil.rmtree(folder)
        manifest.unlink()

    def begin(self, index: int, name: str, gm: torch.fx.GraphModule) -> PassDump:
        folder = self.root / f"{index:02d}_{_safe(name)}"
        folder.mkdir(parents=True, exist_ok=True)
        code = _code(gm)
        (folder / "before.py").write_text(code)
        dump = PassDump(index, name, folder, code, copy.deepcopy(gm.graph), op_counts(gm))
        self.dumps.append(dump)
        with open(self.root / _MANIFEST, "a") as f:
            f.write(folder.name + "\n")
        return dump

    def end(self, dump: PassDump, gm: torch.fx.GraphModule, record: Any) -> None:
        after_code = _code(gm)
        (dump.folder / "after.py").write_text(after_code)
        (dump.folder / "op_counts.txt").write_text(
            format_op_count_diff(dump.before_counts, op_counts(gm)) + "\n"
        )
        (dump.folder / "diff.txt").write_text(str(graph_diff(dump.before_graph, gm)) + "\n")
        (dump.folder / "time.txt").write_text(
            f"seconds: {record.seconds:.6f}\n"
            f"nodes: {record.nodes_before} -> {record.nodes_after}\n"
            f"modified: {record.modified}\n"
        )
        dump.status = "ok"
        dump.extra = {"record": record}
        if not record.modified and after_code != dump.before_code:
            msg = (
                f"pass {dump.name!r} returned modified=False but changed the graph code; "
                f"see {dump.folder / 'diff.txt'}"
            )
            self.warnings.append(msg)
            logger.warning(msg)
        dump.before_graph = torch.fx.Graph()  # release the copy early

    def fail(self, dump: PassDump, exc: BaseException) -> None:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        (dump.folder / "error.txt").write_text(text)
        dump.status = f"FAILED: {type(exc).__name__}"

    def skip(self, name: str) -> None:
        self.skipped.append(name)

    def finish(self) -> None:
        rows = [("folder", "modified", "seconds", "nodes", "status")]
        for d in self.dumps:
            record = d.extra.get("record")
            if record is None:
                rows.append((d.folder.name, "-", "-", "-", d.status))
            else:
                rows.append((
                    d.folder.name, str(record.modified), f"{record.seconds:.4f}",
                    f"{record.nodes_before} -> {record.nodes_after}", d.status,
                ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        total = sum(d.extra["record"].seconds for d in self.dumps if "record" in d.extra)
        lines.append(f"{len(self.dumps)} passes ran, {total:.4f} s in passes")
        if self.skipped:
            lines.append(f"disabled: {', '.join(self.skipped)}")
        lines += [f"warning: {w}" for w in self.warnings]
        (self.root / "summary.txt").write_text("\n".join(lines) + "\n")
