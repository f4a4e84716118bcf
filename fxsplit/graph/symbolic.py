"""Fake propagation that keeps symbolic sizes on every supported torch.

[Note: symbolic matmul on torch 2.11]
torch 2.11's C++ matmul (which ``F.linear`` on a 3-D input and ``@`` reach) calls ``numel()`` on its
input, which a fake tensor of symbolic sizes refuses, or, through ``nn.Linear`` with no bias, fixes
the batch and sequence symbols to the example's sizes: the trace came out static in both, and the
plan refused any other microbatch size (seen on the GPU machines' torch 2.11, gpu-check
2026-12-04; torch 2.13 keeps the symbols). torch.export is not affected: it decomposes matmul in
Python (``torch._decomp.decompositions.matmul``). So where a probe shows the C++ matmul losing the
symbols, fake propagation routes ``torch.matmul`` / ``@`` / ``F.linear`` (and their ATen overloads
``aten.matmul`` / ``aten.linear``, which an exported graph calls) through that same Python
decomposition (a torch function mode; the result's shapes and dtype are the C++ kernel's). A 3-D
sdpa (no heads dim) reaches that matmul inside its C++ math kernel, which no mode sees: it runs as
4-D with one head, which 2.11's kernel choice keeps symbolic. Passes that run a graph's ops again
on its fake tensors (context parallelism's local shapes, mixed precision) do so inside
``keeping_symbols()`` (also exported by ``fxsplit.graph.meta``), the same mode: without it, 2.11
fixed the batch symbol of the trace's shape environment to the example's size for every later
plan from that trace (a second plan from a shared trace found the symbol gone).
"""

from __future__ import annotations

import contextlib
import functools

import torch

__all__ = ["keeping_symbols"]


def keeping_symbols() -> contextlib.AbstractContextManager:
    """A context for running ops on fake tensors of symbolic sizes that keeps the symbols: where this
    torch's C++ matmul loses them (torch 2.11), ``matmul`` / ``@`` / ``linear`` (``torch`` and
    ``aten``) and 3-D sdpa run through torch's Python decomposition; elsewhere a no-op."""
    return contextlib.nullcontext() if _matmul_keeps_symbols() else _PythonMatmul()


@functools.lru_cache(maxsize=None)
def _matmul_keeps_symbols() -> bool:
    """Whether this torch's matmul keeps a symbolic batch of a 3-D fake input (probed once)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.DYNAMIC, DimDynamic.STATIC])
    x = mode.from_tensor(torch.empty(4, 8, 16), symbolic_context=ctx)
    try:
        with mode:
            out = torch.nn.functional.linear(x, torch.empty(32, 16))
    except Exception:  # noqa: BLE001 -- torch 2.11: "Cannot call numel() on tensor with symbolic sizes"
        return False
    return not mode.shape_env.replacements and not isinstance(out.shape[0], int)


class _PythonMatmul(torch.overrides.TorchFunctionMode):
    """``torch.matmul``, ``@`` and ``F.linear`` through torch's Python matmul decomposition
    ([Note: symbolic matmul on torch 2.11])."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch._decomp.decompositions import matmul

        kwargs = kwargs or {}
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.ops.aten.matmul.default) \
                and not kwargs:
            return matmul(*args)
        if func in (torch.nn.functional.linear, torch.ops.aten.linear.default):
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            out = matmul(x, weight.t())
            return out if bias is None else out + bias
        if func in _SDPA and isinstance(args[0], torch.Tensor) and args[0].dim() == 3:
            # a 3-D sdpa runs its math kernel through the C++ matmul: as 4-D (one head), the same shapes
            q, k, v, *rest = args
            rest = list(rest)
            mask = rest[0] if rest else kwargs.get("attn_mask")
            if isinstance(mask, torch.Tensor) and mask.dim() == 3:
                mask = mask.unsqueeze(-3)
            if rest:
                rest[0] = mask
            elif "attn_mask" in kwargs:
                kwargs = {**kwargs, "attn_mask": mask}
            return func(q.unsqueeze(-3), k.unsqueeze(-3), v.unsqueeze(-3), *rest, **kwargs).squeeze(-3)
        return func(*args, **kwargs)


_SDPA = (torch.nn.functional.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention,
         torch.ops.aten.scaled_dot_product_attention.default)
