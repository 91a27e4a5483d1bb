"""A hand-written GShard/Switch MoE (tests/moe_cases.py's ``GShardGPT``: 3-D experts, one-hot einsum dispatch
at a fixed capacity): recognised with its capacity factor, priced at every capacity slot plus its dispatch
and combine einsums, its expert region proved splittable for ep (autopar/capturing/moe_capacity.py), and a
capacity that can drop tokens kept off every split of the batch. No process group needed.

Reference counts are computed here from the model's sizes, never from autopar's pricing.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.batch_coupling import refusal as coupling_refusal
from autopar.choice import BatchCoupling
from autopar.errors import LoweringError, PinError
from autopar.experts import Dispatch, ExpertLayout
from autopar.mesh import Mesh
from autopar.passes.expert_parallel import check_expert_parallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moe_cases  # noqa: E402

G = moe_cases.GSHARD


def _capture(build):
    torch.manual_seed(0)
    model, inputs = build()
    return model, inputs, autopar.capture(model, inputs)


def _forward_flops(tokens: int, seq: int, top_k: int, cf: float) -> float:
    """Forward FLOPs of GShardGPT on ``tokens`` tokens in one call: qkv and output projections, full T×T
    attention, the router, dispatch and combine einsums over [tokens, E, C] (2·S·E·C·M each), both expert
    einsums on every one of the E × C capacity slots (dropped or padded ones included), the head."""
    d, h, e, vocab = G["d"], G["hidden"], G["num_experts"], G["vocab"]
    c = math.ceil(cf * tokens * top_k / e)
    per_layer = (tokens * (2 * 4 * d * d + 4 * seq * d + 2 * d * e)
                 + 2 * (2 * tokens * e * c * d)  # dispatch "sec,sm->ecm" and combine "sec,ecm->sm"
                 + e * c * (2 * d * h + 2 * h * d))  # w1 and w2 on every capacity slot
    return G["layers"] * per_layer + tokens * 2 * d * vocab


@pytest.mark.parametrize(("build", "top_k", "cf"), [(moe_cases.gshard_top2, 2, 2.0), (moe_cases.gshard_top1, 1, 4.0),
                                                   (moe_cases.gshard_dropping, 1, 1.25)])
def test_gshard_layer_is_an_moe_block_priced_at_every_capacity_slot(build, top_k, cf) -> None:
    model, inputs, graph = _capture(build)
    tokens, seq = inputs[0].numel(), inputs[0].shape[1]
    assert graph.total_flops_per_sample * inputs[0].shape[0] == pytest.approx(_forward_flops(tokens, seq, top_k, cf),
                                                                              rel=1e-9)
    facts = graph.layer("h.0").moe[0]
    assert (facts.num_experts, facts.top_k, facts.capacity_factor) == (4, top_k, cf)
    assert facts.layout is ExpertLayout.FUSED and facts.dispatch is Dispatch.CAPACITY and facts.block_held
    assert facts.expert_params == 2 * G["d"] * G["hidden"] and facts.reroute_refusal == ""
    assert facts.describe().endswith(f"dispatch: one-hot einsum, capacity factor {cf:g}")
    assert facts.activation_margin(ep=2) == 1.0  # the capacity buffers are the model's own, measured


def test_a_drop_free_gshard_layer_is_offered_ep_and_its_plan_says_how_it_dispatches() -> None:
    _, _, graph = _capture(moe_cases.gshard_top2)
    plan = autopar.solve(graph, 2, cluster="cpu", global_batch=4, dtype="fp32", pins=["ep=2", "tp=1", "pp=1"])
    assert plan.mesh.ep == 2 and plan.mesh.dp == 2
    assert "dispatch: one-hot einsum, capacity factor 2" in plan.summary()


def test_a_dropping_capacity_is_split_per_rank_by_default_and_kept_whole_when_pinned_exact() -> None:
    """Capacity 1.25 on top-1 of 4 experts drops tokens, and which drop depends on the tokens of one call.
    By default (batch_coupled=auto) dp and microbatches are offered, each dp rank's microbatch its own
    capacity (as GShard and Switch compute it), and the plan names the splits, ep (which borrows dp) too;
    pinned exact, no plan that splits the batch is offered."""
    _, _, graph = _capture(moe_cases.gshard_dropping)
    why = r"capacity factor 1.25 × top-1 < 4 experts drops tokens over capacity"
    for pins, splits in ((["dp=2"], 2), (["dp=1", "microbatches=2"], 2)):
        plan = autopar.solve(graph, 2, cluster="cpu", global_batch=4, pins=pins)
        assert plan.training.batch_coupled is BatchCoupling.AUTO
        assert any(n.startswith("batch-coupled layers (h.0 (capacity MoE), h.1 (capacity MoE)): split") and
                   f"{splits} splits of 2 samples" in n for n in plan.notes), plan.notes
        with pytest.raises(PinError, match=why):
            autopar.solve(graph, 2, cluster="cpu", global_batch=4, pins=[*pins, "batch_coupled=exact"])
    # ep borrows dp's ranks and each rank dispatches its own tokens with its own capacity
    # (passes/expert_capacity.py): the same splits as dp alone, named so
    plan = autopar.solve(graph, 2, cluster="cpu", global_batch=4, pins=["ep=2"])
    assert plan.mesh.ep == 2 and any("split (batch_coupled=auto)" in n for n in plan.notes), plan.notes
    with pytest.raises(PinError, match=why):
        autopar.solve(graph, 2, cluster="cpu", global_batch=4, pins=["ep=2", "batch_coupled=exact"])
    plan = autopar.solve(graph, 2, cluster="cpu", global_batch=4, pins=["batch_coupled=exact"])
    assert plan.mesh.dp * plan.mesh.cp * plan.microbatches == 1  # what is left: one call on the whole batch
    # a split plan handed to the runtime is refused before any collective (autopar/runtime/lowering.py)
    assert re.search(why, coupling_refusal(graph, Mesh(dp=2), 1, BatchCoupling.EXACT))
    assert coupling_refusal(graph, Mesh(dp=2), 1, BatchCoupling.AUTO) is None
    assert "cp would hand it a share of each sequence" in coupling_refusal(graph, Mesh(cp=2), 1, BatchCoupling.AUTO)


def test_ep_not_dividing_the_experts_names_the_layer() -> None:
    model, inputs, graph = _capture(moe_cases.gshard_top2)
    plan = autopar.solve(graph, 2, cluster="cpu", global_batch=6, pins=["dp=2", "tp=1", "pp=1"])
    plan = dataclasses.replace(plan, mesh=Mesh(dp=6, ep=3), world_size=6)
    with pytest.raises(LoweringError, match=r"layer 'h.0': ep=3 does not divide its 4 experts"):
        check_expert_parallel(model, graph, plan)
    with pytest.raises(PinError, match=r"ep=3 does not divide the number of experts \(4 experts in 2 of 2"):
        autopar.solve(graph, 6, cluster="cpu", global_batch=6, pins=["ep=3"])


class _SumsOverExperts(moe_cases.GShardMoE):
    """A capacity block whose experts' output is summed over e before the combine: no split on e computes it."""

    def forward(self, x):
        b, t, m = x.shape
        x = x.reshape(b * t, m)
        e, c = self.num_experts, math.ceil(self.capacity_factor * b * t * self.top_k / self.num_experts)
        dispatch = F.one_hot(torch.arange(b * t) % c, c).float()[:, None, :].expand(b * t, e, c)
        routed = torch.einsum("sec,sm->ecm", dispatch, x)
        h = F.gelu(torch.einsum("ecm,emh->ech", routed, self.w1))
        y = torch.einsum("ech,ehm->cm", h, self.w2)
        return (y.sum(0) + x * self.wg(x).sum(-1, keepdim=True)).reshape(b, t, m)


