"""The op vocabulary: one name per operator whatever graph spelled it, the op classes built on
those names, and dotted paths into a module.

Terms:
    op name      what a node computes, normalized by :func:`op_name`, so that the torch-level fx
                 spelling, the method, the module and the aten op of ``torch.export`` share it.
    op class     a frozenset of op names that share one property a pass relies on (``VIEWS``,
                 ``ELEMENTWISE``, ``REDUCTIONS``, ...). An op may be in several classes.
    dotted path  attribute names from a root module joined by dots (``"blocks.0.attn.q.weight"``,
                 a node's ``get_attr`` or ``call_module`` target); ``""`` is the root itself.

    op_name(node, gm=None) -> str                       # "linear", "add", "view", "module:MyBlock"
    resolve_path(gm, "blocks.0.attn.q.weight")          # the Parameter
    owner_and_leaf(gm, "blocks.0.attn.q.weight")        # (the Linear, "weight")

[Note: op names]
One name per operator, the same in fx and export graphs (``tests/test_ops.py`` pins them):

* ``call_function`` of an aten op: its overload packet (``aten.add.Tensor`` -> ``add``); of a
  Python callable: its ``__name__`` (``operator.add``, ``F.linear``, ``torch.cat``, ``getattr``).
* ``call_method``: the method (``x.view`` -> ``view``).
* ``call_module``: the name of the torch class in :data:`MODULE_NAMES` the module is an instance
  of (``nn.Linear`` -> ``linear``), provided it runs torch's own ``forward``; any other module,
  including a subclass that overrides ``forward``, is ``"module:" + its class name``, which no
  operator name can equal.
* placeholder, get_attr, output: the node's op (``"placeholder"``, ``"get_attr"``, ``"output"``).

Every name is then normalized: leading and trailing underscores go (``_softmax`` -> ``softmax``,
in-place ``add_`` -> ``add``), and :data:`_ALIASES` maps other spellings of one operator to one
name (``iadd``/``radd`` -> ``add``, ``truediv`` -> ``div``, ``native_layer_norm`` ->
``layer_norm``, ``_unsafe_view`` -> ``view``, ``_to_copy`` -> ``to``, ``nn.Identity`` and
``aten.alias`` -> ``alias``). What the op does with its arguments (an in-place update, a
reflected operand) is read from the node, not from the name.
"""

from __future__ import annotations

import difflib
from typing import Any

import torch
import torch.fx
from torch import nn

from fxsplit.errors import PathError

__all__ = [
    "is_random",
    "op_name",
    "is_elementwise",
    "MODULE_NAMES",
    "RESHAPES",
    "VIEWS",
    "METADATA",
    "COST_FREE",
    "COPIES",
    "CASTS",
    "CREATION",
    "ELEMENTWISE",
    "REDUCTIONS",
    "MATMULS",
    "NORMS",
    "PathError",
    "resolve_path",
    "owner_and_leaf",
    "SDPA_ARGS",
    "sdpa_arguments",
]


# ---------------------------------------------------------------------------------------------
# Op names

_ALIASES = {
    "iadd": "add", "radd": "add", "isub": "sub", "rsub": "sub", "imul": "mul", "rmul": "mul",
    "truediv": "div", "itruediv": "div", "rtruediv": "div", "true_divide": "div",
    "floordiv": "floor_divide", "ifloordiv": "floor_divide", "multiply": "mul", "subtract": "sub",
    "rmatmul": "matmul", "native_layer_norm": "layer_norm", "fused_rms_norm": "rms_norm",
    "safe_softmax": "softmax", "native_dropout": "dropout", "feature_dropout": "dropout",
    "linalg_vector_norm": "norm", "unsafe_view": "view", "to_copy": "to", "concat": "cat",
    "concatenate": "cat", "identity": "alias",
}

MODULE_NAMES: tuple[tuple[type[nn.Module], str], ...] = (
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
    (nn.Identity, "alias"), (nn.Flatten, "flatten"), (nn.Unflatten, "unflatten"),
    (nn.LeakyReLU, "leaky_relu"), (nn.ELU, "elu"), (nn.Mish, "mish"), (nn.Hardtanh, "hardtanh"),
    (nn.CrossEntropyLoss, "cross_entropy"), (nn.MSELoss, "mse_loss"),
    (nn.modules.pooling._MaxPoolNd, "max_pool"), (nn.modules.pooling._AvgPoolNd, "avg_pool"),
    (nn.modules.pooling._AdaptiveAvgPoolNd, "adaptive_avg_pool"),
) + (((nn.RMSNorm, "rms_norm"),) if hasattr(nn, "RMSNorm") else ())
"""torch module classes and the op name of their forward ([Note: op names]); first match wins."""


