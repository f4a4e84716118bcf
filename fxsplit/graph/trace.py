"""Tracing frontends: one fx GraphModule with fxsplit metadata, from plain fx or torch.export.

Terms:
- **method**: ``"fx"`` (``torch.fx`` symbolic tracing at module level: ``nn.Linear`` stays a
  ``call_module`` node), ``"export"`` (``torch.export.export(..., strict=False).module()``: ATen
  ops, parameters as ``get_attr`` nodes), ``"auto"`` (fx, then export; :class:`TraceInfo` says which
  ran and why).
- **flat inputs**: the graph's placeholders, in order: the positional then keyword arguments the
  caller gave (arguments left at their defaults are baked in).
- **dynamic dimensions**: dim 0 of every tensor input (the batch) and dim 1 of every integer tensor
  input (the sequence of token ids) are traced as sympy symbols where the model allows, so shapes
  and costs are expressions and one plan serves several batch sizes; an example batch of one
  sample is traced as two ([Note: batch of one]). The switches are ``ParallelConfig``'s:
  ``dynamic_sequence=None`` keeps the sequence static under torch.export ([Note: a static sequence
  for export]); ``microbatch_size=b`` traces the batch static at b samples under torch.export, the
  example resized to it, and ``dynamic_batch=True`` keeps it symbolic ([Note: a static batch]).

    gm = fxsplit.trace(model, (idx,))                  # fx, or export when fx cannot trace it
    gm.meta["fxsplit"]                                 # TraceInfo(method=..., reason=..., symbols=...)
    gm.graph.nodes[...].meta["fxsplit"]                # NodeInfo (see fxsplit.graph.meta)

Works on models whose parameters live on the meta device: shapes come from fake tensors, nothing
is computed.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import torch
import torch.fx
from torch import nn
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxsplit import config
from fxsplit.graph.decompose import Decomposition, attention_as_ops
from fxsplit.graph.examples import WIDE_NOTE, batch_of, dynamic_dims, example_at_batch, static_batch_size, widen_batch
from fxsplit.graph.export import export_model, failure_location, is_hf_model
from fxsplit.graph.meta import TraceInfo, annotate_graph
from fxsplit.graph.shapes import batch_dims
from fxsplit.graph.symbolic import keeping_symbols
from fxsplit.errors import ArgumentTypeError, TraceError, UsageError

__all__ = ["trace", "TraceError", "flatten_inputs", "example_at_batch"]

log = logging.getLogger(__name__)

METHODS = config.TRACE_METHODS



# --------------------------------------------------------------------------------------------
# argument checks


def _normalize_args(model: Any, example_args: Any, example_kwargs: Any) -> tuple[tuple, dict]:
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(
            f"fxsplit.trace expects a torch.nn.Module, got {type(model).__name__}; wrap a function "
            f"in an nn.Module whose forward calls it"
        )
    if isinstance(example_args, (torch.Tensor, dict)) or not isinstance(example_args, Sequence):
        if isinstance(example_args, dict):
            raise ArgumentTypeError(
                "example_args is a dict; pass positional arguments as a tuple and keyword arguments "
                "as example_kwargs=dict(...)"
            )
        example_args = (example_args,)
    example_args = tuple(example_args)
    if example_kwargs is None:
        example_kwargs = {}
    if not isinstance(example_kwargs, Mapping):
        raise ArgumentTypeError(f"example_kwargs must be a dict of keyword arguments, got {type(example_kwargs).__name__}")
    example_kwargs = dict(example_kwargs)
    sig = inspect.signature(model.forward)
    try:
        sig.bind(*example_args, **example_kwargs)
    except TypeError as exc:
        raise ArgumentTypeError(
            f"example arguments do not match {type(model).__name__}.forward{sig}: {exc}. "
            f"Got {len(example_args)} positional argument(s) and keyword(s) {sorted(example_kwargs)}"
        ) from None
    return example_args, example_kwargs


def _given_params(model: nn.Module, args: tuple, kwargs: dict) -> tuple[list[str], dict[str, Any]]:
    """(names of the parameters the caller gave, in signature order; defaults of the others)."""
    sig = inspect.signature(model.forward)
    bound = sig.bind(*args, **kwargs)
    given, concrete = [], {}
    for name, p in sig.parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            if name in bound.arguments:
                raise ArgumentTypeError(
                    f"{type(model).__name__}.forward takes *{name}/**{name}; fxsplit traces fixed "
                    f"signatures: pass the arguments by name or wrap the model"
                )
            continue
        if name in bound.arguments:
            given.append(name)
        else:
            concrete[name] = p.default
    return given, concrete


def flatten_inputs(gm: torch.fx.GraphModule, args: Sequence = (), kwargs: Mapping | None = None) -> list:
    """The flat input list (placeholder order) of a traced graph for a call ``model(*args, **kwargs)``."""
    info: TraceInfo | None = getattr(gm, "meta", {}).get("fxsplit")
    kwargs = dict(kwargs or {})
    if info is not None and info.method == "export":
        in_spec = gm._in_spec  # pytree spec of (args, kwargs) recorded by export
        flat, spec = torch.utils._pytree.tree_flatten((tuple(args), kwargs))
        if spec != in_spec:
            # kwargs may come in another order: reorder by the traced spec
            ordered = {k: kwargs[k] for k in in_spec.child(1).context if k in kwargs}
            flat, spec = torch.utils._pytree.tree_flatten((tuple(args), ordered))
            if spec != in_spec:
                raise ArgumentTypeError(
                    f"inputs do not have the structure the model was traced with: expected {in_spec}, got {spec}"
                )
        return flat
    names = list(info.input_names) if info is not None else [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    values = list(args)
    if len(values) > len(names):
        raise ArgumentTypeError(f"traced model takes {len(names)} inputs {names}, got {len(values)} positional arguments")
    for name in names[len(values):]:
        if name not in kwargs:
            raise ArgumentTypeError(f"traced model input {name!r} is missing; the graph was traced with inputs {names}")
        values.append(kwargs.pop(name))
    if kwargs:
        raise ArgumentTypeError(f"unexpected keyword arguments {sorted(kwargs)}; the graph was traced with inputs {names}")
    return values


# --------------------------------------------------------------------------------------------
# error reporting


def _fx_error(exc: BaseException, model: nn.Module) -> TraceError:
    mod, line = failure_location(exc, model)
    where = f" in module {mod!r} at {line}" if mod else ""
    hints = []
    if mod and mod != "<root>":
        hints.append(f"mark it as a leaf (leaf_modules=[{mod!r}]) so fx does not trace into it")
    hints.append('use method="export" (torch.export handles Python control flow on shapes and most library models)')
    if is_hf_model(model):
        hints.append("Hugging Face models need method=\"export\" with use_cache=False")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return TraceError(
        f"torch.fx could not trace {type(model).__name__}{where}: {type(exc).__name__}: {first}. "
        f"Fix: " + "; or ".join(hints)
    )


# --------------------------------------------------------------------------------------------
# fx


class _LeafTracer(torch.fx.Tracer):
    def __init__(self, leaf_types: tuple[type, ...], leaf_paths: frozenset[str], not_leaves: frozenset[int] = frozenset()):
        super().__init__()
        self._leaf_types = leaf_types
        self._leaf_paths = leaf_paths
        self._not_leaves = not_leaves  # torch modules traced into ([Note: attention modules as ops])

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if self._is_user_leaf(m, module_qualified_name):
            return True
        if id(m) in self._not_leaves:
            return False
        return super().is_leaf_module(m, module_qualified_name)

    def _is_user_leaf(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self._leaf_paths or bool(self._leaf_types and isinstance(m, self._leaf_types))


def _split_leaves(model: nn.Module, leaf_modules: Iterable[Any]) -> tuple[tuple[type, ...], frozenset[str]]:
    types, paths = [], set()
    names = dict(model.named_modules())
    for leaf in leaf_modules:
        if isinstance(leaf, type) and issubclass(leaf, nn.Module):
            types.append(leaf)
        elif isinstance(leaf, str):
            if leaf not in names:
                import difflib

                close = difflib.get_close_matches(leaf, list(names), n=3)
                raise UsageError(f"leaf_modules: no module named {leaf!r} in the model" + (f"; did you mean {close}?" if close else ""))
            paths.add(leaf)
        else:
            raise ArgumentTypeError(f"leaf_modules entries must be module paths (str) or nn.Module classes, got {leaf!r}")
    return tuple(types), frozenset(paths)


def _drop_concrete_placeholders(gm: torch.fx.GraphModule, names: Iterable[str]) -> None:
    """Remove placeholders of arguments fixed to their defaults, and fx's checks on them."""
    names = set(names)
    for node in list(gm.graph.nodes):
        if node.op != "placeholder" or node.target not in names:
            continue
        doomed: list[torch.fx.Node] = []
        frontier = [node]
        while frontier:
            n = frontier.pop()
            doomed.append(n)
            frontier.extend(n.users)
        for n in reversed(list(dict.fromkeys(doomed))):
            if n.users:
                raise TraceError(f"argument {node.target!r} fixed to its default is still used by {list(n.users)}")
            gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()


