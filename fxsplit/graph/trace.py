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
  sample is traced as two ([Note: batch of one]). ``dynamic_sequence=None`` keeps the sequence
  static under torch.export ([Note: a static sequence for export]); ``static_batch=b`` traces the
  batch static at b samples under torch.export, the example resized to it ([Note: a static batch]).

    gm = fxsplit.trace(model, (idx,))                  # fx, or export when fx cannot trace it
    gm.meta["fxsplit"]                                 # TraceInfo(method=..., reason=..., symbols=...)
    gm.graph.nodes[...].meta["fxsplit"]                # NodeInfo (see fxsplit.graph.meta)

Works on models whose parameters live on the meta device: shapes come from fake tensors, nothing
is computed.
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import logging
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.fx
from torch import nn

from fxsplit import config
from fxsplit.graph.decompose import Decomposition, attention_as_ops
from fxsplit.graph.examples import _WIDE_BATCH, _widen_batch, example_at_batch
from fxsplit.graph.lazy_code import lazily_recompiled
from fxsplit.graph.meta import TraceInfo, annotate_graph, to_expr
from fxsplit.graph.ops import resolve_path
from fxsplit.graph.sequence import at_length, sequence_input
from fxsplit.graph.sequence import follow_sequence as follow_lengths
from fxsplit.errors import ArgumentTypeError, TraceError, UsageError

__all__ = ["trace", "TraceError", "flatten_inputs", "example_at_batch"]

log = logging.getLogger(__name__)

METHODS = config.TRACE_METHODS

# ops that export inserts for its own runtime checks; they carry no computation and would tie
# stages together for nothing, so the traced graph drops them.
_EXPORT_CHECK_OPS = (
    "aten._assert_tensor_metadata.default",
    "aten._assert_scalar.default",
    "aten.sym_constrain_range_for_size.default",
    "aten._assert_async.msg",
)


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


def _failure_location(exc: BaseException, model: nn.Module) -> tuple[str, str]:
    """(module path, 'file:line: source') of the innermost model frame in the traceback."""
    paths = {id(m): name for name, m in model.named_modules()}
    where_mod, where_line = "", ""
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        self_obj = frame.f_locals.get("self")
        if self_obj is not None and id(self_obj) in paths:
            where_mod = paths[id(self_obj)] or "<root>"
            line = linecache.getline(frame.f_code.co_filename, tb.tb_lineno).strip()
            where_line = f"{frame.f_code.co_filename}:{tb.tb_lineno}: {line}"
        tb = tb.tb_next
    return where_mod, where_line


def _is_hf(model: nn.Module) -> bool:
    return hasattr(model, "config") and type(model).__module__.startswith("transformers")


def _fx_error(exc: BaseException, model: nn.Module) -> TraceError:
    mod, line = _failure_location(exc, model)
    where = f" in module {mod!r} at {line}" if mod else ""
    hints = []
    if mod and mod != "<root>":
        hints.append(f"mark it as a leaf (leaf_modules=[{mod!r}]) so fx does not trace into it")
    hints.append('use method="export" (torch.export handles Python control flow on shapes and most library models)')
    if _is_hf(model):
        hints.append("Hugging Face models need method=\"export\" with use_cache=False")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return TraceError(
        f"torch.fx could not trace {type(model).__name__}{where}: {type(exc).__name__}: {first}. "
        f"Fix: " + "; or ".join(hints)
    )


def _export_error(exc: BaseException, model: nn.Module, kwargs: dict) -> TraceError:
    mod, line = _failure_location(exc, model)
    where = f" in module {mod!r} at {line}" if mod else ""
    text = f"{type(exc).__name__}: {str(exc).strip()}"
    hints = []
    cache_on = _is_hf(model) and getattr(model.config, "use_cache", False) and kwargs.get("use_cache") is not False
    if cache_on or "DynamicCache" in text or "Cache" in type(exc).__name__:
        hints.append(
            "the model returns a key/value cache (config.use_cache=True), which torch.export cannot "
            "output: pass use_cache=False (example_kwargs={'use_cache': False} or config.use_cache=False)"
        )
    hints.append("or trace with method=\"fx\" and leaf_modules=[...] for the untraceable parts")
    short = text.splitlines()[0][:500]
    return TraceError(f"torch.export could not trace {type(model).__name__}{where}: {short}. Fix: " + "; ".join(hints))


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


