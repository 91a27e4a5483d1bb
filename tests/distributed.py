"""Named test cases on W gloo processes that the whole test session shares, one pool per world size.

    def test_zero3(ranks):                                  # the session fixture in conftest.py
        results = ranks(2).run(["dp", "zero3"], module="equivalence_cases")
        results["zero3"]["grad_rel"]                        # rank 0's metrics for the case
        results["zero3"]["ranks"][1]["losses"]              # rank 1's; every rank's are there

A case is ``name -> fn(rank, world_size) -> dict`` in the ``CASES`` of ``module`` (a ``*_cases.py``
beside this file); ``other_module:case`` takes it from another module, so one request can run the
cases of several test files. Metrics must be JSON-able (they go through ``json``, tuples become
lists). Start-up (import torch, join the group) costs seconds a rank on a small machine, so a
:class:`RankPool`'s workers stay alive for the session and run request after request, a test module
puts every case of one world size in one request, and the workers are forked from a fork server that
has imported what they all import once a session (:mod:`fork_server`).

What the pool guarantees, whatever a case does:

- a case that raises on any rank fails with that rank's error and traceback, naming the case and
  the rank (the rank that failed first when several did: its peers' errors usually follow from it);
- a case that desynchronises the ranks fails when its collective gives up (``collective_timeout_s``):
  no rank starts a case before every rank has finished the one before, so it cannot spill into the
  next; a case that hangs fails after ``stall_timeout_s`` without a word from any rank, naming the
  ranks that did not finish it;
- a worker that dies fails the case it was running, with its exit code or signal;
- after any of these the pool is torn down and started again for the cases after the failed one,
  so a broken group never runs another case; the cases before it keep their results;
- every case starts from the RNG state its worker started with, and with the environment the
  request gave (variables a case or torch set are removed after it); a case that leaves the
  default dtype, the thread count or grad mode changed fails, naming what it left (and the worker
  puts it back);
- the sub-groups a case's device meshes make are destroyed once every rank has finished the case
  (``_close_groups``: each gloo group holds sockets and threads of its own); what still outlives a
  case is bounded: a worker raises its descriptor limit to the hard one, and the pool starts afresh
  before a request once a worker has more than half of it open, or more than ``THREAD_RECYCLE``
  threads;
- at the end of the session each worker destroys its process group and exits.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import queue
import random
import resource
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import fork_server

START_TIMEOUT_S = 300.0  # W processes importing torch on 2 busy cores
STALL_TIMEOUT_S = 300.0  # no case finished on any rank for this long: a hang
COLLECTIVE_TIMEOUT_S = 120.0  # a collective whose peers never come raises after this
ERROR_GRACE_S = 15.0  # after one rank's error, how long its peers have to report the same case
MAX_RESTARTS = 3  # per request: a batch whose cases keep breaking the pool stops trying
FD_RECYCLE = 0.5  # a worker with more than this share of its descriptor limit open starts afresh
THREAD_RECYCLE = 96  # ... or with more threads than this (gloo's, of the groups its cases left open)


# ------------------------------------------------------------------ in each worker


def _serve(rank: int, world_size: int, store_path: str, inbox: Any, outbox: Any,
           collective_timeout_s: float) -> None:
    """A worker: join the group, then run each request's cases in order until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C is the parent's: it stops the pool
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # every device mesh a case makes holds sockets
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 65536), hard))
    parent = os.getppid()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=collective_timeout_s))
        fresh = _State.now()
        gc.freeze()  # the ~450,000 objects of the imports: _close_groups' collection after each case skips them
    except BaseException:  # noqa: BLE001 - reported to the parent, which names the rank
        outbox.put(("failed", rank, traceback.format_exc()))
        return
    outbox.put(("ready", rank, os.getpid()))
    while True:
        try:
            command = inbox.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() != parent:  # the session is gone: nobody will ever stop us
                return
            continue
        if command[0] == "stop":
            dist.destroy_process_group()
            return
        _, request, module, cases, env = command
        with _environment(env):
            for k, name in enumerate(cases):
                groups = _groups()
                outbox.put(("case", request, rank, name, _run_case(name, module, rank, world_size, fresh)))
                # no rank starts the next case before every rank has finished this one, through the store
                # and not a collective: a case that left the ranks out of step fails itself, not the next
                store.set(f"autopar-pool/{request}/{k}/{rank}", "1")
                store.wait([f"autopar-pool/{request}/{k}/{r}" for r in range(world_size)], timedelta(days=1))
                _close_groups(_groups() - groups)
        outbox.put(("done", request, rank, _fd_fill(), _threads()))


