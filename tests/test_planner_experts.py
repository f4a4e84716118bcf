"""The auto-planner with expert parallelism: ep in the search space, the all-to-all in the step
time and its breakdown (hidden under DualPipeV's paired actions), each rank's E / ep experts and
the exchange buffers in the memory model. One process, no weights: the MoE is built on the meta
device and only traced."""

import dataclasses
import math

import pytest
import torch

import fxsplit
from fxsplit.graph.trace import trace
from fxsplit.planner import Candidate, Scorer, analyze, search
from fxsplit.planner.score import EXPERT_LOAD_MARGIN
from fxsplit.testing import zoo

_HW = fxsplit.Hardware.preset("a100-80gb")


@pytest.fixture(scope="module")
def moe():
    """A MoE GPT whose experts are most of its parameters (16 experts, top-2), traced once."""
    with torch.device("meta"):
        model, _, _ = zoo.make("moe", n_layer=4, num_experts=16, top_k=2, n_embd=1024, n_head=8,
                               expert_hidden=2048, block_size=256, vocab_size=1024)
    args = (torch.randint(0, 1024, (2, 256)),)
    gm = trace(model, args, None, decompose_attention=True)
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    return analyze(gm, world_size=8, hardware=_HW), experts


def _cand(**kw):
    base = dict(dp=4, tp=1, pp=1, stages_per_rank=1, schedule="1f1b", microbatches=8, microbatch_size=2,
                activation_checkpointing="none", sequence_parallel=False)
    return Candidate(**{**base, **kw})


def test_workload_finds_the_experts(moe):
    w, experts = moe
    assert w.num_experts == 16 and w.expert_params.sum() == experts
    assert w.a2a_bytes.lin.sum() > 0 and w.expert_units.any()


def test_search_picks_ep_and_its_breakdown_shows_the_all_to_all(moe):
    w, _ = moe
    result = search(w, world_size=8, global_batch=64, hardware=_HW)
    best = result.best
    assert best.candidate.ep > 1, result.table(6, 0)
    assert best.breakdown.ep_comm > 0 and "ep comm" in str(best.breakdown)
    assert f"ep{best.candidate.ep}" in result.table(1, 0)
    assert best.candidate.config_fields()["ep"] == best.candidate.ep
    assert any(s.candidate.ep == 1 for s in result.scores)  # ep was chosen over layouts without it


def test_memory_at_ep2_holds_half_the_expert_bytes(moe):
    w, experts = moe
    scorer = Scorer(w, _HW, math.inf)
    one, two = (scorer.score(_cand(ep=ep)) for ep in (1, 2))
    assert one.memory.params - two.memory.params == pytest.approx(experts / 2)
    assert one.breakdown.ep_comm == 0 and two.breakdown.ep_comm > 0
    # the exchange buffers and the busiest rank's extra rows (the margin) cost activations
    assert two.memory.activations > one.memory.activations
    assert EXPERT_LOAD_MARGIN > 1


def test_expert_gradients_are_reduced_only_over_their_replicas(moe):
    """dp = 4: at ep = 4 each expert block lives on one data rank and needs no reduction; at ep = 2
    it is all-reduced over its 2 replicas; everything else over all 4 data ranks."""
    w, experts = moe
    scorer = Scorer(w, _HW, math.inf)
    one, two, four = (scorer.score(_cand(ep=ep)) for ep in (1, 2, 4))
    dense = one.memory.params - experts
    assert four.memory.params == pytest.approx(dense + experts / 4)
    assert one.dp_time == pytest.approx(_HW.allreduce_time(one.memory.params, 4, _HW.same_node(0, 3)))
    assert four.dp_time == pytest.approx(_HW.allreduce_time(dense, 4, _HW.same_node(0, 3)))
    assert two.dp_time == pytest.approx(_HW.allreduce_time(dense, 4, _HW.same_node(0, 3))
                                        + _HW.allreduce_time(experts / 2, 2, _HW.same_node(0, 2)))


