"""The communication plan of a pipeline: which messages each rank sends and receives, in which
order. Pure (no process group): part of :class:`fxsplit.Plan`, printed and tested in one process;
the runtime's channel (:mod:`fxsplit.runtime.p2p`) posts what it says.

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
    plans = plan_all_communication(schedule, all_stage_io, num_ranks=p)   # every rank, one pass
    print(plan)                                                            # per peer, in order

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

[Note: token messages]
Generation's decode program ([Note: decode schedules] in fxsplit.schedule.decode) feeds a model
input back: the token the last stage chose for virtual microbatch j becomes the token ids of
microbatch j + lag on the stage that reads them (``Feedback``). That is one more message kind,
``TOKEN``, from ``(S-1)Fj`` to ``sF(j + lag)``, planned like an activation (a dependency of the
receiving forward, a place in the per-peer order, a tag of its own), so the decode program is one
plan on every backend; its value is the model input the receiving stage reads (the runtime's
program writes it there, ``PipelineRuntime.run_program``), not a stage output.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from fxsplit.errors import PlanError, ScheduleError, StageBuildError
from fxsplit.pipeline.stage import StageIO
from fxsplit.schedule.ir import Action, ActionKind

__all__ = [
    "ACT",
    "GRAD",
    "TOKEN",
    "ActionComm",
    "CommOp",
    "Feedback",
    "CommPlan",
    "Message",
    "plan_all_communication",
    "plan_communication",
]

F = ActionKind.FORWARD
B = ActionKind.BACKWARD
BI = ActionKind.BACKWARD_INPUT
BW = ActionKind.BACKWARD_WEIGHT

ACT = "activation"
GRAD = "gradient"
TOKEN = "token"  # [Note: token messages]
# Largest tag the C++ API takes (int).
_MAX_TAG = 2**31 - 1


@dataclass(frozen=True, order=True)
class Message:
    """One value crossing between stages for one microbatch (see Terms: edge).

    ``stage``/``input`` name the consumer's input; ``src_stage`` sends it, ``dst_stage``
    receives it (for a gradient, the consumer sends back to the producer).
    """

    kind: str  # ACT, GRAD or TOKEN
    stage: int
    input: int
    microbatch: int
    src_stage: int
    dst_stage: int
    tag: int

    def describe(self) -> str:
        what = {ACT: "activation for", GRAD: "gradient of", TOKEN: "token ids for"}[self.kind]
        return (f"{what} stage {self.stage} input {self.input} (stage {self.src_stage} -> stage "
                f"{self.dst_stage}, microbatch {self.microbatch}, tag {self.tag})")


@dataclass(frozen=True)
class Feedback:
    """[Note: token messages]: the last stage's forward of microbatch j sends the token ids that
    input ``input`` of stage ``stage`` (a model input) reads in microbatch j + ``lag``."""

    stage: int
    input: int
    lag: int


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


def _edges(io: Sequence[StageIO]) -> list[tuple[int, int, int, int, bool]]:
    """(consumer c, input k, producer t, output j, requires_grad) for every stage-to-stage input."""
    out = []
    for c, sio in enumerate(io):
        for k, (src, meta) in enumerate(zip(sio.inputs, sio.input_meta)):
            if src.stage is None:
                continue
            if not 0 <= src.stage < c:
                raise StageBuildError(
                    f"stage {c} input {k} ({meta.name}) comes from stage {src.stage}, which is not an "
                    f"earlier stage; stage inputs must come from stages 0..{c - 1} or model inputs"
                )
            if src.index >= len(io[src.stage].outputs):
                raise StageBuildError(
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
            raise ScheduleError(
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


def _rank_rows(schedule: Sequence[Sequence[Action | None]], num_stages: int, num_ranks: int,
               rank_of_stage: Callable[[int], int], forward_only: bool) -> list[list[Action]]:
    """Each rank's actions without idle steps (only the F actions with ``forward_only``), checked
    to name existing stages that live on that rank."""
    if len(schedule) != num_ranks:
        raise ScheduleError(f"schedule has {len(schedule)} rank rows, expected num_ranks={num_ranks}")
    rows: list[list[Action]] = []
    for r, row in enumerate(schedule):
        kept = []
        for a in row:
            if a is None or (forward_only and a.kind is not F):
                continue
            if not 0 <= a.stage < num_stages:
                raise ScheduleError(f"schedule rank {r}: action {a} names stage {a.stage}, but there are "
                                    f"{num_stages} stages (0..{num_stages - 1})")
            if rank_of_stage(a.stage) != r:
                raise ScheduleError(f"schedule rank {r}: action {a} runs stage {a.stage}, which lives on "
                                    f"rank {rank_of_stage(a.stage)}; move it to that rank's list")
            kept.append(a)
        rows.append(kept)
    return rows


class _Wiring:
    """The stage graph's edges as seen by actions: what each action needs, receives and sends."""

    def __init__(self, io: Sequence[StageIO], actions: set[Action], feedback: Feedback | None = None):
        self.actions = actions
        self.feedback = feedback
        self.num_stages = len(io)
        self.num_microbatches = 1 + max((a.microbatch for a in actions), default=-1)
        self.producers: dict[int, list] = defaultdict(list)  # c -> edges into c
        self.consumers: dict[int, list] = defaultdict(list)  # t -> edges out of t
        for e in _edges(io):
            self.producers[e[0]].append(e)
            self.consumers[e[2]].append(e)
        self.max_inputs = max((len(s.inputs) for s in io), default=1) or 1
        if 2 * self.num_microbatches * self.num_stages * self.max_inputs > _MAX_TAG:
            raise PlanError(f"too many messages for 31-bit tags (m={self.num_microbatches}, stages="
                            f"{self.num_stages}, inputs={self.max_inputs}); use fewer microbatches")

    def tag(self, kind: str, c: int, k: int, mb: int) -> int:
        """Distinct per (direction, consumer stage, consumer input, microbatch); token messages
        above every activation's and gradient's."""
        if kind == TOKEN:
            return 2 * self.num_microbatches * self.num_stages * self.max_inputs + mb
        return ((mb * self.num_stages + c) * self.max_inputs + k) * 2 + (kind == GRAD)

    def _token(self, mb: int) -> Message:
        fb = self.feedback
        tag = self.tag(TOKEN, fb.stage, fb.input, mb)
        return Message(TOKEN, fb.stage, fb.input, mb, self.num_stages - 1, fb.stage, tag)

    def _token_recv(self, a: Action) -> list[Message]:
        fb = self.feedback
        return [self._token(a.microbatch)] if fb and a.stage == fb.stage and a.microbatch >= fb.lag else []

    def _token_send(self, a: Action) -> list[Message]:
        fb = self.feedback
        last = fb is not None and a.stage == self.num_stages - 1 and a.microbatch + fb.lag < self.num_microbatches
        return [self._token(a.microbatch + fb.lag)] if last else []

    def grad_action(self, stage: int, mb: int) -> Action:
        for kind in (B, BI):
            if Action(stage, kind, mb) in self.actions:
                return Action(stage, kind, mb)
        raise ScheduleError(f"stage {stage} microbatch {mb}: the schedule has neither {stage}B{mb} nor "
                            f"{stage}I{mb}, which the backward of an earlier stage needs")

    def deps(self, a: Action) -> list[Action]:
        """The actions ``a`` waits for: producers' forwards, its own forward, consumers' backwards."""
        s, mb = a.stage, a.microbatch
        if a.kind is F:
            need = [Action(t, F, mb) for t in sorted({e[2] for e in self.producers[s]})]
            need += [Action(m.src_stage, F, mb - self.feedback.lag) for m in self._token_recv(a)]
        elif a.kind is BW:
            need = [Action(s, BI, mb)]
        else:
            need = [Action(s, F, mb)] + [self.grad_action(c, mb)
                                         for c in sorted({e[0] for e in self.consumers[s] if e[4]})]
        missing = [d for d in need if d not in self.actions]
        if missing:
            raise ScheduleError(f"action {a} needs {', '.join(map(str, missing))}, which the schedule "
                                "does not contain; every stage needs F (and B, or I and W) for every "
                                "microbatch")
        return need

    def messages(self, a: Action) -> tuple[list[Message], list[Message]]:
        """(received, sent) messages of action ``a``, sends in their posting order."""
        s, mb, tag = a.stage, a.microbatch, self.tag
        if a.kind is F:
            recv = [Message(ACT, c, k, mb, t, c, tag(ACT, c, k, mb)) for c, k, t, j, rg in self.producers[s]]
            send = [Message(ACT, c, k, mb, t, c, tag(ACT, c, k, mb)) for c, k, t, j, rg in self.consumers[s]]
            recv, send = recv + self._token_recv(a), send + self._token_send(a)
        elif a.kind is BW:
            recv, send = [], []
        else:
            recv = [Message(GRAD, c, k, mb, c, t, tag(GRAD, c, k, mb))
                    for c, k, t, j, rg in self.consumers[s] if rg]
            send = [Message(GRAD, c, k, mb, c, t, tag(GRAD, c, k, mb))
                    for c, k, t, j, rg in self.producers[s] if rg]
        return recv, send


