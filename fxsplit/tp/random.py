"""Random-number streams for model parallelism (Megatron's RNG tracker, on torch generator states).

Terms: **stream**: where a random op's numbers come from (a generator state). **stage stream**:
the default generators (CPU and the stage's device) seeded for one forward of one microbatch of
one stage; everything not in a tp-sharded region draws from it. **tp stream**: a tp rank's own
stream, for random ops in tp-sharded regions. **tp-sharded random op**: a random op (dropout,
bernoulli, attention with ``dropout_p > 0``, ...) whose output is a shard (heads, hidden width,
sequence) rather than a replica.

    with stage_stream(seed, stage=s, microbatch=i, step=k, device=dev):   # the runtime, per forward
        out = stage_module(*args)
    y = in_tp_stream(F.dropout)(x, 0.1, True)          # what the TP pass writes for a sharded dropout
    y = call_in_tp_stream(drop_module, x)              # ... and for an nn.Dropout call_module

[Note: RNG streams]
From one user seed (``ParallelConfig.seed``; default ``torch.initial_seed()`` of global rank 0,
so it follows the user's ``torch.manual_seed``):
1. Stage stream: before each forward of microbatch i on stage s in step k the runtime seeds the
   CPU generator and the stage device's generator with ``derive_seed(seed, s, i, k)`` and
   restores the caller's states afterwards (the user's global RNG is not consumed). It is the
   same on every tp rank, so a replicated region (e.g. the residual dropout after a row-parallel
   all-reduce) draws the same mask on every tp rank and the replicas never diverge. It differs
   per stage (Megatron adds 100 * pp_rank; a rank here holds v stages, so it is per stage), per
   microbatch and per step, and depends on nothing else: not on the schedule's order.
2. tp stream: a tp-sharded random op runs under :func:`tp_stream`: a 62-bit number r is drawn
   from the CPU stage stream (the same r on every tp rank, which all advance alike), and the op
   runs with the CPU and its device's generator seeded with ``derive_seed(r, 2718 + tp_rank)``
   (Megatron's offset: seed + 2718 + tp_rank), the caller's states restored after. Each sharded
   op gets its own r, so two sharded dropouts never share a mask.
3. Replay: both streams are functions of the generator states at the start of the forward, so
   whatever restores those replays every mask: ``torch.utils.checkpoint`` (``preserve_rng_state``,
   the default) recomputes with the same draws, replicated and sharded. The zero-bubble I/W split
   never re-runs a forward (W reuses the graph I kept), so it cannot re-draw. Traced (the graph
   split, fxsplit.runtime.compile.split_graph), a tp stream is Python around the op, outside any graph:
   inside `traced_tp_streams()` the block only records which traced nodes it covers, and the
   split puts `enter_tp_stream` / `exit_tp_stream` (this module's seeding, run where the graph
   runs) around them, so the graph draws r and seeds exactly as the eager block does.
4. Data-parallel replicas get the same streams, as in Megatron (its default): their different
   data makes them differ; nothing here depends on the dp rank.
The same seed gives the same draws run to run, on CPU; on CUDA the draws are deterministic too,
but a kernel may not be (``torch.use_deterministic_algorithms``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from fxsplit.graph.ops import is_random
from fxsplit.tp.collectives import axis_rank

__all__ = [
    "TP_SEED_OFFSET",
    "TracedStream",
    "call_in_tp_stream",
    "derive_seed",
    "enter_tp_stream",
    "exit_tp_stream",
    "in_tp_stream",
    "is_random",
    "stage_stream",
    "tp_stream",
    "traced_tp_streams",
]

TP_SEED_OFFSET = 2718  # Megatron-LM's offset of the tp-sharded streams
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed from ``seed`` and ``keys`` (splitmix64 chained over them): a pure function,
    the same on every process, and unrelated seeds for neighbouring keys."""
    x = _splitmix64(int(seed) & _MASK64)
    for k in keys:
        x = _splitmix64(x ^ (int(k) & _MASK64))
    return x >> 1


def _generators(device: torch.device | str | None) -> list[torch.Generator]:
    """The CPU default generator and, for an accelerator device, that device's default one."""
    gens = [torch.default_generator]
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda":
            idx = device.index if device.index is not None else torch.cuda.current_device()
            torch.cuda.init()
            gens.append(torch.cuda.default_generators[idx])
    return gens


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device | str | None) -> Iterator[None]:
    gens = _generators(device)
    saved = [g.get_state() for g in gens]
    try:
        for g in gens:
            g.manual_seed(seed)
        yield
    finally:
        for g, s in zip(gens, saved):
            g.set_state(s)


