"""Context parallelism in the planner: cp divides a layer's compute and activations and the loss's
logits (attention by the prefix share that runs), adds the K/V all-gather (forward) and reduce-scatter
(backward) of (cp − 1)/cp · 2 · b · S · h_kv · bytes and the gathered K/V and prefix masks to what
attention keeps, shards ZeRO over dp × cp;
it is searched with the other axes, pinned, and refused with one line where it cannot run."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from synthetic import transformer_graph

import autopar
from autopar.choice import LayerChoice
from autopar.contract import REPLICATED, DataParallelism, Engine, cp_admits_style, cp_refusal, plan_engine
from autopar.cost_models.communication import Collective, collective_time_s, p2p_time_s, place_group
from autopar.cost_models.compute import attention_time_s, compute_time_s
from autopar.cost_models.pipeline import Schedule, ScheduleKind
from autopar.cost_models.presets import PRESETS
from autopar.errors import LoweringError, PinError
from autopar.graph import Layer, LayerGraph, OpKind, OpRecord, SampleDim
from autopar.mesh import Mesh
from autopar.passes.context_parallel import positions
from autopar.pins import Pins
from autopar.planning import configs as configs_module
from autopar.planning.bounds import lower_bound_s
from autopar.planning.choices import allowed_choices
from autopar.planning.configs import CP_UNSEARCHED, enumerate_configs, searched_configs
from autopar.planning.configuration import Configuration, TrainingSpec
from autopar.planning.evaluate import evaluate
from autopar.planning.layer_compute import layer_compute
from autopar.planning.pricing import PriceTable
from autopar.planning.shared_prices import SharedPrices

S, H, HEADS, KV_HEADS = 64, 256, 4, 2
KV = 2.0 * S * KV_HEADS * (H // HEADS) * 2  # K and V of one sample, bf16: 2 · S · h_kv · bytes


def _graph(refusal: str = "") -> LayerGraph:
    base = transformer_graph(2, H, S, vocab=1024, heads=HEADS)
    layers = [replace(l, kv_bytes_per_sample=KV, attention_calls=1) if l.kind == "Block" else l for l in base]
    return LayerGraph(layers, model_name="cp", example_batch=1, dtype_bytes=base.dtype_bytes, seq_len=S,
                      output_bytes_per_sample=base.output_bytes_per_sample, cp_refusal=refusal)


def _price(cp: int, dp: int = 1, zero: int = 0, batch: int = 4, tp: int = 1, style: str | None = None,
           sp: bool = False):
    graph = _graph()
    cluster = PRESETS["h100-80g"].for_world_size(cp * dp * tp)
    mode = DataParallelism(sharded=True, root_zero=zero) if zero else REPLICATED
    table = PriceTable(graph, Configuration(Mesh(dp=dp, cp=cp, tp=tp), 1, Schedule(ScheduleKind.NONE), mode),
                       cluster, TrainingSpec(batch * dp, dtype="bf16"))
    i = next(l.index for l in graph if l.kind == "Block")
    return table, graph[i], table.prices[i][table.choices[i].index(LayerChoice(style, zero, False, sp))]


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_adds_the_kv_all_gather_and_its_reduce_scatter_per_attention_layer(cp: int) -> None:
    one_table, _, one = _price(1)
    table, layer, price = _price(cp)
    group = place_group(cp, 1, table.cluster.gpus_per_node)
    gathered = 4 * KV  # b · 2 · S · h_kv · bytes: collective_time_s moves (cp − 1)/cp of it
    expected = (collective_time_s(Collective.ALL_GATHER, gathered, group, table.cluster)
                + collective_time_s(Collective.REDUCE_SCATTER, gathered, group, table.cluster))
    assert one.tp_comm_mb_s == 0.0 and price.tp_comm_mb_s == pytest.approx(expected, rel=1e-12)
    assert price.cp_comm_mb_s == price.tp_comm_mb_s and one.cp_comm_mb_s == 0.0  # all of it cp's, none tp's
    # a layer priced by its FLOPs (no per-op records): 1/cp of them on each rank
    assert price.forward_mb_s == pytest.approx(compute_time_s(4 * layer.flops_per_sample / cp,
                                                              table.cluster.device, "bf16"), rel=1e-12)


def test_cp_keeps_one_cp_th_of_the_activations_plus_the_gathered_kv_and_masks() -> None:
    _, layer, one = _price(1)
    table, _, two = _price(2)
    b = 4
    gathered = b * KV / 2  # the other rank's half of K and V
    # the two prefix masks of the rank's query chunks (L = S/4 each), bf16 biases per call per microbatch:
    # rank 0's head chunk L × L and tail chunk L × 4·L, rank 1's L × 2·L and L × 3·L; 5·L² either way
    L = S // 4
    assert {L * L + L * 4 * L, L * 2 * L + L * 3 * L} == {5 * L * L}
    mask = 5 * L * L * 2
    assert two.activation_mb_bytes == pytest.approx(one.activation_mb_bytes / 2 + gathered + mask, abs=2)
    assert table.loss_bytes[0] * 2 == pytest.approx(_price(1)[0].loss_bytes[0], abs=2)  # the logits of S/cp tokens


def _attention_layer(flops: float) -> Layer:
    op = OpRecord(OpKind.ATTENTION, flops_per_sample=flops, per_sample=SampleDim.NONE, causal=True)
    return Layer("attn", 0, "Attention", flops_per_sample=flops, param_count=0, param_bytes=0,
                 activation_bytes_per_sample=0.0, input_bytes_per_sample=0.0, boundary_bytes_per_sample=0.0,
                 can_cut_after=True, ops=(op,))


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_cp_attention_is_priced_as_the_two_prefix_products_every_rank_runs(cp: int) -> None:
    """Each cp rank runs one masked SDPA per query chunk on the keys up to the chunk's last position
    (``passes/context_parallel.py``): its work is the chunk's L queries × (last position + 1) keys,
    of the S × S the op's FLOPs count, at the non-causal rate. Derived from the lowering's own
    positions, on every rank: (2·cp + 1)/(4·cp) of one S/cp × S call (5/8 at cp = 2)."""
    device, b, seq, flops = PRESETS["h100-80g"].device, 4, 4096 * cp, 1e12
    chunk = seq // (2 * cp)
    layer = _attention_layer(flops)
    old_work = b * flops / cp  # what one masked call of S/cp queries against all S keys did
    for rank in range(cp):
        last = positions(seq, cp, rank).reshape(2, chunk)[:, -1]
        works = [b * flops * chunk * (int(p) + 1) / seq**2 for p in last]
        got = layer_compute(layer, None, 1, b, device, "bf16", cp=cp)
        assert got.fwd_s == pytest.approx(sum(attention_time_s(w, device, "bf16", masked=True) for w in works),
                                          rel=1e-12)
        assert got.bwd_s == pytest.approx(sum(attention_time_s(w, device, "bf16", backward=True, masked=True)
                                              for w in works), rel=1e-12)
        assert sum(works) / old_work == pytest.approx((2 * cp + 1) / (4 * cp), rel=1e-12)
    # without an op model (FLOPs priced as a whole), the attention record's share replaces its 1/cp
    flat = replace(device, op_model=None)
    share = (2 * cp + 1) / (4 * cp * cp)
    assert layer_compute(layer, None, 1, b, flat, "bf16", cp=cp).fwd_s == pytest.approx(
        compute_time_s(b * flops * share, flat, "bf16"), rel=1e-12)


def test_zero_shards_over_dp_times_cp() -> None:
    table, layer, price = _price(2, dp=2, zero=3)
    assert table.data_ranks == 4 and table.dp_group.size == 4
    assert price.params_bytes == 2 * layer.param_count // 4  # bf16 weights, a quarter each


def test_cp_is_searched_where_the_logits_bind_and_pinned_or_refused_in_one_line() -> None:
    graph = _graph()
    plan = autopar.solve(graph, 4, cluster="h100-80g", global_batch=1, pins=["cp=4"])
    assert plan.mesh.cp == 4 and plan.mesh.dp == 1 and "cp=4" in plan.summary()
    assert autopar.Plan.from_json(plan.to_json()).mesh.cp == 4
    with pytest.raises(PinError, match=r"cp=8 needs the sequence length divisible by 2·cp = 16"):
        autopar.solve(replace_seq(graph, 24), 8, cluster="h100-80g", global_batch=1, pins=["cp=8"])
    refused = _graph("cumsum (it mixes tokens along the sequence) in blocks.0")
    with pytest.raises(PinError, match=r"cp=2 cannot split this model's sequence: cumsum"):
        autopar.solve(refused, 2, cluster="h100-80g", global_batch=1, pins=["cp=2"])
    assert cp_refusal(Mesh(dp=2, cp=2)) is None and cp_refusal(Mesh(pp=2, cp=2), graph) is None
    # cp beside ep runs beside dp (ep borrows dp × cp's ranks), tp and pp
    assert cp_refusal(Mesh(dp=2, cp=2, ep=2)) is None and cp_refusal(Mesh(cp=2, ep=2)) is None
    assert cp_refusal(Mesh(cp=2, ep=2, tp=2)) is None and cp_refusal(Mesh(pp=2, dp=2, cp=2, ep=2)) is None
    assert cp_refusal(Mesh(pp=2, cp=2, ep=2, tp=2)) is None
    # a model whose pipeline stages are single ATen graphs calls no attention module there: refused under pp
    export = LayerGraph(list(graph), model_name="exported", example_batch=1, dtype_bytes=2, seq_len=S,
                        cp_refusal="", tracer="export")
    assert cp_refusal(Mesh(cp=2), export) is None
    with pytest.raises(PinError, match=r"cp=2 with pp=2 cannot run on exported: its pipeline stages are single ATen"):
        autopar.solve(export, 4, cluster="h100-80g", global_batch=2, pins=["cp=2", "pp=2"])


def test_cp_inside_pipeline_stages_is_searched_up_to_a_count_and_noted_past_it(monkeypatch) -> None:
    """cp × pp multiplies the configurations (configs.CP_PP_SEARCHED_UP_TO): the free search takes them while
    the whole count stays within the limit, always where cp or pp is pinned, and past the limit leaves them
    out and the plan says how many, and how to plan one."""
    graph = _graph()
    cluster = PRESETS["h100-80g"].for_world_size(8)

    def searched(pins: list[str]) -> tuple[bool, int]:
        configs, left_out = searched_configs(graph, 8, cluster, TrainingSpec(4, dtype="bf16"), Pins.parse(pins))
        return any(c.mesh.cp > 1 and c.mesh.pp > 1 for c in configs), left_out

    assert searched([]) == (True, 0) and searched(["pp=1"]) == (False, 0)
    free = autopar.solve(graph, 8, cluster="h100-80g", global_batch=4)
    assert not any(n.startswith(CP_UNSEARCHED) for n in free.notes)
    every = enumerate_configs(graph, 8, cluster, TrainingSpec(4, dtype="bf16"), Pins())
    total = len(every)  # the limit counts the configurations but the split-backward schedules' twins
    monkeypatch.setattr(configs_module, "CP_PP_SEARCHED_UP_TO", sum(not c.schedule.split_backward for c in every) - 1)
    both, left_out = searched([])
    assert not both and left_out > 0 and searched(["pp=2"]) == (True, 0) and searched(["cp=2"]) == (True, 0)
    assert len(enumerate_configs(graph, 8, cluster, TrainingSpec(4, dtype="bf16"), Pins())) == total - left_out
    plan = autopar.solve(graph, 8, cluster="h100-80g", global_batch=4)
    note = next(n for n in plan.notes if n.startswith(CP_UNSEARCHED))
    assert f"its {left_out:,} configurations" in note and "--pin pp=2" in note
    assert plan.solver.configs_considered == total - left_out
    pinned = autopar.solve(graph, 8, cluster="h100-80g", global_batch=4, pins=["pp=2"])
    assert not any(n.startswith(CP_UNSEARCHED) for n in pinned.notes)


def test_tables_alike_but_for_the_schedule_share_their_rows_and_price_as_their_own() -> None:
    """The search's tables of configurations that differ only in the schedule share their rows, fastest
    times and allowed choices (pipeline meshes, cp with pp pinned among them), yet every one prices, allows
    and bounds what a table of its own does: the sharing drops no work a schedule changes."""
    graph = _graph()
    cluster = PRESETS["h100-80g"].for_world_size(8)
    training = TrainingSpec(4, dtype="bf16")
    shared, free = SharedPrices(), [{}] * len(graph)
    configs = [c for pins in ([], ["pp=2"]) for c in enumerate_configs(graph, 8, cluster, training, Pins.parse(pins))]
    assert any(c.mesh.cp > 1 and c.mesh.pp > 1 for c in configs)
    bounds = []
    for config in configs:
        table, own = PriceTable(graph, config, cluster, training, shared), PriceTable(graph, config, cluster, training)
        assert allowed_choices(table, free) == allowed_choices(own, free)
        assert table.prices == own.prices and table.choices == own.choices
        assert table.fastest_time_mb_s() == own.fastest_time_mb_s() and table.workspace_bytes == own.workspace_bytes
        bounds.append(lower_bound_s(table, allowed_choices(table, free), 2**24))  # 16 MiB: memory binds
        assert bounds[-1] == lower_bound_s(own, allowed_choices(own, free), 2**24)
    assert len(shared.rows) < len(configs)  # some configurations differ only in their schedule
    assert any(b == math.inf for b in bounds) and any(b < math.inf for b in bounds)


def test_cp_inside_pipeline_stages_is_planned_and_its_sends_carry_s_over_cp_tokens() -> None:
    """cp beside pp (run against one device in tests/runtime/test_context_parallel.py): pinned, it plans,
    and every stage boundary's send per microbatch moves the rank's S/cp tokens, 1/cp of cp=1's."""
    graph = _graph()
    plan = autopar.solve(graph, 4, cluster="h100-80g", global_batch=2, pins=["cp=2", "pp=2"])
    assert (plan.mesh.pp, plan.mesh.cp) == (2, 2)
    cluster = PRESETS["h100-80g"].for_world_size(4)
    sends = {}
    for cp in (1, 2):
        config = Configuration(Mesh(pp=2, cp=cp), 2, Schedule(ScheduleKind.ONE_F_ONE_B), REPLICATED)
        table = PriceTable(graph, config, cluster, TrainingSpec(2, dtype="bf16"))
        sends[cp] = [table.p2p_s(q, 1) for q in range(1, len(graph))]
    one_bytes = [graph[q - 1].boundary_bytes_per_sample for q in range(1, len(graph))]
    assert all(b > 0 for b in one_bytes)
    for q, nbytes in enumerate(one_bytes):
        assert sends[1][q] == pytest.approx(p2p_time_s(nbytes, inter_node=False, cluster=cluster), rel=1e-12)
        assert sends[2][q] == pytest.approx(p2p_time_s(nbytes / 2, inter_node=False, cluster=cluster), rel=1e-12)


