"""Expert parallelism in autopar.planning.pricing, figure by figure: ep divides the routed experts'
memory, adds its all-to-alls to the layer's per-microbatch collectives and the experts' all-reduce over
the expert-data-parallel group to its exposed traffic, and nothing at ep = 1."""

from __future__ import annotations

from dataclasses import replace

import pytest
from synthetic import transformer_graph

from autopar.choice import LayerChoice
from autopar.contract import REPLICATED, DataParallelism
from autopar.cost_models.communication import Collective, all_to_all_time_s, collective_time_s, place_group
from autopar.cost_models.pipeline import Schedule, ScheduleKind
from autopar.cost_models.presets import PRESETS
from autopar.experts import Dispatch, ExpertLayout, MoEFacts, RouterKind
from autopar.graph import LayerGraph
from autopar.mesh import Mesh
from autopar.plan import BREAKDOWN_TERMS
from autopar.planning import expert_price
from autopar.planning.configuration import Configuration, TrainingSpec
from autopar.planning.evaluate import evaluate
from autopar.planning.pricing import PriceTable

E, K, EXPERT = 8, 2, 3 * 256 * 512  # experts, top-k, one expert's parameters (H=256, I=512)


def _moe_graph() -> LayerGraph:
    base = transformer_graph(2, 256, 64, vocab=1024, heads=4)
    facts = MoEFacts("blocks.0.mlp", "blocks.0.mlp.experts", E, K, EXPERT, 2.0 * EXPERT, 256 * E,
                     RouterKind.SOFTMAX_TOPK, ExpertLayout.FUSED, Dispatch.GROUPED,
                     routed_activation_bytes_per_sample=1000.0)
    layers = [replace(l, moe=(facts,), param_count=l.param_count + E * EXPERT) if l.name == "blocks.0" else l
              for l in base]
    return LayerGraph(layers, model_name="moe", example_batch=1, dtype_bytes=base.dtype_bytes, seq_len=64)


def _price(ep: int, dp: int = 4, zero: int = 0, per_node: int = 8, world: int | None = None):
    graph = _moe_graph()
    cluster = replace(PRESETS["h100-80g"], gpus_per_node=per_node).for_world_size(world or dp)
    mode = DataParallelism(sharded=True, root_zero=zero) if zero else REPLICATED
    table = PriceTable(graph, Configuration(Mesh(dp=dp, ep=ep), 1, Schedule(ScheduleKind.NONE), mode), cluster,
                       TrainingSpec(8 * dp, dtype="fp32"))
    i = next(l.index for l in graph if l.moe)
    return table, graph[i], table.prices[i][table.choices[i].index(LayerChoice(None, zero, False))]


def test_ep_holds_one_ep_th_of_the_experts_with_their_whole_state() -> None:
    _, _, one = _price(1)
    table, layer, two = _price(2)
    routed = E * EXPERT
    assert expert_price.local_params(table, layer) == routed // 2
    # fp32 Adam: 4 (weights) + 4 (grads) + 8 (moments) bytes a parameter; half the experts leave the rank
    # both run on DDP, whose fp32 buckets hold no expert gradient under ep (the experts are left out of it)
    assert two.buckets_bytes > 0 and one.buckets_bytes - two.buckets_bytes == 4 * routed
    assert (one.state_bytes - one.buckets_bytes) - (two.state_bytes - two.buckets_bytes) == 16 * routed // 2
    assert one.params_bytes - two.params_bytes == 4 * routed // 2


def test_ep_adds_dispatch_and_combine_all_to_alls_forward_and_backward() -> None:
    table, layer, two = _price(2)
    _, _, one = _price(1)
    rows = table.microbatch_size * layer.boundary_bytes_per_sample * table.act_scale * K
    a2a = all_to_all_time_s(rows, table.ep_group, table.cluster)
    counts = all_to_all_time_s(8 * E, table.ep_group, table.cluster)
    assert a2a > 0 and table.ep_group.size == 2
    assert two.forward_tp_mb_s - one.forward_tp_mb_s == pytest.approx(2 * a2a + counts)
    assert two.tp_comm_mb_s - one.tp_comm_mb_s == pytest.approx(4 * a2a + counts)
    assert two.ep_comm_mb_s == pytest.approx(4 * a2a + counts) and one.ep_comm_mb_s == 0.0  # its own line


