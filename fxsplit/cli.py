"""The ``fxsplit`` command: plan a model from a Python file, or look at a pipeline schedule.

Terms:
    factory spec: ``FILE.py:NAME`` (or ``package.module:NAME``), a callable in that file.
    example: what the factory's result gives, in one of three forms:
        ``(model, example_args, example_kwargs)``, ``(model, example_args)``, or a bare model
        plus a module-level ``example_inputs()`` returning ``example_args`` (a tuple, or one
        tensor) or ``(example_args, example_kwargs)`` (a 2-tuple whose second item is a dict).
    d, t, p, v, m: data-, tensor-, pipeline-parallel degrees, stages per pipeline rank and
        microbatches, as in :mod:`fxsplit.api`.

Representative use::

    fxsplit plan models/gpt.py:build --tp 2 --pp 4 --dot g.dot --timeline pp.png --debug-dir dumps
    fxsplit plan models/llama.py:build --meta --tp 8 --pp 8 --memory-limit 80GB
    fxsplit schedule interleaved_1f1b --pp 4 --microbatches 8 --stages-per-rank 2 --timeline pp.png
    python -m fxsplit ...                                     # the same, without the entry point

    main(argv: Sequence[str] | None = None) -> int

``plan`` prints :class:`fxsplit.Plan` (stages, costs, tensor-parallel plan, simulated step) and
writes on request the graph colored by stage (DOT), the simulated schedule (PNG) and the per-pass
dumps of :mod:`fxsplit.graph.debug`. ``schedule`` prints a schedule's grid and its simulation with unit
costs (forward 1, backward 2 unless told otherwise); no model needed.

Exit codes: 0 success; 2 a usage error, one line naming it and the fix, no traceback (bad
arguments, an unknown ``--hardware`` preset or schedule, a file or factory that cannot be found, a
factory result of the wrong form, an output path that cannot be written, or a request that cannot
be planned: any error of ``fxsplit.errors.REQUEST_ERRORS``); 1 an error raised by the user's own
code or while tracing (traceback printed), or a missing optional dependency.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

from fxsplit.errors import REQUEST_ERRORS, UsageError

__all__ = ["main", "build_parser", "load_factory", "load_example", "parse_size", "UsageError"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

_SIZE_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


class _UserCodeError(Exception):
    """The user's file or factory raised; carries the original exception as ``__cause__``."""


# ------------------------------------------------------------------------------------------------
# argument types


