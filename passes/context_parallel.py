"""The context-parallel pass: rewrite a traced graph into one cp rank's graph, found from the graph.

Terms as in ``fxsplit.tp.context`` (C, S, chunk, local tokens, gathered / natural order);
**sequence input** -- an integer graph input of shape (B, S) (token ids); **sharded value** -- a
value that holds only this rank's tokens along one dim (its **sequence dim**, whose full size is
``outer * S * inner``: the sequence may be merged with the batch, as a flattened ``[B * S, V]``);
**full value** -- any other value: every rank computes it whole (positions, masks, rotary tables,
labels).

    PassManager([partial(context_parallel, cp=2)])(gm, ctx)   # the rewrite; ctx.report["context_parallel"]
    with bind_groups({"cp": cp_group}):
        loss, logits = gm(input_ids, labels)                   # every rank: the whole batch

[Note: context parallelism by propagation]
Every rank is handed the whole batch. The rewrite walks the graph once, in order, tracking which
values are sharded and along which dim (a rule per op, ``_RULES``):
- entry: an embedding of a sequence input reads ``keep_local(ids)``: this rank's tokens only,
  chunks r and 2C-1-r ([Note: load-balanced chunks] in ``fxsplit.tp.context``);
- per-token ops (pointwise, linear, norms over features, views, transposes) keep the sequence dim,
  shape arguments carrying it become the local size; where a FULL value meets a sharded one along
  the sequence (rotary cos / sin from ``arange(S)``, absolute position embeddings, a mask built
  in the graph, labels shifted in the graph), the full value is cut to this rank's tokens there
  (``keep_local``), so every position-dependent op sees the global positions of the local tokens
  and labels are shifted globally before they are cut (Hugging Face shifts inside its loss);
- attention: the local queries read every rank's keys and values, all-gathered along the
  sequence (``gather_to_region`` over ``"cp"``, put back in natural order; Llama 3's CP) or
  passed around the ring (``ring_attention``), chosen per call ([Note: all-gather or ring] in
  ``passes/cp_attention.py``); a mask given to sdpa keeps its rows of the local queries;
  ``is_causal=True`` becomes the causal rows at the local queries' global positions; eager
  ``softmax(Q K^T) V`` gathers K at the first matmul and V at the second;
- loss: ``cross_entropy(reduction="mean")`` becomes the cp-sum of the local sums over the cp-sum of
  the local counts of non-ignored targets: the mean over ALL tokens of all ranks;
- outputs: a sharded model output is all-gathered (natural order), so the model returns what the
  unsplit model returns (logits cost [B, S, V] per rank there).
An op with a sharded input and no rule, a reduction over the sequence, or a slice of it raises
PlanError naming the node: a rewrite that cannot be exact is not made. Parameter gradients are
this rank's tokens' share: summed over the cp ranks (the runtime and ``verify`` do).
Written only against fxsplit's public API.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx

from fxsplit.errors import PlanError
from fxsplit.graph.meta import annotate_graph, fake_like, keeping_symbols
from fxsplit.graph.ops import op_name
from fxsplit.graph.pass_api import PassContext, PassResult
from fxsplit.tp.collectives import all_reduce_sum, gather_from_region, gather_to_region, reduce_from_region
from fxsplit.tp.context import causal_rows, keep_local, natural_order
from fxsplit.tp.ring import ring_attention
from fxsplit.passes.cp_experts import EXPERT_RULES, LOCAL_OK, Local
from fxsplit.passes.cp_attention import KV_STRATEGIES, matmul_rule, ndim as _ndim, same as _same, sdpa_rule, val as _val

__all__ = ["CPPlan", "context_parallel"]

_AXIS = "cp"
_aten = torch.ops.aten


@dataclass(frozen=True)
class Seq:
    """A sharded value's sequence dim; its full size is outer * S * inner."""

    dim: int
    inner: int = 1


