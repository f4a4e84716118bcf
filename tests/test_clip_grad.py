"""ParallelModel.clip_grad_norm_: the norm of the whole model's gradient over dp x tp x pp, each
parameter counted once ([Note: counting each parameter once] in fxsplit.api.grad_norm), equal to
torch.nn.utils.clip_grad_norm_ on the unsplit model, and the clipped training equal to it too."""

import math

import pytest
import torch

import fxsplit
from fxsplit.api.grad_norm import check_norm_type, global_norm, norm_parameters, scale_grads
from fxsplit.testing import run_distributed, zoo
from fxsplit.testing.trace_cache import SharedPlans, SharedTraces, shared_plans, shared_traces

INF = float("inf")
STEPS = 3
BATCH = 4
MAX_NORM = 0.5  # the zoo GPT's gradient norm is about 1.4 to 1.8 in these steps: clipping happens
LAYOUTS = {
    "tp2-pp2": (dict(tp=2, pp=2, microbatches=2), "sgd"),
    "dp2-pp2": (dict(dp=2, pp=2, microbatches=2), "adamw"),
    "dp2-tp2": (dict(dp=2, tp=2), "sgd"),
    # sequence parallelism: the graph itself sums the replicated parameters' gradients over tp
    "tp2-pp2-sp": (dict(tp=2, pp=2, microbatches=2, sequence_parallel=True), "sgd"),
}


# ------------------------------------------------------------------------------------------
# one process: which rank counts what


def _canonical(model):
    first = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    return {name: first[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("options", [dict(tp=2, pp=2, microbatches=2),
                                     dict(tp=2, pp=2, microbatches=4, schedule="interleaved_1f1b")])
def test_every_parameter_is_counted_once_over_the_mesh(options):
    model, args, _ = zoo.make("gpt", batch_size=BATCH)
    plan = fxsplit.plan(model, args, **options)
    c = plan.config
    specs = plan.tp_plan.param_specs
    canonical = _canonical(model)
    counts: dict[str, int] = {}
    for dp in range(2):
        for pp in range(c.pp):
            stages = {s: plan.stages.modules[s] for s in range(c.num_stages) if s % c.pp == pp}
            for tp in range(c.tp):
                params = norm_parameters(stages, shared_params=plan.stages.shared_params, sharded=specs,
                                         coords={"dp": dp, "pp": pp, "tp": tp})
                names = {id(p): n for m in stages.values() for n, p in m.named_parameters()}
                for p in params:
                    counts[canonical[names[id(p)]]] = counts.get(canonical[names[id(p)]], 0) + 1
    assert plan.stages.shared_params, "the tied embedding / LM head spans two stages"
    expected = {n: (c.tp if n in specs else 1) for n in set(canonical.values())}
    assert counts == expected
    assert any(n not in specs for n in expected) and any(n in specs for n in expected)


def test_global_norm_and_scale_match_torch_in_one_process():
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.zeros(s)) for s in [(3, 4), (5,), (2, 2, 2)]]
    for norm_type in (2.0, 1.0, 3.0, INF, "inf"):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        ref = [p.grad.clone() for p in ps]
        want = torch.nn.utils.clip_grad_norm_([_with_grad(r) for r in ref], 0.3, norm_type=norm_type)
        total = global_norm([p.grad for p in ps], norm_type, group=None)
        assert total.dtype == torch.float32
        torch.testing.assert_close(total, want, rtol=1e-6, atol=0)
        scale_grads(ps, 0.3, total)
        for p, r in zip(ps, ref):
            torch.testing.assert_close(p.grad, r * min(1.0, 0.3 / (float(want) + 1e-6)), rtol=1e-6, atol=0)
    assert float(global_norm([], 2.0, group=None)) == 0.0
    for bad in (0, -1.0, "two", None):
        with pytest.raises(ValueError, match="norm_type"):
            check_norm_type(bad)


def _with_grad(grad):
    p = torch.nn.Parameter(torch.zeros_like(grad))
    p.grad = grad.clone()
    return p


# ------------------------------------------------------------------------------------------
# gloo, 4 ranks: dp x tp x pp against the unsplit model


