"""Fault injection for the failure protocol ([Note: failure protocol] in fxsplit.runtime.watch):
launch the quickstart GPT on 2 or 4 local gloo processes, break one rank at step 3, and measure
how every other rank ends. Used by ``benchmarks/faults.py`` (the whole matrix) and
``tests/test_faults.py`` (a few cases with a short timeout).

    row = run_case("tp2pp2-raise-loss", timeout=4.0)
    row["seconds"], row["named"], row["exit_codes"], row["hung"]

Cases are ``<layout>-<fault>``: layouts in :data:`LAYOUTS`, faults in :data:`FAULTS`: ``kill-F`` /
``kill-B`` (SIGKILL inside a forward / backward action), ``kill-generate`` (SIGKILL inside a forward
action of ``ParallelModel.generate``: survivors wait in its messages, collectives or the token's broadcast), ``stop`` (SIGSTOP inside a forward: the
process stays, silent), ``raise-loss`` (its loss_fn raises), ``raise-model`` (a forward action
raises), and for the cp layouts ``kill-cp`` (SIGKILL inside the context-parallel exchange of keys
and values: the ring's all-to-all or the all-gather, at its first call of the step). The launcher is :func:`run_case`: like torchrun it hosts the rendezvous store in the
parent (a killed rank 0 does not take the store with it) and gives each rank RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT (each rank a process forked from the test harness's forkserver); unlike torchrun it does not kill the other ranks when one exits, so it
measures how each survivor ends on its own. A SIGSTOPped rank is killed once every survivor exited.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import sys
import tempfile
import time

from fxsplit.testing.harness import rank_context

__all__ = ["FAULTS", "LAYOUTS", "cases", "run_case"]

LAYOUTS = {  # name -> (world size, parallelize options, fault rank, fault rank of raise-loss: one with the loss)
    "tp2pp2": (4, dict(tp=2, pp=2), 2, 2),
    "pp4": (4, dict(pp=4), 1, 3),
    "dp2pp2": (4, dict(dp=2, pp=2), 1, 1),
    "tp2dp2": (4, dict(tp=2, dp=2), 1, 1),
    "ds2pp2": (4, dict(dp_shard=2, pp=2), 1, 1),
    "zbv": (2, dict(pp=2, schedule="zbv"), 1, 0),
    "ep2": (2, dict(dp=2, ep=2), 1, 1),  # the zoo's MoE: a survivor waits in the experts' all-to-all
    "cp2ring": (2, dict(cp=2, cp_kv="ring"), 1, 1),  # a survivor waits in the ring exchange of K/V
    "cp2ag": (2, dict(cp=2, cp_kv="allgather"), 1, 1),  # a survivor waits in the all-gather of K/V
}


def fault_rank_of(case: str) -> int:
    layout, fault = case.split("-", 1)
    return LAYOUTS[layout][3] if fault == "raise-loss" else LAYOUTS[layout][2]
FAULTS = ("kill-F", "kill-B", "stop", "raise-loss", "raise-model")
FAULT_STEP = 3
_GENERATES = ("tp2pp2", "pp4", "dp2pp2", "zbv")  # the layouts whose kill-generate case benchmarks/faults.py runs


def cases() -> list[str]:
    return [f"{layout}-{fault}" for layout in LAYOUTS
            for fault in FAULTS + (("kill-cp",) if "cp" in LAYOUTS[layout][1] else ())
            + (("kill-generate",) if layout in _GENERATES else ())]


# -------------------------------------------------------------------------------------------- rank


def rank_main(case: str, timeout: float, out_dir: str) -> None:
    import torch

    from fxsplit.api.parallelize import parallelize
    from fxsplit.schedule.ir import ActionKind
    from fxsplit.testing.zoo import GPT, GPTConfig, cross_entropy_loss

    layout, fault = case.split("-", 1)
    world, options = LAYOUTS[layout][:2]
    fault_rank = fault_rank_of(case)
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=4, n_head=4, n_embd=64)
    torch.manual_seed(0)
    if options.get("ep", 1) > 1:
        from fxsplit.testing.zoo_moe import MoEConfig, MoEGPT

        cfg = MoEConfig(vocab_size=128, block_size=32)
        model = MoEGPT(cfg)
    else:
        model = GPT(cfg)
    step = [0]
    mine = rank == fault_rank

    def mark() -> None:  # the fault time, read by the launcher
        with open(os.path.join(out_dir, "fault"), "w") as f:
            f.write(repr(time.time()))

    def loss_fn(out, y):
        if mine and fault == "raise-loss" and step[0] == FAULT_STEP:
            mark()
            raise ValueError("the user's loss_fn failed on purpose")
        return cross_entropy_loss(out, y)

    dp = options.get("dp", 1) * options.get("dp_shard", 1)
    x = torch.randint(0, cfg.vocab_size, (4 * dp if dp > 1 else 8, cfg.block_size))
    # every rank computes the same plan: rank 0 verifies it (the default), the others do not repeat it
    pm = parallelize(model, (x[: len(x) // dp],), loss_fn=loss_fn, timeout=timeout, verify=None if rank == 0 else False,
                     microbatches=4 if options.get("pp", 1) > 1 else 2, **options)
    injected = contextlib.nullcontext()
    if mine and fault in ("kill-F", "kill-B", "stop", "raise-model", "kill-generate"):
        # fault injection as one action of this rank starts: F, or a backward (B or I)
        kinds = ({ActionKind.FORWARD} if fault in ("kill-F", "stop", "raise-model", "kill-generate")
                 else {ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT})

        def faulty(_step, action):
            if step[0] == FAULT_STEP and action.microbatch == 1 and action.kind in kinds:
                mark()
                if fault.startswith("kill"):
                    os.kill(os.getpid(), signal.SIGKILL)
                elif fault == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                else:
                    raise RuntimeError("the model failed on purpose in a forward action")

        injected = pm.runtime.probe(before=faulty)
    if mine and fault == "kill-cp":
        _kill_inside_cp_exchange(options.get("cp_kv"), step, mark)
    opt = torch.optim.SGD(pm.parameters(), lr=0.01)
    d = pm.coords.get("dp", 0) * options.get("dp_shard", 1) + pm.coords.get("dp_shard", 0)
    rows = len(x) // dp
    try:
        with injected:
            for step[0] in range(FAULT_STEP + 3):
                xb = x[d * rows: (d + 1) * rows]
                if fault == "kill-generate":  # killed in a forward action of the FAULT_STEP-th call
                    pm.generate(xb[:2, :8], max_new_tokens=4)
                    continue
                pm.step(xb, target=xb.roll(-1, 1))
                opt.step()
                opt.zero_grad()
        outcome = dict(kind="ok", text="")
    except Exception as exc:  # noqa: BLE001 -- what the survivor raised is the measurement
        outcome = dict(kind=type(exc).__name__, text=str(exc))
    outcome["t"] = time.time()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)
    if outcome["kind"] != "ok":
        raise SystemExit(1)


def _kill_inside_cp_exchange(kv: str | None, step: list[int], mark) -> None:
    """SIGKILL this rank at its first K/V exchange of step FAULT_STEP: the ring's (its exchange
    object) or the all-gather's (the collectives' all-gather, which the cp all-gather calls)."""
    from fxsplit.tp import collectives, ring

    owner, name = (ring._Exchange, "__call__") if kv == "ring" else (collectives, "_all_gather")
    original = getattr(owner, name)

    def faulty(*args, _original=original, **kwargs):
        if step[0] == FAULT_STEP:
            mark()
            os.kill(os.getpid(), signal.SIGKILL)
        return _original(*args, **kwargs)

    setattr(owner, name, faulty)


# -------------------------------------------------------------------------------------------- launch


def _rank_process(env: dict[str, str], case: str, timeout: float, out_dir: str) -> None:
    """One rank, as ``python -m fxsplit.testing.faults --rank-case ...`` runs it: its environment,
    stdout discarded, stderr to ``out_dir/stderr<rank>.txt``; exits 1 when it raised, the way an
    interpreter exits (below)."""
    import atexit
    import ctypes

    os.environ.update(env)
    with open(os.devnull, "w") as null, open(os.path.join(out_dir, f"stderr{env['RANK']}.txt"), "w") as err:
        os.dup2(null.fileno(), 1)
        os.dup2(err.fileno(), 2)
    code = 0
    try:
        rank_main(case, timeout, out_dir)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    # A forked child ends with os._exit, which skips what a survivor's exit must survive under
    # torchrun: Python's atexit hooks (fxsplit's watch threads stop there) and C's exit, whose
    # static destructors abort a process that left a C++ thread running (SIGABRT, "terminate
    # called without an active exception"). Both run here, as at the end of an interpreter.
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    ctypes.CDLL(None).exit(code)


def run_case(case: str, timeout: float) -> dict:
    import torch.distributed as dist

    layout, fault = case.split("-", 1)
    world = LAYOUTS[layout][0]
    fault_rank = fault_rank_of(case)
    out_dir = tempfile.mkdtemp(prefix=f"fxsplit-fault-{case}-")
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=600))
    # ranks fork from the test harness's forkserver (torch, fxsplit and what a first parallelize
    # imports, imported once: a fork, not an interpreter start-up of about 4 CPU-s per rank); each
    # rank is still a process of its own that nothing ends while it runs: a survivor exits on its
    # own, as under torchrun
    ctx = rank_context()
    procs = []
    for r in range(world):
        env = dict(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True",
                   OMP_NUM_THREADS="1")
        procs.append(ctx.Process(target=_rank_process, args=(env, case, timeout, out_dir), name=f"fxsplit-fault-rank{r}"))
        procs[-1].start()
    limit = time.time() + 240 + 4 * timeout
    exits: dict[int, tuple[int, float]] = {}
    survivors = [r for r in range(world) if r != fault_rank]
    while time.time() < limit and any(r not in exits for r in survivors):
        for r, p in enumerate(procs):
            if r not in exits and p.exitcode is not None:
                exits[r] = (p.exitcode, time.time())
        time.sleep(0.05)
    for r, p in enumerate(procs):
        if p.exitcode is None:
            if fault == "stop" and r == fault_rank:
                os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.join()
    fault_path = os.path.join(out_dir, "fault")
    t_fault = float(open(fault_path).read()) if os.path.exists(fault_path) else None
    hung = [r for r in survivors if r not in exits]
    outcomes = {}
    for r in survivors:
        path = os.path.join(out_dir, f"rank{r}.json")
        outcomes[r] = json.load(open(path)) if os.path.exists(path) else dict(kind="(none)", text="")
    named = all(f"global rank {fault_rank} " in o["text"] for o in outcomes.values())
    last = max((exits[r][1] for r in survivors if r in exits), default=float("nan"))
    return dict(case=case, fault_rank=fault_rank, seconds=(last - t_fault) if t_fault and not hung else None,
                exit_codes=[exits.get(r, (None,))[0] for r in survivors], hung=hung, named=named,
                kinds=sorted({o["kind"] for o in outcomes.values()}),
                sample=next(iter(outcomes.values()))["text"][:300], dir=out_dir)




if __name__ == "__main__":  # one rank of a case: python -m fxsplit.testing.faults --rank-case C --timeout T --out D
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--rank-case", required=True)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rank_main(a.rank_case, a.timeout, a.out)
