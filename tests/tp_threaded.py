"""All tp ranks of a tensor-parallel graph in ONE process: one thread per rank over torch's
threaded process group (``torch.testing._internal.distributed.multi_threaded_pg``), so a test
compares every rank with the unsplit model without spawning processes.

    results = run_threaded(fn, world=2)     # fn(rank, world) runs with "tp" bound to the group

[Note: threaded tp ranks] The threaded group sums in one place, so collectives are exact and
deterministic; autograd runs backward on the calling thread (multithreading disabled while it is
installed). torch 2.13 registers every group name in one global C++ registry, which the threaded
group (one "0" group per thread) trips over; the registry only serves name lookups of
functional collectives, which fxsplit does not use, so it is bypassed while the group is installed.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from fxsplit.tp.collectives import bind_groups

_LOCK = threading.Lock()


def run_threaded(fn: Callable[[int, int], Any], world: int, timeout: float = 300.0) -> list[Any]:
    """``[fn(0, world), ..., fn(world - 1, world)]``, each on its own thread with the "tp" axis
    bound to a threaded process group of size ``world``; re-raises the first rank's exception."""
    from torch.testing._internal.distributed import multi_threaded_pg as mt

    with _LOCK:
        register = c10d._register_process_group
        c10d._register_process_group = lambda name, pg: None
        mt._install_threaded_pg()
        store = dist.HashStore()
        results: list[Any] = [None] * world
        errors: list[tuple[int, BaseException]] = []

        def worker(rank: int) -> None:
            dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
            try:
                with bind_groups({"tp": dist.group.WORLD}):
                    results[rank] = fn(rank, world)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                errors.append((rank, exc))
                mt.ProcessLocalGroup.exception_handle(exc)  # wake ranks waiting in a collective
            finally:
                dist.destroy_process_group()

        threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(world)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout)
            alive = [r for r, t in enumerate(threads) if t.is_alive()]
        finally:
            mt._uninstall_threaded_pg()
            c10d._register_process_group = register
        if errors:
            rank, exc = sorted(errors, key=lambda e: e[0])[0]
            raise RuntimeError(f"tp rank {rank} of {world} failed: {exc!r}").with_traceback(exc.__traceback__)
        if alive:
            print(f"run_threaded: ranks {alive} still running after {timeout}s", file=sys.stderr)
            raise TimeoutError(f"run_threaded: tp ranks {alive} of {world} did not finish in {timeout}s")
        return results
