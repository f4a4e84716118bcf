"""The TP coverage matrix: tiny transformers architectures (decoders of every family, encoders,
encoder-decoders, vision transformers, mixtures of experts), ``nn.TransformerEncoder`` and a
timm-layout ViT, planned at t=2 (t=4 where the heads allow) and checked by ``fxsplit.verify``
(all ranks in one process, outputs and every gradient vs the unsplit model).

Each case asserts what is true today (``fxsplit.testing.tp_coverage`` defines the measures):
``SHARDED`` cases hold at most the bound (every matrix / t plus norms, biases, small tables)
+ 5% of their parameters on the largest rank and use the given forward / backward collectives
per layer (Megatron: 2 / 2); ``PARTIAL`` cases replicate part of attention or the MLP and the
plan says why (the op names asserted). A case that improves fails too, on purpose: update its
row here and the table in benchmarks/README.md (``python benchmarks/tp_coverage.py``).
Known bugs are ``xfail(strict=True)`` naming the bug.
"""

import collections
import dataclasses
import functools
import sys
import traceback
from pathlib import Path

import pytest

from fxsplit.testing import run_distributed
from fxsplit.testing import tp_coverage as tc
from fxsplit.testing.trace_cache import SharedTraces, shared_traces

sys.path.insert(0, str(Path(__file__).parent))
from tp_layout_models import make_layout  # noqa: E402

SLACK = 0.05
POSITIONS = "its indices are not a model input"

# arch -> (fwd, bwd) collectives per layer, the reasons (substrings) of what stays replicated
SHARDED = {
    "gpt2": ((2, 2), [POSITIONS]),
    "gpt_neo": ((2, 2), [POSITIONS]),
    "gptj": ((2, 1), []),          # parallel attention + MLP: one f for both
    "codegen": ((2, 1), []),
    "gpt_neox": ((2, 2), []),
    "llama": ((2, 2), []),
    "mistral": ((2, 2), []),
    "qwen2": ((2, 2), []),
    "qwen3": ((2, 4), []),         # + an f on each per-head q/k norm weight (its gradient is summed)
    "phi": ((2, 1), []),
    "phi3": ((2, 2), []),
    "gemma": ((2, 2), []),
    "gemma2": ((2, 2), []),
    "gemma3": ((2, 4), []),        # as qwen3: its q/k norms read the weight as (1 + w), f on that value
    "olmo": ((2, 2), []),
    "olmo2": ((4, 6), []),         # q/k RMSNorm over the whole projection: + g and f per norm statistic,
                                   # + a scatter per norm weight ([Note: reductions over the sharded dim])
    "falcon": ((2, 2), []),        # FalconLinear (x @ W.T) found as a linear; kv groups broadcast_to
    "starcoder2": ((2, 2), []),
    "opt": ((2, 2), [POSITIONS]),
    "cohere": ((2, 1), []),
    "stablelm": ((2, 2), []),
    "bert": ((2, 2), [POSITIONS, "layer_norm"]),  # the MLM head's dense feeds a LayerNorm
    "roberta": ((2, 2), [POSITIONS, "layer_norm"]),
    "electra": ((2, 2), [POSITIONS, "layer_norm"]),
    "distilbert": ((2, 2), [POSITIONS, "layer_norm"]),
    "vit": ((2, 2), ["a sharded value is a model output"]),  # the classifier
    "deit": ((2, 2), ["a sharded value is a model output"]),
    "timm_vit": ((2, 2), []),
    "torch_encoder": ((2, 2), []),  # nn.TransformerEncoder, traced through (fxsplit.graph.decompose)
    # multi-query: q by heads, the one k / v head whole in c_attn ([Note: whole blocks]); + an f on
    # the whole rows of c_attn's weight and of its bias (their gradient is partial)
    "gpt_bigcode": ((2, 4), [POSITIONS]),
    # cross-attention: q (decoder) and k / v (encoder output) seeded together ([Note: attention
    # partners]); decoder layers have 3 regions, 2 f's for the cross-attention's two inputs
    "t5": ((2.5, 4.5), [POSITIONS]),  # backward count as measured (not analysed per node)
    "bart": ((2.5, 3), [POSITIONS]),
    # experts as grouped linears (fused 3-D gate_up / down, column / row per expert), router replicated
    "mixtral": ((2, 2), ["a router's scores over its experts"]),
    # + the shared expert's own f / g (its 1-output sigmoid gate replicated)
    "qwen2_moe": ((3, 3), ["a router's scores over its experts", "combines the sharded value with replicated"]),
    # the same under transformers' batched_mm experts (W[expert_ids] then bmm: batched linears)
    "mixtral+batched_mm": ((2, 2), ["a router's scores over its experts"]),
    "qwen2_moe+batched_mm": ((3, 3), ["a router's scores over its experts", "combines the sharded value with replicated"]),
    # [heads, 3, hd] fused qkv by heads, then q / k / v reshaped to (B * heads, T, hd): heads merged
    # as the INNER factor, each rank its strided rows ([Note: heads merged as an inner factor] in
    # fxsplit.tp.merged), ALiBi's [B * heads, 1, T] read through a strided scatter: one for both
    # layers (+1 backward-only node in layer 0, whose backward never runs: ALiBi has no gradient)
    "bloom": ((2, 2.5), []),
}

