"""What ``autopar run`` starts on every rank: the user's script, its failure recorded for the launcher.

    python -m autopar.runtime.entry SCRIPT [ARGS ...]

Runs SCRIPT as ``__main__`` (``sys.argv`` = SCRIPT ARGS, its folder first on
``sys.path``, as ``python SCRIPT`` would) under torchrun's ``record``: an
uncaught exception is written, with its traceback, to the error file
torchrun gives this rank, so ``autopar run`` can say which rank failed and
why. Whatever happens, the process groups are then shut down while the
interpreter is whole (:func:`autopar.runtime.launch.shutdown`). Rank 0
prints autopar's one-line notes (the ``autopar`` logger at INFO: which default
loss it picked) on stderr, once.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from autopar.quiet import silence_if_asked
from autopar.runtime.launch import shutdown


def _notes_on_rank_0() -> None:
    """The ``autopar`` logger's INFO lines on rank 0's stderr (the other ranks would repeat them)."""
    if os.environ.get("RANK", "0") != "0":
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("autopar: %(message)s"))
    log = logging.getLogger("autopar")
    log.addHandler(handler)
    log.setLevel(logging.INFO)


@record
def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m autopar.runtime.entry SCRIPT [ARGS ...]")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    _notes_on_rank_0()
    silence_if_asked()  # `autopar run` without -v: the lines autopar.quiet names stay off every rank's stderr
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        shutdown()


if __name__ == "__main__":
    main()
