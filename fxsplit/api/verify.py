"""``fxsplit.verify``: run every tp rank of every stage of a plan in ONE process, collectives
emulated, and compare outputs and every parameter gradient with the unsplit model.

Terms as in :mod:`fxsplit.api.plan`; **reference**: the model traced and run unsplit (t = p = 1,
with the user's passes), materialized from the same weights; **per-rank values**: the t values
one graph node takes on the t tp ranks; **gathered value**: the full tensor rebuilt from a
sharded node's per-rank values (along the dim ``plan.tp_plan.sharded_nodes`` records).

    report = fxsplit.verify(model, (idx,), plan)             # raises VerificationError on a mismatch
    plan = fxsplit.plan(model, (idx,), tp=2, pp=2, verify=True)
    pm = fxsplit.parallelize(model, (idx,), tp=2, verify=False)   # default: auto (see below)

[Note: plan-time verification]
The t ranks' stage graphs are one graph (shard offsets come from the tp group at run time), so
each stage is interpreted in lockstep, node by node, computing every node for the t ranks; a
collective node is evaluated over the t values at once by ``fxsplit.tp.emulate`` (a
differentiable combine, [Note: emulated collectives]), and other nodes run with ``axis_rank``
bound to the rank. Stages run in order, fed as the pipeline feeds them (``StageIO``), each value
handed over in the layout the transfer gives it ([Note: boundary layouts] in
:mod:`fxsplit.pipeline.layout`), so a stage whose code needs other strides fails here as it
would in the runtime. The loss
is ``loss_fn(output, target)`` when given, else a fixed random projection of every floating
output; each rank's loss is backpropagated (one ``backward`` of their sum: the emulated
collectives give each rank its own backward), and each rank's gradients are reassembled
(``ShardSpec.unshard``; replicated parameters must hold the full gradient on every rank;
parameters tied across stages are summed over their stages, as the runtime does).

With expert parallelism (ep > 1) the lockstep ranks are every (ep, tp) rank, ep outer: each ep
rank is fed its own slice of the example batch (dim 0 of every input of the batch's size), the tp
ranks of one ep rank the same slice, and each holds its own block of every expert weight (its tp
shard of it with tp > 1); the token exchange is emulated over the ep ranks of one tp rank
(``fxsplit.tp.experts.emulated_dispatch`` / ``emulated_combine``), the tp collectives over the tp
ranks of one ep rank. Per tp rank, the ep ranks' outputs, joined along the batch, are compared with
the unsplit model's on the whole batch and one loss is taken of them, so an expert's gradient is
its ranks' blocks joined on dim 0 and every other gradient the sum of the ranks' (each rank
computed its slice's share), as the runtime's reductions make them; then the tp shards are
joined as without ep.

Tolerance, relative to the reference's magnitude: a value passes when
``max|x - ref| <= rtol * max(max|ref|, 1e-3)`` with ``rtol`` 1e-4 for float32, 1e-9 for float64,
5e-3 for float16 and 3e-2 for bfloat16 (``tolerance(dtype)``); integer and bool values must be
equal. The splits only reorder sums (float32 last bits); a wrong shard, a missing or misplaced
collective or a wrong rewrite is off by O(1).

On a mismatch, every node of the split graphs that the reference graph holds under the same name
is compared in graph order (gathered when sharded, also in the block layouts of fused weights;
partial sums before an all-reduce and values of another shape are skipped), and
:class:`VerificationError` names the first one that diverges, its stage and module path.

[Note: which reference]
``verify`` compares with the model the user gave (``reference="model"``). A user pass may change
what the model computes on purpose (an op swap); then the split cannot match the model, and the
question is which pass moved it: the model is traced with the first k passes for k = 0..n and
each pass whose outputs differ from those before it (beyond the tolerance) is named in the
VerificationError, with ``reference="graph"`` offered, which compares with the traced model
after all the passes (the split alone). ``parallelize`` checks the split alone (its passes are
the user's request).

``parallelize`` verifies by default (``verify=None``: auto) when the model has real weights,
fewer than 1e8 parameters, no random op drawing numbers (dropout with p > 0, whose masks
differ from the unsplit run by design), no ``mp_policy`` and no ``vocab_parallel_loss`` (not
verified yet: its outputs stay sharded); ``verify=True`` forces it (and raises when it cannot
run), ``verify=False`` turns it off.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils import _pytree as pytree

from fxsplit.api.lockstep import run_lockstep
from fxsplit.api.materialize import keep_own_experts, materialize_stage
from fxsplit.api.padding import check_padding, outputs_cut, pad_to_traced
from fxsplit.errors import PlanError, UsageError, VerificationError
from fxsplit.graph.examples import batch_of, example_at_batch
from fxsplit.graph.ops import resolve_path
from fxsplit.graph.trace import flatten_inputs
from fxsplit.pipeline.layout import hand_over
from fxsplit.tp import collectives as C
from fxsplit.tp.random import is_random

__all__ = ["REFERENCES", "VerificationError", "VerifyReport", "auto_verify_reason", "tolerance", "verify"]

REFERENCES = ("model", "graph")
_REFERENCE_WORDS = {"model": "model you gave", "graph": "model after the plan's passes"}

AUTO_MAX_PARAMS = 100_000_000  # parallelize verifies models below this size by default
_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
_FLOOR = 1e-3
_REDUCING = (C.reduce_from_region, C.reduce_scatter_to_region, C.all_reduce_sum)


def tolerance(dtype: torch.dtype) -> float:
    """The relative tolerance of a value of ``dtype`` ([Note: plan-time verification])."""
    return _TOL.get(dtype, 1e-4) if dtype.is_floating_point else 0.0


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` checked: outputs and gradients compared, the largest relative error of
    each (``max|x - ref| / max(max|ref|, 1e-3)``) and the time it took."""

    outputs: int
    gradients: int
    max_output_error: float
    max_gradient_error: float
    seconds: float

    def __str__(self) -> str:
        return (f"verified: {self.outputs} outputs (max rel. error {self.max_output_error:.2e}) and "
                f"{self.gradients} parameter gradients (max {self.max_gradient_error:.2e}) in {self.seconds:.2f}s")