# arch -> reasons (substrings) the plan must give for the attention / MLP it replicates
PARTIAL: dict[str, list[str]] = {}

# arch -> parameters neither sharded nor named in plan.tp_plan.replicated (silently whole)
UNREPORTED: dict[str, str] = {}

XFAIL: dict[str, str] = {}  # arch -> the known bug (strict xfail); none known now

FAST = ["gpt2", "llama", "qwen3", "phi3", "gemma", "bert", "vit", "timm_vit", "gpt_bigcode", "olmo2", "mixtral",
        "torch_encoder"]
T4 = ["gpt2", "gpt_neox", "bert", "vit", "timm_vit", "torch_encoder", "bloom"]
PP2 = ["gpt2", "llama"]


def _build(arch):
    if arch == "timm_vit":
        return make_layout("vit")
    if arch == "torch_encoder":
        return tc.transformer_encoder_lm()
    pytest.importorskip("transformers")
    return tc.build(arch)


# [Note: how the matrix is computed]
# One model per arch, traced once and planned from copies of that trace at each (t, pp)
# ([Note: sharing a trace between plans] in fxsplit.testing.trace_cache): the plans, measures and
# verify are exactly those of a fresh trace; the trace (torch.export, seconds per model) was most
# of a t=4 or pp=2 case. The rows are independent, so WORKERS processes (run_distributed: its
# forkserver has transformers imported; a worker that dies fails the launch with its traceback)
# compute the rows the selected tests need, every layout of an arch in the same worker; each
# test then asserts on its own row, and a row whose measure raised re-raises there (by name).
# The archs are not dealt in advance (an arch's cost is mostly its export, which varies by
# several times between archs): each worker takes the next arch of one queue, those with the
# most layouts first, from a counter on the launch's store (TCPStore.add is atomic), so no worker
# idles while the other still has several archs to do.
WORKERS = 2  # the CI and development machines have 2 cores
_TRACES = SharedTraces()
_NEXT = "fxsplit_tp_coverage_next_arch"


@functools.lru_cache(maxsize=None)
def _model(arch):
    return _build(arch)


def _row(arch, t, pp=1):
    model, args, kwargs = _model(arch)
    with shared_traces(_TRACES):
        return tc.measure(model, args, kwargs, tp=t, pp=pp, arch=arch)


@dataclasses.dataclass
class _Raised:
    """A row whose measure raised (in a worker): the exception's text, or a skip's reason."""

    text: str
    skip: bool = False


def _queue(keys):
    """The archs of ``keys``, most layouts first (then by name): the order workers take them in."""
    layouts = collections.Counter(arch for arch, _, _ in keys)
    return sorted(layouts, key=lambda a: (-layouts[a], a))


def _rows_of(rank, world, keys):
    import datetime
    import os

    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    archs = _queue(keys)
    out = {}
    while (i := store.add(_NEXT, 1) - 1) < len(archs):
        for key in (k for k in keys if k[0] == archs[i]):
            try:
                out[key] = _row(*key)
            except pytest.skip.Exception as exc:
                out[key] = _Raised(str(exc), skip=True)
            except Exception:  # noqa: BLE001 -- reported by the test of this row
                out[key] = _Raised(traceback.format_exc())
    return out


