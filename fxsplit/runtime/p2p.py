"""Point-to-point layer of the pipeline runtime: which messages a rank sends and receives, in
which order, and a channel that posts them asynchronously with a timeout on every wait.

Terms
- **edge**: stage input ``(c, k)`` whose source is output ``j`` of an earlier stage ``t``
  (``StageIO.inputs[k] == ValueSource(t, j)``). Every edge carries one **activation** message
  ``t -> c`` per microbatch in the forward, and, when ``io[c].input_meta[k].requires_grad``, one
  **gradient** message ``c -> t`` in the backward. Model inputs (``ValueSource(None, i)``) are
  read locally on every rank and never sent. A skip connection is an edge like any other: the
  value goes straight from its producer to each consumer, never through the stages in between.
- **local** message: producer and consumer stage live on the same rank; handed over in memory.
- **logical step**: the step at which an action runs when every rank executes its own action
  list in order, as early as its dependencies allow (an ASAP simulation on the host; see
  `plan_communication`). A dependency always has a strictly smaller step.

Representative signature::

    plan = plan_communication(schedule, all_stage_io, rank=r, num_ranks=p, rank_of_stage=f)
    ch = P2PChannel(plan, group=pp_group, timeout_s=300.0, alloc=make_buffer)
    ch.send(msg, tensor, action); x = ch.wait(msg, action); ch.finish()

[Note: message order]
gloo matches a receive to a send by (source rank, tag); NCCL matches the operations between two
ranks by the order in which both sides post them (across both directions: a pair of ranks shares
one communicator and one stream). fxsplit therefore posts, on every rank and for every peer, the
operations between the two ranks in ONE global order that both sides compute alone from the
schedule and the stage wiring: sorted by (logical step of the SENDING action, sending rank,
position of the message among that action's sends). This order never makes a rank wait on
itself: an operation a rank needs at logical step T has a key below T, and every send with a
key below T was produced by an action the rank has already run. Sends are posted as soon as
they are produced (first posting the receives ordered before them); receives are posted early
(prefetch) up to the next few actions, stopping at a send not yet produced. Tags are distinct
per (direction, consumer stage, consumer input, microbatch), so gloo is order-free anyway; the
same order is used on every backend so that the gloo tests exercise the NCCL path.
"""

from __future__ import annotations

import datetime
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fxsplit.schedule.ir import Action, ActionKind
from fxsplit.pipeline.stage import StageIO
from fxsplit.errors import PipelineError

__all__ = [
    "ActionComm",
    "CommOp",
    "CommPlan",
    "Message",
    "P2PChannel",
    "PipelineError",
    "plan_communication",
]

F = ActionKind.FORWARD
B = ActionKind.BACKWARD
BI = ActionKind.BACKWARD_INPUT
BW = ActionKind.BACKWARD_WEIGHT

ACT = "activation"
GRAD = "gradient"
# Largest tag the C++ API takes (int).
_MAX_TAG = 2**31 - 1


@dataclass(frozen=True, order=True)
class Message:
    """One value crossing between stages for one microbatch (see Terms: edge).

    ``stage``/``input`` name the consumer's input; ``src_stage`` sends it, ``dst_stage``
    receives it (for a gradient, the consumer sends back to the producer).
    """

    kind: str  # ACT or GRAD
    stage: int
    input: int
    microbatch: int
    src_stage: int
    dst_stage: int
    tag: int

    def describe(self) -> str:
        what = "activation for" if self.kind == ACT else "gradient of"
        return (f"{what} stage {self.stage} input {self.input} (stage {self.src_stage} -> stage "
                f"{self.dst_stage}, microbatch {self.microbatch}, tag {self.tag})")


@dataclass(frozen=True)
class CommOp:
    """A send or receive between this rank and ``peer`` (pipeline-group ranks)."""

    is_send: bool
    peer: int
    message: Message
    key: tuple[int, int, int]


@dataclass(frozen=True)
class ActionComm:
    """The messages one action of this rank consumes (``recvs``) and produces (``sends``);
    ``local_*`` stay on this rank, the others cross to a peer."""

    action: Action
    step: int
    recvs: tuple[Message, ...]
    sends: tuple[Message, ...]
    local_recvs: tuple[Message, ...]
    local_sends: tuple[Message, ...]