@dataclass
class CPPlan:
    """What the rewrite did: printable, recorded in ``ctx.report["context_parallel"]``."""

    cp: int
    seq_len: int
    sequence_inputs: tuple[str, ...]
    attention: list[str] = field(default_factory=list)  # "node: how"
    cut: list[str] = field(default_factory=list)  # full values cut to the local tokens
    losses: list[str] = field(default_factory=list)
    gathered_outputs: list[str] = field(default_factory=list)
    kv: str | None = None  # the request: "allgather", "ring", or None (auto, per attention)

    @property
    def method(self) -> str:
        ring = sum("ring attention" in a for a in self.attention)
        return (f"K/V by ring in {ring} and by all-gather in {len(self.attention) - ring} of {len(self.attention)} "
                f"attention ops (cp_kv={self.kv!r}), load-balanced head/tail chunks")

    def __str__(self) -> str:
        return (f"context parallel cp={self.cp}, S={self.seq_len} ({self.method}); sequence inputs "
                f"{list(self.sequence_inputs)}; attention: {len(self.attention)} ({'; '.join(self.attention[:2])}"
                f"{'; ...' if len(self.attention) > 2 else ''}); full values cut: {len(self.cut)}; losses: "
                f"{self.losses or 'none'}; outputs gathered: {self.gathered_outputs or 'none'}")


# ----------------------------------------------------------------------------------------- the pass


def context_parallel(gm: torch.fx.GraphModule, ctx: PassContext, *, cp: int, kv: str | None = None) -> PassResult:
    """Rewrite ``gm`` (a graph traced by torch.export with a static sequence) into the graph every
    cp rank runs ([Note: context parallelism by propagation]); ``kv``: "allgather", "ring" or None
    (auto per attention: [Note: all-gather or ring] in ``passes/cp_attention.py``). PlanError when
    the graph has no sequence input, the sequence does not divide by 2 * cp, or an op cannot be
    rewritten exactly."""
    if cp == 1:
        return PassResult(gm, False)
    if kv is not None and kv not in KV_STRATEGIES:
        raise PlanError(f"context_parallel: kv must be one of {KV_STRATEGIES} or None (auto), got {kv!r}")
    seq_len, inputs = _sequence(gm, cp)
    rw = _Rewrite(gm, cp, seq_len, CPPlan(cp=cp, seq_len=seq_len, sequence_inputs=tuple(n.name for n in inputs),
                                          kv=kv), inputs)
    rw.run()
    gm.graph.eliminate_dead_code()
    gm.recompile()
    _repropagate(gm, cp)
    annotate_graph(gm)
    ctx.report["context_parallel"] = rw.plan
    return PassResult(gm, True)


def _sequence(gm: torch.fx.GraphModule, cp: int) -> tuple[int, list[torch.fx.Node]]:
    """S and the sequence inputs: integer placeholders of shape (B, S) with a static S."""
    found = []
    for n in gm.graph.nodes:
        v = _val(n)
        if n.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() == 2 and not v.is_floating_point():
            found.append(n)
    lengths = {v.shape[1] for v in map(_val, found)}
    if not found or any(type(s) is not int for s in lengths):
        raise PlanError(
            "context parallelism (cp > 1) needs integer token inputs of shape (batch, sequence) traced with a "
            f"static sequence; found {[f'{n.name}{tuple(_val(n).shape)}' for n in found] or 'none'}. Plan with "
            "method='export' and dynamic_sequence=False (or None), and pass the token ids (not inputs_embeds)")
    if len(lengths) > 1:
        raise PlanError(f"context parallelism: the token inputs have different lengths {sorted(lengths)} "
                        f"({[n.name for n in found]}); cp cuts one sequence length")
    (seq_len,) = lengths
    if seq_len % (2 * cp):
        raise PlanError(
            f"context parallelism cp={cp} cuts the sequence in 2 * cp = {2 * cp} chunks (load balance for causal "
            f"attention), but the example's sequence has {seq_len} tokens; use a length divisible by {2 * cp} "
            f"(pad and mask), or cp={_divisor_hint(seq_len)}")
    return seq_len, found


def _divisor_hint(seq_len: int) -> str:
    good = [c for c in (2, 4, 8, 16) if seq_len % (2 * c) == 0]
    return " or ".join(map(str, good)) if good else "1"


# ---------------------------------------------------------------------------------------- rewriting


