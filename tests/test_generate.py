"""ParallelModel.generate: the tokens equal the unsplit model's in one process (fxsplit's own loop
for the zoo GPT, Hugging Face's ``generate`` with its own cache for the transformers families),
greedy and sampled, for prompts of one sample and more at tp=2 x pp=2 (and dp=2, dp_shard=2 with
pp=2). Every model runs with the KV cache, its steps overlapped across microbatches ([Note:
overlapped steps] in fxsplit.api.generate; the token a message of the program's plan, [Note: token
messages] in fxsplit.pipeline.comm): the zoo GPT by [Note: generation with a KV cache]
(fxsplit.api.kv_cache), the exported families by [Note: KV cache for exported graphs]
(fxsplit.api.kv_export), past the traced length too; compared with stepwise decoding and recompute."""

import pytest
import torch

import fxsplit
from fxsplit.api.generate import Sampling, cache_path, generate_unsplit, next_tokens
from fxsplit.errors import PlanError, UsageError
from fxsplit.graph.ops import op_name
from fxsplit.schedule.ir import ActionKind
from fxsplit.testing import run_distributed, zoo
from fxsplit.testing.trace_cache import SharedPlans, shared_plans

NEW = 8
SAMPLED = dict(do_sample=True, temperature=0.9, top_k=20, seed=3)
HF_FAMILIES = ("llama", "qwen2", "mistral", "gpt2", "mixtral")


def _prompt(batch, length, vocab, seed):
    return torch.randint(2, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# one process


def test_forward_with_fewer_microbatches_keeps_the_schedule_order():
    model, args, kwargs = zoo.make("gpt")
    p = fxsplit.plan(model, args, kwargs, pp=2, microbatches=4, schedule="1f1b")
    for r in (0, 1):
        rp = p.rank_plan(r)
        assert rp.forward_with(4) is rp.forward
        one = rp.forward_with(1)
        assert one.num_microbatches == 1
        assert [str(ac.action) for ac in one.actions] == [f"{r}F0"]
        two = [str(ac.action) for ac in rp.forward_with(2).actions]
        assert two == [str(ac.action) for ac in rp.forward.actions if ac.action.microbatch < 2]
        assert all(ac.action.kind is ActionKind.FORWARD for ac in rp.forward_with(3).actions)
    # the activation message of microbatch 0 leaves rank 0 and arrives on rank 1
    assert [op.is_send for op in p.rank_plan(0).forward_with(1).peer_ops[1]] == [True]
    assert [op.is_send for op in p.rank_plan(1).forward_with(1).peer_ops[0]] == [False]
    with pytest.raises(PlanError, match=r"microbatches=5 is outside 1..4"):
        p.rank_plan(0).forward_with(5)


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv"])
def test_forward_with_one_microbatch_runs_every_stage_in_order(schedule):
    model, args, kwargs = zoo.make("gpt")
    p = fxsplit.plan(model, args, kwargs, pp=2, microbatches=4, schedule=schedule)
    ranks = p.stage_ranks  # zbv: stages 0, 3 on rank 0 and 1, 2 on rank 1 (a V)
    for r in (0, 1):
        got = [str(ac.action) for ac in p.rank_plan(r).forward_with(1).actions]
        assert got == [f"{s}F0" for s in range(4) if ranks[s] == r], (schedule, r, got)


def test_sampling_options_are_checked():
    with pytest.raises(UsageError, match="temperature=0"):
        Sampling(do_sample=True, temperature=0)
    with pytest.raises(UsageError, match="top_k=0"):
        Sampling(top_k=0)
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 1.0, 2.0]])
    assert next_tokens(logits, Sampling(), None).tolist() == [1, 0]
    # top_k=1 leaves one token: sampling it is greedy whatever the draw
    s = Sampling(do_sample=True, top_k=1, seed=0)
    assert next_tokens(logits, s, s.generator(torch.device("cpu"))).tolist() == [1, 0]


