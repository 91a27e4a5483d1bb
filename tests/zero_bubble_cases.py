"""Zero-bubble pipeline cases for :mod:`distributed`: split-backward schedules against one process.

torch's ``ScheduleInterleavedZeroBubble`` (``interleaved_zb``), ``ScheduleZBVZeroBubble`` (``zbv``) and
``ScheduleDualPipeV`` (``dualpipev``) on the repo's GPT, a Hugging Face ``LlamaForCausalLM`` from a tiny
config and nanoGPT as its author writes it; same protocol as :mod:`pipeline_cases` (3 SGD steps; the
AdamW leg is pp_1f1b's, equivalence_cases.ADAM_CASES; every rank compares its losses, gradients and parameters with
one process).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn
from equivalence_cases import Spec, equivalence, gpt_tiny, hf_llama


def nanogpt() -> tuple[nn.Module, tuple]:
    """nanoGPT's model.py (attention by hand, its ``bias`` mask buffer), 2 blocks."""
    import zoo

    return zoo.NanoGPT(zoo.NanoConfig()), zoo._ids()


def gpt_6layer() -> tuple[nn.Module, tuple]:
    """Enough layers for 8 virtual stages (zbv at pp = 4)."""
    import gpt

    return gpt.gpt(n_layer=6, d_model=32, n_head=4, vocab_size=256, seq_len=16, device="cpu")


PP2 = ("pp=2", "dp=1", "tp=1", "zero=0", "recompute=none")

SPECS: dict[str, Spec] = {
    # W = 2
    "zb1p_gpt": Spec(gpt_tiny, PP2 + ("microbatches=4", "schedule=interleaved_zb", "chunks=1"), 8),
    "zb_interleaved_gpt": Spec(gpt_tiny, PP2 + ("microbatches=4", "schedule=interleaved_zb", "chunks=2"), 8),
    "zbv_gpt": Spec(gpt_tiny, PP2 + ("microbatches=4", "schedule=zbv"), 8),
    "dualpipev_gpt": Spec(gpt_tiny, PP2 + ("microbatches=4", "schedule=dualpipev"), 8),
    "zbv_hf_llama": Spec(hf_llama, PP2 + ("microbatches=2", "schedule=zbv"), 4),
    "zb1p_hf_llama": Spec(hf_llama, PP2 + ("microbatches=2", "schedule=interleaved_zb", "chunks=1"), 4),
    "dualpipev_hf_llama": Spec(hf_llama, PP2 + ("microbatches=4", "schedule=dualpipev"), 4),
    "zbv_nanogpt": Spec(nanogpt, PP2 + ("microbatches=4", "schedule=zbv"), 8),
    "dualpipev_nanogpt": Spec(nanogpt, PP2 + ("microbatches=4", "schedule=dualpipev"), 8),
    "zb_interleaved_nanogpt": Spec(nanogpt, PP2 + ("microbatches=2", "schedule=interleaved_zb", "chunks=2"), 4),
    # W = 4
    # ZeRO-2 inside the V's stages (ZeRO-3 is withdrawn: contract.offered_zeros), plain DP under ZB-H1
    "zbv_dp2_zero2_gpt": Spec(gpt_tiny, ("pp=2", "dp=2", "tp=1", "zero=2", "recompute=none", "microbatches=2",
                                         "schedule=zbv"), 8),
    "zb1p_dp2_plain_dp_gpt": Spec(gpt_tiny, ("pp=2", "dp=2", "tp=1", "zero=0", "recompute=none", "microbatches=2",
                                             "schedule=interleaved_zb", "chunks=1"), 8),
    "zbv_pp4_gpt": Spec(gpt_6layer, ("pp=4", "dp=1", "tp=1", "zero=0", "recompute=none", "microbatches=4",
                                     "schedule=zbv"), 8),
    "zb_interleaved_pp4_gpt": Spec(gpt_6layer, ("pp=4", "dp=1", "tp=1", "zero=0", "recompute=none",
                                                "microbatches=4", "schedule=interleaved_zb", "chunks=2"), 8),
    "dualpipev_pp4_gpt": Spec(gpt_6layer, ("pp=4", "dp=1", "tp=1", "zero=0", "recompute=none", "microbatches=8",
                                           "schedule=dualpipev"), 8),
}

CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {k: equivalence(v) for k, v in SPECS.items()}