def _dynamic_dims(t: torch.Tensor, sequence: bool = True, batch: bool = True) -> list[int]:
    """Which dims of an example input to trace as symbols: with ``batch``, batch (0) and, with
    ``sequence``, sequence (1 of int inputs)."""
    dims = []
    if batch and t.dim() >= 1 and t.shape[0] >= 2:
        dims.append(0)
    if sequence and t.dim() >= 2 and not t.is_floating_point() and t.shape[1] >= 2:
        dims.append(1)
    return dims


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
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(shape_env=ShapeEnv() if dynamic else None, allow_non_fake_inputs=True)
    fakes = []
    for x in flat:
        if isinstance(x, torch.Tensor):
            if dynamic:
                dyn = set(_dynamic_dims(x, sequence, batch))
                ctx = StatelessSymbolicContext(
                    dynamic_sizes=[DimDynamic.DYNAMIC if d in dyn else DimDynamic.STATIC for d in range(x.dim())]
                )
                fakes.append(mode.from_tensor(x, symbolic_context=ctx))
            else:
                fakes.append(mode.from_tensor(x))
        else:
            fakes.append(x)
    with mode:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)


def _propagate(gm: torch.fx.GraphModule, flat: list, dynamic: bool, on_meta: bool,
               wide: list | None = None, sequence: bool = True) -> str:
    """Fill ``meta["val"]``: fake tensors (symbolic if asked, from ``wide``, the example with a
    batch of one widened, when given: [Note: batch of one]); falls back to static shapes, then,
    for real-weight models only, to one real forward (a leaf module with data-dependent code)."""
    try:
        _fake_propagate(gm, wide if dynamic and wide is not None else flat, dynamic, sequence)
        return _WIDE_NOTE if dynamic and wide is not None else ""
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


_WIDE_NOTE = f" (the example batch of 1 traced as {_WIDE_BATCH}, so the batch size stays symbolic)"


# --------------------------------------------------------------------------------------------
# export


# [Note: tracing under a parameter dtype]
# torch.export bakes dtypes into the graph: HF's RMSNorm computes ``w * x.to(input_dtype)`` with
# ``input_dtype = x.dtype`` read while tracing, rotary embeddings return ``cos.to(x.dtype)``. A
# graph traced with float32 parameters says ``.to(torch.float32)`` there, so casting its parameter
# reads to bfloat16 afterwards (mixed precision) mixes dtypes (``weight_bf16 * x_fp32`` is float32,
# and the next matmul with a bfloat16 weight fails), where the eager model under FSDP's
# MixedPrecisionPolicy would have computed in bfloat16. So with ``param_dtype`` the model is
# exported as that policy runs it: every floating parameter cast to ``param_dtype`` (one copy per
# tensor, so tied weights stay tied; free on the meta device) and every floating input too
# (``cast_forward_inputs``), so the model's own dtype logic is traced for the compute dtype (its
# deliberate float32 upcasts in norms and softmax stay). Then the interface is put back: the
# graph module holds the original float32 parameters and its parameter reads and floating
# placeholders say so in ``meta["val"]``, where the mixed-precision pass inserts the casts
# (``passes/mixed_precision.py``). fx graphs read ``x.dtype`` at run time and need none of this.


