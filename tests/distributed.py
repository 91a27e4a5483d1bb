"""Run named test cases in W gloo processes, spawned once per call.

    results = run_cases(2, ["dp", "zero3"], module="equivalence_cases")
    results["zero3"]["grad_rel"]        # rank 0's metrics for the case

``module`` is imported in every process and must define ``CASES``: a dict of
``name -> fn(rank, world_size) -> dict`` (JSON-able metrics; rank 0's are
returned); a name ``other_module:case`` takes the case from another module,
so one spawn can run the cases of several test files. A case that raises records ``{"error": "<Type>: message",
"traceback": ...}`` for its rank; the parent reports the first rank that
failed. Start-up (spawn + import torch) costs seconds on a small machine, so
put every case of one world size in one call. The process group has a
timeout, so a case that desynchronises the ranks fails instead of hanging.
"""

from __future__ import annotations

import importlib
import json
import os
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any


def _worker(rank: int, world_size: int, store_path: str, module: str, cases: list[str],
            out_dir: str, timeout_s: float) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    results: dict[str, Any] = {}
    for name in cases:
        start = time.perf_counter()
        where, _, case = name.rpartition(":")
        try:
            registry = importlib.import_module(where or module).CASES
            metrics = dict(registry[case](rank, world_size) or {})
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            metrics = {"error": f"{type(exc).__name__}: {exc}", "error_type": type(exc).__name__,
                       "traceback": traceback.format_exc()}
        metrics["wall_s"] = round(time.perf_counter() - start, 3)
        results[name] = metrics
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results, default=float))
    dist.destroy_process_group()


def run_cases(world_size: int, cases: list[str], *, module: str = "equivalence_cases",
              timeout_s: float = 600.0, collective_timeout_s: float = 120.0) -> dict[str, dict]:
    """Spawn ``world_size`` processes once, run ``cases`` in order in each, return rank 0's metrics.

    A case that failed on any rank carries that rank's ``error`` (and ``rank``).
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="autopar-dist-") as tmp:
        store = os.path.join(tmp, "store")
        ctx = mp.start_processes(_worker, args=(world_size, store, module, cases, tmp,
                                                collective_timeout_s),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        crashed = None
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} processes did not finish {cases} in {timeout_s} s")
        except mp.ProcessRaisedException as exc:  # a worker died outside a case
            crashed = str(exc)
        except mp.ProcessExitedException as exc:
            crashed = str(exc)
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
        per_rank = []
        for r in range(world_size):
            f = Path(tmp, f"rank{r}.json")
            per_rank.append(json.loads(f.read_text()) if f.exists() else {})
    return _merge(per_rank, cases, crashed)


def _merge(per_rank: list[dict], cases: list[str], crashed: str | None) -> dict[str, dict]:
    out = {}
    for name in cases:
        metrics = dict(per_rank[0].get(name, {"error": f"not run ({crashed or 'no result'})"}))
        for r, results in enumerate(per_rank):
            res = results.get(name)
            if res is None:
                metrics.setdefault("error", f"rank {r} did not finish ({crashed or 'no result'})")
            elif "error" in res and "error" not in metrics:
                metrics.update(error=res["error"], error_type=res.get("error_type"),
                               traceback=res.get("traceback"), rank=r)
        out[name] = metrics
    return out


# ------------------------------------------------------------------ assertions on the metrics

EXACT = 1e-5  # first-step loss and gradients, SGD losses and parameters: ‖Δ‖/‖ref‖ per tensor
ADAM = 1e-3  # AdamW losses (Adam turns rounding noise into full-size updates)


def ok(metrics: dict) -> dict:
    """The case's metrics, or a test failure carrying the failing rank's error and traceback."""
    import pytest

    if "error" in metrics:
        pytest.fail(f"rank {metrics.get('rank', 0)}: {metrics['error']}\n{metrics.get('traceback', '')}")
    return metrics


def check_equivalent(m: dict) -> None:
    """The equivalence bar of the lowering issue, on one case's metrics."""
    m = ok(m)
    assert m["loss1_rel"] < EXACT, m
    assert m["grad_rel"] < EXACT, (m["grad_worst"], m["grad_rel"])
    assert m["sgd_loss_rel"] < EXACT, m
    assert m["param_rel"] < EXACT, (m["param_worst"], m["param_rel"])
    assert m["adam_loss_rel"] < ADAM, m
