"""The limits report over usage rows inserted here (PostgreSQL and SQLite): peaks, p99 over the
minutes with traffic, throttled minutes and 429s by reason, the suggestion rule (raise, lower,
keep, unlimited, too little data), pruned minutes; then ``GET /admin/limits/report`` (auth,
400s naming the field, sort orders), ``loraplex admin limits report`` and the console's view with
its Apply through the limits confirm step."""

from __future__ import annotations

import json
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
from registry.admin_commands import limits_report_text
from registry.limits_report import (
    KEEP_BAND,
    MIN_MINUTES,
    BadQuery,
    limits_report,
    nearest_rank,
    parse_window,
    round_up_2sf,
    suggest,
)
from registry.models import UsageBucket
from registry.service import RegistryService
from tests.registry_support import fresh_registry, make_settings
from tests.test_admin_cli import run, server  # noqa: F401 (the admin API on a port, for the CLI)

NOW = 1_790_000_030
END = NOW // 60 * 60


def _row(tenant: str, start: int, outcome: str = "ok", requests: int = 1, prompt: int = 0, completion: int = 0,
         peak: int = 0, alias: str = "chat", version: str = "") -> dict:
    return {"width": "m", "start": start, "tenant": tenant, "alias": alias, "version": version, "outcome": outcome,
            "requests": requests, "prompt_tokens": prompt, "cached_tokens": prompt // 2,
            "completion_tokens": completion, "peak_concurrent": peak}


async def _insert(service: RegistryService, rows: list[dict]) -> None:
    async with service.sessions() as s, s.begin():
        await s.execute(insert(UsageBucket), rows)


async def seed(service: RegistryService, end: int, *, edges: bool = False) -> None:
    """Four tenants with traffic, one without.

    hot: 200 minutes; 50*i tokens in minute i (p99 9,900, peak 10,000 at a limit of 10,000); 11
    requests a minute over two aliases, 3 more refused on tokens in minutes 1..42, 2 on concurrency
    in minute 50 (where 16 were in flight), one 4xx in minute 60; concurrency 1 + i % 5 elsewhere.
    calm: 150 minutes, always 20 requests, 1,000 tokens, 8 in flight: inside every keep band.
    sparse: 10 minutes (too little data), refused on requests in 2 of them.
    free: 120 minutes, every limit 0 (unlimited).
    """
    await service.create_tenant("hot", requests_per_min=600, tokens_per_min=10_000, max_concurrent=16)
    await service.create_tenant("calm", requests_per_min=30, tokens_per_min=3_000, max_concurrent=16)
    await service.create_tenant("sparse")
    await service.create_tenant("free", requests_per_min=0, tokens_per_min=0, max_concurrent=0)
    await service.create_tenant("idle")
    rows = []
    for i in range(1, 201):
        t = end - 60 * i
        rows.append(_row("hot", t, requests=10, prompt=30 * i, completion=20 * i, peak=16 if i == 50 else 1 + i % 5))
        rows.append(_row("hot", t, alias="other", version="v2", requests=1))
        if i <= 42:
            rows.append(_row("hot", t, "429:tokens", requests=3))
    rows += [_row("hot", end - 60 * 50, "429:concurrency", requests=2),
             _row("hot", end - 60 * 60, "4xx:invalid_request", requests=1)]
    rows += [_row("calm", end - 60 * i, requests=20, prompt=600, completion=400, peak=8) for i in range(1, 151)]
    rows += [_row("sparse", end - 60 * i, requests=5, prompt=60, completion=40, peak=1) for i in range(1, 11)]
    rows += [_row("sparse", end - 60 * i, "429:requests") for i in (3, 4)]
    rows += [_row("free", end - 60 * i, requests=7, prompt=500, completion=500, peak=2) for i in range(1, 121)]
    if edges:  # outside the window, the minute under way, and an hour row: none of them count
        rows += [_row("hot", end - 7 * 86400 - 60, requests=10**6, prompt=10**9, peak=999),
                 _row("hot", end, requests=10**6, prompt=10**9, peak=999),
                 {**_row("hot", end - 3 * 3600, requests=10**6, prompt=10**9, peak=999), "width": "h"}]
    await _insert(service, rows)


