"""Context parallelism beside expert parallelism (cp × ep) against one process, on gloo: tiny Hugging Face Mixtral and
Qwen2-MoE (tests/moe_cases.py) trained 3 steps at cp=2 × ep=2 on two ranks (ep borrows its ranks from dp × cp, so
the ep group is the cp pair; also under Ulysses and the ring, and at ZeRO-3 with full recompute, by all-gather and
by the ring), and at dp=2 × cp=2 on four ranks with ep=2 (the ep group the cp pair, the experts averaged over the dp
pair; replicated, ZeRO-1 and ZeRO-3 over 2 microbatches, Ulysses and the ring) and ep=4 (one expert a rank, over all
four); and at cp=2 × ep=2 on four ranks beside tp=2 (Megatron attention, the ep group the cp pair of each tp rank)
and inside pp=2 stages (1F1B, the ep group each stage's cp pair), Mixtral, by all-gather and by the ring; and both
on eight ranks (Mixtral at cp=2 × ep=2 inside pp=2 stages beside tp=2). Attention written by hand beside ep:
nanoGPT's masked softmax with Mixtral's sparse MoE blocks for MLPs (``context_cases.nanogpt_moe``), at cp=2 × ep=2
by the kᵀ/v all-gather and by Ulysses.

An MoE block on a cp rank routes that rank's S/cp tokens: the routers are per token, with no capacity rule
(tests/moe_cases.py says why routing cannot flip between the runs), so splitting the sequence changes no
routing decision. The ring's K/V sends and Ulysses' all-to-alls run on the cp group, ep's dispatch on the ep
group, the same pair (on two ranks the very same process group, at dp=2 × cp=2 another one): every rank issues
them in one order, attention's before its block's dispatch. Bars (DESIGN.md, fp32 on CPU): first-step loss and
gradients, SGD losses and parameters within 1e-5 relative per tensor; AdamW losses within 1e-3 where
the case runs AdamW (one an engine: equivalence_cases.ADAM_CASES). The groups are
what autopar.mesh lays out.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from distributed import check_equivalent, every_rank

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytestmark = pytest.mark.distributed

W2 = ["cp2_ep2_mixtral", "cp2_ep2_qwen2_moe", "uly_cp2_ep2_mixtral", "cp2_ep2_zero3_recompute_mixtral",
      "ring_cp2_ep2_mixtral", "ring_cp2_ep2_zero3_recompute_mixtral", "cp2_ep2_nanogpt_moe", "uly_cp2_ep2_nanogpt_moe"]
W4 = ["cp2_dp2_ep2_mixtral", "cp2_dp2_ep2_zero3_qwen2_moe", "cp2_dp2_ep2_zero1_mixtral", "cp2_dp2_ep4_mixtral",
      "uly_cp2_dp2_ep2_qwen2_moe", "ring_cp2_dp2_ep2_mixtral"]
W4_TP_PP = ["cp2_tp2_ep2_mixtral", "cp2_pp2_ep2_mixtral", "ring_cp2_tp2_ep2_mixtral", "ring_cp2_pp2_ep2_mixtral"]
GROUPS = ("cp2_dp2_ep2_mixtral", "cp2_dp2_ep4_mixtral", "cp2_tp2_ep2_mixtral", "cp2_pp2_ep2_mixtral")


def _method(case: str) -> str:
    return {"uly": "ulysses", "ring": "ring"}.get(case.split("_")[0], "allgather")


@pytest.fixture(scope="module")
def w2(ranks) -> dict[str, dict]:
    pool = ranks(2)
    got = pool.run(W2 + ["groups_cp2_ep2_mixtral", "uly_cp2_ep2_nanogpt_moe_runs_all_to_alls"], module="context_cases")
    return got | pool.run(["ring_cp2_ep2_runs_ring"], module="ring_cases")


@pytest.fixture(scope="module")
def w4(ranks) -> dict[str, dict]:
    return ranks(4).run(W4 + W4_TP_PP + [f"groups_{c}" for c in GROUPS], module="context_cases")


@pytest.mark.parametrize("case", W2)
def test_cp2_ep2_on_two_ranks_matches_one_device(w2: dict, case: str) -> None:
    check_equivalent(w2[case])
    for r in every_rank(w2[case]):
        assert r["ep"] == 2 and r["mesh"] == [1, 1, 1] and r["mesh_dims"] == ["pp", "dp", "cp", "tp"]
        assert r["cp_attention"] == _method(case)


@pytest.mark.parametrize("case", W4)
def test_dp2_cp2_with_ep_on_four_ranks_matches_one_device(w4: dict, case: str) -> None:
    check_equivalent(w4[case])
    for r in every_rank(w4[case]):
        assert r["ep"] == (4 if "ep4" in case else 2) and r["mesh"] == [1, 2, 1]
        assert r["cp_attention"] == _method(case)


@pytest.mark.parametrize("case", W4_TP_PP)
def test_cp2_ep2_beside_tp2_or_inside_pp2_stages_matches_one_device(w4: dict, case: str) -> None:
    check_equivalent(w4[case])
    for r in every_rank(w4[case]):
        assert r["ep"] == 2 and r["mesh"] == ([1, 1, 2] if "tp2" in case else [2, 1, 1])
        assert r["cp_attention"] == _method(case)
    if "pp2" in case:
        assert sorted(set(w4[case]["stages"])) == [0, 1] and w4[case]["schedule"] == "1f1b"


def test_beside_ep_the_ring_and_ulysses_run_their_own_collectives(w2: dict) -> None:
    """The ring plan runs torch's ring once per attention call (Mixtral: 2 decoder layers) and never gathers
    K/V, its only autograd all-to-alls ep's dispatch (2 a block); Ulysses on nanoGPT's hand-written attention
    all-to-alls q, kᵀ, v and the output (4 a block) beside the dispatch's 2, gathering nothing."""
    for r in every_rank(w2["ring_cp2_ep2_runs_ring"]):
        assert r["method"] == "ring" and r["ring"] is True
        assert r["calls"] == {"ring": 2, "ring_backward": 2, "all_gather": 0, "all_to_all": 4}
    for r in every_rank(w2["uly_cp2_ep2_nanogpt_moe_runs_all_to_alls"]):
        assert r["method"] == "ulysses" and r["ulysses"] is True
        assert r["calls"] == {"all_to_all": 12, "all_gather": 0}


