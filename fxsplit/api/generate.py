"""Text generation through the pipeline: :meth:`ParallelModel.generate` for causal language models
at any (dp, tp, pp), and :func:`generate_unsplit`, the same decoding in one process.

Terms
- **prompt**: ``input_ids`` (B, T), one row per sequence; B >= 1.
- **step**: one new token for every row: a forward of the whole model over the tokens so far
  (with the cache: over the tokens not yet cached), then the next token from the logits of the
  last real position.
- **m'**: the microbatches a step is split into: ``min(B, m)``, so a single prompt runs at any pp
  ([Note: fewer microbatches for inference]).
- **cache path**: with a KV cache ([Note: generation with a KV cache] in fxsplit.api.kv_cache:
  the prompt once, then one token per step, attention reading the keys and values cached on each
  rank per (stage, microbatch); for a graph torch.export traced at a fixed length, [Note: KV cache
  for exported graphs] in fxsplit.api.kv_export) where :func:`cache_path` finds it exact, else by
  recompute (below);
  the reason is logged on ``fxsplit.generate`` at INFO and returned by :func:`cache_path`.
- **traced length**: the sequence length the plan's graph fixes (torch.export without
  ``dynamic_sequence=True``: [Note: a static sequence for export] in fxsplit.graph.trace), or
  none (fx traces, or ``dynamic_sequence=True``: the sequence is a symbol).

Representative use (inside torchrun, on every rank of a replica with the same arguments)::

    pm = fxsplit.parallelize(model, (ids,), tp=2, pp=2)
    out = pm.generate(prompt, max_new_tokens=20)                           # greedy: (B, T + 20)
    out = pm.generate(prompt, max_new_tokens=20, do_sample=True, temperature=0.8, top_k=50, seed=0)
    ref = generate_unsplit(model, prompt, max_new_tokens=20)               # the same, one process

[Note: overlapped steps]
With the cache, the steps of the m' microbatches overlap (``overlap_steps=True``, the default):
(step k, microbatch i) is virtual microbatch k * m' + i of one forward program
(fxsplit.schedule.decode, lowered by the communication plan like any forward and run by
``PipelineRuntime.run_program``) with one more dependency, F(first stage, j) after F(last stage,
j - m'): the token, a message from the last stage's rank to the first's, planned in the
program's communication plan like the activations ([Note: token messages] in
fxsplit.pipeline.comm; fxsplit.api.overlapped_decode). So while microbatch i's step runs on
stage s, microbatch i + 1's runs on stage s - 1, and step k + 1 of microbatch 0 starts as soon as
its token exists. Shapes are
known up front (the prompt, then one token), so every rank binds symbols without the values; the
last stage draws each microbatch's tokens in the order one process draws a step's rows, so seeded
sampling matches. With one microbatch (B = 1) nothing can overlap. ``overlap_steps=False`` runs
one pipeline forward per step (the stepwise loop below, with the cache). The program is one plan
on every backend: NCCL matches the token messages by their place in the per-peer order as it
matches the activations (tested on gloo, which runs the same order; not run on a GPU).

[Note: generation by recompute]
Each step runs the pipeline's forward (no autograd, no loss: ``PipelineRuntime.forward``, the F
actions only) over the whole sequence so far and reads the logits of the last real position; the
rank holding the last stage picks the token, every rank of the replica receives it (a broadcast
over the tensor-parallel ranks of the last stage, then over the pipeline), and the next step feeds
the longer sequence. This is the path when the KV cache is not exact for the plan (its reason
in :func:`cache_path`): explicit softmax attention, masks built in an fx graph, a graph traced at a
fixed length that mixes positions outside attention (fxsplit.api.kv_export names the node), compiled
stages. Every step then costs a full forward
over the sequence, O(T) work per token. What it buys: exactness with no new graph (the same stage
graphs that train, so any model that plans, at any tp and pp and schedule, generates), and the
failure protocol for free: every wait is the runtime's or goes through the Watch
(``ParallelModel._wait``), and the call is one agreed inference call (``ParallelModel._inference``),
so a failed rank is named on every rank instead of hanging; both hold for the cache path too, which
runs the same forward program with other stage modules. Within a step the m' microbatches are
pipelined by the schedule's own forward order; on this path steps do not overlap (step k+1 of
microbatch 0 waits for step k of every microbatch; [Note: overlapped steps] is the cache's).
A traced length L fixes every forward at L positions: the tokens are padded on the right to L
(an attention mask, if the model takes one, is 0 there), which leaves the logits of earlier
positions as they are in a causal model, so the prompt plus the new tokens must fit in L (the
error says so and names ``dynamic_sequence=True``). A model that is not causal (a position sees
later ones) would see the padding: generation is for causal language models only.

[Note: fewer microbatches for inference]
A training step needs m microbatches (the schedule's), but a forward splits the batch into
m' = min(B, m): the schedule's F actions of microbatches below m', in its order, are a valid
program (``RankPlan.forward_with``), so a batch of one still runs through every stage.

Sampling is Hugging Face's (``generate(do_sample=True)``): float32 logits of the last position,
divided by ``temperature``, all but the ``top_k`` largest set to -inf, softmax,
``torch.multinomial`` with a ``torch.Generator`` seeded with ``seed`` (HF draws from the global
generator: ``torch.manual_seed(seed)`` before HF's ``generate`` draws the same numbers on CPU).
Greedy is ``argmax``. With ``eos_token_id``, a row that produced it is padded with it and the
call ends when every row has (HF's default ``pad_token_id``).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from fxsplit.api.inputs import check_batch, inference_microbatches
from fxsplit.api.decode_graphs import export_refusal_kept, kv_cache_kept
from fxsplit.api.kv_cache import KVCache, cache_refusal, decode_module, stage_refusal
from fxsplit.api.overlapped_decode import overlapped_decode
from fxsplit.api.padding import follows, traced_length
from fxsplit.errors import ArgumentTypeError, RunError, UsageError

if TYPE_CHECKING:
    from fxsplit.pipeline.stage import ValueMeta

__all__ = ["Sampling", "cache_path", "generate", "generate_unsplit", "model_logits", "next_tokens"]

_log = logging.getLogger("fxsplit.generate")


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy (``do_sample=False``), or drawn from the softmax of the
    logits over ``temperature`` restricted to the ``top_k`` largest, from a generator seeded with
    ``seed`` (None: the global generator of the rank that draws)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.do_sample, bool):
            raise ArgumentTypeError(f"generate(do_sample=...) takes a bool, got {self.do_sample!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature > 0:
            raise UsageError(f"generate(temperature={self.temperature!r}): must be a number > 0 "
                             "(use do_sample=False for greedy decoding)")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise UsageError(f"generate(top_k={self.top_k!r}): must be an int >= 1, or None for no cut")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ArgumentTypeError(f"generate(seed=...) takes an int or None, got {type(self.seed).__name__}")

    def generator(self, device: torch.device) -> torch.Generator | None:
        if not self.do_sample or self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """(B,) int64 next tokens from the logits of the last position (B, V), as HF's generate picks them."""
    scores = logits.to(dtype=torch.float32, copy=True)
    if not sampling.do_sample:
        return torch.argmax(scores, dim=-1)
    if sampling.temperature != 1.0:
        scores = scores / sampling.temperature
    if sampling.top_k is not None:
        k = min(sampling.top_k, scores.shape[-1])
        scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


