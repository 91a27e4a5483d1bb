"""Ring attention cases for :mod:`distributed` (``cp_attention=ring``, ``passes/context_ring.py``).

``ring_op``: torch's ring (``_templated_ring_attention`` and its backward, driven with SDPA's CPU flash
kernel) on this rank's head-tail chunks against one causal SDPA over the whole sequence, forward and the
gradients of q, k and v, fp32, with as many key/value heads as query heads and with grouped-query heads
(2 query heads a key/value head). The ``ring_*`` equivalence cases (:func:`equivalence_cases.equivalence`:
3 SGD-with-momentum steps, 3 AdamW steps on ring_cp2_gpt alone, against one process, fp32 on gloo) train the
project's GPT and a tiny Hugging Face Llama (grouped-query) with ``cp_attention=ring``; ``ring_cp2_runs_ring`` checks
one training step calls torch's ring once per attention call and never gathers K/V (also beside tp, and beside ep on
``context_cases``' ring Mixtral, whose only autograd all-to-alls are then ep's dispatch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import context_cases
import torch
import torch.distributed as dist
import torch.nn.functional as F
from context_cases import LLAMA_TP, PP, RING, _pins, hf_llama
from equivalence_cases import GPT_TP, Spec, equivalence, gpt_tiny, plan_for

import autopar
from autopar.passes.context_chunks import positions
from autopar.passes.context_ring import ring_attention

SPECS: dict[str, Spec] = {
    "ring_cp2_gpt": Spec(gpt_tiny, _pins(2) + RING, 2, adam=True),
    # grouped-query (4 heads over 2 kv heads); selective recompute's replay runs the ring again inside
    # backward, over 2 microbatches
    "ring_cp2_selective_accum_llama": Spec(hf_llama, _pins(2, recompute="selective", m=2) + RING, 2),
    "ring_cp4_gpt": Spec(gpt_tiny, _pins(4) + RING, 2),
    # full recompute: the recomputed forward runs the ring again
    "ring_cp4_recompute_llama": Spec(hf_llama, _pins(4, recompute="full") + RING, 2),
    # beside dp: ZeRO-3 over the dp × cp ranks, 2 microbatches
    "ring_cp2_dp2_zero3_accum_gpt": Spec(gpt_tiny, _pins(2, dp=2, zero=3, m=2) + RING, 4),
    # beside tp (W=4): each tp rank's heads (the Llama: its one key/value head) passed round the cp ring;
    # the GPT's embeddings vocab-parallel, the Llama with sequence parallelism
    "ring_cp2_tp2_gpt": Spec(gpt_tiny, _pins(2, tp=2) + GPT_TP + RING, 2),
    "ring_cp2_tp2_sp_llama": Spec(hf_llama, _pins(2, tp=2) + LLAMA_TP + ("model.layers.*:sp=on",) + RING, 2),
    # inside pipeline stages (W=4): each stage's attention modules run the ring over their cp pair
    "ring_cp2_pp2_1f1b_gpt": Spec(gpt_tiny, PP + ("schedule=1f1b",) + RING, 4),
    "ring_cp2_pp2_gpipe_recompute_llama": Spec(hf_llama, PP[:-2] + ("recompute=full", "microbatches=2",
                                                                    "schedule=gpipe") + RING, 4),
    "ring_cp2_pp2_tp2_gpt": Spec(gpt_tiny, ("pp=2", "tp=2", "dp=1", "cp=2", "zero=0", "recompute=none",
                                            "microbatches=2", "schedule=1f1b", "blocks.*:tp=megatron") + RING, 8),
}

CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {k: equivalence(v) for k, v in SPECS.items()}


def ring_op(rank: int, world_size: int) -> dict[str, Any]:
    """The ring's output and q, k, v gradients on this rank's tokens against one device's causal SDPA
    (every rank builds the same tensors from one seed): max absolute error of each, per head layout."""
    errors: dict[str, list[float]] = {}
    for name, heads, kv_heads in (("mha", 4, 4), ("gqa", 4, 2)):
        g = torch.Generator().manual_seed(7)
        b, s, d = 2, 16 * world_size, 8
        q = torch.randn(b, heads, s, d, generator=g, requires_grad=True)
        k, v = (torch.randn(b, kv_heads, s, d, generator=g, requires_grad=True) for _ in range(2))
        grad = torch.randn(b, heads, s, d, generator=g)
        gqa = {"enable_gqa": True} if heads != kv_heads else {}
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        ref.backward(grad)
        index = positions(s, world_size, rank)
        lq, lk, lv = (t.detach().index_select(2, index).requires_grad_() for t in (q, k, v))
        out = ring_attention(lq, lk, lv, dist.group.WORLD, {"is_causal": True, **gqa})
        out.backward(grad.index_select(2, index))
        errors[name] = [float((out - ref.detach().index_select(2, index)).abs().max())] + [
            float((mine.grad - whole.grad.index_select(2, index)).abs().max()) for mine, whole in
            ((lq, q), (lk, k), (lv, v))]
    dist.barrier()
    return {"errors": errors}


def ring_cp2_runs_ring(rank: int, world_size: int, spec: str = "ring_cp2_gpt") -> dict[str, Any]:
    """One training step under the ring plan ``spec`` (the GPT's, also beside tp; or a Mixtral's beside ep, from
    ``context_cases``): torch's ring forward runs once per attention call (2 blocks, one SDPA each), its backward
    once per call, K/V are never all-gathered, and the autograd all-to-alls are ep's dispatch alone (2 a block
    in forward: the rows out to their experts' ranks and back; none without ep)."""
    import torch.distributed._functional_collectives as fc
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    specs = SPECS | context_cases.SPECS
    plan, graph = plan_for(specs[spec], world_size)
    torch.manual_seed(0)
    model, inputs = specs[spec].build()
    pm = autopar.compile(model, example_inputs=inputs, plan=plan, graph=graph)
    calls = {"ring": 0, "ring_backward": 0, "all_gather": 0, "all_to_all": 0}
    real = (ring._templated_ring_attention, ring._templated_ring_attention_backward, fc.all_gather_single_autograd,
            fc.all_to_all_single_autograd)

    def counted(key: str, fn: Callable) -> Callable:
        def run(*a: Any, **k: Any) -> Any:
            calls[key] += 1
            return fn(*a, **k)
        return run

    ring._templated_ring_attention = counted("ring", real[0])
    ring._templated_ring_attention_backward = counted("ring_backward", real[1])
    fc.all_gather_single_autograd = counted("all_gather", real[2])
    fc.all_to_all_single_autograd = counted("all_to_all", real[3])
    try:
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        pm.train_step(pm.local_batch(ids), pm.local_batch(ids.roll(-1, 1)))
    finally:
        (ring._templated_ring_attention, ring._templated_ring_attention_backward, fc.all_gather_single_autograd,
         fc.all_to_all_single_autograd) = real
    return {"calls": calls, "method": str(plan.cp_attention), "ring": pm.lowered.context.ring}


CASES["ring_op"] = ring_op
CASES["ring_cp2_runs_ring"] = ring_cp2_runs_ring
CASES["ring_cp2_tp2_runs_ring"] = lambda rank, world_size: ring_cp2_runs_ring(rank, world_size, "ring_cp2_tp2_gpt")
CASES["ring_cp2_ep2_runs_ring"] = lambda rank, world_size: ring_cp2_runs_ring(rank, world_size,
                                                                              "ring_cp2_ep2_mixtral")