@pytest.fixture(scope="module")
def rows(request):
    """(arch, t, pp) -> Coverage for every row this module's selected tests read."""
    mine = [item for item in request.session.items if item.module is sys.modules[__name__]]
    keys = {tuple(item.callspec.params[k] for k in ("arch", "t", "pp")) for item in mine if hasattr(item, "callspec")}
    if any(item.name == "test_layer_collectives_are_counted_per_layer" for item in mine):
        keys.add(("llama", 2, 1))
    if "transformers" not in sys.modules:
        try:
            import transformers  # noqa: F401 -- imported here, the workers' forkserver preloads it
        except ImportError:
            pass
    world = min(WORKERS, len({k[0] for k in keys}))
    out = {}
    for part in run_distributed(_rows_of, world, sorted(keys), timeout=3000):
        out.update(part)
    return out


def _get(rows, arch, t, pp):
    row = rows[(arch, t, pp)]
    if isinstance(row, _Raised):
        if row.skip:
            pytest.skip(row.text)
        raise AssertionError(f"{arch} t={t} pp={pp}: measuring raised\n{row.text}")
    return row


ALL = sorted({*SHARDED, *PARTIAL, *UNREPORTED, *XFAIL})


def _case(arch, t, pp=1):
    marks = [] if arch in ("timm_vit", "torch_encoder") else [pytest.mark.hf]
    if arch not in FAST or pp > 1:
        marks.append(pytest.mark.slow)
    if arch in XFAIL:
        marks.append(pytest.mark.xfail(strict=True, reason=XFAIL[arch]))
    return pytest.param(arch, t, pp, marks=marks, id=f"{arch}-t{t}" + (f"-pp{pp}" if pp > 1 else ""))


CASES = [_case(a, 2) for a in ALL] + [_case(a, 4) for a in T4] + [_case(a, 2, 2) for a in PP2]


@pytest.mark.dist  # the rows are computed on run_distributed's ranks (see `rows`)
@pytest.mark.parametrize("arch,t,pp", CASES)
def test_coverage(rows, arch, t, pp):
    row = _get(rows, arch, t, pp)
    assert row.ok, f"{arch} t={t} pp={pp}: {row.error}"
    assert row.verified.startswith("verified"), row.verified
    reasons = " | ".join(why for _, why in row.replicated)
    if arch in SHARDED:
        (fwd, bwd), expected = SHARDED[arch]
        assert row.share <= row.bound + SLACK, (
            f"{arch} t={t}: the largest rank holds {row.share:.3f} of the parameters, over the bound "
            f"{row.bound:.3f} + {SLACK}; replicated: {row.replicated}")
        assert (row.fwd_per_layer, row.bwd_per_layer) == (fwd, bwd), (row.fwd_per_layer, row.bwd_per_layer)
        assert row.share >= 1 / t, row.share
    else:
        expected = PARTIAL.get(arch, [])
        assert row.share > row.bound + SLACK, (
            f"{arch} t={t}: now within the bound ({row.share:.3f} <= {row.bound:.3f} + {SLACK}): coverage "
            f"improved, move it to SHARDED and update benchmarks/README.md")
    for why in expected:
        assert why in reasons, f"{arch}: expected a replicated reason with {why!r}; got {reasons!r}"
    if arch in SHARDED and not expected:
        assert not row.replicated, row.replicated
    if pp > 1 and arch == "llama":
        # the interleaved 4-stage split leaves a column_parallel_linear with no users in the stage
        # before the cut inside layer 1's attention (wasted forward compute; no wrong number)
        assert row.dead, "the dead column_parallel_linear at pp=2 is gone: drop this note"
    else:
        assert not row.dead, row.dead
    if arch in UNREPORTED:
        assert UNREPORTED[arch] in row.unreported, row.unreported
    elif arch not in ("vit", "deit"):  # their class token, position table and patch conv are no linears
        assert not row.unreported, f"{arch}: matrices neither sharded nor reported: {row.unreported}"


@pytest.mark.hf
@pytest.mark.dist
def test_layer_collectives_are_counted_per_layer(rows):
    """The measure itself: Llama at t=2 has one g per attention and per MLP in each of its 2 layers,
    and the largest rank's share is about 1/2 (so the bound is not vacuous)."""
    row = _get(rows, "llama", 2, 1)
    assert row.layers == 2 and row.fwd_per_layer == 2 and row.bwd_per_layer == 2
    assert 0.5 <= row.share <= 0.51 and row.bound < 0.51