@pytest.fixture
async def service(db_url, tmp_path):
    await fresh_registry(db_url)
    svc = RegistryService(make_settings(tmp_path, db_url))
    yield svc
    await svc.close()


# --- the rule, without a database ---------------------------------------------------------------

def test_rounding_percentile_and_window():
    assert [round_up_2sf(x) for x in (15_500, 12_375, 3.75, 99.5, 100, 101, 7, 0)] == [16_000, 13_000, 4, 100, 100,
                                                                                       110, 7, 0]
    assert nearest_rank(list(range(1, 101))) == 99 and nearest_rank(list(range(200, 0, -1))) == 198
    assert nearest_rank([5, 1]) == 5  # fewer than 100 minutes: the p99 is the peak
    assert parse_window("7d") == 7 * 86400 and parse_window("90m") == 5400 and parse_window("90d") == 90 * 86400
    for bad in ("", "7", "d", "7w", "-1d", "0h", "59m", "91d", "1.5d", "7 d"):
        with pytest.raises(BadQuery) as e:
            parse_window(bad)
        assert e.value.status == 400 and e.value.param == "window"


def test_suggestion_rule():
    raise_ = suggest("tokens_per_min", 10_000, 12_000, 12_400, 500, 42, "7 d")
    assert raise_["suggested"] == 16_000 and raise_["used"] == 1.24
    assert raise_["reason"] == ("p99 12,400 tokens/min over 7 d + 25% headroom, rounded up; throttled in 42 "
                                "minutes at 10,000")
    lower = suggest("requests_per_min", 600, 30, 20, 500, 0, "7 d")
    assert lower["suggested"] == 25 and "the limit 600 is 30.0x the p99" in lower["reason"]
    for limit in (22, 40, 60):  # [p99 x 1.1, p99 x 3], both ends kept
        keep = suggest("requests_per_min", limit, 30, 20, 500, 0, "7 d")
        assert keep["suggested"] is None and "keep" in keep["reason"], limit
    assert suggest("requests_per_min", 21, 30, 20, 500, 0, "7 d")["suggested"] == 25
    assert suggest("requests_per_min", 61, 30, 20, 500, 0, "7 d")["suggested"] == 25
    few = suggest("tokens_per_min", 10, 900, 800, MIN_MINUTES - 1, 3, "7 d")
    assert few["suggested"] is None and few["reason"].startswith("too little data: 99 minutes with traffic")
    assert suggest("tokens_per_min", 10, 900, 800, MIN_MINUTES, 3, "7 d")["suggested"] == 1000
    unlimited = suggest("tokens_per_min", 0, 900, 800, 500, 0, "7 d")
    assert unlimited["suggested"] is None and unlimited["used"] is None and "unlimited" in unlimited["reason"]
    nothing = suggest("tokens_per_min", 5_000, 0, 0, 500, 0, "7 d")  # 0 would mean unlimited: never suggested
    assert nothing["suggested"] is None
    assert suggest("max_concurrent", 2, 4, 3, 500, 5, "7 d", headroom_percent=50)["suggested"] == 5


@pytest.mark.parametrize("headroom", [10, 25, 60, 100])
def test_an_applied_suggestion_is_kept_by_the_next_report(headroom):
    """Headroom 10-100% and rounding up (under +10%) land inside the keep band: no back and forth."""
    for p99 in (1, 3, 7, 19, 99, 101, 999, 1234, 9_950, 12_400, 87_654, 1_000_001):
        s = suggest("tokens_per_min", 1, p99, p99, 500, 0, "7 d", headroom)["suggested"]
        if s is None:
            continue
        assert s >= p99 and KEEP_BAND[0] * p99 <= s <= KEEP_BAND[1] * p99, (p99, headroom, s)
        assert suggest("tokens_per_min", s, p99, p99, 500, 0, "7 d", headroom)["suggested"] is None


