"""The presets: the GPU clusters people train on, and the local CPU, built from cited or measured figures.

A preset's device holds what the silicon does (``gpu_figures``: each figure cited or measured on a GPU this
project was lent), its ``matmul_efficiency`` that device's measured GEMM efficiency times the eager
stack's share of it, the one figure fitted to the calibration set (``benchmarks/calibration_set.py
--fit``). :func:`autopar.cost_models.hardware.load_cluster` finds them by name.
"""

from __future__ import annotations

import re
from pathlib import Path

from autopar.cost_models.gpu_figures import (
    ALLOCATOR_OVERHEAD_FRACTION,
    ATTENTION_BWD_RELATIVE,
    ATTENTION_FWD_RELATIVE,
    ATTENTION_TFLOPS,
    BANDWIDTH_FRACTION,
    BEST_GEMM,
    CUDA_CONTEXT_BYTES,
    FP8_DENSE_TFLOPS,
    GEMM_TILE_M,
    GEMM_TILE_N,
    GPU_BANDWIDTH_FRACTION,
    GPU_KERNEL_OVERHEAD_S,
    HOST_OP_S,
    MASKED_ATTENTION_BWD,
    MASKED_ATTENTION_FWD,
    NCCL_BUFFER_BYTES,
    NET_STEP_LATENCY_S,
    NVLINK_STEP_LATENCY_S,
    SM_COUNT,
    gemm_k_half,
)
from autopar.cost_models.hardware import GB, ClusterError, ClusterSpec, DeviceSpec, LinkSpec, OpModel, load_cluster_file
from autopar.units import GiB

# A preset's large-GEMM efficiency (``DeviceSpec.matmul_efficiency``, η_max) is a device fact times a
# stack fact, kept apart:
# - the device's: the large-k, whole-wave efficiency its best measured GEMM implies
#   (:func:`device_gemm_efficiency` of ``gpu_figures.BEST_GEMM``: A100 0.914, H100 0.892, H200 0.856);
# - the stack's, :data:`TORCH_EAGER_GEMM_SHARE`: the share of it a training step's GEMMs reach under eager
#   PyTorch with FSDP2 in bf16 (torch's kernel choices against cuBLAS's best shape, and what the per-op
#   model leaves out: the stack's fragmentation of the step, its unmodelled copies). Fitted on the
#   calibration set's A100 runs (``python benchmarks/calibration_set.py --fit``: torchtitan's 8B and 70B
#   on 64 A100, geometric mean), the only runs of this stack on a part whose GEMM rate is measured.
TORCH_EAGER_GEMM_SHARE = 0.805
# - torchtitan's H100 runs used a power-limited part (96 GB HBM2e at 500 W, docs/performance.md of
#   torchtitan), whose clocks under a GEMM sit below the 700 W SXM5's: no GEMM rate of it is published,
#   so its share of the 700 W part's rate is the one device figure the calibration set fits
#   (``--fit``: its two 8B runs, given the stack share above). It prices that part alone (``h100-96g``).
H100_500W_GEMM_SHARE = 0.744
# Work per layer call at which a GPU reaches half its large-layer efficiency:
# about a 1024×1024×1024 bf16 GEMM (2 GFLOP). Not fitted; a stated assumption.
GPU_HALF_EFFICIENCY_FLOPS = 2e9


def device_gemm_efficiency(family: str) -> float:
    """The large-k, whole-wave GEMM efficiency of a GPU family: its best measured GEMM's rate over its bf16
    peak (``gpu_figures.BEST_GEMM``), divided by the shape factor the op model gives that GEMM's shape on the
    part measured, so that the op model prices the measured GEMM at the measured rate."""
    rate, (m, n, k), peak, hbm = BEST_GEMM[family]
    ops = _op_model(family, peak / 1e12, hbm / GB)
    return rate / peak / ops.shape_factor(m, n, k)


_NVLINK_A100 = LinkSpec(bandwidth_bytes_s=230 * GB, latency_s=NVLINK_STEP_LATENCY_S)
_NVLINK_H100 = LinkSpec(bandwidth_bytes_s=370 * GB, latency_s=NVLINK_STEP_LATENCY_S)
_NVLINK_V100 = LinkSpec(bandwidth_bytes_s=130 * GB, latency_s=NVLINK_STEP_LATENCY_S)
_HDR_NIC = LinkSpec(bandwidth_bytes_s=24 * GB, latency_s=NET_STEP_LATENCY_S)
_NDR_NIC = LinkSpec(bandwidth_bytes_s=46 * GB, latency_s=NET_STEP_LATENCY_S)
_EDR_NIC = LinkSpec(bandwidth_bytes_s=11 * GB, latency_s=NET_STEP_LATENCY_S)


def _op_model(chip: str, bf16: float, hbm: float, gemm_efficiency: float | None = None) -> OpModel:
    """``chip``'s per-op terms (``gpu_figures``); ``gemm_efficiency``: its large-GEMM η_max at full power, over
    whose rate its measured attention rates become the relative ``attention_fwd`` / ``attention_bwd``."""
    rates = ATTENTION_TFLOPS.get(chip) if gemm_efficiency else None
    fwd, bwd = ((rates[0] / (gemm_efficiency * bf16), rates[1] / (gemm_efficiency * bf16)) if rates
                else (ATTENTION_FWD_RELATIVE, ATTENTION_BWD_RELATIVE))
    return OpModel(sm_count=SM_COUNT[chip], tile_m=GEMM_TILE_M, tile_n=GEMM_TILE_N,
                   gemm_k_half=gemm_k_half(bf16 * 1e12, hbm * GB), kernel_overhead_s=GPU_KERNEL_OVERHEAD_S,
                   bandwidth_fraction=BANDWIDTH_FRACTION.get(chip, GPU_BANDWIDTH_FRACTION), attention_fwd=fwd,
                   attention_bwd=bwd, masked_attention_fwd=MASKED_ATTENTION_FWD,
                   masked_attention_bwd=MASKED_ATTENTION_BWD, host_op_s=HOST_OP_S)


