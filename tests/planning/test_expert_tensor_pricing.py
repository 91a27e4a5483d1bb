"""Expert tensor parallelism (the ``megatron+experts`` style, ``autopar/sharding/experts.py``) in pricing and
in the solver, on a Hugging Face Mixtral captured on the meta device: against ``megatron`` (experts
replicated over tp), the split layer holds and computes 1/tp of its routed experts and pays one more
all-reduce of the [tokens, H] output forward and two backward (the input's and the top-k weights'
gradients); the solver picks it per layer where it is cheaper, the plan says so, and it is offered with
tp and dp (a pin beside pp, cp or ep is refused with one line), and eagerly only."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.choice import LayerChoice
from autopar.contract import REPLICATED
from autopar.cost_models.communication import Collective, collective_time_s
from autopar.cost_models.pipeline import Schedule, ScheduleKind
from autopar.cost_models.presets import PRESETS
from autopar.errors import PinError
from autopar.mesh import Mesh
from autopar.planning.configuration import Configuration, TrainingSpec
from autopar.planning.layer_compute import op_flops_per_sample, style_flops_per_sample
from autopar.planning.pricing import PriceTable
from autopar.sharding.experts import EXPERTS_STYLE

H, I, S, TP = 256, 1024, 128, 2


@pytest.fixture(scope="module")
def graph():
    import transformers

    cfg = transformers.MixtralConfig(vocab_size=256, hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=4, intermediate_size=I, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=S, use_cache=False,
                                     tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(cfg)
    return autopar.capture(model, (torch.zeros(1, S, dtype=torch.long, device="meta"),))


def _prices(graph, name: str):
    cluster = PRESETS["h100-80g"].for_world_size(TP)
    table = PriceTable(graph, Configuration(Mesh(tp=TP), 1, Schedule(ScheduleKind.NONE), REPLICATED), cluster,
                       TrainingSpec(4, dtype="fp32"))
    layer = graph.layer(name)
    price = {s: table.prices[layer.index][table.index_of(layer.index, LayerChoice(s, 0, False))]
             for s in ("megatron", EXPERTS_STYLE)}
    return table, layer, price


@pytest.mark.slow
def test_split_experts_cost_one_tp_th_and_their_all_reduces(graph) -> None:
    table, layer, price = _prices(graph, "model.layers.0")
    style, moe = layer.tp_style(EXPERTS_STYLE), layer.moe[0]
    assert I in style.divisors and style.experts == (moe.experts_path,) and not style.sequence
    # memory: fp32 weights, gradients and Adam's two moments of half the routed experts leave the rank
    routed = moe.routed_params
    rep, split = price["megatron"], price[EXPERTS_STYLE]
    assert rep.params_bytes - split.params_bytes == 4 * routed // TP
    assert rep.grads_bytes - split.grads_bytes == 4 * routed // TP
    assert rep.optimizer_bytes - split.optimizer_bytes == 8 * routed // TP
    # FLOPs: the experts' (top-k a token, S tokens a sample) are 1/tp, in the layer's total and its kernels
    experts = moe.top_k * moe.expert_flops_per_token * S
    full, half = (style_flops_per_sample(layer, n, TP) for n in ("megatron", EXPERTS_STYLE))
    assert (full - half) / (experts * (1 - 1 / TP)) == pytest.approx(1.0, abs=1e-6)
    ops_full, ops_half = (op_flops_per_sample(layer, n, TP) for n in ("megatron", EXPERTS_STYLE))
    assert (ops_full - ops_half) / (experts * (1 - 1 / TP)) == pytest.approx(1.0, abs=1e-6)
    # the collectives: the output's all-reduce forward; backward the input's and the top-k weights'
    b, elem = table.microbatch_size, 4
    base = layer.tp_style("megatron")
    fwd = lambda s: collective_time_s(Collective.ALL_REDUCE, s.fwd_allreduce_elems * elem * b, table.tp_group,  # noqa: E731
                                      table.cluster, count=s.fwd_allreduce_count)
    assert style.fwd_allreduce_elems - base.fwd_allreduce_elems == S * H
    assert style.bwd_allreduce_elems - base.bwd_allreduce_elems == S * H + S * moe.top_k
    assert (style.fwd_allreduce_count, style.bwd_allreduce_count) == (base.fwd_allreduce_count + 1,
                                                                       base.bwd_allreduce_count + 2)
    extra = fwd(style) - fwd(base) + table.cluster.tp_overhead_s
    assert split.forward_tp_mb_s - rep.forward_tp_mb_s == pytest.approx(extra) and extra > 0


@pytest.mark.slow
def test_the_solver_splits_the_experts_where_cheaper_and_the_plan_says_so(graph) -> None:
    # a batch large enough that the experts' kernels, not the host issuing them, decide (at 256 samples of 128
    # tokens an H100's host takes longer to issue each layer's ops than its kernels run, so splitting them
    # saves nothing; nor, at 8, beside the all-reduces' latency)
    plan = autopar.solve(graph, TP, cluster="h100-80g", global_batch=2048, pins=["tp=2", "dp=1", "pp=1"])
    moe = [l for l in plan.layers if graph.layer(l.name).moe]
    assert moe and all(l.choice.tp == EXPERTS_STYLE for l in moe)
    assert EXPERTS_STYLE in plan.summary()
    # beside pp the style is not offered (passes/expert_tensor.py does not run it there): a pin says why
    with pytest.raises(PinError, match=r"splitting experts over tp \(megatron\+experts\) meets pp, cp or ep"):
        autopar.solve(graph, 4, cluster="h100-80g", global_batch=8,
                      pins=["tp=2", "dp=1", "pp=2", f"model.layers.*:tp={EXPERTS_STYLE}"])
    plan = autopar.solve(graph, 4, cluster="h100-80g", global_batch=8, pins=["tp=2", "dp=1", "pp=2"])
    assert all(l.choice.tp != EXPERTS_STYLE for l in plan.layers)
    # nor compiled (its forward runs eagerly): a compiled solve keeps the experts replicated
    plan = autopar.solve(graph, TP, cluster="h100-80g", global_batch=8, pins=["tp=2", "dp=1", "pp=1"], compiled=True)
    assert all(l.choice.tp != EXPERTS_STYLE for l in plan.layers)