def _groups() -> set[Any]:
    """The process groups this process has open, the default one among them."""
    from torch.distributed import distributed_c10d

    return set(distributed_c10d._world.pg_map)


def _close_groups(groups: set[Any]) -> None:
    """Destroy the groups a case made (every rank has finished it), closing their sockets and gloo
    threads: left open, hundreds of threads a worker slow every later case on two cores.

    DTensor caches sharding and redistribution plans by value (in Python and in C++), and two meshes of one shape are
    equal, so a later case's plan could come back holding this case's mesh and its destroyed groups;
    those caches are emptied first. Where this torch lacks one, the groups are left open (and the
    pool's recycle rule bounds them)."""
    if not groups:
        return
    import torch
    import torch.distributed as dist

    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._collective_utils import MeshTopoInfo
        from torch.distributed.tensor._redistribute import _gen_transform_infos

        propagator = DTensor._op_dispatcher.sharding_propagator
        caches = [propagator.propagate_op_sharding, propagator._propagate_tensor_meta_cached,
                  _gen_transform_infos, MeshTopoInfo.build_from_mesh]
        clears = [c.cache_clear for c in caches] + [torch._C._clear_DTensor_sharding_propagator_cache]
    except (ImportError, AttributeError):
        return
    for clear in clears:
        clear()
    for group in groups:
        dist.destroy_process_group(group)
    gc.collect()  # a group's threads stop when its last reference goes: the case's model and meshes, in cycles
    # what outlived the case (the worker's captures and caches) is kept from every later collection's scan: a
    # full one over the imports' objects took 0.25 s, once a case a rank (about 150 s of a suite's run)
    gc.freeze()


def _fd_fill() -> float:
    """The share of its descriptor limit this process has open (0 where /proc cannot say)."""
    fds = "/proc/self/fd"
    return len(os.listdir(fds)) / resource.getrlimit(resource.RLIMIT_NOFILE)[0] if os.path.isdir(fds) else 0.0


def _threads() -> int:
    """How many threads this process has (0 where /proc cannot say): each gloo group a case's meshes
    leave open keeps two or more alive."""
    tasks = "/proc/self/task"
    return len(os.listdir(tasks)) if os.path.isdir(tasks) else 0


class _State:
    """What a case may change in its process and must leave as it found it (the RNG and the
    environment: reset for it)."""

    def __init__(self, rng: Any, py_rng: Any, dtype: Any, threads: int, grad: bool, env: dict[str, str]):
        self.rng, self.py_rng, self.dtype, self.threads, self.grad, self.env = rng, py_rng, dtype, threads, grad, env

    @classmethod
    def now(cls) -> _State:
        import torch

        return cls(torch.get_rng_state(), random.getstate(), torch.get_default_dtype(), torch.get_num_threads(),
                   torch.is_grad_enabled(), dict(os.environ))

    def leaks(self, before: _State) -> list[str]:
        """What differs from ``before``, put back as it was; one phrase each."""
        import torch

        left = []
        if self.dtype != before.dtype:
            left.append(f"the default dtype {self.dtype} (was {before.dtype})")
            torch.set_default_dtype(before.dtype)
        if self.threads != before.threads:
            left.append(f"torch.set_num_threads({self.threads}) (was {before.threads})")
            torch.set_num_threads(before.threads)
        if self.grad != before.grad:
            left.append(f"grad mode {'on' if self.grad else 'off'}")
            torch.set_grad_enabled(before.grad)
        # the environment goes back as it was, said or not: torch sets variables of its own on first use
        # ($TORCHINDUCTOR_CACHE_DIR), which is no fault of the case
        os.environ.clear()
        os.environ.update(before.env)
        return left


