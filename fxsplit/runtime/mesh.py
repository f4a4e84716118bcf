"""The ("dp", "pp", "tp") device mesh fxsplit runs on (("dp", "dp_shard", "pp", "tp") with
sharded data parallelism, a "cp" dim before "pp" with context parallelism), and process-group start-up.

Terms: **d, p, t** -- data-, pipeline- and tensor-parallel degrees; **s** -- the sharded
data-parallel degree (``dp_shard``: FSDP2 shards parameters over those ranks); **world size** --
the number of ranks in the default process group, which must equal d * s * p * t; **coords** --
this rank's index along each mesh dimension.

    init_from_env()                       # under torchrun: nccl with CUDA, else gloo
    mesh = build_mesh(dp=2, pp=2, tp=2)   # 8 ranks
    with bind_groups(mesh_groups(mesh)):  # fxsplit.tp.collectives resolves "tp" etc. here
        ...
    groups = build_groups(mesh, ep=1, timeout=datetime.timedelta(seconds=300))  # every group a run uses

Layout: global rank = ((dp_i * s + dp_shard_i) * p + pp_i) * t + tp_i (with cp degree c > 1:
(((dp_i * s + dp_shard_i) * c + cp_i) * p + pp_i) * t + tp_i), so tp is innermost (a
tensor-parallel group is t consecutive ranks, which keeps it inside one host for t <= GPUs per
host) and dp is outermost. With s == 1 the mesh keeps its three dims ("dp", "pp", "tp"), exactly
as without sharding; with s > 1 it has the four of :data:`MESH_DIMS_SHARDED`. Every check below runs before any collective, so a wrong request raises the same
error on every rank instead of hanging the job.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fxsplit.errors import ArgumentTypeError, PlanError, RunError, UsageError

__all__ = [
    "Groups",
    "MESH_DIMS",
    "MESH_DIMS_SHARDED",
    "build_groups",
    "build_mesh",
    "check_mesh",
    "choose_backend",
    "expert_groups",
    "fsdp_mesh",
    "init_from_env",
    "mesh_coords",
    "mesh_dims",
    "mesh_groups",
    "shared_gpus",
]

_log = logging.getLogger("fxsplit")

MESH_DIMS: tuple[str, str, str] = ("dp", "pp", "tp")
MESH_DIMS_SHARDED: tuple[str, str, str, str] = ("dp", "dp_shard", "pp", "tp")
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _check_degrees(fn: str, dp: int, pp: int, tp: int) -> None:
    for name, value in (("dp", dp), ("pp", pp), ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(
                f"{fn}: {name}={value!r} must be an int >= 1 (1 means no "
                f"{'data' if name == 'dp' else 'pipeline' if name == 'pp' else 'tensor'} "
                "parallelism)"
            )


def _suggest(world: int, dp: int, pp: int, tp: int) -> str:
    """Degree choices that multiply to `world`, changing one of the requested degrees."""
    options = []
    for keep_a, keep_b, fill in (("pp", "tp", "dp"), ("dp", "tp", "pp"), ("dp", "pp", "tp")):
        given = {"dp": dp, "pp": pp, "tp": tp}
        rest = given[keep_a] * given[keep_b]
        if world % rest == 0:
            given[fill] = world // rest
            text = f"dp={given['dp']}, pp={given['pp']}, tp={given['tp']}"
            if text not in options:
                options.append(text)
    if not options:
        options.append(f"dp={world}, pp=1, tp=1")
    return " or ".join(f"({o})" for o in options)


def mesh_dims(*, dp_shard: int = 1, cp: int = 1) -> tuple[str, ...]:
    """The mesh's dim names, outermost first: ("dp", ["dp_shard",] ["cp",] "pp", "tp") -- "dp_shard"
    with dp_shard > 1, "cp" with cp > 1 (context parallelism: the ranks that split every sequence;
    between the data-parallel dims and pp, as torchtitan's [dp_replicate, dp_shard, cp, tp] keeps
    tp innermost)."""
    return ("dp",) + (("dp_shard",) if dp_shard > 1 else ()) + (("cp",) if cp > 1 else ()) + ("pp", "tp")


def build_mesh(
    *, dp: int = 1, pp: int = 1, tp: int = 1, dp_shard: int = 1, cp: int = 1, device_type: str | None = None
) -> DeviceMesh:
    """A DeviceMesh of shape (dp, pp, tp) with dims ("dp", "pp", "tp") over the default group;
    with ``dp_shard`` > 1, of shape (dp, dp_shard, pp, tp) with dims :data:`MESH_DIMS_SHARDED`;
    with ``cp`` > 1, a "cp" dim before "pp" (:func:`mesh_dims`).

    Collective on every rank (it creates the sub-groups). `device_type` defaults to "cuda"
    when CUDA is available and the default group runs NCCL, else "cpu".
    """
    _check_degrees("build_mesh", dp, pp, tp)
    _check_shard("build_mesh", dp_shard)
    _check_cp("build_mesh", cp)
    if cp > 1:
        return _build_cp_mesh(dp, dp_shard, cp, pp, tp, device_type)
    if not dist.is_available() or not dist.is_initialized():
        raise RunError(
            f"build_mesh(dp={dp}, pp={pp}, tp={tp}): the default process group is not "
            "initialized; call fxsplit.runtime.mesh.init_from_env() under torchrun, or "
            "torch.distributed.init_process_group(...) first"
        )
    world = dist.get_world_size()
    if dp_shard > 1 and world != dp * dp_shard * pp * tp:
        raise PlanError(
            f"build_mesh: dp*dp_shard*pp*tp = {dp}*{dp_shard}*{pp}*{tp} = {dp * dp_shard * pp * tp}, but "
            f"the default process group has world size {world}; the degrees must multiply to the world "
            f"size: launch {dp * dp_shard * pp * tp} processes, or change the degrees"
        )
    if dp_shard == 1 and world != dp * pp * tp:
        raise PlanError(
            f"build_mesh: dp*pp*tp = {dp}*{pp}*{tp} = {dp * pp * tp}, but the default process "
            f"group has world size {world}; the degrees must multiply to the world size. "
            f"Try {_suggest(world, dp, pp, tp)}, or launch {dp * pp * tp} processes"
        )
    if device_type is None:
        nccl = "nccl" in str(dist.get_backend()).lower()
        device_type = "cuda" if torch.cuda.is_available() and nccl else "cpu"
    if dp_shard > 1:
        return init_device_mesh(device_type, (dp, dp_shard, pp, tp), mesh_dim_names=MESH_DIMS_SHARDED)
    return init_device_mesh(device_type, (dp, pp, tp), mesh_dim_names=MESH_DIMS)


def _check_cp(fn: str, cp: int) -> None:
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise PlanError(f"{fn}: cp={cp!r} must be an int >= 1 (1 means no context parallelism)")


def _build_cp_mesh(dp: int, ds: int, cp: int, pp: int, tp: int, device_type: str | None) -> DeviceMesh:
    if not dist.is_available() or not dist.is_initialized():
        raise RunError(f"build_mesh(dp={dp}, cp={cp}, pp={pp}, tp={tp}): the default process group is not "
                       "initialized; call fxsplit.runtime.mesh.init_from_env() under torchrun first")
    world, want = dist.get_world_size(), dp * ds * cp * pp * tp
    if world != want:
        raise PlanError(f"build_mesh: dp*dp_shard*cp*pp*tp = {dp}*{ds}*{cp}*{pp}*{tp} = {want}, but the default "
                        f"process group has world size {world}; launch {want} processes, or change the degrees")
    if device_type is None:
        nccl = "nccl" in str(dist.get_backend()).lower()
        device_type = "cuda" if torch.cuda.is_available() and nccl else "cpu"
    dims = mesh_dims(dp_shard=ds, cp=cp)
    sizes = {"dp": dp, "dp_shard": ds, "cp": cp, "pp": pp, "tp": tp}
    return init_device_mesh(device_type, tuple(sizes[d] for d in dims), mesh_dim_names=dims)


def _check_shard(fn: str, dp_shard: int) -> None:
    if isinstance(dp_shard, bool) or not isinstance(dp_shard, int) or dp_shard < 1:
        raise PlanError(f"{fn}: dp_shard={dp_shard!r} must be an int >= 1 (1 means no sharded data parallelism)")


def check_mesh(mesh: DeviceMesh, dp: int, pp: int, tp: int, dp_shard: int = 1, cp: int = 1) -> None:
    """Raise UsageError (a ValueError) unless `mesh` has dims ("dp", "pp", "tp") and shape (dp, pp, tp), or (any
    ``dp_shard``) dims :data:`MESH_DIMS_SHARDED` and shape (dp, dp_shard, pp, tp); with ``cp`` > 1, the dims
    of :func:`mesh_dims`."""
    _check_degrees("check_mesh", dp, pp, tp)
    _check_shard("check_mesh", dp_shard)
    _check_cp("check_mesh", cp)
    if not isinstance(mesh, DeviceMesh):
        raise ArgumentTypeError(f"check_mesh: expected a DeviceMesh, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    shape = tuple(mesh.shape)
    if cp > 1 or "cp" in names:
        dims = mesh_dims(dp_shard=dp_shard, cp=cp)
        sizes = {"dp": dp, "dp_shard": dp_shard, "cp": cp, "pp": pp, "tp": tp}
        want = tuple(sizes[d] for d in dims)
        if names != dims or shape != want:
            raise UsageError(f"check_mesh: the mesh has dims {names or 'without names'} with shape {shape}; fxsplit "
                             f"needs dims {dims} with shape {want}. Build it with fxsplit.runtime.mesh.build_mesh("
                             f"dp={dp}, dp_shard={dp_shard}, cp={cp}, pp={pp}, tp={tp})")
        return
    if names == MESH_DIMS_SHARDED or dp_shard > 1:
        if names != MESH_DIMS_SHARDED or shape != (dp, dp_shard, pp, tp):
            raise UsageError(
                f"check_mesh: the mesh has dims {names or 'without names'} with shape {shape}; fxsplit "
                f"needs dims {MESH_DIMS_SHARDED} with shape ({dp}, {dp_shard}, {pp}, {tp}) for dp={dp}, "
                f"dp_shard={dp_shard}, pp={pp}, tp={tp}. Build it with fxsplit.runtime.mesh.build_mesh("
                f"dp={dp}, dp_shard={dp_shard}, pp={pp}, tp={tp})"
            )
        return
    if names != MESH_DIMS or shape != (dp, pp, tp):
        raise UsageError(
            f"check_mesh: the mesh has dims {names or 'without names'} with shape {shape}; "
            f"fxsplit needs dims {MESH_DIMS} with shape ({dp}, {pp}, {tp}) for dp={dp}, "
            f"pp={pp}, tp={tp}. Build it with fxsplit.runtime.mesh.build_mesh(dp={dp}, pp={pp}, "
            f"tp={tp}), or init_device_mesh(device_type, ({dp}, {pp}, {tp}), "
            f"mesh_dim_names={MESH_DIMS})"
        )


# [Note: expert-parallel groups] ep ranks are carved out of the data-parallel ranks, as DeepSpeed-MoE
# and torchtitan do: the world size stays dp * dp_shard * cp * pp * tp. At one (cp, pp, tp) position the
# D = dp * dp_shard data ranks (data index i = dp_i * dp_shard + dp_shard_i) form D / ep expert-parallel
# groups of ep consecutive data indices (they hold different experts and exchange tokens: "ep"), and
# at one (pp, tp) position, ep expert-replica groups of the D / ep data indices with the same i % ep,
# at every cp position (they hold the same experts and reduce those experts' gradients: "ep_replica";
# a cp rank's expert gradient is its tokens' share, so the sum runs over cp too, as for the dense
# weights, [Note: cp gradients]). Consecutive indices keep an ep group on one host where the data
# ranks of a host are consecutive.
def expert_groups(mesh: DeviceMesh, ep: int, *, timeout: datetime.timedelta | None = None
                  ) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's ("ep", "ep_replica") process groups ([Note: expert-parallel groups]); collective
    on every rank of the mesh. PlanError when ep does not divide the data-parallel ranks."""
    names = tuple(mesh.mesh_dim_names or ())
    shape = dict(zip(names, mesh.shape))
    data = shape.get("dp", 1) * shape.get("dp_shard", 1)
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or data % ep:
        raise PlanError(f"expert_groups: ep={ep!r} must be an int dividing the {data} data-parallel ranks "
                        f"(dp * dp_shard) of a mesh of shape {shape}")
    grid = mesh.mesh.reshape(data, shape.get("cp", 1), -1)  # (data index, cp, (pp, tp) position)
    columns = grid.flatten(1).t().tolist()  # per (cp, pp, tp) position: its data ranks in order
    ep_sets = [col[i:i + ep] for col in columns for i in range(0, data, ep)]
    replica_sets = [sorted(grid[e::ep, :, pos].flatten().tolist()) for pos in range(grid.shape[2]) for e in range(ep)]
    options = {} if timeout is None else {"timeout": timeout}
    ep_group, _ = dist.new_subgroups_by_enumeration(ep_sets, **options)
    replica_group, _ = dist.new_subgroups_by_enumeration(replica_sets, **options)
    return ep_group, replica_group


