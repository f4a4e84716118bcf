"""The tensor-parallel collectives emulated in ONE process, over all t ranks' values at once.

Terms: **t** -- the tp degree; **per-rank values** -- a list of t values, rank r's at index r;
**emulated op** -- a function of the per-rank arguments of one collective node that returns the
per-rank results, with the same forward values and the same per-rank backward as the real op
over a process group of t ranks (fxsplit.tp.collectives' table).

    outs = emulate(reduce_from_region, [(x0,), (x1,)], [{"axis": "tp"}] * 2)   # [x0 + x1, x0 + x1]
    with as_rank(r, t):              # axis_rank("tp") == r, axis_size("tp") == t for plain ops
        y = node.target(*args_r)

[Note: emulated collectives]
Each op is one autograd Function over the t tensors (``_Combine``), so one ``backward()`` of the
sum of the t ranks' losses gives every rank exactly the gradient its own backward would get in a
real run: f (copy_to_region) forwards each rank's own value and gives each rank the sum of the
t output gradients (the real backward all-reduce); g (reduce_from_region) forwards the sum and
gives each rank its own output's gradient (identity); gathers forward the concatenation and keep
the own shard of the gradient; and so on. The fused ops of ``fxsplit.tp.functional`` are
emulated by their definitions (f then the linears; a masked lookup then g; a gather then the
one-process op), which have the same values and gradients. Sums run in rank order, as a ring
all-reduce need not, so results may differ from a real run in the last float bits. A collective
with no emulation (a new op) fails loudly: ``as_rank`` binds the axis to a stand-in
``ProcessGroup`` with no backend, so a real collective on it raises instead of returning a
wrong number. Used by ``fxsplit.api.verify``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fxsplit.tp import collectives as C
from fxsplit.tp import experts as ep
from fxsplit.tp import functional as tpf
from fxsplit.tp import ring

__all__ = ["EMULATED_OPS", "as_rank", "as_ranks", "emulate", "is_emulated"]


@contextlib.contextmanager
def as_rank(rank: int, size: int, axis: str = "tp") -> Iterator[None]:
    """Inside the block ``axis_rank(axis) == rank`` and ``axis_size(axis) == size`` (a stand-in
    group with no backend: any real collective over it raises)."""
    with C.bind_groups({axis: dist.ProcessGroup(rank, size)}):
        yield


@contextlib.contextmanager
def as_ranks(ranks: Mapping[str, tuple[int, int]]) -> Iterator[None]:
    """:func:`as_rank` along every axis of ``ranks`` (axis -> (rank, size)) at once."""
    with C.bind_groups({axis: dist.ProcessGroup(r, n) for axis, (r, n) in ranks.items()}):
        yield


def _sum(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    out = xs[0].clone()
    for x in xs[1:]:
        out = out + x
    return out


class _Combine(torch.autograd.Function):
    """forward(kind, dim, *xs) -> t outputs; see [Note: emulated collectives]."""

    @staticmethod
    def forward(ctx, kind, dim, *xs):
        t = len(xs)
        ctx.kind, ctx.dim, ctx.t = kind, dim, t
        if kind == "copy":
            outs = tuple(x.view_as(x) for x in xs)
        elif kind == "reduce":
            s = _sum(xs)
            outs = tuple(s.clone() for _ in range(t))
        elif kind in ("gather", "gather_sp"):  # gather_from_region / gather_to_region
            full = torch.cat([x.contiguous() for x in xs], dim=dim)
            outs = tuple(full.clone() for _ in range(t))
        elif kind == "scatter":
            outs = tuple(x.chunk(t, dim=dim)[r].contiguous() for r, x in enumerate(xs))
        elif kind == "reduce_scatter":
            s = _sum(xs)
            outs = tuple(s.chunk(t, dim=dim)[r].contiguous() for r in range(t))
        else:
            raise AssertionError(kind)
        ctx.out_meta = [(o.shape, o.dtype, o.device) for o in outs]
        return outs

    @staticmethod
    def backward(ctx, *grads):
        kind, dim, t = ctx.kind, ctx.dim, ctx.t
        gs = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g
              for g, (shape, dtype, device) in zip(grads, ctx.out_meta)]
        if kind == "copy":  # f: the real backward all-reduces
            s = _sum(gs)
            out = [s.clone() for _ in range(t)]
        elif kind == "reduce":  # g: identity
            out = gs
        elif kind == "gather":  # keep own shard
            out = [g.chunk(t, dim=dim)[r].contiguous() for r, g in enumerate(gs)]
        elif kind in ("scatter", "reduce_scatter"):  # all-gather the gradient shards
            full = torch.cat([g.contiguous() for g in gs], dim=dim)
            out = [full.clone() for _ in range(t)]
        else:  # gather_sp: reduce-scatter the gradient
            s = _sum(gs)
            out = [s.chunk(t, dim=dim)[r].contiguous() for r in range(t)]
        return (None, None, *out)


def _combine(kind: str, xs: Sequence[torch.Tensor], dim: int = 0) -> list[torch.Tensor]:
    if len(xs) == 1:
        return list(xs)
    if kind in ("gather", "scatter", "reduce_scatter", "gather_sp"):
        dim = dim % xs[0].dim()
    return list(_Combine.apply(kind, dim, *xs))


def _bind(fn: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    import inspect

    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


# --------------------------------------------------------------------------------- per op
# each: (list of per-rank bound arguments) -> list of per-rank results


def _region(kind: str, dim_arg: str | None) -> Callable[[list[dict]], list]:
    def run(bs: list[dict]) -> list:
        return _combine(kind, [b["x"] for b in bs], bs[0][dim_arg] if dim_arg else 0)
    return run


def _all_reduce_sum(bs: list[dict]) -> list:
    with torch.no_grad():
        s = _sum([b["x"] for b in bs])
    if bs[0]["inplace"]:
        for b in bs:
            b["x"].copy_(s)
        return [b["x"] for b in bs]
    return [s.clone() for _ in bs]


def _column_parallel_linear(bs: list[dict]) -> list:
    xs = _combine("copy", [b["x"] for b in bs])
    return [tuple(F.linear(x, w, bias) for w, bias in zip(b["weights"], b["biases"])) for x, b in zip(xs, bs)]


def _vocab_parallel_embedding(bs: list[dict]) -> list:
    t, outs = len(bs), []
    for r, b in enumerate(bs):
        ids, w, vocab, pad = b["ids"], b["weight_shard"], b["vocab_size"], b["padding_idx"]
        local = w.shape[0]
        if t == 1:
            outs.append(F.embedding(ids, w, padding_idx=pad))
            continue
        pad = None if pad is None else pad % vocab
        start = r * local
        outside = (ids < start) | (ids >= start + local)
        local_pad = pad - start if pad is not None and start <= pad < start + local else None
        out = F.embedding((ids - start).masked_fill(outside, 0), w, padding_idx=local_pad)
        outs.append(out.masked_fill(outside.unsqueeze(-1), 0.0))
    return _combine("reduce", outs)


def _gathered_logits(bs: list[dict], key: str) -> list[torch.Tensor]:
    full = _combine("gather", [b[key] for b in bs], -1)
    vocab = bs[0]["vocab_size"]
    return [f.narrow(-1, 0, vocab) if f.shape[-1] > vocab else f for f in full]


def _gather_logits(bs: list[dict]) -> list:
    return _gathered_logits(bs, "logits_shard")


def _vocab_parallel_cross_entropy(bs: list[dict]) -> list:
    outs = []
    for full, b in zip(_gathered_logits(bs, "logits_shard"), bs):
        target, vocab = b["target"], b["vocab_size"]
        loss = F.cross_entropy(full.float().reshape(-1, vocab), target.reshape(-1),
                               ignore_index=b["ignore_index"], reduction=b["reduction"])
        loss = loss.reshape(target.shape) if b["reduction"] == "none" else loss
        outs.append(loss.to(b["logits_shard"].dtype))
    return outs


def _ep(emulated: Callable, *names: str) -> Callable[[list[dict]], list]:
    def run(bs: list[dict]) -> list:
        return emulated(*([b[name] for b in bs] for name in names))
    return run


EMULATED_OPS: dict[Callable, Callable[[list[dict]], list]] = {
    ep.ep_token_counts: _ep(ep.emulated_token_counts, "offs"),
    ep.ep_dispatch: _ep(ep.emulated_dispatch, "x", "offs", "recv"),
    ep.ep_combine: _ep(ep.emulated_combine, "y", "offs", "recv"),
    C.copy_to_region: _region("copy", None),
    C.reduce_from_region: _region("reduce", None),
    C.gather_from_region: _region("gather", "dim"),
    C.scatter_to_region: _region("scatter", "dim"),
    C.reduce_scatter_to_region: _region("reduce_scatter", "dim"),
    C.gather_to_region: _region("gather_sp", "dim"),
    C.all_reduce_sum: _all_reduce_sum,
    tpf.column_parallel_linear: _column_parallel_linear,
    tpf.vocab_parallel_embedding: _vocab_parallel_embedding,
    tpf.gather_logits: _gather_logits,
    tpf.vocab_parallel_cross_entropy: _vocab_parallel_cross_entropy,
    ring.ring_attention: ring.emulated_ring_attention,
}


def is_emulated(target: Any) -> bool:
    """Whether ``target`` (a graph node's) is a collective that :func:`emulate` evaluates."""
    try:
        return target in EMULATED_OPS
    except TypeError:  # unhashable target
        return False


def emulate(target: Callable, args: Sequence[tuple], kwargs: Sequence[dict],
            ranks: Sequence[Mapping[str, tuple[int, int]]] | None = None) -> list:
    """The per-rank results of collective ``target`` called with each rank's ``args[r]`` and
    ``kwargs[r]`` (see [Note: emulated collectives]). ``ranks[r]``: rank r's (rank, size) along
    each mesh axis, when the ranks span several ([Note: emulated collectives over several axes]).

    [Note: emulated collectives over several axes]
    With cp x tp, the per-rank lists hold every (cp, tp) rank; a collective over one axis (its
    ``axis`` argument) combines the ranks that share every OTHER coordinate, in the order of their
    rank along that axis, as the mesh's sub-groups do."""
    bound = [_bind(target, a, k) for a, k in zip(args, kwargs)]
    if ranks is None:
        return EMULATED_OPS[target](bound)
    axis = bound[0].get("axis", "tp")
    groups: dict[tuple, list[int]] = {}
    for i, coords in enumerate(ranks):
        key = tuple(sorted((a, c) for a, c in coords.items() if a != axis))
        groups.setdefault(key, []).append(i)
    out: list = [None] * len(bound)
    for members in groups.values():
        members.sort(key=lambda i: ranks[i].get(axis, (0, 1))[0])
        for i, v in zip(members, EMULATED_OPS[target]([bound[i] for i in members])):
            out[i] = v
    return out