# --- the report over the ledger ------------------------------------------------------------------

async def test_report_numbers(service):
    await seed(service, END, edges=True)
    r = await limits_report(service, window="7d", now=NOW)
    assert (r["start"], r["end"], r["covered_from"], r["limited"]) == (END - 7 * 86400, END, END - 7 * 86400, False)
    assert [t["tenant"] for t in r["data"]] == ["hot", "sparse", "calm", "free"]  # most throttled first
    assert r["tenants_with_traffic"] == 4 and r["tenants_total"] == 5 and not r["truncated"]
    hot = r["data"][0]
    assert (hot["minutes"], hot["throttled_minutes"]) == (200, 43)
    assert hot["refused"] == {"concurrency": 2, "tokens": 126}
    tok, req, conc = (hot["limits"][d] for d in ("tokens_per_min", "requests_per_min", "max_concurrent"))
    # tokens: admitted only (the refused rows carry none), summed over both aliases
    assert (tok["peak"], tok["p99"], tok["used"], tok["throttled_minutes"]) == (10_000, 9_900, 0.99, 42)
    assert tok["suggested"] == 13_000
    assert tok["reason"] == ("p99 9,900 tokens/min over 7 d + 25% headroom, rounded up; throttled in 42 minutes "
                             "at 10,000")
    # requests: the demand, refused ones included (11 + 3 in minutes 1..42)
    assert (req["peak"], req["p99"], req["throttled_minutes"], req["suggested"]) == (14, 14, 0, 18)
    assert (conc["peak"], conc["p99"], conc["throttled_minutes"], conc["suggested"]) == (16, 5, 1, 7)
    assert conc["reason"].endswith("the limit 16 is 3.2x the p99; throttled in 1 minute at 16")
    assert hot["apply"] == {"requests_per_min": 18, "tokens_per_min": 13_000, "max_concurrent": 7}
    assert hot["used"] == 0.99 and hot["enough_data"]

    calm = next(t for t in r["data"] if t["tenant"] == "calm")
    assert calm["apply"] is None and calm["throttled_minutes"] == 0 and calm["refused"] == {}
    assert {d: (x["p99"], x["suggested"]) for d, x in calm["limits"].items()} == {
        "requests_per_min": (20, None), "tokens_per_min": (1000, None), "max_concurrent": (8, None)}
    assert all("keep" in x["reason"] for x in calm["limits"].values())

    sparse = next(t for t in r["data"] if t["tenant"] == "sparse")
    assert not sparse["enough_data"] and sparse["apply"] is None and sparse["refused"] == {"requests": 2}
    assert sparse["minutes"] == 10 and sparse["limits"]["requests_per_min"]["throttled_minutes"] == 2
    assert all(x["reason"].startswith("too little data") for x in sparse["limits"].values())

    free = next(t for t in r["data"] if t["tenant"] == "free")
    assert free["used"] is None and free["apply"] is None and free["limits"]["tokens_per_min"]["p99"] == 1000

    by_headroom = await limits_report(service, window="7d", sort="headroom", now=NOW)
    assert [t["tenant"] for t in by_headroom["data"]] == ["hot", "calm", "sparse", "free"]
    top = await limits_report(service, window="7d", limit=2, now=NOW)
    assert [t["tenant"] for t in top["data"]] == ["hot", "sparse"] and top["truncated"]

    idle = await limits_report(service, tenant="idle", now=NOW)
    assert [(t["tenant"], t["minutes"], t["enough_data"], t["apply"]) for t in idle["data"]] == [("idle", 0, False,
                                                                                                   None)]
    only = await limits_report(service, tenant="hot", window="2h", now=NOW)  # minutes 1..120 only
    assert only["data"][0]["minutes"] == 120 and only["data"][0]["limits"]["tokens_per_min"]["peak"] == 6000


