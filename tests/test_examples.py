"""The examples run as documented: quickstart, hf_llama, train_llama and train_packed_text on 4 gloo processes
(their own check against one process decides the exit status), inspect_plan on a shallow meta
Llama, and examples/custom_pass.py on launched ranks (its pass given to ``fxsplit.parallelize(passes=...)``).

Launching: the documented command, ``torchrun --nproc-per-node=4 examples/X.py``, runs for the
quickstart (the process group from torchrun's environment, ``fxsplit.runtime.mesh.init_from_env``).
The other runs, train_llama's, first_steps' and custom_pass's included (their torchrun launches
added interpreter start-up over the quickstart's, not a path of their own), run on the ranks of
``fxsplit.testing.run_distributed`` (the group already set up; its ranks fork from a server that
imported torch, fxsplit and transformers once): the script's ``main(argv)``, or the whole file as
``python X.py`` runs it (``__name__ == "__main__"``, its ``sys.exit`` status kept) for the
scripts the README and their docstrings launch as files. Four fresh interpreters per torchrun
launch cost about 8 CPU-s each of start-up, which is what these runs would add, not coverage."""

import argparse
import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fxsplit.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
STEP_LINE = re.compile(r"^step (\d+): loss fxsplit (\S+)  single (\S+)$", re.M)


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def _torchrun(script, *args, nproc=4, timeout=240, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(EXAMPLES / script), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**_env(), **(env or {})},
                          cwd=ROOT)
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    return done.stdout