@contextlib.contextmanager
def stage_stream(seed: int, *, stage: int, microbatch: int, step: int,
                 device: torch.device | str | None = None) -> Iterator[None]:
    """Run the block on the stage stream of (stage, microbatch, step) ([Note: RNG streams] 1)."""
    with _seeded(derive_seed(seed, stage, microbatch, step), device):
        yield


def enter_tp_stream(axis: str = "tp", device: torch.device | str | None = None) -> list[torch.Tensor]:
    """Enter this tp rank's own stream ([Note: RNG streams] 2): draw r from the CPU generator,
    seed the CPU and ``device``'s generators from it; returns their states before seeding, for
    `exit_tp_stream`."""
    r = int(torch.randint(0, 1 << 62, (), generator=torch.default_generator))
    gens = _generators(device)
    saved = [g.get_state() for g in gens]
    for g in gens:
        g.manual_seed(derive_seed(r, TP_SEED_OFFSET + axis_rank(axis)))
    return saved


def exit_tp_stream(saved: list[torch.Tensor], device: torch.device | str | None = None) -> None:
    """Leave the stream `enter_tp_stream` entered: put the generators' states back."""
    for g, state in zip(_generators(device), saved):
        g.set_state(state)


@dataclass
class TracedStream:
    """One `tp_stream` block as make_fx traced it ([Note: RNG streams] 3): ``start`` the number of
    graph nodes before it, ``before`` the last of them, ``nodes`` the nodes traced inside it."""

    axis: str
    device: str | None
    start: int
    before: torch.fx.Node
    nodes: list[torch.fx.Node]


_TRACED: contextvars.ContextVar[list[TracedStream] | None] = contextvars.ContextVar(
    "fxsplit_traced_tp_streams", default=None)


@contextlib.contextmanager
def traced_tp_streams() -> Iterator[list[TracedStream]]:
    """Inside the block, `tp_stream` seeds nothing while tracing: under make_fx it records the
    nodes it covers (returned list, in trace order); under fake tensors alone it does nothing."""
    streams: list[TracedStream] = []
    token = _TRACED.set(streams)
    try:
        yield streams
    finally:
        _TRACED.reset(token)


@contextlib.contextmanager
def tp_stream(axis: str = "tp", *, device: torch.device | str | None = None) -> Iterator[None]:
    """Run the block on this tp rank's own stream ([Note: RNG streams] 2); ``axis`` is the mesh
    axis whose bound group gives the rank (rank 0 when unbound)."""
    traced = _TRACED.get()
    if traced is not None:  # traced ([Note: RNG streams] 3)
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        mode = get_proxy_mode()
        if mode is None:
            yield
            return
        graph = mode.tracer.graph
        start, before = len(graph.nodes), next(iter(reversed(graph.nodes)))
        yield
        traced.append(TracedStream(axis, None if device is None else str(device), start, before,
                                   list(graph.nodes)[start:]))
        return
    saved = enter_tp_stream(axis, device)
    try:
        yield
    finally:
        exit_tp_stream(saved, device)


def _device_of(args: tuple, kwargs: dict) -> torch.device | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    return None


_WRAPPED: dict[Any, Callable] = {}  # op -> its tp-stream wrapper: one function per op (fx globals)


def in_tp_stream(op: Callable) -> Callable:
    """``op`` run under :func:`tp_stream` (``tp_axis=`` keyword, default "tp"); the wrapper keeps
    ``op``'s name (``op_name`` and the cost model see the op) and is one object per op, so an fx
    graph calling it prints as ``fxsplit_tp_random_<name>(...)``."""
    if op in _WRAPPED:
        return _WRAPPED[op]

    def wrapper(*args: Any, tp_axis: str = "tp", **kwargs: Any) -> Any:
        with tp_stream(tp_axis, device=_device_of(args, kwargs)):
            return op(*args, **kwargs)

    name = op.__name__ if not isinstance(op, torch._ops.OpOverload) else op.overloadpacket.__name__
    wrapper.__name__ = name
    wrapper.__qualname__ = f"in_tp_stream.{name}"
    wrapper.__module__ = __name__
    wrapper.__wrapped__ = op  # type: ignore[attr-defined]
    _WRAPPED[op] = wrapper
    return wrapper


def call_in_tp_stream(module: nn.Module, *args: Any, tp_axis: str = "tp", **kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` under :func:`tp_stream` (for a random leaf module, e.g. an
    ``nn.Dropout`` call_module; the module keeps its ``training`` flag)."""
    with tp_stream(tp_axis, device=_device_of(args, kwargs)):
        return module(*args, **kwargs)


call_in_tp_stream.draws_random = True  # type: ignore[attr-defined]  # graph.ops.is_random reads it
