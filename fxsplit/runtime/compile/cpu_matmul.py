"""fp32 matrix multiplications of a CPU stage graph through oneDNN where it is faster than the
BLAS aten calls ([Note: CPU matmuls through oneDNN]).

Terms: **route** -- replace a graph's ``aten.mm`` / ``aten.addmm`` nodes by ``fxsplit::onednn_mm``
(same math, one call of oneDNN's matmul); **probe** -- one timing, per process, of both on a
fixed shape (reported, never deciding).

    min_macs = onednn_min_macs()             # None: keep aten (FXSPLIT_CPU_MATMUL, the host)
    if min_macs is not None:
        n = route_cpu_matmuls(gm, min_macs)   # before the graph is compiled

[Note: CPU matmuls through oneDNN]
torch's CPU wheel sends an fp32 ``aten.mm`` / ``addmm`` to MKL's sgemm. MKL picks its kernels by
CPU vendor, not by instruction set: on AMD hosts it runs a generic path (``MKL_VERBOSE=1`` names
no AVX-512 there) although the core has AVX-512, so a (256 x 256) @ (256 x 1024) product takes
1.4-1.7 ms on one core of an AMD EPYC host where oneDNN, which ships in the same wheel and
dispatches on the instruction set, takes 0.6 ms (oneDNN 0.44-0.67x MKL's time on every F, I and W
product of the pipeline benchmark's GPT: ``python benchmarks/cpu_matmul.py``, its table in
benchmarks/README). torch has no switch for this:
``torch.backends.mkldnn.matmul.fp32_precision`` sends fp32 matmuls to oneDNN only when it may
lower their precision (tf32 / bf16), and inductor lowers oneDNN's linear only for constant
(frozen) weights, never for training. So compiled stage graphs ([Note: compiled stages]) route
their fp32 CPU matmuls through ``fxsplit::onednn_mm``, an operator of ours whose kernel is one
call of ``torch.ops.mkldnn._linear_pointwise`` (oneDNN's matmul with an optional bias; inductor
calls it as an opaque kernel, fusing around it as around aten's), when
- ``FXSPLIT_CPU_MATMUL`` is ``onednn``, or it is ``auto`` (the default) and this is the case
  above: torch's BLAS is MKL, the machine x86-64 and its CPU vendor not GenuineIntel (an Intel
  host, where MKL runs its own AVX-512 kernels, keeps MKL); ``aten`` never routes. ``auto`` is
  a fact of the host, not a timing, so every rank of a host decides alike (tp ranks computing a
  replicated value must round alike, or replicated parameters drift apart); the probe (one
  timing of both on a fixed shape) is only reported, by benchmarks/pipeline_vs_ptd.py and
  benchmarks/cpu_matmul.py;
- the node is ``aten.mm(a, b)`` or ``aten.addmm(bias, a, b)`` (beta = alpha = 1, a 1-d bias of
  the output's width) on 2-d float32 CPU tensors of static, non-zero sizes, and (under ``auto``)
  its m * k * n is at least `MIN_MACS`: a oneDNN call costs 13-23 us of its own here, so below
  about 64 x 128 x 128 MKL's generic path is still the faster (benchmarks/cpu_matmul.py
  ``--small``); ``onednn`` routes every such matmul whatever its size.
Numerics: the same product accumulated in another order, equal to MKL's to rounding (about 6e-7
relative here), as every compiled graph is to its eager one. Eager graphs are never routed: the
graph split promises autograd's gradients bit for bit ([Note: graph split backward]).
"""

from __future__ import annotations

import functools
import platform
import time

import torch
import torch.fx as fx

from fxsplit.config import cpu_matmul_from_env

__all__ = ["MIN_MACS", "mkl_on_non_intel_x86", "onednn_matmul_chosen", "onednn_min_macs", "onednn_mm", "probe",
           "route_cpu_matmuls"]

MIN_MACS = 128**3  # under auto: the smallest m * k * n routed (2.1e6; the gain starts near 1e6)

_LIB = torch.library.Library("fxsplit", "FRAGMENT")
_LIB.define("onednn_mm(Tensor a, Tensor b, Tensor? bias=None) -> Tensor")


def _onednn_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # oneDNN's linear computes a @ w.T + bias for w of shape (n, k): w = b.T (a view, any strides)
    return torch.ops.mkldnn._linear_pointwise(a, b.t(), bias, "none", [], "")


