"""The console's server side, without a browser: auth and refusals, headers, keyset pages,
the confirm step's before/after, escaping, the fleet and live views, live numbers across
replicas (real Redis). The browser flows are ``tests/test_console_browser.py``."""

from __future__ import annotations

import json
import re
import time
import uuid
from html import unescape
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from gateway.live_stats import LiveStats
from loraplex.tokens import mint, mint_admin
from loraplex.wire import WorkerReport
from registry.admin_api import admin_app
from registry.service import RegistryService
from tests.registry_support import TINY, fresh_registry, make_settings, write_adapter


class FakeSources:
    def __init__(self) -> None:
        self.reports: list[WorkerReport] = []
        self.stats: dict[str, dict[str, Any]] = {}
        self.ejected: dict[str, Any] = {}

    async def workers(self) -> list[WorkerReport]:
        return self.reports

    async def ejections(self) -> dict[str, Any]:
        return self.ejected

    async def live(self) -> dict[str, dict[str, Any]]:
        return self.stats


@pytest.fixture
async def console(db_url, tmp_path):
    await fresh_registry(db_url)
    settings = make_settings(tmp_path, db_url)
    service = RegistryService(settings)
    sources = FakeSources()
    app = Starlette(routes=[Mount("/admin", app=admin_app(service, settings, console=sources))])
    headers = {"authorization": f"Bearer {mint_admin(settings, subject='ops-alice')}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t/admin",
                                 headers=headers) as client:
        client.settings, client.service, client.sources = settings, service, sources  # type: ignore[attr-defined]
        yield client
    await service.close()


async def _seed(svc: RegistryService, root) -> dict[str, str]:
    await svc.register_base_model(TINY)
    await svc.create_tenant("acme")
    ids = {}
    for i, name in enumerate(("one", "two", "three")):
        a = await svc.register_adapter(name, str(write_adapter(root / "adapters" / name, TINY, seed=i)), TINY.name,
                                       owner="acme")
        ids[name] = (await svc.activate_adapter(a.id, verification={"passed": True, "reason": "probes differ"})).id
    await svc.bind("acme", "chat", ids["one"])
    await svc.bind("acme", "chat", ids["two"])  # previous: one
    await svc.canary_start("acme", "chat", ids["three"], 10)
    return ids


def _rows(html: str, attr: str) -> list[str]:
    return re.findall(rf'{attr}="([^"]+)"', html)


def _diff(html: str) -> list[tuple[str, str, str]]:
    """The audit change cells' rows: (field, before, after) as shown."""
    return [(f, unescape(b), unescape(a)) for f, b, a in re.findall(
        r'<tr data-field="([^"]+)"><th>[^<]*</th><td class="before"[^>]*>([^<]*)</td><td class="arrow">[^<]*</td>'
        r'<td class="after"[^>]*>([^<]*)</td>', html)]


def _calls(html: str) -> list[dict[str, Any]]:
    """The admin API calls a confirm step's button makes, in order."""
    return json.loads(unescape(re.search(r'data-calls="([^"]*)"', html).group(1)))


async def test_the_shell_is_self_contained_and_locked_down(console):
    r = await console.get("/console", headers={"authorization": ""})
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp and r.headers["x-frame-options"] == "DENY"
    assert not re.search(r'(src|href)="(https?:)?//', r.text)  # nothing from elsewhere
    for name in ("console.js", "console.css"):
        s = await console.get(f"/console/static/{name}", headers={"authorization": ""})
        assert s.status_code == 200 and len(s.text) > 500
    js = (await console.get("/console/static/console.js")).text
    assert "http://" not in js.replace('"http://www.w3.org/2000/svg"', "")  # the SVG namespace is a name, not a fetch
    assert (await console.get("/console/static/../views.py")).status_code == 404
    assert (await console.get("/console/static/secrets.txt")).status_code == 404


