"""Byte units and their display, in one place."""

from __future__ import annotations

KiB = 2**10
MiB = 2**20
GiB = 2**30


def format_bytes(n: float) -> str:
    """GiB for large sizes, MiB below 1 GiB, so small budgets do not print as 0.00."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.2f} MiB"
