"""Routed experts in any layout train one device's numbers under ZeRO-3 and under ep (issue 41, item 1).

torchtitan's ``GroupedExperts`` (``w1``/``w2``/``w3``, called with the rows sorted by expert), Hugging Face's
gpt-oss (biases, interleaved clamped SwiGLU, ``[E, H, 2I]``), Llama 4 (a shared expert beside every expert run
by ``bmm`` on every token's scored copy) and Jamba (Mamba and attention layers, an MoE in each) are recognised
by what they compute and how their block calls them (``autopar.experts``); ep runs each module's own forward
on its slice of the experts. Each model, on 2 ranks: ZeRO-3 over dp=2, and ep=2 beside ZeRO-3 over dp=2,
against one process (first-step loss and gradients, SGD losses and parameters within 1e-5 relative per
tensor), in one spawn; gpt-oss also at pp=2 cut after its rotary embedding.
"""

from __future__ import annotations

import pytest
from distributed import every_rank
from moe_layouts import LAYOUT_MODELS

pytestmark = pytest.mark.distributed

EXACT = 1e-5
WEIGHTS = {"titan_moe": ("torchtitan", "GROUPED"), "gpt_oss": ("gpt-oss", "INDEXED"), "llama4": ("llama4", "BLOCKED"),
           "jamba": ("hf-fused", "INDEXED")}


@pytest.fixture(scope="module")
def w2(ranks) -> dict[str, dict]:
    return ranks(2).run(list(LAYOUT_MODELS), module="expert_layout_cases")


@pytest.mark.parametrize("model", list(LAYOUT_MODELS))
def test_each_expert_layout_trains_one_devices_numbers_under_zero3_and_ep2(w2: dict, model: str) -> None:
    for r in every_rank(w2[model]):
        assert r["facts"] and all(f == [*WEIGHTS[model], ""] for f in r["facts"]), r["facts"]
        for kind in ("zero3", "ep2"):
            got = r[kind]
            assert "refused" not in got, got
            assert got["loss_rel"] < EXACT and got["grad_rel"] < EXACT and got["param_rel"] < EXACT, (kind, got)
        assert r["zero3"]["mesh"] == [1, 2, 1, 1] and r["zero3"]["zero"] == [3]
        assert r["ep2"]["mesh"] == [1, 2, 2, 1] and r["ep2"]["zero"] == [3]
        # ep really splits the experts (edp = 1: held whole beside the dense weights' ZeRO-3 halves)
        assert r["ep2"]["local_param_bytes"] == pytest.approx(r["zero3"]["local_param_bytes"], rel=0.05)


def test_gpt_oss_at_pp2_cut_after_its_rotary_embedding_trains_one_devices_numbers(w2: dict) -> None:
    """The cut hands stage 1 the rotary's (cos, sin) tuple, sent as its two tensors."""
    for r in every_rank(w2["gpt_oss"]):
        got = r["pp2_rotary"]
        assert "refused" not in got, got
        assert got["mesh"] == [2, 1, 1, 1] and got["stages"] == [0, 0, 1, 1, 1, 1], got
        assert got["loss_rel"] < EXACT and got["grad_rel"] < EXACT and got["param_rel"] < EXACT, got
