"""Cost model (fxsplit.graph.cost) and measured profile (fxsplit.graph.profile).

Terms: b batch, s sequence, h hidden, V vocabulary, n layers. Analytic forward FLOPs of a GPT
(Megatron): n * (24*b*s*h^2 + 4*b*s^2*h) + 2*b*s*h*V, all of it matmul-like work.
"""

from __future__ import annotations

import math
import sys

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils.flop_counter import FlopCounterMode

from fxsplit.graph.cost import (
    ZERO_COST,
    NodeCost,
    estimate_time,
    graph_cost,
    graph_costs,
    node_cost,
    op_name,
    to_expr,
    value_bytes,
)
from fxsplit.graph.profile import PROFILE_KEY, apply_profile, node_time, profile_graph

F32 = 4


# ---------------------------------------------------------------------------------------------
# helpers


def fx_graph(module: nn.Module, *args, tracer: torch.fx.Tracer | None = None) -> torch.fx.GraphModule:
    """symbolic_trace + fake-tensor propagation (what fxsplit.trace(method="fx") gives)."""
    if tracer is None:
        gm = torch.fx.symbolic_trace(module)
    else:
        gm = torch.fx.GraphModule(module, tracer.trace(module))
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*args)
    return gm


def export_graph(module: nn.Module, *args, dynamic_shapes=None) -> torch.fx.GraphModule:
    return torch.export.export(module, args, strict=False, dynamic_shapes=dynamic_shapes).module()


def only(gm: torch.fx.GraphModule, name: str) -> torch.fx.Node:
    """The single compute node whose normalized op name is ``name``."""
    nodes = [n for n in gm.graph.nodes if n.op.startswith("call") and op_name(n) == name]
    assert len(nodes) == 1, (name, [(n.name, op_name(n)) for n in gm.graph.nodes])
    return nodes[0]


def analytic_gpt_flops(b: int, s: int, h: int, V: int, n: int) -> int:
    return n * (24 * b * s * h * h + 4 * b * s * s * h) + 2 * b * s * h * V


def unique_param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() dedupes


# ---------------------------------------------------------------------------------------------
# A nanoGPT-like model: separate or fused qkv, SDPA or explicit softmax(q @ k^T) @ v, tied head


