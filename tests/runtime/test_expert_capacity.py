"""Expert parallelism on a hand-written GShard/Switch MoE (tests/moe_cases.py's ``GShardGPT``: experts as
3-D parameters, one-hot einsum dispatch and combine at a fixed capacity; ``passes/expert_capacity.py``
splits its expert region on e with an all-to-all of the dispatched [E, C, M] tensor, forward and back)
against one process, on gloo: top-2 and top-1 under ep=2 (W=2, ZeRO-0 and ZeRO-3, and with full
recompute), ep=2 × edp=2 (W=4, ZeRO-0 and ZeRO-3: the experts whole over edp), and ep=2 inside the
stages of a pp=2 pipeline (W=4, ZeRO-0 and ZeRO-3).

Parity is exact because the capacity factors are drop-free (cf ≥ E / top-k: tests/moe_cases.py says
why a dropping capacity cannot be split, and the planner refuses it); routing decisions stay identical
(fp32 router on the same tokens). Bars as tests/runtime/test_expert_parallel.py's: first-step loss and
gradients, SGD losses and parameters within 1e-5 relative per tensor; AdamW losses within 1e-3 where
the case runs AdamW (one an engine: equivalence_cases.ADAM_CASES).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from distributed import check_equivalent, every_rank

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moe_cases  # noqa: E402

pytestmark = pytest.mark.distributed

W2 = ["ep2_gshard_top2", "ep2_gshard_top1", "ep2_zero3_gshard_top2", "ep2_recompute_gshard_top2"]
W4 = ["ep2_dp4_gshard_top2", "ep2_dp4_zero3_gshard_top1", "pp2_ep2_gshard_top2", "pp2_ep2_zero3_gshard_top2"]


@pytest.fixture(scope="module")
def w2(ranks) -> dict[str, dict]:
    return ranks(2).run(W2, module="moe_cases")


@pytest.fixture(scope="module")
def w4(ranks) -> dict[str, dict]:
    return ranks(4).run(W4, module="moe_cases")


def _experts_split(result: dict, case: str) -> None:
    """Each rank holds 1/ep of the experts (w1, w2: whole over edp at every ZeRO stage) and its share of the
    rest (1/dp of it at ZeRO-3); in a pipeline, less than the whole model."""
    spec = moe_cases.SPECS[case]
    model, _ = spec.build()
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if n.endswith((".w1", ".w2")))
    dp = next(int(p[3:]) for p in spec.pins if p.startswith("dp="))
    dense = (total - experts) / (dp if "zero=3" in spec.pins else 1)
    for r in every_rank(result):
        if case.startswith("pp2"):
            assert r["local_bytes_frac"] < (dense + experts / 2) / total
        else:
            assert r["local_bytes_frac"] == pytest.approx((dense + experts / 2) / total, rel=1e-9)


@pytest.mark.parametrize("case", W2)
def test_gshard_ep2_matches_one_device(w2: dict, case: str) -> None:
    check_equivalent(w2[case])
    for r in every_rank(w2[case]):
        assert r["ep"] == 2 and r["mesh"] == [1, 2, 1]
        assert bool(r["recomputed"]) == ("recompute" in case)  # the blocks checkpointed where pinned
    _experts_split(w2[case], case)


@pytest.mark.parametrize("case", W4)
def test_gshard_ep2_on_four_ranks_matches_one_device(w4: dict, case: str) -> None:
    check_equivalent(w4[case])
    for r in every_rank(w4[case]):
        assert r["ep"] == 2 and r["mesh"] == ([2, 2, 1] if case.startswith("pp2") else [1, 4, 1])
    _experts_split(w4[case], case)
