"""The canary judge's tests of "worse": against exact computations, and the checks on arms."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from gateway.canary_stats import Arm, fisher_exact, judge, mann_whitney_u, two_proportion_z, z_allowed
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


def test_one_event_is_never_a_failure():
    """The case that aborted a healthy canary: 1 empty answer of 10 against 0 of 90. The z test
    gave p = 0.0013; Fisher's exact test gives 0.1, and one event is below the minimum anyway."""
    assert two_proportion_z(1, 10, 0, 90) == pytest.approx(0.0013, abs=1e-4)
    assert fisher_exact(1, 10, 0, 90) == pytest.approx(0.1, abs=1e-12)
    assert not z_allowed(1, 10, 0, 90)
    for test in ("two-proportion-z", "fisher-exact"):
        rows = {r["check"]: r for r in judge(DEFAULTS | {"proportion_test": test}, _arm(10, empty=1), _arm(90))}
        row = rows["empty_share"]
        assert row["verdict"] == "pass" and row["ratio"] == "inf" and not row["failed"]
        assert "canary 1 of 10 answers vs active 0 of 90 (ratio inf, limit 2)" in row["reason"]


def test_the_z_test_only_where_its_approximation_holds():
    assert z_allowed(30, 100, 10, 100) and not z_allowed(3, 100, 0, 100)
    rows = {r["check"]: r for r in judge(DEFAULTS, _arm(40, empty=10), _arm(360))}
    assert rows["empty_share"]["test"] == "fisher-exact" and rows["empty_share"]["verdict"] == "fail"
    assert rows["empty_share"]["p"] == pytest.approx(fisher_exact(10, 40, 0, 360), rel=1e-5)
    rows = {r["check"]: r for r in judge(DEFAULTS, _arm(100, errors=30, seed=3), _arm(300, errors=2, seed=1))}
    assert rows["error_rate"]["test"] == "two-proportion-z" and rows["error_rate"]["verdict"] == "fail"
    # A large table: the tail sum stops early and agrees with the z test's order of magnitude.
    assert fisher_exact(600, 5000, 400, 45000) < 1e-100
    assert fisher_exact(50, 5000, 450, 45000) == pytest.approx(0.5, abs=0.05)


def test_no_data_is_neither_a_pass_nor_a_failure():
    whole = Arm()
    for _ in range(50):
        whole.add(True, 0.2, 0.0, 12, False, False)  # whole answers: no decode rate
    rows = {r["check"]: r for r in judge(DEFAULTS, whole, _arm(200))}
    assert rows["tokens_per_s"]["verdict"] == "no data" and rows["tokens_per_s"]["canary"] is None
    assert rows["tokens_per_s"]["reason"] == "no data: no streamed answers on the canary"
    failing = Arm()
    for _ in range(50):
        failing.add(False, 0.0, 0.0, 0, False, False)
    rows = {r["check"]: r for r in judge(DEFAULTS, failing, _arm(200))}
    assert rows["empty_share"]["verdict"] == "no data" and rows["ttft_p99"]["verdict"] == "no data"
    assert rows["error_rate"]["verdict"] == "fail"


def _topics(n: int, refund_empty: bool, seed: int) -> Arm:
    """Refund questions are one in 20; 8% of the answers of every topic are empty (a client's stop)."""
    rng = random.Random(seed)
    arm = Arm()
    for i in range(n):
        topic = "refund" if i % 20 == 0 else rng.choice(["billing", "shipping", "login"])
        empty = rng.random() < 0.08 or (refund_empty and topic == "refund")
        arm.add(True, 0.1, 0.0, 12, empty, False, {"topic": topic})
    return arm


def test_a_check_per_topic_catches_a_rare_broken_topic():
    """The canary answers every refund question empty; refunds are 5% of the traffic. Pooled, its
    empty share is under twice the active's and passes; judged per topic, refunds fail."""
    canary, active = _topics(400, True, 1), _topics(4000, False, 2)
    [pooled] = [r for r in judge(DEFAULTS | {"checks": {"empty_share": 2.0}}, canary, active)]
    assert pooled["verdict"] == "pass" and pooled["segment"] is None, pooled
    segmented = DEFAULTS | {"checks": {"empty_share": {"threshold": 2.0, "segment": "metadata.topic"}}}
    rows = judge(segmented, canary, active)
    assert {r["segment"] for r in rows} == {"topic=refund", "topic=billing", "topic=shipping", "topic=login"}
    [refund] = [r for r in rows if r["segment"] == "topic=refund"]
    assert refund["verdict"] == "fail" and (refund["canary_events"], refund["canary_n"]) == (20, 20)
    assert refund["alpha"] == pytest.approx(0.05 / 4)  # Bonferroni over the topics
    assert [r["segment"] for r in rows if r["failed"]] == ["topic=refund"]
