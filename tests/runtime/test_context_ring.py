"""Ring attention (``cp_attention=ring``: K/V passed round the cp ring by torch's ``_templated_ring_attention``)
against one process, on gloo: the op on its own at cp=2 and cp=4 (forward and q, k, v gradients, fp32, within
1e-5; as many key/value heads as query heads, and grouped-query), then examples/gpt.py's GPT and a tiny Hugging
Face Llama (grouped-query: 4 heads over 2 key/value heads) trained 3 steps at cp=2 (W=2; the Llama with selective
recompute over 2 microbatches), cp=4 (W=4; the Llama with full recompute), cp=2 × dp=2 (W=4, the GPT at
ZeRO-3 over the dp × cp ranks, 2 microbatches), cp=2 × tp=2 (W=4; Megatron blocks, each tp rank's heads passed
round its cp pair: the GPT with vocab-parallel embeddings, the Llama, its one key/value head a tp rank, with
sequence parallelism) and cp=2 × pp=2 (W=4; each stage's attention modules run the ring: the GPT under 1F1B,
the Llama under GPipe with full recompute), and cp=2 × pp=2 × tp=2 (W=8, the GPT's Megatron blocks under 1F1B).

Bars (DESIGN.md, fp32 on CPU): first-step loss and gradients, SGD losses and parameters within 1e-5 relative per
tensor; AdamW losses within 1e-3 where
the case runs AdamW (one an engine: equivalence_cases.ADAM_CASES). The lowering really is the ring: a step runs
torch's ring forward and backward once per attention call and the K/V all-gather never, beside tp too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from distributed import check_equivalent, every_rank

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytestmark = pytest.mark.distributed

W2 = ["ring_cp2_gpt", "ring_cp2_selective_accum_llama"]
W4 = ["ring_cp4_gpt", "ring_cp4_recompute_llama", "ring_cp2_dp2_zero3_accum_gpt"]
W4_TP_PP = ["ring_cp2_tp2_gpt", "ring_cp2_tp2_sp_llama", "ring_cp2_pp2_1f1b_gpt", "ring_cp2_pp2_gpipe_recompute_llama"]


@pytest.fixture(scope="module")
def w2(ranks) -> dict[str, dict]:
    return ranks(2).run(["ring_op"] + W2 + ["ring_cp2_runs_ring"], module="ring_cases")


@pytest.fixture(scope="module")
def w4(ranks) -> dict[str, dict]:
    return ranks(4).run(["ring_op"] + W4 + W4_TP_PP + ["ring_cp2_tp2_runs_ring"], module="ring_cases")


@pytest.mark.parametrize("world", ["w2", "w4"])
def test_torchs_ring_on_cpu_matches_one_causal_sdpa(world: str, request: pytest.FixtureRequest) -> None:
    got = request.getfixturevalue(world)["ring_op"]
    assert "error" not in got, got.get("traceback")
    for r in every_rank(got):
        for layout in ("mha", "gqa"):
            out, dq, dk, dv = r["errors"][layout]
            assert max(out, dq, dk, dv) <= 1e-5, (layout, r["errors"][layout])


@pytest.mark.parametrize("case", W2)
def test_ring_cp2_on_two_ranks_matches_one_device(w2: dict, case: str) -> None:
    check_equivalent(w2[case])
    assert w2[case]["cp_attention"] == "ring"
    decoders = {p: k for p, k in w2[case]["recomputed"].items() if p.startswith("model.layers.")}
    if "selective" in case:  # the selective replay runs the ring again; 2 microbatches
        assert decoders == {"model.layers.0": "selective", "model.layers.1": "selective"}
        assert w2[case]["microbatches"] == 2


@pytest.mark.parametrize("case", W4)
def test_ring_cp4_and_beside_dp_on_four_ranks_matches_one_device(w4: dict, case: str) -> None:
    check_equivalent(w4[case])
    assert w4[case]["cp_attention"] == "ring"
    for r in every_rank(w4[case]):
        assert r["mesh"] == ([1, 2, 1] if "dp2" in case else [1, 1, 1])
    decoders = {p: k for p, k in w4[case]["recomputed"].items() if p.startswith("model.layers.")}
    if "recompute" in case:  # the recomputed forward runs the ring again
        assert decoders == {"model.layers.0": "full", "model.layers.1": "full"}
    if "zero3" in case:  # the weights are sharded over all four dp × cp ranks
        assert all(r["local_bytes_frac"] < 0.3 for r in every_rank(w4[case]))
        assert w4[case]["microbatches"] == 2


@pytest.fixture(scope="module")
def w8(ranks) -> dict[str, dict]:
    return ranks(8).run(["ring_cp2_pp2_tp2_gpt"], module="ring_cases")


def test_ring_inside_pp2_stages_beside_tp2_on_eight_ranks_matches_one_device(w8: dict) -> None:
    """The ring over each tp rank's heads inside each pipeline stage: (pp, dp, cp, tp) = (2, 1, 2, 2)."""
    m = w8["ring_cp2_pp2_tp2_gpt"]
    check_equivalent(m)
    assert m["cp_attention"] == "ring" and sorted(set(m["stages"])) == [0, 1]
    for r in every_rank(m):
        assert r["mesh"] == [2, 1, 2]


@pytest.mark.parametrize("case", W4_TP_PP)
def test_ring_beside_tp_or_inside_pp_stages_matches_one_device(w4: dict, case: str) -> None:
    """cp=2 × tp=2: each tp rank's heads' K/V (h_kv/tp) passed round its cp pair, sp off and on; cp=2 × pp=2:
    each stage's attention modules run the ring over their cp pair, the stages sending S/cp tokens."""
    m = w4[case]
    check_equivalent(m)
    assert m["cp_attention"] == "ring"
    for r in every_rank(m):
        assert r["mesh"] == ([1, 1, 2] if "tp2" in case else [2, 1, 1])
    if "tp2" in case:
        blocks = [layer for layer in m["layers"] if layer[0].startswith(("blocks.", "model.layers."))]
        assert blocks and all(tp == "megatron" and sp == ("_sp_" in case) for _, tp, _, _, sp in blocks)
    else:
        assert sorted(set(m["stages"])) == [0, 1] and m["schedule"] == case.split("_")[3]
    if "recompute" in case:  # the recomputed forward runs the ring again, inside the stage
        assert {k for p, k in m["recomputed"].items() if p.startswith("model.layers.")} == {"full"}


@pytest.mark.parametrize(("world", "case"), [("w2", "ring_cp2_runs_ring"), ("w4", "ring_cp2_tp2_runs_ring")])
def test_the_ring_plan_runs_torchs_ring_not_the_kv_all_gather(world: str, case: str,
                                                                request: pytest.FixtureRequest) -> None:
    for r in every_rank(request.getfixturevalue(world)[case]):
        assert r["method"] == "ring" and r["ring"] is True
        assert r["calls"] == {"ring": 2, "ring_backward": 2, "all_gather": 0, "all_to_all": 0}  # 2 blocks
