"""The planner's FSDP policies ([Note: FSDP policies], [Note: FSDP overlap] in
fxsplit.planner.fsdp): fxsplit's own (one unit per stage, collectives exposed) is what a plan is
scored with; a published run's per-layer FSDP2 hides what its compute covers and holds two layers.

All in one process on the meta device."""

import dataclasses

import pytest
import torch

import fxsplit
from fxsplit.graph.trace import trace
from fxsplit.planner import Candidate, Scorer, analyze, search
from fxsplit.planner.fsdp import FSDP2_PER_LAYER, FXSPLIT_STAGES, Job, overlap, step_jobs, unit_of
from fxsplit.testing import zoo

A100 = fxsplit.Hardware.preset("a100-80gb")


def test_overlap_hides_what_the_compute_covers():
    # communication shorter than the compute it runs under: the first gather and the last
    # reduction alone are exposed
    jobs = [Job(10.0, before=3.0, after=2.0) for _ in range(4)]
    exposed, hidden = overlap(jobs)
    assert exposed == pytest.approx(3.0 + 2.0) and exposed + hidden == pytest.approx(4 * 5.0)
    # communication longer than the compute: the stream of collectives sets the time
    slow = [Job(1.0, before=3.0, after=2.0) for _ in range(4)]
    exposed, hidden = overlap(slow)
    assert exposed + 4 * 1.0 == pytest.approx(4 * 5.0)  # the step ends with the last collective
    assert overlap([Job(5.0)]) == (0.0, 0.0) and overlap([]) == (0.0, 0.0)
    # a gather is issued one job ahead: it waits for the job before the one it serves to start
    exposed, _ = overlap([Job(1.0), Job(1.0), Job(1.0, before=10.0)])
    assert exposed == pytest.approx(1.0 + 10.0 - 2.0)


def test_units_and_jobs_follow_torchtitans_wrapping():
    assert [unit_of(p) for p in ("model.layers.7", "model.layers.7.mlp", "model.embed_tokens", "lm_head", "")] == [
        "model.layers.7", "model.layers.7", "", "", ""]
    paths = ["model.embed", "model.layers.0", "model.layers.1", "lm_head"]
    units = [unit_of(p) for p in paths]
    g, r = [1.0, 2.0, 2.0, 1.0], [10.0, 20.0, 20.0, 10.0]
    jobs = step_jobs(units, [1.0] * 4, [2.0] * 4, g, r, [(0, 4)], pipeline=False)
    # forward: the root (embedding + head) gathered first, each layer before its compute
    assert [j.before for j in jobs[:4]] == [2.0, 2.0, 2.0, 0.0]
    # backward: the root gathered again, the last layer kept (not resharded), each layer reduced
    # after its backward, the root after the last
    assert [j.before for j in jobs[4:]] == [2.0, 0.0, 2.0, 0.0]
    assert [j.after for j in jobs[4:]] == [0.0, 20.0, 20.0, 20.0]
    piped = step_jobs(units, [1.0] * 4, [2.0] * 4, g, r, [(0, 2), (2, 4)], pipeline=True)
    assert sum(j.before for j in piped) == sum(g) and sum(j.after for j in piped) == sum(r)
    assert all(j.before == 0.0 for j in piped[4:])  # not resharded after forward under a pipeline


def _workload(width: int = 256, seq: int = 128):
    with torch.device("meta"):
        model = zoo.GPT(zoo.GPTConfig(n_layer=8, n_embd=width, n_head=4, vocab_size=512, block_size=seq))
    return analyze(trace(model, (torch.zeros(1, seq, dtype=torch.long, device="meta"),)), world_size=16,
                   hardware=A100)


def test_per_layer_policy_hides_fsdp_traffic_and_holds_less():
    w = _workload(1024, 1024)  # layers whose compute covers their gathers (16 x 1024 tokens a microbatch)
    mine, titan = Scorer(w, A100, A100.memory_bytes), Scorer(w, A100, A100.memory_bytes, fsdp=FSDP2_PER_LAYER)
    assert mine.fsdp is FXSPLIT_STAGES
    c = Candidate(dp=16, tp=1, pp=1, stages_per_rank=1, schedule="1f1b", microbatches=1, microbatch_size=16,
                  activation_checkpointing="none", sequence_parallel=False, dp_shard=16)
    a, b = mine.score(c), titan.score(c)
    assert a.breakdown.dp_overlapped == 0.0 and b.breakdown.dp_overlapped > 0
    assert b.breakdown.dp_comm < a.breakdown.dp_comm and b.step_time < a.step_time
    assert b.breakdown.step == pytest.approx(b.step_time, rel=1e-9)
    assert b.memory.gathered < a.memory.gathered and b.memory.params == a.memory.params
    # under a pipeline the stages are held whole (no resharding after forward): only the time differs
    piped = dataclasses.replace(c, dp=8, dp_shard=8, pp=2, microbatches=4, microbatch_size=4)
    assert titan.score(piped).memory.total == mine.score(piped).memory.total
    assert titan.score(piped).dp_time <= mine.score(piped).dp_time


def test_the_search_bound_holds_under_the_per_layer_policy():
    w = _workload()
    limit = A100.memory_bytes
    found = search(w, world_size=16, global_batch=64, hardware=A100, shard=True, fsdp=FSDP2_PER_LAYER,
                   top_k=10**6)
    scorer = Scorer(w, A100, limit, fsdp=FSDP2_PER_LAYER)
    sharded = [s for s in found.scores if s.candidate.dp_shard > 1]
    assert sharded
    for s in found.scores:
        assert scorer.lower_bound(s.candidate) <= scorer.score(s.candidate).step_time * (1 + 1e-9), s.candidate
