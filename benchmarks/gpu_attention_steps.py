"""The fused attention kernels of one ring-attention step at torchtitan's long-context shapes, measured on
the GPU check's device beside what pricing charges for them (``cost_models.compute.attention_time_s``).

    python benchmarks/gpu_attention_steps.py              # on a GPU (the GPU check calls it too)
    python benchmarks/gpu_attention_steps.py --dry        # CPU, tiny: checks the script runs

torchtitan's context-parallel table (``benchmarks/torchtitan_cp.py``: Llama 3.1 8B on 8 H100s, 32K–256K
tokens, cp 1–8) holds 32,768 tokens on every GPU in every row, so each ring step computes the same
kernels: step 0 the rank's queries against its own K/V (causal, L × L with L = 32,768), every later step
one unmasked half block under the head-tail layout (L queries against the earlier L/2 of the K/V, or the
later L/2 queries against all L). Per layer: 32 query heads of 128 (torchtitan repeats the 8 K/V heads
before SDPA), batch 1, bf16. Each kernel is timed forward and backward on every SDPA backend this device
runs (flash, memory-efficient, cuDNN), as a rate and against the priced time on the preset the table is
priced on (``h100-96g``: the same Hopper tensor cores as this check's H200, whose extra bandwidth does
not bound these kernels). The per-step line adds what one ring step costs the 8B's 32 layers under full
recompute (forward twice, backward once), measured and priced.

Measurements only: nothing here changes a preset.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

GPU_SHAPE = {"tokens": 32768, "heads": 32, "head_dim": 128, "layers": 32}  # torchtitan's 8B, 32K a GPU
DRY_SHAPE = {"tokens": 256, "heads": 4, "head_dim": 16, "layers": 2}
PRICED_ON = "h100-96g"


def kernels(tokens: int) -> tuple[tuple[str, int, int, bool], ...]:
    """(name, query tokens, key tokens, causal) of one ring step's attention calls at ``tokens`` a rank."""
    half = tokens // 2
    return (("step 0: own chunk, causal", tokens, tokens, True),
            ("later step: all queries, early half of K/V", tokens, half, False),
            ("later step: late half of queries, all K/V", half, tokens, False))


def _time(torch: Any, fn: Any, cuda: bool, reps: int) -> float:
    """Median seconds of ``fn`` (CUDA events on a GPU) after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            import time

            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(dry: bool) -> dict[str, Any]:
    """Every backend's forward and backward seconds per kernel, with rates and the priced times."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from autopar.cost_models.compute import attention_time_s
    from autopar.cost_models.presets import load_cluster

    cuda = not dry and torch.cuda.is_available()
    device, dtype = (torch.device("cuda", 0), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    shape = DRY_SHAPE if dry else GPU_SHAPE
    h, d = shape["heads"], shape["head_dim"]
    spec = load_cluster(PRICED_ON).device
    backends = ((("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                 ("cudnn", SDPBackend.CUDNN_ATTENTION)) if cuda else (("cpu flash", SDPBackend.FLASH_ATTENTION),))
    rows, errors = [], {}
    for backend, which in backends:
        for name, sq, sk, causal in kernels(shape["tokens"]):
            g = torch.Generator(device=device).manual_seed(0)
            q = torch.randn(1, h, sq, d, device=device, dtype=dtype, generator=g, requires_grad=True)
            k, v = (torch.randn(1, h, sk, d, device=device, dtype=dtype, generator=g, requires_grad=True)
                    for _ in range(2))
            grad = torch.randn(1, h, sq, d, device=device, dtype=dtype, generator=g)
            try:
                with sdpa_kernel([which]):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    fwd = _time(torch, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), cuda,
                                reps=5 if cuda else 2)
                    bwd = _time(torch, lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), cuda,
                                reps=5 if cuda else 2)
            except RuntimeError as exc:  # this backend does not run this shape or device: said, not timed
                errors[backend] = str(exc).splitlines()[0][:200]
                break
            flops = 4.0 * h * sq * sk * d  # the full Sq × Sk work, as capture counts it
            executed = flops * (0.5 if causal else 1.0)
            priced_f = attention_time_s(flops, spec, "bf16", causal=causal)
            priced_b = attention_time_s(flops, spec, "bf16", causal=causal, backward=True)
            rows.append({"backend": backend, "kernel": name, "q_tokens": sq, "kv_tokens": sk, "causal": causal,
                         "fwd_s": fwd, "bwd_s": bwd, "fwd_tflops": executed / fwd / 1e12,
                         "bwd_tflops": 2.5 * executed / bwd / 1e12, "priced_fwd_s": priced_f,
                         "priced_bwd_s": priced_b})
    steps = {}
    for backend in {r["backend"] for r in rows}:
        later = [r for r in rows if r["backend"] == backend and not r["causal"]]
        if later:  # a later ring step, full recompute: forward twice and backward once, every layer
            step = statistics.mean(2 * r["fwd_s"] + r["bwd_s"] for r in later) * shape["layers"]
            priced = statistics.mean(2 * r["priced_fwd_s"] + r["priced_bwd_s"] for r in later) * shape["layers"]
            steps[backend] = {"measured_s": step, "priced_s": priced, "ratio": step / priced}
    return {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
            "shape": shape, "priced_on": PRICED_ON, "kernels": rows, "ring_step": steps, "errors": errors}


def summary(result: dict[str, Any]) -> str:
    lines = [f"{'backend':10s} {'kernel':44s} fwd ms (TFLOP/s, priced ms)   bwd ms (TFLOP/s, priced ms)"]
    for r in result["kernels"]:
        lines.append(f"{r['backend']:10s} {r['kernel']:44s} {r['fwd_s'] * 1e3:8.2f} ({r['fwd_tflops']:5.0f}, "
                     f"{r['priced_fwd_s'] * 1e3:7.2f})   {r['bwd_s'] * 1e3:8.2f} ({r['bwd_tflops']:5.0f}, "
                     f"{r['priced_bwd_s'] * 1e3:7.2f})")
    for backend, s in sorted(result["ring_step"].items()):
        lines.append(f"one later ring step, {result['shape']['layers']} layers, full recompute, {backend}: "
                     f"{s['measured_s']:.3f} s measured, {s['priced_s']:.3f} s priced ({s['ratio']:.2f})")
    lines += [f"{b}: not run ({e})" for b, e in result["errors"].items()]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="CPU and tiny shapes: check the script runs")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the results here")
    args = parser.parse_args()
    result = measure(args.dry)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
