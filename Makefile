# The two commands of the README. Both install what they need (.venv) on first use.
VENV := .venv
STAMP := $(VENV)/.fxsplit-installed
NPROC ?= 4

.PHONY: demo test test-fast bench install

$(STAMP): pyproject.toml scripts/bootstrap.sh
	bash scripts/bootstrap.sh

install: $(STAMP)

# Main job: a GPT trained for a few steps with tp=2 x pp=2 on 4 local processes (gloo on CPU,
# NCCL on GPUs), printing each step's loss next to the single-process loss.
demo: $(STAMP)
	$(VENV)/bin/python -m torch.distributed.run --standalone --nproc-per-node $(NPROC) examples/quickstart.py

# The whole test suite (graph/plan/schedule tests, gloo multi-process tests; GPU tests skip without CUDA),
# in TEST_WORKERS pytest-xdist workers, one test file per worker at a time (a file's module fixtures
# are built once): on 2 cores the one-process tests fill the core a launch's ranks leave idle
# (16 min against 22 min in one worker). TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# Only the tests that need no process group.
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q tests -m "not dist"