@dataclass(frozen=True)
class CommPlan:
    """Everything rank ``rank`` needs to run its actions: per action its messages, and per peer
    the operations in the global order of [Note: message order]."""

    rank: int
    num_ranks: int
    actions: tuple[ActionComm, ...]
    peer_ops: Mapping[int, tuple[CommOp, ...]]
    num_microbatches: int

    def __str__(self) -> str:
        rows = [f"CommPlan rank {self.rank}: {len(self.actions)} actions"]
        for peer, ops in sorted(self.peer_ops.items()):
            rows.append(f"  peer {peer}: " + " ".join(
                f"{'S' if op.is_send else 'R'}{op.message.kind[0]}{op.message.stage}.{op.message.input}"
                f"@{op.message.microbatch}" for op in ops))
        return "\n".join(rows)


# --------------------------------------------------------------------------------------------
# Planning (pure: no process group)
# --------------------------------------------------------------------------------------------


def _edges(io: Sequence[StageIO]) -> list[tuple[int, int, int, int, bool]]:
    """(consumer c, input k, producer t, output j, requires_grad) for every stage-to-stage input."""
    out = []
    for c, sio in enumerate(io):
        for k, (src, meta) in enumerate(zip(sio.inputs, sio.input_meta)):
            if src.stage is None:
                continue
            if not 0 <= src.stage < c:
                raise ValueError(
                    f"stage {c} input {k} ({meta.name}) comes from stage {src.stage}, which is not an "
                    f"earlier stage; stage inputs must come from stages 0..{c - 1} or model inputs"
                )
            if src.index >= len(io[src.stage].outputs):
                raise ValueError(
                    f"stage {c} input {k} ({meta.name}) reads output {src.index} of stage "
                    f"{src.stage}, which has {len(io[src.stage].outputs)} outputs"
                )
            out.append((c, k, src.stage, src.index, bool(meta.requires_grad)))
    return out


def _schedule_grid(rows: Sequence[Sequence[Action]], marks: dict[int, int]) -> str:
    marked = [[f"[{a}]" if marks.get(r) == i else str(a) for i, a in enumerate(row)]
              for r, row in enumerate(rows)]
    return "\n".join(f"  rank {r}: " + " ".join(row) for r, row in enumerate(marked))


def _logical_steps(rows: list[list[Action]], deps: Callable[[Action], list[Action]]) -> dict[Action, int]:
    """ASAP simulation: step of every action when each rank runs its list in order."""
    need = {a: deps(a) for row in rows for a in row}
    step: dict[Action, int] = {}
    ptr = [0] * len(rows)
    t = 0
    remaining = sum(len(r) for r in rows)
    while remaining:
        ran = []
        for r, row in enumerate(rows):
            if ptr[r] < len(row):
                a = row[ptr[r]]
                if all(d in step and step[d] < t for d in need[a]):
                    ran.append((r, a))
        if not ran:  # nothing ran at step t, so nothing ever will
            stuck = {r: ptr[r] for r, row in enumerate(rows) if ptr[r] < len(row)}
            waits = "; ".join(
                f"rank {r} at {rows[r][i]} waits for "
                + ", ".join(str(d) for d in need[rows[r][i]] if d not in step)
                for r, i in stuck.items())
            raise ValueError(
                "the schedule deadlocks with these stages: no rank can run its next action ("
                f"{waits}).\n{_schedule_grid(rows, stuck)}\nReorder the actions so each one "
                "comes after the actions it needs (see fxsplit.schedule.validate)"
            )
        for r, a in ran:
            step[a] = t
            ptr[r] += 1
            remaining -= 1
        t += 1
    return step


