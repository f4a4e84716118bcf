"""Graph inspection: table, FLOPs formatting, graph diff, op counts and DOT export."""

from __future__ import annotations

import copy
import logging
import re
import shutil
from collections import Counter
from dataclasses import dataclass

import pytest
import sympy
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from fxsplit.graph.inspection import (
    GraphDiff,
    format_flops,
    format_op_count_diff,
    graph_diff,
    graph_rows,
    graph_table,
    op_counts,
    to_dot,
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.GELU()

    def forward(self, x):
        return self.act(self.fc(x)) + F.gelu(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x * self.scale


def fx_graph() -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(Net())


# Stand-ins with the fields of fxsplit.graph.meta.NodeInfo / TensorMeta and fxsplit.graph.cost.NodeCost that
# inspection reads (duck-typed, so the test does not depend on the tracer).
@dataclass(frozen=True)
class FakeTensorMeta:
    shape: tuple
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class FakeCost:
    flops: object


@dataclass(frozen=True)
class FakeInfo:
    module_path: str
    outputs: tuple = ()
    params: tuple = ()
    cost: object = None


def cells(table: str, row_name: str) -> list[str]:
    """The cells of one table row, cut at the column offsets of the separator line."""
    lines = table.splitlines()
    starts = [m.start() for m in re.finditer(r"-+", lines[1])]
    line = next(l for l in lines if l.split() and l.split()[0] == row_name)
    bounds = zip(starts, starts[1:] + [None])
    return [line[a:b].strip() for a, b in bounds]


# --------------------------------------------------------------------------- table


def test_table_from_fx_fallback_metadata():
    table = graph_table(fx_graph())
    lines = table.splitlines()
    assert lines[0].split() == ["node", "op", "target", "module", "path", "shape", "FLOPs", "params"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    # aligned: every column starts at the same offset in the header and a data row
    header = lines[0]
    row = next(l for l in lines if l.startswith("layers_0_fc "))
    for col in ("op", "target", "module path"):
        start = header.index(col)
        assert row[start - 2 : start] == "  " and row[start] != " "
    assert cells(table, "layers_0_fc") == [
        "layers_0_fc", "call_module", "layers.0.fc", "layers.0.fc", "", "",
        "layers.0.fc.weight, layers.0.fc.bias",
    ]
    assert cells(table, "gelu") == [
        "gelu", "call_function", "torch.nn.functional.gelu", "layers.0", "", "", ""
    ]
    assert cells(table, "mul")[-1] == "scale"
    assert lines[-1] == "12 nodes"


def test_table_from_export_has_shapes_and_param_inputs():
    ep = torch.export.export(Net(), (torch.randn(2, 4),), strict=False).module()
    rows = {r.name: r for r in graph_rows(ep)}
    assert rows["x"].shape == "[2, 4]"
    assert rows["linear"].target == "aten.linear.default"
    assert rows["linear"].module_path == "layers.0.fc"
    assert rows["linear"].params == "layers.0.fc.weight, layers.0.fc.bias"
    assert rows["gelu"].module_path == "layers.0.act"
    assert rows["layers_1_fc_weight"].shape == "[4, 4]"


def test_table_prefers_fxsplit_metadata_and_sums_flops():
    gm = fx_graph()
    s = sympy.Symbol("s0", positive=True, integer=True)
    for node in gm.graph.nodes:
        if node.name == "layers_0_fc":
            node.meta["fxsplit"] = FakeInfo(
                "custom.path", (FakeTensorMeta((s, 4)),), ("p.weight",), FakeCost(32 * s)
            )
        if node.name == "layers_1_fc":
            node.meta["fxsplit"] = FakeInfo("", (FakeTensorMeta((2, 4)),), (), FakeCost(1_234_567))
    table = graph_table(gm)
    assert cells(table, "layers_0_fc")[3:] == ["custom.path", "[s0, 4]", "32*s0", "p.weight"]
    assert cells(table, "layers_1_fc")[3:] == ["", "[2, 4]", "1.2M", ""]
    assert table.splitlines()[-1] == (
        "12 nodes, total FLOPs 32*s0 + 1234567 over 2 annotated nodes"
    )


def test_table_clips_long_cells():
    table = graph_table(fx_graph(), max_width=10)
    assert "layers.0.…" in table
    with pytest.raises(ValueError, match="at least 4"):
        graph_table(fx_graph(), max_width=2)
    with pytest.raises(TypeError, match="expected a torch.fx.GraphModule or torch.fx.Graph, got Net"):
        graph_table(Net())


def test_symbolic_shapes_from_dynamic_export():
    batch = torch.export.Dim("batch", min=2, max=64)
    ep = torch.export.export(
        Net(), (torch.randn(4, 4),), dynamic_shapes={"x": {0: batch}}, strict=False
    ).module()
    rows = {r.name: r for r in graph_rows(ep)}
    shape = rows["x"].shape
    assert re.fullmatch(r"\[s\d+, 4\]", shape), shape
    assert rows["mul"].shape == shape


def test_table_of_fxsplit_trace_names_symbols():
    import fxsplit

    for method in ("fx", "export"):
        gm = fxsplit.trace(Net(), (torch.randn(2, 4),), method=method)
        rows = {r.name: r for r in graph_rows(gm)}
        assert rows["x"].shape == "[batch, 4]", method
        assert rows["mul"].module_path == "" and rows["mul"].params == "scale"
        assert re.fullmatch(r"\d+\*batch", rows["add_1"].flops), rows["add_1"].flops
        assert graph_table(gm).splitlines()[-1].endswith("*batch over %d annotated nodes" % len(rows))
        label = parse_dot(to_dot(gm))[0]["x"]["label"]
        assert label == r"x\nplaceholder\n[batch, 4]\n(top level)"


@pytest.mark.parametrize(
    "value, text",
    [
        (None, ""), (0, "0"), (999, "999"), (1000, "1.0K"), (1_234_567, "1.2M"),
        (3.4e9, "3.4G"), (5e12, "5.0T"), (2e15, "2.0P"), (0.5, "0.5"),
        (sympy.Integer(2_000_000), "2.0M"), (sympy.Symbol("b") * 8 + 1, "8*b + 1"),
    ],
)
def test_format_flops(value, text):
    assert format_flops(value) == text


# --------------------------------------------------------------------------- op counts


def test_op_counts_and_diff_text():
    gm = fx_graph()
    counts = op_counts(gm)
    assert counts == Counter({
        "placeholder": 1, "call_module:Linear": 2, "call_module:GELU": 2,
        "call_function:torch.nn.functional.gelu": 2, "call_function:operator.add": 2,
        "get_attr": 1, "call_function:operator.mul": 1, "output": 1,
    })
    after = Counter(counts)
    after["call_function:torch.nn.functional.gelu"] -= 2
    after["call_function:torch.relu"] += 1
    assert format_op_count_diff(counts, after).splitlines() == [
        "call_function:torch.nn.functional.gelu: 2 -> 0 (-2)",
        "call_function:torch.relu: 0 -> 1 (+1)",
        "total nodes: 12 -> 11 (-1)",
    ]
    assert format_op_count_diff(counts, counts) == "no change (12 nodes)"


# --------------------------------------------------------------------------- diff


def test_diff_of_identical_graphs_is_empty():
    gm = fx_graph()
    diff = graph_diff(gm, copy.deepcopy(gm))
    assert not diff and diff == GraphDiff((), (), (), ())
    assert str(diff) == "graph diff: 0 added, 0 removed, 0 changed, 0 renamed"


def test_diff_added_removed_changed():
    before = fx_graph()
    after = copy.deepcopy(before)
    g = after.graph
    nodes = {n.name: n for n in g.nodes}
    nodes["gelu"].target = torch.relu  # changed target
    with g.inserting_after(nodes["add"]):  # added node, and `layers_1_fc` now reads it
        neg = g.call_function(torch.neg, (nodes["add"],))
    nodes["layers_1_fc"].args = (neg,)
    nodes["gelu_1"].replace_all_uses_with(nodes["add"])  # removed node
    g.erase_node(nodes["gelu_1"])
    after.recompile()

    diff = graph_diff(before, after)
    assert [s.name for s in diff.added] == ["neg"]
    assert str(diff.added[0]) == "neg = call_function torch.neg(%add)"
    assert [s.name for s in diff.removed] == ["gelu_1"]
    changed = {c.after.name: c.fields for c in diff.changed}
    assert changed == {"gelu": ("target",), "layers_1_fc": ("args",), "add_1": ("args",)}
    text = str(diff)
    assert text.splitlines()[0] == "graph diff: 1 added, 1 removed, 3 changed, 0 renamed"
    assert "- gelu_1 = call_function torch.nn.functional.gelu(%add)" in text
    assert "    -> layers_1_fc = call_module layers.1.fc(%neg)   [args]" in text


def test_diff_matches_renamed_nodes_by_signature():
    def build(names):
        g = torch.fx.Graph()
        x = g.placeholder("x")
        a = g.call_function(torch.relu, (x,), name=names[0])
        b = g.call_function(torch.neg, (a,), name=names[1])
        g.output(b)
        return g

    diff = graph_diff(build(["r", "n"]), build(["r2", "n2"]))
    assert diff.renamed == (("r", "r2"), ("n", "n2"))
    assert diff.added == () and diff.removed == () and diff.changed == ()
    # the output reads the renamed node: same value, not a change
    assert "> r renamed to r2" in str(diff)


# --------------------------------------------------------------------------- DOT


def parse_dot(text: str):
    """A strict reader for the DOT subset to_dot writes: returns (nodes {id: attrs}, edges)."""
    lines = text.strip().splitlines()
    assert lines[0] == "digraph fxsplit {" and lines[-1] == "}"
    depth, nodes, edges = 0, {}, []
    quoted = r'"((?:[^"\\]|\\.)*)"'
    for line in lines:
        depth += line.count("{") - line.count("}")
        s = line.strip()
        if m := re.fullmatch(quoted + r" -> " + quoted + ";", s):
            edges.append((m.group(1), m.group(2)))
        elif m := re.fullmatch(quoted + r" \[(.*)\];", s):
            attrs = dict(re.findall(r'(\w+)=' + quoted, m.group(2)))
            nodes[m.group(1)] = attrs
        else:
            assert re.fullmatch(r'(digraph fxsplit \{|\}|subgraph cluster_legend \{|rankdir=TB;|'
                                r'node \[.*\];|label="legend"; fontname="monospace";)', s), s
    assert depth == 0
    for a, b in edges:
        assert a in nodes and b in nodes, (a, b)
    return nodes, edges


def test_dot_is_valid_and_colored_by_module():
    gm = fx_graph()
    text = to_dot(gm, module_depth=2)
    nodes, edges = parse_dot(text)
    graph_nodes = list(gm.graph.nodes)
    assert len(edges) == sum(len(n.all_input_nodes) for n in graph_nodes)
    assert ("layers_0_fc", "layers_0_act") in edges
    color = {n: nodes[n]["fillcolor"] for n in ("layers_0_fc", "gelu", "layers_1_fc", "x")}
    assert color["layers_0_fc"] == color["gelu"]  # both in layers.0
    assert len({color["layers_0_fc"], color["layers_1_fc"], color["x"]}) == 3
    assert nodes["layers_0_fc"]["label"] == r"layers_0_fc\ncall_module layers.0.fc\nlayers.0"
    legend = [a["label"] for k, a in nodes.items() if k.startswith("__legend_")]
    assert legend == ["(top level)", "layers.0", "layers.1"]


def test_dot_colored_by_stage():
    gm = fx_graph()
    compute = [n.name for n in gm.graph.nodes if n.op in ("call_module", "call_function")]
    stage_of = {name: (0 if i < 4 else 1) for i, name in enumerate(compute)}
    nodes, _ = parse_dot(to_dot(gm, color_by="stage", stage_of=stage_of))
    assert nodes["x"]["fillcolor"] == "#ffffff"  # placeholders carry no stage
    s0 = {nodes[n]["fillcolor"] for n, s in stage_of.items() if s == 0}
    s1 = {nodes[n]["fillcolor"] for n, s in stage_of.items() if s == 1}
    assert len(s0) == 1 and len(s1) == 1 and s0 != s1
    with pytest.raises(ValueError, match="needs stage_of"):
        to_dot(gm, color_by="stage")
    with pytest.raises(ValueError, match="use 'module' or 'stage'"):
        to_dot(gm, color_by="layer")


def test_dot_escapes_quotes_and_backslashes():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_method("view", (x, -1))
    y.meta["nn_module_stack"] = {"m": ('L[\'self\'].blk["a\\b"]', "Blk")}
    g.output(y)
    nodes, edges = parse_dot(to_dot(g))
    assert edges == [("x", "view"), ("view", "output")]
    # the path L['self'].blk["a\b"] as DOT text: quotes and the backslash escaped
    assert nodes["view"]["label"] == "view\\ncall_method view\\nL['self'].blk[\\\"a\\\\b\\\"]"


def test_dot_writes_files(tmp_path, caplog):
    gm = fx_graph()
    text = to_dot(gm, tmp_path / "g.dot")
    assert (tmp_path / "g.dot").read_text() == text
    with caplog.at_level(logging.WARNING, logger="fxsplit.graph.inspection"):
        to_dot(gm, tmp_path / "r.svg")
    assert (tmp_path / "r.dot").read_text() == text
    if shutil.which("dot") is None:
        assert not (tmp_path / "r.svg").exists()
        assert "graphviz 'dot' not found" in caplog.text
    else:
        assert (tmp_path / "r.svg").read_text().lstrip().startswith("<?xml")


def test_diff_prints_tensor_constants_by_shape():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.add, (x, torch.zeros(1000, 3)), {"alpha": 2})
    z = g.call_function(torch.cat, ([x, y],), {"dim": slice(0, None, None)})
    g.output((z,))
    diff = graph_diff(torch.fx.Graph(), g)
    text = str(diff)
    assert "add = call_function torch.add(%x, tensor([1000, 3], float32), alpha=2)" in text
    assert "cat = call_function torch.cat([%x, %add], dim=slice(0, None, None))" in text
    assert "+ x = placeholder x\n" in text
    assert "output = output ((%cat,))" in text
    assert len(diff.added) == 4 and diff.removed == ()