@pytest.mark.parametrize("who, status, words", [
    ("none", 401, "not valid"),
    ("garbage", 401, "not valid"),
    ("expired", 401, "has expired"),
    ("tenant", 403, "not an admin token"),
])
async def test_views_refuse_with_a_page_never_a_traceback(console, who, status, words):
    s = console.settings
    token = {"none": "", "garbage": "Bearer x.y.z", "expired": f"Bearer {mint_admin(s, ttl_s=-3600)}",
             "tenant": f"Bearer {mint(s, 'acme-backend', tenant='acme')}"}[who]
    r = await console.get("/console/view/tenants", headers={"authorization": token})
    assert r.status_code == status and 'data-refused="signed-out"' in r.text and words in r.text, r.text
    assert "Traceback" not in r.text and "<section" in r.text


async def test_tenants_page_by_key_and_search(console):
    for i in range(120):
        await console.service.create_tenant(f"t{i:03d}")
    await console.service.create_tenant("zeta")
    r = await console.get("/console/view/tenants")
    assert r.status_code == 200 and "121 in all" in r.text and r.headers["server-timing"].startswith("view;dur=")
    first = _rows(r.text, "data-tenant")
    assert first == [f"t{i:03d}" for i in range(50)]
    nxt = re.search(r'class="next" href="#tenants\?([^"]+)"', r.text).group(1).replace("&amp;", "&")
    assert nxt == "after=t049"
    page2 = _rows((await console.get(f"/console/view/tenants?{nxt}")).text, "data-tenant")
    assert page2 == [f"t{i:03d}" for i in range(50, 100)]
    last = (await console.get("/console/view/tenants?after=t099")).text
    assert _rows(last, "data-tenant") == [f"t{i:03d}" for i in range(100, 120)] + ["zeta"] and 'class="next"' not in last
    found = (await console.get("/console/view/tenants?q=t11")).text
    assert _rows(found, "data-tenant") == [f"t11{i}" for i in range(10)] and "10 in all" in found
    assert "No tenant matches" in (await console.get("/console/view/tenants?q=%25")).text  # LIKE wildcards are literal


async def test_a_tenant_page_shows_bindings_canary_and_the_actions(console, tmp_path):
    await _seed(console.service, tmp_path)
    html = (await console.get("/console/view/tenant?slug=acme")).text
    row = html[html.index('data-alias="chat"'):]
    assert "two@1" in row and "one@1" in row and "three@1" in row and "10.0%" in row
    for action in ("rollback", "promote", "abort", "percent"):
        assert f'data-confirm="{action}"' in row
    r = await console.get("/console/view/tenant?slug=nobody")
    assert r.status_code == 404 and "nobody" in r.text and 'data-refused="refused"' in r.text


async def test_the_confirm_step_shows_before_and_after_and_the_call(console, tmp_path):
    await _seed(console.service, tmp_path)
    r = (await console.get("/console/view/confirm?action=rollback&slug=acme&alias=chat")).text
    assert re.findall(r'data-field="(\w+)"><th>\w+</th><td class="before">([^<]+)</td><td class="after">([^<]+)<', r) == [
        ("active", "two@1", "one@1"), ("previous", "one@1", "two@1")]
    [call] = _calls(r)
    assert (call["method"], call["path"], call["body"]) == ("POST", "/admin/tenants/acme/bindings/chat/rollback", None)
    assert call["if_match"] in (2, 3)
    r = (await console.get("/console/view/confirm?action=limits&slug=acme&requests_per_min=900&tokens_per_min=100000"
                           "&max_concurrent=16&priority=high")).text
    assert "requests_per_min" in r and "priority" in r and "tokens_per_min" not in r  # unchanged fields are left out
    assert _calls(r)[0]["body"] == {"requests_per_min": 900, "priority": "high"}
    r = await console.get("/console/view/confirm?action=percent&slug=acme&alias=chat&percent=lots")
    assert r.status_code == 422 and "percent must be a number" in r.text
    await console.service.rollback("acme", "chat")
    await console.service.rollback("acme", "chat")
    r = await console.get("/console/view/confirm?action=abort&slug=acme&alias=chat")
    assert 'data-field="canary"' in r.text
    r = (await console.get("/console/view/confirm?action=disable&slug=acme")).text
    assert 'data-field="status"><th>status</th><td class="before">active</td><td class="after">disabled<' in r
    assert [(c["method"], c["path"]) for c in _calls(r)] == [("POST", "/admin/tenants/acme/disable")]
    r = await console.get("/console/view/confirm?action=explode&slug=acme&alias=chat")
    assert r.status_code == 422 and "unknown action" in r.text


