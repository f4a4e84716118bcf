"""Stage cuts at layer boundaries ([Note: layer cuts] in fxsplit.pipeline.cuts) and values each
stage recomputes instead of receiving ([Note: recompute, don't ship] in
fxsplit.pipeline.recomputable): one-process plan checks, numerics against the unsplit model."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import fxsplit
from fxsplit.graph.meta import node_info
from fxsplit.graph.recompute import layer_key
from fxsplit.pipeline.comm import plan_all_communication
from fxsplit.pipeline.cuts import INNER_GAIN, layer_boundaries
from fxsplit.pipeline.partition import solve
from fxsplit.pipeline.split import plan_split
from fxsplit.pipeline.stage import build_stages
from fxsplit.testing import zoo

_COMPUTE = ("call_function", "call_method", "call_module")


def _keys(gm):
    return [layer_key(node_info(u).module_path) for u in gm.graph.nodes if u.op in _COMPUTE]


def test_layer_boundaries_ignore_top_level_ops_inside_a_layer():
    keys = ["emb", "layers.0", "layers.0", "", "layers.0", "layers.1", "layers.1", "head"]
    assert layer_boundaries(keys) == [True, True, False, False, False, True, False, True, True]


@pytest.mark.parametrize("n_layer,S", [(4, 2), (6, 4), (5, 3)])
def test_default_cuts_are_at_layers_unless_inside_is_2_percent_better(n_layer, S):
    model, args, kwargs = zoo.make("gpt", n_layer=n_layer)
    gm = fxsplit.trace(model, args, kwargs, method="fx")
    plan = plan_split(gm, num_stages=S, hardware=fxsplit.Hardware.cpu())
    ok = layer_boundaries(_keys(gm))
    at_layers = solve(replace(plan.problem, allowed=tuple(ok)))
    free = solve(replace(plan.problem, allowed=None))
    inside = [k for k in plan.partition.cuts[1:-1] if not ok[k]]
    if free.bottleneck < (1 - INNER_GAIN) * at_layers.bottleneck:
        assert inside and plan.cut_reason and "starts inside" in plan.cut_reason
        assert plan.partition.bottleneck == pytest.approx(free.bottleneck)
    else:
        assert not inside and plan.cut_reason == ""
        assert plan.partition.bottleneck == pytest.approx(at_layers.bottleneck)
    assert ("cuts inside layers" in str(plan)) == bool(plan.cut_reason)


class _Lopsided(nn.Module):
    """Layer 0 holds nearly all the compute: two stages cut at layers leave it whole on one."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                                                   nn.Linear(512, 64)), nn.Linear(64, 64)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_cut_inside_a_layer_that_pays_is_taken_and_explained():
    model = _Lopsided()
    x = torch.randn(4, 64)
    gm = fxsplit.trace(model, (x,), method="fx")
    plan = plan_split(gm, num_stages=2, hardware=fxsplit.Hardware(link_bytes_per_s=float("inf")))
    assert plan.starts[1] != "layers_1" and "stage 1 starts inside layers.0" in plan.cut_reason
    assert "% lower" in plan.cut_reason and "cuts inside layers: stage 1" in str(plan)
    held = plan_split(gm, num_stages=2, cut_at="modules", hardware=fxsplit.Hardware(link_bytes_per_s=float("inf")))
    assert held.cut_reason == ""  # other cut_at values keep their own rules
    stages = plan.build(gm)
    torch.testing.assert_close(stages.run_sequential(x)[0], model(x), rtol=0, atol=0)


