"""The usage ledger over HTTP, on PostgreSQL and SQLite: ``GET /admin/usage`` (admin scope, the
OpenAPI document, a 400 naming each bad parameter, the row cap) and ``GET /v1/usage`` on the
gateway with a tenant's own token, which reaches that tenant's rows only through any parameter
(filters, grouping, page tokens), and answers 503 with ``retry-after`` when the database is down."""

from __future__ import annotations

import time
from typing import Any

import httpx
import hypothesis
import pytest
from hypothesis import strategies as st
from sqlalchemy import insert

from gateway.app import create_app
from gateway.ratelimit import LocalLimiter
from loraplex.residency import MemoryResidency
from loraplex.tokens import mint, mint_admin
from registry.admin_api import admin_app, openapi_document
from registry.db import make_engine, session_factory
from registry.models import UsageBucket
from registry.service import RegistryService
from tests.registry_support import fresh_registry, make_settings
from tests.stub_worker import MutableSnapshots, make_snapshot
from tests.test_admin_api import mounted

HOUR = 1_765_000_000 - 1_765_000_000 % 3600
ROWS = [  # (minute, tenant, alias, version, outcome, requests, prompt, cached, completion)
    (0, "acme", "support", "v-1", "ok", 3, 300, 100, 60),
    (0, "acme", "support", "v-1", "429:tokens", 2, 0, 0, 0),
    (1, "acme", "tiny", "", "ok", 1, 50, 0, 7),
    (1, "acme", "support", "v-2", "cancelled", 1, 40, 0, 3),
    (0, "globex", "support", "g-1", "ok", 7, 7000, 700, 70),
    (2, "globex", "secret-alias", "g-9", "5xx:no_worker", 1, 10, 0, 0),
    (61, "globex", "support", "g-1", "ok", 5, 500, 0, 50),
]
TENANTS = {"acme": {"bindings": {"support": {"active": ("sup", 1)}}},
           "globex": {"bindings": {"support": {"active": ("gsup", 1)}}}}


async def _ledger(url: str) -> None:
    engine = make_engine(url)
    async with session_factory(engine).begin() as s:
        await s.execute(insert(UsageBucket), [
            {"width": "m", "start": HOUR + 60 * m, "tenant": t, "alias": a, "version": v, "outcome": o,
             "requests": r, "prompt_tokens": p, "cached_tokens": c, "completion_tokens": x, "peak_concurrent": 1}
            for m, t, a, v, o, r, p, c, x in ROWS])
    await engine.dispose()


def _sum(tenant: str | None = None, **where: Any) -> dict[str, Any]:
    out = {"num_model_requests": 0, "input_tokens": 0, "input_cached_tokens": 0, "output_tokens": 0, "outcomes": {}}
    for _m, t, a, v, o, r, p, c, x in ROWS:
        if (tenant and t != tenant) or any({"alias": a, "version": v}[k] != w for k, w in where.items()):
            continue
        out["num_model_requests"] += r
        out["input_tokens"] += p
        out["input_cached_tokens"] += c
        out["output_tokens"] += x
        out["outcomes"][o] = out["outcomes"].get(o, 0) + r
    return out


def _totals(page: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "object"} for b in page["data"] for r in b["results"]]


