"""``Hardware.measure()``: profile this machine in about a second and cache it as JSON.

Terms:
    budget: the seconds one local timing loop may run (``budget_s``); a loop keeps the fastest
        repetition, the least disturbed by other processes.
    collective loops: under a process group every rank runs the same fixed number of repetitions
        (a loop bounded by time could run a different count on each rank and hang).

Signature::

    measure(cls, *, cache, budget_s) -> Hardware

[Note: what measure() measures]
Matmul: square ``n x n`` matmuls (``2 n^3`` FLOPs), fp32 always and bf16 when the device runs it;
the fp32 rate becomes ``flops_per_s`` (the default dtype is what an unsplit model runs in here).
Memory: one large ``copy_`` (``2 x nbytes``: read and write). Both are achievable rates, so the
peaks equal them and the efficiencies are 1. Links, only under ``torch.distributed``: rank 0 <-> 1
ping-pong over the current backend (one-way time = round trip / 2) and an all-reduce over the whole
group, each at a few message sizes, least-squares fitted to ``t = alpha + bytes / bw`` and to the
ring form of [Note: collective time formulas]. Rank 0's figures are broadcast so every rank returns
the same Hardware. Without a process group no link is measured: the link fields keep Hardware's
defaults and ``source`` says so (a 2-process gloo measurement is not started behind the caller).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fxsplit.config import cache_dir_from_env

__all__ = ["measure", "cache_key", "cache_file"]

CACHE_FORMAT = 1
_P2P_SIZES = (1 << 10, 1 << 16, 1 << 20, 1 << 22)  # bytes
_COLLECTIVE_REPS = 5


def cache_key(device: str, dist_info: dict[str, Any] | None) -> dict[str, Any]:
    """What a cached measurement is valid for: host, device, torch version, process group."""
    import torch

    return {"format": CACHE_FORMAT, "host": platform.node(), "device": device,
            "torch": torch.__version__, "dist": dist_info}


def cache_file(key: dict[str, Any]) -> Path:
    """The JSON file for ``key`` under ``FXSPLIT_CACHE_DIR`` (default ``~/.cache/fxsplit``)."""
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    host = "".join(c if c.isalnum() or c in "-_." else "_" for c in key["host"])[:40] or "host"
    return cache_dir_from_env() / f"hardware-{host}-{digest}.json"


def _read(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("hardware"), dict):
        return None  # another key hashed here, or an older format: measure again
    return data["hardware"]


def _write(path: Path, key: dict[str, Any], fields: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "hardware": fields}, indent=1, sort_keys=True))
        os.replace(tmp, path)  # atomic: ranks on one host write the same content
    except OSError:
        pass  # a read-only home is no reason to fail; the next call measures again


def _best_time(fn: Callable[[], Any], sync: Callable[[], None], budget_s: float, max_reps: int = 50) -> float:
    """The fastest of repeated runs of ``fn`` within ``budget_s`` (after one warm-up)."""
    fn()
    sync()
    best, start = math.inf, time.perf_counter()
    for _ in range(max_reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return max(best, 1e-9)


def _matmul_rate(torch: Any, device: Any, dtype: Any, n: int, sync: Callable[[], None], budget_s: float) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / _best_time(lambda: torch.mm(a, b), sync, budget_s)


def _bf16_runs(torch: Any, device: Any) -> bool:
    try:
        x = torch.ones(8, 8, device=device, dtype=torch.bfloat16)
        return bool(torch.isfinite(torch.mm(x, x)).all())
    except (RuntimeError, TypeError):
        return False


def _memory_capacity(torch: Any, device: Any) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return math.inf


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``t = alpha + size * slope``; returns (alpha >= 0, slope > 0)."""
    n = len(sizes)
    mx, mt = sum(sizes) / n, sum(times) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (t - mt) for x, t in zip(sizes, times)) / sxx if sxx > 0 else 0.0
    if not slope > 0:  # noise swamped the size dependence: charge everything to bandwidth
        slope = max(times[-1], 1e-12) / sizes[-1]
    return max(mt - slope * mx, 0.0), slope


