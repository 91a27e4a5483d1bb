"""The refit: the cluster's figures moved so that the plans' predictions meet their measured step times.

A measured step time says how fast the machine ran that plan; it cannot say which figure of the
cluster was wrong unless plans that lean on different figures were measured. So the refit moves
a few *groups* of figures, each by one factor, and keeps a group where it was when no measurement
depends on it (or when two groups always move together in what was measured):

- ``compute``: the device's achieved rate (both peaks, so the compute efficiency ``peak · η`` is kept
  as a fraction, and the memory bandwidth the optimizer step and memory-bound ops are priced with);
- ``communication``: every link's bandwidth (× f) and latency (÷ f), per collective kind alike;
- ``overlap``: ``comm_overlap`` itself, the fraction of compute that hides communication, in [0, 1];
- ``host``: what the host spends per op and per collective beyond the device and the link — the
  per-call overhead (``half_efficiency_flops``), the op model's ``host_op_s`` and ``kernel_overhead_s``,
  ``tp_overhead_s``, ``zero_overhead_s``, ``optimizer_dtensor_s`` and ``collective_sync_s``.

On a host whose ranks share its cores (``cores_per_node`` > 0), the cores they effectively get is
fitted too, from 1 to the host's in steps of :data:`CORES_STEP`, the groups fitted at each: Linux
shares a busy host's cores between sessions, not processes, so other work leaves the ranks a share
of the cores that is rarely a whole number, and a rank that waits (in a pipeline) gives its part of
that share to the ranks still working — plans whose ranks wait then measure faster than plans whose
ranks all work, by more than the host's whole cores would make them
(:func:`autopar.cost_models.hardware.idle_core_speedup`), and whose collectives then wait for fewer
descheduled peers (:func:`~autopar.cost_models.hardware.blocking_wait_share`). Another count than the given is kept only
where the given leaves errors beyond the measurements' noise (:data:`NOISE`) and the other fits
:data:`CORES_BETTER` times better.

Every prediction is the planner's own (:func:`autopar.planning.api.reprice`, the plan kept and
repriced under the moved figures): one home for pricing. The factors minimise the squared log
error of predicted over measured step time, plus a small pull towards no change (``PRIOR``),
so a group that no measurement determines stays put; a projected Gauss–Newton step keeps each
factor inside its range (:class:`Bounds`: the range ``autopar calibrate``'s fit allows it — an
efficiency never above 1 of the GEMM peak its probe measured, an overlap in [0, 1], figures
within :data:`PROBE_SPREAD` of the probes' where the probes ran).

The allocator's reserve is a memory figure: on a GPU each candidate's peak reserved over peak
allocated bytes gives ``allocator_overhead_fraction`` (bounded by :data:`MAX_ALLOCATOR_OVERHEAD`);
CPU tensors have no caching allocator, so there it is reported as not determined.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from autopar.cost_models.hardware import ClusterSpec, LinkSpec

GROUPS = ("compute", "communication", "overlap", "host")
ABSOLUTE = ("overlap", "cores")  # fitted as themselves; the other groups as log factors of the given figures
PRIOR = 1e-3  # weight of the pull towards the starting figures, against squared log errors of order 1e-2
SENSITIVE = 0.02  # a group moves a prediction by less than 2 % per e-fold: no measurement depends on it
DISTINCT = 0.05  # a group's column that others explain to within 5 %: it moves with them, not on its own
FACTOR_RANGE = 64.0  # without probes, a factor stays within 1/64 … 64 of the given figure
PROBE_SPREAD = 2.0  # with probes, a figure stays within ½ … 2 × the probes' (their spread against steps)
MAX_ALLOCATOR_OVERHEAD = 0.5
_STEP = 1e-3  # finite-difference step in the factors' own coordinates
CORES_STEP = 0.125  # the shared cores tried: 1 to the host's in these steps
CORES_BETTER = 1.25  # other shared cores are taken only where they fit this much better than the given
NOISE = 0.05  # a shared host's step times are no closer than this (rms log error) to what any model says


@dataclass(frozen=True)
class Bounds:
    """Each group's range in the fit's coordinates: log factors, and ``overlap`` and ``cores`` as themselves."""

    low: dict[str, float]
    high: dict[str, float]

    def clip(self, x: dict[str, float]) -> dict[str, float]:
        return {k: min(self.high[k], max(self.low[k], v)) for k, v in x.items()}


@dataclass(frozen=True)
class RefitResult:
    """The refit cluster, the factors found, which groups the measurements determined, and why not the rest."""

    cluster: ClusterSpec
    factors: dict[str, float]  # compute, communication, host: × the given figures; overlap, cores: the value
    determined: tuple[str, ...]
    undetermined: dict[str, str]  # group -> why the measurements could not determine it
    at_bound: tuple[str, ...] = ()  # groups the fit pushed to an end of their range
    allocator_overhead: float | None = None
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, object]:
        return {"factors": {k: round(v, 6) for k, v in self.factors.items()},
                "determined": list(self.determined), "undetermined": dict(self.undetermined),
                "at_bound": list(self.at_bound), "allocator_overhead_fraction": self.allocator_overhead,
                "notes": list(self.notes)}


# ------------------------------------------------------------------ moving the figures


def _link(link: LinkSpec, f: float) -> LinkSpec:
    return LinkSpec(link.bandwidth_bytes_s * f, link.latency_s / f,
                    {k: _link(v, f) for k, v in link.collectives.items()})


def apply(cluster: ClusterSpec, x: dict[str, float]) -> ClusterSpec:
    """``cluster`` with the groups moved to ``x`` (log factors; ``overlap`` and ``cores`` absolute)."""
    c, comm, host = (math.exp(x.get(k, 0.0)) for k in ("compute", "communication", "host"))
    d = cluster.device
    ops = d.op_model
    if ops is not None:
        ops = replace(ops, host_op_s=ops.host_op_s * host, kernel_overhead_s=ops.kernel_overhead_s * host)
    # per-call overhead is priced as FLOPs at the device's rate: × host for its time, × compute to keep it so
    device = replace(d, peak_flops_bf16=d.peak_flops_bf16 * c, peak_flops_fp32=d.peak_flops_fp32 * c,
                     peak_flops_fp8=d.peak_flops_fp8 * c, memory_bandwidth_bytes_s=d.memory_bandwidth_bytes_s * c,
                     half_efficiency_flops=d.half_efficiency_flops * host * c, op_model=ops)
    return replace(cluster, device=device, intra_node=_link(cluster.intra_node, comm),
                   inter_node=_link(cluster.inter_node, comm),
                   comm_overlap=x.get("overlap", cluster.comm_overlap),
                   cores_per_node=x.get("cores", cluster.cores_per_node),
                   tp_overhead_s=cluster.tp_overhead_s * host, zero_overhead_s=cluster.zero_overhead_s * host,
                   optimizer_dtensor_s=cluster.optimizer_dtensor_s * host,
                   collective_sync_s=cluster.collective_sync_s * host)


def bounds(start: ClusterSpec, probed: ClusterSpec | None = None) -> Bounds:
    """Each group's range (module docstring): the probes' figures ×/÷ :data:`PROBE_SPREAD` where the
    probes ran, the compute rate never above the GEMM peak they measured; else ×/÷ :data:`FACTOR_RANGE`."""
    wide = math.log(FACTOR_RANGE)
    low = {"compute": -wide, "communication": -wide, "host": -wide, "overlap": 0.0}
    high = {"compute": wide, "communication": wide, "host": wide, "overlap": 1.0}
    if probed is not None:
        spread = math.log(PROBE_SPREAD)
        rate = start.device.peak_flops_fp32 * start.device.matmul_efficiency
        probe_rate = probed.device.peak_flops_fp32 * probed.device.matmul_efficiency
        centre = math.log(probe_rate / rate)
        # an efficiency above 1 of the GEMM peak the probe measured is not a figure this device reaches
        ceiling = math.log(probed.device.peak_flops_fp32 / rate)
        low["compute"], high["compute"] = centre - spread, min(centre + spread, ceiling)
        ratio = math.log(probed.intra_node.bandwidth_bytes_s / start.intra_node.bandwidth_bytes_s)
        low["communication"], high["communication"] = ratio - spread, ratio + spread
    for k in low:
        if low[k] > high[k]:
            low[k] = high[k]
    return Bounds(low, high)


# ------------------------------------------------------------------ the fit

Predict = Callable[[ClusterSpec], Sequence[float]]


def _errors(predict: Predict, start: ClusterSpec, x: dict[str, float], measured: np.ndarray) -> np.ndarray:
    return np.log(np.asarray(predict(apply(start, x)), dtype=float)) - np.log(measured)


def _jacobian(predict: Predict, start: ClusterSpec, x: dict[str, float], measured: np.ndarray,
              base: np.ndarray, b: Bounds, groups: Sequence[str]) -> np.ndarray:
    cols = []
    for k in groups:
        h = _STEP if x[k] + _STEP <= b.high[k] else -_STEP
        cols.append((_errors(predict, start, {**x, k: x[k] + h}, measured) - base) / h)
    return np.stack(cols, axis=1)


def _fit(predict: Predict, start: ClusterSpec, y: np.ndarray, b: Bounds, x0: dict[str, float], free: Sequence[str],
         iterations: int, start_at: dict[str, float] | None = None) -> tuple[dict[str, float], float]:
    """Projected Gauss–Newton on the ``free`` groups (the others stay at ``x0``), from ``start_at``'s free
    groups where given (else ``x0``), pulled towards ``x0``: the groups and the cost."""
    x = {**x0, **{k: start_at[k] for k in free}} if start_at is not None else dict(x0)

    def cost_of(v: dict[str, float]) -> float:
        r = _errors(predict, start, v, y)
        p = np.array([v[k] - x0[k] for k in free])
        return float(r @ r + PRIOR * p @ p)

    cost = cost_of(x)
    for _ in range(iterations if free else 0):
        r = _errors(predict, start, x, y)
        j = _jacobian(predict, start, x, y, r, b, free)
        prior = np.array([x[k] - x0[k] for k in free])
        step = np.linalg.solve(j.T @ j + PRIOR * np.eye(len(free)), -(j.T @ r + PRIOR * prior))
        for scale in (1.0, 0.5, 0.25, 0.125):  # backtrack until the projected step lowers the cost
            trial = b.clip({**x, **{k: x[k] + scale * d for k, d in zip(free, step)}})
            trial_cost = cost_of(trial)
            if trial_cost < cost:
                break
        else:
            break
        moved = max(abs(trial[k] - x[k]) for k in free)
        x, cost = trial, trial_cost
        if moved < 1e-5:
            break
    return x, cost


def refit(predict: Predict, start: ClusterSpec, measured: Sequence[float], *, probed: ClusterSpec | None = None,
          iterations: int = 30) -> RefitResult:
    """The factors that bring ``predict(cluster)`` (one step time per measured plan) to ``measured``.

    Only the groups the measurements determine move (:func:`_identified`, at the starting figures);
    the rest stay as given (or as the probes found them). On a host whose ranks share its cores
    (``cores_per_node`` > 0), the cores the ranks effectively have is fitted too, a whole number from 1
    to the cores the host has (its probes' count, else the given one): a host that other work loads
    gives them fewer, which shows as plans whose ranks wait (pipelines) measuring faster than priced.
    ``probed``: the cluster ``autopar calibrate``'s fit made of this machine, if its probes ran: it
    bounds the groups (:func:`bounds`) and the fit starts from its figures.
    """
    y = np.asarray(measured, dtype=float)
    if y.size == 0 or not np.all(y > 0):
        raise ValueError("the refit needs at least one positive measured step time")
    b = bounds(start, probed)
    x0 = b.clip(_centre(start, probed))
    tries = []
    x = dict(x0)
    counts = _core_counts(start, probed)
    if len(counts) > 1 and np.allclose(_errors(predict, replace(start, cores_per_node=min(counts)), x0, y),
                                       _errors(predict, start, x0, y), rtol=0, atol=1e-9):
        counts = [start.cores_per_node]  # no measured plan's ranks wait for another: the share is not seen
    for cores in counts:  # the fit at each, started from the last one's (warm)
        base = replace(start, cores_per_node=cores)
        r0 = _errors(predict, base, x0, y)
        free, undetermined = _identified(_jacobian(predict, base, x0, y, r0, b, GROUPS), len(y))
        x, _ = _fit(predict, base, y, b, x0, free, iterations, start_at=x)
        r = _errors(predict, base, x, y)
        tries.append((float(r @ r), cores, base, x, free, undetermined))  # compared by how well each fits
    best = min(tries, key=lambda t: t[0])
    given = next(t for t in tries if t[1] == start.cores_per_node)
    # the given count stays where it fits within the measurements' noise, or about as well as the best
    keep = given[0] <= len(y) * NOISE ** 2 or given[0] <= best[0] * CORES_BETTER
    cost, cores, base, x, free, undetermined = given if keep else best
    notes = []
    if cores != start.cores_per_node:
        notes.append(f"the ranks effectively get {cores:g} of the host's cores (given {start.cores_per_node:g}): "
                     "other work on the host takes the rest")
    at_bound = tuple(k for k in free if b.low[k] != b.high[k]
                     and min(abs(x[k] - b.low[k]), abs(x[k] - b.high[k])) < 1e-6)
    factors = {k: float(x[k] if k in ABSOLUTE else math.exp(x[k])) for k in GROUPS}
    if start.cores_per_node > 0:
        factors["cores"] = float(cores)
    return RefitResult(apply(base, x), factors, tuple(free), undetermined, at_bound, notes=tuple(notes))


def _core_counts(start: ClusterSpec, probed: ClusterSpec | None) -> list[float]:
    """The shared cores the refit tries, the given count among them (just it where ranks share none)."""
    most = _cores(start, probed)
    if most <= 0:
        return [start.cores_per_node]
    steps = int(round((most - 1) / CORES_STEP))
    return sorted({start.cores_per_node, *(1 + k * CORES_STEP for k in range(steps + 1))}, reverse=True)


def _cores(start: ClusterSpec, probed: ClusterSpec | None) -> float:
    """The host's cores the ranks share (its probes' count where they ran); 0 where ranks share none."""
    if start.cores_per_node <= 0:
        return 0.0
    return float(max(start.cores_per_node, probed.cores_per_node if probed is not None else 0))


def _centre(start: ClusterSpec, probed: ClusterSpec | None) -> dict[str, float]:
    """Where the fit starts and what it is pulled back to: the given figures, or the probes' where they ran."""
    if probed is None:
        return {"compute": 0.0, "communication": 0.0, "host": 0.0, "overlap": start.comm_overlap}
    d, p = start.device, probed.device
    return {"compute": math.log(p.peak_flops_fp32 * p.matmul_efficiency / (d.peak_flops_fp32 * d.matmul_efficiency)),
            "communication": math.log(probed.intra_node.bandwidth_bytes_s / start.intra_node.bandwidth_bytes_s),
            "host": 0.0, "overlap": probed.comm_overlap}


