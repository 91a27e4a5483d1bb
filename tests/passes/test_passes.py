"""Single-process tests of the lowering passes and the runtime's checks (no process group).

The passes on real process groups are tested in test_equivalence.py
(``runtime_cases``), in the same spawn as the equivalence cases.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar.errors import LaunchError, LoweringError, PlanError
from autopar.passes.recompute import apply_recompute
from autopar.passes.tensor_parallel import check_tensor_parallel
from autopar.passes.zero import layer_zero_stages
from autopar.runtime import default_loss
from autopar.sharding.rules import segment_permutation

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402


@pytest.fixture(autouse=True)
def _no_launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)


def _tiny(device: str = "cpu"):
    torch.manual_seed(0)
    return gpt.gpt(n_layer=2, d_model=32, n_head=4, vocab_size=256, seq_len=16, device=device)


@pytest.fixture(scope="module")
def graph():
    model, inputs = _tiny("meta")
    return autopar.capture(model, inputs)


def _plan(graph, world_size: int, *pins: str):
    return autopar.solve(graph, world_size, cluster="cpu", dtype="fp32", global_batch=4,
                         pins=["pp=1", *pins])


def test_segment_permutation_gives_each_rank_its_piece_of_every_segment() -> None:
    perm = segment_permutation((8, 4, 4), 2)  # GQA-shaped fused q/k/v: 4 q heads, 2 kv heads, head_dim 2
    # q rows 0..7 (4 heads × 2), k rows 8..11, v rows 12..15
    assert perm[:8].tolist() == [0, 1, 2, 3, 8, 9, 12, 13]
    assert perm[8:].tolist() == [4, 5, 6, 7, 10, 11, 14, 15]
    assert sorted(perm.tolist()) == list(range(16))


def test_tp_that_does_not_divide_heads_is_a_lowering_error(graph) -> None:
    plan = _plan(graph, 2, "dp=1", "tp=2", "zero=0", "blocks.*:tp=megatron")
    model, _ = _tiny("meta")
    check_tensor_parallel(model, graph, plan, 2)
    with pytest.raises(LoweringError, match="tp=3 does not divide"):
        check_tensor_parallel(model, graph, plan, 3)


def test_admission_lists_what_the_passes_refuse_from_the_graph_alone(graph) -> None:
    """One home for the rules: what check_tensor_parallel refuses from the graph, admission's refusals list
    first (compile and verify refuse it before any group starts); a cp or ep the graph cannot take too."""
    import dataclasses

    from autopar.admission import Here, layer_refusals, refusals
    from autopar.mesh import Mesh

    plan = _plan(graph, 2, "dp=1", "tp=2", "zero=0", "blocks.*:tp=megatron")
    assert layer_refusals(graph, plan) == [] and refusals(graph, plan, Here(world_size=2)) == []
    three = dataclasses.replace(plan, mesh=Mesh(tp=3), world_size=3)
    found = refusals(graph, three, Here(world_size=3))
    assert found and all(r.error is LoweringError for r in found)
    assert "tp=3 does not divide the sizes its 'megatron' style splits" in found[0].reason
    experts = dataclasses.replace(plan, mesh=Mesh(dp=2, ep=2), world_size=4)
    assert [r.reason for r in layer_refusals(graph, experts) if "ep=2" in r.reason] == [
        f"ep=2 shards experts, but none of the model's {len(graph)} layers has any"]


def test_admission_refuses_a_hand_edited_pipeline_the_planner_would_not_make(graph) -> None:
    """A plan file edited by hand (or a plan of another capture) reaches the runtime without the planner: a
    split-backward schedule beside recompute or ZeRO-3 would run with wrong gradients, and tp or recompute
    inside stages that call no layer module would fail in the pipeline pass. Admission refuses both first."""
    import dataclasses

    from autopar.admission import Here, pipeline_refusals, refusals

    zb = autopar.solve(graph, 2, cluster="cpu", dtype="fp32", global_batch=4,
                       pins=["pp=2", "dp=1", "schedule=interleaved_zb", "microbatches=2"])
    assert zb.schedule.value == "interleaved_zb" and pipeline_refusals(graph, zb) == []
    assert refusals(graph, zb, Here(world_size=2)) == []
    layers = tuple(dataclasses.replace(lp, choice=dataclasses.replace(lp.choice, recompute=True))
                   if lp.name.startswith("blocks") else lp for lp in zb.layers)
    edited = dataclasses.replace(zb, layers=layers)
    found = refusals(graph, edited, Here(world_size=2))
    assert found and found[0].error is LoweringError and "splits each backward" in found[0].reason
    from autopar.mesh import Mesh

    beside_tp = dataclasses.replace(zb, mesh=Mesh(pp=2, tp=2), world_size=4)  # never held to one device there
    assert any("beside tp=2 they are not offered yet" in why for why in pipeline_refusals(graph, beside_tp))
    one = autopar.solve(graph, 2, cluster="cpu", dtype="fp32", global_batch=4,
                        pins=["pp=2", "dp=1", "schedule=1f1b", "blocks.*:recompute=on"])
    assert pipeline_refusals(graph, one) == []
    inlined = graph.__class__.from_dict({**graph.to_dict(), "tracer": "export"})  # layers inlined by export
    assert any("recompute inside pipeline stages" in why for why in pipeline_refusals(inlined, one))


def test_recompute_keeps_names_and_gradients(graph) -> None:
    plan = _plan(graph, 1, "blocks.*:recompute=on", "tok_emb:recompute=off", "pos_emb:recompute=off",
                 "drop:recompute=off", "ln_f:recompute=off", "lm_head:recompute=off")
    assert [l.choice.recompute for l in plan.layers if l.name.startswith("blocks")] == [True, True]
    model, (x,) = _tiny()
    ref, _ = _tiny()
    names = [n for n, _ in model.named_parameters()]
    assert apply_recompute(model, graph, plan) == ["blocks.0", "blocks.1"]
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == list(ref.state_dict())
    x = torch.randint(0, 256, (2, 16))
    saved = {}
    for key, m in (("recompute", model), ("plain", ref)):
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            loss = default_loss(m(x), x)
        saved[key] = len(packed)
        loss.backward()
    assert saved["recompute"] < saved["plain"] / 2  # the blocks keep only their inputs
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_zero_stages_per_module_and_root(graph) -> None:
    plan = _plan(graph, 2, "dp=2", "tp=1", "zero=0")
    stages, root = layer_zero_stages(graph, plan)
    assert set(stages.values()) == {0} and root == 0 and "drop" not in stages  # no params
    plan = _plan(graph, 2, "dp=2", "tp=1", "blocks.1:zero=3",
                 *(f"{n}:zero=0" for n in ("tok_emb", "pos_emb", "drop", "blocks.0", "ln_f", "lm_head")))
    stages, root = layer_zero_stages(graph, plan)
    # blocks get their own units; the odd layers (embeddings, norm, head) share the root's
    assert stages == {"blocks.0": 0, "blocks.1": 3} and root == 1  # never a replicate root over shards


def test_outside_a_process_group_the_plan_is_inspectable_but_does_not_train(graph) -> None:
    model, inputs = _tiny("meta")
    pm = autopar.compile(model, world_size=2, example_inputs=inputs, cluster="cpu",
                         pins=["dp=2", "zero=3"], global_batch=4)
    assert pm.plan.world_size == 2 and pm.plan.mesh.dp == 2 and not pm.launched
    assert pm.predicted.step_time_s > 0
    with pytest.raises(LaunchError, match="torchrun --nproc-per-node 2"):
        pm.train_step(torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long))
    with pytest.raises(LaunchError, match="needs world_size"):
        autopar.compile(model, example_inputs=inputs)


@pytest.mark.slow
def test_one_rank_runs_locally_like_plain_torch(graph) -> None:
    model, _ = _tiny()
    ref, _ = _tiny()
    def sgd(p):
        return torch.optim.SGD(p, lr=0.1, momentum=0.9)

    pm = autopar.compile(model, world_size=1, graph=graph, plan=_plan(graph, 1, "microbatches=2"),
                         optimizer=sgd)
    x, y = torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16))
    loss = pm.train_step(x, y)
    opt = sgd(ref.parameters())
    ref_loss = default_loss(ref(x), y)
    ref_loss.backward()
    opt.step()
    assert loss == pytest.approx(ref_loss.item(), rel=1e-6)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.slow
def test_a_plan_for_another_model_is_refused(graph, tmp_path: Path) -> None:
    plan = _plan(graph, 1)
    other, inputs = gpt.gpt(n_layer=3, d_model=32, n_head=4, vocab_size=256, seq_len=16)
    with pytest.raises(PlanError, match="another model"):
        autopar.compile(other, world_size=1, example_inputs=inputs, plan=plan)
    plan.save(tmp_path / "plan.json")
    with pytest.raises(PlanError, match="another model"):
        autopar.compile(other, world_size=1, example_inputs=inputs, plan=tmp_path / "plan.json")
    with pytest.raises(PlanError, match="for 1 ranks but world_size is 2"):
        autopar.compile(_tiny("meta")[0], world_size=2, graph=graph, plan=plan)


def test_pipeline_plans_need_the_pipeline_pass() -> None:
    from autopar.runtime.lowering import _pipeline_builder

    try:
        import autopar.passes.pipeline  # noqa: F401
    except ImportError:
        with pytest.raises(PlanError, match="pipeline plans need autopar.passes.pipeline"):
            _pipeline_builder()
    else:
        assert callable(_pipeline_builder())