def parse_size(text: str) -> float:
    """``"80GB"`` -> 8e10 bytes. Units: B, KB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB
    (powers of 1024), case-insensitive; a bare number is bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write a number with an optional unit, e.g. 80GB, 80GiB, 512MB or 1e9"
        )
    return float(match.group(1)) * _SIZE_UNITS[unit]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give a whole number >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not allowed; a degree or count must be >= 1")
    return value


def _nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{value} is not allowed; a cost must be >= 0")
    return value


def _hardware_preset(text: str) -> Any:
    """``--hardware NAME`` -> that :class:`fxsplit.Hardware` preset, checked before any model loads."""
    from fxsplit.hardware import Hardware

    try:
        return Hardware.preset(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _comma_list(text: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise argparse.ArgumentTypeError(
            "--split-points needs module paths separated by commas, e.g. blocks.2,blocks.4"
        )
    return items


# ------------------------------------------------------------------------------------------------
# loading the user's factory


def _callables_in(module: Any) -> list[str]:
    """Names of the functions and classes defined in ``module`` itself (not imported into it)."""
    names = []
    for name, obj in vars(module).items():
        if name.startswith("_") or not callable(obj):
            continue
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and getattr(obj, "__module__", None) == module.__name__:
            names.append(name)
    return sorted(names)


def _import_file(path: Path) -> Any:
    """Import ``path`` once per process (a factory and a ``--pass`` from the same file share one
    module, so its ``register_pass`` decorators run once)."""
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
    module_name = f"fxsplit_user_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise UsageError(f"cannot import {str(path)!r}: it is not a Python file; give FILE.py:FACTORY")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look their module up here
    folder = str(path.parent.resolve())
    sys.path.insert(0, folder)  # the file may import its neighbours
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise _UserCodeError(f"importing {str(path)!r} raised {type(exc).__name__}: {exc}") from exc
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    return module


def load_factory(spec: str) -> tuple[Callable[[], Any], Any]:
    """Resolve ``FILE.py:NAME`` (or ``package.module:NAME``) to ``(callable, module)``.

    Raises :class:`UsageError` naming the file and listing its callables when the file or the
    name cannot be found.
    """
    where, sep, name = spec.rpartition(":")
    if not sep:
        where, name = spec, ""
    path = Path(where)
    if path.suffix == ".py" or path.exists():
        if not path.is_file():
            raise UsageError(f"model file {where!r} does not exist (cwd: {os.getcwd()}); give FILE.py:FACTORY")
        module = _import_file(path)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            raise UsageError(
                f"{where!r} is neither a file nor an importable module ({exc}); give FILE.py:FACTORY"
            ) from None
    available = _callables_in(module)
    listing = ", ".join(available) if available else "(none)"
    if not name:
        raise UsageError(f"name the factory: write {where}:NAME; callables defined in {where}: {listing}")
    obj = getattr(module, name, None)
    if obj is None or not callable(obj):
        what = "is not callable" if obj is not None else "is not defined"
        raise UsageError(f"{name!r} {what} in {where}; callables defined there: {listing}")
    return obj, module


def _as_args(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def load_example(spec: str, *, meta: bool = False) -> tuple[Any, tuple, dict]:
    """Call the factory named by ``spec`` and return ``(model, example_args, example_kwargs)``.

    With ``meta``, the factory (and ``example_inputs()``) run under ``torch.device("meta")``, so
    parameters and tensors created without an explicit device take no memory.
    """
    import contextlib

    import torch
    from torch import nn

    factory, module = load_factory(spec)
    scope = torch.device("meta") if meta else contextlib.nullcontext()
    try:
        with scope:
            result = factory()
    except Exception as exc:
        raise _UserCodeError(f"{spec} raised {type(exc).__name__}: {exc}") from exc
    if isinstance(result, nn.Module):
        inputs_fn = getattr(module, "example_inputs", None)
        if not callable(inputs_fn):
            raise UsageError(
                f"{spec} returned a bare model and its file defines no "
                "example_inputs(); return (model, example_args[, example_kwargs]) or add a module-level "
                "example_inputs() returning example_args or (example_args, example_kwargs)"
            )
        try:
            with scope:
                inputs = inputs_fn()
        except Exception as exc:
            raise _UserCodeError(f"example_inputs() raised {type(exc).__name__}: {exc}") from exc
        if isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[1], dict):
            model, args, kwargs = result, _as_args(inputs[0]), dict(inputs[1])
        else:
            model, args, kwargs = result, _as_args(inputs), {}
    elif isinstance(result, (tuple, list)) and len(result) in (2, 3):
        model, args = result[0], _as_args(result[1])
        kwargs = dict(result[2] or {}) if len(result) == 3 else {}
    else:
        got = f"a value of type {type(result).__name__}"
        if isinstance(result, (tuple, list)):
            got += f" of length {len(result)}"
        raise UsageError(
            f"{spec} returned {got}; it must return (model, example_args, example_kwargs), "
            "(model, example_args), or a model with a module-level example_inputs()"
        )
    if not isinstance(model, nn.Module):
        raise UsageError(
            f"{spec} returned {type(model).__name__} as the model; the first item must be a torch.nn.Module"
        )
    return model, args, kwargs


# ------------------------------------------------------------------------------------------------
# commands


def _load_passes(specs: Sequence[str]) -> list[Callable]:
    passes = []
    for spec in specs:
        fn, _ = load_factory(spec)
        passes.append(fn)
    return passes


def _cmd_plan(ns: argparse.Namespace) -> int:
    from fxsplit.api import ParallelConfig, plan
    from fxsplit.hardware import Hardware

    model, args, kwargs = load_example(ns.factory, meta=ns.meta)
    if ns.auto:
        return _cmd_plan_auto(ns, model, args, kwargs)
    hardware = ns.hardware
    if ns.link_bandwidth is not None:
        hardware = (Hardware(link_bytes_per_s=ns.link_bandwidth) if hardware is None
                    else dataclasses.replace(hardware, link_bytes_per_s=ns.link_bandwidth))
    config = ParallelConfig(
        tp=ns.tp, pp=ns.pp, dp=ns.dp, ep=ns.ep, cp=ns.cp, cp_kv=ns.cp_kv, microbatches=ns.microbatches, schedule=ns.schedule,
        stages_per_rank=ns.stages_per_rank, split_points=ns.split_points, memory_limit=ns.memory_limit,
        method=ns.method, passes=tuple(_load_passes(ns.passes)), debug=ns.debug_dir,
        sequence_parallel=ns.sequence_parallel, vocab_parallel_loss=ns.vocab_parallel_loss,
        activation_checkpointing=ns.activation_checkpointing,
        hardware=hardware,
    )
    the_plan = plan(model, args, kwargs, config=config)
    print(the_plan)
    _outputs(ns, the_plan)
    return EXIT_OK


def _outputs(ns: argparse.Namespace, the_plan: Any) -> None:
    """What ``plan`` writes besides the printed plan, with or without --auto: --grid, --dot,
    --timeline, and where --debug-dir put its dumps."""
    if ns.grid:
        print(the_plan.schedule_grid())
    if ns.dot:
        the_plan.to_dot(ns.dot)
        print(f"wrote the graph colored by stage to {ns.dot}")
    if ns.timeline:
        the_plan.timeline(ns.timeline)
        print(f"wrote the simulated schedule to {ns.timeline}")
    if ns.debug_dir and Path(ns.debug_dir).is_dir():
        print(f"wrote per-pass dumps to {ns.debug_dir} (summary.txt lists the passes)")


def _cmd_plan_auto(ns: argparse.Namespace, model: Any, args: tuple, kwargs: dict) -> int:
    """``fxsplit plan FILE:FACTORY --auto --world-size N --global-batch B --hardware NAME``."""
    from fxsplit.api import plan
    from fxsplit.errors import PlanError

    if ns.world_size is None or ns.global_batch is None:
        raise PlanError("--auto needs --world-size N and --global-batch B (samples per optimizer step)")
    the_plan = plan(model, args, kwargs, strategy="auto", world_size=ns.world_size, global_batch_size=ns.global_batch,
                    hardware=ns.hardware, memory_limit=ns.memory_limit, method=ns.method,
                    passes=tuple(_load_passes(ns.passes)), debug=ns.debug_dir)
    print(the_plan.search)
    print()
    print(the_plan)
    _outputs(ns, the_plan)
    return EXIT_OK


def _cmd_schedule(ns: argparse.Namespace) -> int:
    from fxsplit import schedule as schedules

    try:
        v = ns.stages_per_rank
        if v is None:
            v = schedules.schedule_spec(ns.name).default_stages_per_rank(ns.pp)
        sched = schedules.build(ns.name, ns.pp, ns.microbatches, stages_per_rank=v)
    except (ValueError, TypeError) as exc:  # unknown name, or degrees the builder rejects
        raise UsageError(str(exc)) from None
    info = schedules.validate(sched)
    timeline = schedules.simulate(sched, forward=ns.forward, backward=ns.backward, comm=ns.comm)
    title = f"{ns.name}: p={ns.pp} v={v} m={ns.microbatches}"
    kind = "I and W" if info.split_backward else "B"
    placed = "" if info.stage_ranks == tuple(st % ns.pp for st in range(info.num_stages)) else \
        f", stage -> rank {list(info.stage_ranks)}"
    print(f"{title}; {info.num_stages} stages{placed}, backward as {kind}; valid")
    print(schedules.format_grid(sched))
    print(timeline)
    if ns.timeline:
        schedules.timeline_png(timeline, ns.timeline, title=title,
                               unit=f"unit costs: forward {ns.forward:g}, backward {ns.backward:g}")
        print(f"wrote the simulated schedule to {ns.timeline}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    from fxsplit import config
    from fxsplit import schedule as schedules  # torch-free, like everything --help needs

    SCHEDULES, METHODS = schedules.NAMES, config.TRACE_METHODS
    parser = argparse.ArgumentParser(
        prog="fxsplit", description="Plan tensor + pipeline parallelism for an unmodified PyTorch model.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{plan,schedule}")

    p = sub.add_parser(
        "plan", help="trace and plan a model from a Python file; print the plan",
        description="Trace FILE.py:FACTORY and plan it for dp x tp x pp devices (one process, no weights needed).",
    )
    p.add_argument("factory", metavar="FILE.py:FACTORY",
                   help="a callable returning (model, args[, kwargs]), or a model with a module-level example_inputs()")
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel degree (default 1)")
    p.add_argument("--pp", type=_positive_int, default=1, help="pipeline-parallel degree (default 1)")
    p.add_argument("--dp", type=_positive_int, default=1, help="data-parallel degree (default 1)")
    p.add_argument("--ep", type=_positive_int, default=1,
                   help="expert-parallel degree, carved out of the dp ranks: each holds E/ep experts (default 1)")
    p.add_argument("--cp", type=_positive_int, default=1,
                   help="context-parallel degree: each rank keeps 2 of 2*cp chunks of every sequence (default 1)")
    p.add_argument("--cp-kv", choices=("allgather", "ring"), default=None,
                   help="how attention reads other cp ranks' keys and values (default: chosen per attention)")
    p.add_argument("--microbatches", type=_positive_int, default=None, help="microbatches per step (default 2 * pp)")
    p.add_argument("--schedule", choices=SCHEDULES, default="interleaved_1f1b", help="pipeline schedule")
    p.add_argument("--stages-per-rank", type=_positive_int, default=None,
                   help="v: stages per pipeline rank (default 2 for interleaved_1f1b, else 1)")
    p.add_argument("--split-points", type=_comma_list, default=None, metavar="PATH[,PATH...]",
                   help="module paths that start a new stage, e.g. blocks.2,blocks.4")
    p.add_argument("--memory-limit", type=parse_size, default=None, metavar="SIZE",
                   help="bytes per pipeline rank, e.g. 80GB or 80GiB")
    p.add_argument("--link-bandwidth", type=parse_size, default=None, metavar="SIZE",
                   help="bytes per second between pipeline ranks (default: fxsplit.Hardware's)")
    p.add_argument("--method", choices=METHODS, default="auto", help="tracer: fx, export, or auto (fx, then export)")
    p.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism with tp")
    p.add_argument("--vocab-parallel-loss", action="store_true", help="keep the LM head's logits sharded")
    p.add_argument("--activation-checkpointing", choices=("none", "selective", "full", "auto"), default="none",
                   help="recompute activations in backward: selective (keep matmul outputs), full (keep each "
                        "layer's inputs), auto (per stage, the cheapest that fits --memory-limit)")
    p.add_argument("--pass", dest="passes", action="append", default=[], metavar="FILE.py:FN",
                   help="a user pass (gm, ctx) -> PassResult, run before the built-in passes; repeatable")
    p.add_argument("--auto", action="store_true",
                   help="search dp, tp, pp, v, schedule, microbatches, checkpointing, sp (needs --world-size, --global-batch)")
    p.add_argument("--world-size", type=_positive_int, default=None, help="ranks to plan for, with --auto")
    p.add_argument("--global-batch", type=_positive_int, default=None,
                   help="samples per optimizer step over all replicas, with --auto")
    p.add_argument("--hardware", type=_hardware_preset, default=None, metavar="NAME",
                   help="the fxsplit.Hardware preset that stage times are estimated for (a100-80gb, h100-sxm, h100-hbm2e; "
                        "default: fxsplit.Hardware(), a100-80gb with --auto); --link-bandwidth overrides its link")
    p.add_argument("--meta", action="store_true", help='build the model under torch.device("meta") (no memory)')
    p.add_argument("--grid", action="store_true", help="also print the schedule grid (rank x step)")
    p.add_argument("--dot", metavar="PATH", help="write the graph colored by stage as Graphviz DOT")
    p.add_argument("--timeline", metavar="PATH.png", help="write the simulated schedule as a PNG (needs matplotlib)")
    p.add_argument("--debug-dir", metavar="DIR", help="write per-pass dumps (graph before/after, diff, time) to DIR")
    p.set_defaults(run=_cmd_plan)

    s = sub.add_parser(
        "schedule", help="print a pipeline schedule's grid and simulation",
        description="Build, validate and simulate a pipeline schedule (no model; unit costs by default).",
    )
    s.add_argument("name", help=f"one of {', '.join(schedules.NAMES)}")
    s.add_argument("--pp", type=_positive_int, required=True, help="pipeline ranks p")
    s.add_argument("--microbatches", type=_positive_int, required=True, help="microbatches m")
    s.add_argument("--stages-per-rank", type=_positive_int, default=None,
                   help="v: stages per rank (default 2 for interleaved_1f1b and zbv, else 1)")
    s.add_argument("--forward", type=_nonnegative_float, default=1.0, help="cost of one forward (default 1)")
    s.add_argument("--backward", type=_nonnegative_float, default=2.0, help="cost of one backward (default 2)")
    s.add_argument("--comm", type=_nonnegative_float, default=0.0, help="cost of one cross-rank transfer (default 0)")
    s.add_argument("--timeline", metavar="PATH.png", help="write the simulated schedule as a PNG (needs matplotlib)")
    s.set_defaults(run=_cmd_schedule)
    return parser


def _check_optional_dependencies(ns: argparse.Namespace) -> None:
    """Refuse a request whose output needs a package that is not installed, before any model loads
    (a plan of a large model takes minutes, and the PNG is written last)."""
    from fxsplit.errors import MissingDependencyError

    if getattr(ns, "timeline", None) and importlib.util.find_spec("matplotlib") is None:
        raise MissingDependencyError(
            "--timeline needs matplotlib, which is not installed: pip install -e '.[viz]' (or "
            "pip install 'matplotlib>=3.7'), or leave out --timeline")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed the usage and the error
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    try:
        _check_optional_dependencies(ns)
        return ns.run(ns)
    except REQUEST_ERRORS as exc:
        print(f"fxsplit {ns.command}: error: {exc}", file=sys.stderr)
        for note in getattr(exc, "__notes__", ()):
            print(f"  {note}", file=sys.stderr)
        return EXIT_USAGE
    except _UserCodeError as exc:
        traceback.print_exception(exc.__cause__, file=sys.stderr)
        print(f"fxsplit {ns.command}: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except BrokenPipeError:  # the output was piped into a reader that stopped (`| head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except OSError as exc:  # an output path that cannot be written (--dot, --timeline, --debug-dir)
        print(f"fxsplit {ns.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ImportError as exc:  # an optional dependency (matplotlib, transformers)
        print(f"fxsplit {ns.command}: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        print(f"fxsplit {ns.command}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
