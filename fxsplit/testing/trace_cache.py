"""Plan one model several times from one trace (tests): ``with shared_traces(): ...`` makes
:func:`fxsplit.plan` trace each (model object, example inputs, trace options) once and plan every
later call from a copy of that trace.

Terms:
    trace key: the model object (held, so its id is not reused), a fingerprint of it (every
        module's class, identity and training flag; every parameter's and buffer's name, identity,
        shape, dtype, device and requires_grad), the example inputs (tensors by identity, shape,
        dtype and device; other values by ``repr``) and ``trace``'s keyword options
        (``decompose_attention`` read as False for a model with no torch attention module to
        decompose, so a tp plan shares the trace of the plans without tp).
    copy: a new GraphModule over a deep copy of the graph (nodes new, each node's ``meta`` a new
        dict of the same values, as ``torch.fx`` copies nodes), with the module tree copied
        container by container and the tensors shared (the model's own parameters, as a fresh
        trace holds them).

    with shared_traces() as cache:
        p2 = fxsplit.plan(model, args, tp=2)          # traces
        p4 = fxsplit.plan(model, args, tp=4)          # plans from a copy of the same trace
    cache.hits, cache.misses

[Note: sharing a trace between plans]
``torch.export`` of a tiny transformers model takes seconds (symbolic shapes), most of a test that
plans it at t=2, t=4 and pp=2; the graph it produces depends only on the model's code, structure,
configuration and the inputs' shapes and trace options, not on the weights' values. ``plan``'s
passes rewrite the graph they are given in place (tensor parallelism shards, the split cuts), so
each plan gets its own copy and the cached trace is never handed out; the copy keeps every module
and tensor attribute at its path (an alias name of a tied weight that no node reads included,
which ``GraphModule.__deepcopy__`` would drop) and shares the tensors (the plan materializes and
verifies from the model's parameters by reference). A model changed between the calls (a module,
parameter or buffer replaced or reshaped, ``train()``/``eval()``) has another key and is traced
again; a change the fingerprint cannot see (a plain Python attribute read by ``forward``, a
replaced ``forward``) is not: this is for tests that build a model once and plan it several ways,
not a cache for users. Each reuse also checks that the cached graph's code is still what it was.

[Note: plans made before the fork]
``shared_plans(cache)`` goes one step further for a launch's ranks: every rank of
``fxsplit.parallelize`` plans the same model the same way, so a launch's ``prepare`` (run once, in
the process the ranks are forked from: [Note: preparing once per launch] in
fxsplit.testing.harness) plans each layout with ``cache.add(model, args, kwargs, **options)``, and
inside ``shared_plans(cache)`` each rank's ``parallelize`` of that model object with those input
objects and options takes the plan it inherited instead of planning. The key is the trace key with
the whole planning config (``planning_config``: what parallelize plans with) in place of the
options. A plan is handed out once per process (each rank's copy is its own, copy-on-write; a
layout parallelized twice in one rank is added twice, and a third call plans afresh), so nothing
a rank does to its plan reaches another use; ``hits`` / ``misses`` count the calls, for a test to check that its
ranks really planned nothing.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils import _pytree as pytree

from fxsplit.graph.decompose import decomposes

_plan_module = importlib.import_module("fxsplit.api.plan")  # the module (fxsplit.api.plan is also the function)
_parallelize_module = importlib.import_module("fxsplit.api.parallelize")
_make_config = importlib.import_module("fxsplit.api.options").make_config

__all__ = ["SharedPlans", "SharedTraces", "copy_graph_module", "shared_plans", "shared_traces"]


def _tree_copy(mod: nn.Module, memo: dict[int, nn.Module]) -> nn.Module:
    """``mod`` and its submodules as new containers (the same module at two paths stays one),
    holding the same parameter, buffer and attribute objects."""
    if id(mod) in memo:
        return memo[id(mod)]
    new = mod.__class__.__new__(mod.__class__)
    new.__dict__ = dict(mod.__dict__)
    memo[id(mod)] = new
    new._parameters = dict(mod._parameters)
    new._buffers = dict(mod._buffers)
    new._non_persistent_buffers_set = set(mod._non_persistent_buffers_set)
    new._modules = {k: None if v is None else _tree_copy(v, memo) for k, v in mod._modules.items()}
    return new


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` that passes may rewrite without touching ``gm`` ([Note: sharing a trace
    between plans]): new graph and nodes, new module containers, the same tensors."""
    new = _tree_copy(gm, {})
    new.meta = dict(getattr(gm, "meta", {}))
    new.graph = copy.deepcopy(gm.graph)  # the setter takes ownership and recompiles
    return new


# [Note: the trace's shape environment]
# The copies share the trace's symbolic sizes, and with them its ShapeEnv: what a plan learns
# about a size (a guard, a divisibility fact, a replacement such as s0 -> 2*s7 when cp or ep
# splits the batch or the sequence) is written there and would change the next plan's view of
# the same symbols (measured: a dp2 x ep2 x cp2 plan of Mixtral made the next plan's bindings
# miss the batch symbol). A fresh trace starts from a fresh ShapeEnv, so the cache keeps the
# trace's ShapeEnv state (the fields below) and puts it back before each plan from it, bumping
# the version counters its caches are keyed by (torch's private fields: this is a test harness).
_SHAPE_FIELDS = ("replacements", "replacements_slocs", "divisible", "var_to_range", "var_to_range_sloc", "guards",
                 "axioms", "deferred_runtime_asserts", "num_deferred_runtime_asserts")


