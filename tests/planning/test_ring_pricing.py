"""cp's third attention method, ring attention (K/V passed round the cp ring by torch's ring), in the planner:
priced step by step (each step's K/V transfer against the step's attention, the longer of the two; the
backward's K/V gradients in fp32 on the same link; the last gradient unhidden), its attention the ring's
kernels (step 0 causal over the rank's own chunks, cp − 1 unmasked half blocks), keeping no gathered K/V
and no masks (its buffers in flight transient); offered beside dp on SDPA attention only; pinned with
``cp_attention=ring``; refused in one line elsewhere; recorded in the plan."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from synthetic import transformer_graph

import autopar
from autopar.choice import CpAttention, LayerChoice
from autopar.contract import REPLICATED, cp_methods, ring_refusal
from autopar.cost_models.communication import p2p_time_s
from autopar.cost_models.compute import attention_time_s
from autopar.cost_models.pipeline import Schedule, ScheduleKind
from autopar.cost_models.presets import PRESETS
from autopar.errors import PinError, PlanError
from autopar.graph import LayerGraph, OpKind, OpRecord, SampleDim
from autopar.mesh import Mesh
from autopar.pins import Pins
from autopar.planning import context_price
from autopar.planning.configs import enumerate_configs
from autopar.planning.configuration import Configuration, TrainingSpec
from autopar.planning.layer_compute import cp_attention_share, layer_compute, ring_elementwise_s
from autopar.planning.pricing import PriceTable

RING, ALL_GATHER, ULYSSES = CpAttention.RING, CpAttention.ALL_GATHER, CpAttention.ULYSSES
H, HEADS, KV_HEADS = 256, 4, 2


def _graph(seq: int = 64, kv_heads: int = KV_HEADS) -> LayerGraph:
    """A synthetic transformer whose blocks record one causal SDPA call: its K/V bytes, head count and kernel."""
    base = transformer_graph(2, H, seq, vocab=1024, heads=HEADS)
    kv = 2.0 * seq * kv_heads * (H // HEADS) * 2  # K and V of one sample, bf16
    attn = OpRecord(OpKind.ATTENTION, flops_per_sample=4.0 * seq * seq * H, per_sample=SampleDim.NONE, causal=True)
    layers = [replace(l, kv_bytes_per_sample=kv, qo_bytes_per_sample=2 * kv * HEADS / kv_heads, attention_calls=1,
                      kv_heads=(kv_heads,), ops=(attn,)) if l.kind == "Block" else l for l in base]
    return LayerGraph(layers, model_name="cp", example_batch=1, dtype_bytes=base.dtype_bytes, seq_len=seq,
                      output_bytes_per_sample=base.output_bytes_per_sample, cp_refusal="")


def _price(graph: LayerGraph, cp: int, method: CpAttention, batch: int = 4, cluster: str = "h100-80g"):
    spec = PRESETS[cluster].for_world_size(cp)
    config = Configuration(Mesh(cp=cp), 1, Schedule(ScheduleKind.NONE), REPLICATED, method)
    table = PriceTable(graph, config, spec, TrainingSpec(batch, dtype="bf16"))
    i = next(l.index for l in graph if l.kind == "Block")
    return table, graph[i], table.prices[i][table.choices[i].index(LayerChoice(None, 0, False))]


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_ring_attention_is_step_zero_causal_and_cp_minus_one_unmasked_half_blocks(cp: int) -> None:
    """Of the S × S work a rank computes (2L)² causal and cp − 1 blocks of 2L × L, L = S/(2·cp):
    (cp + 1)/(2·cp²) of it counted (step 0's kernel at the causal rate, which skips its masked half), in cp
    kernels a call."""
    graph = _graph()
    layer = next(l for l in graph if l.kind == "Block")
    device, b, work = PRESETS["h100-80g"].device, 4, 4 * layer.ops[0].flops_per_sample
    got = layer_compute(replace(layer, flops_per_sample=layer.ops[0].flops_per_sample), None, 1, b, device, "bf16",
                        cp=cp, method=RING)
    fwd = attention_time_s(work / cp**2, device, "bf16", causal=True) + (cp - 1) * attention_time_s(
        work / (2 * cp**2), device, "bf16")
    bwd = attention_time_s(work / cp**2, device, "bf16", backward=True, causal=True) + (cp - 1) * attention_time_s(
        work / (2 * cp**2), device, "bf16", backward=True)
    m_fwd, m_bwd = ring_elementwise_s(layer, b, device, "bf16", 1.0, cp)  # the merges and casts around them
    assert m_fwd > 0 and m_bwd > 0
    assert got.device_fwd_s == pytest.approx(fwd + m_fwd, rel=1e-9)
    assert got.device_bwd_s == pytest.approx(bwd + m_bwd, rel=1e-9)
    assert cp_attention_share(cp, RING) == pytest.approx((1 + (cp - 1) / 2) / cp**2)


@pytest.mark.parametrize(("cp", "seq"), [(2, 64), (4, 64), (4, 65536)])
def test_ring_prices_each_steps_transfer_against_its_attention(cp: int, seq: int) -> None:
    """Forward: Σ_{i<cp−1} max(a_i, x) + a_{cp−1}; backward: Σ_i max(b_i, l_i) + y, the K/V gradient y in
    fp32; the cp communication is what the attention does not hide (module docstring of context_price).
    Short sequences wait on the link; a long one hides every K/V transfer of the forward."""
    graph = _graph(seq)
    table, layer, price = _price(graph, cp, RING)
    b, local = 4, 4 * layer.kv_bytes_per_sample / cp  # the rank's K/V of one call, bf16
    link = table.cluster.collective_sync_s
    x = p2p_time_s(local, inter_node=False, cluster=table.cluster) + link
    y = p2p_time_s(2 * local, inter_node=False, cluster=table.cluster) + link  # fp32: twice bf16's bytes
    work, device = b * layer.ops[0].flops_per_sample, table.cluster.device
    a0, a = attention_time_s(work / cp**2, device, "bf16", causal=True), attention_time_s(work / (2 * cp**2), device,
                                                                                           "bf16")
    b0 = attention_time_s(work / cp**2, device, "bf16", backward=True, causal=True)
    bs = attention_time_s(work / (2 * cp**2), device, "bf16", backward=True)
    fwd = max(0, x - a0) + (cp - 2) * max(0, x - a)
    links = [x * (i <= cp - 2) + y * (i >= 1) for i in range(cp)]
    bwd = sum(max(0, l - t) for l, t in zip(links, [b0] + [bs] * (cp - 1))) + y
    assert price.cp_comm_mb_s == pytest.approx(fwd + bwd, rel=1e-9)
    if seq == 65536:
        assert fwd == 0 and bwd == pytest.approx(y)  # only the last gradient waits
    else:
        assert fwd > 0


def test_ring_elementwise_work_is_the_merges_packing_and_casts_of_torchs_ring() -> None:
    """The heaviest rank's bytes (layer_compute.ring_elementwise_s): at cp = 2 in bf16 (p = 2, E_o output and
    E_kv K/V elements of the rank) the forward moves 2·p·E_kv + 3·6·E_o + 32·E_o bytes; fp32 casts nothing."""
    graph = _graph()
    layer = next(l for l in graph if l.kind == "Block")
    device = replace(PRESETS["h100-80g"].device, op_model=None)  # bytes over the bandwidth, no kernel overhead
    e_o, e_kv = 4 * layer.qo_bytes_per_sample / 2 / 2 / 2, 4 * layer.kv_bytes_per_sample / 2 / 2
    fwd, bwd = ring_elementwise_s(layer, 4, device, "bf16", 1.0, 2)
    assert fwd * device.memory_bandwidth_bytes_s == pytest.approx(4 * e_kv + 18 * e_o + 32 * e_o)
    assert bwd * device.memory_bandwidth_bytes_s == pytest.approx(
        4 * (e_o + e_kv) + 10 * (e_o + e_kv) + (10 * e_kv + 13 * e_o) + 4 * e_kv + 16 * e_kv + 6 * (e_o + e_kv))
    fwd32, _ = ring_elementwise_s(layer, 4, device, "fp32", 2.0, 2)  # the same elements in fp32: no casts
    assert fwd32 * device.memory_bandwidth_bytes_s == pytest.approx(8 * e_kv + 32 * e_o)
    assert ring_elementwise_s(layer, 4, device, "bf16", 1.0, 1) == (0.0, 0.0)


def test_ring_keeps_no_gathered_kv_and_counts_its_buffers_in_flight() -> None:
    graph = _graph()
    _, _, alone = _price(graph, 1, ALL_GATHER)
    table, layer, ring = _price(graph, 2, RING)
    _, _, gather = _price(graph, 2, ALL_GATHER)
    assert ring.activation_mb_bytes == pytest.approx(alone.activation_mb_bytes / 2, abs=2)
    assert gather.activation_mb_bytes > ring.activation_mb_bytes  # the gathered K/V and the masks
    local = 4 * layer.kv_bytes_per_sample / 2
    assert context_price.ring_transient_bytes(table, layer) == pytest.approx(2 * local + 3 * 2 * local)
    gather_table, _, _ = _price(graph, 2, ALL_GATHER)
    # one layer's activations less all-gather's kept K/V and masks, plus the ring's buffers in flight
    assert table.workspace_bytes - gather_table.workspace_bytes == pytest.approx(
        2 * local + 3 * 2 * local - 4 * context_price.kept_bytes(gather_table, layer), abs=4)


def test_ring_is_offered_beside_dp_tp_pp_or_ep_on_sdpa_and_refused_elsewhere_in_one_line() -> None:
    graph = _graph()
    assert cp_methods(graph, Mesh(cp=2)) == (ALL_GATHER, ULYSSES, RING)
    assert cp_methods(graph, Mesh(cp=2, dp=2)) == (ALL_GATHER, ULYSSES, RING)
    # beside tp (cp × tp = 4 does not divide the 2 key/value heads: no Ulysses) and inside pipeline stages
    assert cp_methods(graph, Mesh(cp=2, tp=2)) == (ALL_GATHER, RING)
    assert cp_methods(graph, Mesh(cp=2, pp=2)) == (ALL_GATHER, ULYSSES, RING)
    assert ring_refusal(graph, Mesh(pp=2, cp=2, tp=2)) is None
    # beside ep (run against one device: tests/runtime/test_context_experts.py)
    assert ring_refusal(graph, Mesh(cp=2, ep=2)) is None and ring_refusal(graph, Mesh(dp=2, cp=2, ep=2)) is None
    by_hand = _graph()
    by_hand.cp_manual = {"blocks.0.attn": ()}  # as capture records a nanoGPT's attention
    why = ring_refusal(by_hand, Mesh(cp=2))
    assert why.startswith("ring attention does not run on attention written by hand (blocks.0.attn")
    assert RING not in cp_methods(by_hand, Mesh(cp=2))
    cluster = PRESETS["h100-80g"].for_world_size(4)
    with pytest.raises(PinError, match="^pin cp_attention=ring: ring attention does not run on attention written"):
        enumerate_configs(by_hand, 4, cluster, TrainingSpec(4, dtype="bf16"), Pins.parse(["cp_attention=ring"]))
    with pytest.raises(PinError, match="^pin cp_attention=ring splits attention over cp ranks, but cp=1 is pinned"):
        enumerate_configs(graph, 4, cluster, TrainingSpec(4, dtype="bf16"), Pins.parse(["cp_attention=ring", "cp=1"]))
    configs = enumerate_configs(graph, 4, cluster, TrainingSpec(4, dtype="bf16"), Pins())
    # the free search offers the ring beside dp and tp; cp × pp is offered where pp is pinned (as all-gather's)
    assert {(c.mesh.cp, c.mesh.tp, c.cp_attention) for c in configs} >= {(2, 1, RING), (4, 1, RING), (2, 2, RING)}
    staged = enumerate_configs(graph, 4, cluster, TrainingSpec(4, dtype="bf16"), Pins.parse(["pp=2", "cp=2"]))
    assert {c.cp_attention for c in staged} == {ALL_GATHER, ULYSSES, RING}


def test_ring_is_not_offered_at_fp32_on_cuda_whose_flash_kernel_takes_half_precision_only() -> None:
    """On an NCCL (CUDA) cluster the ring drives SDPA's flash kernel, fp16/bf16 only: an fp32 plan gets
    no ring, and a ring pin at fp32 is one line; on CPU (gloo) fp32 keeps the ring."""
    graph = _graph()
    cluster = PRESETS["h100-80g"].for_world_size(4)
    fp32 = enumerate_configs(graph, 4, cluster, TrainingSpec(4, dtype="fp32"), Pins())
    assert {c.cp_attention for c in fp32 if c.mesh.cp > 1} == {ALL_GATHER, ULYSSES}
    with pytest.raises(PinError, match=r"^pin cp_attention=ring: ring attention on CUDA runs SDPA's flash kernel, "
                                       r"which takes fp16 and bf16 tensors, not this plan's fp32"):
        enumerate_configs(graph, 4, cluster, TrainingSpec(4, dtype="fp32"), Pins.parse(["cp_attention=ring"]))
    cpu = enumerate_configs(graph, 4, PRESETS["cpu"].for_world_size(4), TrainingSpec(4, dtype="fp32"), Pins())
    assert RING in {c.cp_attention for c in cpu}


def test_ring_beside_tp_passes_the_tp_ranks_heads_kv_round_the_cp_ring() -> None:
    """Beside tp (run against one device: test_context_ring.py) a layer whose style splits the heads passes
    its tp rank's K/V, h_kv/tp heads, round the cp ring: x and y halve at tp=2, and the layer's cp time is
    the ring's stepped time at that share; a layer tp leaves whole passes all h_kv heads."""
    graph = _graph()
    config = Configuration(Mesh(cp=2, tp=2), 1, Schedule(ScheduleKind.NONE), REPLICATED, RING)
    table = PriceTable(graph, config, PRESETS["h100-80g"].for_world_size(4), TrainingSpec(4, dtype="bf16"))
    i = next(l.index for l in graph if l.kind == "Block")
    layer, choices = graph[i], table.choices[i]
    split = table.prices[i][choices.index(LayerChoice("megatron", 0, False))]
    whole = table.prices[i][choices.index(LayerChoice(None, 0, False))]
    local = 4 * layer.kv_bytes_per_sample / 2 / 2  # the rank's K/V of its tp half of the heads, bf16, cp=2
    sync = table.cluster.collective_sync_s
    assert context_price.ring_transfers_s(table, layer, 2) == pytest.approx(
        (p2p_time_s(local, inter_node=False, cluster=table.cluster) + sync,
         p2p_time_s(2 * local, inter_node=False, cluster=table.cluster) + sync))  # the gradient in fp32
    assert split.cp_comm_mb_s == pytest.approx(sum(context_price.ring_s(table, layer, 2)), rel=1e-9)
    assert whole.cp_comm_mb_s == pytest.approx(sum(context_price.ring_s(table, layer, 1)), rel=1e-9)
    assert 0 < split.cp_comm_mb_s < whole.cp_comm_mb_s  # a short sequence: the transfers wait on the link


