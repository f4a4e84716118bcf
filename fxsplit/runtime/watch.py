"""The failure protocol: every wait on another rank is bounded, and a failure on any rank ends
every rank fast, naming the rank at fault ([Note: failure protocol]).

Terms: **board** -- keys under one prefix in the rendezvous store (torchrun's, or the one
``init_process_group`` made) where a rank that fails posts a *report*; **heartbeat** -- a
counter each rank's watch thread adds to every ``interval`` seconds, with what the rank is
doing; **suspect** -- the global rank a report blames; **slice** -- the short wait a polled wait
repeats until its work is done.

    watch = Watch(store, prefix="fxsplit/pm0", rank=r, world_size=n, timeout=300.0,
                  describe=lambda rank: "global rank 3 (dp 0, pp 1, tp 1, stage 1)")
    watch.doing = "action 1F3"               # what this rank does now (read by the watch thread)
    watch.wait(work, "the loss broadcast", peers=(0, 1))   # raises RankFailedError, never hangs
    watch.post_raised(exc)                    # this rank's own code failed: tell the others

[Note: failure protocol]
Why: gloo's ``Work.wait(timeout)`` ends only its own wait; the operation stays queued in the
group's worker thread until the group's own timeout, and ``ProcessGroup.abort()`` does not
cancel it (checked on torch 2.13 CPU). A rank blocked in a collective learns nothing of a
failure two hops away, and a rank killed with -9 is seen only by the ranks it had a socket to.
So every rank knows of every failure through the store, which every rank already talks to:
1. *Polled waits.* `Watch.wait` waits ``slice`` seconds at a time on a collective (its work stays
   valid after a timed-out wait, so the next slice resumes it) and between slices reads a flag the
   watch thread sets when the board holds a report. A transport error (a peer's socket closed) or
   ``timeout`` seconds without completion ends the wait too. Used by the tensor-parallel
   collectives, the data-parallel reductions, the loss broadcast and the end-of-call error
   exchange. Point-to-point waits (the pipeline's transfers, tied-weight sums) cannot be sliced:
   on gloo a timed-out wait on them closes the connection to the peer. They wait ``timeout`` in one
   piece and the watch thread interrupts them when the board holds a report, by that very closure
   (a 1 ms wait on the same work, ``_interrupt``), which also wakes the peer's transfers with this
   rank. Only where waits block the host (gloo): a timed NCCL wait is not a harmless poll, and
   NCCL's own watchdog bounds its waits. Waits fxsplit cannot poll (FSDP2's own collectives,
   compiled graphs' functional collectives, DCP, object collectives) are bounded by the groups'
   timeout, which parallelize sets to ``timeout`` on every group it uses.
2. *Reports.* A rank whose own code raised posts a report ("raised", with its error text and what
   it was doing) before anything else, so the peers it leaves waiting read the cause, not an echo.
   A rank whose wait failed or timed out finds the suspect from the heartbeats: a rank whose
   counter did not move for ``stale`` seconds is dead or stopped (kill -9, SIGSTOP, host down);
   else a rank that is alive but not waiting on anyone is busy in its own code (a stall). It posts
   that ("lost" / "stalled") naming the suspect, never itself or another survivor.
3. *Order.* Every rank names the same cause: the first "raised" report, else the first "lost",
   else the first "stalled" (posts are numbered by the store's atomic counter).
4. *Exit.* A group that may hold an operation no peer will ever complete is *abandoned*
   (:func:`abandon`): fxsplit keeps a reference to it that is never released, so neither
   ``destroy_process_group`` nor interpreter exit runs its destructor, which would join the gloo
   worker thread stuck in that operation until the group's timeout (measured: exit delayed by
   exactly the group timeout). Safe because such a group is never used again (the model refuses to
   run after such a failure), its sockets close when the process exits, and nothing else of the
   process waits on it. A failure that leaves the model usable (pp = tp = 1: nothing in flight)
   moves every rank to a fresh board (``recovered``), so its report cannot end later waits.
Cost on the happy path: one store ``add`` per rank per ``interval`` (at most one second) from a
daemon thread, and a check of a flag per slice of a wait that has not finished in one slice.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import json
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from fxsplit.errors import RankFailedError

__all__ = ["Report", "Watch", "abandon", "group_wait", "host_blocking", "slice_timed_out"]

_ABANDONED: list[Any] = []
_LIVE: "weakref.WeakSet[Watch]" = weakref.WeakSet()


@atexit.register
def _stop_watches() -> None:
    """Stop every watch thread before the interpreter tears down: a daemon thread caught inside a
    store call while the process's native objects are destroyed can abort the exit (SIGABRT,
    seen in 2 of 30 fault cases without this stop)."""
    watches = list(_LIVE)
    for w in watches:
        w.close()
    for w in watches:
        w._thread.join(timeout=2.0)


def abandon(group: Any) -> None:
    """Never destroy ``group`` ([Note: failure protocol] point 4): an operation left in it would
    make its destructor block until the group's timeout."""
    if group is None or any(g is group for g in _ABANDONED):
        return
    _ABANDONED.append(group)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))  # survives interpreter teardown too


