"""The linears and embeddings of a traced graph, whatever their spelling (``fxsplit.tp.plan``'s
Terms: **linear**), found before anything is decided.

    find_linears(gm)["linear_3"]     # LinearInfo(node="linear_3", weight="h.0.attn.q.weight", ...)
    find_embeddings(gm)

A **grouped** linear (kind ``"grouped"``) is a mixture of experts' grouped matmul
``grouped_mm(x, W.transpose(-2, -1), offs)`` over a fused 3-D expert weight ``W [E, out, in]``
(transformers' ``grouped_mm`` experts; ``[E, in, out]`` read directly when the model stores it
transposed): every expert's linear at once, so it is column- or row-parallel as one linear is,
on the expert weight's out / in dim ([Note: experts as grouped linears]). A **batched** linear
(kind ``"batched"``) is the same expert weight gathered per row and multiplied batch by batch,
transformers' ``batched_mm`` experts: ``bmm(W[ids], x.unsqueeze(-1))`` (``W [E, out, in]``; its
output ``[S, out, 1]``) or ``bmm(x.unsqueeze(1), W[ids])`` (``W [E, in, out]``; ``[S, 1, out]``):
each row's own expert's linear, column / row-parallel as the grouped one is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from fxsplit.graph.ops import RESHAPES, op_name, resolve_path

__all__ = ["LinearInfo", "EmbeddingInfo", "find_linears", "find_embeddings", "aliases", "get_attr_fqn", "module_of"]

@dataclass(frozen=True)
class LinearInfo:
    """One linear of the graph. ``out_dim`` is the weight dim holding the output features
    (0 for nn.Linear's [out, in], 1 for Conv1D/addmm's [in, out]); ``x_index`` the argument
    position of the input; ``feature_dim`` the input dim contracted (always the last)."""

    node: str
    module_path: str
    weight: str
    bias: str | None
    out_dim: int
    in_features: int
    out_features: int
    x_index: int
    kind: str  # "module", "linear", "addmm", "mm", "matmul" (x @ W.T, no bias), "grouped" / "batched" (3-D experts)

    @property
    def in_dim(self) -> int:
        """The weight dim holding the input features (a row linear's sharded dim)."""
        return 3 - self.out_dim if self.kind in ("grouped", "batched") else 1 - self.out_dim

    @property
    def out_axis(self) -> int:
        """The dim of the node's output holding the output features: the last, but -2 for
        ``bmm(W[ids], x.unsqueeze(-1))`` ([S, out, 1])."""
        return -2 if self.kind == "batched" and self.out_dim == 1 else -1

    @property
    def x_axis(self) -> int:
        """The dim of the input (``args[x_index]``) holding the input features (as ``out_axis``)."""
        return -2 if self.kind == "batched" and self.out_dim == 1 else -1


@dataclass(frozen=True)
class EmbeddingInfo:
    node: str
    module_path: str
    weight: str
    num_embeddings: int
    padding_idx: int | None
    kind: str  # "module", "embedding"
    from_input: bool  # ids come from a model input (token ids), not a buffer or arange



def get_attr_fqn(node: Any) -> str | None:
    return str(node.target) if isinstance(node, torch.fx.Node) and node.op == "get_attr" else None


def module_of(fqn: str, node: torch.fx.Node | None = None) -> str:
    """The module a node came from (export's module stack), else the parameter's owner."""
    info = node.meta.get("fxsplit") if node is not None else None
    path = getattr(info, "module_path", "") or ""
    return path or fqn.rpartition(".")[0]


def find_linears(gm: torch.fx.GraphModule) -> dict[str, LinearInfo]:
    """Every linear of the graph by node name (see the module's Terms)."""
    out: dict[str, LinearInfo] = {}
    for node in gm.graph.nodes:
        name = op_name(node, gm)
        info = None
        if node.op == "call_module" and name == "linear":
            mod = gm.get_submodule(str(node.target))
            info = LinearInfo(node.name, str(node.target), f"{node.target}.weight",
                              f"{node.target}.bias" if mod.bias is not None else None, 0,
                              mod.in_features, mod.out_features, 0, "module")
        elif node.op == "call_function" and name == "linear":
            args = list(node.args) + [node.kwargs.get("weight"), node.kwargs.get("bias")][len(node.args) - 1:]
            w = get_attr_fqn(args[1] if len(args) > 1 else None)
            b = args[2] if len(args) > 2 else None
            if w is not None and (b is None or get_attr_fqn(b)):
                shape = tuple(resolve_path(gm, w).shape)
                if len(shape) == 2:
                    info = LinearInfo(node.name, module_of(w, node), w, get_attr_fqn(b), 0, shape[1], shape[0], 0, "linear")
        elif node.op == "call_function" and name in ("addmm", "mm") and not node.kwargs:
            off = 1 if name == "addmm" else 0
            w = get_attr_fqn(node.args[off + 1])
            b = get_attr_fqn(node.args[0]) if name == "addmm" else None
            if w is not None and (name == "mm" or b is not None):
                shape = tuple(resolve_path(gm, w).shape)
                if len(shape) == 2 and (b is None or tuple(resolve_path(gm, b).shape) == (shape[1],)):
                    info = LinearInfo(node.name, module_of(w, node), w, b, 1, shape[0], shape[1], off, name)
        elif node.op == "call_function" and name == "matmul" and len(node.args) == 2 and not node.kwargs:
            w = _transposed_param(node.args[1])
            if w is not None and isinstance(node.args[0], torch.fx.Node):
                shape = tuple(resolve_path(gm, w).shape)
                info = LinearInfo(node.name, module_of(w, node), w, None, 0, shape[1], shape[0], 0, "matmul")
        elif node.op == "call_function" and name in _GROUPED_MM and len(node.args) >= 2:
            info = _grouped(gm, node)
        elif node.op in ("call_function", "call_method") and name == "bmm" and len(node.args) == 2 and not node.kwargs:
            info = _batched(gm, node)
        if info is not None:
            out[node.name] = info
    return out


def _transposed_param(node: Any) -> str | None:
    """The FQN of a 2-D parameter read transposed (``W.T``, ``W.t()``, ``W.transpose(0, 1)``,
    ``W.permute(1, 0)``; export's ``numpy_T``), else None: ``x @ W.T`` is a linear (Falcon's
    ``FalconLinear``)."""
    if not isinstance(node, torch.fx.Node) or node.op not in ("call_function", "call_method") or not node.args:
        return None
    w = get_attr_fqn(node.args[0])
    val = getattr(node.args[0], "meta", {}).get("val")
    if w is None or not isinstance(val, torch.Tensor) or val.dim() != 2 or node.kwargs:
        return None
    name, rest = op_name(node), tuple(node.args[1:])
    ok = (name in ("numpy_T", "t") and not rest) or (name == "getattr" and rest in (("T",), ("mT",))) \
        or (name == "transpose" and sorted(d % 2 for d in rest) == [0, 1]) \
        or (name == "permute" and [d % 2 for d in (rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest)] == [1, 0])
    return w if ok else None


def _from_input(node: Any) -> bool:
    """Whether a value is a model input seen through casts and views (token ids), or through
    context parallelism's cut to a rank's tokens (``keep_local``: the same ids, fewer of them)."""
    seen = 0
    while isinstance(node, torch.fx.Node) and seen < 8:
        if node.op == "placeholder":
            return True
        if node.op in ("call_function", "call_method") and op_name(node) in (RESHAPES | {"to", "long", "int", "contiguous", "slice", "alias", "keep_local"}):
            node = node.args[0]
            seen += 1
            continue
        return False
    return False


def find_embeddings(gm: torch.fx.GraphModule) -> dict[str, EmbeddingInfo]:
    out: dict[str, EmbeddingInfo] = {}
    for node in gm.graph.nodes:
        name = op_name(node, gm)
        if name != "embedding":
            continue
        if node.op == "call_module":
            mod = gm.get_submodule(str(node.target))
            out[node.name] = EmbeddingInfo(node.name, str(node.target), f"{node.target}.weight",
                                           mod.num_embeddings, mod.padding_idx, "module",
                                           _from_input(node.args[0]))
        elif isinstance(node.target, torch._ops.OpOverload):
            w = get_attr_fqn(node.args[0])
            if w is None:
                continue
            pad = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
            out[node.name] = EmbeddingInfo(node.name, module_of(w, node), w, int(resolve_path(gm, w).shape[0]),
                                           None if pad in (None, -1) else int(pad), "embedding",
                                           _from_input(node.args[1]))
    return out


def aliases(gm: torch.fx.GraphModule) -> dict[str, tuple[str, ...]]:
    """FQN -> every FQN of the same parameter object (tied weights)."""
    by_id: dict[int, list[str]] = {}
    for n, p in gm.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    return {n: tuple(names) for names in by_id.values() for n in names}




_GROUPED_MM = ("grouped_mm", "_grouped_mm", "grouped_mm_fallback")


def _grouped(gm: torch.fx.GraphModule, node: torch.fx.Node) -> LinearInfo | None:
    """A grouped matmul ``grouped_mm(x [S, in], W.transpose(-2, -1) | W, offs)`` over a 3-D
    parameter ``W`` ([E, out, in] read transposed, or [E, in, out] read as it is), else None."""
    x, wt = node.args[0], node.args[1]
    if not isinstance(x, torch.fx.Node) or len(getattr(x.meta.get("val"), "shape", ())) != 2:
        return None
    out_dim, w = 2, get_attr_fqn(wt)
    if w is None and isinstance(wt, torch.fx.Node) and op_name(wt) == "transpose" and not wt.kwargs:
        if sorted(d % 3 for d in wt.args[1:]) == [1, 2]:
            out_dim, w = 1, get_attr_fqn(wt.args[0])
    if w is None:
        return None
    shape = tuple(resolve_path(gm, w).shape)
    if len(shape) != 3:
        return None
    return LinearInfo(node.name, module_of(w, node), w, None, out_dim, shape[3 - out_dim], shape[out_dim], 0,
                      "grouped")


# [Note: experts as grouped linears] A mixture of experts whose experts are one fused 3-D tensor
# (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) runs them as grouped matmuls: the rows
# of ``x`` sorted by expert, ``offs`` the group ends, each group times its expert's matrix. Each
# expert's FFN is then column / row-parallel exactly as a dense MLP is: sharding the out dim
# (``I``, gate and up as two blocks of the fused ``2I``) of every expert at once is sharding the
# grouped linear's output features, and the down projection's in dim its input features; the
# per-row routing weights and the combine (a sum over the top-k) act on the row linear's
# output after g, so one forward all-reduce per MoE layer, as a dense MLP. transformers'
# ``batched_mm`` experts gather each row's expert matrix instead (``W[expert_ids]``: ``[S, out,
# in]``) and multiply row by row with ``bmm``: the same linears, one per row, so the same shards
# (the gather keeps W's dims, the local W gives the local gathered matrices, and the backward of
# the gather sums each rank's rows into its own shard). Its eager per-expert loop (over
# ``nonzero()`` of the routing mask) does not trace (data-dependent control flow). The router (a plain
# linear to E scores and a softmax over them) stays replicated: its softmax reads the whole
# output (the plan says so), and every rank routes every token the same way.


def _gathered_param(gm: torch.fx.GraphModule, node: Any) -> str | None:
    """The FQN of a 3-D parameter indexed by one tensor of row ids on its first dim (``W[ids]``:
    export's ``aten.index(W, [ids])``, fx's ``getitem(W, ids)``), else None."""
    if not isinstance(node, torch.fx.Node) or node.kwargs or len(node.args) != 2:
        return None
    w, idx = get_attr_fqn(node.args[0]), node.args[1]
    name = op_name(node)
    if name == "index" and isinstance(idx, (list, tuple)) and len(idx) == 1:
        idx = idx[0]
    elif name != "getitem":
        return None
    if w is None or not isinstance(idx, torch.fx.Node) or len(resolve_path(gm, w).shape) != 3:
        return None
    ids = idx.meta.get("val")
    return w if isinstance(ids, torch.Tensor) and ids.dim() == 1 and not ids.is_floating_point() else None


def _unsqueezed(node: Any, dim: int) -> bool:
    """Whether ``node`` is a 2-D value unsqueezed at ``dim`` of its 3-D result."""
    if not isinstance(node, torch.fx.Node) or op_name(node) != "unsqueeze" or node.kwargs or len(node.args) != 2:
        return False
    x = node.args[0]
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 2 and isinstance(node.args[1], int) and node.args[1] % 3 == dim


def _batched(gm: torch.fx.GraphModule, node: torch.fx.Node) -> LinearInfo | None:
    """``bmm(W[ids], x.unsqueeze(-1))`` over ``W [E, out, in]``, or ``bmm(x.unsqueeze(1), W[ids])``
    over ``W [E, in, out]`` (transformers' ``batched_mm`` experts), else None."""
    a, b = node.args
    for w_node, x_node, x_index, x_dim, out_dim in ((a, b, 1, 2, 1), (b, a, 0, 1, 2)):
        w = _gathered_param(gm, w_node)
        if w is not None and len(w_node.users) == 1 and _unsqueezed(x_node, x_dim):  # the gather only feeds it
            shape = tuple(resolve_path(gm, w).shape)
            return LinearInfo(node.name, module_of(w, node), w, None, out_dim, shape[3 - out_dim], shape[out_dim],
                              x_index, "batched")
    return None
