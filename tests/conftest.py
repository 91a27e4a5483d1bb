"""Shared by every test: the helpers at tests/ import by plain name, and the session's rank pools.

Tests that start processes that form a process group are marked ``distributed`` (pyproject.toml
registers the marker), so ``pytest -m "not distributed"`` is the quick loop. A test that uses
the ``ranks`` fixture without the marker is refused at collection.
"""

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# tests import their shared helpers (synthetic graphs, cases, the rank pools) by plain module name
sys.path.insert(0, str(Path(__file__).parent))

import fork_server  # noqa: E402
from distributed import RankPool, RankPools  # noqa: E402

_POOLS: list[RankPools] = []  # the session's pools, for the summary (pytest_terminal_summary)


@pytest.fixture(scope="session")
def ranks() -> Iterator[Callable[[int], RankPool]]:
    """``ranks(W)``: the session's pool of W gloo processes, one per world size, shared by every test
    module (spawned on first use, stopped at the end of the session)."""
    pools = RankPools()
    _POOLS.append(pools)
    try:
        yield pools.get
    finally:
        pools.close()


@pytest.fixture(scope="session")
def training(ranks: Callable[[int], RankPool]):
    """The training, checkpoint and weights cases, run once a session (:mod:`training_runs`)."""
    from training_runs import TrainingRuns

    runs = TrainingRuns(ranks)
    try:
        yield runs
    finally:
        runs.cleanup()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The pools' fork server ends with the session (:func:`fork_server.stop`: the time ``time -v`` reports
    holds its workers'), whether the ``ranks`` fixture or a test's own pool started it."""
    fork_server.stop()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [item.nodeid for item in items
                if "ranks" in getattr(item, "fixturenames", ()) and item.get_closest_marker("distributed") is None]
    if unmarked:
        raise pytest.UsageError("these tests use the ranks fixture but are not marked distributed "
                                "(`pytestmark = pytest.mark.distributed`, or `@pytest.mark.distributed`):\n  "
                                + "\n  ".join(unmarked))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--pool-slowest", type=int, default=15, metavar="N",
                     help="list the N slowest rank-pool cases at the end (default 15; 0 lists none)")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Where the distributed tests' time went: each pool's starts (spawning W processes that import torch)
    and the slowest cases (a test's ``setup`` in --durations is its module fixture running them)."""
    slowest = config.getoption("--pool-slowest")
    lines = [line for pools in _POOLS for line in pools.report(slowest)]
    if lines:
        terminalreporter.write_sep("=", "rank pools: starts and slowest cases")
        for line in lines:
            terminalreporter.write_line(line)
