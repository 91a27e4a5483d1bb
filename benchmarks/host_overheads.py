"""What a recomputed block costs the host beyond its ops, measured where the kernels are negligible.

    python benchmarks/host_overheads.py

On one CPU thread with tiny tensors (every kernel a few hundred nanoseconds, so the time is the host's),
for a GPT block (``examples/gpt.py``) and a Hugging Face Llama decoder layer built from a tiny config:
forward + backward eager, then under full recompute as autopar lowers it (composable ``checkpoint``,
``passes/recompute.py``). It prints the extra time checkpointing adds beyond the recomputed forward, in
units of the block's own host time per op that capture records (its eager forward + backward over
:func:`autopar.planning.layer_compute.host_ops`): :data:`autopar.cost_models.gpu_figures.CHECKPOINT_HOST_OPS`
is that figure per forward op, which pricing scales by each host's measured per-op time. Then the same
forward + backward under ``torch.compile`` (inductor's C++ kernels here): its host time against eager's is
:data:`autopar.cost_models.gpu_figures.COMPILED_HOST_SHARE` (guards, autograd's compiled wrappers and the
launches of fused kernels, where eager dispatches every op).
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def _median_s(fn, calls: int = 200, rounds: int = 7) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def measure(name: str, block: torch.nn.Module, layer, make_input, sync=lambda: None) -> list[dict[str, float]]:
    """Host seconds of ``block``'s forward + backward eager and under each recompute kind, and each kind's
    machinery (beyond the ops it re-runs) in units of the block's host time per recorded op."""
    from autopar.choice import Recompute
    from autopar.graph import OpKind
    from autopar.passes.recompute import checkpoint_modules
    from autopar.planning.layer_compute import host_ops

    x = make_input()
    fwd_ops, bwd_ops = host_ops(layer)
    memory = sum(op.count for op in layer.ops if op.kind is OpKind.MEMORY)
    gemms = sum(op.count for op in layer.ops if op.kind is OpKind.GEMM)
    rerun = {Recompute.FULL: fwd_ops, Recompute.SELECTIVE: memory, Recompute.ALTERNATE_MM: memory + gemms / 2}

    def step(mod):
        def run() -> None:
            out = mod(x)
            (out[0] if isinstance(out, tuple) else out).sum().backward()
            sync()
        return run

    def forward() -> None:
        out = block(x)
        sync()
        del out

    eager = _median_s(step(block))
    fwd = _median_s(forward)
    per_op = eager / (fwd_ops + bwd_ops)
    rows = []
    for kind, ops in rerun.items():
        holder = torch.nn.Module()
        holder.block = copy.deepcopy(block)
        checkpoint_modules(holder, ["block"], {"block": kind})
        recomputed = _median_s(step(holder.block))
        machinery = recomputed - eager - fwd * ops / fwd_ops
        rows.append({"block": name, "recompute": kind.name.lower(), "forward_ops": fwd_ops, "backward_ops": bwd_ops,
                     "eager_s": eager, "forward_s": fwd, "recomputed_s": recomputed, "host_per_op_s": per_op,
                     "machinery_s": machinery, "machinery_ops_per_forward_op": machinery / per_op / fwd_ops})
    compiled = torch.compile(copy.deepcopy(block))
    step(compiled)()  # compile once, outside the timing
    seconds = _median_s(step(compiled))
    rows.append({"block": name, "recompute": "compiled, none", "forward_ops": fwd_ops, "backward_ops": bwd_ops,
                 "eager_s": eager, "forward_s": fwd, "recomputed_s": seconds, "host_per_op_s": per_op,
                 "compiled_share": seconds / eager})
    return rows


CPU = torch.device("cpu")


def cases(device: torch.device = CPU, dtype: torch.dtype = torch.float32):
    """(name, block on ``device`` in ``dtype``, its captured layer, its input) for a GPT block and an HF Llama
    decoder layer, both tiny."""
    import gpt
    from transformers import LlamaConfig, LlamaForCausalLM

    import autopar

    net, inputs = gpt.gpt(n_layer=3, d_model=16, n_head=2, vocab_size=64, seq_len=8, device="cpu")
    graph = autopar.capture(net, inputs)
    block = next(lay for lay in graph if lay.name == "blocks.0")
    yield ("gpt block", net.blocks[0].to(device=device, dtype=dtype), block,
           lambda: torch.randn(1, 8, 16, device=device, dtype=dtype, requires_grad=True))

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, use_cache=False)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (1, 8))
    graph = autopar.capture(model, (ids,))
    layer = next(lay for lay in graph if lay.name.endswith("layers.0"))
    model = model.to(device=device, dtype=dtype)
    rotary = model.model.rotary_emb
    decoder = model.model.layers[0]
    positions = torch.arange(8, device=device).unsqueeze(0)

    class Layer(torch.nn.Module):  # the decoder layer with its position embeddings, as the model calls it
        def __init__(self) -> None:
            super().__init__()
            self.block = decoder

        def forward(self, h):
            return self.block(h, position_embeddings=rotary(h, positions))

    yield "HF Llama layer", Layer(), layer, lambda: torch.randn(1, 8, 16, device=device, dtype=dtype,
                                                                requires_grad=True)


def summarise(device: torch.device = CPU, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Per block (GPT, Llama): the host's time per recorded op, each recompute policy's machinery in ops per
    forward op, and the compiled share: the figures ``gpu_figures`` prices, measured on ``device``."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out: dict[str, float] = {}
    for name, block, layer, make_input in cases(device, dtype):
        for r in measure(name, block, layer, make_input, sync):
            key = name.split()[0].lower()
            out[f"{key}.host_per_op_s"] = r["host_per_op_s"]
            if "compiled_share" in r:
                out[f"{key}.compiled_share"] = r["compiled_share"]
            else:
                out[f"{key}.{r['recompute']}_ops_per_forward_op"] = r["machinery_ops_per_forward_op"]
    return out


def raw_op_s() -> float:
    """One eager op called from Python on tiny tensors: the dispatcher and the call, no module around it."""
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    return statistics.median(_median_s(fn) for fn in (lambda: torch.mm(a, b), lambda: a + b, lambda: a * b))


def main() -> None:
    torch.set_num_threads(1)
    raw = raw_op_s()
    print(f"an eager op on tiny tensors: {raw * 1e6:.2f} µs (median of mm, add, mul)")
    for name, block, layer, make_input in cases():
        for r in measure(name, block, layer, make_input):
            if "compiled_share" in r:
                print(f"{r['block']}, compiled: forward + backward {r['recomputed_s'] * 1e6:.0f} µs against eager "
                      f"{r['eager_s'] * 1e6:.0f} µs: {r['compiled_share']:.2f} of the eager host time")
                continue
            print(f"{r['block']}, {r['recompute']}: {r['forward_ops']:.0f} + {r['backward_ops']:.0f} recorded ops; "
                  f"eager forward + backward {r['eager_s'] * 1e6:.0f} µs ({r['host_per_op_s'] * 1e6:.1f} µs an op), "
                  f"forward {r['forward_s'] * 1e6:.0f} µs, recomputed {r['recomputed_s'] * 1e6:.0f} µs: machinery "
                  f"{r['machinery_s'] * 1e6:.0f} µs = {r['machinery_ops_per_forward_op']:.1f} ops per forward op; "
                  f"framework beyond the op itself {(r['host_per_op_s'] - raw) * 1e6:.1f} µs a recorded op")

if __name__ == "__main__":
    main()
