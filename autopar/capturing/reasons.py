"""A proof's verdict as one line: what capture's region provers return to the planner.

A prover (``moe_capacity.prove``, ``moe_reroute.prove``) runs the model's own code on stand-ins and
returns "" when the rewrite is proven, else why not. The model's code may also raise on the
stand-ins; that is a reason too, kept to one line for the plan's notes, and the global RNG is left as
it was so capturing never changes what the user's next random draw would be.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def reason_of(prove: Callable[..., str], *args: Any) -> str:
    """``prove(*args)``'s reason ("" when it passes), or the exception it raised as one line."""
    with torch.random.fork_rng(devices=[]):
        try:
            return prove(*args)
        except Exception as exc:
            text = str(exc).splitlines()[0] if str(exc) else ""
            return f"{type(exc).__name__}: {text}"


__all__ = ["reason_of"]
