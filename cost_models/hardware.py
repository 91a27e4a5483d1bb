"""Hardware: devices, links and clusters, with presets and user files.

A cluster is ``nodes`` hosts of ``gpus_per_node`` identical devices. Inside a
node, devices talk over ``intra_node`` (NVLink: bandwidth is the nccl-tests
*bus* bandwidth); between nodes over ``inter_node`` (bandwidth is one NIC's),
with ``nics_per_node`` NICs shared by the node's devices.

Preset figures are public (DESIGN.md "Cost model facts") or measured on a GPU this project
was lent (``gpu_figures``); a preset's compute efficiency (``matmul_efficiency``) is the
device's measured GEMM efficiency times the eager stack's share of it, the one figure fitted
to the calibration set (``benchmarks/calibration_set.py --fit`` prints the fit).
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError
from autopar.units import GiB

GB = 1e9


class CostModelError(AutoparError):
    """Base class of errors raised by the cost models for bad input (an :class:`AutoparError`)."""


class ClusterError(CostModelError):
    """A cluster name is unknown or a cluster description is incomplete or invalid."""


# torch.compile's memory-bound ops at this fraction of their eager time (the assumption, its source and
# where pricing applies it: ``cost_models.compute``); ``autopar calibrate`` measures it per device
COMPILED_MEMORY_BOUND_FRACTION = 0.5


@dataclass(frozen=True)
class OpModel:
    """The device's terms for pricing a layer op by op (``cost_models.compute``), beyond its peak.

    A GEMM runs its output in ``tile_m`` × ``tile_n`` tiles, ``sm_count`` at a
    time (0: no wave quantisation, as on a CPU), at an efficiency that ramps
    with the reduction depth k as k / (k + ``gemm_k_half``); every kernel pays
    ``kernel_overhead_s``; memory-bound ops move their bytes at
    ``bandwidth_fraction`` of the device's memory bandwidth; fused attention
    runs at ``attention_fwd`` (forward) and ``attention_bwd`` (backward) of the
    large-GEMM rate, a call with an explicit mask at ``masked_attention_fwd`` /
    ``masked_attention_bwd`` of those (1 where the fused kernel takes masks, as
    on a CPU; on CUDA the flash kernel takes none); under torch.compile memory-bound ops take
    ``compiled_memory_bound_fraction`` of their eager time (inductor fuses
    them with their neighbours). ``host_op_s`` is what the host spends issuing one eager op (Python,
    the dispatcher, autograd, the launch): a layer takes at least its ops' host time, however fast its
    kernels (0 where the host is the device, as on a CPU, whose ``kernel_overhead_s`` already holds it).
    Presets cite each figure (``cost_models.gpu_figures``); ``autopar calibrate`` measures them on its host.
    """

    sm_count: int
    tile_m: int
    tile_n: int
    gemm_k_half: float
    kernel_overhead_s: float
    bandwidth_fraction: float
    attention_fwd: float
    attention_bwd: float
    compiled_memory_bound_fraction: float = COMPILED_MEMORY_BOUND_FRACTION
    masked_attention_fwd: float = 1.0
    masked_attention_bwd: float = 1.0
    host_op_s: float = 0.0

    def shape_factor(self, m: float, n: float, k: float, batch: float = 1.0) -> float:
        """The share of the large-GEMM rate one GEMM of ``batch`` (m × k)·(k × n) products reaches: the
        ramp in its reduction depth, k / (k + k½), times the tile and wave quantisation of its m × n output
        (``cost_models.compute``'s module docstring)."""
        ramp = k / (k + self.gemm_k_half)
        if self.sm_count <= 0:
            return ramp
        tiles = math.ceil(m / self.tile_m) * math.ceil(n / self.tile_n) * math.ceil(batch)
        waves = math.ceil(tiles / self.sm_count)
        return ramp * min(1.0, m * n * batch / (waves * self.sm_count * self.tile_m * self.tile_n))


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or one CPU process in the ``cpu`` preset).

    ``peak_flops_bf16`` / ``peak_flops_fp32`` are dense peak FLOP/s;
    ``peak_flops_fp8`` the dense float8 tensor-core peak, 0 on a device without
    float8 matmuls (older than SM 8.9, a CPU), where float8 training is refused
    or, on a CPU, emulated (:mod:`autopar.float8`).
    ``matmul_efficiency`` is the fraction of peak a large training layer
    reaches (fitted); ``half_efficiency_flops`` is the work per layer call at
    which efficiency falls to half of that, which makes small microbatches slow.
    ``op_model``, when set, prices layers captured with per-op records op by op
    (GEMM shapes, attention kernels, memory-bound bytes; ``matmul_efficiency``
    is then the large-GEMM efficiency); without it, or for layers without
    records, the FLOPs model above prices them.
    """

    name: str
    memory_bytes: int
    peak_flops_bf16: float
    peak_flops_fp32: float
    memory_bandwidth_bytes_s: float
    matmul_efficiency: float
    half_efficiency_flops: float
    op_model: OpModel | None = None
    peak_flops_fp8: float = 0.0

    def peak_flops(self, dtype: str) -> float:
        if dtype == "fp8":
            return self.peak_flops_fp8
        return self.peak_flops_bf16 if dtype == "bf16" else self.peak_flops_fp32


LINK_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


@dataclass(frozen=True)
class LinkSpec:
    """An α-β link: ``latency_s`` per collective or message, ``bandwidth_bytes_s`` bus bandwidth.

    ``collectives`` optionally overrides both per kind (``all_reduce``,
    ``all_gather``, ``reduce_scatter``, ``p2p``): NCCL reaches about the same
    bus bandwidth in each, but gloo's all-gather and reduce-scatter run at half
    its all-reduce's, which ``autopar calibrate`` measures and records here.
    """

    bandwidth_bytes_s: float
    latency_s: float
    collectives: dict[str, LinkSpec] = field(default_factory=dict)

    def for_kind(self, kind: str) -> LinkSpec:
        """The figures a collective of ``kind`` (or point-to-point, ``p2p``) runs at."""
        return self.collectives.get(kind, self)


@dataclass(frozen=True)
class MemoryBudget:
    """A device's memory and what is kept back from the planner (see :class:`ClusterSpec`)."""

    device_bytes: int
    reserve_fraction: float
    cuda_context_bytes: int
    nccl_buffer_bytes: int
    allocator_overhead_fraction: float

    @property
    def budget_bytes(self) -> int:
        """What the caching allocator may hand out: allocated × (1 + overhead) fits what is left
        (0 where the context and NCCL's buffers alone fill the device: every plan is then
        infeasible, and the solver says by how much)."""
        left = self.device_bytes * (1.0 - self.reserve_fraction) - self.cuda_context_bytes - self.nccl_buffer_bytes
        return max(0, int(left / (1.0 + self.allocator_overhead_fraction)))

    def describe(self) -> str:
        """One line: the budget and each term kept back."""
        kept = [f"{self.reserve_fraction:.0%} reserve"] if self.reserve_fraction else []
        kept += [f"{name} {n / GiB:.2f} GiB" for name, n in
                 (("CUDA context", self.cuda_context_bytes), ("NCCL buffers", self.nccl_buffer_bytes)) if n]
        if self.allocator_overhead_fraction:
            kept.append(f"÷ {1 + self.allocator_overhead_fraction:.2f} for the caching allocator")
        return f"{self.device_bytes / GiB:.1f} GiB device" + (f", less {', '.join(kept)}" if kept else "")


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` × ``gpus_per_node`` devices and the links between them.

    The planner's memory budget is what the caching allocator may hand out
    (:meth:`memory_budget`): the device's memory less ``memory_reserve_fraction``
    of it, less ``cuda_context_bytes`` (the CUDA context: driver, kernels) and
    ``nccl_buffer_bytes`` (NCCL's communicator buffers, allocated outside the
    caching allocator), divided by 1 + ``allocator_overhead_fraction`` (what the
    caching allocator reserves beyond what it has allocated). The GPU presets
    price the three terms from their sources (:data:`CUDA_CONTEXT_BYTES`,
    :data:`NCCL_BUFFER_BYTES`, :data:`ALLOCATOR_OVERHEAD_FRACTION`) with no flat
    reserve; the CPU preset keeps its measured flat reserve; a cluster file
    without the three terms keeps the old flat 10%.

    ``nccl_tuning`` prices collectives with NCCL's own tuning model (per-step
    ring latencies, tree all-reduce, protocols; :mod:`.communication`), as the
    GPU presets do.

    ``comm_overlap`` is the fraction of compute under which data-parallel
    communication can hide: 1 on GPUs (copy engines and NCCL kernels run
    beside compute); below 1 where collectives take turns with compute on
    the same cores, as gloo on a CPU does (``autopar calibrate`` measures it).

    ``cores_per_node`` is set where a node's devices are processes sharing
    that many CPU cores (0: devices do not share compute, as GPUs do). With
    more ranks than cores, ranks that wait (in a pipeline's fill and drain,
    or for a stage ahead) give their cores to the ranks still working (see
    :func:`idle_core_speedup` and ``autopar.planning.pricing``). It may be a
    fraction: the share of the host's cores the ranks get where other work
    takes the rest (Linux shares a busy host's cores between sessions, not
    processes), as ``autopar tune`` fits it.

    ``tp_overhead_s`` is what each tensor-parallel collective costs beyond its
    link figures: DTensor's dispatch and redistribution around it, paid in
    line where the host computes (CPU), hidden where the host runs ahead of
    the device (GPUs: 0).

    ``optimizer_dtensor_s`` is what each DTensor parameter (sharded by FSDP2
    or tensor parallelism) adds to an optimizer step beyond its bytes:
    DTensor's dispatch around every op the optimizer runs on it. Measured
    by ``autopar calibrate`` on CPU hosts; 0 for GPUs, where the host runs
    ahead of the device.

    ``zero_overhead_s`` is what each collective FSDP2 issues costs beyond
    its link figures: its hooks and its copies in and out of the flat
    collective buffers, made on the host. ``autopar calibrate`` measures it
    on CPU hosts; 0 for GPUs, where the host runs ahead of the device.

    ``latency_per_step`` makes link latencies per ring step (a collective over
    n ranks pays 2(n−1) of them for an all-reduce, n−1 for all-gather and
    reduce-scatter) instead of per collective, so a calibration taken over
    all ranks prices smaller groups right. ``collective_sync_s`` is the wait
    for the slowest rank each blocking collective adds where ranks drift
    apart between collectives (measured by ``autopar calibrate``; 0 for GPUs).
    """

    name: str
    device: DeviceSpec
    gpus_per_node: int
    nodes: int
    intra_node: LinkSpec
    inter_node: LinkSpec
    nics_per_node: int
    backend: str = "nccl"
    memory_reserve_fraction: float = 0.10
    comm_overlap: float = 1.0
    cores_per_node: float = 0
    tp_overhead_s: float = 0.0
    optimizer_dtensor_s: float = 0.0
    zero_overhead_s: float = 0.0
    latency_per_step: bool = False
    collective_sync_s: float = 0.0
    nccl_tuning: bool = False
    cuda_context_bytes: int = 0
    nccl_buffer_bytes: int = 0
    allocator_overhead_fraction: float = 0.0

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def memory_budget_bytes(self) -> int:
        return self.memory_budget().budget_bytes

    def memory_budget(self) -> MemoryBudget:
        """How the device's memory splits into what the planner may fill and what it keeps back."""
        return MemoryBudget(self.device.memory_bytes, self.memory_reserve_fraction, self.cuda_context_bytes,
                            self.nccl_buffer_bytes, self.allocator_overhead_fraction)

    @property
    def nic_bandwidth_per_device(self) -> float:
        """Inter-node bandwidth one device can count on when all devices send at once."""
        return self.nic_bandwidth_for("all_reduce")

    def nic_bandwidth_for(self, kind: str) -> float:
        """:attr:`nic_bandwidth_per_device` for a collective of ``kind``."""
        share = min(1.0, self.nics_per_node / self.gpus_per_node)
        return self.inter_node.for_kind(kind).bandwidth_bytes_s * share

    def for_world_size(self, world_size: int, nodes: int | None = None) -> ClusterSpec:
        """The cluster sized for ``world_size`` ranks (``nodes`` hosts if given).

        Without ``nodes``, full nodes are used (a world smaller than a node uses
        part of one node). With ``nodes``, the ranks spread evenly over them.
        """
        if world_size < 1:
            raise ClusterError(f"world size must be at least 1, got {world_size}")
        if nodes is None:
            if world_size <= self.gpus_per_node:
                return replace(self, nodes=1, gpus_per_node=world_size)
            if world_size % self.gpus_per_node:
                raise ClusterError(
                    f"world size {world_size} is not a multiple of the {self.gpus_per_node} "
                    f"devices per node of cluster {self.name!r}; pass --nodes to spread it"
                )
            return replace(self, nodes=world_size // self.gpus_per_node)
        if nodes < 1 or world_size % nodes:
            raise ClusterError(f"world size {world_size} does not split evenly over {nodes} nodes")
        per_node = world_size // nodes
        if per_node > self.gpus_per_node:
            raise ClusterError(
                f"{world_size} ranks on {nodes} nodes is {per_node} per node, but cluster "
                f"{self.name!r} has {self.gpus_per_node} devices per node; use more nodes"
            )
        return replace(self, nodes=nodes, gpus_per_node=per_node)

    def with_memory(self, memory_bytes: int) -> ClusterSpec:
        """The same cluster with another per-device memory (``--memory-gb``)."""
        return replace(self, device=replace(self.device, memory_bytes=int(memory_bytes)))

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for level in ("intra_node", "inter_node"):  # no per-kind figures: the field stays out of files
            if not data[level]["collectives"]:
                del data[level]["collectives"]
        if data["device"]["op_model"] is None:  # TOML has no null: the field stays out of files
            del data["device"]["op_model"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "cluster") -> ClusterSpec:
        return _cluster_from_dict(data, source)


def idle_core_speedup(cluster: ClusterSpec, ranks_on_node: int) -> Fraction:
    """How much faster one rank computes while the other ranks of its node wait than while all work.

    1 unless the node's ``ranks_on_node`` processes share fewer cores than
    there are ranks: then a rank gets cores/ranks of a core while all work
    (the pace ``autopar calibrate`` measures, every rank busy) and a whole
    core when enough of the others wait (a rank runs one intra-op thread
    there, see ``autopar.tools.host.threads_per_process``), or all the
    ranks' share where that is less than a core.
    """
    if cluster.cores_per_node <= 0:
        return Fraction(1)
    cores = max(Fraction(1), Fraction(cluster.cores_per_node).limit_denominator(1000))  # one thread: ≤ a core
    if ranks_on_node <= cores:
        return Fraction(1)
    return Fraction(ranks_on_node) / cores


def blocking_wait_share(cluster: ClusterSpec, busy_ranks: float, ranks_on_node: int) -> float:
    """The share of a blocking exchange's calibrated wait a collective pays while only ``busy_ranks`` of
    the node's ``ranks_on_node`` processes compete for its cores.

    ``autopar calibrate`` measures ``collective_sync_s`` and ``tp_overhead_s`` with every rank busy: where
    the ranks outnumber the cores, each is off its core 1 − cores/ranks of the time, and a collective waits
    for its peers to be scheduled again. While fewer ranks work (a pipeline with fewer microbatches than
    stages: the others sleep in a receive), fewer are descheduled, so the wait shrinks in proportion:
    ``off(busy) / off(ranks_on_node)`` with ``off(n) = max(0, 1 − cores/n)``, none once every busy rank
    has a core. 1 where the ranks do not outnumber the cores (GPUs: ``cores_per_node`` 0), so a figure
    calibrated without that wait is kept as measured.
    """
    if cluster.cores_per_node <= 0:
        return 1.0
    cores = max(1.0, float(cluster.cores_per_node))
    if ranks_on_node <= cores:
        return 1.0
    return max(0.0, 1.0 - cores / max(busy_ranks, 1.0)) / (1.0 - cores / ranks_on_node)


def _validate(c: ClusterSpec) -> None:
    positive = {
        "gpus_per_node": c.gpus_per_node,
        "nodes": c.nodes,
        "nics_per_node": c.nics_per_node,
        "device.memory_bytes": c.device.memory_bytes,
        "device.peak_flops_bf16": c.device.peak_flops_bf16,
        "device.peak_flops_fp32": c.device.peak_flops_fp32,
        "device.memory_bandwidth_bytes_s": c.device.memory_bandwidth_bytes_s,
        "device.matmul_efficiency": c.device.matmul_efficiency,
        "intra_node.bandwidth_bytes_s": c.intra_node.bandwidth_bytes_s,
        "inter_node.bandwidth_bytes_s": c.inter_node.bandwidth_bytes_s,
    }
    non_negative = {
        "device.half_efficiency_flops": c.device.half_efficiency_flops,
        "device.peak_flops_fp8": c.device.peak_flops_fp8,
        "intra_node.latency_s": c.intra_node.latency_s,
        "inter_node.latency_s": c.inter_node.latency_s,
        "tp_overhead_s": c.tp_overhead_s,
        "optimizer_dtensor_s": c.optimizer_dtensor_s,
        "zero_overhead_s": c.zero_overhead_s,
        "collective_sync_s": c.collective_sync_s,
        "cuda_context_bytes": c.cuda_context_bytes,
        "nccl_buffer_bytes": c.nccl_buffer_bytes,
        "allocator_overhead_fraction": c.allocator_overhead_fraction,
    }
    for level in ("intra_node", "inter_node"):
        link = getattr(c, level)
        if not isinstance(link.collectives, dict):
            raise ClusterError(f"cluster {c.name!r}: {level}.collectives must be a table of kinds")
        for kind, sub in link.collectives.items():
            if kind not in LINK_KINDS:
                raise ClusterError(f"cluster {c.name!r}: {level}.collectives has unknown kind {kind!r}; "
                                   f"use {', '.join(LINK_KINDS)}")
            positive[f"{level}.collectives.{kind}.bandwidth_bytes_s"] = sub.bandwidth_bytes_s
            non_negative[f"{level}.collectives.{kind}.latency_s"] = sub.latency_s
    ops = c.device.op_model
    if ops is not None:
        for name in ("tile_m", "tile_n", "bandwidth_fraction", "attention_fwd", "attention_bwd",
                     "compiled_memory_bound_fraction", "masked_attention_fwd", "masked_attention_bwd"):
            positive[f"device.op_model.{name}"] = getattr(ops, name)
        if ops.compiled_memory_bound_fraction > 1:
            raise ClusterError(f"cluster {c.name!r}: device.op_model.compiled_memory_bound_fraction must be "
                               f"≤ 1 (compiled no slower than eager), got {ops.compiled_memory_bound_fraction!r}")
        for name in ("sm_count", "gemm_k_half", "kernel_overhead_s", "host_op_s"):
            non_negative[f"device.op_model.{name}"] = getattr(ops, name)
        if not all(isinstance(v, int) for v in (ops.sm_count, ops.tile_m, ops.tile_n)):
            raise ClusterError(f"cluster {c.name!r}: device.op_model's sm_count, tile_m and tile_n "
                               "must be whole numbers")
    for key, value in positive.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ClusterError(f"cluster {c.name!r}: {key} must be a positive number, got {value!r}")
    for key, value in non_negative.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ClusterError(f"cluster {c.name!r}: {key} must be a number ≥ 0, got {value!r}")
    if c.device.matmul_efficiency > 1:
        raise ClusterError(f"cluster {c.name!r}: device.matmul_efficiency must be ≤ 1")
    if not 0 <= c.memory_reserve_fraction < 1:
        raise ClusterError(f"cluster {c.name!r}: memory_reserve_fraction must be in [0, 1)")
    for flag in ("latency_per_step", "nccl_tuning"):
        if not isinstance(getattr(c, flag), bool):
            raise ClusterError(f"cluster {c.name!r}: {flag} must be true or false")
    if c.allocator_overhead_fraction >= 1:
        raise ClusterError(f"cluster {c.name!r}: allocator_overhead_fraction must be in [0, 1)")
    if (isinstance(c.cores_per_node, bool) or not isinstance(c.cores_per_node, (int, float))
            or not math.isfinite(c.cores_per_node) or c.cores_per_node < 0):
        raise ClusterError(f"cluster {c.name!r}: cores_per_node must be a number ≥ 0, got {c.cores_per_node!r}")
    if not isinstance(c.comm_overlap, (int, float)) or not 0 <= c.comm_overlap <= 1:
        raise ClusterError(f"cluster {c.name!r}: comm_overlap must be in [0, 1], got {c.comm_overlap!r}")
    if c.backend not in ("nccl", "gloo"):
        raise ClusterError(f"cluster {c.name!r}: backend must be 'nccl' or 'gloo', got {c.backend!r}")


_OPTIONAL_FIELDS = {"collectives", "op_model", "peak_flops_fp8", "compiled_memory_bound_fraction",
                    "masked_attention_fwd", "masked_attention_bwd", "host_op_s"}


def _section(data: dict[str, Any], key: str, cls: type, source: str) -> Any:
    raw = data.get(key)
    if not isinstance(raw, dict):
        raise ClusterError(f"{source}: missing section {key!r}")
    names = [f.name for f in fields(cls) if f.name != "name"]
    missing = [n for n in names if n not in raw and n not in _OPTIONAL_FIELDS]
    if missing:
        raise ClusterError(f"{source}: {key} is missing {', '.join(missing)}")
    unknown = sorted(set(raw) - set(names) - {"name"})
    if unknown:
        raise ClusterError(f"{source}: {key} has unknown fields {', '.join(unknown)}")
    kwargs = {n: raw[n] for n in names if n in raw}
    if cls is LinkSpec and "collectives" in raw:
        subs = raw["collectives"]
        if not isinstance(subs, dict):
            raise ClusterError(f"{source}: {key}.collectives must be a table of kinds")
        kwargs["collectives"] = {k: _section(subs, k, LinkSpec, f"{source}: {key}.collectives")
                                 for k in subs}
    if cls is DeviceSpec:
        kwargs["name"] = str(raw.get("name", data.get("name", "device")))
        if "op_model" in raw:
            kwargs["op_model"] = _section(raw, "op_model", OpModel, f"{source}: {key}")
    return cls(**kwargs)


def _cluster_from_dict(data: dict[str, Any], source: str) -> ClusterSpec:
    if not isinstance(data, dict):
        raise ClusterError(f"{source}: expected a table of cluster fields")
    required = ["gpus_per_node", "nics_per_node"]
    missing = [k for k in required if k not in data]
    if missing:
        raise ClusterError(f"{source}: missing {', '.join(missing)}")
    # ``calibration`` records how ``autopar calibrate`` measured the figures; the planner ignores it
    known = {f.name for f in fields(ClusterSpec)} | {"calibration"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ClusterError(f"{source}: unknown fields {', '.join(unknown)}")
    try:
        return ClusterSpec(
            name=str(data.get("name", Path(source).stem)),
            device=_section(data, "device", DeviceSpec, source),
            gpus_per_node=data["gpus_per_node"],
            nodes=data.get("nodes", 1),
            intra_node=_section(data, "intra_node", LinkSpec, source),
            inter_node=_section(data, "inter_node", LinkSpec, source),
            nics_per_node=data["nics_per_node"],
            backend=data.get("backend", "nccl"),
            memory_reserve_fraction=data.get("memory_reserve_fraction", 0.10),
            comm_overlap=data.get("comm_overlap", 1.0),
            cores_per_node=data.get("cores_per_node", 0),
            tp_overhead_s=data.get("tp_overhead_s", 0.0),
            optimizer_dtensor_s=data.get("optimizer_dtensor_s", 0.0),
            zero_overhead_s=data.get("zero_overhead_s", 0.0),
            latency_per_step=data.get("latency_per_step", False),
            collective_sync_s=data.get("collective_sync_s", 0.0),
            nccl_tuning=data.get("nccl_tuning", False),
            cuda_context_bytes=data.get("cuda_context_bytes", 0),
            nccl_buffer_bytes=data.get("nccl_buffer_bytes", 0),
            allocator_overhead_fraction=data.get("allocator_overhead_fraction", 0.0),
        )
    except TypeError as exc:  # a field of the wrong type reached a comparison
        raise ClusterError(f"{source}: {exc}") from None


def load_cluster_file(path: Path) -> ClusterSpec:
    """A cluster from a ``.json`` or ``.toml`` file (``autopar calibrate`` writes them; a preset's
    :meth:`ClusterSpec.to_dict` is one)."""
    if not path.is_file():
        raise ClusterError(f"cluster file {str(path)!r} does not exist")
    try:
        text = path.read_text()
        data = tomllib.loads(text) if path.suffix.lower() == ".toml" else json.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ClusterError(f"cluster file {str(path)!r} is not valid: {exc}") from None
    return ClusterSpec.from_dict(data, source=str(path))