def _assemble(rows: list[list[Action]], wiring: _Wiring, steps: Mapping[Action, int], num_ranks: int,
              rank_of_stage: Callable[[int], int]) -> tuple[CommPlan, ...]:
    """Every rank's CommPlan: per action its messages, per peer the ops in [Note: message order]."""
    peer_ops: list[dict[int, list[CommOp]]] = [defaultdict(list) for _ in range(num_ranks)]
    mine: list[list[ActionComm]] = [[] for _ in range(num_ranks)]
    for r, row in enumerate(rows):
        for a in row:
            recv, send = wiring.messages(a)
            for pos, msg in enumerate(send):
                dst = rank_of_stage(msg.dst_stage)
                if dst == r:
                    continue
                key = (steps[a], r, pos)
                peer_ops[r][dst].append(CommOp(True, dst, msg, key))
                peer_ops[dst][r].append(CommOp(False, r, msg, key))

            def split(msgs: list[Message], other: str) -> tuple[tuple[Message, ...], tuple[Message, ...]]:
                remote = tuple(x for x in msgs if rank_of_stage(getattr(x, other)) != r)
                return remote, tuple(x for x in msgs if rank_of_stage(getattr(x, other)) == r)

            (recvs, local_recvs), (sends, local_sends) = split(recv, "src_stage"), split(send, "dst_stage")
            mine[r].append(ActionComm(a, steps[a], recvs, sends, local_recvs, local_sends))
    return tuple(
        CommPlan(r, num_ranks, tuple(mine[r]),
                 {peer: tuple(sorted(ops, key=lambda op: op.key)) for peer, ops in peer_ops[r].items()},
                 wiring.num_microbatches)
        for r in range(num_ranks)
    )