def _normalize(name: str) -> str:
    if name.startswith("aten::"):
        name = name[len("aten::"):]
    name = name.strip("_")
    return _ALIASES.get(name, name)


def _runs_torch_forward(module: nn.Module) -> bool:
    """Whether the module's ``forward`` is torch's own (a subclass that overrides it computes
    something else, so its base class does not name it)."""
    forward = getattr(type(module), "forward", None)
    return (getattr(forward, "__module__", None) or "").startswith("torch.")


def _module_name(module: Any) -> str:
    if module is None:
        return "module:?"
    for cls, name in MODULE_NAMES:
        if isinstance(module, cls) and _runs_torch_forward(module):
            return name
    return f"module:{type(module).__name__}"


def op_name(node: torch.fx.Node, gm: nn.Module | None = None) -> str:
    """The normalized operator name of ``node`` ([Note: op names]): ``"linear"`` for ``nn.Linear``,
    ``F.linear`` and ``aten.linear``; ``"add"`` for ``operator.add``/``operator.iadd``/``x.add_``/
    ``aten.add.Tensor``; ``"module:MyBlock"`` for a module fxsplit does not know.

    ``gm`` resolves a ``call_module`` target (default ``node.graph.owning_module``); a target that
    cannot be resolved is ``"module:?"``. Never raises.
    """
    target = node.target
    if node.op == "call_function":
        if isinstance(target, torch._ops.OpOverload):
            return _normalize(target.overloadpacket.__name__)
        if isinstance(target, torch._ops.OpOverloadPacket):
            return _normalize(target.__name__)
        return _normalize(getattr(target, "__name__", str(target)).rpartition(".")[2])
    if node.op == "call_method":
        return _normalize(str(target))
    if node.op == "call_module":
        root = gm if gm is not None else node.graph.owning_module
        return _module_name(resolve_path(root, str(target), default=None))
    return node.op


# ---------------------------------------------------------------------------------------------
# Op classes (op names, after normalization)

RESHAPES = frozenset({"view", "reshape", "unsqueeze", "squeeze", "flatten", "unflatten", "view_as"})
"""The output holds the input's elements in the same order, in another shape (tensor parallelism
matches their dims in groups of equal size, [Note: sharded-dim propagation])."""

VIEWS = RESHAPES | frozenset({
    "reshape_as", "transpose", "permute", "t", "movedim", "swapaxes", "swapdims", "expand",
    "expand_as", "select", "slice", "narrow", "diagonal", "as_strided", "split", "split_with_sizes",
    "tensor_split", "chunk", "unbind", "alias", "detach", "lift_fresh", "real", "imag",
    "view_as_real", "view_as_complex",
})
"""The output is a view of (or the same data as) the input: no element is computed or moved
(``reshape`` may copy; the cost model counts none of these)."""

METADATA = frozenset({"size", "sym_size", "dim", "numel", "stride", "requires_grad", "getattr"})
"""Reads a tensor's metadata (sizes, attributes such as ``x.shape`` or ``x.dtype``), not its data."""

COST_FREE = VIEWS | METADATA | frozenset({"getitem"})
"""What the cost model counts as free ([Note: cost conventions] in ``fxsplit.graph.cost``):
views, metadata reads and ``getitem`` (an element of a tuple, or a tensor index)."""

COPIES = frozenset({
    "clone", "contiguous", "to", "copy", "type", "type_as", "float", "half", "bfloat16", "double",
    "int", "long", "bool", "cat", "stack", "index_select", "gather", "pad", "constant_pad_nd",
    "repeat", "repeat_interleave", "tile", "index", "scatter", "roll", "flip", "masked_select",
    "index_put", "lift_fresh_copy", "cpu", "cuda", "hstack", "vstack", "take", "index_copy",
    "embedding_dense", "slice_scatter", "select_scatter", "upsample_nearest2d", "interpolate",
})
"""The output is (rearranged) input data: bytes move, nothing is computed."""

