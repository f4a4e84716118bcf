"""Tensor-parallel collectives as graph-friendly functions of a mesh axis NAME.

Terms: **axis** -- a mesh dimension name ("tp", "dp", "pp"); **group** -- the ProcessGroup an
axis is bound to at run time; **n** -- the group's size; **shard** -- this rank's 1/n slice of a
tensor along `dim`; **f / g** -- Megatron's conjugate operators (f: identity forward, all-reduce
backward; g: all-reduce forward, identity backward).

    with bind_groups({"tp": tp_group}):
        y = reduce_from_region(row_linear(gelu(col_linear(copy_to_region(x)))))

[Note: axis binding] A plan graph holds axis names, never ProcessGroups, so it prints cleanly,
pickles, and runs unchanged in one process. `bind_groups` binds names to groups for the current
context (a `contextvars.ContextVar`, so threads and async tasks each see their own binding;
nested blocks add to and override the outer binding). An axis that is unbound, bound to None,
or bound to a group of size 1 makes every op below the identity (a shard is the whole tensor).
The group is looked up in forward and stored on the autograd context, so backward uses the
same group even when it runs outside the `with` block or on another thread.

[Note: fx leaves] Every public op here is registered with `torch.fx.wrap`, and also turns
itself into a node when called on a `torch.fx.Proxy` (which covers callers that imported the
function by name). Either way `torch.fx.symbolic_trace` records ONE `call_function` node whose
target is the function itself, with the axis name as a plain argument; the body is never traced.

| op | forward | backward |
| --- | --- | --- |
| copy_to_region (f) | identity | all-reduce sum |
| reduce_from_region (g) | all-reduce sum | identity |
| gather_from_region | all-gather, concat on dim | keep own shard |
| scatter_to_region | keep own shard | all-gather, concat on dim |
| reduce_scatter_to_region (sequence parallel) | reduce-scatter sum on dim | all-gather on dim |
| gather_to_region (sequence parallel, = gather_for_sp) | all-gather on dim | reduce-scatter on dim |

Counting: `record_collectives()` logs each collective a rank issues (op, wire kind, axis,
phase, shape) so tests can check, e.g., one all-reduce forward and one backward per MLP;
`COLLECTIVE_OPS` holds the graph targets so a pass or test can find the nodes.

[Note: traced collectives]
Eagerly, every op above calls the c10d collectives (``dist.all_reduce`` & co.). Under a tracer
(make_fx, fake tensors, dynamo: ``_functional_collectives._are_we_tracing``) those trace as
in-place c10d ops whose Work is waited on outside the graph, so data flow neither orders their
readers nor waits for them. Traced, the ops call torch's functional collectives instead
(``_c10d_functional.all_reduce`` / ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, each
followed by ``wait_tensor``): pure functions of their input, so a stage's joint forward and
backward traces into a graph that can be partitioned (fxsplit.runtime.compile.split_graph) and run.
They sum the same contributions in the backend's order, as the eager ops do (gather and
reduce-scatter work on dim 0; another dim is moved there and back, which is data movement).
A traced collective is not logged when traced (its tensors are fake) but where the traced
graph runs: `traced_collectives()` collects the calls a trace issued, in order, for the runner
to attach to its graph's nodes and `note_calls` them each time the graph runs.

Sharded dims must divide evenly by n (all ranks hold equal shards). Reduce-scatter uses
`torch.distributed.reduce_scatter`, which gloo supports in torch 2.13 for float32/float64/
bfloat16/int64 (checked); no all-reduce fallback is needed there. All ops sum in the group's
reduction order, so results can differ from a one-process sum in the last float bits.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch.distributed._functional_collectives import _are_we_tracing

from fxsplit.errors import ArgumentTypeError, OutOfRangeError, RunError, ShardingError, UsageError

__all__ = [
    "COLLECTIVE_OPS",
    "CollectiveCall",
    "active",
    "all_reduce_sum",
    "axis_rank",
    "axis_size",
    "bind_groups",
    "bind_waiter",
    "wait_collective",
    "copy_to_region",
    "current_group",
    "gather_for_sp",
    "gather_from_region",
    "gather_to_region",
    "note_calls",
    "note_collective",
    "record_collectives",
    "reduce_from_region",
    "reduce_scatter_to_region",
    "scatter_to_region",
    "start_all_reduce",
    "traced_collectives",
]

_EMPTY: Mapping[str, Any] = MappingProxyType({})
_GROUPS: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "fxsplit_axis_groups", default=_EMPTY
)


# ----------------------------------------------------------------------------- binding


@contextlib.contextmanager
def bind_groups(mapping: Mapping[str, Any]) -> Iterator[None]:
    """Bind axis names to ProcessGroups (or None to unbind) inside the `with` block.

    See [Note: axis binding]. `mapping` is typically `fxsplit.runtime.mesh.mesh_groups(mesh)`.
    """
    if not isinstance(mapping, Mapping):
        raise ArgumentTypeError(
            f"bind_groups: expected a mapping from axis name to ProcessGroup, got "
            f"{type(mapping).__name__}; for a DeviceMesh use bind_groups(mesh_groups(mesh))"
        )
    for name, group in mapping.items():
        if not isinstance(name, str):
            raise ArgumentTypeError(f"bind_groups: axis names must be str, got {name!r}")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise ArgumentTypeError(
                f"bind_groups: axis {name!r} is bound to a {type(group).__name__}, expected a "
                "torch.distributed.ProcessGroup or None"
            )
    token = _GROUPS.set(MappingProxyType({**_GROUPS.get(), **mapping}))
    try:
        yield
    finally:
        _GROUPS.reset(token)


_WAITER: contextvars.ContextVar[Any] = contextvars.ContextVar("fxsplit_waiter", default=None)


@contextlib.contextmanager
def bind_waiter(waiter: Any) -> Iterator[None]:
    """Inside the block, eager collectives wait through ``waiter(work, what, peers)`` instead of
    ``work.wait()`` (the runtime's polled, bounded wait: [Note: failure protocol] in
    fxsplit.runtime.watch); captured in forward for backward like the group ([Note: axis binding])."""
    token = _WAITER.set(waiter)
    try:
        yield
    finally:
        _WAITER.reset(token)


def wait_collective(work: Any, group: dist.ProcessGroup, what: str) -> None:
    """Wait for an eager collective on ``group`` through the bound waiter, if any (``bind_waiter``)."""
    waiter = _WAITER.get()
    if waiter is None:
        work.wait()
    else:
        ranks = dist.get_process_group_ranks(group)
        waiter(work, f"in the {what} (global ranks {ranks})", ranks)


def current_group(axis: str) -> dist.ProcessGroup | None:
    """The ProcessGroup `axis` is bound to in this context, or None when it is unbound."""
    return _GROUPS.get().get(axis)


@dataclass(frozen=True)
class CollectiveCall:
    """One collective this rank issued, as recorded by `record_collectives`.

    `op` is the public function ("copy_to_region"), `kind` the wire operation ("all_reduce",
    "all_gather" or "reduce_scatter"), `phase` "forward", "backward" or "no_grad"
    (`all_reduce_sum`), `shape`/`dtype` those of the tensor this rank contributed.
    """

    op: str
    kind: str
    axis: str
    phase: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{self.phase} {self.kind}[{self.axis}] {list(self.shape)} ({self.op})"


_LOG: contextvars.ContextVar[list[CollectiveCall] | None] = contextvars.ContextVar(
    "fxsplit_collective_log", default=None
)


@contextlib.contextmanager
def record_collectives() -> Iterator[list[CollectiveCall]]:
    """Record every collective issued by ops called inside the block, backward included.

    Yields the list the calls are appended to. The log is captured by each op in forward, so
    the backward collectives of ops run inside the block are recorded even when `.backward()`
    is called after it. Identity ops (unbound axis, group of size 1) record nothing.
    """
    log: list[CollectiveCall] = []
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)


def note_collective(op: str, kind: str, axis: str, phase: str, x: torch.Tensor) -> None:
    """Record a collective that an op issues itself (with torch.distributed directly) in the
    active `record_collectives()` log, so that every collective fxsplit issues is counted."""
    log = _LOG.get()
    if log is not None:
        log.append(CollectiveCall(op, kind, axis, phase, tuple(x.shape), x.dtype))


_TRACE_LOG: contextvars.ContextVar[list[CollectiveCall] | None] = contextvars.ContextVar(
    "fxsplit_traced_collectives", default=None
)


@contextlib.contextmanager
def traced_collectives() -> Iterator[list[CollectiveCall]]:
    """Collect the collectives issued while tracing inside the block, in issue order (one per
    functional collective node the trace records: [Note: traced collectives])."""
    calls: list[CollectiveCall] = []
    token = _TRACE_LOG.set(calls)
    try:
        yield calls
    finally:
        _TRACE_LOG.reset(token)


def note_calls(calls: list[CollectiveCall]) -> None:
    """Log ``calls`` (a traced graph's collectives, as it runs them) in the active
    `record_collectives()` log, if any."""
    log = _LOG.get()
    if log is not None:
        log.extend(calls)


@dataclass(frozen=True)
class _Bound:
    """What an op needs from its context, captured in forward for use in backward."""

    axis: str
    group: dist.ProcessGroup
    log: list[CollectiveCall] | None
    waiter: Any = None

    def wait(self, work: Any, kind: str) -> None:
        """Wait for an eager collective's ``work``: bounded and failure-aware when a waiter is bound."""
        if self.waiter is None:
            work.wait()
        else:
            self.waiter(work, f"in the {_PARALLELISM.get(self.axis, 'mesh-axis')} {kind} over axis {self.axis!r} (global ranks "
                        f"{dist.get_process_group_ranks(self.group)})", dist.get_process_group_ranks(self.group))

    def note(self, op: str, kind: str, phase: str, x: torch.Tensor) -> None:
        call = CollectiveCall(op, kind, self.axis, phase, tuple(x.shape), x.dtype)
        if _are_we_tracing():  # [Note: traced collectives]: logged where the graph runs
            traced = _TRACE_LOG.get()
            if traced is not None:
                traced.append(call)
        elif self.log is not None:
            self.log.append(call)


_PARALLELISM = {"tp": "tensor-parallel", "dp": "data-parallel", "ep": "expert-parallel", "cp": "context-parallel"}  # wait messages


def _active(axis: str) -> _Bound | None:
    """The bound group if it has more than one rank, else None (the ops become identities)."""
    if not isinstance(axis, str):
        raise ArgumentTypeError(f"collectives: axis must be a mesh axis name (str), got {axis!r}")
    group = _GROUPS.get().get(axis)
    if group is None or group.size() == 1:
        return None
    return _Bound(axis, group, _LOG.get(), _WAITER.get())


def active(axis: str) -> _Bound | None:
    """What an op issuing its own collective over ``axis`` needs (the group, the log, the bounded
    waiter), or None when the axis is unbound or has one rank (the op is then the identity)."""
    return _active(axis)


def axis_size(axis: str = "tp") -> int:
    """Number of ranks along `axis` (1 when unbound)."""
    group = current_group(axis)
    return 1 if group is None else group.size()


def axis_rank(axis: str = "tp") -> int:
    """This process's rank along `axis` (0 when unbound)."""
    group = current_group(axis)
    return 0 if group is None else group.rank()


# ----------------------------------------------------------------------------- raw collectives


def _norm_dim(x: torch.Tensor, dim: int, op: str) -> int:
    if not -x.dim() <= dim < x.dim():
        raise OutOfRangeError(f"{op}: dim={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def _check_divisible(x: torch.Tensor, dim: int, n: int, op: str, axis: str) -> None:
    if x.shape[dim] % n:
        raise ShardingError(
            f"{op}: dim {dim} of shape {tuple(x.shape)} has size {x.shape[dim]}, which axis "
            f"{axis!r} (size {n}) cannot split evenly; choose a degree that divides "
            f"{x.shape[dim]} or pad that dimension"
        )


_FC = torch.ops._c10d_functional


def _all_reduce(x: torch.Tensor, b: _Bound, op: str, phase: str) -> torch.Tensor:
    b.note(op, "all_reduce", phase, x)
    if _are_we_tracing():  # [Note: traced collectives]
        return _FC.wait_tensor(_FC.all_reduce(x.contiguous(), "sum", b.group.group_name))
    out = x.clone(memory_format=torch.contiguous_format)
    b.wait(dist.all_reduce(out, group=b.group, async_op=True), "all-reduce")
    return out


class _PendingAllReduce:
    """An all-reduce started by `start_all_reduce`; ``wait()`` returns the sum."""

    def __init__(self, x: torch.Tensor, work: Any, b: _Bound | None = None):
        self.x, self.work, self.b = x, work, b

    def wait(self) -> torch.Tensor:
        if self.work is None:
            return _FC.wait_tensor(self.x)
        self.b.wait(self.work, "all-reduce")
        return self.x


def start_all_reduce(x: torch.Tensor, b: _Bound, op: str, phase: str) -> _PendingAllReduce:
    """Start summing ``x`` over ``b``'s group; ``.wait()`` gives the sum. Eager: in place on
    ``x`` (contiguous), asynchronous; traced: a functional all-reduce whose ``wait_tensor`` is
    placed where ``wait()`` is called ([Note: traced collectives]), so the overlap is kept."""
    b.note(op, "all_reduce", phase, x)
    if _are_we_tracing():
        return _PendingAllReduce(_FC.all_reduce(x.contiguous(), "sum", b.group.group_name), None)
    return _PendingAllReduce(x, dist.all_reduce(x, group=b.group, async_op=True), b)


def _all_gather(x: torch.Tensor, dim: int, b: _Bound, op: str, phase: str) -> torch.Tensor:
    b.note(op, "all_gather", phase, x)
    n = b.group.size()
    if _are_we_tracing():  # gathered on dim 0, then the n blocks laid side by side on dim
        out = _FC.wait_tensor(_FC.all_gather_into_tensor(x.contiguous(), n, b.group.group_name))
        return out if dim == 0 else torch.cat(out.chunk(n, dim=0), dim=dim)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(b.group.size())]
    b.wait(dist.all_gather(parts, x, group=b.group, async_op=True), "all-gather")
    return torch.cat(parts, dim=dim)


def _own_shard(x: torch.Tensor, dim: int, b: _Bound) -> torch.Tensor:
    return x.chunk(b.group.size(), dim=dim)[b.group.rank()].contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, b: _Bound, op: str, phase: str) -> torch.Tensor:
    b.note(op, "reduce_scatter", phase, x)
    if _are_we_tracing():  # the blocks of dim stacked on dim 0, reduce-scattered there
        n = b.group.size()
        stacked = x.contiguous() if dim == 0 else torch.cat(x.chunk(n, dim=dim), dim=0)
        return _FC.wait_tensor(_FC.reduce_scatter_tensor(stacked, "sum", n, b.group.group_name))
    parts = [c.contiguous() for c in x.chunk(b.group.size(), dim=dim)]
    out = torch.empty_like(parts[b.group.rank()])
    b.wait(dist.reduce_scatter(out, parts, group=b.group, async_op=True), "reduce-scatter")
    return out


