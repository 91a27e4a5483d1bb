"""Zero-bubble pipeline schedules lowered: each against one device on gloo ranks (:mod:`zero_bubble_cases`).

Bars (DESIGN.md, fp32 on CPU): first-step loss and gradients, and parameters and losses over 3
SGD-with-momentum steps, within 1e-5 relative, on every rank; 3 AdamW steps' losses within 1e-3.
"""

from __future__ import annotations

import pytest
from distributed import check_equivalent

W2 = ["zb1p_gpt", "zb_interleaved_gpt", "zbv_gpt", "dualpipev_gpt", "zbv_hf_llama", "zb1p_hf_llama",
      "dualpipev_hf_llama", "zbv_nanogpt", "dualpipev_nanogpt", "zb_interleaved_nanogpt"]
W4 = ["zbv_dp2_zero2_gpt", "zb1p_dp2_plain_dp_gpt", "zbv_pp4_gpt", "zb_interleaved_pp4_gpt", "dualpipev_pp4_gpt"]


@pytest.fixture(scope="module")
def w2(ranks) -> dict[str, dict]:
    return ranks(2).run(W2, module="zero_bubble_cases")


@pytest.fixture(scope="module")
def w4(ranks) -> dict[str, dict]:
    return ranks(4).run(W4, module="zero_bubble_cases")


@pytest.mark.distributed
@pytest.mark.parametrize("case", W2)
def test_two_ranks_match_one_device(w2: dict, case: str) -> None:
    check_equivalent(w2[case])


@pytest.mark.distributed
@pytest.mark.parametrize("case", W4)
def test_four_ranks_match_one_device(w4: dict, case: str) -> None:
    check_equivalent(w4[case])