def host_blocking(group: Any) -> bool:
    """Whether waits on ``group`` block the host (gloo, or no process group) rather than only
    ordering streams (NCCL): only those are polled through a watch or given a timeout."""
    return (dist.get_backend(group) != "nccl") if dist.is_initialized() else True


def group_wait(watch: Watch | None, *, polled: bool) -> Callable[[Any, str, Any], None]:
    """``wait(work, what, group)``: a wait on ``group``'s ranks through ``watch`` (polled and
    failure-aware, [Note: failure protocol]) when ``polled``, else ``work.wait()``. Poll only where
    waits block the host (gloo): NCCL's waits only order streams, and a timed NCCL wait is not a
    harmless poll (its watchdog bounds them)."""
    def wait(work: Any, what: str, group: Any) -> None:
        if watch is None or not polled:
            work.wait()
        else:
            watch.wait(work, what, dist.get_process_group_ranks(group))
    return wait


def slice_timed_out(exc: BaseException) -> bool:
    """True for the error ``Work.wait(timeout)`` raises when only the wait ran out (the work goes on)."""
    return "Operation timed out!" in str(exc)


@dataclass(frozen=True)
class Report:
    """One post on the board: ``suspect`` (global rank at fault) failed, as seen by ``by``.

    kind: "raised" (the suspect's own code raised; ``text`` is its error), "lost" (it stopped
    answering: no heartbeat), "stalled" (alive, but did not answer for ``timeout`` seconds)."""

    kind: str
    suspect: int
    by: int
    where: str          # the suspect's coordinates, e.g. "global rank 2 (dp 0, pp 1, tp 0, stage 1)"
    doing: str          # what the suspect was doing
    text: str           # its error ("raised") or how it was found
    seq: int = 0

    _RANK = {"raised": 0, "lost": 1, "stalled": 2}

    def sentence(self) -> str:
        if self.kind == "raised":
            return f"{self.where} failed while {self.doing}: {self.text}"
        return f"{self.where} {self.text} (its last state: {self.doing})"


