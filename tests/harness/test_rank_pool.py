"""The rank pools the distributed tests share (tests/distributed.py): every rank's metrics come back,
workers are reused across requests, and a case that raises, hangs, desynchronises the ranks, kills its
worker or leaks state fails alone — naming the case and the rank — while the pool starts again for the
cases after it. The cases are in :mod:`pool_cases`."""

from __future__ import annotations

import pytest
from distributed import RankPool, RankPools, ok

pytestmark = pytest.mark.distributed


def test_every_ranks_metrics_come_back_under_the_requests_environment(ranks) -> None:
    pool = ranks(2)
    results = pool.run(["ranks", "reads_env"], module="pool_cases", env={"AUTOPAR_POOL_TEST": "on"})
    every = ok(results["ranks"])["ranks"]
    assert [m["rank"] for m in every] == [0, 1] and results["ranks"]["rank"] == 0  # rank 0's, on top
    assert [m["sum"] for m in every] == [1.0, 1.0] and {m["world_size"] for m in every} == {2}
    assert [m["value"] for m in ok(results["reads_env"])["ranks"]] == ["on", "on"]
    again = pool.run(["pool_cases:ranks", "pool_cases:reads_env"])  # "module:case" names
    assert [m["pid"] for m in again["pool_cases:ranks"]["ranks"]] == [m["pid"] for m in every]  # the same workers
    assert [m["value"] for m in again["pool_cases:reads_env"]["ranks"]] == [None, None]  # that request's only


@pytest.fixture
def pool():
    """A pool of its own with short timeouts: these cases break it on purpose."""
    with RankPool(2, stall_timeout_s=10, collective_timeout_s=5, error_grace_s=3) as p:
        yield p


def test_every_case_starts_from_the_random_state_its_worker_started_with(pool: RankPool) -> None:
    first = pool.run(["ranks", "draws_without_seeding"], module="pool_cases")
    then = pool.run(["draws_without_seeding"], module="pool_cases")
    for rank in (0, 1):  # whatever the cases before it drew
        draws = [results[name]["ranks"][rank]["draw"] for results in (first, then) for name in results]
        assert len(draws) == 3 and len(set(draws)) == 1 and pool.starts == 1


def test_a_case_that_raises_names_the_case_the_rank_and_the_error(pool: RankPool) -> None:
    results = pool.run(["raises_on_1", "ranks"], module="pool_cases")
    failed = results["raises_on_1"]
    assert failed["rank"] == 1 and failed["error"] == "ValueError: rank 1 has no data"
    assert "in raises_on_1" in failed["traceback"]
    with pytest.raises(pytest.fail.Exception, match=r"case raises_on_1, rank 1: ValueError: rank 1 has no data"):
        ok(failed)
    assert ok(results["ranks"])["sum"] == 1.0 and pool.starts == 2  # the next case, in a fresh group


def test_a_case_that_hangs_fails_on_the_rank_that_hung_and_the_next_runs(pool: RankPool) -> None:
    results = pool.run(["hangs_on_1", "ranks"], module="pool_cases")
    hung = results["hangs_on_1"]
    assert hung["rank"] == 1 and "did not finish on rank(s) 1: it hung, or the ranks desynchronised" in hung["error"]
    assert ok(results["ranks"])["sum"] == 1.0 and pool.starts == 2


def test_a_case_that_desynchronises_the_ranks_fails_when_the_collective_times_out(pool: RankPool) -> None:
    results = pool.run(["desyncs", "ranks"], module="pool_cases")
    assert results["desyncs"]["rank"] == 0 and "desyncs" in results["desyncs"]["traceback"]
    assert ok(results["ranks"])["sum"] == 1.0 and pool.starts == 2


def test_a_worker_that_dies_is_named_and_the_pool_starts_again(pool: RankPool) -> None:
    results = pool.run(["dies_on_1", "ranks"], module="pool_cases")
    died = results["dies_on_1"]
    assert died["rank"] == 1 and died["error"] == "rank 1's process died while running it (killed by SIGKILL)"
    assert ok(results["ranks"])["sum"] == 1.0 and pool.starts == 2


