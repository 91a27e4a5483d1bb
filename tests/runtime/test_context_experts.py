"""Context parallelism beside expert parallelism (cp × ep) against one process, on gloo: tiny Hugging Face
Mixtral and Qwen2-MoE (tests/moe_cases.py) trained 3 steps at cp=2 × ep=2 on two ranks (ep borrows its
ranks from dp × cp, so the ep group is the cp pair; also under Ulysses, and at ZeRO-3 with full recompute),
and at dp=2 × cp=2 on four ranks with ep=2 (the ep group the cp pair, the experts averaged over the dp pair;
replicated, ZeRO-1 and ZeRO-3 over 2 microbatches, and Ulysses) and ep=4 (one expert a rank, over all four).

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


@pytest.fixture(scope="module")
def w2(ranks) -> dict[str, dict]:
    return ranks(2).run(W2 + ["groups_cp2_ep2_mixtral"], module="context_cases")


@pytest.fixture(scope="module")
def w4(ranks) -> dict[str, dict]:
    return ranks(4).run(W4 + ["groups_cp2_dp2_ep2_mixtral", "groups_cp2_dp2_ep4_mixtral"], module="context_cases")


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
