"""Checkpoints that cannot lie ([Note: checkpoint layout] in fxsplit.api.checkpoint): a damaged
file or a NaN model raises a CheckpointError naming the tensor and its file on both load paths, a
failed save leaves the previous checkpoint in place, a resume with dropout continues bit for bit,
DCP's CheckpointException (a BaseException) arrives as an FxsplitError, and a checkpoint without
checksums (older) still loads.

One 2-rank run (tp=2, dropout) trains 2 steps, saves, trains 2 more and then fails two saves on
purpose; a second 2-rank run is refused the damaged copies, loads the good one and repeats steps
3 and 4 exactly."""

import glob
import io
import json
import os
import shutil
import zlib

import pytest
import torch

import fxsplit
from fxsplit.testing import run_distributed, zoo

GPT = dict(n_layer=2, dropout=0.2, attn_dropout=0.2, batch_size=4, seq_len=8)
V, B, T = 128, 4, 8
SHARD = "blocks.0.attn.q.weight/tp1of2"  # a tp shard (each tp rank writes its own)
REPLICATED = "ln_f.weight"  # replicated over tp: DCP stores one of the two copies


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def _model(torch_seed):
    torch.manual_seed(torch_seed)  # the RNG streams' default seed follows it ([Note: RNG streams])
    model, args, _ = zoo.make("gpt", **GPT)
    pm = fxsplit.parallelize(model, args, loss_fn=zoo.loss_fn("gpt"), tp=2, microbatches=2, timeout=60,
                             hardware=fxsplit.Hardware(link_bytes_per_s=float("inf")))
    return pm, torch.optim.Adam(pm.parameters(), lr=1e-2)


def _steps(pm, opt, n):
    losses = []
    for _ in range(n):
        x, y = _batch(pm.step_count)
        losses.append(pm.step(x, target=y).item())
        opt.step()
        opt.zero_grad()
    return losses


def _first(rank, world, ckpt, fresh):
    """2 steps, save, 2 steps; then two saves that fail after every file was written."""
    from fxsplit.api import checkpoint

    pm, opt = _model(torch_seed=1)
    _steps(pm, opt, 2)
    pm.save_checkpoint(ckpt, optimizer=opt)
    losses = _steps(pm, opt, 2)
    state = pm.full_state_dict()
    writer = checkpoint._writer_class()
    finish = writer.finish

    def fail_after_finish(self, metadata, results):  # the coordinator: .metadata is written, then it fails
        finish(self, metadata, results)
        raise OSError("disk full (injected)")

    writer.finish = fail_after_finish
    errors = []
    try:
        for path in (ckpt, fresh):
            try:
                pm.save_checkpoint(path, optimizer=opt)
                errors.append(None)
            except Exception as exc:  # noqa: BLE001 -- the test looks at its type and text
                errors.append((isinstance(exc, fxsplit.FxsplitError), type(exc).__name__, str(exc)))
    finally:
        writer.finish = finish
    return losses, state, errors


def _resume(rank, world, ckpt, damaged):
    pm, opt = _model(torch_seed=2)  # another default seed: the checkpoint's must win
    refused = {}
    for kind, path in damaged.items():
        try:
            pm.load_checkpoint(path, optimizer=opt)
            refused[kind] = None
        except fxsplit.FxsplitError as exc:
            refused[kind] = (type(exc).__name__, str(exc))
    pm.load_checkpoint(damaged["nan"], allow_nonfinite=True)
    nan_loaded = not all(torch.isfinite(p).all() for p in pm.parameters())
    pm.load_checkpoint(ckpt, optimizer=opt)
    step_count = pm.step_count
    losses = _steps(pm, opt, 2)
    return refused, nan_loaded, step_count, losses, pm.full_state_dict()


# -- editing a checkpoint's files, as a damaged disk or a diverged run would


