"""Sharded checkpoints of a :class:`~fxsplit.api.model.ParallelModel`: saved atomically, loaded
under any (dp, tp, pp) or whole in one process, and verified on every load.

Terms: a *checkpoint* is a torch.distributed.checkpoint (DCP) folder ([Note: checkpoint layout]);
a *chunk* is one piece of a saved tensor as DCP stores it (the whole tensor, one tp shard, or one
FSDP shard of either), held in one ``.distcp`` file; its *checksum* is the CRC-32 of the chunk's
bytes as the rank that wrote it held them. The *training state* is the step count
(:attr:`ParallelModel.step_count`) and the RNG streams' seed and step counter ([Note: RNG
streams] in :mod:`fxsplit.tp.random`).

    pm.save_checkpoint("run/ckpt", optimizer=opt)     # every rank; replaces run/ckpt atomically
    pm.load_checkpoint("run/ckpt", optimizer=opt)     # every rank, any layout; verified
    state = fxsplit.load_full_checkpoint("run/ckpt")  # one process, no process group; verified

Every failure raises :class:`~fxsplit.errors.CheckpointError` (an ``FxsplitError``), on every rank
for the methods (a rank whose peer failed raises ``RankFailedError``, [Note: failures]).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import logging
import os
import pickle
import shutil
import uuid
import warnings
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from fxsplit.errors import CheckpointError

if TYPE_CHECKING:
    from fxsplit.api import ParallelModel

__all__ = ["load_full_checkpoint", "save_checkpoint", "load_checkpoint", "CheckpointError", "alias_groups", "like_param"]

log = logging.getLogger(__name__)

# [Note: checkpoint layout]
# A checkpoint is a torch.distributed.checkpoint folder. A replicated tensor is stored under its
# original name (written once, DCP deduplicates replicas); a tensor-parallel shard under
# "<name>/tp<r>of<t>"; "fxsplit_meta/pp<i>-tp<r>" holds the ShardSpecs of the shards that position
# wrote, so a reader can reassemble the full tensor and cut it again for any other layout.
# "optim/<param name>/<state key>" is per-parameter optimizer state, sharded like its parameter.
# "fxsplit_train/state" is the training state (_TrainState; absent in older checkpoints).
# An expert weight placed by ep (and its optimizer state) is saved as the whole [E, ...] tensor (its
# tp shard's key with tp) that each ep rank's block is a chunk of: a DTensor over the ep group,
# Shard(0), so DCP writes each block at its offset once (the expert replicas' blocks deduplicated)
# and any reader, of any ep or none, reads the whole tensor as it reads any other.
# "fxsplit_checksums.json" holds the CRC-32 of every chunk, keyed by (stored name, chunk offsets),
# with the file that holds it. Each rank hashes the chunks of its *final* DCP plan, after DCP's
# deduplication, from the tensor DCP then writes: the reference is exactly the copy that was
# stored, never another replica's (tp replicas of a replicated tensor may differ in float noise).
# The coordinator writes the file before ".metadata", which DCP writes last; a checkpoint without
# it (written before checksums existed) loads unverified, with a warning.
# A save writes "<path>.tmp-<token>" (the token drawn by rank 0 and broadcast) and global rank 0
# renames it to <path> once every rank finished: a crash mid-save leaves only the temporary folder,
# never a <path> that loads. An existing checkpoint at <path> is moved to "<path>.old-<token>"
# just before, and deleted just after, the rename. This assumes one file system seen by every rank,
# as DCP's FileSystemWriter does.
_META = "fxsplit_meta"
_OPTIM = "optim"  # "optim/<param name>/<state key>": per-parameter optimizer state (Adam's exp_avg, ...)
_TRAIN = "fxsplit_train/state"
_CHECKSUMS = "fxsplit_checksums.json"
# CRC-32 (zlib): ~1.2 GB/s on one core here against ~0.8 for sha256 and ~0.3 for md5 or blake2b,
# it releases the GIL, and it detects every burst of up to 32 flipped bits and other damage with
# probability 1 - 2**-32. It guards against damage (disk, copy, truncation), not tampering.
_ALGORITHM = "crc32"


@dataclass(frozen=True)
class _ShardRecord:
    """Saved as one object (DCP would flatten a dict into many entries)."""

    tp: int
    specs: Mapping[str, Any]
    aliases: tuple[tuple[str, ...], ...] = ()  # every name of a tied tensor (absent in older checkpoints)


@dataclass(frozen=True)
class _TrainState:
    """The training state a resume needs to continue bit for bit at the same layout."""

    steps: int  # completed step() calls: ParallelModel.step_count
    seed: int | None  # the RNG streams' seed ([Note: RNG streams] in fxsplit.tp.random)
    rng_step: int  # the streams' step counter k: step() and forward() calls so far


def alias_groups(graph: nn.Module) -> tuple[tuple[str, ...], ...]:
    """The names of each tensor of ``graph`` held under more than one name (saved with a
    checkpoint; ``ParallelModel.full_state_dict`` gives a tied tensor under each)."""
    names: dict[int, list[str]] = {}
    for name, t in [*graph.named_parameters(remove_duplicate=False), *graph.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(name)
    return tuple(tuple(g) for g in names.values() if len(g) > 1)


def like_param(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (whole: this rank's tp shard) laid out as ``param``: cut to this rank's FSDP
    shard when ``param`` is a DTensor (locally, no communication), else as it is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor) and not isinstance(value, DTensor):
        return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    return value


# -- save


def save_checkpoint(pm: ParallelModel, path: str | os.PathLike, *,
                    optimizer: torch.optim.Optimizer | None = None) -> None:
    """:meth:`ParallelModel.save_checkpoint`: every rank writes its own chunks into a temporary
    folder, then global rank 0 puts it at ``path`` ([Note: checkpoint layout])."""
    path = os.fspath(path)
    distributed = dist.is_available() and dist.is_initialized()
    rank0 = not distributed or dist.get_rank() == 0
    error, state = None, None
    try:
        state = _state_to_save(pm, optimizer)
        if rank0:
            _check_replaceable(path)
    except Exception as exc:  # noqa: BLE001 -- raised on every rank by _agree
        error = exc
    pm._agree(error, False, "save_checkpoint")
    box = [uuid.uuid4().hex[:12] if rank0 else None]
    if distributed and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    tmp = f"{path}.tmp-{box[0]}"
    try:
        _dcp_save(state, tmp, distributed=distributed, path=path)
    except Exception as exc:  # noqa: BLE001 -- raised on every rank by _agree
        error = exc
    try:
        pm._agree(error, False, "save_checkpoint")
        if rank0:
            try:
                _replace(tmp, path, box[0])
            except OSError as exc:
                error = CheckpointError(f"save_checkpoint({path!r}): the checkpoint was written to {tmp!r} "
                                        f"but could not be put at {path!r}: {exc}")
        pm._agree(error, False, "save_checkpoint")
    except BaseException:
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _expert_blocks(pm: ParallelModel) -> tuple[set[str], Any]:
    """(the expert weights placed by ep, a DeviceMesh of this rank's ep group, or None without ep)."""
    if pm.plan.config.ep == 1:
        return set(), None
    from torch.distributed.device_mesh import DeviceMesh

    device = next(iter(pm.parameters())).device.type
    return set(pm.plan.ep_plan.expert_params), DeviceMesh.from_group(pm._groups.ep, device)


def _as_block(tensor: torch.Tensor, mesh: Any) -> torch.Tensor:
    """This ep rank's block of experts as its chunk of the whole tensor ([Note: checkpoint layout])."""
    from torch.distributed.tensor import DTensor, Shard

    shape = (tensor.shape[0] * mesh.size(), *tensor.shape[1:])
    return DTensor.from_local(tensor.contiguous(), mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def _state_to_save(pm: ParallelModel, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The state dict this rank hands to DCP ([Note: checkpoint layout])."""
    experts, ep_mesh = _expert_blocks(pm)
    specs = pm.plan.tp_plan.param_specs
    t, tp_rank = pm.plan.config.tp, pm.coords.get("tp", 0)
    tensors: dict[str, torch.Tensor] = dict(pm._local_state())
    tensor_specs = dict(specs)
    if optimizer is not None:
        for name, param in pm._named_local_params().items():
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    okey = f"{_OPTIM}/{name}/{key}"
                    tensors[okey] = value
                    if name in specs and tuple(value.shape) == tuple(param.shape):
                        tensor_specs[okey] = specs[name]
                    if name in experts and tuple(value.shape) == tuple(param.shape):
                        experts.add(okey)
    state: dict[str, Any] = {}
    mine: dict[str, Any] = {}
    for name, tensor in tensors.items():
        value = _as_block(tensor.detach(), ep_mesh) if name in experts else tensor.detach()
        if name in tensor_specs and t > 1:
            state[_shard_key(name, tp_rank, t)] = value
            mine[name] = tensor_specs[name]
        else:
            state[name] = value
    # each (pp, tp) position records the specs of the shards it wrote (replicas write the same)
    state[f"{_META}/pp{pm.coords.get('pp', 0)}-tp{tp_rank}"] = _ShardRecord(t, mine, alias_groups(pm.plan.graph))
    runtime = pm.runtime
    state[_TRAIN] = _TrainState(steps=pm.step_count, seed=runtime.seed, rng_step=runtime.rng_step)
    return state


def _check_replaceable(path: str) -> None:
    """A save may replace a checkpoint or an empty folder, never anything else."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        entries = os.listdir(path)
        if not entries or ".metadata" in entries:
            return
    raise CheckpointError(
        f"save_checkpoint({path!r}): {path!r} exists and is not a checkpoint (no .metadata in it); a save "
        "replaces an earlier checkpoint or an empty folder only: remove it or save to another path"
    )


def _dcp_save(state: dict[str, Any], tmp: str, *, distributed: bool, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save(state, storage_writer=_writer_class()(tmp), no_dist=not distributed)  # every rank: the default group
    except CheckpointException as exc:  # a BaseException: `except Exception` would miss it
        raise CheckpointError(f"save_checkpoint({path!r}): torch.distributed.checkpoint failed: {exc}") from exc
    except Exception as exc:
        raise CheckpointError(f"save_checkpoint({path!r}): {type(exc).__name__}: {exc}") from exc


def _replace(tmp: str, path: str, token: str) -> None:
    """Put the finished folder ``tmp`` at ``path``; an earlier checkpoint there is moved aside
    first and deleted once the new one is in place."""
    old = None
    if os.path.lexists(path):
        old = f"{path}.old-{token}"
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except OSError:
        if old is not None:
            os.rename(old, path)  # the earlier checkpoint goes back where it was
        raise
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(folder: str) -> None:
    try:  # make the renames durable; not every file system allows opening a folder
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _crc(tensor: torch.Tensor) -> int:
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return zlib.crc32(data.numpy())


def _chunk_id(fqn: str, offsets: Any) -> str:
    return f"{fqn}@{','.join(str(int(o)) for o in offsets)}"


@dataclass(frozen=True)
class _Checked:
    """A chunk's storage record with its checksum, on its way from a writing rank to the
    coordinator (unwrapped there: never stored)."""

    storage: Any
    crc32: int


@functools.cache
def _writer_class() -> type:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.planner import WriteItemType

    class ChecksumWriter(FileSystemWriter):
        """DCP's FileSystemWriter that also writes ``fxsplit_checksums.json`` ([Note: checkpoint
        layout]): each rank hashes the tensor chunks of its final plan, the coordinator writes
        them all before ``.metadata``."""

        def write_data(self, plan, planner):  # noqa: ANN001 -- DCP's signature
            sums = {_chunk_id(item.index.fqn, item.index.offset): _crc(planner.resolve_data(item))
                    for item in plan.items if item.type != WriteItemType.BYTE_IO}
            results = super().write_data(plan, planner).wait()
            out: torch.futures.Future = torch.futures.Future()
            out.set_result([  # objects (offset None) carry no checksum
                r if r.index.offset is None else dataclasses.replace(
                    r, storage_data=_Checked(r.storage_data, sums[_chunk_id(r.index.fqn, r.index.offset)]))
                for r in results
            ])
            return out

        def finish(self, metadata, results):  # noqa: ANN001 -- DCP's signature
            chunks, plain = {}, []
            for row in results:
                plain.append([])
                for r in row:
                    if isinstance(r.storage_data, _Checked):
                        chunks[_chunk_id(r.index.fqn, r.index.offset)] = {
                            _ALGORITHM: r.storage_data.crc32, "file": r.storage_data.storage.relative_path}
                        r = dataclasses.replace(r, storage_data=r.storage_data.storage)
                    plain[-1].append(r)
            with open(os.path.join(self.path, _CHECKSUMS), "w") as f:
                json.dump({"format": "fxsplit checksums", "version": 1, "algorithm": _ALGORITHM,
                           "chunks": chunks}, f, indent=0, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            super().finish(metadata, plain)

    return ChecksumWriter


# -- load


def load_checkpoint(pm: ParallelModel, path: str | os.PathLike, *, optimizer: torch.optim.Optimizer | None = None,
                    allow_nonfinite: bool = False) -> None:
    """:meth:`ParallelModel.load_checkpoint`; every rank learns whether any rank failed."""
    error = None
    try:
        _load_into(pm, os.fspath(path), optimizer, allow_nonfinite)
    except Exception as exc:  # noqa: BLE001 -- raised on every rank by _agree
        error = exc
    pm._agree(error, False, "load_checkpoint")


def _load_into(pm: ParallelModel, path: str, optimizer: torch.optim.Optimizer | None,
               allow_nonfinite: bool) -> None:
    from fxsplit.runtime.fsdp import local_tensor

    names = set()
    for mod in pm.stage_modules.values():
        names |= set(mod.state_dict(keep_vars=True))  # parameters and persistent buffers
    params = pm._named_local_params()
    wanted = set(names)
    if optimizer is not None:
        wanted |= {f"{_OPTIM}/{n}" for n in params}
    full, train = _read(path, names=wanted, include_optimizer=False, allow_nonfinite=allow_nonfinite)
    pm.load_full_state_dict({k: v for k, v in full.items() if not k.startswith(_OPTIM + "/")})
    if train is not None:  # older checkpoints have none: the counters stay as they are
        pm._steps = train.steps
        pm.runtime.resume_rng(train.seed, train.rng_step)
    if optimizer is None:
        return
    specs = pm.plan.tp_plan.param_specs
    tp_rank = pm.coords.get("tp", 0)
    experts, ep = (set(pm.plan.ep_plan.expert_params), pm.plan.config.ep) if pm.plan.config.ep > 1 else (set(), 1)
    mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for name, param in params.items():
        if id(param) not in mine:
            continue
        prefix = f"{_OPTIM}/{name}/"
        entry = {}
        for key, value in full.items():
            if key.startswith(prefix):
                if name in specs and value.dim() > 0 and tuple(value.shape) != tuple(param.shape):
                    value = specs[name].shard(value, tp_rank)
                if name in experts and value.dim() > 0:  # this rank's block of experts
                    value = value.chunk(ep)[pm._groups.ep.rank()]
                if value.dim() > 0:
                    value = like_param(param, value.to(local_tensor(param).device))
                entry[key[len(prefix):]] = value
        if entry:
            optimizer.state[param] = entry


def _shard_key(name: str, rank: int, t: int) -> str:
    return f"{name}/tp{rank}of{t}"


def load_full_checkpoint(path: str | os.PathLike, *, names: set[str] | None = None,
                         include_optimizer: bool = False, allow_nonfinite: bool = False) -> dict[str, torch.Tensor]:
    """The full model state dict (original names and shapes, CPU) of a checkpoint written by
    :meth:`ParallelModel.save_checkpoint`, read in this process alone (no process group);
    ``names`` limits it to those tensors; ``include_optimizer`` adds the optimizer state saved
    with it, as "optim/<param name>/<state key>" entries.

    Every chunk read is checked against its checksum, and every floating-point tensor read for
    non-finite values unless ``allow_nonfinite``; either raises :class:`CheckpointError` naming
    the tensor and the ``.distcp`` file. A checkpoint older than checksums loads unverified."""
    return _read(os.fspath(path), names=names, include_optimizer=include_optimizer,
                 allow_nonfinite=allow_nonfinite)[0]


def _read(path: str, *, names: set[str] | None, include_optimizer: bool,
          allow_nonfinite: bool) -> tuple[dict[str, torch.Tensor], _TrainState | None]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _read_metadata(path)
    meta = metadata.state_dict_metadata
    objs: dict[str, Any] = {k: None for k in meta if k.startswith(_META + "/") or k == _TRAIN}
    _dcp_load(objs, path)
    specs: dict[str, Any] = {}
    aliases: set[tuple[str, ...]] = set()
    for key, obj in objs.items():
        if key.startswith(_META + "/"):
            specs.update(obj.specs)
            aliases.update(obj.aliases)  # a checkpoint from before the field: the class default, ()
    extra: set[str] = set()  # a tied tensor's name reads it under whichever name it was saved
    if names is not None:
        extra = {n for group in aliases if names.intersection(group) for n in group} - set(names)
        names = set(names) | extra
    wanted: dict[str, Any] = {}
    for key, m in meta.items():
        if not isinstance(m, TensorStorageMetadata):
            continue
        base = key.rsplit("/tp", 1)[0] if "/tp" in key else key
        if names is None and key.startswith(_OPTIM + "/") and not include_optimizer:
            continue
        if names is None or base in names or base.rsplit("/", 1)[0] in names:
            wanted[key] = torch.empty(m.size, dtype=m.properties.dtype)
    _dcp_load(wanted, path)
    _verify(path, metadata, wanted, allow_nonfinite=allow_nonfinite)
    full: dict[str, torch.Tensor] = {}
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for key, tensor in wanted.items():
        if "/tp" in key and key.rsplit("/", 1)[0] in specs:
            base, tag = key.rsplit("/", 1)
            shards.setdefault(base, {})[int(tag[2:].split("of")[0])] = tensor
        else:
            full[key] = tensor
    for base, parts in shards.items():
        full[base] = specs[base].unshard([parts[r] for r in sorted(parts)])
    for group in aliases:  # a tied tensor is saved once; its other names as the model has them
        have = next((n for n in group if n in full), None)
        if have is not None:
            full.update((n, full[have]) for n in group if n not in full and (names is None or n in names))
    for n in extra:
        full.pop(n, None)
    return full, objs.get(_TRAIN)


def _read_metadata(path: str) -> Any:
    import torch.distributed.checkpoint as dcp

    if not os.path.isdir(path):
        raise CheckpointError(f"{path!r} is not an fxsplit checkpoint: "
                              f"{'no such folder' if not os.path.exists(path) else 'not a folder'}")
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        raise CheckpointError(f"{path!r} is not an fxsplit checkpoint (no torch.distributed.checkpoint "
                              "metadata: .metadata is missing; an interrupted save leaves <path>.tmp-* "
                              "folders instead)") from None
    except Exception as exc:
        raise CheckpointError(f"{path!r}: its .metadata cannot be read ({type(exc).__name__}: {exc})") from exc


def _dcp_load(state: dict[str, Any], path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if not state:
        return
    warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
    try:
        dcp.load(state, checkpoint_id=path, planner=_loader_class()(), no_dist=True)
    except CheckpointException as exc:  # a BaseException: `except Exception` would miss it
        raise CheckpointError(f"checkpoint {path!r}: torch.distributed.checkpoint failed to read it "
                              f"(a damaged or truncated file?): {exc}") from exc
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path!r}: {type(exc).__name__}: {exc}") from exc


def _verify(path: str, metadata: Any, loaded: Mapping[str, torch.Tensor], *, allow_nonfinite: bool) -> None:
    """Raise CheckpointError when a chunk of ``loaded`` differs from its checksum, or (unless
    ``allow_nonfinite``) holds a NaN or an infinity; each names the tensor and its file."""
    files = {(i.fqn, tuple(i.offset)): s.relative_path
             for i, s in metadata.storage_data.items() if i.offset is not None}
    sums = _read_checksums(path)
    for key, tensor in loaded.items():
        chunks = metadata.state_dict_metadata[key].chunks
        for chunk in chunks:
            piece = tensor
            for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
                piece = piece.narrow(dim, offset, size)
            file = files.get((key, tuple(chunk.offsets)), "?")
            where = f"tensor {key!r}" + (f" (chunk at offsets {tuple(chunk.offsets)})" if len(chunks) > 1 else "")
            if sums is not None:
                want = sums.get(_chunk_id(key, chunk.offsets))
                if want is None:
                    raise CheckpointError(f"checkpoint {path!r}: {where} in {file!r} has no checksum in "
                                          f"{_CHECKSUMS}; the checkpoint was altered after it was saved")
                got = _crc(piece)
                if got != want:
                    raise CheckpointError(
                        f"checkpoint {path!r}: {where} in file {file!r} does not match its checksum "
                        f"({_ALGORITHM} {got:#010x}, saved {want:#010x}): the file was damaged after the save "
                        "(disk, copy, edit); restore it from a copy, or load an earlier checkpoint")
            if not allow_nonfinite and (piece.is_floating_point() or piece.is_complex()):
                bad = int((~torch.isfinite(piece)).sum())
                if bad:
                    raise CheckpointError(
                        f"checkpoint {path!r}: {where} in file {file!r} holds {bad} non-finite value(s) "
                        f"(NaN or infinity) of {piece.numel()}; the model diverged before it was saved. Load an "
                        "earlier checkpoint, or pass allow_nonfinite=True to load it anyway")


def _read_checksums(path: str) -> dict[str, int] | None:
    """Chunk -> checksum, or None for a checkpoint written before checksums (with a warning)."""
    file = os.path.join(path, _CHECKSUMS)
    if not os.path.exists(file):
        log.warning("checkpoint %r has no %s (written before fxsplit saved checksums): loaded unverified",
                    path, _CHECKSUMS)
        return None
    try:
        with open(file) as f:
            data = json.load(f)
        if data.get("algorithm") != _ALGORITHM:
            raise ValueError(f"algorithm {data.get('algorithm')!r}, expected {_ALGORITHM!r}")
        return {k: int(v[_ALGORITHM]) for k, v in data["chunks"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint {path!r}: {_CHECKSUMS} cannot be read ({type(exc).__name__}: "
                              f"{exc}); the checkpoint was damaged after the save") from exc


# A checkpoint may name _ShardRecord under fxsplit.api.model in its pickle (the module that held
# the class when that checkpoint was saved); the loader reads it as this module's class, so such
# checkpoints still load.
_MOVED = {("fxsplit.api.model", "_ShardRecord"): _ShardRecord}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return _MOVED.get((module, name)) or super().find_class(module, name)


class _CompatPickle:
    """A ``pickle_module`` for ``torch.load`` whose Unpickler knows the moved classes."""

    Unpickler = _Unpickler
    load = staticmethod(lambda f, **kw: _Unpickler(f, **kw).load())
    __name__ = "fxsplit_checkpoint_pickle"


@functools.cache
def _loader_class() -> type:
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class Loader(DefaultLoadPlanner):
        """DCP's DefaultLoadPlanner, reading objects through `_CompatPickle`."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:  # noqa: ANN001 -- DCP's signature
            obj = torch.load(value, weights_only=False, pickle_module=_CompatPickle)
            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return Loader