def test_inputs_generate_cannot_fill_are_refused_with_the_fix():
    from fxsplit.api.generate import _Feed

    model, args, kwargs = zoo.make("kwargs")  # input_ids, attention_mask, position_ids
    metas = fxsplit.plan(model, args, kwargs, pp=2, microbatches=2).stages.input_meta
    with pytest.raises(UsageError, match=r"cannot fill \['position_ids', 'scale'\]\. Plan the model with its token "
                                         r"ids alone"):
        _Feed.of(metas)
    feed = _Feed(ids=0, mask=1, length=6)
    ids, mask = feed.inputs(torch.tensor([[5, 6, 7], [8, 9, 10]]))
    assert ids.tolist() == [[5, 6, 7, 0, 0, 0], [8, 9, 10, 0, 0, 0]]  # padded on the right to the traced length
    assert mask.tolist() == [[1, 1, 1, 0, 0, 0]] * 2
    feed.check_fits(3, 4)  # 3 + 3 fed tokens fit in 6
    with pytest.raises(UsageError, match=r"max_new_tokens <= 4.*dynamic_sequence=True"):
        feed.check_fits(3, 5)


def test_unsplit_gpt_loop_equals_argmax_of_full_forwards():
    model, _, _ = zoo.make("gpt")
    prompt = _prompt(2, 5, model.config.vocab_size, 0)
    out = generate_unsplit(model, prompt, max_new_tokens=4)
    assert out.shape == (2, 9) and torch.equal(out[:, :5], prompt)
    with torch.no_grad():
        for t in range(5, 9):
            assert torch.equal(out[:, t], model(out[:, :t])[:, -1].argmax(-1))


@pytest.mark.hf
def test_unsplit_loop_equals_hugging_face_generate_greedy_and_sampled():
    from fxsplit.testing import hf_zoo

    model, _, _ = hf_zoo.tiny_llama()
    prompt = _prompt(2, 6, 256, 1)
    eos = model.generation_config.eos_token_id
    mask = torch.ones_like(prompt)
    ref = model.generate(prompt, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(generate_unsplit(model, prompt, max_new_tokens=NEW, eos_token_id=eos), ref)
    torch.manual_seed(SAMPLED["seed"])
    ref = model.generate(prompt, attention_mask=mask, max_new_tokens=NEW, do_sample=True,
                         temperature=SAMPLED["temperature"], top_k=SAMPLED["top_k"])
    got = generate_unsplit(model, prompt, max_new_tokens=NEW, eos_token_id=eos, sampling=Sampling(**SAMPLED))
    assert torch.equal(got, ref)


def _through_stages(modules, cache, ids, microbatch=0):
    out = (ids,)
    for s, mod in sorted(modules.items()):
        with cache.context(s, microbatch):
            out = mod(*out)
        out = out if isinstance(out, tuple) else (out,)
    return out[0]


@pytest.mark.parametrize("config, split", [(dict(), None), (dict(n_kv_head=2, fused_qkv=True, mlp="swiglu"), None),
                                           (dict(), ["blocks.0", "blocks.2"])])
def test_kv_cache_prefill_then_decode_equals_full_forwards(config, split):
    """[Note: generation with a KV cache]: the decode modules of a pp=2 plan, fed the prompt, then
    two tokens at once (a bottom-right causal mask), then one token (no mask), give the logits the
    unsplit model gives those positions; a second microbatch keeps its own slot. The split at
    ``blocks.0`` leaves the embeddings alone in stage 0: its positions advance with no attention."""
    from fxsplit.api.kv_cache import KVCache, cache_refusal, decode_module

    model = zoo.GPT(zoo.GPTConfig(vocab_size=128, block_size=32, n_layer=4, n_head=4, n_embd=32, **config)).eval()
    ids = _prompt(2, 16, 128, 0)
    p = fxsplit.plan(model, (ids,), pp=2, microbatches=2, split_points=split)
    if split is not None:
        assert not any(op_name(n) == "scaled_dot_product_attention" for n in p.stages.modules[0].graph.nodes)
    assert cache_refusal(p, traced_length=None, mask_input=False, compiled=False) is None
    cache = KVCache({s: decode_module(g) for s, g in enumerate(p.stages.modules)})
    with torch.no_grad():
        full = model(ids)
        other = _through_stages(cache.modules, cache, ids[:1, :3], microbatch=1)  # another slot
        got = [_through_stages(cache.modules, cache, ids[:, :5]),
               _through_stages(cache.modules, cache, ids[:, 5:7]),
               _through_stages(cache.modules, cache, ids[:, 7:8])]
        later = _through_stages(cache.modules, cache, ids[:1, 3:4], microbatch=1)
    torch.testing.assert_close(torch.cat(got, dim=1), full[:, :8], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([other, later], dim=1), full[:1, :4], rtol=1e-5, atol=1e-5)
    # outside a slot a decode module is the stage itself
    with torch.no_grad():
        torch.testing.assert_close(cache.modules[0](ids)[0], p.stages.modules[0](ids)[0])


def test_unsplit_generate_with_the_cache_equals_recompute():
    model, _, _ = zoo.make("gpt")
    prompt = _prompt(3, 5, model.config.vocab_size, 4)
    for sampling in (Sampling(), Sampling(**SAMPLED)):
        want = generate_unsplit(model, prompt, max_new_tokens=NEW, sampling=sampling)
        assert torch.equal(generate_unsplit(model, prompt, max_new_tokens=NEW, sampling=sampling, use_cache=True), want)
    explicit = zoo.GPT(zoo.GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, attn_dropout=0.1))
    with pytest.raises(UsageError, match=r"not exact for this model: stage 0: arange node .* pass use_cache=False"):
        generate_unsplit(explicit, prompt % 64, max_new_tokens=2, use_cache=True)


