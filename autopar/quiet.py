"""The third-party lines the ``autopar`` command keeps off its user's terminal (``-v`` shows them again).

None of them concerns what the user asked for, and each is dropped where it is made, by its message
and by the logger that makes it, so anything else those libraries say still reaches stderr:

- torchao's ``Failed to load …/torchao/_C_mxfp8….so`` and ``…/_C_cutlass_90a.abi3.so``: logged as
  warnings on the ``torchao`` logger when torchao is imported and its CUDA-only kernels do not load
  (a CPU build of torch). autopar imports torchao only for ``--float8``; transformers imports it
  whenever it is installed (``transformers/quantizers/auto.py`` registers its quantizer), so every
  Hugging Face model brings it;
- torch's ``<enum 'KernelPreference'> is an Enum subclass … register_constant() … deprecated`` (and
  ``ScaleCalculationMode``'s): logged on ``torch.utils._pytree`` when torchao registers its enums, a
  matter between torchao and torch. Dropped only for torchao's own enums.

Only the CLI asks for this: :func:`cli_filters` around a command, and the processes the command starts
(``verify``'s and ``calibrate``'s ranks, ``run``'s) call :func:`silence_if_asked`, which reads
:data:`QUIET_ENV` from the environment they inherit. ``import autopar`` changes nothing: a program
using the library keeps its own logging.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

QUIET_ENV = "AUTOPAR_QUIET"  # "1" in a process the CLI started without -v


class _TorchaoKernels(logging.Filter):
    """torchao's "Failed to load …/torchao/_C….so: …" at import."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (text.startswith("Failed to load ") and "torchao" in text and ".so" in text)


class _TorchaoEnums(logging.Filter):
    """torch's "<enum …> is an Enum subclass … register_constant() … deprecated", for torchao's enums only."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        owner = getattr(args[0], "__module__", "") if args else ""
        return not ("is an Enum subclass" in str(record.msg) and "register_constant()" in str(record.msg)
                    and owner.split(".")[0] == "torchao")


_FILTERS = (("torchao", _TorchaoKernels()), ("torch.utils._pytree", _TorchaoEnums()))


def install() -> None:
    """Drop those lines in this process (adding a filter twice adds it once)."""
    for name, drop in _FILTERS:
        logging.getLogger(name).addFilter(drop)


def uninstall() -> None:
    for name, drop in _FILTERS:
        logging.getLogger(name).removeFilter(drop)


def silence_if_asked() -> None:
    """In a process the CLI started: drop those lines too, unless the CLI ran with ``-v``."""
    if os.environ.get(QUIET_ENV) == "1":
        install()


@contextmanager
def cli_filters(verbose: bool) -> Iterator[None]:
    """Around one CLI command: the filters here and :data:`QUIET_ENV` for the processes it starts, both
    taken back after (``main`` may be called again in one process, as the tests do)."""
    before = os.environ.get(QUIET_ENV)
    os.environ[QUIET_ENV] = "0" if verbose else "1"
    if not verbose:
        install()
    try:
        yield
    finally:
        uninstall()
        if before is None:
            os.environ.pop(QUIET_ENV, None)
        else:
            os.environ[QUIET_ENV] = before