def _run_case(name: str, module: str, rank: int, world_size: int, fresh: _State) -> dict[str, Any]:
    import torch

    torch.set_rng_state(fresh.rng)
    random.setstate(fresh.py_rng)
    before = _State.now()
    start = time.perf_counter()
    where, _, case = name.rpartition(":")
    try:
        registry = importlib.import_module(where or module).CASES
        metrics = json.loads(json.dumps(dict(registry[case](rank, world_size) or {}), default=float))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        metrics = {"error": f"{type(exc).__name__}: {exc}", "error_type": type(exc).__name__,
                   "traceback": traceback.format_exc(), "failed_at": time.time()}
    left = _State.now().leaks(before)
    if left and "error" not in metrics:
        metrics.update(error="the case left " + ", ".join(left) + " behind: reset it before returning",
                       error_type="LeakedState", traceback="", failed_at=time.time())
    metrics["wall_s"] = round(time.perf_counter() - start, 3)
    return metrics


class _environment:
    """The request's environment variables for the length of its cases, then as they were."""

    def __init__(self, env: dict[str, str]):
        self.env, self.saved = env, {}

    def __enter__(self) -> None:
        self.saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)

    def __exit__(self, *exc: object) -> None:
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# ------------------------------------------------------------------ in the test process


class PoolBroke(Exception):
    """The batch cannot go on in this pool: ``index`` is the case that broke it, ``why`` says how
    (None: the ranks' own errors say it); ``start``: the pool never started, so nothing can run."""

    def __init__(self, index: int, why: str | None, start: bool = False):
        super().__init__(why)
        self.index, self.why, self.start = index, why, start