def _onednn_mm_fake(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]))


_LIB.impl("onednn_mm", _onednn_mm, "CPU")
torch.library.register_fake("fxsplit::onednn_mm", _onednn_mm_fake, lib=_LIB)
onednn_mm = torch.ops.fxsplit.onednn_mm.default


@functools.cache
def probe() -> tuple[bool, str]:
    """(oneDNN at most 0.8x aten's time on a (256 x 256) @ (256 x 1024) fp32 product with this
    process's threads, what was measured): reported by the benchmarks, never deciding."""
    if not torch.backends.mkldnn.is_available():
        return False, "torch is built without oneDNN"
    a, b = torch.randn(256, 256), torch.randn(256, 1024)

    def best(fn) -> float:
        fn()  # the first call builds oneDNN's primitive
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    aten_s, dnn_s = best(lambda: torch.mm(a, b)), best(lambda: _onednn_mm(a, b))
    return dnn_s <= 0.8 * aten_s, f"oneDNN {dnn_s * 1e3:.2f} ms, aten {aten_s * 1e3:.2f} ms"


@functools.cache
def mkl_on_non_intel_x86() -> bool:
    """Whether torch's fp32 matmuls go to MKL on an x86-64 CPU that is not Intel's (Linux:
    ``vendor_id`` in /proc/cpuinfo; False where that cannot be read)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or "BLAS_INFO=mkl" not in torch.__config__.show():
        return False
    try:
        with open("/proc/cpuinfo") as f:
            vendor = next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), None)
    except OSError:
        return False
    return vendor is not None and vendor != "GenuineIntel"


def onednn_min_macs() -> int | None:
    """The smallest m * k * n a compiled CPU graph routes through oneDNN ([Note: CPU matmuls
    through oneDNN]), or None: none. ``FXSPLIT_CPU_MATMUL`` = ``onednn``: 0 (every one); ``aten``:
    None; ``auto`` (default): `MIN_MACS` with MKL on a non-Intel x86-64 CPU, else None."""
    mode = cpu_matmul_from_env()
    if not torch.backends.mkldnn.is_available() or mode == "aten":
        return None
    if mode == "onednn":
        return 0
    return MIN_MACS if mkl_on_non_intel_x86() else None


def onednn_matmul_chosen() -> bool:
    """Whether compiled CPU graphs route any fp32 matmul through oneDNN (`onednn_min_macs`)."""
    return onednn_min_macs() is not None


def _cpu_fp32_2d(n: object) -> torch.Tensor | None:
    """The fake value of ``n`` if it is a 2-d float32 CPU tensor of static non-zero sizes."""
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    ok = (isinstance(v, torch.Tensor) and v.dim() == 2 and v.dtype == torch.float32 and v.device.type == "cpu"
          and all(isinstance(d, int) and d > 0 for d in v.shape))
    return v if ok else None


def _routable(n: fx.Node, min_macs: int) -> bool:
    if n.target is torch.ops.aten.mm.default:
        if len(n.args) != 2 or n.kwargs:
            return False
        a, b = n.args
    elif n.target is torch.ops.aten.addmm.default:
        if len(n.args) != 3 or n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1:
            return False
        bias, a, b = n.args
        bv = bias.meta.get("val") if isinstance(bias, fx.Node) else None
        bv2 = _cpu_fp32_2d(b)
        if not (isinstance(bv, torch.Tensor) and bv.dtype == torch.float32 and bv.dim() == 1 and bv2 is not None
                and bv.shape[0] == bv2.shape[1]):
            return False
    else:
        return False
    av, bv = _cpu_fp32_2d(a), _cpu_fp32_2d(b)
    return av is not None and bv is not None and av.shape[0] * av.shape[1] * bv.shape[1] >= min_macs


def route_cpu_matmuls(gm: fx.GraphModule, min_macs: int = MIN_MACS) -> int:
    """Replace ``gm``'s fp32 CPU ``mm`` / ``addmm`` nodes of at least ``min_macs`` multiply-adds
    by ``fxsplit::onednn_mm`` ([Note: CPU matmuls through oneDNN]), in place; how many."""
    count = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or not _routable(n, min_macs):
            continue
        args = n.args if n.target is torch.ops.aten.mm.default else (n.args[1], n.args[2], n.args[0])
        with gm.graph.inserting_after(n):
            new = gm.graph.call_function(onednn_mm, tuple(args))
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