def model_logits(out: Any) -> torch.Tensor:
    """The (B, T, V) logits in a causal language model's output: a tensor, an output with
    ``.logits`` (transformers' ``ModelOutput``) or a ``"logits"`` key, or the first of a tuple."""
    if isinstance(out, Mapping) and "logits" in out:
        out = out["logits"]
    elif not isinstance(out, torch.Tensor) and hasattr(out, "logits"):
        out = out.logits
    elif isinstance(out, (tuple, list)) and out:
        out = out[0]
    if not isinstance(out, torch.Tensor) or out.dim() != 3:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise RunError(f"generate(): the model returned {shape}, not logits (B, T, vocab); generate() is for "
                       "causal language models whose output is the logits, has .logits or starts with them")
    return out


def _decode(step: Callable[[torch.Tensor], torch.Tensor | None], share: Callable[[torch.Tensor | None, int], torch.Tensor],
            ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None, sampling: Sampling) -> torch.Tensor:
    """The decoding loop both paths share: ``step(tokens)`` is the last position's logits (B, V)
    where they are computed, else None; ``share(next, B)`` gives every caller the chosen tokens."""
    tokens = ids
    unfinished = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
    generator = None
    for _ in range(max_new_tokens):
        logits = step(tokens)
        nxt = None
        if logits is not None:
            if generator is None:
                generator = sampling.generator(logits.device)
            nxt = next_tokens(logits, sampling, generator).to(ids.device)
            if eos_token_id is not None:
                nxt = torch.where(unfinished, nxt, torch.full_like(nxt, eos_token_id))
        nxt = share(nxt, ids.shape[0])
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        if eos_token_id is not None:
            unfinished &= nxt != eos_token_id
            if not bool(unfinished.any()):
                break
    return tokens


