"""``autopar run`` and ``autopar verify``: launch and check a plan end to end on gloo."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopar.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.distributed
def test_verify_a_tensor_parallel_plan(capsys: pytest.CaptureFixture) -> None:
    code = main(["verify", str(ROOT / "examples/gpt.py") + ":gpt_tiny", "--world-size", "2",
                 "--pin", "pp=1", "--pin", "tp=2", "--pin", "blocks.*:tp=megatron",
                 "--batch-size", "4", "--steps", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "mesh tp=2," in out and "step 2: loss" in out and "OK:" in out


@pytest.mark.distributed
def test_verify_the_solvers_plan_on_a_3d_mesh(capsys: pytest.CaptureFixture) -> None:
    # pp 2 × dp 2 × tp 2 with the solver choosing ZeRO stages and recompute per layer
    # (it mixes ZeRO-0 embeddings with ZeRO-3 blocks in one pipeline stage)
    code = main(["verify", str(ROOT / "examples/gpt.py") + ":gpt_tiny", "--world-size", "8",
                 "--pin", "pp=2", "--pin", "dp=2", "--pin", "tp=2", "--pin", "schedule=1f1b",
                 "--pin", "microbatches=2", "--batch-size", "8", "--steps", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "mesh pp=2 × dp=2 × tp=2," in out and "OK:" in out


def test_verify_refuses_a_plan_for_another_world_size(tmp_path: Path, capsys) -> None:
    plan = tmp_path / "plan.json"
    spec = str(ROOT / "examples/gpt.py") + ":gpt_tiny"
    assert main(["plan", spec, "--world-size", "4", "--cluster", "cpu", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["verify", spec, "--world-size", "2", "--plan", str(plan)]) == 2
    assert "is for 4 ranks" in capsys.readouterr().err


@pytest.mark.distributed
def test_run_launches_the_script_on_n_processes(tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text(
        "import os, sys, pathlib\n"
        "pathlib.Path(sys.argv[1], os.environ['RANK']).write_text(os.environ['WORLD_SIZE'])\n")
    assert main(["run", str(script), "--nproc", "2", "--", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "hello.py") == ["0", "1"]


@pytest.mark.distributed
def test_run_reports_a_failing_script(tmp_path: Path, capsys) -> None:
    script = tmp_path / "fail.py"
    script.write_text("raise SystemExit(3)\n")
    assert main(["run", str(script), "--nproc", "1"]) == 1
    assert "failed" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "missing.py"), "--nproc", "1"]) == 2


@pytest.mark.distributed
def test_run_names_the_default_loss_once(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    script = tmp_path / "classify.py"
    script.write_text(
        "import torch, torch.nn as nn, autopar\n"
        "model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))\n"
        "pm = autopar.compile(model, example_inputs=(torch.zeros(4, 4),), global_batch=4, dtype='fp32',\n"
        "                     pins=['dp=2', 'zero=0'])\n"
        "x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))\n"
        "for _ in range(2):\n"
        "    pm.train_step(pm.local_batch(x), pm.local_batch(y))\n"
        "pm.close()\n")
    assert main(["run", str(script), "--nproc", "2"]) == 0
    err = capfd.readouterr().err
    assert err.count("autopar: default loss: cross-entropy over 3 classes (one class index per sample)") == 1, err


@pytest.mark.distributed
def test_the_trainers_bad_data_is_one_line_and_exit_2_through_run(tmp_path: Path,
                                                                  capfd: pytest.CaptureFixture) -> None:
    trainer = str(ROOT / "examples" / "train_gpt.py")
    assert main(["run", trainer, "--nproc", "1", "--", "--data", str(tmp_path / "missing.txt")]) == 2
    err = capfd.readouterr().err
    assert f"train_gpt.py: error: data file {tmp_path / 'missing.txt'} does not exist\n" in err
    assert err.strip().splitlines()[-1].startswith("autopar: error: ") and "exited with code 2" in err
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("the first corpus, " * 200)
    b.write_text("and another one, " * 200)
    common = ["--steps", "1", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1"]
    assert main(["run", trainer, "--nproc", "1", "--", "--data", str(a), *common]) == 0
    capfd.readouterr()
    assert main(["run", trainer, "--nproc", "1", "--", "--data", str(b), *common]) == 2
    line = next(x for x in capfd.readouterr().err.splitlines() if x.startswith("train_gpt.py: error: "))
    assert f"was trained on {a} (" in line and f"this run reads {b} (" in line
