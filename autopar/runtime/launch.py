"""Launch: the process group, this rank's device, and the plan every rank agrees on.

A rank that raises must not hang the others: every check that can fail on
bad input (world size, a plan for another model) is deterministic — the same
on every rank given the same plan — and runs before the first collective.

Without a ``cluster``, compile prices its plan on the machine it runs on
(:func:`local_cluster`).

Ending cleanly (:func:`hold`, :func:`shutdown`). A gloo worker thread
finishes a collective, wakes the caller, and only then drops its reference
to the collective's tensors. If Python has already dropped its own, the
tensor's Python object now belongs to that C++ reference, and the worker
must take the GIL to free it. Near the end of a script the caller runs on
to interpreter finalization while the worker waits for the GIL; a thread
taking the GIL during finalization is ended with ``pthread_exit``, which,
unwinding through the worker's ``noexcept`` loop, is ``terminate called
without an active exception`` and exit −6 (seen in 2 of 40 runs of
``examples/train_gpt.py`` before this was fixed; faulthandler showed the
aborting thread with no Python frame and the main thread already gone).
So the runtime keeps the tensors of its last collectives alive (:func:`hold`:
the worker's release is then a plain C++ decrement, needing no GIL), and
:func:`shutdown`, registered at exit when autopar starts the process group,
waits until gloo has let go of them (their C++ use count is back to one),
destroys the groups and collects the garbage while the interpreter is whole.
"""

from __future__ import annotations

import atexit
import gc
import os
import time
import warnings
from collections import deque
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.errors import AutoparError, PlanError
from autopar.graph import LayerGraph
from autopar.plan import Plan


def ensure_process_group() -> bool:
    """True inside a process group; under torchrun's env vars, initialise one (NCCL on GPU, else gloo)."""
    if not dist.is_available():
        return False
    if dist.is_initialized():
        return True
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return False
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    atexit.register(shutdown)
    return True


RELEASE_TIMEOUT_S = 1.0
_HELD: deque[torch.Tensor] = deque(maxlen=8)  # the last collectives' tensors (see the module docstring)


def hold(tensor: torch.Tensor) -> torch.Tensor:
    """Keep ``tensor``, just used by a collective, alive until later collectives replace it or
    :func:`shutdown`, so no gloo worker has to free its Python object. Costs nothing a step."""
    if tensor.device.type == "cpu":  # NCCL's work objects keep theirs for the watchdog: not this race
        _HELD.append(tensor)
    return tensor


def released(tensor: torch.Tensor, timeout_s: float = RELEASE_TIMEOUT_S) -> torch.Tensor:
    """``tensor`` once no gloo worker holds it any more (its C++ use count is one: ours)."""
    deadline = time.monotonic() + timeout_s
    while tensor._use_count() > 1 and time.monotonic() < deadline:
        time.sleep(1e-4)  # lets the worker take the GIL and run
    return tensor


def shutdown() -> None:
    """Let gloo release the held tensors, destroy every process group and collect the garbage,
    while the interpreter is whole. Safe to call twice and after the user's own
    ``destroy_process_group``."""
    while _HELD:
        released(_HELD.popleft())
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class UnknownDeviceWarning(UserWarning):
    """This machine's GPU matches no cluster preset, so compile priced its plan on another one."""


def local_cluster() -> str:
    """The preset of the machine this process runs on: its CUDA device's, else ``cpu``.

    A GPU that matches no preset warns (:class:`UnknownDeviceWarning`) and
    gives the planning API's default cluster.
    """
    from autopar.cost_models.presets import preset_for_device
    from autopar.planning.api import DEFAULT_CLUSTER

    if not torch.cuda.is_available():
        return "cpu"
    index = torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    memory = torch.cuda.get_device_properties(index).total_memory
    preset = preset_for_device(name, memory)
    if preset is None:
        warnings.warn(f"no cluster preset matches this machine's GPU ({name}, {memory / 2**30:.1f} GiB): "
                      f"pricing the plan on {DEFAULT_CLUSTER}; pass cluster= a preset or a cluster "
                      "file from `autopar calibrate`", UnknownDeviceWarning, stacklevel=6)
        return DEFAULT_CLUSTER
    return preset


