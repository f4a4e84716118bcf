"""nn.MultiheadAttention and nn.TransformerEncoder(Layer) sharded by heads ([Note: attention
modules as ops] in fxsplit.graph.decompose): the decomposition is exact against torch's modules,
the plan shards the fused in_proj as blocks [q|k|v] and out_proj row-parallel, each rank holds 1/t
of the attention and MLP weights, and the numbers match one process (fxsplit.verify, one gloo run)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxsplit
from fxsplit.api.materialize import materialize_stage
from fxsplit.testing import run_distributed
from fxsplit.testing.trace_cache import SharedPlans, shared_plans

_HW = fxsplit.Hardware(link_bytes_per_s=float("inf"))
V, E, HEADS, T, B = 64, 32, 4, 8, 2


class EncoderLM(nn.Module):
    """A language model on nn.TransformerEncoder, with a causal mask (and optionally a padding mask)."""

    def __init__(self, batch_first=True, norm_first=False, activation="relu", layers=2):
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(V, E)
        layer = nn.TransformerEncoderLayer(E, HEADS, 2 * E, dropout=0.0, batch_first=batch_first,
                                           norm_first=norm_first, activation=activation)
        self.enc = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(E), enable_nested_tensor=False)
        self.head = nn.Linear(E, V)

    def forward(self, idx, pad=None):
        x = self.emb(idx)
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1])
        if not self.batch_first:
            x = x.transpose(0, 1)
        x = self.enc(x, mask=mask, src_key_padding_mask=pad, is_causal=pad is None)
        if not self.batch_first:
            x = x.transpose(0, 1)
        return self.head(x)


class BareMHA(nn.Module):
    """A bare nn.MultiheadAttention block: bool attn_mask, optional key padding mask, then an MLP."""

    def __init__(self, batch_first=True, need_weights=False, bias=True):
        super().__init__()
        self.batch_first, self.need_weights = batch_first, need_weights
        self.norm = nn.LayerNorm(E)  # (a linear here would pair with in_proj as an MLP-like region)
        self.attn = nn.MultiheadAttention(E, HEADS, batch_first=batch_first, bias=bias)
        self.up, self.down = nn.Linear(E, 2 * E), nn.Linear(2 * E, E)

    def forward(self, x, pad=None):
        L = x.shape[1]
        mask = torch.ones((L, L), dtype=torch.bool).triu(1)
        h = self.norm(x)
        if not self.batch_first:
            h = h.transpose(0, 1)
        a = self.attn(h, h, h, key_padding_mask=pad, attn_mask=mask, need_weights=self.need_weights)[0]
        if not self.batch_first:
            a = a.transpose(0, 1)
        return self.down(F.gelu(self.up(a))) + a


def _ids(batch=B, seed=0):
    return (torch.randint(0, V, (batch, T), generator=torch.Generator().manual_seed(seed)),)


def _pad():
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, -3:] = True  # the second sample's last three positions are padding
    return pad


def _case(name):
    torch.manual_seed(0)
    if name.startswith("encoder"):
        bf = "seq_first" not in name
        model = EncoderLM(batch_first=bf, norm_first="norm_first" in name, activation="gelu" if "gelu" in name else "relu")
        kwargs = {"pad": _pad()} if "pad" in name else {}
        return model, _ids(), kwargs
    model = BareMHA(batch_first="seq_first" not in name, bias="nobias" not in name)
    kwargs = {"pad": _pad()} if "pad" in name else {}
    return model, (torch.randn(B, T, E),), kwargs


CASES = ["encoder", "encoder_seq_first", "encoder_norm_first_gelu", "encoder_pad", "mha", "mha_seq_first_pad",
         "mha_nobias"]


def _grads(model, out, params):
    loss = (out.float() ** 2).mean() + out.float().sum() * 1e-2
    return torch.autograd.grad(loss, list(params.values()))


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("name", CASES)
def test_decomposition_is_exact(name, method):
    model, args, kwargs = _case(name)
    gm = fxsplit.trace(model, args, kwargs, method=method, decompose_attention=True)
    assert "kept as torch modules" not in gm.meta["fxsplit"].reason
    ops = {str(n.target) for n in gm.graph.nodes}
    assert any("scaled_dot_product_attention" in o for o in ops), "the attention was not decomposed"
    assert not any(isinstance(m, (nn.MultiheadAttention, nn.TransformerEncoderLayer)) and n.op == "call_module"
                   for n in gm.graph.nodes for m in [gm.get_submodule(str(n.target)) if n.op == "call_module" else None])
    ref = model(*args, **kwargs)
    got = gm(*args, **kwargs)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    names = [n for n, _ in model.named_parameters()]
    mine = dict(gm.named_parameters())
    assert set(names) <= set(mine), sorted(set(names) - set(mine))  # the same parameter names
    g_ref = _grads(model, ref, dict(model.named_parameters()))
    g_got = _grads(gm, got, {n: mine[n] for n in names})
    for n, a, b in zip(names, g_got, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    # the model is given back as it was: torch's own forwards again
    assert all("forward" not in vars(m) for m in model.modules())


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["encoder", "encoder_seq_first", "mha"])
def test_plan_shards_in_proj_as_blocks_and_out_proj_rowwise(name, tp):
    model, args, kwargs = _case(name)
    p = fxsplit.plan(model, args, kwargs, tp=tp, pp=1, hardware=_HW)
    plan = p.tp_plan
    attn = [m for m, mod in model.named_modules() if isinstance(mod, nn.MultiheadAttention)]
    assert attn
    table = str(plan)
    for a in attn:
        spec = plan.param_specs[f"{a}.in_proj_weight"]
        assert (spec.dim, spec.num_shards, spec.blocks) == (0, tp, (E, E, E)), spec
        assert plan.param_specs[f"{a}.in_proj_bias"].blocks == (E, E, E)
        assert plan.style_of(a) == "colwise" and plan.style_of(f"{a}.out_proj") == "rowwise"
        assert plan.param_specs[f"{a}.out_proj.weight"].dim == 1
        assert f"{a}.out_proj" in table and "blocks from chunk [32, 32, 32]" in table
    # each rank holds 1/t of the attention and MLP weights (out_proj's bias is added once, whole)
    full = dict(model.named_parameters())
    split = [n for n in full if n.endswith(("in_proj_weight", "in_proj_bias", "out_proj.weight", "linear1.weight",
                                            "linear2.weight", "up.weight", "down.weight"))]
    assert len(split) >= 4 * len(attn)
    for r in range(tp):
        mod = materialize_stage(p, 0, tp_rank=r, source=model)
        local = dict(mod.named_parameters())
        for n in split:
            assert local[n].numel() * tp == full[n].numel(), (n, tuple(local[n].shape), tuple(full[n].shape))
        # rank r's in_proj rows: its own heads of q, of k and of v
        a = attn[0]
        w, rows = full[f"{a}.in_proj_weight"], E // tp
        want = torch.cat([w[i * E + r * rows: i * E + (r + 1) * rows] for i in range(3)])
        assert torch.equal(local[f"{a}.in_proj_weight"].detach(), want.detach())


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("name,tp,pp", [("encoder", 2, 2), ("encoder_seq_first", 4, 2), ("encoder_norm_first_gelu", 2, 1),
                                        ("encoder_pad", 2, 2), ("mha", 4, 1), ("mha_seq_first_pad", 2, 2),
                                        ("mha_nobias", 2, 1)])
def test_verify_against_one_process(name, tp, pp, method):
    model, args, kwargs = _case(name)
    p = fxsplit.plan(model, args, kwargs, tp=tp, pp=pp, method=method, hardware=_HW)
    assert p.graph.meta["fxsplit"].method == method
    assert any(s.blocks for s in p.tp_plan.param_specs.values())
    report = fxsplit.verify(model, args, p, kwargs)
    assert report.gradients > 0 and report.max_gradient_error < 1e-4 and report.max_output_error < 1e-4, report


class CrossOrWeights(nn.Module):
    """Cross-attention (kept as torch's module), or self-attention whose weights are returned."""

    def __init__(self, cross):
        super().__init__()
        self.cross = cross
        self.norm, self.norm2 = nn.LayerNorm(E), nn.LayerNorm(E)
        self.attn = nn.MultiheadAttention(E, HEADS, batch_first=True)
        self.up, self.down = nn.Linear(E, 2 * E), nn.Linear(2 * E, E)

    def forward(self, x):
        h = self.norm(x)
        kv = self.norm2(x) if self.cross else h
        a, w = self.attn(h, kv, kv)  # need_weights=True, averaged over the heads
        return self.down(F.gelu(self.up(a))) + a, w


@pytest.mark.parametrize("method", ["fx", "export"])
def test_need_weights_true_unread_weights_still_shard(method):
    torch.manual_seed(0)
    model = BareMHA(need_weights=True)  # attn(h, h, h, ...)[0] with need_weights=True
    args = (torch.randn(B, T, E),)
    gm = fxsplit.trace(model, args, method=method, decompose_attention=True)
    assert not any(str(n.target).endswith("mean") or "mean" == str(n.target) for n in gm.graph.nodes)
    torch.testing.assert_close(gm(*args), model(*args), rtol=1e-5, atol=1e-5)
    p = fxsplit.plan(model, args, tp=2, pp=1, method=method, hardware=_HW)
    assert p.tp_plan.param_specs["attn.in_proj_weight"].blocks == (E, E, E)
    report = fxsplit.verify(model, args, p)
    assert report.gradients > 0 and report.max_gradient_error < 1e-4, report


@pytest.mark.parametrize("method", ["fx", "export"])
def test_returned_weights_are_averaged_over_heads_with_an_all_reduce(method):
    """The returned attention weights average over the heads: a mean over the sharded dim, made
    whole by g ([Note: reductions over the sharded dim]); the attention shards by heads."""
    torch.manual_seed(0)
    model, args = CrossOrWeights(cross=False), (torch.randn(B, T, E),)
    gm = fxsplit.trace(model, args, method=method, decompose_attention=True)
    for a, b in zip(gm(*args), model(*args)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    p = fxsplit.plan(model, args, tp=2, pp=1, method=method, hardware=_HW)
    assert p.tp_plan.param_specs["attn.in_proj_weight"].blocks == (E, E, E)
    assert p.tp_plan.rewrite.partial_sums, str(p.tp_plan)
    assert p.tp_plan.style_of("up") == "colwise"  # the MLP is sharded too
    report = fxsplit.verify(model, args, p)
    assert report.max_gradient_error < 1e-4 and report.max_output_error < 1e-4, report


def test_cross_attention_keeps_the_module_and_says_why():
    torch.manual_seed(0)
    model, args = CrossOrWeights(cross=True), (torch.randn(B, T, E),)
    p = fxsplit.plan(model, args, tp=2, pp=1, method="fx", hardware=_HW)
    assert "attn: query, key and value are not one tensor (cross-attention)" in str(p)
    assert [n.target for n in p.graph.graph.nodes if n.op == "call_module" and n.target == "attn"] == ["attn"]
    assert "attn.in_proj_weight" not in p.tp_plan.param_specs  # replicated, whole
    assert p.tp_plan.style_of("up") == "colwise"
    report = fxsplit.verify(model, args, p)
    assert report.max_gradient_error < 1e-4, report


def test_a_user_leaf_stays_a_leaf():
    model, args, kwargs = _case("mha")
    gm = fxsplit.trace(model, args, kwargs, method="fx", leaf_modules=["attn"], decompose_attention=True)
    assert [n.target for n in gm.graph.nodes if n.op == "call_module" and n.target == "attn"] == ["attn"]


def test_without_tensor_parallelism_the_trace_keeps_torch_modules():
    model, args, kwargs = _case("encoder")
    gm = fxsplit.trace(model, args, kwargs, method="fx")
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["emb", "enc", "head"]


# ------------------------------------------------------------------------------------------------
# one gloo run: tp=2 x pp=2, a few SGD steps, against one process

STEPS, LR = 3, 0.1


def _lm_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _batches():
    return [(_ids(4, seed=s)[0], _ids(4, seed=100 + s)[0]) for s in range(STEPS)]


LAYOUT = dict(tp=2, pp=2, microbatches=2, schedule="1f1b", hardware=_HW)
_PREPARED: list = []  # (model, args): the encoder _prepare planned, before the ranks forked
_PLANS = SharedPlans()


def _prepare():
    """Plan the layout once per launch ([Note: preparing once per launch] in fxsplit.testing.harness);
    each rank takes its copy of the plan ([Note: plans made before the fork])."""
    model, args, _ = _case("encoder_seq_first")
    _PREPARED.extend((model, args))
    _PLANS.add(model, args, **LAYOUT)


def _train(rank, world):
    model, args = _PREPARED
    # compared with one process by the test: rank 0 verifies the plan (the default), the others
    # compute the same plan and do not repeat that check
    with shared_plans(_PLANS) as plans:
        pm = fxsplit.parallelize(model, args, loss_fn=_lm_loss, timeout=60, verify=None if rank == 0 else False,
                                 **LAYOUT)
    assert plans.misses == 0, f"rank {rank} planned itself: the plan made before the fork went unused"
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    losses = []
    for x, y in _batches():
        losses.append(pm.step(x, target=y))
        opt.step()
        opt.zero_grad()
    specs = pm.plan.tp_plan.param_specs
    return {"losses": [None if l is None else float(l) for l in losses], "state": pm.full_state_dict(),
            "blocks": specs["enc.layers.0.self_attn.in_proj_weight"].blocks}


@pytest.mark.dist
def test_encoder_lm_trains_like_one_process_tp2_pp2():
    model, _, _ = _case("encoder_seq_first")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref = []
    for x, y in _batches():
        loss = _lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref.append(loss.item())
    results = run_distributed(_train, 4, timeout=300, prepare=(_prepare, ()))
    assert all(r["blocks"] == (E, E, E) for r in results)
    got = [r["losses"] for r in results if r["losses"][0] is not None]
    assert got, "no rank reported the loss"
    for losses in got:
        assert losses == pytest.approx(ref, rel=1e-5), (losses, ref)
    state = results[0]["state"]
    for name, value in model.state_dict().items():  # every parameter after 3 steps: every gradient
        assert torch.allclose(state[name], value, rtol=1e-5, atol=1e-6), name


class _Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(E, HEADS, 2 * E, batch_first=True)  # torch's default dropout=0.1
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    def forward(self, x):
        return self.enc(x)


def test_attention_dropout_follows_the_mode_at_trace_time():
    torch.manual_seed(0)
    model, x = _Wrapped().eval(), torch.randn(B, T, E)
    gm = fxsplit.trace(model, (x,), method="fx", decompose_attention=True)
    sdpa = [n for n in gm.graph.nodes if "scaled_dot_product_attention" in str(n.target)]
    assert len(sdpa) == 1 and sdpa[0].kwargs["dropout_p"] == 0.0
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # torch's eval fast path (fused kernels): the same numbers
        torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)
    gm = fxsplit.trace(model.train(), (x,), method="fx", decompose_attention=True)
    sdpa = [n for n in gm.graph.nodes if "scaled_dot_product_attention" in str(n.target)]
    assert sdpa[0].kwargs["dropout_p"] == pytest.approx(0.1)