# ----------------------------------------------------------------------------- autograd pairs
# Each forward stores the _Bound on ctx; see [Note: axis binding].


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, b):
        ctx.b = b
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.b, "copy_to_region", "backward"), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, b):
        return _all_reduce(x, b, "reduce_from_region", "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, b):
        ctx.dim, ctx.b = dim, b
        return _all_gather(x, dim, b, "gather_from_region", "forward")

    @staticmethod
    def backward(ctx, grad):
        return _own_shard(grad, ctx.dim, ctx.b), None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, b):
        ctx.dim, ctx.b = dim, b
        return _own_shard(x, dim, b)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.b, "scatter_to_region", "backward"), None, None


class _ReduceScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, b):
        ctx.dim, ctx.b = dim, b
        return _reduce_scatter(x, dim, b, "reduce_scatter_to_region", "forward")

    @staticmethod
    def backward(ctx, grad):
        return (_all_gather(grad, ctx.dim, ctx.b, "reduce_scatter_to_region", "backward"),
                None, None)


class _GatherToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, b):
        ctx.dim, ctx.b = dim, b
        return _all_gather(x, dim, b, "gather_to_region", "forward")

    @staticmethod
    def backward(ctx, grad):
        return (_reduce_scatter(grad, ctx.dim, ctx.b, "gather_to_region", "backward"),
                None, None)