# ------------------------------------------------------------------ the plan


def _solve_everywhere(graph: LayerGraph, world_size: int, launched: bool, **kwargs: Any) -> Plan:
    """Solve on rank 0 and broadcast, so every rank lowers the same plan (CP-SAT with
    several workers may pick different optima); an error on rank 0 is raised on all.
    Without a cluster, the solving rank prices on its own machine (:func:`local_cluster`)."""
    from autopar.planning.api import solve

    def solve_here() -> Plan:
        if kwargs.get("cluster") is None:
            kwargs["cluster"] = local_cluster()
        return solve(graph, world_size, **kwargs)

    if not launched or dist.get_world_size() == 1:
        return solve_here()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("plan", solve_here().to_json())
        except AutoparError as exc:
            box[0] = ("error", type(exc).__name__, str(exc))
    dist.broadcast_object_list(box, src=0)
    if box[0][0] == "error":
        import autopar.errors as errors

        raise getattr(errors, box[0][1], AutoparError)(box[0][2])
    return Plan.from_json(box[0][1])


def capture_for(model: nn.Module, example_inputs: Any) -> LayerGraph:
    """``model``'s graph, captured with ``example_inputs`` (which ``compile`` needs to plan)."""
    if example_inputs is None:
        raise AutoparError("compile needs example_inputs to capture the model "
                           "(a tuple of tensors shaped like one batch)")
    from autopar.capturing import capture

    return capture(model, example_inputs)


def resolve_plan(model: nn.Module, example_inputs: Any, plan: Plan | str | Path | None,
                 graph: LayerGraph | None, world_size: int, launched: bool,
                 **solve_kwargs: Any) -> tuple[Plan, LayerGraph]:
    """The plan to run and the graph it was made for (captured unless given)."""
    if graph is None:
        graph = capture_for(model, example_inputs)
    if plan is None:
        return _solve_everywhere(graph, world_size, launched, **solve_kwargs), graph
    if isinstance(plan, (str, Path)):
        return Plan.load(plan, fingerprint=graph.fingerprint()), graph
    if not isinstance(plan, Plan):
        raise PlanError(f"plan must be a Plan or a path to plan JSON, got {type(plan).__name__}")
    plan.check_fingerprint(graph.fingerprint())
    return plan, graph


# ------------------------------------------------------------------ what a launch reports


def _error_text(failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    message = " ".join(str(message).split())
    return "" if message.startswith("To enable traceback") or message.startswith("Signal ") else message


def bad_input_only(failures: dict[int, Any]) -> bool:
    """Every rank that failed of itself exited with code 2 (bad input, as autopar's own commands
    report it); the others were stopped by the launcher."""
    import signal

    own = [f.exitcode for f in failures.values() if f.exitcode != -signal.SIGTERM]
    return bool(own) and all(code == 2 for code in own)


def describe_failures(script: str, failures: dict[int, Any], nproc: int) -> str:
    """One line naming every failed rank, the first to fail first: its exit code or the signal that
    ended it, and its error (the exception's type and message, when the rank recorded one).

    ``failures`` maps a global rank to torchrun's ``ProcessFailure``. A rank ended by SIGTERM
    after another one failed was stopped by the launcher, and is said so."""
    import signal

    ordered = sorted(failures.items(), key=lambda kv: (kv[1].timestamp, kv[1].exitcode == -signal.SIGTERM,
                                                      kv[0]))
    first = ordered[0][0]
    parts, stopped = [], 0
    for rank, failure in ordered:
        code, error = failure.exitcode, _error_text(failure)
        if code < 0:
            name = failure.signal_name()
            if code == -signal.SIGTERM and rank != first:
                parts.append(f"rank {rank} was stopped by the launcher ({name}) after rank {first} failed")
                stopped += 1
                continue
            what = f"rank {rank} was killed by {name}" + (" (aborted)" if code == -signal.SIGABRT else "")
        else:
            what = f"rank {rank} exited with code {code}"
        parts.append(what + (f": {error}" if error else ""))
    return f"{script} failed on {len(failures) - stopped} of {nproc} processes: " + "; ".join(parts)
