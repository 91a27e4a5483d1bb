"""``benchmarks/megatron_scaling.py``: the paper's FLOP count and one row planned end to end."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import megatron_scaling  # noqa: E402
from plain_gpt import MEGATRON  # noqa: E402  (megatron_scaling puts examples/ on the path)


def test_paper_flops_is_eq_3_of_the_paper():
    # 96·B·s·l·h²·(1 + s/6h + V/16lh) for the 1T row, written out by hand
    row = MEGATRON["1T"]
    b, s, l, h, v = 3072, 2048, 128, 25600, 51200
    expected = 96 * b * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))
    assert megatron_scaling.paper_flops(row) == pytest.approx(expected, rel=1e-12)


def test_published_configuration_is_pinned_with_full_recompute_and_no_zero():
    assert megatron_scaling.published_pins(MEGATRON["145B"]) == [
        "tp=8", "pp=8", "dp=24", "recompute=full", "zero=0", "loss=full"]  # the loss over whole logits, as run


def test_an_unknown_row_is_one_line_and_exit_2(capsys):
    assert megatron_scaling.main(["--rows", "2T"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown row 2T" in err


@pytest.mark.slow
def test_one_row_prints_published_predicted_and_free_side_by_side(capsys):
    assert megatron_scaling.main(["--rows", "1.7B", "--time-limit", "10"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 1.7B |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:5] == ["tp1 pp1 dp32", "32", "512", "137"]
    predicted, error = float(cells[5]), float(cells[6])
    assert error == pytest.approx(100 * (predicted / 137 - 1), abs=0.06)
    assert "rows plannable at the published configuration: 1 of 1" in out
    assert "free plan slower than the published one: never" in out