# ----------------------------------------------------------------------------- public ops


def _traced(name: str, args: tuple, kwargs: dict) -> torch.fx.Proxy | None:
    """If any argument is an fx Proxy, record one call_function node (see [Note: fx leaves])."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.fx.Proxy):
            return a.tracer.create_proxy("call_function", _ORIGINALS[name], args, kwargs)
    return None


def copy_to_region(x: torch.Tensor, axis: str = "tp") -> torch.Tensor:
    """f: identity forward; backward all-reduces the gradient over `axis`.

    Goes before a column-parallel layer (its input is replicated)."""
    if (node := _traced("copy_to_region", (x,), {"axis": axis})) is not None:
        return node
    b = _active(axis)
    return x if b is None else _CopyToRegion.apply(x, b)


def reduce_from_region(x: torch.Tensor, axis: str = "tp") -> torch.Tensor:
    """g: forward all-reduces (sums) partial results over `axis`; identity backward.

    Goes after a row-parallel layer (its output is a partial sum)."""
    if (node := _traced("reduce_from_region", (x,), {"axis": axis})) is not None:
        return node
    b = _active(axis)
    return x if b is None else _ReduceFromRegion.apply(x, b)


def gather_from_region(x: torch.Tensor, dim: int = -1, axis: str = "tp") -> torch.Tensor:
    """Forward all-gathers shards and concatenates them on `dim`; backward keeps this rank's
    shard (the consumer is replicated, so every rank holds the same full gradient)."""
    if (node := _traced("gather_from_region", (x,), {"dim": dim, "axis": axis})) is not None:
        return node
    b = _active(axis)
    if b is None:
        return x
    return _GatherFromRegion.apply(x, _norm_dim(x, dim, "gather_from_region"), b)


def scatter_to_region(x: torch.Tensor, dim: int = -1, axis: str = "tp") -> torch.Tensor:
    """Forward keeps this rank's shard of `dim`; backward all-gathers the gradient shards."""
    if (node := _traced("scatter_to_region", (x,), {"dim": dim, "axis": axis})) is not None:
        return node
    b = _active(axis)
    if b is None:
        return x
    d = _norm_dim(x, dim, "scatter_to_region")
    _check_divisible(x, d, b.group.size(), "scatter_to_region", axis)
    return _ScatterToRegion.apply(x, d, b)


