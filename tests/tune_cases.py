"""Cases for ``autopar tune``'s ranks (:mod:`autopar.tools.tune.ranks`), run in the shared rank pools."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "gpt.py") + ":gpt_tiny"


def _plans(world_size: int) -> tuple[dict, list[str]]:
    from autopar.capturing import capture
    from autopar.planning.api import solve
    from autopar.tools.spec import load_spec

    graph = capture(*load_spec(TINY, device="meta"))
    pins = [["pp=1", f"dp={world_size}", "tp=1", "zero=0", "microbatches=1"],
            ["pp=2", f"dp={world_size // 2}", "tp=1", "schedule=1f1b", "microbatches=2"]]
    plans = [solve(graph, world_size, cluster="cpu", global_batch=8, dtype="fp32", pins=p, runners_up=0).to_json()
             for p in pins]
    return graph.to_dict(), plans


def candidates(rank: int, world_size: int) -> dict[str, Any]:
    """Two plans that run and, between them, one every rank refuses (another model's): taking turns, then one
    by one; then a budget already spent, which starts nothing."""
    from autopar.tools.tune.ranks import run_candidates

    graph, plans = _plans(world_size)
    other = json.loads(plans[0])
    other["fingerprint"] = "0" * len(other["fingerprint"])
    todo = [(0, plans[0]), (1, json.dumps(other)), (2, plans[1])]
    landed: list[int] = []
    together = run_candidates(TINY, None, todo, graph, steps=2, warmup=1, deadline=None, together=True,
                              on_done=lambda m: landed.append(m.index))
    alone = run_candidates(TINY, None, todo[2:], graph, steps=2, warmup=1, deadline=None, together=False)
    spent = run_candidates(TINY, None, todo, graph, steps=2, warmup=1, deadline=time.time() - 1.0)
    return {"together": [m.to_dict() for m in together], "alone": [m.to_dict() for m in alone],
            "spent": len(spent), "landed": landed}
CASES = {"candidates": candidates}
