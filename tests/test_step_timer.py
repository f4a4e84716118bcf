"""[Note: step timing] in fxsplit.runtime.timing: host time on the CPU; on a GPU the device's time
between CUDA events, which a host clock cannot see (kernels run after step() returns)."""

import time

import pytest
import torch

from fxsplit.runtime.timing import StepTimer


def test_cpu_step_is_the_host_time():
    timer = StepTimer("cpu")
    assert timer.seconds == 0.0  # not stopped yet
    time.sleep(0.05)
    timer.stop()
    assert 0.05 <= timer.seconds < 5.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")
def test_cuda_step_is_the_device_time():
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    timer = StepTimer("cuda")
    torch.cuda._sleep(1_000_000_000)  # 1e9 GPU cycles: 0.5 s at 2 GHz, enqueued in microseconds
    timer.stop()
    host = time.perf_counter() - t0
    seconds = timer.seconds  # waits for the device
    assert host < 0.1 < 0.25 < seconds, (host, seconds)