def test_cp_is_offered_beside_both_data_parallel_modes_and_every_microbatch_count_never_on_ddp() -> None:
    """What the planner offers beside cp (each run against one device in
    tests/runtime/test_context_parallel.py): replicated and sharded plans, any microbatch count, on
    FSDP2 units over dp × cp. The composable DDP runs only where dp is the one axis above 1: a
    replicated plan under cp is one FSDP2 replicate unit, never DDP (not run under cp)."""
    graph = _graph()
    cluster = PRESETS["h100-80g"].for_world_size(4)
    configs = enumerate_configs(graph, 4, cluster, TrainingSpec(8, dtype="bf16"), Pins.parse(["cp=2", "dp=2"]))
    assert {c.microbatches for c in configs} == {1, 2, 4}
    assert {c.data_parallel.sharded for c in configs} == {False, True}
    assert {plan_engine(c.mesh, c.data_parallel) for c in configs} == {Engine.REPLICATE, Engine.FULLY_SHARD}
    assert plan_engine(Mesh(cp=2), REPLICATED) is Engine.REPLICATE
    assert plan_engine(Mesh(dp=4), REPLICATED) is Engine.DDP


def test_an_unchecked_graph_is_never_offered_cp() -> None:
    base = _graph()
    unchecked = LayerGraph(list(base), model_name="old", example_batch=1, dtype_bytes=2, seq_len=S)
    plan = autopar.solve(unchecked, 4, cluster="h100-80g", global_batch=1)
    assert plan.mesh.cp == 1
    assert LayerGraph.from_dict({k: v for k, v in base.to_dict().items() if k != "cp_refusal"}).cp_refusal


