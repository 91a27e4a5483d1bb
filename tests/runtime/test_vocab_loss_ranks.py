"""The vocabulary-parallel loss trains as one device does (:mod:`vocab_loss_cases`): tp=2 alone and with
sequence parallelism on W=2, pp=2 × tp=2 and dp=2 × tp=2 (ZeRO-3) on W=4; the repo's GPT and a Hugging
Face Llama, untied and tied; and the chunked loss under cp (all-gather, Ulysses, ring; beside tp with
sp, and pp); every rank's losses, gradients and parameters against one process."""

from __future__ import annotations

import pytest
from distributed import check_equivalent, every_rank
from vocab_loss_cases import CP_W2, CP_W4, W2, W4

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def w2(ranks) -> dict[str, dict]:
    return ranks(2).run([*W2, *CP_W2, "vp_measured_peak"], module="vocab_loss_cases")


@pytest.fixture(scope="module")
def w4(ranks) -> dict[str, dict]:
    return ranks(4).run([*W4, *CP_W4], module="vocab_loss_cases")


@pytest.mark.parametrize("case", [*W2, *CP_W2])
def test_w2_matches_one_device(w2: dict, case: str) -> None:
    check_equivalent(w2[case])


@pytest.mark.parametrize("case", [*W4, *CP_W4])
def test_w4_matches_one_device(w4: dict, case: str) -> None:
    check_equivalent(w4[case])


def test_the_plans_run_the_loss_and_the_splits_named(w2: dict, w4: dict) -> None:
    for m in (*(w2[c] for c in W2 if c.startswith("vp_")), *(w4[c] for c in W4 if c.startswith("vp_"))):
        for r in every_rank(m):
            assert r["loss_kind"] == "vocab_parallel" and r["tp_styles"]["lm_head"] == "vocab"
    tied = w2["vp_tp2_sp_llama_tied"]
    assert tied["tp_styles"]["model.embed_tokens"] == "vocab"  # the tied embedding split with its head
    assert tied["layers"][2][4]  # sequence parallelism on the blocks
    whole = w2["full_tp2_llama_tied"]
    assert whole["loss_kind"] == "full" and whole["tp_styles"]["model.embed_tokens"] is None
    piped = w4["chunk_pp2_tp2_llama_tied"]
    assert piped["loss_kind"] == "chunked" and piped["tp_styles"]["lm_head"] is None
    assert w4["vp_pp2_tp2_gpt"]["mesh"] == [2, 1, 2] and w4["vp_dp2_tp2_zero3_gpt"]["mesh"] == [1, 2, 2]
    for m in (*(w2[c] for c in CP_W2), *(w4[c] for c in CP_W4)):
        assert m["cp"] == 2 and m["loss_kind"] == ("vocab_parallel" if m["mesh"][2] == 2 else "chunked")
    assert {w2[c]["cp_attention"] for c in CP_W2} == {"allgather", "ulysses", "ring"}


def test_the_measured_peak_is_the_priced_one(w2: dict, monkeypatch) -> None:
    """fp32 on a CPU, tp=2: each rank's vocabulary-parallel loss over one microbatch peaks within 10% of
    ``PriceTable.loss_bytes`` (two fp32 chunks of a 4,096-class shard), and gives F.cross_entropy's loss."""
    import sys
    from pathlib import Path

    import autopar
    import autopar.contract_loss as contract_loss
    from autopar.choice import LossKind
    from autopar.cost_models.pipeline import Schedule, ScheduleKind
    from autopar.mesh import Mesh
    from autopar.planning.configuration import Configuration, TrainingSpec
    from autopar.planning.pricing import PriceTable

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import gpt
    from vocab_loss_cases import PEAK

    p = PEAK
    monkeypatch.setattr(contract_loss, "CHUNK_LOGITS_BYTES", 4 * p["vocab"] // 2 * p["chunk"])
    graph = autopar.capture(*gpt.gpt(n_layer=1, d_model=p["hidden"], n_head=4, vocab_size=p["vocab"], seq_len=p["seq"]))
    table = PriceTable(graph, Configuration(Mesh(tp=2), 1, Schedule(ScheduleKind.NONE)),
                       autopar.cost_models.presets.load_cluster("cpu").for_world_size(2),
                       TrainingSpec(p["batch"], dtype="fp32", loss=LossKind.CHUNKED))
    assert table.loss is LossKind.VOCAB_PARALLEL
    priced = table.loss_bytes[0]
    assert priced == 2 * p["chunk"] * p["vocab"] // 2 * 4
    for r in every_rank(w2["vp_measured_peak"]):
        assert abs(r["measured"] - priced) <= 0.1 * priced, (r["forward"], r["backward"], priced)
        assert r["loss_rel"] < 1e-5
