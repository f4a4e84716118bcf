"""Tensor parallelism through the layouts of attention and MLP found outside the zoo: factored
views of fused projections (ViT's [3, heads, hd], NeoX's [heads, 3, hd], Falcon's [kv_groups,
q_per_kv + 2, hd]), splits by sizes and slices (GQA, Phi-3), chunk(2) gate/up, per-head q/k
norms (reductions over head_dim), interleaved rotary (stack + flatten).

Plans are checked on graphs with no process group; numerics run every tp rank in this process
(threads over torch's threaded process group, tests/tp_threaded.py) and compare the loss of 3
SGD steps and every gradient with the unsplit model; one gloo launch checks the same over
processes. Each rank must hold 1/t of every column/row weight, and the full state dict must come
back in the original layout.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxsplit
from fxsplit.passes.tensor_parallel import apply_tp_plan, full_state_dict
from fxsplit.testing import run_distributed
from fxsplit.tp.plan import LocalSize, TPPlanError, find_tp_plan
from fxsplit.tp.propagate import RULES
from fxsplit.tp.sharding import ShardSpec, materialize_module, unshard_state_dict

from tp_layout_models import C, LAYOUTS, make_hf_layout, make_layout
from tp_threaded import run_threaded

STEPS, LR = 3, 0.1
RTOL, ATOL = 1e-5, 1e-6


@functools.lru_cache(maxsize=None)
def _traced(name: str, method: str = "fx"):
    model, args, kwargs = make_layout(name)
    return fxsplit.trace(model, args, kwargs, method=method)


@functools.lru_cache(maxsize=None)
def _traced_hf(name: str, **cfg):
    model, args, kwargs = make_hf_layout(name)
    return fxsplit.trace(model, args, kwargs)


# ------------------------------------------------------------------------------ rules


def test_rule_table_covers_reductions_views_and_indexing():
    for op in ("mean", "var", "sum", "amax", "norm", "layer_norm", "rms_norm", "stack", "unbind", "select",
               "index", "index_select", "slice", "narrow", "chunk", "split_with_sizes", "flatten", "unflatten"):
        assert op in RULES, op


class _PerHeadMean(nn.Module):
    """A reduction over head_dim keeps the heads sharded; a mean over the heads is a partial sum
    (all-reduced); a var over the heads has no rule."""

    def __init__(self, over_heads: str):
        super().__init__()
        self.q, self.o = nn.Linear(C, C), nn.Linear(C, C)
        self.over_heads = over_heads

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, 4, 8)
        if self.over_heads == "mean":
            s = q.mean(dim=2, keepdim=True)
        elif self.over_heads == "var":
            s = q.var(dim=2, keepdim=True)
        else:
            s = q.var(dim=-1, keepdim=True)
        return self.o((q - s).reshape(b, n, C))


def _gm(model, method="fx"):
    return fxsplit.trace(model, (torch.randn(2, 6, C),), method=method)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_reduction_over_head_dim_shards_and_over_heads_replicates(method):
    plan = find_tp_plan(_gm(_PerHeadMean(""), method), 2)
    assert plan.styles["q"] == "colwise" and plan.styles["o"] == "rowwise" and not plan.rewrite.partial_sums
    plan = find_tp_plan(_gm(_PerHeadMean("mean"), method), 2)  # [Note: reductions over the sharded dim]
    assert plan.styles["q"] == "colwise" and len(plan.rewrite.partial_sums) == 1, plan
    plan = find_tp_plan(_gm(_PerHeadMean("var"), method), 2)
    assert plan.styles["q"] == "replicate"
    assert "var over the sharded dim" in dict(plan.replicated)["q"]


class _ViewGateUp(nn.Module):
    """gate/up fused and split by a VIEW [.., 2, F]: at t=2 the first factor (2) divides, so the
    propagation first shards it, fails at unbind, and backtracks to shard F (blocks (F, F))."""

    def __init__(self):
        super().__init__()
        self.gu, self.down = nn.Linear(C, 128), nn.Linear(64, C)

    def forward(self, x):
        b, n, _ = x.shape
        gate, up = self.gu(x).view(b, n, 2, 64).unbind(2)
        return self.down(F.silu(gate) * up)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_view_factor_choice_backtracks(method):
    plan = find_tp_plan(_gm(_ViewGateUp(), method), 2)
    assert plan.param_specs["gu.weight"] == ShardSpec(0, 2, (64, 64))
    assert plan.styles["down"] == "rowwise"
    assert "shard on factor 1 (64)" in plan.layouts["gu"]


@pytest.mark.parametrize("method", ["fx", "export"])
def test_vit_fused_qkv_reshape_permute_is_sharded_by_heads(method):
    gm = _traced("vit", method)
    for t in (2, 4):
        plan = find_tp_plan(gm, t)  # used to raise "has size 3, which t=2 does not divide"
        assert plan.param_specs["0.attn.qkv.weight"] == ShardSpec(0, t, (C, C, C))
        assert plan.param_specs["0.attn.qkv.bias"] == ShardSpec(0, t, (C, C, C))
        assert plan.styles["0.attn.proj"] == "rowwise" and plan.replicated == ()
        assert plan.layouts["0.attn.qkv"] == "view [3, 4, 8], shard on factor 1 (4)"
        assert "blocks from view [3, 4, 8]" in str(plan)
        assert plan.param_specs["0.mlp.gate_up.weight"] == ShardSpec(0, t, (64, 64))
    # 4 heads: t=8 names the heads (4), not the 3 of q/k/v
    with pytest.raises(TPPlanError, match=r"has size 4 \(the number of attention heads.*nearest valid t: t=4"):
        find_tp_plan(gm, 8)
    if method == "fx":  # reshape(b, n, c) with c read from x.shape: divided by t in the graph
        plan = find_tp_plan(gm, 2)
        assert any(isinstance(a.value, LocalSize) for a in plan.rewrite.shape_args)


def test_neox_heads_outermost_is_a_plain_column_range():
    plan = find_tp_plan(_traced("neox"), 2)
    assert plan.param_specs["0.attn.query_key_value.weight"] == ShardSpec(0, 2)
    assert plan.styles["0.attn.dense"] == "rowwise"
    assert "0.attn.query_key_value" not in plan.layouts


def test_gqa_split_by_sizes_and_groups_layouts():
    plan = find_tp_plan(_traced("gqa_split"), 2)
    assert plan.param_specs["0.attn.qkv.weight"] == ShardSpec(0, 2, (32, 16, 16))
    assert plan.layouts["0.attn.qkv"] == "split [32, 16, 16]"
    with pytest.raises(TPPlanError, match=r"in module '0\.attn' has size 2 .*nearest valid t: t=2"):
        find_tp_plan(_traced("gqa_split"), 4)  # 2 key/value heads
    plan = find_tp_plan(_traced("gqa_sliced"), 2)  # the same cut by slices (Phi-3), bounds made local
    assert plan.param_specs["0.attn.qkv.weight"] == ShardSpec(0, 2, (32, 16, 16))
    assert plan.layouts["0.attn.qkv"] == "slice [0:32]; slice [32:48]; slice [48:64]"
    local = [(a.value.start, a.value.stop) for a in plan.rewrite.shape_args
             if isinstance(a.value, slice) and a.node.startswith("getitem")]
    assert local[:3] == [(None, 16), (16, 24), (24, None)], plan.rewrite.shape_args
    plan = find_tp_plan(_traced("gqa_groups"), 2)  # [kv_groups, q_per_kv + 2, hd]: groups outermost
    assert plan.param_specs["0.attn.qkv.weight"] == ShardSpec(0, 2)
    assert plan.styles["0.attn.o"] == "rowwise"
    # 2 key/value groups at t=4: replicated, and the reason says which factor t does not divide
    plan = find_tp_plan(_traced("gqa_groups"), 4)
    why = dict(plan.replicated)["0.attn.qkv"]
    assert "t=4 does not divide the factor 2" in why, why
    assert plan.styles["0.mlp.gate_up"] == "colwise"


def test_per_head_qk_norm_weights_sum_their_gradients():
    plan = find_tp_plan(_traced("qknorm_rotary"), 2)
    assert plan.styles["0.attn.q"] == plan.styles["0.attn.k"] == "colwise" and plan.replicated == ()
    nodes = {n.name: n for n in _traced("qknorm_rotary").graph.nodes}
    summed = {str(nodes[g.operand].target) for g in plan.rewrite.grad_sums}
    assert {"0.attn.q_norm", "0.attn.k_norm", "1.attn.q_norm"} <= summed
    assert not summed & set(plan.param_specs)


class _Cumsum(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(C, C), nn.Linear(C, C)

    def forward(self, x):
        return self.o(torch.cumsum(self.q(x), dim=1).flip(1))


def test_an_op_without_a_rule_replicates_and_names_the_op():
    plan = find_tp_plan(_gm(_Cumsum()), 2)
    assert plan.styles["q"] == "replicate"
    assert "cumsum" in dict(plan.replicated)["q"]


def test_blocks_that_disagree_with_a_whole_read_replicate():
    class Bad(nn.Module):  # the fused output is read whole by one row linear, sliced for another
        def __init__(self):
            super().__init__()
            self.up, self.down, self.down2 = nn.Linear(C, 64), nn.Linear(64, C), nn.Linear(32, C)

        def forward(self, x):
            h = self.up(x)
            return self.down(h) + self.down2(h[..., :32])

    plan = find_tp_plan(_gm(Bad()), 2)
    assert plan.styles["up"] == "replicate"
    assert "another use splits it at [32]" in dict(plan.replicated)["up"], plan


def test_a_value_derived_whole_from_a_cut_projection_replicates():
    class Bad(nn.Module):  # h is cut in halves for one use, and stacked (layout fixed) for another
        def __init__(self):
            super().__init__()
            self.up, self.down, self.down2 = nn.Linear(C, 64), nn.Linear(64, C), nn.Linear(32, C)

        def forward(self, x):
            h = self.up(x)
            a, b = h.chunk(2, dim=-1)
            both = torch.stack([h, h], dim=0).sum(0)
            return self.down(both) + self.down2(a * b)

    plan = find_tp_plan(_gm(Bad()), 2)
    assert plan.styles["up"] == "replicate"
    assert "another use splits it at [32]" in dict(plan.replicated)["up"], plan


# ------------------------------------------------------------------------------ numerics


def _loss(out, target):
    if hasattr(out, "logits"):
        out = out.logits
    if target.dtype == torch.long:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    return F.mse_loss(out, target)


def _train(model, args, kwargs, target):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = _loss(model(*args, **kwargs), target)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)
                      if p.grad is not None})
        opt.step()
    return losses, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _check_tp(model, args, kwargs, gm, t, *, min_sharded: float):
    """Plan + apply once (every rank runs the same graph), materialize each rank, train all ranks
    in threads; compare with the unsplit model, check the 1/t shares and the state dict."""
    plan = find_tp_plan(gm, t)
    local = apply_tp_plan(copy.deepcopy(gm), plan)
    with torch.no_grad():
        out = model(*args, **kwargs)
    logits = out.logits if hasattr(out, "logits") else out
    g = torch.Generator().manual_seed(3)
    target = (torch.randint(0, logits.shape[-1], logits.shape[:-1], generator=g) if hasattr(out, "logits")
              else torch.randn(logits.shape, generator=g))
    ranks = [copy.deepcopy(local) for _ in range(t)]
    for r, m in enumerate(ranks):
        materialize_module(m, plan.param_specs, r, source=model)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    # before training: the shards put back give the original tensors in the original layout
    start = unshard_state_dict([dict(m.named_parameters()) for m in ranks], plan.param_specs)
    for n, p in full.items():
        assert torch.equal(start[n], p), n
    ref_losses, ref_grads, ref_sd = _train(copy.deepcopy(model), args, kwargs, target)
    results = run_threaded(lambda rank, world: _train(ranks[rank], args, kwargs, target), t)

    for losses, _, _ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    for step in range(STEPS):
        for rank, (_, grads, _) in enumerate(results):
            assert set(grads[step]) == set(ref_grads[step]), (rank, set(grads[step]) ^ set(ref_grads[step]))
        for name, ref in ref_grads[step].items():
            shards = [grads[step][name] for _, grads, _ in results]
            got = plan.param_specs[name].unshard(shards) if name in plan.param_specs else shards[0]
            if name not in plan.param_specs:
                for s in shards[1:]:
                    torch.testing.assert_close(s, got, rtol=0, atol=0)
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} step {step}: {m}")
    after = full_state_dict([sd for _, _, sd in results], plan)
    for name in full:
        torch.testing.assert_close(after[name], ref_sd[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")

    # every column/row weight: 1/t on each rank; the sharded part is most of the linears
    linear_w = {l.weight for l in plan.rewrite.linears.values()}
    sharded = local_total = full_total = 0
    for name, p in ranks[0].named_parameters():
        if name in linear_w:
            full_total += full[name].numel()
            local_total += p.numel()
            if name in plan.param_specs:
                spec = plan.param_specs[name]
                assert tuple(p.shape) == spec.local_shape(full[name].shape), name
                whole = spec.whole and sum(spec.blocks[i] for i in spec.whole) / sum(spec.blocks)
                if not whole:  # 1/t on each rank (a multi-query weight keeps its k / v blocks whole)
                    assert p.numel() * t == full[name].numel(), name
                sharded += full[name].numel() * (1 - (whole or 0))
    assert sharded >= min_sharded * full_total, (sharded, full_total, plan)
    return plan


_KV2_AT_T4 = (("gqa_split", 4), ("gqa_sliced", 4))  # 2 kv heads at t=4: TPPlanError (tested above)


@pytest.mark.parametrize("name,t", [(n, t) for n in sorted(LAYOUTS) for t in (2, 4) if (n, t) not in _KV2_AT_T4])
def test_layouts_match_one_process(name, t):
    model, args, kwargs = make_layout(name)
    share = 0.45 if (name, t) == ("gqa_groups", 4) else 0.99  # gqa_groups t=4: attention replicated
    _check_tp(model, args, kwargs, _traced(name), t, min_sharded=share)


@pytest.mark.parametrize("name", ["vit", "gqa_groups", "qknorm_rotary"])
def test_layouts_exported_match_one_process(name):
    model, args, kwargs = make_layout(name)
    _check_tp(model, args, kwargs, _traced(name, "export"), 2, min_sharded=0.99)


HF_CASES = [
    ("qwen3", 2, {}, 0.99),
    ("qwen3", 4, {"num_key_value_heads": 4}, 0.99),
    ("phi3", 2, {}, 0.99),
    ("phi3", 4, {"num_key_value_heads": 4}, 0.99),
    ("gpt_neox", 2, {}, 0.99),
    ("gpt_neox", 4, {}, 0.99),
    ("gptj", 2, {}, 0.99),
    ("vit", 2, {}, 0.9),   # the classifier head stays replicated
    ("vit", 4, {}, 0.9),
    ("olmo2", 2, {}, 0.99),  # q/k norm over the whole projection: its statistic all-reduced
    ("gpt_bigcode", 2, {}, 0.6),  # multi-query attention: q by heads, the k / v head whole
]


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("name,t,cfg,share", HF_CASES, ids=[f"{c[0]}-t{c[1]}" for c in HF_CASES])
def test_hf_layouts_match_one_process(name, t, cfg, share):
    model, args, kwargs = make_hf_layout(name, **cfg)
    plan = _check_tp(model, args, kwargs, fxsplit.trace(model, args, kwargs), t, min_sharded=share)
    if name == "phi3":
        assert plan.param_specs["model.layers.0.self_attn.qkv_proj.weight"].blocks == (
            (32, 16, 16) if t == 2 else (32, 32, 32))
        assert plan.param_specs["model.layers.0.mlp.gate_up_proj.weight"].blocks == (64, 64)
    if name == "gpt_bigcode":  # [Note: whole blocks]: q split by heads, k / v kept whole on every rank
        spec = plan.param_specs["transformer.h.0.attn.c_attn.weight"]
        assert spec.whole and not any("attn" in p for p, _ in plan.replicated), plan
    if name == "olmo2":
        assert plan.rewrite.partial_sums and plan.rewrite.scatters and not plan.replicated, plan


# ------------------------------------------------------------------------------ gloo


def _gloo_worker(rank: int, world: int, names: list[str]) -> list:
    import torch.distributed as dist

    from fxsplit.tp.collectives import bind_groups

    out = []
    for name in names:
        model, args, kwargs = make_layout(name)
        gm = fxsplit.trace(model, args, kwargs)
        plan = find_tp_plan(gm, world)
        apply_tp_plan(gm, plan)
        materialize_module(gm, plan.param_specs, rank, source=model)
        target = torch.randn(model(*args).shape, generator=torch.Generator().manual_seed(3))
        with bind_groups({"tp": dist.group.WORLD}):
            losses, grads, _ = _train(gm, args, kwargs, target)
        out.append((losses, grads, dict(plan.param_specs)))
    return out


@pytest.mark.dist
def test_layouts_over_gloo():
    names = ["vit", "qknorm_rotary"]
    results = run_distributed(_gloo_worker, 2, names, timeout=240)
    for i, name in enumerate(names):
        model, args, kwargs = make_layout(name)
        target = torch.randn(model(*args).shape, generator=torch.Generator().manual_seed(3))
        ref_losses, ref_grads, _ = _train(model, args, kwargs, target)
        specs = results[0][i][2]
        for losses, _, _ in (r[i] for r in results):
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
        for n, ref in ref_grads[-1].items():
            shards = [r[i][1][-1][n] for r in results]
            got = specs[n].unshard(shards) if n in specs else shards[0]
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} {n}: {m}")