def plan_all_communication(
    schedule: Sequence[Sequence[Action | None]],
    io: Sequence[StageIO],
    *,
    num_ranks: int,
    rank_of_stage: Callable[[int], int] | None = None,
    forward_only: bool = False,
    feedback: Feedback | None = None,
) -> tuple[CommPlan, ...]:
    """Every pipeline rank's `CommPlan` for ``schedule`` over stages wired by ``io`` (ALL stages),
    from one simulation. ``rank_of_stage`` defaults to ``s % num_ranks``. With ``forward_only``
    only the F actions are kept (inference). Raises ``ScheduleError`` (a ValueError) naming the action when an
    action runs on the wrong rank, a dependency is missing from the schedule, or the schedule
    deadlocks. See [Note: message order]; ``feedback``: [Note: token messages].
    """
    rank_of_stage = rank_of_stage or (lambda s: s % num_ranks)
    rows = _rank_rows(schedule, len(io), num_ranks, rank_of_stage, forward_only)
    wiring = _Wiring(io, {a for row in rows for a in row}, feedback)
    steps = _logical_steps(rows, wiring.deps)
    return _assemble(rows, wiring, steps, num_ranks, rank_of_stage)


def plan_communication(
    schedule: Sequence[Sequence[Action | None]],
    io: Sequence[StageIO],
    *,
    rank: int,
    num_ranks: int,
    rank_of_stage: Callable[[int], int],
    forward_only: bool = False,
) -> CommPlan:
    """Rank ``rank``'s `CommPlan` (see `plan_all_communication`)."""
    return plan_all_communication(schedule, io, num_ranks=num_ranks, rank_of_stage=rank_of_stage,
                                  forward_only=forward_only)[rank]