async def test_the_calls_the_console_makes_are_the_admin_apis_and_audited_with_the_actor(console, tmp_path):
    await _seed(console.service, tmp_path)
    r = (await console.get("/console/view/confirm?action=percent&slug=acme&alias=chat&percent=30")).text
    [call] = _calls(r)
    path, version = call["path"], call["if_match"]
    done = await console.patch(path.removeprefix("/admin"), json={"percent": 30}, headers={"if-match": f'"{version}"'})
    assert done.status_code == 200 and done.json()["canary_percent"] == 30
    stale = await console.patch(path.removeprefix("/admin"), json={"percent": 40}, headers={"if-match": f'"{version}"'})
    assert stale.status_code == 412  # the row moved since the confirm step was shown
    audit = (await console.get("/console/view/audit?actor=ops-alice")).text
    assert _rows(audit, "data-action") == ["binding.canary_set"]
    assert _diff(audit) == [("canary_percent", "10", "30")]


async def test_pages_escape_what_they_show(console, tmp_path):
    await _seed(console.service, tmp_path)
    bad = await console.service.register_adapter("bad", str(write_adapter(tmp_path / "adapters" / "bad", TINY)),
                                                 TINY.name)
    await console.service.fail_adapter(bad.id, reason='<script>alert("x")</script>')
    html = (await console.get("/console/view/adapters")).text
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert 'data-adapter="one@1"' in html and "passed" in html and TINY.revision[:12] in html


async def test_adapters_page_by_key_and_status(console, tmp_path):
    await console.service.register_base_model(TINY)
    for i in range(60):
        await console.service.register_adapter(f"ad{i:02d}", str(write_adapter(tmp_path / "adapters" / f"a{i}", TINY,
                                                                                seed=i)),
                                               TINY.name)
    first = (await console.get("/console/view/adapters")).text
    assert len(_rows(first, "data-adapter")) == 50 and "60 in all" in first
    second = (await console.get("/console/view/adapters?after=ad49@1")).text
    assert _rows(second, "data-adapter") == [f"ad{i}@1" for i in range(50, 60)]
    assert "No adapter version matches" in (await console.get("/console/view/adapters?status=active")).text


async def test_the_fleet_and_live_views(console, tmp_path):
    ids = await _seed(console.service, tmp_path)
    console.sources.reports = [
        WorkerReport(worker_id="w2", url="http://w2", base_model="tiny", base_revision="r",
                     device_adapters=[ids["one"]], host_adapters=[ids["one"], ids["two"]], queue_depth=3, running=5,
                     free_kv_blocks=25, total_kv_blocks=100, max_num_seqs=32, max_loras=8),
        WorkerReport(worker_id="w1", url="http://w1", base_model="tiny", base_revision="r"),
    ]
    html = (await console.get("/console/view/fleet")).text
    assert _rows(html, "data-worker") == ["w1", "w2"] and "75.0%" in html and "2 workers" in html
    w2 = html[html.index('data-worker="w2"'):]
    assert re.search(r'class="device">one@1', w2) and re.search(r'class="host">two@1', w2)
    assert _rows((await console.get("/console/view/fleet?q=two@")).text, "data-worker") == ["w2"]
    console.sources.stats = {"one@1": {"requests": 30, "requests_per_s": 0.1, "error_rate": 0.1, "cold_loads": 2,
                                       "ttft_p50_s": 0.05, "ttft_p99_s": 0.5},
                             "base": {"requests": 90, "requests_per_s": 0.3, "error_rate": 0.0, "cold_loads": 0,
                                      "ttft_p50_s": None, "ttft_p99_s": None}}
    html = (await console.get("/console/view/live")).text
    assert _rows(html, "data-version") == ["base", "one@1"] and "10.0%" in html and "500 ms" in html


