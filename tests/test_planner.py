"""The auto-planner (fxsplit.planner, strategy="auto"): fits memory or says why not, picks what a
hand calculation picks on toy hardware, builds the plan it scored, and trains exactly on gloo.

The simulator's closed forms (1F1B, GPipe, interleaved, ZB-H1) are tested in
test_schedule_simulate.py; here: the planner's extension of a long schedule from a shorter
simulation, and its p = 1 step time."""

import math

import pytest
import torch

import fxsplit
from fxsplit.errors import PlanError
from fxsplit.graph.trace import trace
from fxsplit.planner import Candidate, Scorer, analyze, score, search
from fxsplit.testing import zoo

GPT = dict(n_layer=4, n_embd=64, n_head=4, batch_size=4, seq_len=16)


def toy(**kw):
    """A toy device: 1 TFLOP/s, 100 GB/s, 4 per node, links as given (default: free)."""
    base = dict(flops_per_s=1e12, bytes_per_s=1e11, devices_per_node=4, intra_node_bytes_per_s=1e15,
                inter_node_bytes_per_s=1e15, compute_dtype="fp32", name="toy")
    base.update(kw)
    return fxsplit.Hardware(**base)


@pytest.fixture(scope="module")
def workload():
    model, args, _ = zoo.make_gpt(**GPT)
    return analyze(trace(model, args, decompose_attention=True), world_size=4, hardware=toy())


@pytest.mark.parametrize("limit", [1.2e6, 1.6e6, 3e6, None])
def test_search_never_returns_a_plan_over_the_memory_limit(workload, limit):
    r = search(workload, world_size=4, global_batch=8, hardware=toy(), memory_limit=limit)
    cap = math.inf if limit is None else limit
    assert r.scores and all(s.fits and s.memory.total <= cap for s in r.scores)
    assert r.best is r.scores[0] and r.best.step_time == min(s.step_time for s in r.scores[:8])
    for desc, why in r.rejected:
        assert why, desc
    over = [w for _, w in r.rejected if w.startswith("memory")]
    assert (limit is None) == (not over)
    text = str(r)
    assert "best first" in text and r.best.candidate.schedule in text


def test_nothing_fits_raises_naming_the_tightest_candidate(workload):
    with pytest.raises(PlanError, match=r"tightest, dp=1 tp=\d.*needs .*params .*optimizer"):
        search(workload, world_size=4, global_batch=8, hardware=toy(), memory_limit=2e5)


def test_model_fits_and_compute_dominates_picks_pure_data_parallel(workload):
    # slow device, real link latency: every rank computing its own samples has no bubble and no
    # per-layer collectives; one gradient all-reduce per step is all it pays
    hw = toy(flops_per_s=1e9, bytes_per_s=1e10, intra_node_latency_s=2e-5, inter_node_latency_s=2e-5,
             intra_node_bytes_per_s=1e10, inter_node_bytes_per_s=1e10)
    c = search(workload, world_size=4, global_batch=16, hardware=hw).best.candidate
    assert (c.dp, c.tp, c.pp) == (4, 1, 1)


def test_fast_links_and_small_memory_pick_tensor_parallelism(workload):
    # a replica does not fit 1.6 MB; with free links TP divides the work with no bubble, while
    # a 4-stage pipeline on a global batch of 4 runs m = 4 = p microbatches: a 3/7 bubble
    r = search(workload, world_size=4, global_batch=4, hardware=toy(), memory_limit=1.6e6)
    c = r.best.candidate
    assert (c.dp, c.tp, c.pp) == (1, 4, 1)
    assert all(s.candidate.dp == 1 or s.candidate.tp * s.candidate.pp > 1 for s in r.scores)


def test_slow_inter_node_links_put_the_pipeline_across_nodes(workload):
    # 2 devices per node, 1 ms and 100 MB/s between nodes: TP's per-layer all-reduces must stay in a
    # node and a replica needs 4 ranks' memory, so tp=2 inside each node, pp=2 across them
    hw = toy(devices_per_node=2, inter_node_bytes_per_s=1e8, inter_node_latency_s=1e-3)
    r = search(workload, world_size=4, global_batch=8, hardware=hw, memory_limit=1.6e6)
    c = r.best.candidate
    assert (c.tp, c.pp, c.dp) == (2, 2, 1)
    assert any("devices per node" in why for _, why in r.rejected)


