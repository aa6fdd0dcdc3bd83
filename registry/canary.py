"""Canary policies: how a binding's canaries are judged, and the judge's moves on the registry.

A policy belongs to a binding (tenant, alias). Its configuration is the operator's:

* ``steps``: canary percents walked in order (e.g. 5, 10, 25, 50, 100); after the last the
  canary is promoted;
* ``interval_s``: the least time spent on a step before stepping up;
* ``min_requests``: no judgement on fewer requests than this, per arm (canary and active);
* ``max_failures``: failed judgements in a row that abort the canary; a failure counts only on
  new evidence: ``interval_s`` after the previous counted one, with new samples on both arms
  (``gateway.canary_decide``);
* ``checks``: each compares the canary with the active version over the same window (the
  current step), and fails when the canary is worse by more than its threshold *and* the
  policy's test calls the difference significant at ``alpha`` (``gateway.canary_stats``):
  ``error_rate``, ``empty_share``, ``length_share`` (ratio canary/active above the threshold;
  ``proportion_test``), ``ttft_p99`` (ratio above; ``sample_test`` on the TTFT samples),
  ``tokens_per_s`` (ratio of means below; ``sample_test``) and ``completion_length`` (ratio of
  means outside [1/t, t]; ``sample_test``, two-sided). A check given as ``{"threshold": t,
  "segment": "metadata.topic"}`` is judged per value of the requests' ``metadata.topic``
  (``gateway.canary_stats``). Share checks need a few events on the canary to fail, and use
  Fisher's exact test where the z test's approximation does not hold; checks with nothing to
  compare say "no data" and neither pass nor fail.

The state is the judge's (``gateway.canary_judge``): ``status`` (``waiting`` for a canary,
``running``, ``paused``, ``promoted``, ``aborted``), the version judged (``canary_id``: a new
canary on the binding starts over at step 0), the step and when it began, the failures in a
row and the last judgement's numbers. State writes are not registry changes (no version bump,
no audit row); the decisions are: stepping up, promoting and aborting go through the same
service calls as the CLI, with actor ``canary-judge`` and the judgement in the audit row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from registry.errors import Invalid, NotFound
from registry.lookups import binding_row, version_labels
from registry.models import Binding, CanaryPolicy, utcnow
from registry.service import RegistryService

PROPORTION_TESTS = ("two-proportion-z", "fisher-exact")
SAMPLE_TESTS = ("mann-whitney-u",)
CHECKS: dict[str, float] = {
    "error_rate": 2.0, "empty_share": 2.0, "length_share": 2.0,
    "ttft_p99": 1.5, "tokens_per_s": 0.67, "completion_length": 2.0,
}
"""Every check and its default threshold (a ratio canary/active)."""
DEFAULTS: dict[str, Any] = {
    "steps": [5.0, 10.0, 25.0, 50.0, 100.0], "interval_s": 60.0, "min_requests": 50, "max_failures": 2,
    "checks": dict(CHECKS), "proportion_test": "two-proportion-z", "sample_test": "mann-whitney-u", "alpha": 0.05,
}
JUDGE = "canary-judge"
"""The actor of the judge's decisions in the audit log."""
STATUSES = ("waiting", "running", "paused", "promoted", "aborted")


def _number(body: dict[str, Any], key: str, lo: float, hi: float, *, integer: bool = False) -> Any:
    v = body[key]
    ok = isinstance(v, int) if integer else isinstance(v, int | float)
    if isinstance(v, bool) or not ok or not math.isfinite(v) or not lo <= v <= hi:
        kind = "an integer" if integer else "a number"
        raise Invalid(f"{key} must be {kind} in [{lo:g}, {hi:g}], got {v!r}", param=key)
    return int(v) if integer else float(v)


def _check(name: str, value: Any) -> float | dict[str, Any]:
    """A check's threshold, or ``{"threshold": t, "segment": "metadata.KEY"}`` to judge it per value
    of a request label."""
    segment = None
    t = value
    if isinstance(value, dict):
        unknown = set(value) - {"threshold", "segment"}
        if unknown or "threshold" not in value:
            raise Invalid(f"the check {name} takes a threshold or {{\"threshold\": T, \"segment\": "
                          f"\"metadata.KEY\"}}, got {value!r}", param="checks")
        t, segment = value["threshold"], value.get("segment")
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or not 0 < t < 1e6:
        raise Invalid(f"the threshold of {name} must be a positive ratio, got {t!r}", param="checks")
    if segment is None:
        return float(t)
    key = segment.removeprefix("metadata.") if isinstance(segment, str) else ""
    if not (isinstance(segment, str) and segment.startswith("metadata.") and 0 < len(key) <= 64):
        raise Invalid(f"the segment of {name} must be metadata.KEY (a key of the requests' metadata), "
                      f"got {segment!r}", param="checks")
    return {"threshold": float(t), "segment": segment}


