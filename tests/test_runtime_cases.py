"""Hand-built pipeline stages for the runtime tests, and single-process runtime checks.

The stages are written by hand (not by `build_stages`) so that the runtime is tested on its own:
- ``gpt``: `fxsplit.testing.zoo.GPT` with tied ``wte``/``lm_head`` weights; stage 0 embeds, the last
  stage holds ``ln_f`` and computes the head with ``wte.weight`` (a shared-parameter group).
- ``skip``: `fxsplit.testing.zoo.SkipModel`; ``h0`` from stage 0 goes straight to the last stage (a skip
  connection over every stage in between), and the last stage reads the model input ``x`` too.
Boundary shapes are symbolic in the batch symbol ``b`` so unequal microbatches work.

`run_case` trains ``steps`` SGD steps through `PipelineRuntime` and compares the loss and every
gradient held by this rank with the unsplit model (float32); it returns a list of mismatch
strings (empty = pass) and the number of comparisons made.
"""

from __future__ import annotations

import math

import pytest
import sympy
import torch
import torch.nn.functional as Fn
from torch import nn

from fxsplit.testing import zoo
from fxsplit.runtime import PipelineRuntime, RuntimeOptions
from fxsplit.pipeline.rank_plan import RankPlan
from fxsplit.schedule import build
from fxsplit.pipeline.stage import StageIO, ValueMeta, ValueSource

b = sympy.Symbol("b", integer=True, positive=True)
RTOL, ATOL = 1e-5, 1e-6
T, V, C, D = 8, 32, 16, 16


def _layers_per_stage(n: int, S: int) -> list[list[int]]:
    return [list(range(n))[s * n // S:(s + 1) * n // S] for s in range(S)]


class GPTStage(nn.Module):
    def __init__(self, gpt: zoo.GPT, s: int, S: int, layers: list[int]):
        super().__init__()
        self.s, self.S = s, S
        if s == 0 or s == S - 1:
            self.wte = gpt.wte  # stage 0: embedding; last stage: the tied head weight
        if s == 0:
            self.wpe = gpt.wpe
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in layers})
        if s == S - 1:
            self.ln_f = gpt.ln_f

    def forward(self, x):
        if self.s == 0:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.wte(x) + self.wpe(pos)
        for blk in self.blocks.values():
            x = blk(x)
        if self.s == self.S - 1:
            return (Fn.linear(self.ln_f(x), self.wte.weight),)
        return (x,)


def gpt_model(seed: int = 0) -> zoo.GPT:
    torch.manual_seed(seed)
    cfg = zoo.GPTConfig(vocab_size=V, block_size=T, n_layer=8, n_head=2, n_embd=C)
    return zoo.GPT(cfg)


def gpt_stages(model: zoo.GPT, S: int):
    idx_meta = ValueMeta("idx", True, (b, T), torch.int64, False)
    h = ValueMeta("h", True, (b, T, C), torch.float32, True)
    logits = ValueMeta("logits", True, (b, T, V), torch.float32, True)
    mods, ios = [], []
    for s, layers in enumerate(_layers_per_stage(len(model.blocks), S)):
        last = s == S - 1
        mods.append(GPTStage(model, s, S, layers))
        ios.append(StageIO(
            index=s,
            inputs=(ValueSource(None, 0),) if s == 0 else (ValueSource(s - 1, 0),),
            input_meta=(idx_meta,) if s == 0 else (h,),
            outputs=(logits,) if last else (h,),
            consumers=((),) if last else ((s + 1,),),
            model_outputs=((0, 0),) if last else (),
            param_names=tuple(n for n, _ in mods[-1].named_parameters()),
        ))
    shared = (((0, "wte.weight"), (S - 1, "wte.weight")),) if S > 1 else ()
    return mods, ios, (idx_meta,), shared


def gpt_loss(logits, y):
    return Fn.cross_entropy(logits.reshape(-1, V), y.reshape(-1))