# ------------------------------------------------------------------------------------------------
# comparison


def _error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error of ``x`` against ``ref``; inf for a shape mismatch; exact for integers."""
    if tuple(x.shape) != tuple(ref.shape):
        return float("inf")
    if not ref.is_floating_point() and not ref.is_complex():
        return 0.0 if torch.equal(x.to(ref.dtype), ref) else float("inf")
    x, ref = x.detach().double(), ref.detach().double()
    if x.numel() == 0:
        return 0.0
    if not torch.isfinite(ref).all() or not torch.isfinite(x).all():
        same = torch.equal(torch.isnan(x), torch.isnan(ref)) and torch.equal(torch.isinf(x), torch.isinf(ref))
        fin = torch.isfinite(ref) & torch.isfinite(x)
        if not same or not torch.equal(x[~fin & ~torch.isnan(x)], ref[~fin & ~torch.isnan(ref)]):
            return float("inf")
        x, ref = x[fin], ref[fin]
        if x.numel() == 0:
            return 0.0
    return float((x - ref).abs().max()) / max(float(ref.abs().max()), _FLOOR)


def _ok(x: torch.Tensor, ref: torch.Tensor, rtol: float | None) -> tuple[bool, float]:
    err = _error(x, ref)
    return err <= (rtol if rtol is not None else tolerance(ref.dtype)), err


def _projection_loss(flat: Sequence[Any]) -> torch.Tensor:
    """A fixed random projection of every floating output: every output element gets a gradient."""
    g = torch.Generator().manual_seed(1234)
    total = None
    for v in flat:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            w = torch.randn(v.shape, generator=g, dtype=torch.float64).to(v.device)
            term = (v.double() * w).sum() / max(v.numel(), 1) ** 0.5
            total = term if total is None else total + term
    if total is None:
        raise PlanError("verify: the model has no floating-point output to compute a loss from; pass loss_fn=")
    return total


# ------------------------------------------------------------------------------------------------
# the check


def _draws_random(gm: torch.fx.GraphModule) -> str | None:
    for node in gm.graph.nodes:
        if not is_random(node, gm):
            continue
        mod = (gm.get_submodule(str(node.target)) if node.op == "call_module" else
               resolve_path(gm, str(node.args[0].target)) if node.op == "call_function" and node.args
               and isinstance(node.args[0], torch.fx.Node) and node.args[0].op == "get_attr" else None)
        if isinstance(mod, nn.Module):  # a dropout module (or one run in the tp stream)
            if getattr(mod, "p", None) == 0 or not mod.training:
                continue
        elif node.op == "call_function" and len(node.args) > 1 and node.args[1] in (0, 0.0):
            continue
        elif node.op == "call_function" and node.kwargs.get("p", None) in (0, 0.0):
            continue
        return node.name
    return None


def auto_verify_reason(model: nn.Module, the_plan: Any) -> str | None:
    """Why ``parallelize``'s default (auto) verification does not run, or None when it does."""
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.is_meta for t in tensors):
        return "the model is on the meta device (no weights to compare)"
    n = sum(p.numel() for p in model.parameters())
    if n >= AUTO_MAX_PARAMS:
        return f"the model has {n:.3g} parameters (auto-verification runs below {AUTO_MAX_PARAMS:.0e})"
    if the_plan.config.mp_policy is not None:
        return "mixed precision (mp_policy) is on"
    if the_plan.config.vocab_parallel_loss:
        return "vocab_parallel_loss is on (its outputs stay vocabulary-sharded; not verified yet)"
    for s, gm in enumerate(the_plan.stages.modules):
        if (node := _draws_random(gm)) is not None:
            return f"stage {s} draws random numbers at node {node!r} (dropout with p > 0)"
    return None