@dataclass
class _ShapeState:
    env: Any = None
    saved: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def of(gm: torch.fx.GraphModule) -> "_ShapeState":
        env = next((n.meta["val"].fake_mode.shape_env for n in gm.graph.nodes if n.op == "placeholder"
                    and getattr(n.meta.get("val"), "fake_mode", None) is not None), None)
        if env is None:
            return _ShapeState()
        return _ShapeState(env, {k: _copied(getattr(env, k)) for k in _SHAPE_FIELDS if hasattr(env, k)})

    def restore(self) -> None:
        if self.env is None:
            return
        for k, v in self.saved.items():
            setattr(self.env, k, _copied(v))
        for counter in ("_version_counter", "_replacements_version_counter"):
            if hasattr(self.env, counter):
                setattr(self.env, counter, getattr(self.env, counter) + 1)
        if hasattr(self.env, "_get_key"):
            self.env._prev_cache_key = self.env._get_key()
        self.env._resimplify_floor_div_axioms = True


def _copied(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: list(v) if isinstance(v, list) else v for k, v in value.items()}
    return copy.copy(value)


def _fingerprint(model: nn.Module) -> tuple:
    mods = tuple((name, type(m).__qualname__, id(m), m.training) for name, m in model.named_modules(remove_duplicate=False))
    tensors = tuple((name, id(t), tuple(t.shape), t.dtype, str(t.device), t.requires_grad)
                    for name, t in [*model.named_parameters(remove_duplicate=False),
                                    *model.named_buffers(remove_duplicate=False)])
    return mods, tensors


def _input_key(value: Any) -> tuple:
    leaves, spec = pytree.tree_flatten(value)
    return str(spec), tuple((id(x), tuple(x.shape), x.dtype, str(x.device)) if isinstance(x, torch.Tensor) else repr(x)
                            for x in leaves)


@dataclass
class SharedTraces:
    """The traces of one ``shared_traces()`` block; ``hits`` / ``misses`` count the plans."""

    entries: dict[Any, tuple[nn.Module, torch.fx.GraphModule, str]] = field(default_factory=dict)
    shapes: dict[Any, "_ShapeState"] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0

    def trace(self, model: nn.Module, example_args: Any = (), example_kwargs: Any = None, **options: Any):
        if options.get("decompose_attention") and not decomposes(model):  # the same graph as without it
            options = {**options, "decompose_attention": False}
        key = (id(model), _fingerprint(model), _input_key((example_args, example_kwargs)),
               tuple(sorted((k, repr(v)) for k, v in options.items())))
        entry = self.entries.get(key)
        if entry is None:
            self.misses += 1
            gm = _TRACE(model, example_args, example_kwargs, **options)
            entry = self.entries[key] = (model, gm, gm.code)
            self.shapes[key] = _ShapeState.of(gm)
        else:
            self.hits += 1
            self.shapes[key].restore()
        _, gm, code = entry
        if gm.code != code:
            raise AssertionError("shared_traces: the cached trace was modified (a pass rewrote the graph it was handed)")
        return copy_graph_module(gm)


_TRACE = _plan_module.trace


@contextlib.contextmanager
def shared_traces(cache: SharedTraces | None = None) -> Iterator[SharedTraces]:
    """Inside the block, :func:`fxsplit.plan` plans from copies of one trace per trace key
    ([Note: sharing a trace between plans]); ``cache`` carries the traces over from an earlier
    block (a module of tests that plans each model in several tests)."""
    cache = SharedTraces() if cache is None else cache
    previous = _plan_module.trace
    _plan_module.trace = cache.trace
    try:
        yield cache
    finally:
        _plan_module.trace = previous


def _plan_key(model: nn.Module, example_args: Any, example_kwargs: Any, config: Any, global_batch_size: Any) -> tuple:
    return (id(model), _fingerprint(model), _input_key((example_args, example_kwargs)), repr(config),
            global_batch_size)


@dataclass
class SharedPlans:
    """Plans made before a launch's ranks fork ([Note: plans made before the fork]); ``hits`` /
    ``misses`` count the ``parallelize`` calls that took one and those that planned."""

    entries: dict[Any, list[tuple[nn.Module, Any]]] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0

    def add(self, model: nn.Module, example_args: Any = (), example_kwargs: Any = None, *, device_type: str = "cpu",
            global_batch_size: int | None = None, **options: Any) -> Any:
        """Plan ``model`` as ``fxsplit.parallelize(model, example_args, example_kwargs, **options)``
        plans on a ``device_type`` rank, and keep the plan for the ranks."""
        config = _parallelize_module.planning_config(_make_config(None, options, where="parallelize"), device_type)
        the_plan = _plan_module.plan(model, example_args, example_kwargs, config=config,
                                     global_batch_size=global_batch_size)
        key = _plan_key(model, example_args, example_kwargs, config, global_batch_size)
        self.entries.setdefault(key, []).append((model, the_plan))
        return the_plan

    def plan(self, model: nn.Module, example_args: Any = (), example_kwargs: Any = None, *, config: Any = None,
             global_batch_size: int | None = None, **options: Any) -> Any:
        """``fxsplit.plan`` as parallelize calls it: the kept plan of this key, once, else a new plan."""
        key = None if options else _plan_key(model, example_args, example_kwargs, config, global_batch_size)
        kept = self.entries.get(key)
        if not kept:
            self.misses += 1
            return _plan_module.plan(model, example_args, example_kwargs, config=config,
                                     global_batch_size=global_batch_size, **options)
        self.hits += 1
        return kept.pop(0)[1]


@contextlib.contextmanager
def shared_plans(cache: SharedPlans) -> Iterator[SharedPlans]:
    """Inside the block, :func:`fxsplit.parallelize` takes the plans ``cache`` holds for its model,
    inputs and options instead of planning ([Note: plans made before the fork])."""
    previous = _parallelize_module.plan
    _parallelize_module.plan = cache.plan
    try:
        yield cache
    finally:
        _parallelize_module.plan = previous