def plan_communication(
    schedule: Sequence[Sequence[Action | None]],
    io: Sequence[StageIO],
    *,
    rank: int,
    num_ranks: int,
    rank_of_stage: Callable[[int], int],
    forward_only: bool = False,
) -> CommPlan:
    """Return rank ``rank``'s `CommPlan` for ``schedule`` over stages wired by ``io`` (ALL stages).

    With ``forward_only`` only the F actions are kept (inference). Raises ``ValueError`` naming
    the action when an action runs on the wrong rank, a dependency is missing from the schedule,
    or the schedule deadlocks. See [Note: message order].
    """
    num_stages = len(io)
    if len(schedule) != num_ranks:
        raise ValueError(f"schedule has {len(schedule)} rank rows, expected num_ranks={num_ranks}")
    rows: list[list[Action]] = []
    for r, row in enumerate(schedule):
        kept = []
        for a in row:
            if a is None or (forward_only and a.kind is not F):
                continue
            if not 0 <= a.stage < num_stages:
                raise ValueError(f"schedule rank {r}: action {a} names stage {a.stage}, but there are "
                                 f"{num_stages} stages (0..{num_stages - 1})")
            if rank_of_stage(a.stage) != r:
                raise ValueError(f"schedule rank {r}: action {a} runs stage {a.stage}, which lives on "
                                 f"rank {rank_of_stage(a.stage)}; move it to that rank's list")
            kept.append(a)
        rows.append(kept)
    all_actions = {a for row in rows for a in row}
    m = 1 + max((a.microbatch for a in all_actions), default=-1)
    edges = _edges(io)
    producers = defaultdict(list)  # c -> edges into c
    consumers = defaultdict(list)  # t -> edges out of t
    for e in edges:
        producers[e[0]].append(e)
        consumers[e[2]].append(e)
    max_inputs = max((len(s.inputs) for s in io), default=1) or 1
    if 2 * m * num_stages * max_inputs > _MAX_TAG:
        raise ValueError(f"too many messages for 31-bit tags (m={m}, stages={num_stages}, "
                         f"inputs={max_inputs}); use fewer microbatches")

    def tag(kind: str, c: int, k: int, mb: int) -> int:
        return ((mb * num_stages + c) * max_inputs + k) * 2 + (kind == GRAD)

    def grad_action(stage: int, mb: int) -> Action:
        for kind in (B, BI):
            if Action(stage, kind, mb) in all_actions:
                return Action(stage, kind, mb)
        raise ValueError(f"stage {stage} microbatch {mb}: the schedule has neither {stage}B{mb} nor "
                         f"{stage}I{mb}, which the backward of an earlier stage needs")

    def deps(a: Action) -> list[Action]:
        s, mb = a.stage, a.microbatch
        if a.kind is F:
            need = [Action(t, F, mb) for t in sorted({e[2] for e in producers[s]})]
        elif a.kind is BW:
            need = [Action(s, BI, mb)]
        else:
            need = [Action(s, F, mb)] + [grad_action(c, mb)
                                         for c in sorted({e[0] for e in consumers[s] if e[4]})]
        missing = [d for d in need if d not in all_actions]
        if missing:
            raise ValueError(f"action {a} needs {', '.join(map(str, missing))}, which the schedule "
                             "does not contain; every stage needs F (and B, or I and W) for every "
                             "microbatch")
        return need

    steps = _logical_steps(rows, deps)

    def messages(a: Action) -> tuple[list[Message], list[Message]]:
        """(received, sent) messages of action ``a``, sends in their posting order."""
        s, mb = a.stage, a.microbatch
        if a.kind is F:
            recv = [Message(ACT, c, k, mb, t, c, tag(ACT, c, k, mb)) for c, k, t, j, rg in producers[s]]
            send = [Message(ACT, c, k, mb, t, c, tag(ACT, c, k, mb)) for c, k, t, j, rg in consumers[s]]
        elif a.kind is BW:
            recv, send = [], []
        else:
            recv = [Message(GRAD, c, k, mb, c, t, tag(GRAD, c, k, mb))
                    for c, k, t, j, rg in consumers[s] if rg]
            send = [Message(GRAD, c, k, mb, c, t, tag(GRAD, c, k, mb))
                    for c, k, t, j, rg in producers[s] if rg]
        return recv, send

    peer_ops: dict[int, list[CommOp]] = defaultdict(list)
    mine: list[ActionComm] = []
    for r, row in enumerate(rows):
        for a in row:
            recv, send = messages(a)
            for pos, msg in enumerate(send):
                dst = rank_of_stage(msg.dst_stage)
                if dst == r:
                    continue
                key = (steps[a], r, pos)
                if r == rank:
                    peer_ops[dst].append(CommOp(True, dst, msg, key))
                elif dst == rank:
                    peer_ops[r].append(CommOp(False, r, msg, key))
            if r == rank:
                remote = lambda msgs, other: tuple(  # noqa: E731
                    x for x in msgs if rank_of_stage(getattr(x, other)) != rank)
                local = lambda msgs, other: tuple(  # noqa: E731
                    x for x in msgs if rank_of_stage(getattr(x, other)) == rank)
                mine.append(ActionComm(
                    a, steps[a], remote(recv, "src_stage"), remote(send, "dst_stage"),
                    local(recv, "src_stage"), local(send, "dst_stage")))
    ordered = {peer: tuple(sorted(ops, key=lambda op: op.key)) for peer, ops in peer_ops.items()}
    return CommPlan(rank, num_ranks, tuple(mine), ordered, m)


