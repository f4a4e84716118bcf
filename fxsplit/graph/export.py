"""The torch.export frontend of :func:`fxsplit.trace`: the model exported non-strict at its
example, with the batch and sequence symbolic as asked, the key/value cache of a Hugging Face model
switched off while it runs, a static fallback for a model that cannot take symbolic sizes, and the
parameters kept in their own dtype under mixed precision ([Note: tracing under a parameter dtype]).

    exported = export_model(model, args, kwargs, symbolic=True, sequence=None, static_batch=4,
                            wide=None, param_dtype=None, decomposing=...)
    exported.gm, exported.note, exported.kept, exported.input_names

Errors name the module and source line where export failed and the fix (``TraceError``); the
same location finder serves the fx frontend's errors (``failure_location``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import linecache
import operator
from typing import Any, Callable, Mapping, NamedTuple

import logging

import torch
import torch.fx
from torch import nn

from fxsplit.errors import TraceError
from fxsplit.graph.batch_marker import choose_marker, mark_batch
from fxsplit.graph.examples import WIDE_NOTE, batch_of, dynamic_dims, example_at_batch
from fxsplit.graph.lazy_code import lazily_recompiled
from fxsplit.graph.ops import resolve_path
from fxsplit.graph.sequence import at_length, sequence_input
from fxsplit.graph.sequence import follow_sequence as follow_lengths

log = logging.getLogger("fxsplit")

__all__ = ["export_model", "export_graph", "Exported", "failure_location", "is_hf_model"]

# ops that export inserts for its own runtime checks; they carry no computation and would tie
# stages together for nothing, so the traced graph drops them.
_EXPORT_CHECK_OPS = (
    "aten._assert_tensor_metadata.default",
    "aten._assert_scalar.default",
    "aten.sym_constrain_range_for_size.default",
    "aten._assert_async.msg",
)


class Exported(NamedTuple):
    gm: torch.fx.GraphModule
    note: str  # what the trace reason adds: the cache switched off, the batch static or widened, a fallback
    kept: list  # (module path, why) of attention modules kept whole ([Note: attention modules as ops])
    input_names: tuple[str, ...]
    traced_length: int | None = None  # the static sequence length export traced at, if any
    # the graph takes every length up to traced_length ([Note: following the sequence from two static
    # traces] in fxsplit.graph.sequence)
    follows: bool = False
    follow_refused: str | None = None  # why it stays static, when following was asked



def export_model(model: nn.Module, args: tuple, kwargs: dict, *, symbolic: bool, sequence: bool | None,
                 static_batch: int | None, wide: tuple[tuple, dict] | None, param_dtype: torch.dtype | None,
                 decomposing: Callable[[], Any], follow_sequence: bool = False,
                 propagate: Callable[[torch.fx.GraphModule, bool], None] | None = None,
                 stack_traces: bool = False, marker: bool = True) -> Exported:
    """Export ``model`` at the example ``(args, kwargs)``: at ``static_batch`` samples when given
    ([Note: a static batch]), else at ``wide`` (a batch of one widened: [Note: batch of one]) when
    given; the sequence symbolic only when ``sequence is True``; nothing symbolic without
    ``symbolic``. ``follow_sequence``: a sequence traced static is made to take every shorter
    length ([Note: following the sequence from two static traces] in ``fxsplit.graph.sequence``),
    ``propagate(gm, batch[, at])`` re-propagating fake values through the rewritten graph (the
    example at ``at`` samples when given: the marker batch).
    ``stack_traces``: nodes keep the model's source lines ([Note: no stack traces by default]).
    Raises TraceError naming where export failed and the fix.

    A symbolic batch with the sequence not symbolic is exported static at a marker batch and made to
    take any batch ([Note: a marker batch] in ``fxsplit.graph.batch_marker``); where the marker cannot
    serve, the batch is exported symbolic and the note says why; ``marker=False`` (``dynamic_batch=True``)
    asks for the symbolic export itself."""
    if marker and symbolic and static_batch is None and sequence is not True:
        options = dict(symbolic=symbolic, sequence=sequence, param_dtype=param_dtype, decomposing=decomposing,
                       follow_sequence=follow_sequence, stack_traces=stack_traces)
        marked, why = _at_marker(model, args, kwargs, options, propagate)
        if marked is not None:
            return marked
        exported = export_model(model, args, kwargs, static_batch=None, wide=wide, propagate=propagate, marker=False,
                                **options)
        return exported if why is None else exported._replace(note=exported.note + why)
    if static_batch is not None:
        ex_args, ex_kwargs = example_at_batch(args, kwargs, static_batch)
        batch_note = _static_note(static_batch)
    else:
        ex_args, ex_kwargs = wide if wide is not None else (args, kwargs)
        batch_note = WIDE_NOTE if wide is not None else ""
    try:
        with _cache_off(model, kwargs) as note, _stack_traces(stack_traces):
            try:
                with decomposing() as dec:
                    gm = export_graph(model, ex_args, ex_kwargs, symbolic, param_dtype, sequence=sequence is True,
                                      batch=static_batch is None)
                    dec.prune(gm)
                note += batch_note
                followed = _followed(gm, model, ex_args, ex_kwargs, decomposing=decomposing, symbolic=symbolic,
                                     param_dtype=param_dtype, batch=static_batch is None, asked=follow_sequence,
                                     propagate=propagate)
                note += followed[0]
            except Exception:
                if not symbolic:
                    raise
                with decomposing() as dec:
                    gm = export_graph(model, ex_args if static_batch is not None else args,
                                      ex_kwargs if static_batch is not None else kwargs, False,
                                      param_dtype)  # a model that cannot take symbolic sizes
                    dec.prune(gm)
                note += " (static shapes: export failed with symbolic batch/sequence)"
                followed = _followed(gm, model, ex_args, ex_kwargs, decomposing=decomposing, symbolic=False,
                                     param_dtype=param_dtype, batch=False, asked=False, propagate=None)
    except Exception as exc:
        raise _export_error(exc, model, kwargs) from exc
    return Exported(gm, note, dec.kept, tuple(_flat_input_names(gm._in_spec, model, args)), *followed[1:])


def _static_note(batch: int) -> str:
    return f" (the batch static at {batch} samples per microbatch: [Note: a static batch])"


def _at_marker(model: nn.Module, args: tuple, kwargs: dict, options: dict,
               propagate: Callable | None) -> tuple[Exported | None, str | None]:
    """``(exported, None)``: ``model`` exported at a marker batch and made to take any batch ([Note: a
    marker batch] in ``fxsplit.graph.batch_marker``); else ``(None, why)`` for the trace reason (None
    when the example has no batch or every marker divides a size of the model)."""
    example = batch_of((args, kwargs))
    p = choose_marker(model, args, kwargs, example) if example is not None else None
    if p is None:
        return None, None
    try:
        exported = export_model(model, args, kwargs, static_batch=p, wide=None, **options,
                                propagate=None if propagate is None else (lambda g, batch: propagate(g, batch, p)))
        why = mark_batch(exported.gm, p, example)
    except TraceError as exc:
        why = f"the export at batch {p} failed: {str(exc).splitlines()[0]}"
    if why is not None:
        log.info("fxsplit.trace: the batch is traced symbolic: the marker batch %d cannot serve: %s", p, why)
        return None, f" (the batch symbolic: the marker batch {p} cannot serve: {why})"
    note = exported.note.replace(_static_note(p), f" (traced at the marker batch {p}, every batch runs: "
                                                  "[Note: a marker batch])")
    return exported._replace(note=note), None


def _followed(gm: torch.fx.GraphModule, model: nn.Module, args: tuple, kwargs: dict, *, decomposing: Callable,
              symbolic: bool, param_dtype: torch.dtype | None, batch: bool, asked: bool,
              propagate: Callable | None) -> tuple[str, int | None, bool, str | None]:
    """``(note, traced length, follows, why not)``: [Note: following the sequence from two static
    traces]: ``gm`` rewritten in place when asked and possible."""
    static_seq = sequence_input(gm)
    length = static_seq[1] if static_seq is not None else None
    if not asked or static_seq is None:
        return "", length, False, None
    if param_dtype is not None:
        # the trace ran on parameters cast for it, now restored: propagating again would see the
        # restored dtype, not the one the graph computes in
        why = "the graph was traced under mp_policy's param_dtype"
        return f" (the sequence stays static at {length}, shorter steps padded: {why})", length, False, why

    def again(n: int) -> torch.fx.GraphModule:
        with decomposing() as dec:
            other = export_graph(model, at_length(args, length, n), at_length(kwargs, length, n), symbolic,
                                 param_dtype, sequence=False, batch=batch)
            dec.prune(other)
        return other

    _, why = follow_lengths(gm, again=again, propagate=lambda g: propagate(g, symbolic and batch))
    if why is not None:
        log.info("fxsplit.trace: the sequence stays static at %d: %s", length, why)
        return f" (the sequence stays static at {length}, shorter steps padded: {why})", length, False, why
    return (f" (traced at {length} and {length - 1} positions: every length up to {length} runs as it is, "
            "[Note: following the sequence from two static traces])"), length, True, None


# [Note: no stack traces by default]
# torch.export records, for every node it creates, the Python stack of the model's code that made
# it (``node.stack_trace``: a traceback captured and formatted per node). Nothing in fxsplit reads
# it, and it is a quarter of the export: a Llama-70B config (80 layers, meta) exported in 6.3 s
# with it and 4.8 s without, 11.5 s and 10.0 s with the batch symbolic (benchmarks/README.md,
# issue 28 part 5). So the exports fxsplit makes leave it out (``torch.fx.config.
# do_not_emit_stack_traces``); ``fxsplit.trace(..., stack_traces=True)`` keeps it, for a person
# who reads the graph's code (``gm.print_readable()`` prints each node's source line above it).
# torch 2.11 has no such setting (``_stack_traces`` then leaves its export as it is).


@contextlib.contextmanager
def _stack_traces(keep: bool):
    """[Note: no stack traces by default]: torch.export without per-node stack traces unless ``keep``."""
    config = torch.fx.config
    if keep or not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


@contextlib.contextmanager
def _cache_off(model: nn.Module, kwargs: dict):
    """torch.export cannot output a key/value cache: a Hugging Face model whose config has it on
    (and whose call does not set ``use_cache``) is traced with it off, then restored. Yields the
    note the trace reason carries."""
    cfg = getattr(model, "config", None) if is_hf_model(model) else None
    was = getattr(cfg, "use_cache", None)
    if not was or "use_cache" in kwargs:
        yield ""
        return
    cfg.use_cache = False
    try:
        yield " (with config.use_cache=False: torch.export cannot output a key/value cache)"
    finally:
        cfg.use_cache = was


def failure_location(exc: BaseException, model: nn.Module) -> tuple[str, str]:
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


def is_hf_model(model: nn.Module) -> bool:
    return hasattr(model, "config") and type(model).__module__.startswith("transformers")


def _export_error(exc: BaseException, model: nn.Module, kwargs: dict) -> TraceError:
    mod, line = failure_location(exc, model)
    where = f" in module {mod!r} at {line}" if mod else ""
    text = f"{type(exc).__name__}: {str(exc).strip()}"
    hints = []
    cache_on = is_hf_model(model) and getattr(model.config, "use_cache", False) and kwargs.get("use_cache") is not False
    if cache_on or "DynamicCache" in text or "Cache" in type(exc).__name__:
        hints.append(
            "the model returns a key/value cache (config.use_cache=True), which torch.export cannot "
            "output: pass use_cache=False (example_kwargs={'use_cache': False} or config.use_cache=False)"
        )
    hints.append(("or " if hints else "") + "trace with method=\"fx\" and leaf_modules=[...] naming the module "
                 "that cannot be traced (kept as one call in the graph)")
    short = text.splitlines()[0][:500]
    return TraceError(f"torch.export could not trace {type(model).__name__}{where}: {short}. Fix: " + "; ".join(hints))


def _flat_input_names(spec: Any, model: nn.Module, args: tuple) -> list[str]:
    sig_names = list(inspect.signature(model.forward).parameters)
    names = [sig_names[i] if i < len(sig_names) else f"arg{i}" for i in range(len(args))]
    kw_spec = spec.child(1)
    names += list(kw_spec.context)
    if len(names) != spec.num_leaves:  # nested inputs: name the leaves by position
        names = [f"input{i}" for i in range(spec.num_leaves)]
    return names


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


def export_graph(model: nn.Module, args: tuple, kwargs: dict, dynamic: bool,
                 param_dtype: torch.dtype | None = None, sequence: bool = True,
                 batch: bool = True) -> torch.fx.GraphModule:
    """``torch.export`` (non-strict) of ``model`` at the example, as a GraphModule: ``batch`` /
    ``sequence`` symbolic when ``dynamic``, the parameters kept in their own dtype ([Note: tracing
    under a parameter dtype]), export's own runtime checks dropped."""
    from torch.export import Dim

    dyn_spec = None
    if dynamic and (batch or sequence):
        sig = inspect.signature(model.forward)
        bound = sig.bind(*args, **kwargs)
        spec: dict[str, Any] = {}
        for name, val in bound.arguments.items():
            if isinstance(val, torch.Tensor):
                spec[name] = {d: Dim.AUTO for d in dynamic_dims(val, sequence, batch)} or None
            else:
                spec[name] = None
        dyn_spec = spec
    input_dtypes = [v.dtype if isinstance(v, torch.Tensor) else None
                    for v in torch.utils._pytree.tree_leaves((args, kwargs))]
    with _parameters_in(model, param_dtype) as originals, _meta_weights_read_by_cpu_indices(model):
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
    _inline_no_grad_blocks(gm)
    for sub in gm.modules():  # higher-order ops' subgraphs hold check ops too (torch 2.11)
        if isinstance(sub, torch.fx.GraphModule):
            for node in list(sub.graph.nodes):
                if node.op == "call_function" and str(node.target) in _EXPORT_CHECK_OPS and not node.users:
                    sub.graph.erase_node(node)
            if sub is not gm:
                sub.recompile()
    gm.graph.lint()
    gm.recompile()
    return gm


