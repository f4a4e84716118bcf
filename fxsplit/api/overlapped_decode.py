"""Generation whose steps overlap across microbatches: the KV cache's prefill and decode steps run
as one forward program ([Note: decode schedules] in fxsplit.schedule.decode), so while microbatch
i's step k runs on stage s, microbatch i + 1's runs on stage s - 1 and, once a token is chosen,
its next step starts on the first stage without waiting for the other microbatches.

Terms
- **m'**, **steps**, **virtual microbatch** ``j = k * m' + i``: as in fxsplit.schedule.decode.
- **token message**: the (b_i, 1) token ids microbatch i's step k chose, from the last stage's
  rank to the first stage's: a message of the decode program's communication plan ([Note: token
  messages] in fxsplit.pipeline.comm), posted, ordered and waited on as the activations are, on
  every backend (NCCL's order-matched pairs included), every wait bounded and a failed peer named
  ([Note: failure protocol]).

The choice of a token is ``next_tokens`` (fxsplit.api.generate) on the rows of one microbatch,
in the order of the virtual microbatches, which is the order one process draws a step's rows in
(step by step, rows in order), so seeded sampling draws the same numbers; the tensor-parallel
ranks of the last stage take tp rank 0's choice, as the stepwise path does. With
``eos_token_id`` every step still runs (the program is fixed up front); finished rows get the
token, and the result is cut where every row had finished, as the stepwise loop stops there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from fxsplit.api.kv_cache import KVCache
from fxsplit.pipeline.comm import Feedback, plan_all_communication
from fxsplit.schedule.decode import decode

__all__ = ["overlapped_decode"]


class _Program:
    """The override ``run_program`` runs the stages with: the cache's slots, token messages in, and
    the last stage's choice of tokens out."""

    def __init__(self, pm: Any, cache: KVCache, inputs: list, m: int, steps: int, pick: Callable, eos: int | None):
        self.pm, self.rt, self.cache, self.inputs, self.m, self.steps = pm, pm.runtime, cache, inputs, m, steps
        self.pick, self.eos = pick, eos
        self.group = self.rt.pp_group if self.rt.pp_group is not None else dist.group.WORLD
        self.last = self.rt.plan.stage_ranks[-1]
        sizes = [int(x[0].shape[0]) for x in inputs[:m]]
        self.starts = [sum(sizes[:i]) for i in range(m)]
        batch = sum(sizes)
        self.out = torch.zeros(batch, steps, dtype=torch.long, device=self.rt.device)
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=self.rt.device)
        self.tokens: dict[int, torch.Tensor] = {}  # virtual microbatch -> the token ids it reads
        self.shapes = cache.shapes
        self.modules = dict(cache.modules)
        if self.rt.last_stage in self.modules:
            inner = self.modules[self.rt.last_stage]
            self.modules[self.rt.last_stage] = lambda *args: self._chose(inner(*args))
        self.j = 0

    def _peer(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not dist.group.WORLD else group_rank

    @contextlib.contextmanager
    def context(self, stage: int, j: int) -> Iterator[None]:
        self.j = j
        with self.cache.context(stage, j % self.m):
            yield

    def token(self, j: int) -> torch.Tensor:
        """The token ids virtual microbatch ``j`` reads: what the runtime sends as its token message."""
        return self.tokens.pop(j)

    def _chose(self, out: Any) -> Any:
        rt, j = self.rt, self.j
        flat = out if isinstance(out, (tuple, list)) else (out,)
        model_out = [flat[local] for _, local in sorted(rt.io[rt.last_stage].model_outputs)]
        model_out = (pytree.tree_unflatten(model_out, rt.output_spec) if rt.output_spec is not None
                     else model_out[0] if len(model_out) == 1 else tuple(model_out))
        i, k = j % self.m, j // self.m
        nxt = self.pick(model_out).to(rt.device)
        rows = slice(self.starts[i], self.starts[i] + nxt.shape[0])
        if self.eos is not None:
            nxt = torch.where(self.unfinished[rows], nxt, torch.full_like(nxt, self.eos))
        tp = self.pm._groups.tp
        if tp is not None and dist.get_world_size(tp) > 1:
            work = dist.broadcast(nxt, dist.get_global_rank(tp, 0), group=tp, async_op=True)
            self.pm._wait(work, "in generate(), sharing a token over the tensor-parallel ranks of the last stage", tp)
        self.out[rows, k] = nxt
        if self.eos is not None:
            self.unfinished[rows] &= nxt != self.eos
        if k + 1 < self.steps:
            self.tokens[j + self.m] = nxt[:, None].contiguous()
        return out


def overlapped_decode(pm: Any, ids: torch.Tensor, m: int, max_new_tokens: int, eos_token_id: int | None,
                      pick: Callable[[torch.Tensor], torch.Tensor], cache: KVCache,
                      flat: Callable[[torch.Tensor, int], list[torch.Tensor]]) -> torch.Tensor:
    """The tokens (B, T + n) on every rank of the replica: prefill and ``max_new_tokens - 1`` decode
    steps of ``m`` microbatches as one program; ``pick(output)`` chooses a microbatch's tokens from
    its model output (the model's own structure); ``flat(tokens, positions)``: a call's flat inputs
    from its new tokens (the token ids first) and the positions so far."""
    rt = pm.runtime
    ids = ids.to(rt.device)
    if max_new_tokens == 0:
        return ids
    chunks = torch.tensor_split(ids, m, dim=0)  # the rows the runtime's split gives each microbatch
    prompt = ids.shape[1]
    inputs = [flat(c, prompt) for c in chunks] + [flat(torch.zeros(c.shape[0], 1, dtype=ids.dtype, device=rt.device),
                                                       prompt + k) for k in range(1, max_new_tokens) for c in chunks]
    ranks = rt.plan.stage_ranks
    rows = [[a for a in row if a is not None] for row in decode(ranks, m, max_new_tokens)]
    ids_input = next(k for k, src in enumerate(rt.io[0].inputs) if src.stage is None and src.index == 0)
    program = plan_all_communication(rows, rt.io, num_ranks=rt.num_ranks, rank_of_stage=ranks.__getitem__,
                                     forward_only=True, feedback=Feedback(0, ids_input, m))[rt.pp_rank]
    run = _Program(pm, cache, inputs, m, max_new_tokens, pick, eos_token_id)
    rt.run_program(program, inputs, override=run)
    out = run.out
    if rt.num_ranks > 1:
        work = dist.broadcast(out, run._peer(run.last), group=run.group, async_op=True)
        pm._wait(work, "in generate(), sharing the new tokens over the pipeline from the last stage's rank", run.group)
    tokens = torch.cat([ids, out], dim=1)
    if eos_token_id is not None:
        hit = out == eos_token_id
        if bool(hit.any(dim=1).all()):  # the stepwise loop stops once every row has produced it
            last = int(hit.float().argmax(dim=1).max())
            tokens = tokens[:, : ids.shape[1] + last + 1]
    return tokens
