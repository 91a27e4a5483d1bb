"""Code people write whose tensor parallelism needed a sharding rule (complex rotary embeddings,
attention sinks, a size with two roles), run at tp=2 on gloo processes with the same numbers as one
device (cases in ``tp_rule_cases``), all in one request of the session's pool."""

from __future__ import annotations

import pytest
from distributed import check_equivalent, every_rank
from tp_rule_cases import CASES

pytestmark = pytest.mark.distributed
BLOCKS = ("layers.", "model.layers.", "blocks.", "decoder.layers.", "backbone.layers.", "h.")


@pytest.fixture(scope="module")
def w2(ranks) -> dict[str, dict]:
    return ranks(2).run(sorted(CASES), module="tp_rule_cases")


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_tp_ranks_match_one_device(w2: dict, case: str) -> None:
    check_equivalent(w2[case])
    for r in every_rank(w2[case]):
        # the blocks hold shares (gpt-oss's experts stay whole: ep is not asked)
        assert r["mesh"] == [1, 1, 2] and r["local_bytes_frac"] < 0.95
        blocks = [layer for layer in r["layers"] if layer[0].startswith(BLOCKS)]
        assert blocks and all(tp == "megatron" for _, tp, _, _, _ in blocks)
