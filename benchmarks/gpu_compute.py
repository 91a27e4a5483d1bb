"""The per-op compute terms measured on a lent GPU, beside what the preset prices them at.

Called by ``benchmarks/gpu_check.py`` through :func:`check` (``--dry``: on CPU, small shapes):

- a sweep of bf16 GEMM shapes — deep and shallow reductions, a thin m, a shape one tile
  column past a whole wave — each timed and priced by the preset's op model
  (``cost_models.compute.gemm_time_s``), then fitted as ``autopar calibrate`` fits them
  (``fit_gemm``: large-GEMM rate, k at half rate, per-kernel overhead);
- an elementwise add's bandwidth against the preset's achievable share of HBM;
- causal scaled dot-product attention, forward and backward, as a fraction of the GEMM rate
  against the preset's ``attention_fwd`` / ``attention_bwd``;
- the host's time per op: a tiny transformer block's forward and backward over the ops capture records
  for it, against the preset's ``host_op_s``.

The figures are measurements to compare with the cited ones (``cost_models/hardware.py``);
nothing here changes a preset.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace
from typing import Any

BACK_TO_BACK = 20  # calls per timed sample on a GPU: launches queue behind each other, as in training


def _timer(torch: Any, cuda: bool, reps: int) -> Any:
    """Median seconds per call; on a GPU, of ``BACK_TO_BACK`` calls between synchronisations, so the
    per-kernel overhead fitted is what a queue of kernels pays, not a synchronisation's latency."""
    inner = BACK_TO_BACK if cuda else 1

    def timer(fn: Any) -> float:
        fn()
        times = []
        for _ in range(reps):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(inner):
                fn()
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t) / inner)
        return statistics.median(times)
    return timer


def measure(dry: bool, cluster: Any) -> dict[str, Any]:
    """Measure the op probes on this device and set each beside ``cluster``'s preset pricing."""
    import torch

    from autopar.cost_models.compute import gemm_time_s
    from autopar.tools.calibrate.errors import CalibrationError
    from autopar.tools.calibrate.fit import Measurements, fit_gemm, fit_op_model
    from autopar.tools.calibrate.op_probes import (
        CPU_OP_SIZES,
        GPU_OP_SIZES,
        attention_times,
        elementwise_bandwidth,
        gemm_sweep,
        host_per_op,
    )

    cuda = not dry
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype, name = (torch.bfloat16, "bf16") if cuda else (torch.float32, "fp32")
    sizes = GPU_OP_SIZES if cuda else replace(CPU_OP_SIZES, elementwise=1 << 16, attention=(1, 2, 32, 16))
    timer = _timer(torch, cuda, reps=10 if cuda else 5)
    gemms = gemm_sweep(torch, device, dtype, sizes.gemms, timer)
    bandwidth = elementwise_bandwidth(torch, device, dtype, sizes.elementwise, timer)
    attention = attention_times(torch, device, dtype, sizes.attention, timer)
    host = host_per_op(torch, device, dtype, timer)
    spec = cluster.device
    for g in gemms:
        g["predicted_s"] = gemm_time_s(g["m"], g["n"], g["k"], 1, spec, name)
        g["tflops_s"] = 2.0 * g["m"] * g["n"] * g["k"] / g["seconds"] / 1e12
    preset = spec.op_model
    # measured whatever the fit does: a busy host's failed fit still reports it
    host_row = dict(host, per_op_s=host["seconds"] / host["ops"], preset_host_op_s=preset.host_op_s if preset else None)
    try:
        rate, k_half, overhead = fit_gemm(gemms)
        sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 0
        fitted = fit_op_model(Measurements(backend="nccl" if cuda else "gloo", nproc=1, threads=1,
                                           gemm_shapes=gemms, bandwidth=bandwidth, attention=attention,
                                           sm_count=sms), spec.memory_bandwidth_bytes_s)
    except CalibrationError as exc:  # a busy host's noise: reported, the rest of the check still runs
        return {"dtype": name, "gemms": gemms, "host": host_row, "error": str(exc)}
    ops = fitted[1] if fitted else None
    return {
        "dtype": name, "gemms": gemms, "sm_count": ops.sm_count if ops else 0,
        "fit": {"rate_flops_s": rate, "efficiency_of_peak": rate / spec.peak_flops(name), "gemm_k_half": k_half,
                "kernel_overhead_s": overhead},
        "bandwidth": dict(bandwidth, bytes_s=bandwidth["bytes"] / bandwidth["seconds"],
                          fraction_of_spec=bandwidth["bytes"] / bandwidth["seconds"] / spec.memory_bandwidth_bytes_s,
                          preset_fraction=preset.bandwidth_fraction if preset else None),
        "host": host_row,
        "attention": dict(attention, fwd_of_gemm=ops.attention_fwd if ops else None,
                          bwd_of_gemm=ops.attention_bwd if ops else None,
                          preset_fwd=preset.attention_fwd if preset else None,
                          preset_bwd=preset.attention_bwd if preset else None),
    }


def with_measured_gemms(cluster: Any, result: dict[str, Any]) -> Any:
    """``cluster`` with η_max (``matmul_efficiency``) the measured large-GEMM rate over peak, where
    it prices op by op: the per-op model's η_max is a GEMM's, not a whole layer's (which
    ``autopar calibrate``'s layer fit gives). The other per-op terms stay the preset's cited ones,
    so the plans check them."""
    device = cluster.device
    if device.op_model is None or "fit" not in result:
        return cluster
    eta = min(1.0, result["fit"]["efficiency_of_peak"])
    return replace(cluster, device=replace(device, matmul_efficiency=eta))


def check(dry: bool, cluster: Any) -> tuple[dict[str, Any], Any]:
    """What ``gpu_check.py`` calls: measure, print the summary (stderr), and return the results and
    the cluster its plans are priced on (:func:`with_measured_gemms`)."""
    result = measure(dry, cluster)
    print(summary(result), file=sys.stderr, flush=True)
    return result, with_measured_gemms(cluster, result)


def summary(result: dict[str, Any]) -> str:
    """A few lines for the terminal."""
    lines = [f"GEMM {g['m']}×{g['n']}×{g['k']}: {g['seconds'] * 1e3:.3f} ms ({g['tflops_s']:.1f} TFLOP/s), "
             f"predicted {g['predicted_s'] * 1e3:.3f} ms" for g in result["gemms"]]
    if "fit" not in result:
        return "\n".join([*lines, f"per-op fit failed: {result['error']}"])
    f, b, a = result["fit"], result["bandwidth"], result["attention"]
    lines.append(f"GEMM fit: {f['rate_flops_s'] / 1e12:.1f} TFLOP/s ({f['efficiency_of_peak']:.2f} of peak), "
                 f"k½ {f['gemm_k_half']:.0f}, {f['kernel_overhead_s'] * 1e6:.1f} µs a kernel")
    lines.append(f"elementwise: {b['bytes_s'] / 1e9:.0f} GB/s, {b['fraction_of_spec']:.2f} of the spec "
                 f"(preset {b['preset_fraction']})")
    lines.append(f"attention: forward {a['fwd_of_gemm']:.2f}, backward {a['bwd_of_gemm']:.2f} of the GEMM rate "
                 f"(preset {a['preset_fwd']}, {a['preset_bwd']})")
    h = result["host"]
    preset_us = (h["preset_host_op_s"] or 0.0) * 1e6
    lines.append(f"host: {h['per_op_s'] * 1e6:.1f} µs an op ({h['ops']:.0f} ops of a tiny block's forward and "
                 f"backward; preset {preset_us:.1f} µs)")
    return "\n".join(lines)