def test_kv_cache_refusals_name_the_reason():
    from fxsplit.api.kv_cache import cache_refusal

    explicit = zoo.GPT(zoo.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16,
                                     attn_dropout=0.1))
    p = fxsplit.plan(explicit, (_prompt(2, 8, 64, 0),), pp=2, microbatches=2)
    why = cache_refusal(p, traced_length=None, mask_input=False, compiled=False)
    # the explicit attention builds its causal mask from an arange: named first, in graph order
    assert why is not None and why.startswith("stage 0: arange node") and "not a position embedding" in why, why
    assert "dynamic_sequence=True" in cache_refusal(p, traced_length=16, mask_input=False, compiled=False)
    assert "attention mask" in cache_refusal(p, traced_length=None, mask_input=True, compiled=False)
    assert "compiled" in cache_refusal(p, traced_length=None, mask_input=False, compiled=True)
    from fxsplit.api.kv_cache import stage_refusal

    class EvenPositions(torch.nn.Module):  # positions 0, 2, 4, ...: a step the offset would not keep
        def __init__(self):
            super().__init__()
            self.wpe = torch.nn.Embedding(64, 8)

        def forward(self, idx):
            return self.wpe(torch.arange(0, 2 * idx.shape[1], 2))

    why = stage_refusal(0, torch.fx.symbolic_trace(EvenPositions()))
    assert why is not None and "has a step or keyword bounds" in why, why
    mlp, args, kwargs = zoo.make("mlp")
    p = fxsplit.plan(mlp, args, kwargs, pp=2, microbatches=2)
    assert cache_refusal(p, traced_length=None, mask_input=False, compiled=False) == "no attention found in the plan's graphs"


def _stages_in_order(plan, cache, flat):
    """The model outputs of ``flat`` run through every stage of ``plan`` in one process, each stage
    as ``cache.modules[s]`` inside its slot (microbatch 0)."""
    values = {}
    for s, sio in enumerate(plan.stages.io):
        args = [flat[src.index] if src.stage is None else values[(src.stage, src.index)] for src in sio.inputs]
        with cache.context(s, 0):
            out = cache.modules[s](*args)
        for k, value in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
            values[(s, k)] = value
    return value


@pytest.mark.hf
@pytest.mark.parametrize("name", HF_FAMILIES)
def test_export_kv_cache_equals_hugging_face_generate_with_its_cache(name):
    """[Note: KV cache for exported graphs]: the decode graphs of a pp=2 plan of a model exported at
    16 tokens, fed a prompt of 6 then one token per step (positions past 16 included), choose the
    tokens Hugging Face's own generate chooses with its cache (tp=2 x pp=2: the gloo launch below)."""
    from fxsplit.api.generate import _Feed, model_logits
    from fxsplit.api.kv_cache import KVCache
    from fxsplit.api.kv_export import export_decode, export_refusal

    model, args, kwargs = _family(name)
    p = fxsplit.plan(model, args, kwargs, pp=2, microbatches=2)
    feed = _Feed.of(p.stages.input_meta)
    assert feed.length == 16
    assert export_refusal(p.stages.modules, p.stages.input_meta, 16) is None
    dec = export_decode(dict(enumerate(p.stages.modules)), p.stages.modules, p.stages.io, p.stages.input_meta,
                        16, mask_input=feed.mask)
    cache = KVCache(dec.modules, shapes=dec)

    def last_logits(flat):
        logits = model_logits(_stages_in_order(p, cache, flat))
        assert logits.shape[1] == flat[0].shape[1]
        return logits[:, -1]

    _greedy_equals_hugging_face(model, feed, last_logits, name)


