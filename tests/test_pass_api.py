"""Pass API: PassResult/PassContext, PassManager checks and failure notes, ordering constraints,
disabling by name, the registry (decorator and entry points), and per-pass debug dumps."""

from __future__ import annotations

import functools
import importlib
import sys
import textwrap

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from fxsplit import config
from fxsplit.graph.pass_api import (
    PassContext,
    PassManager,
    PassResult,
    get_pass,
    load_entry_point_passes,
    pass_name,
    register_pass,
    registered_passes,
    this_before_that,
    unregister_pass,
)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return F.gelu(self.fc(x)) + x


def traced() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return torch.fx.symbolic_trace(Tiny())


def gelu_to_relu(gm, ctx):
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is F.gelu:
            node.target = torch.relu
            changed = True
    return PassResult(gm, changed)


def noop(gm, ctx):
    return PassResult(gm, False)


def record_order(gm, ctx, *, tag):
    ctx.report.setdefault("order", []).append(tag)
    return PassResult(gm, False)


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


# --------------------------------------------------------------------------- results and names


def test_pass_result_validates_types():
    gm = traced()
    with pytest.raises(TypeError, match="graph_module must be a torch.fx.GraphModule, got Tiny"):
        PassResult(Tiny(), True)
    with pytest.raises(TypeError, match="modified must be a bool, got int"):
        PassResult(gm, 1)
    result = PassResult(gm, True)
    with pytest.raises(AttributeError):
        result.modified = False  # frozen


def test_pass_name_sees_through_partial():
    assert pass_name(gelu_to_relu) == "gelu_to_relu"
    bound = functools.partial(functools.partial(record_order, tag="a"))
    assert pass_name(bound) == "record_order"


# --------------------------------------------------------------------------- running


def test_manager_runs_in_order_and_reports():
    gm = traced()
    x = torch.randn(3, 4)
    expected = torch.relu(gm.fc(x)) + x
    passes = [functools.partial(record_order, tag="first"), gelu_to_relu,
              functools.partial(record_order, tag="second")]
    ctx = PassContext(example_args=(x,), options={"tp": 2})
    result = PassManager(passes, debug=False)(gm, ctx)
    assert result.modified is True
    assert ctx.report["order"] == ["first", "second"]
    assert [r.name for r in ctx.history] == ["record_order", "gelu_to_relu", "record_order"]
    assert [r.modified for r in ctx.history] == [False, True, False]
    assert all(r.seconds >= 0 and r.nodes_before == r.nodes_after for r in ctx.history)
    assert torch.relu in targets(result.graph_module)
    # recompiled after the pass: the module computes the new graph
    torch.testing.assert_close(result.graph_module(x), expected, rtol=0, atol=0)


def test_manager_unmodified_when_no_pass_changes():
    result = PassManager([noop], debug=False)(traced())
    assert result.modified is False


def test_pass_returning_wrong_type_names_pass():
    def forgets_result(gm, ctx):
        return gm

    with pytest.raises(TypeError) as info:
        PassManager([noop, forgets_result], debug=False)(traced())
    msg = str(info.value)
    assert "pass 'forgets_result' returned Tiny;" in msg
    assert "PassResult(graph_module, modified)" in msg and "['noop']" in msg


def test_a_pass_failing_inside_a_no_grad_block_leaves_grad_mode_on():
    """[Note: grad mode kept across a pass]: torch's wrap_with_set_grad_enabled turns grad mode off and
    does not turn it back on when its body raises; the manager restores the mode the pass began in."""

    def body(x):
        raise RuntimeError("body failed")

    def runs_a_block(gm, ctx):
        torch.ops.higher_order.wrap_with_set_grad_enabled(False, body, torch.ones(2))
        return PassResult(gm, False)

    assert torch.is_grad_enabled()
    try:
        with pytest.raises(RuntimeError, match="body failed"):
            PassManager([runs_a_block], debug=False)(traced())
        assert torch.is_grad_enabled()
    finally:
        torch.set_grad_enabled(True)


def test_failing_pass_reraises_original_with_note():
    boom = KeyError("missing thing")

    def explode(gm, ctx):
        raise boom

    with pytest.raises(KeyError) as info:
        PassManager([gelu_to_relu, noop, explode], debug=False)(traced())
    assert info.value is boom
    notes = "\n".join(info.value.__notes__)
    assert "in pass 'explode'" in notes
    assert "passes that ran before 'explode': gelu_to_relu, noop" in notes


def test_lint_failure_after_pass_is_attributed():
    def breaks_graph(gm, ctx):
        # use a node before it is defined: move the output's producer after the output
        add = [n for n in gm.graph.nodes if n.op == "call_function"][-1]
        gm.graph.output_node().append(add)
        return PassResult(gm, True)

    with pytest.raises(RuntimeError) as info:
        PassManager([noop, breaks_graph], debug=False)(traced())
    notes = "\n".join(info.value.__notes__)
    assert "graph lint/recompile after pass 'breaks_graph'" in notes
    assert "passes that ran before 'breaks_graph': noop" in notes


