"""cp's second attention method, the head all-to-all (DeepSpeed-Ulysses), in the planner: priced as four
all-to-alls of (cp − 1)/cp² · b · S · h · bytes each way and full causal attention over S for heads/cp,
keeping no gathered K/V and no masks; offered only where cp (× tp) divides every attention's key/value
heads; chosen against the all-gather by cost; pinned with ``cp_attention=``; refused in one line naming
the head count; recorded in the plan (older plans load as all-gather)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from synthetic import transformer_graph

import autopar
from autopar.choice import CpAttention, LayerChoice
from autopar.contract import REPLICATED, cp_methods, ulysses_refusal
from autopar.cost_models.communication import Collective, collective_time_s, place_group
from autopar.cost_models.compute import attention_time_s
from autopar.cost_models.pipeline import Schedule, ScheduleKind
from autopar.cost_models.presets import PRESETS
from autopar.errors import LoweringError, PinError, PlanError
from autopar.graph import Layer, LayerGraph, OpKind, OpRecord, SampleDim
from autopar.mesh import Mesh
from autopar.pins import Pins
from autopar.planning.configs import enumerate_configs
from autopar.planning.configuration import Configuration, TrainingSpec
from autopar.planning.layer_compute import layer_compute
from autopar.planning.pricing import PriceTable

ULYSSES, ALL_GATHER = CpAttention.ULYSSES, CpAttention.ALL_GATHER


def _graph(heads: int = 4, kv_heads: int = 2, seq: int = 64, hidden: int = 256, blocks: int = 2,
           recorded: bool = True) -> LayerGraph:
    """A synthetic transformer whose blocks carry what capture records of their SDPA call: K and V bytes,
    Q and output bytes, and the key/value head count (``recorded`` False: a graph captured before it)."""
    base = transformer_graph(blocks, hidden, seq, vocab=1024, heads=heads)
    d = hidden // heads
    kv, qo = 2.0 * seq * kv_heads * d * 2, 2.0 * seq * heads * d * 2  # bf16, per sample, whole sequence
    layers = [replace(l, kv_bytes_per_sample=kv, qo_bytes_per_sample=qo, attention_calls=1,
                      kv_heads=(kv_heads,) if recorded else ()) if l.kind == "Block" else l for l in base]
    return LayerGraph(layers, model_name="cp", example_batch=1, dtype_bytes=base.dtype_bytes, seq_len=seq,
                      output_bytes_per_sample=base.output_bytes_per_sample, cp_refusal="")


def _price(graph: LayerGraph, cp: int, method: CpAttention, tp: int = 1, style: str | None = None,
           batch: int = 4):
    cluster = PRESETS["h100-80g"].for_world_size(cp * tp)
    config = Configuration(Mesh(cp=cp, tp=tp), 1, Schedule(ScheduleKind.NONE), REPLICATED, method)
    table = PriceTable(graph, config, cluster, TrainingSpec(batch, dtype="bf16"))
    i = next(l.index for l in graph if l.kind == "Block")
    return table, graph[i], table.prices[i][table.choices[i].index(LayerChoice(style, 0, False))]


@pytest.mark.parametrize(("cp", "tp"), [(2, 1), (4, 1), (2, 2)])
def test_ulysses_moves_four_all_to_alls_each_way_and_keeps_only_its_share(cp: int, tp: int) -> None:
    """Each of q, k, v and the output: every rank sends its b · S/cp tokens of the tensor (of its tp
    rank's heads under a Megatron style), (cp − 1)/cp of it to the others; forward and backward alike.
    Nothing is kept beyond 1/cp of the activations (no gathered K/V, no prefix masks)."""
    graph = _graph(heads=8, kv_heads=4)
    style = "megatron" if tp > 1 else None
    table, layer, price = _price(graph, cp, ULYSSES, tp, style)
    group = place_group(cp, tp, table.cluster.gpus_per_node)
    assert table.cp_group == group
    b, seq, d = 4, 64, 256 // 8
    q = b * seq * 8 * d * 2 / cp / tp  # one rank's local query (= output), bf16
    k = b * seq * 4 * d * 2 / cp / tp  # one rank's local key (= value)
    one_way = 2 * collective_time_s(Collective.ALL_TO_ALL, q, group, table.cluster) + 2 * collective_time_s(
        Collective.ALL_TO_ALL, k, group, table.cluster)
    assert price.cp_comm_mb_s == pytest.approx(2 * one_way, rel=1e-12)
    # (cp − 1)/cp of each local buffer moves: (cp − 1)/cp² · b · S · h · bytes, the volume
    assert q * (cp - 1) / cp == pytest.approx(b * seq * 8 * d * 2 / tp * (cp - 1) / cp**2)
    _, _, alone = _price(graph, 1, ALL_GATHER, tp, style)
    assert price.activation_mb_bytes == pytest.approx(alone.activation_mb_bytes / cp, abs=2)
    _, _, gather = _price(graph, cp, ALL_GATHER, tp, style)
    assert gather.activation_mb_bytes > price.activation_mb_bytes  # the gathered K/V and the masks


def test_ulysses_attention_is_full_causal_attention_over_s_for_heads_over_cp() -> None:
    """One causal kernel per call on 1/cp of the work (its heads), at the causal rate, on every rank:
    no head-tail imbalance and no masked rectangle (all-gather's two masked prefix kernels do
    (2·cp + 1)/(4·cp²) of the S × S work at the full rate: more at cp = 2, about as much as cp grows)."""
    device, b, flops = PRESETS["h100-80g"].device, 4, 1e12
    op = OpRecord(OpKind.ATTENTION, flops_per_sample=flops, per_sample=SampleDim.NONE, causal=True)
    layer = Layer("attn", 0, "Attention", flops_per_sample=flops, param_count=0, param_bytes=0,
                  activation_bytes_per_sample=0.0, input_bytes_per_sample=0.0, boundary_bytes_per_sample=0.0,
                  can_cut_after=True, ops=(op,))
    for cp in (2, 4, 8):
        got = layer_compute(layer, None, 1, b, device, "bf16", cp=cp, method=ULYSSES)
        assert got.fwd_s == pytest.approx(attention_time_s(b * flops / cp, device, "bf16", causal=True), rel=1e-12)
        assert got.bwd_s == pytest.approx(
            attention_time_s(b * flops / cp, device, "bf16", backward=True, causal=True), rel=1e-12)


def test_ulysses_is_offered_only_where_cp_times_tp_divides_every_kv_head_count() -> None:
    graph = _graph(heads=8, kv_heads=2)
    assert cp_methods(graph, Mesh(cp=2)) == (ALL_GATHER, ULYSSES, CpAttention.RING)  # the ring beside dp
    assert cp_methods(graph, Mesh(cp=4)) == (ALL_GATHER, CpAttention.RING)
    assert ulysses_refusal(graph, Mesh(cp=4)) == (
        "Ulysses at cp=4 needs 4 to divide the key/value heads, but blocks.0 has 2 key/value heads")
    assert "cp × tp = 2 × 2 = 4" in ulysses_refusal(graph, Mesh(cp=2, tp=2))
    assert "capture did not record" in ulysses_refusal(_graph(recorded=False), Mesh(cp=2))
    cluster = PRESETS["h100-80g"].for_world_size(4)
    configs = enumerate_configs(graph, 4, cluster, TrainingSpec(4, dtype="bf16"), Pins())
    methods = {(c.mesh.cp, c.cp_attention) for c in configs}
    assert (2, ULYSSES) in methods and (2, ALL_GATHER) in methods and (4, ULYSSES) not in methods
    assert (1, ULYSSES) not in methods


def test_ulysses_is_offered_inside_pipeline_stages_and_on_attention_written_by_hand_beside_dp_tp_pp_or_ep() -> None:
    """Inside pipeline stages Ulysses runs as the all-gather does (run against one device at cp=2 × pp=2);
    on attention written by hand it runs beside dp, tp, pp and ep (its heads recorded at capture, cp dividing
    them; beside tp cp × tp)."""
    graph = _graph(heads=8, kv_heads=2)
    assert ulysses_refusal(graph, Mesh(pp=2, cp=2)) is None
    assert cp_methods(graph, Mesh(pp=2, cp=2)) == (ALL_GATHER, ULYSSES, CpAttention.RING)
    assert cp_methods(graph, Mesh(pp=2, cp=4)) == (ALL_GATHER, CpAttention.RING)  # the head rule holds in stages too
    by_hand = _graph(heads=8, kv_heads=4)
    by_hand.cp_manual = {"blocks.0.attn": ()}  # as capture records a nanoGPT's attention
    assert ulysses_refusal(by_hand, Mesh(cp=2, dp=2)) is None and ULYSSES in cp_methods(by_hand, Mesh(cp=2))
    assert ulysses_refusal(by_hand, Mesh(pp=2, cp=2)) is None and ulysses_refusal(by_hand, Mesh(cp=2, tp=2)) is None
    assert ULYSSES in cp_methods(by_hand, Mesh(cp=2, tp=2)) and ULYSSES in cp_methods(by_hand, Mesh(pp=2, cp=2))
    assert ulysses_refusal(by_hand, Mesh(pp=2, cp=2, tp=2)) is None
    # beside ep (run against one device: tests/runtime/test_context_experts.py, nanoGPT with Mixtral's MoE blocks)
    assert ulysses_refusal(by_hand, Mesh(cp=2, ep=2)) is None and ULYSSES in cp_methods(by_hand, Mesh(cp=2, ep=2))
    assert "needs 8 to divide the key/value heads" in ulysses_refusal(by_hand, Mesh(cp=4, tp=2))
    assert "needs 8 to divide the key/value heads" in ulysses_refusal(by_hand, Mesh(cp=8))
    unrecorded = _graph(heads=8, kv_heads=2, recorded=False)
    unrecorded = LayerGraph([replace(l, attention_calls=0) for l in unrecorded], model_name="cp", example_batch=1,
                            dtype_bytes=unrecorded.dtype_bytes, seq_len=64, cp_refusal="",
                            output_bytes_per_sample=unrecorded.output_bytes_per_sample,
                            cp_manual={"blocks.0.attn": ()})  # by hand: no SDPA call, heads not recorded
    assert "capture did not record for blocks.0" in ulysses_refusal(unrecorded, Mesh(cp=2))


def _best(graph: LayerGraph, world: int, pins: list[str]) -> autopar.Plan:
    return autopar.solve(graph, world, cluster="h100-80g", global_batch=1, pins=["pp=1", *pins], runners_up=0)


@pytest.mark.parametrize(("heads", "kv_heads", "cp", "cheaper"), [
    # multi-head attention, cp = 8: Ulysses moves 4·(cp − 1)/cp² = 7/16 of b·S·h, all-gather 2·(cp − 1)/cp = 7/4
    (16, 16, 8, ULYSSES),
    # grouped-query 16:2 at cp = 2: Ulysses moves q and the output of 16 heads, all-gather K/V of 2
    (16, 2, 2, ALL_GATHER),
])
def test_the_solver_takes_the_cheaper_method(heads: int, kv_heads: int, cp: int, cheaper: CpAttention) -> None:
    """Free, the solver's method is the one whose plan (each method pinned) is faster; which one that is
    follows the volumes: Ulysses where the heads are many per key/value head few and cp large, the
    all-gather where grouped-query attention makes K/V small beside q and the output."""
    graph = _graph(heads=heads, kv_heads=kv_heads, seq=16384, hidden=2048, blocks=4)
    free = _best(graph, cp, [f"cp={cp}"])
    pinned = {m: _best(graph, cp, [f"cp={cp}", f"cp_attention={m}"]) for m in (ULYSSES, ALL_GATHER)}
    assert pinned[ULYSSES].cp_attention is ULYSSES and pinned[ALL_GATHER].cp_attention is ALL_GATHER
    faster = min(pinned, key=lambda m: pinned[m].predicted.step_time_s)
    assert free.cp_attention is faster is cheaper
    assert free.predicted.step_time_s == pytest.approx(pinned[cheaper].predicted.step_time_s, rel=1e-9)
    other = pinned[ALL_GATHER if cheaper is ULYSSES else ULYSSES]
    assert other.predicted.breakdown.cp_comm_s > free.predicted.breakdown.cp_comm_s
    assert f"cp attention {cheaper.value}" in free.summary()


def test_a_ulysses_pin_cp_does_not_divide_the_kv_heads_is_refused_in_one_line() -> None:
    graph = _graph(heads=8, kv_heads=2)
    with pytest.raises(PinError, match=r"^pin cp_attention=ulysses: Ulysses at cp=4 needs 4 to divide the "
                                       r"key/value heads, but blocks.0 has 2 key/value heads$"):
        autopar.solve(graph, 4, cluster="h100-80g", global_batch=1, pins=["cp=4", "cp_attention=ulysses"])
    with pytest.raises(PinError, match=r"cp × tp = 2 × 2 = 4 needs 4 to divide .* has 2 key/value heads"):
        autopar.solve(graph, 4, cluster="h100-80g", global_batch=1, pins=["cp=2", "tp=2", "cp_attention=ulysses"])
    with pytest.raises(PinError, match=r"cp=1 is pinned"):
        autopar.solve(graph, 4, cluster="h100-80g", global_batch=4, pins=["cp=1", "cp_attention=ulysses"])
    with pytest.raises(PinError, match=r"cp_attention must be allgather, ulysses or ring, got 'zigzag'"):
        Pins.parse(["cp_attention=zigzag"])
    # cp free: Ulysses pinned runs at the cp degrees it can (cp=2 here, beside dp=2), never at cp=4
    plan = autopar.solve(graph, 4, cluster="h100-80g", global_batch=2, pins=["cp_attention=ulysses", "tp=1",
                                                                            "pp=1", "dp=2"])
    assert plan.mesh.cp == 2 and plan.cp_attention is ULYSSES
    # one sample on 4 ranks leaves only cp=4 (with tp and pp pinned to 1), where Ulysses cannot run
    with pytest.raises(PinError, match=r"^pin cp_attention=ulysses: Ulysses at cp=4 needs 4 .* has 2 key/value "
                                       r"heads \(and no other mesh the pins allow runs it\)$"):
        autopar.solve(graph, 4, cluster="h100-80g", global_batch=1, pins=["cp_attention=ulysses", "tp=1", "pp=1"])


def test_the_method_is_in_the_plan_file_and_an_older_plan_loads_as_all_gather() -> None:
    from autopar.passes.context_parallel import check_context_parallel

    graph = _graph(heads=8, kv_heads=2)
    plan = _best(graph, 2, ["cp=2", "cp_attention=ulysses"])
    data = json.loads(plan.to_json())
    assert data["cp_attention"] == "ulysses"
    assert autopar.Plan.from_json(plan.to_json()).cp_attention is ULYSSES
    del data["cp_attention"]
    assert autopar.Plan.from_dict(data).cp_attention is ALL_GATHER
    with pytest.raises(PlanError, match=r"field 'cp_attention' is 'zigzag'; use allgather, ulysses or ring"):
        autopar.Plan.from_dict({**data, "cp_attention": "zigzag"})
    check_context_parallel(graph, plan)  # runs: cp=2 divides 2 key/value heads
    hand_made = replace(plan, mesh=Mesh(cp=4), world_size=4)  # a plan the solver would not make
    with pytest.raises(LoweringError, match=r"^Ulysses at cp=4 needs 4 to divide the key/value heads, but "
                                            r"blocks.0 has 2 key/value heads$"):
        check_context_parallel(graph, hand_made)


def test_explain_shows_the_method_and_prices_the_other_one() -> None:
    """``autopar explain`` names each column's cp attention, and ``--why-not cp_attention=…`` solves the
    plan again with the other method: slower by the cp line (the all-gather moves 7/4 of b·S·h at
    cp = 8 where Ulysses moves 7/16)."""
    from autopar.tools.explain import explain

    graph = _graph(heads=16, kv_heads=16, seq=16384, hidden=2048, blocks=4)
    plan = _best(graph, 8, ["cp=8"])
    assert plan.cp_attention is ULYSSES
    e = explain(plan, graph, ["cp_attention=allgather"])
    table = e.render()
    assert any(line.split()[:4] == ["cp", "attention", "ulysses", "allgather"] for line in table.splitlines())
    cf = e.counterfactuals[0]
    assert cf.figures is not None and cf.figures.cp_attention == "allgather" and not cf.same_plan
    assert cf.figures.step_time_s > plan.predicted.step_time_s
    assert cf.figures.term("cp_comm_s") > plan.predicted.breakdown.cp_comm_s


def test_a_ulysses_plan_notes_what_its_price_leaves_out() -> None:
    plan = _best(_graph(heads=8, kv_heads=2), 2, ["cp=2", "cp_attention=ulysses"])
    assert any(n.startswith("cp attention by Ulysses' head all-to-all (cp=2): not priced") for n in plan.notes)
    gather = _best(_graph(heads=8, kv_heads=2), 2, ["cp=2", "cp_attention=allgather"])
    assert not any("Ulysses" in n for n in gather.notes)