def _greedy_equals_hugging_face(model, feed, last_logits, name):
    """A prompt of 6 tokens, then 14 greedy tokens (positions past the traced 16), each step fed as the
    KV cache takes it (``feed.cached``: the new tokens only) to ``last_logits(flat) -> [B, vocab]``:
    the tokens equal Hugging Face's own generate with its cache."""
    prompt = _prompt(2, 6, 256, 1)
    ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=14, do_sample=False,
                         use_cache=True)
    tokens, fed = prompt, 0
    with torch.no_grad():
        for _ in range(14):
            flat = feed.cached(tokens[:, fed:], tokens.shape[1])
            fed = tokens.shape[1]
            tokens = torch.cat([tokens, last_logits(flat).argmax(-1)[:, None]], dim=1)
    assert torch.equal(tokens, ref), (name, tokens, ref)


@pytest.mark.hf
def test_export_kv_cache_at_tp2_in_one_process_equals_hugging_face_generate():
    """The decode graphs of a tp=2 x pp=2 plan (heads and the vocabulary sharded) run for both tp
    ranks in this process by verify's lockstep interpreter (collectives emulated), each rank with
    its own slots: the tokens equal Hugging Face's generate with its cache, past the traced 16."""
    import contextlib
    from types import SimpleNamespace

    from fxsplit.api.generate import _Feed, model_logits
    from fxsplit.api.kv_cache import _SLOT, KVCache, cached_positions
    from fxsplit.api.kv_export import cached_masked_attention, export_graphs, kv_total
    from fxsplit.api.lockstep import run_lockstep
    from fxsplit.api.materialize import materialize_stage
    from fxsplit.tp.collectives import axis_rank

    model, args, kwargs = _family("llama")
    p = fxsplit.plan(model, args, kwargs, tp=2, pp=2, microbatches=2)
    feed = _Feed.of(p.stages.input_meta)
    graphs = export_graphs(p.stages.modules, p.stages.io, p.stages.input_meta, 16, mask_input=feed.mask).graphs
    mods = [[materialize_stage(p, s, tp_rank=r, source=model) for r in range(2)] for s in range(len(graphs))]
    caches = [KVCache({}), KVCache({})]  # each tp rank's slots
    stage = [0]

    def rank_slot(fn):  # the slot of the rank the lockstep is evaluating
        def run(*a, **kw):
            token = _SLOT.set(caches[axis_rank("tp")]._slots[(stage[0], 0)])
            try:
                return fn(*a, **kw)
            finally:
                _SLOT.reset(token)
        return run

    for g in graphs:
        for node in g.nodes:
            if node.target in (cached_masked_attention, cached_positions, kv_total):
                node.target = rank_slot(node.target)

    def forward(flat):
        values = {}
        for s, sio in enumerate(p.stages.io):
            stage[0] = s
            ins = [[flat[src.index] if src.stage is None else values[(src.stage, src.index)][r] for src in sio.inputs]
                   for r in range(2)]
            with contextlib.ExitStack() as stack:
                for c in caches:
                    stack.enter_context(c.context(s, 0))
                outs = run_lockstep(SimpleNamespace(graph=graphs[s]), mods[s], ins, None)
            for k in range(len(outs[0])):
                values[(s, k)] = [o[k] for o in outs]
        return values[(len(graphs) - 1, len(outs[0]) - 1)]

    def last_logits(flat):
        logits = [model_logits(x)[:, -1] for x in forward(flat)]
        assert torch.equal(logits[0], logits[1])  # gathered: every rank holds the whole vocabulary
        return logits[0]

    _greedy_equals_hugging_face(model, feed, last_logits, "llama tp2 x pp2")