class Watch:
    """One rank's side of the failure protocol ([Note: failure protocol])."""

    def __init__(self, store: Any, *, prefix: str, rank: int, world_size: int, timeout: float,
                 describe: Callable[[int], str], interval: float | None = None):
        self.store, self.prefix, self.rank, self.world_size = store, prefix, rank, world_size
        self.timeout = float(timeout)
        self.describe = describe
        self.interval = interval if interval is not None else min(1.0, max(0.05, self.timeout / 20))
        self.slice = min(0.1, self.interval)
        self.stale = max(4 * self.interval, 0.5)
        self.doing: Any = "between fxsplit calls (after parallelize())"  # set by the main thread
        self.failed = threading.Event()
        self.blocked: Any = None  # the point-to-point work the main thread waits on in one piece
        self.generation = 0  # reports of earlier, recovered failures are not read again
        self.store_error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"fxsplit-watch-{rank}", daemon=True)
        _LIVE.add(self)
        self._thread.start()

    def doing_text(self) -> str:
        d = self.doing  # an Action (the pipeline's current action) or a sentence
        if isinstance(d, str):
            return d
        return f"running action {d} (stage {d.stage}, microbatch {d.microbatch})"

    # -- keys
    def _k(self, *parts: Any) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    # -- the watch thread
    def _loop(self) -> None:
        published, errors = None, 0
        while not self._stop.is_set():
            try:
                self.store.add(self._k("hb", self.rank), 1)
                doing = self.doing_text()
                if doing != published:
                    self.store.set(self._k("doing", self.rank), doing)
                    published = doing
                if not self.failed.is_set() and self.store.add(self._k("g", self.generation, "n"), 0) > 0:
                    self.failed.set()
                if self.failed.is_set() and self.blocked is not None:
                    self._interrupt()
                errors = 0
            except Exception as exc:  # noqa: BLE001 -- the store's host may be gone
                errors += 1
                if errors >= 3 and self.store_error is None:
                    self.store_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    self.failed.set()
            self._stop.wait(self.interval)

    def recovered(self) -> None:
        """Every rank agreed on a failure that left the model usable (no transfer left half done):
        later waits read a fresh board. Called by every rank at the same point."""
        self.generation += 1
        self.failed.clear()

    def close(self) -> None:
        self._stop.set()

    # -- the board
    def post(self, kind: str, suspect: int, doing: str, text: str) -> None:
        body = json.dumps(dict(kind=kind, suspect=suspect, by=self.rank, where=self.describe(suspect),
                               doing=doing, text=text))
        try:
            n = self.store.add(self._k("g", self.generation, "n"), 1)
            self.store.set(self._k("g", self.generation, "r", n), body)
        except Exception:  # noqa: BLE001 -- no store: the peers find the failure by timeout
            pass
        self.failed.set()

    def post_raised(self, exc: BaseException) -> None:
        """This rank's own code raised ``exc``: tell every rank (first thing after the failure)."""
        if getattr(exc, "_fxsplit_posted", False):
            return
        try:
            exc._fxsplit_posted = True
        except Exception:  # noqa: BLE001 -- an exception type that refuses attributes
            pass
        first = str(exc).split("\n\n")[0]
        self.post("raised", self.rank, self.doing_text(), f"{type(exc).__name__}: {first}")

    def reports(self) -> list[Report]:
        """Every report on the board, best cause first ([Note: failure protocol] point 3)."""
        out = []
        try:
            n = self.store.add(self._k("g", self.generation, "n"), 0)
            for i in range(1, n + 1):
                key = self._k("g", self.generation, "r", i)
                self.store.wait([key], datetime.timedelta(seconds=5))
                out.append(Report(**json.loads(self.store.get(key).decode()), seq=i))
        except Exception:  # noqa: BLE001 -- what could be read
            pass
        return sorted(out, key=lambda r: (Report._RANK.get(r.kind, 3), r.seq))

    def cause(self) -> Report | None:
        reports = self.reports()
        return reports[0] if reports else None

    # -- diagnosis
    def _beats(self) -> dict[int, int]:
        beats = {}
        for r in range(self.world_size):
            try:
                beats[r] = self.store.add(self._k("hb", r), 0)
            except Exception:  # noqa: BLE001
                beats[r] = -1
        return beats

    def _doing_of(self, rank: int) -> str:
        try:
            key = self._k("doing", rank)
            if self.store.check([key]):
                return self.store.get(key).decode()
        except Exception:  # noqa: BLE001
            pass
        return "(unknown)"

    def diagnose(self, peers: Sequence[int], *, why: str, timed_out: bool = False) -> Report:
        """Find the rank at fault after a wait on ``peers`` failed (``why``): a report already on
        the board, else a rank whose heartbeat stopped, else a rank busy outside any wait."""
        others = [r for r in range(self.world_size) if r != self.rank]
        first = self._beats()
        deadline = time.monotonic() + self.stale
        while True:  # another rank's report (its own error, or a diagnosis) is the better answer
            reports = self.reports()
            if reports:
                return reports[0]
            if time.monotonic() >= deadline:
                break
            time.sleep(self.interval)
        now = self._beats()
        dead = [r for r in others if now[r] == first[r]]
        if dead:
            suspect = next((r for r in dead if r in peers), dead[0])
            text = (f"stopped answering: no heartbeat for {self.stale:.1f} s (killed, crashed, stopped, or its "
                    f"host is down); found by global rank {self.rank} when {why}")
            return self._posted("lost", suspect, text)
        busy = [r for r in others if not self._doing_of(r).startswith("waiting")]
        suspect = next((r for r in busy if r in peers), busy[0] if busy else (peers[0] if peers else others[0]))
        if not timed_out:
            return self._posted("lost", suspect, f"broke its connection: found by global rank {self.rank} when {why}")
        doing = self._doing_of(suspect)
        if doing.startswith("between fxsplit calls"):
            text = (f"did not call step() or forward() like the other ranks within {self.timeout:g} s (it is "
                    f"alive, {doing}; every rank must make the same calls); found by global rank {self.rank} "
                    f"when {why}")
        else:
            text = (f"did not answer for {self.timeout:g} s while alive and not waiting on any rank (busy in "
                    f"its own code, e.g. loss_fn or data loading, or slow: a slow but healthy rank needs a "
                    f"larger `timeout`); found by global rank {self.rank} when {why}")
        return self._posted("stalled", suspect, text)

    def _posted(self, kind: str, suspect: int, text: str) -> Report:
        doing = self._doing_of(suspect)
        self.post(kind, suspect, doing, text)
        return self.cause() or Report(kind, suspect, self.rank, self.describe(suspect), doing, text)

    def error(self, report: Report, what: str) -> RankFailedError:
        me = self.describe(self.rank)
        exc = RankFailedError(f"{report.sentence()}. This is {me}, stopped while {what}; every rank raises.",
                              failed={report.suspect: report.text})
        exc.report = report
        return exc

    # -- waiting
    def _wait_whole(self, work: Any, what: str, peers: Sequence[int], t0: float) -> None:
        """One blocking wait of ``timeout`` seconds, for gloo's point-to-point work, where a wait
        that times out closes the connection to the peer (checked on torch 2.13: "Application
        timeout caused pair closure"), so it cannot be sliced. The watch thread interrupts it when
        the board reports a failure, by that very closure: a 1 ms wait on the same work
        (``_interrupt``); the peer then sees its own transfers with this rank fail, and reads the
        board."""
        self.blocked = work
        try:
            work.wait(datetime.timedelta(seconds=self.timeout))
            return
        except Exception as exc:  # noqa: BLE001
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            elapsed = time.monotonic() - t0
            failure = exc
        finally:
            self.blocked = None
        if self.failed.is_set() and self.store_error is None:
            cause = self.cause()
            if cause is not None:
                raise self.error(cause, what) from failure
        timed = "imed out" in first and elapsed >= 0.9 * self.timeout
        why = f"{what} failed after {elapsed:.1f} s ({first[:160]})"
        raise self.error(self.diagnose(peers, why=why, timed_out=timed), what) from failure

    def _interrupt(self) -> None:
        """Watch thread: end the main thread's unsliceable wait after a failure elsewhere."""
        work = self.blocked
        if work is not None:
            try:
                work.wait(datetime.timedelta(milliseconds=1))
            except Exception:  # noqa: BLE001 -- the timeout closes the connection: the point
                pass

    def wait(self, work: Any, what: str, peers: Sequence[int] = (), *, until_lost: bool = False,
             sliced: bool = True) -> None:
        """Wait for ``work``, a slice at a time. Raises :class:`RankFailedError` naming the rank at
        fault when the board holds a report (only a "lost"/"stalled" one with ``until_lost``: the
        end-of-call exchange waits for ranks that raised), when the transfer fails, or after
        ``timeout`` seconds. ``what`` names the wait ("receiving ... from global rank 2")."""
        t0 = time.monotonic()
        prev, self.doing = self.doing, f"waiting: {what}"  # "waiting" marks a victim in `diagnose`
        if not sliced:
            try:
                self._wait_whole(work, what, peers, t0)
            finally:
                self.doing = prev
            return
        try:
            while True:
                try:
                    work.wait(datetime.timedelta(seconds=self.slice))
                    return
                except Exception as exc:  # noqa: BLE001
                    if not slice_timed_out(exc):
                        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                        # the group's own timeout (= `timeout`) may end the operation first
                        timed = "imed out" in first and time.monotonic() - t0 >= 0.9 * self.timeout
                        why = f"{what} failed after {time.monotonic() - t0:.1f} s ({first[:160]})"
                        raise self.error(self.diagnose(peers, why=why, timed_out=timed), what) from exc
                if self.failed.is_set():
                    if self.store_error is not None:
                        raise RankFailedError(
                            f"the rendezvous store stopped answering ({self.store_error}) while this rank "
                            f"({self.describe(self.rank)}) was {what}; the process that hosts it (torchrun's "
                            "agent, or global rank 0 when the process group was made without torchrun) "
                            "died or its host is down", failed={})
                    cause = self.cause()
                    if cause is not None and (not until_lost or cause.kind != "raised"):
                        raise self.error(cause, what)
                if time.monotonic() - t0 >= self.timeout:
                    raise self.error(self.diagnose(peers, why=f"{what} did not finish in {self.timeout:g} s",
                                                    timed_out=True), what)
        finally:
            self.doing = prev