class _Rewrite:
    def __init__(self, gm: torch.fx.GraphModule, cp: int, seq_len: int, plan: CPPlan, inputs: list) -> None:
        self.gm, self.graph, self.cp, self.S, self.plan = gm, gm.graph, cp, seq_len, plan
        self.kv = plan.kv
        self.inputs = set(inputs)
        self.state: dict[torch.fx.Node, Any] = {}  # node -> Seq, or a tuple of Seq | None for tuples
        self.cuts: dict[tuple[torch.fx.Node, int, int], torch.fx.Node] = {}
        self.reduced: set[torch.fx.Node] = set()  # full values summed over the cp ranks (losses)
        self.row_numbers: set[torch.fx.Node] = set()  # this rank's row numbers ([Note: an MoE block under cp])

    # -- helpers
    def fail(self, node: torch.fx.Node, why: str) -> PlanError:
        info = node.meta.get("fxsplit")
        where = getattr(info, "module_path", "") or ""
        return PlanError(
            f"context parallelism cannot rewrite node {node.name!r} ({op_name(node)}{f', module {where!r}' if where else ''}) "
            f"exactly: {why}. The rewrite is not made (plan with cp=1, or keep this op off the sequence dim)")

    def new(self, target: Callable, args: tuple, kwargs: dict | None = None, *, like: torch.fx.Node) -> torch.fx.Node:
        n = self.graph.call_function(target, args, kwargs or {})
        for key in ("nn_module_stack", "stack_trace"):
            if key in like.meta:
                n.meta[key] = like.meta[key]
        return n

    def cut(self, value: torch.fx.Node, dim: int, inner: int, at: torch.fx.Node) -> torch.fx.Node:
        """``value`` (full) cut to the local tokens along ``dim`` (inserted right after it)."""
        key = (value, dim, inner)
        if key not in self.cuts:
            with self.graph.inserting_after(value):
                self.cuts[key] = self.new(keep_local, (value, dim, self.S, inner), {"axis": _AXIS}, like=at)
            self.plan.cut.append(f"{value.name} (dim {dim}) at {at.name}")
        return self.cuts[key]

    def natural(self, like: torch.fx.Node, x: torch.fx.Node) -> torch.fx.Node:
        return self.new(natural_order, (x, self.S), {"axis": _AXIS}, like=like)

    def gather(self, x: torch.fx.Node, dim: int, at: torch.fx.Node, backward_sum: bool = True) -> torch.fx.Node:
        """All of ``x``'s tokens (every rank's) along ``dim``, in natural order, before ``at``."""
        op = gather_to_region if backward_sum else gather_from_region
        with self.graph.inserting_before(at):
            g = self.new(op, (x,), {"dim": dim, "axis": _AXIS}, like=at)
            return self.new(_aten.index_select.default, (g, dim, self.natural(at, x)), like=at)

    def seq_of(self, a: Any) -> Seq | None:
        return self.state.get(a) if isinstance(a, torch.fx.Node) else None

    # -- the walk
    def run(self) -> None:
        for node in list(self.graph.nodes):
            if node.op == "output":
                self.output(node)
            elif node.op == "call_function":
                self.visit(node)

    def visit(self, node: torch.fx.Node) -> None:
        name = op_name(node)
        if name == "embedding" and self.token_ids(node.args[1]):
            ids = node.args[1]
            dim = _ndim(ids) - 1
            node.update_arg(1, self.cut(ids, dim, 1, node))
            self.state[node] = Seq(dim)
            return
        if node.target is operator.getitem and isinstance(self.state.get(node.args[0]), tuple):
            self.state[node] = self.state[node.args[0]][node.args[1]]
            return
        sharded = [a for a in node.all_input_nodes if isinstance(self.state.get(a), Seq)]
        if any(isinstance(self.state.get(a), Local) for a in node.all_input_nodes):
            if name not in LOCAL_OK:  # [Note: an MoE block under cp] in passes/cp_experts.py
                raise self.fail(node, "it reads a value counted over this rank's tokens only (an MoE block's "
                                      "rows per expert) other than as a grouped matmul's offsets")
            if not sharded:
                self.state[node] = Local()
                return
        if not sharded:
            return
        rule = _RULES.get(name)
        if rule is None:
            raise self.fail(node, f"no context-parallel rule for op {name!r} with an input sharded along the sequence")
        out = rule(self, node)
        if out is not None:
            self.state[node] = out

    def token_ids(self, ids: Any) -> bool:
        """Whether ``ids`` (full) are a sequence input, or a view of one, with the sequence last."""
        while isinstance(ids, torch.fx.Node) and ids not in self.state:
            if ids in self.inputs:
                return True
            if op_name(ids) not in ("view", "reshape", "_unsafe_view", "to", "contiguous", "alias") \
                    or not _same(_val(ids).shape[-1], self.S):
                return False
            ids = ids.args[0]
        return False

    def output(self, node: torch.fx.Node) -> None:
        def fix(a: Any) -> Any:
            s = self.seq_of(a)
            if isinstance(s, Local):
                raise self.fail(a, "a model output counted over this rank's tokens only")
            if s is None:
                v = _val(a)
                if isinstance(v, torch.Tensor) and v.requires_grad and a not in self.reduced:
                    raise self.fail(a, "this model output is computed whole on every rank from parameters, not "
                                       "from the sequence-sharded tokens (the rewrite found no embedding of the token "
                                       "ids to start from, or a value bypasses it), so its gradient would count "
                                       "once per cp rank")
                return a
            if s.inner != 1:
                raise self.fail(a, "a model output sharded with the sequence merged inside another dim")
            self.plan.gathered_outputs.append(a.name)
            return self.gather(a, s.dim, node, backward_sum=False)

        node.args = torch.fx.node.map_aggregate(node.args, fix)


