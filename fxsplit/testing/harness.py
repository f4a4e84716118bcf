"""Multi-process test harness: run one function on every rank of a fresh gloo process group.

Terms: **rank** -- one spawned process, numbered 0..world_size-1; **launch** -- one call of
`run_distributed`, which owns a fresh process group for its lifetime.

    run_distributed(fn, world_size, *args, backend="gloo", timeout=120.0, env=None, prepare=None) -> list

The parent hosts the rendezvous store (a `TCPStore` on a port the OS picks), so launches running
side by side on one machine never race for a port. Every rank gets MASTER_ADDR=127.0.0.1,
MASTER_PORT (the store's port), RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE in its
environment, runs with `torch.set_num_threads(1)`, and joins the default process group before
`fn(rank, world_size, *args)` is called. `fn` and `args` must be picklable (a module-level
function), and so must the return values. Both directions use plain `pickle`, so every rank
gets its own copy of the arguments and the parent its own copy of each result (tensors are
copied, never shared through shared memory, so nothing depends on a rank staying alive).

Start-up cost: by default ranks come from a multiprocessing "forkserver" that imported torch
once (preloaded) for the life of the parent, so each launch forks instead of importing torch
again: measured on 2 loaded cores, a 4-rank launch took 2 s this way against 36 s with
"spawn". The server also preloads fxsplit and the parts of torch (and, when the parent uses it,
transformers) that a rank's first parallelize would import ([Note: rank start-up]). The server is forked before any CUDA or OpenMP use, which keeps forking safe; pass
`start_method="spawn"` to get fresh interpreters. Environment variables set in the parent
after the server started do not reach the ranks: pass them in `env`.

[Note: preparing once per launch]
``prepare=(fn0, args0)`` runs ``fn0(*args0)`` once, in one process started like a rank (a
launcher), which then forks every rank: the ranks inherit what it built (a model, its plans:
``fxsplit.testing.trace_cache.shared_plans``) instead of each building the same thing. Every
rank plans the same model the same way ([Note: what every rank does] in fxsplit.api.parallelize),
so a 4-rank launch that plans in ``prepare`` plans once instead of four times. Forking is safe
only from a process with one thread and no OpenMP pool: the launcher runs with
``torch.set_num_threads(1)`` from its start and refuses to fork (an error naming the threads, not
a hang) while another thread is alive; process groups are made after the fork, in each rank. The
ranks are the launcher's children, not the parent's: the launcher sends their pids, the parent
sees a rank end at the EOF of its pipe and kills them by pid, and the launcher reaps them only
after the parent has closed the launch (so a pid the parent may still kill is never reused).

Failure handling: the parent waits on one pipe per rank plus each process's exit sentinel. The
first rank to raise (or to exit without a result) ends the launch at once: the others are
killed, and `DistributedRunError` names the rank and carries its traceback text. Past `timeout`
seconds of wall-clock time (start-up included), every rank is killed and the error names the
ranks that had not returned. Processes are always joined; none is left behind.
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from fxsplit.errors import ArgumentTypeError, DistributedRunError, UsageError

__all__ = ["DistributedRunError", "rank_context", "run_distributed"]

# [Note: rank start-up]: what the forkserver imports once, so that no rank imports it again.
# Besides torch and fxsplit: the parts of torch that tracing and planning import lazily on the
# first parallelize (dynamo, export, functorch's partitioner with networkx, DTensor, FSDP's
# policy types): measured 3.6 CPU-s for a rank's first pp=2 parallelize without them against
# 1.3 s with them. Modules in _PRELOAD_IF_LOADED are preloaded only when the parent has imported
# them already (so a launch never imports a package the caller does not use): transformers
# costs about 3.5 CPU-s per rank for Llama's modeling module alone. A rank starts with
# ``gc.freeze()``: the cyclic collector then never walks what the rank inherited from the server
# (every preloaded module's objects), which each rank's full collections otherwise traverse again,
# touching (and so copying) the server's pages. Measured on test_expert_parallel.py +
# test_runtime_dist.py (CPU-s of the whole process tree, benchmarks/suite_cpu.py): 74.6 without
# the freeze, 70.7 with it. Preloading more (fxsplit.api, DCP, inductor's compile_fx: modules a
# py-spy of the suite saw ranks import lazily) measured 82.6 without the freeze and 72.2 with it,
# no better than this list, so the list stays as it is.
_PRELOAD = (
    "torch", "torch.distributed", "fxsplit", __name__,
    "torch._dynamo", "torch.export", "torch._export", "torch._functorch.partitioners",
    "torch._inductor.decomposition", "torch.distributed.tensor", "torch.distributed.fsdp", "networkx",
)
_PRELOAD_IF_LOADED = {
    "pytest": ("pytest",),
    "hypothesis": ("hypothesis",),
    "transformers": ("transformers", "transformers.models.llama.modeling_llama",
                     "transformers.models.gpt2.modeling_gpt2"),
}


def _preload() -> list[str]:
    """The forkserver's preload list: `_PRELOAD`, the `_PRELOAD_IF_LOADED` groups whose package
    the parent has imported, and every Hugging Face modeling module the parent has imported."""
    names = list(_PRELOAD)
    for package, modules in _PRELOAD_IF_LOADED.items():
        if package in sys.modules:
            names += modules
    names += sorted(m for m in sys.modules if m.startswith("transformers.models.")
                    and m.rsplit(".", 1)[-1].startswith("modeling_"))
    return list(dict.fromkeys(names))


# Collective timeout inside the ranks: longer than the wall-clock timeout, so that a hang is
# reported by the parent (which names the stuck ranks) rather than by a gloo timeout in one rank.
_PG_TIMEOUT_MARGIN_S = 30.0
# After a failure, how long the parent keeps reading other ranks' reports before killing them.
_ERROR_GRACE_S = 0.05
# After every rank has returned, how long each may take to exit before it is killed.
_EXIT_GRACE_S = 10.0


def rank_context(start_method: str | None = None) -> Any:
    """The multiprocessing context ranks start from: ``start_method``, by default "forkserver"
    where the platform has it (its server preloading :func:`_preload`'s modules: a rank is a fork,
    [Note: rank start-up]), else "spawn"."""
    if start_method is None:
        start_method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_preload())
    return ctx


def _profiled(fn: Callable[..., Any], rank: int, world_size: int, args: tuple) -> Any:
    """`fn(rank, world_size, *args)`; under FXSPLIT_RANK_PROFILE=DIR (in the environment the
    launching process had when its forkserver started), profiled with cProfile into
    DIR/<fn>-rank<r>-<pid>.prof: where a launch's time goes (benchmarks/suite_cpu.py --ranks)."""
    out = os.environ.get("FXSPLIT_RANK_PROFILE")
    if not out:
        return fn(rank, world_size, *args)
    import cProfile

    prof = cProfile.Profile()
    try:
        return prof.runcall(fn, rank, world_size, *args)
    finally:
        os.makedirs(out, exist_ok=True)
        prof.dump_stats(os.path.join(out, f"{getattr(fn, '__name__', 'fn')}-rank{rank}-{os.getpid()}.prof"))


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    pg_timeout_s: float,
    env: Mapping[str, str],
    conn: multiprocessing.connection.Connection,
    alive: multiprocessing.connection.Connection,
    payload: bytes,
) -> None:
    """Body of one rank: join the process group, run `fn`, send ("ok", value) or ("error", ...)."""
    gc.freeze()  # [Note: rank start-up]: what the rank inherited is not the rank's garbage
    _exit_with_parent(alive)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    os.environ.update(env)
    torch.set_num_threads(1)
    ok = False
    try:
        if "nccl" in backend and torch.cuda.is_available():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        fn, args = pickle.loads(payload)
        value = _profiled(fn, rank, world_size, args)
        try:
            data = pickle.dumps(("ok", value))
        except Exception as exc:  # the value could not be pickled
            raise ArgumentTypeError(
                f"run_distributed: rank {rank} returned a {type(value).__name__}, which could "
                f"not be pickled ({exc}); return plain data (numbers, dicts, detached tensors)"
            ) from exc
        conn.send_bytes(data)
        ok = True
        # Let every rank finish its last sends/receives before any rank tears its group down.
        if dist.is_initialized():
            dist.barrier()
    except BaseException as exc:  # noqa: BLE001 -- everything is reported to the parent
        if not ok:
            conn.send_bytes(
                pickle.dumps(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
            )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()
    # Skip interpreter teardown (seconds with torch loaded); the report is already sent.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_with_parent(alive: multiprocessing.connection.Connection) -> None:
    """Exit this rank as soon as the parent dies (a killed test run leaves no orphans).

    `alive` is the read end of a pipe whose only write end the parent holds: it reaches EOF
    exactly when the parent is gone. (The process's own parent is the forkserver, which
    outlives a killed test process while ranks hold its pipe, so PR_SET_PDEATHSIG would not do.)
    """

    def watch() -> None:
        try:
            alive.recv_bytes()
        except (EOFError, OSError):
            pass
        os._exit(1)

    threading.Thread(target=watch, name="fxsplit-parent-watch", daemon=True).start()


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


def _kill_all(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    start_method: str | None = None,
    prepare: tuple[Callable[..., Any], tuple] | None = None,
) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` fresh processes; return their results.

    Returns the list of per-rank return values, indexed by rank. Raises `DistributedRunError`
    naming the first rank that raised (with its traceback text) or died, or, past `timeout`
    seconds, the ranks still running. `env` adds environment variables in every rank before
    the process group is set up (torch is already imported by then). `start_method` is a
    multiprocessing start method; the default, "forkserver" where the platform has it (else
    "spawn"), imports torch once in a server process and forks every rank from it, so a launch
    costs no torch import (see the module docstring). ``prepare=(fn0, args0)`` runs ``fn0(*args0)``
    once before the ranks start, in the process they are forked from ([Note: preparing once per launch]).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"run_distributed: world_size must be an int >= 1, got {world_size!r}")
    if timeout <= 0:
        raise UsageError(f"run_distributed: timeout must be > 0 seconds, got {timeout!r}")
    ctx = rank_context(start_method)
    try:
        payload = pickle.dumps((fn, args))
        prep_payload = None if prepare is None else pickle.dumps(tuple(prepare))
    except Exception as exc:
        raise ArgumentTypeError(
            f"run_distributed: could not pickle {getattr(fn, '__qualname__', fn)!r} and its "
            f"arguments ({exc}); fn must be a module-level function and args plain data"
        ) from exc
    # The parent hosts the store: port 0 lets the OS pick a free port with no race.
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, datetime.timedelta(seconds=timeout), wait_for_workers=False
    )
    deadline = time.monotonic() + timeout
    pg_timeout_s = timeout + _PG_TIMEOUT_MARGIN_S
    procs, readers = [], []
    alive_r, alive_w = ctx.Pipe(duplex=False)  # EOF in the ranks when this process dies
    if prep_payload is not None:
        rank_args = (world_size, store.port, backend, pg_timeout_s, dict(env or {}))
        try:
            return _run_prepared(ctx, rank_args, alive_r, alive_w, payload, prep_payload, deadline, timeout)
        finally:
            alive_r.close()
            alive_w.close()
            del store
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_worker,
                args=(rank, world_size, store.port, backend, pg_timeout_s, dict(env or {}),
                      writer, alive_r, payload),
                name=f"fxsplit-rank{rank}",
                daemon=True,
            )
            p.start()
            writer.close()
            procs.append(p)
            readers.append(reader)
        results = _collect(procs, readers, deadline, timeout)
        # Every rank has reported; give them a moment to tear down their groups and exit.
        for p in procs:
            p.join(timeout=max(0.0, min(_EXIT_GRACE_S, deadline - time.monotonic())))
        return results
    finally:
        _kill_all(procs)
        for r in readers:
            r.close()
        alive_r.close()
        alive_w.close()
        del store


def _run_prepared(ctx: Any, rank_args: tuple, alive_r: Any, alive_w: Any, payload: bytes, prep_payload: bytes,
                  deadline: float, timeout: float) -> list:
    """``run_distributed`` with ``prepare``: one launcher process runs it and forks the ranks
    ([Note: preparing once per launch])."""
    pipes = [ctx.Pipe(duplex=False) for _ in range(rank_args[0])]
    ctl_r, ctl_w = ctx.Pipe(duplex=False)
    launcher = ctx.Process(target=_launcher, args=(rank_args, [w for _, w in pipes], ctl_w, alive_r, payload,
                                                   prep_payload), name="fxsplit-launcher", daemon=True)
    procs: list = []
    launcher.start()
    try:
        for _, w in pipes:
            w.close()
        ctl_w.close()
        pids = _launched(launcher, ctl_r, deadline, timeout)
        procs = [_ForkedRank(pid) for pid in pids]
        results = _collect(procs, [r for r, _ in pipes], deadline, timeout)
        for p in procs:  # every rank has reported: let them tear their groups down
            p.join(timeout=max(0.0, min(_EXIT_GRACE_S, deadline - time.monotonic())))
        return results
    finally:
        _kill_all(procs)
        alive_w.close()  # the launcher reaps its ranks and exits
        launcher.join(timeout=_EXIT_GRACE_S)
        _kill_all([launcher])
        for r, _ in pipes:
            r.close()
        ctl_r.close()


def _launched(launcher: Any, ctl: Any, deadline: float, timeout: float) -> list[int]:
    """The ranks' pids, sent by the launcher once ``prepare`` has returned; its error if it raised."""
    multiprocessing.connection.wait([ctl, launcher.sentinel], timeout=max(0.0, deadline - time.monotonic()))
    msg = None
    if ctl.poll():
        try:
            msg = pickle.loads(ctl.recv_bytes())
        except EOFError:
            pass
    elif launcher.is_alive():
        raise DistributedRunError(f"run_distributed: timed out after {timeout:g} s in prepare, before any rank "
                                  "started; the launcher was killed", stuck_ranks=())
    if msg is None:
        launcher.join(timeout=1.0)
        raise DistributedRunError(f"run_distributed: the launcher {_exit_reason(launcher.exitcode)} before "
                                  "starting the ranks (see its stderr above)")
    if msg[0] == "error":
        raise DistributedRunError(f"run_distributed: prepare failed: {msg[1]}\n--- traceback of prepare ---\n"
                                  f"{msg[2].rstrip()}", rank_traceback=msg[2])
    return msg[1]


def _launcher(rank_args: tuple, writers: list, ctl: Any, alive: Any, payload: bytes, prep_payload: bytes) -> None:
    """Body of the launcher: run ``prepare``, fork every rank (each runs `_worker`), send their pids,
    reap them once the parent has closed the launch ([Note: preparing once per launch])."""
    torch.set_num_threads(1)  # before any compute: no OpenMP pool may exist at the fork
    os.environ.update(rank_args[4])
    try:
        fn0, args0 = pickle.loads(prep_payload)
        fn0(*args0)
        _stop_tqdm_monitor()
        others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        if others:
            raise UsageError(f"run_distributed: prepare left threads running ({', '.join(others)}); the ranks are "
                             "forked from its process, and a fork beside other threads can hang: join them first")
    except BaseException as exc:  # noqa: BLE001 -- reported to the parent
        ctl.send_bytes(pickle.dumps(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    pids = []
    for rank, conn in enumerate(writers):
        sys.stdout.flush()  # a fork copies unflushed output
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                for other in (*writers[:rank], *writers[rank + 1:], ctl):
                    other.close()
                _worker(rank, *rank_args, conn, alive, payload)
            finally:
                os._exit(1)
        pids.append(pid)
    ctl.send_bytes(pickle.dumps(("pids", pids)))
    for conn in (*writers, ctl):
        conn.close()
    try:
        alive.recv_bytes()  # EOF: the parent has closed the launch (or died); no pid is killed after this
    except (EOFError, OSError):
        pass
    for pid in pids:
        os.waitpid(pid, 0)
    os._exit(0)


def _stop_tqdm_monitor() -> None:
    """Join tqdm's monitor thread, which a progress bar starts (transformers shows some while building a
    model) and which outlives the bar; tqdm starts a new one when a later bar needs it."""
    tqdm = getattr(sys.modules.get("tqdm"), "tqdm", None)
    if tqdm is not None and getattr(tqdm, "monitor", None) is not None:
        tqdm.monitor.exit()
        tqdm.monitor = None


class _ForkedRank:
    """The parent's view of a rank the launcher forked: not its child, so no sentinel (its pipe's EOF
    is its end) and no waitpid; its state and exit status come from /proc (a zombie until the
    launcher reaps it, which is after the parent stops looking)."""

    sentinel = None

    def __init__(self, pid: int):
        self.pid = pid

    def _stat(self) -> list[str]:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()
        except OSError:
            return []

    def is_alive(self) -> bool:
        stat = self._stat()
        return bool(stat) and stat[0] not in ("Z", "X")

    @property
    def exitcode(self) -> int | None:
        stat = self._stat()
        if self.is_alive() or len(stat) < 50:
            return None
        status = int(stat[49])  # field 52, exit_code: the status as waitpid reports it
        return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)

    def join(self, timeout: float | None = None) -> None:
        end = time.monotonic() + (timeout or 0.0)
        while self.is_alive() and time.monotonic() < end:
            time.sleep(0.01)

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _collect(procs: list, readers: list, deadline: float, timeout: float) -> list:
    """Wait for every rank's report; raise at the first failure or at the deadline."""
    world_size = len(procs)
    results: dict[int, Any] = {}
    errors: dict[int, tuple[str, str]] = {}
    waiting = {r: reader for r, reader in enumerate(readers)}
    by_sentinel = {p.sentinel: r for r, p in enumerate(procs) if p.sentinel is not None}
    error_deadline = None
    while len(results) < world_size:
        now = time.monotonic()
        if error_deadline is not None and now >= error_deadline:
            break
        if now >= deadline:
            stuck = tuple(r for r in range(world_size) if r not in results)
            raise DistributedRunError(
                f"run_distributed: timed out after {timeout:g} s; rank(s) {list(stuck)} had not "
                f"returned (finished: {sorted(results)}); all ranks were killed. A rank waiting "
                "on a collective or recv that its peers never reach hangs like this.",
                stuck_ranks=stuck,
            )
        limit = min(deadline, error_deadline or deadline) - now
        ready = multiprocessing.connection.wait(
            list(waiting.values()) + [procs[r].sentinel for r in waiting if procs[r].sentinel is not None],
            timeout=limit,
        )
        for obj in ready:
            rank = by_sentinel[obj] if obj in by_sentinel else readers.index(obj)
            if rank not in waiting:
                continue
            reader = waiting[rank]
            msg = None
            if reader.poll():
                try:
                    msg = pickle.loads(reader.recv_bytes())
                except EOFError:
                    pass  # it exited (or died while starting) without a report
            elif obj is reader:
                continue  # spurious wake-up
            elif procs[rank].is_alive():
                continue
            del waiting[rank]
            if msg is None:
                procs[rank].join(timeout=1.0)
                errors[rank] = (f"rank {rank} {_exit_reason(procs[rank].exitcode)} before "
                                "returning a result (see its stderr above)", "")
            elif msg[0] == "ok":
                results[rank] = msg[1]
            else:
                errors[rank] = (msg[1], msg[2])
        if errors and error_deadline is None:
            error_deadline = time.monotonic() + _ERROR_GRACE_S
    if errors:
        raise _first_error(errors)
    return [results[r] for r in range(world_size)]


def _first_error(errors: dict[int, tuple[str, str]]) -> DistributedRunError:
    """Blame the lowest rank whose error is not a peer hanging up (the usual echo of a failure)."""
    echoes = ("Connection closed by peer", "Connection reset by peer", "before returning a result")
    primary = sorted(errors, key=lambda r: (any(e in errors[r][0] for e in echoes), r))
    rank = primary[0]
    summary, tb = errors[rank]
    others = [f"rank {r}: {errors[r][0].splitlines()[0]}" for r in primary[1:]]
    text = f"run_distributed: rank {rank} failed: {summary}"
    if tb:
        text += f"\n--- traceback of rank {rank} ---\n{tb.rstrip()}"
    if others:
        text += "\n--- other ranks ---\n" + "\n".join(others)
    return DistributedRunError(text, rank=rank, rank_traceback=tb)
