"""Fitting: the ranks' measurements turned into the cluster file's figures (pure functions, no torch)."""

from __future__ import annotations

import platform
import socket
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from autopar.cost_models.communication import Collective, bus_factor, collective_time_s, place_group, ring_steps
from autopar.cost_models.compute import ATTENTION_BACKWARD_FLOPS_FACTOR, CAUSAL_ATTENTION_RATE, CAUSAL_ATTENTION_WORK
from autopar.cost_models.gpu_figures import (
    GEMM_TILE_M,
    GEMM_TILE_N,
    GPU_KERNEL_OVERHEAD_S,
    MASKED_ATTENTION_BWD,
    MASKED_ATTENTION_FWD,
)
from autopar.cost_models.hardware import COMPILED_MEMORY_BOUND_FRACTION, ClusterSpec, DeviceSpec, LinkSpec, OpModel
from autopar.tools.calibrate.errors import CalibrationError


@dataclass
class Measurements:
    """What the ranks measured (rank means of per-rank medians), before any fitting."""

    backend: str
    nproc: int
    threads: int
    cores: int = 0
    layers: list[dict[str, Any]] = field(default_factory=list)  # kind, width, fwd_flops, seconds
    gemm_flops_s: dict[str, float] = field(default_factory=dict)  # dtype -> FLOP/s
    collectives: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # kind -> (bytes, s)
    overlap: dict[str, float] = field(default_factory=dict)  # compute_s, comm_s, both_s
    optimizer: dict[str, float] = field(default_factory=dict)  # params, seconds
    tensor_parallel: dict[str, float] = field(default_factory=dict)  # tp_s, local_s, bytes
    zero: dict[str, float] = field(default_factory=dict)  # zero_s, local_s, layers, layer_bytes
    gemm_shapes: list[dict[str, float]] = field(default_factory=list)  # m, n, k, seconds (fp32)
    bandwidth: dict[str, float] = field(default_factory=dict)  # bytes, seconds of an elementwise add
    attention: dict[str, float] = field(default_factory=dict)  # flops, fwd_s, bwd_s (causal SDPA)
    fused: dict[str, Any] = field(default_factory=dict)  # eager_s, compiled_s of a two-op chain (or error)
    host: dict[str, float] = field(default_factory=dict)  # ops, seconds of a tiny block's forward + backward (GPU)
    sm_count: int = 0  # a GPU's streaming multiprocessors (0: a CPU, no waves of tiles)
    device_memory_bytes: int = 0
    device_name: str = "cpu"
    wall_s: float = 0.0


def measurements_from_dict(data: dict[str, Any]) -> Measurements:
    """Measurements from their JSON form (collective points back to tuples)."""
    data = dict(data, collectives={k: [tuple(p) for p in v] for k, v in data["collectives"].items()})
    return Measurements(**data)


# ------------------------------------------------------------------ fitting (pure functions)


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """``y ≈ slope · x + intercept`` minimising *relative* squared error, intercept ≥ 0.

    Relative error, because the points span orders of magnitude and a 4 KiB
    message's latency matters as much as a 64 MiB message's bandwidth.
    """
    if len(xs) != len(ys) or len(xs) < 2:
        raise CalibrationError("a fit needs at least two measurements")
    w = [1.0 / y ** 2 for y in ys]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs))
    sy = sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det if det > 0 else 0.0
    intercept = (sy - slope * sx) / sw
    if intercept < 0:  # through the origin instead
        slope, intercept = sxy / sxx, 0.0
    if not slope > 0:
        raise CalibrationError("the measurements do not grow with size; the machine was too busy to "
                               "calibrate, run again when it is idle")
    return slope, intercept