def reduce_scatter_to_region(x: torch.Tensor, dim: int, axis: str = "tp") -> torch.Tensor:
    """Sequence parallel: forward sums over `axis` and keeps this rank's shard of `dim`;
    backward all-gathers. Replaces g after a row-parallel layer."""
    if (node := _traced("reduce_scatter_to_region", (x,), {"dim": dim, "axis": axis})) is not None:
        return node
    b = _active(axis)
    if b is None:
        return x
    d = _norm_dim(x, dim, "reduce_scatter_to_region")
    _check_divisible(x, d, b.group.size(), "reduce_scatter_to_region", axis)
    return _ReduceScatterToRegion.apply(x, d, b)


def gather_to_region(x: torch.Tensor, dim: int, axis: str = "tp") -> torch.Tensor:
    """Sequence parallel: forward all-gathers shards on `dim`; backward reduce-scatters the
    gradient (sums the ranks' contributions, keeps this rank's shard). Replaces f before a
    column-parallel layer."""
    if (node := _traced("gather_to_region", (x,), {"dim": dim, "axis": axis})) is not None:
        return node
    b = _active(axis)
    if b is None:
        return x
    return _GatherToRegion.apply(x, _norm_dim(x, dim, "gather_to_region"), b)


gather_for_sp = gather_to_region  # the name used in the shared contract


