"""How parameters are split over the tensor-parallel axis, and per-rank materialization.

Terms: **t** -- the tensor-parallel degree (`num_shards`); **dim** -- the dimension a tensor is
split along; **block** -- a sub-range of `dim` that is split into t pieces on its own (a fused
[q|k|v] weight has three blocks, so every rank gets its q, k and v heads); **pad_to** -- the
padded size of `dim` (a multiple of t) used for vocabulary sharding; **local** -- this rank's
piece; **full** -- the unsplit tensor. Everything here is pure tensor code: no process group.

    spec = ShardSpec(dim=0, num_shards=4, blocks=(C, C, C))     # fused QKV, column-parallel
    w_r = spec.shard(w, rank)          # concat of q/k/v's rank-th chunks, shape (3C/4, C)
    w = spec.unshard([w_0, w_1, w_2, w_3])
    materialize_module(gm, specs, rank, source=model, device="cuda:0")

[Note: every buffer keeps its value]
Parameters of a model on the meta device may be freshly initialized (they are trained), but a
buffer or constant is part of the function the model computes: rotary `inv_freq`, causal masks,
norm statistics, and the tensors a trace creates itself (torch.export's `lifted_tensor_*`,
fx's `_tensor_constant*`, plain tensor attributes), which are in no state dict. Each takes its
value from a real tensor (the model, else the plan's stage module, which holds the trace's
constants by reference: `fxsplit.api.materialize._value_sources`), or materialization raises;
it is never zero-filled (zeros would give a wrong loss with no error).

[Note: vocabulary padding] When the vocabulary V does not divide by t, the table is padded to
`pad_to` rows (the next multiple of t, or of t * k for alignment) and rank r holds the padded
rows [r * L, (r + 1) * L) with L = pad_to / t. The padding rows are zero, are never looked up
(`fxsplit.tp.functional.vocab_parallel_embedding` only sees ids < V) and their logit columns are excluded from
the loss (`fxsplit.tp.functional.vocab_parallel_cross_entropy` treats them as -inf), so they get no gradient
and never change. `local_range` reports ranges in the padded index space. `unshard` drops the
padding, which needs the unpadded size: the spec's `size` field, or `unshard(..., size=V)`.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx
from torch import nn
from fxsplit.errors import ArgumentTypeError, ShardingError
from fxsplit.graph.ops import owner_and_leaf, resolve_path

__all__ = [
    "ShardSpec",
    "ShardedParam",
    "ShardingError",
    "default_init",
    "materialize_module",
    "materialize_tensor",
    "padded_size",
    "shard_state_dict",
    "unshard_state_dict",
    "valid_degrees",
]


def valid_degrees(size: int, upto: int = 64) -> list[int]:
    """The degrees t in [1, upto] that split `size` into equal pieces (divisors of size)."""
    if size < 0:
        raise ShardingError(f"valid_degrees: size must be >= 0, got {size}")
    return [t for t in range(1, upto + 1) if size % t == 0]


def padded_size(size: int, num_shards: int, multiple_of: int = 1) -> int:
    """The smallest size >= `size` divisible by num_shards * multiple_of (a `pad_to` value)."""
    if num_shards < 1 or multiple_of < 1:
        raise ShardingError(
            f"padded_size: num_shards={num_shards} and multiple_of={multiple_of} must be >= 1"
        )
    unit = num_shards * multiple_of
    return -(-size // unit) * unit


def _nearest(valid: list[int], t: int) -> str:
    below = [d for d in valid if d < t]
    above = [d for d in valid if d > t]
    near = ([below[-1]] if below else []) + ([above[0]] if above else [])
    return " or ".join(f"t={d}" for d in near) if near else "none"


def _common_degrees(sizes: Sequence[int], upto: int = 64) -> list[int]:
    return [t for t in range(1, upto + 1) if all(s % t == 0 for s in sizes)]


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is split over the tp axis (see the module's Terms).

    dim: the dimension split (negative counts from the end); num_shards: t; blocks: sizes along
    `dim` of sub-blocks that are each split into t pieces separately (fused QKV [q|k|v] ->
    blocks=(C, C, C), grouped-query fused -> (C, kv, kv)); None = one block. pad_to: for
    vocabulary sharding, the padded size of `dim` (a multiple of t); padded rows are zero and
    never looked up or used (see [Note: vocabulary padding]). whole: indices of blocks that are
    not split but held whole by every rank (a multi-query [q | k | v]: q by heads, the one k / v
    head replicated; [Note: whole blocks] in ``fxsplit.tp.regions``). size: optional unpadded size of
    `dim`, which `unshard` needs to drop padding (and which shapes are checked against).
    """

    dim: int
    num_shards: int
    blocks: tuple[int, ...] | None = None
    pad_to: int | None = None
    size: int | None = None
    whole: tuple[int, ...] = ()  # indices of blocks every rank holds whole (replicated)

    def __post_init__(self) -> None:
        t = self.num_shards
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ShardingError(f"ShardSpec: num_shards must be an int >= 1, got {t!r}")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise ShardingError(f"ShardSpec: dim must be an int, got {self.dim!r}")
        if self.blocks is not None:
            if not isinstance(self.blocks, tuple) or not self.blocks or any(
                isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.blocks
            ):
                raise ShardingError(
                    f"ShardSpec: blocks must be a non-empty tuple of positive ints, got "
                    f"{self.blocks!r} (use a tuple, e.g. blocks=(C, C, C))"
                )
            if self.pad_to is not None:
                raise ShardingError(
                    f"ShardSpec: blocks={self.blocks} and pad_to={self.pad_to} cannot be "
                    "combined; padding is for one-block (vocabulary) sharding"
                )
            if any(not isinstance(i, int) or not 0 <= i < len(self.blocks) for i in self.whole):
                raise ShardingError(f"ShardSpec: whole={self.whole} names no block of blocks={self.blocks}")
            bad = [b for i, b in enumerate(self.blocks) if b % t and i not in self.whole]
            if bad:
                raise ShardingError(
                    f"ShardSpec: block sizes {self.blocks} along dim {self.dim} cannot each be "
                    f"split into t={t} equal pieces ({bad} not divisible); nearest valid t: "
                    f"{_nearest(_common_degrees(self.blocks), t)}"
                )
            if self.size is not None and self.size != sum(self.blocks):
                raise ShardingError(
                    f"ShardSpec: size={self.size} differs from the sum of blocks "
                    f"{self.blocks} = {sum(self.blocks)}"
                )
        if self.whole and self.blocks is None:
            raise ShardingError(f"ShardSpec: whole={self.whole} needs blocks")
        if self.blocks is None and self.pad_to is None and self.size is not None:
            if self.size % t:
                raise ShardingError(
                    f"ShardSpec: size={self.size} cannot be split into t={t} equal shards; "
                    f"nearest valid t: {_nearest(valid_degrees(self.size), t)}, or pad it with "
                    f"pad_to=padded_size({self.size}, {t}) = {padded_size(self.size, t)}"
                )
        if self.pad_to is not None:
            if self.pad_to < 1 or self.pad_to % t:
                raise ShardingError(
                    f"ShardSpec: pad_to={self.pad_to} must be a positive multiple of "
                    f"num_shards={t}; use padded_size(size, {t}) = "
                    f"{padded_size(max(self.pad_to, 1), t)}"
                )
            if self.size is not None and self.size > self.pad_to:
                raise ShardingError(
                    f"ShardSpec: size={self.size} is larger than pad_to={self.pad_to}; use "
                    f"pad_to=padded_size({self.size}, {t}) = {padded_size(self.size, t)}"
                )

    # ------------------------------------------------------------------ shapes

    def _dim_of(self, ndim: int, shape: tuple) -> int:
        if not -ndim <= self.dim < ndim:
            raise ShardingError(
                f"ShardSpec: dim={self.dim} is out of range for a tensor of shape {shape}"
            )
        return self.dim % ndim

    def _check_full(self, full_shape: Sequence[int]) -> int:
        """Validate a full shape; return the normalized dim."""
        shape = tuple(int(s) for s in full_shape)
        d = self._dim_of(len(shape), shape)
        n, t = shape[d], self.num_shards
        if self.blocks is not None:
            if n != sum(self.blocks):
                raise ShardingError(
                    f"ShardSpec: dim {d} of shape {shape} has size {n}, but blocks "
                    f"{self.blocks} sum to {sum(self.blocks)}"
                )
        elif self.pad_to is not None:
            if n > self.pad_to:
                raise ShardingError(
                    f"ShardSpec: dim {d} of shape {shape} has size {n}, larger than "
                    f"pad_to={self.pad_to}; use pad_to=padded_size({n}, {t}) = "
                    f"{padded_size(n, t)}"
                )
            if self.size is not None and n != self.size:
                raise ShardingError(
                    f"ShardSpec: dim {d} of shape {shape} has size {n}, but the spec says "
                    f"size={self.size}"
                )
        elif self.size is not None and n != self.size:
            raise ShardingError(
                f"ShardSpec: dim {d} of shape {shape} has size {n}, but the spec says "
                f"size={self.size}"
            )
        elif n % t:
            raise ShardingError(
                f"ShardSpec: dim {d} of shape {shape} has size {n}, which t={t} cannot split "
                f"into equal shards; nearest valid t: {_nearest(valid_degrees(n), t)} "
                f"(valid up to 64: {valid_degrees(n)}), or pad it with "
                f"pad_to=padded_size({n}, {t}) = {padded_size(n, t)}"
            )
        return d

    def _local_len(self, n: int) -> int:
        if self.blocks is not None:
            return sum(b if i in self.whole else b // self.num_shards for i, b in enumerate(self.blocks))
        if self.pad_to is not None:
            return self.pad_to // self.num_shards
        return n // self.num_shards

    def local_shape(self, full_shape: Sequence[int]) -> tuple[int, ...]:
        """This rank's shape for a tensor of `full_shape` (every rank's is the same)."""
        shape = tuple(int(s) for s in full_shape)
        d = self._check_full(shape)
        return shape[:d] + (self._local_len(shape[d]),) + shape[d + 1 :]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_shards:
            raise ShardingError(
                f"ShardSpec: rank={rank} is out of range for num_shards={self.num_shards}"
            )

    def local_range(self, rank: int, size: int | None = None) -> list[tuple[int, int]]:
        """Global [start, end) ranges along `dim` that `rank` holds, in order (one per block;
        in the padded index space when pad_to is set, see [Note: vocabulary padding]). A plain
        spec (no blocks, pad_to or size field) needs the size of `dim` as `size`."""
        self._check_rank(rank)
        t = self.num_shards
        if self.blocks is not None:
            ranges, offset = [], 0
            for i, b in enumerate(self.blocks):
                piece = b // t
                ranges.append((offset, offset + b) if i in self.whole else
                              (offset + rank * piece, offset + (rank + 1) * piece))
                offset += b
            return ranges
        total = self.pad_to if self.pad_to is not None else (
            self.size if self.size is not None else size
        )
        if total is None:
            raise ShardingError(
                "ShardSpec.local_range: a spec with neither blocks, pad_to nor size does not "
                "know the size of its dim; call local_range(rank, size=full_shape[dim])"
            )
        if total % t:
            raise ShardingError(
                f"ShardSpec: size {total} cannot be split into t={t} equal shards; nearest "
                f"valid t: {_nearest(valid_degrees(total), t)}"
            )
        piece = total // t
        return [(rank * piece, (rank + 1) * piece)]

    def _ranges(self, n: int, rank: int) -> list[tuple[int, int]]:
        return self.local_range(rank, n)

    # ------------------------------------------------------------------ tensors

    def shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's piece of `full`, a contiguous copy on `full`'s device (for blocks: the
        concatenation of each block's rank-th chunk; with pad_to: padding rows are zero)."""
        self._check_rank(rank)
        d = self._check_full(tuple(full.shape))
        n = full.shape[d]
        pieces = []
        for start, end in self._ranges(n, rank):
            real_end = min(end, n)
            if real_end > start:
                pieces.append(full.narrow(d, start, real_end - start))
            pad = end - max(start, real_end)
            if pad:
                shape = list(full.shape)
                shape[d] = pad
                pieces.append(full.new_zeros(shape))
        if len(pieces) == 1:
            return pieces[0].clone(memory_format=torch.contiguous_format)
        return torch.cat(pieces, dim=d)

    def unshard(self, shards: Sequence[torch.Tensor], *, size: int | None = None) -> torch.Tensor:
        """Inverse of `shard`: the full tensor from every rank's piece, in rank order, with
        padding removed (pad_to needs the unpadded size: `size=` here or the spec's `size`)."""
        shards = list(shards)
        t = self.num_shards
        if len(shards) != t:
            raise ShardingError(
                f"ShardSpec.unshard: expected {t} shards (one per rank), got {len(shards)}"
            )
        first = tuple(shards[0].shape)
        d = self._dim_of(len(first), first)
        for r, s in enumerate(shards):
            if tuple(s.shape) != first:
                raise ShardingError(
                    f"ShardSpec.unshard: shard {r} has shape {tuple(s.shape)}, shard 0 has "
                    f"{first}; every rank's shard must have the same shape"
                )
        if self.blocks is not None:
            if first[d] != self._local_len(0):
                raise ShardingError(
                    f"ShardSpec.unshard: shards of size {first[d]} on dim {d} do not fit blocks "
                    f"{self.blocks} split {t} ways (expected {self._local_len(0)})"
                )
            local = [b if i in self.whole else b // t for i, b in enumerate(self.blocks)]
            pieces = [s.split(local, dim=d) for s in shards]
            return torch.cat(
                [p for i in range(len(self.blocks))
                 for p in ([pieces[0][i]] if i in self.whole else [pieces[r][i] for r in range(t)])], dim=d
            )
        full = torch.cat(shards, dim=d)
        if self.pad_to is not None:
            if full.shape[d] != self.pad_to:
                raise ShardingError(
                    f"ShardSpec.unshard: shards of size {first[d]} on dim {d} give "
                    f"{full.shape[d]}, expected pad_to={self.pad_to}"
                )
            n = size if size is not None else self.size
            if n is None:
                raise ShardingError(
                    f"ShardSpec.unshard: pad_to={self.pad_to} is set but the unpadded size is "
                    "unknown; pass unshard(shards, size=V) or build the spec with size=V"
                )
            full = full.narrow(d, 0, n).contiguous()
        return full


@dataclass(frozen=True)
class ShardedParam:
    """One parameter of a plan, for full_state_dict and checkpoint reassembly.

    fqn: the parameter's original name; full_shape: its unsplit shape; spec: how it is split
    over tp, or None when it is replicated (every tp rank holds the full tensor).
    """

    fqn: str
    full_shape: tuple[int, ...]
    spec: ShardSpec | None

    def __post_init__(self) -> None:
        if self.spec is not None:
            self.spec.local_shape(self.full_shape)  # raises ShardingError naming the sizes

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.full_shape if self.spec is None else self.spec.local_shape(self.full_shape)


# ----------------------------------------------------------------------------- state dicts


def shard_state_dict(
    full_sd: Mapping[str, torch.Tensor], specs: Mapping[str, ShardSpec], rank: int
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s state dict: sharded entries sliced by their spec (copies), the rest the
    same tensor objects (replicated). Every key in `specs` must be in `full_sd`."""
    missing = sorted(set(specs) - set(full_sd))
    if missing:
        raise ShardingError(
            f"shard_state_dict: specs name {missing[:5]} which the state dict does not hold "
            f"(it has {len(full_sd)} entries, e.g. {sorted(full_sd)[:3]})"
        )
    out = {}
    for name, value in full_sd.items():
        spec = specs.get(name)
        out[name] = value if spec is None else _shard_named(spec, value, rank, name)
    return out


def _shard_named(spec: ShardSpec, value: torch.Tensor, rank: int, name: str) -> torch.Tensor:
    try:
        return spec.shard(value, rank)
    except ShardingError as exc:
        raise ShardingError(f"{name!r}: {exc}") from None


def unshard_state_dict(
    per_rank: Sequence[Mapping[str, torch.Tensor]], specs: Mapping[str, ShardSpec]
) -> dict[str, torch.Tensor]:
    """The full state dict from every tp rank's state dict (in rank order): sharded entries
    reassembled, replicated ones taken from rank 0. Padding needs the spec's `size`."""
    if not per_rank:
        raise ShardingError("unshard_state_dict: got no per-rank state dicts")
    keys = list(per_rank[0])
    for r, sd in enumerate(per_rank[1:], 1):
        if set(sd) != set(keys):
            diff = sorted(set(sd) ^ set(keys))
            raise ShardingError(
                f"unshard_state_dict: rank {r}'s keys differ from rank 0's: {diff[:5]}"
            )
    out = {}
    for name in keys:
        spec = specs.get(name)
        if spec is None:
            out[name] = per_rank[0][name]
            continue
        try:
            out[name] = spec.unshard([sd[name] for sd in per_rank])
        except ShardingError as exc:
            raise ShardingError(f"{name!r}: {exc}") from None
    return out


# ----------------------------------------------------------------------------- materialization


def _seed(fqn: str, rank: int, base: int) -> int:
    return (zlib.crc32(f"{fqn}#{rank}".encode()) + 1_000_003 * base) % (2**63)


def default_init(fqn: str, tensor: torch.Tensor) -> None:
    """The default initializer (in place, from torch's current RNG, which `materialize_module`
    seeds per fqn): normal(0, 0.02) for tensors of 2 or more dims, ones for 1-D tensors whose
    name ends in "weight" (norm scales), zeros for everything else (biases, 1-D buffers)."""
    with torch.no_grad():
        if not tensor.is_floating_point() and not tensor.is_complex():
            tensor.zero_()
        elif tensor.dim() >= 2:
            tensor.normal_(0.0, 0.02)
        elif fqn.rsplit(".", 1)[-1].endswith("weight"):
            tensor.fill_(1.0)
        else:
            tensor.zero_()


def materialize_module(
    module: nn.Module,
    specs: Mapping[str, ShardSpec],
    rank: int,
    *,
    source: nn.Module | Mapping[str, torch.Tensor] | None,
    device: torch.device | str | None = None,
    init_fn: Callable[[str, torch.Tensor], None] | None = None,
    full_shapes: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
    seed_names: Mapping[str, str] | None = None,
) -> None:
    """Replace, in place, every parameter and buffer of `module` by rank `rank`'s real tensor.

    module: typically a stage or plan GraphModule whose tensors may be on the meta device, with
    FULL or already-LOCAL shapes. specs: fqn -> ShardSpec for tp-sharded tensors (others are
    replicated). Each tensor comes from, in order:
      1. `source` (a model with real weights, or a full state dict) when it holds the fqn (or a
         tied alias) on a real device: the shard is sliced where the source lives and only the
         slice is copied to `device`, never the full tensor;
      2. the module's own tensor when it is real (not meta): sharded if it has the full shape;
      3. otherwise a fresh tensor of the LOCAL shape only, filled by `init_fn(fqn, tensor)`
         (default `default_init`) under torch's RNG seeded from (seed, fqn, and rank when the
         tensor is sharded), so replicated tensors are identical on every tp rank and a run is
         reproducible. `seed_names` maps a local fqn to the name it is seeded (and initialized)
         under: one name per tensor tied across stages (``wte.weight`` on the first stage and
         ``lm_head.weight`` on the last), so every copy starts from the same values.
    Buffers and graph constants are not initialized: one with no real value (neither in `source`
    nor in the module) raises, unless `init_fn` is given ([Note: every buffer keeps its value]).
    The full shape of a tensor is the source's shape, else `full_shapes[fqn]`, else the module
    tensor's own shape (so pass `full_shapes` -- e.g. {p.fqn: p.full_shape for p in
    sharded_params} -- when a meta module already has local shapes and there is no source);
    the module's shape must be that full shape or its local shape. `device` defaults to the
    module tensor's device, or CPU for meta tensors. Dtypes follow the module's tensors.
    Tied parameters (one Parameter object under several names) stay one object; parameters
    keep their names and requires_grad; buffers keep their persistence.
    """
    src = _source_tensors(source)
    full_shapes = dict(full_shapes or {})
    # Group names by tensor object (tied parameters/buffers), in registration order.
    groups: dict[int, list[str]] = {}
    objects: dict[int, torch.Tensor] = {}
    for name, t in (*module.named_parameters(remove_duplicate=False),
                    *module.named_buffers(remove_duplicate=False)):
        if t is None:
            continue
        groups.setdefault(id(t), []).append(name)
        objects[id(t)] = t
    _check_constants(module, groups)
    if init_fn is None:
        _check_buffers(groups, objects, src)
    unknown = sorted(set(specs) - {n for names in groups.values() for n in names})
    if unknown:
        raise ShardingError(
            f"materialize_module: specs name {unknown[:5]}, which are not parameters or buffers "
            f"of the module (it has e.g. {[ns[0] for ns in list(groups.values())[:3]]})"
        )
    for key, names in groups.items():
        old = objects[key]
        spec = _group_spec(names, specs)
        seed_name = next((seed_names[n] for n in names if seed_names and n in seed_names), names[0])
        new = _materialize_one(
            names, old, spec, rank, src, device, init_fn, full_shapes, seed, seed_name
        )
        if isinstance(old, nn.Parameter):
            new = nn.Parameter(new, requires_grad=old.requires_grad)
        for name in names:
            owner, leaf = owner_and_leaf(module, name)
            if leaf in owner._parameters:
                owner._parameters[leaf] = new
            else:
                owner._buffers[leaf] = new


def materialize_tensor(
    names: Sequence[str],
    old: torch.Tensor,
    specs: Mapping[str, ShardSpec],
    rank: int,
    *,
    source: nn.Module | Mapping[str, torch.Tensor] | None,
    device: torch.device | str | None = None,
    full_shapes: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
    seed_names: Mapping[str, str] | None = None,
) -> torch.Tensor:
    """Rank `rank`'s real tensor for ONE tensor of a module, known by all its (tied) `names`,
    exactly as :func:`materialize_module` would make it (same sources, shapes and seeded
    initialization), returned instead of installed: lets a caller materialize a module one
    tensor at a time (sharded data parallelism keeps only a slice of each)."""
    names = list(names)
    seed_name = next((seed_names[n] for n in names if seed_names and n in seed_names), names[0])
    return _materialize_one(names, old, _group_spec(names, specs), rank, _source_tensors(source), device,
                            None, dict(full_shapes or {}), seed, seed_name)


def _check_constants(module: nn.Module, groups: Mapping[int, list[str]]) -> None:
    """A graph's plain tensor attributes (constants) cannot be materialized: fail on meta ones
    before anything is replaced."""
    if not isinstance(module, torch.fx.GraphModule):
        return
    known = {n for names in groups.values() for n in names}
    bad = []
    for node in module.graph.nodes:
        if node.op != "get_attr" or node.target in known:
            continue
        value = resolve_path(module, node.target, default=None)  # None: a dangling get_attr is the graph's problem
        if isinstance(value, torch.Tensor) and value.is_meta:
            bad.append(node.target)
    if bad:
        raise ShardingError(
            f"materialize_module: the graph reads tensor constants {bad[:5]} that are on the "
            "meta device and are neither parameters nor buffers, so nothing can fill them; "
            "register them as buffers in the model, or trace with real (non-meta) constants"
        )


def _check_buffers(groups: Mapping[int, list[str]], objects: Mapping[int, torch.Tensor],
                   src: Mapping[str, torch.Tensor]) -> None:
    """[Note: every buffer keeps its value]: a buffer (or graph constant) whose value is nowhere
    real cannot be initialized like a parameter; fail before anything is replaced."""
    lost = [names[0] for key, names in groups.items()
            if not isinstance(objects[key], nn.Parameter) and objects[key].is_meta
            and not any(n in src and not src[n].is_meta for n in names)]
    if lost:
        raise ShardingError(
            f"materialize_module: buffers/constants {lost[:5]}{' ...' if len(lost) > 5 else ''} are on the meta "
            "device and no source holds a real value for them, so nothing can give them their value (a "
            "buffer is not a weight to initialize: an inverse frequency table, a mask, a constant the "
            "trace lifted). Build the model with real buffers and meta parameters only (e.g. "
            "accelerate's init_empty_weights(include_buffers=False), or model.to_empty(device='cpu') and "
            "recompute them), pass the model itself as the source (a state dict has no non-persistent "
            "buffers), or pass init_fn= to fill them yourself"
        )


def _source_tensors(
    source: nn.Module | Mapping[str, torch.Tensor] | None,
) -> Mapping[str, torch.Tensor]:
    if source is None:
        return {}
    if isinstance(source, nn.Module):
        out = dict(source.named_parameters(remove_duplicate=False))
        out.update(source.named_buffers(remove_duplicate=False))
        return out
    if isinstance(source, Mapping):
        return source
    raise ArgumentTypeError(
        f"materialize_module: source must be an nn.Module, a state dict (Mapping[str, Tensor]) "
        f"or None, got {type(source).__name__}"
    )


def _group_spec(names: list[str], specs: Mapping[str, ShardSpec]) -> ShardSpec | None:
    found = {n: specs[n] for n in names if n in specs}
    if len(set(found.values())) > 1:
        raise ShardingError(
            f"materialize_module: tied names {names} have different specs {found}; tied "
            "tensors are one tensor and need one spec"
        )
    return next(iter(found.values()), None)


def _materialize_one(names, old, spec, rank, src, device, init_fn, full_shapes, seed, seed_name):
    name = names[0]
    cur = tuple(old.shape)
    target = torch.device(device) if device is not None else (
        torch.device("cpu") if old.is_meta else old.device
    )
    real = next((src[n] for n in names if n in src and not src[n].is_meta), None)
    if real is not None:
        full = tuple(real.shape)
    else:
        full = next((tuple(full_shapes[n]) for n in names if n in full_shapes), cur)
    try:
        local = full if spec is None else spec.local_shape(full)
    except ShardingError as exc:
        raise ShardingError(f"materialize_module: {name!r}: {exc}") from None
    if cur not in (full, local):
        raise ShardingError(
            f"materialize_module: {name!r} has shape {cur} in the module, but its full shape "
            f"is {full} and this rank's shape {local}{'' if spec is None else f' ({spec})'}; "
            "the module must hold the full or the local shape"
        )
    with torch.no_grad():
        if real is None and not old.is_meta:
            if cur == full:
                real = old
            else:  # already local and real: keep its values
                return old.detach().to(device=target, copy=old.device == target)
        if real is not None:
            if spec is None:
                return real.detach().to(device=target, dtype=old.dtype, copy=True)
            return spec.shard(real.detach(), rank).to(device=target, dtype=old.dtype)
        out = torch.empty(local, dtype=old.dtype, device=target)
        cuda = target.type == "cuda"
        index = (target.index if target.index is not None else torch.cuda.current_device()) \
            if cuda else None
        with torch.random.fork_rng(devices=[index] if cuda else []):
            # seed only the generators this tensor uses (torch.manual_seed would reseed every
            # GPU for good); fork_rng restores them afterwards
            s = _seed(seed_name, rank if spec is not None else 0, seed)
            torch.default_generator.manual_seed(s)
            if cuda:
                torch.cuda.default_generators[index].manual_seed(s)
            (init_fn or default_init)(seed_name, out)
        return out
