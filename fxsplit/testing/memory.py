"""Measured tensor memory on any device, CPU included: :class:`LiveBytes`.

torch has allocator statistics for CUDA (``torch.cuda.max_memory_allocated``) but none for the
CPU, and ``saved_tensors_hooks`` see only what autograd saves outside ``torch.utils.checkpoint``
(a checkpoint keeps its inputs, and a selective checkpoint its cached outputs, out of their
sight). ``LiveBytes`` is a ``TorchDispatchMode`` that sees every op: it counts the bytes of each
new storage an op returns until that storage is freed (a storage's Python object lives exactly
as long as the storage), so ``live`` is what the ops run under it still hold, and ``peak`` its
maximum. An output on the storage of one of the op's inputs (a view, an in-place result) is not
a new allocation and is not counted (so a view of a parameter does not count it); memory
allocated outside the dispatcher (a collective's internal buffers) is not seen.

    with LiveBytes() as mem:
        loss = pm.step(x, target=y)
    mem.peak, mem.live          # bytes
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fxsplit.schedule.ir import ActionKind

__all__ = ["LiveBytes", "LAYOUTS", "case_model", "cases", "measure_case", "measured_step_peak", "plan_options"]


class LiveBytes(TorchDispatchMode):
    """Live and peak bytes of the storages ops allocate while the mode is on (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def _free(self, ptr: int, nbytes: int) -> None:
        self.live -= nbytes
        self._sizes.pop(ptr, None)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {_ptr(t) for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and not t.is_meta}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta and _ptr(t):
                st = t.untyped_storage()
                ptr, nbytes = st.data_ptr(), st.nbytes()
                if ptr and nbytes and ptr not in self._sizes and ptr not in inputs:
                    self._sizes[ptr] = nbytes
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(st, self._free, ptr, nbytes)
        return out


def _ptr(t: torch.Tensor) -> int:
    """The data pointer of ``t``'s storage; 0 for one without readable data (a storage FSDP
    freed to size 0, an empty tensor's)."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return 0


def local_bytes(tensors: Any) -> int:
    """Bytes of the distinct tensors in ``tensors`` as this rank stores them (a DTensor's local
    shard; a tensor listed twice, as a tied Parameter can be, once)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        seen[id(t)] = local.nbytes
    return sum(seen.values())


def fsdp_gathered_bytes(pm: Any) -> int:
    """Bytes of FSDP's unsharded parameter storages of ``pm`` (a ``ParallelModel``) now: FSDP2
    allocates and frees them by resizing a storage in place (``untyped_storage().resize_``), which
    no dispatcher mode sees, so ``LiveBytes`` misses them; read them off FSDP's own records."""
    total = 0
    for m in pm.runtime.modules.values():  # instrumentation only
        state = getattr(m, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        for fp in (group.fsdp_params if group is not None else ()):
            t = getattr(fp, "_unsharded_param", None)
            total += t.untyped_storage().nbytes() if t is not None else 0
    return total


def measured_step_peak(pm: Any, opt: torch.optim.Optimizer, *args: Any, target: Any = None,
                       parts: dict | None = None) -> int:
    """The most tensor bytes this rank holds during ``pm.step(*args, target=target)`` and
    ``opt.step()``: the parameters and optimizer state held before (run one step first, so the
    state exists, and set the gradients to None), plus the peak of what the ops allocate
    (``LiveBytes``: activations, gradients, messages, buckets), plus, under FSDP, the gathered
    parameters read as each backward starts (``fsdp_gathered_bytes``). The measured side of
    ``Plan.memory()``'s ``peak`` (benchmarks/memory_truth.py). ``parts``, when given, receives
    the three terms (``held``, ``ops``, ``gathered``)."""
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim()]
    held = local_bytes(pm.parameters()) + local_bytes(state)
    gathered = [0]

    def backward_starts(step: Any, action: Any) -> None:
        if action.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT):
            gathered[0] = max(gathered[0], fsdp_gathered_bytes(pm))

    with pm.runtime.probe(before=backward_starts), LiveBytes() as mem:
        pm.step(*args, target=target)
        opt.step()
    if parts is not None:
        parts.update(held=held, ops=mem.peak, gathered=gathered[0])
    return held + mem.peak + gathered[0]