def verify(
    model: nn.Module,
    example_args: Any,
    plan: Any,
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    rtol: float | None = None,
    stage_modules: Sequence[Sequence[nn.Module]] | None = None,
    reference: str = "model",
    quiet: bool = False,
) -> VerifyReport:
    """Check ``plan`` (a :class:`fxsplit.Plan` of ``model``) on ``example_args``: outputs and every
    parameter gradient of all tp ranks of all stages, run in this process, against the unsplit
    model ([Note: plan-time verification]). Raises :class:`fxsplit.errors.VerificationError`
    naming the first diverging node, or PlanError when the plan cannot be verified (meta weights,
    random ops). ``stage_modules[s][r]``: rank r's materialized module of stage s to check instead
    of building them from ``model``. ``rtol`` overrides the dtype's tolerance.

    ``reference="model"`` (default) compares with the model you gave; when the plan's own passes
    (``passes=...``) change what it computes, the VerificationError names each pass that does
    ([Note: which reference]). ``reference="graph"`` compares with the model traced and rewritten by
    those passes, checking the split alone. On success one line is printed unless ``quiet``."""
    t0 = time.perf_counter()
    _check_verifiable(model, plan, reference)
    if not isinstance(example_args, (tuple, list)):
        example_args = (example_args,)
    c = plan.config
    example_args, example_kwargs, target = _at_microbatch(c, example_args, example_kwargs, target)
    t, num_stages = c.tp, c.num_stages
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    # an example shorter than the traced length runs padded, as a step would ([Note: padding to the traced length])
    flat, length = pad_to_traced(flatten_inputs(plan.graph, example_args, example_kwargs), plan)
    batch = batch_of((tuple(example_args), dict(example_kwargs or {})))
    held = _lockstep_ranks(c)[1]
    if stage_modules is None:
        stage_modules = [[_materialized(plan, s, r, model, device) for r in range(held)] for s in range(num_stages)]
    vals: list[dict[str, list[Any]]] = []
    rank_flat = _run_stages(plan, stage_modules, flat, vals, batch)
    if length is not None:
        rank_flat = [outputs_cut(plan, length)(r) for r in rank_flat]
    saved = {n: b.detach().clone() for n, b in model.named_buffers()}  # a train-mode forward updates some

    def padding() -> None:
        check_padding(model, tuple(example_args), dict(example_kwargs or {}), plan,
                      lambda padded: _run_stages(plan, stage_modules, padded, [], batch)[0],
                      lambda x, ref: _ok(x, ref, rtol), strict=length is not None or c.pad_sequence is True)

    try:
        if length is not None:  # a padded example: a padding that changes the model is named as such first
            padding()
        report = _compare(model, example_args, example_kwargs, plan, stage_modules, vals, rank_flat,
                          loss_fn=loss_fn, target=target, rtol=rtol, t0=t0, reference=reference)
        if length is None:
            padding()
    finally:
        with torch.no_grad():
            for n, b in model.named_buffers():
                if not torch.equal(b, saved[n]):
                    b.copy_(saved[n])
    if not quiet:
        print(f"fxsplit.verify: OK, {report} against the {_REFERENCE_WORDS[reference]}")
    return report



