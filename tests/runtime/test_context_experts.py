"""Context parallelism beside expert parallelism (cp × ep) against one process, on gloo: tiny Hugging Face
Mixtral and Qwen2-MoE (tests/moe_cases.py) trained 3 steps at cp=2 × ep=2 on two ranks (ep borrows its
ranks from dp × cp, so the ep group is the cp pair; also under Ulysses, and at ZeRO-3 with full recompute),
and at dp=2 × cp=2 on four ranks with ep=2 (the ep group the cp pair, the experts averaged over the dp pair;
replicated, ZeRO-1 and ZeRO-3 over 2 microbatches, and Ulysses) and ep=4 (one expert a rank, over all four);
and at cp=2 × ep=2 on four ranks beside tp=2 (Megatron attention, the ep group the cp pair of each tp rank)
and inside pp=2 stages (1F1B, the ep group each stage's cp pair), Mixtral; and both on eight ranks (Mixtral
at cp=2 × ep=2 inside pp=2 stages beside tp=2).

An MoE block on a cp rank routes that rank's S/cp tokens: the routers are per token, with no capacity rule
(tests/moe_cases.py says why routing cannot flip between the runs), so splitting the sequence changes no
routing decision. Bars (DESIGN.md, fp32 on CPU): first-step loss and gradients, SGD losses and parameters
within 1e-5 relative per tensor; AdamW losses within 1e-3. The groups are what autopar.mesh lays out.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from distributed import check_equivalent, every_rank

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytestmark = pytest.mark.distributed

W2 = ["cp2_ep2_mixtral", "cp2_ep2_qwen2_moe", "uly_cp2_ep2_mixtral", "cp2_ep2_zero3_recompute_mixtral"]
W4 = ["cp2_dp2_ep2_mixtral", "cp2_dp2_ep2_zero3_qwen2_moe", "cp2_dp2_ep2_zero1_mixtral", "cp2_dp2_ep4_mixtral",
      "uly_cp2_dp2_ep2_qwen2_moe"]
W4_TP_PP = ["cp2_tp2_ep2_mixtral", "cp2_pp2_ep2_mixtral"]


@pytest.fixture(scope="module")
def w2(ranks) -> dict[str, dict]:
    return ranks(2).run(W2 + ["groups_cp2_ep2_mixtral"], module="context_cases")


@pytest.fixture(scope="module")
def w4(ranks) -> dict[str, dict]:
    return ranks(4).run(W4 + W4_TP_PP + [f"groups_{c}" for c in ("cp2_dp2_ep2_mixtral", "cp2_dp2_ep4_mixtral")
                                          + tuple(W4_TP_PP)], module="context_cases")


@pytest.mark.parametrize("case", W2)
def test_cp2_ep2_on_two_ranks_matches_one_device(w2: dict, case: str) -> None:
    check_equivalent(w2[case])
    for r in every_rank(w2[case]):
        assert r["ep"] == 2 and r["mesh"] == [1, 1, 1] and r["mesh_dims"] == ["pp", "dp", "cp", "tp"]
        assert r["cp_attention"] == ("ulysses" if case.startswith("uly_") else "allgather")


@pytest.mark.parametrize("case", W4)
def test_dp2_cp2_with_ep_on_four_ranks_matches_one_device(w4: dict, case: str) -> None:
    check_equivalent(w4[case])
    for r in every_rank(w4[case]):
        assert r["ep"] == (4 if "ep4" in case else 2) and r["mesh"] == [1, 2, 1]


@pytest.mark.parametrize("case", W4_TP_PP)
def test_cp2_ep2_beside_tp2_or_inside_pp2_stages_matches_one_device(w4: dict, case: str) -> None:
    check_equivalent(w4[case])
    for r in every_rank(w4[case]):
        assert r["ep"] == 2 and r["mesh"] == ([1, 1, 2] if "tp2" in case else [2, 1, 1])
    if "pp2" in case:
        assert sorted(set(w4[case]["stages"])) == [0, 1] and w4[case]["schedule"] == "1f1b"


@pytest.fixture(scope="module")
def w8(ranks) -> dict[str, dict]:
    return ranks(8).run(["cp2_pp2_tp2_ep2_mixtral"], module="context_cases")


def test_cp2_ep2_inside_pp2_stages_beside_tp2_on_eight_ranks_matches_one_device(w8: dict) -> None:
    m = w8["cp2_pp2_tp2_ep2_mixtral"]
    check_equivalent(m)
    for r in every_rank(m):
        assert r["ep"] == 2 and r["mesh"] == [2, 1, 2]


def test_beside_tp_or_pp_the_ep_group_is_the_cp_pair_of_each_tp_rank_or_stage(w4: dict) -> None:
    """Ranks lie (pp, dp, cp, tp), tp innermost: beside tp=2 a tp rank's cp pair is {t, t + 2}, each its own
    edp; inside pp=2 stages each stage's cp pair, {2s, 2s + 1}, holding half its one MoE layer's experts
    (a quarter of the model's two)."""
    for rank, r in enumerate(every_rank(w4["groups_cp2_tp2_ep2_mixtral"])):
        assert r["ep_ranks"] == [rank % 2, rank % 2 + 2] and r["edp_ranks"] == [rank] and r["experts_frac"] == 0.5
    for rank, r in enumerate(every_rank(w4["groups_cp2_pp2_ep2_mixtral"])):
        assert r["ep_ranks"] == [rank - rank % 2, rank - rank % 2 + 1] and r["edp_ranks"] == [rank]
        assert r["experts_frac"] == 0.25


def test_ep_groups_are_drawn_from_the_dp_by_cp_ranks(w2: dict, w4: dict) -> None:
    """ep borrows the flattened dp × cp ranks, ep innermost: the cp pair first, then dp's; edp is the rest,
    and every expert gradient is the mean over dp × cp."""
    for rank, r in enumerate(every_rank(w2["groups_cp2_ep2_mixtral"])):
        assert r["ep_ranks"] == [0, 1] and r["edp_ranks"] == [rank] and r["dp"] == 2
        assert r["experts_frac"] == 0.5
    for rank, r in enumerate(every_rank(w4["groups_cp2_dp2_ep2_mixtral"])):
        assert r["ep_ranks"] == [rank - rank % 2, rank - rank % 2 + 1] and r["edp_ranks"] == [rank % 2, rank % 2 + 2]
        assert r["dp"] == 4 and r["experts_frac"] == 0.5
    for rank, r in enumerate(every_rank(w4["groups_cp2_dp2_ep4_mixtral"])):
        assert r["ep_ranks"] == [0, 1, 2, 3] and r["edp_ranks"] == [rank] and r["experts_frac"] == 0.25