def test_extended_simulation_matches_the_full_one(workload, monkeypatch):
    hw = toy(intra_node_latency_s=1e-5)
    scorer = Scorer(workload, hw, math.inf)
    c = Candidate(dp=1, tp=1, pp=2, stages_per_rank=1, schedule="1f1b", microbatches=32, microbatch_size=1,
                  activation_checkpointing="none", sequence_parallel=False)
    full = scorer.score(c, simulate=True)
    assert full.method == "simulated"
    monkeypatch.setattr(score, "MAX_SIMULATED_ACTIONS", 3 * 2 * 4)
    short = scorer.score(c, simulate=True)
    assert short.method.startswith("simulated at m=4 and 6")
    assert short.pipeline_time == pytest.approx(full.pipeline_time, rel=1e-9)
    one = scorer.score(Candidate(dp=4, tp=1, pp=1, stages_per_rank=1, schedule="1f1b", microbatches=3,
                                 microbatch_size=1, activation_checkpointing="none", sequence_parallel=False))
    sc = one.stage_costs
    assert one.pipeline_time == pytest.approx(3 * (sc["forward"][0] + sc["backward_input"][0] + sc["backward_weight"][0]))


def test_plan_auto_builds_the_scored_plan():
    model, args, _ = zoo.make_gpt(**GPT)
    hw = toy(devices_per_node=2, inter_node_bytes_per_s=1e8, inter_node_latency_s=1e-3)
    p = fxsplit.plan(model, args, strategy="auto", world_size=4, global_batch_size=8, hardware=hw,
                     memory_limit=1.6e6)
    best = p.search.best
    c = p.config
    assert c.world_size == 4, c
    assert (c.dp * c.dp_shard, c.tp, c.pp, c.schedule, c.microbatches) == (
        best.candidate.dp, best.candidate.tp, best.candidate.pp, best.candidate.schedule, best.candidate.microbatches)
    assert c.split_points == (p.search.split_points() or None) and c.num_stages == len(best.cuts) - 1
    assert p.predicted_step_time == best.step_time and p.predicted_memory["total"] <= 1.6e6
    assert "predicted step" in str(p)
    # the auto table fits 30 lines by default, everything behind table(None, None)
    assert len(str(p.search).splitlines()) <= 30
    full = p.search.table(limit=None, rejected_limit=None).splitlines()
    assert len(full) >= len(str(p.search).splitlines()) and len(full) >= 2 + len(p.search.scores)
    with pytest.raises(PlanError, match="chooses tp itself"):
        fxsplit.plan(model, args, strategy="auto", world_size=4, global_batch_size=8, tp=2)
    with pytest.raises(PlanError, match="needs world_size"):
        fxsplit.plan(model, args, strategy="auto")


def test_cli_plan_auto(tmp_path, capsys):
    from fxsplit.cli import main

    f = tmp_path / "m.py"
    f.write_text("from fxsplit.testing import zoo\n\ndef make():\n"
                 f"    return zoo.make_gpt(**{GPT!r})\n")
    dot, png = tmp_path / "g.dot", tmp_path / "pp.png"
    assert main(["plan", f"{f}:make", "--auto", "--world-size", "4", "--global-batch", "8",
                 "--hardware", "a100-80gb", "--dot", str(dot), "--timeline", str(png)]) == 0
    out = capsys.readouterr().out
    assert "auto plan for 4 ranks" in out and "fxsplit plan:" in out
    # --auto honours --dot and --timeline like a fixed layout
    assert dot.read_text().lstrip().startswith("digraph") and png.read_bytes()[:4] == b"\x89PNG"
    assert f"wrote the graph colored by stage to {dot}" in out


def _auto_case(rank, world):
    from test_parallelize import _train

    # the search's pick for 2 ranks (a 2-rank node, free links), trained like any fixed layout
    hw = toy(devices_per_node=2)
    return _train(rank, world, "gpt", {"batch_size": 4}, dict(strategy="auto", global_batch_size=4, hardware=hw))


@pytest.mark.dist
def test_parallelize_auto_matches_single_process():
    from fxsplit.testing import run_distributed
    from test_parallelize import _check, _reference

    results = run_distributed(_auto_case, 2, timeout=240)
    _check(results, *_reference("gpt", {"batch_size": 4}))