def test_the_step_breakdown_shows_the_all_to_alls_apart_from_the_tensor_parallel_collectives() -> None:
    table, _, _ = _price(2)
    choices = tuple(LayerChoice(None, 0, False) for _ in table.graph)
    step = evaluate(table, (0,) * len(choices), choices)
    b = step.breakdown
    ep = table.config.microbatches * sum(table.prices[i][table.index_of(i, c)].ep_comm_mb_s
                                         for i, c in enumerate(choices))
    assert b.ep_comm_s == pytest.approx(ep) and ep > 0 and b.tp_comm_s == pytest.approx(0.0, abs=1e-12)
    assert sum(getattr(b, key) for key, _, _ in BREAKDOWN_TERMS) == pytest.approx(step.step_time_s)


def test_expert_gradients_reduce_over_the_edp_group_only_and_are_never_hidden() -> None:
    table, layer, two = _price(2, dp=4)
    assert (table.edp_group.size, table.ep_group.size) == (2, 2)
    sync = collective_time_s(Collective.ALL_REDUCE, 4 * E * EXPERT // 2, table.edp_group, table.cluster, count=2)
    assert expert_price.sync_s(table, layer) == pytest.approx(sync) and sync > 0
    # ep = dp: every dp rank holds other experts, there is no one to reduce with
    full, layer_full, _ = _price(4, dp=4)
    assert full.edp_group.size == 1 and expert_price.sync_s(full, layer_full) == 0.0


def test_a_module_lists_experts_are_priced_as_passes_expert_list_runs_them() -> None:
    """The same all-to-alls as fused experts (the same dispatch code moves the same rows), and their
    gradients one flat all-reduce per block over edp (passes.expert_parallel.reduce_expert_grads)."""
    table, layer, _ = _price(2, dp=4)
    listed = replace(layer, moe=tuple(replace(m, layout=ExpertLayout.MODULE_LIST) for m in layer.moe))
    assert expert_price.dispatch_s(table, listed) == expert_price.dispatch_s(table, layer)
    one = collective_time_s(Collective.ALL_REDUCE, 4 * E * EXPERT // 2, table.edp_group, table.cluster, count=1)
    assert expert_price.sync_s(table, listed) == pytest.approx(one)
    assert one < expert_price.sync_s(table, layer)  # fused: gate_up_proj and down_proj, two all-reduces
    refused = replace(listed.moe[0], reroute_refusal="an expert cannot be called on one [rows, hidden] tensor")
    assert listed.moe[0].ep_refusal == "" and refused.ep_refusal.startswith("blocks.0.mlp: an expert cannot")


def test_ep_groups_are_neighbouring_dp_ranks_and_the_edp_group_spans_them() -> None:
    # 16 ranks, 8 a node: ep=8 groups sit in one node, the edp pairs cross it
    table, _, _ = _price(8, dp=16, world=16)
    assert table.ep_group == place_group(8, 1, 8) and not table.ep_group.spans_nodes
    assert table.edp_group.spans_nodes and table.edp_group.size == 2


def test_under_cp_ep_borrows_dp_times_cp_and_dispatches_the_rank_s_s_over_cp_tokens() -> None:
    """cp=2 × ep=2 beside dp=2 (passes/expert_parallel.py's expert_mesh): the ep group is the cp pair, the edp
    group the (dp × cp)/ep = 2 ranks two apart, and each all-to-all moves the rank's S/cp tokens' rows."""
    graph = _moe_graph()
    cluster = PRESETS["h100-80g"].for_world_size(4)

    def table(mesh: Mesh) -> PriceTable:
        return PriceTable(graph, Configuration(mesh, 1, Schedule(ScheduleKind.NONE), REPLICATED), cluster,
                          TrainingSpec(32, dtype="fp32"))

    cp, flat = table(Mesh(dp=2, cp=2, ep=2)), table(Mesh(dp=4, ep=2))
    assert cp.ep_group == place_group(2, 1, 8) and cp.edp_group == place_group(2, 2, 8) and cp.data_ranks == 4
    layer = next(l for l in graph if l.moe)
    rows = cp.microbatch_size * layer.boundary_bytes_per_sample * cp.act_scale * K / 2  # S/cp tokens a sample
    assert expert_price.dispatch_s(cp, layer)[1] == pytest.approx(2 * all_to_all_time_s(rows, cp.ep_group, cluster))
    assert cp.microbatch_size == 2 * flat.microbatch_size  # dp=2 ranks take twice dp=4's samples, half their tokens
    assert expert_price.dispatch_s(cp, layer) == pytest.approx(expert_price.dispatch_s(flat, layer))
    assert expert_price.imbalance_bytes(cp, layer) == pytest.approx(expert_price.imbalance_bytes(flat, layer) / 2)


def test_cp_is_refused_on_a_block_that_drops_tokens_past_a_capacity() -> None:
    """A capacity computed from the tokens of each call would drop other tokens on a rank's S/cp: no cp."""
    from autopar.contract import cp_refusal

    graph = _moe_graph()
    assert cp_refusal(Mesh(cp=2, ep=2), graph) is None
    capped = LayerGraph([replace(l, moe=tuple(replace(m, capacity_factor=1.25) for m in l.moe)) for l in graph],
                        model_name="capped", example_batch=1, dtype_bytes=graph.dtype_bytes, seq_len=64)
    assert cp_refusal(Mesh(cp=2), capped) == (
        "cp=2 cannot split capped's sequence: the mixture-of-experts block of blocks.0 drops tokens past a "
        "capacity computed from the tokens of each call, so a rank's S/cp tokens would drop others than one "
        "device drops; use cp=1")


def test_cp_with_ep_pinned_solves_and_runs_beside_tp_and_pp() -> None:
    import autopar

    graph = _moe_graph()
    graph = LayerGraph(list(graph), model_name="moe", example_batch=1, dtype_bytes=graph.dtype_bytes, seq_len=64,
                       cp_refusal="")
    plan = autopar.solve(graph, 4, cluster="h100-80g", global_batch=2, pins=["cp=2", "ep=2", "tp=1", "pp=1"])
    assert (plan.mesh.cp, plan.mesh.ep) == (2, 2)
    from autopar.contract import cp_refusal

    # beside tp and pp as well (run against one device: test_context_experts.py)
    beside_tp = autopar.solve(graph, 4, cluster="h100-80g", global_batch=2, pins=["cp=2", "ep=2", "tp=2"])
    assert (beside_tp.mesh.cp, beside_tp.mesh.ep, beside_tp.mesh.tp) == (2, 2, 2)
    assert cp_refusal(Mesh(pp=2, cp=2, ep=2), graph) is None and cp_refusal(Mesh(pp=2, cp=2, ep=2, tp=2), graph) is None


def test_an_all_to_all_moves_n_minus_1_over_n_of_the_bytes_over_nvlink_or_the_nic_share() -> None:
    cluster = PRESETS["h100-80g"].for_world_size(16)
    inside, across = place_group(8, 1, 8), place_group(4, 4, 8)  # 4 ranks, 2 a node
    nbytes = 64e6
    intra = cluster.intra_node.for_kind("all_to_all").bandwidth_bytes_s
    alpha = cluster.intra_node.for_kind("p2p").latency_s + cluster.collective_sync_s
    assert all_to_all_time_s(nbytes, inside, cluster) == pytest.approx(alpha + nbytes * 7 / 8 / intra)
    alpha = cluster.inter_node.for_kind("p2p").latency_s + cluster.collective_sync_s
    nic = cluster.nic_bandwidth_for("all_to_all")
    assert all_to_all_time_s(nbytes, across, cluster) == pytest.approx(
        alpha + max(nbytes * 1 / 4 / intra, nbytes * 2 / 4 / nic))
    assert collective_time_s(Collective.ALL_TO_ALL, nbytes, inside, cluster) == all_to_all_time_s(nbytes, inside,
                                                                                                  cluster)


def test_routed_activations_carry_the_imbalance_margin_under_ep_only() -> None:
    _, _, one = _price(1)
    table, _, two = _price(2)
    # margin 1.25 on 1000 bytes a sample of routed activations, microbatch of 8 samples (in the plan's dtype)
    assert two.activation_mb_bytes - one.activation_mb_bytes == pytest.approx(8 * 1000 * 0.25 * table.act_scale,
                                                                              abs=1)


def test_zero_shards_the_dense_weights_over_dp_and_the_experts_over_edp() -> None:
    table, layer, z3 = _price(2, dp=4, zero=3)
    routed = E * EXPERT
    dense = layer.param_count - routed
    assert expert_price.expert_zero(table, layer, 3) == 3 and table.edp_group.size == 2
    assert z3.params_bytes == 4 * (dense // 4) + 4 * (routed // 2 // 2)
    # ZeRO-1: the experts' own FSDP2 unit reduce-scatters every microbatch, so it runs (and is priced) as ZeRO-2
    table, layer, z1 = _price(2, dp=4, zero=1)
    assert expert_price.expert_zero(table, layer, 1) == 2
    assert z1.params_bytes == 4 * dense + 4 * (routed // 2)
    assert z1.grads_bytes == 4 * dense + 4 * (routed // 2 // 2)
    # no edp group to shard over (ep = dp): the experts stay whole, whatever the layer's stage
    table, layer, _ = _price(4, dp=4, zero=3)
    assert expert_price.expert_zero(table, layer, 3) == 0


def test_under_ep_the_experts_leave_their_layer_s_fsdp_unit() -> None:
    """FSDP2's buffers and workspace are sized by the largest unit: under ep an MoE layer's unit holds its
    dense weights, and its experts are a unit of this rank's 1/ep of them."""
    one, layer, _ = _price(1, zero=3)
    two, _, _ = _price(2, zero=3)
    routed = E * EXPERT
    assert one.largest_unit_params >= layer.param_count  # the experts in their layer's unit
    from autopar.contract import wrapping

    w = wrapping(two.graph, 1)
    dense = [l.param_count - (routed if l.moe else 0) for l in two.graph]
    units = [d for d, own in zip(dense, w.own) if own] + [sum(d for d, r in zip(dense, w.root) if r), routed // 2]
    assert two.largest_unit_params == max(units)
    assert two.largest_unit_params < one.largest_unit_params


def _capacity(layer, cf: float):
    """The layer's block as a GShard/Switch capacity block: its own 3-D experts, one-hot einsum dispatch."""
    moe = tuple(replace(m, experts_path=m.module_path, dispatch=Dispatch.CAPACITY, capacity_factor=cf)
                for m in layer.moe)
    return replace(layer, moe=moe)


def test_a_capacity_block_sends_its_whole_dispatched_tensor_and_keeps_its_experts_whole_over_edp() -> None:
    """GShard's all-to-all moves the dispatched [E, C, H] tensor, E·C = cf × tokens × top-k slots (padding and
    dropped slots included), with no counts; its experts are the block's own weights beside its router, so
    they stay whole over edp at every ZeRO stage (passes/expert_capacity.py) and reduce by all-reduce."""
    table, layer, _ = _price(2, dp=4, zero=3)
    capacity = _capacity(layer, E / K)  # drop-free
    rows = table.microbatch_size * layer.boundary_bytes_per_sample * table.act_scale * K
    a2a = all_to_all_time_s(rows * E / K, table.ep_group, table.cluster)
    assert expert_price.dispatch_s(table, capacity) == pytest.approx((2 * a2a, 2 * a2a))
    assert expert_price.expert_zero(table, layer, 3) == 3 and expert_price.expert_zero(table, capacity, 3) == 0
    assert capacity.moe[0].block_held and capacity.moe[0].ep_refusal == ""
    dropping = _capacity(layer, 1.25).moe[0]
    # a block that drops tokens drops them per dp rank's microbatch under ep as under dp (batch_coupling)
    assert dropping.drops_tokens and "capacity factor 1.25 × top-2 < 8 experts drops tokens" in dropping.split_refusal
    assert dropping.ep_refusal == ""