def replace_seq(graph: LayerGraph, seq: int) -> LayerGraph:
    return LayerGraph(list(graph), model_name="cp", example_batch=1, dtype_bytes=2, seq_len=seq, cp_refusal="")


def test_a_plan_shows_cp_collectives_on_their_own_line_not_as_tensor_parallel() -> None:
    """The step's breakdown names cp's K/V traffic "cp comm": under tp = 1 nothing is tensor-parallel
    communication, and the summary line says how long the K/V collectives take."""
    table, _, _ = _price(2)
    stages = tuple(0 for _ in table.graph)
    choices = tuple(LayerChoice(None, 0, False) for _ in table.graph)
    b = evaluate(table, stages, choices).breakdown
    assert b.cp_comm_s > 0 and b.tp_comm_s == pytest.approx(0.0, abs=1e-15)
    plan = autopar.solve(_graph(), 2, cluster="h100-80g", global_batch=4, pins=["cp=2"], runners_up=0)
    assert plan.predicted.breakdown.cp_comm_s > 0 and "cp K/V" in plan.summary()


@pytest.mark.parametrize("sp", [False, True])
def test_cp_beside_tp_gathers_the_tp_ranks_heads_over_a_cp_group_tp_ranks_apart(sp: bool) -> None:
    """cp × tp: a tensor-parallel block's K/V all-gather and reduce-scatter move 1/tp of the layer's
    K and V (each tp rank gathers its own heads), over the cp group, whose neighbours sit tp ranks
    apart (``Mesh.stride("cp")``); the K/V the layer keeps are the tp rank's heads too. The data
    group is the dp × cp ranks, tp apart. A block left whole by tp gathers all its heads."""
    table, layer, split = _price(2, tp=2, style="megatron", sp=sp)
    assert Mesh(cp=2, tp=2).stride("cp") == 2 and table.cp_group == place_group(2, 2, table.cluster.gpus_per_node)
    gathered = 4 * KV / 2  # b · 2 · S · h_kv/tp · bytes
    expected = (collective_time_s(Collective.ALL_GATHER, gathered, table.cp_group, table.cluster)
                + collective_time_s(Collective.REDUCE_SCATTER, gathered, table.cp_group, table.cluster))
    assert split.cp_comm_mb_s == pytest.approx(expected, rel=1e-12)
    _, _, whole = _price(2, tp=2)
    assert whole.cp_comm_mb_s == pytest.approx(
        collective_time_s(Collective.ALL_GATHER, 2 * gathered, table.cp_group, table.cluster)
        + collective_time_s(Collective.REDUCE_SCATTER, 2 * gathered, table.cp_group, table.cluster), rel=1e-12)
    # what the split layer keeps beyond 1/cp of its tp-priced activations: the other cp rank's half of
    # its heads' K and V, and the masks (the two query chunks' prefix biases per call, not split by heads)
    _, _, alone = _price(1, tp=2, style="megatron", sp=sp)
    L = S // 4
    mask = 5 * L * L * 2
    assert split.activation_mb_bytes == pytest.approx(alone.activation_mb_bytes / 2 + 4 * (KV / 2) / 2 + mask, abs=2)
    table4, _, _ = _price(2, dp=2, tp=2, style="megatron", sp=sp)
    assert table4.data_ranks == 4 and table4.dp_group == place_group(4, 2, table4.cluster.gpus_per_node)