def _identified(j: np.ndarray, n: int) -> tuple[list[str], dict[str, str]]:
    """The groups the ``n`` measurements determine, most influential first: those some prediction
    depends on (:data:`SENSITIVE`) whose column the groups already taken do not explain (:data:`DISTINCT`),
    at most ``n``; and why each other group is not (it would move with those taken, or nothing needs it)."""
    order = sorted(range(len(GROUPS)), key=lambda i: -float(np.max(np.abs(j[:, i]))))
    taken: list[int] = []
    undetermined: dict[str, str] = {}
    for i in order:
        col = j[:, i]
        if float(np.max(np.abs(col))) < SENSITIVE:
            undetermined[GROUPS[i]] = "no measured plan's step time depends on it"
            continue
        left = 1.0
        if taken:
            a = j[:, taken]
            coef, *_ = np.linalg.lstsq(a, col, rcond=None)
            left = float(np.linalg.norm(col - a @ coef) / np.linalg.norm(col))
        if left >= DISTINCT and len(taken) < n:
            taken.append(i)
            continue
        partners = ", ".join(GROUPS[k] for k in taken)
        undetermined[GROUPS[i]] = (f"the {n} measured step time{'s' if n != 1 else ''} cannot tell it from "
                                   f"{partners}: kept as given")
    return [GROUPS[i] for i in taken], undetermined


def allocator_overhead(pairs: Sequence[tuple[int, int]]) -> float | None:
    """``allocator_overhead_fraction`` from (peak reserved, peak allocated) bytes of the candidates that
    ran on a GPU: the largest reserved / allocated − 1, in [0, :data:`MAX_ALLOCATOR_OVERHEAD`]; None without."""
    ratios = [r / a - 1.0 for r, a in pairs if a > 0 and r > 0]
    if not ratios:
        return None
    return min(MAX_ALLOCATOR_OVERHEAD, max(0.0, max(ratios)))