def _check_call(input_ids: Any, max_new_tokens: Any, eos_token_id: Any) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        got = (f"a {input_ids.dim()}-d {input_ids.dtype} tensor" if isinstance(input_ids, torch.Tensor)
               else type(input_ids).__name__)
        raise ArgumentTypeError(f"generate(input_ids): expected integer token ids of shape (batch, length), got {got}")
    if input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        raise UsageError(f"generate(input_ids): shape {tuple(input_ids.shape)} has no prompt; pass at least one token per row")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise UsageError(f"generate(max_new_tokens={max_new_tokens!r}): must be an int >= 0")
    if eos_token_id is not None and not isinstance(eos_token_id, int):
        raise ArgumentTypeError(f"generate(eos_token_id=...) takes an int or None, got {type(eos_token_id).__name__}")


def generate_unsplit(model: nn.Module, input_ids: torch.Tensor, *, max_new_tokens: int,
                     sampling: Sampling = Sampling(), eos_token_id: int | None = None,
                     use_cache: bool = False) -> torch.Tensor:
    """[Note: generation by recompute] in one process, on the unsplit ``model`` called as
    ``model(tokens)``: the reference :meth:`ParallelModel.generate` equals (and the baseline of
    ``benchmarks/generate.py``). ``use_cache``: the model traced by ``torch.fx.symbolic_trace`` and
    run with the KV cache instead ([Note: generation with a KV cache] in fxsplit.api.kv_cache);
    a model the cache is not exact for raises, naming why."""
    _check_call(input_ids, max_new_tokens, eos_token_id)
    cache = None
    if use_cache:
        traced = torch.fx.symbolic_trace(model)
        why = stage_refusal(0, traced)
        if why is not None:
            raise UsageError(f"generate_unsplit(use_cache=True): the KV cache is not exact for this model: {why}; "
                             "pass use_cache=False")
        cache = KVCache({0: decode_module(traced)})
    fed = [0]

    def step(tokens: torch.Tensor) -> torch.Tensor:
        if cache is None:
            return model_logits(model(tokens))[:, -1, :]
        new, fed[0] = tokens[:, fed[0]:], tokens.shape[1]
        with cache.context(0, 0):
            return model_logits(cache.modules[0](new))[:, -1, :]

    with torch.no_grad():
        return _decode(step, lambda nxt, _: nxt, input_ids, max_new_tokens, eos_token_id, sampling)


# ------------------------------------------------------------------------------------------------
# through the pipeline


