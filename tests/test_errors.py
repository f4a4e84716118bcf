"""Every error a user can cause is an ``fxsplit.FxsplitError`` (issue 25, part 5).

One static check reads every ``raise`` in ``fxsplit/`` and ``passes/`` with ``ast`` and fails on a
builtin exception class (``raise ValueError(...)``) unless the raise is on the short allow-list of
internal invariants below, each entry with its reason; a second one does the same for exception
classes fxsplit defines outside :mod:`fxsplit.errors`. Then a sample of user mistakes, one process
and no launcher: each raises an FxsplitError that is still the builtin class it was before (so
``except ValueError`` written against older versions keeps working).
"""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fxsplit
import fxsplit.graph.cost
import fxsplit.graph.trace
import fxsplit.schedule
from fxsplit import errors
from fxsplit.runtime import mesh as meshes
from fxsplit.runtime.microbatch import split_microbatches
from fxsplit.testing import zoo

ROOT = Path(__file__).resolve().parents[1]
BUILTIN_EXCEPTIONS = {name for name, obj in vars(builtins).items()
                      if isinstance(obj, type) and issubclass(obj, BaseException)}

# (file, or None for any file; enclosing function; builtin class) -> why it may stay a builtin.
ALLOWED_RAISES: dict[tuple[str | None, str, str], str] = {
    # internal invariants: "this cannot happen" checks written as raise instead of assert
    ("fxsplit/api/lockstep.py", "run_lockstep", "AssertionError"): "fx graphs always have an output node",
    ("fxsplit/pipeline/partition/chain.py", "reconstruct", "AssertionError"): "the DP table always has a start",
    ("fxsplit/schedule/auto.py", "_greedy", "AssertionError"): "the greedy zb_auto builder always progresses",
    ("fxsplit/tp/emulate.py", "forward", "AssertionError"): "an op kind outside the emulator's own table",
    ("fxsplit/testing/trace_cache.py", "trace", "AssertionError"):
        "a test helper's own check that no test mutated a shared cached trace (a bug in that test)",
    # behaviour kept identical to torch's on purpose
    ("fxsplit/graph/decompose.py", "_additive", "AssertionError"):
        "mirrors torch's F._canonical_mask, which raises AssertionError for the same mask dtype: the "
        "decomposed nn.MultiheadAttention fails exactly as the original",
    # fault injection: the faults a test or benchmark provokes on purpose, and a rank's exit status
    ("fxsplit/testing/faults.py", "loss_fn", "ValueError"): "the injected user error of a fault case",
    ("fxsplit/testing/faults.py", "faulty", "RuntimeError"): "the injected model error of a fault case",
    ("fxsplit/testing/faults.py", "rank_main", "SystemExit"): "a fault case's rank exits 1 after its error",
    # the Python protocol: a module __getattr__ (PEP 562) answers an unknown name with AttributeError,
    # which hasattr() and getattr(mod, name, default) rely on
    ("fxsplit/__init__.py", "__getattr__", "AttributeError"): "PEP 562: an unknown attribute of the package",
    # a malformed checksum file: caught on the next line and raised as a CheckpointError
    ("fxsplit/api/checkpoint.py", "_read_checksums", "ValueError"): "caught at once, re-raised as CheckpointError",
}

# Exception classes fxsplit defines that are not FxsplitErrors: control flow that never leaves fxsplit.
ALLOWED_CLASSES: dict[tuple[str, str], str] = {
    ("fxsplit/cli.py", "_UserCodeError"): "carries the user's own exception to main(), which prints it",
    ("fxsplit/runtime/compile/split_graph.py", "UnsupportedStage"):
        "caught in runtime/runners.py: the stage falls back to autograd, or a PlanError is raised",
    ("fxsplit/tp/shapes.py", "RegionFailed"): "caught in tp/propagate.py and tp/plan.py: the region stays replicated",
    ("fxsplit/pipeline/partition/memory_caps.py", "_Exhausted"): "caught in the same module: the search budget ran out",
    ("fxsplit/api/seq_dims.py", "SeqDimsError"):
        "caught in api/kv_export.py and api/decode_graphs.py: the refusal becomes generate's one-line reason to "
        "recompute",
    ("passes/causal_masks.py", "_Unsure"): "caught in the same module: the mask stays, the report says why",
}


def _sources():
    for folder in ("fxsplit", "passes"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), str(path))


def _raised_name(exc: ast.expr | None) -> str | None:
    node = exc.func if isinstance(exc, ast.Call) else exc
    return node.id if isinstance(node, ast.Name) else None


def _builtin_raises():
    """``(file, function, class, line)`` for every ``raise <builtin exception>`` in fxsplit/ and passes/."""
    for rel, tree in _sources():
        def visit(node, func):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield from visit(child, child.name)
                    continue
                if isinstance(child, ast.Raise):
                    name = _raised_name(child.exc)
                    if name in BUILTIN_EXCEPTIONS:
                        yield rel, func, name, child.lineno
                yield from visit(child, func)
        yield from visit(tree, "<module>")


