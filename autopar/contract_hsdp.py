"""Hybrid sharding (HSDP): ZeRO's shards over a group of the data ranks, replicated across groups.

The mesh's ``dp_replicate`` axis (:mod:`autopar.mesh`, folded into ``dp`` outermost) splits the dp
ranks into R replicas of dp/R neighbouring ranks. What runs, for a plan with R > 1:

* every ZeRO-1/2/3 unit shards over one replica's ``dp/R × cp`` ranks (the **shard group**,
  torchtitan's ``dp_shard_cp``; inside a node where it fits, so its all-gathers and reduce-scatters
  stay on NVLink) and all-reduces each reduce-scattered gradient shard over the R replicas (the
  **replicate group**, across nodes): FSDP2's own HSDP, ``fully_shard`` on the 2-D device mesh
  (``dp_replicate``, ``dp_shard_cp``) (``passes/zero.py``); the reduce-scatter divides by the whole
  ``dp × cp``, so every gradient is the mean one device computes;
* a ZeRO-0 block's replicate unit, 0-d parameters kept whole and the step's other dp reductions stay
  over all ``dp × cp`` ranks (as at R = 1);
* a unit's weights, gradients and optimizer state are ``1/(dp/R × cp)`` a rank, not ``1/(dp × cp)``.

R = 1 (the default, and every plan written before the axis) shards over all of dp as before. Torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.contract_cp import data_ranks

if TYPE_CHECKING:
    from autopar.mesh import Mesh


def shard_ranks(mesh: Mesh) -> int:
    """The ranks ZeRO shards a unit over: one replica's dp × cp (all of dp × cp at dp_replicate = 1)."""
    return data_ranks(mesh) // mesh.dp_replicate


def dp_shard(mesh: Mesh) -> int:
    """The dp ranks of one replica (the ``dp_shard=`` pin's degree): dp / dp_replicate."""
    return mesh.dp // mesh.dp_replicate


def hsdp_refusal(mesh: Mesh, *, sharded: bool | None = None, compiled: bool = False,
                 float8: bool = False) -> str | None:
    """Why ``mesh``'s dp_replicate cannot run (None when it can, and always at dp_replicate = 1).
    ``sharded``: whether the plan shards some layer (None: not known yet, the mesh alone)."""
    r = mesh.dp_replicate
    if r <= 1:
        return None
    if mesh.ep > 1:
        return (f"dp_replicate={r} beside ep={mesh.ep} is not lowered (the experts' own edp groups are not split "
                "into replicas); use dp_replicate=1")
    if shard_ranks(mesh) <= 1:
        return (f"dp_replicate={r} = dp leaves ZeRO one rank to shard over (dp_shard=1): that is replicated dp; "
                "use dp_replicate=1 with zero=0")
    if sharded is False:
        return (f"dp_replicate={r} replicates ZeRO's shards, but this plan shards nothing (every layer ZeRO-0), "
                "which already replicates over all of dp; pin zero ≥ 1 or use dp_replicate=1")
    if compiled:
        return f"dp_replicate={r} (hybrid sharding) is not run under torch.compile; plan it eager or use dp_replicate=1"
    if float8:
        return f"dp_replicate={r} (hybrid sharding) is not run with float8 weights; use dp_replicate=1"
    return None


def searched_replicas(mesh: Mesh, gpus_per_node: int) -> bool:
    """Whether the free search tries ``mesh``'s dp_replicate: 1 (shard over all of dp), or the one degree
    whose shard group is exactly one node's ranks (dp/R × cp × tp = a node), the HSDP every large PyTorch
    run uses (shard inside the node on NVLink, all-reduce across nodes: PyTorch's ``HYBRID_SHARD``).
    Larger shard groups trade memory for inter-node all-gathers that plain ZeRO already prices; they
    are planned where pinned (``dp_shard=`` or ``dp_replicate=``), and leaving them out keeps the search's
    configurations at most doubled in its sharded mode."""
    r = mesh.dp_replicate
    return r == 1 or shard_ranks(mesh) * mesh.tp == gpus_per_node


__all__ = ["dp_shard", "hsdp_refusal", "searched_replicas", "shard_ranks"]
