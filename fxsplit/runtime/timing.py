"""How long one ``step()`` took: :class:`StepTimer`.

[Note: step timing]
On the CPU the host runs every op, so the host's wall-clock time from the start of ``step()`` to
its end is the step. On a CUDA device the host only enqueues kernels: NCCL waits order streams
without blocking the host, so ``step()`` can return long before the device has finished, and a host
clock would measure how fast the work was enqueued. There a CUDA event is recorded on the current
stream at the start and at the end of the step (after the waits that order the gradient reductions
before it), and the step's time is the device time between them. Reading it waits for the end event
only then, so a training loop that never asks keeps the host running ahead of the device.

    timer = StepTimer(device); ...; timer.stop()
    timer.seconds        # host seconds on the CPU; on CUDA, the device's, after the step has finished
"""

from __future__ import annotations

import time

import torch

__all__ = ["StepTimer"]


class StepTimer:
    """The time of one step on ``device`` ([Note: step timing])."""

    def __init__(self, device: torch.device | str):
        self._cuda = torch.device(device).type == "cuda"
        self._t0 = time.perf_counter()
        self._host: float | None = None
        self._start = self._end = None
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def stop(self) -> None:
        self._host = time.perf_counter() - self._t0
        if self._cuda:
            self._end = torch.cuda.Event(enable_timing=True)
            self._end.record()

    @property
    def seconds(self) -> float:
        """The step's seconds (0.0 before :meth:`stop`); on CUDA this waits for the step's device work."""
        if self._host is None:
            return 0.0
        if self._end is None:
            return self._host
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1e3
