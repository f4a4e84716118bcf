"""CPU seconds per test file, of the whole process tree: a pytest plugin.

    python -m pytest -q -p benchmarks.suite_cpu tests/... [--suite-cpu-out FILE.json]
    python benchmarks/suite_cpu.py FILE.json [BEFORE.json]      # print the table (and the change)
    python benchmarks/suite_cpu.py --costs tests/file_costs.json FILE.json [...]   # the order `make test` runs

Why not `time` or RUSAGE_CHILDREN: the gloo ranks of `fxsplit.testing.run_distributed` are forked
by a multiprocessing forkserver, a child of the pytest process that lives until pytest exits and
reaps the ranks itself; their CPU reaches no rusage of ours until the server is reaped, and an
orphaned server never is. So before and after every test this plugin adds up: this process
(RUSAGE_SELF), the children it has reaped (RUSAGE_CHILDREN: torchrun subprocesses), and for every
live descendant found in /proc its own CPU plus the CPU of the children it has reaped
(utime + stime + cutime + cstime), which counts each rank once, live or reaped by the server.
A test's CPU goes to its file, module fixtures included (pytest sets them up inside the first test
that asks and tears them down after the last). Collection (importing the test modules) is left out.
Run with `-n 0` (one pytest process) to get one launch at a time; under xdist each worker writes
its own FILE.json.<worker>.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict

_TICK = os.sysconf("SC_CLK_TCK")


def _descendants(root: int) -> list[int]:
    children = defaultdict(list)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children[int(fields[1])].append(int(name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out


def _proc_cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # after the command: state ppid ... utime(12) stime(13) cutime(14) cstime(15), 1-based from state
    return sum(int(x) for x in fields[11:15]) / _TICK


def tree_cpu() -> float:
    """CPU seconds of this process and every descendant, live or reaped by a descendant."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = me.ru_utime + me.ru_stime + reaped.ru_utime + reaped.ru_stime
    return total + sum(_proc_cpu(p) for p in _descendants(os.getpid()))


class _Recorder:
    def __init__(self, out: str | None):
        self.out = out
        self.files: dict[str, dict] = {}
        self.start_cpu = tree_cpu()
        self.start_wall = time.monotonic()

    def record(self, path: str, name: str, cpu: float, wall: float, outcome: str) -> None:
        entry = self.files.setdefault(path, {"cpu": 0.0, "wall": 0.0, "tests": 0, "failed": 0, "per_test": {}})
        entry["per_test"][name] = [round(cpu, 2), round(wall, 2)]
        entry["cpu"] += cpu
        entry["wall"] += wall
        entry["tests"] += 1
        entry["failed"] += outcome == "failed"
        self.write(final=False)  # a run stopped part way keeps the files it measured

    def write(self, final: bool = True) -> None:
        data = {"files": self.files, "session_cpu": tree_cpu() - self.start_cpu,
                "session_wall": time.monotonic() - self.start_wall}
        if self.out:
            worker = os.environ.get("PYTEST_XDIST_WORKER")
            path = f"{self.out}.{worker}" if worker else self.out
            with open(path, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
        elif final:
            sys.stderr.write(_table(data) + "\n")


def pytest_addoption(parser):
    parser.addoption("--suite-cpu-out", default=None, help="write per-file CPU seconds as JSON here")


def pytest_configure(config):
    config._suite_cpu = _Recorder(config.getoption("--suite-cpu-out"))


def pytest_unconfigure(config):
    rec = getattr(config, "_suite_cpu", None)
    if rec is not None:
        rec.write()


def _hookwrapper():
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        rec = item.config._suite_cpu
        cpu0, wall0 = tree_cpu(), time.monotonic()
        outcome = yield
        failed = False
        for report in getattr(item, "_suite_cpu_reports", ()):
            failed |= report.failed
        del outcome
        rec.record(item.location[0], item.name, tree_cpu() - cpu0, time.monotonic() - wall0,
                   "failed" if failed else "passed")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        outcome = yield
        item.__dict__.setdefault("_suite_cpu_reports", []).append(outcome.get_result())

    return pytest_runtest_protocol, pytest_runtest_makereport


if "pytest" in sys.modules:
    pytest_runtest_protocol, pytest_runtest_makereport = _hookwrapper()


def _table(data: dict, before: dict | None = None) -> str:
    files = data["files"]
    rows = sorted(files, key=lambda p: -files[p]["cpu"])
    lines = []
    head = "| file | tests | CPU s | wall s |" + (" CPU s before | wall s before |" if before else "")
    lines.append(head)
    lines.append("|" + " --- |" * (head.count("|") - 1))
    for p in rows:
        e = files[p]
        line = f"| {os.path.basename(p)} | {e['tests']} | {e['cpu']:.1f} | {e['wall']:.1f} |"
        if before:
            b = before["files"].get(p)
            line += f" {b['cpu']:.1f} | {b['wall']:.1f} |" if b else " - | - |"
        lines.append(line)
    total_cpu = sum(e["cpu"] for e in files.values())
    total_wall = sum(e["wall"] for e in files.values())
    line = f"| total ({len(files)} files) | {sum(e['tests'] for e in files.values())} | {total_cpu:.1f} | {total_wall:.1f} |"
    if before:
        bf = before["files"]
        line += f" {sum(e['cpu'] for e in bf.values()):.1f} | {sum(e['wall'] for e in bf.values()):.1f} |"
    lines.append(line)
    return "\n".join(lines)


def write_costs(path: str, measured: list[str]) -> dict[str, float]:
    """tests/file_costs.json ([Note: heaviest files first] in tests/conftest.py): the CPU seconds of
    every file in the ``measured`` JSON files (a later file's figure replaces an earlier one's), over
    the figures already in ``path`` for the files not measured now."""
    costs = {}
    if os.path.exists(path):
        with open(path) as f:
            costs = json.load(f)
    for name in measured:
        with open(name) as f:
            for p, e in json.load(f)["files"].items():
                costs[os.path.basename(p)] = round(e["cpu"], 1)
    with open(path, "w") as f:
        json.dump(dict(sorted(costs.items(), key=lambda kv: (-kv[1], kv[0]))), f, indent=1)
        f.write("\n")
    return costs


if __name__ == "__main__":
    if sys.argv[1] == "--costs":  # --costs tests/file_costs.json MEASURED.json [...]
        write_costs(sys.argv[2], sys.argv[3:])
        sys.exit(0)
    with open(sys.argv[1]) as f:
        after = json.load(f)
    before = None
    if len(sys.argv) > 2:
        with open(sys.argv[2]) as f:
            before = json.load(f)
    print(_table(after, before))
