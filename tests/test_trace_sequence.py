"""[Note: a static sequence for export] (fxsplit.graph.trace): ``dynamic_sequence`` decides
whether the sequence is a symbol; plans trace it symbolically with fx and statically with export
by default, and a step at another length is refused naming the fix, never run wrongly."""

import pytest
import torch

import fxsplit
from fxsplit.errors import PlanError
from fxsplit.graph.shapes import batch_dims
from fxsplit.testing import zoo


def _dims(gm):
    ph = next(n for n in gm.graph.nodes if n.op == "placeholder")
    return list(batch_dims(ph.meta["val"]))  # the batch read as a symbol ([Note: a marker batch])


def test_sequence_symbolic_by_method():
    model, args, _ = zoo.make_gpt(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16, batch_size=2,
                                  seq_len=8)
    for method, seq, want in (("export", None, False), ("export", True, True), ("fx", None, True), ("fx", False, False)):
        gm = fxsplit.trace(model, args, method=method, dynamic_sequence=seq)
        info = gm.meta["fxsplit"]
        batch, length = _dims(gm)
        assert batch == info.symbols["batch"], (method, seq)
        assert ("seq" in info.symbols) == want and (length == 8) != want, (method, seq)
        if not want:  # the costs are symbolic in the batch only
            assert all(s == info.symbols["batch"] for n in gm.graph.nodes if n.meta.get("fxsplit") is not None
                       and n.meta["fxsplit"].cost is not None for s in n.meta["fxsplit"].cost.free_symbols)


def test_plan_with_export_traces_the_example_sequence_and_refuses_another():
    from fxsplit.api.model import check_batch

    model, args, _ = zoo.make_gpt(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16, batch_size=4,
                                  seq_len=8)
    # follow_sequence=False: the static graph as traced (tests/test_sequence_follow.py has the default)
    p = fxsplit.plan(model, args, pp=2, microbatches=2, schedule="1f1b", method="export", follow_sequence=False)
    assert "seq" not in p.graph.meta["fxsplit"].symbols
    check_batch([torch.zeros(6, 8, dtype=torch.long)], p, "step")  # another batch size: fine
    with pytest.raises(ValueError, match="dynamic_sequence=True"):
        check_batch([torch.zeros(4, 12, dtype=torch.long)], p, "step")
    with pytest.raises(PlanError, match="dynamic_sequence must be"):
        fxsplit.ParallelConfig(dynamic_sequence="yes")