# [Note: FSDP over cp] With cp > 1 the cp ranks of a data-parallel rank hold the same parameters and
# see different tokens of the same sequences, so FSDP2 shards over them too, as torchtitan's
# "dp_shard_cp" mesh dim does: the ("dp_shard", "cp") dims flattened into one. FSDP's reduce-scatter
# then sums a gradient over the cp ranks' shares with the data ranks'; it must divide by the data
# ranks dp * dp_shard only (each cp rank holds its tokens' share of the replica's gradient, not a
# gradient of its own mean), which fxsplit.runtime.fsdp.shard_stages sets as FSDP's divide factor.
def fsdp_mesh(mesh: DeviceMesh, *, timeout: datetime.timedelta | None = None) -> DeviceMesh:
    """The mesh FSDP2 shards a stage over: "dp_shard" (1-D), or ("dp", "dp_shard") with dp > 1 (HSDP);
    with a "cp" dim, "dp_shard" x "cp" flattened into "dp_shard_cp" ([Note: FSDP over cp]). Collective
    on every rank of ``mesh`` when it flattens (the new group); its group bounded by ``timeout``."""
    names = tuple(mesh.mesh_dim_names or ())
    shard = "dp_shard"
    if "cp" in names:
        flat = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        if timeout is not None:
            _set_timeout(flat.get_group(), timeout)
        shard = "dp_shard_cp"
    return mesh["dp", shard] if mesh.shape[names.index("dp")] > 1 else mesh[shard]