CASTS = frozenset({"to", "type", "type_as", "float", "half", "bfloat16", "double", "int", "long",
                   "bool", "contiguous", "cpu", "cuda"})
"""dtype, device and memory-layout conversions (``contiguous``): a copy, or the input itself
when nothing changes."""

CREATION = frozenset({
    "arange", "zeros", "ones", "full", "empty", "rand", "randn", "randint", "zeros_like",
    "ones_like", "full_like", "empty_like", "rand_like", "randn_like", "new_zeros", "new_ones",
    "new_full", "new_empty", "new_tensor", "scalar_tensor", "tensor", "linspace", "eye",
    "empty_strided", "tril_indices", "triu_indices", "randperm", "bernoulli",
})
"""A new tensor from sizes, a fill value or a random generator (input values are not read)."""

ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "neg", "pow", "gelu", "silu", "relu", "tanh", "sigmoid", "exp",
    "dropout", "float", "half", "bfloat16", "to", "type_as", "contiguous", "clone", "alias",
    "detach", "lift_fresh_copy", "masked_fill", "where", "rsqrt", "sqrt", "abs", "erf",
    "softplus", "leaky_relu", "elu",
})
"""Output element i depends only on element i of each (broadcast) input, and the output has the
broadcast shape: arithmetic, activations, dropout, casts. Beyond these names, an aten op with
``torch.Tag.pointwise`` is elementwise too (:func:`is_elementwise`)."""

REDUCTIONS = frozenset({
    "sum", "mean", "amax", "amin", "max", "min", "prod", "var", "std", "var_mean", "std_mean",
    "norm", "logsumexp", "argmax", "argmin", "all", "any", "cumsum", "cumprod", "count_nonzero",
    "cross_entropy", "nll_loss", "nll_loss_forward", "nll_loss2d_forward", "mse_loss", "l1_loss",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "smooth_l1_loss",
    "huber_loss", "max_pool", "avg_pool", "adaptive_avg_pool", "max_pool1d", "max_pool2d",
    "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d",
    "adaptive_avg_pool2d", "adaptive_avg_pool3d", "max_pool2d_with_indices", "topk", "sort",
})
"""Each output element combines many input elements along some dims (reductions, scans, losses,
pooling, top-k and sort)."""

MATMULS = frozenset({"linear", "matmul", "mm", "bmm", "dot", "vdot", "mv", "addmm", "baddbmm",
                     "addbmm", "addmv", "bilinear", "einsum"})
"""Products that contract a dim of one operand with a dim of another."""

NORMS = frozenset({"layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm"})
"""Normalizations; backend variants contain one of these names (``native_batch_norm``)."""


def is_elementwise(node: torch.fx.Node, name: str | None = None) -> bool:
    """Whether ``node`` is elementwise: its op name is in :data:`ELEMENTWISE`, or it is an aten
    op tagged ``torch.Tag.pointwise``. ``name`` is ``op_name(node)`` when the caller has it."""
    if (name if name is not None else op_name(node)) in ELEMENTWISE:
        return True
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


# ---------------------------------------------------------------------------------------------
# Dotted paths

_RAISE: Any = object()


# ------------------------------------------------------------------------------------------------
# which nodes draw random numbers (tp RNG streams; the stage builder's recompute check)

_RANDOM_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_F = torch.nn.functional
_RANDOM_FUNCTIONS = frozenset(
    f for f in (
        _F.dropout, _F.dropout1d, _F.dropout2d, _F.dropout3d, _F.alpha_dropout, _F.feature_alpha_dropout,
        getattr(torch, "dropout", None), getattr(torch, "bernoulli", None), getattr(torch, "rand_like", None),
        getattr(torch, "randn_like", None), getattr(torch, "rand", None), getattr(torch, "randn", None),
        getattr(torch, "normal", None), getattr(torch, "multinomial", None), getattr(torch, "randint", None),
        getattr(torch, "randint_like", None), getattr(torch, "randperm", None),
    ) if f is not None
)
_ATTENTION = frozenset({_F.scaled_dot_product_attention})


def _dropout_p(node: torch.fx.Node, position: int) -> Any:
    return node.kwargs.get("dropout_p", node.args[position] if len(node.args) > position else 0.0)