def validate_policy(body: dict[str, Any], base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A complete policy configuration: ``body``'s fields over ``base`` (or the defaults)."""
    merged = {**(base or DEFAULTS), **{k: v for k, v in body.items() if v is not None}}
    steps = merged["steps"]
    if not isinstance(steps, list) or not 1 <= len(steps) <= 20:
        raise Invalid("steps must be a list of 1-20 percents", param="steps")
    out_steps: list[float] = []
    for s in steps:
        if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s) or not 0 < s <= 100:
            raise Invalid(f"each step must be a percent in (0, 100], got {s!r}", param="steps")
        if out_steps and s <= out_steps[-1]:
            raise Invalid("steps must increase", param="steps")
        out_steps.append(float(s))
    checks = merged["checks"]
    if not isinstance(checks, dict) or not checks:
        raise Invalid(f"checks must map check names ({', '.join(CHECKS)}) to thresholds", param="checks")
    out_checks = {}
    for name, value in checks.items():
        if name not in CHECKS:
            raise Invalid(f"unknown check {name!r}; known: {', '.join(CHECKS)}", param="checks")
        out_checks[name] = _check(name, value)
    if merged["proportion_test"] not in PROPORTION_TESTS:
        raise Invalid(f"proportion_test must be one of {', '.join(PROPORTION_TESTS)}", param="proportion_test")
    if merged["sample_test"] not in SAMPLE_TESTS:
        raise Invalid(f"sample_test must be one of {', '.join(SAMPLE_TESTS)}", param="sample_test")
    return {"steps": out_steps, "interval_s": _number(merged, "interval_s", 1, 7 * 86400),
            "min_requests": _number(merged, "min_requests", 1, 10**7, integer=True),
            "max_failures": _number(merged, "max_failures", 1, 1000, integer=True), "checks": out_checks,
            "proportion_test": merged["proportion_test"], "sample_test": merged["sample_test"],
            "alpha": _number(merged, "alpha", 1e-9, 0.5)}


def _aware(t: datetime | None) -> datetime | None:
    return None if t is None else (t if t.tzinfo is not None else t.replace(tzinfo=UTC))


CONFIG = ("steps", "interval_s", "min_requests", "max_failures", "checks", "proportion_test", "sample_test", "alpha")


@dataclass(frozen=True, slots=True)
class CanaryPolicyRecord:
    """A binding's canary policy and where its judge stands (what ``CanaryPolicies`` answers; the
    admin API answers ``to_json()``)."""

    id: int
    tenant: str
    alias: str
    steps: tuple[float, ...]
    interval_s: float
    min_requests: int
    max_failures: int
    checks: dict[str, Any]
    proportion_test: str
    sample_test: str
    alpha: float
    status: str
    canary_id: str | None
    canary: str | None
    """The judged version's ``name@version`` (its id where the label was not looked up)."""
    step: int
    percent: float | None
    """The current step's percent (None without a canary, or past the last step)."""
    step_started_at: datetime | None
    next_step_at: datetime | None
    failures: int
    last: dict[str, Any] | None
    row_version: int

    @classmethod
    def of(cls, p: CanaryPolicy, labels: dict[str, str] | None = None) -> CanaryPolicyRecord:
        started = _aware(p.step_started_at)
        next_at = started + timedelta(seconds=p.interval_s) if p.status == "running" and started is not None else None
        return cls(id=p.id, tenant=p.tenant, alias=p.alias, steps=tuple(p.steps), interval_s=p.interval_s,
                   min_requests=p.min_requests, max_failures=p.max_failures, checks=p.checks,
                   proportion_test=p.proportion_test, sample_test=p.sample_test, alpha=p.alpha, status=p.status,
                   canary_id=p.canary_id, canary=(labels or {}).get(p.canary_id or "", p.canary_id), step=p.step,
                   percent=p.steps[p.step] if p.canary_id and p.step < len(p.steps) else None,
                   step_started_at=started, next_step_at=next_at, failures=p.failures, last=p.last,
                   row_version=p.row_version)

    def config(self) -> dict[str, Any]:
        """The operator's configuration (``CONFIG``), as ``validate_policy`` takes and gives it."""
        return {"steps": list(self.steps), "interval_s": self.interval_s, "min_requests": self.min_requests,
                "max_failures": self.max_failures, "checks": self.checks, "proportion_test": self.proportion_test,
                "sample_test": self.sample_test, "alpha": self.alpha}

    def to_json(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant, "alias": self.alias, **self.config(), "status": self.status,
            "canary_id": self.canary_id, "canary": self.canary, "step": self.step, "percent": self.percent,
            "step_started_at": self.step_started_at.isoformat() if self.step_started_at else None,
            "next_step_at": self.next_step_at.isoformat() if self.next_step_at else None,
            "failures": self.failures, "last": self.last, "row_version": self.row_version,
        }


@dataclass(frozen=True)
class Routing:
    """Where a judged binding routes now (``CanaryPolicies.judged``)."""

    active_id: str
    canary_id: str | None
    percent: float