async def test_the_fleet_view_says_which_workers_are_ejected_until_when_and_why(console):
    from gateway.outliers import Ejection

    console.sources.reports = [WorkerReport(worker_id=w, url=f"http://{w}", base_model="tiny", base_revision="r")
                               for w in ("w1", "w2")]
    until = time.time() + 40
    console.sources.ejected = {"w2": Ejection(until=until, reason="first_byte_timeout", streak=3)}
    html = (await console.get("/console/view/fleet")).text
    w1, w2 = html[html.index('data-worker="w1"'):html.index('data-worker="w2"')], html[html.index('data-worker="w2"'):]
    assert "in rotation" in w1 and "ejected" not in w1
    assert f"<strong>ejected</strong> until {time.strftime('%H:%M:%S', time.gmtime(until))} UTC" in w2
    assert "first byte timeout, 3 in a row" in w2


def test_live_numbers_carry_a_series_per_version_for_the_charts(monkeypatch):
    import asyncio

    from gateway import live_stats

    clock = [1765000003.0]
    monkeypatch.setattr(live_stats.time, "time", lambda: clock[0])
    live = LiveStats()
    live.record("a@1", 200, 0.1, cold=False)
    live.record("a@1", 502, None, cold=False)
    clock[0] += 20  # two buckets later
    live.record("a@1", 200, 0.3, cold=False)
    live.record("a@1", 200, 0.5, cold=False)
    live.record("base", 200, None, cold=False)  # not streamed: no TTFT
    snap = asyncio.run(live.snapshot())
    assert snap["a@1"]["series"] == [[1765000000, 2, 1, 0.1], [1765000020, 2, 0, 0.5]]
    assert snap["a@1"]["streamed"] == 3 and snap["base"]["streamed"] == 0
    assert snap["base"]["series"] == [[1765000020, 1, 0, None]]
    clock[0] += live_stats.WINDOW_S  # the first bucket leaves the window
    live.record("a@1", 200, 0.2, cold=False)
    assert [b[0] for b in asyncio.run(live.snapshot())["a@1"]["series"]] == [1765000320]


def test_live_numbers_per_version_in_a_window():
    live = LiveStats()
    for i in range(10):
        live.record("a@1", 200 if i < 9 else 502, 0.01 * (i + 1), cold=i == 0)
    live.record("base", 200, None, cold=False)
    import asyncio

    snap = asyncio.run(live.snapshot())
    a = snap["a@1"]
    assert (a["requests"], a["error_rate"], a["cold_loads"]) == (10, 0.1, 1)
    assert a["ttft_p50_s"] == 0.06 and a["ttft_p99_s"] == 0.1
    assert snap["base"]["ttft_p50_s"] is None


async def test_live_numbers_are_merged_across_replicas_through_redis(redis_url, redis_prefix):
    import redis.asyncio as aioredis

    r1, r2 = aioredis.Redis.from_url(redis_url), aioredis.Redis.from_url(redis_url)
    try:
        one, two = LiveStats(r1, redis_prefix), LiveStats(r2, redis_prefix)
        one.record("a@1", 200, 0.2, cold=True)
        two.record("a@1", 500, None, cold=False)
        two.record("b@2", 200, 0.1, cold=False)
        await one.publish()
        seen = await two.snapshot()  # its own plus what one published
        assert seen["a@1"]["requests"] == 2 and seen["a@1"]["error_rate"] == 0.5 and seen["a@1"]["cold_loads"] == 1
        assert seen["b@2"]["requests"] == 1
        other = LiveStats(aioredis.Redis.from_url(redis_url), f"{redis_prefix}-{uuid.uuid4().hex[:6]}")
        assert await other.snapshot() == {}  # another deployment's prefix sees nothing
    finally:
        await r1.aclose()
        await r2.aclose()


def _text(html: str) -> str:
    """What a person sees: the page without its tags and attributes."""
    return unescape(re.sub(r"<[^>]+>", " ", html))


async def _call(console, call: dict[str, Any]) -> httpx.Response:
    """Make one of the confirm step's calls as console.js does."""
    headers = {} if call["if_match"] is None else {"if-match": f'"{call["if_match"]}"'}
    return await console.request(call["method"], call["path"].removeprefix("/admin"), headers=headers,
                                 json=call["body"])


