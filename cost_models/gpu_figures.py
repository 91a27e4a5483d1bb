"""The public figures the GPU presets are built from, each with its source.

Numbers only (no cost-model code): :mod:`autopar.cost_models.hardware` builds the
presets from them, and docs/cost-model.md cites the same sources.
"""

# Link latencies are NCCL's per ring step (ring/simple hwLat in NVIDIA/nccl src/graph/tuning.cc:
# 3.4 µs a step over NVLink, 14 µs over the network); collectives add NCCL's base latency and
# choose ring or tree there (``nccl_tuning``, cost_models/communication.py), point-to-point
# sends pay one step.
NVLINK_STEP_LATENCY_S = 3.4e-6
NET_STEP_LATENCY_S = 14.0e-6

# What a GPU rank keeps outside the planner's tensors (ClusterSpec.memory_budget):
# - the CUDA context: 645,464,064 bytes measured on an H200 (torch 2.11.0+cu130, the free memory a
#   parent sees drop while a child holds a context: benchmarks/gpu_memory.py, run by the GPU check on
#   2026-12-04, docs/benchmarks.md); the figure cited before it, "around 400MB if CUDA >= 11.7 is used
#   and lazy module loading enabled" (pytorch/pytorch#109888), was 0.62 of it.
CUDA_CONTEXT_BYTES = 645_464_064
# - NCCL's buffers, allocated by NCCL outside the caching allocator, per communicator: each
#   channel's ring keeps 2 connections whatever the scale (sjeaugey, NVIDIA/nccl#864 / #986),
#   each with a FIFO per protocol: Simple NCCL_BUFFSIZE 4 MiB (DEFAULT_BUFFSIZE, src/init.cc),
#   LL128 120 elements × 640 threads × 8 steps × 8 B = 4.69 MiB, LL 8 lines × 512 threads ×
#   8 steps × 16 B = 512 KiB (DEFAULT_LL128_BUFFSIZE / DEFAULT_LL_BUFFSIZE, src/init.cc, with
#   src/include/device.h); up to 32 channels on an NVSwitch node (NCCL_MAX_NCHANNELS; 32
#   channels per GPU pair seen on 8 × H100 in NVIDIA/nccl#1685). A plan opens one communicator
#   per mesh axis it splits (pp, dp, tp): three at most, which the budget keeps back.
NCCL_CONNECTION_BYTES = 4 * 2**20 + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16
NCCL_CHANNELS = 32
NCCL_RING_CONNECTIONS = 2
NCCL_COMMUNICATORS = 3
NCCL_BUFFER_BYTES = NCCL_COMMUNICATORS * NCCL_CHANNELS * NCCL_RING_CONNECTIONS * NCCL_CONNECTION_BYTES
# - the caching allocator's reserved-over-allocated overhead: large blocks are rounded up to 2 MiB and split
#   from cached segments, so memory_reserved exceeds max_memory_allocated by a share that depends on the
#   allocation pattern (pytorch/pytorch#35901, and expandable_segments, pytorch/pytorch#96995, which exists
#   to reduce it): fragmentation, a fact of the software stack, not the device. Fitted on the calibration
#   set's runs that publish their peak reserved memory (torchtitan's two 8B runs on H100: reserved over the
#   predicted allocated peak 1.061 and 1.053; ``python benchmarks/calibration_set.py --fit``, geometric
#   mean). It was 0.10, a stated assumption. One H200 run of a GPT-125M under FSDP2 reserved 1.30× (docs/
#   benchmarks.md "One H200"): a small model on one rank, whose few large tensors round up more; one point,
#   not used.
ALLOCATOR_OVERHEAD_FRACTION = 0.057


# Dense float8 (E4M3/E5M2) tensor-core peaks, TFLOP/s: NVIDIA's datasheets give "FP8 Tensor Core
# 3,958 teraFLOPS*" for H100 SXM and for H200 SXM, "* With sparsity", so 1,979 dense (H100 Tensor Core
# GPU datasheet, https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet; H200
# datasheet, https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446). A100 and
# V100 (SM 8.0, 7.0) have no float8 tensor cores: float8 needs SM 8.9 (Ada) or 9.0 (Hopper) and later.
FP8_DENSE_TFLOPS = {"H100": 1979.0, "H200": 1979.0}
# The compute capability float8 matmuls (torch._scaled_mm on CUDA) need.
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)