def test_export_kv_cache_refusals_name_the_node():
    from fxsplit.api.kv_export import export_refusal

    class MeanPool(torch.nn.Module):  # a mean over the positions: not a causal language model
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(32, 8)
            self.head = torch.nn.Linear(8, 32)

        def forward(self, idx):
            h = self.emb(idx)
            q = h.view(idx.shape[0], 1, 8, 8)
            a = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            return self.head(a.view(idx.shape[0], 8, 8) + h.mean(dim=1, keepdim=True))

    ids = torch.randint(0, 32, (2, 8))
    p = fxsplit.plan(MeanPool(), (ids,), pp=1, microbatches=1, dynamic_sequence=False, method="export")
    why = export_refusal(p.stages.modules, p.stages.input_meta, 8)
    assert why is not None and "reduces sequence dim(s) [1]" in why and "mixes positions" in why, why


# ---------------------------------------------------------------------------------------------
# tp=2 x pp=2 on gloo


def _family(name):
    from fxsplit.testing import hf_zoo
    from fxsplit.testing.tp_coverage import build

    if name == "mixtral":
        return build("mixtral+batched_mm")
    if name == "mistral":  # a window shorter than prompt + new tokens: it masks
        return hf_zoo.tiny_mistral(sliding_window=4)
    return getattr(hf_zoo, f"tiny_{name}")()


TP2_PP2 = dict(tp=2, pp=2, microbatches=2)
ZBV = dict(tp=2, pp=2, microbatches=2, schedule="zbv")
DP2_PP2 = dict(dp=2, pp=2, microbatches=2)
DS2_PP2 = dict(dp_shard=2, pp=2, microbatches=2)
_BUILT: dict = {}  # "gpt" or a family -> (model, args, kwargs), built once per process
_PLANS = SharedPlans()


def _built(name):
    if name not in _BUILT:
        _BUILT[name] = zoo.make("gpt") if name == "gpt" else _family(name)
    return _BUILT[name]


def _family_inputs(name):
    model, args, kwargs = _built(name)
    return model, args, kwargs if name == "llama" else {}  # llama keeps its attention mask as a graph input


def _prepare():
    """Once per launch, before the ranks fork ([Note: preparing once per launch] in fxsplit.testing.harness):
    every layout _generations parallelizes, planned; each rank takes its copy instead of planning it
    ([Note: plans made before the fork] in fxsplit.testing.trace_cache). parallelize never modifies the
    model, so every gpt layout plans the one zoo GPT."""
    model, args, _ = _built("gpt")
    for options in (TP2_PP2, ZBV, DP2_PP2, DS2_PP2, TP2_PP2):  # the last: _fault's
        _PLANS.add(model, args, verify=False, **options)
    for name in HF_FAMILIES:
        _PLANS.add(*_family_inputs(name), verify=False, **TP2_PP2)


def _generations(rank, world):
    with shared_plans(_PLANS) as plans:
        out = _generate_all(rank)
    assert plans.misses == 0, f"rank {rank} planned {plans.misses} layout(s) itself: a plan made before the fork went unused"
    return out


