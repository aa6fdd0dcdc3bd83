"""The console's server side, without a browser: auth and refusals, headers, keyset pages,
the confirm step's before/after, escaping, the fleet and live views, live numbers across
replicas (real Redis). The browser flows are ``tests/test_console_browser.py``."""

from __future__ import annotations

import re
import uuid
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

    async def workers(self) -> list[WorkerReport]:
        return self.reports

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
        ids[name] = (await svc.activate_adapter(a["id"], verification={"passed": True, "reason": "probes differ"}))["id"]
    await svc.bind("acme", "chat", ids["one"])
    await svc.bind("acme", "chat", ids["two"])  # previous: one
    await svc.canary_start("acme", "chat", ids["three"], 10)
    return ids


def _rows(html: str, attr: str) -> list[str]:
    return re.findall(rf'{attr}="([^"]+)"', html)


async def test_the_shell_is_self_contained_and_locked_down(console):
    r = await console.get("/console", headers={"authorization": ""})
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp and r.headers["x-frame-options"] == "DENY"
    assert not re.search(r'(src|href)="(https?:)?//', r.text)  # nothing from elsewhere
    for name in ("console.js", "console.css"):
        s = await console.get(f"/console/static/{name}", headers={"authorization": ""})
        assert s.status_code == 200 and len(s.text) > 500
    assert "http://" not in (await console.get("/console/static/console.js")).text
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
    assert 'data-method="POST" data-path="/admin/tenants/acme/bindings/chat/rollback"' in r
    assert 'data-if-match="2"' in r or 'data-if-match="3"' in r
    r = (await console.get("/console/view/confirm?action=limits&slug=acme&requests_per_min=900&tokens_per_min=100000"
                           "&max_concurrent=16&priority=high")).text
    assert "requests_per_min" in r and "priority" in r and "tokens_per_min" not in r  # unchanged fields are left out
    assert 'data-body="{&#34;requests_per_min&#34;:900,&#34;priority&#34;:&#34;high&#34;}"' in r
    r = await console.get("/console/view/confirm?action=percent&slug=acme&alias=chat&percent=lots")
    assert r.status_code == 422 and "percent must be a number" in r.text
    await console.service.rollback("acme", "chat")
    await console.service.rollback("acme", "chat")
    r = await console.get("/console/view/confirm?action=abort&slug=acme&alias=chat")
    assert 'data-field="canary"' in r.text
    r = (await console.get("/console/view/confirm?action=disable&slug=acme")).text
    assert 'data-field="status"><th>status</th><td class="before">active</td><td class="after">disabled<' in r
    assert 'data-method="POST" data-path="/admin/tenants/acme/disable"' in r
    r = await console.get("/console/view/confirm?action=explode&slug=acme&alias=chat")
    assert r.status_code == 422 and "unknown action" in r.text


async def test_the_calls_the_console_makes_are_the_admin_apis_and_audited_with_the_actor(console, tmp_path):
    await _seed(console.service, tmp_path)
    r = (await console.get("/console/view/confirm?action=percent&slug=acme&alias=chat&percent=30")).text
    path = re.search(r'data-path="([^"]+)"', r).group(1)
    version = re.search(r'data-if-match="(\d+)"', r).group(1)
    done = await console.patch(path.removeprefix("/admin"), json={"percent": 30}, headers={"if-match": f'"{version}"'})
    assert done.status_code == 200 and done.json()["canary_percent"] == 30
    stale = await console.patch(path.removeprefix("/admin"), json={"percent": 40}, headers={"if-match": f'"{version}"'})
    assert stale.status_code == 412  # the row moved since the confirm step was shown
    audit = (await console.get("/console/view/audit?actor=ops-alice")).text
    assert _rows(audit, "data-action") == ["binding.canary_set"]
    assert "canary_percent</b> 10.0 &rarr; 30" in audit


async def test_pages_escape_what_they_show(console, tmp_path):
    await _seed(console.service, tmp_path)
    bad = await console.service.register_adapter("bad", str(write_adapter(tmp_path / "adapters" / "bad", TINY)),
                                                 TINY.name)
    await console.service.fail_adapter(bad["id"], reason='<script>alert("x")</script>')
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
