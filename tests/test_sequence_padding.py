"""[Note: padding to the traced length] (fxsplit.api.padding): a plan traced by torch.export at a
fixed length serves every shorter length, padded on the right and cut back, exactly; verify refuses
a model the padding would change; packed documents (position ids restarting per document) run as
each document alone. The plans here pad (follow_sequence=False); tests/test_sequence_follow.py has
plans that take every length as it is. One process; the gloo runs are in
tests/test_sequence_lengths_dist.py."""

import functools

import pytest
import torch
from torch import nn

import fxsplit
from fxsplit.api.packing import position_ids_from_documents
from fxsplit.api.padding import outputs_cut, pad_to_traced, traced_length
from fxsplit.errors import PlanError, VerificationError
from fxsplit.testing import hf_zoo
from fxsplit.testing.trace_cache import SharedTraces, shared_traces

PACKED = ((0, 5), (5, 12), (12, 16))  # three documents in a row of 16
_TRACES = SharedTraces()  # a plan of the same model and inputs in two tests: one torch.export trace


@functools.cache
def _llama():
    return hf_zoo.make_hf("llama", batch_size=2, seq_len=16)


def _packed_positions(batch):
    docs = torch.cat([torch.full((b - a,), i) for i, (a, b) in enumerate(PACKED)]).expand(batch, -1)
    return position_ids_from_documents(docs)


def test_position_ids_from_documents():
    docs = torch.tensor([[7, 7, 7, 3, 3, 9], [1, 1, 1, 1, 1, 1]])
    assert position_ids_from_documents(docs).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]
    assert _packed_positions(1).tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]]
    with pytest.raises(TypeError, match="integer tensor"):
        position_ids_from_documents(torch.zeros(2, 3))


def test_pad_inputs_and_cut_outputs():
    model, args, kwargs = _llama()
    pos = torch.arange(16).expand(2, -1).clone()
    p = fxsplit.plan(model, args, {**kwargs, "position_ids": pos}, pp=2, microbatches=2, schedule="1f1b",
                     method="export", follow_sequence=False)
    assert traced_length(p) == 16
    ids, mask = args[0][:, :10], kwargs["attention_mask"][:, :10]
    flat, t = pad_to_traced([ids, mask, pos[:, :10]], p)
    assert t == 10 and [tuple(x.shape) for x in flat] == [(2, 16)] * 3
    assert torch.equal(flat[0][:, :10], ids) and not flat[1][:, 10:].any()  # padded keys masked
    assert torch.equal(flat[2], pos)  # positions count on
    assert pad_to_traced([args[0], kwargs["attention_mask"], pos], p) == ([args[0], kwargs["attention_mask"], pos], None)
    cut = outputs_cut(p, t)([torch.zeros(2, 16, 7), torch.zeros(2, 3)])
    assert [tuple(x.shape) for x in cut] == [(2, 10, 7), (2, 3)]
    with pytest.raises(PlanError, match="traced at 16"):
        pad_to_traced([torch.zeros(2, 20, dtype=torch.long)] * 3, p)
    with pytest.raises(PlanError, match="different lengths"):
        pad_to_traced([ids, mask[:, :9], pos[:, :10]], p)
    with shared_traces(_TRACES):
        off = fxsplit.plan(model, args, kwargs, pp=2, microbatches=2, schedule="1f1b", method="export", pad_sequence=False)
    assert traced_length(off) is None


class _Bidirectional(nn.Module):
    """Every position attends to every other, with no mask: padding changes every output."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 32)

    def forward(self, ids):
        q, k, v = self.qkv(self.emb(ids)).chunk(3, dim=-1)
        return self.out(nn.functional.scaled_dot_product_attention(q, k, v))


def _lm_loss(out, y):
    return nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def test_verify_checks_that_padding_is_exact():
    model, args, kwargs = _llama()
    with shared_traces(_TRACES):
        p = fxsplit.plan(model, args, kwargs, tp=2, pp=2, microbatches=2, schedule="1f1b", method="export",
                         follow_sequence=False)
    fxsplit.verify(model, args, p, kwargs)  # causal: a real position never reads a padded one
    # shorter examples run padded, as steps do: outputs, loss and every gradient against the model
    for t in (9, 13):
        y = torch.randint(0, 256, (2, t), generator=torch.Generator().manual_seed(t))
        report = fxsplit.verify(model, (args[0][:, :t],), p, {"attention_mask": kwargs["attention_mask"][:, :t]},
                                loss_fn=_lm_loss, target=y, quiet=True)
        assert report.gradients > 0

    torch.manual_seed(0)
    bi, ids = _Bidirectional(), torch.randint(0, 32, (2, 8))
    with shared_traces(_TRACES):
        p = fxsplit.plan(bi, (ids,), pp=2, microbatches=2, schedule="1f1b", method="export", follow_sequence=False)
    # at the traced length the plan is right: verify passes and refuses padding for this plan (its
    # half is checked), so a shorter step raises naming the fix; a shorter example fails verify
    fxsplit.verify(bi, (ids,), p, quiet=True)
    with pytest.raises(PlanError, match="pad_sequence=False"):
        pad_to_traced([ids[:, :5]], p)
    with pytest.raises(PlanError, match="pad_sequence=False"):  # the plan refuses shorter steps now
        fxsplit.verify(bi, (ids[:, :5],), p)
    with shared_traces(_TRACES):  # padding asked for explicitly: verify at the traced length raises
        p = fxsplit.plan(bi, (ids,), pp=2, microbatches=2, schedule="1f1b", method="export", pad_sequence=True,
                         follow_sequence=False)
    with pytest.raises(VerificationError, match="pad_sequence=False"):
        fxsplit.verify(bi, (ids,), p)
    with pytest.raises(VerificationError, match="pad_sequence=False"):  # a shorter example, checked first
        fxsplit.verify(bi, (ids[:, :5],), p)
    with shared_traces(_TRACES):
        p = fxsplit.plan(bi, (ids,), pp=2, microbatches=2, schedule="1f1b", method="export", pad_sequence=False)
    fxsplit.verify(bi, (ids,), p)


def test_packed_documents_equal_each_document_alone():
    model, args, _ = hf_zoo.make_hf("llama", batch_size=2, seq_len=16)
    ids, pos = args[0], _packed_positions(2)
    alone = torch.cat([model(ids[:, a:b], position_ids=pos[:, a:b]).logits for a, b in PACKED], dim=1)
    torch.testing.assert_close(model(ids, position_ids=pos).logits, alone, rtol=1e-5, atol=1e-6)
    # the plan on the packed batch equals the unsplit model (outputs and every gradient), padded too
    p = fxsplit.plan(model, (ids,), {"position_ids": pos}, tp=2, pp=2, microbatches=2, schedule="1f1b",
                     method="export", follow_sequence=False)
    fxsplit.verify(model, (ids,), p, {"position_ids": pos})
    y = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    fxsplit.verify(model, (ids[:, :10],), p, {"position_ids": pos[:, :10]}, loss_fn=_lm_loss, target=y, quiet=True)