def no_relu(gm):
    if torch.relu in targets(gm):
        raise ValueError("relu found")


def test_check_failure_names_check_and_pass():
    with pytest.raises(ValueError, match="relu found") as info:
        PassManager([noop, gelu_to_relu, noop], checks=[no_relu], debug=False)(traced())
    notes = "\n".join(info.value.__notes__)
    assert "invariant check 'no_relu' after pass 'gelu_to_relu'" in notes
    assert "passes that ran before 'gelu_to_relu': noop" in notes


def test_check_failure_on_input_graph():
    def never(gm):
        raise AssertionError("bad input")

    with pytest.raises(AssertionError) as info:
        PassManager([noop], checks=[never], debug=False)(traced())
    assert "on the input graph, before any pass ran" in info.value.__notes__[0]


def test_checks_pass_when_invariant_holds():
    calls = []
    PassManager([noop, noop], checks=[lambda gm: calls.append(1)], debug=False)(traced())
    assert len(calls) == 3  # the input graph and after each pass


def test_manager_rejects_bad_arguments():
    with pytest.raises(TypeError, match="wrap a single pass as"):
        PassManager(noop)
    with pytest.raises(TypeError, match=r"passes\[1\] is not callable"):
        PassManager([noop, 3])
    with pytest.raises(TypeError, match="expects a torch.fx.GraphModule, got Tiny"):
        PassManager([noop], debug=False)(Tiny())
    with pytest.raises(ValueError, match="needs a folder"):
        PassManager([noop], debug=True)


# --------------------------------------------------------------------------- constraints, disable


def test_constraint_violation_names_both_passes():
    with pytest.raises(ValueError) as info:
        PassManager([noop, gelu_to_relu], constraints=[this_before_that("gelu_to_relu", "noop")])
    msg = str(info.value)
    assert "this_before_that('gelu_to_relu', 'noop')" in msg
    assert "pass 'noop' (position 0) runs before pass 'gelu_to_relu' (position 1)" in msg


def test_constraint_satisfied_and_ignores_absent_or_disabled():
    c = [this_before_that("gelu_to_relu", "noop")]
    PassManager([gelu_to_relu, noop], constraints=c)
    PassManager([noop], constraints=c)
    PassManager([noop, gelu_to_relu], constraints=c, disabled=["noop"])


def test_custom_constraint_function():
    def noop_last(a, b):
        return a != "noop"

    with pytest.raises(ValueError, match="violates constraint noop_last"):
        PassManager([noop, gelu_to_relu], constraints=[noop_last])


def test_disabled_pass_is_skipped():
    ctx = PassContext()
    result = PassManager([gelu_to_relu, noop], disabled=["gelu_to_relu"], debug=False)(
        traced(), ctx
    )
    assert result.modified is False
    assert [r.name for r in ctx.history] == ["noop"]
    assert F.gelu in targets(result.graph_module)


def test_disabled_unknown_name_suggests_close_names():
    with pytest.raises(ValueError) as info:
        PassManager([gelu_to_relu, noop], disabled=["gelu_to_rel"])
    assert "did you mean 'gelu_to_relu'" in str(info.value)


# --------------------------------------------------------------------------- registry


@pytest.fixture
def clean_registry():
    before = set(registered_passes())
    yield
    for name in set(registered_passes()) - before:
        unregister_pass(name)


def test_register_by_decorator_and_use_by_name(clean_registry):
    @register_pass("test_swap")
    def swap(gm, ctx):
        return gelu_to_relu(gm, ctx)

    assert get_pass("test_swap") is swap
    assert registered_passes()["test_swap"] is swap
    pm = PassManager(["test_swap", noop], disabled=[], debug=False)
    assert pm.names == ("test_swap", "noop")
    result = pm(traced())
    assert result.modified and torch.relu in targets(result.graph_module)
    # disabling by the registered name
    pm = PassManager(["test_swap"], disabled=["test_swap"], debug=False)
    assert pm.enabled_names == ()


def test_register_conflict_and_unknown(clean_registry):
    register_pass("test_dup")(noop)
    register_pass("test_dup")(noop)  # same function again is fine
    with pytest.raises(ValueError, match="already registered to .*noop.*replace=True"):
        register_pass("test_dup")(gelu_to_relu)
    register_pass("test_dup", replace=True)(gelu_to_relu)
    assert get_pass("test_dup") is gelu_to_relu
    with pytest.raises(KeyError, match="did you mean 'test_dup'") as info:
        get_pass("test_dpu")
    assert str(info.value).startswith("no pass named 'test_dpu'")  # not wrapped in quotes
    with pytest.raises(KeyError, match="no pass named"):
        PassManager(["definitely_not_a_pass"])


