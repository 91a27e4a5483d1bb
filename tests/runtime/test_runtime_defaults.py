"""What ``autopar.compile`` prices on when no cluster is given, and how a ParallelModel prints.

Without ``cluster=``, compile prices on the machine it runs on: a CUDA
device's preset (matched by name and memory), ``cpu`` without a GPU, and a
warning naming a GPU no preset matches. The GPU cases patch ``torch.cuda``,
so they run on this GPU-less machine.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import autopar
from autopar.cost_models.presets import PRESETS, preset_for_device
from autopar.errors import LaunchError
from autopar.runtime.launch import UnknownDeviceWarning, local_cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402

GiB = 2**30


@pytest.fixture(autouse=True)
def _no_launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)


def _tiny():
    return gpt.gpt(n_layer=2, d_model=32, n_head=4, vocab_size=256, seq_len=16, device="meta")


@pytest.fixture(scope="module")
def graph():
    model, inputs = _tiny()
    return autopar.capture(model, inputs)


def _no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, name: str, memory_gib: float) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index=None: SimpleNamespace(total_memory=int(memory_gib * GiB)))


# ------------------------------------------------------------------ device name → preset


@pytest.mark.parametrize("name, memory_gib, preset", [
    ("NVIDIA A100-SXM4-80GB", 79.1, "a100-80g"),
    ("NVIDIA A100-SXM4-40GB", 39.4, "a100-40g"),
    ("NVIDIA A100 80GB PCIe", 79.1, "a100-80g"),
    ("NVIDIA A100-PCIE-40GB", None, "a100-40g"),     # memory read from the name
    ("NVIDIA H100 80GB HBM3", 79.1, "h100-80g"),
    ("NVIDIA H100 NVL", 93.1, "h100-96g"),
    ("NVIDIA H200", 139.8, "h200"),
    ("NVIDIA H200", None, "h200"),                    # one H200 preset: no memory needed
    ("Tesla V100-SXM2-16GB", 15.8, "v100-16g"),
])
def test_a_cuda_device_name_maps_to_its_preset(name: str, memory_gib: float | None, preset: str) -> None:
    memory = None if memory_gib is None else int(memory_gib * GiB)
    assert preset_for_device(name, memory) == preset


@pytest.mark.parametrize("name, memory_gib", [
    ("Tesla V100-SXM2-32GB", 31.7),                   # a V100, but not the 16 GB preset
    ("NVIDIA GH200 480GB", 94.5),                     # not an H200
    ("NVIDIA A100-SXM4-80GB MIG 3g.40gb", 39.0),      # a slice of a GPU
    ("NVIDIA H100 PCIe", None),                       # 80 or 96 GB: unknown without memory
    ("NVIDIA L4", 22.0),
    ("NVIDIA GeForce RTX 4090", 24.0),
    ("NVIDIA A800-SXM4-80GB", 79.1),
])
def test_a_device_no_preset_describes_maps_to_none(name: str, memory_gib: float | None) -> None:
    assert preset_for_device(name, None if memory_gib is None else int(memory_gib * GiB)) is None


def test_every_gpu_preset_is_found_from_its_own_device() -> None:
    for preset, spec in PRESETS.items():
        if spec.backend == "nccl":
            assert preset_for_device("NVIDIA " + spec.device.name, spec.device.memory_bytes) == preset


def test_the_local_cluster_is_the_gpus_preset_or_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_gpu(monkeypatch)
    assert local_cluster() == "cpu"
    _fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", 79.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert local_cluster() == "h100-80g"


# ------------------------------------------------------------------ compile's default cluster


def test_compile_without_a_cluster_prices_on_this_gpu_less_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_gpu(monkeypatch)
    model, inputs = _tiny()
    pm = autopar.compile(model, world_size=2, example_inputs=inputs, pins=["dp=2"], global_batch=4)
    assert pm.plan.cluster.name == "cpu" and not pm.launched
    assert "(cpu, " in pm.plan.summary().splitlines()[0]
    with pytest.raises(LaunchError, match="torchrun --nproc-per-node 2"):
        pm.train_step(torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long))


def test_compile_prices_on_the_gpu_it_finds(monkeypatch: pytest.MonkeyPatch, graph) -> None:
    _fake_gpu(monkeypatch, "NVIDIA A100-SXM4-40GB", 39.4)
    pm = autopar.compile(_tiny()[0], world_size=2, graph=graph, global_batch=4)
    assert pm.plan.cluster.name == "a100-40g"


def test_an_unknown_gpu_warns_at_the_compile_call_and_prices_on_the_default(
        monkeypatch: pytest.MonkeyPatch, graph) -> None:
    _fake_gpu(monkeypatch, "NVIDIA L4", 22.0)
    with pytest.warns(UnknownDeviceWarning, match=r"NVIDIA L4.*a100-80g.*cluster=") as record:
        pm = autopar.compile(_tiny()[0], world_size=2, graph=graph, global_batch=4)
    assert pm.plan.cluster.name == "a100-80g"
    assert len(record) == 1 and record[0].filename == __file__   # points at the caller's line
    assert "\n" not in str(record[0].message)


def test_a_cluster_given_to_compile_is_the_one_priced(monkeypatch: pytest.MonkeyPatch, graph) -> None:
    _fake_gpu(monkeypatch, "NVIDIA L4", 22.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # nothing is detected, so nothing warns
        pm = autopar.compile(_tiny()[0], world_size=2, graph=graph, cluster="h200", global_batch=4)
    assert pm.plan.cluster.name == "h200"


def test_solve_keeps_its_own_default_cluster(monkeypatch: pytest.MonkeyPatch, graph) -> None:
    _no_gpu(monkeypatch)
    assert autopar.solve(graph, 2, time_limit_s=5).cluster.name == "a100-80g"


# ------------------------------------------------------------------ repr


def test_a_parallel_model_prints_as_one_short_line(monkeypatch: pytest.MonkeyPatch, graph) -> None:
    _no_gpu(monkeypatch)
    pm = autopar.compile(_tiny()[0], world_size=2, graph=graph, pins=["dp=2"], global_batch=4)
    text = repr(pm)
    assert text == f"ParallelModel({pm.plan.model}, 2 ranks, dp=2, cpu, launched=False)"  # degree-1 axes unsaid
    assert "\n" not in text and len(text) < 120

    local = autopar.compile(gpt.gpt(n_layer=2, d_model=32, n_head=4, vocab_size=256, seq_len=16)[0],
                            world_size=1, graph=graph, global_batch=4)
    assert repr(local).startswith("ParallelModel(") and "1 rank, cpu" in repr(local)
    assert "\n" not in repr(local) and "Linear" not in repr(local)