@dataclass(frozen=True)
class _Feed:
    """How a step's tokens become the plan's flat inputs: the token ids at ``ids``, an attention
    mask at ``mask`` (or none), padded to the traced ``length`` (None: the sequence is a symbol)."""

    ids: int
    mask: int | None
    length: int | None

    @classmethod
    def of(cls, metas: Sequence[ValueMeta], traced: int | None = None) -> _Feed:
        rest = [(i, m) for i, m in enumerate(metas) if i != 0]
        mask = [i for i, m in rest if "mask" in m.name and m.is_tensor and len(m.shape) == 2]
        other = [m.name for i, m in rest if i not in mask]
        ok = metas and metas[0].is_tensor and len(metas[0].shape) == 2 and not metas[0].dtype.is_floating_point
        if not ok or other or len(mask) > 1:
            names = [m.name for m in metas]
            raise UsageError(
                f"generate(): the plan's model takes the inputs {names}; generate() feeds token ids (the first "
                "input, integer, (batch, length)) and at most one attention mask (an input named '*mask*'), "
                f"so it cannot fill {other or names}. "
                "Plan the model with its token ids alone (e.g. fxsplit.parallelize(model, (input_ids,)))")
        length = metas[0].shape[1]
        # a plan following the step's length ([Note: following the sequence from two static traces]) is
        # exact up to its traced length only, so it generates as the static plan it was traced as
        return cls(0, mask[0] if mask else None, length if isinstance(length, int) else traced)

    def check_fits(self, prompt: int, max_new_tokens: int) -> None:
        if self.length is None:
            return
        need = prompt + max(max_new_tokens - 1, 0)
        if need > self.length:
            raise UsageError(
                f"generate(): the plan traced the sequence at {self.length} tokens (torch.export fixes it: "
                "[Note: a static sequence for export] in fxsplit.graph.trace), but a prompt of "
                f"{prompt} plus {max_new_tokens} new tokens needs forwards over {need}; pass "
                f"max_new_tokens <= {self.length - prompt + 1}, plan with an example of >= {need} tokens, or "
                "plan with dynamic_sequence=True")

    def cached(self, tokens: torch.Tensor, total: int) -> list[torch.Tensor]:
        """The flat inputs of a cached call: the new ``tokens`` (b, T) unpadded, and an attention
        mask of ones over all ``total`` positions so far ([Note: KV cache for exported graphs])."""
        flat = [tokens]
        if self.mask is not None:
            flat.append(torch.ones(tokens.shape[0], total, dtype=torch.long, device=tokens.device))
        return flat

    def inputs(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        b, t = tokens.shape
        width = t if self.length is None else self.length
        ids = tokens if width == t else torch.cat([tokens, tokens.new_zeros(b, width - t)], dim=1)
        flat = [ids]
        if self.mask is not None:
            flat.append((torch.arange(width, device=tokens.device) < t).to(torch.long).expand(b, width).contiguous())
        return flat


def _h60(value: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 4


def cache_path(pm: Any, *, use_cache: bool = True) -> str | None:
    """None when :meth:`ParallelModel.generate` of ``pm`` runs with the KV cache ([Note: generation
    with a KV cache] in fxsplit.api.kv_cache), else the one-line reason it recomputes every step."""
    if not use_cache:
        return "use_cache=False"
    feed = _Feed.of(pm.plan.stages.input_meta, traced_length(pm.plan))
    compiled = bool(pm.runtime.compile)
    if follows(pm.plan):
        return ("the plan follows each step's length (follow_sequence=True): its graphs compute every "
                "length-dependent size from one symbol, the length of the step's token ids, but a cached step needs "
                "two (the new tokens for the activations, every position so far for the attention mask), which the "
                "KV cache of an exported graph tells apart by the literal traced length of a static trace; plan with "
                "follow_sequence=False (the default) for a cached generate")
    if feed.length is not None and not compiled:
        return export_refusal_kept(pm, feed.length, feed.mask)
    return cache_refusal(pm.plan, traced_length=feed.length, mask_input=feed.mask is not None, compiled=compiled)


def _cache(pm: Any, feed: _Feed) -> KVCache:
    """The KV cache of one call over the stages this rank holds: [Note: generation with a KV cache]
    for a graph with a symbolic sequence, [Note: KV cache for exported graphs] for one traced at a
    fixed length. Its decode modules are kept per model and put on the parameters the stages hold
    in this call (FSDP has gathered them): [Note: decode graphs kept per model] in
    fxsplit.api.decode_graphs."""
    return kv_cache_kept(pm, feed.length, feed.mask)


def generate(pm: Any, input_ids: torch.Tensor, *, max_new_tokens: int, eos_token_id: int | None = None,
             use_cache: bool = True, overlap_steps: bool = True, **sampling: Any) -> torch.Tensor:
    """:meth:`ParallelModel.generate` of ``pm``: with the KV cache where :func:`cache_path` allows
    it, else [Note: generation by recompute] (the reason logged on ``fxsplit.generate`` at INFO);
    the tokens (B, T + n) on every rank, on ``input_ids``' device; ``sampling``: the fields of
    :class:`Sampling`. Bad arguments raise inside the agreed call, so a rank given them does not
    leave its peers waiting. (``pm`` is typed Any: fxsplit.api.model imports this module.)"""
    runtime = pm.runtime
    options = (tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else None, max_new_tokens,
               eos_token_id, use_cache, overlap_steps, sorted(sampling.items()))

    def prepare() -> list:
        _check_call(input_ids, max_new_tokens, eos_token_id)
        rule = Sampling(**sampling)
        feed = _Feed.of(pm.plan.stages.input_meta, traced_length(pm.plan))
        why = cache_path(pm, use_cache=use_cache)
        if why is not None:  # the cache's graphs take any length
            feed.check_fits(input_ids.shape[1], max_new_tokens)
        m = inference_microbatches([input_ids], pm.plan)
        check_batch(feed.inputs(input_ids[:, :feed.length]), pm.plan, "generate", microbatches=m)
        _log.info("generate(): %s", "KV cache" if why is None else f"recomputing every step (no KV cache): {why}")
        return [feed, input_ids, m, rule, why]

    def signature(flat: list) -> tuple:
        # the prompt's values too: ranks of a replica given different prompts would mix them silently
        return (pm._replica(), _h60((options, input_ids.cpu().tolist())))

    def check(spans: list, flat: Any) -> None:
        bad = sorted(r for r, fields in enumerate(spans) if any(hi != lo for hi, lo in fields))
        if bad:
            raise UsageError(
                f"generate(): the ranks of data-parallel replica(s) {bad} were given different prompts or "
                "options (input_ids, max_new_tokens, do_sample, temperature, top_k, seed, eos_token_id); "
                "every tensor- and pipeline-parallel rank of a replica must generate the same thing. "
                "Raised on every rank; this model stays usable.")

    def body(flat: list) -> torch.Tensor:
        feed, ids, m, rule, why = flat
        holds_last = runtime.last_stage in runtime.modules
        cache = None if why is not None else _cache(pm, feed)
        if cache is not None and overlap_steps:
            made: list = []

            def pick(output: Any) -> torch.Tensor:
                logits = model_logits(output)[:, -1, :]
                if not made:  # one generator for the call, as the stepwise loop has
                    made.append(rule.generator(logits.device))
                return next_tokens(logits, rule, made[0])

            return overlapped_decode(pm, ids, m, max_new_tokens, eos_token_id, pick, cache,
                                     feed.cached).to(ids.device)
        fed = [0]

        def step(tokens: torch.Tensor) -> torch.Tensor | None:
            new = tokens if cache is None else tokens[:, fed[0]:]  # prefill the prompt, then one token
            fed[0] = tokens.shape[1]
            flat = feed.inputs(new) if cache is None else feed.cached(new, tokens.shape[1])
            out = runtime.forward(flat, microbatches=m, override=cache)
            return model_logits(out)[:, new.shape[1] - 1, :] if holds_last else None

        share = lambda nxt, b: _share(pm, nxt, b)  # noqa: E731
        return _decode(step, share, ids.to(runtime.device), max_new_tokens, eos_token_id, rule).to(ids.device)

    return pm._inference("generate", prepare, body, signature=signature, check=check)


def _share(pm: Any, nxt: torch.Tensor | None, batch: int) -> torch.Tensor:
    """The last stage's tokens on every rank of the replica: first from tp rank 0 to the other tp
    ranks of the last stage (each drew its own; one answer wins), then over the pipeline."""
    runtime = pm.runtime
    tokens = nxt if nxt is not None else torch.empty(batch, dtype=torch.long, device=runtime.device)
    tokens = tokens.to(runtime.device)
    tp = pm._groups.tp
    if nxt is not None and tp is not None and dist.get_world_size(tp) > 1:
        work = dist.broadcast(tokens, dist.get_global_rank(tp, 0), group=tp, async_op=True)
        pm._wait(work, "in generate(), sharing the next tokens over the tensor-parallel ranks of the last stage", tp)
    if runtime.num_ranks > 1:
        group = runtime.pp_group if runtime.pp_group is not None else dist.group.WORLD
        src = dist.get_global_rank(group, runtime.last_rank)
        work = dist.broadcast(tokens, src, group=group, async_op=True)
        pm._wait(work, "in generate(), sharing the next tokens over the pipeline from the last stage's rank", group)
    return tokens
