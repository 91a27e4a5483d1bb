"""Batch-coupled layers under a split batch (issue 41 item 4): a capacity MoE is offered dp and a
BatchNorm model microbatches, each split named in the plan, and each run matches one process that runs
the same splits within 1e-5 on every rank (cases in ``batch_coupling_cases``, one request of the pool)."""

from __future__ import annotations

import pytest
from batch_coupling_cases import CASES
from distributed import EXACT, every_rank

pytestmark = pytest.mark.distributed

SPLITS = {"switch_dp2_mb2": 4, "switch_ep2_mb2": 4, "resnet_pp2_mb4": 4, "resnet_dp2_split": 2, "resnet_dp2_exact": 1}


def test_batch_coupled_layers_match_one_process_running_the_same_splits(ranks) -> None:
    results = ranks(2).run(sorted(CASES), module="batch_coupling_cases")
    for case, splits in SPLITS.items():
        for r in every_rank(results[case]):
            assert r["splits"] == splits, (case, r["splits"])
            assert r["ep"] == (2 if "ep2" in case else 1), (case, r["ep"])
            assert r["loss_rel"] < EXACT and r["grad_rel"][0] < EXACT and r["param_rel"][0] < EXACT, (case, r)
            line = next((n for n in r["notes"] if n.startswith("batch-coupled layers")), "")
            if splits > 1:  # named in the plan, and the splits change the numbers (else this proves nothing)
                assert f"{splits} splits" in line, (case, r["notes"])
                assert r["whole_grad_rel"][0] > 1e-3, (case, r["whole_grad_rel"])
            else:
                assert "exact" in line and "all-reduced over the dp group" in line, (case, r["notes"])