async def test_bind_a_new_alias_and_rebind_one_through_the_confirm_step(console, tmp_path):
    ids = await _seed(console.service, tmp_path)
    page = (await console.get("/console/view/tenant?slug=acme")).text
    assert 'data-confirm="bind"' in page and "<option>one@1</option>" in page  # the versions it may bind
    r = (await console.get("/console/view/confirm?action=bind&slug=acme&alias=helpdesk&adapter=one@1")).text
    assert "new alias" in r and re.findall(r'data-field="(\w+)"><th>\w+</th><td class="before">([^<]+)</td>'
                                           r'<td class="after">([^<]+)<', r) == [("active", "—", "one@1")]
    [call] = _calls(r)
    assert (call["method"], call["path"], call["body"], call["if_match"]) == (
        "PUT", "/admin/tenants/acme/bindings/helpdesk", {"adapter": "one@1"}, None)
    assert (await _call(console, call)).status_code == 200
    r = (await console.get("/console/view/confirm?action=bind&slug=acme&alias=chat&adapter=one@1")).text
    assert re.findall(r'data-field="(\w+)"><th>\w+</th><td class="before">([^<]+)</td><td class="after">([^<]+)<',
                      r) == [("active", "two@1", "one@1"), ("previous", "one@1", "two@1")]
    [call] = _calls(r)
    assert isinstance(call["if_match"], int) and (await _call(console, call)).status_code == 200
    audit = (await console.get("/console/view/audit?actor=ops-alice")).text
    assert _rows(audit, "data-action") == ["binding.bind", "binding.create"]
    assert ("active", "two@1", "one@1") in _diff(audit)
    assert not any(i in _text(audit) for i in ids.values())  # versions by name@version, never ids
    pending = await console.service.register_adapter("four", str(write_adapter(tmp_path / "adapters" / "four", TINY,
                                                                                seed=9)), TINY.name, owner="acme")
    r = await console.get(f"/console/view/confirm?action=bind&slug=acme&alias=chat&adapter={pending.label}")
    assert r.status_code == 409 and "activate it first" in r.text


async def test_activate_an_uploaded_version_and_see_the_gates_evidence(console, tmp_path):
    await _seed(console.service, tmp_path)
    a = await console.service.register_adapter("four", str(write_adapter(tmp_path / "adapters" / "four", TINY,
                                                                          seed=9)), TINY.name, owner="acme")
    listing = (await console.get("/console/view/adapters?q=four")).text
    assert 'data-confirm="activate" data-ref="four@1"' in listing
    r = (await console.get("/console/view/confirm?action=activate&ref=four@1")).text
    assert 'data-field="status"><th>status</th><td class="before">pending</td>' in r and "activation gate" in r
    [call] = _calls(r)
    assert (call["method"], call["path"]) == ("POST", "/admin/adapters/four%401/activate")
    assert (await _call(console, call)).json()["status"] == "active"  # no gate in this app: recorded as given
    audit = (await console.get("/console/view/audit?action=adapter.activate")).text
    assert "adapter:four@1" in _text(audit) and a.id not in _text(audit)
    assert ("status", "pending", "active") in _diff(audit)
    # A version the gate refused: its page shows the verdict, the reason and the probes.
    bad = await console.service.register_adapter("five", str(write_adapter(tmp_path / "adapters" / "five", TINY,
                                                                            seed=7)), TINY.name)
    evidence = {"worker": "w1", "passed": False, "reason": "degenerate output: the adapter answered nothing",
                "probes_differing": 2, "probes": [{"prompt": "Hi?", "base": "Hello.", "adapter": ""}]}
    await console.service.fail_adapter(bad.id, reason=evidence["reason"], verification=evidence)
    page = (await console.get("/console/view/adapter?ref=five@1")).text
    assert "refused" in page and "answered nothing" in page and "(empty)" in page and "Hello." in page
    assert 'data-confirm="activate"' in page  # activating again re-runs the gate
    r = (await console.get("/console/view/confirm?action=activate&ref=five@1")).text
    assert "answered nothing" in r  # the last evidence, before the gate runs again


