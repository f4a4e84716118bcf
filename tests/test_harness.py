"""Tests for fxsplit.testing.run_distributed: results, a raising rank, a hanging rank."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from fxsplit.testing import DistributedRunError, run_distributed

pytestmark = pytest.mark.dist


def _report(rank, world_size, scale, shared=None):
    if shared is not None:
        shared.add_(100.0)  # each rank owns a copy: the parent's tensor must not change
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {
        "rank": rank,
        "world_size": world_size,
        "pg_rank": dist.get_rank(),
        "pg_world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "sum": t.item() * scale,
        "env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                            "FXSPLIT_TEST_VAR")},
        "threads": torch.get_num_threads(),
        "tensor": torch.full((2,), float(rank)),
        "big": torch.full((1 << 20,), float(rank)),  # 4 MB, copied back after the rank exits
        "shared": None if shared is None else shared.clone(),
    }


def test_returns_per_rank_values():
    arg = torch.zeros(3)
    out = run_distributed(_report, 3, 10.0, arg, env={"FXSPLIT_TEST_VAR": "x"}, timeout=60)
    assert torch.equal(arg, torch.zeros(3))
    assert [o["rank"] for o in out] == [0, 1, 2]
    for r, o in enumerate(out):
        assert o["pg_rank"] == r and o["pg_world"] == 3 and o["world_size"] == 3
        assert o["backend"] == "gloo"
        assert o["sum"] == 60.0  # (1 + 2 + 3) * 10, so the collective really ran
        assert o["env"] == {"RANK": str(r), "WORLD_SIZE": "3", "LOCAL_RANK": str(r),
                            "MASTER_ADDR": "127.0.0.1", "FXSPLIT_TEST_VAR": "x"}
        assert o["threads"] == 1
        assert torch.equal(o["tensor"], torch.full((2,), float(r)))
        assert torch.equal(o["big"], torch.full((1 << 20,), float(r)))
        assert torch.equal(o["shared"], torch.full((3,), 100.0))


def _pids_left(pid_dir):
    """Ranks (from the pid files they wrote) whose process still exists."""
    left = []
    for f in sorted(pid_dir.glob("rank*.pid")):
        try:
            os.kill(int(f.read_text()), 0)
            left.append(f.stem)
        except ProcessLookupError:
            pass
    return left


def _raise_on_rank_one(rank, world_size, pid_dir):
    (pid_dir / f"rank{rank}.pid").write_text(str(os.getpid()))
    if rank == 1:
        deadline = time.monotonic() + 20  # let rank 0 record its pid first (a loaded machine may
        while not (pid_dir / "rank0.pid").exists() and time.monotonic() < deadline:  # run it late)
            time.sleep(0.01)
        raise ValueError("boom from the test")
    dist.barrier()  # rank 0 would wait here forever: the harness must kill it
    return rank


def test_raising_rank_is_named_quickly(tmp_path):
    start = time.monotonic()
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_raise_on_rank_one, 2, tmp_path, timeout=60)
    elapsed = time.monotonic() - start
    err = info.value
    assert err.rank == 1
    assert "rank 1" in str(err) and "ValueError: boom from the test" in str(err)
    assert "_raise_on_rank_one" in err.rank_traceback  # the rank's own traceback text
    assert elapsed < 30, f"took {elapsed:.1f}s: the failure was not detected promptly"
    assert len(list(tmp_path.glob("rank*.pid"))) == 2 and _pids_left(tmp_path) == []


def _hang_on_rank_one(rank, world_size, pid_dir):
    (pid_dir / f"rank{rank}.pid").write_text(str(os.getpid()))
    if rank == 1:
        t = torch.zeros(1)
        dist.recv(t, src=0)  # rank 0 never sends
    return rank


def test_hanging_rank_is_killed_at_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_hang_on_rank_one, 2, tmp_path, timeout=5)
    elapsed = time.monotonic() - start
    err = info.value
    assert err.rank is None and 1 in err.stuck_ranks
    assert "timed out after 5 s; rank(s) [1] had not" in str(err), str(err)
    assert 5 <= elapsed < 15
    assert _pids_left(tmp_path) == []  # killed and reaped


def _die_on_rank_zero(rank, world_size):
    if rank == 0:
        os._exit(3)
    dist.barrier()


def test_rank_dying_without_result_is_reported():
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_die_on_rank_zero, 2, timeout=60)
    assert info.value.rank == 0
    assert "rank 0 exited with code 3 before returning a result" in str(info.value)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        run_distributed(_report, 0)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        run_distributed(_report, 1, timeout=0)


def _fail_to_unpickle():
    raise RuntimeError("this argument cannot be loaded in the child")


class _Unloadable:
    """Pickles fine in the parent, raises while the child unpickles it (before fn runs)."""

    def __reduce__(self):
        return (_fail_to_unpickle, ())


def _return_unpicklable(rank, world_size):
    return (lambda: None) if rank == 1 else 0


def test_pickling_failures_name_the_culprit():
    with pytest.raises(TypeError, match="could not pickle .*<lambda>.*module-level function"):
        run_distributed(lambda rank, ws: None, 2)
    with pytest.raises(DistributedRunError, match="this argument cannot be loaded in the child"):
        run_distributed(_report, 2, _Unloadable(), timeout=60)
    with pytest.raises(DistributedRunError, match="rank 1 failed: ArgumentTypeError: .*rank 1 returned a function"):
        run_distributed(_return_unpicklable, 2, timeout=60)