def _data(i):
    g = torch.Generator().manual_seed(200 + i)
    V = zoo.GPTConfig().vocab_size
    return torch.randint(0, V, (BATCH, 16), generator=g), torch.randint(0, V, (BATCH, 16), generator=g)


def _optimizer(kind, params):
    return torch.optim.SGD(params, lr=0.5) if kind == "sgd" else torch.optim.AdamW(params, lr=1e-2)


def _clip_steps(step, clip, optimizer):
    """Per step: (inf norm, 1-norm, 2-norm before clipping, 2-norm after) around clip(0.5)."""
    out = []
    for i in range(STEPS):
        x, y = _data(i)
        step(x, y)
        norms = (clip(1e9, INF), clip(1e9, 1.0), clip(MAX_NORM, 2.0), clip(1e9, 2.0))  # 1e9: scale by 1
        optimizer.step()
        optimizer.zero_grad()
        out.append(tuple(float(n) for n in norms))
    return out


# one model per launch, every layout planned from one trace, once, before the ranks fork ([Note:
# preparing once per launch] in fxsplit.testing.harness); each rank takes its copy of the plans
# ([Note: plans made before the fork] in fxsplit.testing.trace_cache), and rank 0 verifies the
# plan every rank takes ([Note: one model and trace per launch] in test_parallelize.py)
_MODEL: list = []
_TRACES = SharedTraces()
_PLANS = SharedPlans()
INF_LINK = fxsplit.Hardware(link_bytes_per_s=float("inf"))


def _example():
    if not _MODEL:
        _MODEL.append(zoo.make("gpt", batch_size=BATCH))
    return _MODEL[0]


def _prepare():
    model, args, _ = _example()
    with shared_traces(_TRACES):
        for opts, _ in LAYOUTS.values():
            _PLANS.add(model, args, hardware=INF_LINK, **opts)


def _train(rank, world, options, kind):
    torch.manual_seed(0)
    model, args, _ = _example()
    with shared_plans(_PLANS):
        pm = fxsplit.parallelize(model, args, loss_fn=zoo.loss_fn("gpt"), timeout=60, verify=None if rank == 0 else False,
                                 hardware=INF_LINK, **options)
    assert pm.plan.stages.shared_params or options.get("pp", 1) == 1
    d, dp = options.get("dp", 1), pm.coords["dp"]
    per = BATCH // d

    def step(x, y):  # each data-parallel replica its own slice of the batch
        pm.step(x[dp * per:(dp + 1) * per], target=y[dp * per:(dp + 1) * per])

    norms = _clip_steps(step, lambda m, p: pm.clip_grad_norm_(m, norm_type=p), _optimizer(kind, pm.parameters()))
    return norms, pm.full_state_dict()


def _all_layouts(rank, world):
    out = {label: _train(rank, world, dict(opts), kind) for label, (opts, kind) in LAYOUTS.items()}
    assert _PLANS.misses == 0, (f"rank {rank} planned {_PLANS.misses} layout(s) itself: "
                                "a plan made before the fork went unused")
    return out


def _reference(kind):
    model, _, _ = zoo.make("gpt", batch_size=BATCH)
    loss_fn = zoo.loss_fn("gpt")

    def step(x, y):
        loss_fn(model(x), y).backward()

    def clip(max_norm, p):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=p)

    norms = _clip_steps(step, clip, _optimizer(kind, model.parameters()))
    return norms, model.state_dict()


@pytest.mark.dist
def test_clip_grad_norm_matches_the_unsplit_model():
    results = run_distributed(_all_layouts, 4, timeout=400, prepare=(_prepare, ()))
    for label, (_, kind) in LAYOUTS.items():
        ref_norms, ref_state = _reference(kind)
        for n_inf, n1, n2, after in ref_norms:
            assert n2 > MAX_NORM and after == pytest.approx(MAX_NORM, rel=1e-5)  # clipping happened
        for rank, r in enumerate(results):
            norms, state = r[label]
            assert norms == results[0][label][0], f"{label}: rank {rank} got another norm than rank 0"
            for step, (got, want) in enumerate(zip(norms, ref_norms)):
                assert got == pytest.approx(want, rel=1e-5), f"{label} rank {rank} step {step}: (inf, 1, 2, after)"
            for k, v in ref_state.items():
                torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-5, msg=f"{label} rank {rank} {k}")