async def test_start_a_canary_with_a_policy_through_the_confirm_step(console, tmp_path):
    ids = await _seed(console.service, tmp_path)
    await console.service.bind("acme", "solo", ids["one"])
    page = (await console.get("/console/view/tenant?slug=acme")).text
    assert 'data-confirm="canary"' in page
    q = "action=canary&slug=acme&alias=solo&adapter=two@1&steps=10,50&interval_s=30&min_requests=20&max_failures=3"
    r = (await console.get(f"/console/view/confirm?{q}")).text
    rows = re.findall(r'data-field="([\w ]+)"><th>[\w ]+</th><td class="before">([^<]+)</td><td class="after">([^<]+)<',
                      r)
    assert rows[:2] == [("canary", "—", "two@1"), ("canary_percent", "0.0", "10.0")]
    assert ("policy steps", "—", "10, 50") in rows and ("policy min_requests", "—", "20") in rows
    for bad, words in (("steps=50,10", "steps must increase"), ("min_requests=lots", "min_requests must be"),
                       ("alias=chat&adapter=one@1", "already has a canary")):
        refused = await console.get(f"/console/view/confirm?action=canary&slug=acme&alias=solo&adapter=two@1&{bad}")
        assert refused.status_code in (409, 422) and words in refused.text, refused.text
    policy, start = _calls(r)
    assert (policy["method"], policy["path"]) == ("PUT", "/admin/tenants/acme/bindings/solo/canary/policy")
    assert policy["body"] == {"steps": [10.0, 50.0], "interval_s": 30.0, "min_requests": 20, "max_failures": 3}
    assert (start["method"], start["path"], start["body"]) == (
        "POST", "/admin/tenants/acme/bindings/solo/canary", {"adapter": "two@1", "percent": 10.0})
    for call in (policy, start):
        assert (await _call(console, call)).status_code == 200
    audit = (await console.get("/console/view/audit?actor=ops-alice")).text
    assert _rows(audit, "data-action") == ["binding.canary_start", "canary.policy_set"]
    page = (await console.get("/console/view/tenant?slug=acme")).text
    assert "two@1 at" in page[page.index('data-alias="solo"'):]


async def test_roll_back_says_why_when_there_is_nothing_to_roll_back_to(console, tmp_path):
    ids = await _seed(console.service, tmp_path)
    await console.service.bind("acme", "solo", ids["one"])
    page = (await console.get("/console/view/tenant?slug=acme")).text
    solo = page[page.index('data-alias="solo"'):]
    solo = solo[:solo.index("</tr>")]
    assert 'data-confirm="rollback"' not in solo and "<button type=\"button\" disabled" in solo
    assert "Nothing to roll back to" in solo and "one@1" in solo
    chat = page[page.index('data-alias="chat"'):]
    assert 'data-confirm="rollback"' in chat[:chat.index("</tr>")]


def _judgement(decision: str) -> dict[str, Any]:
    """A judgement as the canary judge records it (``gateway.canary_decide``)."""
    return {"decision": decision, "reason": "empty_share failed 2 times: canary 10 of 40 answers empty vs active 0 of 360",
            "step": 0, "percent": 10.0, "window_s": 31.2, "canary_requests": 40, "active_requests": 360,
            "failures": 2, "max_failures": 2, "failed": ["empty_share"], "no_data": ["tokens_per_s"],
            "checks": [
                {"check": "error_rate", "segment": None, "verdict": "pass", "failed": False, "canary": 0.0,
                 "active": 0.0, "canary_n": 40, "active_n": 360, "ratio": 1.0, "threshold": 2.0, "p": 1.0,
                 "reason": "canary 0 of 40 requests vs active 0 of 360"},
                {"check": "empty_share", "segment": "topic=refund", "verdict": "fail", "failed": True, "canary": 0.25,
                 "active": 0.0, "canary_n": 40, "active_n": 360, "canary_events": 10, "active_events": 0,
                 "ratio": "inf", "threshold": 2.0, "test": "fisher-exact", "p": 1e-9,
                 "reason": "canary 10 of 40 answers empty vs active 0 of 360"},
                {"check": "tokens_per_s", "verdict": "no data", "failed": False, "canary": None, "active": None,
                 "reason": "no streamed answers"}]}