@pytest.fixture(scope="module")
def w8(ranks) -> dict[str, dict]:
    return ranks(8).run(["cp2_pp2_tp2_ep2_mixtral"], module="context_cases")


def test_cp2_ep2_inside_pp2_stages_beside_tp2_on_eight_ranks_matches_one_device(w8: dict) -> None:
    """Also the suite's cp inside pp stages beside Megatron tp with cp's default method (K/V of the tp rank's
    heads gathered over cp; the GPT's case of it went: test_context_parallel)."""
    m = w8["cp2_pp2_tp2_ep2_mixtral"]
    check_equivalent(m)
    for r in every_rank(m):
        assert r["ep"] == 2 and r["mesh"] == [2, 1, 2] and r["mesh_dims"] == ["pp", "dp", "cp", "tp"]
        assert r["cp_attention"] == "allgather"


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
    and every expert gradient is the mean over dp × cp. The ep group holds the cp group's ranks: on two ranks
    it is the very process group attention's collectives run on (torch's world group), on four another group
    of the same pair, so the cases above run attention beside the dispatch both ways."""
    for rank, r in enumerate(every_rank(w2["groups_cp2_ep2_mixtral"])):
        assert r["ep_ranks"] == [0, 1] and r["edp_ranks"] == [rank] and r["dp"] == 2
        assert r["experts_frac"] == 0.5 and r["cp_ranks"] == [0, 1] and r["cp_is_ep"] is True
    for rank, r in enumerate(every_rank(w4["groups_cp2_dp2_ep2_mixtral"])):
        assert r["ep_ranks"] == [rank - rank % 2, rank - rank % 2 + 1] and r["edp_ranks"] == [rank % 2, rank % 2 + 2]
        assert r["dp"] == 4 and r["experts_frac"] == 0.5
        assert r["cp_ranks"] == r["ep_ranks"] and r["cp_is_ep"] is False
    for rank, r in enumerate(every_rank(w4["groups_cp2_dp2_ep4_mixtral"])):
        assert r["ep_ranks"] == [0, 1, 2, 3] and r["edp_ranks"] == [rank] and r["experts_frac"] == 0.25