# ------------------------------------------------------------------------------------------- rules


def _pointwise(rw: _Rewrite, node: torch.fx.Node) -> Seq:
    """Elementwise with broadcasting: every sharded operand on the same (aligned) dim; a full
    operand spanning that dim is cut to the local tokens."""
    out_v = _val(node)
    nd = out_v.dim()
    dims = {(rw.state[a].dim + nd - _ndim(a), rw.state[a].inner) for a in node.all_input_nodes
            if isinstance(rw.state.get(a), Seq)}
    if len(dims) != 1:
        raise rw.fail(node, f"operands sharded along different dims {sorted(dims)}")
    ((od, inner),) = dims

    def fix(a: Any) -> Any:
        if not isinstance(a, torch.fx.Node) or isinstance(rw.state.get(a), Seq):
            return a
        v = _val(a)
        if not isinstance(v, torch.Tensor):
            return a
        ad = od - (nd - v.dim())
        if ad < 0 or _same(v.shape[ad], 1):
            return a
        if not _same(v.shape[ad], out_v.shape[od]):
            raise rw.fail(node, f"operand {a.name} of shape {tuple(v.shape)} meets the sequence dim {od} of "
                                f"{tuple(out_v.shape)} with another size")
        return rw.cut(a, ad, inner, node)

    node.args = torch.fx.node.map_aggregate(node.args, fix)
    node.kwargs = torch.fx.node.map_aggregate(node.kwargs, fix)
    return Seq(od, inner)


def _first(rw: _Rewrite, node: torch.fx.Node) -> Seq:
    s = rw.seq_of(node.args[0])
    if s is None or any(isinstance(rw.state.get(a), Seq) for a in node.all_input_nodes if a is not node.args[0]):
        raise rw.fail(node, "only its first operand may be sharded along the sequence")
    return s


def _linear(rw: _Rewrite, node: torch.fx.Node) -> Seq:
    s = _first(rw, node)
    if s.dim == _ndim(node.args[0]) - 1:
        raise rw.fail(node, "a linear over the sequence dim")
    return s


def _over_last(count: Callable[[torch.fx.Node], int]) -> Callable:
    def rule(rw: _Rewrite, node: torch.fx.Node) -> Seq:
        s = _first(rw, node)
        if s.dim >= _ndim(node.args[0]) - count(node):
            raise rw.fail(node, "it normalizes over the sequence dim")
        return s
    return rule