def _trace_fx(model: nn.Module, args: tuple, kwargs: dict, leaves: tuple,
              not_leaves: frozenset[int] = frozenset()) -> tuple[torch.fx.GraphModule, list[str]]:
    given, concrete = _given_params(model, args, kwargs)
    tracer = _LeafTracer(*leaves, not_leaves)
    graph = tracer.trace(model, concrete_args=concrete or None)
    name = model.__class__.__name__
    gm = torch.fx.GraphModule(tracer.root, graph, name)
    # fx renames the placeholders of concrete arguments ("mask_1"); match them by signature order
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sig_names = [p for p in inspect.signature(model.forward).parameters if p in given or p in concrete]
    doomed = [n.target for n, pname in zip(ph, sig_names) if pname in concrete]
    if doomed:
        _drop_concrete_placeholders(gm, doomed)
    return gm, given


# [Note: a static sequence for export]
# A symbolic sequence is what makes torch.export slow: with symbolic sizes it runs torch's Python
# reference implementations (fake-tensor shape and stride arithmetic in sympy) where static
# sizes take the C++ meta kernels, and the sequence enters every attention and rotary op.
# Measured on a 4-layer Llama config (2 cores): bare export (static, batch 1) 3.6 s, batch
# symbolic 6.5 s, batch and sequence symbolic 16.7 s. Nothing fxsplit plans varies the sequence:
# microbatching splits the batch (dim 0), and the planner scales costs by the microbatch size.
# So ``dynamic_sequence=None`` (what ``plan`` / ``parallelize`` pass by default,
# ``ParallelConfig.dynamic_sequence``) keeps the sequence symbolic for torch.fx, whose graph code
# reads sizes at run time and whose fake propagation is cheap, and traces it at the example's
# length for torch.export; a plan then serves shorter steps padded to that length and cut back
# ([Note: padding to the traced length] in fxsplit.api.padding), and refuses a longer one (or,
# with ``pad_sequence=False``, any other) with the traced size, never running it wrongly. ``True``
# (the default of ``trace`` itself) makes it symbolic for both.


