"""The canary judge's decision as a table: each decision ``decide`` can make, from the policy's
state, the window's samples and the time alone (no registry, no clock)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from gateway.canary_decide import KINDS, Arms, decide
from gateway.canary_stats import Arm
from registry.canary import CHECKS

T0 = 1000.0


def _policy(**kw: Any) -> dict[str, Any]:
    binding = {"active_id": "a", "canary_id": "c", "percent": 10.0} | kw.pop("binding", {})
    return {"id": 1, "row_version": 7, "tenant": "acme", "alias": "support", "steps": [10.0, 50.0, 100.0],
            "interval_s": 30.0, "min_requests": 10, "max_failures": 2, "checks": dict(CHECKS),
            "proportion_test": "two-proportion-z", "sample_test": "mann-whitney-u", "alpha": 0.05,
            "status": "running", "canary_id": "c", "step": 0, "step_started": datetime.fromtimestamp(T0, UTC),
            "failures": 0, "last": None, "binding": binding} | kw


def _arm(n: int, *, errors: int = 0, empty: int = 0, streamed: bool = False) -> Arm:
    arm = Arm()
    for i in range(n):
        ok = i >= errors
        arm.add(ok, 0.05 + (i % 7) * 1e-3, (40.0 + i % 5) if streamed else 0.0, 12, ok and i < errors + empty, False)
    return arm


def _arms(nc: int, na: int, **canary: Any) -> Arms:
    return Arms(_arm(nc, **canary), _arm(na))


def _mark(at: float, nc: int, na: int) -> dict[str, Any]:
    return {"last": {"counted_failure": {"at": at, "canary_requests": nc, "active_requests": na}}}


CASES = [
    # (name, policy overrides, arms, now, decision, extra expectations)
    ("a person ended the canary", {"binding": {"canary_id": None}}, Arms(), T0 + 5, "stopped", {}),
    ("a new canary starts at the first step", {"status": "waiting", "canary_id": None, "step_started": None,
                                               "binding": {"percent": 1.0}}, Arms(), T0, "start", {"percent": 10.0}),
    ("another version on the binding starts over", {"canary_id": "old", "binding": {"percent": 50.0}},
     _arms(50, 50), T0, "start", {"percent": 10.0}),
    ("too few on the canary: waiting", {}, _arms(9, 200), T0 + 60, "waiting", {}),
    ("healthy, step not over: passing", {}, _arms(20, 180), T0 + 10, "passing", {}),
    ("healthy, step over: the next step", {}, _arms(20, 180), T0 + 31, "step", {"percent": 50.0}),
    ("healthy on the last step below 100: promote", {"step": 1}, _arms(20, 20), T0 + 31, "promote", {}),
    ("a quarter empty: a counted failure", {}, _arms(40, 360, empty=10), T0 + 5, "failing",
     {"failures": 1, "counted": True}),
    ("the same evidence a second later: not counted", {"failures": 1, **_mark(T0 + 5, 40, 360)},
     _arms(40, 360, empty=10), T0 + 6, "failing", {"failures": 1, "counted": False}),
    ("an interval later but no new samples: not counted", {"failures": 1, **_mark(T0 + 5, 40, 360)},
     _arms(40, 360, empty=10), T0 + 40, "failing", {"failures": 1, "counted": False}),
    ("new samples before the interval: not counted", {"failures": 1, **_mark(T0 + 5, 40, 360)},
     _arms(60, 500, empty=15), T0 + 20, "failing", {"failures": 1, "counted": False}),
    ("an interval later on new samples: abort", {"failures": 1, **_mark(T0 + 5, 40, 360)},
     _arms(60, 500, empty=15), T0 + 36, "abort", {"failures": 2, "counted": True}),
    ("worse but not significant: inconclusive", {}, Arms(_arm(100, empty=3), _arm(100)), T0 + 31, "inconclusive",
     {}),
    ("one empty answer of 10 against 0 of 90 steps up", {}, _arms(10, 90, empty=1), T0 + 31, "step", {}),
]


@pytest.mark.parametrize(("name", "over", "arms", "now", "kind", "want"), CASES, ids=[c[0] for c in CASES])
def test_decide(name, over, arms, now, kind, want):
    d = decide(_policy(**over), arms, now)
    assert d.kind == kind, d.judgement
    if "percent" in want:
        assert d.percent == want["percent"]
    for key in ("failures", "counted"):
        if key in want:
            assert d.judgement[key] == want[key], d.judgement
    if d.judgement is not None:
        assert d.judgement["decision"] == kind and d.judgement["reason"] and d.state["last"] is d.judgement
        assert d.judgement["at"] == now
    assert (d.policy_id, d.row_version) == (1, 7)


def test_every_decision_is_in_the_table():
    assert {c[4] for c in CASES} == set(KINDS)


def test_state_and_registry_change_of_each_decision():
    abort = decide(_policy(failures=1, **_mark(T0 + 5, 40, 360)), _arms(60, 500, empty=15), T0 + 36)
    assert abort.registry_change == "abort" and abort.state["status"] == "aborted"
    assert abort.judgement["failed"] == ["empty_share"]
    assert abort.judgement["counted_failure"] == {"at": T0 + 36, "canary_requests": 60, "active_requests": 500}
    assert "empty_share" in abort.judgement["reason"] and "15 of 60" in abort.judgement["reason"]
    step = decide(_policy(), _arms(20, 180), T0 + 31)
    assert step.registry_change == "set" and step.state["step"] == 1 and step.state["failures"] == 0
    assert step.state["step_started_at"] == datetime.fromtimestamp(T0 + 31, UTC)
    assert "counted_failure" not in step.judgement  # a pass ends the run of failures
    promote = decide(_policy(step=1), _arms(20, 20), T0 + 31)
    assert promote.registry_change == "promote" and promote.state["status"] == "promoted"
    same = decide(_policy(binding={"percent": 10.0}, status="waiting", step_started=None), Arms(), T0)
    assert same.kind == "start" and same.percent is None  # already at the first step
    already = decide(_policy(steps=[100.0], status="waiting", step_started=None, binding={"percent": 5.0}), Arms(), T0)
    assert already.kind == "start" and already.percent is None and already.registry_change is None
    for kind_arms in ((_arms(9, 200), T0 + 60), (Arms(_arm(100, empty=3), _arm(100)), T0 + 31)):
        held = decide(_policy(failures=1, **_mark(T0 + 5, 40, 360)), *kind_arms)
        assert held.registry_change is None and "failures" not in held.state  # waiting, inconclusive: kept
        assert held.judgement["counted_failure"]["at"] == T0 + 5
    stopped = decide(_policy(binding={"canary_id": None}), Arms(), T0)
    assert stopped.judgement is None and stopped.state == {"status": "waiting", "failures": 0}


def test_one_empty_answer_is_reported_as_such_and_never_fails():
    d = decide(_policy(), _arms(10, 90, empty=1), T0 + 5)
    assert d.kind == "passing"
    [row] = [r for r in d.judgement["checks"] if r["check"] == "empty_share"]
    assert row["verdict"] == "pass" and row["ratio"] == "inf"
    assert (row["canary_events"], row["canary_n"], row["active_events"], row["active_n"]) == (1, 10, 0, 90)
    assert "canary 1 of 10 answers vs active 0 of 90" in row["reason"] and "too few" in row["reason"]
    # Non-streamed traffic has no decode rate: "no data", in its own list, neither pass nor fail.
    [tps] = [r for r in d.judgement["checks"] if r["check"] == "tokens_per_s"]
    assert tps["verdict"] == "no data" and tps["ratio"] is None and tps["p"] is None and not tps["failed"]
    assert d.judgement["no_data"] == ["tokens_per_s"] and "no data" in tps["reason"]