class Block(nn.Module):
    def __init__(self, h: int, nh: int, fused: bool, sdpa: bool):
        super().__init__()
        self.nh, self.fused, self.sdpa = nh, fused, sdpa
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        if fused:
            self.qkv = nn.Linear(h, 3 * h)
        else:
            self.q, self.k, self.v = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.proj = nn.Linear(h, h)
        self.fc, self.act, self.out = nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)

    def forward(self, x):
        B, T, C = x.shape
        y = self.ln1(x)
        if self.fused:
            q, k, v = self.qkv(y).split(C, dim=2)
        else:
            q, k, v = self.q(y), self.k(y), self.v(y)
        q = q.view(B, T, self.nh, C // self.nh).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.nh, C // self.nh).transpose(1, 2)
        v = v.view(B, T, self.nh, C // self.nh).transpose(1, 2)
        if self.sdpa:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
            a = att.softmax(dim=-1) @ v
        a = a.transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.proj(a)
        return x + self.out(self.act(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, V=512, h=64, nh=4, n=2, fused=True, sdpa=True):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, h), nn.Embedding(128, h)
        self.blocks = nn.ModuleList(Block(h, nh, fused, sdpa) for _ in range(n))
        self.ln_f, self.head = nn.LayerNorm(h), nn.Linear(h, V, bias=False)
        self.head.weight = self.wte.weight  # tied

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


B, S, H, V, N = 2, 32, 64, 512, 2


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("fused,sdpa", [(True, True), (False, False)])
def test_gpt_flops_match_analytic(frontend, fused, sdpa):
    torch.manual_seed(0)
    model = TinyGPT(V, H, 4, N, fused=fused, sdpa=sdpa)
    idx = torch.randint(0, V, (B, S))
    gm = fx_graph(model, idx) if frontend == "fx" else export_graph(model, idx)
    cost = graph_cost(gm)
    analytic = analytic_gpt_flops(B, S, H, V, N)
    assert cost.matmul_flops == analytic  # the analytic count is exactly the matmul work
    assert abs(cost.flops - analytic) / analytic < 0.05, (cost.flops, analytic)
    assert cost.flops > analytic  # norms, softmax, GELU, residual adds are counted too
    assert cost.param_bytes == unique_param_bytes(model)  # tied head/embedding counted once
    assert cost.backward_flops == cost.flops + cost.matmul_flops


def test_gpt_flops_symbolic_in_batch_and_seq():
    model = TinyGPT(V, H, 4, N, fused=True, sdpa=False)
    idx = torch.randint(0, V, (B, S))
    b_dim, s_dim = torch.export.Dim("b", min=1, max=64), torch.export.Dim("s", min=2, max=128)
    gm = export_graph(model, idx, dynamic_shapes=({0: b_dim, 1: s_dim},))
    b_sym, s_sym = (to_expr(d) for d in next(iter(gm.graph.find_nodes(op="placeholder"))).meta["val"].shape)
    assert isinstance(b_sym, sympy.Symbol) and isinstance(s_sym, sympy.Symbol)
    cost = graph_cost(gm)
    assert isinstance(cost.flops, sympy.Expr) and cost.flops.free_symbols == {b_sym, s_sym}
    for b, s in ((2, 32), (5, 100)):
        analytic = analytic_gpt_flops(b, s, H, V, N)
        concrete = cost.evaluate({b_sym: b, s_sym.name: s})  # by symbol or by name
        assert concrete.matmul_flops == analytic
        assert abs(concrete.flops - analytic) / analytic < 0.05
        assert not concrete.is_symbolic and concrete.param_bytes == unique_param_bytes(model)
    with pytest.raises(ValueError, match=s_sym.name):
        cost.evaluate({b_sym: 2})


@pytest.mark.parametrize("method", ["fx", "export"])
def test_zoo_gpt_through_trace_is_symbolic_and_matches(method):
    from fxsplit.testing import zoo

    trace = sys.modules["fxsplit.graph.trace"].trace
    model, args, _ = zoo.make_gpt(n_layer=2, n_embd=64, n_head=4, vocab_size=512, block_size=64,
                                  batch_size=2, seq_len=32, fused_qkv=True)
    gm = trace(model, args, method=method)
    symbols = gm.meta["fxsplit"].symbols
    total = graph_cost(gm)
    attached = [n.meta["fxsplit"].cost for n in gm.graph.nodes]
    assert sum(attached, ZERO_COST) == total  # trace attaches exactly these node costs
    for b, s in ((2, 32), (3, 50)):
        analytic = analytic_gpt_flops(b, s, 64, 512, 2)
        concrete = total.evaluate({symbols["batch"]: b, symbols["seq"]: s})
        assert concrete.matmul_flops == analytic
        assert abs(concrete.flops - analytic) / analytic < 0.05


def test_hf_gpt2_flops_match_analytic():
    transformers = pytest.importorskip("transformers")  # a test dependency in pyproject
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    idx = torch.randint(0, 1000, (B, S))
    gm = torch.export.export(model, (), {"input_ids": idx, "use_cache": False}, strict=False).module()
    assert any(op_name(n) == "addmm" for n in gm.graph.nodes)  # Conv1D projections
    cost = graph_cost(gm)
    analytic = analytic_gpt_flops(B, S, 64, 1000, 2)
    assert cost.matmul_flops == analytic
    assert abs(cost.flops - analytic) / analytic < 0.05
    assert cost.param_bytes == unique_param_bytes(model)


# ---------------------------------------------------------------------------------------------
# unit checks with exact numbers


def test_linear_exact_fx_and_export():
    lin = nn.Linear(8, 16)
    x = torch.randn(4, 8)
    expected = dict(flops=2 * 4 * 16 * 8 + 4 * 16, matmul_flops=2 * 4 * 16 * 8,
                    bytes_read=(4 * 8 + 16 * 8 + 16) * F32, bytes_written=4 * 16 * F32,
                    saved_bytes=4 * 8 * F32)
    c = node_cost(only(fx_graph(nn.Sequential(lin), x), "linear"))  # call_module
    assert c == NodeCost(param_bytes=(16 * 8 + 16) * F32, **expected)
    gm = export_graph(lin, x)
    c = node_cost(only(gm, "linear"))
    assert c == NodeCost(param_bytes=0, **expected)  # the get_attr nodes own the parameters
    assert graph_cost(gm).param_bytes == (16 * 8 + 16) * F32


def test_functional_linear_without_bias_and_matmul_family():
    class M(nn.Module):
        def forward(self, x, w, a, bt):
            return F.linear(x, w), torch.bmm(a, bt), torch.addmm(x[:, :3], x, w.t()), x @ w.t()

    x, w, a, bt = torch.randn(4, 8), torch.randn(3, 8), torch.randn(2, 5, 6), torch.randn(2, 6, 7)
    gm = fx_graph(M(), x, w, a, bt)
    costs = {op_name(n): node_cost(n) for n in gm.graph.nodes if n.op == "call_function"}
    assert costs["linear"].flops == costs["linear"].matmul_flops == 2 * 4 * 3 * 8
    assert costs["bmm"].flops == 2 * 2 * 5 * 7 * 6
    assert costs["addmm"].matmul_flops == 2 * 4 * 3 * 8 and costs["addmm"].flops == 2 * 4 * 3 * 8 + 12
    assert costs["matmul"].flops == 2 * 4 * 3 * 8
    assert costs["matmul"].saved_bytes == (4 * 8 + 8 * 3) * F32  # both operands are activations


@pytest.mark.parametrize("conv,shape,expected_mm,bias_out", [
    (nn.Conv2d(3, 8, 3, padding=1), (2, 3, 10, 10), 2 * (2 * 8 * 10 * 10) * (3 * 3 * 3), 2 * 8 * 10 * 10),
    (nn.Conv2d(4, 8, 3, groups=2, bias=False), (1, 4, 6, 6), 2 * (8 * 4 * 4) * (2 * 3 * 3), 0),
    (nn.ConvTranspose2d(8, 3, 2, stride=2), (1, 8, 4, 4), 2 * (8 * 4 * 4) * (3 * 2 * 2), 3 * 8 * 8),
    (nn.Conv1d(4, 6, 5), (2, 4, 20), 2 * (2 * 6 * 16) * (4 * 5), 2 * 6 * 16),
])
def test_conv_exact_fx_and_export(conv, shape, expected_mm, bias_out):
    x = torch.randn(*shape)
    with FlopCounterMode(display=False) as counter:
        conv(x)
    assert counter.get_total_flops() == expected_mm  # the expected numbers agree with PyTorch's
    graphs = [fx_graph(nn.Sequential(conv), x), export_graph(conv, x)]  # call_module, aten
    if not isinstance(conv, nn.ConvTranspose2d):  # its forward has control flow fx cannot trace
        graphs.append(fx_graph(conv, x))  # F.conv*d
    for gm in graphs:
        node = next(n for n in gm.graph.nodes if n.op.startswith("call") and "conv" in op_name(n))
        c = node_cost(node)
        assert (c.matmul_flops, c.flops) == (expected_mm, expected_mm + bias_out), gm.code
        assert c.bytes_written == math.prod(conv(x).shape) * F32


def test_embedding_exact():
    emb = nn.Embedding(100, 16)
    idx = torch.randint(0, 100, (2, 5))
    gathered = 2 * 5 * 16 * F32
    c = node_cost(only(fx_graph(nn.Sequential(emb), idx), "embedding"))
    assert c == NodeCost(flops=0, bytes_read=10 * 8 + gathered, bytes_written=gathered,
                         param_bytes=100 * 16 * F32, saved_bytes=10 * 8)
    c = node_cost(only(export_graph(emb, idx), "embedding"))  # aten.embedding(weight, indices)
    assert c == NodeCost(flops=0, bytes_read=10 * 8 + gathered, bytes_written=gathered,
                         param_bytes=0, saved_bytes=10 * 8)


def test_layer_norm_exact():
    ln = nn.LayerNorm(16)
    x = torch.randn(2, 5, 16)
    numel, rows = 160, 10
    common = dict(flops=(5 + 2) * numel, bytes_written=numel * F32,
                  saved_bytes=numel * F32 + 2 * rows * F32, bytes_read=(numel + 32) * F32)
    assert node_cost(only(fx_graph(nn.Sequential(ln), x), "layer_norm")) == NodeCost(param_bytes=32 * F32, **common)
    assert node_cost(only(export_graph(ln, x), "layer_norm")) == NodeCost(**common)
    c = node_cost(only(fx_graph(nn.Sequential(nn.LayerNorm(16, elementwise_affine=False)), x), "layer_norm"))
    assert c.flops == 5 * numel and c.param_bytes == 0


@pytest.mark.parametrize("norm,shape,flops,saved", [
    (nn.GroupNorm(2, 4), (2, 4, 3, 3), (5 + 2) * 72, 72 * F32),
    (nn.BatchNorm2d(4).eval(), (2, 4, 3, 3), (5 + 2) * 72, 72 * F32),  # running stats are not affine
    (nn.RMSNorm(6), (2, 3, 6), (4 + 1) * 36, 36 * F32 + 6 * F32),  # one float32 rstd per row
])
def test_other_norms_exact_fx_and_export(norm, shape, flops, saved):
    x = torch.randn(*shape)
    for gm in (fx_graph(nn.Sequential(norm), x), export_graph(norm, x)):
        node = next(n for n in gm.graph.nodes if n.op.startswith("call") and op_name(n).endswith("_norm"))
        c = node_cost(node)
        assert (c.flops, c.saved_bytes, c.bytes_written) == (flops, saved, x.numel() * F32), gm.code


def test_attention_matches_flop_counter():
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 12, 16), torch.randn(2, 4, 12, 16)

    class Attn(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    with FlopCounterMode(display=False) as counter:  # (CPU SDPA kernels are not counted)
        torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v
    scores = 2 * 4 * 8 * 12
    for gm in (fx_graph(Attn(), q, k, v), export_graph(Attn(), q, k, v)):
        c = node_cost(only(gm, "scaled_dot_product_attention"))
        assert c.matmul_flops == counter.get_total_flops() == 2 * 2 * scores * 16
        assert c.flops == c.matmul_flops + 5 * scores
        assert c.saved_bytes == (q.numel() + k.numel() + v.numel() + q.numel() + 2 * 4 * 8) * F32


def test_views_are_free_and_unknown_ops_do_not_crash():
    class M(nn.Module):
        def forward(self, x):
            y = x.view(4, 6).transpose(0, 1)  # free
            z = torch.special.erfinv(y.clamp(-0.5, 0.5))  # not in any table
            return torch.cumprod(z, 0).sum()

    gm = fx_graph(M(), torch.randn(24))
    costs = {n.name: node_cost(n) for n in gm.graph.nodes}
    assert costs["view"] == ZERO_COST and costs["transpose"] == ZERO_COST
    erfinv = next(c for name, c in costs.items() if "erfinv" in name)
    assert erfinv.flops == 24 and erfinv.bytes_written == 24 * F32 and erfinv.saved_bytes == 24 * F32


def test_casts_and_contiguous_cost_only_when_they_copy():
    class M(nn.Module):
        def forward(self, x):
            a = x.float().contiguous()  # both return x itself: free
            b = x.transpose(0, 1).contiguous()  # a real copy
            return a, b, x.to(torch.float16)  # a real cast

    gm = fx_graph(M(), torch.randn(4, 6))
    costs = {n.name: node_cost(n) for n in gm.graph.nodes}
    assert costs["float_1"] == ZERO_COST and costs["contiguous"] == ZERO_COST
    assert costs["contiguous_1"] == NodeCost(bytes_read=24 * F32, bytes_written=24 * F32)
    assert costs["to"] == NodeCost(bytes_read=24 * F32, bytes_written=24 * 2)


class MatPair(nn.Module):
    """A leaf module the cost model does not know: x @ w1 @ w2."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(8, 12)), nn.Parameter(torch.randn(12, 5))

    def forward(self, x):
        return x @ self.w1 @ self.w2


class SelfScores(nn.Module):
    """A parameter-free leaf module the cost model does not know: x @ x^T."""

    def forward(self, x):
        return x @ x.transpose(-2, -1)


def test_unknown_leaf_modules_counted_with_flop_counter():
    class LeafTracer(torch.fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, (MatPair, SelfScores)) or super().is_leaf_module(m, qualname)

    model = nn.Sequential(MatPair(), nn.ReLU(), SelfScores())
    x = torch.randn(3, 8)
    gm = fx_graph(model, x, tracer=LeafTracer())
    costs = {n.target: node_cost(n) for n in gm.graph.nodes if n.op == "call_module"}
    mm = 2 * 3 * 8 * 12 + 2 * 3 * 12 * 5
    assert costs["0"].matmul_flops == mm and costs["0"].flops == mm + 3 * 5
    assert costs["0"].param_bytes == (8 * 12 + 12 * 5) * F32
    assert costs["0"].bytes_read == (3 * 8 + 8 * 12 + 12 * 5) * F32
    assert costs["2"].matmul_flops == 2 * 3 * 3 * 5 and costs["2"].param_bytes == 0
    # symbolic batch: the count at the hint is scaled to the symbolic output size
    gm = sys.modules["fxsplit.graph.trace"].trace(model, (x,), method="fx", leaf_modules=[MatPair, SelfScores])
    b = gm.meta["fxsplit"].symbols["batch"]
    costs = {n.target: n.meta["fxsplit"].cost for n in gm.graph.nodes if n.op == "call_module"}
    assert sympy.simplify(costs["0"].matmul_flops - mm // 3 * b) == 0
    assert sympy.simplify(costs["2"].matmul_flops - 2 * b * b * 5) == 0


def test_activation_modules_cost_like_their_functions():
    """nn.GELU / nn.Dropout / nn.ReLU cost what F.gelu / F.dropout / F.relu and their aten ops cost
    (the op vocabulary names them alike; they were once mistaken for unknown leaf modules because
    their op name equals their lower-cased class name), and a user class that shares a name with
    an op is a leaf module, not that op."""
    class Functions(nn.Module):
        def forward(self, x):
            return F.relu(F.dropout(F.gelu(x), 0.5))

    class Gelu(nn.Module):  # a user module that is not GELU
        def forward(self, x):
            return x @ x.transpose(0, 1)

    x = torch.randn(3, 8)
    modules = fx_graph(nn.Sequential(nn.GELU(), nn.Dropout(0.5), nn.ReLU()), x)
    functions = fx_graph(Functions(), x)
    exported = export_graph(Functions(), x)
    for name in ("gelu", "dropout", "relu"):
        assert node_cost(only(modules, name)) == node_cost(only(functions, name)) == node_cost(only(exported, name))
    assert node_cost(only(modules, "gelu")).flops == 8 * 24 and node_cost(only(modules, "dropout")).saved_bytes == 24

    class LeafTracer(torch.fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, Gelu) or super().is_leaf_module(m, qualname)

    gm = fx_graph(nn.Sequential(Gelu()), x, tracer=LeafTracer())
    assert node_cost(only(gm, "module:Gelu")).matmul_flops == 2 * 3 * 3 * 8  # counted, not costed as gelu


def test_module_called_twice_owns_params_once():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(self.lin(x))

    gm = fx_graph(Twice(), torch.randn(2, 4))
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert [node_cost(n).param_bytes for n in calls] == [20 * F32, 0]
    assert [graph_costs(gm)[n.name].param_bytes for n in calls] == [20 * F32, 0]


# ---------------------------------------------------------------------------------------------
# NodeCost arithmetic, evaluation, roofline


def test_nodecost_arithmetic_and_validation():
    s = sympy.Symbol("s", positive=True, integer=True)
    a = NodeCost(flops=10, bytes_read=4, bytes_written=2, param_bytes=1, saved_bytes=3, matmul_flops=6)
    b = NodeCost(flops=2 * s, bytes_read=s, matmul_flops=s)
    total = sum([a, b, ZERO_COST])
    assert total.flops == 10 + 2 * s and total.is_symbolic and total.free_symbols == {s}
    assert total.backward_flops == 16 + 3 * s
    assert total.evaluate({"s": 5}) == NodeCost(20, 9, 2, 1, 3, 11)
    assert a.scale(2) == NodeCost(20, 8, 4, 2, 6, 12)
    fake = FakeTensorMode().from_tensor(torch.empty(3, 4, dtype=torch.float16))
    assert value_bytes((fake, 5, None, [fake])) == 2 * 3 * 4 * 2
    assert to_expr(7) == 7 and to_expr(sympy.Integer(3)) == 3 and isinstance(to_expr(3), int)
    with pytest.raises(ValueError, match="flops"):
        NodeCost(flops=-1)
    with pytest.raises(ValueError, match="matmul_flops"):
        NodeCost(flops=1, matmul_flops=2)
    with pytest.raises(TypeError, match="to_expr"):
        NodeCost(flops=torch.tensor(1))


def test_estimate_time_roofline():
    compute_bound = NodeCost(flops=1000, bytes_read=10, bytes_written=10, saved_bytes=10, matmul_flops=1000)
    assert estimate_time(compute_bound, flops_per_s=100.0, bytes_per_s=1.0, backward=False) == 20.0
    assert estimate_time(compute_bound, flops_per_s=100.0, bytes_per_s=1000.0, backward=False) == 10.0
    # backward: 2x matmul FLOPs (20 s) vs (10 + 10 + 10) bytes / 1000 -> total 30 s
    assert estimate_time(compute_bound, flops_per_s=100.0, bytes_per_s=1000.0) == 30.0
    with pytest.raises(ValueError, match="evaluate"):
        estimate_time(NodeCost(flops=sympy.Symbol("b")), flops_per_s=1.0, bytes_per_s=1.0)


# ---------------------------------------------------------------------------------------------
# measured profile


def _mlp_graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(8, 32)
    return fx_graph(model, x), x


def test_profile_times_every_compute_node_and_replaces_estimate():
    gm, x = _mlp_graph()
    times = profile_graph(gm, (x,), repeats=2)
    compute = [n.name for n in gm.graph.nodes if n.op.startswith("call")]
    assert sorted(times) == sorted(compute)
    assert all(t > 0 for t in times.values())

    rates = dict(flops_per_s=1e9, bytes_per_s=1e9)
    node = next(n for n in gm.graph.nodes if n.name == compute[0])
    estimate = estimate_time(node_cost(node), **rates)
    assert node_time(node, **rates) == estimate  # no profile yet
    apply_profile(gm, {node.name: 0.5})
    assert node.meta[PROFILE_KEY] == 0.5
    assert node_time(node, backward=False, **rates) == 0.5
    ratio = estimate / estimate_time(node_cost(node), backward=False, **rates)
    assert node_time(node, **rates) == pytest.approx(0.5 * ratio)
    with pytest.raises(ValueError, match="not nodes of this graph"):
        apply_profile(gm, {"no_such_node": 1.0})
    with pytest.raises(ValueError, match="finite number"):
        apply_profile(gm, {node.name: -1.0})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")
def test_profile_on_cuda_leaves_graph_on_cpu():
    gm, x = _mlp_graph()
    times = profile_graph(gm, (x,), device="cuda", repeats=2)
    assert times and all(t > 0 for t in times.values())
    assert all(p.device.type == "cpu" for p in gm.parameters())
