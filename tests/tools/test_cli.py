"""The ``autopar`` command: plan, show, compare, and one clean line for every bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from console import autopar_command

import autopar
from autopar.errors import PlanError, SpecError
from autopar.plan import SCHEMA, Plan
from autopar.tools.cli import main
from autopar.tools.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "gpt.py") + ":gpt_tiny"
BASE = [TINY, "--world-size", "8", "--cluster", "cpu"]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _console(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """This interpreter's installed console script (``python -m autopar.tools.cli`` where it has none)."""
    return subprocess.run(autopar_command(*argv), cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    """A plan written by a real run of the console script (the one subprocess plan run)."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    proc = _console("plan", *BASE, "-o", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "autopar plan — gpt_tiny on 8 × cpu" in proc.stdout and proc.stderr == ""
    return path


def _assert_one_line_error(code: int, err: str, expected: int = 2, *needles: str) -> None:
    assert code == expected, err
    assert err.startswith("autopar: error: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err


# ------------------------------------------------------------------ plan / show / compare


def test_plan_prints_summary(capsys):
    code, out, err = _run(capsys, "plan", *BASE)
    assert code == 0 and err == ""
    assert out.startswith("autopar plan — gpt_tiny on 8 × cpu (cpu, bf16)")
    for needle in ("mesh          dp=", "step time", "memory/rank", "solver        OPTIMAL", "blocks."):
        assert needle in out  # the layer table (alike blocks folded into one row)


def test_plan_json_parses(capsys):
    code, out, _ = _run(capsys, "plan", *BASE, "--json", "--pin", "tp=2", "--batch-size", "16")
    assert code == 0
    data = json.loads(out)
    assert data["schema"] == SCHEMA and data["world_size"] == 8
    assert data["mesh"]["tp"] == 2 and data["training"]["global_batch"] == 16
    assert data["pins"] == ["tp=2"]


@pytest.mark.slow
def test_saved_plan_shows_and_is_bound_to_its_model(plan_file, capsys):
    code, out, err = _run(capsys, "show", str(plan_file))
    assert code == 0 and err == "" and out.startswith("autopar plan — gpt_tiny")
    plan = Plan.load(plan_file)
    assert Plan.load(plan_file, fingerprint=plan.fingerprint) == plan
    with pytest.raises(PlanError, match="another model"):
        Plan.load(plan_file, fingerprint="sha256:" + "0" * 32)


def test_show_does_not_import_torch(plan_file):
    code = ("import sys; from autopar.tools.cli import main; rc = main(['show', sys.argv[1]]); "
            "assert 'torch' not in sys.modules, 'show imported torch'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, str(plan_file)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_compare_chosen_is_no_slower_than_any_fitting_baseline(capsys):
    code, out, err = _run(capsys, "compare", *BASE, "--json")
    assert code == 0 and err == ""
    rows = json.loads(out)
    assert rows[0]["name"] == "autopar (chosen)" and rows[0]["fits"]
    names = [r["name"] for r in rows]
    assert {"DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "Megatron (tp × dp)"} <= set(names)
    chosen = rows[0]["step_time_s"]
    for row in rows[1:]:
        if row["fits"]:
            assert chosen <= row["step_time_s"] * (1 + 1e-9), row
            assert row["vs_chosen"] >= 1 - 1e-9


@pytest.mark.slow
def test_compare_table(capsys):
    code, out, _ = _run(capsys, "compare", *BASE)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[0] == "strategy" and lines[2].startswith("autopar (chosen)")
    assert any(l.startswith("DDP ") for l in lines) and "1.00×" in lines[2]


# ------------------------------------------------------------------ lazy package


def test_lazy_package_exports():
    assert callable(autopar.capture) and autopar.Plan is Plan
    assert set(autopar.__all__) <= set(dir(autopar))
    with pytest.raises(AttributeError):
        autopar.no_such_name  # noqa: B018


# ------------------------------------------------------------------ bad input: exit 2 (or 3), one line


def _cluster_dict() -> dict:
    from autopar.cost_models.presets import PRESETS

    d = PRESETS["cpu"].to_dict()
    d.pop("name")
    d["device"].pop("name")
    return d


def _write_toml(path: Path, d: dict) -> None:
    lines = [f"{k} = {json.dumps(v)}" for k, v in d.items() if not isinstance(v, dict)]
    for section, body in ((k, v) for k, v in d.items() if isinstance(v, dict)):
        lines += [f"[{section}]"] + [f"{k} = {json.dumps(v)}" for k, v in body.items()]
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("suffix", ["json", "toml"])
@pytest.mark.parametrize("defect, needle", [
    ("missing", "peak_flops_bf16"), ("negative", "intra_node.bandwidth_bytes_s")])
def test_bad_cluster_file(tmp_path, capsys, suffix, defect, needle):
    d = _cluster_dict()
    if defect == "missing":
        del d["device"]["peak_flops_bf16"]
    else:
        d["intra_node"]["bandwidth_bytes_s"] = -1.0
    path = tmp_path / f"bad.{suffix}"
    path.write_text(json.dumps(d)) if suffix == "json" else _write_toml(path, d)
    code, _, err = _run(capsys, "plan", TINY, "--world-size", "8", "--cluster", str(path))
    _assert_one_line_error(code, err, 2, needle)


@pytest.mark.slow
def test_cluster_file_plans(tmp_path, capsys):
    path = tmp_path / "mine.toml"
    _write_toml(path, _cluster_dict())
    code, out, _ = _run(capsys, "plan", TINY, "--world-size", "8", "--cluster", str(path))
    assert code == 0 and "(mine, bf16)" in out


@pytest.mark.parametrize("extra, needles", [
    (["--cluster", "nosuch"], ["unknown cluster 'nosuch'"]),
    (["--pin", "tp=3"], ["tp=3", "world size 8"]),
    (["--pin", "tp=2", "--pin", "tp=4"], ["contradict"]),
    (["--pin", "zero=3", "--pin", "blocks.*:zero=1"], ["contradict"]),
    (["--pin", "nosuch.*:zero=1"], ["names no layer"]),
    (["--pin", "dp=8", "--batch-size", "12"], ["12", "dp=8"]),
    (["--pin", "nonsense"], ["KEY=VALUE"]),
    (["--pin", "ep=2"], ["pin ep=2", "none of this model's", "layers has experts"]),
    (["--pin", "dp=2", "--pin", "cp=1", "--pin", "ep=4"],
     ["the pinned ep=4 does not divide the pinned dp × cp = 2 × 1 = 2 (ep borrows its ranks from dp × cp)"]),
    (["--pin", "zp=2"], ["unknown key 'zp'", "the mesh axes are pp, dp, dp_replicate, ep, cp, tp"]),
    (["--memory-gb", "-1"], ["positive"]),
    (["--world-size", "12"], ["not a multiple"]),
    (["--world-size", "eight"], ["invalid int value"]),
    (["--dtype", "fp8"], ["invalid choice"]),
])
@pytest.mark.slow
def test_bad_plan_options(capsys, extra, needles):
    code, out, err = _run(capsys, "plan", *BASE, *extra)
    _assert_one_line_error(code, err, 2, *needles)
    assert out == ""


def test_no_subcommand_or_unknown_option(capsys):
    _assert_one_line_error(*_run(capsys)[::2])
    _assert_one_line_error(*_run(capsys, "plan", *BASE, "--frobnicate")[::2])


@pytest.mark.slow
def test_memory_too_small_is_infeasible(capsys):
    code, _, err = _run(capsys, "plan", *BASE, "--memory-gb", "0.0001")
    _assert_one_line_error(code, err, 3, "per rank at best", "MiB")


SPEC_FILES = {
    "raises.py": "def f(device='meta'):\n    raise RuntimeError('no weights\\nhere')\n",
    "returns_int.py": "def f(device='meta'):\n    return 42\n",
    "returns_pair.py": "def f(device='meta'):\n    return ('model', 'inputs')\n",
    "bad_import.py": "import no_such_module_for_autopar_tests\ndef f():\n    pass\n",
    "no_seq_len.py": ("import torch\ndef f(device='meta'):\n"
                      "    return torch.nn.Linear(2, 2), torch.zeros(1, 2)\n"),
    "untraceable.py": (
        "import torch, torch.nn as nn\n"
        "class Untraceable(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.lin = nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        if int(torch.nonzero(x > 0).shape[0]) % 3 == 1:\n            return self.lin(x)\n"
        "        return self.lin(x) * 2\n"
        "def f(device='cpu'):\n    return Untraceable(), (torch.randn(2, 4),)\n"),
}


@pytest.mark.parametrize("spec, extra, needles", [
    ("missing.py:f", [], ["does not exist"]),
    ("no_colon.py", [], ["FILE.py:FUNCTION"]),
    ("no_such_module_for_autopar_tests:f", [], ["cannot import module", "ModuleNotFoundError"]),
    ("bad_import.py:f", [], ["ModuleNotFoundError", "no_such_module_for_autopar_tests"]),
    ("raises.py:f", [], ["RuntimeError: no weights here"]),
    ("returns_int.py:f", [], ["returned int"]),
    ("returns_pair.py:f", [], ["returned (str, str)"]),
    ("no_seq_len.py:f", ["--seq-len", "16"], ["seq_len"]),
    ("untraceable.py:f", [], ["Untraceable", "symbolic_trace", "export"]),
])
def test_bad_spec(tmp_path, capsys, spec, extra, needles):
    for name, text in SPEC_FILES.items():
        (tmp_path / name).write_text(text)
    target = spec if spec.startswith("no_such_module") else str(tmp_path / spec)
    code, _, err = _run(capsys, "plan", target, "--world-size", "8", "--cluster", "cpu", *extra)
    _assert_one_line_error(code, err, 2, *needles)


def test_missing_function_lists_the_module_functions(capsys):
    code, _, err = _run(capsys, "plan", TINY.replace("gpt_tiny", "gpt_huge"), "--world-size", "8")
    _assert_one_line_error(code, err, 2, "no function 'gpt_huge'", "gpt2_small")


def test_load_spec_normalises_inputs(tmp_path):
    (tmp_path / "shapes.py").write_text(
        "import torch\n"
        "def tensor(device='meta'):\n    return torch.nn.Linear(2, 2), torch.zeros(1, 2, device=device)\n"
        "def listed(device='meta'):\n    return torch.nn.Linear(2, 2), [torch.zeros(1, 2, device=device)]\n"
        "def keyed(**kw):\n    return torch.nn.Linear(2, 2), {'input': torch.zeros(1, 2)}\n")
    for fn, kind in (("tensor", tuple), ("listed", tuple), ("keyed", dict)):
        model, inputs = load_spec(f"{tmp_path / 'shapes.py'}:{fn}")
        assert isinstance(inputs, kind)
    model, inputs = load_spec(TINY, seq_len=16)
    assert inputs[0].shape == (1, 16) and inputs[0].is_meta
    with pytest.raises(SpecError, match="returned"):
        load_spec("autopar.errors:AutoparError")


def test_load_spec_by_module_name(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    model, inputs = load_spec("gpt:gpt_tiny", device="meta")
    assert type(model).__name__ == "GPT" and inputs[0].is_meta


@pytest.mark.parametrize("doctor, needle", [
    (lambda text: text[: len(text) // 2], "not valid JSON"),
    (lambda text: text.replace(SCHEMA, "autopar.plan/0"), "schema"),
    (lambda text: json.dumps({**json.loads(text), "mesh": {"pp": 1, "dp": 3, "tp": 1}}), "world size"),
    (lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "layers"}), "layers"),
])
def test_show_rejects_doctored_plans(plan_file, tmp_path, capsys, doctor, needle):
    bad = tmp_path / "bad.json"
    bad.write_text(doctor(plan_file.read_text()))
    code, out, err = _run(capsys, "show", str(bad))
    _assert_one_line_error(code, err, 2, needle)


def test_show_missing_file(tmp_path, capsys):
    code, _, err = _run(capsys, "show", str(tmp_path / "nope.json"))
    _assert_one_line_error(code, err, 2, "does not exist")


def test_unwritable_output_is_bad_input(tmp_path, capsys):
    code, _, err = _run(capsys, "plan", *BASE, "-o", str(tmp_path / "no" / "dir" / "plan.json"))
    _assert_one_line_error(code, err, 2, "plan.json")


@pytest.mark.slow
def test_console_script_bad_input(plan_file):
    proc = _console("plan", TINY, "--world-size", "8", "--cluster", "nosuch")
    _assert_one_line_error(proc.returncode, proc.stderr, 2, "unknown cluster")
    proc = _console("show", str(plan_file))
    assert proc.returncode == 0 and proc.stdout.startswith("autopar plan — gpt_tiny")


# ------------------------------------------------------------------ compare: units, collapsed baselines, reasons

SMALL = [TINY, "--world-size", "2", "--cluster", "cpu", "--batch-size", "8"]


@pytest.mark.slow
def test_compare_on_a_small_model_keeps_significant_digits_in_units_that_fit(capsys):
    code, out, err = _run(capsys, "compare", *SMALL)
    assert code == 0 and err == ""
    header, _, *rows = out.splitlines()
    assert "FLOP/s per rank" in header and "GPU" not in header  # the cpu cluster has no GPUs
    for line in rows[:7]:
        assert " 0.0 " not in line and " 0.00 " not in line, line
        assert "FLOP/s" in line and ("MiB" in line or "KiB" in line or "GiB" in line), line
    code, out, _ = _run(capsys, "compare", *SMALL, "--json")
    json_rows = json.loads(out)
    for row in json_rows:  # the JSON keeps its keys and its raw numbers
        assert {"name", "fits", "mesh", "microbatches", "step_time_s", "tflops_per_gpu",
                "peak_memory_bytes", "vs_chosen", "same_as", "note"} <= set(row)


@pytest.mark.slow
def test_compare_says_when_a_baseline_collapses_into_another_row(capsys):
    code, out, _ = _run(capsys, "compare", *SMALL, "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    megatron = rows["Megatron (tp × dp)"]
    assert megatron["mesh"]["tp"] == 1  # gpt_tiny on 2 ranks: tensor parallelism does not pay
    assert megatron["same_as"] == "DDP" and megatron["note"].startswith("same plan as DDP (tp=1: ")
    for row in rows.values():
        if row["name"].startswith("Megatron") and row["fits"] and row["mesh"]["tp"] == 1:
            assert "tp=1: " in row["note"], row
        if row["fits"] and row["same_as"]:  # same_as names an earlier row with the same mesh
            assert rows[row["same_as"]]["mesh"] == row["mesh"], row
    assert rows["DDP"]["same_as"] is None and rows["DDP"]["note"] == ""
    _, table, _ = _run(capsys, "compare", *SMALL)
    line = next(l for l in table.splitlines() if l.startswith("Megatron (tp × dp)"))
    assert line.endswith("does not fit or cannot run)") and "same plan as DDP" in line


@pytest.mark.slow
def test_compare_prints_reasons_in_full_below_the_table_naming_the_baselines_pins(capsys):
    code, out, err = _run(capsys, "compare", TINY, "--world-size", "4", "--cluster", "cpu",
                          "--batch-size", "6")
    assert code == 0 and err == ""
    assert "…" not in out and "given pins" not in out
    lines = out.splitlines()
    ddp = next(l for l in lines if l.startswith("DDP "))
    assert " no [1] " in ddp
    notes = [l for l in lines if l.startswith("[")]
    assert notes[0] == ("[1] DDP: with this baseline's pins (pp=1, cp=1, tp=1, zero=0): the pinned pp=1 × cp=1 × "
                        "tp=1 leave dp=4 for world size 4, which does not divide batch size 6; use a batch size "
                        "divisible by 4")
    assert [n.split(":")[0] for n in notes] == ["[1] DDP", "[2] ZeRO-1", "[3] ZeRO-2", "[4] ZeRO-3"]
    code, out, _ = _run(capsys, "compare", TINY, "--world-size", "4", "--cluster", "cpu",
                        "--batch-size", "6", "--json")
    ddp = next(r for r in json.loads(out) if r["name"] == "DDP")
    assert not ddp["fits"] and ddp["reason"] == notes[0][len("[1] DDP: "):]


@pytest.mark.slow
def test_compare_on_a_gpu_cluster_says_per_gpu_and_tflops(capsys):
    code, out, _ = _run(capsys, "compare", TINY, "--world-size", "8", "--cluster", "a100-80g",
                        "--batch-size", "64")
    assert code == 0
    assert "FLOP/s per GPU" in out.splitlines()[0]


def test_infeasible_compare_numbers_every_row_and_exits_3(capsys):
    code, out, err = _run(capsys, "compare", *SMALL, "--memory-gb", "0.001")
    _assert_one_line_error(code, err, 3, "no plan fits in memory")
    rows = [l for l in out.splitlines()[2:] if l and not l.startswith("[")]
    notes = [l for l in out.splitlines() if l.startswith("[")]
    assert len(rows) == len(notes) == 7
    assert all(f"[{k}]" in row for k, row in enumerate(rows, 1))
    assert notes[0].startswith("[1] autopar (chosen): no plan fits in memory")  # the user's own pins: none


def test_mesh_pin_messages_name_the_pins_or_claim_none():
    from autopar.pins import Pins
    from autopar.planning.configs import why_no_config
    from autopar.planning.configuration import TrainingSpec

    graph = autopar.capture(*load_spec(TINY, device="meta"))
    plain = why_no_config(graph, 7, TrainingSpec(5), Pins(), 3)
    assert "pin" not in plain and "no mesh pp × dp × cp × tp = 7 divides batch size 5" in plain
    one = why_no_config(graph, 8, TrainingSpec(5), Pins.parse(["pp=2"]), 3)
    assert "with the pinned pp=2" in one
    both = why_no_config(graph, 8, TrainingSpec(5), Pins.parse(["pp=2", "tp=2"]), 3)
    assert "with the pinned pp=2 × tp=2 divides batch size 5" in both  # cp may take what dp does not
    every = why_no_config(graph, 8, TrainingSpec(5), Pins.parse(["pp=2", "tp=2", "cp=1"]), 3)
    assert "the pinned pp=2 × cp=1 × tp=2 leave dp=2" in every


def test_flop_rates_keep_three_significant_figures_and_devices_are_named():
    from autopar.cost_models.presets import PRESETS
    from autopar.units import device_noun, format_flop_rate

    assert format_flop_rate(189.23e12) == "189 TFLOP/s"
    assert format_flop_rate(5.9416e9) == "5.94 GFLOP/s"
    assert format_flop_rate(812.4e6) == "812 MFLOP/s"
    assert format_flop_rate(999.7e9) == "1 TFLOP/s"  # rounded before the unit is chosen
    assert format_flop_rate(0.0) == "0 FLOP/s"
    assert device_noun(PRESETS["cpu"]) == "rank" and device_noun(PRESETS["cpu"].to_dict()) == "rank"
    assert all(device_noun(c) == "GPU" for name, c in PRESETS.items() if name != "cpu")
    assert device_noun("cpu (host)") == "rank" and device_noun("NVIDIA H200") == "GPU"


def test_each_help_names_the_cluster_and_precision_it_defaults_to(capsys):
    """plan, compare and explain price on a100-80g without --cluster, verify on cpu (in fp32): each --help
    says which, and the CLI's word for the planner's default is the planner's."""
    from autopar.planning.api import DEFAULT_CLUSTER
    from autopar.tools.cli_args import PLAN_CLUSTER

    assert PLAN_CLUSTER == DEFAULT_CLUSTER
    for verb, cluster, dtype in (("plan", "a100-80g", "bf16"), ("compare", "a100-80g", "bf16"),
                                 ("explain", "a100-80g", "bf16"), ("verify", "cpu", "fp32")):
        code, out, _ = _run(capsys, verb, "--help")
        text = " ".join(out.split())
        assert code == 0 and f"(default: {cluster}," in text and f"(default: {dtype}" in text, (verb, text)
