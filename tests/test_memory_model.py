"""The per-rank memory model against measured memory, in one process: each saved storage counted
once ([Note: saved tensors by storage] in fxsplit.graph.saved), what a stage holds per microbatch
([Note: what a stage holds] in fxsplit.pipeline.memory) in every checkpointing mode, the peak of a
whole training step ([Note: memory model] in fxsplit.pipeline.memory), and the auto-planner
scoring with the same model. Measured with ``fxsplit.testing.memory.LiveBytes`` (every storage
an op allocates, until freed) and saved-tensor hooks."""

import dataclasses

import pytest
import torch
from torch import nn

import fxsplit
from fxsplit.graph.saved import first_saver_bytes, union_bytes, unit_saved
from fxsplit.api.memory import memory_limit_error
from fxsplit.errors import PlanError, SplitError
from fxsplit.pipeline.memory import RankMemory, worst
from fxsplit.pipeline.split import example_bindings
from fxsplit.planner import Memory
from fxsplit.testing import zoo
from fxsplit.testing.memory import LiveBytes


class _ThreeProjections(nn.Module):
    """One layer norm output read by three linears (q, k, v): autograd keeps it once."""

    def __init__(self, d=64):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        h = self.ln(x)
        return self.q(h) * self.k(h) + self.v(h)


def _saved_storage_bytes(fn, params):
    """Bytes of the distinct non-parameter storages autograd saves while ``fn`` runs."""
    seen, weights = {}, {p.untyped_storage().data_ptr() for p in params}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in weights:  # a weight's transposed view shares its storage
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_a_tensor_saved_by_three_ops_is_counted_once():
    model = _ThreeProjections()
    x = torch.randn(4, 16, 64, requires_grad=True)
    plan = fxsplit.plan(model, (x,))
    gm = plan.stage_graph(0)
    units = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    binds = example_bindings(gm)
    held = unit_saved(gm, units, binds)
    per_op = sum(float(n.meta["fxsplit"].cost.evaluate(binds).saved_bytes) for n in units)
    once = sum(first_saver_bytes(held))
    assert once == union_bytes(held)
    h = 4 * 16 * 64 * 4
    assert per_op - once == 2 * h  # the layer norm output was in three linears' saved bytes
    measured = _saved_storage_bytes(lambda: gm(x), gm.parameters())
    assert abs(once - measured) <= 0.1 * measured, (once, measured)


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_what_each_stage_holds_per_microbatch_is_predicted(mode):
    model, (x,), _ = zoo.make_gpt(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=32, seq_len=32,
                                  batch_size=2, seed=0)
    plan = fxsplit.plan(model, (x,), pp=2, activation_checkpointing=mode)
    args = (x,)
    for s in range(2):
        gm = plan.stage_graph(s)
        with LiveBytes() as mem:  # the received values are allocated by the step, as the runtime's buffers are
            ins = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
            out = gm(*ins)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            if s == 1:  # the last stage keeps the loss's saved tensor, not its outputs
                logits = outs[0]
                del out, outs
                loss = zoo.cross_entropy_loss(logits, torch.randint(0, logits.shape[-1], logits.shape[:-1]))
                del logits
            held = mem.live
        predicted = plan.split.stages[s].activation_bytes
        assert abs(predicted - held) <= 0.15 * held, (mode, s, predicted, held)
        if s == 0:
            args = tuple(o.detach() for o in outs)
    del loss


@pytest.mark.parametrize("mode", ["none", "full"])
def test_a_tensor_parallel_stage_holds_what_is_predicted(mode):
    """tp rank 0's stages of transformer blocks at tp=2, run in one process with the collectives
    unbound: the fused q/k/v column linear keeps its input once (not once per linear), a region
    collective (reduce_from_region) keeps nothing, nor does a dropout of p=0 (torch returns its
    input). Each was charged before, 1.5x the measured bytes on stage 0."""
    from fxsplit.api.materialize import materialize_stage

    cfg = zoo.GPTConfig(n_embd=64, n_head=4, block_size=32)
    model = nn.Sequential(*[zoo.Block(cfg) for _ in range(4)])
    args = (torch.randn(2, 32, 64),)
    plan = fxsplit.plan(model, args, pp=2, tp=2, activation_checkpointing=mode)
    for s in range(2):
        gm = materialize_stage(plan, s, tp_rank=0, source=model)
        with LiveBytes() as mem:
            out = gm(*[a.clone().requires_grad_() for a in args])
            held = mem.live
        predicted = plan.split.stages[s].activation_bytes
        assert abs(predicted - held) <= 0.02 * held, (mode, s, predicted, held)
        args = tuple(o.detach() for o in (out if isinstance(out, (tuple, list)) else (out,)))


