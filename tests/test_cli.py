"""The ``fxsplit`` command line: plan a model file (table, DOT, PNG, per-pass dumps), the three
factory forms, ``--meta``, ``schedule``, and the errors (exit code 2 for usage, 1 for user code)."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fxsplit.cli import load_example, main, parse_size

MODEL_FILE = textwrap.dedent(
    """
    import torch
    from fxsplit.testing import zoo

    def gpt():
        return zoo.make("gpt", n_layer=2, seed=0)          # (model, args, kwargs)

    def mlp_pair():
        model, args, _ = zoo.make("mlp", sizes=(16, 32, 32, 32, 16))
        return model, args                                 # (model, args)

    def bare():
        torch.manual_seed(0)
        return zoo.MLP((16, 32, 16))                       # a model; inputs from example_inputs()

    def example_inputs():
        return torch.randn(4, 16)

    def broken():
        raise RuntimeError("the user's factory is broken")

    def not_a_model():
        return 42

    def empty():                                           # an example of 0 samples
        return zoo.MLP((16, 32, 16)), (torch.randn(0, 16),)

    class NotUsed:
        pass

    def tag_outputs(gm, ctx):                              # a user pass for --pass
        from fxsplit.graph.pass_api import PassResult
        ctx.report["tag_outputs"] = len(gm.graph.find_nodes(op="output"))
        return PassResult(gm, False)
    """
)

KWARGS_FILE = textwrap.dedent(
    """
    import torch
    from fxsplit.testing import zoo

    def build():
        return zoo.make("kwargs", n_layer=2)[0]

    def example_inputs():
        _, args, kwargs = zoo.make("kwargs", n_layer=2)
        return args, kwargs
    """
)


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(MODEL_FILE)
    return path


def test_plan_prints_plan_and_writes_dot_png_and_dumps(model_file, tmp_path, capsys):
    dot, png, dumps = tmp_path / "g.dot", tmp_path / "pp.png", tmp_path / "dumps"
    rc = main(["plan", f"{model_file}:gpt", "--tp", "2", "--pp", "2", "--schedule", "1f1b", "--grid",
               "--dot", str(dot), "--timeline", str(png), "--debug-dir", str(dumps)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "fxsplit plan: dp=1 tp=2 pp=2 (world size 4); 2 stages (v=1), 1f1b, m=4" in out
    assert re.search(r"  blocks\.0(-\d+)?: .*colwise.*rowwise", out), out  # the TP plan, layers folded
    assert "SplitPlan: 2 stages on 2 ranks" in out                            # the stage table
    assert "rank 1 |" in out and "1B3" in out                                  # --grid
    assert dot.read_text().lstrip().startswith("digraph")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (dumps / "summary.txt").is_file()
    tp_dump = dumps / "00_tensor_parallel"
    assert (tp_dump / "before.py").read_text() != (tp_dump / "after.py").read_text()


def test_factory_forms_and_meta(model_file, tmp_path):
    model, args, kwargs = load_example(f"{model_file}:mlp_pair")
    assert isinstance(model, torch.nn.Module) and len(args) == 1 and kwargs == {}
    model, args, kwargs = load_example(f"{model_file}:bare")
    assert tuple(args[0].shape) == (4, 16) and kwargs == {}
    assert model(*args).shape == (4, 16)
    model, args, kwargs = load_example(f"{model_file}:bare", meta=True)
    assert all(p.is_meta for p in model.parameters()) and args[0].is_meta
    kw = tmp_path / "kw_model.py"
    kw.write_text(KWARGS_FILE)
    model, args, kwargs = load_example(f"{kw}:build")
    assert set(kwargs) == {"attention_mask", "position_ids", "scale"} and len(args) == 1
    model(*args, **kwargs)  # the split of (args, kwargs) is the one the model takes


def test_plan_options_split_points_meta_and_memory(model_file, capsys):
    rc = main(["plan", f"{model_file}:mlp_pair", "--pp", "2", "--schedule", "gpipe", "--microbatches", "2",
               "--split-points", "layers.2", "--meta", "--memory-limit", "1GiB", "--method", "fx"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "(user split points)" in out and "gpipe, m=2" in out
    stage_rows = [line.split() for line in out.splitlines() if line.startswith("    ")]
    assert [row[:3] for row in stage_rows] == [["0", "0", "layers.0,"], ["1", "1", "layers.2,"]], out


@pytest.mark.parametrize(
    "argv, code, message",
    [
        (["plan", "--tp", "2"], 2, "FILE.py:FACTORY"),
        (["plan", "{dir}/missing.py:gpt"], 2, "does not exist"),
        (["plan", "{file}:nope"], 2,
         "callables defined there: NotUsed, bare, broken, empty, example_inputs, gpt, mlp_pair, not_a_model, "
         "tag_outputs"),
        (["plan", "{file}"], 2, "write {file}:NAME"),
        (["plan", "no_such_module_xyz:f"], 2, "neither a file nor an importable module"),
        (["plan", "{file}:not_a_model"], 2, "returned a value of type int; it must return (model, example_args"),
        (["plan", "{file}:broken"], 1, "the user's factory is broken"),
        (["plan", "{file}:mlp_pair", "--pp", "0"], 2, "a degree or count must be >= 1"),
        (["plan", "{file}:mlp_pair", "--pp", "2", "--microbatches", "1"], 2, "microbatches=1 < pp=2"),
        (["plan", "{file}:mlp_pair", "--memory-limit", "80XB"], 2, "is not a size"),
        (["plan", "{file}:mlp_pair", "--pp", "2", "--schedule", "1f1b", "--memory-limit", "1KB"], 2, "memory"),
        (["plan", "{file}:gpt", "--tp", "3"], 2, "which t=3 does not divide"),
        (["schedule", "no_such_schedule", "--pp", "2", "--microbatches", "2"], 2, "valid names: gpipe, 1f1b"),
        # usage errors: exit 2 and one line naming the problem, never a traceback
        (["plan", "{file}:mlp_pair", "--hardware", "tpu-v9"], 2,
         "argument --hardware: Hardware.preset: unknown name 'tpu-v9'; presets: a100-80gb, h100-hbm2e, h100-sxm"),
        (["plan", "{file}:mlp_pair", "--auto", "--world-size", "8", "--global-batch", "64", "--hardware", "x"], 2,
         "unknown name 'x'"),
        (["plan", "{file}:mlp_pair", "--tp", "two"], 2, "argument --tp: 'two' is not an integer"),
        (["plan", "{file}:mlp_pair", "--pp", "-1"], 2, "a degree or count must be >= 1"),
        (["plan", "{file}:mlp_pair", "--schedule", "no_such"], 2, "argument --schedule: invalid choice: 'no_such'"),
        (["plan", "{file}:mlp_pair", "--method", "jit"], 2, "argument --method: invalid choice: 'jit'"),
        (["plan", "{file}:mlp_pair", "--split-points", ","], 2, "--split-points needs module paths"),
        (["plan", "{file}:mlp_pair", "--pp", "2", "--split-points", "no.such"], 2, "no.such"),
        (["plan", "{file}:mlp_pair", "--auto"], 2, "--auto needs --world-size N and --global-batch B"),
        (["plan", "{file}:mlp_pair", "--dot", "{dir}/no_such_dir/g.dot"], 2, "No such file or directory"),
        (["plan", "{file}:empty"], 2, "the example has 0 samples: example_args[0] has shape (0, 16)"),
        (["plan", "{file}:not_a_model"], 2, "must return (model, example_args"),
        (["schedule", "zbv", "--pp", "2", "--microbatches", "4", "--stages-per-rank", "3"], 2,
         "zbv places exactly 2 stages per rank"),
        (["schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--forward", "-1"], 2, "a cost must be >= 0"),
        (["schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--timeline", "{dir}/no_such_dir/t.png"], 2,
         "No such file or directory"),
        (["frobnicate"], 2, "invalid choice: 'frobnicate'"),
    ],
)
def test_errors_name_the_problem(model_file, argv, code, message, capsys):
    fill = dict(file=str(model_file), dir=str(model_file.parent))
    rc = main([a.format(**fill) for a in argv])
    err = capsys.readouterr().err
    assert rc == code, err
    assert message.format(**fill) in err, err
    if code == 2:  # a usage error is one line (after argparse's usage text), never a traceback
        assert "Traceback" not in err, err
        assert len([line for line in err.splitlines() if "error:" in line]) == 1, err


def test_hardware_preset_sets_the_plan_hardware(model_file, capsys):
    rc = main(["plan", f"{model_file}:mlp_pair", "--pp", "2", "--hardware", "h100-sxm", "--link-bandwidth", "1GB"])
    assert rc == 0, capsys.readouterr().err
    from fxsplit.cli import build_parser

    ns = build_parser().parse_args(["plan", "f.py:g", "--hardware", "H100-SXM"])
    assert ns.hardware.name == "h100-sxm"


def test_user_pass_and_debug_dir(model_file, tmp_path, capsys):
    dumps = tmp_path / "dumps"
    rc = main(["plan", f"{model_file}:mlp_pair", "--pass", f"{model_file}:tag_outputs", "--debug-dir", str(dumps)])
    assert rc == 0, capsys.readouterr().err
    assert (dumps / "00_tag_outputs" / "after.py").is_file() and (dumps / "summary.txt").is_file()
    # with no user pass and tp=1 the pipeline split pass still runs through the PassManager
    rc = main(["plan", f"{model_file}:mlp_pair", "--debug-dir", str(tmp_path / "split")])
    assert rc == 0, capsys.readouterr().err
    assert (tmp_path / "split" / "00_pipeline_split" / "before.py").is_file()
    assert (dumps / "01_pipeline_split").is_dir()


def test_import_error_in_the_file_is_exit_1(tmp_path, capsys):
    path = tmp_path / "bad.py"
    path.write_text("import no_such_package_xyz\n")
    assert main(["plan", f"{path}:f"]) == 1
    err = capsys.readouterr().err
    assert "importing" in err and "No module named 'no_such_package_xyz'" in err


def test_bare_model_without_example_inputs(tmp_path, capsys):
    path = tmp_path / "lonely.py"
    path.write_text("from fxsplit.testing import zoo\n\ndef build():\n    return zoo.MLP()\n")
    assert main(["plan", f"{path}:build"]) == 2
    assert "defines no example_inputs()" in capsys.readouterr().err


def test_schedule_command_prints_grid_and_simulation(tmp_path, capsys):
    png = tmp_path / "s.png"
    rc = main(["schedule", "interleaved_1f1b", "--pp", "4", "--microbatches", "8", "--stages-per-rank", "2",
               "--timeline", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "interleaved_1f1b: p=4 v=2 m=8; 8 stages" in out
    assert out.count("rank ") >= 4 and "7B7" in out
    assert "makespan 28.5" in out  # golden: the simulator for p=4 v=2 m=8, F=1 B=2 (per stage F/v, B/v)
    assert png.read_bytes()[:4] == b"\x89PNG"
    rc = main(["schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--forward", "1", "--backward", "1"])
    assert rc == 0 and "makespan 6" in capsys.readouterr().out  # 2(m + p - 1) with F = B = 1


def test_parse_size():
    assert parse_size("80GB") == 80e9
    assert parse_size("80GiB") == 80 * 2**30
    assert parse_size("512 mb") == 512e6
    assert parse_size("1e9") == 1e9
    with pytest.raises(Exception, match="not a size"):
        parse_size("lots")


def test_python_dash_m_entry_point(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "fxsplit", "schedule", "gpipe", "--pp", "2", "--microbatches", "2"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "gpipe: p=2 v=1 m=2" in done.stdout
    # the exit code of a usage error reaches the shell, with one line and no traceback
    done = subprocess.run([sys.executable, "-m", "fxsplit", "plan", "x.py:f", "--hardware", "tpu-v9"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr
    assert "unknown name 'tpu-v9'" in done.stderr and "Traceback" not in done.stderr


def test_plan_parallelism_flags_reach_the_plan(model_file, capsys, monkeypatch):
    """--dp, --sequence-parallel, --vocab-parallel-loss and --link-bandwidth on `plan`: each one's
    value in the ParallelConfig planned, and in the printed plan where it shows."""
    import fxsplit.api

    configs = []
    inner = fxsplit.api.plan
    monkeypatch.setattr(fxsplit.api, "plan", lambda *a, **k: configs.append(k["config"]) or inner(*a, **k))
    rc = main(["plan", f"{model_file}:gpt", "--dp", "2", "--tp", "2", "--sequence-parallel", "--vocab-parallel-loss",
               "--link-bandwidth", "3GB"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    (config,) = configs
    assert (config.dp, config.tp, config.sequence_parallel, config.vocab_parallel_loss) == (2, 2, True, True), config
    assert config.hardware.link_bytes_per_s == 3e9, config.hardware
    assert "fxsplit plan: dp=2 tp=2 pp=1 (world size 4)" in out.out, out.out
    assert "sequence parallel, vocabulary-parallel loss" in out.out, out.out
    assert main(["plan", f"{model_file}:gpt", "--tp", "2"]) == 0  # and without them: the defaults
    assert (configs[1].dp, configs[1].sequence_parallel, configs[1].vocab_parallel_loss) == (1, False, False)
    tp_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("tensor parallel t=2"))
    assert "sequence parallel" not in tp_line and "vocabulary-parallel loss" not in tp_line, tp_line


def test_plan_cp_flag_reaches_the_plan_and_its_print(model_file, capsys):
    assert main(["plan", f"{model_file}:gpt", "--cp", "2", "--dp", "2", "--cp-kv", "ring"]) == 0
    out = capsys.readouterr().out
    assert "fxsplit plan: dp=2 cp=2 tp=1 pp=1 (world size 4)" in out, out
    assert "context parallel cp=2" in out and "by all-gather in 0 of" in out and "cp_kv='ring'" in out, out


def test_schedule_comm_cost_reaches_the_simulation(capsys):
    from fxsplit import schedule as schedules

    rc = main(["schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--forward", "1", "--backward", "1",
               "--comm", "0.5"])
    out = capsys.readouterr().out
    want = schedules.simulate(schedules.build("1f1b", 2, 2), forward=1, backward=1, comm=0.5)
    free = schedules.simulate(schedules.build("1f1b", 2, 2), forward=1, backward=1, comm=0.0)
    assert rc == 0 and want.makespan > free.makespan, (want.makespan, free.makespan)
    assert "comm=0.5" in out and f"makespan {want.makespan:g};" in out, out


def test_installed_console_script(tmp_path):
    """The `fxsplit` command pip installs next to this interpreter (pyproject's [project.scripts])."""
    script = Path(sys.executable).parent / "fxsplit"
    assert script.exists(), f"{script} missing: install the package (make install / pip install -e .)"
    done = subprocess.run([str(script), "schedule", "gpipe", "--pp", "2", "--microbatches", "2"], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "gpipe: p=2 v=1 m=2" in done.stdout, done.stdout
