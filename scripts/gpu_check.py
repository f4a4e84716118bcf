#!/usr/bin/env python3
"""``make gpu-check``: fxsplit's CUDA path checked in minutes, one report written and printed
([Note: gpu check] in fxsplit/testing/gpu_check.py). Runs from a plain checkout with the machine's
own torch: nothing to install, nothing downloaded."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fxsplit.testing.gpu_check import main  # noqa: E402 -- after the checkout is on the path

if __name__ == "__main__":
    sys.exit(main())
