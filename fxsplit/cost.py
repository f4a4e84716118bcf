"""Cost model: FLOPs, bytes and memory of each fx node, from node metadata only.

Terms:
    node metadata   ``node.meta["val"]``: a FakeTensor (or tuple/list of them, or int/SymInt/None);
                    ``node.meta["tensor_meta"]`` (ShapeProp) is accepted when "val" is absent.
    Number          ``int | float | sympy.Expr``. Shapes that are symbolic (``torch.SymInt``)
                    become sympy expressions in the tracer's symbols (e.g. batch ``s0``, sequence
                    ``s1``), so one cost serves every batch size and sequence length;
                    ``NodeCost.evaluate(bindings)`` turns it into numbers.
    FLOPs           forward floating-point operations, a multiply-add counting 2.
    matmul-like     linear, matmul/mm/bmm/addmm/baddbmm/einsum, convolution and the two products
                    of attention. Their FLOPs are also kept in ``NodeCost.matmul_flops``.
    owner           the node that counts a parameter's bytes: a ``get_attr`` node whose value is an
                    ``nn.Parameter``, or a ``call_module`` node (its module's parameters). A
                    parameter reachable from several nodes (tied weights, a module called twice)
                    is owned by the FIRST such node in graph order only. Buffers are never owned.

    node_cost(node, gm=None) -> NodeCost
    graph_costs(gm) -> dict[str, NodeCost]   # every node, parameter ownership resolved in one pass
    graph_cost(gm) -> NodeCost               # their sum

[Note: cost conventions]
  * FLOPs of matmul-like ops are exact for the contraction (2 * output elements * contracted
    size); a bias adds 1 FLOP per output element. Attention counts the full (not causal-halved)
    ``q @ k^T`` and ``p @ v`` plus ``5`` FLOPs per score for the softmax, as the explicit graph does.
  * Other ops are estimated per element (``_PER_ELEMENT_FLOPS``, default 1 per output element;
    reductions and losses count their first input): layer_norm 5 (+1 per affine tensor),
    rms_norm 4 (+1), softmax 5, gelu 8, silu/sigmoid/tanh 4. Views, getitem and shape arithmetic
    cost nothing; copies (cat, clone, contiguous, dtype casts) move bytes but do no FLOPs, and
    a cast or ``contiguous`` that returns its input unchanged costs nothing;
    an embedding lookup does no FLOPs and reads only the gathered rows plus the indices.
  * ``bytes_read`` counts every tensor input, parameters and buffers included (a call_module node
    reads its module's parameters and buffers); ``bytes_written`` counts every tensor output.
  * ``saved_bytes`` estimates the activations autograd keeps for backward, by op kind: inputs
    that are not parameters (matmul-like, mul/div, gelu, norms, unknown ops), the output (softmax,
    relu, sigmoid, tanh, exp), a one-byte mask (dropout), nothing (add, views, copies, reductions
    such as sum). Attention keeps q, k, v, the output and a float32 log-sum-exp per query row
    (flash-style); layer_norm keeps its input and float32 mean and rstd per row.
  * Backward FLOPs: 2x forward for matmul-like work (gradients of both operands), 1x for the rest
    (``NodeCost.backward_flops``). Backward bytes: the output gradient and saved activations are
    read, an input gradient is written for every input (``NodeCost.backward_bytes``).
  * An op the model does not know is costed as elementwise from its output size and never raises;
    an unknown leaf module is run once under ``FlopCounterMode`` on fake inputs of the node's
    shapes (symbolic dims replaced by their hints), its count scaled to the symbolic output size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Union

import sympy
import torch
import torch.fx
from torch import nn

__all__ = [
    "Number",
    "NodeCost",
    "ZERO_COST",
    "to_expr",
    "op_name",
    "node_cost",
    "graph_costs",
    "graph_cost",
    "estimate_time",
    "value_bytes",
]

Number = Union[int, float, sympy.Expr]

_FIELDS = ("flops", "bytes_read", "bytes_written", "param_bytes", "saved_bytes", "matmul_flops")


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


# ---------------------------------------------------------------------------------------------
# NodeCost


@dataclass(frozen=True)
class NodeCost:
    """Cost of one node (or of a sum of nodes). Terms and conventions: module docstring.

    flops          forward FLOPs (multiply-add = 2).
    bytes_read     tensor bytes read in forward (inputs, parameters, buffers).
    bytes_written  tensor bytes written in forward (outputs).
    param_bytes    bytes of the parameters this node owns (counted once per parameter).
    saved_bytes    activation bytes kept for backward.
    matmul_flops   the part of ``flops`` that is matmul-like (backward costs 2x of it).
    """

    flops: Number = 0
    bytes_read: Number = 0
    bytes_written: Number = 0
    param_bytes: Number = 0
    saved_bytes: Number = 0
    matmul_flops: Number = 0

    def __post_init__(self) -> None:
        for name in _FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, sympy.Expr)):
                raise TypeError(
                    f"NodeCost.{name} must be an int, float or sympy expression, got {value!r} "
                    f"(type {type(value).__name__}); convert SymInts with fxsplit.cost.to_expr"
                )
            if not _is_symbolic(value) and value < 0:
                raise ValueError(f"NodeCost.{name} must be >= 0, got {value}")
        if not _is_symbolic(self.flops) and not _is_symbolic(self.matmul_flops):
            if self.matmul_flops > self.flops * (1 + 1e-9):
                raise ValueError(
                    f"NodeCost.matmul_flops ({self.matmul_flops}) exceeds flops ({self.flops}); "
                    "matmul_flops is the matmul-like part of flops"
                )

    @property
    def backward_flops(self) -> Number:
        """Estimated backward FLOPs: 2x the matmul-like part plus 1x the rest of ``flops``."""
        return self.flops + self.matmul_flops

    @property
    def backward_bytes(self) -> Number:
        """Estimated backward bytes: read grad-output and saved values, write input gradients."""
        return self.bytes_written + self.saved_bytes + self.bytes_read

    @property
    def is_symbolic(self) -> bool:
        return any(_is_symbolic(getattr(self, name)) for name in _FIELDS)

    @property
    def free_symbols(self) -> frozenset[sympy.Symbol]:
        out: set[sympy.Symbol] = set()
        for name in _FIELDS:
            value = getattr(self, name)
            if isinstance(value, sympy.Basic):
                out |= value.free_symbols
        return frozenset(out)

    def __add__(self, other: NodeCost) -> NodeCost:
        if not isinstance(other, NodeCost):
            return NotImplemented
        return NodeCost(**{n: _sum((getattr(self, n), getattr(other, n))) for n in _FIELDS})

    def __radd__(self, other: Any) -> NodeCost:
        if isinstance(other, int) and other == 0:  # sum(costs) starts from 0
            return self
        return NotImplemented

    def scale(self, factor: Number) -> NodeCost:
        """Every field multiplied by ``factor`` (e.g. a microbatch fraction)."""
        return NodeCost(**{n: _mul(getattr(self, n), factor) for n in _FIELDS})

    def evaluate(self, bindings: Mapping[sympy.Symbol | str, int | float]) -> NodeCost:
        """Substitute symbol values (keyed by symbol or symbol name) and return plain numbers.

        Raises ValueError naming the symbols that ``bindings`` leaves unbound.
        """
        by_name = {(k if isinstance(k, str) else k.name): v for k, v in bindings.items()}
        missing = sorted(s.name for s in self.free_symbols if s.name not in by_name)
        if missing:
            raise ValueError(
                f"NodeCost.evaluate: no value for symbol(s) {missing}; bound: {sorted(by_name)}. "
                "Pass every symbol of the cost, e.g. evaluate({'s0': batch, 's1': seq_len}); "
                "the symbols are the tracer's names for dynamic dims (see NodeCost.free_symbols)"
            )
        values = {}
        for name in _FIELDS:
            value = getattr(self, name)
            if isinstance(value, sympy.Basic):
                subs = {s: by_name[s.name] for s in value.free_symbols}
                value = _simplify_number(sympy.sympify(value.subs(subs)))
                if _is_symbolic(value):
                    raise ValueError(f"NodeCost.evaluate: {name} = {value} did not reduce to a number")
            values[name] = value
        return NodeCost(**values)

    def __str__(self) -> str:
        parts = ", ".join(f"{n}={_fmt(getattr(self, n))}" for n in _FIELDS)
        return f"NodeCost({parts})"


def _mul(a: Number, b: Number) -> Number:
    value = a * b
    return _simplify_number(value) if isinstance(value, sympy.Basic) else value


def _fmt(x: Number) -> str:
    if isinstance(x, int) and x >= 10_000:
        return f"{x:.3e}"
    return str(x)


ZERO_COST = NodeCost()


def estimate_time(
    cost: NodeCost, *, flops_per_s: float, bytes_per_s: float, backward: bool = True
) -> float:
    """Roofline seconds: ``max(flops / flops_per_s, bytes / bytes_per_s)`` for forward, plus the
    same for backward (``cost.backward_flops``, ``cost.backward_bytes``) when ``backward``.

    ``cost`` must be concrete: call ``cost.evaluate(bindings)`` first for a symbolic cost.
    """
    if flops_per_s <= 0 or bytes_per_s <= 0:
        raise ValueError(
            f"estimate_time: flops_per_s ({flops_per_s}) and bytes_per_s ({bytes_per_s}) must be > 0"
        )
    if cost.is_symbolic:
        raise ValueError(
            f"estimate_time: the cost is symbolic in {sorted(s.name for s in cost.free_symbols)}; "
            "call cost.evaluate({symbol: value, ...}) first"
        )
    t = max(cost.flops / flops_per_s, (cost.bytes_read + cost.bytes_written) / bytes_per_s)
    if backward:
        t += max(cost.backward_flops / flops_per_s, cost.backward_bytes / bytes_per_s)
    return float(t)


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
# Op tables (see [Note: cost conventions])

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
# Node cost


def _owned_params(node: torch.fx.Node, gm: nn.Module | None) -> list[nn.Parameter]:
    """Parameters this node references directly (get_attr of a Parameter, call_module's params)."""
    if node.op == "get_attr":
        attr = _resolve_attr(gm, str(node.target))
        return [attr] if isinstance(attr, nn.Parameter) else []
    if node.op == "call_module":
        module = _resolve_attr(gm, str(node.target))
        return list(module.parameters()) if isinstance(module, nn.Module) else []
    return []


def _param_bytes(params: Iterable[nn.Parameter], seen: set[int]) -> int:
    total = 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def _related(a: str, b: str) -> bool:
    """Targets that can reach the same parameter by name: equal, or one a submodule of the other."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _seen_before(node: torch.fx.Node, gm: nn.Module | None) -> set[int]:
    """Ids of ``node``'s parameters that an earlier node already owns.

    Only earlier nodes whose target is related by name are resolved, unless one of the node's
    parameters is reachable under several names (tied), so costing every node stays near-linear.
    """
    mine = _owned_params(node, gm)
    if not mine or gm is None:
        return set()
    ids = {id(p) for p in mine}
    counts: dict[int, int] = {}
    for _, p in gm.named_parameters(remove_duplicate=False):
        if id(p) in ids:
            counts[id(p)] = counts.get(id(p), 0) + 1
    tied = any(c > 1 for c in counts.values())
    target = str(node.target)
    seen: set[int] = set()
    for other in node.graph.nodes:
        if other is node:
            break
        if other.op in ("get_attr", "call_module") and (tied or _related(str(other.target), target)):
            seen.update(id(p) for p in _owned_params(other, gm) if id(p) in ids)
    return seen


def node_cost(node: torch.fx.Node, gm: torch.fx.GraphModule | None = None) -> NodeCost:
    """Cost of one node from its metadata (module docstring: conventions).

    ``gm`` is the graph's module (default ``node.graph.owning_module``); it resolves get_attr and
    call_module targets. Never raises for an unknown op. Costing every node of a graph is
    quicker with ``graph_costs(gm)``, which resolves parameter ownership in one pass.
    """
    gm = gm if gm is not None else node.graph.owning_module
    seen = _seen_before(node, gm) if node.op in ("get_attr", "call_module") else set()
    return _node_cost(node, gm, seen)


def _node_cost(node: torch.fx.Node, gm: nn.Module | None, seen: set[int]) -> NodeCost:
    if node.op in ("placeholder", "output"):
        return ZERO_COST
    param_bytes = _param_bytes(_owned_params(node, gm), seen)
    if node.op == "get_attr":
        return NodeCost(param_bytes=param_bytes)
    outs = _metas_of_value(_node_value(node))
    if not outs:  # non-tensor value (shape arithmetic, asserts, None)
        return NodeCost(param_bytes=param_bytes)
    module = _resolve_attr(gm, str(node.target)) if node.op == "call_module" else None
    name = op_name(node, gm)
    ins = _arg_metas(list(node.args) + list(node.kwargs.values()), gm)
    if name in _VIEWS or _is_noop_copy(node, name):
        return NodeCost(param_bytes=param_bytes)
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
        return NodeCost(0, read, written, param_bytes, idx_bytes, 0)
    if kind == "leaf":
        flops, mm, saved = _leaf_module_cost(node, module, ins, outs, gm)
    else:
        flops, mm, saved = _FORMULAS[kind](node, name, ins, outs, gm, module)
    read = _sum((_sum(m.nbytes for m in ins), extra_read))
    written = _sum(o.nbytes for o in outs)
    return NodeCost(
        flops=_clean(flops), bytes_read=_clean(read), bytes_written=_clean(written),
        param_bytes=param_bytes, saved_bytes=_clean(saved), matmul_flops=_clean(mm),
    )


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


def _clean(x: Number) -> Number:
    return _simplify_number(sympy.expand(x)) if isinstance(x, sympy.Basic) else x


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


def graph_costs(gm: torch.fx.GraphModule) -> dict[str, NodeCost]:
    """Node name -> ``NodeCost`` for every node, in graph order (parameters owned once)."""
    seen: set[int] = set()
    return {node.name: _node_cost(node, gm, seen) for node in gm.graph.nodes}


def graph_cost(gm: torch.fx.GraphModule) -> NodeCost:
    """Sum of ``graph_costs(gm)``; symbolic where the graph's shapes are."""
    costs = list(graph_costs(gm).values())
    return NodeCost(**{n: _clean(_sum(getattr(c, n) for c in costs)) for n in _FIELDS})


def value_bytes(val: Any) -> Number:
    """Bytes of the tensors in a node value (``node.meta["val"]``: tensor, tuple/list/dict of them,
    or a non-tensor, which is 0); symbolic where the shapes are. Useful for boundary traffic."""
    return _sum(m.nbytes for m in _metas_of_value(val))
