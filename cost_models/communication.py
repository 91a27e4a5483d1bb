"""Communication: α-β collectives and point-to-point on a placed process group.

Time ≈ α + bytes · factor / busbw (nccl-tests' bus-bandwidth convention):
all-reduce factor 2(n−1)/n, all-gather, reduce-scatter and all-to-all
(n−1)/n, where ``bytes`` is the full (unsharded) buffer — for an all-to-all,
what one rank sends and receives (nccl-tests' ``alltoall_perf`` convention). A group inside one node runs at the
NVLink bus bandwidth. A group that spans nodes with ``local`` members per node
is limited by the NICs those members drive at once (each device's share of
its node's NICs), and never faster than NVLink: busbw = min(intra, local · nic).

Where the cluster follows NCCL's tuning model (``ClusterSpec.nccl_tuning``,
the GPU presets), α is NCCL's own estimate and each collective takes the
fastest of the algorithms and protocols NCCL would choose from, as NCCL
does per call (``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime`` in
NVIDIA/nccl ``src/graph/tuning.cc``, the figures below from it):

    ring   α = base + (steps − inter_steps) · hop_intra + inter_steps · hop_net
           (steps: all-reduce 2(n−1), all-gather / reduce-scatter n−1; inter_steps:
           all-reduce 2 · nodes, the others nodes − 1; a multi-node ring all-reduce
           pays its α × 1.4 more, NCCL's "plateau effect of ring" on Ampere and later)
    tree   α = base + 2 · ((ranks per node − 1) · hop_intra + log2(nodes) · hop_net),
           all-reduce only, moving 2 · bytes at 0.92 × the ring's bus bandwidth

A tree all-reduce's latency grows with log2 of the nodes where the ring's
grows with the ranks, so at large rank counts small and mid-size
all-reduces go by tree and the largest, bandwidth-bound ones by ring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from .hardware import ClusterSpec

US = 1e-6


class Collective(Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"


@dataclass(frozen=True)
class NcclProtocol:
    """One (algorithm, protocol) row of NCCL's tuning table: its base latency, its latency per hop
    over NVLink and over the network, and the share of the bus bandwidth it reaches."""

    name: str
    base_s: float
    hop_nvlink_s: float
    hop_net_s: float
    bandwidth_share: float


# NVIDIA/nccl src/graph/tuning.cc (the NCCL 2.18–2.19 tables): baseLat, hwLat[NVLINK] and
# hwLat[NET]; LL moves 8 bytes of data in every 16 (1/4 of the bus bandwidth on a multi-node
# or all-reduce ring, 1/3.8 on a tree), LL128 120 of every 128 (× 0.92 on a ring).
RING_PROTOCOLS = (
    NcclProtocol("ring/simple", 8.4 * US, 3.4 * US, 14.0 * US, 1.0),
    NcclProtocol("ring/ll128", 14.0 * US, 1.9 * US, 4.0 * US, 0.92),
    NcclProtocol("ring/ll", 6.6 * US, 0.6 * US, 2.7 * US, 0.25),
)
TREE_PROTOCOLS = (
    NcclProtocol("tree/simple", 0.0, 28.0 * US, 28.0 * US, 1.0),
    NcclProtocol("tree/ll128", 14.0 * US, 1.25 * US, 8.5 * US, 120 / 128),
    NcclProtocol("tree/ll", 6.8 * US, 0.6 * US, 5.0 * US, 1 / 3.8),
)
TREE_BANDWIDTH_SHARE = 0.92  # tuning.cc: busBw = min(busBw · .92, …) for the tree
TREE_BUS_FACTOR = 2.0  # tuning.cc: a tree's algorithm bandwidth is half its bus bandwidth
RING_PLATEAU = 1.4  # tuning.cc: a multi-node ring all-reduce's latency × 1.4 (compute capability ≥ 8.0)


@dataclass(frozen=True)
class GroupPlacement:
    """Where a process group's ranks sit: ``size`` ranks, ``local`` of them per node."""

    size: int
    local: int

    @property
    def spans_nodes(self) -> bool:
        return self.size > self.local

    @property
    def nodes(self) -> int:
        return -(-self.size // self.local)


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


def inter_node_steps(kind: str, nodes: int) -> int:
    """Of a ring's steps, those that cross nodes (tuning.cc's nInterSteps)."""
    if nodes <= 1:
        return 0
    return 2 * nodes if kind == "all_reduce" else nodes - 1


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
    and the wait for the slowest rank that a blocking collective adds (``collective_sync_s``).
    Under NCCL's tuning model, the ring/simple latency of :func:`ring_latency_s`."""
    if cluster.nccl_tuning and kind != "p2p":
        return ring_latency_s(RING_PROTOCOLS[0], kind, group) + cluster.collective_sync_s
    link = cluster.inter_node if group.spans_nodes else cluster.intra_node
    alpha = link.for_kind(kind).latency_s
    if cluster.latency_per_step:
        alpha *= ring_steps(kind, group.size)
    return alpha + cluster.collective_sync_s


def ring_latency_s(proto: NcclProtocol, kind: str, group: GroupPlacement) -> float:
    """NCCL's ring latency: a hop per step, the steps between nodes over the network."""
    steps, inter = ring_steps(kind, group.size), inter_node_steps(kind, group.nodes)
    inter = min(inter, steps)
    alpha = proto.base_s + (steps - inter) * proto.hop_nvlink_s + inter * proto.hop_net_s
    return alpha * (RING_PLATEAU if kind == "all_reduce" and group.spans_nodes else 1.0)


def tree_latency_s(proto: NcclProtocol, group: GroupPlacement) -> float:
    """NCCL's tree all-reduce latency: up and down a chain inside each node and a binary tree of nodes."""
    log_nodes = int(math.log2(group.nodes)) if group.nodes > 1 else 0
    return proto.base_s + 2 * ((group.local - 1) * proto.hop_nvlink_s + log_nodes * proto.hop_net_s)


def nccl_time_s(kind: Collective, nbytes: float, group: GroupPlacement, cluster: ClusterSpec,
                count: float = 1) -> tuple[float, str]:
    """(time, "algorithm/protocol") of the fastest choice NCCL's tuning model has for ``count``
    collectives moving ``nbytes`` in all (each of ``nbytes / count``, but ``count`` may be a share)."""
    bw = bus_bandwidth(group, cluster, kind.value)
    factor = bus_factor(kind, group.size)
    options = [(count * ring_latency_s(p, kind.value, group) + nbytes * factor / (bw * p.bandwidth_share),
                p.name) for p in RING_PROTOCOLS]
    if kind is Collective.ALL_REDUCE:
        tree_bw = bw * TREE_BANDWIDTH_SHARE
        options += [(count * tree_latency_s(p, group) + nbytes * TREE_BUS_FACTOR / (tree_bw * p.bandwidth_share),
                     p.name) for p in TREE_PROTOCOLS]
    return min(options)


def all_to_all_time_s(nbytes: float, group: GroupPlacement, cluster: ClusterSpec, *, count: float = 1) -> float:
    """Time of ``count`` all-to-alls in which each rank sends ``nbytes`` in all (1/n of it to each rank,
    itself included, so (n−1)/n of it moves).

    The n − 1 sends of an all-to-all go out together (NCCL groups them: ``ncclGroupStart`` around its
    sends and receives), so its fixed cost is one send's latency and the wait for the slowest rank
    (``collective_sync_s``). A rank's bytes for ranks of its own node move over NVLink, those for
    the other nodes' (n − local)/n over its own share of its node's NICs, both at once: the slower
    of the two paces it. No ring passes a rank's data through the others, so unlike a ring
    collective the NICs' share per rank is not multiplied by the members per node.
    """
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    n, local = group.size, group.local
    intra = nbytes * (local - 1) / n / cluster.intra_node.for_kind("all_to_all").bandwidth_bytes_s
    inter = nbytes * (n - local) / n / cluster.nic_bandwidth_for("all_to_all") if group.spans_nodes else 0.0
    link = cluster.inter_node if group.spans_nodes else cluster.intra_node
    alpha = link.for_kind("p2p").latency_s + cluster.collective_sync_s
    return count * alpha + max(intra, inter)


def collective_time_s(
    kind: Collective, nbytes: float, group: GroupPlacement, cluster: ClusterSpec, *, count: float = 1
) -> float:
    """Time of ``count`` collectives moving ``nbytes`` (full buffer size) in all.

    ``count`` may be fractional: traffic that rides in a share of a collective
    (a layer's gradients in a DDP bucket) pays that share of its latency.
    """
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    if kind is Collective.ALL_TO_ALL:
        return all_to_all_time_s(nbytes, group, cluster, count=count)
    if cluster.nccl_tuning:
        return nccl_time_s(kind, nbytes, group, cluster, count)[0] + count * cluster.collective_sync_s
    bw = bus_bandwidth(group, cluster, kind.value)
    return count * latency(group, cluster, kind.value) + nbytes * bus_factor(kind, group.size) / bw


def p2p_time_s(nbytes: float, *, inter_node: bool, cluster: ClusterSpec) -> float:
    """One send/recv of ``nbytes`` between neighbouring pipeline stages (no sync term: the
    receiver's wait for its sender is the pipeline bubble, priced there).

    Every rank of a stage (each tp rank, each dp rank) sends its own tensor to
    its peer in the next stage at the same moment; between nodes each sends
    over its own share of its node's NICs (:meth:`ClusterSpec.nic_bandwidth_for`:
    one NIC per GPU on a DGX), so the time is one rank's bytes over one share.
    """
    if nbytes <= 0:
        return 0.0
    if inter_node:
        return cluster.inter_node.for_kind("p2p").latency_s + nbytes / cluster.nic_bandwidth_for("p2p")
    link = cluster.intra_node.for_kind("p2p")
    return link.latency_s + nbytes / link.bandwidth_bytes_s