def _err(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


WINDOW = {"start_time": HOUR, "end_time": HOUR + 7200, "bucket_width": "1h"}


# --- GET /admin/usage --------------------------------------------------------------------------------

@pytest.fixture
async def admin(db_url, tmp_path):
    await fresh_registry(db_url)
    await _ledger(db_url)
    settings = make_settings(tmp_path, db_url)
    service = RegistryService(settings)
    app = mounted(admin_app(service, settings))
    headers = {"authorization": f"Bearer {mint_admin(settings, subject='ops')}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t/admin",
                                 headers=headers) as client:
        client.settings = settings  # type: ignore[attr-defined]
        client.service = service  # type: ignore[attr-defined]
        yield client
    await service.close()


async def test_admin_usage_needs_the_admin_scope(admin):
    _err(await admin.get("/usage", params=WINDOW, headers={"authorization": ""}), 401, "missing_token")
    tenant = {"authorization": f"Bearer {mint(admin.settings, 'u', tenant='acme')}"}
    _err(await admin.get("/usage", params=WINDOW, headers=tenant), 403, "insufficient_scope")
    r = await admin.get("/usage", params=WINDOW)
    assert r.status_code == 200 and r.json()["object"] == "page"


async def test_admin_usage_sums_groups_and_filters(admin):
    page = (await admin.get("/usage", params=WINDOW)).json()
    assert [b["start_time"] for b in page["data"]] == [HOUR, HOUR + 3600]
    assert page["has_more"] is False and page["next_page"] is None
    first = [r for r in page["data"][0]["results"]]
    assert len(first) == 1 and first[0]["object"] == "organization.usage.completions.result"
    assert _totals(page)[0] == {"num_model_requests": 15, "input_tokens": 7400, "input_cached_tokens": 800,
                                "output_tokens": 140,
                                "outcomes": {"ok": 11, "429:tokens": 2, "cancelled": 1, "5xx:no_worker": 1}}
    grouped = (await admin.get("/usage", params={**WINDOW, "bucket_width": "1d", "group_by": "tenant"})).json()
    assert [r["tenant"] for r in grouped["data"][0]["results"]] == ["acme", "globex"]
    assert _totals(grouped) == [_sum("acme") | {"tenant": "acme"}, _sum("globex") | {"tenant": "globex"}]
    many = await admin.get(f"/usage?start_time={HOUR}&bucket_width=1d&group_by=tenant&group_by=alias&tenants=acme"
                           "&aliases[]=support&aliases[]=tiny")
    got = _totals(many.json())
    assert got == [_sum("acme", alias="support") | {"tenant": "acme", "alias": "support"},
                   _sum("acme", alias="tiny") | {"tenant": "acme", "alias": "tiny"}]
    by_version = (await admin.get("/usage", params={**WINDOW, "versions": "g-1,v-2", "group_by": "version,outcome",
                                                    "bucket_width": "1d"})).json()
    assert {(r["version"], r["outcome"]) for r in by_version["data"][0]["results"]} == {("g-1", "ok"),
                                                                                        ("v-2", "cancelled")}


async def test_admin_usage_pages(admin):
    params = {"start_time": HOUR, "end_time": HOUR + 7200, "bucket_width": "1m", "limit": 50}
    seen, token, pages = [], None, 0
    while True:
        r = await admin.get("/usage", params=params | ({"page": token} if token else {}))
        page = r.json()
        pages += 1
        seen += [b["start_time"] for b in page["data"]]
        if not page["has_more"]:
            break
        token = page["next_page"]
    assert pages == 3 and seen == list(range(HOUR, HOUR + 7200, 60))


@pytest.mark.parametrize("params,param", [
    ({"end_time": HOUR}, "start_time"),
    ({"start_time": "monday"}, "start_time"),
    ({"start_time": HOUR, "end_time": HOUR - 60}, "end_time"),
    ({"start_time": HOUR, "bucket_width": "2h"}, "bucket_width"),
    ({"start_time": HOUR, "group_by": "project_id"}, "group_by"),
    ({"start_time": HOUR, "limit": 32}, "limit"),
    ({"start_time": HOUR, "page": "not-a-token"}, "page"),
    ({"start_time": HOUR, "models": "x"}, "models"),
    ({"start_time": HOUR, "tenants": "ac\x00me"}, "tenants"),
])
async def test_admin_usage_refuses_a_bad_parameter_with_a_400_naming_it(admin, params, param):
    _err(await admin.get("/usage", params=params), 400, param=param)


async def test_admin_usage_refuses_a_page_over_the_row_cap(db_url, tmp_path):
    await fresh_registry(db_url)
    await _ledger(db_url)
    settings = make_settings(tmp_path, db_url, usage_query_max_rows=2)
    service = RegistryService(settings)
    app = mounted(admin_app(service, settings))
    headers = {"authorization": f"Bearer {mint_admin(settings)}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t/admin",
                                 headers=headers) as c:
        err = _err(await c.get("/usage", params={**WINDOW, "group_by": "tenant,alias"}), 400, "too_many_rows")
        assert "narrow" in err["message"] and "2" in err["message"]
        assert (await c.get("/usage", params={**WINDOW, "group_by": "tenant", "bucket_width": "1d"})).status_code == 200
    await service.close()


def test_the_openapi_document_describes_the_usage_query():
    op = openapi_document()["paths"]["/usage"]["get"]
    names = {p["name"] for p in op["parameters"]}
    assert names == {"start_time", "end_time", "bucket_width", "group_by", "tenants", "aliases", "versions",
                     "limit", "page"}
    assert op["responses"]["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/UsagePage"}


# --- GET /v1/usage -----------------------------------------------------------------------------------

@pytest.fixture
async def gateway(db_url, tmp_path):
    await fresh_registry(db_url)
    await _ledger(db_url)
    settings = make_settings(tmp_path, db_url, canary_judge_interval_s=0.0)
    app = create_app(settings, snapshots=MutableSnapshots(make_snapshot(TENANTS)), limiter=LocalLimiter(),
                     residency=MemoryResidency(), mount_admin=False)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        c.settings = settings  # type: ignore[attr-defined]
        yield c


def _as(settings: Any, tenant: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {mint(settings, 'u', tenant=tenant)}"}


async def test_a_tenant_reads_its_own_usage(gateway):
    acme = _as(gateway.settings, "acme")
    page = (await gateway.get("/v1/usage", params={**WINDOW, "bucket_width": "1d"}, headers=acme)).json()
    assert _totals(page) == [_sum("acme")]
    grouped = (await gateway.get("/v1/usage", params={**WINDOW, "group_by": "tenant,alias"}, headers=acme)).json()
    assert _totals(grouped) == [_sum("acme", alias="support") | {"tenant": "acme", "alias": "support"},
                                _sum("acme", alias="tiny") | {"tenant": "acme", "alias": "tiny"}]
    own = await gateway.get("/v1/usage", params={**WINDOW, "tenants": "acme", "bucket_width": "1d"}, headers=acme)
    assert _totals(own.json()) == [_sum("acme")]


async def test_another_tenants_usage_is_unreachable_through_any_parameter(gateway):
    acme, globex = _as(gateway.settings, "acme"), _as(gateway.settings, "globex")
    named = [await gateway.get("/v1/usage", params={**WINDOW, "tenants": t}, headers=acme)
             for t in ("globex", "ghost", "acme,globex")]
    named.append(await gateway.get(f"/v1/usage?start_time={HOUR}&tenants[]=acme&tenants[]=globex", headers=acme))
    bodies = []
    for r in named:
        _err(r, 404, "tenant_not_found", "tenants")
        bodies.append(r.json()["error"]["message"].replace("ghost", "globex"))
    assert bodies[0] == bodies[1]  # an existing tenant and a missing one read the same
    # globex's alias, version and outcome filter acme's rows to nothing
    for extra in ({"aliases": "secret-alias"}, {"versions": "g-1,g-9"}):
        r = await gateway.get("/v1/usage", params={**WINDOW, **extra, "group_by": "tenant,alias,version"},
                              headers=acme)
        assert r.status_code == 200 and _totals(r.json()) == []
    # every grouping shows acme alone
    for group in ("tenant", "tenant,alias,version,outcome", "outcome"):
        page = (await gateway.get("/v1/usage", params={**WINDOW, "group_by": group}, headers=acme)).json()
        assert all(r.get("tenant", "acme") == "acme" for r in _totals(page))
        assert "secret-alias" not in str(page) and "g-1" not in str(page)
    # globex's page token does not open globex's next page to acme
    params = {"start_time": HOUR, "end_time": HOUR + 7200, "bucket_width": "1h", "limit": 1}
    theirs = (await gateway.get("/v1/usage", params=params, headers=globex)).json()
    assert _totals(theirs)[0]["num_model_requests"] == 8
    _err(await gateway.get("/v1/usage", params={**params, "page": theirs["next_page"]}, headers=acme), 400,
         param="page")
    mine = (await gateway.get("/v1/usage", params=params, headers=acme)).json()
    second = (await gateway.get("/v1/usage", params={**params, "page": mine["next_page"]}, headers=acme)).json()
    assert second["data"][0]["start_time"] == HOUR + 3600 and _totals(second) == []  # globex's hour 2 stays theirs


async def test_v1_usage_authenticates_and_validates(gateway):
    _err(await gateway.get("/v1/usage", params=WINDOW), 401, "missing_token")
    _err(await gateway.get("/v1/usage", params=WINDOW, headers=_as(gateway.settings, None)), 403, "no_tenant")
    _err(await gateway.get("/v1/usage", params=WINDOW, headers=_as(gateway.settings, "nobody")), 401,
         "unknown_tenant")
    _err(await gateway.get("/v1/usage", params={"bucket_width": "1d"}, headers=_as(gateway.settings, "acme")),
         400, param="start_time")
    _err(await gateway.get("/v1/usage", params={**WINDOW, "group_by": "project"},
                           headers=_as(gateway.settings, "acme")), 400, param="group_by")


async def test_v1_usage_answers_503_when_the_registry_database_is_down(tmp_path):
    settings = make_settings(tmp_path, "postgresql+asyncpg://postgres@127.0.0.1:9/none", canary_judge_interval_s=0.0)
    app = create_app(settings, snapshots=MutableSnapshots(make_snapshot(TENANTS)), limiter=LocalLimiter(),
                     residency=MemoryResidency(), mount_admin=False)
    t0 = time.monotonic()
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        r = await c.get("/v1/usage", params=WINDOW, headers=_as(settings, "acme"))
    err = _err(r, 503, "registry_unavailable")
    assert r.headers["retry-after"] and "127.0.0.1" not in err["message"] and time.monotonic() - t0 < 15


# --- fuzz: any query string -------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["postgresql", "sqlite"])
def fuzzed(request, tmp_path_factory):
    import asyncio

    from starlette.testclient import TestClient

    tmp = tmp_path_factory.mktemp("usage-fuzz")
    url = request.getfixturevalue("pg_url") if request.param == "postgresql" else f"sqlite+aiosqlite:///{tmp}/registry.db"
    asyncio.run(fresh_registry(url))
    asyncio.run(_ledger(url))
    settings = make_settings(tmp, url, usage_query_max_rows=50)
    service = RegistryService(settings)
    with TestClient(mounted(admin_app(service, settings)), base_url="http://t",
                    raise_server_exceptions=False) as c:
        c.headers["authorization"] = f"Bearer {mint_admin(settings)}"
        yield c
    asyncio.run(service.engine.dispose())


NAMES = ["start_time", "end_time", "bucket_width", "group_by", "group_by[]", "tenants", "aliases", "versions",
         "limit", "page", "x"]


VALUES = st.one_of(st.text(max_size=8), st.integers(-2, 2**42).map(str), st.sampled_from(
    ["1m", "1h", "1d", "tenant", "alias,version,outcome", "acme", "globex", str(HOUR), str(HOUR + 60), "1440", ""]))


@hypothesis.settings(max_examples=200, deadline=None, suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(query=st.lists(st.tuples(st.sampled_from(NAMES), VALUES), max_size=6))
def test_no_query_string_gets_a_5xx(fuzzed, query):
    r = fuzzed.get("/admin/usage", params=query)
    assert r.status_code in (200, 400), (query, r.text)
    if r.status_code == 400:
        err = r.json()["error"]
        assert err["message"] and "Traceback" not in err["message"]
        assert err["param"] in {*NAMES, None} or err["code"] == "unknown_parameter", err
    else:
        page = r.json()
        assert page["object"] == "page" and len(page["data"]) <= 1440