def mesh_coords(mesh: DeviceMesh) -> dict[str, int]:
    """This rank's index along each mesh dim, e.g. {"dp": 1, "pp": 0, "tp": 1} (and "dp_shard"
    for a sharded mesh)."""
    names = mesh.mesh_dim_names
    if not names:
        raise UsageError("mesh_coords: the mesh has no dim names; build it with build_mesh(...)")
    return {name: mesh.get_local_rank(name) for name in names}


def mesh_groups(mesh: DeviceMesh) -> dict[str, dist.ProcessGroup]:
    """Axis name -> this rank's ProcessGroup along it, for fxsplit.tp.collectives.bind_groups."""
    names = mesh.mesh_dim_names
    if not names:
        raise UsageError("mesh_groups: the mesh has no dim names; build it with build_mesh(...)")
    return {name: mesh.get_group(name) for name in names}


# [Note: process groups] Every group a parallelized model runs with is made here, once, by
# `build_groups`, in one order on every rank (making a group is collective): the mesh's own groups
# (one per dim), then the groups the mesh has no dim for. A failure gives groups up ([Note: failure
# protocol] point 4): the holder replaces its `Groups` by one `without` them, never edits it.
@dataclass(frozen=True)
class Groups:
    """This rank's process groups; None where the layout has no such group (or it was given up).

    - ``dp``: the data-parallel gradient mean: the mesh's "dp" dim, or dp x cp ranks with cp > 1
      ([Note: cp gradients] in fxsplit.runtime.data_parallel).
    - ``dp_shard`` / ``cp`` / ``pp`` / ``tp``: the mesh's dims of those names.
    - ``pipe``: the pipeline runtime's own chain of pp ranks (pp > 1 over more than one rank): a
      group of its own, since the runtime gives it up on a failure and the mesh's "pp" group may be
      the world group itself.
    - ``errors``: every rank, on gloo: the end-of-call flag all-reduces ([Note: failures]); a group of
      its own, so that data-parallel all-reduces running during the pipeline never interleave with them.
    - ``data``: every data-parallel rank (dp x dp_shard, and the cp ranks) of one (pp, tp) position
      (dp_shard > 1): the loss mean.
    - ``ep`` / ``ep_replica``: [Note: expert-parallel groups] (ep > 1).
    """

    dp: dist.ProcessGroup | None = None
    dp_shard: dist.ProcessGroup | None = None
    cp: dist.ProcessGroup | None = None
    pp: dist.ProcessGroup | None = None
    tp: dist.ProcessGroup | None = None
    pipe: dist.ProcessGroup | None = None
    errors: dist.ProcessGroup | None = None
    data: dist.ProcessGroup | None = None
    ep: dist.ProcessGroup | None = None
    ep_replica: dist.ProcessGroup | None = None

    def axes(self) -> dict[str, dist.ProcessGroup | None]:
        """The axis names fxsplit.tp.collectives resolves inside a stage (``bind_groups``)."""
        return {"tp": self.tp, "dp": self.dp, "ep": self.ep, "cp": self.cp}

    def all(self) -> tuple[dist.ProcessGroup, ...]:
        """Every group that exists, each once."""
        out: list[dist.ProcessGroup] = []
        for f in dataclasses.fields(self):
            g = getattr(self, f.name)
            if g is not None and all(g is not h for h in out):
                out.append(g)
        return tuple(out)

    def without(self, *names: str) -> Groups:
        """These groups with ``names`` given up (None)."""
        return dataclasses.replace(self, **{n: None for n in names})


