"""[Note: a marker batch] (fxsplit.graph.batch_marker): with no microbatch size known, torch.export
traces the batch static at a prime marker, the graph is made to take any batch, and fxsplit's own
sizes read the marker's multiples as the symbol ``batch``: outputs, costs and plans equal those of a
graph traced with the batch symbolic, at every batch."""

import pytest
import sympy
import torch
from torch import nn

import fxsplit
from fxsplit.graph.batch_marker import MARKERS, _is_marker_float, choose_marker, mark_batch
from fxsplit.graph.meta import TensorMeta
from fxsplit.graph.shapes import BATCH, batch_dims, tensor_metas
from fxsplit.testing import hf_zoo


def _llama(**kw):
    return hf_zoo.tiny_llama(batch_size=2, seq_len=8, **kw)


def _placeholder_val(gm):
    return next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"]


def _at(args, kwargs, b):
    ids, mask = args[0], kwargs["attention_mask"]
    reps = -(-b // ids.shape[0])
    return (ids.repeat(reps, 1)[:b],), {"attention_mask": mask.repeat(reps, 1)[:b]}


def test_default_trace_takes_every_batch_and_reads_the_marker_as_the_batch():
    model, args, kwargs = _llama()
    gm = fxsplit.trace(model, args, kwargs, dynamic_sequence=None)
    info = gm.meta["fxsplit"]
    assert "marker batch 97" in info.reason and info.symbols == {"batch": BATCH}
    val = _placeholder_val(gm)
    assert val.shape[0] == 97 and batch_dims(val) == (BATCH, 8)  # static fake values, the batch read as a symbol
    hidden = [m for n in gm.graph.nodes for m in tensor_metas(n.meta.get("val")) if m.shape[1:] == (8, 64)]
    assert hidden and all(m.shape[0] == BATCH for m in hidden)
    assert not any(type(a) is int and a and a % 97 == 0 for n in gm.graph.nodes for a in
                   torch.utils._pytree.tree_leaves((n.args, n.kwargs)))
    model.eval()
    for b in (1, 2, 3, 5):
        a, k = _at(args, kwargs, b)
        torch.testing.assert_close(gm(*a, **k).logits, model(*a, **k).logits, rtol=1e-5, atol=1e-5)


def test_costs_equal_the_symbolic_trace():
    model, args, kwargs = _llama()
    marked = fxsplit.trace(model, args, kwargs, dynamic_sequence=None)
    symbolic = fxsplit.trace(model, args, kwargs, dynamic_batch=True, dynamic_sequence=None)
    sym = symbolic.meta["fxsplit"].symbols["batch"]
    assert "marker" not in symbolic.meta["fxsplit"].reason and sym != BATCH

    def total(gm, s, b):
        out = 0
        for n in gm.graph.nodes:
            cost = n.meta["fxsplit"].cost if n.meta.get("fxsplit") is not None else None
            if cost is not None:
                out += sympy.sympify(cost.flops).xreplace({s: b}) if isinstance(cost.flops, sympy.Basic) else cost.flops
        return out

    for b in (1, 3, 8):
        assert total(marked, BATCH, b) == total(symbolic, sym, b)


def test_plan_and_verify_at_the_example_batch_and_another():
    model, args, kwargs = _llama()
    plan = fxsplit.plan(model, args, kwargs, tp=2, pp=2, microbatches=2)
    assert "marker batch" in plan.graph.meta["fxsplit"].reason
    fxsplit.verify(model, args, plan, kwargs, quiet=True)
    a, k = _at(args, kwargs, 6)
    fxsplit.verify(model, a, plan, k, quiet=True)


class _MeanByHand(nn.Module):
    """A mean over the batch written with the batch size as a float: the marker cannot tell it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return h.sum(0) * (1.0 / x.shape[0])


def test_a_float_of_the_batch_refuses_the_marker():
    model, x = _MeanByHand(), torch.randn(3, 4)
    gm = fxsplit.trace(model, (x,), method="export", dynamic_sequence=None)
    info = gm.meta["fxsplit"]
    assert "the marker batch 97 cannot serve" in info.reason and "may be computed from the batch" in info.reason
    for b in (2, 5):
        y = torch.randn(b, 4)
        torch.testing.assert_close(gm(y), model(y))


def test_choose_marker_skips_primes_of_the_model():
    model = nn.Sequential(nn.Linear(97 * 2, 101), nn.Linear(101, 103 * 3))
    assert choose_marker(model, (torch.randn(2, 194),), {}, 2) == 107
    assert choose_marker(nn.Linear(4, 4), (torch.randn(2, 97 * 5),), {}, 2) == 101  # a non-batch dim of an input
    assert choose_marker(nn.Linear(4, 4), (torch.randn(97, 4),), {}, 97) == 97  # the batch dim itself is left out
    assert choose_marker(nn.Linear(4, 4), (torch.randn(2, 4),), {}, 2) == MARKERS[0]


def test_mark_batch_refuses_a_graph_with_no_input_at_the_marker():
    model, args, kwargs = _llama()
    gm = fxsplit.trace(model, args, kwargs, dynamic_batch=False, dynamic_sequence=None)  # static at 2
    assert mark_batch(gm, 97, 2) == "no input has the marker batch 97 as its dim 0"


def test_tensor_meta_of_a_plain_value_is_unchanged():
    assert tensor_metas(torch.empty(97, 3)) == (TensorMeta((97, 3), torch.float32),)


def _static_views(gm, ctx):
    """A user pass that writes every view's shape from its traced (static) value."""
    from fxsplit.graph.pass_api import PassResult

    changed = False
    for n in gm.graph.nodes:
        if n.target in (torch.ops.aten.view.default, torch.ops.aten.reshape.default):
            n.args = (n.args[0], [int(s) for s in n.meta["val"].shape])
            changed = True
    gm.recompile()
    return PassResult(gm, changed)


def test_sizes_a_pass_writes_from_the_static_values_follow_the_batch():
    model, args, kwargs = _llama()
    plan = fxsplit.plan(model, args, kwargs, pp=2, microbatches=2, passes=[_static_views])
    views = [n for st in plan.stages.modules for n in st.graph.nodes if n.target == torch.ops.aten.view.default]
    assert views and not any(type(a) is int and a % 97 == 0 for n in views for a in n.args[1])
    a, k = _at(args, kwargs, 6)
    fxsplit.verify(model, a, plan, k, quiet=True)


class _Similarity(nn.Module):
    """An in-batch similarity: the batch twice in one value, which the marker cannot tell apart from a
    size of the model that is a multiple of it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return (h @ h.t()).softmax(-1) @ h


class _PadCompare(nn.Module):
    """Compares token ids with a pad id that is a multiple of 97: that prime is not the marker."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(300, 4, padding_idx=194)

    def forward(self, ids):
        return self.emb(ids) * (ids != self.emb.padding_idx).unsqueeze(-1)


def test_values_with_the_batch_twice_refuse_the_marker_and_pad_ids_skip_their_primes():
    model, x = _Similarity(), torch.randn(3, 4)
    gm = fxsplit.trace(model, (x,), method="export", dynamic_sequence=None)
    assert "the marker in more than one size" in gm.meta["fxsplit"].reason
    for b in (2, 5):
        y = torch.randn(b, 4)
        torch.testing.assert_close(gm(y), model(y))
    model = _PadCompare()
    ids = torch.tensor([[1, 194, 5], [194, 2, 3]])
    gm = fxsplit.trace(model, (ids,), method="export", dynamic_sequence=None)
    assert "marker batch 101" in gm.meta["fxsplit"].reason  # 97 divides the pad id 194
    for b in (1, 3):
        y = ids.repeat(2, 1)[:b]
        torch.testing.assert_close(gm(y), model(y))


def test_floats_of_the_batch_and_floats_of_the_model():
    assert _is_marker_float(1 / 97, 97) and _is_marker_float(3 / 97, 97) and _is_marker_float(194.0, 97)
    # epsilons, a dtype's smallest value, halves and scales are the model's own
    for x in (1e-12, 1e-5, -3.4028234663852886e38, 0.5, 0.125, 1.0, 10000.0, 0.7071067811865476):
        assert not _is_marker_float(x, 97), x


class _Flatten(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x.reshape(x.shape[0] * x.shape[1], 4)).view(x.shape[0], x.shape[1], 4)


def test_multiples_of_the_batch_become_products_and_a_second_rewrite_reuses_the_batch():
    from fxsplit.graph.batch_marker import rebatch

    model, x = _Flatten(), torch.randn(2, 3, 4)
    gm = fxsplit.trace(model, (x,), method="export", dynamic_sequence=None)
    assert "marker batch 97" in gm.meta["fxsplit"].reason
    sizes = [n for n in gm.graph.nodes if n.target is torch.ops.aten.sym_size.int]
    assert len(sizes) == 1 and any(n.args == (sizes[0], 3) for n in gm.graph.nodes)  # 291 = 3 * batch
    for n in gm.graph.nodes:  # what a pass writing sizes from the static values does
        if n.target in (torch.ops.aten.view.default, torch.ops.aten.reshape.default):
            n.args = (n.args[0], [int(s) for s in n.meta["val"].shape])
    assert rebatch(gm) == 2
    assert [n for n in gm.graph.nodes if n.target is torch.ops.aten.sym_size.int] == sizes
    for b in (1, 5):
        y = torch.randn(b, 3, 4)
        torch.testing.assert_close(gm(y), model(y))