# --------------------------------------------------------------------------------------------
# Channel (posts the plan's operations on a process group)
# --------------------------------------------------------------------------------------------


class P2PChannel:
    """Posts one rank's sends and receives in the plan's per-peer order; waits with a timeout.

    ``alloc(message) -> Tensor`` makes the receive buffer (shape and dtype known from the plan).
    ``blocking_waits``: when True, ``Work.wait(timeout)`` blocks the host until the transfer is
    done or ``timeout_s`` passes (gloo; NCCL too, at the cost of host/device overlap); when False,
    ``Work.wait()`` only orders the current CUDA stream after the transfer and the process
    group's own timeout applies (NCCL's watchdog).
    """

    def __init__(self, plan: CommPlan, *, group: dist.ProcessGroup | None, timeout_s: float,
                 alloc: Callable[[Message], torch.Tensor], blocking_waits: bool = True):
        self.plan = plan
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

    def reset(self) -> None:
        """Start a new step: nothing posted."""
        self._cursor = {peer: 0 for peer in self.plan.peer_ops}
        self._ready: dict[Message, tuple[torch.Tensor, Action]] = {}
        self._recvs: dict[Message, tuple[dist.Work, torch.Tensor]] = {}
        self._sends: list[tuple[dist.Work, Message, Action, torch.Tensor]] = []
        self.wait_seconds = 0.0  # host time blocked in waits this step (the measured bubble)

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
                self._sends.append((work, msg, producer, tensor))
            else:
                work = dist.irecv(tensor, dst, group=self.group, tag=msg.tag)
                self._recvs[msg] = (work, tensor)
        except Exception as exc:  # a dead peer makes the post itself raise on gloo
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
        self._wait(work, "waited for", msg, self._where[(False, msg)][0], action)
        return buf

    def _wait(self, work: dist.Work, what: str, msg: Message, peer: int, action: Action) -> None:
        """Wait for one transfer (with the timeout when waits block the host), counting the
        time in ``wait_seconds``; a failure names the peer, the message and the action."""
        t0 = time.perf_counter()
        try:
            if self.blocking_waits:
                work.wait(self.timeout)
            else:
                work.wait()
        except Exception as exc:
            raise self.error(what, msg, peer, action, exc) from exc
        finally:
            self.wait_seconds += time.perf_counter() - t0

    def reap(self) -> None:
        """Drop finished sends (frees their buffers)."""
        self._sends = [s for s in self._sends if not s[0].is_completed()]

    def finish(self) -> None:
        """End of step: every operation must be posted; wait for all sends."""
        for peer, ops in self.plan.peer_ops.items():
            assert self._cursor[peer] == len(ops), (
                f"rank {self.plan.rank}: {len(ops) - self._cursor[peer]} operations with rank {peer} "
                f"were never posted (first: {ops[self._cursor[peer]].message.describe()})")
        assert not self._recvs, f"receives never consumed: {[m.describe() for m in self._recvs]}"
        sends, self._sends = self._sends, []
        for work, msg, action, _ in sends:
            self._wait(work, "sending", msg, self._where[(True, msg)][0], action)
