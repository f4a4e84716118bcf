"""Deferred code generation for a traced graph module ([Note: lazy recompile]).

    gm = lazily_recompiled(ep.module())   # gm.recompile() from now on only marks the code stale
    gm.graph ...                          # passes edit the graph and call gm.recompile() freely
    gm.code, gm(*args)                    # the first use generates the code, once

[Note: lazy recompile]
``GraphModule.recompile()`` turns the whole graph into Python source and compiles it: ~0.45 s for
a Llama-70B graph (5.6k nodes) here, and planning recompiles the traced graph after its own edits,
in the tensor-parallel pass and after every pass of the ``PassManager``, while nothing reads the
code until a user prints it or runs the graph (the stages are separate modules). torch has the
mechanism, ``torch.fx._lazy_graph_module._LazyGraphModule`` (inductor's passes use it the same
way): ``recompile()`` marks the code stale, and ``code``, ``str``, pickling and the forward
generate it first. ``torch.export``'s ``ep.module()`` builds a plain module, so its per-instance
class is swapped for one that puts ``_LazyGraphModule`` first; nothing else of the module changes.
The class is private, so this falls back to eager recompiles (identical behaviour, slower) where a
torch release lacks it.
"""

from __future__ import annotations

import torch.fx

try:  # private in torch; see the note
    from torch.fx._lazy_graph_module import _LazyGraphModule
except ImportError:  # pragma: no cover - a torch without it: recompiles stay eager
    _LazyGraphModule = None

__all__ = ["lazily_recompiled"]


def lazily_recompiled(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` itself, from now on generating its code at first use instead of at each
    ``recompile()``; returns ``gm`` unchanged where it already does or torch cannot."""
    if _LazyGraphModule is None or isinstance(gm, _LazyGraphModule):
        return gm
    cls = type(gm)  # GraphModule's own per-instance class (GraphModule.__new__): gm's alone
    for name in ("__call__", "_wrapped_call"):  # its eager recompile's call wrapper would call
        if name in vars(cls):                   # the new class's wrapper back, for ever
            delattr(cls, name)
    # named like GraphModule's per-instance classes, so that a deepcopy makes its own
    gm.__class__ = type("GraphModuleImpl", (_LazyGraphModule, cls), {"__module__": cls.__module__})
    gm.recompile()
    return gm
