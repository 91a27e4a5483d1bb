"""The console script's collector pause: resumed (and the imports' objects frozen) before capture."""

from __future__ import annotations

import gc

from autopar.tools import startup


def test_pause_then_resume_freezes_and_collects_again() -> None:
    assert gc.isenabled()
    try:
        startup.pause()
        assert not gc.isenabled()
        kept = [[] for _ in range(100)]  # objects made while paused: frozen on resume
        startup.resume()
        assert gc.isenabled() and gc.get_freeze_count() >= len(kept)
        startup.resume()  # a second resume does nothing
        assert gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()


def test_resume_without_pause_leaves_the_collector_alone() -> None:
    gc.disable()  # a program that turned collection off itself keeps it off
    try:
        startup.resume()
        assert not gc.isenabled() and gc.get_freeze_count() == 0
        startup.pause()  # nothing to pause: resume must not turn it on
        startup.resume()
        assert not gc.isenabled()
    finally:
        gc.enable()
