"""What every rank runs for ``autopar tune``: each candidate plan lowered and trained for a few steps.

Inside an initialised process group (the ranks ``tune`` spawns, or an outside ``torchrun``'s), every
rank calls :func:`run_candidates`. Each candidate is built, lowered and trained with the runtime
``autopar verify`` and ``autopar run`` use (:func:`autopar.compile`; the default AdamW and loss, on
synthetic global batches made from the example inputs by :mod:`autopar.tools.batches`), for
``warmup`` steps, then ``steps`` timed steps, each begun after a barrier; its step time is the
slowest rank's median, its memory the largest rank's peak tensor bytes (CUDA's peak allocated, and
reserved, on a GPU; the profiler's allocation events over compile and warm-up on a CPU,
:mod:`.memory`). Candidates that fit in a rank's memory together are all built first and take turns
step by step (a shared host's slow spells then fall on all alike, as ``benchmarks/fidelity.py``
times plans); others are timed as soon as they are built, then dropped before the next one.

Every decision is rank 0's, broadcast: whether the budget leaves time for the next candidate,
and the candidate's status, which is the worst of every rank's (a rank that ran out of memory or
raised makes it ``oom`` or ``failed`` for all, and the others go on to the next). A rank that dies,
or stalls in a collective its peer never joins, ends the whole group; the spawning parent then
records that candidate as failed and starts the rest afresh (:mod:`.launch`).
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

OK, OOM, FAILED = "ok", "oom", "failed"
_CODES = {OK: 0, OOM: 1, FAILED: 2}
SEED = 0


@dataclass(frozen=True)
class Measured:
    """One candidate as it ran: its status, the slowest rank's median step time, the peak bytes."""

    index: int
    status: str
    measured_s: float | None = None
    peak_bytes: int | None = None
    reserved_bytes: int | None = None  # a GPU's caching allocator's peak reserved (None on a CPU)
    error: str = ""
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def is_oom(exc: BaseException) -> bool:
    """Out of memory, on a GPU or on the host."""
    import torch

    text = str(exc).lower()
    return isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or "out of memory" in text \
        or "can't allocate memory" in text or "cannot allocate memory" in text


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:500]


