"""Tensor-parallel runtime overhead: autopar's graph-derived TP vs hand-written ``parallelize_module``.

    python benchmarks/tp_overhead.py [--steps 40]

At W=2 (gloo, CPU), two GPTs are trained with Megatron TP on every block:
the project's GPT (examples/gpt.py) and a nanoGPT written as its author
writes it (tests/zoo.py: ``B, T, C = x.size()``, ``split(n_embd)``,
``C // n_head``). autopar runs each model's own forward under the sharding
rules it proved at capture; the hand-written version permutes the fused
q/k/v rows, applies ``ColwiseParallel``/``RowwiseParallel`` and adapts the
head counts (and, for nanoGPT, the forward's widths) by hand. Steps
alternate between the two; the median step time of each and their ratio are
printed (target: autopar / hand-written ≤ 1.05).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from runtime_overhead import _manual_step, spawn_and_report  # noqa: E402 - the same hand-written step, timed alike

SEQ, BATCH, VOCAB = 64, 8, 2048


def build(kind: str) -> tuple[nn.Module, tuple, str]:
    torch.manual_seed(0)
    if kind == "gpt":
        import gpt

        model, inputs = gpt.gpt(n_layer=4, d_model=256, n_head=8, vocab_size=VOCAB, seq_len=SEQ, device="cpu")
        return model, inputs, "blocks.*"
    import zoo

    model = zoo.NanoGPT(zoo.NanoConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=4, n_head=8, n_embd=256,
                                       flash=True))
    return model, (torch.zeros(BATCH, SEQ, dtype=torch.long),), "transformer.h.*"


def _nano_local_forward(self, x):
    """nanoGPT's attention with its widths made this rank's share by hand."""
    B, T, _ = x.size()
    C = self.n_embd
    q, k, v = self.c_attn(x).split(C, dim=2)
    q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


def hand_written(kind: str, model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = mesh.size()
    blocks = model.blocks if kind == "gpt" else model.transformer.h
    for block in blocks:
        attn = block.attn
        width = attn.d_model if kind == "gpt" else attn.n_embd
        h = attn.n_head
        rows = torch.arange(3 * width).view(3, tp, width // tp)  # (q|k|v, rank, rows)
        perm = rows.transpose(0, 1).reshape(-1)
        with torch.no_grad():
            attn.c_attn.weight.copy_(attn.c_attn.weight[perm])
            attn.c_attn.bias.copy_(attn.c_attn.bias[perm])
        attn.n_head = h // tp
        if kind == "gpt":
            attn.d_model = width // tp
        else:
            attn.n_embd = width // tp
            attn.forward = types.MethodType(_nano_local_forward, attn)
        parallelize_module(block, mesh, {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                                         "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
    return model


def _worker(rank: int, world_size: int, store: str, steps: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import autopar

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    lines = []
    for kind in ("gpt", "nanogpt"):
        model, inputs, blocks = build(kind)
        graph = autopar.capture(model, inputs)
        prefix = blocks.removesuffix(".*") + "."
        pins = ["pp=1", "dp=1", f"tp={world_size}", "zero=0", "recompute=none", "microbatches=1",
                f"{blocks}:tp=megatron"] + [f"{l.name}:tp=none" for l in graph if not l.name.startswith(prefix)]
        plan = autopar.solve(graph, world_size, cluster="cpu", dtype="fp32", global_batch=BATCH, pins=pins)

        def sgd(p):
            return torch.optim.SGD(p, lr=0.01, momentum=0.9)

        pm = autopar.compile(build(kind)[0], plan=plan, graph=graph, optimizer=sgd)
        manual = hand_written(kind, build(kind)[0], mesh)
        opt = sgd(manual.parameters())
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        times: dict[str, list[float]] = {"autopar": [], "manual": []}
        losses: dict[str, float] = {}
        for i in range(steps + 3):  # 3 warm-up steps
            for name in ("autopar", "manual") if i % 2 else ("manual", "autopar"):
                dist.barrier()
                t = time.perf_counter()
                losses[name] = pm.train_step(x, y) if name == "autopar" else _manual_step(manual, opt, x, y)
                if i >= 3:
                    times[name].append(time.perf_counter() - t)
        a, m = statistics.median(times["autopar"]), statistics.median(times["manual"])
        params = sum(p.numel() for p in build(kind)[0].parameters())
        lines.append(f"{kind:8s} {params / 1e6:4.1f}M  autopar {a * 1e3:7.1f} ms   hand-written {m * 1e3:7.1f} ms   "
                     f"ratio {a / m:5.3f}   final loss {losses['autopar']:.5f} vs {losses['manual']:.5f}")
    if rank == 0:
        Path(out).write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    spawn_and_report(_worker, 2, args.steps,
                     f"TP=2 on every block, batch {BATCH}×{SEQ}, W=2 gloo on CPU, median of {args.steps} steps")


if __name__ == "__main__":
    main()
