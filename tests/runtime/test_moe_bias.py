"""DeepSeek-V3's bias update (``compile(..., moe_bias_update=γ)``) in one process: the rule on counts given
by hand, one device's run against the rule written out (``moe_cases.bias_reference``) with recompute
replaying the MoE layer, and the refusals. The multi-process parity (ep over dp against one device) is
``test_expert_parallel.py::test_bias_update_under_ep_matches_one_device``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import equivalence_cases as ec  # noqa: E402
import moe_cases  # noqa: E402

import autopar  # noqa: E402
from autopar.admission import Here, admit, refusals  # noqa: E402
from autopar.choice import Recompute  # noqa: E402
from autopar.errors import LoweringError  # noqa: E402
from autopar.mesh import Mesh  # noqa: E402
from autopar.runtime.balance import BiasBalancer, BiasedRouter  # noqa: E402


class _Router(nn.Module):
    def __init__(self, e: int):
        super().__init__()
        self.e_score_correction_bias = nn.Buffer(torch.zeros(e))


class _Experts(nn.Module):
    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return hidden


def test_the_rule_moves_each_bias_by_gamma_towards_the_mean_and_leaves_an_expert_at_the_mean_alone() -> None:
    router, experts = _Router(4), _Experts()
    balancer = BiasBalancer([BiasedRouter("gate", router, experts, 4)], gamma=0.5)
    h = torch.zeros(5, 2)
    experts(h, torch.tensor([[0, 3]] * 5), h)  # not counting outside a train step
    balancer.counting = True
    experts(h, torch.tensor([[0, 3], [0, 3], [0, 1], [3, 0], [1, 3]]), h)  # loads 4, 2, 0, 4 (mean 2.5)
    experts(h, top_k_index=torch.tensor([[2, 1]]), top_k_weights=h[:1])  # keywords too: loads 4, 3, 1, 4 (mean 3)
    assert balancer.loads()["gate"].tolist() == [4, 3, 1, 4]
    balancer.update()
    assert router.e_score_correction_bias.tolist() == [-0.5, 0.0, 0.5, -0.5]
    assert balancer.loads()["gate"].tolist() == [0, 0, 0, 0]  # cleared for the next step


@pytest.mark.slow
def test_one_device_moves_the_biases_as_the_rule_written_out_and_recompute_counts_each_token_once() -> None:
    spec = moe_cases.BIAS_SPECS["bias_ep2_deepseek_v3"]
    torch.manual_seed(0)
    model, inputs = spec.build()
    batches = ec._batches(spec, inputs, model)
    pm = autopar.compile(model, world_size=1, example_inputs=inputs, global_batch=spec.global_batch, dtype="fp32",
                         pins=["microbatches=2", "model.layers.*:recompute=full"], moe_bias_update=moe_cases.GAMMA,
                         optimizer=lambda p: torch.optim.SGD(p, **ec.SGD))
    assert next(lp for lp in pm.plan.layers if lp.name == "model.layers.1").choice.recompute is Recompute.FULL
    routed, update = [], pm.balancer.update
    pm.balancer.update = lambda: (routed.append(sum(int(c.sum()) for c in pm.balancer.counts)), update())
    losses = [pm.train_step(x, y) for x, y in batches]
    tokens = spec.global_batch * inputs[0].shape[1]
    assert routed == [tokens * 2] * 3  # top-2 of every token, once, though the layer's forward ran twice
    ref = moe_cases.bias_reference(spec, moe_cases.GAMMA)
    state = pm.state_dict()
    for name, bias in ref["biases"].items():
        assert torch.equal(state[name], bias) and bias.abs().max() > 0
    assert ec._max_rel({n: state[n] for n in ref["params"]}, ref["params"])[0] < 1e-5
    assert max(abs(a - b) / b for a, b in zip(losses, ref["losses"])) < 1e-5


@pytest.fixture(scope="module")
def mixtral_plan():
    torch.manual_seed(0)
    model, inputs = moe_cases.hf_mixtral()
    graph = autopar.capture(model, inputs)
    return graph, autopar.solve(graph, 1, cluster="cpu", global_batch=2, dtype="fp32")


@pytest.mark.parametrize("gamma", [-0.001, float("nan"), float("inf"), True])
@pytest.mark.slow
def test_a_negative_or_non_finite_gamma_is_refused(gamma: float, mixtral_plan) -> None:
    graph, plan = mixtral_plan
    with pytest.raises(LoweringError, match=r"^moe_bias_update must be a finite float ≥ 0 \(the bias step γ; "
                                            r"0 = off\), got "):
        admit(graph, plan, Here(world_size=1, moe_bias_update=gamma, biased_routers=1))


@pytest.mark.slow
def test_what_the_bias_update_does_not_run_under_is_refused_each_reason_named(mixtral_plan) -> None:
    """Admission lists every reason, the first raised: no biased router, a pipeline, torch.compile."""
    import dataclasses

    graph, plan = mixtral_plan
    staged = dataclasses.replace(plan, mesh=Mesh(pp=2), world_size=2,
                                 training=dataclasses.replace(plan.training, compiled=True))
    reasons = [r.reason for r in refusals(graph, staged, Here(world_size=2, moe_bias_update=0.01))]
    assert [r.split(" ")[0:3] for r in reasons[:1]] == [["moe_bias_update=0.01", "moves", "each"]]
    assert any("under a pipeline yet (pp=2)" in r for r in reasons)
    assert any("does not run with torch.compile yet" in r for r in reasons)
    assert not refusals(graph, plan, Here(world_size=1, moe_bias_update=0.01, biased_routers=1))


@pytest.mark.slow
def test_a_gamma_on_a_model_without_a_biased_router_is_refused_before_lowering() -> None:
    torch.manual_seed(0)
    model, inputs = moe_cases.hf_mixtral()
    with pytest.raises(LoweringError) as err:
        autopar.compile(model, world_size=1, example_inputs=inputs, global_batch=2, dtype="fp32",
                        moe_bias_update=0.001)
    assert str(err.value) == ("moe_bias_update=0.001 moves each router's e_score_correction_bias, and no MoE "
                              "router of this model has one (DeepSeek-V3-style routers do)")
    admit(None, autopar.solve(autopar.capture(model, inputs), 1, cluster="cpu", global_batch=2, dtype="fp32"),
          Here(world_size=1, moe_bias_update=0.0))  # 0: off, nothing asked of the model