class _Group:
    """The process group's rank 0 decides; the others follow (a tensor broadcast, no pickling)."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if dist.get_backend() == "nccl" else torch.device("cpu"))

    def decide(self, value: float) -> float:
        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        self.dist.broadcast(t, src=0)
        return float(t.item())

    def worst(self, value: float) -> float:
        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())


@dataclass
class _Built:
    """A candidate lowered and warmed up on this rank, ready for timed steps."""

    index: int
    pm: Any
    x: Any
    y: Any
    peak: int
    reserved: int | None
    started: float
    times: list[float]


def _build(index: int, spec: str, seq_len: int | None, plan_json: str, graph: dict, warmup: int,
           group: _Group) -> _Built:
    """Build, lower and warm up one plan on this rank, reading its peak bytes while it does."""
    import torch

    import autopar
    from autopar.graph import LayerGraph
    from autopar.plan import Plan
    from autopar.tools.batches import probe, synthetic_batch
    from autopar.tools.spec import load_spec
    from autopar.tools.tune.memory import MARK, peak_tensor_bytes, profiled

    started = time.perf_counter()
    plan = Plan.from_json(plan_json)
    cuda = group.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()

    def build_and_warm() -> Any:
        torch.manual_seed(SEED)
        model, inputs = load_spec(spec, seq_len=seq_len, device="cpu")
        probed = probe(model, inputs, wrap=False)
        batch = synthetic_batch(model, inputs, plan.training.global_batch, SEED + 1, probed)
        pm = autopar.compile(model, example_inputs=inputs, plan=plan, graph=LayerGraph.from_dict(graph))
        x, y = pm.local_batch(batch[0]), (pm.local_batch(batch[1]) if batch[1] is not None else None)
        del model, probed, batch
        with torch.profiler.record_function(MARK):
            for _ in range(warmup):
                pm.train_step(x, y)
        return pm, x, y

    if cuda:
        pm, x, y = build_and_warm()
        peak = torch.cuda.max_memory_allocated() - base
        reserved: int | None = torch.cuda.max_memory_reserved()
    else:  # only this window's allocations count: the candidates built before it are not its memory
        (pm, x, y), (events, _) = profiled(build_and_warm)
        peak, reserved = peak_tensor_bytes(events, 0), None
    return _Built(index, pm, x, y, peak, reserved, started, [])


def _step(b: _Built, group: _Group) -> None:
    """One timed step, begun after a barrier so every rank starts it together."""
    group.dist.barrier()
    t = time.perf_counter()
    b.pm.train_step(b.x, b.y)
    if group.device.type == "cuda":
        group.torch.cuda.synchronize()
    b.times.append(time.perf_counter() - t)


def _agree(group: _Group, status: str) -> str:
    """Every rank's worst status: ``oom`` or ``failed`` anywhere is the candidate's everywhere."""
    code = group.worst(_CODES[status])
    return next(k for k, v in _CODES.items() if v == code)


def _attempt(fn: Callable[[], Any]) -> tuple[Any, str, str]:
    try:
        return fn(), OK, ""
    except Exception as exc:  # noqa: BLE001 - recorded as the candidate's outcome; the search goes on
        return None, (OOM if is_oom(exc) else FAILED), _one_line(exc)


def run_candidates(spec: str, seq_len: int | None, plans: list[tuple[int, str]], graph: dict, *, steps: int,
                   warmup: int, deadline: float | None, together: bool = False,
                   on_start: Callable[[int], None] | None = None,
                   on_done: Callable[[Measured], None] | None = None) -> list[Measured]:
    """Run each (index, plan JSON) on every rank of the process group (module docstring).

    ``together``: every candidate is built first and kept, and the timed steps take turns, one step of
    each in turn, so the machine's slow spells (a host shared with other work) fall on all of them
    alike, as ``benchmarks/fidelity.py`` times plans; for candidates that fit in memory together (the
    caller decides, from their predicted bytes). Else each is timed as soon as it is built, then dropped.
    ``deadline`` (``time.time()``, rank 0's clock): a candidate is started only while rank 0 expects it
    to end before then (the slowest candidate so far as the guess); the rest are not run.
    ``on_start(index)`` and ``on_done(measured)`` are called on rank 0.
    """
    group = _Group()
    done: list[Measured] = []
    kept: list[_Built] = []
    longest = 0.0

    def finish(b: _Built | None, index: int, status: str, error: str, started: float) -> None:
        wall = time.perf_counter() - started
        ok = status == OK and b is not None
        m = Measured(index, status, group.worst(statistics.median(b.times)) if ok else None,
                     int(group.worst(b.peak)) if ok else None,
                     int(group.worst(b.reserved)) if ok and b.reserved is not None else None,
                     "" if ok else error, wall)
        done.append(m)
        if group.rank == 0 and on_done is not None:
            on_done(m)

    for index, plan_json in plans:
        if group.decide(1.0 if deadline is None or time.time() + longest < deadline else 0.0) < 0.5:
            break
        if group.rank == 0 and on_start is not None:
            on_start(index)
        started = time.perf_counter()
        built, status, error = _attempt(lambda: _build(index, spec, seq_len, plan_json, graph, warmup, group))
        status = _agree(group, status)
        if status == OK and not together:
            _, status, error = _attempt(lambda: [_step(built, group) for _ in range(steps)])
            status = _agree(group, status)
        if status == OK and together:
            kept.append(built)
        else:
            finish(built, index, status, error, started)
            built = None
            _release(group)
        longest = max(longest, time.perf_counter() - started)
    for _ in range(steps if kept else 0):  # one step of each in turn
        for b in list(kept):
            _, status, error = _attempt(lambda: _step(b, group))
            status = _agree(group, status)
            if status != OK:
                kept.remove(b)
                finish(None, b.index, status, error, b.started)
    for b in kept:
        finish(b, b.index, OK, "", b.started)
    kept.clear()
    _release(group)
    return done


def _release(group: _Group) -> None:
    gc.collect()
    if group.device.type == "cuda":
        group.torch.cuda.empty_cache()


# ------------------------------------------------------------------ spawned ranks


def worker(rank: int, world_size: int, tmp: str, spec: str, seq_len: int | None, plans: list[tuple[int, str]],
           graph: dict, steps: int, warmup: int, deadline: float | None, probe: bool, together: bool) -> None:
    """One spawned rank: join the group, (probe the machine,) run the candidates; rank 0 writes each
    outcome to ``tmp`` as it lands (``started-I``, ``result-I.json``, ``probes.json``)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from autopar.quiet import silence_if_asked
    from autopar.tools.host import threads_per_process
    from autopar.tools.verify import leave

    silence_if_asked()
    torch.set_num_threads(threads_per_process(world_size))
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, store=dist.FileStore(str(Path(tmp, "store")), world_size), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=300))
    if probe:
        m = probe_machine(backend)
        if rank == 0:
            Path(tmp, "probes.json").write_text(json.dumps(m))

    def start(index: int) -> None:
        Path(tmp, f"started-{index}").write_text("")

    def done(m: Measured) -> None:
        Path(tmp, f"result-{m.index}.json").write_text(json.dumps(m.to_dict()))

    run_candidates(spec, seq_len, plans, graph, steps=steps, warmup=warmup, deadline=deadline, together=together,
                   on_start=start, on_done=done)
    dist.barrier()
    dist.destroy_process_group()
    leave()


def probe_machine(backend: str) -> dict[str, Any]:
    """``autopar calibrate --quick``'s probes in this process group: the Measurements, as JSON data."""
    import torch.distributed as dist

    from autopar.tools.calibrate import measure_in_process_group, probe_sizes
    from autopar.tools.host import available_memory_bytes

    memory = (available_memory_bytes() or 0) // dist.get_world_size()
    return measure_in_process_group(backend, probe_sizes(backend, quick=True), memory).__dict__
