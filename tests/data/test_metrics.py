"""The metrics logger without a process group: what a JSON-lines report holds and how it is computed
from the plan, a resumed run's file, the progress bar, TensorBoard asked for without its package."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import autopar
from autopar.errors import MetricsError
from autopar.runtime.metrics import MetricsLogger


@pytest.fixture(scope="module")
def plan() -> autopar.Plan:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import gpt

    model, inputs = gpt.build(gpt.CONFIGS["gpt-tiny"], device="meta")
    return autopar.solve(autopar.capture(model, inputs), 1, cluster="cpu", dtype="fp32", global_batch=8)


def _pm(plan: autopar.Plan, step: int = 0) -> SimpleNamespace:
    return SimpleNamespace(plan=plan, step=step, grad_norm=0.5)


def test_a_report_holds_each_figure_beside_the_plans_and_the_ratio(plan, tmp_path: Path) -> None:
    out = io.StringIO()
    m = MetricsLogger(_pm(plan), log_every=2, metrics_file=tmp_path / "m.jsonl", total_steps=5, stream=out)
    for step, step_s in enumerate([0.1, 0.3, 0.2, 0.2, 0.5]):
        m.log(step, 4.0 - step, step_s=step_s, tokens=256, lr=1e-3, tokens_hash=f"h{step}", data_wait_s=0.01)
    m.close()
    reports = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in reports] == [1, 3, 4]  # every 2 steps, and the last
    r = reports[0]
    assert r["loss"] == 3.0 and r["tokens"] == 512 and r["tokens_hash"] == "h1" and r["grad_norm"] == 0.5
    assert r["step_time_s"] == pytest.approx(0.2) and r["tokens_per_s"] == pytest.approx(512 / 0.4)
    p = plan.predicted
    flops = p.tflops_per_gpu * 1e12 * p.step_time_s  # the plan's FLOPs per step, one rank
    peak = plan.cluster.device.peak_flops("fp32")
    assert r["tflops"] == pytest.approx(flops / 0.2 / 1e12) and r["mfu"] == pytest.approx(flops / 0.2 / peak)
    assert r["plan"]["tokens_per_s"] == pytest.approx(256 / p.step_time_s)
    assert r["plan"]["memory_bytes"] == max(p.memory_per_rank_bytes)
    assert r["vs_plan"]["tokens_per_s"] == pytest.approx(r["tokens_per_s"] / r["plan"]["tokens_per_s"])
    assert r["vs_plan"]["step_time_s"] == pytest.approx(0.2 / p.step_time_s)
    assert r["memory_kind"] == "process_max_rss" and r["memory_bytes"] > 0
    assert r["data_wait_s"] == pytest.approx(0.01)
    assert reports[2]["step_time_s"] == pytest.approx(0.5)  # the last report covers one step
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and lines[0].startswith("step     1  loss 3.0000  lr 1.00e-03  grad norm 0.500  ")
    assert "data wait 5.0%" in lines[0] and "×)" in lines[0]


def test_the_line_compares_like_with_like(plan) -> None:
    """Tokens/s per rank, as the plan's header (``tokens/s per rank``) counts them; on a CPU cluster no MFU
    against the preset's guessed peak, and the host's resident set alone, no ratio to the plan's tensors."""
    import gpt

    model, inputs = gpt.build(gpt.CONFIGS["gpt-tiny"], device="meta")
    two = autopar.solve(autopar.capture(model, inputs), 2, cluster="cpu", dtype="fp32", global_batch=8)
    tokens = two.training.global_batch * two.training.seq_len
    out = io.StringIO()
    r = MetricsLogger(_pm(two), stream=out).log(0, 4.0, step_s=0.1, tokens=tokens)
    line = out.getvalue()
    assert f"{tokens / 0.1 / 2:,.0f} tok/s/rank (plan {two.predicted.tokens_per_s_per_gpu:,.0f}, " in line
    assert f"({two.predicted.tokens_per_s_per_gpu:,.0f} tokens/s per rank)" in two.summary()  # the same figure
    assert "MFU" not in line and "host rss " in line and "MiB (plan" not in line
    assert r["vs_plan"]["memory_bytes"] is None and r["mfu"] is not None  # the JSON keeps mfu
    gpu = {**r, "memory_kind": "cuda_peak_allocated", "memory_bytes": 3 * 2**20, "per": "GPU",
           "plan": {**r["plan"], "memory_bytes": 2 * 2**20}, "vs_plan": {**r["vs_plan"], "memory_bytes": 1.5}}
    line = MetricsLogger.line(gpu)
    assert "tok/s/GPU" in line and "MFU " in line and "peak 3 MiB (plan 2 MiB, 1.50×)" in line


def test_a_resumed_run_keeps_the_reports_before_its_step_and_drops_the_rest(plan, tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": k, "loss": 1.0}) + "\n" for k in range(6)) + '{"step": 6, "lo')
    m = MetricsLogger(_pm(plan, step=4), metrics_file=path, stream=io.StringIO())
    m.log(4, 2.0, step_s=0.1, tokens=256)
    m.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3, 4]
    # rank 1 writes nothing, even where the file is shared
    MetricsLogger(_pm(plan), metrics_file=path, rank=1).log(0, 1.0, step_s=0.1, tokens=256)
    assert len(path.read_text().splitlines()) == 5


def test_a_terminal_gets_a_progress_bar_instead_of_lines(plan) -> None:
    pytest.importorskip("tqdm")
    out = io.StringIO()
    m = MetricsLogger(_pm(plan), total_steps=3, progress=True, stream=out)
    for k in range(3):
        m.log(k, 1.0, step_s=0.1, tokens=256)
    m.close()
    text = out.getvalue()
    assert "3/3" in text and "tok/s" in text and "step     0  loss" not in text


def test_tensorboard_without_its_package_is_one_line(plan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as when not installed
    with pytest.raises(MetricsError) as err:
        MetricsLogger(_pm(plan), tensorboard=tmp_path / "tb")
    assert "pip install tensorboard" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(MetricsError, match="log_every must be at least 1"):
        MetricsLogger(_pm(plan), log_every=0)


def test_tensorboard_events_are_written_when_the_package_is_there(plan, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    m = MetricsLogger(_pm(plan), tensorboard=tmp_path / "tb", stream=io.StringIO())
    m.log(0, 1.0, step_s=0.1, tokens=256)
    m.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