def _generate_all(rank):
    out = {}
    model, args, _ = _built("gpt")
    # the tokens are compared with one process below, and every rank computes the same plan:
    # rank 0 verifies it (the default), the others do not repeat that check
    pm = fxsplit.parallelize(model, args, timeout=60, verify=None if rank == 0 else False, **TP2_PP2)
    V = model.config.vocab_size
    out[("gpt", "path")] = cache_path(pm)  # None: the KV cache
    for b in (1, 3):
        out[("gpt", b)] = pm.generate(_prompt(b, 5, V, b), max_new_tokens=NEW)
    out[("gpt", "recompute")] = pm.generate(_prompt(3, 5, V, 3), max_new_tokens=NEW, use_cache=False)
    out[("gpt", "stepwise")] = pm.generate(_prompt(3, 5, V, 3), max_new_tokens=NEW, overlap_steps=False)
    eos = int(out[("gpt", 3)][0, 5 + 2])  # row 0's third new token: every row stops by the last step or not
    out[("gpt", "eos")] = (eos, pm.generate(_prompt(3, 5, V, 3), max_new_tokens=NEW, eos_token_id=eos),
                           pm.generate(_prompt(3, 5, V, 3), max_new_tokens=NEW, eos_token_id=eos, overlap_steps=False))
    out[("gpt", "sampled")] = pm.generate(_prompt(3, 5, V, 3), max_new_tokens=NEW, **SAMPLED)
    out[("gpt", "slow")] = _slow_tokens(pm, _prompt(3, 5, V, 3))
    try:  # ranks of one replica given different prompts: refused on every rank, the model stays usable
        pm.generate(_prompt(1, 5, V, rank), max_new_tokens=NEW)
    except UsageError as exc:
        out[("gpt", "mismatch")] = str(exc)
    try:  # a bad option on one rank: raised there, named on the others, before the pipeline
        pm.generate(_prompt(1, 5, V, 1), max_new_tokens=NEW, do_sample=True, temperature=0.0 if rank == 1 else 1.0)
    except Exception as exc:  # noqa: BLE001 -- the test inspects it
        out[("gpt", "bad_option")] = (type(exc).__name__, "temperature=0.0" in str(exc), "global rank" in str(exc))
    out[("gpt", "after")] = pm.generate(_prompt(1, 5, V, 1), max_new_tokens=2)
    # zbv: the last stage sits on the first stage's rank, so the token stays on the rank
    pm = fxsplit.parallelize(model, args, timeout=60, verify=None if rank == 0 else False, **ZBV)
    out[("gpt", "zbv")] = pm.generate(_prompt(3, 5, V, 3), max_new_tokens=NEW)
    # dp=2 x pp=2: each replica (ranks 0-1, 2-3) continues its own prompt
    # the tokens are compared with one process below: plan-time verification (every rank emulating
    # every rank) is the same model's check again, so only the first parallelize runs it
    pm = fxsplit.parallelize(model, args, timeout=60, verify=False, **DP2_PP2)
    dp_out = [pm.generate(_prompt(1, 5, V, 10 + rank // 2), max_new_tokens=NEW)]
    # dp_shard=2 x pp=2 (FSDP2 units gathered for the whole call): the same replicas
    pm = fxsplit.parallelize(model, args, timeout=60, verify=False, **DS2_PP2)
    dp_out.append(pm.generate(_prompt(1, 5, V, 10 + rank // 2), max_new_tokens=NEW))
    for name in HF_FAMILIES:
        model, args, kwargs = _family_inputs(name)  # llama's attention mask a graph input: generate fills it
        pm = fxsplit.parallelize(model, args, kwargs, timeout=60, verify=False, **TP2_PP2)
        eos = model.generation_config.eos_token_id
        out[(name, "path")] = cache_path(pm)
        for b in (1, 2):
            out[(name, b)] = pm.generate(_prompt(b, 6, 256, b), max_new_tokens=NEW, eos_token_id=eos)
        if name == "llama":
            out[(name, "sampled")] = pm.generate(_prompt(2, 6, 256, 2), max_new_tokens=NEW, eos_token_id=eos,
                                                 **SAMPLED)
            # with the cache the graphs take any length: 10 + 8 tokens past the 16 the export traced,
            # steps overlapped and stepwise; recomputing, the traced length still bounds them
            out[(name, "long")] = pm.generate(_prompt(2, 10, 256, 0), max_new_tokens=NEW, eos_token_id=eos)
            out[(name, "long_stepwise")] = pm.generate(_prompt(2, 10, 256, 0), max_new_tokens=NEW,
                                                       eos_token_id=eos, overlap_steps=False)
            try:
                pm.generate(_prompt(1, 10, 256, 0), max_new_tokens=NEW, use_cache=False)
            except UsageError as exc:
                out[(name, "too_long")] = str(exc)
    out["fault"] = _fault(rank)
    return out, dp_out


def _slow_tokens(pm, prompt):
    """Tokens that take longer than a polled wait's slice to choose: the first stage's rank waits for
    them whole (a timed-out wait would break the gloo pair, [Note: overlapped steps])."""
    import time

    from fxsplit.api import generate as gen

    pick = gen.next_tokens

    def slow(*a, **kw):
        time.sleep(0.3)
        return pick(*a, **kw)

    gen.next_tokens = slow
    try:
        return pm.generate(prompt, max_new_tokens=3)
    finally:
        gen.next_tokens = pick


def _fault(rank):
    """Global rank 3 (tp 1 of the last stage) raises while choosing the third token: every rank
    raises at once, the others naming it ([Note: failures] in fxsplit.api.model), none hangs."""
    import time

    from fxsplit.api import generate as gen

    model, args, _ = _built("gpt")  # the GPT the first layout ran (parallelize left it as it was)
    pm = fxsplit.parallelize(model, args, timeout=60, verify=False, **TP2_PP2)
    calls = [0]
    pick = gen.next_tokens

    def failing(*a, **kw):
        calls[0] += 1
        if rank == 3 and calls[0] == 3:
            raise RuntimeError("injected failure while choosing a token")
        return pick(*a, **kw)

    gen.next_tokens = failing
    t0 = time.perf_counter()
    try:
        pm.generate(_prompt(2, 5, model.config.vocab_size, 0), max_new_tokens=NEW)
    except Exception as exc:  # noqa: BLE001 -- the test inspects it
        return type(exc).__name__, str(exc), time.perf_counter() - t0
    finally:
        gen.next_tokens = pick
    return "ok", "", time.perf_counter() - t0


def _hf_reference(name, key):
    model, _, _ = _family(name)
    b = 2 if key in ("sampled", "long") else key
    prompt = _prompt(2, 10, 256, 0) if key == "long" else _prompt(b, 6, 256, b)
    options = dict(do_sample=False, use_cache=True)  # Hugging Face's own cache
    if key == "sampled":
        torch.manual_seed(SAMPLED["seed"])
        options = dict(do_sample=True, temperature=SAMPLED["temperature"], top_k=SAMPLED["top_k"], use_cache=True)
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, **options)


@pytest.mark.dist
@pytest.mark.hf
def test_generate_at_tp2_pp2_equals_one_process():
    results = run_distributed(_generations, 4, timeout=600, prepare=(_prepare, ()))
    gpt, _, _ = zoo.make("gpt")
    V = gpt.config.vocab_size
    for rank, (_, dp_out) in enumerate(results):
        want = generate_unsplit(gpt, _prompt(1, 5, V, 10 + rank // 2), max_new_tokens=NEW)
        assert torch.equal(dp_out[0], want) and torch.equal(dp_out[1], want), (rank, dp_out, want)
    results = [res for res, _ in results]
    for rank, res in enumerate(results):
        kind, text, seconds = res.pop("fault")
        want = "RuntimeError" if rank == 3 else "RankFailedError"
        assert kind == want and seconds < 30, (rank, kind, seconds, text)
        assert ("injected failure" in text) and (rank == 3 or "global rank 3" in text), (rank, text)
    for rank, res in enumerate(results):
        got = res.pop(("gpt", "bad_option"))
        assert got == (("UsageError", True, False) if rank == 1 else ("RankFailedError", True, True)), (rank, got)
    for key, value in results[0].items():  # every rank returns the same tokens
        for r in results[1:]:
            same = (torch.equal(r[key], value) if isinstance(value, torch.Tensor) else
                    all(torch.equal(a, b) for a, b in zip(r[key][1:], value[1:])) if key == ("gpt", "eos") else
                    r[key] == value)
            assert same, (key, r[key], value)
    for b in (1, 3):
        assert torch.equal(results[0][("gpt", b)], generate_unsplit(gpt, _prompt(b, 5, V, b), max_new_tokens=NEW))
    assert results[0][("gpt", "path")] is None  # the tokens above came from the KV cache
    assert torch.equal(results[0][("gpt", "recompute")], results[0][("gpt", 3)])
    assert torch.equal(results[0][("gpt", "stepwise")], results[0][("gpt", 3)])  # steps not overlapped
    assert torch.equal(results[0][("gpt", "slow")], results[0][("gpt", 3)][:, :8])
    assert torch.equal(results[0][("gpt", "zbv")], results[0][("gpt", 3)])
    eos, overlapped, stepwise = results[0][("gpt", "eos")]
    want = generate_unsplit(gpt, _prompt(3, 5, V, 3), max_new_tokens=NEW, eos_token_id=eos)
    assert torch.equal(overlapped, want) and torch.equal(stepwise, want), (eos, overlapped, stepwise, want)
    for name in HF_FAMILIES:  # exported at a fixed length: the cache of [Note: KV cache for exported graphs]
        assert results[0][(name, "path")] is None, (name, results[0][(name, "path")])
    ref = generate_unsplit(gpt, _prompt(3, 5, V, 3), max_new_tokens=NEW, sampling=Sampling(**SAMPLED))
    assert torch.equal(results[0][("gpt", "sampled")], ref)
    assert "different prompts or options" in results[0][("gpt", "mismatch")]
    assert results[0][("gpt", "after")].shape == (1, 7)
    text = results[0][("llama", "too_long")]
    assert "traced the sequence at 16 tokens" in text and "max_new_tokens <= 7" in text, text
    assert torch.equal(results[0][("llama", "long_stepwise")], results[0][("llama", "long")])
    for name in HF_FAMILIES:
        for key in (1, 2, "sampled", "long") if name == "llama" else (1, 2):
            got = results[0][(name, key)]
            assert torch.equal(got, _hf_reference(name, key)), (name, key, got)


def _kept_decode_graphs(rank, world):
    """Three generate calls of one model at pp=2 (two prompts of one length, one of another): the
    export analysis runs once and the second and third calls run the first call's decode modules."""
    from fxsplit.api import decode_graphs
    from fxsplit.api import generate as gen

    analysed, caches = [0], []
    analyse, keep = decode_graphs.export_graphs, gen.kv_cache_kept

    def counted(*a, **kw):
        analysed[0] += 1
        return analyse(*a, **kw)

    def recorded(*a, **kw):
        cache = keep(*a, **kw)
        caches.append(dict(cache.modules))
        return cache

    decode_graphs.export_graphs, gen.kv_cache_kept = counted, recorded
    try:
        model, args, kwargs = _family("llama")
        pm = fxsplit.parallelize(model, args, kwargs, pp=2, microbatches=2, timeout=60, verify=False)
        eos = model.generation_config.eos_token_id
        out = [pm.generate(_prompt(2, 6, 256, 2), max_new_tokens=4, eos_token_id=eos),
               pm.generate(_prompt(1, 6, 256, 1), max_new_tokens=4, eos_token_id=eos),
               pm.generate(_prompt(2, 9, 256, 0), max_new_tokens=3, eos_token_id=eos)]
        # FSDP gathers and reshards the stage between calls: the kept modules still read this call's parameters
        model, args, _ = zoo.make("gpt")
        fsdp = fxsplit.parallelize(model, args, dp_shard=2, pp=1, microbatches=2, timeout=60, verify=False)
        out += [fsdp.generate(_prompt(1, 5, model.config.vocab_size, 4), max_new_tokens=4) for _ in range(2)]
    finally:
        decode_graphs.export_graphs, gen.kv_cache_kept = analyse, keep
    reused = [all(c[s] is caches[0][s] for s in caches[0]) for c in caches[1:3]]
    return out, analysed[0], reused


@pytest.mark.dist
@pytest.mark.hf
def test_a_second_generate_builds_no_decode_graph():
    """[Note: decode graphs kept per model] (fxsplit.api.decode_graphs): the export analysis once
    per model, the decode modules reused by later calls (other batch and prompt lengths), tokens
    equal to Hugging Face's generate with its cache; under FSDP a second call equals one process."""
    results = run_distributed(_kept_decode_graphs, 2, timeout=400)
    model, _, _ = _family("llama")
    gpt, _, _ = zoo.make("gpt")
    for rank, (out, analysed, reused) in enumerate(results):
        assert analysed == 1 and reused == [True, True], (rank, analysed, reused)
        for got, (b, t, seed, new) in zip(out, [(2, 6, 2, 4), (1, 6, 1, 4), (2, 9, 0, 3)]):
            prompt = _prompt(b, t, 256, seed)
            want = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                                  do_sample=False, use_cache=True)
            assert torch.equal(got, want), (rank, b, t, got, want)
        want = generate_unsplit(gpt, _prompt(1, 5, gpt.config.vocab_size, 4), max_new_tokens=4)
        assert torch.equal(out[3], want) and torch.equal(out[4], want), (rank, out[3:], want)
