"""[Note: the dist marker]
A test that starts a process group, in this process (``dist.init_process_group``) or in others
(``fxsplit.testing.run_distributed``, a ``torchrun`` / ``torch.distributed.run`` subprocess), is
marked ``dist``, so that ``make test-fast`` (``pytest -m "not dist"``) starts none. Enforced two
ways: while a test without the marker runs (its fixtures included, module-scoped ones too, as they
are set up inside the first test that asks for them), those three entry points fail it, naming the
marker; and tests/test_markers.py reads every test file for launches a test cannot reach at run
time here (a skipped test, a test a -k filter left out).


[Note: scalar inductor kernels in the suite]
The compiled tests (compile=True: test_zero_bubble_dist, test_context_parallel_dist,
test_expert_parallel, test_compiling, test_split_graph) compile ~90 distinct graphs, and a fresh
clone on a fresh machine (CI) finds none of them in inductor's cache: measured with an empty
``TORCHINDUCTOR_CACHE_DIR``, those 13 tests took 372 CPU-s against 134 with a warm cache, the largest
single item of `make test`'s time. Most of the difference is g++ on inductor's C++ kernels, and
vectorized kernels (at::vec's headers, and a probe compile per instruction set) cost twice the
scalar ones: with ``TORCHINDUCTOR_VEC_ISA_OK=0`` the same 13 tests took 280 CPU-s (benchmarks/README.md
"Suite time, 2026-12-05"). So the suite asks inductor for scalar CPU kernels. What fxsplit hands to
torch.compile is the same graph either way (which graphs, in which order, with which collectives);
the instruction set is inductor's choice of C++ for one graph, checked against eager by torch's own
tests, and the compiled tests compare with one process to tolerances that hold for both. A person
who wants the vectorized kernels sets ``TORCHINDUCTOR_VEC_ISA_OK=1`` (this only sets a default);
`make gpu-check` and the benchmarks run torch's defaults.

[Note: no fake-tensor cache in the suite]
A fake tensor mode caches each op's output metadata; with symbolic sizes, making an entry rebuilds
the output from it (sympy arithmetic for every size and stride) and a hit does so again. For a model
of many alike layers the hits pay (fxsplit.trace of Llama-70B's 80 layers, symbolic batch: 11.4 CPU-s
with the cache, 17.6 without), so fxsplit leaves torch's cache alone; for the suite's small models
most ops are first seen once and the entries cost more than they save (a 2-layer Llama export 1.94
-> 1.27; test_planner_published 41.7 -> 32.7 s; benchmarks/README.md "Suite time, 2026-12-05"). So
the suite runs with ``TORCH_FAKE_TENSOR_DISPATCH_CACHE=0`` (a default: set it to 1 for torch's).
The same ops run either way; only the memo of their results is off.
"""

import json
import math
import os
import subprocess
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")  # before torch: [Note: scalar inductor kernels in the suite]
os.environ.setdefault("TORCH_FAKE_TENSOR_DISPATCH_CACHE", "0")  # before torch: [Note: no fake-tensor cache in the suite]

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fxsplit.testing.harness as harness  # noqa: E402

# [Note: rank start-up] in fxsplit.testing.harness: a pytest process starts its ranks' forkserver at
# its first launch, and the server preloads transformers (and its Llama and GPT-2 modules) only if
# this process has imported transformers by then. A worker whose first launch came from a file
# that had not imported it (test_examples: the quickstart before hf_llama and train_llama) left
# every later rank of that worker importing transformers itself, measured 8.6 CPU-s of a 23 CPU-s
# train_llama rank (profiled). Imported here, every worker's server preloads it once.
try:
    import transformers  # noqa: F401
except ImportError:  # the HF tests skip; nothing to preload
    pass

_unmarked: list[str] = []  # the node id of the running test when it has no dist marker


def _refuse(what: str) -> None:
    if _unmarked:
        pytest.fail(f"{_unmarked[-1]} starts {what} but is not marked @pytest.mark.dist: mark it (or its module's "
                    "pytestmark); `make test-fast` runs -m 'not dist' and must start no process group "
                    "([Note: the dist marker] in tests/conftest.py)", pytrace=False)


class _GuardedDist:
    """torch.distributed as fxsplit.testing.harness sees it: creating the launch's store refuses
    while an unmarked test runs (the store is made before any rank starts)."""

    def __getattr__(self, name):
        return getattr(dist, name)

    def TCPStore(self, *args, **kwargs):  # noqa: N802 -- torch's name
        _refuse("ranks (fxsplit.testing.run_distributed)")
        return dist.TCPStore(*args, **kwargs)


class _GuardedPopen(subprocess.Popen):
    def __init__(self, args, *rest, **kwargs):
        words = [args] if isinstance(args, (str, bytes)) else [str(a) for a in args]
        if any("torch.distributed.run" in w or "torchrun" in w for w in words):
            _refuse(f"a launcher ({' '.join(words)[:120]})")
        super().__init__(args, *rest, **kwargs)


_init_process_group = dist.init_process_group


def _guarded_init_process_group(*args, **kwargs):
    backend = kwargs.get("backend", args[0] if args else None)
    if backend != "threaded":  # tests/tp_threaded.py: tp ranks as threads of this process, no launch
        _refuse("a process group in the pytest process (torch.distributed.init_process_group)")
    return _init_process_group(*args, **kwargs)


# [Note: heaviest files first]: `make test` runs `--dist loadfile --no-loadscope-reorder`, so xdist hands
# the files out in collection order, the next file to whichever worker runs low; this hook orders the
# files by their CPU seconds in tests/file_costs.json, most first (a file not listed there, a new one,
# goes first of all: it may be heavy), and keeps each file's tests in their order. xdist's own order,
# most tests first, left the heaviest files (a few tests, each a multi-rank launch) to the end, where
# one worker ran them for minutes while the other had nothing left to do. Refresh the table from a
# measurement: benchmarks/suite_cpu.py --costs tests/file_costs.json FILE.json [...].
FILE_COSTS = Path(__file__).with_name("file_costs.json")


def pytest_collection_modifyitems(session, config, items):
    costs = json.loads(FILE_COSTS.read_text())
    items.sort(key=lambda item: -costs.get(item.path.name, math.inf))  # stable: a file's tests keep their order


# [Note: one thread per worker]: under xdist each worker runs torch on cores / workers intra-op threads
# (one on the 2-core machines `make test` runs on). With torch's default, a thread per core in every
# worker, two workers run four OpenMP threads on two cores, and an idle OpenMP thread spins before it
# sleeps: tests/test_activation_checkpointing.py (in-process tests) run alone on the loaded machine
# measured 36.9 and 40.6 CPU-s with the default against 25.3 with one thread (benchmarks/README.md). Ranks of a launch already run one thread each
# (fxsplit.testing.harness), so the in-process references now run as the ranks do.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _WORKERS))

harness.dist = _GuardedDist()
subprocess.Popen = _GuardedPopen
dist.init_process_group = _guarded_init_process_group


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    marked = item.get_closest_marker("dist") is not None
    if not marked:
        _unmarked.append(item.nodeid)
    try:
        yield
    finally:
        if not marked:
            _unmarked.pop()