def all_reduce_sum(x: torch.Tensor, axis: str = "dp", *, inplace: bool = False) -> torch.Tensor:
    """Sum `x` over `axis` with no autograd (gradient buckets, tied-weight gradients, metrics).

    Returns a new tensor, or `x` itself summed in place when `inplace=True`. Raises if `x`
    requires grad while grad mode is on: use `reduce_from_region` for a differentiable sum.
    """
    if (node := _traced("all_reduce_sum", (x,), {"axis": axis, "inplace": inplace})) is not None:
        return node
    if x.requires_grad and torch.is_grad_enabled():
        raise RunError(
            f"all_reduce_sum: the tensor of shape {tuple(x.shape)} requires grad, and this sum "
            "is not differentiated; use reduce_from_region(x, axis) inside a model, or call "
            "under torch.no_grad() for gradients and metrics"
        )
    b = _active(axis)
    if b is None:
        return x if inplace else x.clone()
    if inplace:
        if not x.is_contiguous():
            raise UsageError(
                f"all_reduce_sum: inplace=True needs a contiguous tensor, got shape "
                f"{tuple(x.shape)} with strides {x.stride()}; call .contiguous() first or use "
                "inplace=False"
            )
        b.note("all_reduce_sum", "all_reduce", "no_grad", x)
        b.wait(dist.all_reduce(x, group=b.group, async_op=True), "all-reduce")
        return x
    return _all_reduce(x, b, "all_reduce_sum", "no_grad")


_ORIGINALS = {
    f.__name__: f
    for f in (
        copy_to_region,
        reduce_from_region,
        gather_from_region,
        scatter_to_region,
        reduce_scatter_to_region,
        gather_to_region,
        all_reduce_sum,
    )
}

# The graph targets of the ops above: `node.target in COLLECTIVE_OPS` finds (and counts) them.
COLLECTIVE_OPS: frozenset = frozenset(_ORIGINALS.values())

torch.fx.wrap("copy_to_region")
torch.fx.wrap("reduce_from_region")
torch.fx.wrap("gather_from_region")
torch.fx.wrap("scatter_to_region")
torch.fx.wrap("reduce_scatter_to_region")
torch.fx.wrap("gather_to_region")
torch.fx.wrap("gather_for_sp")
torch.fx.wrap("all_reduce_sum")
