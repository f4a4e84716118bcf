"""The causal-mask pass: an attention mask that is exactly causal becomes ``is_causal=True``.

Written only against fxsplit's public API.

[Note: causal masks as is_causal]
A traced model hands sdpa the mask its code built: Hugging Face models skip the mask in eager
mode when nothing is padded (``is_causal=True``: the flash kernel), but under tracing they always
build it, a boolean (B, 1, S, S) from ``arange`` comparisons (and, in transformers 5, packed-
document ids from the position ids). sdpa with a mask cannot run the flash kernel: on an H200 the
traced 1.26B Llama stepped 15% slower than the same model in plain eager (benchmarks/README.md,
"gpu-check on an NVIDIA H200"), and on every pipeline cut the mask travels as an activation.

Terms: the **mask subgraph** -- the nodes the mask is computed from; a **size read** -- a node that
reads a size off a tensor (``aten.sym_size.int``, ``x.size(...)``, ``x.shape``), where the mask
subgraph stops. A mask is **data-free** when its subgraph reaches the model's inputs only through
size reads and holds no module call: then its value depends on sizes alone, and the pass
evaluates it (on the CPU, whatever device the trace baked in) at the sizes the graph runs at.
The mask is replaced (``attn_mask=None, is_causal=True``) only where

- the queries' and keys' lengths are static (a symbolic length would be checked at one length
  and run at others: a sliding window longer than the checked length looks causal there);
- other symbols (the batch) take two trial values, and the mask is the same at both;
- the value equals sdpa's own causal mask, ``ones(Lq, Lk).tril()`` (boolean), or 0 on and below
  the diagonal and -inf or the dtype's lowest value above it (float: ``exp`` of either is 0);
- it has at most ``MAX_ELEMENTS`` elements (a longer mask is left as it is, with the reason);
- nothing in its subgraph draws random numbers.

Every other mask stays, and ``ctx.report["causal_masks"]`` names each with its reason. The mask
subgraph's nodes that nothing else reads are removed.

    PassManager([causal_masks])(gm, ctx)
"""

from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
import torch.fx

from fxsplit.graph.meta import to_expr
from fxsplit.graph.ops import SDPA_ARGS
from fxsplit.graph.pass_api import PassContext, PassResult

__all__ = ["MAX_ELEMENTS", "causal_masks", "reads_a_mask"]

MAX_ELEMENTS = 1 << 28  # 256 Mi booleans evaluated at plan time: sequences up to 16k
_TRIAL_BATCHES = (1, 3)
_SDPA_TARGETS = {torch.ops.aten.scaled_dot_product_attention.default, torch._C._nn.scaled_dot_product_attention,
                 torch.nn.functional.scaled_dot_product_attention}
_RANDOM = ("rand", "bernoulli", "dropout", "normal", "uniform", "multinomial", "poisson", "exponential")


class _Unsure(Exception):
    """The mask cannot be shown causal (the message says why); caught inside this module."""


def _is_size_read(n: torch.fx.Node) -> bool:
    if n.op == "call_function":
        if n.target in (torch.ops.aten.sym_size.int, torch.ops.aten.sym_size.default):
            return True
        return n.target is getattr and len(n.args) > 1 and n.args[1] == "shape"
    return n.op == "call_method" and n.target in ("size", "dim")


def _arg(node: torch.fx.Node, name: str, default: Any = None) -> Any:
    i = SDPA_ARGS.index(name)
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _subgraph(mask: torch.fx.Node) -> list[torch.fx.Node]:
    """The mask subgraph, stopping at size reads; refused when it reads data or calls a module."""
    seen: dict[torch.fx.Node, None] = {}
    stack = [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen[n] = None
        if _is_size_read(n):
            continue
        if n.op == "placeholder":
            raise _Unsure(f"it reads the model input {n.name!r} (a padding or document mask)")
        if n.op in ("call_module", "output"):
            raise _Unsure(f"it is computed by the module call {n.name!r}")
        if any(word in str(n.target) for word in _RANDOM):
            raise _Unsure(f"it draws random numbers ({n.name!r}): one evaluation says nothing of the next step")
        stack.extend(n.all_input_nodes)
    return list(seen)


def _concrete(x: Any, bindings: dict) -> Any:
    """A size value (int, SymInt, torch.Size / tuple of them) with the symbols bound."""
    if isinstance(x, torch.Size):
        return torch.Size([_concrete(v, bindings) for v in x])
    if isinstance(x, (tuple, list)):
        return type(x)(_concrete(v, bindings) for v in x)
    if isinstance(x, torch.SymInt):
        v = to_expr(x).xreplace(bindings)
        if not v.is_Integer:
            raise _Unsure(f"a size {x} has a symbol other than the batch's")
        return int(v)
    return x


def _on_cpu(x: Any) -> Any:
    return torch.device("cpu") if isinstance(x, torch.device) else x


def _evaluate(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], mask: torch.fx.Node, bindings: dict) -> torch.Tensor:
    env: dict[torch.fx.Node, Any] = {}
    wanted = set(nodes)
    for n in gm.graph.nodes:  # graph order is a topological order
        if n not in wanted:
            continue
        if _is_size_read(n):
            if "val" not in n.meta:
                raise _Unsure(f"the size read {n.name!r} has no value in its metadata")
            env[n] = _concrete(n.meta["val"], bindings)
            continue
        if n.op == "get_attr":
            value = operator.attrgetter(str(n.target))(gm)
            if isinstance(value, torch.Tensor) and value.is_meta:
                raise _Unsure(f"it reads {n.target!r}, which is on the meta device (no value at plan time)")
            env[n] = value.detach().cpu() if isinstance(value, torch.Tensor) else value
            continue
        args = torch.fx.node.map_aggregate(torch.fx.node.map_arg(n.args, env.__getitem__), _on_cpu)
        kwargs = torch.fx.node.map_aggregate(torch.fx.node.map_arg(n.kwargs, env.__getitem__), _on_cpu)
        fn = getattr(args[0], n.target) if n.op == "call_method" else n.target
        env[n] = fn(*args[1:], **kwargs) if n.op == "call_method" else fn(*args, **kwargs)
    return env[mask]


