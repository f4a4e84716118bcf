"""Tests for fxsplit.runtime.mesh: argument checks in one process; meshes, coords and groups on 4 gloo ranks."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fxsplit.tp.collectives import axis_rank, axis_size, bind_groups, reduce_from_region
from fxsplit.runtime.mesh import build_mesh, check_mesh, init_from_env, mesh_coords, mesh_groups
from fxsplit.testing import run_distributed


def test_degrees_must_be_positive_ints():
    with pytest.raises(ValueError, match=r"tp=0 must be an int >= 1 \(1 means no tensor"):
        build_mesh(tp=0)
    with pytest.raises(ValueError, match=r"pp=-1 must be an int >= 1"):
        build_mesh(pp=-1)
    with pytest.raises(ValueError, match=r"dp=2.0 must be an int"):
        build_mesh(dp=2.0)


def test_build_mesh_without_process_group_says_how_to_start_one():
    assert not dist.is_initialized()  # pytest's own process never joins a process group
    with pytest.raises(RuntimeError, match="not initialized; call fxsplit.runtime.mesh.init_from_env"):
        build_mesh(dp=2)


def test_init_from_env_names_missing_variables(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set; launch with `torchrun"):
        init_from_env()


def _group_ranks(mesh):
    return {name: dist.get_process_group_ranks(g) for name, g in mesh_groups(mesh).items()}


def _mesh_checks(rank, world_size):
    out = {}
    for dp, pp, tp in ((2, 1, 2), (1, 2, 2), (2, 2, 1)):
        mesh = build_mesh(dp=dp, pp=pp, tp=tp)
        check_mesh(mesh, dp, pp, tp)
        assert mesh.device_type == "cpu"
        with bind_groups(mesh_groups(mesh)):
            sizes = {a: axis_size(a) for a in ("dp", "pp", "tp")}
            ranks = {a: axis_rank(a) for a in ("dp", "pp", "tp")}
            # a tp all-reduce through the mesh group sums exactly the tp peers' ranks
            total = reduce_from_region(torch.tensor([float(rank)]), axis="tp").item()
        out[(dp, pp, tp)] = dict(coords=mesh_coords(mesh), groups=_group_ranks(mesh),
                                 sizes=sizes, ranks=ranks, tp_sum=total)
        try:
            check_mesh(mesh, dp=4, pp=1, tp=1)
        except ValueError as e:
            out[(dp, pp, tp), "check"] = str(e)
    errors = {}
    for kwargs in (dict(dp=3), dict(dp=2, tp=4), dict(pp=3, tp=2)):
        try:
            build_mesh(**kwargs)
        except ValueError as e:
            errors[tuple(sorted(kwargs.items()))] = str(e)
    out["errors"] = errors
    other = init_device_mesh("cpu", (4,), mesh_dim_names=("x",))
    try:
        check_mesh(other, 1, 1, 4)
    except ValueError as e:
        out["names"] = str(e)

    # init_from_env: tear the harness's group down, then rendezvous again through env://
    port = [None]
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port[0])
    init_from_env(timeout_s=60)
    t = torch.ones(1)
    dist.all_reduce(t)
    init_from_env()  # a second call is a no-op
    out["reinit"] = (dist.get_backend(), dist.get_rank(), t.item())
    return out


@pytest.mark.dist
def test_meshes_groups_and_errors_on_four_ranks():
    results = run_distributed(_mesh_checks, 4, timeout=120)
    for r, out in enumerate(results):
        # (dp=2, tp=2): rank = 2*dp_i + tp_i
        m = out[(2, 1, 2)]
        assert m["coords"] == {"dp": r // 2, "pp": 0, "tp": r % 2}
        assert m["groups"] == {"dp": [r % 2, r % 2 + 2], "pp": [r], "tp": [r - r % 2, r - r % 2 + 1]}
        assert m["sizes"] == {"dp": 2, "pp": 1, "tp": 2} and m["ranks"] == m["coords"]
        assert m["tp_sum"] == 2 * (r - r % 2) + 1
        # (pp=2, tp=2): rank = 2*pp_i + tp_i
        m = out[(1, 2, 2)]
        assert m["coords"] == {"dp": 0, "pp": r // 2, "tp": r % 2}
        assert m["groups"] == {"dp": [r], "pp": [r % 2, r % 2 + 2], "tp": [r - r % 2, r - r % 2 + 1]}
        # (dp=2, pp=2): rank = 2*dp_i + pp_i
        m = out[(2, 2, 1)]
        assert m["coords"] == {"dp": r // 2, "pp": r % 2, "tp": 0}
        assert m["groups"] == {"dp": [r % 2, r % 2 + 2], "pp": [r - r % 2, r - r % 2 + 1], "tp": [r]}
        assert m["tp_sum"] == r  # tp of size 1: identity
        assert "shape (2, 1, 2)" in out[(2, 1, 2), "check"] and "shape (4, 1, 1)" in out[(2, 1, 2), "check"]
        # a wrong world size raises on EVERY rank, with the numbers and a valid choice
        errs = out["errors"]
        assert set(errs) == {(("dp", 3),), (("dp", 2), ("tp", 4)), (("pp", 3), ("tp", 2))}
        e = errs[(("dp", 3),)]
        assert "dp*pp*tp = 3*1*1 = 3" in e and "world size 4" in e and "(dp=4, pp=1, tp=1)" in e
        e = errs[(("dp", 2), ("tp", 4))]
        assert "= 8" in e and "(dp=1, pp=1, tp=4)" in e and "(dp=2, pp=1, tp=2)" in e
        e = errs[(("pp", 3), ("tp", 2))]
        assert "Try (dp=1, pp=2, tp=2), or launch 6 processes" in e
        assert "dims ('x',) with shape (4,)" in out["names"] and "('dp', 'pp', 'tp')" in out["names"]
        assert out["reinit"] == ("gloo", r, 4.0)


def test_backend_follows_the_gpus_there_are():
    from fxsplit.runtime.mesh import choose_backend

    assert choose_backend(local_ranks=4, cuda_devices=0) == ("gloo", "")  # a CPU host: quietly gloo
    assert choose_backend(local_ranks=4, cuda_devices=4) == ("nccl", "")  # a GPU per rank
    assert choose_backend(local_ranks=2, cuda_devices=8) == ("nccl", "")
    backend, why = choose_backend(local_ranks=4, cuda_devices=1)  # make demo on a 1-GPU workstation
    assert backend == "gloo" and "4 processes" in why and "1 CUDA device" in why
    assert "--nproc-per-node 1" in why  # the command that runs on the GPU instead


def test_ranks_sharing_a_gpu_are_named():
    # parallelize refuses these before NCCL hangs on them (the GPU id is the device's UUID)
    from fxsplit.runtime.mesh import shared_gpus

    gpus = [("a", "GPU-0"), ("a", "GPU-0"), ("a", "GPU-1"), ("b", "GPU-0"), ("a", "GPU-0")]
    assert shared_gpus(gpus) == {("a", "GPU-0"): [0, 1, 4]}
    assert shared_gpus([("a", "GPU-0"), ("a", "GPU-1"), ("b", "GPU-0")]) == {}