class SkipStage(nn.Module):
    def __init__(self, model: zoo.SkipModel, s: int, S: int, layers: list[int]):
        super().__init__()
        self.s, self.S = s, S
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        if s == S - 1:
            self.head = model.head

    def forward(self, *args):
        items = list(self.layers.items())
        if self.s == 0:
            (x,) = args
            h0 = torch.tanh(items[0][1](x))
            h = h0
            items = items[1:]
        elif self.s == self.S - 1:
            h, h0, x = args
        else:
            (h,) = args
        for _, layer in items:
            h = torch.tanh(layer(h))
        if self.s == self.S - 1:
            h = h + h0
            return (self.head(h) * x.shape[-1] ** -0.5,)
        return (h, h0) if self.s == 0 else (h,)


def skip_model(seed: int = 0) -> zoo.SkipModel:
    torch.manual_seed(seed)
    return zoo.SkipModel(dim=D, n_layer=8, out_dim=D)


def skip_stages(model: zoo.SkipModel, S: int):
    assert S >= 2
    x = ValueMeta("x", True, (b, D), torch.float32, False)
    h = ValueMeta("h", True, (b, D), torch.float32, True)
    h0 = ValueMeta("h0", True, (b, D), torch.float32, True)
    out = ValueMeta("out", True, (b, D), torch.float32, True)
    mods, ios = [], []
    for s, layers in enumerate(_layers_per_stage(len(model.layers), S)):
        mods.append(SkipStage(model, s, S, layers))
        if s == 0:
            io = dict(inputs=(ValueSource(None, 0),), input_meta=(x,), outputs=(h, h0),
                      consumers=((1,), (S - 1,)), model_outputs=())
        elif s == S - 1:
            io = dict(inputs=(ValueSource(s - 1, 0), ValueSource(0, 1), ValueSource(None, 0)),
                      input_meta=(h, h0, x), outputs=(out,), consumers=((),), model_outputs=((0, 0),))
        else:
            io = dict(inputs=(ValueSource(s - 1, 0),), input_meta=(h,), outputs=(h,),
                      consumers=((s + 1,),), model_outputs=())
        ios.append(StageIO(index=s, param_names=tuple(n for n, _ in mods[-1].named_parameters()), **io))
    return mods, ios, (x,), ()


def mse_loss(out, y):
    return Fn.mse_loss(out, y)


MODELS = {
    "gpt": (gpt_model, gpt_stages, gpt_loss),
    "skip": (skip_model, skip_stages, mse_loss),
}


