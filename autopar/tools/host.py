"""The local host: how many processes it can run, and how each one is set up.

Every place that starts local ranks (``autopar calibrate``, ``autopar
verify``, the fidelity benchmark) uses :func:`threads_per_process`, so a
calibrated cluster describes processes configured the way training runs them.
torchrun does the same for CPU ranks (``OMP_NUM_THREADS=1`` when it starts
several per host on a 2-core machine).
"""

from __future__ import annotations

import os

from autopar.errors import AutoparError
from autopar.units import GiB

# Resident memory of one idle rank: torch, gloo and the Python interpreter
# (about 0.4 GiB measured with torch 2.13 on CPU), with headroom for measurement.
PROCESS_OVERHEAD_BYTES = 3 * GiB // 2
# Beyond this many ranks per core, timings measure the OS scheduler, not the ranks.
MAX_PROCESSES_PER_CORE = 4


def cpu_count() -> int:
    """Cores this process may run on (its affinity mask, not the whole machine)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_per_process(nproc: int) -> int:
    """Intra-op threads for each of ``nproc`` ranks sharing this host: the cores split evenly."""
    return max(1, cpu_count() // max(1, nproc))


def available_memory_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo (None where the kernel does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_local_processes(nproc: int, *, backend: str) -> None:
    """Raise :class:`AutoparError` unless this host can run ``nproc`` ranks on ``backend``."""
    if not isinstance(nproc, int) or nproc < 2:
        raise AutoparError(f"--nproc must be at least 2 (collectives need two ranks), got {nproc}")
    if backend == "nccl":
        import torch

        gpus = torch.cuda.device_count()
        if nproc > gpus:
            raise AutoparError(f"--nproc {nproc} needs {nproc} GPUs for NCCL but this machine has "
                               f"{gpus}; use --nproc {gpus} or --backend gloo")
        return
    cores = cpu_count()
    if nproc > MAX_PROCESSES_PER_CORE * cores:
        raise AutoparError(f"--nproc {nproc} is more than {MAX_PROCESSES_PER_CORE} processes per core on "
                           f"this {cores}-core machine, where timings would measure the scheduler; "
                           f"use at most {MAX_PROCESSES_PER_CORE * cores}")
    free = available_memory_bytes()
    if free is not None and nproc * PROCESS_OVERHEAD_BYTES > free:
        most = max(1, free // PROCESS_OVERHEAD_BYTES)
        raise AutoparError(f"--nproc {nproc} needs about {nproc * PROCESS_OVERHEAD_BYTES / GiB:.1f} GiB "
                           f"but {free / GiB:.1f} GiB is available; use at most {most}")


def stop_processes(processes: list) -> None:
    """End the ranks a spawn started (those still alive terminated, each then joined for up to 5 s): what a
    spawn's caller does on its way out, finished or not."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(timeout=5)