def _check_verifiable(model: nn.Module, plan: Any, reference: str) -> None:
    """UsageError / PlanError when ``plan`` cannot be verified against ``model`` here: an unknown
    reference, meta weights, vocabulary-sharded outputs, or random draws the unsplit run draws
    differently."""
    if reference not in REFERENCES:
        raise UsageError(f"verify(reference={reference!r}): choose one of {REFERENCES}: 'model' compares with the "
                         "model you gave, 'graph' with the model after the plan's passes")
    if any(p.is_meta for p in [*model.parameters(), *model.buffers()]):
        raise PlanError("verify: the model is on the meta device; verification needs real weights "
                        "(build the model on a real device, or plan without verify=True)")
    if plan.config.vocab_parallel_loss:
        raise PlanError("verify: a plan with vocab_parallel_loss=True is not verified yet (the model's outputs "
                        "stay vocabulary-sharded into the runtime's parallel cross-entropy); verify the same "
                        "plan with vocab_parallel_loss=False")
    for s, gm in enumerate(plan.stages.modules):
        if (node := _draws_random(gm)) is not None:
            raise PlanError(f"verify: stage {s} draws random numbers at node {node!r} (dropout with p > 0), "
                            "which the unsplit run draws differently; verify with the model in eval() mode or p=0")


def _at_microbatch(c: Any, example_args: Any, example_kwargs: Any, target: Any) -> tuple[Any, Any, Any]:
    """``(example_args, example_kwargs, target)``: a plan with a static batch runs microbatches of
    that size ([Note: a static batch]), so the example and the loss's target are cut (or
    repeated) to one microbatch per expert-parallel rank together."""
    static = c.static_batch(batch_of((tuple(example_args), dict(example_kwargs or {}))))
    if static is None:
        return example_args, example_kwargs, target
    key = "\0target"
    example_args, cut = example_at_batch(tuple(example_args), {**dict(example_kwargs or {}), key: target},
                                         static * c.ep)
    target = cut.pop(key)
    return example_args, cut, target


