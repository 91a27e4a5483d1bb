"""Recompute as a choice of three — none, selective, full — priced as it runs and lowered as priced.

Selective recompute keeps the outputs of matmul-class ops and re-runs the rest
(``passes/recompute.py``). The tests measure what a checkpointed model really
keeps for backward (every storage an op produced that is still alive once the
forward is done: autograd's saved tensors and the selective cache alike) and
check it against what capture recorded and pricing charged; they check the
pins, plan files and graphs that carry the new choice, the contract's offer,
the solver's use of it, and — on gloo processes — the same numbers as one
device for selective and mixed plans (``recompute_cases``).
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from distributed import check_equivalent, every_rank
from torch.distributed._composable import checkpoint
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import autopar
from autopar import contract
from autopar.choice import LayerChoice, Recompute
from autopar.errors import PinError, PlanError
from autopar.graph import LayerGraph
from autopar.mesh import Mesh
from autopar.passes.recompute import alternate_context, apply_recompute, selective_context
from autopar.pins import Pins
from autopar.plan import Plan
from autopar.planning.configuration import Configuration, TrainingSpec
from autopar.planning.pricing import PriceTable

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402

from autopar.cost_models.pipeline import Schedule, ScheduleKind  # noqa: E402
from autopar.cost_models.presets import PRESETS  # noqa: E402


def _tiny(device: str = "cpu") -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return gpt.gpt(n_layer=2, d_model=32, n_head=4, vocab_size=256, seq_len=16, device=device)


@pytest.fixture(scope="module")
def graph() -> LayerGraph:
    """Captured from the CPU model the measurements run (on the meta device, capture's
    attention saves a tensor more than CPU's kernel does, whatever the recompute)."""
    model, inputs = _tiny()
    return autopar.capture(model, inputs)


def _solve(graph: LayerGraph, *pins: str, **kwargs: Any) -> Plan:
    return autopar.solve(graph, 1, cluster="cpu", dtype="fp32", global_batch=2, pins=["pp=1", *pins], **kwargs)


def _cpu_table(graph: LayerGraph, *, tp: int) -> PriceTable:
    """Prices of one microbatch of 2 samples on the CPU preset, pp = dp = 1."""
    return PriceTable(graph, Configuration(Mesh(tp=tp), 1, Schedule(ScheduleKind.NONE)), PRESETS["cpu"],
                      TrainingSpec(2, "fp32"))


def kept_for_backward(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of every storage an op made in ``model``'s forward that is still alive after it
    (parameters aside): what autograd and the selective cache keep for backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    made: dict[int, tuple[StorageWeakRef, int]] = {}

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                    storage = t.untyped_storage()
                    ptr = storage.data_ptr()
                    if ptr not in made or made[ptr][0].expired():  # a freed address may be reused
                        made[ptr] = (StorageWeakRef(storage), storage.nbytes())
            return out

    with Track():
        loss = model(x).sum()
    gc.collect()
    alive = sum(n for ptr, (ref, n) in made.items() if not ref.expired() and ptr not in params)
    loss.backward()  # the graph was whole: backward still runs
    return alive


# ---------------------------------------------------------------- priced as it runs


@pytest.mark.slow
def test_priced_selective_saving_is_what_checkpointing_frees(graph: LayerGraph) -> None:
    """Selective recompute of a block frees its saved activations but its input and its
    matmul-class outputs (linear layers, fused attention's output and log-sum-exp); full frees
    those too. The bytes capture recorded, and pricing charges, are the measured ones."""
    plain, _ = _tiny()
    selective, _ = _tiny()
    full, _ = _tiny()
    x = torch.randint(0, 256, (2, 16))
    checkpoint(selective.blocks[1], context_fn=selective_context)
    checkpoint(full.blocks[1])
    layer = graph.layer("blocks.1")
    base = layer.input_bytes_per_sample + layer.glue_saved_bytes_per_sample
    kept = base + layer.selective_saved_bytes_per_sample
    before = kept_for_backward(plain, x)
    assert before - kept_for_backward(selective, x) == 2 * (layer.activation_bytes_per_sample - kept)
    assert before - kept_for_backward(full, x) == 2 * (layer.activation_bytes_per_sample - base)
    # four linears' outputs (qkv 3h, proj h, fc 4h, fc_proj h) and attention's h + log-sum-exp
    h = 16 * 32 * 4
    assert layer.selective_saved_bytes_per_sample == 10 * h + 4 * 16 * 4
    table = _cpu_table(graph, tp=1)
    i = layer.index
    price = table.prices[i][table.index_of(i, LayerChoice(None, 0, Recompute.SELECTIVE))]
    assert price.activation_mb_bytes == 2 * kept


@pytest.mark.slow
def test_torchtitans_policy_frees_every_other_mm_output_as_priced() -> None:
    """torchtitan's op-level SAC (``recompute=alternate_mm``) on a Llama decoder layer: fused
    attention's outputs and the 1st, 3rd, … ``mm`` outputs kept (q, v, gate, down), the others
    re-run; what it frees beyond autopar's selective policy is what capture recorded, to the byte,
    and their FLOPs are re-run."""
    import zoo

    def llama() -> nn.Module:
        torch.manual_seed(0)
        model, _ = zoo.build("hf_llama")

        class Logits(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = model

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.inner(x).logits
        return Logits()

    graph = autopar.capture(*zoo.build("hf_llama"))
    layer = graph.layer("model.layers.1")
    x = torch.randint(0, 64, (2, 16))
    selective, alternate = llama(), llama()
    checkpoint(selective.inner.model.layers[1], context_fn=selective_context)
    checkpoint(alternate.inner.model.layers[1], context_fn=alternate_context)
    freed = kept_for_backward(selective, x) - kept_for_backward(alternate, x)
    assert freed == 2 * (layer.selective_saved_bytes_per_sample - layer.alternate_saved_bytes_per_sample) > 0
    # k (kv 16 wide), o (32), up (64): every other of the seven mms, 16 positions × 4 bytes each
    assert freed == 2 * 16 * 4 * (16 + 32 + 64)
    assert layer.alternate_recompute_flops_per_sample > layer.selective_recompute_flops_per_sample
    plan = autopar.solve(graph, 1, cluster="cpu", dtype="fp32", global_batch=2,
                         pins=["pp=1", "model.layers.*:recompute=alternate_mm"])
    blocks = {lp.choice.recompute for lp in plan.layers if lp.name.startswith("model.layers.")}
    assert blocks == {Recompute.ALTERNATE_MM}
    # searched plans never pick it: the solver offers none, selective and full
    assert Recompute.ALTERNATE_MM not in contract.offered_recomputes(graph, layer.index, 1)


@pytest.mark.slow
def test_a_lowered_mixed_plan_keeps_what_its_prices_say(graph: LayerGraph) -> None:
    """none / selective / full per layer, lowered by the recompute pass: the whole model's
    measured saving against no recompute is the priced one, to the byte."""
    pins = ("dp=1", "tp=1", "zero=0", "microbatches=1", "blocks.0:recompute=selective",
            "blocks.1:recompute=full", "ln_f:recompute=full", "tok_emb:recompute=none",
            "pos_emb:recompute=none", "drop:recompute=none", "lm_head:recompute=selective")
    plan, plain_plan = _solve(graph, *pins), _solve(graph, "dp=1", "tp=1", "zero=0", "recompute=none")
    assert [lp.choice.recompute for lp in plan.layers] == [Recompute.NONE] * 3 + [
        Recompute.SELECTIVE, Recompute.FULL, Recompute.FULL, Recompute.SELECTIVE]
    lowered, _ = _tiny()
    assert apply_recompute(lowered, graph, plan) == ["blocks.0", "blocks.1", "ln_f", "lm_head"]
    plain, _ = _tiny()
    x = torch.randint(0, 256, (2, 16))
    measured = kept_for_backward(plain, x) - kept_for_backward(lowered, x)
    priced = [sum(r.activations_bytes for r in p.predicted.ranks) for p in (plain_plan, plan)]
    assert measured == priced[0] - priced[1] > 0


def test_selective_costs_less_time_than_full_and_more_than_none(graph: LayerGraph) -> None:
    """Selective re-runs only the module's other ops (priced by the bytes they move at the
    device's memory bandwidth); full re-runs the whole forward, matmuls included."""
    import dataclasses

    config = Configuration(Mesh(), 1, Schedule(ScheduleKind.NONE))
    preset = PRESETS["a100-80g"]
    kernels_only = dataclasses.replace(preset, device=dataclasses.replace(
        preset.device, op_model=dataclasses.replace(preset.device.op_model, host_op_s=0.0)))
    i = graph.layer("blocks.0").index

    def prices(cluster):
        table = PriceTable(graph, config, cluster, TrainingSpec(8))
        return [table.prices[i][table.index_of(i, LayerChoice(None, 0, k))]
                for k in (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)]

    none, sel, full = prices(kernels_only)  # the kernels: selective re-runs less than full
    assert none.compute_mb_s < sel.compute_mb_s < full.compute_mb_s
    assert none.activation_mb_bytes > sel.activation_mb_bytes > full.activation_mb_bytes
    # this tiny block is host-bound on a GPU, and selective's machinery (its policy asked about every op) costs
    # the host more than full's (gpu_figures.CHECKPOINT_HOST_OPS, benchmarks/host_overheads.py): there it is dearer
    none, sel, full = prices(preset)
    assert none.compute_mb_s < full.compute_mb_s < sel.compute_mb_s


def test_tensor_parallel_splits_what_lies_between_the_projections(graph: LayerGraph) -> None:
    """Under a Megatron style the kept outputs between the column and row projections (qkv,
    attention, fc) are split over tp; the row projections' outputs are full-size partial sums."""
    layer = graph.layer("blocks.0")
    h = 16 * 32 * 4
    assert layer.selective_sharded_bytes_per_sample == 3 * h + h + 4 * 16 * 4 + 4 * h
    table = _cpu_table(graph, tp=2)
    price = table.prices[layer.index][table.index_of(layer.index, LayerChoice("megatron", 0, Recompute.SELECTIVE))]
    kept = (layer.input_bytes_per_sample + layer.selective_saved_bytes_per_sample
            - layer.selective_sharded_bytes_per_sample / 2)
    assert price.activation_mb_bytes == 2 * kept


# ---------------------------------------------------------------- the contract's offer and the pins


def test_the_contract_offers_selective_only_where_there_is_something_to_keep(graph: LayerGraph) -> None:
    offered = {layer.name: contract.offered_recomputes(graph, layer.index, 1) for layer in graph}
    assert offered["blocks.0"] == (Recompute.NONE, Recompute.FULL, Recompute.SELECTIVE)
    assert offered["tok_emb"] == (Recompute.NONE, Recompute.FULL)  # an embedding runs no matmul
    table = _cpu_table(graph, tp=1)
    for layer, row in zip(graph, table.choices):
        assert {s.recompute for s in row} == set(offered[layer.name])


def test_recompute_pins_take_the_kinds_and_the_old_words() -> None:
    assert Pins.parse(["recompute=on"]).recompute is Recompute.FULL
    assert Pins.parse(["recompute=all"]).recompute is Recompute.FULL
    assert Pins.parse(["recompute=off"]).recompute is Recompute.NONE
    assert Pins.parse(["recompute=selective"]).recompute is Recompute.SELECTIVE
    pin = Pins.parse(["blocks.*:recompute=full"]).layers[0]
    assert pin.recompute is Recompute.FULL
    assert Pins.parse(["blocks.*:recompute=selective"]).to_strings() == ["blocks.*:recompute=selective"]
    assert Pins.parse(["recompute=alternate_mm"]).recompute is Recompute.ALTERNATE_MM
    with pytest.raises(PinError, match="recompute must be none, selective, alternate_mm or full"):
        Pins.parse(["recompute=some"])
    with pytest.raises(PinError, match="contradict"):
        Pins.parse(["recompute=full", "blocks.0:recompute=selective"]).check_form()


def test_selective_on_a_layer_with_nothing_to_keep_is_a_pin_error(graph: LayerGraph) -> None:
    with pytest.raises(PinError, match=r"layer 'tok_emb' runs no matmul-class op"):
        _solve(graph, "tok_emb:recompute=selective")


def test_a_global_selective_pin_leaves_layers_with_nothing_to_keep_and_notes_them(graph: LayerGraph) -> None:
    plan = _solve(graph, "dp=1", "tp=1", "zero=0", "recompute=selective")
    runs = contract.plan_layout(graph, plan)
    kinds = {role.name: role.recompute for role in runs.layers}
    assert kinds["blocks.0"] is kinds["blocks.1"] is kinds["lm_head"] is Recompute.SELECTIVE
    assert kinds["tok_emb"] is kinds["pos_emb"] is Recompute.NONE
    assert any("selective recompute asked for" in n and "tok_emb" in n for n in plan.notes)


def test_the_solver_takes_selective_where_none_does_not_fit_and_full_is_slower(graph: LayerGraph) -> None:
    """Where no block fits without recompute but selective on both fits, the fastest plan
    recomputes the blocks selectively, not fully."""
    fixed = ("dp=1", "tp=1", "zero=0", "microbatches=1", "tok_emb:recompute=none", "pos_emb:recompute=none",
             "drop:recompute=none", "ln_f:recompute=none", "lm_head:recompute=none", "loss=full")  # one loss
    peak = {k: _solve(graph, *fixed, f"blocks.*:recompute={k}").predicted.memory_per_rank_bytes[0]
            for k in ("none", "selective", "full")}
    assert peak["none"] > peak["selective"] > peak["full"]
    budget_gb = (peak["selective"] + (peak["none"] - peak["selective"]) / 4) / 2**30  # half a block's saving
    plan = _solve(graph, *fixed, memory_gb=budget_gb)
    assert {lp.choice.recompute for lp in plan.layers if lp.name.startswith("blocks")} == {Recompute.SELECTIVE}


# ---------------------------------------------------------------- plans and graphs carry the kind


def test_plans_write_the_kind_and_old_plans_with_bools_still_load(graph: LayerGraph) -> None:
    plan = _solve(graph, "dp=1", "tp=1", "zero=0", "blocks.0:recompute=selective", "blocks.1:recompute=full")
    data = plan.to_dict()
    assert [l["recompute"] for l in data["layers"]][3:5] == ["selective", "full"]
    assert Plan.from_dict(data) == plan
    for layer in data["layers"]:  # a plan written when recompute was a bool
        layer["recompute"] = layer["recompute"] == "full"
    old = Plan.from_dict(data)
    assert [lp.choice.recompute for lp in old.layers][3:5] == [Recompute.NONE, Recompute.FULL]
    data["layers"][0]["recompute"] = "sometimes"
    with pytest.raises(PlanError, match="recompute is 'sometimes'; use none, selective, alternate_mm or full"):
        Plan.from_dict(data)
    assert "selective" in plan.summary()


def test_graphs_keep_the_selective_figures_and_old_graphs_offer_no_selective(graph: LayerGraph) -> None:
    again = LayerGraph.from_dict(graph.to_dict())
    assert [l.selective_saved_bytes_per_sample for l in again] == [l.selective_saved_bytes_per_sample for l in graph]
    assert [l.selective_recompute_bytes_per_sample for l in again] == [
        l.selective_recompute_bytes_per_sample for l in graph]
    old = graph.to_dict()
    for layer in old["layers"]:
        for key in [k for k in layer if k.startswith("selective_")]:
            del layer[key]
    legacy = LayerGraph.from_dict(old)
    assert all(Recompute.SELECTIVE not in contract.offered_recomputes(legacy, l.index, 1) for l in legacy)


def test_an_export_pipeline_stage_offers_no_recompute(graph: LayerGraph) -> None:
    exported = LayerGraph.from_dict({**graph.to_dict(), "tracer": "export"})
    assert contract.offered_recomputes(exported, exported.layer("blocks.0").index, 2) == (Recompute.NONE,)
    assert len(contract.offered_recomputes(exported, exported.layer("blocks.0").index, 1)) == 3


def test_a_cp_position_hook_runs_again_inside_selective_recompute() -> None:
    """Under cp a Hugging Face decoder layer's ``position_ids`` get the rank's global positions by a
    pre-hook (``passes/context_parallel.py``). A checkpointed layer's pre-hooks run again in its
    recomputation, inside selective recompute's replay mode, which refuses any op its forward did
    not record there: the hook must dispatch nothing, and the layer must compute as with the global
    positions given."""
    from autopar.passes.context_parallel import _global_positions, positions

    class Rotated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
            return self.proj(x) * torch.cos(position_ids.float())[..., None]

    local = positions(8, 2, 0)  # cp rank 0 of 2: tokens 0, 1, 6, 7
    torch.manual_seed(0)
    plain, hooked = Rotated(), Rotated()
    hooked.load_state_dict(plain.state_dict())
    hooked.register_forward_pre_hook(_global_positions(local), with_kwargs=True)
    checkpoint(hooked, context_fn=selective_context)
    x = torch.randn(2, 4, 4)
    hooked(x, position_ids=torch.arange(4).expand(2, 4)).sum().backward()
    plain(x, position_ids=local.expand(2, 4)).sum().backward()
    for (name, a), b in zip(hooked.named_parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad), name


# ---------------------------------------------------------------- same numbers as one device (gloo)

CASES = ["selective_zero3", "selective_tp2", "mixed_kinds_zero2", "full_only", "hf_llama_selective_tp2"]


@pytest.fixture(scope="module")
def w2(ranks) -> dict[str, dict]:
    return ranks(2).run(CASES, module="recompute_cases")


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_recompute_plans_match_one_device(w2: dict, case: str) -> None:
    check_equivalent(w2[case])


@pytest.mark.distributed
def test_selective_layers_ran_the_selective_policy_and_kept_matmul_outputs(w2: dict) -> None:
    for case in ("selective_zero3", "selective_tp2", "mixed_kinds_zero2", "hf_llama_selective_tp2"):
        for m in every_rank(w2[case]):
            kept = m["policy_kept"]
            assert m["policy_asked"] > sum(kept.values()) > 0, case  # other ops were recomputed
            assert set(kept) <= {"aten::mm", "aten::addmm", "aten::_scaled_dot_product_flash_attention_for_cpu"}
    assert all(m["policy_asked"] == 0 for m in every_rank(w2["full_only"]))  # full never asks the policy
    mixed = {name: rc for name, _, _, rc, _ in w2["mixed_kinds_zero2"]["layers"]}
    assert (mixed["blocks.0"], mixed["blocks.1"], mixed["ln_f"]) == (Recompute.SELECTIVE, Recompute.FULL,
                                                                      Recompute.FULL)
    assert w2["selective_zero3"]["mesh"] == [1, 2, 1] and w2["selective_tp2"]["mesh"] == [1, 1, 2]
