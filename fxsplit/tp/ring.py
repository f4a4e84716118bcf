"""Ring attention: the local queries of a cp rank against every rank's keys and values, passed
around the cp ring block by block and merged by their log-sum-exp, never all held at once.

Terms as in ``fxsplit.tp.context`` (C, S, chunk, local tokens, natural order); **block** -- one
rank's local keys and values (S / C tokens: its head and tail chunks); **step** -- one turn of
the ring: every rank computes its queries against the block it holds while passing that block
on to the next rank (r -> r + 1 mod C); at step i rank r holds rank (r - i) mod C's block;
**lse** -- the log-sum-exp of a query row's scores, which makes partial softmaxes mergeable;
**lane** -- one rank's share of the work, so the same code runs one lane per process or every
lane at once in one process (``emulated_ring_attention``, for ``fxsplit.verify``).

    out = ring_attention(q, k, v, mask_rows, scale, enable_gqa, seq_len=S, causal=True)  # (B, H, S/C, Dv)

[Note: ring attention]
Forward, per rank: C steps; at each, the exchange of the held block is started, then the local
queries' attention to the block -- by torch's CPU flash-attention kernel, which returns each query
row's log-sum-exp and holds no [Sq, Sk] scores per head ([Note: tiled ring blocks] in
``fxsplit.tp.ring_tiles``: causal and sliding-window rows from the global positions of the local
queries and of the block's keys, [Note: load-balanced chunks]; a given mask's rows are this rank's
queries and its columns are read at the block's positions) -- is merged into the running (out, lse)
of each query row, and the next block is awaited. Backward: the kernel's backward per block from the
merged out and lse (the flash-attention gradient: the block's share of dQ, dK, dV); the blocks go
around the ring again and each block's dK / dV accumulator travels with it, one more step bringing it
home after C steps. Everything is computed in float32 (float64 for float64 inputs) and the output
cast to the queries' dtype. A query row with no allowed key gives 0 and a 0 gradient, as torch's sdpa
does. Numbers differ from one sdpa over all keys only in rounding (a different summation order).
The mask may not need a gradient (a learned score bias keeps the all-gather: the pass checks this at
plan time).

[Note: why our own ring]
torch's ``torch.distributed.tensor.experimental.context_parallel`` (``_templated_ring_attention``)
dispatches on the fused sdpa kernels (flash / efficient / cudnn) through DTensor and did not run
on CPU / gloo here (benchmarks/README.md, "Context parallelism: all-gather vs ring"); it also
changes the model's module in place. This one is a plain function of tensors and a mesh axis (a
leaf in the graph, like the tp collectives), its exchange is ``all_to_all_single`` over the cp group with only the
next rank's share non-empty (gloo runs it; traced, torch's functional ``all_to_all_single``:
[Note: traced collectives] in fxsplit.tp.collectives) and every wait is the runtime's bounded
one (``_Bound.wait``: [Note: failure protocol] in fxsplit.runtime.watch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch.distributed._functional_collectives import _are_we_tracing

from fxsplit.errors import RunError
from fxsplit.tp.collectives import active
from fxsplit.tp.ring_tiles import FlashMerge, pair_backward

__all__ = ["RingSpec", "emulated_ring_attention", "ring_attention", "ring_on_cuda"]

_FC = torch.ops._c10d_functional


@dataclass(frozen=True)
class RingSpec:
    """What every block of one attention call shares (hashable: an autograd Function argument)."""

    seq_len: int
    cp: int
    causal: bool = False
    window: int | None = None
    scale: float | None = None
    gqa: bool = False


# ------------------------------------------------------------------------------------- one block


def _heads(spec: RingSpec, kv: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Grouped-query K / V repeated to the query heads (sdpa's ``enable_gqa``)."""
    if not spec.gqa or kv.shape[-3] == q.shape[-3]:
        return kv
    return kv.repeat_interleave(q.shape[-3] // kv.shape[-3], dim=-3)


def _unrepeat(spec: RingSpec, grad: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """The gradient of ``_heads``: the repeated heads' gradients summed per K / V head."""
    if grad.shape[-3] == kv.shape[-3]:
        return grad
    return grad.unflatten(-3, (kv.shape[-3], grad.shape[-3] // kv.shape[-3])).sum(-3)


def _acc(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the accumulation dtype: float32, or float64 for float64 inputs."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


# ------------------------------------------------------------------------------------ the lanes
# A ``shift`` starts passing every lane's tensor one rank on and returns a handle whose wait()
# gives what each lane received: one lane over a process group, or all lanes rotated in place.


def _pack(*xs: torch.Tensor) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in xs])


def _unpack(flat: torch.Tensor, likes: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, at = [], 0
    for like in likes:
        out.append(flat[at:at + like.numel()].view(like.shape))
        at += like.numel()
    return out


def _forward(spec: RingSpec, lanes: Sequence[int], qs, ks, vs, masks, shift: Callable) -> tuple[list, list]:
    """Every lane's (out float32, lse) after C steps ([Note: ring attention])."""
    held = [_pack(k, v) for k, v in zip(ks, vs)]
    runs = [FlashMerge(q, v.shape[-1]) for q, v in zip(qs, vs)]
    for step in range(spec.cp):
        pending = shift(held) if step < spec.cp - 1 else None
        for i, lane in enumerate(lanes):
            k, v = _unpack(held[i], (ks[i], vs[i]))
            runs[i].add(spec, qs[i], _heads(spec, k, qs[i]), _heads(spec, v, qs[i]), masks[i], lane,
                        (lane - step) % spec.cp)
        if pending is not None:
            held = pending.wait()
    results = [run.result() for run in runs]
    return [o for o, _ in results], [lse for _, lse in results]


def _backward(spec: RingSpec, lanes: Sequence[int], qs, ks, vs, masks, outs, lses, grads,
              shift: Callable) -> tuple[list, list, list]:
    """Every lane's (dq, dk, dv) in the inputs' dtypes ([Note: ring attention])."""
    held = [_pack(k, v) for k, v in zip(ks, vs)]
    dkv = [torch.zeros(k.numel() + v.numel(), dtype=_acc(qs[0]).dtype, device=k.device) for k, v in zip(ks, vs)]
    dos = [_acc(g).to(o.dtype) for g, o in zip(grads, outs)]
    dqs = [torch.zeros(q.shape, dtype=o.dtype, device=q.device) for q, o in zip(qs, outs)]
    for step in range(spec.cp):
        pending = shift(held) if step < spec.cp - 1 else None
        for i, lane in enumerate(lanes):
            k, v = _unpack(held[i], (ks[i], vs[i]))
            dq, dk, dv = pair_backward(spec, qs[i], _heads(spec, k, qs[i]), _heads(spec, v, qs[i]), masks[i], outs[i],
                                       lses[i], dos[i], lane, (lane - step) % spec.cp)
            dqs[i] = dqs[i] + dq
            dkv[i] = dkv[i] + _pack(_unrepeat(spec, dk, k), _unrepeat(spec, dv, v))
        moved = shift(dkv)  # each block's gradient travels with it; after C moves it is home
        if pending is not None:
            held = pending.wait()
        dkv = moved.wait()
    dks, dvs = zip(*(_unpack(d, (k, v)) for d, k, v in zip(dkv, ks, vs)))
    return ([d.to(q.dtype) for d, q in zip(dqs, qs)], [d.to(k.dtype) for d, k in zip(dks, ks)],
            [d.to(v.dtype) for d, v in zip(dvs, vs)])


# ------------------------------------------------------------------------ over a process group


class _Exchange:
    """One lane's ring exchange over the bound cp group: to rank + 1, from rank - 1."""

    def __init__(self, b: Any, phase: str) -> None:
        self.b, self.phase = b, phase

    def __call__(self, xs: list[torch.Tensor]) -> "_Received":
        (x,) = xs
        b = self.b
        n, r = b.group.size(), b.group.rank()
        sends, recvs = [0] * n, [0] * n
        sends[(r + 1) % n] = x.numel()
        recvs[(r - 1) % n] = x.numel()
        b.note("ring_attention", "all_to_all", self.phase, x)
        x = x.contiguous()
        if _are_we_tracing():  # [Note: traced collectives]: waited where the block is needed
            return _Received(_FC.all_to_all_single(x, recvs, sends, b.group.group_name), None, b)
        out = torch.empty_like(x)
        return _Received(out, dist.all_to_all_single(out, x, recvs, sends, group=b.group, async_op=True), b)


class _Received:
    def __init__(self, x: torch.Tensor, work: Any, b: Any) -> None:
        self.x, self.work, self.b = x, work, b

    def wait(self) -> list[torch.Tensor]:
        if self.work is None:
            return [_FC.wait_tensor(self.x)]
        self.b.wait(self.work, "ring exchange of keys and values")
        return [self.x]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, spec, b):
        lane = b.group.rank()
        (out,), (lse,) = _forward(spec, [lane], [q], [k], [v], [mask], _Exchange(b, "forward"))
        ctx.spec, ctx.b = spec, b
        ctx.save_for_backward(q, k, v, mask, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, mask, out, lse = ctx.saved_tensors
        (dq,), (dk,), (dv,) = _backward(ctx.spec, [ctx.b.group.rank()], [q], [k], [v], [mask], [out], [lse], [grad],
                                        _Exchange(ctx.b, "backward"))
        return dq, dk, dv, None, None, None


# [Note: the ring on CUDA]
# The ring's blocks run torch's CPU flash-attention kernel and its backward
# (``_scaled_dot_product_flash_attention_for_cpu``: out and log-sum-exp per block, [Note: tiled ring
# blocks]), which has no CUDA kernel; the CUDA kernels that return a log-sum-exp (flash: 16-bit only,
# no mask; memory-efficient: a padded log-sum-exp) are not wired in, because no GPU here could check
# their numbers against one process (a block kernel that is wrong would be a wrong number, not an
# error). So on a CUDA rank ``parallelize`` plans every attention with the all-gather (sdpa on the
# gathered K/V, torch's own CUDA kernels: the memory-efficient one reads the causal-rows mask), an
# explicit ``cp_kv="ring"`` is refused there, and ``ring_attention`` on a CUDA tensor raises.
def ring_on_cuda(what: str) -> str:
    return (f"{what}: context parallelism's ring runs torch's CPU flash-attention kernel, which has no CUDA "
            "kernel ([Note: the ring on CUDA] in fxsplit/tp/ring.py); plan with cp_kv='allgather' (what "
            "parallelize picks on CUDA), or run the ring on CPU ranks")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                   scale: float | None = None, enable_gqa: bool = False, *, seq_len: int, causal: bool = False,
                   window: int | None = None, axis: str = "cp") -> torch.Tensor:
    """sdpa of this rank's queries ``q`` (..., H, S/C, D) against every cp rank's ``k`` / ``v``
    (..., Hkv, S/C, D each, local tokens), by ring ([Note: ring attention]). ``attn_mask``: rows of
    the local queries, keys in natural order (S, or 1 to broadcast); ``causal`` / ``window``: the
    causal (sliding-window) rows at the local queries' global positions. With no cp group bound it
    is the same computation over the one block held."""
    if attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled():
        raise RunError(
            f"ring_attention: the mask of shape {tuple(attn_mask.shape)} needs a gradient (a learned score bias); "
            "the ring does not differentiate the mask: plan with cp_kv='allgather'")
    if q.device.type != "cpu":
        raise RunError(ring_on_cuda(f"ring_attention on a {q.device.type} tensor"))
    b = active(axis)
    cp = 1 if b is None else b.group.size()
    spec = RingSpec(seq_len=seq_len, cp=cp, causal=causal, window=window, scale=scale, gqa=enable_gqa)
    if b is None:
        return _Local.apply(q, k, v, attn_mask, spec)
    return _RingAttention.apply(q, k, v, attn_mask, spec, b)


class _Local(torch.autograd.Function):
    """One rank holding every token (cp = 1): one step, no exchange."""

    @staticmethod
    def forward(ctx, q, k, v, mask, spec):
        (out,), (lse,) = _forward(spec, [0], [q], [k], [v], [mask], _no_shift)
        ctx.spec = spec
        ctx.save_for_backward(q, k, v, mask, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, mask, out, lse = ctx.saved_tensors
        (dq,), (dk,), (dv,) = _backward(ctx.spec, [0], [q], [k], [v], [mask], [out], [lse], [grad], _no_shift)
        return dq, dk, dv, None, None


class _Rotated:
    def __init__(self, xs: list[torch.Tensor]) -> None:
        self.xs = xs

    def wait(self) -> list[torch.Tensor]:
        return self.xs


def _no_shift(xs: list[torch.Tensor]) -> _Rotated:
    return _Rotated(list(xs))


def _rotate(xs: list[torch.Tensor]) -> _Rotated:
    """Every lane's tensor passed one rank on: lane r receives lane r - 1's."""
    return _Rotated([xs[(r - 1) % len(xs)] for r in range(len(xs))])


# --------------------------------------------------------------------------- emulated, for verify


class _EmulatedRing(torch.autograd.Function):
    """forward(spec, n, *q's, *k's, *v's, *masks) -> n outputs: every lane's ring in one process,
    the exchange a rotation of the lanes' list, the same arithmetic as a real run."""

    @staticmethod
    def forward(ctx, spec, n, *tensors):
        qs, ks, vs, masks = (list(tensors[i * n:(i + 1) * n]) for i in range(4))
        outs, lses = _forward(spec, range(n), qs, ks, vs, masks, _rotate)
        ctx.spec, ctx.n = spec, n
        ctx.save_for_backward(*qs, *ks, *vs, *outs, *lses)
        ctx.masks = masks
        return tuple(o.to(q.dtype) for o, q in zip(outs, qs))

    @staticmethod
    def backward(ctx, *grads):
        n = ctx.n
        saved = ctx.saved_tensors
        qs, ks, vs, outs, lses = (list(saved[i * n:(i + 1) * n]) for i in range(5))
        grads = [torch.zeros_like(o, dtype=q.dtype) if g is None else g for g, o, q in zip(grads, outs, qs)]
        dqs, dks, dvs = _backward(ctx.spec, range(n), qs, ks, vs, ctx.masks, outs, lses, grads, _rotate)
        return (None, None, *dqs, *dks, *dvs, *([None] * n))


def emulated_ring_attention(bound: list[dict]) -> list[torch.Tensor]:
    """The per-rank results of ``ring_attention`` for every cp rank at once (``bound[r]``: rank
    r's arguments by name), with the per-rank gradients of a real run
    ([Note: emulated collectives] in fxsplit.tp.emulate)."""
    b0 = bound[0]
    n = len(bound)
    masks = [b["attn_mask"] for b in bound]
    if any(m is not None and m.requires_grad for m in masks) and torch.is_grad_enabled():
        raise RunError("ring_attention: a mask that needs a gradient (a learned score bias); plan with cp_kv='allgather'")
    spec = RingSpec(seq_len=b0["seq_len"], cp=n, causal=b0["causal"], window=b0["window"], scale=b0["scale"],
                    gqa=b0["enable_gqa"])
    args = [b[name] for name in ("q", "k", "v") for b in bound]
    return list(_EmulatedRing.apply(spec, n, *args, *masks))


torch.fx.wrap("ring_attention")
