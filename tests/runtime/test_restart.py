"""``autopar run`` end to end: a rank killed mid-run is restarted and resumes from the newest checkpoint
to the weights of a run never interrupted, on the same samples (the metrics files' tokens hashes); a
failing launch names every failed rank and why.

Each launch starts real processes under torchrun (a few seconds each on 2 cores).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from autopar.tools.cli import main

pytestmark = pytest.mark.distributed  # each test launches its own ranks under torchrun: a fresh group

ROOT = Path(__file__).resolve().parents[2]
TRAINER = str(ROOT / "examples" / "train_gpt.py")
RESTART_BUDGET_S = 150  # both launches, the restarted one twice over; ~30 s here


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _reports(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_killed_rank_restarts_and_finishes_with_the_uninterrupted_weights_and_samples(
        tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    text = tmp_path / "corpus.txt"  # text read as bytes: 80 windows of 32 + 1, shuffled by --seed
    text.write_text("".join(f"{k}: {k * k} is the square of {k}, {k ** 3} its cube\n" for k in range(80)))
    common = ["--steps", "9", "--checkpoint-every", "3", "--batch-size", "8", "--data", str(text), "--seed", "3"]
    start = time.monotonic()
    assert main(["run", TRAINER, "--nproc", "2", "--", *common, "--checkpoint-dir", str(tmp_path / "a"),
                 "--export", str(tmp_path / "a-final"), "--metrics-file", str(tmp_path / "a.jsonl")]) == 0
    capfd.readouterr()
    assert main(["run", TRAINER, "--nproc", "2", "--max-restarts", "1", "--", *common,
                 "--checkpoint-dir", str(tmp_path / "b"), "--simulate-failure", "5", "--async-checkpoint",
                 "--export", str(tmp_path / "b-final"), "--metrics-file", str(tmp_path / "b.jsonl")]) == 0
    out = capfd.readouterr()
    assert time.monotonic() - start < RESTART_BUDGET_S
    assert "resumed from" in out.out and "step-00000003 at step 3" in out.out  # step 5's rank died
    assert "trained to step 9" in out.out
    a, b = _weights(tmp_path / "a-final"), _weights(tmp_path / "b-final")
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the same samples step by step: none repeated, none skipped (steps 3 and 4, trained before the
    # kill and again after the restart, are reported once, by the run that went on)
    ra, rb = _reports(tmp_path / "a.jsonl"), _reports(tmp_path / "b.jsonl")
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(9))
    assert [r["tokens_hash"] for r in rb] == [r["tokens_hash"] for r in ra] and len({r["tokens_hash"] for r in ra}) == 9
    assert [r["loss"] for r in rb] == [r["loss"] for r in ra]


def test_a_failed_launch_names_each_rank_its_exit_and_its_error(tmp_path: Path,
                                                                capfd: pytest.CaptureFixture) -> None:
    raises = tmp_path / "raises.py"
    raises.write_text("import os, time\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    raise ValueError('no data on this rank')\n"
                      "time.sleep(30)\n")
    assert main(["run", str(raises), "--nproc", "2"]) == 1
    err = capfd.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("autopar: error: ") and "failed on 1 of 2 processes" in err
    assert "rank 1 exited with code 1: ValueError: no data on this rank" in err
    assert "rank 0 was stopped by the launcher (SIGTERM) after rank 1 failed" in err
    killed = tmp_path / "killed.py"
    killed.write_text("import os, signal, time\n"
                      "if os.environ['RANK'] == '0':\n"
                      "    os.kill(os.getpid(), signal.SIGKILL)\n"
                      "time.sleep(30)\n")
    assert main(["run", str(killed), "--nproc", "2"]) == 1
    assert "rank 0 was killed by SIGKILL" in capfd.readouterr().err
