"""Per-op cost of the cost model: what one fx node's operator reads, writes, computes and saves.

This is the internal half of :mod:`fxsplit.graph.cost` (not a public module): ``fxsplit.graph.cost`` owns
``NodeCost``, parameter ownership and the graph sums, and imports what it needs from here; the
public name defined here (``value_bytes``) is re-exported there and should be imported from
there, with ``Number`` and ``to_expr`` (``fxsplit.graph.shapes``'s, also public in
``fxsplit.graph.meta``).

Terms:
    Number          ``int | float | sympy.Expr`` (symbolic dims become sympy expressions).
    meta            a :class:`fxsplit.graph.shapes.TensorMeta`: one tensor value, read from
                    ``node.meta["val"]`` (or ``"tensor_meta"``) by ``tensor_metas``.
    ins, acts       the metas of a node's tensor inputs, and of those that are not parameters
                    (activations: what backward may need saved; norms count the rest as affine).
    op name         the normalized operator name of a node (``fxsplit.graph.ops.op_name``, [Note:
                    op names]): module class, function, method and aten overload of one operator
                    share it; the op classes (``COST_FREE``, ``COPIES``, ...) are that module's too.
    kind            the formula an op name selects (``_kind``): matmul, attention, conv, embedding,
                    norm, other; a call_module of a class the op vocabulary does not know
                    (``"module:ClassName"``) is a leaf module, counted with ``FlopCounterMode``.
    formula         ``(node, name, ins, acts, outs, gm, module) -> (flops, matmul_flops, saved_bytes)``;
                    bytes read and written are computed uniformly by ``op_cost``.

    op_cost(node, gm) -> dict[str, Number]   # NodeCost fields but param_bytes; {} when free

The conventions these tables and formulas implement are [Note: cost conventions] in
``fxsplit/graph/cost.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import sympy
import torch
import torch.fx
from torch import nn

from fxsplit.graph.shapes import Number, TensorMeta, tensor_metas, to_expr
from fxsplit.graph.ops import CASTS, COPIES, COST_FREE, CREATION, MATMULS, NORMS, REDUCTIONS, op_name, resolve_path


# ---------------------------------------------------------------------------------------------
# Numbers


def _is_symbolic(x: Number) -> bool:
    return isinstance(x, sympy.Basic) and not x.is_Number


def _prod(xs: Iterable[Number]) -> Number:
    return math.prod(xs, start=1)


def _sum(xs: Iterable[Number]) -> Number:
    ints: list[Number] = []
    syms: list[sympy.Expr] = []
    for x in xs:
        (syms if isinstance(x, sympy.Basic) else ints).append(x)
    total: Number = sum(ints)
    if syms:
        total = to_expr(sympy.Add(total, *syms))
    return total


def _mul(a: Number, b: Number) -> Number:
    value = a * b
    return to_expr(value) if isinstance(value, sympy.Basic) else value


def _clean(x: Number) -> Number:
    return to_expr(sympy.expand(x)) if isinstance(x, sympy.Basic) else x


# ---------------------------------------------------------------------------------------------
# Tensor metadata


def _node_value(node: torch.fx.Node) -> Any:
    if "val" in node.meta:
        return node.meta["val"]
    return node.meta.get("tensor_meta")


def _arg_metas(arg: Any, gm: nn.Module | None, *, params: bool = True) -> list[TensorMeta]:
    """Tensor metas of one argument (a Node, a tensor, or a nested list/tuple/dict of them);
    ``params=False`` leaves out the parameters (get_attr nodes of an ``nn.Parameter``), which
    leaves the activations."""
    if isinstance(arg, torch.fx.Node):
        val = _node_value(arg)
        if arg.op == "get_attr":
            attr = resolve_path(gm, str(arg.target), default=None)
            if not params and isinstance(attr, nn.Parameter):
                return []
            if val is None and isinstance(attr, torch.Tensor):
                val = attr
        return list(tensor_metas(val))
    if isinstance(arg, torch.Tensor):
        return list(tensor_metas(arg))
    if isinstance(arg, (tuple, list)):
        return [m for a in arg for m in _arg_metas(a, gm, params=params)]
    if isinstance(arg, dict):
        return [m for a in arg.values() for m in _arg_metas(a, gm, params=params)]
    return []


def _arg(node: torch.fx.Node, index: int, name: str) -> Any:
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name)


def _first(node: torch.fx.Node, index: int, name: str, gm: nn.Module | None) -> TensorMeta | None:
    metas = _arg_metas(_arg(node, index, name), gm)
    return metas[0] if metas else None


def value_bytes(val: Any) -> Number:
    """Bytes of the tensors in a node value (``node.meta["val"]``: tensor, tuple/list/dict of them,
    or a non-tensor, which is 0); symbolic where the shapes are. Useful for boundary traffic."""
    return _bytes(tensor_metas(val))


# ---------------------------------------------------------------------------------------------
# Cost tables over the op classes of fxsplit.graph.ops (see [Note: cost conventions] in
# fxsplit/graph/cost.py)

_PER_ELEMENT_FLOPS = {
    "gelu": 8, "silu": 4, "sigmoid": 4, "tanh": 4, "mish": 6, "softplus": 4, "elu": 2, "erf": 4,
    "softmax": 5, "log_softmax": 5, "cross_entropy": 5, "logsumexp": 4, "var": 3, "std": 3,
    "var_mean": 3, "std_mean": 3, "norm": 2, "dropout": 1,
}
_SAVE_NOTHING = frozenset({
    "add", "sub", "neg", "sum", "mean", "cat", "stack", "masked_fill", "where", "eq", "ne", "lt",
    "le", "gt", "ge", "logical_not", "logical_and", "logical_or", "bitwise_and", "bitwise_or",
    "bitwise_not", "tril", "triu", "fill", "zero", "floor", "ceil", "round", "sign", "cumsum",
}) | COST_FREE | COPIES | CREATION
_SAVE_OUTPUT = frozenset({
    "relu", "sigmoid", "tanh", "exp", "softmax", "log_softmax", "sqrt", "rsqrt", "elu", "hardtanh",
    "relu6", "leaky_relu", "exp2", "reciprocal",
})


def _kind(name: str) -> str:
    if name in MATMULS:
        return "matmul"
    if "scaled_dot_product" in name or name in {"flash_attention", "efficient_attention", "ring_attention"}:
        return "attention"
    if name.startswith("conv") or name in {"convolution", "cudnn_convolution", "mkldnn_convolution"}:
        return "conv"
    if name in {"embedding", "embedding_bag"}:
        return "embedding"
    if any(word in name for word in NORMS):
        return "norm"
    return "other"


# ---------------------------------------------------------------------------------------------
# Per-kind formulas. Each returns (flops, matmul_flops, saved_bytes) given the node's input metas
# (``ins``) and output metas (``outs``); bytes read/written are computed uniformly.


def _bytes(metas: Iterable[TensorMeta]) -> Number:
    return _sum(m.nbytes for m in metas)


def _matmul_cost(node, name, ins, acts, outs, gm, module):
    out = outs[0]
    if module is not None:  # nn.Linear / nn.Bilinear leaf
        if name == "linear":
            k: Number = module.in_features
        else:
            k = module.in1_features * module.in2_features
        mm = 2 * out.numel * k
        has_bias = getattr(module, "bias", None) is not None
        return mm + (out.numel if has_bias else 0), mm, _bytes(acts)
    if name == "einsum":
        mm = _einsum_flops(node, gm)
        if mm is None:
            return out.numel, 0, _bytes(acts)
        return mm, mm, _bytes(acts)
    if name == "linear":
        a = _first(node, 0, "input", gm)
        has_bias = _arg(node, 2, "bias") is not None
        extra = out.numel if has_bias else 0
    elif name in {"addmm", "baddbmm", "addbmm", "addmv"}:
        a = _first(node, 1, "mat1" if name == "addmm" else "batch1", gm)
        if a is None:
            a = _first(node, 1, "mat", gm)
        extra = out.numel
    else:  # matmul, mm, bmm, dot, vdot, mv
        a = _first(node, 0, "input", gm)
        extra = 0
    if a is None or not a.shape:
        return out.numel, 0, _bytes(acts)
    mm = 2 * out.numel * a.shape[-1]
    if name == "addbmm":
        mm = mm * a.shape[0]
    return _sum((mm, extra)), mm, _bytes(acts)


def _einsum_flops(node, gm) -> Number | None:
    equation = _arg(node, 0, "equation")
    operands = list(node.args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if not isinstance(equation, str) or "..." in equation or len(operands) < 2:
        return None
    lhs = equation.replace(" ", "").split("->")[0].split(",")
    if len(lhs) != len(operands):
        return None
    sizes: dict[str, Number] = {}
    for letters, operand in zip(lhs, operands):
        metas = _arg_metas(operand, gm)
        if len(metas) != 1 or len(metas[0].shape) != len(letters):
            return None
        for letter, size in zip(letters, metas[0].shape):
            sizes[letter] = size
    return 2 * (len(operands) - 1) * _prod(sizes.values())


def _attention_cost(node, name, ins, acts, outs, gm, module):
    q, k, v = (_first(node, i, n, gm) for i, n in ((0, "query"), (1, "key"), (2, "value")))
    out = outs[0]
    if q is None or k is None or v is None or len(q.shape) < 2 or len(k.shape) < 2:
        return out.numel, 0, _bytes(acts)
    rows = _prod(q.shape[:-1])  # batch * heads * query length
    # a context-parallel ring's k is one rank's block; its queries read every rank's (seq_len keys)
    scores = rows * (node.kwargs.get("seq_len", k.shape[-2]) if name == "ring_attention" else k.shape[-2])
    mm = 2 * scores * q.shape[-1] + 2 * scores * v.shape[-1]
    flops = mm + _PER_ELEMENT_FLOPS["softmax"] * scores
    saved = _sum((q.nbytes, k.nbytes, v.nbytes, out.nbytes, 4 * rows))
    return flops, mm, saved


def _conv_cost(node, name, ins, acts, outs, gm, module):
    out = outs[0]
    if module is not None:
        w_shape = tuple(module.weight.shape)
        transposed = bool(module.transposed)
        has_bias = module.bias is not None
        x = ins[0] if ins else None
    else:
        x = _first(node, 0, "input", gm)
        w = _first(node, 1, "weight", gm)
        if w is None or x is None:
            return out.numel, 0, _bytes(acts)
        w_shape = w.shape
        transposed = "transpose" in name or (
            name in {"convolution", "_convolution"} and bool(_arg(node, 6, "transposed"))
        )
        has_bias = _arg(node, 2, "bias") is not None
    per_element = _prod(w_shape[1:])  # in_channels/groups * kernel (out_channels/groups if transposed)
    driver = x.numel if transposed and x is not None else out.numel
    mm = 2 * driver * per_element
    return _sum((mm, out.numel if has_bias else 0)), mm, _bytes(acts)


def _norm_cost(node, name, ins, acts, outs, gm, module):
    out = outs[0]
    x = ins[0] if ins else out
    base = 4 if "rms_norm" in name else 5
    if module is not None:
        affine = sum(p is not None for p in (getattr(module, "weight", None), getattr(module, "bias", None)))
        normalized = getattr(module, "normalized_shape", None)
    else:  # weight and bias are the parameter inputs (running statistics are buffers)
        affine = min(2, len(ins) - len(acts))
        normalized = _arg(node, 1, "normalized_shape") if name in {"layer_norm", "rms_norm"} else None
    flops = (base + affine) * x.numel
    saved: Number = x.nbytes
    if isinstance(normalized, (tuple, list, torch.Size)) and len(normalized) <= len(x.shape):
        rows = _prod(x.shape[: len(x.shape) - len(normalized)])
        stats = 1 if "rms_norm" in name else 2  # float32 mean and rstd (rms_norm: rstd) per row
        saved = _sum((saved, stats * 4 * rows))
    return flops, 0, saved


def _other_cost(node, name, ins, acts, outs, gm, module):
    out_numel = _sum(o.numel for o in outs)
    if name in REDUCTIONS:
        n = ins[0].numel if ins else out_numel
    elif name in COPIES or name in CREATION:
        return 0, 0, 0
    else:
        n = out_numel
    flops = _PER_ELEMENT_FLOPS.get(name, 1) * n
    if name in _SAVE_NOTHING:
        saved: Number = 0
    elif name in _SAVE_OUTPUT:
        saved = _sum(o.nbytes for o in outs)
    elif name == "dropout":
        saved = outs[0].numel if _keeps_mask(node, module) else 0  # one-byte mask
    else:
        saved = _bytes(acts)
    return flops, 0, saved


def _keeps_mask(node: torch.fx.Node, module: nn.Module | None) -> bool:
    """Whether a dropout keeps a mask for backward: not with ``p == 0`` or outside training, where
    torch returns its input itself (``at::dropout``), known from the module or the literal arguments."""
    if module is not None:
        return bool(getattr(module, "training", True)) and getattr(module, "p", 0.5) != 0
    p, train = _arg(node, 1, "p"), _arg(node, 2, "train" if "train" in node.kwargs else "training")
    return not (isinstance(p, (int, float)) and p == 0) and train is not False


_FORMULAS = {
    "matmul": _matmul_cost,
    "attention": _attention_cost,
    "conv": _conv_cost,
    "norm": _norm_cost,
    "other": _other_cost,
}


# ---------------------------------------------------------------------------------------------
# Copies that change nothing, embeddings, leaf modules


def _is_noop_copy(node: torch.fx.Node, name: str) -> bool:
    """``x.to(...)``/``x.float()``/``x.contiguous()`` that returns ``x`` itself (nothing changes)."""
    if name not in CASTS or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    src, out = _node_value(node.args[0]), _node_value(node)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    same_shape = [to_expr(d) for d in src.shape] == [to_expr(d) for d in out.shape]
    same = same_shape and src.dtype == out.dtype and src.device == out.device
    return same and (name != "contiguous" or src.is_contiguous())


def _embedding_indices(node, ins, module) -> TensorMeta | None:
    if module is not None or node.op == "call_method":
        return ins[0] if ins else None
    if node.op == "call_function" and isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        # aten.embedding(weight, indices)
        return ins[1] if len(ins) > 1 else None
    return ins[0] if ins else None  # F.embedding(input, weight)


def _hint(x: Any) -> int:
    if isinstance(x, torch.SymInt):
        hint = x.node.hint
        if hint is None:
            hint = x.node.shape_env.size_hint(x.node.expr)
        return int(hint)
    return int(x)


def _leaf_module_cost(node, module, ins, acts, outs, gm):
    """Count an unknown leaf module's FLOPs with FlopCounterMode on fake inputs (hinted shapes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    def concrete(arg: Any, mode: FakeTensorMode) -> Any:
        if isinstance(arg, torch.fx.Node):
            val = _node_value(arg)
            if isinstance(val, torch.Tensor):
                t = torch.empty([_hint(d) for d in val.shape], dtype=val.dtype)
                return mode.from_tensor(t)
            if isinstance(val, torch.SymInt):
                return _hint(val)
            return val
        if isinstance(arg, (tuple, list)):
            return type(arg)(concrete(a, mode) for a in arg)
        return arg

    out_numel = _sum(o.numel for o in outs)
    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            args = concrete(tuple(node.args), mode)
            kwargs = {k: concrete(v, mode) for k, v in node.kwargs.items()}
            with FlopCounterMode(display=False) as counter:
                module(*args, **kwargs)
        counted = counter.get_total_flops()
    except Exception:  # an estimate must never break costing: fall back to elementwise
        return out_numel, 0, _bytes(acts)
    # Scale the concrete count to the symbolic output size (FLOPs grow with the output).
    hinted_out = sum(math.prod(_hint(d) for d in o.shape) for o in _node_outs(node))
    mm: Number = counted
    if counted and hinted_out and _is_symbolic(out_numel):
        mm = out_numel * sympy.Rational(counted, hinted_out)
    return _sum((mm, out_numel)), mm, _bytes(acts)


