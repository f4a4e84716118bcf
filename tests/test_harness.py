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



# [Note: preparing once per launch]: prepare runs once, in the process the ranks are forked from
_PREPARED: dict = {}


def _prepare(pid_dir, value):
    with open(pid_dir / "prepare.log", "a") as f:  # one line per run of prepare, whatever process runs it
        f.write(f"{os.getpid()}\n")
    _PREPARED["value"] = torch.arange(4.0) * value
    _PREPARED["pid"] = os.getpid()


def _inherited(rank, world_size, pid_dir):
    (pid_dir / f"rank{rank}.pid").write_text(str(os.getpid()))
    t = _PREPARED["value"] + rank
    dist.all_reduce(t)
    return dict(sum=t.tolist(), prepared_in=_PREPARED["pid"], parent=os.getppid(), me=os.getpid(),
                threads=torch.get_num_threads())


def test_prepare_runs_once_and_every_rank_inherits_it(tmp_path):
    out = run_distributed(_inherited, 3, tmp_path, timeout=60, prepare=(_prepare, (tmp_path, 2.0)))
    runs = (tmp_path / "prepare.log").read_text().split()
    assert len(runs) == 1, runs
    launcher = int(runs[0])
    assert all(o["prepared_in"] == launcher == o["parent"] and o["me"] != launcher for o in out), (launcher, out)
    assert [o["sum"] for o in out] == [[3.0, 9.0, 15.0, 21.0]] * 3  # sum over ranks of 2 * arange(4) + rank
    assert all(o["threads"] == 1 for o in out)
    assert _pids_left(tmp_path) == []


def _prepare_raises():
    raise ValueError("no model today")


def _prepare_leaves_a_thread():
    import threading

    threading.Thread(target=threading.Event().wait, name="left-behind", daemon=True).start()


def test_prepare_failures_are_reported_before_any_rank_starts(tmp_path):
    with pytest.raises(DistributedRunError, match="prepare failed: ValueError: no model today") as info:
        run_distributed(_inherited, 2, tmp_path, timeout=60, prepare=(_prepare_raises, ()))
    assert info.value.rank is None and "_prepare_raises" in info.value.rank_traceback
    with pytest.raises(DistributedRunError, match=r"prepare failed: UsageError: .*threads running \(left-behind\)"):
        run_distributed(_inherited, 2, tmp_path, timeout=60, prepare=(_prepare_leaves_a_thread, ()))
    assert list(tmp_path.glob("rank*.pid")) == []  # no rank ran


def test_prepared_ranks_fail_and_hang_as_others_do(tmp_path):
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_raise_on_rank_one, 2, tmp_path, timeout=60, prepare=(_prepare, (tmp_path, 1.0)))
    assert info.value.rank == 1 and "ValueError: boom from the test" in str(info.value)
    assert _pids_left(tmp_path) == []
    start = time.monotonic()
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_hang_on_rank_one, 2, tmp_path, timeout=5, prepare=(_prepare, (tmp_path, 1.0)))
    assert info.value.rank is None and 1 in info.value.stuck_ranks and 5 <= time.monotonic() - start < 15
    assert _pids_left(tmp_path) == []  # killed by pid, reaped by the launcher before the launch returned
    with pytest.raises(DistributedRunError, match="rank 0 exited with code 3 before returning a result"):
        run_distributed(_die_on_rank_zero, 2, timeout=60, prepare=(_prepare, (tmp_path, 1.0)))
