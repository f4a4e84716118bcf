"""Ring attention (``fxsplit.tp.ring``) in one process: every cp rank's lane of the ring, emulated
(the exchange a rotation of the lanes), against one sdpa over the whole sequence, in float64 so
that the only difference is rounding: outputs and the gradients of q, k and v, with causal,
sliding-window, given (bool and additive) masks, grouped-query heads, a query row with no key and no
mask at all (unmasked and causal blocks run by torch's CPU flash kernel, never holding their scores).
The plan's choice between all-gather and ring ([Note: all-gather or ring]) and its refusals."""

import pytest
import torch
import torch.nn.functional as F

import fxsplit
from fxsplit.errors import PlanError, RunError
from fxsplit.testing import zoo
from fxsplit.testing.trace_cache import SharedTraces, shared_traces
from fxsplit.tp.context import positions_of
from fxsplit.tp.ring import emulated_ring_attention, ring_attention

S = 16


def _ring_vs_sdpa(cp, *, causal=True, window=None, mask=None, heads=4, kv_heads=4, gqa=False):
    g = torch.Generator().manual_seed(cp)
    q, k, v = (torch.randn(2, h, S, 8, dtype=torch.float64, generator=g).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    allowed = torch.ones(S, S, dtype=torch.bool)
    if causal:
        allowed = allowed.tril()
    if window is not None:
        allowed = allowed & ~torch.ones(S, S, dtype=torch.bool).tril(-window)
    full = allowed if mask is None else (allowed & mask if mask.dtype == torch.bool
                                         else mask.masked_fill(~allowed, float("-inf")))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=full, enable_gqa=gqa)
    grad = torch.randn(ref.shape, dtype=ref.dtype, generator=g)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    pos = [positions_of(r, cp, S) for r in range(cp)]
    bound = [dict(q=q[:, :, p], k=k[:, :, p], v=v[:, :, p], attn_mask=None if mask is None else mask[p], scale=None,
                  enable_gqa=gqa, seq_len=S, causal=causal, window=window, axis="cp") for p in pos]
    outs = emulated_ring_attention(bound)
    got = torch.cat(outs, 2).index_select(2, torch.argsort(torch.cat(pos)))
    total = sum((o * grad[:, :, p]).sum() for o, p in zip(outs, pos))
    grads = torch.autograd.grad(total, (q, k, v))
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    for name, a, b in zip("qkv", grads, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"d{name}")


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("case", [
    dict(), dict(window=5), dict(causal=False, mask="bool"), dict(causal=True, mask="additive"),
    dict(kv_heads=2, gqa=True), dict(mask="empty-row"), dict(causal=False),
], ids=["causal", "sliding-window", "bool-mask", "additive-mask", "gqa", "a-row-with-no-key", "bidirectional"])
def test_ring_matches_one_sdpa_over_the_whole_sequence(cp, case):
    case = dict(case)
    g = torch.Generator().manual_seed(7)
    kind = case.pop("mask", None)
    if kind == "bool":
        case["mask"] = torch.rand(S, S, generator=g) > 0.3
    elif kind == "additive":
        case["mask"] = torch.randn(S, S, dtype=torch.float64, generator=g)
    elif kind == "empty-row":  # query 5 reads no key: 0 out, 0 gradient, as sdpa
        mask = torch.ones(S, S, dtype=torch.bool)
        mask[5] = False
        case["mask"] = mask
    _ring_vs_sdpa(cp, **case)


@pytest.mark.parametrize("case", [dict(), dict(causal=False), dict(window=5)],
                         ids=["causal", "bidirectional", "sliding-window"])
def test_no_block_scores_are_materialized(monkeypatch, case):
    """[Note: tiled ring blocks]: every block goes through torch's CPU flash kernel, forward and backward:
    no score matrix by matmul (the reference sdpa runs before matmul is refused), and still exact."""
    import fxsplit.tp.ring_tiles as tiles

    calls = []
    kernel = tiles._aten._scaled_dot_product_flash_attention_for_cpu

    class _Counting:  # the kernel, counted
        _scaled_dot_product_flash_attention_for_cpu = staticmethod(lambda *a, **k: calls.append(1) or kernel(*a, **k))
        _scaled_dot_product_flash_attention_for_cpu_backward = \
            tiles._aten._scaled_dot_product_flash_attention_for_cpu_backward

    monkeypatch.setattr(tiles, "_aten", _Counting)
    real = torch.matmul

    def no_matmul(*args, **kwargs):
        raise AssertionError("a block's scores were computed by matmul")

    case = dict(case)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, S, 8, dtype=torch.float64, generator=g) for _ in range(3))
    pos = [positions_of(r, 2, S) for r in range(2)]
    bound = [dict(q=q[:, :, p], k=k[:, :, p], v=v[:, :, p], attn_mask=None, scale=None, enable_gqa=False,
                  seq_len=S, causal=case.get("causal", True), window=case.get("window"), axis="cp") for p in pos]
    monkeypatch.setattr(torch, "matmul", no_matmul)
    emulated_ring_attention(bound)
    monkeypatch.setattr(torch, "matmul", real)
    assert calls, "the flash kernel never ran"
    _ring_vs_sdpa(2, **case)


