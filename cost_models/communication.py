"""Communication: α-β collectives and point-to-point on a placed process group.

Time ≈ α + bytes · factor / busbw (nccl-tests' bus-bandwidth convention):
all-reduce factor 2(n−1)/n, all-gather and reduce-scatter (n−1)/n, where
``bytes`` is the full (unsharded) buffer. A group inside one node runs at the
NVLink bus bandwidth. A group that spans nodes with ``local`` members per node
is limited by the NICs those members drive at once (each device's share of
its node's NICs), and never faster than NVLink: busbw = min(intra, local · nic).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .hardware import ClusterSpec


class Collective(Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"


@dataclass(frozen=True)
class GroupPlacement:
    """Where a process group's ranks sit: ``size`` ranks, ``local`` of them per node."""

    size: int
    local: int

    @property
    def spans_nodes(self) -> bool:
        return self.size > self.local


def place_group(size: int, stride: int, gpus_per_node: int) -> GroupPlacement:
    """Placement of a mesh axis group of ``size`` ranks spaced ``stride`` apart.

    Ranks are laid out node by node; with the mesh (pp, dp, tp) row-major, the
    tp group has stride 1, dp stride tp, pp stride dp·tp.
    """
    if size <= 1:
        return GroupPlacement(size=max(size, 1), local=max(size, 1))
    if stride >= gpus_per_node:
        return GroupPlacement(size=size, local=1)
    local = min(size, max(1, gpus_per_node // stride))
    return GroupPlacement(size=size, local=local)


def ring_steps(kind: str, n: int) -> int:
    """Steps of a ring collective over n ranks: all-reduce 2(n−1), all-gather and
    reduce-scatter n−1, point-to-point 1."""
    if kind == "p2p":
        return 1
    return max(1, (2 if kind == "all_reduce" else 1) * (n - 1))


def bus_factor(kind: Collective, n: int) -> float:
    if n <= 1:
        return 0.0
    if kind is Collective.ALL_REDUCE:
        return 2.0 * (n - 1) / n
    return (n - 1) / n


def bus_bandwidth(group: GroupPlacement, cluster: ClusterSpec, kind: str = "all_reduce") -> float:
    intra = cluster.intra_node.for_kind(kind).bandwidth_bytes_s
    if not group.spans_nodes:
        return intra
    return min(intra, group.local * cluster.nic_bandwidth_for(kind))


def latency(group: GroupPlacement, cluster: ClusterSpec, kind: str = "all_reduce") -> float:
    """A collective's fixed time: the link's latency (per ring step where the cluster says so),
    and the wait for the slowest rank that a blocking collective adds (``collective_sync_s``)."""
    link = cluster.inter_node if group.spans_nodes else cluster.intra_node
    alpha = link.for_kind(kind).latency_s
    if cluster.latency_per_step:
        alpha *= ring_steps(kind, group.size)
    return alpha + cluster.collective_sync_s


def collective_time_s(
    kind: Collective, nbytes: float, group: GroupPlacement, cluster: ClusterSpec, *, count: float = 1
) -> float:
    """Time of ``count`` collectives moving ``nbytes`` (full buffer size) in all.

    ``count`` may be fractional: traffic that rides in a share of a collective
    (a layer's gradients in a DDP bucket) pays that share of its latency.
    """
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    bw = bus_bandwidth(group, cluster, kind.value)
    return count * latency(group, cluster, kind.value) + nbytes * bus_factor(kind, group.size) / bw


def p2p_time_s(nbytes: float, *, inter_node: bool, cluster: ClusterSpec) -> float:
    """One send/recv of ``nbytes`` between neighbouring pipeline stages (no sync term: the
    receiver's wait for its sender is the pipeline bubble, priced there)."""
    if nbytes <= 0:
        return 0.0
    if inter_node:
        return cluster.inter_node.for_kind("p2p").latency_s + nbytes / cluster.nic_bandwidth_for("p2p")
    link = cluster.intra_node.for_kind("p2p")
    return link.latency_s + nbytes / link.bandwidth_bytes_s