@contextlib.contextmanager
def _parameters_in(model: nn.Module, dtype: torch.dtype | None):
    """Within: ``model``'s floating parameters replaced by ``dtype`` copies (the same copy for a
    tensor reached by several names). Yields {id(copy): original}."""
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    copies: dict[int, nn.Parameter] = {}
    originals: dict[int, nn.Parameter] = {}
    if dtype is not None:
        for mod in model.modules():
            for name, p in list(mod._parameters.items()):
                if p is None or not p.is_floating_point() or p.dtype == dtype:
                    continue
                if id(p) not in copies:
                    copies[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                    originals[id(copies[id(p)])] = p
                swapped.append((mod, name, p))
                mod._parameters[name] = copies[id(p)]
    try:
        yield originals
    finally:
        for mod, name, p in swapped:
            mod._parameters[name] = p


def _cast_inputs(tree: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return tree
    return torch.utils._pytree.tree_map(
        lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v, tree)


def _restore_parameters(gm: torch.fx.GraphModule, originals: Mapping[int, nn.Parameter]) -> None:
    """Put the original parameters back into the exported module, and their dtype into the
    metadata of their reads and of the floating placeholders ([Note: tracing under a parameter dtype])."""
    if not originals:
        return
    for mod in gm.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and id(p) in originals:
                mod._parameters[name] = originals[id(p)]
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_floating_point():
            continue
        if node.op == "get_attr":
            target = resolve_path(gm, str(node.target))
            if isinstance(target, torch.Tensor) and target.dtype != val.dtype:
                node.meta["val"] = val.to(target.dtype)
        elif node.op == "placeholder":
            node.meta["val"] = val.to(node.meta.get("fxsplit_input_dtype", val.dtype))


def _export(model: nn.Module, args: tuple, kwargs: dict, dynamic: bool,
            param_dtype: torch.dtype | None = None, sequence: bool = True, batch: bool = True) -> torch.fx.GraphModule:
    from torch.export import Dim

    dyn_spec = None
    if dynamic and (batch or sequence):
        sig = inspect.signature(model.forward)
        bound = sig.bind(*args, **kwargs)
        spec: dict[str, Any] = {}
        for name, val in bound.arguments.items():
            if isinstance(val, torch.Tensor):
                spec[name] = {d: Dim.AUTO for d in _dynamic_dims(val, sequence, batch)} or None
            else:
                spec[name] = None
        dyn_spec = spec
    input_dtypes = [v.dtype if isinstance(v, torch.Tensor) else None
                    for v in torch.utils._pytree.tree_leaves((args, kwargs))]
    with _parameters_in(model, param_dtype) as originals:
        ep = torch.export.export(model, _cast_inputs(args, param_dtype), _cast_inputs(kwargs, param_dtype),
                                 strict=False, dynamic_shapes=dyn_spec)
        try:
            gm = ep.module(check_guards=False)
        except TypeError:  # older torch: no check_guards argument
            gm = ep.module()
    gm = lazily_recompiled(gm)  # [Note: lazy recompile]: planning edits the graph many times
    if param_dtype is not None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        floating = {d for d in input_dtypes if d is not None and d.is_floating_point}
        for i, n in enumerate(placeholders):  # the dtype the caller passes (one, or by position)
            dtype = next(iter(floating)) if len(floating) == 1 else (
                input_dtypes[i] if len(placeholders) == len(input_dtypes) else None)
            if dtype is not None:
                n.meta["fxsplit_input_dtype"] = dtype
        _restore_parameters(gm, originals)
        for n in placeholders:
            n.meta.pop("fxsplit_input_dtype", None)
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
            if hasattr(gm, "_guards_fn"):
                delattr(gm, "_guards_fn")
        elif node.op == "call_function" and str(node.target) in _EXPORT_CHECK_OPS and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm


def _follow(gm: torch.fx.GraphModule, model: nn.Module, args: tuple, kwargs: dict, decomposing: Any,
            param_dtype: torch.dtype | None, dynamic: bool, batch: bool, length: int) -> tuple[str, str | None]:
    """[Note: following the sequence from two static traces]: rewrite ``gm`` in place; the trace note
    and why the graph stays static (None: it follows the length now)."""
    def again(n: int) -> torch.fx.GraphModule:
        with decomposing() as dec:
            other = _export(model, at_length(args, length, n), at_length(kwargs, length, n), dynamic, param_dtype,
                            sequence=False, batch=batch)
            dec.prune(other)
        return other

    flat = _cast_inputs(torch.utils._pytree.tree_flatten((tuple(args), dict(kwargs)))[0], param_dtype)
    _, why = follow_lengths(gm, again=again, propagate=lambda g: _fake_propagate(g, flat, True, True, dynamic and batch))
    if why is not None:
        log.info("fxsplit.trace: the sequence stays static at %d: %s", length, why)
        return f" (the sequence stays static at {length}, shorter steps padded: {why})", why
    return (f" (traced at {length} and {length - 1} positions: every length up to {length} runs as it is, "
            "[Note: following the sequence from two static traces])"), None


# --------------------------------------------------------------------------------------------
# the entry point


def _name_symbols(gm: torch.fx.GraphModule, input_names: Sequence[str]) -> dict[str, Any]:
    import sympy

    symbols: dict[str, Any] = {}
    for node, name in zip([n for n in gm.graph.nodes if n.op == "placeholder"], input_names):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for d, size in enumerate(val.shape):
            expr = to_expr(size)
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


def trace(
    model: nn.Module,
    example_args: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    method: str = "auto",
    leaf_modules: Iterable[Any] = (),
    dynamic: bool = True,
    dynamic_sequence: bool | None = True,
    param_dtype: torch.dtype | None = None,
    decompose_attention: bool = False,
    static_batch: int | None = None,
    follow_sequence: bool = False,
) -> torch.fx.GraphModule:
    """Trace ``model`` into a GraphModule whose every node carries fxsplit metadata.

    Args:
        model: an unmodified ``nn.Module`` (real weights, or parameters on the meta device).
        example_args / example_kwargs: one example call ``model(*example_args, **example_kwargs)``;
            tensors may be on the meta device. Arguments not given are fixed to their defaults.
        method: ``"fx"``, ``"export"`` or ``"auto"`` (fx first, then export).
        leaf_modules: module paths or classes that fx keeps as single ``call_module`` nodes.
        dynamic: trace batch (dim 0) and sequence (dim 1 of integer inputs) as symbols; an
            example batch of one sample is traced as two so that it does not fix the batch size
            ([Note: batch of one]).
        dynamic_sequence: with ``dynamic``, whether the sequence is symbolic too: True (both
            methods), None (torch.fx only; torch.export traces it at the example's length, which
            makes export several times faster: [Note: a static sequence for export]) or False.
        param_dtype: the compute dtype of mixed precision (``MixedPrecisionPolicy.param_dtype``):
            torch.export traces the model with its parameters and floating inputs in it, then
            puts the originals back ([Note: tracing under a parameter dtype]); fx needs nothing.
        decompose_attention: trace ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` /
            ``nn.TransformerEncoder`` as plain ops (fused in_proj, chunk into q/k/v, heads, sdpa,
            out_proj) instead of one leaf or torch's head-merging views, so tensor parallelism can
            shard them by heads ([Note: attention modules as ops] in ``fxsplit.graph.decompose``);
            calls it does not cover stay torch's module, and the trace reason names them.
        static_batch: under torch.export, trace the batch static at this many samples (the
            example's batch cut or repeated to it: :func:`example_at_batch`); torch.fx keeps it
            symbolic ([Note: a static batch]). None (default): symbolic with ``dynamic``.
        follow_sequence: when torch.export traced the sequence static, trace it again one position
            shorter and make the graph take every length up to the traced one ([Note: following the
            sequence from two static traces] in ``fxsplit.graph.sequence``); the trace reason says
            when it could not, and the graph stays static.

    Returns a GraphModule whose ``meta["fxsplit"]`` is a :class:`fxsplit.graph.meta.TraceInfo` and whose
    nodes have ``meta["fxsplit"]`` (:class:`fxsplit.graph.meta.NodeInfo`) and ``meta["val"]``. Calling it
    returns the model's output in the model's own structure (dicts, tuples, HF ``ModelOutput``).
    """
    if method not in METHODS:
        raise UsageError(f"method must be one of {METHODS}, got {method!r}")
    if static_batch is not None and (isinstance(static_batch, bool) or not isinstance(static_batch, int)
                                     or static_batch < 1):
        raise UsageError(f"static_batch must be an int >= 1 (samples per microbatch) or None, got {static_batch!r}")
    args, kwargs = _normalize_args(model, example_args, example_kwargs)
    leaves = _split_leaves(model, tuple(leaf_modules))
    on_meta = any(p.is_meta for p in model.parameters())
    wide_args, wide_kwargs, widened = _widen_batch(args, kwargs) if dynamic else (args, kwargs, False)
    if decompose_attention:
        tracer = _LeafTracer(*leaves)
        decomposing = lambda: attention_as_ops(model, leaf=tracer._is_user_leaf)  # noqa: E731
    else:
        decomposing = lambda: contextlib.nullcontext(Decomposition())  # noqa: E731
    kept: list[tuple[str, str]] = []

    gm: torch.fx.GraphModule | None = None
    traced_length, follows, follow_refused = None, False, None
    used, reason = method, f'method="{method}" requested'
    fx_error: TraceError | None = None
    if method in ("auto", "fx"):
        try:
            with decomposing() as dec:
                gm, given = _trace_fx(model, args, kwargs, leaves, dec.not_leaves)
                dec.prune(gm)
            kept = dec.kept
            flat = [a for a in args] + [kwargs[k] for k in given[len(args):]]
            wide = [a for a in wide_args] + [wide_kwargs[k] for k in given[len(args):]] if widened else None
            prop_note = _propagate(gm, flat, dynamic, on_meta, wide, sequence=dynamic_sequence is not False)
            input_names = tuple(given)
            used = "fx"
            if method == "auto":
                reason = "torch.fx symbolic tracing succeeded"
            reason += prop_note
        except Exception as exc:  # fx fails in many ways (TraceError, TypeError, ValueError, ...)
            fx_error = _fx_error(exc, model)
            fx_error.__cause__ = exc
            if method == "fx":
                raise fx_error
            gm = None
    if gm is None:
        note = ""
        cache_cfg = getattr(model, "config", None) if _is_hf(model) else None
        cache_was = getattr(cache_cfg, "use_cache", None)
        if cache_was and "use_cache" not in kwargs:
            # torch.export cannot output a key/value cache: trace with the cache off, then restore
            cache_cfg.use_cache = False
            note = " (with config.use_cache=False: torch.export cannot output a key/value cache)"
        if static_batch is not None:
            ex_args, ex_kwargs = example_at_batch(args, kwargs, static_batch)
            batch_note = f" (the batch static at {static_batch} samples per microbatch: [Note: a static batch])"
        else:
            ex_args, ex_kwargs = wide_args, wide_kwargs
            batch_note = _WIDE_NOTE if widened else ""
        try:
            try:
                with decomposing() as dec:
                    gm = _export(model, ex_args, ex_kwargs, dynamic, param_dtype, sequence=dynamic_sequence is True,
                                 batch=static_batch is None)
                    dec.prune(gm)
                kept = dec.kept
                note += batch_note
                static_seq = sequence_input(gm)
                traced_length = static_seq[1] if static_seq is not None else None
                if follow_sequence and static_seq is not None and param_dtype is not None:
                    # the trace ran on parameters cast for it, now restored: propagating again would
                    # see the restored dtype, not the one the graph computes in
                    follow_refused = "the graph was traced under mp_policy's param_dtype"
                    note += f" (the sequence stays static at {traced_length}, shorter steps padded: {follow_refused})"
                elif follow_sequence and static_seq is not None:
                    more, follow_refused = _follow(gm, model, ex_args, ex_kwargs, decomposing, param_dtype, dynamic,
                                                   batch=static_batch is None, length=traced_length)
                    note, follows = note + more, follow_refused is None
            except Exception:
                if not dynamic:
                    raise
                with decomposing() as dec:
                    gm = _export(model, ex_args if static_batch is not None else args,
                                 ex_kwargs if static_batch is not None else kwargs, False,
                                 param_dtype)  # a model that cannot take symbolic sizes
                    dec.prune(gm)
                kept = dec.kept
                note += " (static shapes: export failed with symbolic batch/sequence)"
        except Exception as exc:
            err = _export_error(exc, model, kwargs)
            if fx_error is not None:
                err = TraceError(f"{fx_error}\n\nthen {err}")
            raise err from exc
        finally:
            if cache_was and "use_cache" not in kwargs:
                cache_cfg.use_cache = cache_was
        used = "export"
        reason = (f"torch.fx failed ({str(fx_error).split('. Fix:')[0]}); used torch.export" if fx_error else reason) + note
        spec = gm._in_spec
        input_names = tuple(_flat_input_names(spec, model, args))
    if kept:
        reason += " (kept as torch modules, left whole: " + "; ".join(f"{p}: {w}" for p, w in kept) + ")"
        log.warning("fxsplit.trace: attention modules kept whole: %s", kept)
    # name the dynamic dimensions
    symbols = _name_symbols(gm, input_names)
    gm.meta["fxsplit"] = TraceInfo(
        method=used,
        reason=reason,
        input_names=input_names,
        symbols=symbols,
        dynamic=bool(symbols),
        on_meta=on_meta,
        traced_length=traced_length,
        follows_sequence=follows,
        follow_refused=follow_refused,
    )
    annotate_graph(gm)
    log.info("fxsplit.trace: %s", reason)
    return gm


def _flat_input_names(spec: Any, model: nn.Module, args: tuple) -> list[str]:
    sig_names = list(inspect.signature(model.forward).parameters)
    names = [sig_names[i] if i < len(sig_names) else f"arg{i}" for i in range(len(args))]
    kw_spec = spec.child(1)
    names += list(kw_spec.context)
    if len(names) != spec.num_leaves:  # nested inputs: name the leaves by position
        names = [f"input{i}" for i in range(spec.num_leaves)]
    return names
