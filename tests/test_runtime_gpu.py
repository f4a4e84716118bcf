"""Pipeline runtime on CUDA: one GPU (every stage on one rank) and NCCL with 2 GPUs, compared
with the unsplit model like the gloo tests (see test_runtime_cases.run_case)."""

from __future__ import annotations

import pytest
import torch

from fxsplit.testing import run_distributed

from test_runtime_cases import run_case

pytestmark = [pytest.mark.gpu, pytest.mark.dist]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")
def test_single_gpu_matches_model():
    bad, checks = [], 0
    for model in ("gpt", "skip"):
        for builder in ("hand", "graph"):
            got, n = run_case(model=model, schedule="interleaved_1f1b", p=1, v=2, m=3, batch=7,
                              steps=2, check_forward=True, builder=builder, device="cuda")
            bad += got
            checks += n
    assert not bad, "\n".join(bad)
    assert checks > 20


def _nccl_cases(rank: int, world_size: int) -> tuple[list[str], int]:
    torch.cuda.set_device(rank)
    bad, checks = [], 0
    for model in ("gpt", "skip"):
        for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)):
            got, n = run_case(model=model, schedule=schedule, p=2, v=v, m=3, batch=5, rank=rank,
                              check_forward=True, device=f"cuda:{rank}")
            bad += got
            checks += n
    return bad, checks


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA devices for NCCL (found {})".format(torch.cuda.device_count()))
def test_nccl_two_gpus_matches_model():
    results = run_distributed(_nccl_cases, 2, backend="nccl", timeout=300.0)
    assert not [b for bad, _ in results for b in bad], results
    assert all(n > 20 for _, n in results)
