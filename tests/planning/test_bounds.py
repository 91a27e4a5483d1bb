"""The knapsack bound's exact dual maximum: never above the true least time, never below the bisection it replaced."""

from __future__ import annotations

import itertools
import math
import random

from autopar.planning.bounds import knapsack_dual_bound


def _bisection(groups, capacity):
    """The bound as computed before (bisection on λ over the same dual), kept here to compare."""
    def dual(lam):
        value, used = -lam * capacity, 0.0
        for points, n in groups:
            t, mem = min(points, key=lambda p: (p[0] + lam * p[1], p[1]))
            value += n * (t + lam * mem)
            used += n * mem
        return value, used - capacity

    value, excess = dual(0.0)
    if excess <= 0:
        return value
    if sum(n * min(p[1] for p in points) for points, n in groups) > capacity:
        return math.inf
    lo, hi = 0.0, 1e-15
    while dual(hi)[1] > 0:
        lo, hi = hi, hi * 4
    best = value
    for _ in range(60):
        mid = (lo + hi) / 2
        value, excess = dual(mid)
        best = max(best, value)
        lo, hi = (mid, hi) if excess > 0 else (lo, mid)
    return max(best, dual(hi)[0])


def _least_total(groups, capacity):
    """The true least total time, by trying every choice of every layer."""
    layers = [points for points, n in groups for _ in range(n)]
    best = math.inf
    for pick in itertools.product(*layers):
        if sum(m for _, m in pick) <= capacity:
            best = min(best, sum(t for t, _ in pick))
    return best


def test_exact_dual_is_a_bound_at_least_as_tight_as_the_bisection():
    rng = random.Random(7)
    for _ in range(400):
        groups = [(tuple((rng.choice([0.5, 1.0, 1.5, 2.0, 3.0]) * rng.random() + 0.1, rng.randint(1, 9) * 2**30)
                         for _ in range(rng.randint(1, 4))), rng.randint(1, 3)) for _ in range(rng.randint(1, 3))]
        capacity = rng.randint(2, 30) * 2**30
        exact, old, truth = knapsack_dual_bound(groups, capacity), _bisection(groups, capacity), \
            _least_total(groups, capacity)
        assert math.isinf(exact) == math.isinf(truth) == math.isinf(old)
        if not math.isinf(truth):
            assert exact <= truth * (1 + 1e-12)
            assert exact >= old * (1 - 1e-12)


def test_same_memory_different_times_and_ties_do_not_break_it():
    groups = [(((1.0, 4), (2.0, 4), (3.0, 1)), 2), (((1.0, 2), (1.0, 3)), 1)]
    assert knapsack_dual_bound(groups, 100) == 3.0  # all fastest fit
    assert math.isinf(knapsack_dual_bound(groups, 3))  # 1 + 1 + 2 > 3
    assert knapsack_dual_bound(groups, 6) <= _least_total(groups, 6)