@pytest.mark.parametrize("batch", [2, 8])
def test_plan_memory_peak_matches_a_measured_step(batch):
    model, args, _ = zoo.make("gpt", batch_size=batch, seq_len=64, n_embd=128, n_layer=2, n_head=4,
                              vocab_size=512, block_size=64)
    plan = fxsplit.plan(model, args, verify=False)
    (pred,) = plan.memory()
    gm = plan.stage_graph(0)
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-3)
    y = torch.randint(0, 512, args[0].shape)

    def step():
        out = gm(*args)
        zoo.cross_entropy_loss(out[0] if isinstance(out, (tuple, list)) else out, y).backward()
        opt.step()

    step()  # creates the Adam state
    opt.zero_grad(set_to_none=True)
    at_rest = sum(p.nbytes for p in gm.parameters()) + sum(
        v.nbytes for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim())
    with LiveBytes() as mem:
        step()
    measured = at_rest + mem.peak
    assert abs(pred.params + pred.optimizer - at_rest) <= 1e-3 * at_rest
    assert abs(pred.peak - measured) <= 0.10 * measured, (pred, measured)


def test_the_auto_pick_reports_its_plans_memory_everywhere():
    """[Note: the pick's memory is its plan's]: predicted_memory, the search table's pick row and
    print(plan) show Plan.memory()'s busiest rank, exactly."""
    from fxsplit.graph.units import fmt_bytes

    assert Memory is RankMemory
    model, args, _ = zoo.make("gpt", batch_size=4, seq_len=32, n_embd=64, n_layer=4, n_head=4, vocab_size=256,
                              block_size=32)
    p = fxsplit.plan(model, args, strategy="auto", world_size=2, global_batch_size=8,
                     hardware=fxsplit.Hardware.cpu())
    mine = worst(p.memory())
    assert p.predicted_memory == mine.as_dict()
    assert p.search.best.memory == mine and p.search.scores[0] is p.search.best
    pick_row = str(p.search).splitlines()[2]
    assert fmt_bytes(mine.peak) in pick_row and "memory is its plan's" in pick_row, pick_row
    assert f"memory {fmt_bytes(mine.peak)} on the busiest rank" in str(p)
    assert mine.peak <= p.search.memory_limit
    # the next candidates build_pick may try carry their own layout, not the first pick's leftovers
    from fxsplit.api.auto import config_of

    base = dataclasses.replace(p.config, dp_shard=2, dp=1, microbatch_size=99)
    for score in p.search.scores[:3]:
        c = config_of(score, p.search, base, p.config.hardware)
        assert c.world_size == 2 and c.dp * c.dp_shard == score.candidate.dp, (c, score.candidate)
        assert c.microbatch_size in (None, score.candidate.microbatch_size)


def test_a_plan_under_memory_limit_is_under_it_by_plan_memory():
    """A plan given memory_limit is within it by Plan.memory() (the split re-run under a lowered
    cap when the partition's linear model admitted more), or PlanError names the ranks and terms."""
    model, args, _ = zoo.make("gpt", batch_size=4, seq_len=32, n_embd=64, n_layer=4, n_head=4, vocab_size=256,
                              block_size=32)
    free = worst(fxsplit.plan(model, args, pp=2, schedule="1f1b", microbatches=4).memory()).peak
    kept = 0
    for share in (1.0, 0.95, 0.9, 0.85):
        try:
            p = fxsplit.plan(model, args, pp=2, schedule="1f1b", microbatches=4, memory_limit=share * free)
        except (PlanError, SplitError) as exc:
            assert "memory_limit" in str(exc), exc
            continue
        kept += 1
        assert worst(p.memory()).peak <= share * free, share
    assert kept >= 1  # the unconstrained split's own peak fits
    with pytest.raises((PlanError, SplitError), match="memory_limit"):
        fxsplit.plan(model, args, pp=2, schedule="1f1b", microbatches=4, memory_limit=0.7 * free)
    # what the error says when the built plan is over: every rank over the limit and its terms
    over = dataclasses.replace(p, config=dataclasses.replace(p.config, memory_limit=1.0))
    with pytest.raises(PlanError, match=r"memory_limit = .* per rank is not met.*pp rank 0 needs .*optimizer"):
        raise memory_limit_error(over)