def _set_timeout(group: dist.ProcessGroup, bound: datetime.timedelta) -> None:
    """``group``'s own timeout (every collective on it, e.g. FSDP2's, ends by then)."""
    try:
        group.set_timeout(bound)
    except (AttributeError, RuntimeError):  # a backend without it keeps its own (NCCL's watchdog)
        pass


def build_groups(mesh: DeviceMesh, *, ep: int, timeout: datetime.timedelta) -> Groups:
    """Every process group of a run on ``mesh`` ([Note: process groups]), each bounded by ``timeout``.
    Collective on every rank of the default group."""
    found: dict[str, dist.ProcessGroup | None] = dict(mesh_groups(mesh))
    for group in found.values():  # every wait fxsplit cannot poll is bounded by `timeout` too
        _set_timeout(group, timeout)
    sizes = dict(zip(mesh.mesh_dim_names or (), mesh.shape))
    dp, ds, cp, pp, tp = (sizes.get(d, 1) for d in ("dp", "dp_shard", "cp", "pp", "tp"))
    if dist.get_world_size() > 1:
        found["errors"] = dist.new_group(backend="gloo", timeout=timeout)
        if pp > 1:  # one group per (dp, dp_shard, cp, tp) coordinate, ordered by pp rank
            chains = mesh.mesh.reshape(dp * ds * cp, pp, tp).permute(0, 2, 1).reshape(-1, pp).tolist()
            found["pipe"], _ = dist.new_subgroups_by_enumeration(chains, timeout=timeout)
        if cp > 1:  # [Note: cp gradients]: the gradient all-reduce runs over dp x cp, summed over cp
            # (per dp_shard index: with dp_shard, FSDP reduces over dp_shard x cp, [Note: FSDP over cp])
            replicas = mesh.mesh.reshape(dp, ds, cp, pp * tp).permute(1, 3, 0, 2).reshape(-1, dp * cp).tolist()
            found["dp"], _ = dist.new_subgroups_by_enumeration(replicas, timeout=timeout)
        if ds > 1:  # every data-parallel rank (dp x dp_shard, x cp) of one (pp, tp) position: the loss mean
            replicas = mesh.mesh.reshape(dp * ds * cp, pp * tp).t().tolist()
            found["data"], _ = dist.new_subgroups_by_enumeration(replicas, timeout=timeout)
    if ep > 1:
        found["ep"], found["ep_replica"] = expert_groups(mesh, ep, timeout=timeout)
    return Groups(**found)


