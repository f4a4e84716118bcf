"""Per-op cost of the cost model: what one fx node's operator reads, writes, computes and saves.

This is the internal half of :mod:`fxsplit.graph.cost` (not a public module): ``fxsplit.graph.cost`` owns
``NodeCost``, parameter ownership and the graph sums, and imports what it needs from here; the
public names defined here (``Number``, ``to_expr``, ``op_name``, ``value_bytes``) are re-exported
there and should be imported from there.

Terms:
    Number          ``int | float | sympy.Expr`` (symbolic dims become sympy expressions).
    meta            ``_Meta(shape, dtype, is_param)``: one tensor value as the cost model sees it,
                    read from ``node.meta["val"]`` (or ``"tensor_meta"``).
    op name         the normalized operator name of a node (``op_name``): module class, function,
                    method and aten overload of one operator share it.
    kind            the formula an op name selects (``_kind``): matmul, attention, conv, embedding,
                    norm, other; a call_module of a class we do not know is a leaf module, counted
                    with ``FlopCounterMode``.
    formula         ``(node, name, ins, outs, gm, module) -> (flops, matmul_flops, saved_bytes)``;
                    bytes read and written are computed uniformly by ``op_cost``.

    op_cost(node, gm) -> dict[str, Number]   # NodeCost fields but param_bytes; {} when free

The conventions these tables and formulas implement are [Note: cost conventions] in
``fxsplit/cost.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Union

import sympy
import torch
import torch.fx
from torch import nn

Number = Union[int, float, sympy.Expr]


# ---------------------------------------------------------------------------------------------
# Numbers


def to_expr(x: Any) -> Number:
    """``int``/``SymInt``/``float``/``SymFloat``/sympy -> ``int``, ``float`` or ``sympy.Expr``.

    A symbolic value becomes its sympy expression (``x.node.expr``); a sympy value that is a
    plain number comes back as ``int`` (integers) or ``float``.
    """
    if isinstance(x, bool):
        return int(x)
    if isinstance(x, (int, float)):
        return x
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _simplify_number(x.node.expr)
    if isinstance(x, sympy.Basic):
        return _simplify_number(x)
    raise TypeError(
        f"to_expr: cannot turn {x!r} (type {type(x).__name__}) into a number; expected int, float, "
        "torch.SymInt/SymFloat or a sympy expression"
    )


def _simplify_number(e: sympy.Basic) -> Number:
    if e.is_Integer:
        return int(e)
    if e.is_Number:
        return float(e)
    return e


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
        total = _simplify_number(sympy.Add(total, *syms))
    return total


def _mul(a: Number, b: Number) -> Number:
    value = a * b
    return _simplify_number(value) if isinstance(value, sympy.Basic) else value


def _clean(x: Number) -> Number:
    return _simplify_number(sympy.expand(x)) if isinstance(x, sympy.Basic) else x


# ---------------------------------------------------------------------------------------------
# Tensor metadata


@dataclass(frozen=True)
class _Meta:
    """One tensor value as the cost model sees it."""

    shape: tuple[Number, ...]
    dtype: torch.dtype
    is_param: bool = False

    @property
    def numel(self) -> Number:
        return _prod(self.shape)

    @property
    def nbytes(self) -> Number:
        return _mul(self.numel, self.dtype.itemsize)


def _metas_of_value(val: Any, is_param: bool = False) -> list[_Meta]:
    from torch.fx.passes.shape_prop import TensorMetadata

    if isinstance(val, torch.Tensor):
        return [_Meta(tuple(to_expr(d) for d in val.shape), val.dtype, is_param)]
    if isinstance(val, TensorMetadata):
        return [_Meta(tuple(to_expr(d) for d in val.shape), val.dtype, is_param)]
    if isinstance(val, (tuple, list)):
        return [m for v in val for m in _metas_of_value(v, is_param)]
    if isinstance(val, dict):
        return [m for v in val.values() for m in _metas_of_value(v, is_param)]
    return []


def _resolve_attr(gm: nn.Module | None, target: str) -> Any:
    if gm is None:
        return None
    obj: Any = gm
    for part in target.split("."):
        if not hasattr(obj, part):
            return None
        obj = getattr(obj, part)
    return obj


def _node_value(node: torch.fx.Node) -> Any:
    if "val" in node.meta:
        return node.meta["val"]
    return node.meta.get("tensor_meta")


def _arg_metas(arg: Any, gm: nn.Module | None) -> list[_Meta]:
    """Tensor metas of one argument (a Node, a tensor, or a nested list/tuple/dict of them)."""
    if isinstance(arg, torch.fx.Node):
        is_param = False
        val = _node_value(arg)
        if arg.op == "get_attr":
            attr = _resolve_attr(gm, str(arg.target))
            is_param = isinstance(attr, nn.Parameter)
            if val is None and isinstance(attr, torch.Tensor):
                val = attr
        return _metas_of_value(val, is_param)
    if isinstance(arg, torch.Tensor):
        return _metas_of_value(arg)
    if isinstance(arg, (tuple, list)):
        return [m for a in arg for m in _arg_metas(a, gm)]
    if isinstance(arg, dict):
        return [m for a in arg.values() for m in _arg_metas(a, gm)]
    return []


def _arg(node: torch.fx.Node, index: int, name: str) -> Any:
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name)


def _first(node: torch.fx.Node, index: int, name: str, gm: nn.Module | None) -> _Meta | None:
    metas = _arg_metas(_arg(node, index, name), gm)
    return metas[0] if metas else None


def value_bytes(val: Any) -> Number:
    """Bytes of the tensors in a node value (``node.meta["val"]``: tensor, tuple/list/dict of them,
    or a non-tensor, which is 0); symbolic where the shapes are. Useful for boundary traffic."""
    return _sum(m.nbytes for m in _metas_of_value(val))


# ---------------------------------------------------------------------------------------------
# Op names


_ALIASES = {
    "iadd": "add", "radd": "add", "isub": "sub", "rsub": "sub", "imul": "mul", "rmul": "mul",
    "truediv": "div", "itruediv": "div", "rtruediv": "div", "floordiv": "div", "div_mode": "div",
    "true_divide": "div", "multiply": "mul", "subtract": "sub", "matmul": "matmul", "rmatmul": "matmul",
    "native_layer_norm": "layer_norm", "fused_rms_norm": "rms_norm", "safe_softmax": "softmax",
    "native_dropout": "dropout", "feature_dropout": "dropout", "linalg_vector_norm": "norm",
    "unsafe_view": "view", "to_copy": "to", "concat": "cat", "concatenate": "cat",
}

_MODULE_NAMES: tuple[tuple[type, str], ...] = (
    (nn.Linear, "linear"),
    (nn.Bilinear, "bilinear"),
    (nn.modules.conv._ConvNd, "convolution"),
    (nn.Embedding, "embedding"),
    (nn.LayerNorm, "layer_norm"),
    (nn.GroupNorm, "group_norm"),
    (nn.modules.batchnorm._NormBase, "batch_norm"),
    (nn.Dropout, "dropout"), (nn.Dropout1d, "dropout"), (nn.Dropout2d, "dropout"),
    (nn.Dropout3d, "dropout"), (nn.AlphaDropout, "dropout"),
    (nn.GELU, "gelu"), (nn.ReLU, "relu"), (nn.SiLU, "silu"), (nn.Sigmoid, "sigmoid"),
    (nn.Tanh, "tanh"), (nn.Softmax, "softmax"), (nn.LogSoftmax, "log_softmax"),
    (nn.Identity, "identity"), (nn.Flatten, "flatten"), (nn.Unflatten, "unflatten"),
    (nn.LeakyReLU, "leaky_relu"), (nn.ELU, "elu"), (nn.Mish, "mish"), (nn.Hardtanh, "hardtanh"),
    (nn.CrossEntropyLoss, "cross_entropy"), (nn.MSELoss, "mse_loss"),
    (nn.modules.pooling._MaxPoolNd, "max_pool"), (nn.modules.pooling._AvgPoolNd, "avg_pool"),
    (nn.modules.pooling._AdaptiveAvgPoolNd, "adaptive_avg_pool"),
)
if hasattr(nn, "RMSNorm"):
    _MODULE_NAMES += ((nn.RMSNorm, "rms_norm"),)


def _normalize(name: str) -> str:
    name = name.strip("_")
    if name.startswith("aten::"):
        name = name[len("aten::"):].strip("_")
    return _ALIASES.get(name, name)


def op_name(node: torch.fx.Node, gm: nn.Module | None = None) -> str:
    """A normalized operator name for ``node``: ``"linear"`` for ``nn.Linear``, ``F.linear`` and
    ``aten.linear``; ``"add"`` for ``operator.add``/``aten.add.Tensor``/``x.add_``; ``""`` for
    placeholder/get_attr/output; the module class name (lower case) for an unknown leaf module.
    """
    if node.op == "call_function":
        target = node.target
        if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return _normalize(target.__name__.split(".")[0])  # "linear.default" -> "linear"
        return _normalize(getattr(target, "__name__", str(target)))
    if node.op == "call_method":
        return _normalize(str(node.target))
    if node.op == "call_module":
        gm = gm if gm is not None else node.graph.owning_module
        module = _resolve_attr(gm, str(node.target))
        for cls, name in _MODULE_NAMES:
            if isinstance(module, cls):
                return name
        return type(module).__name__.lower()
    return ""


# ---------------------------------------------------------------------------------------------
# Op tables (see [Note: cost conventions] in fxsplit/cost.py)

_VIEWS = frozenset({
    "view", "reshape", "transpose", "permute", "expand", "expand_as", "unsqueeze", "squeeze", "t",
    "select", "slice", "narrow", "split", "split_with_sizes", "chunk", "unbind", "flatten",
    "unflatten", "as_strided", "alias", "detach", "getitem", "getattr", "view_as", "reshape_as",
    "movedim", "swapaxes", "swapdims", "tensor_split", "identity", "real", "imag", "diagonal",
    "view_as_real", "view_as_complex", "size", "dim", "numel", "stride", "requires_grad",
    "lift_fresh",
})
_COPIES = frozenset({
    "clone", "contiguous", "to", "copy", "type", "type_as", "float", "half", "bfloat16", "double",
    "int", "long", "bool", "cat", "stack", "index_select", "gather", "pad", "constant_pad_nd",
    "repeat", "repeat_interleave", "tile", "index", "scatter", "roll", "flip", "masked_select",
    "index_put", "lift_fresh_copy", "cpu", "cuda", "hstack", "vstack", "take", "index_copy",
    "embedding_dense", "slice_scatter", "select_scatter", "upsample_nearest2d", "interpolate",
})
_CREATION = frozenset({
    "arange", "zeros", "ones", "full", "empty", "rand", "randn", "randint", "zeros_like",
    "ones_like", "full_like", "empty_like", "rand_like", "randn_like", "new_zeros", "new_ones",
    "new_full", "new_empty", "new_tensor", "scalar_tensor", "tensor", "linspace", "eye",
    "empty_strided", "tril_indices", "triu_indices", "randperm", "bernoulli",
})
_REDUCTIONS = frozenset({
    "sum", "mean", "amax", "amin", "max", "min", "prod", "var", "std", "var_mean", "std_mean",
    "norm", "logsumexp", "argmax", "argmin", "all", "any", "cumsum", "cumprod", "count_nonzero",
    "cross_entropy", "nll_loss", "nll_loss_forward", "nll_loss2d_forward", "mse_loss", "l1_loss",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "smooth_l1_loss",
    "huber_loss", "max_pool", "avg_pool", "adaptive_avg_pool", "max_pool1d", "max_pool2d",
    "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d",
    "adaptive_avg_pool2d", "adaptive_avg_pool3d", "max_pool2d_with_indices", "topk", "sort",
})
_PER_ELEMENT_FLOPS = {
    "gelu": 8, "silu": 4, "sigmoid": 4, "tanh": 4, "mish": 6, "softplus": 4, "elu": 2, "erf": 4,
    "softmax": 5, "log_softmax": 5, "cross_entropy": 5, "logsumexp": 4, "var": 3, "std": 3,
    "var_mean": 3, "std_mean": 3, "norm": 2, "dropout": 1,
}
_SAVE_NOTHING = frozenset({
    "add", "sub", "neg", "sum", "mean", "cat", "stack", "masked_fill", "where", "eq", "ne", "lt",
    "le", "gt", "ge", "logical_not", "logical_and", "logical_or", "bitwise_and", "bitwise_or",
    "bitwise_not", "tril", "triu", "fill", "zero", "floor", "ceil", "round", "sign", "cumsum",
}) | _VIEWS | _COPIES | _CREATION
_SAVE_OUTPUT = frozenset({
    "relu", "sigmoid", "tanh", "exp", "softmax", "log_softmax", "sqrt", "rsqrt", "elu", "hardtanh",
    "relu6", "leaky_relu", "exp2", "reciprocal",
})
_MATMULS = frozenset({"linear", "matmul", "mm", "bmm", "dot", "vdot", "mv", "addmm", "baddbmm",
                      "addbmm", "addmv", "bilinear", "einsum"})
_NORM_WORDS = ("layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm")


def _kind(name: str) -> str:
    if name in _MATMULS:
        return "matmul"
    if "scaled_dot_product" in name or name in {"flash_attention", "efficient_attention"}:
        return "attention"
    if name.startswith("conv") or name in {"convolution", "cudnn_convolution", "mkldnn_convolution"}:
        return "conv"
    if name in {"embedding", "embedding_bag"}:
        return "embedding"
    if any(word in name for word in _NORM_WORDS):
        return "norm"
    return "other"


# ---------------------------------------------------------------------------------------------
# Per-kind formulas. Each returns (flops, matmul_flops, saved_bytes) given the node's input metas
# (``ins``) and output metas (``outs``); bytes read/written are computed uniformly.


def _activation_bytes(metas: Iterable[_Meta]) -> Number:
    return _sum(m.nbytes for m in metas if not m.is_param)


def _matmul_cost(node, name, ins, outs, gm, module):
    out = outs[0]
    if module is not None:  # nn.Linear / nn.Bilinear leaf
        if name == "linear":
            k: Number = module.in_features
        else:
            k = module.in1_features * module.in2_features
        mm = 2 * out.numel * k
        has_bias = getattr(module, "bias", None) is not None
        return mm + (out.numel if has_bias else 0), mm, _activation_bytes(ins)
    if name == "einsum":
        mm = _einsum_flops(node, gm)
        if mm is None:
            return out.numel, 0, _activation_bytes(ins)
        return mm, mm, _activation_bytes(ins)
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
        return out.numel, 0, _activation_bytes(ins)
    mm = 2 * out.numel * a.shape[-1]
    if name == "addbmm":
        mm = mm * a.shape[0]
    return _sum((mm, extra)), mm, _activation_bytes(ins)


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


def _attention_cost(node, name, ins, outs, gm, module):
    q, k, v = (_first(node, i, n, gm) for i, n in ((0, "query"), (1, "key"), (2, "value")))
    out = outs[0]
    if q is None or k is None or v is None or len(q.shape) < 2 or len(k.shape) < 2:
        return out.numel, 0, _activation_bytes(ins)
    rows = _prod(q.shape[:-1])  # batch * heads * query length
    scores = rows * k.shape[-2]
    mm = 2 * scores * q.shape[-1] + 2 * scores * v.shape[-1]
    flops = mm + _PER_ELEMENT_FLOPS["softmax"] * scores
    saved = _sum((q.nbytes, k.nbytes, v.nbytes, out.nbytes, 4 * rows))
    return flops, mm, saved


def _conv_cost(node, name, ins, outs, gm, module):
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
            return out.numel, 0, _activation_bytes(ins)
        w_shape = w.shape
        transposed = "transpose" in name or (
            name in {"convolution", "_convolution"} and bool(_arg(node, 6, "transposed"))
        )
        has_bias = _arg(node, 2, "bias") is not None
    per_element = _prod(w_shape[1:])  # in_channels/groups * kernel (out_channels/groups if transposed)
    driver = x.numel if transposed and x is not None else out.numel
    mm = 2 * driver * per_element
    return _sum((mm, out.numel if has_bias else 0)), mm, _activation_bytes(ins)


def _norm_cost(node, name, ins, outs, gm, module):
    out = outs[0]
    x = ins[0] if ins else out
    base = 4 if "rms_norm" in name else 5
    if module is not None:
        affine = sum(p is not None for p in (getattr(module, "weight", None), getattr(module, "bias", None)))
        normalized = getattr(module, "normalized_shape", None)
    else:  # weight and bias are the parameter inputs (running statistics are buffers)
        affine = min(2, sum(m.is_param for m in ins))
        normalized = _arg(node, 1, "normalized_shape") if name in {"layer_norm", "rms_norm"} else None
    flops = (base + affine) * x.numel
    saved: Number = x.nbytes
    if isinstance(normalized, (tuple, list, torch.Size)) and len(normalized) <= len(x.shape):
        rows = _prod(x.shape[: len(x.shape) - len(normalized)])
        stats = 1 if "rms_norm" in name else 2  # float32 mean and rstd (rms_norm: rstd) per row
        saved = _sum((saved, stats * 4 * rows))
    return flops, 0, saved


def _other_cost(node, name, ins, outs, gm, module):
    out_numel = _sum(o.numel for o in outs)
    if name in _REDUCTIONS:
        n = ins[0].numel if ins else out_numel
    elif name in _COPIES or name in _CREATION:
        return 0, 0, 0
    else:
        n = out_numel
    flops = _PER_ELEMENT_FLOPS.get(name, 1) * n
    if name in _SAVE_NOTHING:
        saved: Number = 0
    elif name in _SAVE_OUTPUT:
        saved = _sum(o.nbytes for o in outs)
    elif name == "dropout":
        saved = outs[0].numel  # one-byte mask
    else:
        saved = _activation_bytes(ins)
    return flops, 0, saved


_FORMULAS = {
    "matmul": _matmul_cost,
    "attention": _attention_cost,
    "conv": _conv_cost,
    "norm": _norm_cost,
    "other": _other_cost,
}


# ---------------------------------------------------------------------------------------------
# Copies that change nothing, embeddings, leaf modules


_NOOP_WHEN_UNCHANGED = frozenset({"to", "type", "type_as", "float", "half", "bfloat16", "double",
                                   "int", "long", "bool", "contiguous", "cpu", "cuda"})


def _is_noop_copy(node: torch.fx.Node, name: str) -> bool:
    """``x.to(...)``/``x.float()``/``x.contiguous()`` that returns ``x`` itself (nothing changes)."""
    if name not in _NOOP_WHEN_UNCHANGED or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    src, out = _node_value(node.args[0]), _node_value(node)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    same_shape = [to_expr(d) for d in src.shape] == [to_expr(d) for d in out.shape]
    same = same_shape and src.dtype == out.dtype and src.device == out.device
    return same and (name != "contiguous" or src.is_contiguous())


def _embedding_indices(node, ins, module) -> _Meta | None:
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


def _leaf_module_cost(node, module, ins, outs, gm):
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
        return out_numel, 0, _activation_bytes(ins)
    # Scale the concrete count to the symbolic output size (FLOPs grow with the output).
    hinted_out = sum(math.prod(_hint(d) for d in o.shape) for o in _node_outs(node))
    mm: Number = counted
    if counted and hinted_out and _is_symbolic(out_numel):
        mm = out_numel * sympy.Rational(counted, hinted_out)
    return _sum((mm, out_numel)), mm, _activation_bytes(ins)


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
    outs = _metas_of_value(_node_value(node))
    if not outs:  # non-tensor value (shape arithmetic, asserts, None)
        return {}
    module = _resolve_attr(gm, str(node.target)) if node.op == "call_module" else None
    name = op_name(node, gm)
    ins = _arg_metas(list(node.args) + list(node.kwargs.values()), gm)
    if name in _VIEWS or _is_noop_copy(node, name):
        return {}
    extra_read: Number = 0
    kind = _kind(name)
    if module is not None:
        tensors = list(module.parameters()) + list(module.buffers())
        extra_read = sum(t.numel() * t.element_size() for t in tensors)
        if kind == "other" and name == type(module).__name__.lower():  # a module class we do not know
            kind = "leaf"
    if kind == "embedding":
        index_meta = _embedding_indices(node, ins, module)
        idx_bytes = index_meta.nbytes if index_meta is not None else 0
        read = _sum((idx_bytes, _sum(o.nbytes for o in outs)))
        written = _sum(o.nbytes for o in outs)
        return {"bytes_read": read, "bytes_written": written, "saved_bytes": idx_bytes}
    if kind == "leaf":
        flops, mm, saved = _leaf_module_cost(node, module, ins, outs, gm)
    else:
        flops, mm, saved = _FORMULAS[kind](node, name, ins, outs, gm, module)
    read = _sum((_sum(m.nbytes for m in ins), extra_read))
    written = _sum(o.nbytes for o in outs)
    return {
        "flops": _clean(flops), "bytes_read": _clean(read), "bytes_written": _clean(written),
        "saved_bytes": _clean(saved), "matmul_flops": _clean(mm),
    }
