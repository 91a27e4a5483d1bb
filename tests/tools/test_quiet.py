"""A quiet CLI: torchao's and torch's lines about each other stay off the user's terminal (``-v`` shows
them), only under the ``autopar`` command, and a verify rank leaks no semaphore for the tracker to warn of."""

from __future__ import annotations

import enum
import importlib.util
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from console import autopar_command

from autopar import quiet

ROOT = Path(__file__).resolve().parents[2]
THIRD_PARTY = ("Failed to load", "_C_mxfp8", "_C_cutlass", "is an Enum subclass", "register_constant()")


class KernelPreference(enum.Enum):  # as torchao's, by module
    AUTO = "auto"


KernelPreference.__module__ = "torchao.quantization.quantize_.common.kernel_preference"


class Mine(enum.Enum):
    A = 1


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _emit_all() -> list[str]:
    """Both loggers' torchao lines and a neighbour of each, through a handler on each logger."""
    kept = _Kept()
    ao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    for log in (ao, pytree):
        log.addHandler(kept)
    try:
        ao.warning("Failed to load /venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: "
                   "Could not load this library")
        ao.warning("Skipping import of cpp extensions due to incompatible torch version")
        enum_note = ("%s is an Enum subclass and is now natively supported by torch.compile as an opaque value "
                     "type. Calling register_constant() on Enum subclasses is deprecated and will be an error")
        pytree.warning(enum_note, KernelPreference)
        pytree.warning(enum_note, Mine)
    finally:
        for log in (ao, pytree):
            log.removeHandler(kept)
    return kept.lines


def test_the_filters_drop_torchao_lines_and_nothing_beside_them():
    assert len(_emit_all()) == 4  # nothing filtered before the CLI asks
    with quiet.cli_filters(verbose=False):
        lines = _emit_all()
    assert lines[0].startswith("Skipping import") and "Mine" in lines[1] and len(lines) == 2
    with quiet.cli_filters(verbose=True):
        assert len(_emit_all()) == 4
    assert len(_emit_all()) == 4  # taken back after the command


def test_the_environment_tells_the_ranks_and_is_taken_back(monkeypatch):
    monkeypatch.delenv(quiet.QUIET_ENV, raising=False)
    with quiet.cli_filters(verbose=False):
        assert os.environ[quiet.QUIET_ENV] == "1"
    assert quiet.QUIET_ENV not in os.environ
    monkeypatch.setenv(quiet.QUIET_ENV, "1")
    quiet.silence_if_asked()
    try:
        assert len(_emit_all()) == 2
    finally:
        quiet.uninstall()


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> str:
    """examples/gpt.py's tiny GPT from a file that imports torchao, as transformers does for every HF model."""
    path = tmp_path_factory.mktemp("spec") / "with_torchao.py"
    path.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / "examples")!r})
        import torchao  # noqa: F401
        import gpt

        def tiny(seq_len=None, device="meta"):
            return gpt.gpt_tiny(seq_len, device)
    """))
    return f"{path}:tiny"


def _needs_torchao() -> None:
    if importlib.util.find_spec("torchao") is None:  # not imported here: its import logs
        pytest.skip("torchao is not installed")


def _console(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(autopar_command(*argv), cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_plan_prints_no_third_party_line_and_v_prints_them(spec):
    _needs_torchao()
    quiet_run = _console("plan", spec, "--world-size", "2", "--cluster", "cpu")
    assert quiet_run.returncode == 0 and quiet_run.stderr == "", quiet_run.stderr
    loud = _console("plan", spec, "--world-size", "2", "--cluster", "cpu", "-v")
    assert loud.returncode == 0 and "register_constant()" in loud.stderr, loud.stderr
    assert loud.stdout.splitlines()[:2] == quiet_run.stdout.splitlines()[:2]  # the same plan


@pytest.mark.distributed
def test_verify_ranks_print_no_third_party_line(spec):
    _needs_torchao()
    run = _console("verify", spec, "--world-size", "2", "--pin", "tp=2")
    assert run.returncode == 0, run.stderr
    assert not [line for line in run.stderr.splitlines() if any(s in line for s in THIRD_PARTY)], run.stderr
    loud = _console("-v", "verify", spec, "--world-size", "2", "--pin", "tp=2")
    assert "[rank1]:" in loud.stderr and "register_constant()" in loud.stderr, loud.stderr


LEAK = """
import multiprocessing as mp
import os
import sys

def child(how):
    global lock
    lock = mp.get_context("spawn").RLock()  # a named semaphore, as tqdm's lock under --compile
    if how == "leave":
        from autopar.tools.verify import leave
        leave()
    os._exit(0)

if __name__ == "__main__":
    p = mp.get_context("spawn").Process(target=child, args=(sys.argv[1],))
    p.start()
    p.join()
"""


@pytest.mark.parametrize("how", ["leave", "os._exit"])
@pytest.mark.slow
def test_a_verify_rank_leaves_no_semaphore_for_the_tracker_to_warn_of(tmp_path, how):
    """A verify rank exits by os._exit (gloo's teardown can abort); :func:`leave` releases its semaphores
    first. The bare os._exit is the control: the tracker warns of it, so the check can fail."""
    script = tmp_path / "leak.py"
    script.write_text(LEAK)
    run = subprocess.run([sys.executable, str(script), how], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert ("leaked semaphore" in run.stderr) == (how == "os._exit"), run.stderr
