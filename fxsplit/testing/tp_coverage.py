"""The tensor-parallel coverage matrix: tiny transformers architectures built from configs, and
what fxsplit's automatic TP does with each (share of parameters per rank, collectives per layer,
what stays replicated and why, whether :func:`fxsplit.verify` passes).

Terms:
    arch: a key of ``ARCHS`` (a transformers model class and config from a tiny config: hidden
        64, 2 layers, 4 heads, intermediate 128, vocab 256; inputs batch 2, seq 16, images
        2x3x32x32 with patch 8), or a model given directly to :func:`measure`.
    share: the parameters the largest (stage, tp rank) holds, over that stage's parameters
        (counted from the materialized rank modules, so vocabulary padding counts).
    bound: what a fully sharded stage would hold on one rank: every matrix / t, plus the 1-D
        parameters (norms, biases), the small tables (embeddings whose rows are not the
        vocabulary: positions, token types; parameters of leading size 1: class tokens, position
        parameters) and convolution kernels (a patch embedding), which Megatron replicates too.
    collectives per layer: tp collective nodes of the stage graphs (``fxsplit.tp.emulate``'s
        ``EMULATED_OPS``) whose module path has a layer index (``layers.0``, ``h.1``), divided
        by the number of layers; **forward** ones communicate in the forward (g =
        ``reduce_from_region``, gathers, reduce-scatters, ``all_reduce_sum``), **backward** ones
        only in the backward (f = ``copy_to_region``, ``column_parallel_linear``). Megatron's
        count is 2 / 2 per transformer layer (one g and one f for attention, one each for the MLP).
    dead: tp collective nodes of a stage graph that nothing reads (not counted above).
    unreported: matrices (parameters of 2 or more dims) neither sharded nor named in
        ``plan.tp_plan.replicated`` (a projection the planner does not see as a linear: a
        parameter read by ``matmul`` / ``bmm`` / indexing, as fused expert tensors are).

    row = measure(*build("llama"), tp=2)           # Coverage(...)
    print(row.share, row.bound, row.fwd_per_layer, row.replicated, row.verified)

``transformers`` is imported inside the functions, so importing this module does not need it.
"""

from __future__ import annotations

import inspect
import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fxsplit.api import plan, verify
from fxsplit.api.materialize import materialize_stage
from fxsplit.errors import ArgumentTypeError, VerificationError
from fxsplit.hardware import Hardware
from fxsplit.tp import collectives as C
from fxsplit.tp import functional as tpf
from fxsplit.tp.emulate import EMULATED_OPS

__all__ = ["ARCHS", "EXPERTS", "Coverage", "build", "measure", "transformer_encoder_lm"]

_T = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
          intermediate_size=128, max_position_embeddings=64)
_VIT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32,
            patch_size=8, num_labels=5)
_GPT2ISH = dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=64)

