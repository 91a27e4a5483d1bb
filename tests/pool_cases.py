"""Cases for the tests of :mod:`distributed` itself: well-behaved, raising, hanging, dying, leaking."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist


def ranks(rank: int, world_size: int) -> dict[str, Any]:
    """Each rank says who it is, what an all-reduce of the ranks gives, and its first random draw."""
    total = torch.tensor(float(rank))
    dist.all_reduce(total)
    return {"rank": rank, "world_size": world_size, "sum": float(total), "pid": os.getpid(),
            "draw": float(torch.rand(()))}


def draws_without_seeding(rank: int, world_size: int) -> dict[str, Any]:
    return {"draw": float(torch.rand(()))}


def raises_on_1(rank: int, world_size: int) -> dict[str, Any]:
    if rank == 1:
        raise ValueError("rank 1 has no data")
    return {"fine": True}


def hangs_on_1(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 never returns (a Python hang no collective timeout catches)."""
    while rank == 1:
        time.sleep(1.0)
    return {"fine": True}


def desyncs(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 0 waits in an all-reduce rank 1 never joins: the collective times out."""
    if rank == 0:
        dist.all_reduce(torch.zeros(1))
    return {"fine": True}


def dies_on_1(rank: int, world_size: int) -> dict[str, Any]:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 0 waits for the dead one
    return {"fine": True}


def leaks_dtype(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_default_dtype(torch.float64)
    return {"fine": True}


_KEPT: list[Any] = []


def leaks_descriptors(rank: int, world_size: int) -> dict[str, Any]:
    """Keeps 200 descriptors open after it returns, as the groups of a case's device meshes stay open."""
    _KEPT.extend(open(os.devnull) for _ in range(200))
    return {"kept": len(_KEPT)}


def leaks_threads(rank: int, world_size: int) -> dict[str, Any]:
    """Keeps 100 idle threads alive after it returns."""
    import threading

    never = threading.Event()
    for _ in range(100):
        t = threading.Thread(target=never.wait, daemon=True)
        t.start()
        _KEPT.append(t)
    return {"threads": threading.active_count()}


def meshes(rank: int, world_size: int) -> dict[str, Any]:
    """Builds a 2-D device mesh (its size-1 dimension makes a group on each rank), runs a DTensor
    all-reduce on it, and says how many groups this process has open."""
    from torch.distributed import distributed_c10d
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("pp", "dp"))
    x = distribute_tensor(torch.arange(4.0 * world_size).reshape(world_size, 4), mesh, [Replicate(), Shard(0)])
    return {"sum": float(x.sum().full_tensor()), "groups": len(distributed_c10d._world.pg_map)}


def counts_groups(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed import distributed_c10d

    return {"groups": len(distributed_c10d._world.pg_map)}


def reads_env(rank: int, world_size: int) -> dict[str, Any]:
    return {"value": os.environ.get("AUTOPAR_POOL_TEST")}


CASES = {f.__name__: f for f in (ranks, draws_without_seeding, raises_on_1, hangs_on_1, desyncs, dies_on_1,
                                 leaks_dtype, leaks_descriptors, leaks_threads, meshes, counts_groups, reads_env)}
