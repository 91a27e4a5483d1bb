"""``autopar calibrate``: fits that recover known figures, a cluster file the planner accepts,
clear refusals, and no half-written file when interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from console import autopar_command, default_sigint

from autopar.cost_models.communication import Collective, collective_time_s, place_group
from autopar.cost_models.gpu_figures import GPU_KERNEL_OVERHEAD_S
from autopar.cost_models.hardware import ClusterError, ClusterSpec
from autopar.cost_models.presets import load_cluster
from autopar.planning.pricing import exposed_comm_s
from autopar.tools.calibrate import (
    CalibrationError,
    Measurements,
    build_cluster,
    check_output_path,
    cluster_document,
    fit_compute,
    fit_gemm,
    fit_line,
    fit_op_model,
    overlap_fraction,
    write_atomically,
)
from autopar.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "gpt.py") + ":gpt_tiny"


def _alpha_beta(latency: float, busbw: float, kind: str, n: int = 2) -> list[tuple[int, float]]:
    factor = 1.0 if kind == "p2p" else (2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n)
    return [(b, latency + b * factor / busbw) for b in (4096, 65536, 2**20, 2**24)]


def _measurements(**overrides) -> Measurements:
    rate, half = 50e9, 5e6
    layers = [{"kind": "mlp", "width": w, "fwd_flops": f, "seconds": (3 * f + 2 * half) / rate}
              for w, f in [(64, 1e7), (128, 4e7), (256, 1.6e8), (512, 6.4e8)]]
    m = Measurements(
        backend="gloo", nproc=2, threads=1, layers=layers,
        gemm_flops_s={"fp32": 80e9, "bf16": 40e9},
        collectives={"all_reduce": _alpha_beta(100e-6, 2e9, "all_reduce"),
                     "all_gather": _alpha_beta(300e-6, 0.5e9, "all_gather"),
                     "reduce_scatter": _alpha_beta(300e-6, 0.5e9, "reduce_scatter"),
                     "p2p": _alpha_beta(50e-6, 3e9, "p2p")},
        # 199.8 MB all-reduced over the fitted link (100 µs, 2 GB/s bus) takes 0.1 s
        overlap={"compute_s": 0.1, "comm_s": 0.1, "both_s": 0.15, "bytes": 199.8e6},
        optimizer={"params": 1e6, "seconds": 0.003,
                   "small_tensors": 16.0, "small_plain_s": 0.001, "small_dtensor_s": 0.005},
        device_memory_bytes=4 * 2**30, device_name="cpu (test)", wall_s=12.0)
    for k, v in overrides.items():
        setattr(m, k, v)
    return m


# ------------------------------------------------------------------ fitting


def test_fit_line_recovers_latency_and_bandwidth_from_alpha_beta_points():
    points = _alpha_beta(200e-6, 1.5e9, "p2p")
    slope, intercept = fit_line([b for b, _ in points], [t for _, t in points])
    assert intercept == pytest.approx(200e-6, rel=1e-6)
    assert 1 / slope == pytest.approx(1.5e9, rel=1e-6)


def test_fit_line_goes_through_the_origin_rather_than_report_a_negative_latency():
    slope, intercept = fit_line([1.0, 2.0, 4.0], [0.9, 2.0, 4.1])
    assert intercept == 0.0 and slope > 0


def test_fit_line_refuses_measurements_that_do_not_grow_with_size():
    with pytest.raises(CalibrationError, match="busy"):
        fit_line([1.0, 2.0, 4.0], [3.0, 2.0, 1.0])
    with pytest.raises(CalibrationError, match="two measurements"):
        fit_line([1.0], [1.0])


def test_fit_compute_recovers_rate_and_per_call_overhead():
    rate, half = fit_compute(_measurements().layers)
    assert rate == pytest.approx(50e9, rel=1e-6)
    assert half == pytest.approx(5e6, rel=1e-6)


def _gemm_points(rate: float, k_half: float, overhead: float) -> list[dict[str, float]]:
    shapes = [(256, 256, 32), (256, 256, 512), (512, 512, 64), (512, 512, 512), (16, 512, 512), (768, 768, 768)]
    return [{"m": m, "n": n, "k": k, "seconds": 2 * m * n * (k + k_half) / rate + overhead} for m, n, k in shapes]


def test_fit_gemm_recovers_rate_depth_at_half_rate_and_kernel_overhead():
    rate, k_half, overhead = fit_gemm(_gemm_points(60e9, 96.0, 20e-6))
    assert rate == pytest.approx(60e9, rel=1e-6) and k_half == pytest.approx(96.0, rel=1e-4)
    assert overhead == pytest.approx(20e-6, rel=1e-4)
    assert fit_gemm(_gemm_points(60e9, 0.0, 20e-6))[1] == pytest.approx(0.0, abs=1e-6)  # kept ≥ 0


def test_per_op_probes_give_the_cluster_an_op_model_that_prices_their_own_ops():
    from autopar.cost_models.compute import attention_time_s, gemm_time_s, memory_bound_time_s

    points = _gemm_points(60e9, 96.0, 20e-6)
    att = {"flops": 1e9, "fwd_s": 0.04, "bwd_s": 0.12}
    probes = {"gemm_shapes": points, "bandwidth": {"bytes": 3e8, "seconds": 0.05}, "attention": att}
    c = build_cluster(_measurements(backend="nccl", **probes))
    d = c.device
    assert d.op_model is not None and d.op_model.sm_count == 0
    for p in points:  # the fitted model gives back each measured (bf16) GEMM
        assert gemm_time_s(p["m"], p["n"], p["k"], 1, d, "bf16") == pytest.approx(p["seconds"], rel=1e-4)
    assert memory_bound_time_s(3e8, d) == pytest.approx(0.05)
    assert attention_time_s(1e9, d, "bf16", causal=True) - d.op_model.kernel_overhead_s == pytest.approx(0.04)
    assert attention_time_s(1e9, d, "bf16", backward=True, causal=True) - d.op_model.kernel_overhead_s \
        == pytest.approx(0.12)
    again = ClusterSpec.from_dict(json.loads(json.dumps(c.to_dict())), source="c.json")
    assert again == c
    assert build_cluster(_measurements()).device.op_model is None  # files measured before: the FLOPs model
    on_gpu = build_cluster(_measurements(backend="nccl", sm_count=132, **probes)).device.op_model
    assert (on_gpu.sm_count, on_gpu.tile_m, on_gpu.tile_n) == (132, 256, 128)  # the cited cuBLAS tile
    assert on_gpu.host_op_s == 0  # no host probe: no host term (files measured before it)
    # with the host probe, a GPU's host time per op is the tiny block's, and its kernels pay the launch alone
    hosted = build_cluster(_measurements(backend="nccl", sm_count=132, host={"ops": 44.0, "seconds": 44 * 30e-6},
                                         **probes)).device.op_model
    assert hosted.host_op_s == pytest.approx(30e-6) and hosted.kernel_overhead_s == GPU_KERNEL_OVERHEAD_S
    # a CPU's host is its device: whatever it measured, no host term beside the kernels' own overhead
    assert fit_op_model(_measurements(host={"ops": 44.0, "seconds": 1e-3}, **probes), 1e9)[1].host_op_s == 0
    # a CPU host keeps the FLOPs model fitted to whole layers; its per-op fit is recorded, not used
    cpu = _measurements(**probes)
    assert build_cluster(cpu).device.op_model is None
    recorded = cluster_document(build_cluster(cpu), cpu)["calibration"]["op_model_fit"]
    assert recorded["gemm_k_half"] == pytest.approx(96.0, rel=1e-4)


def test_overlap_fraction_spans_perfect_partial_and_none():
    assert overlap_fraction(1.0, 0.5, 1.0) == 1.0  # the shorter one fully hidden
    assert overlap_fraction(1.0, 0.5, 1.5) == 0.0  # they took turns
    assert overlap_fraction(1.0, 1.0, 1.5) == pytest.approx(0.5)
    assert overlap_fraction(1.0, 1.0, 0.5) == 1.0  # clamped: noise never gives more than perfect


def test_exposed_communication_follows_the_overlap():
    assert exposed_comm_s(0.3, 1.0, 1.0) == 0.0  # GPUs: hidden under compute
    assert exposed_comm_s(1.5, 1.0, 1.0) == pytest.approx(0.5)
    assert exposed_comm_s(0.3, 1.0, 0.0) == pytest.approx(0.3)  # no overlap: all of it shows
    assert exposed_comm_s(0.4, 1.0, 0.5) == pytest.approx(0.2)


# ------------------------------------------------------------------ the cluster file


def test_built_cluster_carries_the_fitted_figures():
    c = build_cluster(_measurements(), name="box")
    assert (c.name, c.gpus_per_node, c.nodes, c.backend) == ("box", 2, 1, "gloo")
    assert c.device.peak_flops_fp32 == 80e9
    assert c.device.matmul_efficiency == pytest.approx(50e9 / 80e9)
    assert c.device.half_efficiency_flops == pytest.approx(5e6)
    assert c.intra_node.bandwidth_bytes_s == pytest.approx(2e9)
    assert c.intra_node.for_kind("all_gather").bandwidth_bytes_s == pytest.approx(0.5e9)
    assert c.intra_node.for_kind("p2p").latency_s == pytest.approx(50e-6)
    assert c.comm_overlap == pytest.approx(0.5)
    # the all-reduce timed alone once is noisy; the link fitted over every size prices it instead
    noisy = build_cluster(_measurements(overlap={"compute_s": 0.1, "comm_s": 0.18, "both_s": 0.15,
                                                 "bytes": 199.8e6}))
    assert noisy.comm_overlap == pytest.approx(0.5)
    assert c.latency_per_step and c.intra_node.latency_s == pytest.approx(50e-6)  # 2 ring steps at n=2
    assert c.device.memory_bandwidth_bytes_s == pytest.approx(24e6 / 0.003)
    assert c.optimizer_dtensor_s == pytest.approx(0.004 / 16)  # DTensor's step beyond the plain one
    assert c.zero_overhead_s == 0.0  # not measured: not priced


def test_fsdp2_time_beyond_compute_and_collectives_becomes_its_overhead_per_collective():
    plain = build_cluster(_measurements())
    unit, layers, group = 2**20, 4, place_group(2, 1, 2)
    links = layers * (2 * collective_time_s(Collective.ALL_GATHER, unit, group, plain)
                      + collective_time_s(Collective.REDUCE_SCATTER, unit, group, plain))
    zero = {"local_s": 0.05, "zero_s": 0.05 + links + layers * 3 * 2e-3, "layers": layers, "layer_bytes": unit}
    assert build_cluster(_measurements(zero=zero)).zero_overhead_s == pytest.approx(2e-3)
    zero["zero_s"] = 0.05 + links * 0.9  # FSDP2 no slower than its collectives: nothing to price
    assert build_cluster(_measurements(zero=zero)).zero_overhead_s == 0.0


def test_cluster_file_round_trips_through_load_cluster_and_prices_each_collective(tmp_path):
    m = _measurements()
    path = tmp_path / "box.json"
    write_atomically(path, json.dumps(cluster_document(build_cluster(m, name="box"), m)))
    loaded = load_cluster(str(path))
    assert loaded == build_cluster(m, name="box")
    group = place_group(2, 1, loaded.gpus_per_node)
    ag = collective_time_s(Collective.ALL_GATHER, 2**24, group, loaded)
    ar = collective_time_s(Collective.ALL_REDUCE, 2**24, group, loaded)
    assert ag == pytest.approx(300e-6 + 2**24 * 0.5 / 0.5e9)
    assert ar == pytest.approx(100e-6 + 2**24 * 1.0 / 2e9)
    assert json.loads(path.read_text())["calibration"]["threads_per_process"] == 1


def test_latency_per_step_prices_a_smaller_group_for_its_own_steps():
    m = _measurements(nproc=4, collectives={
        "all_reduce": _alpha_beta(600e-6, 2e9, "all_reduce", 4),
        "all_gather": _alpha_beta(300e-6, 1e9, "all_gather", 4),
        "reduce_scatter": _alpha_beta(300e-6, 1e9, "reduce_scatter", 4),
        "p2p": _alpha_beta(50e-6, 3e9, "p2p")},
        overlap={"compute_s": 0.1, "comm_s": 0.1, "both_s": 0.15, "sync_s": 1e-3})
    c = build_cluster(m)
    four, two = place_group(4, 1, 4), place_group(2, 1, 4)
    assert collective_time_s(Collective.ALL_REDUCE, 0.0 + 1, four, c) == pytest.approx(600e-6 + 1e-3, rel=1e-3)
    assert collective_time_s(Collective.ALL_REDUCE, 0.0 + 1, two, c) == pytest.approx(200e-6 + 1e-3, rel=1e-3)


def test_cluster_files_without_per_kind_figures_still_load_and_presets_stay_unchanged():
    spec = load_cluster("a100-80g")
    assert "collectives" not in spec.to_dict()["intra_node"]
    assert spec.comm_overlap == 1.0
    assert ClusterSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(comm_overlap=1.5), "comm_overlap"),
    (lambda d: d["intra_node"].update(collectives={"broadcast": {"bandwidth_bytes_s": 1, "latency_s": 0}}),
     "unknown kind 'broadcast'"),
    (lambda d: d["intra_node"].update(collectives={"p2p": {"bandwidth_bytes_s": -1, "latency_s": 0}}),
     "collectives.p2p.bandwidth_bytes_s"),
])
def test_bad_calibrated_fields_are_named(edit, message):
    data = load_cluster("cpu").to_dict()
    edit(data)
    with pytest.raises(ClusterError, match=message):
        ClusterSpec.from_dict(data)


def test_an_interrupted_write_leaves_neither_the_file_nor_a_temporary(tmp_path, monkeypatch):
    target = tmp_path / "cluster.json"

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_atomically(target, "{}")
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_output_is_refused_before_measuring(tmp_path):
    with pytest.raises(CalibrationError, match="does not exist"):
        check_output_path(tmp_path / "missing" / "c.json")
    with pytest.raises(CalibrationError, match="is a directory"):
        check_output_path(tmp_path)


# ------------------------------------------------------------------ the command


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "1"], "at least 2"),
    (["--nproc", "4096"], "processes per core"),
    (["--nproc", "2", "-o", "/nonexistent-dir/c.json"], "does not exist"),
])
def test_calibrate_refuses_bad_input_in_one_line(capsys, argv, message):
    code = main(["calibrate", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and message in err
    assert err.startswith("autopar: error:") and err.count("\n") == 1


@pytest.mark.distributed
def test_interrupted_calibration_says_so_and_writes_nothing(tmp_path):
    target = tmp_path / "cluster.json"
    proc = subprocess.Popen(autopar_command("calibrate", "--nproc", "2", "-o", str(target)),
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=default_sigint)
    try:
        line = ""
        deadline = time.monotonic() + 120
        while "[1/" not in line and time.monotonic() < deadline:  # measuring has begun
            line = proc.stderr.readline()
        assert "[1/" in line
        os.killpg(proc.pid, signal.SIGINT)  # ^C reaches the whole foreground group
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130
    assert "interrupted" in err and "no cluster file" in err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.distributed
def test_quick_calibration_writes_a_cluster_the_planner_uses(tmp_path):
    target = tmp_path / "cluster.json"
    run = subprocess.run(autopar_command("calibrate", "--nproc", "2", "--quick", "-o", str(target)),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "[9/9] done" in run.stderr and f"cluster written to {target}" in run.stderr
    cluster = load_cluster(str(target))
    assert cluster.backend == "gloo" and cluster.gpus_per_node == 2
    assert 0 <= cluster.comm_overlap <= 1
    plan = subprocess.run(autopar_command("plan", TINY, "--world-size", "2", "--cluster", str(target),
                                   "--dtype", "fp32", "--json"), capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["cluster"]["name"] == cluster.name


# ------------------------------------------------------------------ names and words


def test_describe_keeps_a_space_between_every_label_and_its_figure():
    from autopar.tools.calibrate import describe

    lines = describe(build_cluster(_measurements(), name="box")).splitlines()
    assert lines[0].startswith("cluster box: 2 × cpu (test), backend gloo")
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "p2p"):
        line = next(l for l in lines if l.split()[0] == kind)
        assert f"  {kind} " in line and line.split()[1] == "α", line
    for line in lines[1:]:  # labels in one column, the figures in the next, two spaces at least between
        label = line[2:18].rstrip()
        assert line.startswith("  ") and label and len(label) <= 14 and line[18] != " ", line


@pytest.mark.parametrize("extra, expected", [([], "mycluster"), (["--name", "box"], "box")])
def test_a_calibrated_file_plans_under_its_own_stem_unless_named(tmp_path, capsys, monkeypatch,
                                                                 extra, expected):
    import autopar.tools.calibrate as calibrate_pkg

    monkeypatch.setattr(calibrate_pkg, "measure", lambda nproc, **kw: _measurements())
    target = tmp_path / "mycluster.json"
    assert main(["calibrate", "--nproc", "2", "-o", str(target), *extra]) == 0
    err = capsys.readouterr().err
    assert f"cluster {expected}: " in err and "reduce_scatterα" not in err
    assert json.loads(target.read_text())["name"] == expected
    assert load_cluster(str(target)).name == expected
    assert main(["plan", TINY, "--world-size", "2", "--cluster", str(target), "--dtype", "fp32"]) == 0
    assert f"({expected}, fp32)" in capsys.readouterr().out


def test_without_an_output_the_calibrated_cluster_is_named_for_the_host(capsys, monkeypatch):
    import socket

    import autopar.tools.calibrate as calibrate_pkg

    monkeypatch.setattr(calibrate_pkg, "measure", lambda nproc, **kw: _measurements())
    assert main(["calibrate", "--nproc", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == f"{socket.gethostname()}-gloo-x2"


def test_progress_counts_say_one_sweep_not_one_sweeps():
    from autopar.tools.calibrate.probes import _count

    assert (_count(1, "sweep"), _count(3, "round")) == ("1 sweep", "3 rounds")


@pytest.mark.slow
def test_the_compiled_fraction_is_measured_on_a_fused_chain_and_prices_compiled_blocks():
    """calibrate times a two-op memory-bound chain eager and under torch.compile (inductor's C++ backend
    here); the ratio becomes the op model's compiled_memory_bound_fraction, which pricing reads."""
    import time as clock

    import torch

    from autopar.cost_models.hardware import COMPILED_MEMORY_BOUND_FRACTION
    from autopar.tools.calibrate.op_probes import fused_chain

    def timer(fn):
        fn()
        t = clock.perf_counter()
        for _ in range(5):
            fn()
        return (clock.perf_counter() - t) / 5

    fused = fused_chain(torch, torch.device("cpu"), torch.float32, 1 << 20, timer)
    assert "error" not in fused, fused
    assert fused["eager_s"] > 0 and fused["compiled_s"] > 0
    # every rank must compile, or none times it (the timer is a collective)
    assert fused_chain(torch, torch.device("cpu"), torch.float32, 1 << 10, timer, lambda ok: False) == {
        "error": "torch.compile failed on another rank"}
    points = _gemm_points(60e9, 96.0, 20e-6)
    probes = {"gemm_shapes": points, "bandwidth": {"bytes": 3e8, "seconds": 0.05},
              "attention": {"flops": 1e9, "fwd_s": 0.04, "bwd_s": 0.12}}
    measured = build_cluster(_measurements(backend="nccl", fused={"eager_s": 2.0, "compiled_s": 0.7}, **probes))
    assert measured.device.op_model.compiled_memory_bound_fraction == pytest.approx(0.35)
    slower = build_cluster(_measurements(backend="nccl", fused={"eager_s": 1.0, "compiled_s": 1.3}, **probes))
    assert slower.device.op_model.compiled_memory_bound_fraction == 1.0  # never priced slower than eager
    unmeasured = build_cluster(_measurements(backend="nccl", fused={"error": "no compiler"}, **probes))
    assert unmeasured.device.op_model.compiled_memory_bound_fraction == COMPILED_MEMORY_BOUND_FRACTION
    again = ClusterSpec.from_dict(json.loads(json.dumps(measured.to_dict())), source="c.json")
    assert again == measured
    bad = measured.to_dict()
    bad["device"]["op_model"]["compiled_memory_bound_fraction"] = 1.5
    with pytest.raises(ClusterError, match="compiled_memory_bound_fraction must be ≤ 1"):
        ClusterSpec.from_dict(bad, source="c.json")