async def test_an_applied_suggestion_is_audited_and_then_kept(service):
    await seed(service, END)
    hot = (await limits_report(service, tenant="hot", now=NOW))["data"][0]
    after = await service.set_tenant_limits("hot", actor="ops-alice", **hot["apply"])
    assert {k: after.to_json()[k] for k in hot["apply"]} == hot["apply"]
    entry = (await service.audit(action="tenant.limits"))[0]
    assert entry.actor == "ops-alice" and entry.before["tokens_per_min"] == 10_000
    assert entry.after["tokens_per_min"] == 13_000
    again = (await limits_report(service, tenant="hot", now=NOW))["data"][0]
    assert again["apply"] is None, again


async def test_pruned_minutes_limit_the_report_and_say_so(service):
    await service.create_tenant("acme", tokens_per_min=1000)
    rows = [_row("acme", END - 60 * i, requests=2, prompt=50, completion=50) for i in range(1, 2 * 24 * 60)]
    hours = [{**_row("acme", END // 3600 * 3600 - 3600 * h, requests=120, prompt=6000), "width": "h"}
             for h in range(49, 5 * 24)]
    await _insert(service, rows + hours)
    r = await limits_report(service, window="7d", now=NOW)
    oldest = END - 60 * (2 * 24 * 60 - 1)
    assert r["limited"] and r["covered_from"] == oldest and "rolled up into hours and pruned" in r["note"]
    assert r["data"][0]["minutes"] == 2 * 24 * 60 - 1
    assert not (await limits_report(service, window="24h", now=NOW))["limited"]  # all its minutes are there


async def test_bad_parameters_name_the_field(service):
    await service.create_tenant("acme")
    for kwargs, param in (({"window": "7w"}, "window"), ({"sort": "loudest"}, "sort"), ({"limit": 0}, "limit"),
                          ({"limit": 1001}, "limit"), ({"headroom_percent": 5}, "headroom"),
                          ({"headroom_percent": 101}, "headroom")):
        with pytest.raises(BadQuery) as e:
            await limits_report(service, **kwargs)
        assert e.value.status == 400 and e.value.param == param, kwargs


async def test_a_reason_the_report_does_not_know_still_counts_as_throttled(service):
    await service.create_tenant("odd")
    await _insert(service, [_row("odd", END - 60, requests=4, prompt=10, peak=1),
                            _row("odd", END - 60, "429:surge", requests=2), _row("odd", END - 120, "cancelled")])
    odd = (await limits_report(service, now=NOW))["data"][0]
    assert (odd["minutes"], odd["throttled_minutes"], odd["refused"]) == (2, 1, {"surge": 2})
    assert all(x["throttled_minutes"] == 0 for x in odd["limits"].values())
    assert odd["limits"]["requests_per_min"]["peak"] == 6 and odd["limits"]["tokens_per_min"]["peak"] == 10


# --- admin API ---------------------------------------------------------------------------------

@pytest.fixture
async def api(service, tmp_path):
    settings = service.settings
    app = Starlette(routes=[Mount("/admin", app=admin_app(service, settings, console=None))])
    headers = {"authorization": f"Bearer {mint_admin(settings, subject='ops-alice')}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t/admin",
                                 headers=headers) as client:
        client.settings, client.service = settings, service  # type: ignore[attr-defined]
        yield client


async def test_admin_api_report(api):
    end = int(time.time()) // 60 * 60
    await seed(api.service, end)
    s = api.settings
    assert (await api.get("/limits/report", headers={"authorization": ""})).status_code == 401
    tenant = mint(s, "acme-backend", tenant="hot")
    r = await api.get("/limits/report", headers={"authorization": f"Bearer {tenant}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"

    r = await api.get("/limits/report")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "limits_report" and body["window"] == "7d" and body["sort"] == "throttled"
    assert [t["tenant"] for t in body["data"]] == ["hot", "sparse", "calm", "free"]
    assert body["data"][0]["apply"] == {"requests_per_min": 18, "tokens_per_min": 13_000, "max_concurrent": 7}
    r = await api.get("/limits/report", params={"sort": "headroom", "window": "24h"})
    assert [t["tenant"] for t in r.json()["data"]] == ["hot", "calm", "sparse", "free"]
    r = await api.get("/limits/report", params={"tenant": "calm", "headroom": 50})
    assert [t["tenant"] for t in r.json()["data"]] == ["calm"] and r.json()["headroom_percent"] == 50

    for params, field in (({"window": "7w"}, "window"), ({"window": ""}, "window"), ({"sort": "loud"}, "sort"),
                          ({"limit": "0"}, "limit"), ({"headroom": "500"}, "headroom")):
        r = await api.get("/limits/report", params=params)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (params, r.text)
    r = await api.get("/limits/report", params={"windw": "7d"})
    assert r.status_code >= 400 and r.json()["error"]["param"] == "windw"
    for slug in ("nobody", "NUL\x00", "x" * 300):
        r = await api.get("/limits/report", params={"tenant": slug})
        assert r.status_code == 404 and r.json()["error"]["param"] == "tenant"
    doc = (await api.get("/openapi.json")).json()
    op = doc["paths"]["/limits/report"]["get"]
    assert {p["name"] for p in op["parameters"]} == {"window", "sort", "tenant", "limit", "headroom"}
    assert "LimitsReport" in doc["components"]["schemas"]


# --- CLI ---------------------------------------------------------------------------------------

async def test_cli_text_shows_before_after_and_the_command(service):
    await seed(service, END)
    text = limits_report_text(await limits_report(service, now=NOW))
    lines = text.splitlines()
    assert lines[0].startswith("limits over 7d (") and "most throttled first" in lines[0]
    assert lines[1].startswith("per minute: p99, nearest rank, over the minutes in which the tenant sent a request")
    header = lines[2].split()
    assert header[:4] == ["TENANT", "MINUTES", "THROTTLED", "429s"]
    assert [line.split()[0] for line in lines[3:7]] == ["hot", "sparse", "calm", "free"]
    hot = lines[3]
    assert "concurrency 2, tokens 126" in hot and "10,000 (9,900/10,000)" in hot and "16 (5/16)" in hot
    assert hot.endswith("99%")
    assert "tokens_per_min 10,000 -> 13,000: p99 9,900 tokens/min over 7 d + 25% headroom, rounded up; " \
           "throttled in 42 minutes at 10,000" in text
    assert "requests_per_min 600 -> 18:" in text and "max_concurrent 16 -> 7:" in text
    assert "  apply: loraplex admin tenant limits hot --requests-per-min 18 --tokens-per-min 13000 " \
           "--max-concurrent 7" in text
    assert "sparse:\n  no suggestion: too little data: 10 minute(s) with traffic over 7d, 100 needed" in text
    assert "apply: loraplex admin tenant limits calm" not in text and "\ncalm:" not in text
    assert "4 shown of 4 tenant(s) with traffic (5 in the registry)" in text


def test_cli_against_the_admin_api(server, capsys):  # noqa: F811
    """``loraplex admin limits report`` end to end, and its apply line run as printed."""
    import asyncio

    settings, _url, _gate = server

    async def prepare() -> None:
        svc = RegistryService(settings)
        try:
            await seed(svc, int(time.time()) // 60 * 60)
        finally:
            await svc.close()

    asyncio.run(prepare())
    code, out, err = run(capsys, "limits", "report", "--window", "7d", "--sort", "headroom")
    assert code == 0, err
    assert "least headroom first" in out and "tokens_per_min 10,000 -> 13,000" in out
    apply = next(line for line in out.splitlines() if line.startswith("  apply: loraplex admin tenant limits hot"))
    code, out, err = run(capsys, *apply.split("loraplex admin ", 1)[1].split(), "--json")
    assert code == 0, err
    assert {k: json.loads(out)[k] for k in ("requests_per_min", "tokens_per_min", "max_concurrent")} == {
        "requests_per_min": 18, "tokens_per_min": 13_000, "max_concurrent": 7}
    code, out, _ = run(capsys, "limits", "report", "--tenant", "hot", "--json")
    assert code == 0 and json.loads(out)["data"][0]["apply"] is None  # applied: kept now
    code, _, err = run(capsys, "limits", "report", "--window", "7w")
    assert code == 1 and "window" in err and "HTTP 400" in err


# --- console -----------------------------------------------------------------------------------

async def test_console_limits_view_and_apply(api):
    await seed(api.service, int(time.time()) // 60 * 60)
    shell = (await api.get("/console")).text
    assert 'href="#limits"' in shell
    r = await api.get("/console/view/limits")
    assert r.status_code == 200 and "content-security-policy" in r.headers, r.text
    html = r.text
    assert re.findall(r'<tr data-tenant="([^"]+)"', html) == ["hot", "sparse", "calm", "free"]
    assert 'data-sort-current="throttled"' in html and 'href="#limits?window=7d&amp;sort=headroom"' in html
    assert "tokens_per_min 10,000 → <strong>13,000</strong>" in html and "throttled in 42 minutes at 10,000" in html
    assert "No suggestion: too little data" in html and "<meter" in html
    form = re.search(r'<form class="inline apply" data-confirm="limits" data-slug="hot">(.*?)</form>', html, re.S)
    fields = {k: unescape(v) for k, v in re.findall(r'name="([^"]+)" value="([^"]+)"', form.group(1))}
    assert fields == {"requests_per_min": "18", "tokens_per_min": "13000", "max_concurrent": "7",
                      "back": "#limits?window=7d&sort=throttled"}

    r = await api.get("/console/view/limits", params={"sort": "headroom", "window": "24h"})
    assert re.findall(r'<tr data-tenant="([^"]+)"', r.text) == ["hot", "calm", "sparse", "free"]
    bad = await api.get("/console/view/limits", params={"window": "7w"})
    assert bad.status_code == 400 and "window must be" in unescape(bad.text)

    # Apply: the limits confirm step with the suggested values, before and after
    confirm = await api.get("/console/view/confirm", params={"action": "limits", "slug": "hot", **fields})
    rows = re.findall(r'<tr data-field="([^"]+)"><th>[^<]*</th><td class="before">([^<]*)</td>'
                      r'<td class="after">([^<]*)</td>', confirm.text)
    assert rows == [("requests_per_min", "600", "18"), ("tokens_per_min", "10000", "13000"),
                    ("max_concurrent", "16", "7")]
    assert unescape(re.search(r'data-back="([^"]*)"', confirm.text).group(1)) == "#limits?window=7d&sort=throttled"
    elsewhere = await api.get("/console/view/confirm", params={"action": "limits", "slug": "hot", **fields,
                                                                "back": "https://evil.example/"})
    assert unescape(re.search(r'data-back="([^"]*)"', elsewhere.text).group(1)) == "#tenant?slug=hot"
    call = json.loads(unescape(re.search(r'data-calls="([^"]*)"', confirm.text).group(1)))[0]
    assert call["method"] == "PATCH" and call["path"] == "/admin/tenants/hot/limits"
    r = await api.request(call["method"], call["path"].removeprefix("/admin"), json=call["body"],
                          headers={"if-match": f'"{call["if_match"]}"'})
    assert r.status_code == 200 and r.json()["tokens_per_min"] == 13_000
    assert (await api.service.audit(action="tenant.limits"))[0].actor == "ops-alice"
    after = (await api.get("/console/view/limits")).text
    assert 'data-slug="hot"' not in after  # applied: nothing left to apply for it
