"""Launch: the process group, this rank's device, and the plan every rank agrees on.

A rank that raises must not hang the others: every check that can fail on
bad input (world size, a plan for another model) is deterministic — the same
on every rank given the same plan — and runs before the first collective.

Without a ``cluster``, compile prices its plan on the machine it runs on
(:func:`local_cluster`).
"""

from __future__ import annotations

import os
import warnings
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
    return True


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
    from autopar.cost_models.hardware import preset_for_device
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


def launch_hint(world_size: int) -> str:
    return (f"launch one process per rank: `torchrun --nproc-per-node {world_size} script.py` "
            f"or `autopar run script.py --nproc {world_size}`")


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


def resolve_plan(model: nn.Module, example_inputs: Any, plan: Plan | str | Path | None,
                 graph: LayerGraph | None, world_size: int, launched: bool,
                 **solve_kwargs: Any) -> tuple[Plan, LayerGraph]:
    """The plan to run and the graph it was made for (captured unless given)."""
    if graph is None:
        if example_inputs is None:
            raise AutoparError("compile needs example_inputs to capture the model "
                               "(a tuple of tensors shaped like one batch)")
        from autopar.capturing import capture

        graph = capture(model, example_inputs)
    if plan is None:
        return _solve_everywhere(graph, world_size, launched, **solve_kwargs), graph
    if isinstance(plan, (str, Path)):
        return Plan.load(plan, fingerprint=graph.fingerprint()), graph
    if not isinstance(plan, Plan):
        raise PlanError(f"plan must be a Plan or a path to plan JSON, got {type(plan).__name__}")
    plan.check_fingerprint(graph.fingerprint())
    return plan, graph


def check_world(plan: Plan, world_size: int, launched: bool) -> None:
    if launched and dist.get_world_size() != plan.world_size:
        raise PlanError(f"the plan is for {plan.world_size} ranks but {dist.get_world_size()} "
                        f"were launched: re-plan for {dist.get_world_size()} or "
                        f"{launch_hint(plan.world_size)}")
    if plan.world_size != world_size:
        raise PlanError(f"the plan is for {plan.world_size} ranks but world_size is {world_size}: "
                        "re-plan for this world size")
