"""``autopar tune``'s ranks on 4 gloo processes (issue 43): a candidate every rank refuses is recorded as
failed and the search goes on; every rank reports the same outcomes; a spent budget starts nothing."""

from __future__ import annotations

import pytest
from distributed import ok

pytestmark = pytest.mark.distributed


def test_candidates_run_fail_alone_and_every_rank_agrees(ranks) -> None:
    result = ok(ranks(4).run(["candidates"], module="tune_cases")["candidates"])
    every = result["ranks"]
    def agreed(r: dict, mode: str) -> list:
        return [(m["index"], m["status"], m["measured_s"], m["peak_bytes"]) for m in r[mode]]

    for mode in ("together", "alone"):  # the same statuses and figures on every rank
        assert all(agreed(r, mode) == agreed(every[0], mode) for r in every)
    together = {m["index"]: m for m in result["together"]}
    assert [together[i]["status"] for i in (0, 1, 2)] == ["ok", "failed", "ok"]
    assert "fingerprint" in together[1]["error"] or "another" in together[1]["error"]
    for m in (together[0], together[2], *result["alone"]):
        assert m["status"] == "ok" and m["measured_s"] > 0 and m["peak_bytes"] > 0
    assert result["landed"] == [1, 0, 2]  # rank 0's hook: the failure as it happened, then the timed ones
    assert [r["landed"] for r in every[1:]] == [[]] * 3  # the others report nothing
    assert result["spent"] == 0
