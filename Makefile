# The two commands of the README. Both install what they need (.venv) on first use.
VENV := .venv
STAMP := $(VENV)/.fxsplit-installed
NPROC ?= 4

.PHONY: demo test test-fast bench install gpu-check

$(STAMP): pyproject.toml scripts/bootstrap.sh
	bash scripts/bootstrap.sh

install: $(STAMP)

# Main job: a GPT trained for a few steps with tp=2 x pp=2 on 4 local processes (gloo on CPU,
# NCCL on GPUs), printing each step's loss next to the single-process loss.
demo: $(STAMP)
	$(VENV)/bin/python -m torch.distributed.run --standalone --nproc-per-node $(NPROC) examples/quickstart.py

# The whole test suite (graph/plan/schedule tests, gloo multi-process tests; GPU tests skip without CUDA),
# in TEST_WORKERS pytest-xdist workers, one test file per worker at a time (a file's module fixtures
# are built once), the files that cost the most CPU first ([Note: heaviest files first] in
# tests/conftest.py): 1283 tests took 9:09 (pytest; whole .ci/run 9:44) from a clean clone with an
# empty inductor cache, as on CI's fresh machine, on 2 idle cores here (benchmarks/README.md "Suite
# time, session 21"). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# Only the tests that need no process group.
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q tests -m "not dist"

# fxsplit's CUDA path in at most 9 minutes on one GPU: the gpu test tier, parallelize at world size 1
# against the unsplit model, memory, speed against plain PyTorch, and 2-GPU layouts when there are 2
# GPUs; one report ($(GPU_CHECK_OUT) and .txt beside it), printed at the end. Needs no install: a GPU
# machine runs it from a plain checkout with its own python3 and torch (no .venv, no network).
GPU_CHECK_OUT ?= gpu-check-report.json
GPU_CHECK_PYTHON ?= $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3)
gpu-check:
	$(GPU_CHECK_PYTHON) scripts/gpu_check.py --out $(GPU_CHECK_OUT)