def choose_backend(*, local_ranks: int, cuda_devices: int) -> tuple[str, str]:
    """The backend for ``local_ranks`` processes on a host with ``cuda_devices`` GPUs, and a
    one-line reason when it is not the obvious one: NCCL with one GPU per local rank; gloo on the
    CPU when there are no GPUs, or fewer GPUs than local ranks (NCCL needs a GPU of its own per
    rank), e.g. ``make demo``'s 4 processes on a 1-GPU workstation."""
    if cuda_devices <= 0:
        return "gloo", ""
    if local_ranks > cuda_devices:
        return "gloo", (f"{local_ranks} processes on this host but {cuda_devices} CUDA device(s): running on "
                        f"the CPU over gloo (NCCL needs one GPU per process; launch at most {cuda_devices} "
                        f"process(es) per host, e.g. torchrun --nproc-per-node {cuda_devices}, to run on the GPUs)")
    return "nccl", ""


def init_from_env(*, timeout_s: float = 600.0, backend: str | None = None) -> None:
    """Initialize the default process group from torchrun's environment, unless already done.

    Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK for the CUDA device).
    `backend` defaults to :func:`choose_backend`'s pick (NCCL with a GPU per local rank, else gloo
    on the CPU, saying why in one line). `timeout_s` bounds every
    collective, so a rank that never arrives fails the job instead of hanging it.
    """
    if dist.is_initialized():
        return
    if not dist.is_available():
        raise RunError("init_from_env: this torch build has no torch.distributed support")
    missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise RunError(
            f"init_from_env: environment variable(s) {', '.join(missing)} not set; launch with "
            "`torchrun --nproc-per-node=N your_script.py` (which sets them), or call "
            "torch.distributed.init_process_group(...) yourself"
        )
    if timeout_s <= 0:
        raise UsageError(f"init_from_env: timeout_s must be > 0, got {timeout_s!r}")
    if backend is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        backend, why = choose_backend(local_ranks=local, cuda_devices=count)
        if why and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            _log.warning("fxsplit: %s", why)
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            raise RunError(
                f"init_from_env: LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} "
                "CUDA device(s) are visible; start at most that many processes per node"
            )
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s)
    )


def shared_gpus(gpus: list[tuple[str, str]]) -> dict[tuple[str, str], list[int]]:
    """The GPUs that more than one rank uses: ``gpus[r]`` is global rank r's (host, GPU id: the
    device's UUID, which stays one name under any CUDA_VISIBLE_DEVICES) -> the ranks sharing it.
    NCCL needs a GPU of its own per rank; two ranks on one GPU fail NCCL's start-up ("Duplicate GPU
    detected") or hang in it, so parallelize checks first and names the ranks."""
    ranks: dict[tuple[str, str], list[int]] = {}
    for rank, gpu in enumerate(gpus):
        ranks.setdefault(tuple(gpu), []).append(rank)
    return {gpu: rs for gpu, rs in ranks.items() if len(rs) > 1}