class RankPool:
    """W gloo worker processes that run requests of named cases; started on first use, started again
    after a case broke it, stopped by :meth:`close`."""

    def __init__(self, world_size: int, *, stall_timeout_s: float = STALL_TIMEOUT_S,
                 collective_timeout_s: float = COLLECTIVE_TIMEOUT_S, start_timeout_s: float = START_TIMEOUT_S,
                 error_grace_s: float = ERROR_GRACE_S, fd_recycle: float = FD_RECYCLE,
                 thread_recycle: int = THREAD_RECYCLE):
        self.world_size = world_size
        self.stall_timeout_s, self.collective_timeout_s = stall_timeout_s, collective_timeout_s
        self.start_timeout_s, self.error_grace_s, self.fd_recycle = start_timeout_s, error_grace_s, fd_recycle
        self.thread_recycle = thread_recycle
        self.starts = 0  # how many times the workers were spawned (a test reads it)
        self._procs: list[Any] = []
        self._inboxes: list[Any] = []
        self._outbox: Any = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._request = 0
        self.fd_fill = 0.0  # the largest share of its descriptor limit a worker had open after a request
        self.threads = 0  # the most threads a worker had after a request
        self.start_s = 0.0  # seconds spent spawning the workers and joining the group, every start together
        self.case_s: dict[str, float] = {}  # each case run: its slowest rank's wall time (the session's report)

    # -------------------------------------------------------------- running cases

    def run(self, cases: list[str], *, module: str = "equivalence_cases",
            env: dict[str, str] | None = None) -> dict[str, dict]:
        """Run ``cases`` in order on every rank; each name maps to rank 0's metrics, with every
        rank's under ``"ranks"`` and, where any rank failed, that rank's ``error``, ``traceback``
        and ``rank``."""
        per_rank: dict[str, list[dict | None]] = {name: [None] * self.world_size for name in cases}
        pending, restarts = list(cases), 0
        while pending:
            try:
                self._start()
                self._collect(self._submit(pending, module, env or {}), pending, per_rank)
                break
            except PoolBroke as broke:
                dead = {r: p.exitcode for r, p in enumerate(self._procs) if p.exitcode is not None}
                self.close(broken=True)
                if broke.start:
                    for name in pending:
                        per_rank[name] = [_synthetic(broke.why or "")] * self.world_size
                    break
                name = pending[broke.index]
                for r, got in enumerate(per_rank[name]):
                    if r in dead and (got is None or "error" in got):  # the death is the cause, not its peers'
                        per_rank[name][r] = _synthetic(f"rank {r}'s process died while running it "
                                                       f"({_exit_words(dead[r])})", cause=True)
                    elif got is None:
                        per_rank[name][r] = _synthetic(broke.why or "did not finish: the pool was stopped after "
                                                       "another rank failed this case")
                for later in pending[broke.index + 1:]:
                    per_rank[later] = [None] * self.world_size
                pending, restarts = pending[broke.index + 1:], restarts + 1
                if restarts > MAX_RESTARTS and pending:
                    for later in pending:
                        per_rank[later] = [_synthetic(f"not run: {MAX_RESTARTS + 1} cases of this request "
                                                      f"broke the pool, the last {name}")] * self.world_size
                    break
        merged = {name: _merge(name, per_rank[name]) for name in cases}
        for name, m in merged.items():
            walls = [r.get("wall_s", 0.0) for r in m["ranks"]]
            self.case_s[name] = self.case_s.get(name, 0.0) + max(walls, default=0.0)
        return merged

    def _submit(self, cases: list[str], module: str, env: dict[str, str]) -> int:
        self._request += 1
        for inbox in self._inboxes:
            inbox.put(("run", self._request, module, list(cases), env))
        return self._request

    def _collect(self, request: int, cases: list[str], per_rank: dict[str, list[dict | None]]) -> None:
        """Read every rank's results of ``request`` until each says done; raise :class:`PoolBroke`
        at the first case that failed on a rank, hung, or lost a worker."""
        at = [0] * self.world_size  # the index of the case each rank is running
        done: set[int] = set()
        last = time.monotonic()
        while len(done) < self.world_size:
            msg = self._next(request)
            if msg is None:
                self._check_alive(at, cases)
                if time.monotonic() - last > self.stall_timeout_s:
                    raise self._stuck(at, f"no rank finished a case for {self.stall_timeout_s:.0f} s")
                continue
            last = time.monotonic()
            if msg[0] == "done":
                done.add(msg[2])
                self.fd_fill, self.threads = max(self.fd_fill, msg[3]), max(self.threads, msg[4])
                continue
            _, _, rank, name, metrics = msg
            i = at[rank]
            per_rank[name][rank], at[rank] = metrics, i + 1
            if "error" in metrics:
                self._wait_for_peers(request, i, at, per_rank, cases)
                if min(at) < i:  # a rank never got this far: that case broke the group, this error followed
                    raise self._stuck(at, f"its peers went on and case {cases[i]} failed on rank {rank}")
                raise PoolBroke(i, None)

    def _stuck(self, at: list[int], how: str) -> PoolBroke:
        i = min(at)
        stuck = ", ".join(str(r) for r in range(self.world_size) if at[r] == i)
        return PoolBroke(i, f"did not finish on rank(s) {stuck}: it hung, or the ranks desynchronised ({how}; "
                            f"the pool of {self.world_size} was stopped)")

    def _wait_for_peers(self, request: int, i: int, at: list[int], per_rank: dict[str, list[dict | None]],
                        cases: list[str]) -> None:
        """One rank failed case ``i``: give the others a moment to report it too (their own errors,
        or results), so the report can say which rank failed first."""
        deadline = time.monotonic() + self.error_grace_s
        while any(a <= i for a in at) and time.monotonic() < deadline:
            msg = self._next(request)
            if msg is None:
                if any(p.exitcode is not None for p in self._procs):
                    return
                continue
            if msg[0] == "case":
                _, _, rank, name, metrics = msg
                per_rank[name][rank] = metrics
                at[rank] += 1

    def _next(self, request: int) -> tuple | None:
        """The next message of ``request`` (stale ones dropped), or None after half a second."""
        try:
            msg = self._outbox.get(timeout=0.5)
        except queue.Empty:
            return None
        return msg if msg[1] == request else None

    def _check_alive(self, at: list[int], cases: list[str]) -> None:
        dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if p.exitcode is not None]
        if dead:
            rank, code = dead[0]
            raise PoolBroke(min(at[rank], len(cases) - 1), f"rank {rank}'s process died while running it "
                                                            f"({_exit_words(code)})")

    # -------------------------------------------------------------- starting and stopping

    @property
    def processes(self) -> list[Any]:
        """The live workers' processes, in rank order (empty before the first request and after close)."""
        return list(self._procs)

    def _start(self) -> None:
        """Spawn the workers unless they are all alive, and wait until each has joined the group."""
        alive = bool(self._procs) and all(p.exitcode is None for p in self._procs)
        if alive and self.fd_fill < self.fd_recycle and self.threads <= self.thread_recycle:
            return
        # a worker died between requests (stop the others at once), or the groups its cases left hold
        # too many of its descriptors or threads (stop them as at the end): hundreds of idle gloo
        # threads a worker on two cores slow every later case
        self.close(broken=not alive)
        self.fd_fill, self.threads = 0.0, 0
        ctx = fork_server.context()
        self._tmp = tempfile.TemporaryDirectory(prefix=f"autopar-ranks{self.world_size}-")
        store = str(Path(self._tmp.name, "store"))
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [ctx.Process(target=_serve, name=f"autopar-rank{r}-of-{self.world_size}",
                                   args=(r, self.world_size, store, self._inboxes[r], self._outbox,
                                         self.collective_timeout_s))
                       for r in range(self.world_size)]
        started = time.monotonic()
        for p in self._procs:
            p.start()
        self.starts += 1
        try:
            self._await_ready()
        finally:
            self.start_s += time.monotonic() - started

    def _await_ready(self) -> None:
        ready: set[int] = set()
        deadline = time.monotonic() + self.start_timeout_s
        while len(ready) < self.world_size:
            try:
                msg = self._outbox.get(timeout=0.5)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if p.exitcode is not None]
                late = time.monotonic() > deadline
                if dead or late:
                    self.close(broken=True)
                    why = (f"rank {dead[0][0]} exited ({_exit_words(dead[0][1])})" if dead
                           else f"ranks {sorted(set(range(self.world_size)) - ready)} not ready in "
                                f"{self.start_timeout_s:.0f} s")
                    raise PoolBroke(0, f"the pool of {self.world_size} ranks did not start: {why}",
                                    start=True) from None
                continue
            if msg[0] == "failed":
                self.close(broken=True)
                raise PoolBroke(0, f"rank {msg[1]} could not join the process group:\n{msg[2]}", start=True)
            ready.add(msg[1])

    def close(self, *, broken: bool = False) -> None:
        """Stop the workers: ask them (each destroys its process group and returns), then terminate,
        then kill; ``broken``: a case broke the group, its workers may be stuck, terminate at once."""
        if not self._procs:
            return
        if not broken:
            for inbox, p in zip(self._inboxes, self._procs):
                if p.exitcode is None:
                    inbox.put(("stop",))
            deadline = time.monotonic() + 10.0
            for p in self._procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for stop in (lambda p: p.terminate(), lambda p: p.kill()):
            alive = [p for p in self._procs if p.exitcode is None]
            for p in alive:
                stop(p)
            for p in alive:
                p.join(timeout=5.0)
        for q in [*self._inboxes, self._outbox]:
            q.close()
            q.cancel_join_thread()
        self._procs, self._inboxes, self._outbox = [], [], None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RankPools:
    """One :class:`RankPool` per world size, made on first use (the ``ranks`` fixture's ``get``).

    At most ``max_workers`` processes stay alive together (each holds torch, the models its cases
    built and their groups: a few hundred MB): asking for a pool that would pass it first stops the
    pools used least recently, which start again if asked for again; so does a pool of W asked for
    while the machine has less than W × ``worker_bytes`` available. The default, 14, keeps the 2, 4
    and 8 that seven test modules each ask for alive together (at 8, each such module restarted all three).
    """

    def __init__(self, max_workers: int = 14, worker_bytes: int = 1 << 30,
                 available: Callable[[], int | None] | None = None) -> None:
        self.max_workers, self.worker_bytes = max_workers, worker_bytes
        self.available = available or _available_bytes
        self.pools: dict[int, RankPool] = {}  # least recently asked for first
        self.seen: dict[int, RankPool] = {}  # every pool made, by world size (the session's report)

    def get(self, world_size: int) -> RankPool:
        pool = self.seen[world_size] = self.pools.pop(world_size, None) or RankPool(world_size)
        for other in list(self.pools.values()):
            alive = sum(p.world_size for p in self.pools.values() if p.processes)
            if alive == 0 or pool.processes:  # nothing else to stop, or this pool is running already
                break
            free = self.available()
            if alive + world_size <= self.max_workers and (free is None or free >= world_size * self.worker_bytes):
                break
            other.close()
        self.pools[world_size] = pool
        return pool

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()

    def report(self, slowest: int = 15) -> list[str]:
        """Lines for the session's summary: each world size's starts and the seconds they took, and the
        ``slowest`` cases by their slowest rank's wall time (a test's setup time is its fixture's cases)."""
        if not self.seen:
            return []
        lines = [f"rank pools: W={w}: {p.starts} start(s), {p.start_s:.0f} s starting, {len(p.case_s)} case(s), "
                 f"{sum(p.case_s.values()):.0f} s running them" for w, p in sorted(self.seen.items())]
        cases = sorted(((s, w, name) for w, p in self.seen.items() for name, s in p.case_s.items()), reverse=True)
        lines += [f"{s:8.2f}s W={w} {name}" for s, w, name in cases[:slowest]]
        return lines


