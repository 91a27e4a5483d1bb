"""Issue 10, parts 4 and 6: plain specs plan on the meta device, and ``autopar verify`` tells the truth.

The end-to-end runs use small Hugging Face OPT and BERT built from configs
(``tests/verify_specs.py``), whose dropout and zero-gradient attention key
bias made ``verify`` report DIFFERENT even for plain dp = 2.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from autopar.errors import SpecError
from autopar.tools import verify as v
from autopar.tools.cli import main
from autopar.tools.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "tests" / "verify_specs.py"
GPT = ROOT / "examples" / "gpt.py"


def _write(tmp_path: Path, body: str) -> str:
    path = tmp_path / "spec.py"
    path.write_text("import torch\nimport torch.nn as nn\n\n" + body)
    return str(path)


# ------------------------------------------------------------------ part 4: plain specs


def test_a_plain_spec_is_built_on_meta_to_plan_and_for_real_to_verify() -> None:
    model, (idx,) = load_spec(f"{GPT}:gpt_tiny_plain")
    assert all(p.is_meta for p in model.parameters()) and idx.is_meta  # the inputs too
    model, (idx,) = load_spec(f"{GPT}:gpt_tiny_plain", device="cpu")
    assert not any(p.is_meta for p in model.parameters()) and idx.device.type == "cpu"
    assert idx.shape == (8, 32) and idx.max() > 0  # real random token ids


def test_plain_gpt3_175b_allocates_nothing() -> None:
    model, (idx,) = load_spec(f"{GPT}:gpt3_175b_plain")
    assert sum(p.numel() for p in model.parameters()) > 174e9
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers(), idx))


def test_real_inputs_of_a_plain_spec_become_meta_beside_a_meta_model(tmp_path: Path) -> None:
    spec = _write(tmp_path, "IDS = torch.ones(2, 8, dtype=torch.long)  # made outside the function\n\n"
                            "def emb():\n    return nn.Embedding(10, 4), (IDS,)\n")
    _, (ids,) = load_spec(spec + ":emb")
    assert ids.is_meta and ids.shape == (2, 8) and ids.dtype == torch.long
    _, (ids,) = load_spec(spec + ":emb", device="cpu")
    assert ids.device.type == "cpu" and ids.sum() == 16


def test_a_plain_spec_that_needs_real_values_says_how_to_opt_out(tmp_path: Path) -> None:
    spec = _write(tmp_path, "def needs_values():\n    m = nn.Linear(2, 2)\n    m.weight.sum().item()\n"
                            "    return m, (torch.zeros(1, 2),)\n")
    with pytest.raises(SpecError, match=r"torch.device\('meta'\).*`device` parameter"):
        load_spec(spec + ":needs_values")
    model, _ = load_spec(spec + ":needs_values", device="cpu")
    assert not model.weight.is_meta


def test_a_spec_taking_device_is_passed_it_and_not_wrapped(tmp_path: Path) -> None:
    spec = _write(tmp_path, "def lin(device='cpu'):\n    m = nn.Linear(2, 2)  # ignores device, on purpose\n"
                            "    m.seen = str(device)\n    return m, (torch.zeros(1, 2),)\n")
    model, (x,) = load_spec(spec + ":lin")
    assert model.seen == "meta"
    assert not model.weight.is_meta and not x.is_meta  # where it builds is its choice, not autopar's


# ------------------------------------------------------------------ part 6: the comparison


def _noisy(shape: tuple[int, ...], scale: float, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def _model_like() -> dict[str, torch.Tensor]:
    """Gradients at a scale of 1e-2, and a key bias whose exact gradient is 0 (noise of 1e-11)."""
    return {"w": _noisy((64, 64), 1e-2, 0), "k.bias": _noisy((64,), 1e-11, 1)}


def test_the_floor_passes_rounding_noise_on_a_zero_gradient_and_names_it() -> None:
    ref = _model_like()
    got = {"w": ref["w"] * (1 + 1e-7), "k.bias": _noisy((64,), 1e-11, 2)}  # noise, redrawn
    assert v.compare(got, ref, floor=0.0).rel > 1  # the old per-tensor criterion: noise over noise
    c = v.compare(got, ref)
    assert c.rel < 1e-6 and c.floored == ["k.bias"]
    assert c.floor == pytest.approx(v.FLOOR * v.rms(ref))
    assert v.rms(ref) == pytest.approx(math.sqrt((ref["w"] ** 2).sum().item() / (64 * 64 + 64)))


@pytest.mark.parametrize("name,error", [("k.bias", 1e-3), ("w", 1e-4)])
def test_the_floor_still_catches_a_real_error(name: str, error: float) -> None:
    ref = _model_like()
    got = dict(ref)
    bump = error * v.rms(ref) if name == "k.bias" else error * ref["w"]
    got[name] = ref[name] + bump  # 1e-3 of the model's scale on the near-zero tensor; 1e-4 relative on w
    c = v.compare(got, ref)
    assert c.rel > v.TOLERANCE and c.worst == name


@pytest.mark.slow
def test_disable_dropout_switches_off_modules_attributes_and_hf_configs() -> None:
    import verify_specs

    torch.manual_seed(0)
    model, inputs = verify_specs.opt()
    assert v.forward_is_random(model, inputs)
    changed = v.disable_dropout(model)
    assert v.disable_dropout(model) == []  # nothing left above 0
    assert "model.decoder.layers.0.self_attn.dropout=0.1" in changed and "config.dropout=0.1" in changed
    assert model.config.attention_dropout == 0.0
    assert not v.forward_is_random(model, inputs)


def test_a_forward_still_random_is_detected() -> None:
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.drop = nn.Linear(4, 4), nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.drop(self.fc(x)) + torch.rand_like(x)  # noise no dropout switch reaches

    model = Noisy()
    assert v.disable_dropout(model) == ["drop (Dropout p=0.5)"]
    assert v.forward_is_random(model, (torch.zeros(2, 4),))


def _solve_tiny(*pins: str):
    import autopar

    model, inputs = load_spec(f"{GPT}:gpt_tiny")
    return autopar.solve(autopar.capture(model, inputs), 2, cluster="cpu", global_batch=4, dtype="fp32",
                         pins=["pp=1", "tp=2", *pins])


@pytest.mark.slow
def test_a_tp_mesh_with_no_tensor_parallel_layer_is_warned_about_and_the_layers_printed() -> None:
    plan = _solve_tiny("*:tp=none", "loss=full")
    (warning,) = v.plan_warnings(plan)
    assert "tp=2 but no layer is tensor-parallel" in warning
    text = "\n".join(v.setup_lines(plan, [], [warning]))
    assert "warning: the mesh has tp=2" in text
    assert any(line.split()[:2] == ["lm_head", "0"] for line in text.splitlines())  # the layer table
    assert v.plan_warnings(_solve_tiny("blocks.*:tp=megatron")) == []


def _raised_in_torch() -> BaseException:
    try:
        torch.zeros(3).split([1, 1])  # raises inside torch/_tensor.py
    except RuntimeError as exc:
        return exc
    raise AssertionError("split did not raise")


def test_a_failure_names_the_first_rank_that_raised_not_the_peers_it_took_down(tmp_path: Path) -> None:
    cause = v._failure(1, _raised_in_torch())
    assert "torch/_tensor.py" in cause["where"] and "test_verify.py" in cause["caller"]
    peer = v._failure(0, RuntimeError("[gloo/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"))
    assert peer["secondary"] and not cause["secondary"]
    peer["time"] = cause["time"] - 1.0  # the peer's error landed first, and still is not the cause
    for f in (cause, peer):
        (tmp_path / f"error-{f['rank']}.json").write_text(json.dumps(f))
    failure = v._first_failure(str(tmp_path), RuntimeError("unused"))
    assert failure.rank == 1 and "split_with_sizes" in str(failure) and "called from" in str(failure)


def test_a_rank_killed_without_a_traceback_is_still_named(tmp_path: Path) -> None:
    from torch.multiprocessing import ProcessExitedException

    died = ProcessExitedException("process 1 terminated with signal SIGKILL", error_index=1, error_pid=0,
                                  exit_code=-9, signal_name="SIGKILL")
    failure = v._first_failure(str(tmp_path), died)  # no error file: it never got to write one
    assert str(failure) == "rank 1 failed: process 1 terminated with signal SIGKILL (SIGKILL: killed for memory?)"


# ------------------------------------------------------------------ end to end (gloo, 2 ranks)


@pytest.mark.distributed
def test_verify_opt_with_dropout_reports_same(capsys: pytest.CaptureFixture) -> None:
    code = main(["verify", f"{SPECS}:opt", "--world-size", "2", "--pin", "dp=2", "--steps", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "OK: SAME as one process" in out and "global batch 8" in out  # the example's batch
    assert "dropout: off on both sides" in out and "model.decoder.dropout=0.1" in out
    floor = out[out.index("near-zero floor"):].split("\nOK")[0]  # wrapped to 120 columns
    assert max(len(line) for line in out.splitlines()) <= 120
    assert "k_proj.bias" in floor  # the zero-gradient key bias is judged against the floor
    assert "model.decoder.layers.0 … model.decoder.layers.1 (2)" in out  # the per-layer plan


@pytest.mark.distributed
def test_verify_bert_json_with_microbatches_on_the_example_batch(capsys: pytest.CaptureFixture) -> None:
    code = main(["verify", f"{SPECS}:bert", "--world-size", "2", "--pin", "dp=2",
                 "--pin", "microbatches=4", "--steps", "2", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0, result
    assert result["result"] == "SAME" and result["report"]["global_batch"] == 8
    assert result["plan"]["microbatches"] == 4 and result["plan"]["mesh"]["dp"] == 2
    assert any("attention.self.dropout" in d for d in result["dropout_disabled"])
    assert result["report"]["grads"]["floored"][0].endswith("key.bias")
    assert result["report"]["max_rel"] <= result["tolerance"]


def _crash_line() -> int:
    return next(i for i, line in enumerate(SPECS.read_text().splitlines(), 1) if "# CRASH LINE" in line)


@pytest.mark.distributed
@pytest.mark.parametrize("as_json", [False, True])
def test_a_crashing_rank_exits_1_with_its_error_and_line(as_json: bool, capsys: pytest.CaptureFixture) -> None:
    code = main(["verify", f"{SPECS}:crashes_on_rank_1", "--world-size", "2", "--pin", "dp=2",
                 "--steps", "1", *(["--json"] if as_json else [])])
    captured = capsys.readouterr()
    assert code == 1, captured.err
    where = f"verify_specs.py:{_crash_line()} in forward"
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith("autopar: error: rank 1 failed: RuntimeError: rank 1 cannot go on (at ")
    assert where in last
    if as_json:
        failure = json.loads(captured.out)["failure"]
        assert failure["rank"] == 1 and where in failure["where"] and "Traceback" in failure["traceback"]
    else:
        assert "rank 1's traceback:" in captured.err


def test_bad_input_to_verify_stays_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["verify", f"{SPECS}:opt", "--world-size", "2", "--steps", "0"]) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err
    spec = _write(tmp_path, "def kw():\n    return nn.Linear(4, 4), {'x': torch.zeros(2, 4)}\n")
    assert main(["verify", spec + ":kw", "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "input 'x' matches no argument of Linear.forward(input)" in err


def test_an_output_no_default_loss_fits_asks_for_a_loss_function(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    spec = _write(tmp_path, "class Pair(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                  "        self.fc = nn.Linear(4, 4)\n    def forward(self, x):\n        return {'a': 3}\n\n"
                  "def pair():\n    return Pair(), (torch.zeros(2, 4),)\n")
    assert main(["verify", spec + ":pair", "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no default loss fits" in err and "pass a loss function" in err
    assert main(["verify", spec + ":pair", "--world-size", "2", "--loss", spec + ":nothing"]) == 2
    assert "no function 'nothing'" in capsys.readouterr().err


@pytest.mark.distributed
def test_verify_takes_keyword_inputs_and_a_classifier_and_names_its_loss(capsys: pytest.CaptureFixture) -> None:
    code = main(["verify", f"{SPECS}:t5_keywords", "--world-size", "2", "--pin", "dp=2", "--pin", "zero=3",
                 "--steps", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "loss: cross-entropy over the last dim (128) at every position" in out
    assert "OK: SAME as one process" in out
    code = main(["verify", f"{SPECS}:resnet_bn", "--world-size", "2", "--pin", "dp=2", "--steps", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "loss: cross-entropy over 10 classes (one class index per sample)" in out
    assert "OK: SAME as one process" in out
    user = f"{SPECS}:smoothed_cross_entropy"
    code = main(["verify", f"{SPECS}:resnet_bn", "--world-size", "2", "--pin", "dp=2", "--steps", "2", "--loss", user])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"loss: {user} (given with --loss)" in out and "OK: SAME as one process" in out


@pytest.mark.distributed
def test_verify_a_unet_fed_an_image_and_a_timestep_under_zero_3(capsys: pytest.CaptureFixture) -> None:
    """Issue 41 item 6: no nn.Embedding, an integer timestep of 0…999: batches from the inputs as given."""
    code = main(["verify", f"{SPECS}:unet_keywords", "--world-size", "2", "--pin", "dp=2", "--pin", "zero=3",
                 "--steps", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "loss: mean squared error (float targets shaped like the output)" in out
    assert "OK: SAME as one process" in out
