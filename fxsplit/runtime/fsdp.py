"""Sharded data parallelism on one rank: torch FSDP2 (``fully_shard``) over this rank's stage
modules, and the once-per-step gradient reduction a pipeline needs.

Terms as in :mod:`fxsplit.runtime.mesh` (d, s = dp_shard, p, t). A rank's stage modules are its
tensor-parallel shards (plain tensors: fxsplit's TP is in the graph, not DTensor); FSDP shards
each of them further, dim 0, over the s ranks of the ``dp_shard`` mesh axis, and with d > 1
replicates over ``dp`` (HSDP: a 2-D (dp, dp_shard) mesh; gradients are reduce-scattered over
dp_shard and all-reduced over dp, averaged over all d * s data-parallel ranks). With context
parallelism the shard dim is dp_shard x cp flattened and the sum is divided by d * s only ([Note:
FSDP over cp] in :mod:`fxsplit.runtime.mesh`).

    units = shard_stages({s: module, ...}, fsdp_mesh, mp_policy=policy)
    sync = ShardedGradSync(units)
    sync.begin()      # before the pipeline: all-gather every stage, no reduction per microbatch
    ... pipeline step (no FSDP collective runs inside it) ...
    sync.reduce()     # after it: one reduce-scatter (and dp all-reduce) per stage, reshard

[Note: FSDP units and reshard_after_forward]
A stage is one FSDP unit (``fully_shard`` on the stage module as a whole). FSDP2 gathers a unit's
parameters in the forward pre-hook of the module it wraps, but a stage graph reads parameters
with ``get_attr`` (torch.export) or calls only leaf modules (fx), never its layers as modules,
so per-layer units would never be gathered; the stage is the unit. ``reshard_after_forward`` is
False, as torchtitan chooses with pipeline parallelism: resharding after each microbatch's
forward would all-gather the stage again for every microbatch, forward and backward. Without a
pipeline the stage is the whole model, one unit, which is also the last one, and torchtitan keeps
the last unit unsharded after forward because backward needs it at once. Parameters and
gradients are therefore whole (this rank's tp shard) during a step and sharded between steps;
the optimizer state is sharded always.

[Note: FSDP collectives outside the pipeline]
No FSDP collective runs while the pipeline runs: :meth:`ShardedGradSync.begin` all-gathers every
stage before it (``unshard``) and turns off per-backward reduction (``set_requires_gradient_sync
(False)``, ``set_reshard_after_backward(False)``, ``set_is_last_backward(False)``, so gradients
accumulate unsharded over the microbatches, as torch.distributed.pipelining does); after it,
:meth:`ShardedGradSync.reduce` runs what torch's pipelining stage runs after the last backward
(``perform_reduce_grad``: post_backward of every param group, then the root's final callback):
one reduce-scatter per stage per step. The caller runs ``begin`` and ``reduce`` only after every
rank has agreed that no rank failed ([Note: failures] in :mod:`fxsplit.api.model`), so a
failed rank never leaves its dp_shard peers blocked in a collective it will not join.

[Note: mixed precision under FSDP]
With ``mp_policy`` FSDP does the parameter cast: it all-gathers in ``param_dtype`` (half the
bytes) and the stage computes on the gathered low-precision parameters; the casts the
mixed-precision pass put into the graph (``passes/mixed_precision.py``) then see a tensor that
already has ``param_dtype`` and are identities, so nothing is cast twice. Gradients are
accumulated over microbatches and reduced in ``reduce_dtype``; fxsplit's ``reduce_dtype=None``
means "the gradients' own dtype" (float32, the parameters' dtype), where FSDP's None would mean
``param_dtype``, so None is passed to FSDP as float32. FSDP does not cast forward inputs or
outputs (``cast_forward_inputs=False``, ``output_dtype=None``): the graph and the plan's boundary
dtypes already decide those ([Note: boundary dtypes] in :mod:`fxsplit.runtime.executor`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["ShardedGradSync", "fsdp_policy", "local_tensor", "shard_stages"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` when it is a DTensor (a view: in-place ops write through),
    else ``t`` itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def fsdp_policy(mp_policy: Any) -> Any:
    """The FSDP MixedPrecisionPolicy for fxsplit's ``mp_policy`` ([Note: mixed precision under
    FSDP]); None without one."""
    if mp_policy is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    reduce_dtype = mp_policy.reduce_dtype
    if reduce_dtype is None and mp_policy.param_dtype is not None:
        reduce_dtype = torch.float32
    return MixedPrecisionPolicy(param_dtype=mp_policy.param_dtype, reduce_dtype=reduce_dtype,
                                output_dtype=None, cast_forward_inputs=False)


def shard_stages(modules: Mapping[int, nn.Module], mesh: Any, *, mp_policy: Any = None,
                 ignored: Mapping[int, set] | None = None, divide_factor: int | None = None) -> dict[int, nn.Module]:
    """Wrap each stage module with ``fully_shard`` over ``mesh`` (1-D: dp_shard; 2-D (dp,
    dp_shard): HSDP; with cp, dp_shard x cp flattened: fxsplit.runtime.mesh.fsdp_mesh), one unit per
    stage ([Note: FSDP units and reshard_after_forward]); the modules are changed in place (their
    parameters become DTensor shards) and returned. ``ignored[s]``: parameters of stage s FSDP leaves
    whole and unreduced (expert weights placed by ep). ``divide_factor``: what the summed gradients are
    divided by instead of the mesh's size (the data ranks under cp, [Note: FSDP over cp] in
    fxsplit.runtime.mesh); the reductions then sum and divide after (no averaging op, which not every
    backend has for a factor of its own)."""
    from torch.distributed.fsdp import fully_shard

    policy = fsdp_policy(mp_policy)
    out = {}
    for s, module in modules.items():
        kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": False}
        if policy is not None:
            kwargs["mp_policy"] = policy
        if ignored and ignored.get(s):
            kwargs["ignored_params"] = set(ignored[s])
        out[s] = fully_shard(module, **kwargs)
        if divide_factor is not None:
            out[s].set_gradient_divide_factor(float(divide_factor))
            out[s].set_force_sum_reduction_for_comms(True)
    return out


class ShardedGradSync:
    """The FSDP side of one training step over the stage units of this rank ([Note: FSDP
    collectives outside the pipeline])."""

    def __init__(self, units: Mapping[int, nn.Module]):
        self.units = dict(units)
        self._gathered = False

    def begin(self) -> None:
        """All-gather every stage and accumulate gradients unsharded until :meth:`reduce`."""
        from torch.distributed.fsdp import fully_shard

        for m in self.units.values():
            # what the unit's forward pre-hook does first; a stage run as graphs ([Note: graph split
            # backward] in fxsplit.runtime.compile.split_graph) never calls the module, so never that hook
            fully_shard.state(m)._lazy_init()
            m.set_is_last_backward(False)
            m.set_reshard_after_backward(False)
            m.set_requires_gradient_sync(False)
        self.gather()

    def gather(self) -> None:
        """All-gather every stage's parameters (collective over the FSDP mesh)."""
        for m in self.units.values():
            m.unshard()
        self._gathered = True

    def reshard(self) -> None:
        """Free the gathered parameters (after inference); no collective."""
        for m in self.units.values():
            m.reshard()
        self._gathered = False

    def reduce(self) -> None:
        """Reduce-scatter (and with HSDP all-reduce) each stage's accumulated gradients into its
        sharded parameters' ``.grad`` and reshard: torch.distributed.pipelining's
        ``perform_reduce_grad``. Collective over the FSDP mesh, stage by stage in index order."""
        from torch.distributed.fsdp import fully_shard

        for s in sorted(self.units):
            m = self.units[s]
            m.set_is_last_backward(True)
            m.set_reshard_after_backward(True)
            m.set_requires_gradient_sync(True)
            state = fully_shard.state(m)
            for st in state._state_ctx.all_states:
                for group in _param_groups(st):
                    group.post_backward()
            state._root_post_backward_final_callback()
            m.reshard()  # a stage without a gradient this step is gathered still
        self._gathered = False


def _param_groups(state: Any) -> list:
    """The parameter groups of one FSDP state: torch 2.13's ``FSDPState`` holds a list of them
    (``_fsdp_param_groups``), torch 2.11's one group or None (``_fsdp_param_group``)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]