def test_entry_point_passes(tmp_path, monkeypatch, clean_registry):
    pkg = tmp_path / "fake_fxsplit_plugin.py"
    pkg.write_text(textwrap.dedent("""
        from fxsplit.graph.pass_api import PassResult
        LOADS = []
        def plugin_pass(gm, ctx):
            ctx.report["plugin"] = "ran"
            return PassResult(gm, False)
    """))
    dist = tmp_path / "fake_fxsplit_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-fxsplit-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[fxsplit.passes]\nplugin_pass = fake_fxsplit_plugin:plugin_pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert "plugin_pass" not in registered_passes()  # nothing is discovered at import time
    loaded = load_entry_point_passes()
    assert set(loaded) == {"plugin_pass"}
    fn = get_pass("plugin_pass")
    assert fn is sys.modules["fake_fxsplit_plugin"].plugin_pass
    ctx = PassContext()
    PassManager(["plugin_pass"], debug=False)(traced(), ctx)
    assert ctx.report["plugin"] == "ran"
    # loading again registers the same object: no conflict
    assert load_entry_point_passes()["plugin_pass"] is fn


def test_entry_point_lookup_is_lazy_in_get_pass(tmp_path, monkeypatch, clean_registry):
    (tmp_path / "fake_fxsplit_plugin2.py").write_text(
        "from fxsplit.graph.pass_api import PassResult\n"
        "def other(gm, ctx):\n    return PassResult(gm, False)\n"
    )
    dist = tmp_path / "fake_fxsplit_plugin2-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-fxsplit-plugin2\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[fxsplit.passes]\nlazy_pass = fake_fxsplit_plugin2:other\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert pass_name(get_pass("lazy_pass")) == "other"


# --------------------------------------------------------------------------- debug dumps


def test_debug_dumps_every_pass(tmp_path):
    out = tmp_path / "dbg"
    PassManager([gelu_to_relu, noop, noop], disabled=["noop"], debug=out)(traced())
    # the disabled name covers both noop entries
    folder = out / "00_gelu_to_relu"
    assert sorted(p.name for p in folder.iterdir()) == [
        "after.py", "before.py", "diff.txt", "op_counts.txt", "time.txt"
    ]
    assert "torch._C._nn.gelu" in (folder / "before.py").read_text()
    assert "torch.relu" in (folder / "after.py").read_text()
    ops = (folder / "op_counts.txt").read_text()
    assert "call_function:torch.nn.functional.gelu: 1 -> 0 (-1)" in ops
    assert "call_function:torch.relu: 0 -> 1 (+1)" in ops
    diff = (folder / "diff.txt").read_text()
    assert "1 changed" in diff and "[target]" in diff
    assert "modified: True" in (folder / "time.txt").read_text()
    summary = (out / "summary.txt").read_text()
    assert "00_gelu_to_relu  True" in summary and "disabled: noop, noop" in summary


def test_debug_from_env_and_explicit_off(tmp_path, monkeypatch):
    out = tmp_path / "from_env"
    assert config.debug_dir_from_env({}) is None
    assert config.debug_dir_from_env({config.DEBUG_DIR_ENV: "  "}) is None
    assert config.debug_dir_from_env({config.DEBUG_DIR_ENV: str(out)}) == out
    monkeypatch.setenv(config.DEBUG_DIR_ENV, str(out))
    PassManager([noop], debug=False)(traced())
    assert not out.exists()
    PassManager([noop])(traced())
    assert (out / "00_noop" / "after.py").exists()
    assert "no change" in (out / "00_noop" / "op_counts.txt").read_text()


def test_debug_failure_and_rerun(tmp_path):
    out = tmp_path / "dbg"

    def explode(gm, ctx):
        assert ctx.debug_dir == out / "01_explode"
        raise RuntimeError("kaboom")

    with pytest.raises(RuntimeError, match="kaboom"):
        PassManager([noop, explode], debug=out)(traced())
    error = (out / "01_explode" / "error.txt").read_text()
    assert "kaboom" in error and "in pass 'explode'" in error
    assert not (out / "01_explode" / "after.py").exists()
    assert "FAILED: RuntimeError" in (out / "summary.txt").read_text()
    # a new run in the same folder removes the folders of the previous run
    (out / "user_notes.txt").write_text("keep me")
    PassManager([gelu_to_relu], debug=out)(traced())
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["00_gelu_to_relu"]
    assert (out / "user_notes.txt").exists()


def test_debug_warns_when_modified_flag_is_wrong(tmp_path, caplog):
    def sneaky(gm, ctx):
        gelu_to_relu(gm, ctx)
        return PassResult(gm, False)

    PassManager([sneaky], debug=tmp_path)(traced())
    summary = (tmp_path / "summary.txt").read_text()
    assert "warning: pass 'sneaky' returned modified=False but changed the graph code" in summary