def test_the_schedule_walk_counts_gradients_from_the_first_backward():
    from fxsplit.pipeline.memory import schedule_walk
    from fxsplit.schedule.ir import parse_schedule

    # one stage, 10 bytes per microbatch, 3 bytes of gradients: at 0B0 two microbatches are held
    # and the gradients appear; later backwards free activations, the gradients stay
    (row,) = parse_schedule("0F0 0F1 0B0 0F2 0B1 0B2")
    assert schedule_walk(row, [10.0], [10.0], [3.0]) == (20.0, 3.0, 0.0)  # at 0F2: the gradients of 0B0 stay
    assert schedule_walk(parse_schedule("0F0 0F1 0B0 0F2 0F3 0B1 0B2 0B3")[0], [10.0], [10.0], [3.0]) == (30.0, 3.0, 0.0)
    # a checkpointed stage under the graph split: I recomputes, W's inputs (12) exceed the 10 held
    (row,) = parse_schedule("0F0 0F1 0I0 0I1 0W0 0W1")
    assert schedule_walk(row, [10.0], [12.0], [3.0]) == (24.0, 0.0, 0.0)
    # transients: a backward's start (the loss's gradients, 7) on what is held before it, not on
    # what I leaves after recomputing; the graph W's gradients (3) once the stage already has some
    assert schedule_walk(row, [10.0], [12.0], [3.0], start=[7.0]) == (22.0, 0.0, 7.0)  # 0I1 starts on 12 + 10
    (row,) = parse_schedule("0F0 0I0 0W0 0F1 0I1 0W1")
    assert schedule_walk(row, [10.0], [12.0], [3.0], weight_transient=[4.0]) == (12.0, 3.0, 4.0)  # 0W1
    assert schedule_walk(row, [10.0], [12.0], [3.0]) == (12.0, 3.0, 0.0)
    (row,) = parse_schedule("0F0 0B0 0F1 0B1")
    assert schedule_walk(row, [10.0], [10.0], [3.0], start=[7.0]) == (10.0, 3.0, 7.0)  # 0B1: gradients held too


def test_tied_parameters_of_one_rank_are_one_tensor():
    """ZB-V puts the tied embedding and LM head on rank 0 (stages 0 and 3): materialized there as
    one Parameter, the bytes Plan.memory() counts."""
    from fxsplit.api.materialize import materialize_stage, share_tied_on_rank

    model, args, _ = zoo.make("gpt", batch_size=4, seq_len=16, n_embd=32, n_layer=2, n_head=2, vocab_size=128,
                              block_size=16)
    p = fxsplit.plan(model, args, pp=2, schedule="zbv", microbatches=4, split_points=("blocks.0", "blocks.1", "ln_f"))
    assert p.stages_of(0) == (0, 3)
    assert {s for group in p.stages.shared_params for s, _ in group} == {0, 3}, p.stages.shared_params
    stages = {s: materialize_stage(p, s, tp_rank=0, source=model) for s in p.stages_of(0)}
    assert share_tied_on_rank(stages, p.stages.shared_params) == 1
    held = {id(t): t.nbytes for m in stages.values() for t in m.parameters()}
    assert sum(held.values()) == p.memory()[0].params