def _example_module(script):
    """examples/``script``, imported once per process under its own name (``main`` not run)."""
    name = "fxsplit_example_" + Path(script).stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _main_on_rank(rank, world, script, argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = _example_module(script).main(argv)
    return code, out.getvalue()


def _script_on_rank(rank, world, script, argv):
    """examples/``script`` run whole, as ``python script argv`` would run it on this rank: its exit
    status (``sys.exit``'s, 0 when it ends normally) and what it printed."""
    import runpy

    out, saved = io.StringIO(), sys.argv
    sys.argv = [str(EXAMPLES / script), *argv]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(EXAMPLES / script), run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = saved
    return code, out.getvalue()


def _launched(script, *args, nproc=4, timeout=240, as_file=False):
    """``script``'s ``main(args)`` (``as_file``: the whole file as ``__main__``) on ``nproc`` gloo
    ranks (see the module docstring); every rank must return 0; returns rank 0's printed output
    (the examples print on rank 0)."""
    runner = _script_on_rank if as_file else _main_on_rank
    results = run_distributed(runner, nproc, script, list(args), timeout=timeout)
    assert [code for code, _ in results] == [0] * nproc, results
    return results[0][1]


def _check_steps(out, steps):
    found = STEP_LINE.findall(out)
    assert [int(i) for i, _, _ in found] == list(range(steps)), out
    for _, a, b in found:  # the example checks 1e-4 itself; hold it to float32 here
        assert float(a) == pytest.approx(float(b), rel=1e-5), out
    assert "OK: largest relative loss difference" in out, out


@pytest.mark.dist
def test_quickstart_tp2_pp2_interleaved():
    # as `make demo` runs it, with no GPU visible: on a host with fewer GPUs than its 4 processes
    # the backend falls back to gloo on the CPU (fxsplit.runtime.mesh.choose_backend)
    out = _torchrun("quickstart.py", "--steps", "3", "--quiet", env={"CUDA_VISIBLE_DEVICES": ""})
    _check_steps(out, 3)
    assert "dp=1 tp=2 pp=2 interleaved_1f1b" in out


@pytest.mark.dist
def test_quickstart_dp2_pp2_each_replica_its_rows():
    out = _launched("quickstart.py", "--tp", "1", "--dp", "2", "--steps", "2")
    _check_steps(out, 2)
    assert "fxsplit plan: dp=2 tp=1 pp=2 (world size 4)" in out  # the plan is printed without --quiet


@pytest.mark.dist
@pytest.mark.hf
def test_hf_llama_tp2_pp2():
    pytest.importorskip("transformers", reason="hf_llama needs transformers")
    out = _launched("hf_llama.py", "--steps", "2", "--quiet")
    _check_steps(out, 2)
    assert "LlamaForCausalLM, dp=1 tp=2 pp=2" in out


PACKED_LINE = re.compile(r"^step (\d+): length (\d+), (\d+) documents, loss fxsplit (\S+)  single (\S+) ", re.M)


@pytest.mark.dist
@pytest.mark.hf
def test_train_packed_text_changing_lengths():
    """examples/train_packed_text.py at tp=2 x pp=2: standard-library source packed into rows, the
    row length changing between steps on one plan, each step's loss equal to one process's."""
    pytest.importorskip("transformers", reason="train_packed_text needs transformers")
    # --files 3: a corpus of a few kB still packs several documents into a row; the default 40
    # files cost every rank 5 CPU-s of parsing, more than the three steps themselves
    out = _launched("train_packed_text.py", "--steps", "3", "--seq-len", "64", "--batch-size", "4", "--files", "3")
    found = PACKED_LINE.findall(out)
    assert [(int(i), int(t)) for i, t, _, _, _ in found] == [(0, 64), (1, 48), (2, 32)], out
    assert any(int(n) > 1 for _, _, n, _, _ in found), out  # rows that hold several documents
    for *_, a, b in found:
        assert float(a) == pytest.approx(float(b), rel=1e-5), out
    assert "OK: largest relative loss difference" in out, out


TRAIN_LINE = re.compile(r"^step (\d+) \| loss (\S+) \| lr (\S+) \| grad norm (\S+) \| \d+ tokens/s \| \S+ s \| "
                        r"bubble \S+%$", re.M)


def _train_steps(out):
    return {int(i): (float(loss), float(lr), float(norm)) for i, loss, lr, norm in TRAIN_LINE.findall(out)}


@pytest.mark.dist
@pytest.mark.hf
def test_train_llama_saves_and_resumes(tmp_path):
    """examples/train_llama.py (AdamW, warmup + cosine, clipping, selective checkpointing) at
    tp=2 x pp=2: a run saved at step 2 and resumed continues exactly as the uninterrupted run
    (same losses, learning rates and gradient norms at steps 2 and 3: the state, the optimizer,
    the schedule and the data are all restored); resumed at dp=2 x pp=2 it continues within
    float32 rounding. In float32: under the example's default bf16 policy the two layouts round
    at different places (tp partial sums, each replica's half batch), which the 2e-2 this test
    needed there absorbed, and with it a resume that restored, say, the optimizer's moments wrongly (the bf16
    policy itself: tests/test_mixed_precision.py)."""
    pytest.importorskip("transformers", reason="train_llama needs transformers")
    common = ["--steps", "4", "--warmup", "2", "--layers", "2", "--precision", "fp32"]
    full = _train_steps(_launched("train_llama.py", *common, "--save", str(tmp_path), "--save-every", "2",
                                  timeout=400))
    assert sorted(full) == [0, 1, 2, 3], full
    assert full[1][1] > full[0][1] and full[3][1] < full[2][1]  # warmup, then cosine decay
    assert (tmp_path / "step-2" / "trainer.json").exists() and (tmp_path / "step-4").exists()
    resumed = _train_steps(_launched("train_llama.py", *common, "--resume", str(tmp_path / "step-2"), timeout=400))
    assert sorted(resumed) == [2, 3], resumed
    for i in (2, 3):
        assert resumed[i] == full[i], (i, resumed[i], full[i])
    other = _train_steps(_launched("train_llama.py", *common, "--tp", "1", "--dp", "2", "--resume",
                                   str(tmp_path / "step-2"), timeout=400))
    for i in (2, 3):
        assert other[i][1] == full[i][1]
        assert other[i][0] == pytest.approx(full[i][0], rel=1e-5), (i, other[i], full[i])  # the loss
        assert other[i][2] == pytest.approx(full[i][2], rel=1e-5), (i, other[i], full[i])  # the gradient norm


MOE_LINE = re.compile(r"^step (\d+) \| loss (\S+) \| .* \| expert rows min (\d+) / mean (\S+) / max (\d+) \| "
                      r"all-to-all \S+ s$", re.M)


@pytest.mark.dist
@pytest.mark.hf
def test_train_llama_moe_logs_the_expert_load():
    """examples/train_llama.py --experts 4 at dp=2 x ep=2 x pp=2: transformers' Mixtral with its experts
    placed by ep; step 0's loss is the unsplit model's on the whole batch, and each step's line
    carries the rows every expert received (min / mean / max): batch 16 x 32 tokens, top-2, 2 layers
    make 2048 rows over 4 experts, a mean of 512 whatever the routing."""
    pytest.importorskip("transformers", reason="train_llama needs transformers")
    module = _example_module("train_llama.py")
    argv = ["--experts", "4", "--tp", "1", "--dp", "2", "--ep", "2", "--pp", "2", "--steps", "2", "--warmup", "1",
            "--layers", "2", "--precision", "fp32", "--checkpointing", "none"]
    out = _launched("train_llama.py", *argv, timeout=400)
    found = {int(i): (float(loss), int(lo), float(mean), int(hi)) for i, loss, lo, mean, hi in MOE_LINE.findall(out)}
    assert sorted(found) == [0, 1], out
    for loss, lo, mean, hi in found.values():
        assert mean == 512.0 and lo <= mean <= hi, out
    args = module.parse_args(argv)
    model, _, _ = module.tiny_mixtral(num_hidden_layers=2, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                      vocab_size=args.vocab, num_local_experts=4, seed=0)
    x, y = module.batch(0, argparse.Namespace(**{**vars(args), "dp": 1}), 0)  # the whole global batch
    assert found[0][0] == pytest.approx(module.lm_loss(model(x), y).item(), rel=1e-5)


@pytest.mark.hf
def test_inspect_plan_shallow_meta_llama(tmp_path):
    pytest.importorskip("transformers", reason="inspect_plan needs transformers")
    png = tmp_path / "pp.png"
    # main(argv) in this process: the script's whole body but its `sys.exit(main())` line, without an
    # interpreter start-up that imports torch and transformers again
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = _example_module("inspect_plan.py").main(["--layers", "2", "--pp", "2", "--tp", "8", "--schedule",
                                                        "1f1b", "--seq-len", "256", "--timeline", str(png)])
    assert code == 0
    out = out.getvalue()
    assert "fxsplit plan: dp=1 tp=8 pp=2 (world size 16); 2 stages (v=1), 1f1b, m=4" in out
    # both layers in one row ([Note: a plan on one screen] in fxsplit/api/summary.py)
    assert "model.layers.0-1: q/k/v colwise, o rowwise, gate/up colwise, down rowwise" in out, out
    assert re.search(r"16 GPUs: planned in [0-9.]+s", out), out
    assert png.read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------------------------------------------------
# examples/custom_pass.py through parallelize(passes=...), run as a file on 2 launched ranks (its
# launched branch, as under its docstring's torchrun command)


@pytest.mark.dist
def test_custom_pass_on_launched_ranks_through_parallelize():
    out = _launched("custom_pass.py", nproc=2, as_file=True)
    assert re.search(r"gelu_to_tanh rewrote \['gelu(_\d+)?', 'gelu(_\d+)?'\]", out), out
    assert "rank 0's stages with tanh GELU in their code: [0]" in out, out
    found = STEP_LINE.findall(out)
    assert [int(i) for i, _, _ in found] == [0, 1], out
    for _, a, b in found:  # (tanh GELU moves these small-init logits by ~1e-6 only: the code check above
        assert float(a) == pytest.approx(float(b), rel=1e-5), out  # shows the pass ran inside parallelize)
    assert "OK: largest relative loss difference" in out, out


@pytest.mark.dist
def test_first_steps_from_the_readme_trains():
    """README's first example, the whole file on 4 launched ranks: three steps, a finite loss that falls."""
    out = _launched("first_steps.py", as_file=True)
    losses = [float(x) for x in re.findall(r"^step \d: loss (\S+)$", out, re.M)]
    assert len(losses) == 3 and losses[2] < losses[0], out