# --------------------------------------------------------------------------- examples/custom_pass.py


@pytest.fixture(scope="module")
def example():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "custom_pass.py"
    spec = importlib.util.spec_from_file_location("fxsplit_example_custom_pass", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # registers "gelu_to_tanh"
    yield module
    unregister_pass("gelu_to_tanh")


def test_example_main_changes_graph_and_keeps_numerics(example, tmp_path):
    s = example.main(str(tmp_path), verbose=False)
    assert s["modified"] is True
    assert s["report"] == {
        "gelu_to_tanh": ["gelu_1", "gelu_2", "gelu_3"],
        "checkpoint_blocks": ["blocks.0", "blocks.1"],
    }
    added = [a.target for a in s["diff"].added]
    assert added.count("torch.utils.checkpoint.checkpoint") == 2
    # equal to the same model written with tanh GELU: output and every gradient
    assert s["max_abs_vs_tanh_model"] <= 1e-6 and s["max_grad_abs_vs_tanh_model"] <= 1e-6
    # different from, but close to, exact GELU
    assert 0 < s["max_abs_vs_exact_gelu"] < 1e-2
    # checkpointing keeps fewer tensors for backward
    assert s["saved_tensors_after"] < s["saved_tensors_before"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "00_gelu_to_tanh", "01_checkpoint_blocks"
    ]


def test_example_gelu_pass_on_exported_graph(example):
    torch.manual_seed(0)
    model = example.TinyMLP()
    x = torch.randn(2, 16)
    gm = torch.export.export(model, (x,), strict=False).module()
    ctx = PassContext()
    result = PassManager(["gelu_to_tanh"], debug=False)(gm, ctx)
    gelus = [n for n in result.graph_module.graph.nodes
             if n.target is torch.ops.aten.gelu.default]
    assert len(gelus) == 3 and all(n.kwargs["approximate"] == "tanh" for n in gelus)
    tanh_model = example.TinyMLP(approximate="tanh")
    tanh_model.load_state_dict(model.state_dict())
    torch.testing.assert_close(result.graph_module(x), tanh_model(x), rtol=1e-5, atol=1e-6)
    # a second run finds nothing left to rewrite
    assert PassManager(["gelu_to_tanh"], debug=False)(result.graph_module).modified is False


def test_example_checkpoint_rejects_unknown_block(example):
    gm = torch.fx.symbolic_trace(example.TinyMLP())
    bad = functools.partial(example.checkpoint_blocks, blocks=("blocks.7",))
    with pytest.raises(ValueError, match="no node comes from module 'blocks.7'") as info:
        PassManager([bad], debug=False)(gm)
    assert "in pass 'checkpoint_blocks'" in info.value.__notes__[0]


def test_example_gelu_pass_keeps_fxsplit_metadata(example):
    import fxsplit

    torch.manual_seed(0)
    model = example.TinyMLP()
    gm = fxsplit.trace(model, (torch.randn(2, 16),), method="fx")

    def every_node_annotated(gm):
        missing = [n.name for n in gm.graph.nodes if "fxsplit" not in n.meta]
        if missing:
            raise ValueError(f"nodes without meta['fxsplit']: {missing}")

    result = PassManager(["gelu_to_tanh"], checks=[every_node_annotated], debug=False)(gm)
    new = [n for n in result.graph_module.graph.nodes
           if n.op == "call_function" and n.kwargs.get("approximate") == "tanh"]
    assert sorted(n.meta["fxsplit"].module_path for n in new) == ["", "blocks.0.act", "blocks.1.act"]
    widths = {n.meta["fxsplit"].module_path: n.meta["fxsplit"].outputs[0].shape[-1] for n in new}
    assert widths == {"": 16, "blocks.0.act": 64, "blocks.1.act": 64}
    assert all(n.meta["fxsplit"].cost is not None for n in new)


def test_same_pass_file_loaded_twice_registers_once(tmp_path):
    import importlib.util

    from fxsplit.graph.pass_api import get_pass, register_pass, unregister_pass

    src = tmp_path / "twice_pass.py"
    src.write_text(
        "from fxsplit.graph.pass_api import PassResult, register_pass\n"
        "@register_pass('loaded_twice')\n"
        "def loaded_twice(gm, ctx):\n    return PassResult(gm, False)\n"
    )
    try:
        for _ in range(2):  # e.g. two tests importing the same example by path
            spec = importlib.util.spec_from_file_location("twice_pass", src)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        assert get_pass("loaded_twice") is mod.loaded_twice
        # a different function under the same name still conflicts
        with pytest.raises(ValueError, match="already registered"):
            register_pass("loaded_twice")(lambda gm, ctx: None)
    finally:
        unregister_pass("loaded_twice")
