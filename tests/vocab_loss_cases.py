"""Vocabulary-parallel loss cases for :mod:`distributed`: plans whose head tp splits on its vocabulary,
so the loss runs a chunk of tokens × a vocabulary shard, against one process on the whole logits.

Same protocol and case factory as :mod:`equivalence_cases`. Every plan pins ``loss=chunked`` (which the
contract runs vocabulary-parallel where tp splits the head) and leaves the head's style to the contract;
the chunk is made 7 tokens of a rank's shard (:data:`autopar.contract_loss.CHUNK_LOGITS_BYTES` lowered
inside the case), so a microbatch of 32 tokens runs chunks of 7, 7, 7, 7 and 4. Besides: the tied ends
that run replicated over tp (a pipeline splits them; or the logits held whole) keep their tie, and the
chunked loss under cp (each cp method, beside tp and pp).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from chunked_loss_cases import hf_llama_tied
from context_cases import PP, RING, ULYSSES, _pins
from equivalence_cases import Spec, equivalence, gpt_tiny, hf_llama, plan_for

import autopar.contract_loss as contract_loss

CHUNK_TOKENS = 7


def vocab_parallel(spec: Spec, vocab: int, tp: int) -> Callable[[int, int], dict[str, Any]]:
    """``spec``'s equivalence case with chunks of :data:`CHUNK_TOKENS` tokens of a ``vocab // tp`` shard;
    records the plan's loss and each layer's tp style."""
    case = equivalence(spec)

    def run(rank: int, world_size: int) -> dict[str, Any]:
        before = contract_loss.CHUNK_LOGITS_BYTES
        contract_loss.CHUNK_LOGITS_BYTES = 4 * (vocab // tp) * CHUNK_TOKENS
        try:
            metrics = case(rank, world_size)
            plan = plan_for(spec, world_size)[0]
            metrics["loss_kind"] = plan.training.loss.value
            metrics["tp_styles"] = {l.name: l.choice.tp for l in plan.layers}
        finally:
            contract_loss.CHUNK_LOGITS_BYTES = before
        return metrics

    return run


ONE_STAGE = ("pp=1", "dp=1", "tp=2", "zero=0", "recompute=none", "microbatches=1", "loss=chunked")
TWO_STAGES = ("pp=2", "dp=1", "tp=2", "zero=0", "recompute=none", "schedule=1f1b", "microbatches=2", "loss=chunked")
GPT_BLOCKS, LLAMA_BLOCKS = ("blocks.*:tp=megatron",), ("model.layers.*:tp=megatron",)

W2: dict[str, tuple[Spec, int]] = {  # (spec, vocabulary)
    "vp_tp2_gpt": (Spec(gpt_tiny, ONE_STAGE + GPT_BLOCKS, 4, adam=True), 256),
    "vp_tp2_sp_gpt": (Spec(gpt_tiny, ONE_STAGE + GPT_BLOCKS + ("blocks.*:sp=on",), 4), 256),
    "vp_tp2_llama": (Spec(hf_llama, ONE_STAGE + LLAMA_BLOCKS, 4), 128),
    "vp_tp2_sp_llama_tied": (Spec(hf_llama_tied, ONE_STAGE + LLAMA_BLOCKS + ("model.layers.*:sp=on",), 4), 128),
    # the logits held whole: the tied ends run replicated over tp (split on one end only, the tie broke)
    "full_tp2_llama_tied": (Spec(hf_llama_tied, ONE_STAGE[:-1] + ("loss=full",) + LLAMA_BLOCKS, 4), 128),
}
W4: dict[str, tuple[Spec, int]] = {
    "vp_pp2_tp2_gpt": (Spec(gpt_tiny, TWO_STAGES + GPT_BLOCKS, 4), 256),
    "vp_pp2_tp2_llama": (Spec(hf_llama, TWO_STAGES + LLAMA_BLOCKS, 4), 128),
    "vp_dp2_tp2_zero3_gpt": (Spec(gpt_tiny, ("pp=1", "dp=2", "tp=2", "zero=3", "recompute=none", "microbatches=2",
                                              "loss=chunked") + GPT_BLOCKS, 8), 256),
    # a pipeline splits the tied ends: replicated over tp, the chunked loss on the whole head
    "chunk_pp2_tp2_llama_tied": (Spec(hf_llama_tied, TWO_STAGES + LLAMA_BLOCKS, 4), 128),
}

# under cp each rank's loss is its S/cp tokens' mean, as the default loss's on its logits: the chunked loss (and,
# tp splitting the head, the vocabulary-parallel one) on those tokens, with each cp method and beside pp
CP = ("loss=chunked",)
CP_W2: dict[str, tuple[Spec, int]] = {
    "cp2_chunk_llama": (Spec(hf_llama, _pins(2) + CP, 2), 128),
    "uly_cp2_chunk_gpt": (Spec(gpt_tiny, _pins(2) + ULYSSES + CP, 2), 256),
    "ring_cp2_chunk_gpt": (Spec(gpt_tiny, _pins(2) + RING + CP, 2), 256),
}
CP_W4: dict[str, tuple[Spec, int]] = {
    "cp2_tp2_sp_vp_gpt": (Spec(gpt_tiny, _pins(2, tp=2) + GPT_BLOCKS + ("blocks.*:sp=on",) + CP, 2), 256),
    "cp2_pp2_chunk_llama": (Spec(hf_llama, PP + ("schedule=1f1b",) + CP, 4), 128),
}

PEAK = dict(vocab=8192, hidden=64, seq=512, batch=8, chunk=512)  # 4,096 tokens: 8 chunks of a 4,096-class shard


def measured_peak(rank: int, world_size: int) -> dict[str, Any]:
    """Each rank's peak (CPU allocator, torch's profiler) of the vocabulary-parallel loss over one microbatch
    of :data:`PEAK`: the larger of its forward's and its backward's beside the gradients it returns (of h
    and of W's shard, priced as the head layer's backward and gradient)."""
    import torch
    from peak_memory import peak_bytes
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from autopar.runtime.vocab_loss import vocab_parallel_cross_entropy

    p = PEAK
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(0)
    h = torch.randn(p["batch"], p["seq"], p["hidden"], generator=g, requires_grad=True)
    full = torch.randn(p["vocab"], p["hidden"], generator=g)
    w = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
    y = torch.randint(0, p["vocab"], (p["batch"], p["seq"]), generator=g)
    loss: list[torch.Tensor] = []
    forward = peak_bytes(lambda: loss.append(vocab_parallel_cross_entropy(h, w, None, y, p["chunk"])))
    backward = peak_bytes(lambda: loss[0].backward()) - (h.numel() + w.to_local().numel()) * 4
    ref = torch.nn.functional.cross_entropy((h.detach() @ full.t()).reshape(-1, p["vocab"]), y.reshape(-1))
    return {"measured": max(forward, backward), "forward": forward, "backward": backward,
            "loss_rel": abs(loss[0].item() - ref.item()) / ref.item()}


CASES = {name: vocab_parallel(spec, vocab, 2) for name, (spec, vocab) in {**W2, **W4, **CP_W2, **CP_W4}.items()}
CASES["vp_measured_peak"] = measured_peak