def _chunk(ckpt, key):
    """(file path, offset of the tensor's raw bytes in it, the stored tensor) of ``key``'s only chunk."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(ckpt).read_metadata()
    (index, info), = [(i, s) for i, s in meta.storage_data.items() if i.fqn == key]
    file = os.path.join(ckpt, info.relative_path)
    with open(file, "rb") as f:
        f.seek(info.offset)
        blob = f.read(info.length)
    tensor = torch.load(io.BytesIO(blob), weights_only=True)  # DCP stores each chunk with torch.save
    raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    assert blob.count(raw) == 1, key
    return file, info.offset + blob.index(raw), tensor


def _overwrite(file, offset, data):
    with open(file, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _damaged(ckpt, root):
    """Copies of ``ckpt``: bytes of a tp shard overwritten; NaN in a replicated tensor with its
    checksum recomputed (a valid checkpoint of a NaN model); a truncated file (DCP fails)."""
    out = {k: os.path.join(root, k) for k in ("bytes", "nan", "truncated")}
    for path in out.values():
        shutil.copytree(ckpt, path)
    file, offset, tensor = _chunk(out["bytes"], SHARD)
    _overwrite(file, offset + 8, b"\x5a" * 16)
    file, offset, tensor = _chunk(out["nan"], REPLICATED)
    _overwrite(file, offset, torch.tensor([float("nan")]).numpy().tobytes())
    sums_file = os.path.join(out["nan"], "fxsplit_checksums.json")
    sums = json.load(open(sums_file))
    nan = _chunk(out["nan"], REPLICATED)[2]
    assert nan.isnan().any()
    sums["chunks"][f"{REPLICATED}@0"]["crc32"] = zlib.crc32(nan.contiguous().view(-1).view(torch.uint8).numpy())
    json.dump(sums, open(sums_file, "w"))
    file, _, _ = _chunk(out["truncated"], SHARD)
    os.truncate(file, 100)
    return out, os.path.basename(_chunk(ckpt, SHARD)[0]), os.path.basename(_chunk(ckpt, REPLICATED)[0])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    ckpt, fresh = str(root / "ckpt"), str(root / "fresh")
    first = run_distributed(_first, 2, ckpt, fresh, timeout=240)
    return root, ckpt, fresh, first


@pytest.mark.dist
def test_failed_save_leaves_the_previous_checkpoint(trained):
    root, ckpt, fresh, first = trained
    for rank, (_, _, errors) in enumerate(first):
        for err in errors:  # every rank raises an FxsplitError; rank 0 (the coordinator) the cause
            assert err is not None and err[0], err
            if rank == 0:
                assert err[1] == "CheckpointError" and "disk full (injected)" in err[2], err
    assert not os.path.exists(fresh)
    assert sorted(os.listdir(root)) == ["ckpt"]  # no .tmp-* or .old-* folder left behind
    # ckpt still holds step 2, not step 4: test_resume_with_dropout_is_bit_identical repeats 3 and 4


@pytest.mark.dist
def test_resume_with_dropout_is_bit_identical(trained, tmp_path):
    root, ckpt, _, first = trained
    damaged, shard_file, replicated_file = _damaged(ckpt, str(tmp_path))
    second = run_distributed(_resume, 2, ckpt, damaged, timeout=240)
    for (losses, state, _), (refused, nan_loaded, step_count, resumed, resumed_state) in zip(first, second):
        # both load paths refuse the damaged copies, naming the tensor and the file
        kind, text = refused["bytes"]
        assert kind == "CheckpointError" and SHARD in text and shard_file in text and "checksum" in text, text
        kind, text = refused["nan"]
        assert kind == "CheckpointError" and REPLICATED in text and replicated_file in text, text
        assert "non-finite" in text and "allow_nonfinite=True" in text, text
        kind, text = refused["truncated"]
        assert kind == "CheckpointError" and "torch.distributed.checkpoint" in text, text
        assert nan_loaded
        # the good one resumes at step 2 and repeats steps 3 and 4 bit for bit
        assert step_count == 2
        assert resumed == losses
        assert state.keys() == resumed_state.keys()
        for k in state:
            assert torch.equal(state[k], resumed_state[k]), k


@pytest.mark.dist
def test_damaged_checkpoints_raise_in_one_process(trained, tmp_path):
    _, ckpt, _, _ = trained
    damaged, shard_file, replicated_file = _damaged(ckpt, str(tmp_path))
    full = fxsplit.load_full_checkpoint(ckpt, include_optimizer=True)  # the good one: every chunk verifies
    assert full.keys() >= {"blocks.0.attn.q.weight", REPLICATED}
    with pytest.raises(fxsplit.CheckpointError, match="checksum") as exc:
        fxsplit.load_full_checkpoint(damaged["bytes"])
    assert SHARD in str(exc.value) and shard_file in str(exc.value)
    with pytest.raises(fxsplit.CheckpointError, match="non-finite") as exc:
        fxsplit.load_full_checkpoint(damaged["nan"])
    assert REPLICATED in str(exc.value) and replicated_file in str(exc.value)
    assert fxsplit.load_full_checkpoint(damaged["nan"], allow_nonfinite=True)[REPLICATED].isnan().any()
    # DCP's CheckpointException derives from BaseException: it arrives as a CheckpointError
    try:
        fxsplit.load_full_checkpoint(damaged["truncated"])
    except Exception as exc:  # noqa: BLE001 -- what a user's handler would catch
        from torch.distributed.checkpoint.api import CheckpointException

        assert isinstance(exc, fxsplit.FxsplitError) and isinstance(exc.__cause__, CheckpointException)
        assert "CheckpointException" in str(exc)  # the original text is kept
    else:
        raise AssertionError("a truncated file loaded")
    for path in (str(tmp_path / "missing"), os.path.join(ckpt, "fxsplit_checksums.json")):
        with pytest.raises(fxsplit.CheckpointError, match="is not an fxsplit checkpoint"):
            fxsplit.load_full_checkpoint(path)


def test_checkpoint_without_checksums_still_loads(tmp_path, monkeypatch, caplog):
    """The layout before checksums: DCP's own writer, the record pickled as
    fxsplit.api.model._ShardRecord (where it lived then), no training state."""
    import torch.distributed.checkpoint as dcp

    import fxsplit.api.model
    from fxsplit.api import checkpoint

    monkeypatch.setattr(checkpoint._ShardRecord, "__module__", "fxsplit.api.model")
    monkeypatch.setattr(fxsplit.api.model, "_ShardRecord", checkpoint._ShardRecord, raising=False)
    w = torch.randn(4, 3)
    state = {"w": w, "fxsplit_meta/pp0-tp0": checkpoint._ShardRecord(1, {}, ())}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "old")), no_dist=True)
    monkeypatch.undo()
    assert not hasattr(fxsplit.api.model, "_ShardRecord")
    with caplog.at_level("WARNING", logger="fxsplit.api.checkpoint"):
        full = fxsplit.load_full_checkpoint(str(tmp_path / "old"))
    assert torch.equal(full["w"], w) and full.keys() == {"w"}
    assert "loaded unverified" in caplog.text


def test_replace_keeps_the_earlier_checkpoint_when_the_rename_fails(tmp_path, monkeypatch):
    """Rank 0's last step of a save: the earlier checkpoint is moved aside, the new one renamed in;
    a failing rename puts the earlier one back. Anything but a checkpoint or an empty folder is
    never replaced."""
    from fxsplit.api import checkpoint

    path, tmp = tmp_path / "ckpt", tmp_path / "ckpt.tmp-x"
    for folder, text in ((path, "old"), (tmp, "new")):
        folder.mkdir()
        (folder / ".metadata").write_text(text)
    rename = os.rename

    def failing(src, dst):
        if os.fspath(src) == str(tmp):
            raise OSError("injected")
        rename(src, dst)

    monkeypatch.setattr(checkpoint.os, "rename", failing)
    with pytest.raises(OSError, match="injected"):
        checkpoint._replace(str(tmp), str(path), "x")
    assert (path / ".metadata").read_text() == "old" and not (tmp_path / "ckpt.old-x").exists()
    monkeypatch.undo()
    checkpoint._replace(str(tmp), str(path), "x")
    assert (path / ".metadata").read_text() == "new" and sorted(os.listdir(tmp_path)) == ["ckpt"]
    checkpoint._check_replaceable(str(path))  # a checkpoint, an empty folder, nothing: fine
    checkpoint._check_replaceable(str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    checkpoint._check_replaceable(str(tmp_path / "empty"))
    (tmp_path / "empty" / "notes.txt").write_text("mine")
    with pytest.raises(fxsplit.CheckpointError, match="is not a checkpoint"):
        checkpoint._check_replaceable(str(tmp_path / "empty"))
