"""Pipeline runtime on gloo with 2 and 4 processes: loss and every gradient after 3 SGD steps
equal the unsplit model, for each schedule, v in {1, 2}, m in {p, 2p, p+1}, on a tied-weight
GPT and a model whose skip connection crosses every stage; forward-only inference equals the
model; a rank that fails makes its peer raise a PipelineError naming it instead of hanging.
Each group of cases runs in ONE process-group launch (spawning costs seconds)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fxsplit.runtime import PipelineError, PipelineRuntime
from fxsplit.pipeline.rank_plan import RankPlan
from fxsplit.schedule import build
from fxsplit.schedule.ir import Action, ActionKind
from fxsplit.testing import run_distributed

from test_runtime_cases import gpt_model, run_case, skip_model, skip_stages

pytestmark = pytest.mark.dist


def _cases(p: int) -> list[dict]:
    cases = []
    for schedule, vs in (("gpipe", (1, 2)), ("1f1b", (1,)), ("interleaved_1f1b", (2,)), ("zb_h1", (1,))):
        for v in vs:
            for m in (p, 2 * p, p + 1):
                for model in ("gpt", "skip"):
                    batch = 2 * p + 1  # never a multiple of m: unequal microbatches everywhere
                    cases.append(dict(model=model, schedule=schedule, p=p, v=v, m=m, batch=batch,
                                      check_forward=(m == p)))
    if p == 2:  # stages from fxsplit.trace + build_stages (tied weights under two FQNs, skips)
        for model in ("gpt", "skip"):
            for schedule, v, m in (("1f1b", 1, 3), ("interleaved_1f1b", 2, 4)):
                cases.append(dict(model=model, schedule=schedule, p=p, v=v, m=m, batch=2 * p + 1,
                                  check_forward=True, builder="graph"))
    return cases


def _run_cases(rank: int, world_size: int, cases: list[dict], subgroups: bool) -> tuple[list[str], list[dict], dict | None]:
    """(mismatches, one run_case report per case, the subgroup case's report or None)."""
    torch.set_num_threads(1)
    bad, reports = [], []
    for case in cases:
        report: dict = {}
        got_bad, _ = run_case(rank=rank, group=None, report=report, **case)
        bad += got_bad
        reports.append(report)
    sub = None
    if subgroups:
        got_bad, sub = _pp_subgroup_case(rank, world_size)
        bad += got_bad
    return bad, reports, sub


def _model_param_names(model: str) -> set[str]:
    make_model = {"gpt": gpt_model, "skip": skip_model}[model]
    return {n for n, _ in make_model().named_parameters()}  # tied: once, as in run_case


@pytest.mark.parametrize("p", [2, 4])
def test_pipeline_matches_unsplit_model(p):
    cases = _cases(p)
    results = run_distributed(_run_cases, p, cases, p == 4, timeout=300.0)
    bad = [line for rank_bad, _, _ in results for line in rank_bad]
    assert not bad, "\n".join(bad)
    # every rank compared its loss at every step and the gradients of every parameter its stages
    # hold (counted apart from the losses), and the ranks together covered every parameter
    for i, case in enumerate(cases):
        held = [reports[i]["grad_params"] for _, reports, _ in results]
        for rank, (_, reports, _) in enumerate(results):
            rep = reports[i]
            assert rep["loss_checks"] == rep["steps"] >= 1, (case, rank, rep)
            assert rep["grad_params"], (case, rank, "compared no gradient")
            assert rep["grad_checks"] == rep["steps"] * len(rep["grad_params"]), (case, rank, rep)
        missing = _model_param_names(case["model"]) - set().union(*held)
        assert not missing, (case, "no rank compared the gradients of", sorted(missing))
    if p == 4:  # two pipelines of two ranks: each covers the whole model on its own
        for pipeline in ((0, 1), (2, 3)):
            subs = [results[r][2] for r in pipeline]
            assert all(s["grad_checks"] == len(s["grad_params"]) > 0 for s in subs), subs
            assert set().union(*(s["grad_params"] for s in subs)) == _model_param_names("skip"), pipeline


def _pp_subgroup_case(rank: int, world_size: int) -> tuple[list[str], dict]:
    """Two independent 2-rank pipelines on subgroups {0, 1} and {2, 3} of a 4-process world
    (as with dp=2, pp=2): group ranks differ from global ranks, and stages are placed by a custom
    rank_of_stage (stages 0, 2 on pipeline rank 1; stages 1, 3 on pipeline rank 0)."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both, in order
    group = groups[rank // 2]
    owner = {0: 1, 1: 0, 2: 1, 3: 0}
    pp_rank = dist.get_rank(group)
    ref, pipe = skip_model(), skip_model()
    mods, ios, meta, _ = skip_stages(pipe, 4)
    sched = []
    for r in range(2):  # depth-first: each rank runs its stages in order per microbatch
        mine = [s for s in range(4) if owner[s] == r]
        row = [Action(s, ActionKind.FORWARD, mb) for mb in range(3) for s in mine]
        row += [Action(s, ActionKind.BACKWARD, mb) for mb in range(3) for s in reversed(mine)]
        sched.append(row)
    rp = RankPlan.build(ios, sched, rank=pp_rank, num_ranks=2, input_meta=meta, stage_ranks=owner)
    rt = PipelineRuntime(rp, {s: mods[s] for s in range(4) if owner[s] == pp_rank}, group=group,
                         loss_fn=nn.functional.mse_loss, device="cpu", timeout=60.0)
    g = torch.Generator().manual_seed(rank // 2)  # the two pipelines see different data
    x, y = torch.randn(6, 16, generator=g), torch.randn(6, 16, generator=g)
    loss = rt.step((x,), target=y)
    want = nn.functional.mse_loss(ref(x), y)
    want.backward()
    refp = dict(ref.named_parameters())
    bad, report = [], {"grad_checks": 0, "grad_params": set()}
    if abs(loss.item() - want.item()) > 1e-6:
        bad.append(f"subgroup rank {rank}: loss {loss.item()} != {want.item()}")
    for s in range(4):
        if owner[s] != pp_rank:
            continue
        for name, prm in mods[s].named_parameters():
            report["grad_checks"] += 1
            report["grad_params"].add(name)
            if prm.grad is None or not torch.allclose(prm.grad, refp[name].grad, rtol=1e-5, atol=1e-6):
                bad.append(f"subgroup rank {rank}: grad {name} differs")
    return bad, report


class _Faulty(nn.Module):
    """Runs ``inner``, but on its second call (microbatch 1) raises, or sleeps ``hang`` seconds."""

    def __init__(self, inner: nn.Module, hang: float = 0.0):
        super().__init__()
        self.inner, self.hang, self.calls = inner, hang, 0

    def forward(self, *args):
        self.calls += 1
        if self.calls == 2:
            if not self.hang:
                raise RuntimeError("injected failure in the stage forward")
            time.sleep(self.hang)
        return self.inner(*args)


def _one_failure(rank: int, group, timeout: float, hang: float) -> dict:
    mods, ios, meta, _ = skip_stages(skip_model(), 2)
    if rank == 1:
        mods[1] = _Faulty(mods[1], hang)
    rp = RankPlan.build(ios, build("1f1b", 2, 4), rank=rank, num_ranks=2, input_meta=meta)
    rt = PipelineRuntime(rp, {rank: mods[rank]}, group=group, loss_fn=nn.functional.mse_loss, device="cpu",
                         timeout=timeout)
    t0 = time.monotonic()
    try:
        rt.step((torch.randn(8, 16),), target=torch.randn(8, 16))
    except PipelineError as exc:
        return dict(kind="PipelineError", text=str(exc), peer=exc.peer, action=exc.action,
                    microbatch=exc.microbatch, seconds=time.monotonic() - t0)
    except Exception as exc:  # noqa: BLE001 -- the failing rank reports its own error
        return dict(kind=type(exc).__name__, text=str(exc), notes=getattr(exc, "__notes__", []),
                    seconds=time.monotonic() - t0)
    return dict(kind="none", seconds=time.monotonic() - t0)


def _failure_cases(rank: int, world_size: int, timeout: float) -> tuple[dict, dict]:
    # 1. rank 1 hangs (alive, silent) on a subgroup: rank 0 times out naming it, aborts the
    #    subgroup, and rank 1 then fails naming rank 0 when it sends again.
    hang = _one_failure(rank, dist.new_group([0, 1]), timeout=2.0, hang=5.0)
    # 2. rank 1 raises on the default group: it aborts the group and rank 0 fails at once.
    crash = _one_failure(rank, None, timeout=timeout, hang=0.0)
    return hang, crash


def test_failing_or_silent_rank_makes_peer_raise_naming_it():
    timeout = 20.0
    (h0, c0), (h1, c1) = run_distributed(_failure_cases, 2, timeout, timeout=90.0)
    # silent peer: a timeout, named
    assert h0["kind"] == "PipelineError" and h0["peer"] == 1, h0
    assert "timed out after 2 s" in h0["text"] and f"action {h0['action']}" in h0["text"], h0
    assert "from pipeline rank 1 (global rank 1), which timed out" in h0["text"], h0  # the silent rank, named
    assert h0["text"].startswith("pipeline rank 0 (global rank 0): "), h0  # and the rank that waited
    assert h0["action"] == "0B1" and h0["microbatch"] == 1, h0  # waits for the gradient of 1B1
    assert h0["seconds"] < 4.5, h0
    assert h1["kind"] == "PipelineError" and h1["peer"] == 0, h1  # the late peer fails too
    assert "pipeline rank 0 (global rank 0)" in h1["text"], h1
    # crashing peer: its own error carries a note; the other rank fails fast, naming it
    assert c1["kind"] == "RuntimeError" and "injected failure" in c1["text"], c1
    assert any("pipeline rank 1 failed while running action 1F1" in n for n in c1["notes"]), c1
    assert c0["kind"] == "PipelineError" and c0["peer"] == 1, c0
    assert "pipeline rank 1" in c0["text"] and f"microbatch {c0['microbatch']}" in c0["text"], c0
    assert c0["action"].startswith("0") and c0["action"] in c0["text"], c0
    assert c0["seconds"] < timeout / 2, f"rank 0 waited {c0['seconds']:.1f} s: the abort did not reach it"
