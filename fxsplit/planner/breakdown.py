"""Where a candidate's predicted step goes: :class:`Breakdown`, so a person can judge a pick.

Terms as in :mod:`fxsplit.planner.score`; the *busiest rank* is the pipeline rank with the
largest share of forward + backward work (the one the step waits for).

    s = scorer.score(candidate, simulate=True)
    print(s.breakdown)          # compute, recompute, tp / pp / dp communication, bubble, optimizer
    s.breakdown.as_dict()       # the same in seconds per optimizer step

[Note: step breakdown]
The predicted step is split, on the busiest rank, into parts that add up to it exactly:
- ``compute``: its forward and backward work over the m microbatches (the roofline of every op,
  per-node and per-action overheads included), less the two parts below;
- ``recompute``: the forwards activation checkpointing runs again in the backward (their TP
  collectives included);
- ``tp_comm``: tensor-parallel all-reduces and all-gathers of its work. Exposed: fxsplit's TP
  collectives sit between the ops that produce and consume them, so the model puts them on the
  critical path (``tp_overlapped`` is 0);
- ``ep_comm``: expert-parallel all-to-alls of its work (token dispatch and combine, forward and
  backward) left exposed; ``ep_overlapped``: those a schedule pairing one microbatch's forward with
  another's backward (DualPipeV) runs under the other action's compute;
- ``pp_comm``: point-to-point messages on the critical path: the 2(S-1) messages of the fill and
  drain (the closed form's count, at the slowest link; at most the rank's idle time);
  ``pp_overlapped``: the rest of the rank's message time (messages sent while it computes,
  asynchronous);
- ``bubble``: the rest of the busiest rank's idle time (the makespan less its work and the
  exposed messages), or under ranks sharing one host's cores the time it loses to them;
- ``dp_comm``: the data-parallel gradient reduction (and dp_shard's all-gathers) after the
  pipeline; exposed under fxsplit's own runtime (``dp_overlapped`` is 0), as Megatron-LM's 2021
  runs reduced after the backward; under a per-layer FSDP policy (a published run's FSDP2: [Note:
  FSDP policies] in fxsplit.planner.fsdp) the part its compute does not cover, and
  ``dp_overlapped`` the part it does;
- ``optimizer``: the optimizer step's memory traffic.
``step`` = compute + recompute + tp_comm + ep_comm + pp_comm + bubble + dp_comm + optimizer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fxsplit.graph.units import fmt_ms

__all__ = ["Breakdown"]

_EXPOSED = ("compute", "recompute", "tp_comm", "ep_comm", "pp_comm", "bubble", "dp_comm", "optimizer")


@dataclass(frozen=True)
class Breakdown:
    """Seconds per optimizer step of the busiest rank ([Note: step breakdown])."""

    compute: float = 0.0
    recompute: float = 0.0
    tp_comm: float = 0.0
    ep_comm: float = 0.0
    pp_comm: float = 0.0
    bubble: float = 0.0
    dp_comm: float = 0.0
    optimizer: float = 0.0
    tp_overlapped: float = 0.0
    pp_overlapped: float = 0.0
    dp_overlapped: float = 0.0
    ep_overlapped: float = 0.0

    @property
    def step(self) -> float:
        return sum(getattr(self, k) for k in _EXPOSED)

    def as_dict(self) -> dict[str, float]:
        return dict(asdict(self), step=self.step)

    def fractions(self) -> dict[str, float]:
        """Each exposed part as a fraction of the step."""
        total = self.step or 1.0
        return {k: getattr(self, k) / total for k in _EXPOSED}

    def __str__(self) -> str:
        total = self.step or 1.0
        parts = ", ".join(f"{k.replace('_', ' ')} {fmt_ms(getattr(self, k))} ({100 * getattr(self, k) / total:.0f}%)"
                          for k in _EXPOSED if getattr(self, k) > 0)
        hidden = ", ".join(f"{k.split('_')[0]} {fmt_ms(getattr(self, k))}"
                           for k in ("tp_overlapped", "pp_overlapped", "dp_overlapped", "ep_overlapped")
                           if getattr(self, k) > 0)
        return f"step {fmt_ms(self.step)}: {parts}" + (f"; overlapped (hidden): {hidden}" if hidden else "")