def fit_compute(layers: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """``(peak · η, flops_½)`` from forward + backward times of layers with forward FLOPs F.

    The compute model prices forward (F) and backward (2F) as separate calls,
    each paying ``flops_½``: time = (3F + 2·flops_½) / (peak · η).
    """
    slope, intercept = fit_line([3.0 * l["fwd_flops"] for l in layers], [l["seconds"] for l in layers])
    rate = 1.0 / slope
    return rate, intercept * rate / 2.0


def _solve3(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a·x = b for a 3 × 3 system (Gaussian elimination with partial pivoting)."""
    rows = [list(r) + [v] for r, v in zip(a, b)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        if rows[col][col] == 0:
            raise CalibrationError("the GEMM measurements do not determine the fit; use more shapes")
        for r in range(col + 1, 3):
            f = rows[r][col] / rows[col][col]
            rows[r] = [x - f * y for x, y in zip(rows[r], rows[col])]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (rows[r][3] - sum(rows[r][c] * x[c] for c in range(r + 1, 3))) / rows[r][r]
    return x


def fit_gemm(points: Sequence[dict[str, float]]) -> tuple[float, float, float]:
    """``(rate FLOP/s, k_½, overhead s)`` of t = 2mnk / (rate · k / (k + k_½)) + overhead.

    That is t = 2mnk · (1/rate) + 2mn · (k_½/rate) + overhead, linear in its three
    unknowns: fitted by least squares on relative error, each kept ≥ 0 (a negative one
    is dropped and the rest refitted).
    """
    if len(points) < 3:
        raise CalibrationError("a GEMM fit needs at least three shapes")
    cols = [[2.0 * p["m"] * p["n"] * p["k"], 2.0 * p["m"] * p["n"], 1.0] for p in points]
    ys = [p["seconds"] for p in points]
    keep = [0, 1, 2]
    while True:
        xs = [[c[j] for j in keep] for c in cols]
        w = [1.0 / y ** 2 for y in ys]
        a = [[sum(wi * x[i] * x[j] for wi, x in zip(w, xs)) for j in range(len(keep))] for i in range(len(keep))]
        b = [sum(wi * x[i] * y for wi, x, y in zip(w, xs, ys)) for i in range(len(keep))]
        pad = 3 - len(keep)  # solve the smaller system inside the 3 × 3 solver
        a = [r + [0.0] * pad for r in a] + [[0.0] * len(keep) + [1.0 if i == j else 0.0 for j in range(pad)]
                                             for i in range(pad)]
        sol = dict(zip(keep, _solve3(a, b + [0.0] * pad)))
        negative = [j for j in keep[1:] if sol[j] < 0]
        if not negative:
            break
        keep.remove(negative[0])
    if not sol[0] > 0:
        raise CalibrationError("the GEMM measurements do not grow with size; run again when the host is idle")
    return 1.0 / sol[0], sol.get(1, 0.0) / sol[0], sol.get(2, 0.0)


def fit_op_model(m: Measurements, memory_bandwidth_bytes_s: float) -> tuple[float, OpModel] | None:
    """``(large-GEMM rate, the op model)`` from the per-op probes; None when they were not run.

    A GPU's tiles are the cited cuBLAS tile over its measured SM count (a CPU has no waves,
    ``sm_count`` 0); attention is timed as the fraction of the
    GEMM rate its forward and backward reach (backward counted as 2.5 × the forward's FLOPs,
    ``cost_models.compute``); the bandwidth as the fraction of ``memory_bandwidth_bytes_s``
    an elementwise add reaches (above 1 where it outruns the optimizer probe that figure is from).
    On a GPU the host's time per op is the tiny block's forward and backward over its ops (``host``), and
    the kernel's own overhead the cited launch's (back-to-back GEMM calls measure the host, not the launch);
    a CPU's host is its device: the GEMM sweep's per-call term is its kernel overhead and it has no host term.
    """
    if not m.gemm_shapes or not m.bandwidth:
        return None
    rate, k_half, overhead = fit_gemm(m.gemm_shapes)
    host = m.host["seconds"] / m.host["ops"] if m.sm_count > 0 and m.host.get("ops") else 0.0
    if host:
        overhead = GPU_KERNEL_OVERHEAD_S
    att = m.attention
    fwd = att["flops"] / att["fwd_s"] / rate if att else 1.0
    bwd = ATTENTION_BACKWARD_FLOPS_FACTOR * att["flops"] / att["bwd_s"] / rate if att else 1.0
    causal = CAUSAL_ATTENTION_WORK / CAUSAL_ATTENTION_RATE  # the probe is causal: undo what pricing adds
    tile_m, tile_n = (GEMM_TILE_M, GEMM_TILE_N) if m.sm_count > 0 else (1, 1)
    ops = OpModel(sm_count=m.sm_count, tile_m=tile_m, tile_n=tile_n, gemm_k_half=k_half, kernel_overhead_s=overhead,
                  bandwidth_fraction=m.bandwidth["bytes"] / m.bandwidth["seconds"] / memory_bandwidth_bytes_s,
                  attention_fwd=fwd * causal, attention_bwd=bwd * causal,
                  compiled_memory_bound_fraction=compiled_fraction(m.fused), host_op_s=host,
                  # a masked call: not probed; on a GPU the presets' measured memory-efficient kernel's share
                  **({"masked_attention_fwd": MASKED_ATTENTION_FWD, "masked_attention_bwd": MASKED_ATTENTION_BWD}
                     if m.sm_count > 0 else {}))
    return rate, ops


def compiled_fraction(fused: dict[str, Any]) -> float:
    """The op model's ``compiled_memory_bound_fraction`` from the fused-chain probe: compiled over eager
    seconds of the same two-op chain, at most 1 (inductor never made it slower than eager, as priced:
    a slower compiled chain is priced as eager); the presets' figure where it was not measured."""
    if not fused.get("eager_s") or not fused.get("compiled_s"):
        return COMPILED_MEMORY_BOUND_FRACTION
    return min(1.0, fused["compiled_s"] / fused["eager_s"])


def fit_link(collectives: dict[str, list[tuple[int, float]]], nproc: int) -> tuple[float, float]:
    """``(latency_s, bus bandwidth B/s)`` fitted jointly to the given collectives' measurements."""
    xs, ys = [], []
    for kind, points in collectives.items():
        factor = 1.0 if kind == "p2p" else bus_factor(Collective(kind), nproc)
        for nbytes, seconds in points:
            xs.append(nbytes * factor)
            ys.append(seconds)
    slope, intercept = fit_line(xs, ys)
    return intercept, 1.0 / slope


def overlap_fraction(compute_s: float, comm_s: float, both_s: float) -> float:
    """The fraction of the shorter of compute and communication hidden when both run at once.

    Running both takes max(c, m) + (1 − ω)·min(c, m); ω = 1 is perfect overlap,
    ω = 0 none (they take turns on the same cores).
    """
    shorter = min(compute_s, comm_s)
    if shorter <= 0:
        return 1.0
    return min(1.0, max(0.0, (compute_s + comm_s - both_s) / shorter))


def build_cluster(m: Measurements, *, name: str | None = None) -> ClusterSpec:
    """The cluster file's content: one node of ``nproc`` devices with the fitted figures."""
    rate, half = fit_compute(m.layers)
    fp32 = max(m.gemm_flops_s.get("fp32", 0.0), rate)
    bf16 = max(m.gemm_flops_s.get("bf16", 0.0), 1.0)
    if m.backend == "gloo":  # one process on a CPU: the fp32 figure is what training in fp32 reaches
        bf16 = min(bf16, fp32) if bf16 > 1.0 else fp32
    # latency per ring step, so groups smaller than the one measured (a tp pair among 4 ranks)
    # pay for their own steps; a collective as training issues it also waits for the slowest
    # rank (the sync probe), which the cluster carries as collective_sync_s
    fits = {}
    for kind, pts in m.collectives.items():
        latency, bandwidth = fit_link({kind: pts}, m.nproc)
        fits[kind] = LinkSpec(bandwidth, latency / ring_steps(kind, m.nproc))
    base = fits.pop("all_reduce")
    params, seconds = m.optimizer["params"], m.optimizer["seconds"]
    # DTensor's dispatch around each optimizer op, per parameter, beyond a plain tensor's step
    dtensor_s = max(0.0, (m.optimizer.get("small_dtensor_s", 0.0) - m.optimizer.get("small_plain_s", 0.0))
                    / max(m.optimizer.get("small_tensors", 1.0), 1.0)) if m.backend == "gloo" else 0.0
    bytes_touched = params * (2 * 8 + 4 + 4)  # fp32 AdamW: two moments read and written, grad, weight
    link = LinkSpec(base.bandwidth_bytes_s, base.latency_s, collectives=fits)
    device = DeviceSpec(
        name=m.device_name, memory_bytes=int(m.device_memory_bytes),
        peak_flops_bf16=bf16, peak_flops_fp32=fp32,
        memory_bandwidth_bytes_s=bytes_touched / seconds,
        matmul_efficiency=min(1.0, rate / fp32), half_efficiency_flops=half,
    )
    per_op = fit_op_model(m, device.memory_bandwidth_bytes_s)
    # GPUs price layers with op records op by op, at the GEMMs' own large-k rate. A CPU host keeps
    # the FLOPs model fitted to whole layers: there, the per-op sum predicted calibrate's own layer
    # probes 1.4–2.2× too fast (a 2-core host, benchmarks/cpu_op_check.py; docs/cost-model.md "Compute model");
    # its per-op fit is recorded in the file's calibration.
    if per_op is not None and m.backend == "nccl":
        gemm_rate, ops = per_op  # measured in bf16, as GPUs train (probes.ops)
        peak = max(bf16, gemm_rate)
        device = replace(device, peak_flops_bf16=peak, matmul_efficiency=min(1.0, gemm_rate / peak), op_model=ops)
    cluster = ClusterSpec(
        name or f"{socket.gethostname()}-{m.backend}-x{m.nproc}", device,
        gpus_per_node=m.nproc, nodes=1, intra_node=link, inter_node=link, nics_per_node=1,
        backend=m.backend, memory_reserve_fraction=0.25 if m.backend == "gloo" else 0.10,
        cores_per_node=m.cores if m.backend == "gloo" else 0,
        latency_per_step=True, collective_sync_s=m.overlap.get("sync_s", 0.0),
        optimizer_dtensor_s=dtensor_s,
    )
    group = place_group(m.nproc, 1, m.nproc)
    # the overlap probe's all-reduce priced by the link fitted over every size, not timed once on its
    # own: that one time moved ω from 0.09 to 0.47 between runs here, the fit by a few hundredths
    o = m.overlap
    comm_s = (collective_time_s(Collective.ALL_REDUCE, o["bytes"], group, replace(cluster, collective_sync_s=0.0))
              if "bytes" in o else o["comm_s"])
    cluster = replace(cluster, comm_overlap=overlap_fraction(o["compute_s"], comm_s, o["both_s"]))
    # a Megatron MLP makes one all-reduce forward and one backward; what it costs beyond the
    # local shard's compute and those two all-reduces is DTensor's work around each collective
    tp = m.tensor_parallel
    if tp:
        all_reduce = collective_time_s(Collective.ALL_REDUCE, tp["bytes"], group, cluster)
        cluster = replace(cluster, tp_overhead_s=max(0.0, (tp["tp_s"] - tp["local_s"] - 2 * all_reduce) / 2))
    # each ZeRO-3 unit all-gathers twice and reduce-scatters once; what the stack costs beyond its
    # local compute and those collectives is FSDP2's work around each of them on the host
    z = m.zero
    if z and m.backend == "gloo":
        unit = z["layer_bytes"]
        links = z["layers"] * (2 * collective_time_s(Collective.ALL_GATHER, unit, group, cluster)
                               + collective_time_s(Collective.REDUCE_SCATTER, unit, group, cluster))
        cluster = replace(cluster, zero_overhead_s=max(0.0, (z["zero_s"] - z["local_s"] - links) / (3 * z["layers"])))
    return cluster


def cluster_document(cluster: ClusterSpec, m: Measurements) -> dict[str, Any]:
    """The JSON written: the cluster's fields, and a ``calibration`` section saying how it was measured."""
    doc = cluster.to_dict()
    doc["calibration"] = {
        "command": f"autopar calibrate --nproc {m.nproc} --backend {m.backend}",
        "host": socket.gethostname(), "platform": platform.platform(),
        "threads_per_process": m.threads, "wall_s": round(m.wall_s, 1),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "gemm_flops_s": m.gemm_flops_s, "layers": m.layers, "collectives": m.collectives,
        "overlap": m.overlap, "optimizer": m.optimizer, "tensor_parallel": m.tensor_parallel,
        "zero": m.zero, "gemm_shapes": m.gemm_shapes, "bandwidth": m.bandwidth, "attention": m.attention,
        "fused": m.fused,
    }
    per_op = fit_op_model(m, cluster.device.memory_bandwidth_bytes_s)
    if per_op is not None and cluster.device.op_model is None:  # measured, not used (build_cluster)
        doc["calibration"]["op_model_fit"] = {"gemm_rate_flops_s": per_op[0], **asdict(per_op[1])}
    return doc
