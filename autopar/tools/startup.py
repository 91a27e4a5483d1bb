"""The cyclic garbage collector paused while a planning command imports its libraries.

Importing torch, transformers (and what it pulls in: torchao, torch._dynamo,
scipy) and OR-Tools allocates some 500,000 objects that live as long as the
process; each full collection scans all of them again, and an `autopar plan`
of Llama 3 70B ran eight of those during its imports (about 1 s of CPU time
in 8, measured with ``gc.callbacks``). The console script therefore pauses the
collector for the imports and model construction, then moves what they left
into the permanent generation (``gc.freeze``) and resumes it before capture,
so capture and solve are collected as before, without rescanning the libraries.
Only the console script pauses: a program calling :func:`autopar.capture` keeps its own settings.
"""

from __future__ import annotations

import gc

_paused = False


def pause() -> None:
    """Stop automatic collection until :func:`resume` (the console script's own process only)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> None:
    """Freeze what the imports left and collect as usual again; nothing unless :func:`pause` paused."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()
