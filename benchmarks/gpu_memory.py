"""What one GPU can show of the memory the planner keeps back (``cost_models.hardware``), for gpu_check.

On a world of one rank, NCCL's collectives say nothing of time, but memory they do:

- ``cuda_context_bytes``: device memory a fresh process takes when it starts CUDA
  (the free memory the parent sees drop while a child holds a context, less the
  child's own caching-allocator reservation); the presets price what an H200 showed, 645 MB
  (:data:`~autopar.cost_models.hardware.CUDA_CONTEXT_BYTES`).
- ``nccl_world1_bytes``: what a one-rank NCCL communicator takes at its first
  collective (outside the caching allocator). Not the eight-rank ring the preset
  prices (:data:`~autopar.cost_models.hardware.NCCL_BUFFER_BYTES`), a floor of it.
- ``allocator_overhead``: max reserved / max allocated − 1 over FSDP2 training steps
  of a small GPT (``fully_shard`` per block, world size 1), against the preset's
  :data:`~autopar.cost_models.hardware.ALLOCATOR_OVERHEAD_FRACTION`.
- ``forward_units_alive``: in a forward under ``no_grad`` of a GPT whose blocks are
  FSDP2 units resharded after forward, the peak of allocated memory beyond the model and
  its gathered root unit, over the weights one block gathers (0 would say FSDP2 skips
  the copy at world size 1): FSDP2's implicit prefetch keeps two all-gather outputs alive
  (pytorch/pytorch#128884), which pricing counts as the prefetch buffer.

With ``--dry`` (CPU) the FSDP2 steps still run, so the code cannot rot; the CUDA
figures are ``None`` with the reason.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

CHILD = ("import torch, sys; torch.cuda.init(); torch.zeros(1, device='cuda'); torch.cuda.synchronize(); "
         "print(torch.cuda.memory_reserved(), flush=True); sys.stdin.read()")


def cuda_context_bytes() -> int:
    """The device memory a child process's CUDA context takes, seen from this process."""
    import torch

    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        reserved = int(child.stdout.readline())
        free_during, _ = torch.cuda.mem_get_info()
    finally:
        child.communicate("", timeout=60)
    return free_before - free_during - reserved


def nccl_world1_bytes(device: Any) -> int:
    """Device memory a one-rank NCCL communicator takes at its first collective, outside the allocator."""
    import torch
    import torch.distributed as dist

    x = torch.ones(1 << 20, device=device)
    torch.cuda.synchronize()
    free_before, reserved_before = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
    dist.all_reduce(x)
    torch.cuda.synchronize()
    free_after, reserved_after = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
    return (free_before - free_after) - (reserved_after - reserved_before)


def _fsdp_gpt(device: Any, n_layer: int, d_model: int, vocab: int, seq: int, reshard: bool) -> tuple[Any, Any]:
    import gpt
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    net, _ = gpt.gpt(n_layer=n_layer, d_model=d_model, n_head=max(1, d_model // 64), vocab_size=vocab,
                     seq_len=seq, device="cpu")
    net = net.to(device)
    mesh = init_device_mesh(device.type, (1,))
    for block in net.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(net, mesh=mesh)
    x = torch.randint(0, vocab, (1, seq), device=device)
    return net, x


def allocator_overhead(device: Any, dry: bool, steps: int = 4) -> float | None:
    """max reserved / max allocated − 1 over FSDP2 AdamW steps of a small GPT (None on CPU)."""
    import torch

    n_layer, d_model, vocab, seq = (2, 32, 256, 16) if dry else (12, 768, 50304, 1024)
    net, x = _fsdp_gpt(device, n_layer, d_model, vocab, seq, reshard=True)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        logits = net(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_reserved() / torch.cuda.max_memory_allocated() - 1


def forward_units_alive(device: Any, dry: bool) -> float | None:
    """Peak allocated in a no-grad forward, beyond the sharded model, over one unit's gathered weights."""
    import torch

    n_layer, d_model, vocab, seq = (3, 32, 256, 8) if dry else (8, 2048, 1024, 8)
    net, x = _fsdp_gpt(device, n_layer, d_model, vocab, seq, reshard=True)
    unit_bytes = sum(p.numel() * p.element_size() for p in net.blocks[0].parameters())
    in_blocks = {id(p) for p in net.blocks.parameters()}
    root_bytes = sum(p.numel() * p.element_size() for p in net.parameters() if id(p) not in in_blocks)
    if device.type != "cuda":
        with torch.no_grad():
            net(x)
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        net(x)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base - root_bytes) / unit_bytes  # the root stays gathered


def memory_terms(device: Any, dry: bool) -> dict[str, Any]:
    """Every figure above, with the preset's own beside each (``None`` where this machine cannot tell)."""
    from autopar.cost_models.gpu_figures import ALLOCATOR_OVERHEAD_FRACTION, CUDA_CONTEXT_BYTES, NCCL_BUFFER_BYTES

    cuda = device.type == "cuda"
    out: dict[str, Any] = {
        "priced": {"cuda_context_bytes": CUDA_CONTEXT_BYTES, "nccl_buffer_bytes": NCCL_BUFFER_BYTES,
                   "allocator_overhead": ALLOCATOR_OVERHEAD_FRACTION, "forward_units_alive": 2},
        "cuda_context_bytes": cuda_context_bytes() if cuda else None,
        "nccl_world1_bytes": nccl_world1_bytes(device) if cuda else None,
        "allocator_overhead": allocator_overhead(device, dry),
        "forward_units_alive": forward_units_alive(device, dry),
    }
    if not cuda:
        out["why_none"] = "no CUDA device (--dry): the FSDP2 steps ran, the CUDA figures were not taken"
    return out
