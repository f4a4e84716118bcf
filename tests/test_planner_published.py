"""The planner at scale: published runs predicted within 15% ([Note: published runs] in
fxsplit.testing.published), the step breakdown that explains a pick ([Note: step breakdown]),
a workload extended to the full layer count equal to a full trace, and any plan given
``hardware=`` and ``global_batch_size=`` scored like the auto pick ([Note: a layout's prediction]).

All in one process on the meta device: no process group, no weights."""

import dataclasses

import numpy as np
import pytest
import torch

import fxsplit
from fxsplit.errors import PlanError, UsageError
from fxsplit.graph.trace import trace
from fxsplit.planner import Scorer, analyze, search
from fxsplit.planner.workload import Linear, repeat_layers
from fxsplit.testing import published, zoo

A100 = fxsplit.Hardware.preset("a100-80gb")


def _meta_gpt(layers: int, **kw):
    cfg = dict(n_layer=layers, n_embd=128, n_head=4, vocab_size=512, block_size=64, tie_weights=True)
    cfg.update(kw)
    with torch.device("meta"):
        model = zoo.GPT(zoo.GPTConfig(**cfg))
    return model, (torch.zeros(1, 64, dtype=torch.long, device="meta"),)


def _workload(layers: int, world: int = 16):
    model, args = _meta_gpt(layers)
    return analyze(trace(model, args), world_size=world, hardware=A100)


def _equal(a, b) -> bool:
    if isinstance(a, Linear):
        return np.allclose(a.const, b.const) and np.allclose(a.lin, b.lin)
    if isinstance(a, np.ndarray):
        return a.shape == b.shape and np.allclose(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def test_repeat_layers_equals_the_workload_of_a_full_trace():
    full, extended = _workload(4, 8), repeat_layers(_workload(2, 8), 4)
    diff = [f.name for f in dataclasses.fields(full) if not _equal(getattr(full, f.name), getattr(extended, f.name))]
    assert not diff, diff
    a = search(full, world_size=8, global_batch=32, hardware=A100)
    b = search(extended, world_size=8, global_batch=32, hardware=A100)
    assert a.best.candidate == b.best.candidate and a.best.step_time == b.best.step_time


def test_repeat_layers_needs_two_layers():
    with pytest.raises(UsageError, match="needs a workload of >= 2 layers"):
        repeat_layers(_workload(1), 8)


def test_breakdown_adds_up_to_the_step_and_names_each_part():
    w = _workload(8)
    found = search(w, world_size=16, global_batch=64, hardware=A100)
    scorer = Scorer(w, A100, A100.memory_bytes)
    scores = list(found.scores[:10]) + [scorer.score(s.candidate, simulate=False) for s in found.scores[:10]]
    for s in scores:
        parts = s.breakdown.as_dict()
        assert parts["step"] == pytest.approx(s.step_time, rel=1e-9), s.candidate
        assert all(v >= -1e-12 for v in parts.values()), parts
        if s.candidate.pp == 1:
            assert parts["bubble"] == pytest.approx(0.0, abs=1e-12) and parts["pp_comm"] == 0.0
        if s.candidate.tp == 1:
            assert parts["tp_comm"] == 0.0
        if s.candidate.activation_checkpointing == "none":
            assert parts["recompute"] == 0.0
        else:
            assert parts["recompute"] > 0
        if s.candidate.dp == 1:
            assert parts["dp_comm"] == 0.0
    assert "step " in str(found.best.breakdown) and "compute" in str(found.best.breakdown)


def test_a_given_layout_carries_its_prediction_and_compares_with_the_pick():
    model, args = _meta_gpt(4)
    auto = fxsplit.plan(model, args, strategy="auto", world_size=4, global_batch_size=16, hardware=A100)
    assert auto.predicted_breakdown.step == pytest.approx(auto.predicted_step_time)
    c = auto.config
    # the pick's layout planned by hand: the same prediction, from the same model of the step
    mine = fxsplit.plan(model, args, dp=c.dp, tp=c.tp, pp=c.pp, stages_per_rank=c.stages_per_rank,
                        schedule=c.schedule, microbatches=c.microbatches,
                        activation_checkpointing=c.activation_checkpointing, sequence_parallel=c.sequence_parallel,
                        world_size=4, global_batch_size=16, hardware=A100)
    assert mine.predicted_step_time == pytest.approx(auto.predicted_step_time, rel=1e-9)
    other = fxsplit.plan(model, args, tp=2, pp=2, microbatches=4, stages_per_rank=2,
                         schedule="interleaved_1f1b", activation_checkpointing="full", world_size=4,
                         global_batch_size=16, hardware=A100)
    b = other.predicted_breakdown
    assert b.step == pytest.approx(other.predicted_step_time) and b.recompute > 0 and b.tp_comm > 0 and b.bubble > 0
    assert other.predicted_step_time >= auto.predicted_step_time  # the pick is the fastest the search saw
    assert other.predicted_memory["peak"] == max(m.peak for m in other.memory())
    text = str(other)
    assert "planner: predicted step" in text and "where the step goes" in text and len(text.splitlines()) <= 60
    assert fxsplit.plan(model, args, pp=2).predicted_step_time is None  # no hardware / batch: no prediction
    with pytest.raises(PlanError, match="world_size=8 but the layout .* uses 4 ranks"):
        fxsplit.plan(model, args, tp=2, pp=2, world_size=8, global_batch_size=16, hardware=A100)


_CACHE: dict = {}  # one workload per model shape, shared by the rows


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(published.RUNS))
def test_published_layouts_are_predicted_within_15_percent(name):
    """Every row of published.py (``benchmarks/planner.py paper`` prints them)."""
    run = published.RUNS[name]
    row = published.predict(run, cache=_CACHE, search_layouts=False)
    c = row.published.candidate
    assert (c.tp, c.pp, c.dp) == (run.t, run.p, run.d) and row.published.fits
    assert abs(row.error) <= 0.15, (f"{run.name}: predicted {100 * row.error:+.1f}% for the published layout "
                                    f"({run.source}); {row.published.breakdown}")
    if run.peak_gib:  # torchtitan's measured peak, against the memory model's (per-layer FSDP2)
        assert row.published.memory.total / 2**30 == pytest.approx(run.peak_gib, rel=0.10), run.name


