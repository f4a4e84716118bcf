"""Numerics of the tensor-parallel pass (gloo, 2 and 4 processes) and the rewritten graphs.

Every case: each rank traces the same model, finds and applies the plan, materializes its
shards from the real model, binds the tp group and runs 3 SGD steps. The loss of every step and
every gradient (sharded ones reassembled with ShardSpec.unshard, replicated ones equal on all
ranks) must equal a single-process run of the unmodified model (float32, tight tolerance).
Many cases share one process-group launch per world size to keep spawn costs low.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import fxsplit
from fxsplit.testing import hf_zoo, zoo
from fxsplit.tp.collectives import copy_to_region, reduce_from_region
from fxsplit.graph.pass_api import PassContext, PassManager
from fxsplit.passes.tensor_parallel import apply_tp_plan, full_state_dict, tensor_parallel, tp_graph_diff
from fxsplit.tp.sharding import materialize_module
from fxsplit.testing import run_distributed
from fxsplit.tp.functional import gather_logits, vocab_parallel_cross_entropy, vocab_parallel_embedding
from fxsplit.tp.plan import find_tp_plan

STEPS, LR = 3, 0.5
RTOL, ATOL = 1e-5, 1e-6


def _build(spec: tuple):
    kind, kw = spec
    if kind.startswith("hf_"):
        return hf_zoo.make_hf(kind[3:], **kw)
    return zoo.make(kind, **kw)


def _logits(out):
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def _target(kind: str, logits: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if kind == "mlp":
        return torch.randn(logits.shape, generator=g)
    return torch.randint(0, logits.shape[-1], logits.shape[:-1], generator=g)


def _loss(kind: str, logits: torch.Tensor, target: torch.Tensor, vocab: int | None, vp_loss: bool):
    if kind == "mlp":
        return F.mse_loss(logits, target)
    if vp_loss:
        return vocab_parallel_cross_entropy(logits, target, vocab)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _reference(spec: tuple, vocab_size: int | None) -> tuple[list[float], list[dict]]:
    model, args, kwargs = _build(spec)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    params = dict(model.named_parameters(remove_duplicate=False))
    losses, grads = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        logits = _logits(model(*args, **kwargs))
        loss = _loss(spec[0], logits, _target(spec[0], logits), vocab_size, False)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in params.items() if p.grad is not None})
        opt.step()
    return losses, grads


def _run_tp(rank: int, world: int, spec: tuple, options: dict, traced: dict) -> dict:
    import torch.distributed as dist

    from fxsplit.tp.collectives import bind_groups

    model, args, kwargs = _build(spec)
    key = repr(spec)
    if key not in traced:  # tracing HF models costs seconds: once per model, copied per case
        traced[key] = fxsplit.trace(model, args, kwargs)
    gm = copy.deepcopy(traced[key])
    plan = find_tp_plan(gm, world, **options)
    apply_tp_plan(gm, plan)
    materialize_module(gm, plan.param_specs, rank, source=model)
    opt = torch.optim.SGD(gm.parameters(), lr=LR)
    losses, grads = [], []
    with bind_groups({"tp": dist.group.WORLD}):
        for _ in range(STEPS):
            opt.zero_grad()
            logits = _logits(gm(*args, **kwargs))
            full_v = plan.vocab_size if options.get("vocab_parallel_loss") else logits.shape[-1]
            target = _target(spec[0], logits if not options.get("vocab_parallel_loss")
                             else logits.new_empty(*logits.shape[:-1], full_v))
            loss = _loss(spec[0], logits, target, plan.vocab_size, options.get("vocab_parallel_loss", False))
            loss.backward()
            losses.append(loss.item())
            # every name (tied parameters under each of theirs, like the reference)
            grads.append({n: p.grad.clone() for n, p in gm.named_parameters(remove_duplicate=False)
                          if p.grad is not None})
            opt.step()
    return {"losses": losses, "grads": grads, "specs": dict(plan.param_specs),
            "regions": len(plan.regions), "styles": dict(plan.styles)}


_TRACED: dict = {}  # repr(spec) -> its model's trace, made once per launch before the ranks fork


def _prepare(cases: list) -> None:
    """Trace each model of ``cases`` once ([Note: preparing once per launch] in fxsplit.testing.harness):
    every rank copies the trace it inherited instead of tracing the same model itself."""
    for spec, _ in cases:
        if repr(spec) not in _TRACED:
            _TRACED[repr(spec)] = fxsplit.trace(*_build(spec))


def _cases_worker(rank: int, world: int, cases: list) -> list:
    return [_run_tp(rank, world, spec, options, _TRACED) for spec, options in cases]


_REFERENCES: dict[str, tuple] = {}


def _check(spec, options, per_rank: list[dict]) -> None:
    if repr(spec) not in _REFERENCES:  # the single-process run does not depend on the options
        _REFERENCES[repr(spec)] = _reference(spec, None)
    ref_losses, ref_grads = _REFERENCES[repr(spec)]
    specs = per_rank[0]["specs"]
    for r in per_rank:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{spec} {options}: losses differ: {m}")
    for step in range(STEPS):
        names = per_rank[0]["grads"][step].keys()
        # every rank holds (a shard of) every parameter: a lost gradient must fail, not be skipped
        for rank, r in enumerate(per_rank):
            got = set(r["grads"][step])
            assert got == set(ref_grads[step]), (
                spec, options, f"rank {rank} step {step}", "missing:", sorted(set(ref_grads[step]) - got),
                "unexpected:", sorted(got - set(ref_grads[step])))
        assert names and any(n in specs for n in names), (spec, sorted(names))
        for name in names:
            shards = [r["grads"][step][name] for r in per_rank]
            if name in specs:
                full = specs[name].unshard(shards)
            else:
                full = shards[0]
                for s in shards[1:]:
                    torch.testing.assert_close(s, full, rtol=0, atol=0)
            torch.testing.assert_close(full, ref_grads[step][name], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{spec} {options}: grad of {name} step {step}: {m}")


SMALL = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)

CASES_2 = [
    (("mlp", {}), {}),
    (("gpt", SMALL), {}),
    (("gpt", dict(SMALL, fused_qkv=True)), {}),
    (("gpt", dict(SMALL, fused_qkv=True, n_kv_head=2, mlp="swiglu")), {"vocab_parallel_loss": True}),
    (("gpt", dict(SMALL, vocab_size=63)), {}),
    (("hf_gpt2", {}), {}),
    (("hf_llama", {}), {}),
    (("hf_bert", {}), {}),
    (("hf_llama", {}), {"vocab_parallel_loss": True}),
    (("hf_gpt2", {"attn_implementation": "eager"}), {}),  # matmul/softmax attention
]
CASES_2 += [
    (("gpt", SMALL), {"sequence_parallel": True}),
    (("gpt", dict(SMALL, fused_qkv=True, n_kv_head=2, mlp="swiglu")),
     {"sequence_parallel": True, "vocab_parallel_loss": True}),
    (("hf_gpt2", {}), {"sequence_parallel": True}),
    (("hf_llama", {}), {"sequence_parallel": True}),
    (("hf_bert", {}), {"sequence_parallel": True}),
]
CASES_4 = [
    (("mlp", {}), {}),
    (("gpt", SMALL), {}),
    (("gpt", dict(SMALL, fused_qkv=True)), {}),
    (("gpt", dict(SMALL, n_kv_head=4, n_head=8, fused_qkv=True, mlp="swiglu")), {"vocab_parallel_loss": True}),
    (("hf_llama", dict(num_key_value_heads=4)), {}),
    (("gpt", dict(SMALL, fused_qkv=True)), {"sequence_parallel": True}),
    (("hf_gpt2", {}), {"sequence_parallel": True}),
    (("hf_bert", {}), {}),
]


@pytest.mark.dist
@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("world,cases", [(2, CASES_2), (4, CASES_4)], ids=["t2", "t4"])
def test_tp_matches_single_process(world, cases):
    results = run_distributed(_cases_worker, world, cases, timeout=300, prepare=(_prepare, (cases,)))
    for i, (spec, options) in enumerate(cases):
        _check(spec, options, [results[r][i] for r in range(world)])