class CanaryPolicies:
    """Policy reads and writes in a ``RegistryService``'s transactions (``service.db``), with its
    audit and errors."""

    def __init__(self, service: RegistryService) -> None:
        self.service = service

    @staticmethod
    async def _policy(session: AsyncSession, tenant: str, alias: str) -> CanaryPolicy:
        row = (await session.execute(select(CanaryPolicy).where(CanaryPolicy.tenant == tenant,
                                                                CanaryPolicy.alias == alias))).scalar_one_or_none()
        if row is None:
            await binding_row(session, tenant, alias)  # 404 for the tenant or the binding first
            raise NotFound(f"{tenant}/{alias} has no canary policy; set one with set-policy",
                           code="canary_policy_not_found", param="alias")
        return row

    async def get(self, tenant: str, alias: str) -> CanaryPolicyRecord:
        async with self.service.db.read() as session:
            p = await self._policy(session, tenant, alias)
            return CanaryPolicyRecord.of(p, await version_labels(session, [p.canary_id]))

    async def set_policy(self, tenant: str, alias: str, body: dict[str, Any], *,
                         actor: str = "admin") -> CanaryPolicyRecord:
        """Create or change the binding's policy (its configuration; the judge's state is kept)."""
        async with self.service.db.write(actor) as tx:
            await binding_row(tx.session, tenant, alias)
            row = (await tx.session.execute(select(CanaryPolicy).where(
                CanaryPolicy.tenant == tenant, CanaryPolicy.alias == alias).with_for_update())).scalar_one_or_none()
            before = None if row is None else {k: getattr(row, k) for k in CONFIG}
            config = validate_policy(body, before)
            if row is None:
                row = CanaryPolicy(tenant=tenant, alias=alias, status="waiting", step=0, failures=0, row_version=1,
                                   created_at=utcnow(), updated_at=utcnow(), **config)
                tx.session.add(row)
            elif config == before:
                return CanaryPolicyRecord.of(row)
            else:
                for k, v in config.items():
                    setattr(row, k, v)
                row.row_version += 1
                row.updated_at = utcnow()
            await tx.session.flush()
            tx.audit("canary.policy_set", f"binding:{tenant}/{alias}", before, config)
            return CanaryPolicyRecord.of(row)

    async def _status(self, tenant: str, alias: str, status: str, allowed: tuple[str, ...], action: str,
                      actor: str) -> CanaryPolicyRecord:
        async with self.service.db.write(actor) as tx:
            p = await self._policy(tx.session, tenant, alias)
            if p.status == status:
                return CanaryPolicyRecord.of(p)
            if p.status not in allowed:
                raise Invalid(f"the canary of {tenant}/{alias} is {p.status}; {action} needs it "
                              f"{' or '.join(allowed)}", code="canary_not_" + allowed[0], param="alias")
            before = {"status": p.status}
            p.status = status
            p.row_version += 1
            p.updated_at = utcnow()
            await tx.session.flush()
            tx.audit(f"canary.{action}", f"binding:{tenant}/{alias}", before, {"status": status})
            return CanaryPolicyRecord.of(p)

    async def pause(self, tenant: str, alias: str, *, actor: str = "admin") -> CanaryPolicyRecord:
        """Stop judging: the canary keeps its percent until ``resume`` (or a person's decision)."""
        return await self._status(tenant, alias, "paused", ("running", "waiting"), "pause", actor)

    async def resume(self, tenant: str, alias: str, *, actor: str = "admin") -> CanaryPolicyRecord:
        return await self._status(tenant, alias, "running", ("paused",), "resume", actor)

    # --- the judge's side ----------------------------------------------------------------------

    async def judged(self) -> list[tuple[CanaryPolicyRecord, Routing]]:
        """Policies to look at and their bindings' routing."""
        async with self.service.db.read() as session:
            rows = (await session.execute(
                select(CanaryPolicy, Binding.active_id, Binding.canary_id, Binding.canary_percent)
                .join(Binding, (Binding.tenant == CanaryPolicy.tenant) & (Binding.alias == CanaryPolicy.alias))
                .where(CanaryPolicy.status != "paused"))).all()
            out = []
            for p, active_id, canary_id, percent in rows:
                if canary_id is None and p.status != "running":
                    continue  # nothing to judge until a canary starts
                out.append((CanaryPolicyRecord.of(p), Routing(active_id, canary_id, percent)))
            return out

    async def save_state(self, policy_id: int, row_version: int, **state: Any) -> bool:
        """The judge's bookkeeping, when the row is still at ``row_version`` (an operator's change
        in between wins); not a registry change. True when written."""
        async with self.service.db.read() as session:
            async with session.begin():
                res = cast(CursorResult[Any], await session.execute(
                    update(CanaryPolicy).where(CanaryPolicy.id == policy_id, CanaryPolicy.row_version == row_version)
                    .values(**state, row_version=row_version + 1, updated_at=utcnow())))
                return bool(res.rowcount)
