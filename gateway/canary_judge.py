"""The canary judge: steps canaries up, promotes or aborts them, one judge for the whole fleet.

Every gateway replica with the admin API runs a ``CanaryJudge``; one at a time acts. On
PostgreSQL the acting one holds a session advisory lock on a connection of its own
(``pg_try_advisory_lock``): when that replica dies its connection closes, the lock goes with
it, and another replica takes over at its next tick. On SQLite (the embedded default: one
process) the judge always acts.

Each tick (``interval_s``, about a second) the acting judge, for every binding with a canary
policy (``registry.canary``), reads the samples of the current step (``gateway.canary_samples``),
asks ``gateway.canary_decide.decide`` for the decision (pure: the rules are there), and
``apply``-s it: stepping up, promoting and aborting go through the registry service's calls
(the CLI's), with actor ``canary-judge`` and the judgement record in the audit row; each commits
a registry version, which every gateway serves within about a second. The judgement record is
also the policy's ``last`` (``canary status``), written only if no operator changed the policy in
between.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict
from typing import Any

from sqlalchemy import text

from gateway.canary_decide import Arms, Decision, decide, summary, window_start
from gateway.canary_stats import Arm
from registry.canary import JUDGE, CanaryPolicies
from registry.errors import RegistryError
from registry.service import RegistryService

log = logging.getLogger("loraplex.gateway.canary")

LOCK_KEY = 0x6C6F7261706C6578  # "loraplex"
"""The PostgreSQL advisory lock the acting judge holds."""


class Leadership:
    """Whether this process is the one judge (module docstring)."""

    def __init__(self, service: RegistryService) -> None:
        self.service = service
        self._conn: Any = None

    @property
    def postgres(self) -> bool:
        return self.service.db.postgres

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
            conn = await self.service.db.engine.connect()
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
    def __init__(self, service: RegistryService, samples: Any, metrics: Any = None, interval_s: float = 1.0) -> None:
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
        """One look at every judged binding; the judgements made (every decision but ``stopped``)."""
        now = time.time() if now is None else now
        out = []
        for judged, routing in await self.policies.judged():
            policy = {**judged.to_json(), "id": judged.id, "step_started": judged.step_started_at,
                      "binding": asdict(routing)}
            since = window_start(policy)
            arms = Arms()
            if since is not None:
                read = await self.samples.read(f"{policy['tenant']}/{policy['alias']}", since)
                arms = Arms(read.get(routing.canary_id, Arm()), read.get(routing.active_id, Arm()))
            decision = decide(policy, arms, now)
            try:
                await self.apply(decision)
            except RegistryError as exc:  # an operator acted in between: look again next tick
                log.info("canary of %s/%s: %s", policy["tenant"], policy["alias"], exc)
                continue
            if decision.judgement is not None:
                out.append({"tenant": decision.tenant, "alias": decision.alias, **decision.judgement})
        return out

    async def apply(self, decision: Decision) -> None:
        """The decision's side effects: the registry change (audited with the judgement), the
        policy's state, the decision metric and the log line."""
        tenant, alias, judgement = decision.tenant, decision.alias, decision.judgement
        change = decision.registry_change
        if change == "set":
            assert decision.percent is not None
            await self.service.canary_set(tenant, alias, decision.percent, actor=JUDGE, judgement=judgement)
        elif change == "promote":
            await self.service.canary_promote(tenant, alias, actor=JUDGE, judgement=judgement)
        elif change == "abort":
            await self.service.canary_abort(tenant, alias, actor=JUDGE, judgement=judgement)
        await self.policies.save_state(decision.policy_id, decision.row_version, **decision.state)
        if judgement is None or decision.kind in ("waiting", "passing", "inconclusive"):
            return  # looked at again every tick: no metric, no log line
        if decision.kind == "failing" and not judgement.get("counted"):
            return
        if self.metrics is not None and decision.kind != "failing":
            self.metrics.canary_decision(tenant, alias, decision.kind)
        log.info("canary of %s/%s: %s", tenant, alias, summary(judgement))