def _allowed(rel: str, func: str, name: str) -> tuple | None:
    for key in ((rel, func, name), (None, func, name)):
        if key in ALLOWED_RAISES:
            return key
    return None


def test_every_raise_of_a_builtin_exception_is_an_allowed_internal_invariant():
    found = list(_builtin_raises())
    assert 0 < len(found) < 30, "the scan finds the few allowed raises (none: the scan itself is broken)"
    bad = [f"{rel}:{line} in {func}(): raise {name}" for rel, func, name, line in found
           if _allowed(rel, func, name) is None]
    assert not bad, ("raise an fxsplit.errors class that also derives from the builtin one (e.g. ValueError -> "
                     "UsageError/PlanError, TypeError -> ArgumentTypeError, RuntimeError -> RunError), or, for "
                     "an internal invariant, add it to ALLOWED_RAISES with the reason:\n  " + "\n  ".join(bad))
    used = {_allowed(rel, func, name) for rel, func, name, _ in found}
    stale = sorted(set(ALLOWED_RAISES) - used, key=str)
    assert not stale, f"ALLOWED_RAISES entries that match no raise any more; delete them: {stale}"


def test_exception_classes_outside_errors_py_are_fxsplit_errors_or_internal():
    fx_names = {n for n in errors.__all__ if isinstance(getattr(errors, n), type)}
    found, bad = set(), []
    for rel, tree in _sources():
        if rel == "fxsplit/errors.py":
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                     for b in node.bases}
            if bases & BUILTIN_EXCEPTIONS and not bases & fx_names:
                found.add((rel, node.name))
                if (rel, node.name) not in ALLOWED_CLASSES:
                    bad.append(f"{rel}:{node.lineno} class {node.name}({', '.join(sorted(bases))})")
    assert not bad, "derive these from a class of fxsplit.errors (or list them as internal):\n  " + "\n  ".join(bad)
    assert not set(ALLOWED_CLASSES) - found, f"stale ALLOWED_CLASSES entries: {set(ALLOWED_CLASSES) - found}"


def test_new_classes_keep_their_builtin_base_and_a_readable_message():
    for cls, base in [(errors.ArgumentTypeError, TypeError), (errors.OutOfRangeError, IndexError),
                      (errors.MissingKeyError, KeyError), (errors.UnknownPassError, KeyError),
                      (errors.RunError, RuntimeError), (errors.MissingDependencyError, ImportError),
                      (errors.UsageError, ValueError)]:
        assert issubclass(cls, errors.FxsplitError) and issubclass(cls, base), cls
    assert str(errors.MissingKeyError("no symbol 's9'")) == "no symbol 's9'"  # KeyError would add quotes
    assert issubclass(errors.UnknownPassError, errors.MissingKeyError)
    for cls in (errors.ArgumentTypeError, errors.OutOfRangeError, errors.MissingKeyError):
        assert cls in errors.REQUEST_ERRORS  # the CLI's exit code 2
    assert errors.RunError not in errors.REQUEST_ERRORS


# ------------------------------------------------------------------------------------------------
# a sample of user mistakes, in one process


@pytest.fixture(scope="module")
def mlp():
    return zoo.make("mlp")  # (model, (x of shape (4, 32),), {})


def _untraced_node():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    return next(iter(gm.graph.nodes))


def _plan_rank(mlp, r):
    model, args, _ = mlp
    return fxsplit.plan(model, args, pp=2, microbatches=2, schedule="1f1b").rank_plan(r)