# The layouts of benchmarks/memory_truth.py (and of its subset in tests/test_memory_truth_dist.py):
# each without and with full activation checkpointing, and with mp_policy bf16 (parameters
# float32, compute bfloat16, gradients reduced in float32).
BF16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
LAYOUTS = {
    "tp2xpp2": dict(tp=2, pp=2, microbatches=4),
    "interleaved": dict(pp=4, schedule="interleaved_1f1b", stages_per_rank=2, microbatches=8),
    "zbv": dict(pp=4, schedule="zbv", microbatches=8),
    "dp_shard2xpp2": dict(dp_shard=2, pp=2, microbatches=4),
}
CKPT = ("none", "full")


def cases(names: Any, bf16: bool = True) -> dict[str, dict]:
    """Label -> ``parallelize`` options for each layout of ``names`` (keys of ``LAYOUTS``)."""
    out = {}
    for name in names:
        for ckpt in CKPT:
            out[f"{name} ckpt={ckpt}"] = dict(LAYOUTS[name], activation_checkpointing=ckpt)
        if bf16:
            out[f"{name} bf16"] = dict(LAYOUTS[name], mp_policy="bf16")
    return out


def _options(options: dict) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    out = dict(options)
    if out.get("mp_policy") == "bf16":
        out["mp_policy"] = MixedPrecisionPolicy(**BF16)
    return out


def case_model(gpt: dict, batch: int) -> tuple[torch.nn.Module, tuple]:
    """``(model, example_args)``: the zoo GPT :func:`measure_case` measures (``gpt``: its config, ``batch``
    samples per replica)."""
    from fxsplit.testing import zoo

    model, ex, _ = zoo.make("gpt", batch_size=batch, **gpt)
    return model, ex


def plan_options(options: dict, batch: int) -> dict:
    """The keywords :func:`measure_case` plans a case's ``options`` with (``parallelize``'s, loss and timeout
    aside): ``SharedPlans.add``'s, to plan the case before a launch's ranks fork."""
    from fxsplit.hardware import Hardware

    replicas = options.get("dp", 1) * options.get("dp_shard", 1)
    return dict(verify=False, hardware=Hardware.cpu(), global_batch_size=batch * replicas, **_options(options))


def measure_case(options: dict, gpt: dict, batch: int, built: tuple | None = None) -> tuple[float, float, dict]:
    """On one rank of a launch: (measured, predicted) peak bytes of this rank for the zoo GPT
    (``gpt``: its config, ``batch`` samples per replica) planned with ``options`` (one warm-up
    step, one measured: ``measured_step_peak`` against ``Plan.memory()``), and both sides' terms.
    ``built``: :func:`case_model`'s ``(model, example_args)`` to plan (one planned before the fork)."""
    from fxsplit.api.parallelize import parallelize
    from fxsplit.testing import zoo

    torch.manual_seed(0)
    model, ex = case_model(gpt, batch) if built is None else built
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, gpt["vocab_size"], ex[0].shape, generator=g)
    y = torch.randint(0, gpt["vocab_size"], ex[0].shape, generator=g)
    pm = parallelize(model, ex, loss_fn=zoo.cross_entropy_loss, timeout=120, **plan_options(options, batch))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=False)
    pm.step(x, target=y)  # creates the AdamW state
    opt.step()
    opt.zero_grad(set_to_none=True)
    parts: dict = {}
    measured = measured_step_peak(pm, opt, x, target=y, parts=parts)
    opt.zero_grad(set_to_none=True)
    pred = pm.plan.memory()[pm.coords["pp"]]
    return float(measured), float(pred.peak), dict(measured=parts, predicted=pred.as_dict())