def test_split_backward_memory_walks_the_schedule():
    from fxsplit.pipeline.memory import schedule_peaks
    from fxsplit.schedule.ir import parse_schedule

    # one rank, one stage: a microbatch saves 10 bytes, 4 of which its W still needs after I
    rows = parse_schedule("0F0 0F1 0I0 0F2 0W0 0I1 0I2 0W1 0W2")
    assert schedule_peaks(rows, 1, [10.0], [4.0]) == (4 + 10 + 10,)  # at F2: W0 still holds 4 of microbatch 0
    assert schedule_peaks(parse_schedule("0F0 0F1 0B0 0F2 0B1 0B2"), 1, [10.0], [4.0]) == (20.0,)
    model, (x,), _ = zoo.make_gpt(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=32, seq_len=32,
                                  batch_size=2, seed=0)
    zb = fxsplit.plan(model, (x,), pp=2, microbatches=4, schedule="zb_h1").split
    one = fxsplit.plan(model, (x,), pp=2, microbatches=4, schedule="1f1b").split
    assert all(0 < s.weight_bytes <= s.activation_bytes for s in zb.stages)
    # ZB-H1 delays W: the last rank holds more than 1F1B's one microbatch, never more than p
    (z0, z1), (o0, o1) = zb.peak_activations()[0], one.peak_activations()[0]
    assert o1 < z1 <= 2 * zb.stages[1].activation_bytes + zb.message_buffers()[1]


def test_fsdp_gathers_in_the_param_dtype_so_parameter_casts_hold_nothing():
    """With dp_shard and mp_policy's param_dtype, FSDP gathers the parameters in bf16 and the
    graph's casts of them are no-ops: a stage holds no cast copy per microbatch (measured:
    benchmarks/memory_truth.py, dp_shard2 x pp2 bf16); without FSDP each forward's cast is a copy
    the linears save."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model, args, _ = zoo.make("gpt", batch_size=4, seq_len=16, n_embd=64, n_layer=2, n_head=4, vocab_size=128,
                              block_size=16)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plain, sharded = (fxsplit.plan(model, args, mp_policy=bf16, **o) for o in (dict(dp=2), dict(dp_shard=2)))
    (a,), (b,) = ([s.activation_bytes for s in p.split.stages] for p in (plain, sharded))
    # at most one bf16 copy per parameter read (the tied embedding / LM head weight is read twice)
    casts = sum(p.numel() * 2 for _, p in model.named_parameters(remove_duplicate=False))
    assert 0 < a - b <= casts, (a, b, casts)


def test_builds_pass_over_candidates_the_search_underestimated_by_as_much(monkeypatch):
    """[Note: the pick's memory is its plan's]: a built plan over the limit tells how low the search's
    estimate was; the next candidates whose estimate times that ratio is over the limit are not
    built (Llama-70B on 64 H100 at batch 512 built three near-identical layouts, all over, and
    raised), and the pick is the first that fits."""
    from types import SimpleNamespace

    import fxsplit.api.auto as auto
    import fxsplit.pipeline.memory as memory_mod

    gib = 2 ** 30
    monkeypatch.setattr(memory_mod, "worst", lambda m: m)
    base = fxsplit.ParallelConfig(microbatches=1)

    def run(estimates):  # GiB, best first; every built plan needs 1.13x its estimate
        scores = [SimpleNamespace(memory=SimpleNamespace(peak=e * gib), candidate=SimpleNamespace(short=lambda i=i: f"c{i}"))
                  for i, e in enumerate(estimates)]
        picked, built = {}, []
        result = SimpleNamespace(scores=scores, memory_limit=74.5 * gib,
                                 with_pick=lambda k, mem, how, passed=None: picked.update(k=k, how=how, passed=passed))
        monkeypatch.setattr(auto, "config_of", lambda score, res, chosen, hw: dataclasses.replace(
            chosen, microbatches=scores.index(score) + 1))

        def plan_fn(config):
            k = config.microbatches - 1
            built.append(k)
            return SimpleNamespace(memory=lambda: SimpleNamespace(peak=1.13 * estimates[k] * gib, pp_rank=0))

        auto.build_pick(plan_fn, base, result)
        return picked, built

    picked, built = run([67, 69, 72, 60, 50])
    assert picked["k"] == 3 and picked["how"] == "built"
    assert built == [0, 0, 3]  # the pick and its re-split, then straight to candidate 3
    assert sorted(picked["passed"]) == [1, 2] and "x 1.13" in picked["passed"][1]
    with pytest.raises(PlanError, match=r"best 2 attempts do not fit .*\(4 candidates passed over unbuilt"):
        run([67, 69, 72, 70, 70])