def test_a_mask_that_needs_a_gradient_is_refused_naming_the_fix():
    q = torch.randn(1, 2, 8, 4)
    bias = torch.zeros(8, 8, requires_grad=True)
    with pytest.raises(RunError, match="cp_kv='allgather'"):
        ring_attention(q, q, q, bias, seq_len=8)


_TRACES = SharedTraces()


def _plan(hf=None, **opts):
    if hf is None:
        model, args, kwargs = zoo.make_gpt(seq_len=16)  # standard multi-head attention, is_causal (no mask)
    else:
        from fxsplit.testing import hf_zoo

        model, args, kwargs = hf_zoo.make_hf(hf)  # with its attention_mask: a given mask
    with shared_traces(_TRACES):
        return fxsplit.plan(model, args, kwargs, hardware=fxsplit.Hardware(link_bytes_per_s=float("inf")), **opts)


@pytest.mark.parametrize("opts, ring", [
    (dict(cp=2), 4), (dict(cp=4, cp_kv="allgather"), 0),
    (dict(hf="gpt2", cp=2), 0), (dict(hf="gpt2", cp=4), 2), (dict(hf="llama", cp=4), 0),
    (dict(hf="gpt2", cp=2, cp_kv="ring"), 2)],
    ids=["no-mask-cp2-auto", "cp4-allgather", "mha-mask-cp2-auto", "mha-mask-cp4-auto", "gqa-mask-cp4-auto",
         "mha-mask-cp2-ring"])
def test_the_plan_chooses_ring_or_all_gather_by_the_rule_and_says_why(opts, ring):
    """[Note: all-gather or ring]: with no mask to read (the zoo GPT's is_causal) the ring; with a given
    mask, the memory rule (C - 1)(Wk + Wv) > 4 Wq: multi-head GPT-2 (Wk + Wv = 2 Wq) all-gathers at cp = 2
    and takes the ring at cp = 4; Llama's 2 K/V heads of 4, read before their repeat (Wk + Wv = Wq), keep
    the all-gather at cp = 4."""
    cp_plan = _plan(**opts).pass_report["context_parallel"]
    assert sum("ring attention" in a for a in cp_plan.attention) == ring, cp_plan.attention
    assert all(("cp_kv=" in a) or ("auto:" in a) for a in cp_plan.attention), cp_plan.attention
    assert f"by ring in {ring} " in str(cp_plan)


def test_bad_cp_kv_is_refused():
    with pytest.raises(PlanError, match="cp_kv must be"):
        fxsplit.ParallelConfig(cp=2, cp_kv="rings")


@pytest.mark.hf
def test_grouped_query_kv_are_exchanged_before_their_repeat():
    """[Note: K/V before their repeat]: HF Llama's repeat_kv (2 K/V heads to 4 query heads) is read
    before the repeat, with enable_gqa, by the all-gather and by the ring; exactness is
    test_context_parallel's (llama-cp4, qwen2-cp2xtp2, qwen2-cp4-ring against one process)."""
    from fxsplit.testing import hf_zoo

    model, args, kwargs = hf_zoo.make_hf("llama")
    for kv, op in (("allgather", "scaled_dot_product_attention"), ("ring", "ring_attention")):
        plan = fxsplit.plan(model, args, kwargs, cp=2, cp_kv=kv, hardware=fxsplit.Hardware(link_bytes_per_s=float("inf")))
        notes = plan.pass_report["context_parallel"].attention
        assert len(notes) == 2 and all("before their repeat to the 4 query heads" in a for a in notes), notes
        calls = [n for gm in plan.stages.modules for n in gm.graph.nodes if op in str(n.target)]
        assert len(calls) == 2
        for n in calls:
            key = n.args[1]
            assert tuple(key.meta["val"].shape)[1] == 2, key.meta["val"].shape  # 2 K/V heads, not 4
            assert n.kwargs.get("enable_gqa") is True or n.args[5] is True


def test_the_ring_is_not_run_on_cuda():
    # [Note: the ring on CUDA]: its blocks run torch's CPU flash kernel. parallelize plans CUDA ranks
    # with the all-gather, refuses an explicit ring there, and the op itself refuses a non-CPU tensor
    from fxsplit.api.options import ParallelConfig
    from fxsplit.api.parallelize import planning_config

    assert planning_config(ParallelConfig(cp=2), "cuda").cp_kv == "allgather"
    assert planning_config(ParallelConfig(cp=2), "cpu").cp_kv is None  # chosen per attention on the CPU
    assert planning_config(ParallelConfig(cp=1), "cuda").cp_kv is None
    with pytest.raises(PlanError, match="cp_kv='ring' on a CUDA rank.*no CUDA kernel.*cp_kv='allgather'"):
        planning_config(ParallelConfig(cp=2, cp_kv="ring"), "cuda")
    q = torch.empty(1, 2, 8, 4, device="meta")
    with pytest.raises(RunError, match="ring_attention on a meta tensor"):
        ring_attention(q, q, q, seq_len=16, causal=True)
