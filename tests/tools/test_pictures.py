"""Pictures of a plan: the timeline runs the schedule on the plan's own stage times, the memory bars
add up to its memory per rank, and the HTML report is one self-contained file a browser opens."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest
from synthetic import transformer_graph

import autopar
from autopar.cost_models.pipeline import ScheduleKind
from autopar.errors import PlanError
from autopar.plan import Plan, StageTime
from autopar.tools import pictures
from autopar.tools.cli import main
from autopar.tools.pictures import Action, schedule_order, timeline

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "gpt.py") + ":gpt_tiny"
PNG = b"\x89PNG\r\n\x1a\n"
CASES = {  # pins of plans that exercise each schedule, ZeRO and recompute
    "flat": ["pp=1"],
    "ddp": ["pp=1", "tp=1", "zero=0"],
    "gpipe": ["pp=4", "schedule=gpipe", "microbatches=4"],
    "1f1b": ["pp=2", "schedule=1f1b", "microbatches=8", "blocks.*:recompute=on"],
    "interleaved": ["pp=2", "schedule=interleaved_1f1b", "chunks=2", "microbatches=4", "tp=2"],
}


@pytest.fixture(scope="module")
def graph():
    return transformer_graph(8, 2048, 1024, vocab=32768, heads=16)


@pytest.fixture(scope="module")
def plans(graph) -> dict[str, Plan]:
    return {name: autopar.solve(graph, 16, cluster="a100-40g", global_batch=64, pins=pins, runners_up=0)
            for name, pins in CASES.items()}


# ------------------------------------------------------------------ the schedule's order


@pytest.mark.parametrize("kind, pp, m, v", [(ScheduleKind.GPIPE, 4, 3, 1), (ScheduleKind.ONE_F_ONE_B, 4, 6, 1),
                                            (ScheduleKind.INTERLEAVED_1F1B, 2, 4, 2),
                                            (ScheduleKind.INTERLEAVED_1F1B, 4, 8, 4)])
def test_every_rank_runs_each_of_its_actions_once_forward_first(kind, pp, m, v):
    orders = schedule_order(kind, pp, m, v)
    assert len(orders) == pp
    for rank, order in enumerate(orders):
        stages = range(rank, pp * v, pp)
        assert sorted(order, key=str) == sorted([Action(s, k, i) for s in stages for k in "FB" for i in range(m)],
                                                key=str)
        for s in stages:
            for i in range(m):
                assert order.index(Action(s, "F", i)) < order.index(Action(s, "B", i))


def test_orders_are_torchs():
    """1F1B: pp − rank warm-up forwards, then B and F in turn; GPipe: all forwards first."""
    f, b = (lambda i: Action(1, "F", i)), (lambda i: Action(1, "B", i))
    assert schedule_order(ScheduleKind.ONE_F_ONE_B, 3, 4)[1] == [f(0), f(1), b(0), f(2), b(1), f(3), b(2), b(3)]
    assert schedule_order(ScheduleKind.GPIPE, 2, 2)[1] == [f(0), f(1), b(0), b(1)]
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    interleaved = schedules.ScheduleInterleaved1F1B
    if not hasattr(interleaved, "_calculate_single_rank_operations"):
        pytest.skip("this torch computes the interleaved order elsewhere")
    for pp, m, v in ((4, 8, 2), (2, 4, 2), (2, 6, 4)):
        rounds = max(1, m // pp)  # the attributes torch's __init__ sets from a process group's stages
        fake = SimpleNamespace(n_local_stages=v, pp_group_size=pp, _n_microbatches=m, number_of_rounds=rounds,
                               microbatches_per_round=m // rounds)
        for rank in range(pp):
            ops = interleaved._calculate_single_rank_operations(fake, rank)
            theirs = [Action(op.stage_index, "F" if op.computation_type.name == "FORWARD" else "B",
                             op.microbatch_index) for op in ops if op is not None]
            assert schedule_order(ScheduleKind.INTERLEAVED_1F1B, pp, m, v)[rank] == theirs, (pp, m, v, rank)


# ------------------------------------------------------------------ the timeline reads the plan


@pytest.mark.parametrize("name", list(CASES))
def test_busy_time_is_the_plans_stage_time(plans, name):
    plan = plans[name]
    line = timeline(plan)
    pace, m = plan.predicted.pace, plan.microbatches
    for rank in range(plan.mesh.pp):
        own = [s for s in plan.predicted.stages if s.stage % plan.mesh.pp == rank]
        compute = m * pace * sum(s.forward_s + s.backward_s for s in own)
        assert line.busy_s(rank) == pytest.approx(compute, rel=1e-9)
        every = m * pace * sum(s.per_microbatch_s for s in own)
        assert line.busy_s(rank, ("forward", "backward", "tp", "send")) == pytest.approx(every, rel=1e-9)
        cost = plan.predicted.ranks[rank]
        assert line.busy_s(rank, ("dp",)) == pytest.approx(cost.dp_comm_s)
        assert line.busy_s(rank, ("optimizer",)) == pytest.approx(cost.optimizer_s)
        # nothing on a rank overlaps, and waiting fills the rest of the pipeline: the bubble drawn
        spans = sorted((s.start_s, s.end_s) for s in line.segments
                       if s.rank == rank and s.kind not in ("dp", "optimizer"))
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))
        assert sum(e - s for s, e in spans) == pytest.approx(line.pipeline_s, rel=1e-9)


@pytest.mark.parametrize("name", ["flat", "ddp", "gpipe"])
def test_the_timeline_is_as_long_as_the_predicted_step(plans, name):
    line = timeline(plans[name])
    assert line.length_s == pytest.approx(plans[name].predicted.step_time_s, rel=1e-9) and line.matches_priced


@pytest.mark.parametrize("name", ["1f1b", "interleaved"])
def test_with_equal_stages_every_schedule_takes_the_priced_step(plans, name):
    """Pricing's m·T + w·(S − T) is the schedule's own length when stages are equal; the timeline agrees."""
    plan = plans[name]
    even = tuple(StageTime(s.stage, 1e-3, 2e-3, 1e-4, 1e-4, 0.0, 0.0) for s in plan.predicted.stages)
    t, pp, m, w = 3.2e-3 * plan.chunks, plan.mesh.pp, plan.microbatches, 1 / plan.chunks
    tail = max(r.dp_comm_s + r.optimizer_s for r in plan.predicted.ranks)
    step = (m - w) * t + w * pp * t + tail
    evened = replace(plan, predicted=replace(plan.predicted, stages=even, step_time_s=step, pace=1.0))
    assert timeline(evened).length_s == pytest.approx(step, rel=1e-12)


def test_unequal_stages_mark_the_priced_step_too(plans):
    line = timeline(plans["interleaved"])
    assert not line.matches_priced  # its stages are uneven: the schedule and pricing's formula part
    fig = pictures.draw_timeline(plans["interleaved"])
    title = fig.axes[0].get_title()
    assert "as priced" in title and f"{abs(line.length_s - line.priced_s) / line.priced_s:.1%}" in title


@pytest.mark.parametrize("name", list(CASES))
def test_memory_bars_add_up_to_the_plans_memory_per_rank(plans, name):
    plan = plans[name]
    bars = pictures.memory_bars(plan)
    assert [sum(b.values()) for b in bars] == list(plan.predicted.memory_per_rank_bytes)
    assert all(v >= 0 for b in bars for v in b.values())
    fig = pictures.draw_memory(plan)
    heights = {}
    for patch in fig.axes[0].patches:
        heights[patch.get_x()] = heights.get(patch.get_x(), 0.0) + patch.get_height()
    unit = {"(GiB)": 2**30, "(MiB)": 2**20}[fig.axes[0].get_ylabel().split()[-1]]  # the scale the bars are drawn in
    assert [h * unit for _, h in sorted(heights.items())] == pytest.approx(list(plan.predicted.memory_per_rank_bytes))


def test_memory_parts_are_the_zero_formulas(plans, graph):
    """DDP at pp = tp = 1: every rank holds 2Ψ of bf16 weights, 2Ψ of gradients, 12Ψ of optimizer state
    and DDP's 2Ψ of buckets (DESIGN.md's figures), plus the 2Ψ more that the fp32 master gradient of a
    part FSDP2 does not wrap holds (runtime/precision.py), counted with the optimizer's state."""
    psi = graph.total_params
    cost = plans["ddp"].predicted.ranks[0]
    assert (cost.params_bytes, cost.grads_bytes, cost.optimizer_bytes) == (2 * psi, 2 * psi, 14 * psi)
    assert cost.buffers_bytes == 2 * psi


