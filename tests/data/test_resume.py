"""A run resumed under another plan trains on exactly the samples, and to the losses, of one never
interrupted: 8 steps of ``gpt-tiny`` on a token file under dp = 2, against 4 under dp = 2, a
checkpoint, and 4 more under pp = 2 (W = 2) or in one process with gradient accumulation (W = 1),
compared step by step from the metrics files (:mod:`data_cases`). Also a metrics file's report
without a process group."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from distributed import EXACT, every_rank

pytestmark = pytest.mark.distributed


def _reports(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(ranks, monkeypatch_module):
    import data_cases

    root = Path(tempfile.mkdtemp(prefix="autopar-data-"))
    data_cases.write_tokens(root / "tokens.bin")
    monkeypatch_module.setenv(data_cases.DIR_ENV, str(root))
    try:
        results = ranks(2).run(["uninterrupted_dp2", "half_dp2", "resume_pp2"], module="data_cases",
                               env={data_cases.DIR_ENV: str(root)})
        w1 = data_cases.resume("w1", 1, "w1")  # this process, no process group
        yield root, results, w1
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            mp.delenv(key, raising=False)
        yield mp


def test_resumed_under_another_plan_the_samples_and_losses_are_the_uninterrupted_runs(runs) -> None:
    root, results, w1 = runs
    full = _reports(root / "full.jsonl")
    assert [r["step"] for r in full] == list(range(8))
    assert len({r["tokens_hash"] for r in full}) == 8  # a different global batch every step
    assert all(r["grad_norm"] is not None and r["grad_norm"] > 0 for r in full)
    assert [r["tokens"] for r in full] == [256 * (k + 1) for k in range(8)]
    for name in ("pp2", "w1"):
        resumed = _reports(root / f"{name}.jsonl")  # the first half's reports, then the resumed run's
        assert [r["step"] for r in resumed] == list(range(8)), name  # the stale step-5 report was dropped
        assert [r["tokens_hash"] for r in resumed] == [r["tokens_hash"] for r in full], name
        for a, b in zip(resumed, full):
            assert abs(a["loss"] - b["loss"]) <= EXACT * abs(b["loss"]), (name, a["step"], a["loss"], b["loss"])
    # what each rank was handed: dp = 2 a share of 4 samples each; pp = 2 and W = 1 the whole batch of 8
    assert [r["shapes"][0] for r in every_rank(results["uninterrupted_dp2"])] == [[4, 32]] * 2
    assert sorted(r["dp_rank"] for r in every_rank(results["half_dp2"])) == [0, 1]
    for r in every_rank(results["resume_pp2"]):
        assert r["shapes"] == [[8, 32]] * 4 and r["extra_step"] == 4 and r["dp_rank"] == 0
    assert w1["shapes"] == [[8, 32]] * 4 and w1["extra_step"] == 4 and w1["records"] == 4
    # rank 0's plain line: each figure beside the plan's and the ratio; the other ranks report nothing
    line = w1["last_line"]
    assert line.startswith("step     7  loss ") and "tok/s/rank (plan " in line and "host rss " in line
    assert every_rank(results["resume_pp2"])[1]["last_line"] is None