def _node_outs(node) -> list[torch.Tensor]:
    val = _node_value(node)
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


# ---------------------------------------------------------------------------------------------
# One op


def op_cost(node: torch.fx.Node, gm: nn.Module | None) -> dict[str, Number]:
    """The ``NodeCost`` fields of ``node``'s operator, all but ``param_bytes`` (parameter
    ownership is ``fxsplit.graph.cost``'s); ``{}`` for a node that costs nothing (placeholder, output,
    get_attr, a non-tensor value, a view, a copy that returns its input). Never raises for an
    unknown op."""
    if node.op in ("placeholder", "output", "get_attr"):
        return {}
    outs = list(tensor_metas(_node_value(node)))
    if not outs:  # non-tensor value (shape arithmetic, asserts, None)
        return {}
    module = resolve_path(gm, str(node.target), default=None) if node.op == "call_module" else None
    name = op_name(node, gm)
    args = list(node.args) + list(node.kwargs.values())
    ins = _arg_metas(args, gm)
    if name in COST_FREE or _is_noop_copy(node, name):
        return {}
    extra_read: Number = 0
    kind = _kind(name)
    if module is not None:
        tensors = list(module.parameters()) + list(module.buffers())
        extra_read = sum(t.numel() * t.element_size() for t in tensors)
        if name.startswith("module:"):  # a module class the op vocabulary does not know
            kind = "leaf"
    if kind == "embedding":
        index_meta = _embedding_indices(node, ins, module)
        idx_bytes = index_meta.nbytes if index_meta is not None else 0
        read = _sum((idx_bytes, _sum(o.nbytes for o in outs)))
        written = _sum(o.nbytes for o in outs)
        return {"bytes_read": read, "bytes_written": written, "saved_bytes": idx_bytes}
    acts = _arg_metas(args, gm, params=False)
    if kind == "leaf":
        flops, mm, saved = _leaf_module_cost(node, module, ins, acts, outs, gm)
    else:
        flops, mm, saved = _FORMULAS[kind](node, name, ins, acts, outs, gm, module)
    read = _sum((_bytes(ins), extra_read))
    written = _sum(o.nbytes for o in outs)
    return {
        "flops": _clean(flops), "bytes_read": _clean(read), "bytes_written": _clean(written),
        "saved_bytes": _clean(saved), "matmul_flops": _clean(mm),
    }