async def test_an_aborted_canary_shows_its_failed_checks(console, tmp_path):
    from registry.canary import CanaryPolicies

    await _seed(console.service, tmp_path)
    policies = CanaryPolicies(console.service)
    p = await policies.set_policy("acme", "chat", {"steps": [10, 50]})
    [policy_id] = [d.id for d, _ in await policies.judged() if d.alias == "chat"]
    judgement = _judgement("abort")  # what the judge writes when it aborts (its state, then the registry)
    assert await policies.save_state(policy_id, p.row_version, status="aborted", last=judgement | {"at": 1765e6})
    await console.service.canary_abort("acme", "chat", actor="canary-judge", judgement=judgement)
    page = (await console.get("/console/view/tenant?slug=acme")).text
    cell = page[page.index('data-alias="chat"'):]
    cell = cell[cell.index('class="policy"'):cell.index('class="actions"')]
    assert "aborted" in cell and "<details class=\"judgement\" open>" in cell
    assert 'class="failed-checks">empty_share [topic=refund]<' in cell and "10 of 40 answers empty" in cell
    assert re.search(r'data-check="empty_share \[topic=refund\]" class="failed"><td>[^<]+</td><td class="verdict">fail<',
                     cell)
    assert re.search(r'data-check="tokens_per_s" class=""><td>[^<]+</td><td class="verdict">no data<', cell)
    audit = (await console.get("/console/view/audit?action=binding.canary_abort")).text
    assert "judgement: " in audit and "abort" in audit and 'data-check="empty_share [topic=refund]" class="failed"' in audit
    assert ("canary", "three@1", "—") in _diff(audit)
    assert "{" not in _text(audit[audit.index("<tbody>"):])  # no raw JSON in the change cell


async def test_the_audit_change_cell_is_a_readable_diff(console, tmp_path):
    await _seed(console.service, tmp_path)
    await console.service.set_tenant_limits("acme", requests_per_min=777, priority="high", actor="ops-bob")
    long_reason = "x" * 400
    bad = await console.service.register_adapter("six", str(write_adapter(tmp_path / "adapters" / "six", TINY,
                                                                           seed=5)), TINY.name)
    await console.service.fail_adapter(bad.id, reason=long_reason, verification={"passed": False, "worker": "w9"},
                                       actor="ops-bob")
    audit = (await console.get("/console/view/audit?actor=ops-bob")).text
    diff = _diff(audit)
    limits = await console.service.get_tenant("acme")
    assert [(f, a) for f, b, a in diff if f == "requests_per_min" and b.isdigit()] == [
        ("requests_per_min", str(limits.requests_per_min))]
    assert ("priority", "normal", "high") in diff
    assert ("verification.worker", "—", "w9") in diff and ("status", "pending", "failed") in diff
    shown = next(a for f, _, a in diff if f == "status_reason")
    assert len(shown) <= 160 and shown.endswith("…") and f'title="{long_reason}"' in audit  # cut, whole on hover
    assert "adapter:six@1" in _text(audit) and bad.id not in _text(audit)


async def test_the_live_page_draws_charts_and_says_why_ttft_is_blank(console, tmp_path):
    await _seed(console.service, tmp_path)
    console.sources.stats = {
        "one@1": {"requests": 30, "requests_per_s": 0.1, "error_rate": 0.1, "cold_loads": 2, "ttft_p50_s": 0.05,
                  "ttft_p99_s": 0.5, "series": [[1765000000, 20, 2, 0.05], [1765000010, 10, 1, 0.06]]},
        "base": {"requests": 90, "requests_per_s": 0.3, "error_rate": 0.0, "cold_loads": 0, "ttft_p50_s": None,
                 "ttft_p99_s": None, "series": [[1765000000, 90, 0, None]]}}
    html = (await console.get("/console/view/live")).text
    charts = json.loads(unescape(re.search(r'data-charts="([^"]*)"', html).group(1)))
    assert set(charts) == {"one@1", "base"} and charts["one@1"][1] == [1765000010, 10, 1, 0.06]
    assert [c for c in re.findall(r'data-chart="(\w+)"', html)] == ["requests", "errors", "ttft"]
    base = html[html.index('data-version="base"'):]
    assert "no streamed requests" in base[:base.index("</tr>")]
    assert "measured on streamed requests only" in html