def _fake_propagate(gm: torch.fx.GraphModule, flat: list, dynamic: bool, sequence: bool = True,
                    batch: bool = True) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv() if dynamic else None, allow_non_fake_inputs=True)
    fakes = []
    for x in flat:
        if isinstance(x, torch.Tensor):
            if dynamic:
                dyn = set(dynamic_dims(x, sequence, batch))
                ctx = StatelessSymbolicContext(
                    dynamic_sizes=[DimDynamic.DYNAMIC if d in dyn else DimDynamic.STATIC for d in range(x.dim())]
                )
                fakes.append(mode.from_tensor(x, symbolic_context=ctx))
            else:
                fakes.append(mode.from_tensor(x))
        else:
            fakes.append(x)
    with mode, (keeping_symbols() if dynamic else contextlib.nullcontext()):  # [Note: symbolic matmul on torch 2.11]
        _NumbersKept(gm, mode).propagate_dont_convert_inputs(*fakes)


class _NumbersKept(FakeTensorProp):
    """FakeTensorProp that records plain numbers too (a static size read from ``x.shape``): torch
    2.11's records None for them, which stage building reads as a missing value; 2.13's keeps them."""

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        kept = _numbers_kept(result, n.meta.get("val"))
        if kept is not None:
            n.meta["val"] = kept
        return result


