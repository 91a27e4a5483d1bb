"""Plans are data: JSON round trips, readable summaries, and clear errors for bad files."""

from __future__ import annotations

import json

import pytest
from synthetic import transformer_graph

import autopar
from autopar.errors import PlanError
from autopar.plan import BREAKDOWN_TERMS, SCHEMA, Plan


@pytest.fixture(scope="module")
def graph():
    return transformer_graph(8, 2048, 1024, vocab=32768, heads=16)


@pytest.fixture(scope="module")
def plan(graph):
    return autopar.solve(graph, 16, cluster="a100-40g", global_batch=64, pins=["pp=2"])


def test_json_round_trip_is_exact(plan, tmp_path):
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path, fingerprint=plan.fingerprint)
    assert again == plan
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA and list(data)[0] == "schema"
    assert set(data["mesh"]) == {"pp", "dp", "dp_replicate", "ep", "cp", "tp"}
    assert {"name", "stage", "tp", "zero", "recompute", "sp"} == set(data["layers"][0])
    assert set(data["predicted"]["breakdown"]) == {
        "compute_s", "bubble_s", "tp_comm_s", "ep_comm_s", "cp_comm_s", "dp_comm_s", "pp_comm_s", "optimizer_s"}
    assert data["solver"]["status"] in ("OPTIMAL", "FEASIBLE") and data["solver"]["wall_s"] >= 0
    assert data["pins"] == ["pp=2"]


def test_a_plan_written_before_the_ep_and_cp_lines_loads_with_neither(plan):
    data = json.loads(plan.to_json())
    for breakdown in [data["predicted"]["breakdown"]] + [r["breakdown"] for r in data["runners_up"]]:
        del breakdown["ep_comm_s"], breakdown["cp_comm_s"]
    again = Plan.from_json(json.dumps(data))
    assert again.predicted.breakdown == plan.predicted.breakdown
    assert again.predicted.breakdown.ep_comm_s == again.predicted.breakdown.cp_comm_s == 0.0


def test_prediction_adds_up(plan):
    b = plan.predicted.breakdown
    parts = sum(getattr(b, key) for key, _, _ in BREAKDOWN_TERMS)
    assert parts == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    assert len(plan.predicted.memory_per_rank_bytes) == plan.mesh.pp
    assert plan.training.global_batch == plan.mesh.dp * plan.microbatches * plan.microbatch_size


def test_summary_folds_runs_of_identical_layers(plan):
    text = plan.summary()
    shown = " × ".join(f"{axis}={degree}" for axis, degree in plan.mesh.items() if degree > 1)
    assert f"mesh          {shown}\n" in text and plan.mesh.tp == 1 and "tp=1" not in text  # degree 1: not printed
    assert "TFLOP/s per GPU" in text and "memory/rank" in text and "rank 1:" in text
    assert "…" in text  # blocks with the same choices share a row
    shown = [line for line in text.splitlines() if not line.startswith("      ")]  # wrapped lines' continuations aside
    assert len(shown) < 10 + len(plan.layers)


def test_plan_for_another_model_is_refused(plan, tmp_path):
    path = tmp_path / "plan.json"
    plan.save(path)
    other = transformer_graph(6, 2048, 1024, vocab=32768, heads=16)
    with pytest.raises(PlanError, match="another model"):
        Plan.load(path, fingerprint=other.fingerprint())


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.update(schema="autopar.plan/0"), "schema"),
    (lambda d: d.pop("mesh"), "missing field 'mesh'"),
    (lambda d: d["mesh"].update(pp="2"), "wrong type"),
    (lambda d: d.update(world_size=7), "does not multiply"),
    (lambda d: d["layers"][0].update(stage=99), "stages"),
    (lambda d: d["layers"][0].update(zero=7), "zero"),
    (lambda d: d["predicted"]["breakdown"].update(extra=1), "malformed"),
])
def test_bad_plan_files_get_a_clear_error(plan, tmp_path, mutate, message):
    data = plan.to_dict()
    mutate(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=message):
        Plan.load(path)


def test_corrupt_and_missing_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "autopar.plan/1", ')
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(bad)
    binary = tmp_path / "plan.pt"
    binary.write_bytes(b"\x80\x04\x95pickle")
    with pytest.raises(PlanError):
        Plan.load(binary)
    with pytest.raises(PlanError, match="does not exist"):
        Plan.load(tmp_path / "nope.json")


@pytest.fixture(scope="module")
def interleaved(graph):
    return autopar.solve(graph, 16, cluster="a100-40g", global_batch=64,
                         pins=["pp=2", "schedule=interleaved_1f1b", "chunks=2"])


def _table_rows(text: str) -> tuple[list[str], list[list[str]]]:
    lines = text.split("\n\n")[1].splitlines()
    return lines[0].split(), [line.split() for line in lines[2:]]


@pytest.mark.slow
def test_interleaved_summary_gives_each_row_its_rank_and_chunk(interleaved):
    assert interleaved.chunks == 2
    header, rows = _table_rows(interleaved.summary())
    assert header == ["layer", "stage", "rank", "chunk", "tp", "zero", "recompute"]
    seen = set()
    for row in rows:
        stage, rank, chunk = (int(x) for x in row[-6:-3])
        assert (rank, chunk) == (stage % interleaved.mesh.pp, stage // interleaved.mesh.pp)
        seen.add(stage)
    assert seen == set(range(interleaved.stages))  # folded runs never cross a stage boundary
    memory = next(line for line in interleaved.summary().splitlines() if line.startswith("memory/rank"))
    assert "rank 0:" in memory and "rank 1:" in memory and "per pipeline rank" in memory
    assert "s0:" not in memory


def test_plain_summary_keeps_its_columns(graph):
    plain = autopar.solve(graph, 16, cluster="a100-40g", global_batch=64, pins=["pp=2", "schedule=1f1b"])
    header, _ = _table_rows(plain.summary())
    assert header == ["layer", "stage", "tp", "zero", "recompute"]


def test_a_summary_fits_in_120_columns_at_sixteen_pipeline_ranks(plan):
    """Every rank's memory on one line reached 464 columns at pp=16: past what fits, the range and the rank
    holding the most; the budget, the breakdown and the notes wrap under their column."""
    from dataclasses import replace

    memory = tuple(70 * 2**30 + 2**27 * ((5 * j) % 16) for j in range(16))
    long_note = "a note of many words " * 12
    sixteen = replace(plan, predicted=replace(plan.predicted, memory_per_rank_bytes=memory, ranks=()),
                      notes=(long_note.strip(),))
    text = sixteen.summary()
    assert max(len(line) for line in text.splitlines()) <= 120, text
    most = max(range(16), key=lambda j: memory[j])
    assert f"memory/rank   70.00–71.88 GiB over 16 pipeline ranks, most on rank {most}  (budget " in text
    assert " ".join(f"note: {long_note}".split()) in " ".join(text.split())  # wrapped, not cut
    two = plan.summary()
    assert "memory/rank   rank 0: " in two and "rank 1: " in two  # a few ranks are still listed
