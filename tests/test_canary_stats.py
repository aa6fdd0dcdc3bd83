"""The canary judge's tests of "worse": against exact computations, and the checks on arms."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from gateway.canary_stats import Arm, fisher_exact, judge, mann_whitney_u, two_proportion_z
from registry.canary import DEFAULTS


def test_two_proportion_z_one_sided():
    p = two_proportion_z(30, 100, 10, 100)
    assert p < 0.001
    assert two_proportion_z(10, 100, 30, 100) > 0.999
    assert two_proportion_z(10, 100, 10, 100) == pytest.approx(0.5)
    assert two_proportion_z(0, 0, 3, 10) == 1.0 and two_proportion_z(0, 50, 0, 50) == 1.0


def test_fisher_exact_matches_the_hypergeometric_tail():
    # [[8, 2], [2, 8]]: P(X >= 8) with 10 successes among 20, 10 drawn = 0.011507...
    tail = sum(math.comb(10, x) * math.comb(10, 10 - x) for x in range(8, 11)) / math.comb(20, 10)
    assert fisher_exact(8, 10, 2, 10) == pytest.approx(tail, rel=1e-9)
    assert fisher_exact(8, 10, 2, 10) == pytest.approx(0.011507, abs=1e-6)
    assert fisher_exact(0, 10, 0, 10) == 1.0


def _exact_mw_greater(a: list[float], b: list[float]) -> float:
    """P(U >= u_observed) under H0 by enumerating every split of the pooled sample."""
    pooled = a + b

    def u(xs: list[float], ys: list[float]) -> float:
        return sum((x > y) + 0.5 * (x == y) for x in xs for y in ys)

    observed = u(a, b)
    idx = range(len(pooled))
    count = total = 0
    for pick in itertools.combinations(idx, len(a)):
        xs = [pooled[i] for i in pick]
        ys = [pooled[i] for i in idx if i not in pick]
        total += 1
        count += u(xs, ys) >= observed - 1e-12
    return count / total


@pytest.mark.parametrize("seed", range(6))
def test_mann_whitney_close_to_the_exact_test(seed):
    rng = random.Random(seed)
    a = [rng.gauss(0.4 * (seed % 3), 1) for _ in range(7)]
    b = [rng.gauss(0, 1) for _ in range(7)]
    exact = _exact_mw_greater(a, b)
    assert mann_whitney_u(a, b, "greater") == pytest.approx(exact, abs=0.03)
    assert mann_whitney_u(b, a, "less") == pytest.approx(mann_whitney_u(a, b, "greater"), abs=1e-12)


def test_mann_whitney_ties_and_extremes():
    assert mann_whitney_u(list(range(20, 40)), list(range(20)), "greater") < 1e-6
    assert mann_whitney_u(list(range(20)), list(range(20, 40)), "greater") > 0.999
    same = [1.0] * 30
    assert mann_whitney_u(same, same, "two-sided") == 1.0
    assert mann_whitney_u([], [1.0], "greater") == 1.0


def _arm(n: int, *, errors: int = 0, empty: int = 0, ttft: float = 0.1, tps: float = 50.0, ct: int = 20,
         seed: int = 0) -> Arm:
    rng = random.Random(seed)
    arm = Arm()
    for i in range(n):
        arm.add(i >= errors, ttft * rng.uniform(0.8, 1.2), tps * rng.uniform(0.8, 1.2), ct, i < errors + empty,
                False)
    return arm


def _failed(policy, canary, active):
    return {r["check"] for r in judge(policy, canary, active) if r["failed"]}


def test_judge_flags_what_is_worse_and_significant():
    policy = dict(DEFAULTS)
    active = _arm(300, errors=2, seed=1)
    assert _failed(policy, _arm(300, errors=3, seed=2), active) == set()
    assert _failed(policy, _arm(100, errors=30, seed=3), active) == {"error_rate"}
    assert _failed(policy, _arm(100, empty=40, seed=4), active) == {"empty_share"}
    assert _failed(policy, _arm(100, ttft=0.5, seed=5), active) == {"ttft_p99"}
    assert _failed(policy, _arm(100, tps=10.0, seed=6), active) == {"tokens_per_s"}
    assert _failed(policy, _arm(100, ct=200, seed=7), active) == {"completion_length"}
    # Worse but on a handful of requests: not significant, no failure.
    assert _failed(policy, _arm(4, errors=1, seed=8), _arm(4, seed=9)) == set()
    fisher = policy | {"proportion_test": "fisher-exact"}
    results = {r["check"]: r for r in judge(fisher, _arm(100, errors=30, seed=3), active)}
    assert results["error_rate"]["failed"] and results["error_rate"]["test"] == "fisher-exact"
    assert results["error_rate"]["ratio"] == pytest.approx((30 / 100) / (2 / 300), rel=1e-3)
