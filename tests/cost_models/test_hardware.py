"""Clusters: presets, JSON/TOML files that round-trip, and errors that name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopar.cost_models.hardware import ClusterError, ClusterSpec, CostModelError, GiB
from autopar.cost_models.presets import PRESETS, load_cluster


def _file_dict(name: str = "a100-80g") -> dict:
    """A preset as the dict a cluster file holds (the name comes from the file's stem)."""
    d = PRESETS[name].to_dict()
    del d["name"]
    return d


def _toml_value(v) -> str:
    if isinstance(v, dict):  # a nested table (device.op_model) as a TOML inline table
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return json.dumps(v)  # numbers and strings are written the same way in TOML


def _write(path: Path, d: dict) -> Path:
    if path.suffix == ".json":
        path.write_text(json.dumps(d, indent=2))
        return path
    lines = [f"{k} = {_toml_value(v)}" for k, v in d.items() if not isinstance(v, dict)]
    for section, body in ((k, v) for k, v in d.items() if isinstance(v, dict)):
        lines += ["", f"[{section}]"] + [f"{k} = {_toml_value(v)}" for k, v in body.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_load(name):
    c = load_cluster(name)
    assert c is PRESETS[name] and c.name == name
    assert c.world_size >= 1 and 0 < c.memory_budget_bytes < c.device.memory_bytes


def test_a100_preset_figures():
    c = load_cluster("a100-80g")
    assert c.gpus_per_node == 8 and c.nics_per_node == 8 and c.backend == "nccl"
    assert c.device.memory_bytes == 80 * GiB and c.device.peak_flops_bf16 == 312e12
    assert c.intra_node.bandwidth_bytes_s == 230e9 and c.inter_node.bandwidth_bytes_s == 24e9


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_cluster_file_round_trips(tmp_path, suffix):
    path = _write(tmp_path / f"lab{suffix}", _file_dict())
    c = load_cluster(str(path))
    assert c.name == "lab"
    from dataclasses import replace

    assert c == replace(PRESETS["a100-80g"], name="lab")
    again = _write(tmp_path / f"lab2{suffix}", {k: v for k, v in c.to_dict().items() if k != "name"})
    assert load_cluster(str(again)) == replace(c, name="lab2")


def test_optional_fields_default(tmp_path):
    d = _file_dict("cpu")
    for key in ("nodes", "backend", "memory_reserve_fraction"):
        del d[key]
    c = load_cluster(str(_write(tmp_path / "min.toml", d)))
    assert c.nodes == 1 and c.backend == "nccl" and c.memory_reserve_fraction == 0.10


def test_for_world_size():
    c = load_cluster("a100-80g")
    assert c.for_world_size(4).world_size == 4 and c.for_world_size(4).nodes == 1
    assert c.for_world_size(64).nodes == 8
    assert c.for_world_size(12, nodes=3).gpus_per_node == 4


@pytest.mark.parametrize("world, nodes, needle", [
    (0, None, "at least 1"),
    (12, None, "not a multiple of the 8 devices per node"),
    (12, 5, "does not split evenly over 5 nodes"),
    (32, 2, "16 per node"),
    (8, 0, "does not split evenly over 0 nodes"),
])
def test_for_world_size_errors(world, nodes, needle):
    with pytest.raises(ClusterError, match=needle):
        load_cluster("a100-80g").for_world_size(world, nodes)


def test_unknown_cluster_name_lists_presets():
    with pytest.raises(ClusterError, match="unknown cluster 'tpu-v9'.*a100-80g"):
        load_cluster("tpu-v9")
    assert issubclass(ClusterError, CostModelError) and issubclass(CostModelError, ValueError)


@pytest.mark.parametrize("suffix", [".json", ".toml"])
@pytest.mark.parametrize("section, key", [
    (None, "gpus_per_node"), (None, "nics_per_node"), ("device", "memory_bytes"),
    ("device", "matmul_efficiency"), ("intra_node", "latency_s"), ("inter_node", "bandwidth_bytes_s"),
    (None, "device"),
])
def test_missing_field_is_named(tmp_path, suffix, section, key):
    d = _file_dict()
    del (d[section] if section else d)[key]
    with pytest.raises(ClusterError, match=key):
        load_cluster(str(_write(tmp_path / f"c{suffix}", d)))


@pytest.mark.parametrize("section, key", [
    (None, "gpus_per_node"), (None, "nodes"), ("device", "memory_bytes"), ("device", "peak_flops_fp32"),
    ("intra_node", "bandwidth_bytes_s"), ("inter_node", "latency_s"), ("device", "half_efficiency_flops"),
    (None, "memory_reserve_fraction"),
])
def test_negative_field_is_named(tmp_path, section, key):
    d = _file_dict()
    (d[section] if section else d)[key] = -1
    with pytest.raises(ClusterError, match=key):
        load_cluster(str(_write(tmp_path / "c.json", d)))


@pytest.mark.parametrize("section", [None, "device", "inter_node"])
def test_unknown_field_is_named(tmp_path, section):
    d = _file_dict()
    (d[section] if section else d)["bandwith_bytes_s"] = 1e9
    with pytest.raises(ClusterError, match="unknown fields bandwith_bytes_s"):
        load_cluster(str(_write(tmp_path / "c.toml", d)))


@pytest.mark.parametrize("text, suffix, needle", [
    ("{not json", ".json", "not valid"), ("gpus_per_node = = 8", ".toml", "not valid"),
    ("[1, 2]", ".json", "expected a table"),
])
def test_unreadable_cluster_file(tmp_path, text, suffix, needle):
    path = tmp_path / f"c{suffix}"
    path.write_text(text)
    with pytest.raises(ClusterError, match=needle):
        load_cluster(str(path))


def test_missing_cluster_file(tmp_path):
    with pytest.raises(ClusterError, match="does not exist"):
        load_cluster(str(tmp_path / "nope.toml"))


def test_efficiency_and_backend_checked():
    base = PRESETS["cpu"]
    from dataclasses import replace

    with pytest.raises(ClusterError, match="matmul_efficiency must be ≤ 1"):
        replace(base, device=replace(base.device, matmul_efficiency=1.5))
    with pytest.raises(ClusterError, match="backend"):
        replace(base, backend="mpi")
    assert isinstance(ClusterSpec.from_dict(_file_dict("cpu"), source="x.toml"), ClusterSpec)


def test_blocking_wait_share_follows_the_ranks_competing_for_the_cores():
    from dataclasses import replace

    from autopar.cost_models.hardware import blocking_wait_share

    host = replace(PRESETS["a100-80g"], gpus_per_node=4, cores_per_node=2)
    assert blocking_wait_share(host, 4, 4) == 1.0  # as calibrate measured it: every rank busy
    assert blocking_wait_share(host, 3, 4) == pytest.approx((1 - 2 / 3) / (1 - 2 / 4))
    assert blocking_wait_share(host, 2, 4) == 0.0  # each busy rank has a core
    assert blocking_wait_share(replace(host, cores_per_node=4), 2, 4) == 1.0  # never outnumbered: as measured
    assert blocking_wait_share(replace(host, cores_per_node=0), 1, 4) == 1.0  # GPUs