def _measure_links(torch: Any, dist: Any, comm_device: Any, sync: Callable[[], None]) -> dict[str, Any]:
    """p2p (rank 0 <-> 1) and all-reduce fits; fixed repetition counts on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, platform.node())
    single_node = len(set(hosts)) == 1
    out: dict[str, Any] = {"devices_per_node": sum(h == hosts[0] for h in hosts)}
    if world < 2:
        return out
    p2p_times = []
    for size in _P2P_SIZES:
        buf = torch.zeros(size // 4, dtype=torch.float32, device=comm_device)
        best = math.inf
        for rep in range(_COLLECTIVE_REPS + 1):  # the first round trip is a warm-up
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            sync()
            if rep:
                best = min(best, (time.perf_counter() - t0) / 2)
        p2p_times.append(best)
    ar_times = []
    for size in _P2P_SIZES:
        buf = torch.zeros(size // 4, dtype=torch.float32, device=comm_device)
        best = math.inf
        for rep in range(_COLLECTIVE_REPS + 1):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            sync()
            if rep:
                best = min(best, time.perf_counter() - t0)
        ar_times.append(best)
    alpha, slope = fit_alpha_beta(_P2P_SIZES, p2p_times)
    scope = "intra_node" if hosts[0] == hosts[1] else "inter_node"
    out[f"{scope}_latency_s"], out[f"{scope}_bytes_per_s"] = alpha, 1.0 / slope
    out["link_bytes_per_s"] = 1.0 / slope
    if single_node:  # no second node to measure: the inter-node pair is the one measured
        out["inter_node_latency_s"], out["inter_node_bytes_per_s"] = alpha, 1.0 / slope
    # ring all-reduce: t = 2(n-1) alpha + 2(n-1)/n * bytes / bw
    a_ar, s_ar = fit_alpha_beta(_P2P_SIZES, ar_times)
    out["ring_latency_s"] = a_ar / (2 * (world - 1))
    out["ring_bytes_per_s"] = 2 * (world - 1) / (world * s_ar)
    out["ring_intra_node"] = single_node
    out["_link_note"] = (f"links measured over {dist.get_backend()} on {world} ranks "
                         f"({'one host' if single_node else f'{len(set(hosts))} hosts'})")
    return out


def measure(cls: type, *, cache: bool, budget_s: float) -> Any:
    """See :meth:`fxsplit.hardware.Hardware.measure`."""
    import torch
    import torch.distributed as dist

    on_dist = dist.is_available() and dist.is_initialized()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else f"cpu:{platform.processor() or platform.machine()}:{os.cpu_count()}")
    dist_info = {"backend": str(dist.get_backend()), "world_size": dist.get_world_size()} if on_dist else None
    key = cache_key(device_name, dist_info)
    path = cache_file(key)
    cached = _read(path, key) if cache else None
    comm_device = device if on_dist and dist_info["backend"] == "nccl" else torch.device("cpu")
    if on_dist:  # every rank takes the same branch, or the measuring ones would wait forever
        hit = torch.tensor([1 if cached is not None else 0], device=comm_device)
        dist.all_reduce(hit, op=dist.ReduceOp.MIN)
        if int(hit.item()) == 0:
            cached = None
        else:  # ranks on other hosts read other files: rank 0's copy wins, as on a fresh measure
            box = [cached]
            dist.broadcast_object_list(box, src=0)
            cached = box[0]
    if cached is not None:
        return cls.from_dict(cached)

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    n = 4096 if device.type == "cuda" else 512
    fp32 = _matmul_rate(torch, device, torch.float32, n, sync, budget_s)
    bf16 = _matmul_rate(torch, device, torch.bfloat16, n if device.type == "cuda" else 256, sync, budget_s) \
        if _bf16_runs(torch, device) else None
    numel = (64 << 20) if device.type == "cuda" else (8 << 20)  # float32 elements: 256 MB / 32 MB
    src = torch.ones(numel, device=device)
    dst = torch.empty_like(src)
    mem = 2 * src.numel() * src.element_size() / _best_time(lambda: dst.copy_(src), sync, budget_s)
    del src, dst
    fields: dict[str, Any] = dict(
        name=f"measured:{device_name}", flops_per_s=fp32, peak_fp32_flops_per_s=fp32,
        peak_bf16_flops_per_s=bf16 if bf16 is not None else fp32, bytes_per_s=mem,
        memory_bytes=_memory_capacity(torch, device), compute_dtype="fp32",
        devices_per_node=torch.cuda.device_count() if device.type == "cuda" else 1,
    )
    note = "links not measured (no process group): Hardware defaults"
    if on_dist:
        links = _measure_links(torch, dist, comm_device, sync if comm_device.type == "cuda" else (lambda: None))
        note = links.pop("_link_note", note)
        fields.update(links)
    fields["source"] = (f"Hardware.measure() on {platform.node()} ({device_name}, torch {torch.__version__}); "
                        f"bf16 {'measured' if bf16 is not None else 'unsupported: fp32 rate'}; {note}")
    if on_dist:
        box = [fields]
        dist.broadcast_object_list(box, src=0)
        fields = box[0]
    hw = cls.from_dict(fields)
    _write(path, key, hw.to_dict())
    return hw