# [Note: no_grad blocks inlined]
# torch.export puts a ``with torch.no_grad():`` region (or a ``@torch.no_grad()`` forward) of the model in a
# ``wrap_with_set_grad_enabled(False, submod, *inputs)`` higher-order op over a subgraph. transformers
# 5.17 (the GPU machines') decorates every rotary embedding's forward with ``@torch.no_grad()``; 5.25
# does not, and its cos/sin ops sit in the main graph. The passes rewrite the main graph only (context
# parallelism's positions, the split's cuts, the cost of each op), so a block whose inputs carry no
# gradient is inlined: no value in it can require grad with grad mode on or off (its inputs are buffers,
# integer positions or values computed from them), so the inlined ops compute the same values and
# the same (no) gradients. A block reading a parameter or an activation stays a higher-order op.


def _inline_no_grad_blocks(gm: torch.fx.GraphModule) -> None:
    """Inline every ``wrap_with_set_grad_enabled(False, ...)`` of ``gm`` whose inputs carry no
    gradient ([Note: no_grad blocks inlined])."""
    hop = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    if hop is None:
        return
    blocks = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is hop and n.args[0] is False]
    if not blocks:
        return
    graded = _may_carry_gradient(gm)
    for node in blocks:
        sub_node, inputs = node.args[1], node.args[2:]
        if node.kwargs or not isinstance(sub_node, torch.fx.Node) or sub_node.op != "get_attr" \
                or any(isinstance(a, torch.fx.Node) and a in graded for a in inputs):
            continue
        sub = getattr(gm, str(sub_node.target))
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(inputs) or any(n.op in ("get_attr", "call_module") for n in sub.graph.nodes):
            continue  # the subgraph's own attributes: left as it is
        if not all(u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)
                   for u in node.users):
            continue
        with gm.graph.inserting_before(node):
            outputs = gm.graph.graph_copy(sub.graph, dict(zip(placeholders, inputs)))
        if not isinstance(outputs, (tuple, list)):
            outputs = (outputs,)
        for user in list(node.users):
            user.replace_all_uses_with(outputs[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        if not sub_node.users:
            gm.graph.erase_node(sub_node)
            delattr(gm, str(sub_node.target))


def _may_carry_gradient(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Nodes whose value may require grad: a parameter that does, a floating-point input, and every
    node reading one of those (over-approximated: any op)."""
    out: set[torch.fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            try:
                attr = gm.get_parameter(str(n.target))
            except AttributeError:
                attr = None
            if attr is not None and attr.requires_grad:
                out.add(n)
        elif n.op == "placeholder":
            val = n.meta.get("val")
            if not isinstance(val, torch.Tensor) or val.dtype.is_floating_point or val.dtype.is_complex:
                out.add(n)
        elif any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


# [Note: a meta model read by CPU indices]
# A model built on the meta device (planning without weights) is traced with the caller's CPU
# example inputs: ``nn.Embedding`` then reads a meta weight with CPU indices. torch 2.13's fake
# ``aten.embedding`` accepts the pair (its output on the weight's device, meta); torch 2.11's has no
# such rule and torch.export failed ("Unhandled FakeTensor Device Propagation for
# aten.embedding.default, found two different devices meta, cpu"). Where a probe shows that, the
# export of a meta model runs with ``fake_tensor_prefer_device_type="meta"``: an op mixing meta and
# CPU tensors gets meta outputs, as 2.13's embedding does. Only shapes and dtypes are traced (a meta
# model has no values), so no number can come out different.


@functools.lru_cache(maxsize=None)
def _meta_embedding_refused() -> bool:
    """Whether this torch's fake ``aten.embedding`` refuses a meta weight with CPU indices (probed once)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with mode:
            torch.nn.functional.embedding(mode.from_tensor(torch.zeros(3, dtype=torch.int64)),
                                          mode.from_tensor(torch.empty(4, 2, device="meta")))
    except RuntimeError:
        return True
    return False


def _meta_weights_read_by_cpu_indices(model: nn.Module) -> contextlib.AbstractContextManager:
    """[Note: a meta model read by CPU indices]: the setting a meta model's export needs on this torch."""
    if not any(p.is_meta for p in model.parameters()) or not _meta_embedding_refused():
        return contextlib.nullcontext()
    return torch._functorch.config.patch(fake_tensor_prefer_device_type="meta")