def _numbers_kept(result: Any, val: Any) -> Any:
    if val is None and isinstance(result, (int, float, bool)):
        return result
    if isinstance(result, (tuple, list)) and isinstance(val, (tuple, list)) and len(result) == len(val):
        return type(val)(_numbers_kept(r, v) for r, v in zip(result, val))
    return val


def _propagate(gm: torch.fx.GraphModule, flat: list, dynamic: bool, on_meta: bool,
               wide: list | None = None, sequence: bool = True) -> str:
    """Fill ``meta["val"]``: fake tensors (symbolic if asked, from ``wide``, the example with a
    batch of one widened, when given: [Note: batch of one]); falls back to static shapes, then,
    for real-weight models only, to one real forward (a leaf module with data-dependent code)."""
    try:
        _fake_propagate(gm, wide if dynamic and wide is not None else flat, dynamic, sequence)
        return WIDE_NOTE if dynamic and wide is not None else ""
    except Exception as first:
        if dynamic:
            try:
                _fake_propagate(gm, flat, False)
                return " (static shapes: fake propagation failed with symbolic batch/sequence)"
            except Exception:
                pass
        real = not on_meta and all(not (isinstance(x, torch.Tensor) and x.is_meta) for x in flat)
        if not real:
            raise first

    class _RealProp(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            n.meta["val"] = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach().to("meta"), out)
            return out

    with torch.no_grad():
        _RealProp(gm).run(*flat)
    return " (shapes from one real forward: fake-tensor propagation failed, e.g. data-dependent code in a leaf module)"


# --------------------------------------------------------------------------------------------
# the entry point


def _name_symbols(gm: torch.fx.GraphModule, input_names: Sequence[str]) -> dict[str, Any]:
    import sympy

    symbols: dict[str, Any] = {}
    for node, name in zip([n for n in gm.graph.nodes if n.op == "placeholder"], input_names):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for d, expr in enumerate(batch_dims(val)):
            if not isinstance(expr, sympy.Symbol):
                continue
            if d == 0 and "batch" not in symbols:
                key = "batch"
            elif d == 1 and not val.is_floating_point() and "seq" not in symbols:
                key = "seq"
            else:
                key = f"{name}.size({d})"
            if expr not in symbols.values():
                symbols[key] = expr
    return symbols


def _old_spellings(old: Mapping[str, Any], dynamic_batch: bool | None,
                   microbatch_size: int | None) -> tuple[bool, bool | None, int | None]:
    """``(symbolic, dynamic_batch, microbatch_size)`` with trace's deprecated keywords applied:
    ``static_batch=b`` is ``microbatch_size=b``; ``dynamic=False`` traces no symbol at all (fx
    included), which ``dynamic_batch=False, dynamic_sequence=False`` does under torch.export
    (torch.fx keeps the batch symbolic there). A FutureWarning names the new spelling; any other
    keyword is a TypeError, as Python raises it."""
    unknown = sorted(set(old) - {"dynamic", "static_batch"})
    if unknown:
        raise ArgumentTypeError(f"trace() got an unexpected keyword argument {unknown[0]!r}")
    if "static_batch" in old:
        warnings.warn("fxsplit.trace(static_batch=b) is spelled microbatch_size=b (as in ParallelConfig)",
                      FutureWarning, stacklevel=4)
        if microbatch_size is not None:
            raise UsageError("give microbatch_size= only (static_batch= is its former spelling), not both")
        microbatch_size = old["static_batch"]
    if "dynamic" in old:
        warnings.warn("fxsplit.trace(dynamic=...) is spelled dynamic_batch= and dynamic_sequence= (as in "
                      "ParallelConfig); dynamic=True is the default, dynamic=False traces no symbol, fx included "
                      "(dynamic_batch=False, dynamic_sequence=False: the same under torch.export)",
                      FutureWarning, stacklevel=4)
    return bool(old.get("dynamic", True)), dynamic_batch, microbatch_size


