"""Expert parallelism in one process: the MoE layers found from the graph, the exchange inserted
around each, stages never cut inside it, the options refused with their fix, and ``verify``
emulating the all-to-all over the ep ranks (each fed its own slice of the batch) against the
unsplit model. The real gloo runs are in tests/test_expert_parallel.py."""

import importlib

import pytest
import torch

import fxsplit
from fxsplit.errors import PlanError, VerificationError
from fxsplit.testing import zoo
from fxsplit.tp.experts import (emulated_combine, emulated_dispatch, emulated_token_counts, ep_combine, ep_dispatch,
                                ep_local_offsets, ep_token_counts)

_HW = fxsplit.Hardware(link_bytes_per_s=float("inf"))


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_plan_wraps_every_moe_layer_in_one_exchange():
    model, args, _ = zoo.make("moe", n_layer=3)
    plan = fxsplit.plan(model, args, dp=2, ep=2, hardware=_HW)
    ep = plan.ep_plan
    assert [layer.module_path for layer in ep.layers] == [f"blocks.{i}.moe.experts" for i in range(3)]
    assert set(ep.expert_params) == {f"blocks.{i}.moe.experts.w{j}" for i in range(3) for j in (1, 2, 3)}
    assert not ep.skipped
    assert "3 MoE layer(s)" in str(ep) and "(2 per rank)" in str(ep)
    ops = _targets(plan.stages.modules[0])
    for op in (ep_token_counts, ep_dispatch, ep_local_offsets, ep_combine):
        assert ops.count(op) == 3, op
    # every grouped matmul reads the local group ends, the first ones the dispatched rows
    for node in plan.stages.modules[0].graph.nodes:
        if node.op == "call_function" and "grouped_mm" in str(node.target):
            assert node.args[2].target is ep_local_offsets, node.name


def test_stages_never_cut_between_dispatch_and_combine():
    model, args, _ = zoo.make("moe", n_layer=2)
    plan = fxsplit.plan(model, args, dp=2, ep=2, pp=4, microbatches=4, schedule="1f1b", hardware=_HW)
    counted = 0
    for gm in plan.stages.modules:
        ops = _targets(gm)
        assert ops.count(ep_dispatch) == ops.count(ep_combine), gm.code
        counted += ops.count(ep_dispatch)
    assert counted == 2


@pytest.mark.parametrize("options, words", [
    (dict(dp=2, ep=3), "must divide the data-parallel ranks"),
    (dict(dp=1, dp_shard=2, ep=4), "dp \\* dp_shard = 1 \\* 2 = 2"),
    (dict(dp=2, ep=0), "ep must be an int >= 1"),
])
def test_bad_ep_options_name_the_fix(options, words):
    with pytest.raises(PlanError, match=words):
        fxsplit.ParallelConfig(**options)


def test_world_size_is_unchanged_by_ep():
    assert fxsplit.ParallelConfig(dp=4, ep=2, pp=2).world_size == 8


def test_emulated_exchange_routes_rows_to_their_experts_and_back():
    n, E = 2, 4
    g = torch.Generator().manual_seed(0)
    ids = [torch.sort(torch.randint(0, E, (s,), generator=g)).values for s in (7, 5)]
    offs = [torch.cumsum(torch.bincount(i, minlength=E), 0).to(torch.int32) for i in ids]
    xs = [i.double().unsqueeze(1).repeat(1, 3).requires_grad_() for i in ids]  # each row holds its expert id
    recv = emulated_token_counts(offs)
    local = emulated_dispatch(xs, offs, recv)
    k = E // n
    for r in range(n):
        local_offs = torch.cumsum(recv[r].sum(0), 0)
        starts = torch.cat([local_offs.new_zeros(1), local_offs[:-1]])
        for e in range(k):  # expert-major: the rows of local expert e are one group
            assert (local[r][starts[e]:local_offs[e], 0] == r * k + e).all()
    back = emulated_combine([y * 2 for y in local], offs, recv)
    for x, y in zip(xs, back):
        torch.testing.assert_close(y, 2 * x)
    sum(y.sum() for y in back).backward()
    for x in xs:
        torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


