"""Environment switches: the one place fxsplit reads its own ``FXSPLIT_*`` variables (torchrun's
``RANK`` / ``LOCAL_RANK`` / ... are torchrun's contract, read where the process group is made, in
``fxsplit.runtime.mesh``); and the option vocabularies that the torch-free command line
(``fxsplit --help``) must know without importing torch.

Terms:
    FXSPLIT_DEBUG_DIR: when set to a non-empty path, every PassManager run without an explicit
        ``debug=`` argument writes per-pass dumps (graph code before and after, op-count diff,
        graph diff, time) under that folder. See ``fxsplit.graph.debug``.
    FXSPLIT_CACHE_DIR: where ``Hardware.measure()`` caches its JSON (default ``~/.cache/fxsplit``).
    FXSPLIT_CPU_MATMUL: ``auto`` (default), ``onednn`` or ``aten``: how compiled CPU graphs run
        fp32 matmuls ([Note: CPU matmuls through oneDNN] in ``fxsplit.runtime.compile.cpu_matmul``).

Signature::

    debug_dir_from_env(environ=None) -> Path | None
    cache_dir_from_env(environ=None) -> Path
    cpu_matmul_from_env(environ=None) -> str

Other modules call these functions instead of reading ``os.environ`` themselves, so a reader finds
every switch here and tests can pass an explicit mapping instead of patching the process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

TRACE_METHODS = ("auto", "fx", "export")  # fxsplit.trace(method=...): auto tries fx, then export

DEBUG_DIR_ENV = "FXSPLIT_DEBUG_DIR"


def debug_dir_from_env(environ: Mapping[str, str] | None = None) -> Path | None:
    """The folder named by ``FXSPLIT_DEBUG_DIR``, or None when it is unset or blank.

    ``environ`` defaults to ``os.environ``; pass a dict in tests. ``~`` is expanded.
    """
    env = os.environ if environ is None else environ
    value = env.get(DEBUG_DIR_ENV, "").strip()
    if not value:
        return None
    return Path(value).expanduser()


CACHE_DIR_ENV = "FXSPLIT_CACHE_DIR"


def cache_dir_from_env(environ: Mapping[str, str] | None = None) -> Path:
    """The folder named by ``FXSPLIT_CACHE_DIR``, or ``~/.cache/fxsplit`` when it is unset or blank."""
    env = os.environ if environ is None else environ
    value = env.get(CACHE_DIR_ENV, "").strip()
    return Path(value or "~/.cache/fxsplit").expanduser()


CPU_MATMUL_ENV = "FXSPLIT_CPU_MATMUL"
CPU_MATMUL_MODES = ("auto", "onednn", "aten")


def cpu_matmul_from_env(environ: Mapping[str, str] | None = None) -> str:
    """``FXSPLIT_CPU_MATMUL`` (one of `CPU_MATMUL_MODES`), ``auto`` when unset or blank; UsageError
    names the valid values otherwise."""
    from fxsplit.errors import UsageError

    env = os.environ if environ is None else environ
    mode = env.get(CPU_MATMUL_ENV, "").strip() or "auto"
    if mode not in CPU_MATMUL_MODES:
        raise UsageError(f"{CPU_MATMUL_ENV} must be 'auto', 'onednn' or 'aten', got {mode!r}: set it to one of "
                         "them or unset it (auto: oneDNN where torch's MKL runs its generic path)")
    return mode
