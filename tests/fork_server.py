"""How the rank pools' workers (:mod:`distributed`) start: forked from one fork server per session that has
imported, once, what every worker imports (:data:`PRELOAD`).

Spawning a worker that imported them itself cost 4–6 CPU seconds (torch, its distributed engines, autopar's
runtime, the Hugging Face models the cases build), for each of the 68 workers a session started. The fork server
takes the environment of the test process when it starts (the session's first pool); a request's own
variables reach its cases through ``RankPool.run(env=...)``.
"""

from __future__ import annotations

from typing import Any

# Only imports: a fork copies only the calling thread, so nothing here may run an op (torch starts its pools
# on the first).
PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
           "torch.distributed.tensor.parallel", "torch.distributed.pipelining", "torch.distributed.checkpoint",
           "torch.export", "torch._functorch.partitioners", "ortools.sat.python.cp_model", "autopar",
           "autopar.capturing", "autopar.planning.api", "autopar.sharding", "autopar.runtime", "passes",
           "equivalence_cases", "transformers",
           *(f"transformers.models.{m}.modeling_{m}" for m in (
               "llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2", "gpt_neox", "bert", "opt", "vit", "t5",
               "mixtral", "qwen2_moe", "deepseek_v3")))


def context() -> Any:
    """Workers are forked from one fork server per session that has imported :data:`PRELOAD`
    (``spawn`` would import them again in every worker); :func:`stop` ends it."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def stop() -> None:
    """End the session's fork server and wait for it, so that the CPU time of the workers forked from it
    (it reaps them) reaches this process's children's, as ``time`` and ``getrusage`` count them."""
    from multiprocessing import forkserver

    forkserver._forkserver._stop()