@dataclass(frozen=True)
class _Request:
    """One ``trace`` call with its arguments resolved."""

    model: nn.Module
    args: tuple  # the example, normalized (_normalize_args)
    kwargs: dict
    leaves: tuple  # (leaf module types, leaf module paths)
    on_meta: bool  # the model's parameters are on the meta device
    symbolic: bool  # False only for the deprecated dynamic=False: no symbol, fx included
    sequence: bool | None  # dynamic_sequence
    static_batch: int | None  # the batch torch.export traces static at; None: symbolic
    wide: tuple[tuple, dict] | None  # the example with a batch of one widened ([Note: batch of one])
    param_dtype: torch.dtype | None
    decompose: bool  # decompose_attention
    follow_sequence: bool  # [Note: following the sequence from two static traces]
    stack_traces: bool  # [Note: no stack traces by default] in fxsplit.graph.export
    # a symbolic batch may be traced at a marker batch ([Note: a marker batch]); not when
    # dynamic_batch=True asks for symbolic fake values
    marker: bool = True

    def decomposing(self) -> Any:
        """A context manager for one attempt: attention modules traced as ops, or nothing."""
        if not self.decompose:
            return contextlib.nullcontext(Decomposition())
        return attention_as_ops(self.model, leaf=_LeafTracer(*self.leaves)._is_user_leaf)


def _request(model: nn.Module, example_args: Any, example_kwargs: Any, *, leaf_modules: Iterable[Any],
             dynamic_batch: bool | None, dynamic_sequence: bool | None, microbatch_size: int | None,
             param_dtype: torch.dtype | None, decompose_attention: bool, follow_sequence: bool,
             stack_traces: bool, deprecated: Mapping[str, Any]) -> _Request:
    symbolic, dynamic_batch, microbatch_size = _old_spellings(deprecated, dynamic_batch, microbatch_size)
    if microbatch_size is not None and (isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int)
                                        or microbatch_size < 1):
        raise UsageError(f"microbatch_size must be an int >= 1 (samples per microbatch) or None, "
                         f"got {microbatch_size!r}")
    if dynamic_batch not in (True, False, None):
        raise UsageError(f"dynamic_batch must be True, False or None (static when microbatch_size is given), "
                         f"got {dynamic_batch!r}")
    args, kwargs = _normalize_args(model, example_args, example_kwargs)
    static_batch = static_batch_size(dynamic_batch=dynamic_batch, microbatch_size=microbatch_size,
                                     example_batch=batch_of((args, kwargs)))
    leaves = _split_leaves(model, tuple(leaf_modules))
    wide_args, wide_kwargs, widened = widen_batch(args, kwargs) if symbolic else (args, kwargs, False)
    return _Request(model, args, kwargs, leaves, on_meta=any(p.is_meta for p in model.parameters()),
                    symbolic=symbolic, sequence=dynamic_sequence, static_batch=static_batch,
                    wide=(wide_args, wide_kwargs) if widened else None, param_dtype=param_dtype,
                    decompose=decompose_attention, follow_sequence=follow_sequence, stack_traces=stack_traces,
                    marker=dynamic_batch is None)


class _Traced(NamedTuple):
    gm: torch.fx.GraphModule
    method: str  # "fx" or "export": the frontend that ran
    reason: str
    input_names: tuple[str, ...]
    kept: list  # (module path, why) of attention modules kept whole
    traced_length: int | None = None  # export's static sequence length, when static
    follows: bool = False  # the graph takes every shorter length
    follow_refused: str | None = None  # why not, when following was asked


