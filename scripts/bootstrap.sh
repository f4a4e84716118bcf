#!/usr/bin/env bash
# Create .venv (reusing a system torch, e.g. a CUDA build on a GPU machine) and install fxsplit
# with its test extras. With no torch anywhere, install the CPU build named by $TORCH_SPEC.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q "$TORCH_SPEC"
fi
.venv/bin/pip install -q -e ".[test]"
touch .venv/.fxsplit-installed
