"""The fidelity benchmark's own arithmetic: the figures it reports are only as right as these."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from fidelity import peak_tensor_bytes, spearman  # noqa: E402


def test_spearman_is_one_for_the_same_order_and_minus_one_for_the_reverse():
    assert spearman([1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 35.0, 50.0]) == pytest.approx(1.0)
    assert spearman([1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]) == pytest.approx(-1.0)


def test_spearman_gives_tied_values_their_average_rank():
    # ranks (0.5, 0.5, 2) against (0, 1, 2): Pearson's r of the ranks
    assert spearman([1.0, 1.0, 3.0], [1.0, 2.0, 3.0]) == pytest.approx(0.8660254, rel=1e-6)


def test_peak_counts_what_was_allocated_before_the_window_but_only_peaks_inside_it():
    events = [(0, 100, 1), (1, 50, 2), (2, -50, 2), (10, 30, 3), (11, -30, 3), (12, 20, 4)]
    assert peak_tensor_bytes(events, since_ns=10) == 130  # 100 live from before, +30 at t=10
    assert peak_tensor_bytes(events, since_ns=0) == 150
    assert peak_tensor_bytes(events, since_ns=13) == 120  # nothing happens after: what is live then


def test_peak_takes_an_address_allocated_again_as_freed_unseen_just_then():
    # address 7's free happened on a thread the profiler does not follow
    events = [(0, 100, 7), (5, 40, 8), (6, -40, 8), (10, 60, 7), (11, 10, 9)]
    assert peak_tensor_bytes(events, since_ns=0) == 140  # 100 still live when 40 more came
    assert peak_tensor_bytes(events, since_ns=11) == 70  # not 170: the first 100 were gone by t=10