def _batch_slices(flat: Sequence[Any], batch: int | None, ranks: int, ep: int) -> list[Sequence[Any]]:
    """The inputs of every lockstep rank: ``flat`` itself for each tp rank (ep == 1); with ep, lockstep
    rank i (ep rank i // (ranks / ep)) its ep rank's slice of every input holding the batch (dim 0 of
    size ``batch``)."""
    if ep == 1:
        return [flat] * ranks
    if batch is None or batch % ep:
        raise PlanError(f"verify: an example batch of {batch} samples does not split into ep={ep} equal slices (one "
                        f"per expert-parallel rank); give an example whose batch is a multiple of {ep}")
    b, per_ep = batch // ep, ranks // ep
    return [[x[(i // per_ep) * b:(i // per_ep + 1) * b] if isinstance(x, torch.Tensor) and x.dim()
             and x.shape[0] == batch else x for x in flat] for i in range(ranks)]


def _materialized(plan: Any, stage: int, rank: int, model: nn.Module, device: torch.device) -> nn.Module:
    """Lockstep rank ``rank``'s module of ``stage``: its tp shards, and (ep > 1, rank = e * tp + r)
    ep rank e's block of experts."""
    t = plan.config.tp
    module = materialize_stage(plan, stage, tp_rank=rank % t, source=model, device=device)
    if plan.config.ep > 1:
        keep_own_experts({stage: module}, plan.ep_plan, rank // t)
    return module


def _lockstep_ranks(c: Any) -> tuple[list[dict[str, tuple[int, int]]], int]:
    """The ranks verify runs in lockstep (each its (rank, size) per mesh axis), and how many
    distinct stage modules they hold: every (ep, cp, tp) rank (rank i = (e * cp + k) * tp + r), each
    ep rank its batch slice and block of experts; the cp ranks of one (ep, tp) rank share its
    modules (:func:`_module_of`), so their parameter gradients add up in one .grad, as the runtime
    sums them over cp."""
    axes = [("ep", c.ep)] * (c.ep > 1) + [("cp", c.cp)] * (c.cp > 1 or c.ep == 1) + [("tp", c.tp)]
    ranks = [{}]
    for name, size in axes:
        ranks = [{**rank, name: (k, size)} for rank in ranks for k in range(size)]
    return ranks, c.ep * c.tp


def _module_of(c: Any, i: int) -> int:
    """Lockstep rank i's modules (index e * tp + r: its ep and tp ranks; cp ranks share)."""
    return (i // (c.cp * c.tp)) * c.tp + i % c.tp


def _run_stages(plan: Any, stage_modules: Sequence[Sequence[nn.Module]], flat: Sequence[Any],
                vals: list[dict[str, list[Any]]], batch: int | None) -> list[list[Any]]:
    """Every stage on every lockstep rank on the flat model inputs ``flat`` (of ``batch`` samples);
    each stage's node values appended to ``vals``; returns the flat model outputs per rank (one
    list, the ep ranks' outputs joined along the batch, with ep)."""
    c = plan.config
    ranks, _ = _lockstep_ranks(c)
    n = len(ranks)
    rank_inputs = _batch_slices(flat, batch, n, c.ep)
    outs: list[list[tuple]] = []
    for s, io in enumerate(plan.stages.io):
        # values cross as the runtime transfers them: same layout ([Note: boundary layouts])
        inputs = [[rank_inputs[r][src.index] if src.stage is None else
                   hand_over(outs[src.stage][r][src.index], meta.dim_order)
                   for src, meta in zip(io.inputs, io.input_meta)] for r in range(n)]
        vals.append({})
        mods = [stage_modules[s][_module_of(c, i)] for i in range(n)]
        outs.append(run_lockstep(plan.stages.modules[s], mods, inputs, vals[-1], ranks))
    rank_flat = [[outs[-1][r][local] for _, local in sorted(plan.stages.io[-1].model_outputs)] for r in range(n)]
    if c.ep > 1:  # per (cp, tp) rank one model output (its ep ranks' joined), one loss
        per = c.cp * c.tp
        rank_flat = [[torch.cat(vs) if isinstance(vs[0], torch.Tensor) and vs[0].dim() else vs[0]
                      for vs in zip(*rank_flat[j::per])] for j in range(per)]
    return rank_flat


def _compare(model, example_args, example_kwargs, plan, stage_modules, vals, rank_flat, *, loss_fn, target, rtol,
             t0, reference) -> VerifyReport:
    t = plan.config.tp
    with_passes = reference == "graph"
    ref_name = reference
    reference = _Reference.of(model, example_args, example_kwargs, plan, len(rank_flat[0]), with_passes=with_passes)

    def loss_of(flat_out):
        if loss_fn is None:
            return _projection_loss(flat_out)
        return loss_fn(plan.stages.unflatten_outputs(list(flat_out)), target)

    problems: list[str] = []
    max_out = 0.0
    cp = plan.config.cp
    for r in range(len(rank_flat)):
        for k, (x, ref) in enumerate(zip(rank_flat[r], reference.flat)):
            if isinstance(ref, torch.Tensor):
                ok, err = _ok(x, ref, rtol)
                max_out = max(max_out, err)
                if not ok:
                    where = f"tp rank {r % t}" + (f", cp rank {r // t}" if cp > 1 else "")
                    problems.append(f"model output {k} on {where}: relative error {err:.3g}")
    ref_loss = loss_of(reference.flat)
    losses = [loss_of(flat) for flat in rank_flat]
    max_grad, n_grads = 0.0, 0
    if ref_loss.requires_grad:
        ref_grads = reference.grads(ref_loss)
        torch.stack([l.double() for l in losses]).sum().backward()
        grad_problems, max_grad, n_grads = _check_grads(plan, stage_modules, ref_grads, rtol)
        problems += grad_problems
    if problems:
        if ref_name == "model" and plan.config.passes:
            _raise_if_passes_changed_meaning(model, example_args, example_kwargs, plan, rtol, problems)
        ref_gm, ref_vals = reference.node_values(model, example_args, example_kwargs, plan)
        raise _diverged(plan, ref_gm, ref_vals, vals, problems, rtol)
    return VerifyReport(outputs=len(reference.flat) * len(rank_flat), gradients=n_grads, max_output_error=max_out,
                        max_gradient_error=max_grad, seconds=time.perf_counter() - t0)


@dataclass
class _Reference:
    """The unsplit run: the user's model itself (its buffers restored afterwards, its parameters'
    ``.grad`` untouched), or the traced graph with the user's passes when there are passes (they
    may change what is computed) or the outputs do not flatten like the plan's."""

    flat: list[Any]
    params: dict[str, torch.Tensor]  # name (every alias) -> the tensor the loss was computed with

    @classmethod
    def of(cls, model: nn.Module, args: Any, kwargs: Any, plan: Any, n_out: int, *, with_passes: bool) -> _Reference:
        if not (with_passes and plan.config.passes):
            flat, _ = pytree.tree_flatten(model(*args, **dict(kwargs or {})))
            if len(flat) == n_out:
                return cls(flat=flat, params=dict(model.named_parameters(remove_duplicate=False)))
        passes = plan.config.passes if with_passes else ()
        gm, mod, io = _reference_graph(model, args, kwargs, plan, passes=passes)
        out = run_lockstep(gm, [mod], [flatten_inputs(gm, args, kwargs)], None)[0]
        flat = [out[local] for _, local in sorted(io.model_outputs)]
        return cls(flat=flat, params=dict(mod.named_parameters(remove_duplicate=False)))

    def grads(self, loss: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """d loss / d every parameter, by name, without touching any ``.grad``."""
        unique = {id(p): p for p in self.params.values() if p.requires_grad}
        got = torch.autograd.grad(loss, list(unique.values()), allow_unused=True)
        by_id = dict(zip(unique, got))
        return {n: by_id.get(id(p)) for n, p in self.params.items()}

    @staticmethod
    def node_values(model, args, kwargs, plan) -> tuple[torch.fx.GraphModule, dict[str, list[Any]]]:
        gm, mod, _ = _reference_graph(model, args, kwargs, plan, passes=plan.config.passes)
        record: dict[str, list[Any]] = {}
        run_lockstep(gm, [mod], [flatten_inputs(gm, args, kwargs)], record)
        return gm, record


def _raise_if_passes_changed_meaning(model: nn.Module, args: Any, kwargs: Any, plan: Any, rtol: float | None,
                                     problems: Sequence[str]) -> None:
    """[Note: which reference]: the model traced with the first k of the plan's passes, for k = 0..n;
    pass k changed the model's meaning when its outputs differ from those before it."""
    from fxsplit.graph.pass_api import pass_name

    passes = list(plan.config.passes)
    outputs = []
    for k in range(len(passes) + 1):
        gm, mod, io = _reference_graph(model, args, kwargs, plan, passes=passes[:k])
        with torch.no_grad():
            out = run_lockstep(gm, [mod], [flatten_inputs(gm, args, kwargs)], None)[0]
        outputs.append([out[local] for _, local in sorted(io.model_outputs)])
    changed = []
    for k, fn in enumerate(passes):
        errors = [_error(x, ref) for x, ref in zip(outputs[k + 1], outputs[k]) if isinstance(ref, torch.Tensor)]
        worst = max(errors, default=0.0)
        if len(outputs[k + 1]) != len(outputs[k]) or worst > (rtol if rtol is not None else 1e-4):
            changed.append(f"{pass_name(fn)!r} (outputs move by {worst:.3g} relative)")
    if changed:
        raise VerificationError(
            f"verify: the plan's outputs differ from the model you gave because its passes change what the model "
            f"computes: {', '.join(changed)}; if that is intended, verify(..., reference='graph') checks the split "
            f"against the model after the passes. Differences: {'; '.join(problems[:4])}",
            problems=tuple(problems))


def _reference_graph(model: nn.Module, args: Any, kwargs: Any, plan: Any, *,
                     passes: Sequence[Any]) -> tuple[torch.fx.GraphModule, nn.Module, Any]:
    """The model traced unsplit with ``passes`` (some or all of the user's; and the mixed-precision
    pass, as the plan ran it), as one stage GraphModule with real tensors, and its StageIO."""
    import functools

    from fxsplit.graph.pass_api import PassContext, PassManager
    from fxsplit.graph.trace import trace
    from fxsplit.pipeline.stage import build_stages

    c = plan.config
    gm = trace(model, args, kwargs, method=c.method, leaf_modules=c.leaf_modules, dynamic_sequence=c.dynamic_sequence,
               param_dtype=c.mp_policy.param_dtype if c.mp_policy is not None else None)
    passes = list(passes)
    if c.mp_policy is not None and c.mp_policy.param_dtype is not None:
        from fxsplit.passes.mixed_precision import mixed_precision

        passes.append(functools.partial(mixed_precision, param_dtype=c.mp_policy.param_dtype))
    if passes:
        ctx = PassContext(example_args=tuple(args), example_kwargs=dict(kwargs or {}),
                          options={"tp": 1, "pp": 1, "dp": 1})
        gm = PassManager(passes)(gm, ctx).graph_module
    compute = {n.name: 0 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")}
    stages = build_stages(gm, compute, num_stages=1)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ref = _OneStage(stages)
    return stages.modules[0], materialize_stage(ref, 0, tp_rank=0, source=model, device=device), stages.io[0]


@dataclass(frozen=True)
class _OneStage:
    """What :func:`materialize_stage` reads of a plan, for the unsplit reference (t = 1)."""

    stages: Any

    @property
    def tp_plan(self):
        from fxsplit.tp.plan import TPPlan

        return TPPlan.identity()


def _check_grads(plan: Any, stage_modules: Sequence[Sequence[nn.Module]], ref_grads: Mapping[str, Any],
                 rtol: float | None) -> tuple[list[str], float, int]:
    specs = plan.tp_plan.param_specs
    experts = set(plan.ep_plan.expert_params) if plan.config.ep > 1 else None
    group_of = {(s, name): k for k, group in enumerate(plan.stages.shared_params) for s, name in group}
    full: dict[Any, tuple[str, torch.Tensor | None]] = {}  # key (a tied group or (stage, name)) -> grad
    problems: list[str] = []
    for s, mods in enumerate(stage_modules):
        for name, p0 in mods[0].named_parameters():
            if not p0.requires_grad:
                continue
            grads = [dict(m.named_parameters())[name].grad for m in mods]
            if all(g is None for g in grads):
                g = None
            else:
                grads = [torch.zeros_like(dict(m.named_parameters())[name]) if g is None else g
                         for g, m in zip(grads, mods)]
                spec = specs.get(name)
                if experts is not None:  # ep ranks: experts in blocks, the rest each rank's slice's share
                    t = plan.config.tp  # lockstep rank e * t + r: per tp rank r, its ep ranks joined
                    grads = [torch.cat(grads[r::t]) if name in experts else torch.stack(grads[r::t]).sum(0)
                             for r in range(t)]
                if spec is not None:
                    shape = plan.tp_plan.full_shapes.get(name)
                    g = spec.unshard(grads, size=None if shape is None else shape[spec.dim])
                else:
                    g = grads[0]
                    for r, other in enumerate(grads[1:], 1):
                        ok, err = _ok(other, g, rtol)
                        if not ok:
                            problems.append(f"gradient of replicated {name!r} (stage {s}) differs between tp ranks "
                                            f"0 and {r}: relative error {err:.3g}")
            key = group_of.get((s, name), (s, name))
            if key in full and full[key][1] is not None and g is not None:
                full[key] = (name, full[key][1] + g)
            elif key not in full or full[key][1] is None:
                full[key] = (name, g)
    max_err = 0.0
    for key, (name, g) in full.items():
        ref = ref_grads.get(name)
        if ref is None and g is None:
            continue
        ref = torch.zeros_like(g) if ref is None else ref
        g = torch.zeros_like(ref) if g is None else g
        ok, err = _ok(g, ref, rtol)
        max_err = max(max_err, err)
        if not ok:
            problems.append(f"gradient of {name!r}: relative error {err:.3g}")
    return problems, max_err, len(full)


# ------------------------------------------------------------------------------------------------
# naming the first diverging node


def _partial_nodes(gm: torch.fx.GraphModule, sharded: Mapping[str, Any]) -> set[str]:
    """Nodes holding partial sums: inputs of a reducing collective, back to the sharded values."""
    out: set[str] = set()
    todo = [a for n in gm.graph.nodes if n.op == "call_function" and n.target in _REDUCING
            for a in n.all_input_nodes]
    while todo:
        n = todo.pop()
        if n.name in out or n.name in sharded or n.op not in ("call_function", "call_method", "call_module"):
            continue
        out.add(n.name)
        todo.extend(n.all_input_nodes)
    return out


def _gathered(per_rank: Sequence[torch.Tensor], dim: int, size: int, layouts: Sequence[tuple[int, ...]]):
    """Candidate full values of a sharded node: plain concatenation, and each block layout."""
    t = len(per_rank)
    full = torch.cat([v.detach() for v in per_rank], dim=dim)
    yield full.narrow(dim, 0, size) if 0 <= size < full.shape[dim] else full
    for blocks in layouts:
        if sum(blocks) != size or any(b % t for b in blocks) or per_rank[0].shape[dim] * t != size:
            continue
        pieces = [v.detach().split([b // t for b in blocks], dim=dim) for v in per_rank]
        yield torch.cat([pieces[r][i] for i in range(len(blocks)) for r in range(t)], dim=dim)


def _diverged(plan: Any, ref_gm: torch.fx.GraphModule, ref_vals: Mapping[str, list[Any]],
              vals: Sequence[Mapping[str, list[Any]]], problems: list[str], rtol: float | None) -> VerificationError:
    tp = plan.tp_plan
    layouts = sorted({s.blocks for s in tp.param_specs.values() if s.blocks is not None})
    ref_nodes = {n.name: n for n in ref_gm.graph.nodes}
    summary = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
    for s, gm in enumerate(plan.stages.modules):
        partial = _partial_nodes(gm, tp.sharded_nodes)
        for node in gm.graph.nodes:
            if node.op not in ("call_function", "call_method", "call_module") or node.name not in ref_vals:
                continue
            if node.name in partial or ref_nodes[node.name].op != node.op:
                continue
            ref, per_rank = ref_vals[node.name][0], vals[s][node.name]
            if not isinstance(ref, torch.Tensor) or not all(isinstance(v, torch.Tensor) for v in per_rank):
                continue
            if node.name in tp.sharded_nodes:
                dim, size = tp.sharded_nodes[node.name].dim, tp.sharded_nodes[node.name].size
                if ref.dim() == 0 or per_rank[0].dim() != ref.dim():
                    continue
                dim %= ref.dim()
                heads = getattr(tp, "merged", {}).get(node.name)  # [Note: heads merged as an inner factor]
                fulls = ([torch.cat([v.detach().unflatten(dim, (-1, heads // len(per_rank))) for v in per_rank],
                                    dim=dim + 1).flatten(dim, dim + 1)] if heads else
                         _gathered(per_rank, dim, size, layouts))
                errs = [_ok(full, ref, rtol) for full in fulls if tuple(full.shape) == tuple(ref.shape)]
                if not errs or any(ok for ok, _ in errs):
                    continue
                err, how = min(e for _, e in errs), f"gathered along dim {dim}"
            else:
                if any(tuple(v.shape) != tuple(ref.shape) for v in per_rank):
                    continue  # a local shape the plan does not record: not comparable
                checks = [_ok(v, ref, rtol) for v in per_rank]
                if all(ok for ok, _ in checks):
                    continue
                bad = [r for r, (ok, _) in enumerate(checks) if not ok]
                err, how = max(e for _, e in checks), f"replicated, wrong on tp rank(s) {bad}"
            info = node.meta.get("fxsplit")
            where = getattr(info, "module_path", None) or ""
            return VerificationError(
                f"verify: the split model diverges from the unsplit one ({summary}); the first node whose "
                f"value differs is {node.name!r} in stage {s}{f' (module {where!r})' if where else ''}: "
                f"relative error {err:.3g} ({how}; tolerance {rtol if rtol is not None else tolerance(ref.dtype):g}). "
                "Print plan.tp_plan and plan.stage_graph(s).code to see how it was sharded; a tp_plan override "
                "(e.g. {'<module path>': 'replicate'}) keeps a module whole",
                node=node.name, stage=s, problems=tuple(problems))
    return VerificationError(
        f"verify: the split model diverges from the unsplit one ({summary}), but every node's forward value "
        "agrees: the backward differs (a collective with a wrong backward, or a gradient not summed)",
        node=None, stage=None, problems=tuple(problems))
