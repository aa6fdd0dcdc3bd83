"""The canary judge against a real registry (PostgreSQL and SQLite): a broken canary is aborted,
a healthy one walks every step and is promoted, each decision audited with its numbers; the
policy's API and CLI views; one judge at a time on PostgreSQL."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

from gateway.canary_judge import CanaryJudge, Leadership
from gateway.canary_samples import MemorySamples
from loraplex.tokens import mint_admin
from registry.admin_api import admin_app
from registry.canary import JUDGE, CanaryPolicies
from registry.errors import Invalid, NotFound
from registry.service import RegistryService
from tests.registry_support import TINY, fresh_registry, make_settings, write_adapter
from tests.test_admin_api import mounted

POLICY = {"steps": [10, 50, 100], "interval_s": 30, "min_requests": 20, "max_failures": 2}


async def _seed(svc: RegistryService) -> list[str]:
    await svc.register_base_model(TINY)
    await svc.create_tenant("acme")
    root = Path(svc.settings.resolved_adapter_root())
    ids = []
    for seed in range(3):
        write_adapter(root / f"v{seed}", TINY, seed=seed)
        a = await svc.register_adapter("bot", f"v{seed}", "tiny")
        ids.append((await svc.activate_adapter(a.id)).id)
    await svc.bind("acme", "support", ids[0])
    return ids


def _feed(samples: MemorySamples, version: str, n: int, at: float, *, errors: int = 0) -> None:
    for i in range(n):
        ok = i >= errors
        samples.record("acme/support", (at + i * 1e-3, version, ok, 0.05 + (i % 7) * 1e-3, 40.0 + i % 5, 12, False,
                                        False, None))


@pytest.fixture
async def registry(db_url, tmp_path):
    await fresh_registry(db_url)
    svc = RegistryService(make_settings(tmp_path, db_url))
    ids = await _seed(svc)
    yield svc, ids
    await svc.close()


async def test_a_broken_canary_is_aborted_and_a_healthy_one_promoted(registry):
    svc, ids = registry
    samples = MemorySamples()
    judge = CanaryJudge(svc, samples)
    policies = CanaryPolicies(svc)
    await policies.set_policy("acme", "support", POLICY, actor="ops")
    assert await judge.tick(now=1000.0) == []  # no canary: nothing to judge

    # A broken version: a third of its requests fail.
    await svc.canary_start("acme", "support", ids[1], 1, actor="ops")
    [start] = await judge.tick(now=1000.0)
    assert start["decision"] == "start" and (await svc.get_binding("acme", "support")).canary_percent == 10
    _feed(samples, ids[1], 10, 1001.0, errors=4)
    _feed(samples, ids[0], 90, 1001.0)
    [waiting] = await judge.tick(now=1002.0)
    assert waiting["decision"] == "waiting" and "waiting for 20" in waiting["reason"]  # never below the minimum
    _feed(samples, ids[1], 20, 1003.0, errors=8)
    _feed(samples, ids[0], 180, 1003.0)
    [first] = await judge.tick(now=1004.0)
    assert first["decision"] == "failing" and first["failed"] == ["error_rate"] and first["counted"]
    # Judged again a second later on the same samples: still failing, but not a second failure.
    [again] = await judge.tick(now=1005.0)
    assert again["decision"] == "failing" and not again["counted"] and again["failures"] == 1
    assert "Not counted" in again["reason"]
    status = await policies.get("acme", "support")
    assert status.failures == 1 and status.last["counted_failure"]["at"] == 1004.0
    _feed(samples, ids[1], 10, 1030.0, errors=4)  # new evidence, an interval after the counted failure
    _feed(samples, ids[0], 90, 1030.0)
    [abort] = await judge.tick(now=1034.0)
    assert abort["decision"] == "abort" and abort["canary_requests"] == 40 and abort["failures"] == 2
    b = await svc.get_binding("acme", "support")
    assert b.canary is None and b.active.id == ids[0]
    status = await policies.get("acme", "support")
    assert status.status == "aborted" and status.last["decision"] == "abort"
    entry = (await svc.audit(action="binding.canary_abort"))[0]
    assert entry.actor == JUDGE
    checks = {r["check"]: r for r in entry.after["judgement"]["checks"]}
    assert checks["error_rate"]["verdict"] == "fail" and checks["error_rate"]["canary"] == pytest.approx(16 / 40, abs=1e-4)
    assert (checks["error_rate"]["canary_events"], checks["error_rate"]["canary_n"]) == (16, 40)
    assert "canary 16 of 40 requests vs active 0 of 360" in checks["error_rate"]["reason"]
    assert entry.after["judgement"]["failed"] == ["error_rate"] and "error_rate" in entry.after["judgement"]["reason"]

    # A healthy version walks 10% -> 50% and is promoted (a 100% step is the promotion itself).
    await svc.canary_start("acme", "support", ids[2], 5, actor="ops")
    [start] = await judge.tick(now=2000.0)
    assert start["decision"] == "start"
    _feed(samples, ids[2], 40, 2001.0)
    _feed(samples, ids[0], 300, 2001.0)
    [passing] = await judge.tick(now=2010.0)
    assert passing["decision"] == "passing" and passing["failed"] == []  # healthy, but the step lasts 30 s
    [step] = await judge.tick(now=2031.0)
    assert step["decision"] == "step" and step["next_percent"] == 50
    assert (await svc.get_binding("acme", "support")).canary_percent == 50
    _feed(samples, ids[2], 40, 2032.0)
    _feed(samples, ids[0], 40, 2032.0)
    [promote] = await judge.tick(now=2062.0)
    assert promote["decision"] == "promote" and promote["window_s"] == pytest.approx(31.0)
    b = await svc.get_binding("acme", "support")
    assert b.active.id == ids[2] and b.previous.id == ids[0] and b.canary is None
    actions = [e.action for e in await svc.audit(actor=JUDGE)]
    assert actions[:4] == ["binding.canary_promote", "binding.canary_set", "binding.canary_set",
                           "binding.canary_abort"]
    assert (await policies.get("acme", "support")).status == "promoted"


async def test_pause_holds_the_judge_and_policies_are_checked(registry):
    svc, ids = registry
    policies = CanaryPolicies(svc)
    with pytest.raises(NotFound):
        await policies.get("acme", "support")
    for bad, param in (({"steps": [50, 10]}, "steps"), ({"steps": [0]}, "steps"), ({"checks": {"nope": 1}}, "checks"),
                       ({"alpha": 2}, "alpha"), ({"proportion_test": "t"}, "proportion_test"),
                       ({"min_requests": 0}, "min_requests")):
        with pytest.raises(Invalid) as exc:
            await policies.set_policy("acme", "support", bad)
        assert exc.value.param == param
    p = await policies.set_policy("acme", "support", {"interval_s": 5})
    assert p.steps == (5.0, 10.0, 25.0, 50.0, 100.0) and p.interval_s == 5 and p.status == "waiting"
    await svc.canary_start("acme", "support", ids[1], 1)
    samples = MemorySamples()
    judge = CanaryJudge(svc, samples)
    await judge.tick(now=100.0)
    assert (await policies.pause("acme", "support")).status == "paused"
    assert await judge.tick(now=200.0) == []
    assert (await svc.get_binding("acme", "support")).canary_percent == 5  # left as it was
    assert (await policies.resume("acme", "support")).status == "running"
    assert (await policies.resume("acme", "support")).status == "running"  # idempotent
    await svc.canary_abort("acme", "support")
    await judge.tick(now=300.0)  # a person aborted it: the judge waits for the next canary
    assert (await policies.get("acme", "support")).status == "waiting"
    with pytest.raises(Invalid):
        await policies.resume("acme", "support")  # nothing paused
    actions = [e.action for e in await svc.audit(target="binding:acme/support")]
    assert "canary.pause" in actions and "canary.resume" in actions and "canary.policy_set" in actions


async def test_admin_api_status_set_policy_pause_resume(registry):
    svc, _ = registry
    app = mounted(admin_app(svc, svc.settings))
    h = {"authorization": f"Bearer {mint_admin(svc.settings)}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t/admin",
                                 headers=h) as c:
        base = "/tenants/acme/bindings/support/canary"
        assert (await c.get(base + "/policy")).json()["error"]["code"] == "canary_policy_not_found"
        r = await c.put(base + "/policy", json={"steps": [20, 100], "checks": {"error_rate": 1.5}})
        assert r.status_code == 200, r.text
        assert r.json()["steps"] == [20.0, 100.0] and r.json()["checks"] == {"error_rate": 1.5}
        r = await c.put(base + "/policy", json={"checks": {"bogus": 1}})
        assert r.status_code == 422 and r.json()["error"]["param"] == "checks"
        assert (await c.post(base + "/pause")).json()["status"] == "paused"
        assert (await c.post(base + "/resume")).json()["status"] == "running"
        got = (await c.get(base + "/policy")).json()
        assert got["tenant"] == "acme" and got["alias"] == "support" and got["min_requests"] == 50


async def test_one_judge_at_a_time_on_postgresql(pg_url, tmp_path):
    await fresh_registry(pg_url)
    a, b = (RegistryService(make_settings(tmp_path, pg_url)) for _ in range(2))
    la, lb = Leadership(a), Leadership(b)
    try:
        assert await la.acquire() and await la.acquire()  # held: still the judge
        assert not await lb.acquire()
        await la.release()  # as when that gateway dies: its connection goes, and the lock with it
        assert await lb.acquire() and not await la.acquire()
    finally:
        await la.release()
        await lb.release()
        await a.close()
        await b.close()


def _answers(samples: MemorySamples, version: str, n: int, at: float, *, empty: int = 0) -> None:
    """``n`` whole answers on ``version`` from ``at``, the first ``empty`` of them empty."""
    for i in range(n):
        samples.record("acme/support", (at + i * 1e-3, version, True, 0.2 + (i % 7) * 1e-3, 0.0, 12, i < empty, False,
                                        None))


async def test_one_empty_answer_does_not_abort_a_quarter_does(registry, caplog):
    """One empty answer of 10 on the canary against 0 of 90, judged every second for a whole step:
    never a failure, the canary steps up. A canary empty for a quarter of its answers: aborted an
    interval after its minimum sample, on new samples."""
    caplog.set_level(logging.INFO, logger="loraplex.gateway.canary")
    svc, ids = registry
    samples = MemorySamples()
    judge = CanaryJudge(svc, samples)
    policies = CanaryPolicies(svc)
    await policies.set_policy("acme", "support", {"steps": [10, 50, 100], "interval_s": 10, "min_requests": 10,
                                                  "max_failures": 2}, actor="ops")
    await svc.canary_start("acme", "support", ids[1], 1, actor="ops")
    await judge.tick(now=1000.0)
    _answers(samples, ids[1], 10, 1000.5, empty=1)
    _answers(samples, ids[0], 90, 1000.5)
    decisions = [(await judge.tick(now=1001.0 + s))[0]["decision"] for s in range(11)]
    assert decisions == ["passing"] * 9 + ["step", "waiting"], decisions
    assert (await svc.get_binding("acme", "support")).canary_percent == 50
    await svc.canary_abort("acme", "support", actor="ops")
    assert await judge.tick(now=1500.0) == []

    await svc.canary_start("acme", "support", ids[2], 1, actor="ops")
    await judge.tick(now=2000.0)
    _answers(samples, ids[2], 16, 2000.5, empty=4)
    _answers(samples, ids[0], 144, 2000.5)
    got = {}
    for s in range(25):
        now = 2001.0 + s
        if s % 3 == 2:  # traffic goes on: new samples on both arms
            _answers(samples, ids[2], 4, now - 0.5, empty=1)
            _answers(samples, ids[0], 36, now - 0.5)
        [j] = await judge.tick(now=now)
        got[now] = j
        if j["decision"] == "abort":
            break
    assert got[2001.0]["decision"] == "failing" and got[2001.0]["counted"]  # at its minimum sample
    assert [got[t]["counted"] for t in got if got[t]["decision"] == "failing"] == [True] + [False] * 9
    assert j["decision"] == "abort" and now == 2011.0 and j["failed"] == ["empty_share"]
    logged = [r.getMessage() for r in caplog.records if r.name == "loraplex.gateway.canary"]
    assert any("abort (empty_share fail: canary" in m and "ratio inf" in m for m in logged), logged
    assert (await svc.get_binding("acme", "support")).canary is None