def _by_fx(req: _Request, method: str) -> _Traced:
    """torch.fx symbolic tracing, then fake-tensor propagation for ``meta["val"]``."""
    with req.decomposing() as dec:
        gm, given = _trace_fx(req.model, req.args, req.kwargs, req.leaves, dec.not_leaves)
        dec.prune(gm)
    n = len(req.args)
    flat = list(req.args) + [req.kwargs[k] for k in given[n:]]
    wide = None
    if req.wide is not None:
        wide_args, wide_kwargs = req.wide
        wide = list(wide_args) + [wide_kwargs[k] for k in given[n:]]
    note = _propagate(gm, flat, req.symbolic, req.on_meta, wide, sequence=req.sequence is not False)
    reason = "torch.fx symbolic tracing succeeded" if method == "auto" else f'method="{method}" requested'
    return _Traced(gm, "fx", reason + note, tuple(given), dec.kept)


def _by_export(req: _Request, method: str, fx_error: TraceError | None) -> _Traced:
    """torch.export (:mod:`fxsplit.graph.export`); after a failed fx attempt, the error names both."""
    try:
        exported = export_model(req.model, req.args, req.kwargs, symbolic=req.symbolic, sequence=req.sequence,
                                static_batch=req.static_batch, wide=req.wide, param_dtype=req.param_dtype,
                                decomposing=req.decomposing, follow_sequence=req.follow_sequence,
                                stack_traces=req.stack_traces, marker=req.marker,
                                propagate=lambda g, batch, at=None: _fake_propagate(g, _flat_cast(req, at), True, True,
                                                                                    batch))
    except TraceError as err:
        if fx_error is None:
            raise
        raise TraceError(f"{fx_error}\n\nthen {err}") from err.__cause__
    if fx_error is not None:
        reason = f"torch.fx failed ({str(fx_error).split('. Fix:')[0]}); used torch.export"
    else:
        reason = f'method="{method}" requested'
    return _Traced(exported.gm, "export", reason + exported.note, exported.input_names, exported.kept,
                   exported.traced_length, exported.follows, exported.follow_refused)


def _flat_cast(req: _Request, at: int | None = None) -> list:
    """The example's flat inputs as the export traced them (following the sequence is refused
    under a ``param_dtype``, so no input is cast); ``at``: the marker batch it traced at."""
    batch = at if at is not None else req.static_batch
    args, kwargs = example_at_batch(req.args, req.kwargs, batch) if batch is not None else (
        req.wide if req.wide is not None else (req.args, req.kwargs))
    return torch.utils._pytree.tree_flatten((tuple(args), dict(kwargs)))[0]


def _finish(traced: _Traced, on_meta: bool) -> torch.fx.GraphModule:
    """The trace's metadata: ``gm.meta["fxsplit"]`` (TraceInfo, the dynamic dims named) and every
    node's NodeInfo."""
    gm, reason = traced.gm, traced.reason
    if traced.kept:
        reason += " (kept as torch modules, left whole: " + "; ".join(f"{p}: {w}" for p, w in traced.kept) + ")"
        log.warning("fxsplit.trace: attention modules kept whole: %s", traced.kept)
    symbols = _name_symbols(gm, traced.input_names)
    gm.meta["fxsplit"] = TraceInfo(method=traced.method, reason=reason, input_names=traced.input_names,
                                   symbols=symbols, dynamic=bool(symbols), on_meta=on_meta,
                                   traced_length=traced.traced_length, follows_sequence=traced.follows,
                                   follow_refused=traced.follow_refused)
    annotate_graph(gm)
    log.info("fxsplit.trace: %s", reason)
    return gm