async def test_the_judges_own_record_is_shown_check_by_check(console, tmp_path):
    """The judgement as ``gateway.canary_stats.judge`` makes it today, not a copy of its format."""
    from gateway.canary_stats import Arm, judge
    from registry.canary import DEFAULTS

    await _seed(console.service, tmp_path)
    canary, active = Arm(), Arm()
    for i in range(40):
        canary.add(True, 0.05, 0.0, 0 if i % 4 == 0 else 20, i % 4 == 0, False)
    for _ in range(360):
        active.add(True, 0.05, 0.0, 20, False, False)
    rows = judge(DEFAULTS, canary, active)
    assert any(r["failed"] for r in rows)
    await console.service.canary_abort("acme", "chat", actor="canary-judge",
                                       judgement={"decision": "abort", "reason": "empty answers", "checks": rows})
    audit = (await console.get("/console/view/audit?action=binding.canary_abort")).text
    for r in rows:
        shown = re.search(rf'data-check="{r["check"]}" class="(\w*)"><td>[^<]+</td><td class="verdict">([^<]+)<', audit)
        assert shown and shown.group(1) == ("failed" if r["failed"] else "") and shown.group(2) == (
            r.get("verdict") or ("failed" if r["failed"] else "ok")), r


def _words(html: str) -> str:
    """What a person reads, one space between words."""
    return " ".join(_text(html).split())


async def test_the_prefix_cache_scope_is_shown_and_set_through_the_confirm_step(console, tmp_path):
    await _seed(console.service, tmp_path)
    await console.service.create_tenant("acme-us", cache_scope="acme")
    listing = (await console.get("/console/view/tenants")).text
    scopes = dict(re.findall(r'data-tenant="([^"]+)">.*?<td class="scope">([^<]*)</td>', listing, re.S))
    assert scopes == {"acme": "own", "acme-us": "acme"}
    page = (await console.get("/console/view/tenant?slug=acme")).text
    assert 'data-confirm="cache_scope"' in page and "Its own:" in _words(page)
    assert "Shared scope acme " in _words((await console.get("/console/view/tenant?slug=acme-us")).text)

    r = (await console.get("/console/view/confirm?action=cache_scope&slug=acme&cache_scope=acme")).text
    assert re.findall(r'data-field="(\w+)"><th>\w+</th><td class="before">([^<]+)</td><td class="after">([^<]+)<',
                      r) == [("cache_scope", "its own", "shared: acme")]
    assert "tell from response times" in _words(r)
    [call] = _calls(r)
    assert (call["method"], call["path"], call["body"]) == ("PUT", "/admin/tenants/acme/cache-scope",
                                                             {"cache_scope": "acme"})
    assert (await _call(console, call)).status_code == 200
    assert "Shared scope acme " in _words((await console.get("/console/view/tenant?slug=acme")).text)
    r = (await console.get("/console/view/confirm?action=cache_scope&slug=acme&cache_scope=acme")).text
    assert "Nothing would change" in r
    r = await console.get("/console/view/confirm?action=cache_scope&slug=acme&cache_scope=Not%20A%20Scope")
    assert r.status_code == 422 and "cache_scope must be" in _words(r.text)
    r = (await console.get("/console/view/confirm?action=cache_scope&slug=acme")).text  # an emptied field
    [call] = _calls(r)
    assert call["body"] == {"cache_scope": ""} and ("cache_scope", "shared: acme", "its own") in re.findall(
        r'data-field="(\w+)"><th>\w+</th><td class="before">([^<]+)</td><td class="after">([^<]+)<', r)
    assert (await _call(console, call)).status_code == 200
    audit = (await console.get("/console/view/audit?actor=ops-alice")).text
    assert _rows(audit, "data-action") == ["tenant.cache_scope", "tenant.cache_scope"]
    assert ("cache_scope", "acme", "") in _diff(audit)
