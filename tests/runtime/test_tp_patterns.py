"""Outside models whose tensor-parallel styles used to fail, now proved in simulation, run at tp=2 on
gloo processes with the same numbers as one device (cases in ``tp_pattern_cases``)."""

from __future__ import annotations

import pytest
from distributed import check_equivalent, every_rank
from tp_pattern_cases import CASES

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def w2(ranks) -> dict[str, dict]:
    return ranks(2).run(sorted(CASES), module="tp_pattern_cases")


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_tp_ranks_match_one_device(w2: dict, case: str) -> None:
    check_equivalent(w2[case])
    for r in every_rank(w2[case]):
        assert r["mesh"] == [1, 1, 2] and r["local_bytes_frac"] < 0.9  # the blocks hold shares
        blocks = [layer for layer in r["layers"] if ".layers." in layer[0] or ".h." in layer[0]]
        assert blocks and all(tp == "megatron" and sp == case.endswith("/sp") for _, tp, _, _, sp in blocks)
