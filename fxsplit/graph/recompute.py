"""Activation checkpointing: which nodes a layer recomputes, and the functions checkpointed
graph code calls (``torch.utils.checkpoint``, non-reentrant, with a selective policy).

Terms:
    layer key   a node's module path up to its first numeric component (``blocks.3``,
                ``model.layers.11``), else its first component; the module-call boundary a
                region follows (`layer_key`).
    region      a maximal run of consecutive compute nodes (call_function / call_method /
                call_module) of one graph with the same non-empty layer key (`regions`); graph
                code runs it as one checkpointed call.
    mode        "none" (save everything autograd saves), "full" (save the region's inputs,
                recompute the whole region in backward), "selective" (save the region's inputs
                and the outputs of its *kept* nodes, recompute the rest).
    kept node   under "selective": a matmul-like node with a parameter operand (a linear or
                convolution layer) or a fused attention without dropout (`keeps_output`). Its
                output is cached in forward and reused by the recomputation; everything else in
                the region (attention scores and softmax, elementwise ops, norms, dropout) is
                recomputed. A random node is never kept, so the recomputation draws the same
                numbers in the same order as the forward did.

    checkpointed(region_gm, "selective", *inputs)   # what an outlined region's call site runs
    keep(F.linear)(x, w, b)                         # a kept node inside a selective region

[Note: selective policy]
torch's selective checkpoint (``create_selective_checkpoint_contexts``) decides per aten op,
seeing only the op and its arguments; a linear layer's matmul and an attention-score matmul are
both ``aten.mm``/``bmm`` there. The decision is made on the fx graph instead, where the module and
the parameter operand are known: the pass writes each kept node as ``keep(op)(*args)`` (``keep_linear(...)`` in
the graph code), which runs ``op`` with a thread-local flag set, and the policy returns ``MUST_SAVE`` for every aten op
run under the flag except views (the matmul, and a dtype cast of the weight it makes, which
autograd would save anyway) and ``PREFER_RECOMPUTE`` otherwise: a cached view of the layer's
input would keep that input alive. The flag is set by the same
graph code in forward and in recomputation, so the two see the same decisions in the same order.
Collectives (``c10d``) under the flag are recomputed, not cached (in-place ops are not cached).

[Note: checkpoint and RNG]
``torch.utils.checkpoint`` (``preserve_rng_state=True``) restores the CPU generator (and the
devices' of the region's tensor inputs) to its state at the region's forward before recomputing,
and both fxsplit streams ([Note: RNG streams] in ``fxsplit.tp.random``) are functions of that
state: the stage stream is the default generator itself, and a tp stream is seeded from a number
drawn from it. So every dropout in a region replays its mask, replicated or tp-sharded; kept
nodes are never random (their cached output would skip a draw and shift every later one).
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
import torch.utils.checkpoint as ckpt
from torch import nn

from fxsplit.errors import UsageError
from fxsplit.graph.ops import MATMULS, is_random, op_name

__all__ = ["MODES", "layer_key", "node_layer", "regions", "worth_checkpointing", "keeps_output", "keep", "call_module", "checkpointed", "policy",
           "fx_meta_kept"]

MODES = ("none", "selective", "full")
_COMPUTE = ("call_function", "call_method", "call_module")
_PARAM_VIEWS = frozenset({"to", "t", "transpose", "permute", "view", "reshape", "contiguous", "type", "float",
                          "half", "bfloat16", "detach", "_to_copy", "expand", "unsqueeze", "squeeze"})
_ATTENTION = frozenset({"scaled_dot_product_attention", "ring_attention", "_scaled_dot_product_flash_attention",
                        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                        "_scaled_dot_product_cudnn_attention"})
_CONV = ("conv", "convolution")


def layer_key(path: str) -> str:
    """``"blocks.3.attn.q"`` -> ``"blocks.3"``; ``"ln_f"`` -> ``"ln_f"``; ``""`` -> ``""``."""
    parts = path.split(".") if path else []
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0] if parts else ""


def node_layer(node: torch.fx.Node) -> str:
    """The layer key of ``node``'s module path (``fxsplit.graph.inspection.module_path``)."""
    from fxsplit.graph.inspection import module_path

    return layer_key(module_path(node))


def regions(graph: torch.fx.Graph) -> list[tuple[str, list[torch.fx.Node]]]:
    """(layer key, nodes) of every region of ``graph`` in order (see Terms); nodes with an empty
    layer key (the model's own top-level ops) belong to no region."""
    out: list[tuple[str, list[torch.fx.Node]]] = []
    for node in graph.nodes:
        if node.op not in _COMPUTE:
            continue  # placeholders and get_attr stay outside: a region takes them as inputs
        key = node_layer(node)
        if not key:
            out.append(("", []))  # breaks the run
            continue
        if out and out[-1][0] == key:
            out[-1][1].append(node)
        else:
            out.append((key, [node]))
    return [(k, nodes) for k, nodes in out if k and nodes]


def worth_checkpointing(nodes: list[torch.fx.Node]) -> bool:
    """Whether a region is checkpointed at all: more than one node (one node alone saves what the
    checkpoint would keep, its input) and some node saves activations (per the cost model)."""
    if len(nodes) < 2:
        return False
    for n in nodes:
        info = n.meta.get("fxsplit")
        if info is None or info.cost is None or info.cost.saved_bytes != 0:
            return True  # no cost known: assume it saves
    return False


