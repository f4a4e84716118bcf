"""Point-to-point channel of the pipeline runtime: posts one rank's sends and receives, in the
order its :class:`~fxsplit.pipeline.comm.CommPlan` gives ([Note: message order] in
:mod:`fxsplit.pipeline.comm`), asynchronously and with a timeout on every wait.

    ch = P2PChannel(plan.comm_plan(rank), group=pp_group, timeout_s=300.0, alloc=make_buffer)
    ch.send(msg, tensor, action); x = ch.wait(msg, action); ch.finish()

[Note: releasing sends]
A posted send holds its tensor until the transfer is done. NCCL's ``Work.is_completed()`` says
when, and `reap` drops finished sends after every action. gloo's send work reports completion
only once it has been waited on, so polling alone would keep every tensor a rank sent (its
stage outputs, the gradients it sent back) alive until the end of the step: measured at p=2,
m=8, 1.9 MiB of activations of finished microbatches held on rank 0, the difference between
the plan's checkpointing prediction and the memory held. So a completed receive also releases
sends: both ranks post their operations with a peer in one order ([Note: message order] in
fxsplit.pipeline.comm), so when the receive at position i from a peer has arrived, the peer had
posted everything before position i, including the receive of each of our sends to it ordered
before i. Those transfers need nothing more from this rank, so waiting on them returns at once
(or after the transfer in flight) and cannot deadlock; then they are dropped. Done where waits
block the host (``blocking_waits``, gloo's default); elsewhere `reap` suffices.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fxsplit.errors import PipelineError, RankFailedError
from fxsplit.pipeline.comm import CommOp, CommPlan, Message
from fxsplit.schedule.ir import Action

__all__ = ["P2PChannel", "PipelineError"]


class P2PChannel:
    """Posts one rank's sends and receives in the plan's per-peer order; waits with a timeout.

    ``alloc(message) -> Tensor`` makes the receive buffer (shape and dtype known from the plan);
    ``reset(alloc)`` gives it per call (the shapes bind from that call's inputs).
    ``blocking_waits``: when True, ``Work.wait(timeout)`` blocks the host until the transfer is
    done or ``timeout_s`` passes (gloo; NCCL too, at the cost of host/device overlap); when False,
    ``Work.wait()`` only orders the current CUDA stream after the transfer and the process
    group's own timeout applies (NCCL's watchdog).
    """

    def __init__(self, plan: CommPlan, *, group: dist.ProcessGroup | None, timeout_s: float,
                 alloc: Callable[[Message], torch.Tensor] | None = None, blocking_waits: bool = True, watch: Any = None):
        self.plan = plan
        self.watch = watch  # fxsplit.runtime.watch.Watch: polled waits ([Note: failure protocol])
        self.group = group
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.alloc = alloc
        self.blocking_waits = blocking_waits
        self._where: dict[tuple[bool, Message], tuple[int, int]] = {}
        for peer, ops in plan.peer_ops.items():
            for i, op in enumerate(ops):
                self._where[(op.is_send, op.message)] = (peer, i)
        self._global = {peer: self._global_rank(peer) for peer in plan.peer_ops}
        self.reset()

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def reset(self, alloc: Callable[[Message], torch.Tensor] | None = None) -> None:
        """Start a new step: nothing posted; ``alloc``, when given, makes this step's buffers."""
        if alloc is not None:
            self.alloc = alloc
        self._cursor = {peer: 0 for peer in self.plan.peer_ops}
        self._ready: dict[Message, tuple[torch.Tensor, Action]] = {}
        self._recvs: dict[Message, tuple[dist.Work, torch.Tensor]] = {}
        self._sends: list[tuple[dist.Work, Message, Action, torch.Tensor]] = []
        self._send_pos: dict[Message, tuple[int, int]] = {}  # posted send -> (peer, position)
        self.wait_seconds = 0.0  # host time blocked in waits this step (the measured bubble)
        self.sent_bytes = 0  # bytes of the tensors posted as sends this step

    # -- errors ---------------------------------------------------------------------------------

    def error(self, what: str, msg: Message, peer: int, action: Action, exc: BaseException | None) -> PipelineError:
        reason = f"timed out after {self.timeout_s:g} s" if exc is None or "imed out" in str(exc) \
            else f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        text = (
            f"pipeline rank {self.plan.rank} (global rank {self._global_rank(self.plan.rank)}): "
            f"action {action} (stage {action.stage}, microbatch {action.microbatch}) {what} the "
            f"{msg.describe()} {'to' if 'send' in what else 'from'} pipeline rank {peer} "
            f"(global rank {self._global.get(peer, peer)}), which {reason}. Pipeline rank {peer} "
            "most likely failed or is stuck: look for its own error first. A slow but healthy "
            "peer needs a larger `timeout`."
        )
        return PipelineError(text, rank=self.plan.rank, peer=peer, action=str(action),
                             microbatch=action.microbatch)

    # -- posting --------------------------------------------------------------------------------

    def _post(self, op: CommOp, action: Action) -> None:
        msg, dst = op.message, self._global[op.peer]
        if op.is_send:
            tensor, producer = self._ready.pop(msg)
        else:
            tensor = self.alloc(msg)
        try:
            if op.is_send:
                work = dist.isend(tensor, dst, group=self.group, tag=msg.tag)
                self.sent_bytes += tensor.numel() * tensor.element_size()
                self._sends.append((work, msg, producer, tensor))
                self._send_pos[msg] = (op.peer, self._cursor[op.peer])
            else:
                work = dist.irecv(tensor, dst, group=self.group, tag=msg.tag)
                self._recvs[msg] = (work, tensor)
        except Exception as exc:  # a dead peer makes the post itself raise on gloo
            if self.watch is not None:
                why = f"posting an operation with global rank {dst} in action {action} failed ({exc})"
                raise self.watch.error(self.watch.diagnose((dst,), why=why[:300]), why[:300]) from exc
            raise self.error("posting the send of" if op.is_send else "posting the receive of",
                             msg, op.peer, action, exc) from exc

    def _advance(self, peer: int, upto: int, action: Action, strict: bool) -> None:
        ops = self.plan.peer_ops[peer]
        while self._cursor[peer] <= upto:
            op = ops[self._cursor[peer]]
            if op.is_send and op.message not in self._ready:
                assert not strict, (
                    f"rank {self.plan.rank}: {op.message.describe()} to rank {peer} must be posted "
                    f"before a later operation needed by {action}, but it was not produced yet; "
                    "the message order is inconsistent with the action order")
                return
            self._post(op, action)
            self._cursor[peer] += 1

    def send(self, msg: Message, tensor: torch.Tensor, action: Action) -> None:
        """Queue ``tensor`` as ``msg`` and post every operation up to it for that peer."""
        peer, i = self._where[(True, msg)]
        self._ready[msg] = (tensor if tensor.is_contiguous() else tensor.contiguous(), action)
        self._advance(peer, i, action, strict=True)

    def prefetch(self, msgs: Sequence[Message], action: Action) -> None:
        """Post the receives of ``msgs`` early where the order allows (stops at unproduced sends)."""
        for msg in msgs:
            peer, i = self._where[(False, msg)]
            self._advance(peer, i, action, strict=False)

    def wait(self, msg: Message, action: Action) -> torch.Tensor:
        """Post up to ``msg`` if needed, wait for it and return its buffer."""
        if msg not in self._recvs:
            peer, i = self._where[(False, msg)]
            self._advance(peer, i, action, strict=True)
        work, buf = self._recvs.pop(msg)
        peer, i = self._where[(False, msg)]
        self._wait(work, "waited for", msg, peer, action)
        if self.blocking_waits:
            self._release_sends(peer, i)
        return buf

    def _release_sends(self, peer: int, before: int) -> None:
        """Wait for and drop the sends to ``peer`` ordered before position ``before`` of the
        operations with it: the peer has posted their receives ([Note: releasing sends])."""
        keep = []
        for s in self._sends:
            to, pos = self._send_pos[s[1]]
            if to == peer and pos < before:
                self._wait(s[0], "sending", s[1], peer, s[2])
                del self._send_pos[s[1]]
            else:
                keep.append(s)
        self._sends = keep

    def _wait(self, work: dist.Work, what: str, msg: Message, peer: int, action: Action) -> None:
        """Wait for one transfer (with the timeout when waits block the host), counting the
        time in ``wait_seconds``; a failure names the peer, the message and the action."""
        t0 = time.perf_counter()
        try:
            if self.blocking_waits and self.watch is not None:
                g = self._global.get(peer, peer)
                verb = "receiving" if what == "waited for" else what
                self.watch.wait(work, f"{verb} the {msg.describe()} {'to' if 'send' in what else 'from'} "
                                f"global rank {g} in action {action}", (g,), sliced=False)
            elif self.blocking_waits:
                work.wait(self.timeout)
            else:
                work.wait()
        except RankFailedError:
            raise
        except Exception as exc:
            raise self.error(what, msg, peer, action, exc) from exc
        finally:
            self.wait_seconds += time.perf_counter() - t0

    def reap(self) -> None:
        """Drop finished sends (frees their buffers)."""
        keep = []
        for s in self._sends:
            if s[0].is_completed():
                self._send_pos.pop(s[1], None)
            else:
                keep.append(s)
        self._sends = keep

    def finish(self) -> None:
        """End of step: every operation must be posted; wait for all sends."""
        for peer, ops in self.plan.peer_ops.items():
            assert self._cursor[peer] == len(ops), (
                f"rank {self.plan.rank}: {len(ops) - self._cursor[peer]} operations with rank {peer} "
                f"were never posted (first: {ops[self._cursor[peer]].message.describe()})")
        assert not self._recvs, f"receives never consumed: {[m.describe() for m in self._recvs]}"
        sends, self._sends = self._sends, []
        self._send_pos = {}
        for work, msg, action, _ in sends:
            self._wait(work, "sending", msg, self._where[(True, msg)][0], action)
