"""The canary judge: steps canaries up, promotes or aborts them, one judge for the whole fleet.

Every gateway replica with the admin API runs a ``CanaryJudge``; one at a time acts. On
PostgreSQL the acting one holds a session advisory lock on a connection of its own
(``pg_try_advisory_lock``): when that replica dies its connection closes, the lock goes with
it, and another replica takes over at its next tick. On SQLite (the embedded default: one
process) the judge always acts.

Each tick (``interval_s``, about a second) the acting judge looks at the bindings with a canary
policy (``registry.canary``):

* a new canary on the binding starts at the policy's first step;
* fewer than ``min_requests`` samples on either arm since the step began: hold;
* any check failed (``gateway.canary_stats.judge``): one more failure in a row; at
  ``max_failures`` the canary is aborted;
* every check passed and the step has lasted ``interval_s``: the next step, or the promotion
  after the last one (a step of 100% is the promotion itself: the active arm would get no
  traffic to compare with).

Decisions go through the registry service's calls (the CLI's), with actor ``canary-judge`` and
the judgement (every check's numbers, the window, the sample sizes) in the audit row; each
commits a registry version, which every gateway serves within about a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import text

from gateway.canary_stats import Arm, judge
from registry.canary import JUDGE, CanaryPolicies
from registry.errors import RegistryError

log = logging.getLogger("loraplex.gateway.canary")

LOCK_KEY = 0x6C6F7261706C6578  # "loraplex"
"""The PostgreSQL advisory lock the acting judge holds."""


class Leadership:
    """Whether this process is the one judge (module docstring)."""

    def __init__(self, service: Any) -> None:
        self.service = service
        self._conn: Any = None

    @property
    def postgres(self) -> bool:
        return bool(self.service.bus.postgres)

    async def acquire(self) -> bool:
        if not self.postgres:
            return True
        if self._conn is not None:
            try:
                await self._conn.execute(text("SELECT 1"))
                return True
            except Exception:
                await self.release()
        try:
            conn = await self.service.engine.connect()
        except Exception:
            return False
        try:
            got = bool(await conn.scalar(text("SELECT pg_try_advisory_lock(:k)"), {"k": LOCK_KEY}))
            await conn.commit()
        except Exception:
            got = False
        if not got:
            await conn.close()
            return False
        self._conn = conn
        log.info("this gateway is the canary judge")
        return True

    async def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": LOCK_KEY})
            with contextlib.suppress(Exception):
                await conn.close()


class CanaryJudge:
    def __init__(self, service: Any, samples: Any, metrics: Any = None, interval_s: float = 1.0) -> None:
        self.service = service
        self.policies = CanaryPolicies(service)
        self.samples = samples
        self.metrics = metrics
        self.interval_s = interval_s
        self.leadership = Leadership(service)
        self.leader = False

    async def run(self) -> None:
        warned = 0.0
        try:
            while True:
                try:
                    self.leader = await self.leadership.acquire()
                    if self.leader:
                        await self.tick()
                except RegistryError as exc:  # the registry is down or not migrated: say so once a minute
                    if time.monotonic() - warned > 60:
                        warned = time.monotonic()
                        log.warning("canary judge: the registry cannot be read (%s); retrying", exc)
                except Exception:
                    log.exception("canary judge tick failed")
                await asyncio.sleep(self.interval_s)
        finally:
            self.leader = False
            await self.leadership.release()

    async def tick(self, now: float | None = None) -> list[dict[str, Any]]:
        """One look at every judged binding; the decisions made (also the holds)."""
        now = time.time() if now is None else now
        out = []
        for policy, binding in await self.policies.judged():
            try:
                decision = await self._judge(policy, binding, now)
            except RegistryError as exc:  # an operator acted in between: look again next tick
                log.info("canary of %s/%s: %s", policy["tenant"], policy["alias"], exc)
                continue
            if decision is not None:
                out.append(decision)
        return out

    def _count(self, policy: dict[str, Any], decision: str) -> None:
        if self.metrics is not None:
            self.metrics.canary_decision(policy["tenant"], policy["alias"], decision)

    async def _judge(self, policy: dict[str, Any], binding: dict[str, Any], now: float) -> dict[str, Any] | None:
        tenant, alias = policy["tenant"], policy["alias"]
        canary_id = binding["canary_id"]
        steps: list[float] = policy["steps"]
        save = self.policies.save_state
        if canary_id is None:  # a person promoted or aborted it: wait for the next canary
            await save(policy["id"], policy["row_version"], status="waiting", failures=0)
            return None
        started = policy["step_started"]
        if policy["status"] != "running" or policy["canary_id"] != canary_id or started is None:
            first = steps[0] if steps[0] < 100 else binding["percent"]
            judgement = {"decision": "start", "step": 0, "percent": first}
            if binding["percent"] != first:
                await self.service.canary_set(tenant, alias, first, actor=JUDGE, judgement=judgement)
            await save(policy["id"], policy["row_version"], status="running", canary_id=canary_id, step=0,
                       step_started_at=_dt(now), failures=0, last=judgement | {"at": now})
            self._count(policy, "start")
            return {"tenant": tenant, "alias": alias, **judgement}
        since = started.timestamp()
        step = policy["step"]
        arms = await self.samples.read(f"{tenant}/{alias}", since)
        c, a = arms.get(canary_id, Arm()), arms.get(binding["active_id"], Arm())
        judgement: dict[str, Any] = {"step": step, "percent": binding["percent"], "window_s": round(now - since, 3),
                                     "canary_requests": c.requests, "active_requests": a.requests}
        if min(c.requests, a.requests) < policy["min_requests"]:
            judgement |= {"decision": "hold", "reason": f"waiting for {policy['min_requests']} requests on each arm"}
            await save(policy["id"], policy["row_version"], last=judgement | {"at": now})
            return {"tenant": tenant, "alias": alias, **judgement}
        checks = judge(policy, c, a)
        judgement["checks"] = checks
        failed = [r["check"] for r in checks if r["failed"]]
        state: dict[str, Any] = {}
        if failed:
            failures = policy["failures"] + 1
            judgement["failed"] = failed
            if failures >= policy["max_failures"]:
                judgement["decision"] = "abort"
                await self.service.canary_abort(tenant, alias, actor=JUDGE, judgement=judgement)
                state = {"status": "aborted", "failures": failures}
            else:
                judgement["decision"] = "hold"
                state = {"failures": failures}
        elif now - since < policy["interval_s"]:
            judgement["decision"] = "hold"
            state = {"failures": 0}
        elif step + 1 >= len(steps) or steps[step + 1] >= 100:
            judgement["decision"] = "promote"
            await self.service.canary_promote(tenant, alias, actor=JUDGE, judgement=judgement)
            state = {"status": "promoted", "failures": 0}
        else:
            judgement |= {"decision": "step", "next_percent": steps[step + 1]}
            await self.service.canary_set(tenant, alias, steps[step + 1], actor=JUDGE, judgement=judgement)
            state = {"step": step + 1, "step_started_at": _dt(now), "failures": 0}
        await save(policy["id"], policy["row_version"], last=judgement | {"at": now}, **state)
        if judgement["decision"] != "hold":
            self._count(policy, judgement["decision"])
            log.info("canary of %s/%s: %s (%s)", tenant, alias, judgement["decision"],
                     ", ".join(f"{r['check']} {r['ratio']} p={r['p']}" for r in checks))
        return {"tenant": tenant, "alias": alias, **judgement}


def _dt(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)
