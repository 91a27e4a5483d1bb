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


# ------------------------------------------------------------------ compile_speed.py: what each row measures


@pytest.fixture(scope="module")
def speed_graph():
    import compile_speed
    import gpt

    import autopar

    s = compile_speed
    model, inputs = gpt.gpt(n_layer=4, d_model=s.WIDTH, n_head=s.HEADS, vocab_size=s.VOCAB, seq_len=s.SEQ,
                            device="meta")
    return autopar.capture(model, inputs)


@pytest.mark.parametrize("lowering", ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "PP 1F1B", "selective", "full", "TP",
                                      "cp all-gather", "cp Ulysses", "cp ring"])
@pytest.mark.slow
def test_each_compile_speed_row_is_the_lowering_it_names_and_compiles(speed_graph, lowering):
    """Both models of a row are that lowering (the eager and the compiled plan the same mesh, ZeRO stage,
    schedule and recompute), and the compiled one is a plan the compiled runtime runs."""
    from compile_speed import BATCH, pins_for

    import autopar
    from autopar.admission import compiled_refusals

    plans = [autopar.solve(speed_graph, 2, cluster="cpu", dtype="fp32", global_batch=BATCH,
                           pins=pins_for(lowering, 2), compiled=c) for c in (False, True)]
    eager, compiled = plans
    assert compiled.training.compiled and not eager.training.compiled
    blocks = [[(l.choice.zero, str(l.choice.recompute)) for l in p.layers if l.name.startswith("blocks.")]
              for p in plans]
    assert eager.mesh == compiled.mesh and eager.schedule == compiled.schedule and blocks[0] == blocks[1]
    assert not compiled_refusals(compiled, speed_graph)
    zeros = {z for z, _ in blocks[0]}
    recompute = {r for _, r in blocks[0]}
    want = {"DDP": (1, 2, {0}), "ZeRO-1": (1, 2, {1}), "ZeRO-2": (1, 2, {2}), "ZeRO-3": (1, 2, {3}),
            "PP 1F1B": (2, 1, {0}), "selective": (1, 2, {0}), "full": (1, 2, {0}), "TP": (1, 1, {0}),
            "cp all-gather": (1, 1, {0}), "cp Ulysses": (1, 1, {0}), "cp ring": (1, 1, {0})}[lowering]
    assert (eager.mesh.pp, eager.mesh.dp, zeros) == want, (eager.mesh, zeros)
    assert recompute == ({lowering} if lowering in ("selective", "full") else {"none"}), recompute
    assert (eager.mesh.tp, eager.mesh.cp) == ((2, 1) if lowering == "TP" else (1, 2) if lowering.startswith("cp")
                                              else (1, 1))
    if lowering.startswith("cp"):
        assert str(eager.cp_attention) == str(compiled.cp_attention) == lowering.split()[1].lower().replace("-", "")
    if lowering == "PP 1F1B":
        assert eager.schedule.value == "1f1b" and eager.microbatches == 4


def test_compile_time_is_the_first_step_less_a_later_one():
    from compile_speed import compile_time, ratio

    assert compile_time(10.0, [1.0, 3.0, 2.0]) == pytest.approx(8.0)  # the median later step: 2 s
    assert compile_time(1.0, [2.0]) == 0.0  # a first step no slower than the others compiled nothing
    assert ratio(3.0, 2.0) == "1.50" and ratio(3.0, 0.0) == "-"
