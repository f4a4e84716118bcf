"""Generation whose steps overlap across microbatches: the KV cache's prefill and decode steps run
as one forward program ([Note: decode schedules] in fxsplit.schedule.decode), so while microbatch
i's step k runs on stage s, microbatch i + 1's runs on stage s - 1 and, once a token is chosen,
its next step starts on the first stage without waiting for the other microbatches.

Terms
- **m'**, **steps**, **virtual microbatch** ``j = k * m' + i``: as in fxsplit.schedule.decode.
- **token message**: the (b_i, 1) token ids microbatch i's step k chose, from the last stage's
  rank to the first stage's (tag ``TOKEN_TAG + j``, beside the program's activations), received
  into the input of virtual microbatch j + m' before its first stage runs; every wait on it is the
  Watch's, whole as the channel's point-to-point waits are ([Note: failure protocol]), so a failed
  peer is named, never waited on forever.

The choice of a token is ``next_tokens`` (fxsplit.api.generate) on the rows of one microbatch,
in the order of the virtual microbatches, which is the order one process draws a step's rows in
(step by step, rows in order), so seeded sampling draws the same numbers; the tensor-parallel
ranks of the last stage take tp rank 0's choice, as the stepwise path does. With
``eos_token_id`` every step still runs (the program is fixed up front); finished rows get the
token, and the result is cut where every row had finished, as the stepwise loop stops there.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from fxsplit.api.kv_cache import KVCache
from fxsplit.pipeline.comm import plan_all_communication
from fxsplit.schedule.decode import decode

__all__ = ["TOKEN_TAG", "overlapped_decode"]

TOKEN_TAG = 1 << 22  # above every activation's tag


class _Program:
    """The override ``run_program`` runs the stages with: the cache's slots, token messages in, and
    the last stage's choice of tokens out."""

    def __init__(self, pm: Any, cache: KVCache, inputs: list, m: int, steps: int, pick: Callable, eos: int | None):
        self.pm, self.rt, self.cache, self.inputs, self.m, self.steps = pm, pm._runtime, cache, inputs, m, steps
        self.pick, self.eos = pick, eos
        self.group = self.rt.pp_group if self.rt.pp_group is not None else dist.group.WORLD
        ranks = self.rt.plan.stage_ranks
        self.first, self.last = ranks[0], ranks[-1]
        sizes = [int(x[0].shape[0]) for x in inputs[:m]]
        self.starts = [sum(sizes[:i]) for i in range(m)]
        batch = sum(sizes)
        self.out = torch.zeros(batch, steps, dtype=torch.long, device=self.rt.device)
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=self.rt.device)
        self.sends: list = []
        self.modules = dict(cache.modules)
        self.shapes = cache.shapes
        if self.rt.last_stage in self.modules:
            inner = self.modules[self.rt.last_stage]
            self.modules[self.rt.last_stage] = lambda *args: self._chose(inner(*args))
        self.j = 0

    def _peer(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not dist.group.WORLD else group_rank

    def p2p_wait(self, work: Any, what: str, group_rank: int) -> None:
        """A point-to-point wait as the runtime's channel makes it: gloo's pair breaks when a wait on
        it times out, so a wait is whole (bounded by the timeout), never polled in slices."""
        peer = self._peer(group_rank)
        if self.rt.watch is not None:
            self.rt.watch.wait(work, what, (peer,), sliced=False)
        else:
            work.wait(datetime.timedelta(seconds=self.rt.timeout))

    @contextlib.contextmanager
    def context(self, stage: int, j: int) -> Iterator[None]:
        if stage == 0 and j >= self.m and self.first != self.last:
            buf = self.inputs[j][0]
            work = dist.irecv(buf, self._peer(self.last), group=self.group, tag=TOKEN_TAG + j - self.m)
            self.p2p_wait(work, f"in generate(), receiving the token of step {j // self.m - 1} of microbatch "
                          f"{j % self.m} from the last stage's rank", self.last)
        self.j = j
        with self.cache.context(stage, j % self.m):
            yield

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
        tp = self.pm._groups.get("tp")
        if tp is not None and dist.get_world_size(tp) > 1:
            work = dist.broadcast(nxt, dist.get_global_rank(tp, 0), group=tp, async_op=True)
            self.pm._wait(work, "in generate(), sharing a token over the tensor-parallel ranks of the last stage", tp)
        self.out[rows, k] = nxt
        if self.eos is not None:
            self.unfinished[rows] &= nxt != self.eos
        if k + 1 < self.steps:
            nxt_in = nxt[:, None].contiguous()
            if self.first == self.last:
                self.inputs[j + self.m][0].copy_(nxt_in)
            else:
                self.sends.append((nxt_in, dist.isend(nxt_in, self._peer(self.first), group=self.group,
                                                      tag=TOKEN_TAG + j)))
        return out


def overlapped_decode(pm: Any, ids: torch.Tensor, m: int, max_new_tokens: int, eos_token_id: int | None,
                      pick: Callable[[torch.Tensor], torch.Tensor], cache: KVCache,
                      flat: Callable[[torch.Tensor, int], list[torch.Tensor]]) -> torch.Tensor:
    """The tokens (B, T + n) on every rank of the replica: prefill and ``max_new_tokens - 1`` decode
    steps of ``m`` microbatches as one program; ``pick(output)`` chooses a microbatch's tokens from
    its model output (the model's own structure); ``flat(tokens, positions)``: a call's flat inputs
    from its new tokens (the token ids first) and the positions so far."""
    rt = pm._runtime
    ids = ids.to(rt.device)
    if max_new_tokens == 0:
        return ids
    chunks = torch.tensor_split(ids, m, dim=0)  # the rows the runtime's split gives each microbatch
    prompt = ids.shape[1]
    inputs = [flat(c, prompt) for c in chunks] + [flat(torch.zeros(c.shape[0], 1, dtype=ids.dtype, device=rt.device),
                                                       prompt + k) for k in range(1, max_new_tokens) for c in chunks]
    ranks = rt.plan.stage_ranks
    rows = [[a for a in row if a is not None] for row in decode(ranks, m, max_new_tokens)]
    program = plan_all_communication(rows, rt.io, num_ranks=rt.num_ranks, rank_of_stage=ranks.__getitem__,
                                     forward_only=True)[rt.pp_rank]
    run = _Program(pm, cache, inputs, m, max_new_tokens, pick, eos_token_id)
    rt.run_program(program, inputs, override=run)
    for tensor, work in run.sends:
        run.p2p_wait(work, "in generate(), sending a token to the first stage's rank", run.first)
        del tensor
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