def _is_causal_value(value: Any, lq: int, lk: int) -> bool:
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return False
    try:
        value = torch.broadcast_to(value, (*value.shape[:-2], lq, lk))
    except RuntimeError:
        return False
    keep = torch.ones(lq, lk, dtype=torch.bool).tril()
    if value.dtype == torch.bool:
        return bool((value == keep).all())
    if not value.is_floating_point():
        return False
    lowest = torch.finfo(value.dtype).min
    return bool((value[..., keep] == 0).all()) and bool((value[..., ~keep] <= lowest).all())


def _why_not_causal(gm: torch.fx.GraphModule, node: torch.fx.Node, mask: torch.fx.Node) -> str | None:
    """None when ``mask`` is exactly sdpa's causal mask at every size ``node`` runs at, else why not."""
    q, k = _arg(node, "query").meta.get("val"), _arg(node, "key").meta.get("val")
    if q is None or k is None:
        return "the query or key has no value in its metadata"
    lq, lk = q.shape[-2], k.shape[-2]
    if not (isinstance(lq, int) and isinstance(lk, int)):
        return "the sequence length is symbolic (checked at one length, it would run at others)"
    val = mask.meta.get("val")
    if isinstance(val, torch.Tensor) and any(isinstance(d, int) for d in val.shape) and \
            _elements(val.shape) > MAX_ELEMENTS:
        return f"its {_elements(val.shape)} elements are more than {MAX_ELEMENTS} to check at plan time"
    try:
        nodes = _subgraph(mask)
        symbols = set()
        for n in nodes:
            if _is_size_read(n):
                for v in torch.utils._pytree.tree_leaves(n.meta.get("val")):
                    if isinstance(v, torch.SymInt):
                        symbols |= to_expr(v).free_symbols
        values = []
        for trial in (_TRIAL_BATCHES if symbols else _TRIAL_BATCHES[:1]):
            values.append(_evaluate(gm, nodes, mask, {s: sympy.Integer(trial) for s in symbols}))
    except _Unsure as why:
        return str(why)
    except Exception as exc:  # noqa: BLE001 -- an op that will not run on the CPU: keep the mask, say why
        return f"evaluating it failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    if not all(_is_causal_value(v, lq, lk) for v in values):
        return "its value is not the causal mask (a window, padding or another pattern)"
    return None


def _elements(shape: Any) -> int:
    total = 1
    for d in shape:
        total *= int(d) if isinstance(d, int) else 1
    return total


def _make_causal(node: torch.fx.Node) -> None:
    args, kwargs = list(node.args), dict(node.kwargs)
    for name, value in (("attn_mask", None), ("is_causal", True)):
        i = SDPA_ARGS.index(name)
        if len(args) > i:
            args[i] = value
        else:
            kwargs[name] = value
    node.args, node.kwargs = tuple(args), kwargs


def _drop_unused(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> int:
    dropped, wanted = 0, set(nodes)
    for n in reversed([n for n in gm.graph.nodes if n in wanted]):
        if not n.users and n.op in ("call_function", "call_method", "get_attr"):
            gm.graph.erase_node(n)
            dropped += 1
    return dropped


def reads_a_mask(gm: torch.fx.GraphModule) -> bool:
    """Whether some sdpa call of ``gm`` reads a mask (the pass has something to look at)."""
    return any(n.op == "call_function" and n.target in _SDPA_TARGETS and isinstance(_arg(n, "attn_mask"), torch.fx.Node)
               for n in gm.graph.nodes)


def causal_masks(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Every sdpa call whose mask is exactly causal gets ``is_causal=True`` instead ([Note: causal
    masks as is_causal])."""
    verdicts: dict[torch.fx.Node, str | None] = {}  # one check per mask node: the layers share it
    changed, kept, subgraphs = [], [], []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _SDPA_TARGETS:
            continue
        mask = _arg(node, "attn_mask")
        if not isinstance(mask, torch.fx.Node) or _arg(node, "is_causal", False):
            continue
        if mask not in verdicts:
            verdicts[mask] = _why_not_causal(gm, node, mask)
        if verdicts[mask] is None:
            _make_causal(node)
            changed.append(node.name)
            subgraphs.append(mask)
        else:
            kept.append(f"{node.name}: {verdicts[mask]}")
    dropped = 0
    for mask in dict.fromkeys(subgraphs):
        if not mask.users:
            dropped += _drop_unused(gm, _subgraph(mask))
    if changed:
        gm.graph.lint()
        gm.recompile()
    ctx.report["causal_masks"] = (
        f"{len(changed)} of {len(changed) + len(kept)} attention masks are causal: is_causal=True, "
        f"{dropped} mask nodes removed" + "".join(f"\n  mask kept, {k}" for k in kept))
    return PassResult(gm, bool(changed))