CASES = [
    # (id, call, the FxsplitError class, the builtin it still is, text in the message)
    ("bad degree", lambda m: fxsplit.plan(m[0], m[1], tp=0), errors.PlanError, ValueError, "tp must be an int >= 1"),
    ("degree that does not divide", lambda m: fxsplit.plan(m[0], m[1], tp=3), errors.FxsplitError, ValueError, "3"),
    ("unknown schedule in plan", lambda m: fxsplit.plan(m[0], m[1], pp=2, schedule="nope"), errors.PlanError,
     ValueError, "schedule must be one of"),
    ("unknown schedule", lambda m: fxsplit.schedule.build("nope", 2, 2), errors.ScheduleError, ValueError,
     "unknown schedule 'nope'; valid names"),
    ("bad action text", lambda m: fxsplit.schedule.Action.parse("2X0"), errors.ScheduleError, ValueError, "cannot parse action"),
    ("unknown option", lambda m: fxsplit.plan(m[0], m[1], tpp=2), errors.ArgumentTypeError, TypeError, "tpp"),
    ("0-sample example", lambda m: fxsplit.plan(m[0], (torch.randn(0, 32),)), errors.PlanError, ValueError,
     "the example has 0 samples: example_args[0] has shape (0, 32)"),
    ("0-sample keyword example", lambda m: fxsplit.plan(m[0], (), {"x": torch.randn(0, 32)}), errors.PlanError,
     ValueError, "example_kwargs['x'] has shape (0, 32)"),
    ("stage out of range", lambda m: _plan_rank(m, 5), errors.OutOfRangeError, IndexError, "pp_rank 5 out of range"),
    ("not a module", lambda m: fxsplit.trace(lambda x: x, (torch.randn(2),)), errors.ArgumentTypeError, TypeError,
     "fxsplit.trace expects a torch.nn.Module"),
    ("unknown leaf module", lambda m: fxsplit.trace(m[0], m[1], leaf_modules=["nope"]), errors.UsageError, ValueError,
     "leaf_modules: no module named 'nope'"),
    ("no metadata", lambda m: fxsplit.node_info(_untraced_node()), errors.MissingKeyError, KeyError,
     "has no fxsplit metadata"),
    ("pass list not a list", lambda m: fxsplit.PassManager(passes=3), errors.ArgumentTypeError, TypeError,
     "takes a list of passes"),
    ("unknown hardware", lambda m: fxsplit.Hardware.preset("tpu-v9"), errors.UsageError, ValueError,
     "unknown name 'tpu-v9'; presets"),
    ("bad hardware", lambda m: fxsplit.Hardware(matmul_efficiency=2.0), errors.UsageError, ValueError,
     "must be in (0, 1]"),
    ("negative cost", lambda m: fxsplit.graph.cost.NodeCost(flops=-1), errors.UsageError, ValueError, "must be >= 0"),
    ("bad loss_fn", lambda m: fxsplit.parallelize(m[0], m[1], loss_fn=3), errors.ArgumentTypeError, TypeError,
     "loss_fn must be callable"),
    ("bad timeout", lambda m: fxsplit.parallelize(m[0], m[1], timeout=0), errors.UsageError, ValueError,
     "timeout must be a number of seconds > 0"),
    ("bad mesh", lambda m: meshes.check_mesh("mesh", 1, 1, 1), errors.ArgumentTypeError, TypeError,
     "expected a DeviceMesh"),
    ("mesh degree", lambda m: meshes.check_mesh(None, 1, 0, 1), errors.PlanError, ValueError,
     "pp=0 must be an int >= 1"),
    ("mesh without a process group", lambda m: meshes.build_mesh(pp=2), errors.RunError, RuntimeError,
     "the default process group is not initialized"),
    ("microbatches", lambda m: split_microbatches(m[1], 0), errors.UsageError, ValueError,
     "num_microbatches must be >= 1"),
    ("unknown zoo model", lambda m: zoo.make("nope"), errors.UsageError, ValueError, "unknown zoo model 'nope'"),
]


@pytest.mark.parametrize("call, cls, builtin, text", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_user_mistakes_raise_fxsplit_errors(mlp, call, cls, builtin, text):
    if dist.is_available() and dist.is_initialized():
        pytest.skip("needs no default process group")
    with pytest.raises(fxsplit.FxsplitError) as info:
        call(mlp)
    assert isinstance(info.value, cls) and isinstance(info.value, builtin), type(info.value).__mro__
    assert text in str(info.value), str(info.value)


def test_launch_without_torchrun_is_a_run_error(monkeypatch):
    if dist.is_available() and dist.is_initialized():
        pytest.skip("needs no default process group")
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(errors.RunError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set"):
        meshes.init_from_env()


@pytest.fixture
def world_of_one():
    """A default gloo process group of one rank in this process (no launcher), destroyed after."""
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no default process group yet")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.dist  # a gloo group of one rank in this process
def test_misuse_of_a_parallel_model(mlp, world_of_one):
    model, args, _ = mlp
    inference = fxsplit.parallelize(model, args)
    with pytest.raises(errors.RunError, match=r"step\(\) needs a loss"):
        inference.step(*args)
    with pytest.raises(RuntimeError):  # still what it was
        inference.step(*args)
    pm = fxsplit.parallelize(model, args, loss_fn=torch.nn.functional.mse_loss)
    with pytest.raises(errors.UsageError, match="needs the target"):
        pm.step(*args)
    with pytest.raises(errors.ArgumentTypeError, match="takes a torch.amp.GradScaler, got int"):
        pm.step(*args, target=torch.randn(4, 32), scaler=3)
    with pytest.raises(errors.UsageError, match="norm_type=-1 must be a number p > 0"):
        pm.clip_grad_norm_(1.0, norm_type=-1)
    with pytest.raises(errors.PlanError, match="batch size 0"):
        pm.step(torch.randn(0, 32), target=torch.randn(0, 32))
    loss = pm.step(*args, target=torch.randn(4, 32))  # still usable after the refusals
    assert torch.isfinite(loss)