def _resolve(gm: nn.Module | None, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _param_derived(node: Any, gm: nn.Module | None, depth: int = 0) -> bool:
    """Whether ``node`` is a parameter read or a view / cast of one (e.g. ``w.to(bf16)``)."""
    if not isinstance(node, torch.fx.Node) or depth > 4:
        return False
    if node.op == "get_attr":
        return isinstance(_resolve(gm, str(node.target)), nn.Parameter)
    if node.op in ("call_function", "call_method") and op_name(node, gm) in _PARAM_VIEWS and node.args:
        return _param_derived(node.args[0], gm, depth + 1)
    return False


def keeps_output(node: torch.fx.Node, gm: nn.Module | None = None) -> bool:
    """Whether selective checkpointing keeps ``node``'s output (see Terms: kept node)."""
    gm = gm if gm is not None else node.graph.owning_module
    if node.op not in _COMPUTE or is_random(node, gm):
        return False
    name = op_name(node, gm)
    if name in _ATTENTION:
        return True
    if node.op == "call_module":
        mod = _resolve(gm, str(node.target))
        return isinstance(mod, (nn.Linear, nn.modules.conv._ConvNd, nn.Bilinear))
    linear_like = name in MATMULS or name.startswith(_CONV) or name.endswith("parallel_linear")
    return linear_like and any(_param_derived(a, gm) for a in node.all_input_nodes)


# ------------------------------------------------------------------------------------------------
# what checkpointed graph code calls

_STATE = threading.local()


def _keep_call(op: Callable, args: tuple, kwargs: dict) -> Any:
    depth = getattr(_STATE, "keep", 0)
    _STATE.keep = depth + 1
    try:
        return op(*args, **kwargs)
    finally:
        _STATE.keep = depth


_KEPT: dict[Any, Callable] = {}  # op -> its keep wrapper: one function per op (fx globals)


def keep(op: Callable) -> Callable:
    """``op`` as a kept node: the aten ops it runs have their outputs cached by a selective
    region ([Note: selective policy]). One wrapper per op, named ``keep_<op>`` in graph code."""
    if op in _KEPT:
        return _KEPT[op]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return _keep_call(op, args, kwargs)

    name = getattr(op, "__name__", None) or type(op).__name__
    if isinstance(op, torch._ops.OpOverload):
        name = f"{op.overloadpacket.__name__}_{op._overloadname}"
    wrapper.__name__ = "keep_" + re.sub(r"\W", "_", name)
    wrapper.__qualname__ = f"keep.{wrapper.__name__}"
    wrapper.__module__ = __name__
    wrapper.__wrapped__ = op  # type: ignore[attr-defined]
    _KEPT[op] = wrapper
    return wrapper


def call_module(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)``: a module call inside a region, the module passed in by the
    caller (so a region owns no parameters and every parameter keeps its name)."""
    return module(*args, **kwargs)


def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> ckpt.CheckpointPolicy:
    """The selective policy ([Note: selective policy])."""
    if getattr(_STATE, "keep", 0) and getattr(op, "namespace", "") not in ("c10d", "_c10d_functional"):
        # views (of the input, of the weight) are recomputed: a cached view would keep the
        # whole input alive, which is what the region means not to keep
        if not op._schema.is_mutable and not op.is_view:
            return ckpt.CheckpointPolicy.MUST_SAVE
    return ckpt.CheckpointPolicy.PREFER_RECOMPUTE


_SELECTIVE = functools.partial(ckpt.create_selective_checkpoint_contexts, policy)


def checkpointed(region: Callable, mode: str, *inputs: Any) -> Any:
    """Run ``region(*inputs)`` under ``torch.utils.checkpoint`` (non-reentrant, RNG state
    preserved: [Note: checkpoint and RNG]); ``mode`` "full" or "selective". Without autograd
    (inference, ``torch.no_grad``) it is a plain call."""
    if mode not in ("full", "selective"):
        raise UsageError(f"checkpointed: mode must be 'full' or 'selective', got {mode!r}")
    if not torch.is_grad_enabled():
        return region(*inputs)
    context = _SELECTIVE if mode == "selective" else ckpt.noop_context_fn
    return ckpt.checkpoint(region, *inputs, use_reentrant=False, preserve_rng_state=True, context_fn=context)


# [Note: selective checkpoint tags leak]
# torch's selective checkpoint, when it runs under a tracer (its `_CachingTorchDispatchMode` sees a
# proxy mode: our make_fx of a selectively checkpointed stage), writes ``recompute`` and
# ``ac_graph_id`` (None here) into ``torch.fx.traceback.current_meta``, the process-global dict
# whose entries a later trace with preserved node meta copies onto the nodes it makes, and never
# takes them out (torch 2.13). After one such split, a later torch.compile with a backward in the
# same process could get a joint graph whose nodes said "recompute" with ac_graph_id None, and
# AOTAutograd's partitioner failed comparing two ids (`cleanup_recompute_tags`: "'>' not supported
# between instances of 'NoneType' and 'NoneType'"): a compiled loss (compile=True) ran eagerly with
# that reason. The suite's compiled-loss test failed so whenever its pytest worker had run
# test_split_graph's selective case before it (the "compile flake" of issue 26, which depended on
# which files xdist gave one worker). `fx_meta_kept` puts the dict back as it found it around
# such a trace (GraphSplit.trace).
@contextlib.contextmanager
def fx_meta_kept() -> Iterator[None]:
    """Leave ``torch.fx.traceback.current_meta`` as it was ([Note: selective checkpoint tags leak])."""
    meta = fx_traceback.current_meta
    saved = dict(meta)
    try:
        yield
    finally:
        fx_traceback.current_meta = meta  # a context that rebound it and did not restore it
        meta.clear()
        meta.update(saved)
