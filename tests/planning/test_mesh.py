"""The one mesh type: axes declared once, and a new axis carried everywhere by that declaration alone."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest
import torch
from synthetic import transformer_graph

import autopar
from autopar.errors import MeshError, PinError, PlanError
from autopar.mesh import AXES, AxisLimits, Mesh, MeshAxis, axis, axis_names, declared, meshes
from autopar.pins import Pins
from autopar.plan import Plan

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import gpt  # noqa: E402

# A toy axis: declared, never searched (nothing prices or lowers it), so it always runs at degree 1.
TOY = MeshAxis("xp", "nothing: a toy axis", searched=False)


def test_the_axes_are_declared_outermost_first_with_tp_innermost() -> None:
    assert axis_names() == ("pp", "dp", "dp_replicate", "ep", "cp", "tp")
    mesh = Mesh(pp=2, dp=4, tp=8)
    # global rank = ((pp_rank · dp + dp_rank) · cp + cp_rank) · tp + tp_rank
    assert (mesh.stride("pp"), mesh.stride("dp"), mesh.stride("tp")) == (32, 8, 1)
    assert mesh.world_size == 64 and mesh.degrees == (2, 4, 1, 8) and mesh.dim_names() == ("pp", "dp", "cp", "tp")
    with_cp = Mesh(dp=2, cp=4, tp=2)  # cp between dp and tp: a cp group is cp neighbours of a dp rank
    assert (with_cp.stride("dp"), with_cp.stride("cp"), with_cp.world_size) == (8, 2, 16)
    assert mesh["dp"] == mesh.dp == 4 and Mesh(dp=4).pp == 1


def test_an_axis_of_degree_1_prints_nothing_but_is_in_the_file() -> None:
    assert Mesh(dp=8).describe() == "dp=8" and Mesh(pp=2, tp=2).describe() == "pp=2 × tp=2"
    assert Mesh().describe() == "1 rank"
    assert Mesh(dp=8).to_dict() == {"pp": 1, "dp": 8, "dp_replicate": 1, "ep": 1, "cp": 1, "tp": 1}


def test_meshes_are_frozen_hashable_and_ordered_outermost_first() -> None:
    assert Mesh(pp=2) == Mesh(pp=2, dp=1) and len({Mesh(pp=2), Mesh(pp=2, tp=1)}) == 1
    assert sorted([Mesh(tp=2), Mesh(pp=2), Mesh(dp=2)]) == [Mesh(tp=2), Mesh(dp=2), Mesh(pp=2)]
    with pytest.raises(AttributeError):
        Mesh(pp=2).pp = 4  # type: ignore[misc]
    assert Mesh(pp=2).replace(dp=3) == Mesh(pp=2, dp=3)


def test_a_bad_mesh_names_the_known_axes() -> None:
    with pytest.raises(MeshError, match=r"unknown mesh axis 'zp'; the mesh axes are pp, dp, dp_replicate, ep, cp, tp"):
        Mesh(zp=2)
    with pytest.raises(MeshError, match="positive integer"):
        Mesh(dp=0)
    with pytest.raises(MeshError, match=r"'zp'.*not one this autopar knows \(pp, dp, dp_replicate, ep, cp, tp\)"):
        Mesh.from_dict({"pp": 1, "dp": 2, "tp": 1, "zp": 1}, "plan")


def test_each_axis_checks_what_it_splits() -> None:
    limits = AxisLimits(world_size=16, global_batch=6, max_stages=3, gpus_per_node=4)
    pp, dp, _replicate, _ep, cp, tp = AXES
    assert "batch size 6 does not divide over dp=4" in dp.refusal(4, limits)
    assert "no sequence dimension" in cp.refusal(2, limits) and cp.searched_degrees(limits) == [1]
    assert "cut into at most 3" in pp.refusal(4, limits)
    assert tp.searched_degrees(limits) == [1, 2, 4]  # within a node unless pinned
    found = meshes(limits, {})
    assert all(m.world_size == 16 and 6 % m.dp == 0 and m.pp <= 3 and 4 % m.tp == 0 for m in found)
    assert Mesh(pp=2, dp=2, tp=4) in found and Mesh(dp=2, tp=8) not in found
    assert Mesh(dp=2, tp=8) in meshes(limits, {"tp": 8})  # a pin goes beyond the node


def test_cp_needs_a_sequence_it_splits_into_head_and_tail_chunks_of_a_model_it_can_split() -> None:
    cp = axis("cp")
    limits = AxisLimits(world_size=16, global_batch=16, max_stages=4, gpus_per_node=8, seq_len=24)
    assert cp.searched_degrees(limits) == [1, 2, 4]  # 2·cp must divide 24: not 8, not 16
    assert cp.refusal(8, limits) == ("cp=8 needs the sequence length divisible by 2·cp = 16 (each rank holds a "
                                     "head and a tail chunk, so causal work is balanced), got 24")
    refused = AxisLimits(world_size=16, global_batch=16, max_stages=4, gpus_per_node=8, seq_len=24,
                         context_refusal="cumsum (it mixes tokens along the sequence) in blocks.0")
    assert cp.refusal(2, refused) == ("cp=2 cannot split this model's sequence: cumsum (it mixes tokens along "
                                      "the sequence) in blocks.0")
    assert cp.searched_degrees(refused) == [1]
    assert {m.cp for m in meshes(limits, {})} == {1, 2, 4} and meshes(limits, {"cp": 8}) == []


def test_pins_name_the_axes_when_the_key_is_unknown() -> None:
    with pytest.raises(PinError, match=r"unknown key 'zp'; the mesh axes are pp, dp, dp_replicate, ep, cp, tp and the "
                                       r"other"):
        Pins.parse(["zp=2"])
    assert Pins.parse(["tp=8", "pp=2"]).to_strings() == ["pp=2", "tp=8"]


@pytest.fixture(scope="module")
def graph():
    return transformer_graph(4, 256, 128, vocab=512, heads=4)


def test_a_toy_axis_declared_once_is_planned_saved_pinned_and_loaded(graph, tmp_path) -> None:
    with declared(TOY):
        assert axis_names() == ("pp", "dp", "dp_replicate", "ep", "cp", "tp", "xp")
        plan = autopar.solve(graph, 8, cluster="a100-40g", global_batch=16, pins=["xp=1"])
        assert plan.mesh.xp == 1 and plan.mesh.world_size == 8 and plan.pins[-1] == "xp=1"
        mesh_line = next(line for line in plan.summary().splitlines() if line.startswith("mesh "))
        assert "xp" not in mesh_line and mesh_line.endswith(plan.mesh.describe())  # degree 1: it prints nothing
        path = tmp_path / "plan.json"
        plan.save(path)
        data = json.loads(path.read_text())
        assert data["mesh"]["xp"] == 1
        assert Plan.load(path, fingerprint=graph.fingerprint()) == plan
        # a runner-up's pins name every axis, and solve again
        pins = plan.runners_up[0].pins
        assert "xp=1" in pins
        again = autopar.solve(graph, 8, cluster="a100-40g", global_batch=16, pins=pins, runners_up=0)
        assert again.mesh == plan.runners_up[0].mesh
        with pytest.raises(PinError, match=r"the xp axis runs at degree 1 only .*; the axes a pin can set above 1 "
                                           r"are pp, dp, dp_replicate, ep, cp, tp$"):
            Pins.parse(["xp=2"])
        # a plan written before the axis was declared loads with it at degree 1
        del data["mesh"]["xp"]
        assert Plan.from_dict(data).mesh == plan.mesh
    # and a plan naming an axis this autopar does not declare is refused, naming the ones it does
    with pytest.raises(PlanError, match=r"mesh axis 'xp' is not one this autopar knows "
                                        r"\(pp, dp, dp_replicate, ep, cp, tp\)"):
        Plan.load(path)


def test_a_plan_file_written_before_the_mesh_type_still_loads() -> None:
    """``examples/plans`` holds a plan saved by an older autopar; a new axis changes nothing for it."""
    path = ROOT / "examples" / "plans" / "gpt2_xl_pp4_1f1b.json"
    old = Plan.load(path)
    with declared(TOY):
        plan = Plan.load(path)
        assert plan.mesh.xp == 1 and dict(plan.mesh.items()) == {**old.mesh.to_dict(), "xp": 1}
        assert plan.layers == old.layers and plan.summary() == old.summary()


@pytest.mark.slow
def test_a_toy_axis_lowers_and_trains_in_one_process() -> None:
    """Lowering reads the plan's mesh; the toy axis at degree 1 changes no number."""
    torch.manual_seed(0)
    model, (idx,) = gpt.gpt_tiny_plain()
    targets = torch.roll(idx, -1, dims=1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    losses = []
    for toy in (False, True):
        model.load_state_dict(state)
        with declared(TOY) if toy else contextlib.nullcontext():
            pm = autopar.compile(model, world_size=1, example_inputs=(idx,), cluster="cpu", dtype="fp32",
                                 global_batch=8, optimizer=_sgd, pins=["xp=1"] if toy else None)
            assert (pm.plan.mesh.xp == 1) if toy else "xp" not in pm.plan.mesh.to_dict()
            losses.append([pm.train_step(idx, targets) for _ in range(2)])
    assert losses[0] == losses[1]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def test_ep_folds_into_dp_it_borrows_ranks_and_multiplies_nothing() -> None:
    mesh = Mesh(pp=2, dp=4, ep=2, tp=2)
    assert mesh.world_size == 16 and mesh.degrees == (2, 4, 1, 2) and mesh.dim_names() == ("pp", "dp", "cp", "tp")
    assert mesh.stride("ep") == mesh.stride("dp") == 2  # an ep group: ep neighbouring dp ranks
    assert mesh.describe() == "pp=2 × dp=4 × ep=2 × tp=2" and mesh.to_dict()["ep"] == 2
    assert Mesh(dp=4, ep=2) != Mesh(dp=4) and Mesh(dp=4) < Mesh(dp=4, ep=2)
    with pytest.raises(MeshError, match=r"ep=4 must divide dp × cp = 2 × 1 = 2 \(ep borrows its ranks from dp × cp\)"):
        Mesh(dp=2, ep=4)


def test_ep_folds_into_dp_times_cp_an_ep_group_takes_the_cp_ranks_of_a_sample_first() -> None:
    """torchtitan's and Megatron-Core's parallel folding: ep's ranks are the flattened dp × cp, ep innermost."""
    mesh = Mesh(cp=2, ep=2, tp=2)
    assert mesh.world_size == 4 and mesh.host("ep") == 2 and mesh.stride("ep") == mesh.stride("cp") == 2
    assert Mesh(dp=2, cp=2, ep=4).world_size == 4
    with pytest.raises(MeshError, match=r"ep=4 must divide dp × cp = 1 × 2 = 2"):
        Mesh(cp=2, ep=4)
    limits = AxisLimits(world_size=4, global_batch=4, max_stages=4, gpus_per_node=8, experts=(4,), layers=2,
                        seq_len=16)
    found = meshes(limits, {})
    assert Mesh(cp=2, ep=2, tp=2) in found and Mesh(dp=2, cp=2, ep=4) in found and Mesh(cp=4, ep=4) in found
    assert all(m.host("ep") % m.ep == 0 for m in found)


def test_ep_checks_the_experts_it_splits() -> None:
    ep = dict((a.name, a) for a in AXES)["ep"]
    moe = AxisLimits(world_size=16, global_batch=16, max_stages=4, gpus_per_node=8, experts=(8, 8, 6), layers=5)
    assert ep.refusal(2, moe) is None
    assert ep.refusal(4, moe) == ("ep=4 does not divide the number of experts (6 experts in 1 of 3 "
                                  "mixture-of-experts blocks)")
    dense = AxisLimits(world_size=16, global_batch=16, max_stages=4, gpus_per_node=8, layers=5)
    assert "none of this model's 5 layers has experts" in ep.refusal(2, dense)
    found = meshes(moe, {})
    assert Mesh(dp=16, ep=2) in found and Mesh(dp=2, ep=2, tp=8) in found
    assert all(m.world_size == 16 and m.dp % m.ep == 0 for m in found)
    assert meshes(moe, {"ep": 2, "dp": 1}) == []  # ep must divide dp