def test_a_ring_pin_solves_to_a_ring_plan_that_explains_and_round_trips(tmp_path) -> None:
    graph = _graph()
    plan = autopar.solve(graph, 4, cluster="h100-80g", global_batch=4, time_limit_s=5, runners_up=0,
                         pins=["cp=4", "cp_attention=ring"])
    assert plan.cp_attention is RING and plan.mesh.cp == 4
    assert "ring (K/V passed round the cp ring)" in plan.summary()
    assert any(n.startswith("cp attention by ring (cp=4): not priced, the updates") for n in plan.notes)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert autopar.Plan.load(path).cp_attention is RING
    data = json.loads(path.read_text())
    data["cp_attention"], data["mesh"]["cp"], data["mesh"]["dp"] = "ring", 1, 4
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="cp_attention 'ring' splits attention over cp ranks, but the mesh has cp=1"):
        autopar.Plan.load(path)


@pytest.mark.slow
def test_a_tiny_mixtral_plans_the_ring_beside_ep_priced_as_any_ring() -> None:
    """A tiny Hugging Face Mixtral (SDPA attention, 4 experts) captured and solved at cp=2 × ep=2 on two CPU
    ranks: the free search over the pinned mesh offers the ring beside the all-gather and Ulysses, and a ring pin
    solves to a ring plan whose cp comm is the ring's price without ep (the dispatch's all-to-alls apart, in ep
    comm: the ring passes the rank's S/cp tokens' K/V whatever the MLP does)."""
    from moe_cases import hf_mixtral

    model, inputs = hf_mixtral()
    graph = autopar.capture(model, inputs)
    spec, cluster = TrainingSpec(2, dtype="fp32"), PRESETS["cpu"].for_world_size(2)
    configs = enumerate_configs(graph, 2, cluster, spec, Pins.parse(["cp=2", "ep=2"]))
    assert {c.cp_attention for c in configs if (c.mesh.cp, c.mesh.ep) == (2, 2)} == {ALL_GATHER, ULYSSES, RING}
    plan = autopar.solve(graph, 2, cluster="cpu", dtype="fp32", global_batch=2, runners_up=0,
                         pins=["cp=2", "ep=2", "cp_attention=ring"])
    assert (plan.mesh.cp, plan.mesh.ep, plan.cp_attention) == (2, 2, RING)
    alone = autopar.solve(graph, 2, cluster="cpu", dtype="fp32", global_batch=2, runners_up=0,
                          pins=["cp=2", "ep=1", "cp_attention=ring"])
    ring, dense = plan.predicted.breakdown, alone.predicted.breakdown
    assert ring.cp_comm_s == pytest.approx(dense.cp_comm_s) and ring.cp_comm_s > 0  # ep leaves the ring as it is
    assert ring.ep_comm_s > 0 and dense.ep_comm_s == 0
