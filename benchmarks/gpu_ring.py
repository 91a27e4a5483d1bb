"""Ring attention's driver on the GPU check's device (``benchmarks/gpu_check.py``): torch's ring templates
called with CUDA's flash kernel (``passes/context_ring.py``), which the project's CPU machines never run.

At world size 1 the ring is its step 0 alone (no K/V passed), so this checks the CUDA plumbing, not the
ring's steps (those are run against one device on CPU, ``tests/runtime/test_context_ring.py``): the flash
kernel's extra outputs handed to its backward as torch's CUDA ring hands them, grouped-query K/V repeated
inside the op and their gradients summed back, the output and q, k, v gradients against one causal SDPA.
bf16 on CUDA (flash takes no fp32), fp32 with ``--dry`` on CPU.
"""

from __future__ import annotations

from typing import Any

TOLERANCE = {"cuda": 2e-2, "cpu": 1e-5}  # max |error|: bf16's rounding on CUDA, fp32's on CPU


def check(device: Any) -> dict[str, Any]:
    """Max absolute error of the ring's output and gradients against SDPA, per head layout, and whether
    every one is within :data:`TOLERANCE` for the device."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from autopar.passes.context_ring import ring_attention

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    errors: dict[str, list[float]] = {}
    for name, heads, kv_heads in (("mha", 8, 8), ("gqa", 8, 2)):
        g = torch.Generator().manual_seed(3)
        q, k, v, grad = (torch.randn(2, h, 256, 64, generator=g).to(device, dtype)
                         for h in (heads, kv_heads, kv_heads, heads))
        gqa = {"enable_gqa": True} if heads != kv_heads else {}
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*whole, is_causal=True, **gqa)
        ref.backward(grad)
        mine = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*mine, dist.group.WORLD, {"is_causal": True, **gqa})
        out.backward(grad)
        errors[name] = [float((out - ref).abs().max())] + [float((a.grad - b.grad).abs().max())
                                                          for a, b in zip(mine, whole)]
    tolerance = TOLERANCE[device.type]
    return {"errors": errors, "tolerance": tolerance,
            "ok": all(e <= tolerance for layout in errors.values() for e in layout)}