def test_cp_beside_tp_and_sp_is_offered_and_a_whole_kv_style_or_an_unsplittable_share_is_not() -> None:
    """What the runtime runs beside cp × tp (tests/runtime/test_context_parallel.py: the GPT and a
    Llama at cp=2 × tp=2, sp off and on) is offered; a style holding key/value projections whole on
    every tp rank is not (the cp pass refuses it), nor sp where tp does not divide S/cp."""
    graph = _graph()
    table, layer, _ = _price(2, tp=2)
    i = layer.index
    assert {(c.tp, c.sp) for c in table.choices[i]} == {(None, False), ("megatron", False), ("megatron", True)}
    style = layer.tp_style("megatron")
    assert cp_admits_style(style, Mesh(cp=2, tp=2))
    whole = replace(style, whole={"attn.qkv": (0,)})
    assert not cp_admits_style(whole, Mesh(cp=2, tp=2)) and cp_admits_style(whole, Mesh(tp=2))
    blocks = [replace(l, tp_styles=(whole,)) if l.kind == "Block" else l for l in graph]
    mq = LayerGraph(blocks, model_name="cp", example_batch=1, dtype_bytes=2, seq_len=S, cp_refusal="")
    cluster = PRESETS["h100-80g"].for_world_size(4)
    mq_table = PriceTable(mq, Configuration(Mesh(cp=2, tp=2), 1, Schedule(ScheduleKind.NONE), REPLICATED),
                          cluster, TrainingSpec(4, dtype="bf16"))
    assert {c.tp for c in mq_table.choices[i]} == {None}
    # S = 64 over cp = 8 leaves 8 tokens a cp rank: tp = 4 divides them, so sp is offered; cp = 32, 2 tokens, not
    sp8 = PriceTable(graph, Configuration(Mesh(cp=8, tp=4), 1, Schedule(ScheduleKind.NONE), REPLICATED),
                     PRESETS["h100-80g"].for_world_size(32), TrainingSpec(4, dtype="bf16"))
    assert any(c.sp for c in sp8.choices[i])
    no_sp = PriceTable(graph, Configuration(Mesh(cp=32, tp=4), 1, Schedule(ScheduleKind.NONE), REPLICATED),
                       PRESETS["h100-80g"].for_world_size(128), TrainingSpec(4, dtype="bf16"))
    assert {c.tp for c in no_sp.choices[i]} >= {"megatron"} and not any(c.sp for c in no_sp.choices[i])