def _available_bytes() -> int | None:
    """The memory the machine has available for new processes (Linux's MemAvailable; None where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    except OSError:
        return None


def run_cases(world_size: int, cases: list[str], *, module: str = "equivalence_cases") -> dict[str, dict]:
    """``cases`` on a pool of its own, stopped after (tests use the session's ``ranks`` fixture)."""
    with RankPool(world_size) as pool:
        return pool.run(cases, module=module)


def _exit_words(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _synthetic(why: str, cause: bool = False) -> dict[str, Any]:
    """A rank's result the pool wrote for it; ``cause``: reported before any rank's own error."""
    return {"error": why, "error_type": "PoolError", "traceback": "", "failed_at": float("-inf" if cause else "inf")}


def _merge(name: str, ranks: list[dict | None]) -> dict[str, Any]:
    """Rank 0's metrics, every rank's under ``ranks``, and the error of the rank that failed first."""
    ranks = [m if m is not None else _synthetic("no result") for m in ranks]
    out = dict(ranks[0], case=name, ranks=ranks)
    failed = sorted((m["failed_at"], r) for r, m in enumerate(ranks) if "error" in m)
    if failed:
        first = failed[0][1]
        out.update(error=ranks[first]["error"], error_type=ranks[first].get("error_type"),
                   traceback=ranks[first].get("traceback", ""), rank=first,
                   also_failed=sorted(r for _, r in failed[1:]))
    return out


# ------------------------------------------------------------------ assertions on the metrics

EXACT = 1e-5  # first-step loss and gradients, SGD losses and parameters: ‖Δ‖/‖ref‖ per tensor
ADAM = 1e-3  # AdamW losses (Adam turns rounding noise into full-size updates)


def ok(metrics: dict) -> dict:
    """The case's metrics, or a test failure naming the case and the failing rank, with its error
    and traceback."""
    import pytest

    if "error" in metrics:
        also = metrics.get("also_failed") or []
        others = f" (it failed on rank(s) {', '.join(map(str, also))} too)" if also else ""
        pytest.fail(f"case {metrics.get('case', '?')}, rank {metrics.get('rank', 0)}: {metrics['error']}{others}\n"
                    f"{metrics.get('traceback', '')}", pytrace=False)
    return metrics


def every_rank(metrics: dict) -> list[dict]:
    """Each rank's metrics of a case that failed on no rank, in rank order."""
    return ok(metrics)["ranks"]


def check_equivalent(m: dict) -> None:
    """The equivalence bar of the lowering issue, on every rank's metrics of one case (each rank
    compares its own losses, full gradients and full parameters with one process)."""
    for rank, r in enumerate(every_rank(m)):
        assert r["loss1_rel"] < EXACT, (rank, r)
        assert r["grad_rel"] < EXACT, (rank, r["grad_worst"], r["grad_rel"])
        assert r["sgd_loss_rel"] < EXACT, (rank, r)
        assert r["param_rel"] < EXACT, (rank, r["param_worst"], r["param_rel"])
        if r["adam_loss_rel"] is not None:  # the cases that run AdamW: one an engine (equivalence_cases.ADAM_CASES)
            assert r["adam_loss_rel"] < ADAM, (rank, r)