def test_exchange_is_the_identity_without_a_group():
    offs = torch.tensor([2, 2, 5], dtype=torch.int32)
    x = torch.randn(5, 3)
    recv = ep_token_counts(offs)
    assert recv.tolist() == [[2, 0, 3]]
    assert ep_dispatch(x, offs, recv) is x and ep_combine(x, offs, recv) is x
    assert ep_local_offsets(recv, offs) is offs


@pytest.mark.parametrize("options, model_options", [
    (dict(dp=2, ep=2), dict(num_experts=4, top_k=2)),
    (dict(dp=2, ep=2, pp=2, microbatches=2, schedule="1f1b"), dict(num_experts=8, top_k=2, score="sigmoid",
                                                                    shared_expert=False)),
    (dict(dp=2, ep=2, pp=2, microbatches=2, schedule="zb_h1"), {}),
    (dict(dp=2, ep=2, pp=2, microbatches=4, schedule="zb_auto"), {}),
    (dict(dp=2, ep=2, pp=2, microbatches=2, schedule="1f1b", activation_checkpointing="selective"), {}),
    (dict(dp=2, ep=2, tp=2), {}),
    (dict(dp=4, ep=4, tp=2, pp=2, microbatches=2, schedule="1f1b"), dict(num_experts=8, top_k=2)),
], ids=["dp2-ep2", "dp2-ep2-pp2-sigmoid-8experts", "dp2-ep2-pp2-zbh1", "dp2-ep2-pp2-zb_auto",
        "dp2-ep2-pp2-selective", "dp2-ep2-tp2", "dp4-ep4-tp2-pp2"])
def test_verify_emulates_the_all_to_all(options, model_options):
    model, args, _ = zoo.make("moe", **model_options)
    report = fxsplit.verify(model, args, fxsplit.plan(model, args, hardware=_HW, **options), quiet=True)
    assert report.gradients == len(list(model.parameters()))
    assert report.max_gradient_error < 1e-5


def test_verify_catches_experts_on_the_wrong_rank(monkeypatch):
    verify_module = importlib.import_module("fxsplit.api.verify")
    keep = verify_module.keep_own_experts
    monkeypatch.setattr(verify_module, "keep_own_experts", lambda stages, plan, rank: keep(stages, plan, 0))
    model, args, _ = zoo.make("moe")
    with pytest.raises(VerificationError, match="experts"):
        fxsplit.verify(model, args, fxsplit.plan(model, args, dp=2, ep=2, hardware=_HW), quiet=True)


@pytest.mark.hf
def test_ep_x_tp_splits_each_ranks_experts_over_tp():
    """Each rank's E / ep experts are split over tp as tp alone splits them (gate / up by columns, down
    by rows), and the exchange sits inside tp's copy / reduce pair around the expert FFN."""
    from fxsplit.testing import tp_coverage
    from fxsplit.tp.collectives import copy_to_region, reduce_from_region

    model, args, kwargs = tp_coverage.build("qwen2_moe")
    plan = fxsplit.plan(model, args, kwargs, dp=2, ep=2, tp=2, hardware=_HW)
    specs = plan.tp_plan.param_specs
    assert plan.ep_plan.expert_params and all(specs[w].dim in (1, 2) for w in plan.ep_plan.expert_params)
    for node in plan.stages.modules[0].graph.nodes:
        if node.target is ep_dispatch:
            assert node.args[0].target is copy_to_region, node.args[0]
        if node.target is ep_combine:
            assert [u.target for u in node.users] == [reduce_from_region], node.users
    report = fxsplit.verify(model, args, plan, kwargs, quiet=True)
    assert report.outputs == 2 and report.max_gradient_error < 1e-5  # one output per tp rank


def test_verify_needs_a_batch_that_splits_over_ep():
    model, args, _ = zoo.make("moe", batch_size=3)
    with pytest.raises(PlanError, match="multiple of 2"):
        fxsplit.verify(model, args, fxsplit.plan(model, args, dp=2, ep=2, hardware=_HW), quiet=True)


@pytest.mark.hf
def test_transformers_moe_grouped_found_batched_kept_with_reason():
    from fxsplit.testing import tp_coverage

    model, args, kwargs = tp_coverage.build("qwen2_moe")
    plan = fxsplit.plan(model, args, kwargs, dp=2, ep=2, hardware=_HW)
    assert [layer.module_path for layer in plan.ep_plan.layers] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    fxsplit.verify(model, args, plan, kwargs, quiet=True)
    model, args, kwargs = tp_coverage.build("mixtral+batched_mm")
    plan = fxsplit.plan(model, args, kwargs, dp=2, ep=2, hardware=_HW)
    assert not plan.ep_plan.layers
    assert {why for _, why in plan.ep_plan.skipped} == {
        "batched_mm experts (W[expert_ids] per row, in token order); use the grouped_mm experts implementation "
        "for expert parallelism"}


