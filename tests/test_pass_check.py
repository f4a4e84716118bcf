"""The PassManager holds every user pass to the metadata contract ([Note: metadata check after a
pass] in fxsplit/graph/pass_check.py): a pass that adds a node without metadata, breaks a shape or
leaves stale metadata fails at that pass, naming the pass and the first bad node."""

import copy

import pytest
import torch
import torch.fx
import torch.nn.functional as F

import fxsplit
from fxsplit.errors import PassContractError
from fxsplit.graph.meta import annotate_node
from fxsplit.graph.pass_api import PassContext, PassManager, PassResult
from fxsplit.testing import zoo


@pytest.fixture(scope="module")
def traced():
    model, args, kwargs = zoo.make("gpt", n_layer=1, seed=0)
    return fxsplit.trace(model, args, kwargs), args


def _gelus(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is F.gelu]


def _swap(gm, make, *, copy_val=False, annotate=False):
    """Replace every F.gelu node by ``make(graph, input)``; optionally keep the contract."""
    for node in _gelus(gm):
        with gm.graph.inserting_after(node):
            new = make(gm.graph, node.args[0])
        if copy_val:
            new.meta["val"] = node.meta["val"]
        if annotate:
            annotate_node(new, gm, module_path=node.meta["fxsplit"].module_path)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    return PassResult(gm, True)


def no_metadata(gm, ctx):
    return _swap(gm, lambda g, x: g.call_function(F.silu, (x,)))


def kept_contract(gm, ctx):
    return _swap(gm, lambda g, x: g.call_function(F.silu, (x,)), copy_val=True, annotate=True)


def shape_breaking(gm, ctx):  # a "swap" to an op of another shape, the old value copied over
    return _swap(gm, lambda g, x: g.call_function(torch.sum, (x, -1)), copy_val=True, annotate=True)


def val_without_info(gm, ctx):
    return _swap(gm, lambda g, x: g.call_function(F.silu, (x,)), copy_val=True)


def _run(traced, fn, **kwargs):
    gm, args = traced
    return PassManager([fn], **kwargs)(copy.deepcopy(gm), PassContext(example_args=args))


def test_node_added_without_metadata_names_pass_node_and_fix(traced):
    with pytest.raises(PassContractError) as info:
        _run(traced, no_metadata)
    exc = info.value
    assert exc.pass_name == "no_metadata" and exc.node == "silu"
    assert 'has no meta["val"]' in str(exc) and "annotate_node(node, gm)" in str(exc)
    assert any("metadata check after pass 'no_metadata'" in note for note in exc.__notes__)


def test_new_node_with_val_but_no_nodeinfo(traced):
    with pytest.raises(PassContractError, match=r'node \'silu\'.*has no meta\["fxsplit"\]'):
        _run(traced, val_without_info)


def test_stale_metadata_is_caught_by_fake_propagation(traced):
    with pytest.raises(PassContractError) as info:
        _run(traced, shape_breaking)
    msg = str(info.value)
    # the new node's own NodeInfo was refreshed from the stale val: the fake run shows the lie
    assert info.value.node == "sum_1" and "computes [s" in msg and "but its meta[\"val\"] says" in msg, msg


def test_a_reader_that_no_longer_fits_is_named(traced):
    gm, args = traced

    def widen(gm, ctx):  # the up projection's output gets 2x wider, its metadata refreshed honestly
        up = next(n for n in gm.graph.nodes if n.target == "blocks.0.mlp.up")
        with gm.graph.inserting_after(up):
            cat = gm.graph.call_function(torch.cat, ((up, up), -1))
        up.replace_all_uses_with(cat, delete_user_cb=lambda u: u is not cat)
        val = up.meta["val"]
        cat.meta["val"] = torch.cat((val, val), -1)
        annotate_node(cat, gm, module_path="blocks.0.mlp")
        return PassResult(gm, True)

    with pytest.raises(PassContractError) as info:
        _run(traced, widen)
    # gelu reads the wider value: its recomputed shape no longer matches its own metadata
    assert info.value.node == "gelu" and "[s" in str(info.value) and "256]" in str(info.value)


