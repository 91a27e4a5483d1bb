"""NCCL's tuning model on the GPU presets (per-step latency, ring vs tree) and the memory budget's terms."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from autopar.cost_models import PRESETS, Collective, collective_time_s, place_group
from autopar.cost_models.communication import (
    RING_PLATEAU,
    RING_PROTOCOLS,
    TREE_PROTOCOLS,
    nccl_time_s,
    p2p_time_s,
    ring_latency_s,
    tree_latency_s,
)
from autopar.cost_models.gpu_figures import ALLOCATOR_OVERHEAD_FRACTION, CUDA_CONTEXT_BYTES, NCCL_BUFFER_BYTES
from autopar.cost_models.hardware import ClusterError
from autopar.cost_models.presets import load_cluster
from autopar.units import GiB

US = 1e-6
SIMPLE = RING_PROTOCOLS[0]


def test_gpu_presets_follow_nccl_and_the_cpu_preset_does_not():
    for name, c in PRESETS.items():
        assert c.nccl_tuning == (c.backend == "nccl"), name
    assert PRESETS["a100-40g"].intra_node.latency_s == pytest.approx(3.4 * US)  # a ring step over NVLink
    assert PRESETS["a100-40g"].inter_node.latency_s == pytest.approx(14.0 * US)  # a ring step over the network


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_latency_is_paid_per_step_inside_a_node(n):
    group = place_group(n, 1, 8)
    assert ring_latency_s(SIMPLE, "all_gather", group) == pytest.approx(8.4 * US + (n - 1) * 3.4 * US)
    assert ring_latency_s(SIMPLE, "all_reduce", group) == pytest.approx(8.4 * US + 2 * (n - 1) * 3.4 * US)


def test_steps_between_nodes_pay_the_network_hop():
    group = place_group(16, 1, 8)  # 16 ranks on 2 nodes, 8 a node
    assert group.nodes == 2
    # all-gather: 15 steps, nodes − 1 = 1 of them between nodes
    assert ring_latency_s(SIMPLE, "all_gather", group) == pytest.approx(8.4 * US + 14 * 3.4 * US + 14.0 * US)
    # all-reduce: 30 steps, 2 · nodes = 4 between nodes, and the multi-node ring's plateau
    expected = (8.4 * US + 26 * 3.4 * US + 4 * 14.0 * US) * RING_PLATEAU
    assert ring_latency_s(SIMPLE, "all_reduce", group) == pytest.approx(expected)


def test_large_collectives_in_a_node_cost_ring_simple_bytes_plus_per_step_latency():
    cluster = PRESETS["a100-80g"]
    group = place_group(8, 1, 8)
    nbytes = 1e9
    expected = 8.4 * US + 7 * 3.4 * US + nbytes * 7 / 8 / 230e9
    assert collective_time_s(Collective.ALL_GATHER, nbytes, group, cluster) == pytest.approx(expected)
    assert nccl_time_s(Collective.ALL_GATHER, nbytes, group, cluster)[1] == "ring/simple"


def test_tree_latency_grows_with_log2_of_the_nodes():
    simple = TREE_PROTOCOLS[0]
    lat = [tree_latency_s(simple, place_group(n, 8, 8)) for n in (2, 4, 8, 128)]  # one rank a node
    assert lat == pytest.approx([2 * 28 * US * k for k in (1, 2, 3, 7)])


def test_all_reduce_at_scale_goes_by_tree_until_bandwidth_wins():
    cluster = PRESETS["a100-80g"].for_world_size(1024)
    group = place_group(128, 8, 8)  # dp across 128 nodes, one rank each (tp = 8 inside)
    mid = 64e6  # a 64 MB gradient bucket: the ring's 2·127 network hops cost more than the tree's bytes
    assert nccl_time_s(Collective.ALL_REDUCE, mid, group, cluster)[1].startswith("tree")
    huge = 64e9  # bandwidth-bound: the ring moves 2(n−1)/n of the bytes, the tree 2 at 0.92 the speed
    assert nccl_time_s(Collective.ALL_REDUCE, huge, group, cluster)[1] == "ring/simple"
    # the crossover sits between: where the tree's extra bytes equal the ring's extra latency
    ring = ring_latency_s(SIMPLE, "all_reduce", group)
    tree = tree_latency_s(TREE_PROTOCOLS[0], group)
    bw = 24e9
    crossover = (ring - tree) / (2 / (0.92 * bw) - 2 * 127 / 128 / bw)
    below, above = nccl_time_s(Collective.ALL_REDUCE, crossover * 0.9, group, cluster), \
        nccl_time_s(Collective.ALL_REDUCE, crossover * 1.1, group, cluster)
    assert below[1] == "tree/simple" and above[1] == "ring/simple"
    # all-gather and reduce-scatter have no tree in NCCL: always a ring
    assert nccl_time_s(Collective.ALL_GATHER, mid, group, cluster)[1].startswith("ring")


def test_tiny_collectives_take_a_low_latency_protocol():
    group = place_group(8, 1, 8)
    t, how = nccl_time_s(Collective.ALL_REDUCE, 1024, group, PRESETS["h100-80g"])
    assert how.endswith("/ll") and t < ring_latency_s(SIMPLE, "all_reduce", group)


def test_pipeline_sends_between_nodes_go_over_each_ranks_own_nic():
    cluster = PRESETS["a100-80g"].for_world_size(16)
    nbytes = 96e6
    # every tp rank sends its own copy at once, each over its own HDR NIC (8 NICs for 8 GPUs)
    assert p2p_time_s(nbytes, inter_node=True, cluster=cluster) == pytest.approx(14 * US + nbytes / 24e9)
    # with 2 NICs a node, the 8 ranks sending at once share them: a quarter each
    shared = replace(cluster, nics_per_node=2)
    assert p2p_time_s(nbytes, inter_node=True, cluster=shared) == pytest.approx(14 * US + nbytes / 6e9)
    assert p2p_time_s(nbytes, inter_node=False, cluster=cluster) == pytest.approx(3.4 * US + nbytes / 230e9)


def test_gpu_budget_keeps_back_context_nccl_and_the_allocator_share():
    c = PRESETS["a100-40g"]
    assert c.memory_reserve_fraction == 0
    expected = (40 * GiB - CUDA_CONTEXT_BYTES - NCCL_BUFFER_BYTES) / (1 + ALLOCATOR_OVERHEAD_FRACTION)
    assert c.memory_budget_bytes == int(expected)
    assert 35 * GiB < c.memory_budget_bytes < 36 * GiB  # 40 GiB less 2.32 GiB kept back, ÷ 1.057
    # NCCL: 3 communicators × 32 channels × 2 ring connections × (4 MiB + LL128 + LL FIFOs)
    assert NCCL_BUFFER_BYTES == 3 * 32 * 2 * (4 * 2**20 + 4_915_200 + 524_288)
    assert "CUDA context" in c.memory_budget().describe()


def test_cpu_budget_and_old_cluster_files_keep_the_flat_reserve(tmp_path):
    assert PRESETS["cpu"].memory_budget_bytes == int(2 * GiB * 0.75)
    old = {k: v for k, v in PRESETS["a100-80g"].to_dict().items()
           if k not in ("nccl_tuning", "cuda_context_bytes", "nccl_buffer_bytes",
                        "allocator_overhead_fraction", "memory_reserve_fraction", "latency_per_step")}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    c = load_cluster(str(path))
    assert c.memory_budget_bytes == int(80 * GiB * 0.9) and not c.nccl_tuning


def test_budget_terms_are_validated():
    with pytest.raises(ClusterError, match="allocator_overhead_fraction"):
        replace(PRESETS["a100-40g"], allocator_overhead_fraction=1.5)
    with pytest.raises(ClusterError, match="nccl_buffer_bytes"):
        replace(PRESETS["a100-40g"], nccl_buffer_bytes=-1)
    assert replace(PRESETS["a100-40g"], cuda_context_bytes=50 * GiB).memory_budget_bytes == 0