def test_the_solver_offers_cp_beside_tp_where_the_sequence_caps_cp() -> None:
    """A long sequence of 8,200 tokens on 8 ranks with one sample: 2·cp must divide S, so cp ≤ 4, and
    one sample leaves no dp. cp=4 × tp=2 (each cp rank's pair splitting the blocks' heads) is the plan,
    searched freely."""
    base = transformer_graph(4, 1024, 8200, vocab=32768, heads=16)
    kv = 2.0 * 8200 * (1024 // 4) * 2
    layers = [replace(l, kv_bytes_per_sample=kv, attention_calls=1) if l.kind == "Block" else l for l in base]
    graph = LayerGraph(layers, model_name="cp", example_batch=1, dtype_bytes=base.dtype_bytes, seq_len=8200,
                       output_bytes_per_sample=base.output_bytes_per_sample, cp_refusal="")
    plan = autopar.solve(graph, 8, cluster="h100-80g", global_batch=1, runners_up=0)
    assert (plan.mesh.cp, plan.mesh.tp, plan.mesh.dp, plan.mesh.pp) == (4, 2, 1, 1)
    assert {l.choice.tp for l in plan.layers if l.name.startswith("blocks.")} == {"megatron"}
    assert plan.predicted.breakdown.cp_comm_s > 0 and plan.predicted.breakdown.tp_comm_s > 0


def test_a_whole_kv_style_pinned_under_cp_is_refused_by_the_solver_and_by_the_cp_pass() -> None:
    from autopar.passes.context_parallel import check_context_parallel

    blocks = []
    for l in _graph():
        if l.kind == "Block":
            l = replace(l, tp_styles=(replace(l.tp_style("megatron"), whole={"attn.qkv": (0,)}),))
        blocks.append(l)
    mq = LayerGraph(blocks, model_name="cp", example_batch=1, dtype_bytes=2, seq_len=S, cp_refusal="")
    with pytest.raises(PinError, match=r"under cp a pinned style holds key/value projections whole"):
        autopar.solve(mq, 4, cluster="h100-80g", global_batch=1, pins=["cp=2", "tp=2", "blocks.*:tp=megatron"])
    plan = autopar.solve(mq, 4, cluster="h100-80g", global_batch=2,
                         pins=["pp=1", "dp=2", "tp=2", "blocks.*:tp=megatron"])
    cp_plan = replace(plan, mesh=plan.mesh.replace(cp=2, dp=1))  # a hand-made plan the solver would not make
    with pytest.raises(LoweringError, match=r"blocks.0, blocks.1 hold key/value projections whole on every tp rank"):
        check_context_parallel(mq, cp_plan)


def test_a_masked_call_is_priced_at_the_memory_efficient_kernels_rate_on_a_gpu_only() -> None:
    """cp's all-gather passes SDPA an explicit mask, which CUDA's flash kernel does not take: the
    memory-efficient kernel runs it, measured on an H200 at 0.51 (forward) and 0.45 (backward) of
    flash's rate (``benchmarks/gpu_attention_steps.py``). A CPU's flash kernel takes masks."""
    from autopar.cost_models.gpu_figures import MASKED_ATTENTION_BWD, MASKED_ATTENTION_FWD

    gpu, cpu, work = PRESETS["h100-80g"].device, PRESETS["cpu"].device, 1e13
    overhead = gpu.op_model.kernel_overhead_s
    for backward, share in ((False, MASKED_ATTENTION_FWD), (True, MASKED_ATTENTION_BWD)):
        plain = attention_time_s(work, gpu, "bf16", backward=backward) - overhead
        masked = attention_time_s(work, gpu, "bf16", backward=backward, masked=True) - overhead
        assert masked * share == pytest.approx(plain, rel=1e-9) and 0.4 < share < 0.6
        assert attention_time_s(work, cpu, "fp32", backward=backward, masked=True) == attention_time_s(
            work, cpu, "fp32", backward=backward)
