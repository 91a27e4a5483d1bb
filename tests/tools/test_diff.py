"""`autopar diff`: two plans of one model side by side, layers that differ folded into runs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from synthetic import transformer_graph

import autopar
from autopar.errors import PlanError
from autopar.tools.cli import main
from autopar.tools.diff import diff_plans, fold_label, layer_choice


@pytest.fixture(scope="module")
def graph():
    return transformer_graph(24, 1024, 512, vocab=16384, heads=16)


@pytest.fixture(scope="module")
def flat(graph):
    return autopar.solve(graph, 16, cluster="a100-40g", global_batch=64, pins=["pp=1"], runners_up=0)


@pytest.fixture(scope="module")
def piped(graph):
    return autopar.solve(graph, 16, cluster="a100-40g", global_batch=64, pins=["pp=4", "schedule=1f1b"], runners_up=0)


def _one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert err.startswith("autopar: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


def test_a_plan_against_itself_has_no_difference(flat, tmp_path):
    d = diff_plans(flat, flat)
    assert d.same and d.differences == [] and d.layers == ()
    assert d.render().endswith("no difference: the same plan with the same figures")
    path = tmp_path / "a.json"
    flat.save(path)
    again = autopar.Plan.load(path)
    assert diff_plans(flat, again).same  # through the file too


def test_differences_are_marked_and_layers_folded(flat, piped):
    d = diff_plans(flat, piped, "flat.json", "piped.json")
    assert not d.same
    rows = {r.label.strip(): r for r in d.rows}
    assert rows["mesh"].differs and rows["mesh"].b.startswith("pp=4")
    assert not rows["world size"].differs and not rows["cluster"].differs
    step = rows["step time"]
    change = (piped.predicted.step_time_s - flat.predicted.step_time_s) / flat.predicted.step_time_s
    assert step.differs and step.change == f"{change:+.1%}"
    assert rows["by pipeline rank"].b.count(" / ") == 3
    # every layer whose strategy differs is in exactly one run, and runs of blocks fold to "blocks.a–b"
    changed = [l.name for l, m in zip(flat.layers, piped.layers) if layer_choice(flat, l) != layer_choice(piped, m)]
    assert sum(c.count for c in d.layers) == len(changed)
    assert any(c.layers.startswith("blocks.") and "–" in c.layers and c.count > 1 for c in d.layers)
    text = d.render()
    assert "layers whose strategy differs" in text and " → " in text
    blocks = next(c for c in d.layers if c.layers.startswith("blocks."))
    line = next(line for line in text.splitlines() if line.startswith(f"  {blocks.layers} "))
    kept = [f for f in blocks.a.split(", ") if f in blocks.b.split(", ")]  # what stays: once, in parentheses
    assert all(line.count(f) == 1 for f in kept) and (f"({', '.join(kept)})" in line if kept else True)
    assert json.loads(json.dumps(d.to_dict()))["same"] is False


def test_a_style_means_nothing_at_tp_1(flat):
    assert flat.mesh.tp == 1
    styled = replace(flat, layers=tuple(replace(l, choice=replace(l.choice, tp="megatron"))
                                        if l.name.startswith("blocks.") else l for l in flat.layers))
    assert diff_plans(flat, styled).same


def test_fold_label():
    assert fold_label([f"blocks.{i}" for i in range(24)]) == "blocks.0–23"
    assert fold_label(["blocks.3"]) == "blocks.3"
    assert fold_label(["blocks.0", "blocks.2"]) == "blocks.0 … blocks.2 (2)"
    assert fold_label(["ln_f", "lm_head"]) == "ln_f … lm_head (2)"


def test_plans_of_different_models_are_refused(flat):
    other = autopar.solve(transformer_graph(6, 1024, 512, vocab=16384, heads=16), 16, cluster="a100-40g",
                          global_batch=64, runners_up=0)
    with pytest.raises(PlanError, match="different models"):
        diff_plans(flat, other)


def test_cli_diff(capsys, tmp_path, flat, piped):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    flat.save(a)
    piped.save(b)
    assert main(["diff", str(a), str(a)]) == 0
    out, err = capsys.readouterr()
    assert "no difference" in out and err == ""
    assert main(["diff", str(a), str(b), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["same"] is False and data["layers"]
    other = tmp_path / "other.json"
    autopar.solve(transformer_graph(6, 1024, 512, vocab=16384, heads=16), 16, cluster="a100-40g",
                  global_batch=64, runners_up=0).save(other)
    _one_line_error(main(["diff", str(a), str(other)]), capsys.readouterr().err, "different models")
    schema = tmp_path / "schema.json"
    schema.write_text(Path(a).read_text().replace('"autopar.plan/1"', '"autopar.plan/2"'))
    _one_line_error(main(["diff", str(a), str(schema)]), capsys.readouterr().err, "schema")
    _one_line_error(main(["diff", str(a), str(tmp_path / "missing.json")]), capsys.readouterr().err, "does not exist")


def test_sixteen_pipeline_ranks_fit_in_120_columns(flat, piped):
    """A list of every rank's memory made a 300-column table at pp=16: past four ranks a column gives their
    range and the rank that holds the most."""
    memory = tuple(70 * 2**30 + 2**27 * ((5 * j) % 16) for j in range(16))
    sixteen = replace(piped, predicted=replace(piped.predicted, memory_per_rank_bytes=memory, ranks=()))
    d = diff_plans(flat, sixteen, "flat.json", "sixteen.json")
    rows = {r.label.strip(): r for r in d.rows}
    most = max(range(16), key=lambda j: memory[j])
    assert rows["by pipeline rank"].b == f"70.00–71.88 GiB, most on rank {most} of 16"
    assert max(len(line) for line in d.render().splitlines()) <= 120