# arch -> (model class, config class, config fields, input kind: "lm" | "seq2seq" | "image")
ARCHS: dict[str, tuple[str, str, dict[str, Any], str]] = {
    # decoder language models
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(_GPT2ISH), "lm"),
    "gpt_neo": ("GPTNeoForCausalLM", "GPTNeoConfig", dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                                                          intermediate_size=128, max_position_embeddings=64,
                                                          attention_types=[[["global", "local"], 1]], window_size=8), "lm"),
    "gptj": ("GPTJForCausalLM", "GPTJConfig", dict(_GPT2ISH, rotary_dim=8), "lm"),
    "codegen": ("CodeGenForCausalLM", "CodeGenConfig", dict(_GPT2ISH, n_ctx=64, rotary_dim=8), "lm"),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(_T), "lm"),
    "gpt_bigcode": ("GPTBigCodeForCausalLM", "GPTBigCodeConfig", dict(_GPT2ISH, multi_query=True), "lm"),
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(_T, num_key_value_heads=2), "lm"),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(_T, num_key_value_heads=2, sliding_window=None), "lm"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(_T, num_key_value_heads=2), "lm"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(_T, num_key_value_heads=2, head_dim=16), "lm"),
    "phi": ("PhiForCausalLM", "PhiConfig", dict(_T), "lm"),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(_T, num_key_value_heads=2, pad_token_id=0), "lm"),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(_T, num_key_value_heads=2, head_dim=16), "lm"),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(_T, num_key_value_heads=2, head_dim=16, sliding_window=8), "lm"),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(_T, num_key_value_heads=2, head_dim=16, sliding_window=8), "lm"),
    "olmo": ("OlmoForCausalLM", "OlmoConfig", dict(_T, num_key_value_heads=2), "lm"),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", dict(_T, num_key_value_heads=2), "lm"),
    "falcon": ("FalconForCausalLM", "FalconConfig", dict(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                                         num_attention_heads=4, num_kv_heads=2, bias=False,
                                                         new_decoder_architecture=True, max_position_embeddings=64), "lm"),
    "starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Config", dict(_T, num_key_value_heads=2, sliding_window=None), "lm"),
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(vocab_size=256, hidden_size=64, n_layer=2, n_head=4), "lm"),
    "opt": ("OPTForCausalLM", "OPTConfig", dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                ffn_dim=128, max_position_embeddings=64, word_embed_proj_dim=64), "lm"),
    "cohere": ("CohereForCausalLM", "CohereConfig", dict(_T, num_key_value_heads=2), "lm"),
    "stablelm": ("StableLmForCausalLM", "StableLmConfig", dict(_T, num_key_value_heads=2), "lm"),
    # mixture of experts
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(_T, num_key_value_heads=2, num_local_experts=4,
                                                            num_experts_per_tok=2, sliding_window=None), "lm"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(_T, num_key_value_heads=2, num_experts=4,
                                                                num_experts_per_tok=2, moe_intermediate_size=64,
                                                                shared_expert_intermediate_size=64), "lm"),
    # encoders
    "bert": ("BertForMaskedLM", "BertConfig", dict(_T), "lm"),
    "roberta": ("RobertaForMaskedLM", "RobertaConfig", dict(_T, max_position_embeddings=66, pad_token_id=1), "lm"),
    "electra": ("ElectraForMaskedLM", "ElectraConfig", dict(_T, embedding_size=64), "lm"),
    "distilbert": ("DistilBertForMaskedLM", "DistilBertConfig", dict(vocab_size=256, dim=64, n_layers=2, n_heads=4,
                                                                     hidden_dim=128, max_position_embeddings=64), "lm"),
    # encoder-decoders
    "t5": ("T5ForConditionalGeneration", "T5Config", dict(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                          num_decoder_layers=2, num_heads=4), "seq2seq"),
    "bart": ("BartForConditionalGeneration", "BartConfig", dict(vocab_size=256, d_model=64, encoder_layers=2, decoder_layers=2,
                                                               encoder_attention_heads=4, decoder_attention_heads=4,
                                                               encoder_ffn_dim=128, decoder_ffn_dim=128,
                                                               max_position_embeddings=64), "seq2seq"),
    # vision transformers
    "vit": ("ViTForImageClassification", "ViTConfig", dict(_VIT), "image"),
    "deit": ("DeiTForImageClassification", "DeiTConfig", dict(_VIT), "image"),
}
# the mixtures of experts again under transformers' other experts implementation that traces
# (``batched_mm``: ``gate_up_proj[expert_ids]`` then bmm; the eager per-expert loop over
# ``nonzero()`` does not trace)
EXPERTS = ("mixtral+batched_mm", "qwen2_moe+batched_mm")
_ZERO = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout",
         "hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout", "activation_dropout",
         "dropout_rate", "classifier_dropout", "seq_classif_dropout", "qa_dropout", "embed_dropout", "resid_dropout",
         "embedding_dropout", "ffn_dropout")


