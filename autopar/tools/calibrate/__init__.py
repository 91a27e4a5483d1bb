"""``autopar calibrate``: measure this machine and write a cluster file the planner accepts.

    autopar calibrate --nproc 4 -o cluster.json
    autopar plan examples/gpt.py:gpt_tiny --world-size 4 --cluster cluster.json

``nproc`` ranks are started on this host, configured as training runs them
(:func:`autopar.tools.host.threads_per_process` threads each; gloo on CPU, NCCL on
GPUs), and measure *at the same time*, so contention for shared cores and
memory bandwidth is in the figures:

- compute: forward + backward of pre-LN transformer layers (GELU MLP,
  layer norms, softmax attention: the matmul-heavy layers training spends
  its time in, elementwise work included) at several widths, FLOPs counted by the same
  ``FlopCounterMode`` that capture uses; fitted to the compute model
  ``time = (work + flops_½) / (peak · η)`` (:mod:`autopar.cost_models.compute`),
  with ``peak`` a large GEMM's throughput;
- communication: all-reduce, all-gather, reduce-scatter and point-to-point
  over message sizes, each fitted to ``α + bytes · bus factor / busbw``
  (the link's figures are the all-reduce's, the others are kept per kind:
  gloo's all-gather and reduce-scatter are much slower than its all-reduce);
- overlap: an all-reduce issued asynchronously under layer compute, which
  gives the fraction of compute that hides communication (1 on GPUs, where
  copies run on separate engines; below 1 where collectives share the cores);
- optimizer: an AdamW step, whose bytes touched per second become the
  ``memory_bandwidth_bytes_s`` the optimizer term is priced with, and the
  same step over small parameters as plain tensors and as DTensors, whose
  difference per parameter becomes ``optimizer_dtensor_s``;
- tensor parallelism: a Megatron MLP over all ranks with DTensor against its
  local shard, which gives what each tensor-parallel collective costs beyond
  its link figures (``tp_overhead_s``: DTensor's dispatch and redistribution,
  paid in line on a CPU, hidden on a GPU whose host runs ahead);
- ZeRO: a stack of FSDP2 units against the same layers unsharded, which
  gives what each of FSDP2's collectives costs beyond its link figures
  (``zero_overhead_s``: its hooks and buffer copies, on CPU hosts).

The cluster file is written only once every measurement has finished, to a
temporary file renamed into place, so an interrupted run leaves no
half-written file behind.

The package: :mod:`.probes` is what runs inside the process group and measures,
:mod:`.fit` turns the measurements into the cluster's figures, and this module
starts the ranks, fits and writes the file.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from autopar.cost_models.hardware import ClusterSpec
from autopar.tools.calibrate.errors import CalibrationError, CalibrationInterrupted
from autopar.tools.calibrate.fit import (
    Measurements,
    build_cluster,
    cluster_document,
    fit_compute,
    fit_gemm,
    fit_line,
    fit_link,
    fit_op_model,
    measurements_from_dict,
    overlap_fraction,
)
from autopar.tools.calibrate.probes import (
    CPU_SIZES,
    GPU_SIZES,
    ProbeSizes,
    _worker,
    measure_in_process_group,
    probe_sizes,
)
from autopar.tools.host import available_memory_bytes, check_local_processes, stop_processes
from autopar.units import GiB

__all__ = [
    "CPU_SIZES", "GPU_SIZES", "CalibrationError", "CalibrationInterrupted", "Measurements",
    "ProbeSizes", "build_cluster", "calibrate", "check_output_path", "cluster_document", "describe",
    "fit_compute", "fit_gemm", "fit_line", "fit_link", "fit_op_model", "measure", "measure_in_process_group",
    "measurements_from_dict", "overlap_fraction", "probe_sizes", "write_atomically",
]


def write_atomically(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory, renamed into place."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_output_path(path: str | os.PathLike[str]) -> None:
    """Fail before measuring, not after, when the cluster file cannot be written."""
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise CalibrationError(f"cannot write {str(path)!r}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise CalibrationError(f"cannot write {str(path)!r}: directory {str(parent)!r} is not writable")
    if Path(path).is_dir():
        raise CalibrationError(f"cannot write {str(path)!r}: it is a directory")


def measure(nproc: int, *, backend: str = "auto", quick: bool = False,
            timeout_s: float = 600.0) -> Measurements:
    """Start ``nproc`` local ranks, measure, and return rank means (see the module docstring)."""
    import torch
    import torch.multiprocessing as mp

    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nproc else "gloo"
    if backend not in ("gloo", "nccl"):
        raise CalibrationError(f"backend must be gloo, nccl or auto, got {backend!r}")
    check_local_processes(nproc, backend=backend)
    sizes = probe_sizes(backend, quick)
    free = available_memory_bytes() or 0
    memory_bytes = free // nproc  # ranks share the host's memory
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="autopar-calibrate-") as tmp:
        out = os.path.join(tmp, "measurements.json")
        ctx = mp.start_processes(_worker, args=(nproc, backend, os.path.join(tmp, "store"), out, sizes,
                                                memory_bytes),
                                 nprocs=nproc, join=False, start_method="spawn")
        try:
            while not ctx.join(timeout=0.5):
                if time.perf_counter() - started > timeout_s:
                    raise CalibrationError(f"calibration did not finish in {timeout_s:.0f} s")
        except mp.ProcessRaisedException as exc:
            lines = [l for l in str(exc).strip().splitlines() if l.strip()]
            raise CalibrationError(f"a rank failed: {lines[-1] if lines else exc}") from None
        except mp.ProcessExitedException as exc:
            raise CalibrationError(f"a rank exited early ({exc}); nothing was written") from None
        except KeyboardInterrupt:
            raise CalibrationInterrupted("calibration interrupted; no cluster file was written") from None
        finally:
            stop_processes(ctx.processes)
        return measurements_from_dict(json.loads(Path(out).read_text()))


def calibrate(nproc: int, output: str | os.PathLike[str] | None = None, *, backend: str = "auto",
              name: str | None = None, quick: bool = False) -> ClusterSpec:
    """Measure this host with ``nproc`` ranks, fit, and write the cluster file to ``output`` if given.

    SIGTERM is treated like ^C: the ranks are stopped and nothing is written.
    """
    if output is not None:
        check_output_path(output)

    def _terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        m = measure(nproc, backend=backend, quick=quick)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if name is None and output is not None:  # a file you name mycluster.json plans as mycluster
        name = Path(output).stem
    cluster = build_cluster(m, name=name)
    if output is not None:
        write_atomically(output, json.dumps(cluster_document(cluster, m), indent=2) + "\n")
    return cluster


def describe(cluster: ClusterSpec) -> str:
    """The fitted figures, one per line, for the CLI: a label column, then the figure."""
    d, link = cluster.device, cluster.intra_node

    def line(label: str, text: str) -> str:
        return f"  {label:<16}{text}"  # the longest label, reduce_scatter, keeps two spaces

    def per_kind(kind: str) -> str:
        k = link.for_kind(kind)
        return line(kind, f"α {k.latency_s * 1e6:5.0f} µs, bus bandwidth {k.bandwidth_bytes_s / 1e9:.2f} GB/s")

    return "\n".join([
        f"cluster {cluster.name}: {cluster.gpus_per_node} × {d.name}, backend {cluster.backend}",
        line("compute", f"{d.peak_flops_fp32 / 1e9:.1f} GFLOP/s fp32 peak (GEMM), layers reach "
             f"{d.matmul_efficiency:.2f} of it; per-call overhead worth {d.half_efficiency_flops / 1e6:.2f} MFLOP"),
        *([line("per op", f"GEMMs at half rate at k = {d.op_model.gemm_k_half:.0f}, "
                f"{d.op_model.kernel_overhead_s * 1e6:.1f} µs a kernel, elementwise ops at "
                f"{d.op_model.bandwidth_fraction:.2f} of the bandwidth, attention at "
                f"{d.op_model.attention_fwd:.2f} / {d.op_model.attention_bwd:.2f} of the GEMM rate")]
          if d.op_model is not None else []),
        *(per_kind(kind) for kind in ("all_reduce", "all_gather", "reduce_scatter", "p2p")),
        line("overlap", f"{cluster.comm_overlap:.2f} of compute hides communication"),
        *([line("host", f"{cluster.cores_per_node} cores shared by the {cluster.gpus_per_node} ranks")]
          if cluster.cores_per_node else []),
        line("tensor par.", f"{cluster.tp_overhead_s * 1e3:.2f} ms per collective beyond the link (DTensor)"),
        line("optimizer", f"{d.memory_bandwidth_bytes_s / 1e9:.2f} GB/s of optimizer state touched, "
             f"{cluster.optimizer_dtensor_s * 1e6:.0f} µs more per DTensor parameter"),
        line("ZeRO", f"{cluster.zero_overhead_s * 1e3:.2f} ms per collective beyond the link (FSDP2)"),
        line("memory", f"{d.memory_bytes / GiB:.1f} GiB per rank"),
    ])