def is_random(node: torch.fx.Node, gm: torch.nn.Module | None = None) -> bool:
    """Whether ``node`` draws random numbers: a dropout-family ``call_module``, a random torch
    function (``F.dropout``, ``torch.bernoulli``, ...), ``F.scaled_dot_product_attention`` with
    ``dropout_p`` not 0, or an aten op tagged ``nondeterministic_seeded`` (``aten.dropout``,
    ``native_dropout``, ...; attention ops only with ``dropout_p`` not 0)."""
    if node.op == "call_module":
        gm = gm if gm is not None else node.graph.owning_module
        return isinstance(gm.get_submodule(str(node.target)), _RANDOM_MODULES)
    if node.op == "call_method":
        return str(node.target) in ("bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_")
    if node.op != "call_function":
        return False
    t = node.target
    if getattr(t, "draws_random", False):  # a random module run in a stream (tp.random.call_in_tp_stream)
        return True
    while hasattr(t, "__wrapped__"):  # a random function run in a stream (fxsplit.tp.random.in_tp_stream)
        t = t.__wrapped__
    if isinstance(t, torch._ops.OpOverload):
        if torch.Tag.nondeterministic_seeded not in t.tags:
            return False
        names = [a.name for a in t._schema.arguments]
        if "dropout_p" in names:
            return _dropout_p(node, names.index("dropout_p")) != 0
        return True
    if t in _ATTENTION:
        return _dropout_p(node, 3) != 0
    return t in _RANDOM_FUNCTIONS


def _missing(path: str, done: list[str], part: str, obj: Any) -> PathError:
    where = ".".join(done)
    owner = f"{where!r} ({type(obj).__name__})" if done else f"the root {type(obj).__name__}"
    names: list[str] = []
    if isinstance(obj, nn.Module):
        names = [n for n, _ in obj.named_children()] + list(obj._parameters) + list(obj._buffers)
    close = difflib.get_close_matches(part, names, n=3)
    hint = (f"; did you mean {close}?" if close else f"; it has {names[:8]}" if names else "")
    return PathError(f"path {path!r}: {owner} has no attribute {part!r}{hint}")


def resolve_path(root: Any, path: str, *, default: Any = _RAISE) -> Any:
    """The object at dotted ``path`` below ``root`` (``""`` is ``root``): a submodule, parameter,
    buffer or plain attribute, as ``getattr`` step by step finds it.

    A missing component raises :class:`PathError` (an ``AttributeError``) naming the path, the
    component and what its owner has, unless ``default`` is given, which is returned instead
    (also for ``root=None``).
    """
    if root is None:
        if default is not _RAISE:
            return default
        raise PathError(f"path {path!r}: there is no root module to resolve it in")
    obj = root
    done: list[str] = []
    for part in path.split(".") if path else ():
        try:
            obj = getattr(obj, part)
        except AttributeError:
            if default is not _RAISE:
                return default
            raise _missing(path, done, part, obj) from None
        done.append(part)
    return obj


def owner_and_leaf(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    """``(module, leaf)`` for a dotted path to a module's attribute: ``owner_and_leaf(gm,
    "blocks.0.attn.q.weight") -> (gm.blocks[0].attn.q, "weight")``. The owner must exist and be
    an ``nn.Module`` (else :class:`PathError`); the leaf need not exist yet (set it with
    ``setattr`` or the module's ``_parameters``)."""
    if not path:
        raise PathError("owner_and_leaf: the empty path names no attribute; give 'module.path.name'")
    prefix, _, leaf = path.rpartition(".")
    owner = resolve_path(root, prefix)
    if not isinstance(owner, nn.Module):
        raise PathError(f"path {path!r}: {prefix!r} is a {type(owner).__name__}, not a module")
    return owner, leaf


# ---------------------------------------------------------------------------------------------
# Attention calls

# ``F.scaled_dot_product_attention``'s parameters in order (as ``aten.scaled_dot_product_attention``)
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def sdpa_arguments(node: torch.fx.Node) -> dict[str, Any]:
    """The arguments an sdpa call ``node`` was given, by parameter name (positional and keyword)."""
    given = dict(zip(SDPA_ARGS, node.args))
    given.update(node.kwargs)
    return given