class _Tables(nn.Module):
    """A rotary-like table from a buffer and an arange, a mask from the input, and a frozen
    projection (a parameter: sent, never recomputed), all read by every layer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("freq", torch.linspace(0.1, 1.0, 16), persistent=False)
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])

    def forward(self, x, keep):
        pos = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)
        table = torch.cos(pos[:, None] * self.freq[None, :])  # (T, 16)
        mask = (keep > 0).to(x.dtype)[..., None]  # (B, T, 1)
        f = self.frozen(x)
        h = x
        for layer in self.layers:
            h = torch.tanh(layer(h) * table + f) * mask
        return h


@pytest.mark.parametrize("method", ["fx", "export"])
def test_tables_and_masks_are_recomputed_not_sent(method):
    torch.manual_seed(0)
    model = _Tables()
    x, keep = torch.randn(2, 8, 16), torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    gm = fxsplit.trace(model, (x, keep), method=method)
    plan = plan_split(gm, num_stages=4, hardware=fxsplit.Hardware.cpu())
    stages = plan.build(gm)
    by_name = {n.name: n for n in gm.graph.nodes}
    for name in plan.recomputed_reads:
        assert "linear" not in name and "frozen" not in name, name
    kinds = {str(by_name[n].target) for n in plan.recomputed_reads}
    assert any("cos" in k for k in kinds) and len(kinds) == 2, kinds  # the table and the mask
    # what crosses: the hidden state and the frozen projection, nothing the stage can recompute
    for io in stages.io[1:]:
        sent = [m.name for src, m in zip(io.inputs, io.input_meta) if src.stage is not None]
        assert not set(sent) & set(plan.recomputed), (io.index, sent)
        assert len(sent) == 2, (io.index, sent)  # h and f
    everything = build_stages(gm, dict(plan.stage_of), plan.num_stages)
    crossing = lambda sg: sum(src.stage is not None for io in sg.io for src in io.inputs)  # noqa: E731
    assert crossing(everything) == crossing(stages) + 2 * 3  # table and mask into stages 1..3
    torch.testing.assert_close(stages.run_sequential(x, keep)[0], model(x, keep), rtol=0, atol=0)
    assert "recomputed by each stage that reads them, not sent" in str(plan)


def test_llama_sends_only_the_hidden_state_and_its_gradient():
    from fxsplit.testing import hf_zoo

    torch.manual_seed(0)
    model, args, kwargs = hf_zoo.tiny_llama(num_hidden_layers=4)
    m = 4
    plan = fxsplit.plan(model, args, kwargs, pp=2, microbatches=m, schedule="1f1b")
    split = plan.split
    assert split.cut_reason == "" and split.stages[1].module_paths[0].startswith("model.layers.")
    assert len(split.recomputed_reads) == 3  # the causal mask, rotary cos and sin
    sends = sum(op.is_send for cp in plan.comm for ops in cp.peer_ops.values() for op in ops)
    assert sends == 2 * m  # one hidden state forward and its gradient backward, per microbatch
    everything = build_stages(plan.graph, dict(split.stage_of), split.num_stages)
    before = plan_all_communication(plan.schedule, everything.io, num_ranks=2)
    assert sum(op.is_send for cp in before for ops in cp.peer_ops.values() for op in ops) == 5 * m
    flat = [*args, *kwargs.values()]
    torch.testing.assert_close(plan.stages.run_sequential(*flat)[0], model(*args, **kwargs).logits,
                               rtol=1e-6, atol=1e-6)


def _dot_boxes(text):
    import re

    return re.findall(r"^\s+(s\d+_\d+) \[label=\"([^\"]*)\"", text, flags=re.M)


def test_module_dot_folds_layers_and_marks_collectives_and_messages(tmp_path):
    sizes = {}
    for n_layer in (4, 12):
        model, args, kwargs = zoo.make("gpt", n_layer=n_layer)
        plan = fxsplit.plan(model, args, kwargs, tp=2, pp=2, microbatches=2, schedule="1f1b")
        text = plan.to_dot(level="module")
        boxes = _dot_boxes(text)
        sizes[n_layer] = len(boxes)
        assert text.count("subgraph cluster_") == 2
        assert text.count("style=bold") == 1  # one boundary edge, stage 0 -> stage 1
        assert any("layers" in label and "TP all-reduce fwd (g)" in label for _, label in boxes), boxes
        assert "gradients back" in text and "tp=2 pp=2" in text
    assert sizes[12] == sizes[4] < 20, sizes  # depth folds away: one box per run of alike layers
    with pytest.raises(fxsplit.FxsplitError, match="level"):
        plan.to_dot(level="modules")
    path = tmp_path / "plan.dot"
    assert plan.to_dot(str(path), level="module") == path.read_text()


class _Mutated(nn.Module):
    """A mask changed in place after it is made: a copy recomputed elsewhere would miss the change."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x):
        m = torch.ones_like(x)
        m.mul_(2.0)
        for layer in self.layers:
            x = torch.tanh(layer(x)) * m
        return x


def test_a_value_changed_in_place_is_sent_not_recomputed():
    model, x = _Mutated(), torch.randn(3, 8)
    gm = fxsplit.trace(model, (x,), method="fx")
    plan = plan_split(gm, num_stages=4, hardware=fxsplit.Hardware.cpu())
    assert plan.recomputed == ()
    torch.testing.assert_close(plan.build(gm).run_sequential(x)[0], model(x), rtol=0, atol=0)