def _reduce(rw: _Rewrite, node: torch.fx.Node) -> Seq:
    s = _first(rw, node)
    nd = _ndim(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None:
        raise rw.fail(node, "a reduction over every dim, the sequence included")
    dims = [d % nd for d in ([dims] if isinstance(dims, int) else dims)]
    keep = (node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    if s.dim in dims:
        raise rw.fail(node, "a reduction over the sequence dim (the sum would need every rank's tokens)")
    return Seq(s.dim - (0 if keep else sum(d < s.dim for d in dims)), s.inner)


def _softmax(rw: _Rewrite, node: torch.fx.Node) -> Seq:
    s = _first(rw, node)
    if node.args[1] % _ndim(node.args[0]) == s.dim:
        raise rw.fail(node, "a softmax over the sequence dim of the queries")
    return s


def _transpose(rw: _Rewrite, node: torch.fx.Node) -> Seq:
    s = _first(rw, node)
    nd = _ndim(node.args[0])
    a, b = node.args[1] % nd, node.args[2] % nd
    return Seq(b if s.dim == a else a if s.dim == b else s.dim, s.inner)


def _permute(rw: _Rewrite, node: torch.fx.Node) -> Seq:
    s = _first(rw, node)
    nd = _ndim(node.args[0])
    return Seq([d % nd for d in node.args[1]].index(s.dim), s.inner)


def _unsqueeze(rw: _Rewrite, node: torch.fx.Node) -> Seq:
    s = _first(rw, node)
    d = node.args[1] % _ndim(node)
    return Seq(s.dim + (d <= s.dim), s.inner)


def _squeeze(rw: _Rewrite, node: torch.fx.Node) -> Seq:
    s = _first(rw, node)
    nd = _ndim(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else None
    if dims is None:
        raise rw.fail(node, "squeeze without a dim")
    dims = [d % nd for d in ([dims] if isinstance(dims, int) else dims)]
    return Seq(s.dim - sum(d < s.dim for d in dims), s.inner)


def _local_size(rw: _Rewrite, size: Any, like: torch.fx.Node) -> Any:
    if isinstance(size, int):
        return size if size == -1 else size // rw.cp
    if isinstance(size, torch.fx.Node):
        with rw.graph.inserting_before(like):
            return rw.new(operator.floordiv, (size, rw.cp), like=like)
    raise rw.fail(like, f"a size argument {size!r} it cannot scale")


def _view(rw: _Rewrite, node: torch.fx.Node) -> Seq:
    """A view or reshape: the sequence factor found by the product of the dims after it."""
    s = _first(rw, node)
    src, out = _val(node.args[0]).shape, _val(node).shape
    after = s.inner
    for d in src[s.dim + 1:]:
        after = after * d
    tail = 1
    for od in range(len(out) - 1, -1, -1):
        if type(tail) is not int or type(after) is not int:
            break
        if after % tail == 0 and (after // tail) * rw.S <= _as_int(out[od]) and _as_int(out[od]) % (rw.S * (after // tail)) == 0:
            inner = after // tail
            shape = list(node.args[1])
            shape[od] = _local_size(rw, shape[od], node)
            node.update_arg(1, shape)
            return Seq(od, inner)
        tail = tail * _as_int(out[od])
    raise rw.fail(node, f"a view from {tuple(src)} to {tuple(out)} that does not keep the sequence as one factor")


def _as_int(x: Any) -> int:
    try:
        return int(x)
    except (TypeError, ValueError):  # a symbolic size (the batch): never the sequence's own factor
        return -1


def _expand(rw: _Rewrite, node: torch.fx.Node) -> Seq:
    s = _first(rw, node)
    sizes = list(node.args[1])
    od = s.dim + len(sizes) - _ndim(node.args[0])
    sizes[od] = _local_size(rw, sizes[od], node) if sizes[od] != -1 else -1
    node.update_arg(1, sizes)
    return Seq(od, s.inner)


def _slice(rw: _Rewrite, node: torch.fx.Node) -> Seq:
    s = _first(rw, node)
    nd = _ndim(node.args[0])
    dim = (node.args[1] if len(node.args) > 1 else 0) % nd
    if dim == s.dim:
        start = node.args[2] if len(node.args) > 2 else None
        end = node.args[3] if len(node.args) > 3 else None
        step = node.args[4] if len(node.args) > 4 else 1
        full = _val(node.args[0]).shape[dim]
        if start not in (None, 0) or step != 1 or not (end is None or (type(end) is int and end >= full)):
            raise rw.fail(node, "a slice of the sequence dim (its positions are spread over the cp ranks)")
    return s


def _select(rw: _Rewrite, node: torch.fx.Node) -> Seq:
    s = _first(rw, node)
    dim = node.args[1] % _ndim(node.args[0])
    if dim == s.dim:
        raise rw.fail(node, "an index into the sequence dim")
    return Seq(s.dim - (dim < s.dim), s.inner)


def _split(rw: _Rewrite, node: torch.fx.Node) -> tuple:
    s = _first(rw, node)
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % _ndim(node.args[0])
    if dim == s.dim:
        raise rw.fail(node, "a split along the sequence dim")
    return tuple(s for _ in _val(node))


def _dim_arg_not_seq(index: int) -> Callable:
    def rule(rw: _Rewrite, node: torch.fx.Node) -> Seq:
        s = _first(rw, node)
        dim = node.args[index] if len(node.args) > index else node.kwargs.get("dim")
        if dim is None or dim % _ndim(node.args[0]) == s.dim:
            raise rw.fail(node, "it works along the sequence dim")
        return s
    return rule


def _cat(rw: _Rewrite, node: torch.fx.Node) -> Seq:
    parts = node.args[0]
    nd = _ndim(node)
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % nd
    seqs = {rw.state[p] for p in parts if isinstance(rw.state.get(p), Seq)}
    if len(seqs) != 1:
        raise rw.fail(node, f"parts sharded along different dims {seqs}")
    (s,) = seqs
    if dim == s.dim:
        raise rw.fail(node, "a concatenation along the sequence dim")
    node.update_arg(0, [p if isinstance(rw.state.get(p), Seq) else rw.cut(p, s.dim, s.inner, node) for p in parts])
    return s


def _addmm(rw: _Rewrite, node: torch.fx.Node) -> Seq:
    """``bias + x @ W`` (GPT-2's Conv1D): x sharded along its rows, bias and W full."""
    x = node.args[1]
    s = rw.seq_of(x)
    if s is None or s.dim != 0 or any(rw.seq_of(a) for a in (node.args[0], node.args[2])) \
            or _ndim(node.args[0]) > 1:
        raise rw.fail(node, "an addmm whose sharded operand is not the rows of its input")
    return s


def _mm(rw: _Rewrite, node: torch.fx.Node) -> Seq:
    s = rw.seq_of(node.args[0])
    if s is None or s.dim != 0 or rw.seq_of(node.args[1]) is not None:
        raise rw.fail(node, "an mm whose sharded operand is not the rows of its left input")
    return s


_CE = ("self", "target", "weight", "reduction", "ignore_index", "label_smoothing")


def _cross_entropy(rw: _Rewrite, node: torch.fx.Node) -> Any:
    """The mean over every rank's tokens: cp-sum of local sums / cp-sum of local counts."""
    args = dict(zip(_CE, node.args))
    args.update(node.kwargs)
    x, t = args["self"], args["target"]
    s = rw.seq_of(x)
    if s is None or s.dim != 0 or _ndim(x) != 2:
        raise rw.fail(node, "a cross-entropy whose logits are not [tokens, classes] sharded along the tokens")
    st = rw.seq_of(t)
    if st is None:
        t = rw.cut(t, 0, s.inner, node)
    elif st != s:
        raise rw.fail(node, "logits and targets sharded differently")
    if args.get("weight") is not None:
        raise rw.fail(node, "class weights (the mean would divide by the cp-sum of the weights)")
    reduction = args.get("reduction", 1)
    ignore = args.get("ignore_index", -100)
    smoothing = args.get("label_smoothing", 0.0)
    if reduction == 0:  # "none": per token, sharded like the logits
        node.update_arg(1, t)
        return Seq(0, s.inner)
    with rw.graph.inserting_after(node):
        local = rw.new(_aten.cross_entropy_loss.default, (x, t, None, 2, ignore, smoothing), like=node)
    with rw.graph.inserting_after(local):
        total = rw.new(reduce_from_region, (local,), {"axis": _AXIS}, like=node)
    last = total
    if reduction == 1:
        with rw.graph.inserting_after(total):
            valid = rw.new(_aten.ne.Scalar, (t, ignore), like=node)
        with rw.graph.inserting_after(valid):
            count = rw.new(_aten.sum.default, (valid,), like=node)
        with rw.graph.inserting_after(count):
            counts = rw.new(all_reduce_sum, (count,), {"axis": _AXIS}, like=node)
        with rw.graph.inserting_after(counts):
            last = rw.new(_aten.div.Tensor, (total, counts), like=node)
    node.replace_all_uses_with(last)
    rw.graph.erase_node(node)
    rw.reduced.add(last)
    rw.plan.losses.append(f"{node.name}: {'mean over every rank' if reduction == 1 else 'sum over every rank'}'s tokens")
    return None


_POINTWISE = {
    "add", "sub", "rsub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid", "silu", "gelu",
    "relu", "dropout", "to", "_to_copy", "type_as", "contiguous", "clone", "masked_fill", "where", "eq", "ne", "lt",
    "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "bitwise_not", "and", "or", "__and__", "__or__",
    "cos", "sin", "alias", "detach", "abs", "clamp", "float", "mul_", "add_", "tril", "triu", "lift_fresh_copy",
    "erf", "softplus", "square", "reciprocal", "maximum", "minimum", "empty_like",
}
_RULES: dict[str, Callable[[_Rewrite, torch.fx.Node], Any]] = {
    **{name: _pointwise for name in _POINTWISE},
    "linear": _linear,
    "layer_norm": _over_last(lambda n: len(n.args[1])),
    "rms_norm": _over_last(lambda n: len(n.args[1])),
    "mean": _reduce, "sum": _reduce, "amax": _reduce, "var": _reduce,
    "softmax": _softmax, "_softmax": _softmax, "log_softmax": _softmax, "_log_softmax": _softmax,
    "view": _view, "reshape": _view, "_unsafe_view": _view,
    "expand": _expand,
    "transpose": _transpose, "permute": _permute, "unsqueeze": _unsqueeze, "squeeze": _squeeze,
    "slice": _slice, "select": _select,
    "split": _split, "split_with_sizes": _split, "chunk": _split, "unbind": _split,
    "repeat_interleave": _dim_arg_not_seq(2),
    "cat": _cat,
    "matmul": matmul_rule, "bmm": matmul_rule, "addmm": _addmm, "mm": _mm,
    "scaled_dot_product_attention": sdpa_rule,
    "cross_entropy_loss": _cross_entropy,
    **EXPERT_RULES,  # [Note: an MoE block under cp]
}


# ------------------------------------------------------------------------------- shapes, afterwards


def _repropagate(gm: torch.fx.GraphModule, cp: int) -> None:
    """Every node's ``meta["val"]`` again, in the trace's fake mode, with the local shapes (the
    context-parallel ops' shapes by their definition: the cp group is not bound while planning)."""
    mode = next((v.fake_mode for n in gm.graph.nodes if (v := _val(n)) is not None
                 and getattr(v, "fake_mode", None) is not None), None)
    if mode is None:
        raise PlanError("context parallelism needs the trace's fake tensors (meta['val']); trace with fxsplit.trace")
    env: dict[torch.fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            env[node] = _val(node)
            continue
        if node.op == "output":
            continue
        args = torch.fx.node.map_arg(node.args, env.__getitem__)
        kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
        node.meta["val"] = env[node] = _fake_run(node, args, kwargs, mode, cp)


def _fake_run(node: torch.fx.Node, args: tuple, kwargs: dict, mode: Any, cp: int) -> Any:
    t = node.target
    if t is keep_local:
        x, dim, seq_len = args[0], args[1] % args[0].dim(), args[2]
        shape = list(x.shape)
        shape[dim] = shape[dim] // cp
        return fake_like(x, shape)
    if t is natural_order:
        return fake_like(args[0], (args[1],), torch.int64)
    if t is causal_rows:
        return fake_like(args[0], (args[1] // cp, args[1]), torch.bool)
    if t in (gather_to_region, gather_from_region):
        x = args[0]
        dim = kwargs["dim"] % x.dim()
        shape = list(x.shape)
        shape[dim] = shape[dim] * cp
        return fake_like(x, shape)
    if t is ring_attention:
        q, v = args[0], args[2]
        return fake_like(q, (*q.shape[:-1], v.shape[-1]))
    if t in (reduce_from_region, all_reduce_sum):
        return fake_like(args[0], tuple(args[0].shape))
    if node.op == "call_function" and t is operator.floordiv:
        return args[0] // args[1]
    with mode, keeping_symbols():  # [Note: symbolic matmul on torch 2.11] in fxsplit.graph.symbolic
        return t(*args, **kwargs)