# ---------------------------------------------------------------------------------------------
# Which operands an op's saved bytes are (fxsplit.graph.saved counts each storage once)


def _act_nodes(arg: Any, gm: nn.Module | None) -> list[torch.fx.Node]:
    """The tensor Nodes in ``arg`` that are not parameters (what ``_arg_metas(params=False)`` counts)."""
    if isinstance(arg, torch.fx.Node):
        return [arg] if _arg_metas(arg, gm, params=False) else []
    if isinstance(arg, (tuple, list)):
        return [n for a in arg for n in _act_nodes(a, gm)]
    if isinstance(arg, dict):
        return [n for a in arg.values() for n in _act_nodes(a, gm)]
    return []


def saved_operands(node: torch.fx.Node, gm: nn.Module | None) -> tuple[list[torch.fx.Node], bool]:
    """(the input Nodes whose values the op's ``saved_bytes`` counts, whether it counts its own
    output): the same per-kind rules as the formulas above. The rest of ``saved_bytes`` (norm
    statistics, a dropout mask, attention's log-sum-exp) is the op's own."""
    if node.op in ("placeholder", "output", "get_attr") or not list(tensor_metas(_node_value(node))):
        return [], False
    name = op_name(node, gm)
    if name in COST_FREE or _is_noop_copy(node, name):
        return [], False
    module = resolve_path(gm, str(node.target), default=None) if node.op == "call_module" else None
    args = list(node.args) + list(node.kwargs.values())
    kind = "leaf" if module is not None and name.startswith("module:") else _kind(name)
    if kind == "embedding":  # backward needs the indices only, never the table (nor a cast copy of it)
        aten = node.op == "call_function" and isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
        index = _arg(node, 1, "indices") if aten and module is None else _arg(node, 0, "input")
        return _act_nodes(index, gm)[:1], False
    if kind == "attention":
        qkv = [_arg(node, i, n) for i, n in ((0, "query"), (1, "key"), (2, "value"))]
        return [n for a in qkv for n in _act_nodes(a, gm)], True
    if kind == "norm":
        first = _act_nodes(_arg(node, 0, "input"), gm)
        return first[:1], False
    if kind == "other" and (name in _SAVE_NOTHING or name in CREATION or name == "dropout"):
        return [], False
    if kind == "other" and name in _SAVE_OUTPUT:
        return [], True
    return list(dict.fromkeys(_act_nodes(args, gm))), False
