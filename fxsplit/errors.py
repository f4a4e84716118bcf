"""Every exception fxsplit raises on purpose, under one base class, :class:`FxsplitError`.

Terms: a *request error* is a question that cannot be answered as asked (a degree that does not
divide, a split point that does not exist, a schedule that breaks a rule); it subclasses
``ValueError`` as well (or the builtin such a mistake always raised: ``ArgumentTypeError`` is a
``TypeError``, ``OutOfRangeError`` an ``IndexError``, ``MissingKeyError`` a ``KeyError``, so
code that catches the builtin, ``except TypeError``, catches it too), and the message names the
value, the rule and the fix; ``REQUEST_ERRORS`` lists them. A *run error* is a failure while
running (a model that cannot be traced, a peer rank that failed, a call this state does not
allow); it subclasses ``RuntimeError``.

    try:
        plan = fxsplit.plan(model, (x,), tp=3)
    except fxsplit.FxsplitError as exc:        # any of the classes below
        ...

This module is the bottom layer of the package: it imports nothing from fxsplit and no torch, so
the torch-free ``fxsplit.schedule`` can raise these too. A topic's error is re-exported by the
module that raises it (``fxsplit.pipeline.partition.PartitionError`` is this ``PartitionError``);
the general ones (``UsageError``, ``ArgumentTypeError``, ``OutOfRangeError``, ``MissingKeyError``,
``RunError``, ``MissingDependencyError``) are raised all over and imported from here.
"""

from __future__ import annotations

import traceback

from collections.abc import Mapping

__all__ = [
    "FxsplitError", "TraceError", "UnknownPassError", "TPPlanError", "ShardingError", "PartitionError",
    "SplitError", "StageBuildError", "ScheduleError", "PlanError", "PipelineError", "RankFailedError",
    "DistributedRunError", "VerificationError", "PassContractError", "UsageError", "PathError", "ArgumentTypeError",
    "MissingKeyError", "OutOfRangeError", "RunError", "MissingDependencyError", "CheckpointError", "REQUEST_ERRORS",
    "exception_text",
]


class FxsplitError(Exception):
    """Base of every error fxsplit raises on purpose."""


# -- request errors (also ValueError): the message says what to change


class PlanError(FxsplitError, ValueError):
    """A parallelization request that cannot be planned; the message says what to change."""


class TPPlanError(FxsplitError, ValueError):
    """The graph or the user's plan cannot be tensor-parallel as asked; says what and the fix."""


class ShardingError(FxsplitError, ValueError):
    """A tensor cannot be split as asked (sizes, degree, or shapes that do not match)."""


class PartitionError(FxsplitError, ValueError):
    """A partition request that cannot be met; the message names the numbers and the fix."""


class SplitError(FxsplitError, ValueError):
    """A split request that cannot be met (bad split point, too many stages, memory cap)."""


class StageBuildError(FxsplitError, ValueError):
    """A graph or an assignment that cannot be cut into stages; the message names the node."""


class ScheduleError(FxsplitError, ValueError):
    """A schedule breaks a rule; the message names the rule and the action and shows the grid."""


class UsageError(FxsplitError, ValueError):
    """An argument value, a command-line request (exit code 2) or an environment setting
    (``FXSPLIT_CPU_MATMUL``) that cannot be used as given, where none of the errors above (plan,
    tensor-parallel plan, sharding, split, stage, schedule) fits."""


class ArgumentTypeError(FxsplitError, TypeError):
    """A value of the wrong type: an argument, a field, or what a user's callable returned (a pass
    that returns no ``PassResult``); the message names the value, its type and the type wanted."""


class OutOfRangeError(FxsplitError, IndexError):
    """An index outside its range (a stage, a rank, a tensor dim); the message names the range."""