# ------------------------------------------------------------------ files and the report


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        for key, value in attrs:
            if key == "src" and tag == "img":
                self.images.append(value)
            elif key in ("src", "href"):
                self.links.append(value)


def _check_self_contained(page: str, images: int) -> None:
    parser = _Page()
    parser.feed(page)
    assert len(parser.images) == images and parser.links == []
    assert "http://" not in page and "https://" not in page and "<script" not in page
    for src in parser.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(PNG)


@pytest.mark.slow
def test_plan_html_is_self_contained(plans, tmp_path):
    _check_self_contained(pictures.plan_html(plans["1f1b"]), images=3)
    paths = pictures.write_pngs(plans["1f1b"], tmp_path / "pngs")
    assert [p.name for p in paths] == ["timeline.png", "memory.png", "layers.png"]
    assert all(p.read_bytes().startswith(PNG) for p in paths)


def _one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert err.startswith("autopar: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


@pytest.mark.slow
def test_cli_show_draws_and_refuses_what_it_cannot_draw(plans, tmp_path, capsys):
    path = tmp_path / "plan.json"
    plans["gpipe"].save(path)
    report, pngs = tmp_path / "report.html", tmp_path / "pngs"
    assert main(["show", str(path), "--html", str(report), "--png", str(pngs)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("autopar plan — ") and f"report written to {report}" in out
    _check_self_contained(report.read_text(), images=3)
    assert sorted(p.name for p in pngs.iterdir()) == ["layers.png", "memory.png", "timeline.png"]
    data = plans["gpipe"].to_dict()  # a plan written before stage times were recorded: it loads, but cannot be drawn
    for key in ("stages", "ranks", "pace"):
        data["predicted"].pop(key)
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    assert main(["show", str(old)]) == 0
    capsys.readouterr()
    code = main(["show", str(old), "--html", str(tmp_path / "no.html")])
    _one_line_error(code, capsys.readouterr().err, "re-plan it")
    assert not (tmp_path / "no.html").exists()
    with pytest.raises(PlanError, match="per-stage times"):
        timeline(Plan.load(old))


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["predicted"]["ranks"][0].update(params_bytes=d["predicted"]["ranks"][0]["params_bytes"] + 1),
     "does not add up"),
    (lambda d: d["predicted"]["ranks"][0].update(params_bytes=1.5), "wrong type"),
    (lambda d: d["predicted"]["stages"].pop(), "stages 0–"),
    (lambda d: d["predicted"]["stages"][0].update(extra=1), "unknown fields"),
    (lambda d: d["predicted"].update(pace="fast"), "wrong type"),
])
def test_doctored_stage_and_memory_records_are_refused(plans, tmp_path, mutate, message):
    data = plans["gpipe"].to_dict()
    mutate(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=message):
        Plan.load(path)