def test_per_layer_fsdp_leaves_expert_blocks_to_their_replicas(moe):
    """FSDP2 per layer, overlapped, dp = dp_shard = 4: FSDP gathers and reduce-scatters only what is
    not an expert block (the same at ep = 2 and 4); a block is all-reduced over its dp / ep replicas
    (2 at ep = 2, none at ep = 4), once per microbatch without a pipeline."""
    from fxsplit.planner.fsdp import FSDP2_PER_LAYER

    w, _ = moe
    scorer = Scorer(w, _HW, math.inf, fsdp=FSDP2_PER_LAYER)
    two, four = (_cand(ep=ep, dp_shard=4) for ep in (2, 4))
    total = lambda c: (lambda s: s.breakdown.dp_comm + s.breakdown.dp_overlapped)(scorer.score(c))  # noqa: E731
    per_byte = FSDP2_PER_LAYER.reduce_itemsize / w.param_itemsize
    blocks = [e for e in scorer.units_of(two).experts if e > 0]
    assert blocks
    replicas = sum(_HW.allreduce_time(e * per_byte, 2, _HW.same_node(0, 2)) for e in blocks)
    assert total(two) - total(four) == pytest.approx(two.microbatches * replicas, rel=1e-9)


def test_dualpipev_hides_part_of_the_all_to_all(moe):
    w, _ = moe
    scorer = Scorer(w, _HW, math.inf)
    dual = scorer.score(_cand(ep=2, pp=2, stages_per_rank=2, schedule="dualpipev"), simulate=True)
    zbv = scorer.score(_cand(ep=2, pp=2, stages_per_rank=2, schedule="zbv"), simulate=True)
    assert dual.breakdown.ep_overlapped > 0 and zbv.breakdown.ep_overlapped == 0
    assert dual.breakdown.ep_comm < zbv.breakdown.ep_comm
    for s in (dual, zbv):  # the parts add up to the step
        assert s.breakdown.step == pytest.approx(s.step_time, rel=1e-9)


def test_ep_is_not_searched_without_experts():
    model, args, _ = zoo.make_gpt(n_layer=2, n_embd=32, n_head=4, batch_size=2, seq_len=8)
    w = analyze(trace(model, args, decompose_attention=True), world_size=4, hardware=_HW)
    result = search(w, world_size=4, global_batch=8, hardware=_HW)
    assert w.num_experts == 0 and all(s.candidate.ep == 1 for s in result.scores)
    assert all(s.candidate.schedule != "dualpipev" for s in result.scores)


def test_ep_with_dp_shard_is_searched_and_keeps_the_expert_blocks_whole(moe):
    w, experts = moe
    result = search(w, world_size=8, global_batch=64, hardware=_HW, shard=True)
    both = [s for s in result.scores if s.candidate.ep > 1 and s.candidate.dp_shard > 1]
    assert both, result.table(6, 0)
    fields = both[0].candidate.config_fields()
    assert fields["dp"] * fields["dp_shard"] == both[0].candidate.dp and fields["ep"] == both[0].candidate.ep
    fxsplit.ParallelConfig(**fields)  # a layout the runtime takes
    scorer = Scorer(w, _HW, math.inf)
    plain, sharded = (scorer.score(_cand(ep=2, dp_shard=sh)) for sh in (1, 4))
    # FSDP divides the rest by dp_shard; each rank keeps its E / ep experts whole
    assert plain.memory.params - sharded.memory.params == pytest.approx((plain.memory.params - experts / 2) * 3 / 4)


def test_plan_memory_and_the_planner_count_the_exchange_alike():
    """One function ([Note: expert memory]) for Plan.memory() and the score: the exchange buffers of
    the largest MoE layer and the busiest ep rank's extra expert activations, EXPERT_LOAD_MARGIN times
    the even share eagerly, ep times under the graph split's padded exchange (compile=True)."""
    model, args, _ = zoo.make("moe", seed=0)
    w = analyze(trace(model, args, None), world_size=2, hardware=_HW)
    scorer = Scorer(w, _HW, math.inf)
    got = {}
    for compile_ in (False, True):
        plan = fxsplit.plan(model, args, dp=2, ep=2, compile=compile_, hardware=_HW)
        mine = plan.memory()[0]
        assert mine.exchange > 0 and mine.imbalance > 0
        got[compile_] = mine
        if not compile_:
            score = scorer.score(_cand(dp=2, ep=2, microbatches=1, microbatch_size=args[0].shape[0]))
            assert (mine.exchange, mine.imbalance) == pytest.approx((score.memory.exchange, score.memory.imbalance))
            one = fxsplit.plan(model, args, dp=2, hardware=_HW).memory()[0]
            assert one.exchange == one.imbalance == 0
            assert mine.peak - dataclasses.replace(mine, exchange=0.0).peak == pytest.approx(mine.exchange)  # held at the peak
    assert got[True].exchange == pytest.approx(got[False].exchange * 2 / EXPERT_LOAD_MARGIN)
    assert got[True].imbalance == pytest.approx(got[False].imbalance * (2 - 1) / (EXPERT_LOAD_MARGIN - 1))