# Per-op terms of the GPU presets (cost_models.compute prices with them; docs/cost-model.md "Compute model"):
# - GEMM tiles: cuBLAS runs large GEMMs in 256×128 output tiles, one per SM at a time, so a GEMM
#   whose tiles leave the last wave part-empty loses that part (tile and wave quantisation,
#   NVIDIA "Matrix Multiplication Background User's Guide", §2.3 and §3,
#   https://docs.nvidia.com/deeplearning/performance/pdf/Matrix-Multiplication-Background-User-Guide.pdf).
GEMM_TILE_M, GEMM_TILE_N = 256, 128
# - SMs per chip (public specifications; the guide's examples use A100's 108).
SM_COUNT = {"A100": 108, "H100": 132, "H200": 132, "V100": 80}
# - Reduction depth at which a GEMM reaches half its large-k rate: an 8192×8192×k fp16 GEMM on
#   an H800 (Hopper, H100's SMs) runs 386 TFLOP/s at k=256 and 766 at k=16384, 0.50 of it
#   (and 0.82 at k=1024, 0.92 at 2048: k/(k+256) gives 0.80, 0.89); xwhzz/tilelang,
#   benchmark/matmul/README.md.
GEMM_K_HALF = 256.0
#   That ramp is the roofline (Williams, Waterman and Patterson, "Roofline", CACM 2009): a GEMM
#   writes its m × n output whatever k is, so below k ≈ (FLOP/s reached) / (bytes/s moved) it
#   spends as long writing as multiplying (2·m·n·k FLOPs against 2·m·n bf16 bytes). On the H800
#   that is 766 TFLOP/s / (3.35 TB/s × 0.75) ≈ 305, beside the 256 measured. The half point is
#   thus the chip's ratio of compute to memory bandwidth, not a constant: each preset scales the
#   H800's 256 by its own peak/bandwidth ratio against the H800's (989 TFLOP/s dense bf16 and
#   3.35 TB/s HBM3, NVIDIA's H800 SXM5 specifications), ``gemm_k_half``. An A100 (312 TFLOP/s,
#   2.039 TB/s) thus reaches half rate at k ≈ 133, where a Hopper constant made its attention's
#   head-dim-deep (k = 64…128) score GEMMs 1.5–2× too slow.
H800_BF16_FLOPS, H800_HBM_BYTES_S = 989e12, 3.35e12


def gemm_k_half(peak_flops: float, bandwidth_bytes_s: float) -> float:
    """The reduction depth at which a GEMM on a chip with this bf16 peak and memory bandwidth
    reaches half its large-k rate: the H800's measured 256, scaled by the ratio of ridge points."""
    return GEMM_K_HALF * (peak_flops / bandwidth_bytes_s) / (H800_BF16_FLOPS / H800_HBM_BYTES_S)