def trace(
    model: nn.Module,
    example_args: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    method: str = "auto",
    leaf_modules: Iterable[Any] = (),
    dynamic_batch: bool | None = None,
    dynamic_sequence: bool | None = True,
    microbatch_size: int | None = None,
    param_dtype: torch.dtype | None = None,
    decompose_attention: bool = False,
    follow_sequence: bool = False,
    stack_traces: bool = False,
    **deprecated: Any,
) -> torch.fx.GraphModule:
    """Trace ``model`` into a GraphModule whose every node carries fxsplit metadata.

    Args:
        model: an unmodified ``nn.Module`` (real weights, or parameters on the meta device).
        example_args / example_kwargs: one example call ``model(*example_args, **example_kwargs)``;
            tensors may be on the meta device. Arguments not given are fixed to their defaults.
        method: ``"fx"``, ``"export"`` or ``"auto"`` (fx first, then export).
        leaf_modules: module paths or classes that fx keeps as single ``call_module`` nodes.
        dynamic_batch: whether the batch (dim 0) is a symbol under torch.export: None (default:
            static when ``microbatch_size`` is given, else any batch runs, traced static at a
            marker batch whose multiples costs and shapes read as the symbol ``batch``: [Note: a
            marker batch] in fxsplit.graph.batch_marker), True (symbolic, in the fake values too),
            False (static at ``microbatch_size``, or else at the example's batch); torch.fx keeps it
            symbolic ([Note: a static batch]). A symbolic batch of one sample is traced as two so
            that it does not fix the batch size ([Note: batch of one]).
        dynamic_sequence: whether the sequence (dim 1 of integer inputs) is a symbol: True (both
            methods), None (torch.fx only; torch.export traces it at the example's length, which
            makes export several times faster: [Note: a static sequence for export]) or False.
        microbatch_size: the samples per microbatch, when known: torch.export traces the batch
            static at it, the example's batch cut or repeated to it (:func:`example_at_batch`).
        param_dtype: the compute dtype of mixed precision (``MixedPrecisionPolicy.param_dtype``):
            torch.export traces the model with its parameters and floating inputs in it, then
            puts the originals back ([Note: tracing under a parameter dtype] in ``fxsplit.graph.export``);
            fx needs nothing.
        decompose_attention: trace ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` /
            ``nn.TransformerEncoder`` as plain ops (fused in_proj, chunk into q/k/v, heads, sdpa,
            out_proj) instead of one leaf or torch's head-merging views, so tensor parallelism can
            shard them by heads ([Note: attention modules as ops] in ``fxsplit.graph.decompose``);
            calls it does not cover stay torch's module, and the trace reason names them.
        follow_sequence: when torch.export traced the sequence static, trace it again one position
            shorter and make the graph take every length up to the traced one ([Note: following the
            sequence from two static traces] in ``fxsplit.graph.sequence``); the trace reason says
            when it could not, and the graph stays static.
        stack_traces: torch.export keeps each node's source lines (``node.stack_trace``, printed by
            ``gm.print_readable()``); off by default, a quarter of an export's time ([Note: no stack
            traces by default] in ``fxsplit.graph.export``). torch.fx records none either way.
        deprecated: ``static_batch=b`` (now ``microbatch_size=b``) and ``dynamic=`` (now
            ``dynamic_batch`` and ``dynamic_sequence``) still work, with a ``FutureWarning``
            naming the new spelling.

    Returns a GraphModule whose ``meta["fxsplit"]`` is a :class:`fxsplit.graph.meta.TraceInfo` and whose
    nodes have ``meta["fxsplit"]`` (:class:`fxsplit.graph.meta.NodeInfo`) and ``meta["val"]``. Calling it
    returns the model's output in the model's own structure (dicts, tuples, HF ``ModelOutput``).
    """
    if method not in METHODS:
        raise UsageError(f"method must be one of {METHODS}, got {method!r}")
    req = _request(model, example_args, example_kwargs, leaf_modules=leaf_modules, dynamic_batch=dynamic_batch,
                   dynamic_sequence=dynamic_sequence, microbatch_size=microbatch_size, param_dtype=param_dtype,
                   decompose_attention=decompose_attention, follow_sequence=follow_sequence,
                   stack_traces=stack_traces, deprecated=deprecated)
    traced, fx_error = None, None
    if method in ("auto", "fx"):
        try:
            traced = _by_fx(req, method)
        except Exception as exc:  # fx fails in many ways (TraceError, TypeError, ValueError, ...)
            fx_error = _fx_error(exc, model)
            fx_error.__cause__ = exc
            if method == "fx":
                raise fx_error
    if traced is None:
        traced = _by_export(req, method, fx_error)
    return _finish(traced, req.on_meta)

