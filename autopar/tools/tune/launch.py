"""Starting ``autopar tune``'s ranks on this host, and carrying on when a candidate takes them down.

The candidates run in one group of ``nproc`` spawned processes (:func:`.ranks.worker`), which
write each outcome to a temporary directory as it lands. A candidate that kills a rank (the
host's out-of-memory killer, a segfault in a library) or leaves one waiting in a collective its
peer never joins ends the group: that candidate is recorded (``oom`` for a rank killed by
SIGKILL or one that said it ran out of memory, else ``failed``) and a fresh group starts with the
candidates after it. The budget's deadline also bounds the group: past it (and a grace for the
candidate under way), the ranks are stopped and the candidate under way is recorded as failed.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autopar.tools.host import stop_processes
from autopar.tools.tune.ranks import FAILED, OOM, Measured, worker

KINETO_LOG_ENV = "KINETO_LOG_LEVEL"
GRACE_S = 60.0  # past the deadline, how long a candidate under way may still finish


def _died(exc: BaseException, tmp: str, index: int) -> Measured:
    """The candidate under way when the group ended, recorded from how it ended."""
    from autopar.tools.verify import _first_failure

    failure = _first_failure(tmp, exc)
    text = failure.error
    oom = "SIGKILL" in text or "out of memory" in text.lower()
    return Measured(index, OOM if oom else FAILED, error=f"rank {failure.rank}: {text}"[:500])


def measure_spawned(nproc: int, spec: str, seq_len: int | None, plans: list[tuple[int, str]], graph: dict, *,
                    steps: int, warmup: int, deadline: float | None, probe: bool = False, together: bool = False,
                    on_start: Callable[[int], None] | None = None,
                    on_done: Callable[[Measured], None] | None = None) -> tuple[list[Measured], dict[str, Any] | None]:
    """Run the candidates on ``nproc`` spawned ranks (module docstring): their outcomes in order, and the
    probes' measurements (``probe``: ``autopar calibrate --quick``'s, taken first) or None."""
    import torch.multiprocessing as mp

    from autopar.quiet import QUIET_ENV

    # the profiler that reads a CPU rank's memory prints two lines a use (kineto's "USDT: … profiler_start"):
    # off in the ranks of a quiet CLI, as the libraries' other lines are (autopar.quiet); -v shows them
    before = os.environ.get(KINETO_LOG_ENV)
    if os.environ.get(QUIET_ENV) == "1" and before is None:
        os.environ[KINETO_LOG_ENV] = "10"
    try:
        return _measure(mp, nproc, spec, seq_len, plans, graph, steps=steps, warmup=warmup, deadline=deadline,
                        probe=probe, together=together, on_start=on_start, on_done=on_done)
    finally:
        if before is None:
            os.environ.pop(KINETO_LOG_ENV, None)


def _measure(mp: Any, nproc: int, spec: str, seq_len: int | None, plans: list[tuple[int, str]], graph: dict, *,
             steps: int, warmup: int, deadline: float | None, probe: bool, together: bool,
             on_start: Callable[[int], None] | None,
             on_done: Callable[[Measured], None] | None) -> tuple[list[Measured], dict[str, Any] | None]:
    results: list[Measured] = []
    probes: dict[str, Any] | None = None
    todo = list(plans)
    while todo:
        with tempfile.TemporaryDirectory(prefix="autopar-tune-") as tmp:
            ask = probe and probes is None
            ctx = mp.start_processes(worker, args=(nproc, tmp, spec, seq_len, todo, graph, steps, warmup, deadline,
                                                   ask, together),
                                     nprocs=nproc, join=False, start_method="spawn")
            seen: set[int] = set()
            ended: BaseException | None = None
            try:
                while not ctx.join(timeout=0.5, grace_period=3.0):
                    _report(tmp, todo, seen, results, on_start, on_done)
                    if deadline is not None and time.time() > deadline + GRACE_S:
                        ended = TimeoutError("the --budget-s deadline passed")
                        break
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
                ended = exc
            finally:
                stop_processes(ctx.processes)
            _report(tmp, todo, seen, results, on_start, on_done)
            if ask and Path(tmp, "probes.json").exists():
                probes = json.loads(Path(tmp, "probes.json").read_text())
            finished = {m.index for m in results}
            running = [i for i, _ in todo if Path(tmp, f"started-{i}").exists() and i not in finished]
            if ended is None:
                break  # every candidate ran, or the budget stopped the rest
            if running:
                m = (Measured(running[0], FAILED, error="stopped: the --budget-s deadline passed")
                     if isinstance(ended, TimeoutError) else _died(ended, tmp, running[0]))
                results.append(m)
                if on_done is not None:
                    on_done(m)
            elif ask and probes is None:  # the probes themselves failed: go on without them
                probe = False
            else:
                raise RuntimeError(f"the tune's ranks failed before any candidate started: {ended}")
            if isinstance(ended, TimeoutError):
                break
            done = {m.index for m in results}
            todo = [(i, p) for i, p in todo if i not in done]
    return results, probes


def _report(tmp: str, todo: list[tuple[int, str]], seen: set[int], results: list[Measured],
            on_start: Callable[[int], None] | None, on_done: Callable[[Measured], None] | None) -> None:
    """Pass on what the ranks wrote since the last look: candidates started, outcomes landed."""
    for i, _ in todo:
        if i not in seen and Path(tmp, f"started-{i}").exists():
            seen.add(i)
            if on_start is not None:
                on_start(i)
        path = Path(tmp, f"result-{i}.json")
        if path.exists() and all(m.index != i for m in results):
            try:
                m = Measured(**json.loads(path.read_text()))
            except json.JSONDecodeError:  # still being written: read on the next look
                continue
            results.append(m)
            if on_done is not None:
                on_done(m)