def test_ranks_sharing_a_host_are_bound_by_its_cores(workload):
    from fxsplit.planner import Calibration

    c = Candidate(dp=4, tp=1, pp=1, stages_per_rank=1, schedule="1f1b", microbatches=1, microbatch_size=2,
                  activation_checkpointing="none", sequence_parallel=False)
    free = Scorer(workload, toy(), math.inf).score(c)
    shared = Scorer(workload, toy(), math.inf, Calibration(host_cores=2)).score(c)
    assert shared.method.endswith("host-shared")
    # 4 ranks' compute and optimizer steps on 2 cores: each at half speed; the all-reduce as measured
    assert shared.step_time == pytest.approx(2 * (free.pipeline_time + free.optimizer_time) + free.dp_time)
    # a pipeline: simulated under processor sharing ([Note: host sharing]), at least the total
    # work over the cores and the pipeline alone; the closed form ranks by the first bound
    c = Candidate(dp=1, tp=1, pp=4, stages_per_rank=1, schedule="1f1b", microbatches=8, microbatch_size=1,
                  activation_checkpointing="none", sequence_parallel=False)
    free = Scorer(workload, toy(), math.inf).score(c, simulate=True)
    shared = Scorer(workload, toy(), math.inf, Calibration(host_cores=2)).score(c, simulate=True)
    assert shared.method == "simulated, host-shared"
    work = c.microbatches * sum(sum(free.stage_costs[k]) for k in ("forward", "backward_input", "backward_weight"))
    assert shared.pipeline_time >= max(work / 2, free.pipeline_time) * (1 - 1e-9)
    bound = Scorer(workload, toy(), math.inf, Calibration(host_cores=2)).score(c)
    assert bound.method.endswith("host-bound") and bound.pipeline_time == pytest.approx(work / 2)


def test_the_optimizer_step_is_priced_and_held_by_the_optimizer_used(workload):
    # [Note: optimizer cost]: Adam moves 7 x 4 bytes per parameter element and holds m and v;
    # plain SGD moves 3 x 4 and holds nothing
    c = Candidate(dp=2, tp=1, pp=2, stages_per_rank=1, schedule="1f1b", microbatches=4, microbatch_size=2,
                  activation_checkpointing="none", sequence_parallel=False)
    adam = Scorer(workload, toy(), math.inf).score(c)
    sgd = Scorer(workload, toy(), math.inf, optimizer="sgd").score(c)
    assert sgd.optimizer_time == pytest.approx(adam.optimizer_time * 12 / 28)
    assert adam.memory.optimizer > 0 and sgd.memory.optimizer == 0
    assert sgd.step_time - sgd.optimizer_time == pytest.approx(adam.step_time - adam.optimizer_time)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        Scorer(workload, toy(), math.inf, optimizer="lamb")


def test_a_layout_whose_balanced_split_is_over_the_limit_is_partitioned_to_fit(workload):
    # interleaved 1F1B on 2 ranks: the time-balanced cuts put 2.57 MB on the busiest rank; other
    # cuts of the same layout hold 2.40 MB. Under a 2.5 MB limit the layout is searched with those
    c = Candidate(dp=2, tp=1, pp=2, stages_per_rank=2, schedule="interleaved_1f1b", microbatches=4,
                  microbatch_size=2, activation_checkpointing="none", sequence_parallel=False)
    balanced = Scorer(workload, toy(), math.inf).score(c)
    limit = 0.97 * balanced.memory.total
    capped = Scorer(workload, toy(), limit).score(c)
    assert capped.fits and capped.memory.total <= limit < balanced.memory.total
    assert capped.cuts != balanced.cuts and capped.step_time >= balanced.step_time
    # top_k past the space: no candidate is skipped by its bound ([Note: search strategy]), so c is scored
    r = search(workload, world_size=4, global_batch=16, hardware=toy(), memory_limit=limit, top_k=10**6)
    assert c in {s.candidate for s in r.scores}
    assert all(s.fits and s.memory.total <= limit for s in r.scores)
    assert r.repartitioned[0] >= 1 and "re-partitioned under the memory limit" in r.table()
