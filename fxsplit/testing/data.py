"""Feeding data-parallel replicas in tests: each replica trains on its own slice of one global
batch, so only a correct data-parallel mean of the gradients reproduces one process on the whole
batch (a test that gives every replica the same batch cannot tell a mean from a sum or from no
reduction at all)."""

from typing import Any

import torch

from fxsplit.errors import UsageError


def replica_index(pm: Any) -> tuple[int, int]:
    """(this rank's data-parallel replica, the number of replicas) of a ParallelModel: replica
    ``coords["dp"] * dp_shard + coords["dp_shard"]`` of ``dp * dp_shard`` (the README's order)."""
    config = pm.plan.config
    return pm.coords.get("dp", 0) * config.dp_shard + pm.coords.get("dp_shard", 0), config.dp * config.dp_shard


def replica_slice(pm: Any, t: torch.Tensor) -> torch.Tensor:
    """This rank's replica's share of the global batch ``t`` (dim 0): replica d of D gets the d-th
    of D equal slices."""
    d, n = replica_index(pm)
    b = t.shape[0]
    if b % n or b < n:
        raise UsageError(f"a global batch of {b} does not split into {n} equal data-parallel slices; "
                         f"make it a multiple of {n}")
    return t[d * b // n:(d + 1) * b // n]


def local_grads(pm: Any) -> dict[str, torch.Tensor]:
    """A copy of every gradient this rank holds, by its stage-local parameter name (the first of
    tied names wins): what a test compares, step by step, with the one-process model's."""
    grads: dict[str, torch.Tensor] = {}
    for mod in pm.stage_modules.values():
        for n, p in mod.named_parameters(remove_duplicate=False):
            if p.grad is not None:
                grads.setdefault(n, p.grad.detach().clone())
    return grads
