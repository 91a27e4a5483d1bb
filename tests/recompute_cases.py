"""Cases for :mod:`distributed`: selective and mixed recompute plans against one process.

Each case is :func:`equivalence_cases.equivalence` of a fully pinned plan (the
same model, batches and bars), run while the selective policy
(:func:`autopar.passes.recompute.keep_matmul_outputs`) counts the ops it is
asked about, so a case also says whether selective checkpointing ran at all
and which ops it kept.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from equivalence_cases import GPT_TP, Spec, equivalence, gpt_tiny, hf_llama

import autopar.passes.recompute as recompute_pass

_EMBEDDINGS_OFF = ("tok_emb:recompute=none", "pos_emb:recompute=none", "drop:recompute=none",
                   "lm_head:recompute=none")


def _counting(spec: Spec) -> Callable[[int, int], dict[str, Any]]:
    """``equivalence(spec)`` with the selective policy's verdicts counted (kept: MUST_SAVE)."""
    inner = equivalence(spec)

    def case(rank: int, world_size: int) -> dict[str, Any]:
        asked: Counter[str] = Counter()
        kept: Counter[str] = Counter()
        policy = recompute_pass.keep_matmul_outputs

        def counted(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            verdict = policy(ctx, func, *args, **kwargs)
            asked[func._schema.name] += 1
            if verdict.name == "MUST_SAVE":
                kept[func._schema.name] += 1
            return verdict

        recompute_pass.keep_matmul_outputs = counted
        try:
            metrics = inner(rank, world_size)
        finally:
            recompute_pass.keep_matmul_outputs = policy
        metrics["policy_asked"], metrics["policy_kept"] = sum(asked.values()), dict(kept)
        return metrics

    return case


SPECS: dict[str, Spec] = {
    "selective_zero3": Spec(gpt_tiny, ("pp=1", "dp=2", "tp=1", "zero=3", "microbatches=1",
                                       "blocks.*:recompute=selective", "ln_f:recompute=none")
                            + _EMBEDDINGS_OFF, 4),
    "selective_tp2": Spec(gpt_tiny, ("pp=1", "dp=1", "tp=2", "zero=0", "blocks.*:recompute=selective",
                                     "ln_f:recompute=none") + _EMBEDDINGS_OFF + GPT_TP, 4),
    "mixed_kinds_zero2": Spec(gpt_tiny, ("pp=1", "dp=2", "tp=1", "zero=2", "microbatches=2",
                                         "blocks.0:recompute=selective", "blocks.1:recompute=full",
                                         "ln_f:recompute=full") + _EMBEDDINGS_OFF, 4),
    "full_only": Spec(gpt_tiny, ("pp=1", "dp=2", "tp=1", "zero=0", "microbatches=1", "recompute=full"), 4),
    "hf_llama_selective_tp2": Spec(hf_llama, ("pp=1", "dp=1", "tp=2", "zero=0",
                                              "model.layers.0:recompute=selective",
                                              "model.layers.1:recompute=full",
                                              "model.layers.*:tp=megatron", "model.embed_tokens:tp=vocab"), 4),
    "hf_llama_alternate_zero3": Spec(hf_llama, ("pp=1", "dp=2", "tp=1", "zero=3", "microbatches=1",
                                                "model.layers.*:recompute=alternate_mm"), 4),
}

CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {k: _counting(v) for k, v in SPECS.items()}
