"""The chunked loss trains as one device does: dp=2 under DDP and ZeRO-3 (FSDP2), pp=2 under 1F1B,
on the repo's GPT and a Hugging Face Llama (untied and tied), against the unsharded model trained with
the default loss on the whole logits (:mod:`chunked_loss_cases`)."""

from __future__ import annotations

import pytest
from chunked_loss_cases import CHUNK_TOKENS, SPECS
from distributed import check_equivalent, every_rank

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def w2(ranks) -> dict[str, dict]:
    return ranks(2).run(list(SPECS), module="chunked_loss_cases")


@pytest.mark.parametrize("case", list(SPECS))
def test_chunked_loss_matches_one_device(w2: dict, case: str) -> None:
    m = w2[case]
    check_equivalent(m)
    for r in every_rank(m):
        assert r["loss_kind"] == "chunked" and r["chunk_tokens"] == CHUNK_TOKENS


def test_the_cases_run_the_meshes_named(w2: dict) -> None:
    assert w2["chunk_zero3_gpt"]["mesh"] == [1, 2, 1] and w2["chunk_pp2_llama"]["mesh"] == [2, 1, 1]
    assert {u[2] for u in w2["chunk_ddp_gpt"]["units"]} <= {"ddp"}
    assert any(u[1] == 3 for u in w2["chunk_zero3_llama"]["units"])
