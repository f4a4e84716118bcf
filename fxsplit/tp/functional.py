"""Vocabulary-parallel ops: embedding, cross-entropy and logits gather over the tp axis.

Terms: **V** -- the real vocabulary size (`vocab_size`); **t** -- the size of the group `axis`
is bound to; **L** -- the local vocabulary rows/columns per rank (the shard's size), so rank r
holds the padded vocabulary range [r * L, (r + 1) * L) and L * t >= V (see
fxsplit.tp.sharding's [Note: vocabulary padding]); **unbound** -- `axis` not bound, bound to None
or to a group of size 1 (fxsplit.tp.collectives' [Note: axis binding]): every op is then the
plain one-process op on the whole (possibly padded) tensor.

    h = vocab_parallel_embedding(ids, wte_shard, V)            # (B, T, C), full on every rank
    logits = lm_head_shard(h)                                  # (B, T, L): column-parallel
    loss = vocab_parallel_cross_entropy(logits, targets, V)    # no full logits gathered
    full = gather_logits(logits, V)                            # (B, T, V) when the user needs them

    ys = column_parallel_linear(h, [wq, wk, wv], [bq, bk, bv])  # f + q/k/v shards, one node

Each op is one `call_function` node under `torch.fx.symbolic_trace` (registered with
`torch.fx.wrap`, and also when called on an fx Proxy), taking the axis name as a plain argument.
Gradients are exact: value and gradient equal the one-process op on the full tensors, up to the
summation order of the all-reduces (float32 last bits).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx
import torch.nn.functional as F
from torch.distributed._functional_collectives import _are_we_tracing

from fxsplit.errors import ArgumentTypeError, ShardingError, UsageError
from fxsplit.tp.collectives import (
    _active, current_group, gather_from_region, note_collective, reduce_from_region, start_all_reduce,
    wait_collective)

__all__ = ["column_parallel_linear", "gather_logits", "vocab_parallel_cross_entropy", "vocab_parallel_embedding"]


def _group(axis: str) -> dist.ProcessGroup | None:
    if not isinstance(axis, str):
        raise ArgumentTypeError(f"fxsplit.tp.functional: axis must be a mesh axis name (str), got {axis!r}")
    group = current_group(axis)
    return None if group is None or group.size() == 1 else group


def _traced(name: str, args: tuple, kwargs: dict) -> torch.fx.Proxy | None:
    """Record one call_function node when any argument is an fx Proxy. The target is the
    original function (looked up in _ORIGINALS: while symbolic_trace runs, this module's
    global names are patched by torch.fx.wrap)."""
    flat = [b for a in (*args, *kwargs.values()) for b in (a if isinstance(a, (list, tuple)) else (a,))]
    for a in flat:
        if isinstance(a, torch.fx.Proxy):
            return a.tracer.create_proxy("call_function", _ORIGINALS[name], args, kwargs)
    return None


def _check_vocab(op: str, local: int, t: int, vocab_size: int, what: str) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ShardingError(f"{op}: vocab_size must be a positive int, got {vocab_size!r}")
    if local * t < vocab_size:
        raise ShardingError(
            f"{op}: {what} has {local} vocabulary entries per rank x t={t} ranks = {local * t}, "
            f"fewer than vocab_size={vocab_size}; shard the table with "
            f"ShardSpec(dim=0, num_shards={t}, pad_to=padded_size({vocab_size}, {t}))"
        )


# ----------------------------------------------------------------------------- embedding


def vocab_parallel_embedding(
    ids: torch.Tensor,
    weight_shard: torch.Tensor,
    vocab_size: int,
    axis: str = "tp",
    padding_idx: int | None = None,
) -> torch.Tensor:
    """Embedding lookup with the table's rows sharded over `axis`.

    ids: integer tensor (...); weight_shard: (L, C), this rank's rows [r * L, (r + 1) * L).
    Ids outside this rank's range are looked up as local row 0 and their output zeroed, then
    the partial outputs are summed over `axis` (reduce_from_region). Returns (..., C) on every
    rank. padding_idx is a GLOBAL id whose row gets no gradient (as in F.embedding). Unbound:
    plain F.embedding on `weight_shard`.
    """
    kwargs = {"axis": axis, "padding_idx": padding_idx}
    node = _traced("vocab_parallel_embedding", (ids, weight_shard, vocab_size), kwargs)
    if node is not None:
        return node
    group = _group(axis)
    t = 1 if group is None else group.size()
    local = weight_shard.shape[0]
    _check_vocab("vocab_parallel_embedding", local, t, vocab_size, "weight_shard")
    if padding_idx is not None:
        if not -vocab_size <= padding_idx < vocab_size:
            raise UsageError(
                f"vocab_parallel_embedding: padding_idx={padding_idx} is outside the vocabulary "
                f"[-{vocab_size}, {vocab_size})"
            )
        padding_idx %= vocab_size  # negative ids count from V, not from the padded size
    if group is None:
        return F.embedding(ids, weight_shard, padding_idx=padding_idx)
    start = group.rank() * local
    outside = (ids < start) | (ids >= start + local)
    local_ids = (ids - start).masked_fill(outside, 0)
    local_pad = None
    if padding_idx is not None and start <= padding_idx < start + local:
        local_pad = padding_idx - start
    out = F.embedding(local_ids, weight_shard, padding_idx=local_pad)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from_region(out, axis)


# ----------------------------------------------------------------------------- cross-entropy


class _VocabParallelCE(torch.autograd.Function):
    """Per-position loss (...,) from logits (..., L); see vocab_parallel_cross_entropy."""

    @staticmethod
    def forward(ctx, logits, target, vocab_size, ignore_index, group, axis="tp"):
        ctx.axis = axis
        local = logits.shape[-1]
        rank = 0 if group is None else group.rank()
        start = rank * local
        n_real = max(0, min(local, vocab_size - start))  # columns < V on this rank
        x = logits.float()
        if n_real < local or x is logits:
            x = x.clone()
        x[..., n_real:] = float("-inf")
        m = x.max(dim=-1).values  # (...); -inf when the rank holds only padding
        if group is not None:
            note_collective("vocab_parallel_cross_entropy", "all_reduce", ctx.axis, "forward", m)
            wait_collective(dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group, async_op=True), group,
                            "vocabulary-parallel cross-entropy's max")
        x.sub_(m.unsqueeze(-1))
        ignored = target == ignore_index
        mine = (target >= start) & (target < start + local) & ~ignored
        local_t = (target.long() - start).masked_fill(~mine, 0)
        picked = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        x.exp_()
        sum_exp = x.sum(dim=-1)
        if group is not None:
            both = torch.stack([picked, sum_exp])
            note_collective("vocab_parallel_cross_entropy", "all_reduce", ctx.axis, "forward", both)
            wait_collective(dist.all_reduce(both, group=group, async_op=True), group,
                            "vocabulary-parallel cross-entropy's sums")
            picked, sum_exp = both[0], both[1]
        loss = (sum_exp.log() - picked).masked_fill(ignored, 0.0)
        x.div_(sum_exp.unsqueeze(-1))  # softmax of this rank's columns
        ctx.save_for_backward(x, mine, local_t, ignored)
        ctx.in_dtype = logits.dtype
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, mine, local_t, ignored = ctx.saved_tensors
        grad = softmax.clone()
        onehot = mine.to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -onehot)
        scale = grad_loss.to(grad.dtype).masked_fill(ignored, 0.0).unsqueeze(-1)
        grad.mul_(scale)
        return grad.to(ctx.in_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int,
    axis: str = "tp",
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy over logits sharded on the last (vocabulary) dim (Megatron's parallel CE).

    logits_shard: (..., L), this rank's columns [r * L, (r + 1) * L); target: (...) global ids
    in [0, V) or ignore_index. Two all-reduces over `axis` (the max, then the target logit
    and the sum of exponentials together); backward is softmax - onehot on the local
    columns, with no communication and no full logits. Padding columns (global index >= V) are
    treated as -inf. reduction: "mean" (over targets != ignore_index; nan when all are
    ignored, like F.cross_entropy), "sum" or "none" (0 at ignored positions). Equals
    F.cross_entropy(full_logits.reshape(-1, V), target.reshape(-1)) in value and gradient;
    computed in float32 for lower-precision logits. Targets >= V are not checked.
    """
    kwargs = {"axis": axis, "ignore_index": ignore_index, "reduction": reduction}
    node = _traced("vocab_parallel_cross_entropy", (logits_shard, target, vocab_size), kwargs)
    if node is not None:
        return node
    if reduction not in ("mean", "sum", "none"):
        raise UsageError(
            f"vocab_parallel_cross_entropy: reduction={reduction!r}; use 'mean', 'sum' or 'none'"
        )
    if tuple(logits_shard.shape[:-1]) != tuple(target.shape):
        raise ShardingError(
            f"vocab_parallel_cross_entropy: logits_shard has shape {tuple(logits_shard.shape)} "
            f"and target {tuple(target.shape)}; target must be logits' shape without the last "
            "(vocabulary) dim"
        )
    group = _group(axis)
    t = 1 if group is None else group.size()
    local = logits_shard.shape[-1]
    _check_vocab("vocab_parallel_cross_entropy", local, t, vocab_size, "logits_shard")
    if group is None and local == vocab_size:
        flat = F.cross_entropy(
            logits_shard.reshape(-1, local), target.reshape(-1),
            ignore_index=ignore_index, reduction=reduction,
        )
        return flat.reshape(target.shape) if reduction == "none" else flat
    loss = _VocabParallelCE.apply(logits_shard, target, vocab_size, ignore_index, group, axis)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()


