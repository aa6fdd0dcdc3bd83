"""The canary judge's decision: a pure function of the policy, the window's samples and the time.

``decide(policy, arms, now) -> Decision`` reads no clock, no database and no samples store;
``gateway.canary_judge`` reads those, calls it, and applies the decision (registry writes,
the policy's state, audit, metrics, log). ``policy`` is a judged policy
(``registry.canary.CanaryPolicies.judged``) as the judge hands it over: its JSON
(``CanaryPolicyRecord.to_json()``: the configuration, the judge's state ``status``,
``canary_id``, ``step``, ``failures``, ``last``) with the row's ``id`` and ``step_started`` (a
datetime), and the binding's routing under ``binding`` (``active_id``, ``canary_id``, ``percent``). ``arms`` are the canary's
and the active version's samples since the step began.

The decisions, in the order they are tried:

* ``stopped``: the binding has no canary any more (a person promoted or aborted it): wait for the
  next one;
* ``start``: a canary the judge has not seen: its first step begins now;
* ``waiting``: fewer than ``min_requests`` samples on either arm: no judgement;
* ``failing``: a check failed (``gateway.canary_stats``), fewer than ``max_failures`` counted;
* ``abort``: a check failed and that makes ``max_failures`` counted failures in a row;
* ``inconclusive``: no check failed, but one finds the canary worse without being sure: the step
  waits for more samples;
* ``passing``: every check passed (or has no data), and the step has not lasted ``interval_s``;
* ``step`` / ``promote``: every check passed (or has no data) and the step has lasted
  ``interval_s``: the next step, or the promotion after the last (a step of 100% is the
  promotion itself: the active arm would get no traffic to compare with).

**New evidence.** The window is cumulative (every sample since the step began), and the judge
looks about once a second, so the same failing samples are judged again and again. A failed
judgement counts toward ``max_failures`` only when it comes at least ``interval_s`` after the
previous counted one *and* both arms have samples that one did not have; otherwise it is a
``failing`` decision that counts nothing and says when the next one can. A passing judgement ends
the run of failures; ``waiting`` and ``inconclusive`` leave it as it is. The previous counted
failure is kept in the judgement record (``counted_failure``: its time and sample sizes).

**The judgement record** (the policy's ``last``, and the audit row's ``judgement`` for the
decisions that change the registry)::

    {"decision": "abort", "reason": "empty_share failed 2 times: canary 10 of 40 answers vs ...",
     "at": 1765000000.0, "step": 0, "percent": 10.0, "window_s": 31.2,
     "canary_requests": 40, "active_requests": 360,
     "failures": 2, "max_failures": 2, "counted": true,
     "counted_failure": {"at": ..., "canary_requests": 40, "active_requests": 360} | absent,
     "failed": ["empty_share"], "inconclusive": [], "no_data": ["tokens_per_s"],
     "checks": [<one row per check and segment: gateway.canary_stats.judge>],
     "next_percent": 50.0  (step only)}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from gateway.canary_stats import Arm, judge, row_name

KINDS = ("stopped", "start", "waiting", "failing", "abort", "inconclusive", "passing", "step", "promote")


@dataclass(frozen=True)
class Arms:
    """The window's samples: the canary's and the active version's."""

    canary: Arm = field(default_factory=Arm)
    active: Arm = field(default_factory=Arm)


@dataclass(frozen=True)
class Decision:
    kind: str
    tenant: str
    alias: str
    policy_id: int
    row_version: int
    judgement: dict[str, Any] | None
    """The record (module docstring); None for ``stopped``, which records nothing."""
    state: dict[str, Any]
    """The policy's state columns to write (``last`` is the judgement)."""
    percent: float | None = None
    """The canary percent to set (``start``, ``step``); None: leave it."""

    @property
    def registry_change(self) -> str | None:
        """The registry call this decision makes: ``set``, ``promote``, ``abort`` or None."""
        if self.kind in ("abort", "promote"):
            return self.kind
        return "set" if self.percent is not None else None


def window_start(policy: dict[str, Any]) -> float | None:
    """When the window of the step being judged began (epoch s); None: no samples are needed."""
    started = policy["step_started"]
    if (policy["binding"]["canary_id"] is None or policy["status"] != "running"
            or policy["canary_id"] != policy["binding"]["canary_id"] or started is None):
        return None
    return started.timestamp()