class MissingKeyError(FxsplitError, KeyError):
    """A name looked up that is not there (a symbol, a node's metadata, a registered pass); the
    message names it and what there is."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0]) if self.args else ""


class UnknownPassError(MissingKeyError):
    """No pass is registered under the requested name (the message lists close names)."""


class PathError(FxsplitError, AttributeError):
    """A dotted path (``"blocks.0.attn.q.weight"``) names nothing in the module; the message names
    the path, the missing component and what its owner has (``fxsplit.graph.ops.resolve_path``)."""


# -- run errors (also RuntimeError)


class RunError(FxsplitError, RuntimeError):
    """This cannot run now: the environment (no process group, a launcher variable not set, too
    few devices), the order of calls (``step()`` on a model built without ``loss_fn``, a model
    whose rank failed), or a value met while running (gradients with a non-finite norm). The
    message says what to do instead."""


class MissingDependencyError(FxsplitError, ImportError):
    """An optional dependency is not installed (matplotlib for PNG timelines); the message names
    the package and how to install it."""


class TraceError(FxsplitError, RuntimeError):
    """The model could not be traced; the message names where and suggests the fix."""


class PipelineError(FxsplitError, RuntimeError):
    """A pipeline step failed on this rank: a peer failed or never answered, or a stage raised.

    Attributes name the place: ``rank`` (this pipeline rank), ``peer`` (the pipeline rank that was
    awaited, or None), ``action`` (e.g. "2F3"), ``microbatch``.
    """

    def __init__(self, message: str, *, rank: int, peer: int | None, action: str | None,
                 microbatch: int | None):
        super().__init__(message)
        self.rank = rank
        self.peer = peer
        self.action = action
        self.microbatch = microbatch


class RankFailedError(FxsplitError, RuntimeError):
    """Another rank failed a ``step()`` or ``forward()`` call; raised on every rank whose own code
    did not fail ([Note: failures] at :meth:`fxsplit.api.model.ParallelModel._agree`). ``failed``
    maps each failed global rank to its error text."""

    def __init__(self, message: str, *, failed: Mapping[int, str]):
        super().__init__(message)
        self.failed = dict(failed)


class VerificationError(FxsplitError, RuntimeError):
    """``fxsplit.verify``: the split model's outputs or gradients differ from the unsplit model's.

    `node` is the first node of the split graphs whose value diverges (None when every forward
    value agrees and only gradients differ), `stage` its stage, `problems` every output and
    gradient that differs."""

    def __init__(self, message: str, *, node: str | None = None, stage: int | None = None,
                 problems: tuple[str, ...] = ()):
        super().__init__(message)
        self.node = node
        self.stage = stage
        self.problems = tuple(problems)


class PassContractError(FxsplitError, ValueError):
    """A graph pass left the graph in a state later passes cannot trust: a node it added or changed
    has no ``meta["val"]`` / ``meta["fxsplit"]``, or its metadata disagrees with what the node
    computes on fake tensors ([Note: metadata check after a pass] in :mod:`fxsplit.graph.pass_check`).

    `pass_name` is the pass, `node` the first bad node (graph order)."""

    def __init__(self, message: str, *, pass_name: str, node: str):
        super().__init__(message)
        self.pass_name = pass_name
        self.node = node


class CheckpointError(FxsplitError, RuntimeError):
    """A checkpoint cannot be saved or loaded: no checkpoint at the path, a file damaged since the
    save (the message names the tensor and its ``.distcp`` file), non-finite values, or a failure
    inside ``torch.distributed.checkpoint`` (whose ``CheckpointException`` is a ``BaseException``;
    it is kept as ``__cause__`` and its text is in the message). [Note: checkpoint layout] in
    :mod:`fxsplit.api.checkpoint`."""


class DistributedRunError(FxsplitError, RuntimeError):
    """A launch of :func:`fxsplit.testing.run_distributed` failed: a rank raised, died, or the
    launch ran past its timeout.

    `rank` is the failing rank (None for a timeout), `rank_traceback` its traceback text
    ("" when it died without one), `stuck_ranks` the ranks still running at a timeout.
    """

    def __init__(self, message: str, *, rank: int | None = None, rank_traceback: str = "",
                 stuck_ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.rank = rank
        self.rank_traceback = rank_traceback
        self.stuck_ranks = stuck_ranks


REQUEST_ERRORS = (PlanError, TPPlanError, ShardingError, PartitionError, SplitError, StageBuildError,
                  ScheduleError, PassContractError, UsageError, ArgumentTypeError, OutOfRangeError, MissingKeyError, PathError)
"""The errors that mean "this request cannot be answered as given" (the CLI's exit code 2)."""


def exception_text(exc: BaseException) -> str:
    """``"<class name>: <the whole message>"`` of ``exc``, for a reason fxsplit records and shows
    later (``compile_fallbacks``, ``split_fallbacks``): the whole text, as inductor's first line
    often says only that something failed and the cause follows on later lines. When the error
    came from deeper code (its cause chain, then its traceback), the innermost frame is named
    too, ``[raised at <file>:<line> in <function>]``: a compiler's own wrapper messages rarely
    say where in the compiler the failure was."""
    text = str(exc).strip()
    head = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    root, seen = exc, {id(exc)}
    while (nxt := root.__cause__ or root.__context__) is not None and id(nxt) not in seen:
        root = nxt
        seen.add(id(root))
    frames = traceback.extract_tb(root.__traceback__) if root.__traceback__ is not None else []
    if not frames:
        return head
    where = frames[-1]
    path = where.filename.split("site-packages/")[-1]
    kind = "" if root is exc else f"{type(root).__name__} "
    return f"{head} [{kind}raised at {path}:{where.lineno} in {where.name}]"
