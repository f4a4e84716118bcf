"""The pass API: what a graph pass is, how passes are named, registered, ordered and run.

Terms:
    pass: a function ``(gm: GraphModule, ctx: PassContext) -> PassResult``. It may mutate the
        graph module it is given (and only that one) or return a new one. Options are bound with
        ``functools.partial``; a pipeline of passes is a list.
    pass name: ``fn.__name__``; for a ``functools.partial`` the wrapped function's name; a pass
        registered with ``@register_pass("name")`` is found by that name.
    constraint: a function ``(a_name, b_name) -> bool`` asked for every pair where pass ``a`` runs
        before pass ``b``; False means that order is forbidden (as in torch.fx.passes.infra).
    check: an invariant ``check(gm) -> None`` that raises when the graph is wrong; the manager
        runs every check on the input graph and after every pass.

Signatures::

    PassResult(graph_module, modified)
    PassContext(example_args=(), example_kwargs={}, options={}, report={}, debug_dir=None,
                logger=logging.getLogger("fxsplit.passes"))
    PassManager(passes, *, constraints=(), disabled=(), checks=(), debug=None,
                check_metadata=True)(gm, ctx=None) -> PassResult
    register_pass(name) / get_pass(name) / registered_passes() / load_entry_point_passes()
    this_before_that(this, that) -> constraint

[Note: pass failures] A pass, lint, recompile or check that raises is not wrapped: the manager
re-raises the ORIGINAL exception object with a note (``exc.add_note``) naming the pass that failed
and the passes that ran before it, so ``except SomeError`` in user code keeps working and the
traceback still points at the line that failed.

After each pass the manager also holds the pass to the metadata contract when the graph carried it
before the pass ([Note: metadata check after a pass] in :mod:`fxsplit.graph.pass_check`): a node
the pass added or changed without ``meta["val"]`` / ``meta["fxsplit"]``, or whose shapes on fake
tensors disagree with them, raises :class:`PassContractError` naming the pass and the node.
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import torch.fx

from fxsplit import config
from fxsplit.errors import ArgumentTypeError, PassContractError, UnknownPassError, UsageError
from fxsplit.graph.pass_check import check_after, take_snapshot

__all__ = [
    "ENTRY_POINT_GROUP",
    "Check",
    "Constraint",
    "PassContext",
    "PassContractError",
    "PassFn",
    "PassManager",
    "PassRecord",
    "PassResult",
    "get_pass",
    "load_entry_point_passes",
    "pass_name",
    "register_pass",
    "registered_passes",
    "this_before_that",
    "UnknownPassError",
    "unregister_pass",
]

ENTRY_POINT_GROUP = "fxsplit.passes"


@dataclass(frozen=True)
class PassResult:
    """What a pass returns: the graph module to continue with and whether the pass changed it."""

    graph_module: torch.fx.GraphModule
    modified: bool

    def __post_init__(self) -> None:
        if not isinstance(self.graph_module, torch.fx.GraphModule):
            raise ArgumentTypeError(
                f"PassResult.graph_module must be a torch.fx.GraphModule, got "
                f"{type(self.graph_module).__name__}; return PassResult(gm, modified) with the "
                f"graph module the pass received or the new one it built"
            )
        if not isinstance(self.modified, bool):
            raise ArgumentTypeError(
                f"PassResult.modified must be a bool, got {type(self.modified).__name__} "
                f"({self.modified!r}); pass True when the pass changed the graph, else False"
            )


@dataclass(frozen=True)
class PassRecord:
    """One pass as the manager ran it: name, whether it changed the graph, seconds it took."""

    name: str
    modified: bool
    seconds: float
    nodes_before: int
    nodes_after: int


@dataclass
class PassContext:
    """What the PassManager hands every pass.

    ``options`` holds settings shared by passes (e.g. ``{"tp": 2, "pp": 4}``); ``report`` is where
    passes record findings for the user (e.g. ``report["tp"] = "left replicated: [...]"``);
    ``history`` is appended to by the manager, one PassRecord per pass that ran; ``debug_dir`` is
    the folder of the current pass's dumps when debugging is on, else None.
    """

    example_args: tuple = ()
    example_kwargs: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)
    debug_dir: Path | None = None
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("fxsplit.passes"))
    history: list[PassRecord] = field(default_factory=list)


PassFn = Callable[[torch.fx.GraphModule, PassContext], PassResult]
Constraint = Callable[[str, str], bool]
Check = Callable[[torch.fx.GraphModule], None]


def pass_name(fn: Callable[..., Any]) -> str:
    """The name a pass (or check) is known by: ``__name__``, seen through ``functools.partial``."""
    inner = fn
    while isinstance(inner, functools.partial):
        inner = inner.func
    name = getattr(inner, "__name__", None)
    if not isinstance(name, str) or not name:
        name = type(inner).__name__
    return name


# ---------------------------------------------------------------------------------------------
# ordering constraints


@dataclass(frozen=True)
class _ThisBeforeThat:
    this: str
    that: str

    def __call__(self, a: str, b: str) -> bool:
        # a runs before b: forbidden only when a is `that` and b is `this`.
        return not (a == self.that and b == self.this)

    def __str__(self) -> str:
        return f"this_before_that({self.this!r}, {self.that!r})"


def this_before_that(this: str, that: str) -> Constraint:
    """A constraint: when both passes are in the list, pass ``this`` must run before ``that``."""
    return _ThisBeforeThat(this, that)


def _constraint_label(constraint: Constraint) -> str:
    if isinstance(constraint, _ThisBeforeThat):
        return str(constraint)
    return pass_name(constraint)


def _check_order(names: Sequence[str], constraints: Sequence[Constraint]) -> None:
    for constraint in constraints:
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                if not constraint(a, b):
                    raise UsageError(
                        f"pass order violates constraint {_constraint_label(constraint)}: "
                        f"pass {a!r} (position {i}) runs before pass {b!r} (position "
                        f"{names.index(b, i + 1)}); order the list so that {b!r} comes before "
                        f"{a!r}, or disable one of them. Order: {list(names)}"
                    )


# ---------------------------------------------------------------------------------------------
# registry


_REGISTRY: dict[str, PassFn] = {}


def register_pass(name: str, *, replace: bool = False) -> Callable[[PassFn], PassFn]:
    """Decorator: make ``fn`` findable as ``get_pass(name)`` and usable by name in a PassManager.

    Registering a different function under a taken name raises unless ``replace=True``.
    """
    if not isinstance(name, str) or not name:
        raise UsageError(f"register_pass needs a non-empty string name, got {name!r}")

    def decorator(fn: PassFn) -> PassFn:
        _register(name, fn, replace=replace, origin="register_pass")
        return fn

    return decorator


def _register(name: str, fn: PassFn, *, replace: bool, origin: str) -> None:
    if not callable(fn):
        raise ArgumentTypeError(f"pass {name!r} from {origin} is not callable: {fn!r}")
    old = _REGISTRY.get(name)
    # the same function from a module imported again (importlib reload, a file loaded twice) is
    # the same pass: it replaces the old one instead of conflicting
    same = old is not None and _describe(old) == _describe(fn)
    if old is not None and old is not fn and not same and not replace:
        raise UsageError(
            f"pass name {name!r} is already registered to {_describe(old)}; cannot register "
            f"{_describe(fn)} ({origin}) under it. Choose another name or pass replace=True"
        )
    _REGISTRY[name] = fn


def unregister_pass(name: str) -> None:
    """Remove a registered pass (for tests and for packages that replace a pass)."""
    if name not in _REGISTRY:
        raise UnknownPassError(_unknown_pass_message(name, _REGISTRY))
    del _REGISTRY[name]


def registered_passes() -> dict[str, PassFn]:
    """A copy of the registry: name -> pass function (entry points included once loaded)."""
    return dict(_REGISTRY)


def get_pass(name: str) -> PassFn:
    """The pass registered as ``name``; entry-point passes are loaded if the name is unknown."""
    if name not in _REGISTRY:
        load_entry_point_passes()
    if name not in _REGISTRY:
        raise UnknownPassError(_unknown_pass_message(name, _REGISTRY))
    return _REGISTRY[name]


def load_entry_point_passes() -> dict[str, PassFn]:
    """Register the passes other packages ship in the ``fxsplit.passes`` entry-point group.

    A package declares ``[project.entry-points."fxsplit.passes"] my_pass = "pkg.mod:my_pass"``.
    Discovery happens on each call (never at import). Returns name -> pass for what was loaded.
    """
    loaded: dict[str, PassFn] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        origin = f"entry point {ep.name} = {ep.value}" + (
            f" of distribution {dist.name}" if dist is not None else ""
        )
        try:
            fn = ep.load()
        except Exception as exc:
            exc.add_note(f"while loading fxsplit pass from {origin} (group {ENTRY_POINT_GROUP!r})")
            raise
        _register(ep.name, fn, replace=False, origin=origin)
        loaded[ep.name] = fn
    return loaded


def _describe(fn: Callable[..., Any]) -> str:
    inner = fn
    while isinstance(inner, functools.partial):
        inner = inner.func
    module = getattr(inner, "__module__", None) or "?"
    return f"{module}.{getattr(inner, '__qualname__', pass_name(fn))}"


def _unknown_pass_message(name: str, known: Iterable[str]) -> str:
    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=3)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    return (
        f"no pass named {name!r}{hint} Known passes: {known or 'none'}. Register one with "
        f"@fxsplit.register_pass({name!r}) or ship it in the {ENTRY_POINT_GROUP!r} entry-point group"
    )


# ---------------------------------------------------------------------------------------------
# manager


PassSpec = Union[str, PassFn]


class PassManager:
    """Run a list of passes in order, checking the graph after each one.

    ``passes`` holds pass functions or registered names. ``constraints`` are ordering rules
    (``this_before_that``) validated when the manager is built. ``disabled`` names passes to skip;
    a name that matches no pass is an error. ``checks`` are invariants ``check(gm)`` run on the
    input graph and after every pass, after ``gm.graph.lint()`` and ``gm.recompile()``.
    ``debug``: a folder for per-pass dumps (see ``fxsplit.graph.debug``), False for none, or None to
    use the ``FXSPLIT_DEBUG_DIR`` environment variable. ``check_metadata``: hold every pass to the
    metadata contract (module docstring); the check recomputes only the nodes a pass changed, each
    distinct (op, input shapes) once per run ([Note: cached fake values] in fxsplit.graph.pass_check).
    fxsplit's built-in passes are held to it like a user's (tensor parallelism keeps every value it
    shards at its local shape: sequence shards, merged heads, whole multi-query blocks).

    Calling the manager returns ``PassResult(final_gm, modified_by_any_pass)``; failures follow
    [Note: pass failures] in ``fxsplit.graph.pass_api``.
    """

    def __init__(
        self,
        passes: Sequence[PassSpec],
        *,
        constraints: Sequence[Constraint] = (),
        disabled: Iterable[str] = (),
        checks: Sequence[Check] = (),
        debug: str | Path | bool | None = None,
        check_metadata: bool = True,
    ) -> None:
        if isinstance(passes, (str, bytes)) or not isinstance(passes, Sequence):
            raise ArgumentTypeError(
                f"PassManager(passes=...) takes a list of passes or pass names, got "
                f"{type(passes).__name__}; wrap a single pass as [pass]"
            )
        resolved: list[PassFn] = []
        for i, spec in enumerate(passes):
            fn = get_pass(spec) if isinstance(spec, str) else spec
            if not callable(fn):
                raise ArgumentTypeError(
                    f"passes[{i}] is not callable: {spec!r}; a pass is a function "
                    f"(gm, ctx) -> PassResult or the name of a registered pass"
                )
            resolved.append(fn)
        names = [_spec_name(spec, fn) for spec, fn in zip(passes, resolved)]

        disabled = (disabled,) if isinstance(disabled, str) else tuple(disabled)
        for name in disabled:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=3)
                hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
                raise UsageError(
                    f"disabled pass {name!r} matches no pass in this PassManager{hint} "
                    f"Passes: {names}"
                )
        for i, check in enumerate(checks):
            if not callable(check):
                raise ArgumentTypeError(f"checks[{i}] is not callable: {check!r}; a check is check(gm)")
        for i, constraint in enumerate(constraints):
            if not callable(constraint):
                raise ArgumentTypeError(
                    f"constraints[{i}] is not callable: {constraint!r}; a constraint is "
                    f"(a_name, b_name) -> bool, e.g. this_before_that('a', 'b')"
                )

        self.passes: tuple[PassFn, ...] = tuple(resolved)
        self.names: tuple[str, ...] = tuple(names)
        self.disabled: frozenset[str] = frozenset(disabled)
        self.checks: tuple[Check, ...] = tuple(checks)
        self.constraints: tuple[Constraint, ...] = tuple(constraints)
        self.check_metadata = bool(check_metadata)
        if debug is None:
            self.debug_dir: Path | None = config.debug_dir_from_env()
        elif debug is False:
            self.debug_dir = None
        elif debug is True:
            raise UsageError(
                "PassManager(debug=True) needs a folder: pass debug='path/to/dir' or set "
                f"{config.DEBUG_DIR_ENV}"
            )
        else:
            self.debug_dir = Path(debug)
        _check_order(self.enabled_names, self.constraints)

    @property
    def enabled_names(self) -> tuple[str, ...]:
        """Names of the passes that will run, in order."""
        return tuple(n for n in self.names if n not in self.disabled)

    def __repr__(self) -> str:
        parts = [n if n not in self.disabled else f"{n} (disabled)" for n in self.names]
        return f"PassManager([{', '.join(parts)}], checks={[pass_name(c) for c in self.checks]})"

    def __call__(
        self, gm: torch.fx.GraphModule, ctx: PassContext | None = None
    ) -> PassResult:
        if not isinstance(gm, torch.fx.GraphModule):
            raise ArgumentTypeError(
                f"PassManager expects a torch.fx.GraphModule, got {type(gm).__name__}; trace the "
                f"model first (fxsplit.trace or torch.fx.symbolic_trace)"
            )
        ctx = PassContext() if ctx is None else ctx
        if not isinstance(ctx, PassContext):
            raise ArgumentTypeError(f"ctx must be a PassContext, got {type(ctx).__name__}")

        recorder = None
        if self.debug_dir is not None:
            from fxsplit.graph.debug import PassDumper  # debug writing is optional; keep import local

            recorder = PassDumper(self.debug_dir)

        ran: list[str] = []
        any_modified = False
        shapes: dict = {}  # [Note: cached fake values] in fxsplit.graph.pass_check, for this run
        try:
            self._run_checks(gm, failed_after=None, ran=ran)
            for fn, name in zip(self.passes, self.names):
                if name in self.disabled:
                    ctx.logger.debug("pass %s disabled; skipped", name)
                    if recorder is not None:
                        recorder.skip(name)
                    continue
                gm, modified = self._run_one(fn, name, gm, ctx, ran, recorder, shapes)
                any_modified = any_modified or modified
                ran.append(name)
        finally:
            if recorder is not None:
                recorder.finish()
        return PassResult(gm, any_modified)

    # [Note: grad mode kept across a pass]
    # torch's ``wrap_with_set_grad_enabled`` (the higher-order op torch.export makes of a no_grad block,
    # [Note: no_grad blocks inlined] in fxsplit.graph.export) sets grad mode, runs its subgraph and
    # sets it back with no ``finally`` (torch 2.11 and 2.13): a pass whose fake run of such a block
    # raised left grad mode off for the rest of the process, and every later backward found nothing
    # to differentiate (seen on torch 2.11 with transformers 5.17: a failed context-parallel plan,
    # then "element 0 of tensors does not require grad" and ``verify`` comparing 0 gradients in later
    # tests). Each pass runs inside ``torch.set_grad_enabled(<the mode before>)``, which restores it.
    def _run_one(
        self, fn: PassFn, name: str, gm: torch.fx.GraphModule, ctx: PassContext,
        ran: list[str], recorder: Any, shapes: dict,
    ) -> tuple[torch.fx.GraphModule, bool]:
        index = len(ctx.history)
        nodes_before = len(gm.graph.nodes)
        token = None
        outer_debug_dir = ctx.debug_dir
        if recorder is not None:
            token = recorder.begin(len(ran), name, gm)
            ctx.debug_dir = token.folder
        try:
            snapshot = take_snapshot(gm) if self.check_metadata else None
            start = time.perf_counter()
            try:
                with torch.set_grad_enabled(torch.is_grad_enabled()):  # [Note: grad mode kept across a pass]
                    result = fn(gm, ctx)
            except BaseException as exc:
                exc.add_note(_failure_note(f"in pass {name!r}", name, ran))
                raise
            seconds = time.perf_counter() - start
            if not isinstance(result, PassResult):
                raise ArgumentTypeError(
                    f"pass {name!r} returned {type(result).__name__}; a pass "
                    f"must return fxsplit.PassResult(graph_module, modified). Passes before "
                    f"it: {ran or 'none'}"
                )
            new_gm = result.graph_module
            try:
                new_gm.graph.lint()
                new_gm.recompile()
            except BaseException as exc:
                exc.add_note(_failure_note(f"in graph lint/recompile after pass {name!r}", name, ran))
                raise
            try:
                check_after(new_gm, snapshot, pass_name=name, cache=shapes)
            except PassContractError as exc:
                exc.add_note(_failure_note(f"in the metadata check after pass {name!r}", name, ran))
                raise
            self._run_checks(new_gm, failed_after=name, ran=ran)
        except BaseException as exc:
            if recorder is not None and token is not None:
                recorder.fail(token, exc)
            raise
        finally:
            ctx.debug_dir = outer_debug_dir
        record = PassRecord(name, result.modified, seconds, nodes_before, len(new_gm.graph.nodes))
        ctx.history.append(record)
        ctx.logger.debug(
            "pass %d %s: modified=%s %.4fs nodes %d -> %d",
            index, name, result.modified, seconds, nodes_before, record.nodes_after,
        )
        if recorder is not None:
            recorder.end(token, new_gm, record)
        return new_gm, result.modified

    def _run_checks(self, gm, *, failed_after: str | None, ran: list[str]) -> None:
        for check in self.checks:
            try:
                check(gm)
            except BaseException as exc:
                where = (
                    f"after pass {failed_after!r}" if failed_after is not None
                    else "on the input graph, before any pass ran"
                )
                if failed_after is None:
                    note = f"fxsplit: invariant check {pass_name(check)!r} failed {where}"
                else:
                    note = _failure_note(
                        f"in invariant check {pass_name(check)!r} {where}", failed_after, ran
                    )
                exc.add_note(note)
                raise


def _spec_name(spec: PassSpec, fn: PassFn) -> str:
    return spec if isinstance(spec, str) else pass_name(fn)


def _failure_note(what: str, name: str, ran: Sequence[str]) -> str:
    before = ", ".join(ran) if ran else "none"
    return f"fxsplit: failed {what}; passes that ran before {name!r}: {before}"