def test_memory_counts_each_ranks_block_of_experts():
    model, args, _ = zoo.make("moe")
    whole = fxsplit.plan(model, args, dp=2, hardware=_HW).memory()[0]
    placed = fxsplit.plan(model, args, dp=2, ep=2, hardware=_HW).memory()[0]
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    assert whole.params - placed.params == expert_bytes / 2


def test_cli_plans_with_ep(tmp_path, capsys):
    from fxsplit.cli import main

    factory = tmp_path / "moe_model.py"
    factory.write_text("from fxsplit.testing import zoo\n\ndef build():\n    return zoo.make('moe')\n")
    assert main(["plan", f"{factory}:build", "--dp", "2", "--ep", "2"]) == 0
    out = capsys.readouterr().out
    assert "fxsplit plan: dp=2 ep=2 tp=1" in out
    assert "expert parallelism ep=2: 2 MoE layer(s)" in out


def test_memory_with_dp_shard_keeps_the_expert_block_whole():
    model, args, _ = zoo.make("moe")
    placed = fxsplit.plan(model, args, dp_shard=2, ep=2, hardware=_HW).memory()[0]
    sizes = [(".experts." in n, p.numel() * p.element_size()) for n, p in model.named_parameters()]
    experts = sum(b for e, b in sizes if e)
    rest = sum(b for e, b in sizes if not e)
    assert placed.params == pytest.approx(experts / 2 + rest / 2, rel=0.01)  # FSDP halves the rest only


def test_partition_counts_each_ranks_block_of_experts():
    """The split's stage parameter bytes (what its memory cap sums) count E / ep experts, as the
    plan's memory model does."""
    model, args, _ = zoo.make("moe")
    options = dict(dp=2, pp=2, microbatches=2, schedule="1f1b", hardware=_HW)
    whole = fxsplit.plan(model, args, **options)
    placed = fxsplit.plan(model, args, ep=2, **options)
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    split = lambda plan: sum(s.param_bytes for s in plan.split.stages)  # noqa: E731
    assert split(whole) - split(placed) == expert_bytes / 2
    assert [m.params for m in placed.memory()] == [s.param_bytes for s in placed.split.stages]


def _sentinel_moe_forward(threshold: int, write: bool = False):
    """zoo MoELayer.forward with transformers 5.17's sentinel fill between the grouped matmuls:
    ``masked_fill((expert_ids_g >= threshold).unsqueeze(-1), 0.0)`` on the sorted rows (``write``:
    the ids written in place through a view before the comparison)."""
    import torch.nn.functional as F
    from fxsplit.testing.zoo_moe import grouped_mm

    def forward(self, x):
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        top_w, top_i = torch.topk(F.softmax(self.router(flat), dim=-1), self.top_k, dim=-1)
        ids_g, order = torch.sort(top_i.reshape(-1))
        offs = torch.cumsum(torch.histc(ids_g.float(), bins=self.num_experts, min=0, max=self.num_experts - 1),
                            dim=0).to(torch.int32)
        if write:
            ids_g.view(-1).add_(1)
        sentinel = (ids_g >= threshold).unsqueeze(-1)
        token = order // self.top_k
        e, rows = self.experts, flat[token]
        gate = grouped_mm(rows, e.w1.transpose(-2, -1), offs).masked_fill(sentinel, 0.0)
        up = grouped_mm(rows, e.w3.transpose(-2, -1), offs)
        out = grouped_mm(F.silu(gate) * up, e.w2.transpose(-2, -1), offs) * top_w.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(flat).index_add(0, token, out).reshape(B, T, C)

    return forward


@pytest.mark.parametrize("never, write", [(True, False), (False, False), (False, True)],
                         ids=["ids-below-E", "ids-may-reach-the-threshold", "ids-written-in-place"])
