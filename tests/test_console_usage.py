"""The console's usage pages without a browser, on PostgreSQL and SQLite: the fleet's charts and top
tenants, a tenant's charts, its aliases and versions and outcomes (its own rows only), the links
to them, and the charts' bars saying the ledger's numbers."""

from __future__ import annotations

import re
import time
from html import unescape

import httpx
import pytest
from sqlalchemy import insert
from starlette.applications import Starlette
from starlette.routing import Mount

from loraplex.tokens import mint, mint_admin
from registry.admin_api import admin_app
from registry.console.usage_view import compact
from registry.db import make_engine, session_factory
from registry.models import UsageBucket
from registry.service import RegistryService
from tests.registry_support import fresh_registry, make_settings

NOW_HOUR = int(time.time()) // 3600 * 3600
ROWS = [  # (hours ago, tenant, alias, version, outcome, requests, prompt, cached, completion)
    (1, "acme", "support", "v-1", "ok", 3, 300, 100, 60),
    (1, "acme", "support", "v-1", "429:tokens", 2, 0, 0, 0),
    (2, "acme", "tiny", "", "ok", 1, 50, 0, 7),
    (2, "acme", "support", "v-2", "cancelled", 1, 40, 0, 3),
    (1, "globex", "secret-alias", "g-1", "ok", 7, 7000, 700, 70),
    (3, "globex", "secret-alias", "g-9", "5xx:no_worker", 1, 10, 0, 0),
    (30, "initech", "support", "i-1", "4xx:invalid_value", 4, 0, 0, 0),
]


@pytest.fixture
async def console(db_url, tmp_path):
    await fresh_registry(db_url)
    settings = make_settings(tmp_path, db_url)
    service = RegistryService(settings)
    for slug in ("acme", "globex", "initech"):
        await service.create_tenant(slug)
    engine = make_engine(db_url)
    async with session_factory(engine).begin() as s:
        await s.execute(insert(UsageBucket), [
            {"width": "m", "start": NOW_HOUR - 3600 * h + 60, "tenant": t, "alias": a, "version": v, "outcome": o,
             "requests": r, "prompt_tokens": p, "cached_tokens": c, "completion_tokens": x, "peak_concurrent": 1}
            for h, t, a, v, o, r, p, c, x in ROWS])
    await engine.dispose()
    app = Starlette(routes=[Mount("/admin", app=admin_app(service, settings))])
    headers = {"authorization": f"Bearer {mint_admin(settings, subject='ops')}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t/admin",
                                 headers=headers) as client:
        client.settings = settings  # type: ignore[attr-defined]
        yield client
    await service.close()


def _titles(html: str) -> list[str]:
    return [unescape(t) for t in re.findall(r"<rect [^>]*><title>([^<]*)</title></rect>", html)]


async def test_the_fleet_page_charts_tokens_and_requests_and_ranks_tenants(console):
    r = await console.get("/console/view/usage", params={"window": "24h"})
    assert r.status_code == 200 and "content-security-policy" in r.headers
    html = r.text
    assert 'data-window="24h"' in html and html.count("<svg viewBox") == 2
    assert re.findall(r'<tr data-tenant="([^"]+)">', html) == ["globex", "acme"]  # initech is 30 h ago
    assert 'href="#tenant_usage?slug=acme&amp;window=24h"' in html
    titles = _titles(html)
    # the hour 1 h ago: acme's and globex's input less cached, cached, output; ok 10 and 429 2 requests
    assert any(t.endswith("input (not cached) 6,500") for t in titles)
    assert any(t.endswith("input, cached 800") for t in titles)
    assert any(t.endswith("ok 10") for t in titles) and any(t.endswith("429 rate limited 2") for t in titles)
    assert any(t.endswith("5xx failed 1") for t in titles)
    assert "requests <b>15</b>" in html and "input tokens <b>7,400</b>" in html
    assert " style=" not in html and "<script" not in html
    week = (await console.get("/console/view/usage", params={"window": "7d"})).text
    assert re.findall(r'<tr data-tenant="([^"]+)">', week) == ["globex", "acme", "initech"]
    assert any(t.endswith("4xx refused 4") for t in _titles(week))
    assert 'data-window="7d"' in (await console.get("/console/view/usage", params={"window": "1y"})).text


async def test_a_tenants_page_shows_its_own_usage_by_alias_version_and_outcome(console):
    html = (await console.get("/console/view/tenant_usage", params={"slug": "acme", "window": "24h"})).text
    assert re.findall(r'<tr data-alias="([^"]+)" data-version="([^"]*)">', html) == [
        ("support", "v-1"), ("tiny", ""), ("support", "v-2")]  # by tokens, the base model as "base model"
    assert "<em>base model</em>" in html
    assert re.findall(r'<tr data-outcome="([^"]+)">', html) == ["ok", "429:tokens", "cancelled"]
    assert "secret-alias" not in html and "globex" not in html and "g-1" not in html
    assert "requests <b>7</b>" in html and html.count("<svg viewBox") == 2
    empty = (await console.get("/console/view/tenant_usage", params={"slug": "initech", "window": "24h"})).text
    assert "no usage in this window" in empty and "No usage recorded in this window." in empty
    missing = await console.get("/console/view/tenant_usage", params={"slug": "ghost"})
    assert missing.status_code == 404


async def test_usage_is_linked_from_the_navigation_and_the_tenant_page(console):
    assert '<a href="#usage">Usage</a>' in (await console.get("/console")).text
    tenant = (await console.get("/console/view/tenant", params={"slug": "acme"})).text
    assert 'href="#tenant_usage?slug=acme"' in tenant


async def test_the_usage_pages_need_an_admin_token(console):
    tenant = {"authorization": f"Bearer {mint(console.settings, 'u', tenant='acme')}"}
    for view in ("usage", "tenant_usage?slug=acme"):
        assert (await console.get(f"/console/view/{view}", headers=tenant)).status_code == 403
        assert (await console.get(f"/console/view/{view}", headers={"authorization": ""})).status_code == 401


def test_axis_labels_are_compact():
    assert [compact(n) for n in (0, 999, 1000, 1234567, 3.2e9)] == ["0", "999", "1k", "1.23M", "3.2G"]


def test_a_weeks_tables_read_days_over_the_charts_window():
    from registry.console.usage_view import _query

    now = 1_796_640_000 + 34  # 2026-12-07 10:40:34 UTC
    chart, table = _query("7d", now), _query("7d", now, table=True)
    assert (chart.bucket_width, table.bucket_width) == ("1h", "1d")
    assert (chart.start_time, chart.end_time) == (table.start_time, table.end_time) == (1_796_083_200, 1_796_688_000)
    assert chart.limit == 168 and table.limit == 7
    day = _query("24h", now, table=True)
    assert (day.bucket_width, day.end_time - day.start_time, day.end_time) == ("1h", 86400, 1_796_641_200)
