"""Context parallelism (cp) against one process, on gloo: examples/gpt.py's GPT and a tiny Hugging Face
Llama (grouped-query SDPA, rotary positions) trained 3 steps under cp=2 (W=2, also with full recompute),
cp=4 (W=4), cp=2 × dp=2 (W=4; the GPT at ZeRO-3, sharded over the dp × cp ranks) and cp=2 × tp=2 (W=4;
Megatron blocks, with and without sequence parallelism; the GPT's embeddings vocab-parallel), and dp=2 × cp=2
× tp=2 (W=8, the GPT at ZeRO-3) — and under what
else the planner offers beside cp: selective recompute, 2 microbatches (gradient accumulation) on the
replicate engine and at ZeRO-1, 2 and 3 (over the cp ranks alone, and over dp × cp), and one plan per
model mixing recompute kinds (none, full, selective, alternate_mm) and ZeRO stages across its blocks.

Bars (DESIGN.md, fp32 on CPU): first-step loss and gradients, SGD losses and parameters within 1e-5
relative per tensor; AdamW losses within 1e-3 where
the case runs AdamW (one an engine: equivalence_cases.ADAM_CASES). Each rank really holds S/cp tokens (local_batch)
and the model's own loss from ``labels`` is refused on every rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from distributed import check_equivalent, every_rank

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytestmark = pytest.mark.distributed

W2 = ["cp2_gpt", "cp2_llama", "cp2_recompute_gpt", "cp2_selective_accum_llama", "cp2_zero3_selective_accum_gpt"]
W4 = ["cp4_gpt", "cp4_llama", "cp2_dp2_zero3_gpt", "cp2_dp2_llama", "cp2_dp2_zero1_accum_gpt",
      "cp2_dp2_zero2_accum_llama", "cp2_dp2_mixed_gpt", "cp2_dp2_mixed_llama"]
W4_TP = ["cp2_tp2_gpt", "cp2_tp2_llama", "cp2_tp2_sp_gpt", "cp2_tp2_sp_llama", "cp2_tp2_zero3_selective_accum_gpt",
         "cp2_tp2_sp_recompute_accum_llama"]

W2_MANUAL = ["cp2_nanogpt", "cp2_recompute_nanogpt", "cp2_selective_accum_nanogpt"]
W4_MANUAL = ["cp4_nanogpt", "cp2_dp2_zero3_nanogpt", "cp2_pp2_1f1b_nanogpt", "cp2_tp2_nanogpt", "cp2_tp2_sp_nanogpt"]
# cp inside pp stages beside tp on 8 ranks is test_context_experts' cp2_pp2_tp2_ep2_mixtral (the same pins and
# gathered K/V, ep beside): the GPT's cp2_pp2_tp2_gpt added no check of its own (its cp × pp and cp × tp run at W=4)
W8_PP = ["cp2_dp2_pp2_zero3_llama"]
W4_PP = ["cp2_pp2_1f1b_gpt", "cp2_pp2_1f1b_llama", "cp2_pp2_gpipe_zero3_recompute_llama", "cp2_pp2_interleaved_gpt"]


@pytest.fixture(scope="module")
def w2(ranks) -> dict[str, dict]:
    return ranks(2).run(W2 + W2_MANUAL + ["cp2_refuses_labels", "cp2_warns_nothing"], module="context_cases")


@pytest.fixture(scope="module")
def w8(ranks) -> dict[str, dict]:
    return ranks(8).run(["cp2_dp2_tp2_zero3_gpt"] + W8_PP, module="context_cases")


@pytest.fixture(scope="module")
def w4_pp(ranks) -> dict[str, dict]:
    return ranks(4).run(W4_PP + W4_MANUAL, module="context_cases")


@pytest.fixture(scope="module")
def w4(ranks) -> dict[str, dict]:
    return ranks(4).run(W4 + W4_TP, module="context_cases")


@pytest.mark.parametrize("case", W2)
def test_cp2_on_two_ranks_matches_one_device(w2: dict, case: str) -> None:
    check_equivalent(w2[case])
    for r in every_rank(w2[case]):
        assert r["mesh_dims"] == ["pp", "dp", "cp", "tp"]


@pytest.mark.parametrize("case", W4)
def test_cp4_and_cp2_dp2_on_four_ranks_match_one_device(w4: dict, case: str) -> None:
    check_equivalent(w4[case])
    for r in every_rank(w4[case]):
        assert r["mesh"] == ([1, 2, 1] if "dp2" in case else [1, 1, 1])
    if "zero3" in case:  # the weights are sharded over all four dp × cp ranks
        assert all(r["local_bytes_frac"] < 0.3 for r in every_rank(w4[case]))
    if "accum" in case or "mixed" in case:
        assert w4[case]["microbatches"] == 2


def test_cp_beside_selective_recompute_and_gradient_accumulation(w2: dict) -> None:
    """What the planner offers beside cp on two ranks ran as planned: every block checkpointed
    selectively, 2 microbatches, the Llama on one replicate unit and the GPT sharded over the cp ranks."""
    llama, gpt = w2["cp2_selective_accum_llama"], w2["cp2_zero3_selective_accum_gpt"]
    # the final norm runs no matmul-class op, so the global pin leaves it without recompute (noted)
    assert llama["recomputed"] == {"model.layers.0": "selective", "model.layers.1": "selective",
                                   "lm_head": "selective"}
    assert llama["units"] == [["", 0, "replicate"]]
    assert {p: k for p, k in gpt["recomputed"].items() if p.startswith("blocks.")} == {
        "blocks.0": "selective", "blocks.1": "selective"}
    assert {tuple(u) for u in gpt["units"]} >= {("blocks.0", 3, "fully_shard"), ("", 3, "fully_shard")}
    assert llama["microbatches"] == gpt["microbatches"] == 2
    assert all(r["local_bytes_frac"] < 0.6 for r in every_rank(gpt))  # ZeRO-3 over the 2 cp ranks


def test_one_plan_mixing_recompute_kinds_and_zero_stages_across_blocks(w4: dict) -> None:
    gpt, llama = w4["cp2_dp2_mixed_gpt"], w4["cp2_dp2_mixed_llama"]
    assert gpt["recomputed"] == {"blocks.0": "full", "blocks.1": "selective", "blocks.3": "alternate_mm",
                                 "ln_f": "full", "lm_head": "selective"}
    assert gpt["units"] == [["blocks.0", 3, "fully_shard"], ["blocks.1", 0, "replicate"],
                            ["blocks.2", 2, "fully_shard"], ["blocks.3", 1, "fully_shard"], ["", 1, "fully_shard"]]
    assert llama["recomputed"] == {"model.layers.0": "full", "model.layers.1": "selective",
                                   "model.layers.3": "alternate_mm"}
    assert llama["units"] == [["model.layers.1", 0, "replicate"], ["model.layers.2", 3, "fully_shard"],
                              ["", 1, "fully_shard"]]


def test_the_model_own_loss_is_refused_and_each_rank_holds_its_chunks(w2: dict) -> None:
    for r in every_rank(w2["cp2_refuses_labels"]):
        assert "cannot compute its own loss from 'labels'" in r["message"]
        assert r["local_shape"] == [2, 8]


def test_cp_uses_no_deprecated_torch_api(w2: dict) -> None:
    """Neither ``all_gather_tensor_autograd`` (deprecated for ``all_gather_single_autograd``) nor slicing the
    flattened dp × cp mesh from the root mesh: nothing warns on any rank."""
    for r in every_rank(w2["cp2_warns_nothing"]):
        assert r["warnings"] == []


@pytest.mark.parametrize("case", W4_TP)
def test_cp2_beside_tp2_with_and_without_sp_matches_one_device(w4: dict, case: str) -> None:
    """cp=2 × tp=2: each cp rank's tp pair splits the heads and MLP of its chunks (sp: and the blocks'
    sequence share), K and V of the tp rank's heads gathered over the cp group alone; also beside
    ZeRO-3 over the cp ranks with selective recompute, and ZeRO-1 with full recompute, over 2
    microbatches."""
    check_equivalent(w4[case])
    for r in every_rank(w4[case]):
        assert r["mesh"] == [1, 1, 2] and r["mesh_dims"] == ["pp", "dp", "cp", "tp"]
    blocks = [layer for layer in w4[case]["layers"] if layer[0].startswith(("blocks.", "model.layers."))]
    assert blocks and all(tp == "megatron" and sp == ("_sp_" in case) for _, tp, _, _, sp in blocks)
    if "accum" in case:
        assert w4[case]["microbatches"] == 2
        assert {(zero, recompute) for _, _, zero, recompute, _ in blocks} == (
            {(3, 2)} if "zero3" in case else {(1, 1)})


def test_dp2_cp2_tp2_on_eight_ranks_matches_one_device(w8: dict) -> None:
    """The 3-D data × context × tensor mesh: ZeRO-3 over the dp × cp ranks (dp_cp), each a tp pair."""
    case = w8["cp2_dp2_tp2_zero3_gpt"]
    check_equivalent(case)
    for r in every_rank(case):
        assert r["mesh"] == [1, 2, 2] and r["mesh_dims"] == ["pp", "dp", "cp", "tp"]


@pytest.mark.parametrize("case", W4_PP)
def test_cp2_inside_pp2_stages_matches_one_device(w4_pp: dict, case: str) -> None:
    """cp=2 × pp=2 (W=4): the sequence split once before stage 0, each stage's attention gathering K and
    V over its cp pair, the stages sending the rank's S/cp tokens, under 1F1B, GPipe (the Llama at ZeRO-3
    over the cp pair with full recompute) and interleaved 1F1B (two stages per rank)."""
    check_equivalent(w4_pp[case])
    for r in every_rank(w4_pp[case]):
        assert r["mesh"] == [2, 1, 1] and r["mesh_dims"] == ["pp", "dp", "cp", "tp"]
    assert w4_pp[case]["schedule"] == case.split("_")[2].replace("interleaved", "interleaved_1f1b")


@pytest.mark.parametrize("case", W8_PP)
def test_cp2_inside_pp2_stages_beside_dp2_on_eight_ranks_matches_one_device(w8: dict, case: str) -> None:
    """The 4-D mesh (pp, dp, cp, tp) with three axes above 1: cp inside the stages beside dp (ZeRO-3 over the
    dp × cp ranks). Beside Megatron tp (K/V of the tp rank's heads gathered over cp) it is
    test_context_experts' cp2_pp2_tp2_ep2_mixtral, ring's and Ulysses' their own files'."""
    check_equivalent(w8[case])
    for r in every_rank(w8[case]):
        assert r["mesh"] == [2, 2, 1] and r["mesh_dims"] == ["pp", "dp", "cp", "tp"]


@pytest.mark.parametrize("case", W2_MANUAL + W4_MANUAL)
def test_nanogpt_hand_written_attention_under_cp_matches_one_device(w2: dict, w4_pp: dict, case: str) -> None:
    """nanoGPT's attention as its author writes it (softmax over q · kᵀ masked by its ``bias`` buffer),
    rerouted under cp (kᵀ and v gathered over the cp group, the rank's rows of the causal mask) after the
    rewrite was proved on each module: cp=2 (also with full recompute, and selective recompute over 2
    microbatches), cp=4, cp=2 × dp=2 at ZeRO-3, cp=2 × pp=2 (1F1B, the module inside a stage) and cp=2 × tp=2
    (Megatron blocks, the products' gathers on the tp rank's heads; sp off and on)."""
    result = (w2 if case in W2_MANUAL else w4_pp)[case]
    check_equivalent(result)
    assert result["mesh"] == ([1, 2, 1] if "dp2" in case else [2, 1, 1] if "pp2" in case
                              else [1, 1, 2] if "tp2" in case else [1, 1, 1])
    if "tp2" in case:
        blocks = [layer for layer in result["layers"] if layer[0].startswith("transformer.h.")]
        assert blocks and all(tp == "megatron" and sp == ("_sp_" in case) for _, tp, _, _, sp in blocks)