# ----------------------------------------------------------------------------- logits


def gather_logits(logits_shard: torch.Tensor, vocab_size: int, axis: str = "tp") -> torch.Tensor:
    """All-gather vocabulary-sharded logits (..., L) into (..., V), dropping padding columns.

    Backward keeps this rank's columns of the gradient (gather_from_region). Unbound: the
    input with padding columns dropped.
    """
    if (node := _traced("gather_logits", (logits_shard, vocab_size), {"axis": axis})) is not None:
        return node
    group = _group(axis)
    t = 1 if group is None else group.size()
    _check_vocab("gather_logits", logits_shard.shape[-1], t, vocab_size, "logits_shard")
    full = gather_from_region(logits_shard, -1, axis)
    if full.shape[-1] > vocab_size:
        full = full.narrow(-1, 0, vocab_size)
    return full


# ----------------------------------------------------------------------------- column-parallel linears


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run a linear over ``x`` in, or None outside autocast."""
    kind = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return None


class _ColumnParallelLinear(torch.autograd.Function):
    """f followed by the column linears reading its output, with f's backward all-reduce
    overlapped with the weight gradients (Megatron's async tensor-model-parallel all-reduce).

    forward(x, bound, n, w_1..w_n, b_1..b_n) -> (F.linear(x, w_i, b_i) for each i). Backward:
    grad_x = sum_i grad_i @ w_i, start its all-reduce (async), then the weight and bias
    gradients, then wait: the all-reduce runs while this rank computes the weight gradients.
    """

    @staticmethod
    def forward(ctx, x, bound, n, *params):
        # under autocast, compute (and save for backward) in its dtype, as F.linear would: the
        # gradients arriving in backward then have the dtype of the saved tensors (autograd casts
        # the returned gradients back to the dtypes of x and the parameters)
        dtype = _autocast_dtype(x)
        if dtype is not None:
            x = x.to(dtype)
            params = tuple(p.to(dtype) if p is not None else None for p in params)
        weights, biases = params[:n], params[n:]
        ctx.bound, ctx.n = bound, n
        ctx.has_bias = tuple(b is not None for b in biases)
        ctx.save_for_backward(x, *weights)
        with torch.autocast(x.device.type, enabled=False):
            return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        n, need = ctx.n, ctx.needs_input_grad
        g2s = [g.reshape(-1, g.shape[-1]) for g in grads]
        grad_x, work = None, None
        if need[0]:
            traced = _are_we_tracing()  # out of place when traced (the same kernel): a graph split
            for g2, w in zip(g2s, weights):  # summed in place: one [N, in] buffer
                grad_x = (g2.mm(w) if grad_x is None else torch.addmm(grad_x, g2, w) if traced
                          else grad_x.addmm_(g2, w))
            grad_x = grad_x.view(x.shape)
            work = start_all_reduce(grad_x, ctx.bound, "column_parallel_linear", "backward")
        x2 = x.reshape(-1, x.shape[-1])
        grad_w: list = [None] * n
        grad_b: list = [None] * n
        for i, g2 in enumerate(g2s):
            if need[3 + i]:
                grad_w[i] = g2.t().mm(x2)
            if ctx.has_bias[i] and need[3 + n + i]:
                grad_b[i] = g2.sum(0)
        if work is not None:
            grad_x = work.wait()
        return (grad_x, None, None, *grad_w, *grad_b)


def column_parallel_linear(
    x: torch.Tensor,
    weights: list[torch.Tensor] | tuple[torch.Tensor, ...],
    biases: list[torch.Tensor | None] | tuple[torch.Tensor | None, ...],
    axis: str = "tp",
) -> tuple[torch.Tensor, ...]:
    """``copy_to_region(x)`` followed by ``F.linear(., w_i, b_i)`` for every weight: a tuple of
    the column-parallel outputs (the q/k/v or gate/up linears sharing one input are ONE op).

    Same values and gradients as the unfused ops; in backward the input-gradient contributions
    of all the linears are summed first, their single all-reduce over `axis` is started
    asynchronously and the weight (and bias) gradients are computed while it runs (Megatron's
    async tensor-model-parallel all-reduce). weights: (out_i, in) shards; biases: one per weight
    (None for none). Unbound (or a group of size 1): the plain linears.
    """
    kwargs = {"axis": axis}
    if (node := _traced("column_parallel_linear", (x, weights, biases), kwargs)) is not None:
        return node
    if len(weights) != len(biases) or not weights:
        raise UsageError(f"column_parallel_linear: got {len(weights)} weights and {len(biases)} biases; "
                         "pass one bias (or None) per weight, and at least one weight")
    bound = _active(axis)
    if bound is None:
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))
    return _ColumnParallelLinear.apply(x, bound, len(weights), *weights, *biases)


_ORIGINALS = {
    f.__name__: f
    for f in (vocab_parallel_embedding, vocab_parallel_cross_entropy, gather_logits, column_parallel_linear)
}

torch.fx.wrap("vocab_parallel_embedding")
torch.fx.wrap("vocab_parallel_cross_entropy")
torch.fx.wrap("gather_logits")
torch.fx.wrap("column_parallel_linear")