def _dt(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def decide(policy: dict[str, Any], arms: Arms, now: float) -> Decision:
    """The judge's next move on one binding (module docstring)."""
    binding = policy["binding"]
    steps: list[float] = policy["steps"]

    def made(kind: str, judgement: dict[str, Any] | None, state: dict[str, Any], percent: float | None = None
             ) -> Decision:
        if judgement is not None:
            judgement = {"decision": kind, **judgement, "at": now}
            state = {**state, "last": judgement}
        return Decision(kind, policy["tenant"], policy["alias"], policy["id"], policy["row_version"], judgement,
                        state, percent)

    if binding["canary_id"] is None:
        return made("stopped", None, {"status": "waiting", "failures": 0})
    since = window_start(policy)
    if since is None:
        first = steps[0] if steps[0] < 100 else binding["percent"]
        return made("start", {"step": 0, "percent": first, "reason": f"a new canary: its first step, {first:g}%"},
                    {"status": "running", "canary_id": binding["canary_id"], "step": 0,
                     "step_started_at": _dt(now), "failures": 0},
                    first if binding["percent"] != first else None)
    step = policy["step"]
    c, a = arms.canary, arms.active
    failures: int = policy["failures"]
    last = policy.get("last") or {}
    mark = last.get("counted_failure") if failures else None
    base: dict[str, Any] = {"step": step, "percent": binding["percent"], "window_s": round(now - since, 3),
                            "canary_requests": c.requests, "active_requests": a.requests,
                            "failures": failures, "max_failures": policy["max_failures"]}
    if mark:
        base["counted_failure"] = mark
    need = policy["min_requests"]
    if min(c.requests, a.requests) < need:
        return made("waiting", base | {"reason": f"waiting for {need} requests on each arm: canary {c.requests}, "
                                                 f"active {a.requests}"}, {})
    checks = judge(policy, c, a)
    failed = [r for r in checks if r["verdict"] == "fail"]
    unsure = [r for r in checks if r["verdict"] == "inconclusive"]
    base |= {"checks": checks, "failed": [row_name(r) for r in failed], "inconclusive": [row_name(r) for r in unsure],
             "no_data": [row_name(r) for r in checks if r["verdict"] == "no data"]}
    if failed:
        why = "; ".join(f"{row_name(r)}: {r['reason']}" for r in failed)
        if mark is not None and not (now - mark["at"] >= policy["interval_s"] and c.requests > mark["canary_requests"]
                                     and a.requests > mark["active_requests"]):
            after = mark["at"] + policy["interval_s"]
            return made("failing", base | {"counted": False, "reason": (
                f"{why}. Not counted: the same evidence as counted failure {failures} of {policy['max_failures']}; "
                f"the next counts no earlier than {_dt(after).isoformat(timespec='seconds')}, with new requests "
                f"on both arms")}, {})
        failures += 1
        counted = {"at": now, "canary_requests": c.requests, "active_requests": a.requests}
        base |= {"failures": failures, "counted": True, "counted_failure": counted}
        if failures >= policy["max_failures"]:
            return made("abort", base | {"reason": f"aborted after {_plural(failures, 'failed judgement')}: {why}"},
                        {"status": "aborted", "failures": failures})
        return made("failing", base | {"reason": f"failed judgement {failures} of {policy['max_failures']}: {why}"},
                    {"failures": failures})
    if unsure:
        why = "; ".join(f"{row_name(r)}: {r['reason']}" for r in unsure)
        return made("inconclusive", base | {"reason": f"holding the step for more samples: {why}"}, {})
    base.pop("counted_failure", None)
    base["failures"] = 0
    ok = "every check passed" + (f" ({', '.join(base['no_data'])}: no data)" if base["no_data"] else "")
    lasted = now - since
    if lasted < policy["interval_s"]:
        return made("passing", base | {"reason": f"{ok}; the step has lasted {lasted:.0f} of "
                                                 f"{policy['interval_s']:g} s"}, {"failures": 0})
    if step + 1 >= len(steps) or steps[step + 1] >= 100:
        return made("promote", base | {"reason": f"{ok} on the last step: promoted"},
                    {"status": "promoted", "failures": 0})
    nxt = steps[step + 1]
    return made("step", base | {"next_percent": nxt, "reason": f"{ok}: the next step, {nxt:g}%"},
                {"step": step + 1, "step_started_at": _dt(now), "failures": 0}, nxt)


def summary(judgement: dict[str, Any]) -> str:
    """One line for the log: the decision and each failed or inconclusive check's numbers."""
    rows = [r for r in judgement.get("checks", []) if r["verdict"] in ("fail", "inconclusive")]
    detail = "; ".join(f"{row_name(r)} {r['verdict']}: {r['reason']}" for r in rows)
    return f"{judgement['decision']} ({detail or judgement.get('reason', '')})"

