"""Byte units and their display, in one place."""

from __future__ import annotations

KiB = 2**10
MiB = 2**20
GiB = 2**30


def format_bytes(n: float) -> str:
    """GiB for large sizes, MiB below 1 GiB, so small budgets do not print as 0.00."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.2f} MiB"


_FLOP_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def format_flop_rate(flops_per_s: float) -> str:
    """FLOP/s to three significant figures in the unit that fits: 189 TFLOP/s, 5.94 GFLOP/s, 812 MFLOP/s."""
    rounded = float(f"{flops_per_s:.3g}")  # rounded first, so 999.6 GFLOP/s prints as 1 TFLOP/s
    scale, prefix = next(((s, p) for s, p in _FLOP_PREFIXES if abs(rounded) >= s), (1.0, ""))
    value = rounded / scale
    return f"{value:.3g} {prefix}FLOP/s" if abs(value) < 1000 else f"{value:,.0f} {prefix}FLOP/s"


def device_noun(cluster: object) -> str:
    """``"GPU"`` for a GPU cluster, ``"rank"`` for one whose devices are CPU processes.

    For words such as "TFLOP/s per GPU": ``cluster`` is a ClusterSpec (its
    device's name or its backend tells: the ``cpu`` preset and calibrated CPU
    hosts have a device named ``cpu…`` and the gloo backend), a cluster dict as
    plan files hold it, or a device name.
    """
    if isinstance(cluster, str):
        name, backend = cluster, None
    elif isinstance(cluster, dict):
        device = cluster.get("device")
        name = str(device.get("name", "")) if isinstance(device, dict) else ""
        backend = cluster.get("backend")
    else:
        device = getattr(cluster, "device", None)
        name, backend = str(getattr(device, "name", "")), getattr(cluster, "backend", None)
    cpu = name.strip().lower().startswith("cpu") or backend == "gloo"
    return "rank" if cpu else "GPU"