def make_batch(name: str, batch: int, seed: int = 1, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    if name == "gpt":
        x, y = torch.randint(0, V, (batch, T), generator=g), torch.randint(0, V, (batch, T), generator=g)
    else:
        x, y = torch.randn(batch, D, generator=g), torch.randn(batch, D, generator=g)
    return (x.to(device),), y.to(device)


def graph_stages(model: nn.Module, name: str, S: int):
    """Trace ``model`` (dynamic batch) and cut it into ``S`` stages of equal compute-node count."""
    import fxsplit
    from fxsplit.pipeline.stage import build_stages

    (x,), _ = make_batch(name, 4, device=str(next(model.parameters()).device))
    gm = fxsplit.trace(model, (x,))
    compute = [n.name for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    return build_stages(gm, {n: i * S // len(compute) for i, n in enumerate(compute)}, S)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and torch.allclose(got, want, rtol=RTOL, atol=ATOL)


def run_case(*, model: str, schedule: str, p: int, v: int, m: int, batch: int, rank: int = 0,
             group=None, steps: int = 3, lr: float = 0.1, check_forward: bool = False,
             builder: str = "hand", device: str = "cpu", report: dict | None = None) -> tuple[list[str], int]:
    """Train ``steps`` steps through the pipeline and compare with the unsplit model.

    ``report``, when given, is filled with ``steps``, ``loss_checks`` and ``grad_checks`` (the
    number of loss and of gradient comparisons) and ``grad_params`` (the set of the model's parameter
    names whose gradients this rank compared), so that callers can check coverage."""
    make_model, make_stages, loss_fn = MODELS[model]
    S = p * v
    ref = make_model().to(device)
    pipe = make_model().to(device)  # same seed: same weights; stages reference its modules
    sched = build(schedule, p, m, v)
    if builder == "hand":
        mods, ios, input_meta, shared = make_stages(pipe, S)
        rp = RankPlan.build(ios, sched, rank=rank, num_ranks=p, input_meta=input_meta, shared_params=shared)
        rt = PipelineRuntime(rp, {s: mods[s] for s in range(S) if s % p == rank}, group=group, loss_fn=loss_fn,
                             device=device, timeout=60.0)
    else:  # fxsplit.trace + build_stages, even cuts over the compute nodes
        graphs = graph_stages(pipe, model, S)
        mods = graphs.modules
        rt = PipelineRuntime.from_stage_graphs(graphs, schedule=sched, pp_group=group, pp_rank=rank,
                                               num_ranks=p, loss_fn=loss_fn, device=device, timeout=60.0)
    io_all = ios if builder == "hand" else graphs.io
    reads = {src.index for s in range(S) if s % p == rank for src in io_all[s].inputs if src.stage is None}
    canonical = {id(prm): n for n, prm in pipe.named_parameters()}  # tied: one name per object
    mine = {canonical[id(prm)]: prm for s in range(S) if s % p == rank for prm in mods[s].parameters()}
    ref_params = dict(ref.named_parameters())
    tag = f"{model} {schedule} p={p} v={v} m={m} B={batch} rank={rank} {builder}"
    bad: list[str] = []
    checks = loss_checks = grad_checks = 0
    compared: set[str] = set()
    for step in range(steps):
        inputs, target = make_batch(model, batch, seed=step + 1, device=device)
        for prm in list(ref.parameters()) + list(pipe.parameters()):
            prm.grad = None
        want_loss = loss_fn(ref(*inputs), target)
        want_loss.backward()
        # model inputs this rank's stages never read: meta tensors (shapes only, no data)
        given = tuple(x if i in reads else torch.empty_like(x, device="meta") for i, x in enumerate(inputs))
        got_loss = rt.step(given, target=target if rank == (S - 1) % p else None)
        checks += 1
        loss_checks += 1
        if not math.isclose(got_loss.item(), want_loss.item(), rel_tol=RTOL, abs_tol=ATOL):
            bad.append(f"{tag} step {step}: loss {got_loss.item()} != {want_loss.item()}")
        for name, prm in mine.items():
            checks += 1
            grad_checks += 1
            compared.add(name)
            want = ref_params[name].grad
            if prm.grad is None or not _close(prm.grad, want):
                err = "None" if prm.grad is None else f"max err {(prm.grad - want).abs().max().item():.3g}"
                bad.append(f"{tag} step {step}: grad {name} differs ({err})")
        with torch.no_grad():
            for prm in ref.parameters():
                prm -= lr * prm.grad
            for prm in {id(q): q for q in mine.values()}.values():
                prm -= lr * prm.grad
    if check_forward:
        inputs, _ = make_batch(model, batch, seed=99, device=device)
        with torch.no_grad():
            want = ref(*inputs)
        got = rt.forward(inputs)
        checks += 1
        if rank == (S - 1) % p:
            got = got if builder == "graph" else got[0]  # output_spec rebuilds the model's output
            if not _close(got, want):
                bad.append(f"{tag}: forward() output differs from the model")
        elif got is not None:
            bad.append(f"{tag}: forward() returned outputs on a rank without the last stage")
        everywhere = rt.forward(inputs, all_ranks=True)
        everywhere = everywhere if builder == "graph" else everywhere[0]
        checks += 1
        if not _close(everywhere, want):
            bad.append(f"{tag}: forward(all_ranks=True) output differs from the model")
    if report is not None:
        report.update(steps=steps, loss_checks=loss_checks, grad_checks=grad_checks, grad_params=compared)
    return bad, checks


# ---------------------------------------------------------------------------------------------
# Single process: all stages on one rank (every message is local), no process group.
# ---------------------------------------------------------------------------------------------


def test_single_process_matches_model_for_each_schedule():
    bad, checks = [], 0
    for model in ("gpt", "skip"):
        for schedule, v, m, batch in (("gpipe", 2, 3, 7), ("1f1b", 3, 2, 5),
                                      ("interleaved_1f1b", 2, 4, 9), ("zb_h1", 1, 2, 4)):
            if model == "skip" and v == 1:
                v = 2  # the skip model's stage layout needs two stages
                schedule = "gpipe"
            got_bad, n = run_case(model=model, schedule=schedule, p=1, v=v, m=m, batch=batch,
                                  steps=2, check_forward=True)
            bad += got_bad
            checks += n
        got_bad, n = run_case(model=model, schedule="interleaved_1f1b", p=1, v=3, m=3, batch=5,
                              steps=1, check_forward=True, builder="graph")
        bad += got_bad
        checks += n
    assert not bad, "\n".join(bad)
    assert checks > 50


def test_errors_name_the_problem():
    mods, ios, meta, _ = skip_stages(skip_model(), 2)
    rp = RankPlan.build(ios, build("gpipe", 1, 2, 2), rank=0, num_ranks=1, input_meta=meta)
    rt = PipelineRuntime(rp, {0: mods[0], 1: mods[1]}, group=None, loss_fn=mse_loss, device="cpu")
    x, y = make_batch("skip", 4)
    with pytest.raises(ValueError, match=r"stage 0 reads model input 0 \(x\) but this rank was given a meta"):
        rt.step((torch.empty(4, D, device="meta"),), target=y)
    with pytest.raises(ValueError, match="holds the last stage and needs the target"):
        rt.step(x)
    with pytest.raises(ValueError, match="traced with size 16"):
        rt.step((torch.randn(4, D + 1),), target=y)
    with pytest.raises(ValueError, match="was given stages \\[0\\] but holds stages \\[0, 1\\]"):
        PipelineRuntime(rp, {0: mods[0]}, group=None, loss_fn=mse_loss, device="cpu")
    # after the errors the runtime still works (no process group to abort here)
    loss = rt.step(x, target=y)
    assert loss.item() == pytest.approx(mse_loss(skip_model()(x[0]), y).item(), rel=1e-5)


def test_a_microbatch_is_followed_by_the_step_each_action_gets():
    """Every action of one call receives that call's Step (its microbatches, what F saved, the
    loss); the runtime keeps none of it once the call returns, and options come whole or as keywords."""
    mods, ios, meta, _ = skip_stages(skip_model(), 2)
    rp = RankPlan.build(ios, build("gpipe", 1, 3, 2), rank=0, num_ranks=1, input_meta=meta)
    rt = PipelineRuntime(rp, {0: mods[0], 1: mods[1]}, RuntimeOptions(group=None, loss_fn=mse_loss, device="cpu"))
    x, y = make_batch("skip", 6)
    seen = []

    def before(step, action):
        seen.append((step, str(action), len(step.inputs.inputs), sorted(step.saved)))

    with rt.probe(before=before):
        rt.step(x, target=y)
        rt.forward(x)
    steps = {id(s) for s, *_ in seen}  # the steps are alive in ``seen``: their ids differ
    assert len(steps) == 2, seen  # one Step per call, shared by all its actions
    train = [row for row in seen if row[0] is seen[0][0]]
    assert seen[0][0].training and not seen[-1][0].training and seen[0][0].saved == {}
    assert [a for _, a, _, _ in train] == [str(a.action) for a in rp.train.actions]
    assert all(n == 3 for _, _, n, _ in train)
    # B of microbatch 0 on stage 1 finds what the F actions before it saved, on the step
    b0 = next(row for row in train if row[1] == "1B0")
    assert (1, 0) in b0[3] and (0, 0) in b0[3]
    held = [k for k, v in vars(rt).items() if isinstance(v, (torch.Tensor, dict)) and k not in
            ("modules", "runners", "_shape_cache", "_binding_cache", "_channels")]
    assert held == [], held
    with pytest.raises(ValueError, match="not both"):
        PipelineRuntime(rp, {0: mods[0], 1: mods[1]}, RuntimeOptions(group=None, loss_fn=mse_loss, device="cpu"),
                        timeout=5.0)