class _Reshapes(moe_cases.GShardMoE):
    """A capacity block that flattens [E, C, H] into rows inside its expert region."""

    def forward(self, x):
        b, t, m = x.shape
        x = x.reshape(b * t, m)
        e = self.num_experts
        dispatch = torch.softmax(self.wg(x), -1)[:, :, None]
        routed = torch.einsum("sec,sm->ecm", dispatch, x)
        h = torch.einsum("ecm,emh->ech", routed, self.w1).reshape(e, -1)
        return (h.sum() * x).reshape(b, t, m)


@pytest.mark.parametrize(("block", "why"), [(_SumsOverExperts, "does not keep the expert index first"),
                                            (_Reshapes, "reshape on the experts' tensors")])
def test_a_region_ep_cannot_split_is_refused_naming_the_op(block, why) -> None:
    torch.manual_seed(0)
    model = moe_cases.GShardGPT(**G, top_k=2, capacity_factor=2.0)
    for layer in model.h:
        layer.moe = block(G["d"], G["hidden"], G["num_experts"], 2, 2.0)
    graph = autopar.capture(model, (torch.zeros(2, 16, dtype=torch.long),))
    facts = graph.layer("h.0").moe[0]
    assert why in facts.reroute_refusal and why in facts.ep_refusal
    with pytest.raises(PinError, match=why):
        autopar.solve(graph, 2, cluster="cpu", global_batch=4, pins=["ep=2"])
