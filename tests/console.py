"""Children the tests start, started the same however the test runner itself was started.

:func:`autopar_command` is this interpreter's own ``autopar`` console script (the one installed beside
``sys.executable``, not whichever ``autopar`` comes first on ``PATH``: with the virtual environment
not activated, that may be another checkout's). :func:`default_sigint` goes to ``Popen``'s
``preexec_fn`` for a child the test sends ^C: a runner started as a background job (``nohup pytest &``)
inherits SIGINT ignored, its children too, and Python installs its ``KeyboardInterrupt`` handler at
start-up only where SIGINT is not ignored, so the ^C would never arrive.
"""

from __future__ import annotations

import signal
import sys
import sysconfig
from pathlib import Path


def autopar_command(*argv: str) -> list[str]:
    """``autopar ARGV…`` as this interpreter installed it (``python -m autopar.tools.cli`` if it did not)."""
    script = Path(sysconfig.get_path("scripts")) / "autopar"
    return ([str(script)] if script.is_file() else [sys.executable, "-m", "autopar.tools.cli"]) + list(argv)


def default_sigint() -> None:
    """In the child, before exec: SIGINT back to its default, whatever the runner inherited."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