def build(arch: str, seed: int = 0) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """(model, args, kwargs) for ``arch``: dropout 0, no cache, sdpa attention (eager where the
    model has no sdpa), random weights from ``seed``. ``"<arch>+<experts>"`` (``EXPERTS``): a
    mixture of experts run by that transformers ``experts_implementation`` (default
    ``grouped_mm``)."""
    import transformers

    base, _, experts = arch.partition("+")
    model_cls, config_cls, fields, kind = ARCHS[base]
    cls = getattr(transformers, config_cls)
    known = set(inspect.signature(cls.__init__).parameters) | set(getattr(cls, "attribute_map", {})) | set(cls().to_dict()) | {"num_labels"}
    unknown = sorted(k for k in fields if k not in known)
    if unknown:  # configs store any keyword, so a misspelt field would pass silently
        raise ArgumentTypeError(f"{config_cls} has no field(s) {unknown}")
    cfg = dict(fields)
    for k in _ZERO:
        if k in known:
            cfg.setdefault(k, 0.0)
    if "use_cache" in known:
        cfg["use_cache"] = False
    for k in ("bos_token_id", "eos_token_id"):  # inside the tiny vocabulary
        if k in known:
            cfg.setdefault(k, 0)
    config = cls(**cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model_type = getattr(transformers, model_cls)
        config._attn_implementation = "sdpa" if getattr(model_type, "_supports_sdpa", False) else "eager"
        if experts:
            config._experts_implementation = experts
        model = model_type(config)
        g = torch.Generator().manual_seed(seed + 1)
        if kind == "image":
            return model, (torch.randn(2, 3, 32, 32, generator=g),), {}
        ids = torch.randint(2, 256, (2, 16), generator=g)
        if kind == "seq2seq":
            return model, (ids,), {"decoder_input_ids": torch.randint(2, 256, (2, 8), generator=g)}
        return model, (ids,), {}


class _EncoderLM(nn.Module):
    """A language model on ``torch.nn.TransformerEncoder`` (``nn.MultiheadAttention`` inside)."""

    def __init__(self, vocab=256, d=64, heads=4, layers=2, ff=128):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        return self.head(self.encoder(self.embed(idx)))


def transformer_encoder_lm(seed: int = 0) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """(model, (idx,), {}): two pre-norm ``nn.TransformerEncoderLayer`` layers, hidden 64, 4 heads."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _EncoderLM()
        idx = torch.randint(0, 256, (2, 16))
    return model, (idx,), {}


# ------------------------------------------------------------------------------------------------
# measurement

_FORWARD = {C.reduce_from_region, C.gather_from_region, C.reduce_scatter_to_region, C.gather_to_region,
            C.all_reduce_sum, tpf.vocab_parallel_embedding, tpf.gather_logits, tpf.vocab_parallel_cross_entropy}
_LAYER = re.compile(r"^((?:.*?\.)?\d+)(\.|$)")


@dataclass
class Coverage:
    """One row of the matrix (see the module's Terms)."""

    arch: str
    tp: int
    pp: int
    share: float = float("nan")
    bound: float = float("nan")
    layers: int = 0
    fwd_per_layer: float = float("nan")
    bwd_per_layer: float = float("nan")
    replicated: tuple[tuple[str, str], ...] = ()
    verified: str = ""
    error: BaseException | None = None
    seconds: float = 0.0
    sharded_params: int = 0
    unreported: tuple[str, ...] = ()
    dead: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None

    def reasons(self) -> dict[str, list[str]]:
        """why -> the module paths replicated for it."""
        out: dict[str, list[str]] = {}
        for path, why in self.replicated:
            out.setdefault(why, []).append(path)
        return out


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def _count_collectives(the_plan) -> tuple[int, int, set[str], list[str]]:
    fwd = bwd = 0
    dead: list[str] = []
    layers: set[str] = set()
    for gm in the_plan.stages.modules:
        for node in gm.graph.nodes:
            m = _LAYER.match(_module_path(node))
            if m:
                layers.add(m.group(1))
            if node.op != "call_function" or node.target not in EMULATED_OPS or not m:
                continue
            if not node.users:  # computed and never read (a stage's leftover): not counted
                dead.append(f"{node.name} ({_module_path(node)})")
                continue
            if node.target in _FORWARD:
                fwd += 1
            else:
                bwd += 1
    return fwd, bwd, layers, dead


def _stage_modules(model: nn.Module, the_plan) -> list[list[nn.Module]]:
    """``[s][r]``: tp rank r's materialized module of stage s (what :func:`fxsplit.verify` builds)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return [[materialize_stage(the_plan, s, tp_rank=r, source=model, device=device) for r in range(the_plan.config.tp)]
            for s in range(the_plan.config.num_stages)]


def _shares(model: nn.Module, the_plan, vocab: int | None, stages: list[list[nn.Module]]) -> tuple[float, float]:
    """(share, bound) of the largest (stage, rank) of ``stages`` (:func:`_stage_modules`); see the
    module's Terms."""
    t = the_plan.config.tp
    small = {f"{m}.weight" for m, mod in model.named_modules()
             if isinstance(mod, nn.Embedding) and mod.num_embeddings != vocab}
    small |= {n for n, p in model.named_parameters() if p.dim() <= 1 or p.dim() >= 4 or p.shape[0] == 1}
    share = bound = 0.0
    for ranks in stages:
        names = [n for n, _ in ranks[0].named_parameters()]
        full = {n: model.get_parameter(n).numel() for n in names}
        total = sum(full.values())
        if not total:
            continue
        ideal = sum(v if n in small else v / t for n, v in full.items())
        for r in ranks:
            local = sum(p.numel() for p in r.parameters())
            if local / total > share:
                share, bound = local / total, ideal / total
    return share, bound


def measure(model: nn.Module, args: tuple, kwargs: dict, *, tp: int, pp: int = 1, arch: str = "",
            vocab: int | None = None, run_verify: bool = True) -> Coverage:
    """Plan ``model`` at tp x pp (links assumed free, so the balance is by compute only), measure
    it, and run :func:`fxsplit.verify` (its exception, if any, is kept in ``error``)."""
    row = Coverage(arch=arch, tp=tp, pp=pp)
    t0 = time.perf_counter()
    if vocab is None:
        cfg = getattr(model, "config", None)
        vocab = getattr(cfg, "vocab_size", None) if cfg is not None else None
    the_plan = plan(model, args, kwargs, tp=tp, pp=pp, hardware=Hardware(link_bytes_per_s=float("inf")))
    row.replicated = tuple(the_plan.tp_plan.replicated)
    specs = the_plan.tp_plan.param_specs
    row.sharded_params = len(specs)
    named = {path for path, _ in row.replicated}
    row.unreported = tuple(n for n, p in model.named_parameters() if p.dim() >= 2 and n not in specs
                           and n.rsplit(".", 1)[0] not in named)
    fwd, bwd, layers, row.dead = _count_collectives(the_plan)
    row.layers = len(layers)
    if layers:
        row.fwd_per_layer, row.bwd_per_layer = fwd / len(layers), bwd / len(layers)
    # materialized once: the shares count their parameters (before verify's forward / backward,
    # which sets gradients only) and verify checks the same modules
    stages = _stage_modules(model, the_plan)
    row.share, row.bound = _shares(model, the_plan, vocab, stages)
    if run_verify:
        try:
            row.verified = str(verify(model, args, the_plan, kwargs, stage_modules=stages))
        except VerificationError as e:
            row.error = e
    row.seconds = time.perf_counter() - t0
    return row