def test_the_readme_example_plan_draws():
    plan = Plan.load(ROOT / "examples" / "plans" / "gpt2_xl_pp4_1f1b.json")
    line = timeline(plan)
    assert line.ranks == 4 and line.length_s == pytest.approx(plan.predicted.step_time_s, rel=0.01)
    assert [sum(b.values()) for b in pictures.memory_bars(plan)] == list(plan.predicted.memory_per_rank_bytes)


@pytest.mark.slow
def test_cli_show_html_does_not_import_torch(plans, tmp_path):
    path = tmp_path / "plan.json"
    plans["flat"].save(path)
    code = ("import sys; from autopar.tools.cli import main; rc = main(['show', sys.argv[1], '--html', sys.argv[2]]); "
            "assert 'torch' not in sys.modules, 'show --html imported torch'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "r.html")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_cli_compare_html_draws_every_distinct_fitting_row(tmp_path, capsys):
    report = tmp_path / "compare.html"
    assert main(["compare", TINY, "--world-size", "2", "--cluster", "cpu", "--batch-size", "8", "--html",
                 str(report), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    drawn = [r["name"] for r in rows if r["fits"] and not r["same_as"]]
    page = report.read_text()
    assert re.findall(r"<section><h2>(.*?)</h2>", page) == [name.replace("&", "&amp;") for name in drawn]
    _check_self_contained(page, images=1 + 3 * len(drawn))


# ------------------------------------------------------------------ a real browser

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
_LOADED = ("<script>addEventListener('load', () => { document.body.setAttribute('data-loaded', "
           "[...document.images].filter(i => i.complete && i.naturalWidth > 0).length); });</script>")


def _chromium(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--enable-logging=stderr", "--v=0", *args], capture_output=True, text=True, timeout=90)


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install -y chromium; .ci/run does)")
@pytest.mark.slow
def test_the_report_opens_in_headless_chromium(plans, tmp_path):
    import matplotlib.image

    report = tmp_path / "report.html"
    pictures.write_html(report, pictures.plan_html(plans["interleaved"]))
    shot = tmp_path / "shot.png"
    proc = _chromium(f"--screenshot={shot}", "--window-size=1280,2400", report.as_uri())
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    assert not re.search(r"CONSOLE.*(Uncaught|Error)|Not allowed to load", proc.stderr), proc.stderr[-2000:]
    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.std() > 0.05  # not one flat colour
    assert (pixels.mean(axis=2) < 0.9).mean() > 0.02  # a real share of it is drawn, not blank page
    probe = tmp_path / "probe.html"  # the same page, counting the images the browser decoded
    probe.write_text(report.read_text().replace("</body>", _LOADED + "</body>"))
    proc = _chromium("--virtual-time-budget=10000", "--dump-dom", probe.as_uri())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert 'data-loaded="3"' in proc.stdout, proc.stdout[:500]