def test_published_figures_are_the_cited_tables():
    # a typo in a cited figure would move the target: the table's own arithmetic must hold
    for run in published.RUNS.values():
        assert run.gpus == run.t * run.p * run.d and run.global_batch % run.d == 0, run.name
    assert published.RUNS["gpt-1008b"].tflops == 163 and published.RUNS["llama3-405b-16384"].tflops == 400


# the MFU torchtitan prints beside each bf16 row of docs/performance.md (@4d88a8a44): tokens/s/GPU x
# (6 N + 12 l h s) over the GPU's bf16 peak (A100 312, H100 SXM 989 TFLOP/s) must give it back
_TORCHTITAN_MFU = {"torchtitan-llama3-8b-64": (0.582, 312e12), "torchtitan-llama3-70b-64": (0.517, 312e12),
                   "torchtitan-llama3-405b-128": (0.290, 989e12)}


def _llama_params(run) -> float:
    h, l, kv = run.hidden, run.layers, run.kv_heads
    kv_width = kv * h // run.heads
    layer = 2 * h * h + 2 * h * kv_width + 3 * h * run.ffn + 2 * h
    return l * layer + 2 * run.vocab * h + h


def test_torchtitan_rows_agree_with_the_mfu_their_source_prints():
    for name, (mfu, peak) in _TORCHTITAN_MFU.items():
        run = published.RUNS[name]
        per_token = 6 * _llama_params(run) + 12 * run.layers * run.hidden * run.seq
        assert run.tokens_per_gpu_s * per_token / peak == pytest.approx(mfu, abs=0.005), name
    titan = [r for k, r in published.RUNS.items() if k.startswith("torchtitan")]
    assert len(titan) == 5 and all(r.gpus == r.t * r.d and r.shard and r.tokens_per_gpu_s > 0 for r in titan)


def test_the_planners_cuts_carry_no_recomputed_value():
    """An HF Llama's rotary tables and mask are recomputed on every stage ([Note: recompute, don't
    ship]): between two layers the workload's pp traffic is the hidden state alone."""
    from fxsplit.testing import hf_zoo

    model, args, kwargs = hf_zoo.meta_llama_70b(seq_len=64, vocab_size=256, num_hidden_layers=3, hidden_size=64,
                                                intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=64)
    w = analyze(trace(model, args, kwargs), world_size=4, hardware=A100)
    between = [k for k in range(1, w.num_groups) if w.group_paths[k].startswith("model.layers.")
               and w.group_paths[k - 1].startswith("model.layers.")]
    hidden = 64 * 64 * 2  # one sample's (seq, hidden) in bf16
    assert len(between) == 2 and all(w.cut.at(1)[k] == hidden for k in between), (w.group_paths, w.cut.at(1))


def test_the_search_bound_prunes_only_what_could_not_be_picked():
    # a tight memory limit, so that layouts need re-partitions, and the bound decides which do
    w = _workload(8, 16)
    limit = 0.6 * search(w, world_size=16, global_batch=64, hardware=A100).best.memory.total
    scorer = Scorer(w, A100, limit)
    exact = search(w, world_size=16, global_batch=64, hardware=A100, memory_limit=limit, top_k=10**6)
    fast = search(w, world_size=16, global_batch=64, hardware=A100, memory_limit=limit)
    assert exact.pruned == 0 and fast.pruned > 0
    closed = lambda s: scorer.score(s.candidate).step_time  # noqa: E731
    eighth = sorted(closed(s) for s in fast.scores)[7]
    kept = {s.candidate for s in fast.scores}
    missing = [s for s in exact.scores if s.candidate not in kept]  # fitting, but not re-partitioned by fast
    assert missing and all(closed(s) >= eighth for s in missing)
    for s in exact.scores:  # the bound is under every closed-form score
        assert scorer.lower_bound(s.candidate) <= closed(s) * (1 + 1e-9), s.candidate
