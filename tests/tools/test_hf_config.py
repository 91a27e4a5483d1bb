"""A Hugging Face ``config.json`` or model directory as the CLI's SPEC: planned on meta, verified
with its safetensors weights, nothing downloaded, bad input one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from autopar.errors import SpecError
from autopar.tools.cli import main
from autopar.tools.spec import load_spec

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


def _save_config(directory: Path, config_name: str = "LlamaConfig", arch: str = "LlamaForCausalLM") -> Path:
    config = getattr(transformers, config_name)(**SMALL)
    config.architectures = [arch]
    config.save_pretrained(directory)
    return directory


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert err.startswith("autopar: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize(("config_name", "arch"), [("LlamaConfig", "LlamaForCausalLM"),
                                                   ("Qwen2Config", "Qwen2ForCausalLM")])
@pytest.mark.slow
def test_plan_from_a_config_json_and_from_its_directory(tmp_path: Path, capsys, config_name: str,
                                                        arch: str) -> None:
    directory = _save_config(tmp_path / "tiny-model", config_name, arch)
    code, out, err = _run(capsys, "plan", str(directory / "config.json"), "--world-size", "4", "--cluster", "cpu",
                          "--seq-len", "16", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["model"] == "tiny-model"
    assert err.startswith("note: ") and "batch 2" in err and "sequence length" not in err  # --seq-len was given
    names = [layer["name"] for layer in plan["layers"]]
    assert [f"model.layers.{i}" in names for i in range(3)] == [True] * 3 and "lm_head" in names
    code, out, err = _run(capsys, "plan", str(directory), "--world-size", "4", "--cluster", "cpu",
                          "--batch-size", "8", "--seq-len", "16")
    assert code == 0 and err == "", err  # batch and sequence given: no note
    assert out.startswith("autopar plan — tiny-model on 4 × cpu")


@pytest.mark.slow
def test_explain_and_compare_take_a_config(tmp_path: Path, capsys) -> None:
    directory = _save_config(tmp_path / "m")
    code, out, err = _run(capsys, "explain", str(directory / "config.json"), "--world-size", "2", "--cluster",
                          "cpu", "--seq-len", "16", "--batch-size", "2")
    assert code == 0, err
    assert out.startswith("autopar explain — m on 2 × cpu")
    code, out, err = _run(capsys, "compare", str(directory), "--world-size", "2", "--cluster", "cpu",
                          "--seq-len", "16", "--batch-size", "2")
    assert code == 0, err
    assert "DDP" in out


def test_the_config_builds_on_meta_and_the_directory_s_safetensors_are_its_weights(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(**SMALL)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(1)  # not the seed the random builds below use, whatever ran before in this process
    saved = transformers.LlamaForCausalLM(config)
    saved.save_pretrained(tmp_path / "w")
    assert list((tmp_path / "w").glob("*.safetensors")) and not list((tmp_path / "w").glob("*.bin"))
    meta, (ids,) = load_spec(str(tmp_path / "w"), seq_len=8)
    assert all(p.is_meta for p in meta.parameters()) and ids.is_meta and tuple(ids.shape) == (2, 8)
    assert meta.config.use_cache is False
    real, _ = load_spec(str(tmp_path / "w"), seq_len=8, device="cpu")
    for name, p in saved.state_dict().items():
        assert torch.equal(real.state_dict()[name], p), name
    torch.manual_seed(0)
    random_a, _ = load_spec(str(_save_config(tmp_path / "c")), device="cpu")
    torch.manual_seed(0)
    random_b, _ = load_spec(str(tmp_path / "c"), device="cpu")
    assert torch.equal(random_a.lm_head.weight, random_b.lm_head.weight)  # seeded, as verify's ranks build it
    assert not torch.equal(random_a.lm_head.weight, saved.lm_head.weight)


def test_a_pickled_checkpoint_is_never_read(tmp_path: Path) -> None:
    directory = _save_config(tmp_path / "p")
    (directory / "pytorch_model.bin").write_bytes(b"not to be unpickled")
    model, _ = load_spec(str(directory), device="cpu")  # random weights: the .bin is ignored
    assert not model.lm_head.weight.is_meta


@pytest.mark.distributed
def test_verify_runs_the_directory_s_weights(tmp_path: Path, capsys) -> None:
    config = transformers.LlamaConfig(**SMALL)
    config.architectures = ["LlamaForCausalLM"]
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "w")
    code, out, err = _run(capsys, "verify", str(tmp_path / "w"), "--world-size", "2", "--pin", "dp=2",
                          "--seq-len", "16", "--steps", "2")
    assert code == 0, out + err
    assert "OK: SAME as one process" in out


def test_a_hub_id_is_refused_in_one_line(capsys) -> None:
    code, out, err = _run(capsys, "plan", "meta-llama/Llama-3-8B", "--world-size", "8")
    _one_line(code, err, "meta-llama/Llama-3-8B", "never downloads", "config.json")
    assert out == ""


def test_an_unknown_architecture_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    directory = _save_config(tmp_path / "u", arch="LlamaForTimeTravel")
    code, _, err = _run(capsys, "plan", str(directory), "--world-size", "2")
    _one_line(code, err, "LlamaForTimeTravel", "no model class")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps({"model_type": "no-such-model-type"}))
    code, _, err = _run(capsys, "plan", str(tmp_path / "t"), "--world-size", "2")
    _one_line(code, err, "cannot read")


def test_missing_files_and_missing_transformers_are_one_line(tmp_path: Path, capsys,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    code, _, err = _run(capsys, "plan", str(tmp_path / "nowhere" / "config.json"), "--world-size", "2")
    _one_line(code, err, "does not exist")
    code, _, err = _run(capsys, "plan", str(tmp_path), "--world-size", "2")
    _one_line(code, err, "has no config.json")
    directory = _save_config(tmp_path / "m")
    code, _, err = _run(capsys, "show", str(directory / "config.json"))
    _one_line(code, err, "not a saved plan", "autopar plan")
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(SpecError, match="needs the transformers package"):
        load_spec(str(directory))