def _gpu(name: str, mem_gib: float, bf16: float, fp32: float, hbm: float, family: str,
         share: float = 1.0) -> DeviceSpec:
    """A GPU whose GEMMs reach ``family``'s measured efficiency (× ``share`` for a power-limited part), × the
    eager stack's share of it; its attention at its chip's measured rate (× ``share`` alike)."""
    full = device_gemm_efficiency(family) * TORCH_EAGER_GEMM_SHARE
    chip = name.split("-")[0]
    return DeviceSpec(name, int(mem_gib * GiB), bf16 * 1e12, fp32 * 1e12, hbm * GB, full * share,
                      GPU_HALF_EFFICIENCY_FLOPS, _op_model(chip, bf16, hbm, full),
                      FP8_DENSE_TFLOPS.get(chip, 0.0) * 1e12)


def _dgx(name: str, device: DeviceSpec, nvlink: LinkSpec, nic: LinkSpec) -> ClusterSpec:
    return ClusterSpec(name, device, gpus_per_node=8, nodes=1, intra_node=nvlink,
                       inter_node=nic, nics_per_node=8, memory_reserve_fraction=0.0,
                       latency_per_step=True, nccl_tuning=True, cuda_context_bytes=CUDA_CONTEXT_BYTES,
                       nccl_buffer_bytes=NCCL_BUFFER_BYTES,
                       allocator_overhead_fraction=ALLOCATOR_OVERHEAD_FRACTION)


# The local machine: one gloo process per "device", sharing the host's cores and
# memory. Conservative figures for a small CPU host; a cluster file can carry
# measured ones.
_CPU = ClusterSpec(
    "cpu",
    DeviceSpec("cpu", memory_bytes=2 * GiB, peak_flops_bf16=20e9, peak_flops_fp32=20e9,
               memory_bandwidth_bytes_s=10 * GB, matmul_efficiency=0.5,
               half_efficiency_flops=1e7),
    gpus_per_node=8, nodes=1,
    intra_node=LinkSpec(bandwidth_bytes_s=1 * GB, latency_s=100e-6),
    inter_node=LinkSpec(bandwidth_bytes_s=1 * GB, latency_s=100e-6),
    nics_per_node=1, backend="gloo", memory_reserve_fraction=0.25,
)

PRESETS: dict[str, ClusterSpec] = {
    c.name: c
    for c in [
        _dgx("a100-40g", _gpu("A100-SXM4-40GB", 40, 312, 19.5, 1555, "A100"), _NVLINK_A100, _HDR_NIC),
        _dgx("a100-80g", _gpu("A100-SXM4-80GB", 80, 312, 19.5, 2039, "A100"), _NVLINK_A100, _HDR_NIC),
        _dgx("h100-80g", _gpu("H100-SXM5-80GB", 80, 989, 67, 3350, "H100"), _NVLINK_H100, _NDR_NIC),
        _dgx("h100-96g", _gpu("H100-SXM5-96GB-500W", 95, 989, 67, 2400, "H100", H100_500W_GEMM_SHARE),
             _NVLINK_H100, _NDR_NIC),
        _dgx("h200", _gpu("H200-SXM-141GB", 140, 989, 67, 4800, "H200"), _NVLINK_H100, _NDR_NIC),
        # no measured V100 GEMM: A100's efficiency (BEST_GEMM), a stated borrowing
        _dgx("v100-16g", _gpu("V100-SXM2-16GB", 16, 125, 15.7, 900, "A100"), _NVLINK_V100, _EDR_NIC),
        _CPU,
    ]
}


def preset_for_device(name: str, memory_bytes: int | None = None) -> str | None:
    """The GPU preset for a CUDA device, or None when none matches.

    ``name`` as ``torch.cuda.get_device_name()`` gives it ("NVIDIA A100-SXM4-80GB",
    "NVIDIA H100 80GB HBM3", "NVIDIA H200"), ``memory_bytes`` its total memory
    (without it, the "80GB" in the name, if any). A preset matches when its
    device's family (A100, H100, H200, V100) is a word of the name and the
    memory is within 0.9–1.05 × the preset's. A MIG slice, another memory size
    (a V100 32GB) or another chip (GH200, L4) matches nothing. The presets are
    8-GPU NVLink nodes, so a PCIe card matches its chip's preset.
    """
    if re.search(r"\bMIG\b", name):
        return None
    if memory_bytes is None:
        sized = re.search(r"(\d+)\s*GB", name)
        memory_bytes = int(sized.group(1)) * GiB if sized else None
    matches = []
    for preset, spec in PRESETS.items():
        family = spec.device.name.split("-")[0]
        if spec.backend != "nccl" or not re.search(rf"(?<![A-Za-z0-9]){family}(?![0-9])", name):
            continue
        if memory_bytes is None or 0.9 <= memory_bytes / spec.device.memory_bytes <= 1.05:
            matches.append(preset)
    return matches[0] if len(matches) == 1 else None


def load_cluster(name_or_path: str) -> ClusterSpec:
    """A preset by name, or a cluster from a ``.json`` / ``.toml`` file."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if path.suffix.lower() not in (".json", ".toml"):
        raise ClusterError(
            f"unknown cluster {name_or_path!r}: use one of {', '.join(sorted(PRESETS))} "
            "or a .json/.toml cluster file"
        )
    return load_cluster_file(path)