def test_a_sentinel_fill_that_is_never_applied_is_removed_exactly(monkeypatch, never, write):
    """[Note: sentinel masks] in fxsplit.tp.moe: a fill whose mask ``ids >= E`` is never true (the
    ids are a topk's indices over E scores) is the identity, removed, and the layer placed exactly;
    with ``ids >= E - 1`` (true for the last expert's rows), or the ids written in place (through a
    view) before the comparison, the layer is kept, saying why."""
    from fxsplit.testing import zoo_moe

    monkeypatch.setattr(zoo_moe.MoELayer, "forward", _sentinel_moe_forward(3 if not never and not write else 4, write))
    model, args, _ = zoo.make("moe", n_layer=1, shared_expert=False)
    plan = fxsplit.plan(model, args, dp=2, ep=2, hardware=_HW)
    if never:
        assert [layer.module_path for layer in plan.ep_plan.layers] == ["blocks.0.moe"], str(plan.ep_plan)
        assert plan.ep_plan.layers[0].identities and not plan.ep_plan.skipped
        assert not any("masked_fill" in str(n.target) for n in plan.stages.modules[0].graph.nodes)
        report = fxsplit.verify(model, args, plan, quiet=True)
        assert report.gradients == len(list(model.parameters())) and report.max_gradient_error < 1e-5, report
    else:
        assert not plan.ep_plan.layers
        assert [why for _, why in plan.ep_plan.skipped] == [
            "masked_fill (masked_fill) between the grouped matmuls is not a row-wise op"], str(plan.ep_plan)


class _LoopedExperts(torch.nn.Module):
    """JetMoE's expert form on its own: the rows sorted by expert, split by counts computed from
    the data (``tolist()``: data-dependent sizes), one linear per expert on its slice of a 3-D
    weight, joined back; two blocks so that pp=2 has a cut to make."""

    def __init__(self, dim=16, experts=4, top_k=2, vocab=32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.router = torch.nn.ModuleList(torch.nn.Linear(dim, experts, bias=False) for _ in range(2))
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(experts, dim, dim) * 0.2) for _ in range(2))
        self.experts, self.top_k = experts, top_k

    def forward(self, ids):
        h = self.embed(ids)
        for router, w in zip(self.router, self.w):
            x = h.reshape(-1, h.shape[-1])
            weights, chosen = router(x).softmax(-1).topk(self.top_k)
            order = chosen.flatten().argsort()
            rows = x[order // self.top_k]
            counts = torch.nn.functional.one_hot(chosen.flatten(), self.experts).sum(0).tolist()
            out = torch.cat([torch.nn.functional.linear(piece, w[e]) for e, piece in enumerate(rows.split(counts))])
            y = torch.zeros_like(x).index_add(0, order // self.top_k, out * weights.flatten()[order, None])
            h = h + y.view_as(h)
        return h


def test_looped_experts_plan_with_a_pipeline_and_are_kept_with_their_reason():
    """Regression (benchmarks/moe_coverage.py, jetmoe): data-dependent sizes (``u0 .. u3``) made every
    pipeline cost unevaluable (UsageError at pp=2) and the experts were left out of ``ep_plan`` with no
    reason. The split now estimates each as its share of the sum the graph asserts ([Note:
    data-dependent sizes] in fxsplit/pipeline/bindings.py), and ep keeps the loop with its reason."""
    from fxsplit.pipeline.bindings import example_bindings

    torch.manual_seed(0)
    model = _LoopedExperts()
    ids = torch.randint(0, 32, (4, 8))
    plan = fxsplit.plan(model, (ids,), dp=2, ep=2, pp=2, microbatches=2, schedule="1f1b", hardware=_HW)
    assert not plan.ep_plan.layers and plan.ep_plan.skipped, str(plan.ep_plan)
    assert all("experts in a loop" in why for _, why in plan.ep_plan.skipped)
    assert len(plan.ep_plan.skipped) == 2, str(plan.ep_plan)  # both loops (the root module's), one entry each
    # 4 x 8 tokens, top-2: 64 routed rows over 4 experts, 16 each
    unbacked = {str(s): v for s, v in example_bindings(plan.graph).items() if str(s).startswith("u")}
    assert unbacked and set(unbacked.values()) == {16}, unbacked
    report = fxsplit.verify(model, (ids,), plan, quiet=True)
    assert report.max_gradient_error < 1e-5
