"""Weights in and out as safetensors: Hugging Face checkpoints in under tensor parallelism and ZeRO-3,
exports that ``from_pretrained`` reads back, fused q/k/v rows in their original order.

The distributed cases run once a session on the shared rank pools (:mod:`training_runs`), checked
on every rank; the error cases here, in one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed import every_rank
from equivalence_cases import gpt_tiny, hf_llama
from training_cases import BATCH, PLANS

import autopar
from autopar.errors import WeightsError


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["weights_hf_tp", "weights_hf_zero3", "weights_gpt_tp"])
def test_weights_in_equal_loading_on_one_process(training, name: str) -> None:
    assert [m["rel"] for m in every_rank(training.case(name))] == [0.0, 0.0]


@pytest.mark.distributed
def test_each_rank_holds_only_its_shards_of_loaded_weights(training) -> None:
    model, _ = hf_llama()
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    assert all(m["local_bytes"] <= 0.55 * full for m in every_rank(training.case("weights_hf_zero3")))
    # norms and the head replicated
    assert all(m["local_bytes"] <= 0.75 * full for m in every_rank(training.case("weights_hf_tp")))


@pytest.mark.distributed
def test_an_hf_export_loads_back_with_from_pretrained(training) -> None:
    for m in every_rank(training.case("export_hf")):
        assert m["rel"] == 0.0
        assert m["files"] == ["config.json", "model.safetensors"]


@pytest.mark.distributed
def test_a_tensor_parallel_export_is_in_the_original_row_order(training) -> None:
    for m in every_rank(training.case("export_gpt_tp")):
        assert m["rel"] == 0.0 and m["ref_rel"] < 1e-5


@pytest.fixture(autouse=True)
def _no_launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)


def _one_process(device: str = "cpu", **kwargs):
    import gpt

    torch.manual_seed(1)
    model, inputs = gpt.gpt(n_layer=2, d_model=32, n_head=4, vocab_size=256, seq_len=16, device=device)
    graph = autopar.capture(model, inputs)
    plan = autopar.solve(graph, 1, cluster="cpu", dtype="fp32", pins=list(PLANS["w1"]), global_batch=BATCH)
    return autopar.compile(model, world_size=1, example_inputs=inputs, plan=plan, graph=graph, **kwargs)


def _gpt_weights(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    from safetensors.torch import save_file

    torch.manual_seed(3)
    model, _ = gpt_tiny()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tmp_path / "w.safetensors"))
    return tmp_path / "w.safetensors", state


def test_a_meta_model_starts_from_the_weights(tmp_path: Path) -> None:
    path, state = _gpt_weights(tmp_path)
    pm = _one_process("meta", weights=path)
    full = pm.state_dict(full=True)
    assert all(torch.equal(full[k], v) for k, v in state.items())


@pytest.mark.slow
def test_an_export_round_trips_into_another_model(tmp_path: Path) -> None:
    path, state = _gpt_weights(tmp_path)
    _one_process(weights=path).export(tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").is_file()
    pm = _one_process()
    pm.load_weights(tmp_path / "out")
    assert all(torch.equal(pm.state_dict(full=True)[k], v) for k, v in state.items())


@pytest.mark.slow
def test_sharded_exports_have_an_index(tmp_path: Path) -> None:
    from autopar.runtime.weights import export

    path, state = _gpt_weights(tmp_path)
    pm = _one_process(weights=path)
    export(pm, tmp_path / "sharded", max_shard_bytes=64 * 1024)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"]) == set(state)
    other = _one_process()
    other.load_weights(tmp_path / "sharded")
    assert all(torch.equal(other.state_dict(full=True)[k], v) for k, v in state.items())


def test_weights_that_do_not_fit_are_refused_and_nothing_loads(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path, state = _gpt_weights(tmp_path)
    pm = _one_process()
    before = {k: v.clone() for k, v in pm.state_dict(full=True).items()}
    short = dict(state)
    del short["lm_head.weight"]
    save_file(short, str(tmp_path / "short.safetensors"))
    with pytest.raises(WeightsError, match="lm_head.weight is missing.*Nothing was loaded"):
        pm.load_weights(tmp_path / "short.safetensors")
    wrong = dict(state, **{"ln_f.weight": torch.zeros(7)})
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(WeightsError, match=r"ln_f.weight has shape \(7,\) in the file, \(32,\) in the model"):
        pm.load_weights(tmp_path / "wrong.safetensors")
    assert all(torch.equal(pm.state_dict(full=True)[k], v) for k, v in before.items())
    (tmp_path / "pickled").mkdir()
    torch.save(state, tmp_path / "pickled" / "pytorch_model.bin")
    with pytest.raises(WeightsError, match="pickle, which autopar never loads"):
        pm.load_weights(tmp_path / "pickled")
