"""cp's head all-to-all (DeepSpeed-Ulysses) against one process, on gloo: examples/gpt.py's GPT (4 heads) and
a tiny Hugging Face Llama (grouped-query: 4 heads over 2 key/value heads) trained 3 steps with
``cp_attention=ulysses`` at cp=2 (W=2; the Llama also with full recompute, and with selective recompute over 2
microbatches), cp=4 (W=4, the GPT: one head a rank), cp=2 × dp=2 (W=4; the GPT at ZeRO-3 over the dp × cp
ranks, and at ZeRO-1 over 2 microbatches), cp=2 × tp=2 (W=4; Megatron blocks, the GPT's 4 heads and a
Llama's 4 key/value heads split over tp, then over cp; the GPT also with sequence parallelism) and cp=2 × pp=2
(W=4; inside pipeline stages: both models under 1F1B, the Llama under GPipe at ZeRO-3 with full recompute, the
GPT under interleaved 1F1B). nanoGPT's attention written by hand (``passes/manual_attention.py``: q, kᵀ and v
all-to-all'd, the S × S causal mask, the output back) at cp=2 (W=2; also with selective recompute over 2
microbatches), cp=4, cp=2 × dp=2 at ZeRO-3, cp=2 × tp=2 (Megatron blocks, the tp rank's 2 heads split again
over cp; sp off and on) and cp=2 × pp=2 (1F1B, the module inside a stage) (W=4), and cp=2 × pp=2 × tp=2 (W=8).

Bars (DESIGN.md, fp32 on CPU): first-step loss and gradients, SGD losses and parameters within 1e-5
relative per tensor; AdamW losses within 1e-3 where
the case runs AdamW (one an engine: equivalence_cases.ADAM_CASES). The lowering really is the all-to-all: a step calls
``all_to_all_single_autograd`` four times per attention and the K/V all-gather never.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from distributed import check_equivalent, every_rank

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytestmark = pytest.mark.distributed

W2 = ["uly_cp2_gpt", "uly_cp2_llama", "uly_cp2_recompute_llama", "uly_cp2_selective_accum_llama", "uly_cp2_nanogpt",
      "uly_cp2_selective_accum_nanogpt"]
W4 = ["uly_cp4_gpt", "uly_cp2_dp2_gpt", "uly_cp2_dp2_llama", "uly_cp2_tp2_gpt", "uly_cp2_tp2_llama",
      "uly_cp2_dp2_zero1_accum_gpt", "uly_cp2_tp2_sp_gpt", "uly_cp4_nanogpt", "uly_cp2_dp2_zero3_nanogpt",
      "uly_cp2_tp2_nanogpt", "uly_cp2_tp2_sp_nanogpt"]


@pytest.fixture(scope="module")
def w2(ranks) -> dict[str, dict]:
    return ranks(2).run(W2 + ["uly_cp2_runs_all_to_alls", "uly_cp2_nanogpt_runs_all_to_alls"], module="context_cases")


W4_PP = ["uly_cp2_pp2_1f1b_gpt", "uly_cp2_pp2_1f1b_llama", "uly_cp2_pp2_gpipe_zero3_recompute_llama",
         "uly_cp2_pp2_interleaved_gpt", "uly_cp2_pp2_1f1b_nanogpt"]


@pytest.fixture(scope="module")
def w4(ranks) -> dict[str, dict]:
    return ranks(4).run(W4 + W4_PP, module="context_cases")


@pytest.mark.parametrize("case", W2)
def test_ulysses_cp2_on_two_ranks_matches_one_device(w2: dict, case: str) -> None:
    check_equivalent(w2[case])
    assert w2[case]["cp_attention"] == "ulysses"
    for r in every_rank(w2[case]):
        assert r["mesh_dims"] == ["pp", "dp", "cp", "tp"]
    prefix = "transformer.h." if "nanogpt" in case else "model.layers."
    decoders = {p: k for p, k in w2[case]["recomputed"].items() if p.startswith(prefix)}
    if "recompute" in case:  # the recomputed forward runs the all-to-alls again
        assert decoders == {f"{prefix}0": "full", f"{prefix}1": "full"}
    if "selective" in case:  # the selective replay issues them again; 2 microbatches
        assert decoders == {f"{prefix}0": "selective", f"{prefix}1": "selective"}
        assert w2[case]["microbatches"] == 2


@pytest.mark.parametrize("case", W4)
def test_ulysses_cp4_and_beside_dp_or_tp_on_four_ranks_matches_one_device(w4: dict, case: str) -> None:
    check_equivalent(w4[case])
    assert w4[case]["cp_attention"] == "ulysses"
    for r in every_rank(w4[case]):
        assert r["mesh"] == ([1, 2, 1] if "dp2" in case else [1, 1, 2] if "tp2" in case else [1, 1, 1])
    if "zero3" in case or case == "uly_cp2_dp2_gpt":  # the weights are sharded over all four dp × cp ranks
        assert all(r["local_bytes_frac"] < 0.3 for r in every_rank(w4[case]))
    if "tp2" in case:
        blocks = [layer for layer in w4[case]["layers"]
                  if layer[0].startswith(("blocks.", "model.layers.", "transformer.h."))]
        assert blocks and all(tp == "megatron" and sp == ("_sp_" in case) for _, tp, _, _, sp in blocks)
    if "accum" in case:  # ZeRO-1 over dp × cp, its sync deferred to the second microbatch
        assert w4[case]["microbatches"] == 2
        assert {tuple(u) for u in w4[case]["units"]} >= {("", 1, "fully_shard")}


@pytest.mark.parametrize("case", ["uly_cp2_runs_all_to_alls", "uly_cp2_nanogpt_runs_all_to_alls"])
def test_the_ulysses_plan_runs_the_head_all_to_all_not_the_kv_all_gather(w2: dict, case: str) -> None:
    for r in every_rank(w2[case]):
        assert r["method"] == "ulysses" and r["ulysses"] is True
        assert r["calls"] == {"all_to_all": 8, "all_gather": 0}  # 2 blocks × (q, k, v, output)


@pytest.fixture(scope="module")
def w8(ranks) -> dict[str, dict]:
    return ranks(8).run(["uly_cp2_pp2_tp2_nanogpt"], module="context_cases")


def test_ulysses_on_hand_written_attention_inside_pp2_stages_beside_tp2_matches_one_device(w8: dict) -> None:
    """nanoGPT's attention by hand, Megatron blocks inside 1F1B stages: each tp rank's 2 heads split over cp."""
    m = w8["uly_cp2_pp2_tp2_nanogpt"]
    check_equivalent(m)
    assert m["cp_attention"] == "ulysses" and sorted(set(m["stages"])) == [0, 1]
    for r in every_rank(m):
        assert r["mesh"] == [2, 1, 2]


@pytest.mark.parametrize("case", W4_PP)
def test_ulysses_inside_pipeline_stages_matches_one_device(w4: dict, case: str) -> None:
    """cp=2 × pp=2: each stage's attention modules run the head all-to-all over their cp pair, the stages
    send the rank's S/cp tokens; 1F1B, GPipe at ZeRO-3 with full recompute, interleaved 1F1B; nanoGPT's
    attention written by hand under 1F1B."""
    check_equivalent(w4[case])
    m = w4[case]
    assert m["cp_attention"] == "ulysses" and sorted(set(m["stages"])) == ([0, 1, 2, 3] if "interleaved" in case
                                                                             else [0, 1])
    for r in every_rank(m):
        assert r["mesh"] == [2, 1, 1]
    assert m["schedule"] == ("interleaved_1f1b" if "interleaved" in case else "gpipe" if "gpipe" in case else "1f1b")