def test_a_case_that_leaves_state_behind_fails_and_the_next_starts_clean(pool: RankPool) -> None:
    results = pool.run(["leaks_dtype", "ranks"], module="pool_cases")
    assert "the case left the default dtype torch.float64 (was torch.float32) behind" in results["leaks_dtype"]["error"]
    assert ok(results["ranks"])["sum"] == 1.0


def test_workers_holding_too_many_descriptors_start_afresh_before_the_next_request(pool: RankPool) -> None:
    pool.run(["ranks"], module="pool_cases")
    pool.fd_recycle = 1.5 * pool.fd_fill  # what the workers hold after a plain case, and half as much again
    pids = [p.pid for p in pool.processes]
    assert [m["kept"] for m in ok(pool.run(["leaks_descriptors"], module="pool_cases")["leaks_descriptors"])["ranks"]] \
        == [200, 200]
    assert pool.fd_fill > pool.fd_recycle
    again = ok(pool.run(["ranks"], module="pool_cases")["ranks"])["ranks"]
    assert pool.starts == 2 and [m["pid"] for m in again] != pids and pool.fd_fill < pool.fd_recycle


def test_workers_holding_too_many_threads_start_afresh_before_the_next_request(pool: RankPool) -> None:
    pool.run(["ranks"], module="pool_cases")
    pool.thread_recycle = pool.threads + 50
    pids = [p.pid for p in pool.processes]
    ok(pool.run(["leaks_threads"], module="pool_cases")["leaks_threads"])
    assert pool.threads > pool.thread_recycle
    again = ok(pool.run(["ranks"], module="pool_cases")["ranks"])["ranks"]
    assert pool.starts == 2 and [m["pid"] for m in again] != pids and pool.threads < pool.thread_recycle


def test_the_groups_a_case_made_are_closed_and_the_next_case_builds_its_own(pool: RankPool) -> None:
    results = pool.run(["meshes", "counts_groups", "meshes", "counts_groups"], module="pool_cases")
    first = ok(results["meshes"])  # the same name twice: the second run's results
    assert first["sum"] == 28.0 and first["groups"] > 1  # the mesh's own group beside the default one
    assert [m["groups"] for m in ok(results["counts_groups"])["ranks"]] == [1, 1]  # only the default is left
    assert pool.starts == 1


def test_closing_stops_every_worker_cleanly(pool: RankPool) -> None:
    pool.run(["ranks"], module="pool_cases")
    processes = pool.processes
    pool.close()
    assert [p.exitcode for p in processes] == [0, 0] and pool.processes == []  # destroyed its group, returned


def test_pools_past_the_worker_budget_or_the_free_memory_stop_the_least_recently_used() -> None:
    free: list[int | None] = [None]  # the memory the machine has available (None: unknown, no limit)
    pools = RankPools(max_workers=2, worker_bytes=100, available=lambda: free[0])
    try:
        two = pools.get(2)
        assert ok(two.run(["ranks"], module="pool_cases")["ranks"])["sum"] == 1.0
        one = pools.get(1)  # 2 + 1 workers would pass the budget: the pool of 2 stops
        assert two.processes == [] and ok(one.run(["ranks"], module="pool_cases")["ranks"])["sum"] == 0.0
        assert ok(pools.get(2).run(["ranks"], module="pool_cases")["ranks"])["sum"] == 1.0
        assert two.starts == 2 and one.processes == []
        pools.max_workers, free[0] = 3, 99  # within the budget, but less memory than one more worker takes
        assert ok(pools.get(1).run(["ranks"], module="pool_cases")["ranks"])["sum"] == 0.0
        assert two.processes == [] and one.starts == 2
        free[0] = 200  # enough for two workers: the pool of 1 stays beside the pool of 2
        assert ok(pools.get(2).run(["ranks"], module="pool_cases")["ranks"])["sum"] == 1.0
        assert len(one.processes) == 1 and two.starts == 3
    finally:
        pools.close()
