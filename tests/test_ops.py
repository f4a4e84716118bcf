"""The op vocabulary (fxsplit.graph.ops): one op name for the fx and the export spelling of each
operator ([Note: op names]), the op classes, the dotted-path resolver, and one definition of
each shared name (op_name, to_expr, TensorMeta, the resolver). No process group."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from fxsplit.errors import FxsplitError, PathError
from fxsplit.graph import ops
from fxsplit.graph.ops import op_name, owner_and_leaf, resolve_path

# ---------------------------------------------------------------------------------------------
# op names: fx and export forms of the same ops


class Ops(nn.Module):
    """One line per op; STEPS below lists, line by line, the op names of its fx and export graphs."""

    def __init__(self):
        super().__init__()
        self.emb, self.lin = nn.Embedding(10, 8), nn.Linear(8, 8)
        self.ln, self.rms = nn.LayerNorm(8), nn.RMSNorm(8)
        self.act, self.drop, self.idn = nn.GELU(), nn.Dropout(0.0), nn.Identity()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x, ids):
        e = self.emb(ids)
        e = F.embedding(ids, self.emb.weight) + e
        h = self.lin(x)
        h = F.linear(h, self.w)
        h = h @ self.w
        h = torch.matmul(h, self.w)
        h = h + e
        h += 1
        h = h.add_(1)
        h = self.ln(h)
        h = self.rms(h)
        h = h.view(2, 3, 8)
        h = h.reshape(6, 8)
        a, b = h.split(4, dim=1)
        h = torch.cat([a, b], dim=1)
        row = h[0]
        h = F.softmax(h, dim=-1)
        h = h.softmax(-1)
        h = self.idn(self.drop(self.act(h)))
        h = h.transpose(0, 1)
        h = h / 2 - h // 3
        return h.float(), row


STEPS = [  # (what, fx op names, export op names)
    ("nn.Embedding", ["embedding"], ["embedding"]),
    ("F.embedding, +", ["embedding", "add"], ["embedding", "add"]),
    ("nn.Linear", ["linear"], ["linear"]),
    ("F.linear", ["linear"], ["linear"]),
    ("@", ["matmul"], ["matmul"]),
    ("torch.matmul", ["matmul"], ["matmul"]),
    ("+", ["add"], ["add"]),
    ("+= (operator.iadd / aten.add_)", ["add"], ["add"]),
    ("x.add_", ["add"], ["add"]),
    ("nn.LayerNorm", ["layer_norm"], ["layer_norm"]),
    ("nn.RMSNorm", ["rms_norm"], ["rms_norm"]),
    ("view", ["view"], ["view"]),
    ("reshape", ["reshape"], ["reshape"]),
    ("split and its getitems", ["split", "getitem", "getitem"], ["split", "getitem", "getitem"]),
    ("torch.cat", ["cat"], ["cat"]),
    ("h[0]: getitem in fx, select in export (both cost nothing)", ["getitem"], ["select"]),
    ("F.softmax", ["softmax"], ["softmax"]),
    ("x.softmax", ["softmax"], ["softmax"]),
    ("GELU, Dropout, Identity (export drops the identity)", ["gelu", "dropout", "alias"], ["gelu", "dropout"]),
    ("transpose", ["transpose"], ["transpose"]),
    ("/, //, -", ["div", "floor_divide", "sub"], ["div", "floor_divide", "sub"]),
    ("x.float(): a cast in both (aten.to.dtype)", ["float"], ["to"]),
]


def _compute_names(gm: torch.fx.GraphModule) -> list[str]:
    names = [op_name(n, gm) for n in gm.graph.nodes if n.op.startswith("call")]
    return [n for n in names if n not in ("assert_tensor_metadata", "module:GuardsFn")]


@pytest.fixture(scope="module")
def graphs():
    model, args = Ops(), (torch.randn(6, 8), torch.randint(0, 10, (6,)))
    fx = torch.fx.symbolic_trace(model)
    export = torch.export.export(model, args, strict=False).module()
    return {"fx": fx, "export": export}


@pytest.mark.parametrize("method", ["fx", "export"])
def test_fx_and_export_spellings_share_one_name(graphs, method):
    column = 1 if method == "fx" else 2
    want = [(step[0], name) for step in STEPS for name in step[column]]
    got = _compute_names(graphs[method])
    assert got == [name for _, name in want], "\n".join(
        f"{'  ' if i < len(got) and got[i] == w else '>>'} {what}: want {w!r}, got {got[i] if i < len(got) else None!r}"
        for i, (what, w) in enumerate(want)
    )


def test_decomposed_aten_spellings():
    """Core-ATen spellings (after decompositions) name the same ops as the graphs above."""
    aten = torch.ops.aten
    g = torch.fx.Graph()
    x = g.placeholder("x")
    cases = {
        aten.native_layer_norm.default: "layer_norm", aten._unsafe_view.default: "view",
        aten._to_copy.default: "to", aten._softmax.default: "softmax", aten._log_softmax.default: "log_softmax",
        aten.native_dropout.default: "dropout", aten.add_.Tensor: "add", aten.rsub.Scalar: "sub",
        aten.mul.Tensor: "mul", aten.addmm.default: "addmm", aten.t.default: "t", aten.mm.default: "mm",
        aten.sym_size.int: "sym_size", aten.alias.default: "alias", aten.add: "add",  # an overload packet
        operator.truediv: "div", operator.imul: "mul", operator.isub: "sub", operator.getitem: "getitem",
        getattr: "getattr",
    }
    for target, want in cases.items():
        assert op_name(g.call_function(target, (x,))) == want, target
    assert op_name(x) == "placeholder"
    assert op_name(g.output(x)) == "output"


def test_module_names():
    class Subclass(nn.Linear):  # runs nn.Linear's forward: a linear
        pass

    class Overrides(nn.Linear):  # computes something else: named by its own class
        def forward(self, x):
            return super().forward(x).relu()

    class Linear(nn.Module):  # a user class that only shares the name
        def forward(self, x):
            return x

    root = nn.Module()
    root.a, root.b, root.c = Subclass(2, 2), Overrides(2, 2), Linear()
    root.d, root.e = nn.Conv2d(1, 1, 1), nn.MultiheadAttention(4, 1)
    g = torch.fx.Graph()
    x = g.placeholder("x")
    names = {t: op_name(g.call_module(t, (x,)), root) for t in ("a", "b", "c", "d", "e", "missing")}
    assert names == {"a": "linear", "b": "module:Overrides", "c": "module:Linear", "d": "convolution",
                     "e": "module:MultiheadAttention", "missing": "module:?"}


def test_op_classes():
    classes = [ops.RESHAPES, ops.VIEWS, ops.METADATA, ops.COST_FREE, ops.COPIES, ops.CASTS, ops.CREATION,
               ops.ELEMENTWISE, ops.REDUCTIONS, ops.MATMULS, ops.NORMS]
    for cls in classes:  # normalized names only: no "_to_copy", "add_", "native_layer_norm"
        assert isinstance(cls, frozenset)
        assert all(n == n.strip("_") and not n.startswith("native_") for n in cls), sorted(cls)
    assert ops.RESHAPES <= ops.VIEWS <= ops.COST_FREE and ops.CASTS <= ops.COPIES
    g = torch.fx.Graph()
    x = g.placeholder("x")
    assert ops.is_elementwise(g.call_function(torch.ops.aten.erfinv.default, (x,)))  # by aten's pointwise tag
    assert ops.is_elementwise(g.call_method("masked_fill_", (x, x, 0.0)))
    assert not ops.is_elementwise(g.call_function(torch.ops.aten.sum.default, (x,)))


# ---------------------------------------------------------------------------------------------
# dotted paths


def _tree() -> nn.Module:
    root = nn.Module()
    root.blocks = nn.ModuleList([nn.Sequential(nn.Linear(2, 3))])
    root.register_buffer("scale", torch.ones(1))
    return root


def test_resolve_path_and_owner_and_leaf():
    root = _tree()
    lin = root.blocks[0][0]
    assert resolve_path(root, "") is root
    assert resolve_path(root, "blocks.0.0") is lin
    assert resolve_path(root, "blocks.0.0.weight") is lin.weight
    assert resolve_path(root, "scale") is root.scale
    assert resolve_path(root, "blocks.0.1.weight", default=None) is None
    assert resolve_path(None, "scale", default=None) is None
    assert owner_and_leaf(root, "blocks.0.0.bias") == (lin, "bias")
    assert owner_and_leaf(root, "new_buffer") == (root, "new_buffer")  # the leaf need not exist


def test_path_errors_name_the_path_and_the_missing_component():
    root = _tree()
    with pytest.raises(PathError, match=r"path 'blocks\.0\.0\.wieght': 'blocks\.0\.0' \(Linear\) has no "
                                        r"attribute 'wieght'; did you mean \['weight'\]"):
        resolve_path(root, "blocks.0.0.wieght")
    with pytest.raises(PathError, match=r"path 'block\.0': the root Module has no attribute 'block'"):
        resolve_path(root, "block.0")
    with pytest.raises(PathError, match=r"'blocks\.0\.0\.weight' is a Parameter, not a module"):
        owner_and_leaf(root, "blocks.0.0.weight.data")
    with pytest.raises(PathError, match="empty path"):
        owner_and_leaf(root, "")
    err = PathError("x")
    assert isinstance(err, AttributeError) and isinstance(err, FxsplitError)  # getattr-style callers catch it


# ---------------------------------------------------------------------------------------------
# one definition each


def test_one_definition_of_each_vocabulary_name():
    """op_name, to_expr and the path resolver are defined once; the other modules import them."""
    import ast
    from pathlib import Path

    import fxsplit
    from fxsplit.graph import cost, meta, shapes
    from fxsplit.pipeline.stage import ValueMeta

    homes = {"op_name": "fxsplit/graph/ops.py", "is_elementwise": "fxsplit/graph/ops.py",
             "resolve_path": "fxsplit/graph/ops.py", "owner_and_leaf": "fxsplit/graph/ops.py",
             "to_expr": "fxsplit/graph/shapes.py", "TensorMeta": "fxsplit/graph/shapes.py"}
    root = Path(fxsplit.__file__).resolve().parents[1]
    found: dict[str, list[str]] = {}
    for path in [*(root / "fxsplit").rglob("*.py"), *(root / "passes").glob("*.py")]:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in homes:
                found.setdefault(node.name, []).append(path.relative_to(root).as_posix())
    assert found == {name: [home] for name, home in homes.items()}
    assert cost.op_name is op_name and cost.to_expr is meta.to_expr is shapes.to_expr
    assert meta.TensorMeta is shapes.TensorMeta
    assert ValueMeta("h", True, (2, 3), torch.float32, True).tensor == shapes.TensorMeta((2, 3), torch.float32, True)
