"""The per-op compute terms, measured: GEMMs of several shapes, an elementwise pass, fused attention.

What ``cost_models.compute`` prices op by op, timed on this device (``autopar
calibrate`` on every rank at once; ``benchmarks/gpu_compute.py`` on a lent
GPU): a sweep of GEMM shapes, from which :func:`autopar.tools.calibrate.fit.fit_gemm`
fits the large-GEMM rate, the reduction depth at half rate and the per-kernel
overhead; the bytes an elementwise add moves per second; scaled dot-product
attention forward and backward, as a fraction of the GEMM rate; and what
torch.compile leaves of a chain of two memory-bound ops (:func:`fused_chain`); and the host's time per op
(:func:`host_per_op`): a transformer block's forward and backward on tiny tensors, which the host paces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Timer = Callable[[Callable[[], Any]], float]  # seconds of one call of fn, as the caller measures it


@dataclass(frozen=True)
class OpProbeSizes:
    """The shapes probed: GEMMs (m, n, k), the elements of the elementwise pass, attention's
    (batch, heads, sequence, head dim)."""

    gemms: tuple[tuple[int, int, int], ...]
    elementwise: int
    attention: tuple[int, int, int, int]


CPU_OP_SIZES = OpProbeSizes(
    gemms=((256, 256, 32), (256, 256, 128), (256, 256, 512), (512, 512, 64), (512, 512, 512),
           (64, 512, 512), (16, 512, 512), (768, 768, 768)),
    elementwise=1 << 22, attention=(1, 4, 256, 64))
GPU_OP_SIZES = OpProbeSizes(
    gemms=((8192, 8192, 256), (8192, 8192, 1024), (8192, 8192, 4096), (8192, 8192, 8192),
           (2048, 3072, 8192), (256, 8192, 8192), (16, 8192, 8192), (8448, 8192, 4096)),
    elementwise=1 << 28, attention=(4, 16, 2048, 128))


def gemm_sweep(torch: Any, device: Any, dtype: Any, shapes: Sequence[tuple[int, int, int]],
               timer: Timer) -> list[dict[str, float]]:
    """Seconds of one (m × k)·(k × n) product per shape."""
    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        out.append({"m": m, "n": n, "k": k, "seconds": timer(lambda: torch.mm(a, b))})
    return out


def elementwise_bandwidth(torch: Any, device: Any, dtype: Any, elements: int, timer: Timer) -> dict[str, float]:
    """Bytes an out-of-place add moves (two reads, one write) and its seconds."""
    x = torch.randn(elements, device=device, dtype=dtype)
    y = torch.randn(elements, device=device, dtype=dtype)
    z = torch.empty_like(x)
    seconds = timer(lambda: torch.add(x, y, out=z))
    return {"bytes": 3.0 * elements * x.element_size(), "seconds": seconds}


def attention_times(torch: Any, device: Any, dtype: Any, shape: tuple[int, int, int, int],
                    timer: Timer) -> dict[str, float]:
    """Forward and backward seconds of causal scaled dot-product attention, and its forward FLOPs
    as capture counts them (the full T×T work)."""
    import torch.nn.functional as F

    b, h, s, d = shape
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.ones(b, h, s, d, device=device, dtype=dtype)

    def forward() -> Any:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    out = forward()  # the backward is timed alone, on a graph kept between runs

    def backward() -> None:
        out.backward(grad, retain_graph=True)

    return {"flops": 4.0 * b * h * s * s * d, "fwd_s": timer(forward), "bwd_s": timer(backward)}


def fused_chain(torch: Any, device: Any, dtype: Any, elements: int, timer: Timer,
                everyone: Callable[[bool], bool] = bool) -> dict[str, Any]:
    """Seconds of ``relu(x · 2)`` eager (two kernels, each reading and writing the tensor) and compiled
    (inductor fuses them into one pass): the measured form of pricing's assumption that a compiled
    memory-bound op fuses with one neighbour (``cost_models.compute``), whose ratio is the op model's
    ``compiled_memory_bound_fraction``. Empty where torch.compile cannot run here (no C++ compiler for
    inductor's CPU backend, say): the fraction then stays the presets'; ``error`` says why.
    ``everyone(ok)``: whether the compile worked on every rank (the timer is a collective: all time it,
    or none)."""
    x = torch.randn(elements, device=device, dtype=dtype)

    def chain(t: Any) -> Any:
        return torch.relu(t * 2.0)

    eager = timer(lambda: chain(x))
    error = ""
    try:
        fused = torch.compile(chain, fullgraph=True, dynamic=False)
        fused(x)  # compiles
    except Exception as exc:  # inductor's toolchain missing or broken: not measured, and said so
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    if not everyone(not error):
        return {"error": error or "torch.compile failed on another rank"}
    return {"elements": float(elements), "eager_s": eager, "compiled_s": timer(lambda: fused(x))}


# A transformer block small enough that every kernel is a few microseconds: its forward and backward take
# the host's time issuing them, whatever the device. (batch, sequence, width, heads)
HOST_BLOCK = (1, 8, 16, 2)


def host_per_op(torch: Any, device: Any, dtype: Any, timer: Timer) -> dict[str, float]:
    """Seconds of a tiny GPT block's forward and backward, and the ops capture records for it
    (``planning.layer_compute.host_ops``): their ratio is the op model's ``host_op_s`` on a GPU, whose host
    issues kernels the device runs at once. The block is captured on the meta device, so it is counted as
    pricing counts every layer."""
    import autopar
    from autopar.planning.layer_compute import host_ops

    b, s, d, h = HOST_BLOCK
    model = _host_model(torch, d, h, 3)
    graph = autopar.capture(model.to("meta"), (torch.zeros(b, s, d, device="meta"),))
    fwd_ops, bwd_ops = host_ops(next(layer for layer in graph if layer.name == "blocks.0"))
    block = _host_model(torch, d, h, 1).blocks[0].to(device=device, dtype=dtype)
    x = torch.randn(b, s, d, device=device, dtype=dtype, requires_grad=True)

    def step() -> None:
        block(x).sum().backward()

    return {"ops": fwd_ops + bwd_ops, "seconds": timer(step)}


def _host_model(torch: Any, width: int, heads: int, layers: int) -> Any:
    """A GPT of ``layers`` pre-norm blocks (causal SDPA, a GELU MLP) over ``width``-wide inputs."""
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x: Any) -> Any:
            b, s, d = x.shape
            q, k, v = self.qkv(self.ln_1(x)).split(d, dim=2)
            q, k, v = (t.view(b, s, heads, d // heads).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
            x = x + self.proj(y)
            return x + self.out(F.gelu(self.fc(self.ln_2(x))))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(layers))

        def forward(self, x: Any) -> Any:
            for block in self.blocks:
                x = block(x)
            return x

    return Model()