def test_a_pass_that_keeps_the_contract_passes(traced):
    result = _run(traced, kept_contract)
    assert [n.target for n in result.graph_module.graph.nodes if n.name.startswith("silu")] == [F.silu]


def test_check_can_be_turned_off_and_skips_graphs_without_metadata(traced):
    _run(traced, no_metadata, check_metadata=False)
    model, args, _ = zoo.make("gpt", n_layer=1, seed=0)
    plain = torch.fx.symbolic_trace(model)  # no meta["val"]: no contract to keep
    PassManager([no_metadata])(plain, PassContext(example_args=args))


def test_plan_fails_at_the_pass_not_at_run_time(traced):
    model, args, kwargs = zoo.make("gpt", n_layer=1, seed=0)
    with pytest.raises(PassContractError, match="no_metadata"):
        fxsplit.plan(model, args, kwargs, tp=2, passes=[no_metadata])


@pytest.mark.hf
def test_the_issue_case_naive_silu_to_gelu_on_an_exported_llama():
    """The rewrite of issue 31: aten.silu -> aten.gelu with no metadata on an exported Llama used to
    plan, then fail in verify with "The size of tensor a (128) must match the size of tensor b (64)"."""
    pytest.importorskip("transformers")
    from fxsplit.testing import hf_zoo

    aten = torch.ops.aten

    def naive_silu_to_gelu(gm, ctx):
        for node in [n for n in gm.graph.nodes if n.target is aten.silu.default]:
            with gm.graph.inserting_after(node):
                new = gm.graph.call_function(aten.gelu.default, node.args)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
        return PassResult(gm, True)

    model, args, kwargs = hf_zoo.tiny_llama()
    with pytest.raises(PassContractError) as info:
        fxsplit.plan(model, args, kwargs, tp=2, pp=2, passes=[naive_silu_to_gelu])
    assert info.value.pass_name == "naive_silu_to_gelu" and info.value.node.startswith("gelu")
    assert "(call_function gelu.default)" in str(info.value)


def test_a_pass_that_returns_a_copied_graph_module_passes(traced):
    def copies(gm, ctx):  # every node is new; fx's getattr nodes had no meta["val"] before either
        graph = torch.fx.Graph()
        graph.output(graph.graph_copy(gm.graph, {}))  # node_copy keeps names and meta
        return PassResult(torch.fx.GraphModule(gm, graph), True)

    result = _run(traced, copies)
    assert len(result.graph_module.graph.nodes) == len(traced[0].graph.nodes)


def test_a_built_in_pass_is_held_to_the_contract(traced):
    """No exemption by module: a pass shipped as fxsplit.passes.* that breaks a shape is named too."""
    def broken(gm, ctx):
        return shape_breaking(gm, ctx)

    broken.__module__ = "fxsplit.passes.broken"
    with pytest.raises(PassContractError, match="broken"):
        _run(traced, broken)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_keeps_local_shapes_in_its_metadata(traced, sequence_parallel):
    """The tensor-parallel pass passes the check, and every scatter along the sequence (the token
    embedding's, and the position embedding's it is added to) carries this rank's shard's shape."""
    import functools

    from fxsplit.passes.tensor_parallel import tensor_parallel
    from fxsplit.tp.collectives import scatter_to_region

    tp = functools.partial(tensor_parallel, tp=2, sequence_parallel=sequence_parallel)
    gm = _run(traced, tp).graph_module
    scatters = [n for n in gm.graph.nodes if n.target is scatter_to_region]
    assert len(scatters) == (2 if sequence_parallel else 0), [n.format_node() for n in scatters]
    for n in scatters:
        dim, full = n.kwargs["dim"], n.args[0].meta["val"]
        assert n.meta["val"].shape[dim] * 2 == full.shape[dim], (n.name, n.meta["val"].shape, full.shape)