# - The device's best GEMM: the fastest dense bf16 matmul measured on the part, at the shape it was
#   measured (a device fact, apart from any training stack). stas00/ml-engineering,
#   compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table" (mamf-finder.py
#   over many shapes, CUDA 12.1): A100 SXM 267.9 TFLOP/s of 312 at 6912 × 16384 × 2048 (85.9%), H100 SXM
#   792.1 of 989 at 6144 × 17920 × 2816 (80.1%). H200: 787 TFLOP/s at 4096 × 4096 × 4096 (this project's
#   GPU check on one H200, torch 2.11.0+cu130, 2026-12-04; docs/benchmarks.md "One H200"), 0.80 of peak as
#   the H100's table row. V100 has no measured row: it borrows A100's (presets.py says so). Each preset's
#   large-GEMM efficiency is solved from its row so that the op model's GEMM at that shape runs at the
#   measured rate (``presets.device_gemm_efficiency``), the shape's k-ramp and wave quantisation included.
#   family → (FLOP/s measured, (m, n, k), the bf16 peak and HBM bandwidth of the part measured)
BEST_GEMM = {
    "A100": (267.9e12, (6912, 16384, 2048), 312e12, 2039e9),
    "H100": (792.1e12, (6144, 17920, 2816), 989e12, 3350e9),
    "H200": (787.0e12, (4096, 4096, 4096), 989e12, 4800e9),
}
# - The host: eager PyTorch dispatches every op from one CPU thread (Python, the dispatcher, autograd's
#   bookkeeping, the launch), so a layer cannot run faster than its host issues its kernels. Per op that
#   capture records (``planning.layer_compute.host_ops``): the call and launch, 28 µs on the one H200 host
#   this project was lent (back-to-back eager bf16 ``torch.mm`` calls, benchmarks/gpu_compute.py's GEMM sweep
#   fitted by calibrate's ``fit_gemm``: its per-call term; docs/benchmarks.md "One H200"), plus what a real
#   block spends around each recorded op that a bare call does not (module calls, views, autograd's graph):
#   7 µs, the median of a GPT block's 8.3 and a Hugging Face Llama layer's 5.8 µs beyond a bare op's 0.9 µs,
#   measured where kernels are negligible (one CPU thread, tiny tensors: ``python benchmarks/host_overheads.py``,
#   docs/benchmarks.md "The host"). Two measurements on two hosts: the presets charge their sum per op,
#   forward and backward alike, and ``autopar calibrate`` measures a block's own on the user's host.
HOST_OP_S = 35e-6
# - A checkpointed call's machinery on the host, beyond the ops it re-runs (torch's non-reentrant checkpoint:
#   a saved-tensor hook per tensor saved, the recompute triggered from one, the selective policy asked about
#   every op), in recorded ops per forward op of the block: full 7.0 (GPT block) and 4.0 (Llama layer),
#   selective 17.4 and 12.5, torchtitan's alternate-mm policy 16.6 and 13.7 (``benchmarks/host_overheads.py``;
#   runs on a loaded host spread by about ±30%). Carried to a GPU's host by its per-op time: on the H200 a
#   recomputed GPT-125M block cost 2.7–2.8 ms more per microbatch than an eager one, where 11 forward ops at
#   35 µs with 5.5 such ops each give 2.5 ms (docs/benchmarks.md).
CHECKPOINT_HOST_OPS = {"full": 5.5, "selective": 15.0, "alternate_mm": 15.0}
# - A compiled block's host time against eager's (guards, compiled autograd's wrappers and the fused kernels'
#   launches in place of every op's dispatch): 0.96 for the GPT block, 0.57 for the Llama layer (inductor's C++
#   kernels, ``benchmarks/host_overheads.py``), their geometric mean. On the H200 the compiled GPT-125M step
#   took 1.01× the eager one: host-bound, and compiling did not shorten the host's work there.
COMPILED_HOST_SHARE = 0.74
# - Achievable HBM bandwidth: a device-to-device copy on an A100 80 GB SXM4 moves 1536 GB/s of
#   its 2039 (0.75; AnjaliSandip/FastIceFlo, output/EffectiveMemoryThroughput.md).
GPU_BANDWIDTH_FRACTION = 0.75
#   The H200 measured its own: an elementwise copy at 4.36 TB/s of its 4.8 (0.908; the GPU check, 2026-12-04).
#   Chips without a measurement keep the A100's cited 0.75.
BANDWIDTH_FRACTION = {"H200": 4.36 / 4.8}
# - Fused attention against a plain GEMM on the same A100: FlashAttention-2 forward runs
#   180 TFLOP/s non-causal where its two GEMMs alone (softmax disabled) run 220 (0.82;
#   liangan1/GPU_travel, performance/flash-attn/README.md); its backward runs 124.6 TFLOP/s
#   where the forward runs 169.3 (head dim 128, non-causal: 0.74 of the forward; apache/tvm,
#   tl_doc/flash_perf.md), so 0.82 × 0.74 of the GEMM rate.
ATTENTION_FWD_RELATIVE = 0.82
ATTENTION_BWD_RELATIVE = 0.82 * 0.74
# - Fused attention's rate on each chip, forward and backward TFLOP/s (non-causal, head dim 128, bf16; backward
#   counted as 2.5 × the forward's FLOPs): the kernel torch's SDPA runs there, a device fact apart from the
#   stack's GEMM share. Hopper: torch 2.11's flash kernel on the H200 at torchtitan's long-context shapes
#   (32 heads of 128, 32,768 × 16,384 and 16,384 × 32,768: benchmarks/gpu_attention_steps.py, 2026-12-04),
#   forward 351.6, backward 309.6; the H100 SXM has the same SMs at the same clocks and takes them. A100:
#   FlashAttention-2's forward 180 (liangan1/GPU_travel, above) and its backward at 0.74 of it (apache/tvm,
#   above). A preset's ``attention_fwd`` / ``attention_bwd`` are these over its large-GEMM rate
#   (``presets._op_model``); a chip without a row (V100: no flash kernel) keeps the relative figures above.
ATTENTION_TFLOPS = {"A100": (180.0, 180.0 * 0.74), "H100": (351.6, 309.6), "H200": (351.6, 309.6)}
# - A call with an explicit attn_mask (cp's all-gather, passes/context_parallel.py) cannot run SDPA's flash
#   kernel on CUDA, which takes none: next in torch's default order (flash, memory-efficient, math, cuDNN:
#   aten/src/ATen/Context.h sdp_priority_order) the memory-efficient kernel runs it (the order read, the
#   masked call's backend not itself observed on the device). Measured on an H200 (torch 2.11,
#   bf16, 32 heads of 128, 32,768 × 16,384 and 16,384 × 32,768 unmasked: benchmarks/gpu_attention_steps.py,
#   2026-12-04): forward 180.5 TFLOP/s against flash's 351.6, backward 137.9 against 309.6.
MASKED_ATTENTION_FWD = 180.5 / 351.6
MASKED_ATTENTION_BWD = 137.9 / 309.6
# - What every kernel adds, however small: back-to-back asynchronous launches of an empty kernel
#   peak at about 334,000 a second (3 µs each; http://www.cs.virginia.edu/~mwb7w/cuda_support/kernel_overhead.html).
GPU_KERNEL_OVERHEAD_S = 1 / 334_000
