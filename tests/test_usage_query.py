"""Reading the usage ledger (``registry.usage_query``) on PostgreSQL and SQLite: every width equals
the sums of the minutes it covers whatever the rollup has reached (minutes not yet rolled up,
hours rolled up, days rolled up, minutes pruned), grouping and filters, pages over many
buckets, each bad parameter a 400 naming it, and the row cap."""

from __future__ import annotations

import base64
import random
from collections import defaultdict
from typing import Any

import orjson
import pytest
from sqlalchemy import delete, insert

from registry.db import make_engine, session_factory
from registry.models import UsageBucket, UsageRollup
from registry.usage_query import GROUP_KEYS, BadUsageQuery, parse_usage_query, read_usage
from tests.registry_support import fresh_registry

DAY0 = 1_765_000_000 - 1_765_000_000 % 86400
"""A UTC midnight: the ledger's truth spans the day before it to two days after."""
TENANTS, ALIASES, VERSIONS = ("acme", "globex", "initech"), ("support", "tiny"), ("v-1", "v-2", "")
OUTCOMES = ("ok", "ok", "ok", "cancelled", "429:tokens", "4xx:invalid_value", "5xx:no_worker")
H_MARK = DAY0 + 86400 + 5 * 3600
"""Hours are rolled up to here (the second day's 05:00)."""
D_MARK = DAY0 + 86400
"""Days are rolled up to here (the second day's midnight)."""


def _truth(seed: int = 7, n: int = 600) -> dict[tuple[Any, ...], list[int]]:
    """Minute rows: (start, tenant, alias, version, outcome) -> [requests, prompt, cached, completion]."""
    rng = random.Random(seed)
    rows: dict[tuple[Any, ...], list[int]] = {}
    for _ in range(n):
        start = DAY0 - 86400 + 60 * rng.randrange(3 * 1440)
        key = (start, rng.choice(TENANTS), rng.choice(ALIASES), rng.choice(VERSIONS), rng.choice(OUTCOMES))
        req = rng.randint(1, 5)
        prompt = 0 if key[4].startswith("429") else rng.randint(1, 900) * req
        cur = rows.setdefault(key, [0, 0, 0, 0])
        for i, v in enumerate((req, prompt, prompt // 3, 0 if key[4] != "ok" else rng.randint(1, 300))):
            cur[i] += v
    return rows


def _rolled(truth: dict[tuple[Any, ...], list[int]], seconds: int, until: int) -> dict[tuple[Any, ...], list[int]]:
    out: dict[tuple[Any, ...], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for (start, *rest), v in truth.items():
        if start < until:
            cur = out[(start - start % seconds, *rest)]
            for i in range(4):
                cur[i] += v[i]
    return out


def _rows(width: str, rows: dict[tuple[Any, ...], list[int]]) -> list[dict[str, Any]]:
    return [{"width": width, "start": k[0], "tenant": k[1], "alias": k[2], "version": k[3], "outcome": k[4],
             "requests": v[0], "prompt_tokens": v[1], "cached_tokens": v[2], "completion_tokens": v[3],
             "peak_concurrent": 1} for k, v in rows.items()]


TRUTH = _truth()


@pytest.fixture
async def sessions(db_url):
    """The ledger as the rollup leaves it: every minute, hours before ``H_MARK``, days before ``D_MARK``."""
    await fresh_registry(db_url)
    engine = make_engine(db_url)
    factory = session_factory(engine)
    async with factory.begin() as s:
        await s.execute(insert(UsageBucket), _rows("m", TRUTH))
        await s.execute(insert(UsageBucket), _rows("h", _rolled(TRUTH, 3600, H_MARK)))
        await s.execute(insert(UsageBucket), _rows("d", _rolled(TRUTH, 86400, D_MARK)))
        await s.execute(insert(UsageRollup), [{"width": "h", "done_until": H_MARK},
                                              {"width": "d", "done_until": D_MARK}])
    yield factory
    await engine.dispose()


def _expected(width_s: int, lo: int, hi: int, group_by: tuple[str, ...], **filters: tuple[str, ...]
              ) -> dict[tuple[Any, ...], dict[str, Any]]:
    """(bucket start, group keys...) -> the result the API must give, from the minute truth."""
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    cols = dict(zip(GROUP_KEYS, range(1, 5), strict=True))
    for k, v in TRUTH.items():
        if not lo <= k[0] < hi:
            continue
        if any(vals and k[cols[col]] not in vals for col, vals in
               (("tenant", filters.get("tenants")), ("alias", filters.get("aliases")),
                ("version", filters.get("versions")))):
            continue
        key = (k[0] - k[0] % width_s, *[k[cols[g]] for g in GROUP_KEYS if g in group_by])
        r = out.setdefault(key, {"num_model_requests": 0, "input_tokens": 0, "input_cached_tokens": 0,
                                 "output_tokens": 0, "outcomes": {}})
        r["num_model_requests"] += v[0]
        r["input_tokens"] += v[1]
        r["input_cached_tokens"] += v[2]
        r["output_tokens"] += v[3]
        r["outcomes"][k[4]] = r["outcomes"].get(k[4], 0) + v[0]
    return out


def _got(page: dict[str, Any], group_by: tuple[str, ...]) -> dict[tuple[Any, ...], dict[str, Any]]:
    out = {}
    for bucket in page["data"]:
        assert bucket["object"] == "bucket"
        for r in bucket["results"]:
            assert r["object"] == "organization.usage.completions.result"
            key = (bucket["start_time"], *[r[g] for g in GROUP_KEYS if g in group_by])
            assert key not in out
            out[key] = {k: r[k] for k in ("num_model_requests", "input_tokens", "input_cached_tokens",
                                          "output_tokens", "outcomes")}
    return out


def _q(_max: int = 100_000, **params: Any) -> Any:
    return parse_usage_query({k: v if isinstance(v, list) else [str(v)] for k, v in params.items()},
                             max_rows=_max, now=DAY0 + 3 * 86400)


async def _all_pages(factory, **params: Any) -> list[dict[str, Any]]:
    pages = []
    token = None
    while True:
        q = _q(**params, **({"page": token} if token else {}))
        async with factory() as s:
            page = await read_usage(s, q)
        pages.append(page)
        if not page["has_more"]:
            assert page["next_page"] is None
            return pages
        token = page["next_page"]


@pytest.mark.parametrize("width,seconds,limit", [("1m", 60, 1440), ("1h", 3600, 168), ("1d", 86400, 31)])
async def test_each_width_equals_the_minutes_whatever_the_rollup_reached(sessions, width, seconds, limit):
    """Windows across the day watermark and the hour watermark (minutes not yet rolled up) and
    before both: every bucket equals the minutes it covers, each counted once."""
    windows = [(DAY0 - 86400, DAY0 + 3 * 86400), (H_MARK - 2 * 3600, H_MARK + 3 * 3600), (DAY0 + 3600, DAY0 + 7200)]
    for lo, hi in windows:
        if width == "1m" and hi - lo > limit * 60:
            lo, hi = H_MARK - 600 * 60, H_MARK + 600 * 60
        pages = await _all_pages(sessions, start_time=lo, end_time=hi, bucket_width=width, limit=limit)
        got: dict[tuple[Any, ...], dict[str, Any]] = {}
        starts = []
        for p in pages:
            got |= _got(p, ())
            starts += [b["start_time"] for b in p["data"]]
        a, b = lo - lo % seconds, -(-hi // seconds) * seconds
        assert starts == list(range(a, b, seconds))  # every bucket, empty ones too, in order
        assert got == _expected(seconds, a, b, ())
        assert got, "the window holds usage"


async def test_pruned_minutes_leave_hours_and_days_whole(sessions):
    """Once the minutes before the hour watermark are pruned, hours and days still add up."""
    async with sessions.begin() as s:
        await s.execute(delete(UsageBucket).where(UsageBucket.width == "m", UsageBucket.start < H_MARK))
    for width, seconds in (("1h", 3600), ("1d", 86400)):
        pages = await _all_pages(sessions, start_time=DAY0 - 86400, end_time=DAY0 + 3 * 86400, bucket_width=width,
                                 limit=168 if width == "1h" else 31)
        got: dict[tuple[Any, ...], dict[str, Any]] = {}
        for p in pages:
            got |= _got(p, ())
        assert got == _expected(seconds, DAY0 - 86400, DAY0 + 3 * 86400, ())


@pytest.mark.parametrize("group_by,filters", [
    (("tenant",), {}),
    (("tenant", "alias", "version"), {}),
    (("version", "outcome"), {"tenants": ("acme", "globex")}),
    (("alias",), {"versions": ("v-2",), "aliases": ("support",)}),
    ((), {"tenants": ("initech",)}),
])
async def test_grouping_and_filters(sessions, group_by, filters):
    params: dict[str, Any] = {"start_time": DAY0 - 86400, "end_time": DAY0 + 3 * 86400, "bucket_width": "1h",
                              "limit": 168, "group_by": [",".join(group_by)] if group_by else []}
    params |= {k: list(v) for k, v in filters.items()}
    got: dict[tuple[Any, ...], dict[str, Any]] = {}
    for p in await _all_pages(sessions, **params):
        got |= _got(p, group_by)
        for bucket in p["data"]:
            keys = [tuple(r[g] for g in GROUP_KEYS if g in group_by) for r in bucket["results"]]
            assert keys == sorted(keys)
            for r in bucket["results"]:
                assert set(r) - {"object", "input_tokens", "input_cached_tokens", "output_tokens",
                                 "num_model_requests", "outcomes"} == set(group_by)
    assert got == _expected(3600, DAY0 - 86400, DAY0 + 3 * 86400, group_by, **filters)


async def test_pages_over_many_minute_buckets(sessions):
    """A 20-hour window of minutes in pages of 60: 20 pages, each bucket once, the sums whole."""
    lo, hi = H_MARK - 10 * 3600, H_MARK + 10 * 3600
    pages = await _all_pages(sessions, start_time=lo, end_time=hi, bucket_width="1m", limit=60,
                             group_by=["tenant"])
    assert len(pages) == 20 and all(len(p["data"]) == 60 for p in pages)
    starts = [b["start_time"] for p in pages for b in p["data"]]
    assert starts == list(range(lo, hi, 60))
    got: dict[tuple[Any, ...], dict[str, Any]] = {}
    for p in pages:
        got |= _got(p, ("tenant",))
    assert got == _expected(60, lo, hi, ("tenant",))


async def test_default_end_is_now_and_pages_keep_the_first_window(sessions):
    """Without end_time the window ends now; a later page keeps the first page's end (now moves on)."""
    first = parse_usage_query({"start_time": [str(DAY0)], "bucket_width": ["1d"], "limit": ["1"]}, max_rows=100,
                              now=DAY0 + 2 * 86400 + 5)
    assert (first.start_time, first.end_time) == (DAY0, DAY0 + 3 * 86400)
    async with sessions() as s:
        page = await read_usage(s, first)
    later = parse_usage_query({"start_time": [str(DAY0)], "bucket_width": ["1d"], "limit": ["1"],
                               "page": [page["next_page"]]}, max_rows=100, now=DAY0 + 9 * 86400)
    assert (later.page_start, later.end_time) == (DAY0 + 86400, DAY0 + 3 * 86400)


async def test_the_row_cap_refuses_a_page_too_large(sessions):
    q = _q(start_time=DAY0, end_time=DAY0 + 86400, bucket_width="1h", limit=24, group_by=["tenant,alias"], _max=5)
    async with sessions() as s:
        with pytest.raises(BadUsageQuery) as err:
            await read_usage(s, q)
    assert err.value.status == 400 and err.value.code == "too_many_rows" and "narrow" in err.value.message
    ok = _q(start_time=DAY0, end_time=DAY0 + 3600, bucket_width="1h", group_by=["tenant"], _max=5)
    async with sessions() as s:
        assert (await read_usage(s, ok))["data"][0]["results"]


GOOD = {"start_time": [str(DAY0)], "end_time": [str(DAY0 + 86400)]}


def _forged(at: int, end: int) -> str:
    """A page token of GOOD's query (no end_time given) with another bucket and end."""
    q = parse_usage_query({"start_time": GOOD["start_time"]}, max_rows=10)
    return base64.urlsafe_b64encode(orjson.dumps({"at": at, "end": end, "q": q.fingerprint()})).decode()


@pytest.mark.parametrize("param,value", [
    ("start_time", None), ("start_time", "yesterday"), ("start_time", "-5"), ("start_time", "1.5"),
    ("start_time", str(2**41)), ("end_time", str(DAY0 - 1)), ("end_time", "soon"),
    ("bucket_width", "1w"), ("bucket_width", "60"), ("group_by", "model"), ("group_by", "tenant,project_id"),
    ("limit", "0"), ("limit", "32"), ("limit", "x"), ("page", "garbage"), ("page", "e30"),
    ("tenants", "x" * 201), ("aliases", "a\x00b"), ("versions", "v\n1"), ("project_ids", "p1"),
])
def test_each_bad_parameter_is_a_400_naming_it(param, value):
    params = dict(GOOD)
    if value is None:
        params.pop(param)
    else:
        params[param] = [value]
    with pytest.raises(BadUsageQuery) as err:
        parse_usage_query(params, max_rows=10)
    assert err.value.status == 400 and err.value.param == param, err.value.message


@pytest.mark.parametrize("at,end", [(DAY0 + 86400, DAY0 + 86400 + 7), (DAY0 + 86400, DAY0 - 86400),
                                    (DAY0 + 5, DAY0 + 2 * 86400), (DAY0 + 86400, 2**50)])
def test_a_forged_page_token_is_a_400(at, end):
    with pytest.raises(BadUsageQuery) as err:
        parse_usage_query({"start_time": GOOD["start_time"], "page": [_forged(at, end)]}, max_rows=10)
    assert err.value.param == "page"
    ok = parse_usage_query({"start_time": GOOD["start_time"], "page": [_forged(DAY0 + 86400, DAY0 + 3 * 86400)]},
                           max_rows=10)
    assert (ok.page_start, ok.end_time) == (DAY0 + 86400, DAY0 + 3 * 86400)


def test_limits_follow_the_width():
    assert _q(start_time=DAY0, bucket_width="1m").limit == 60
    assert _q(start_time=DAY0, bucket_width="1h").limit == 24
    assert _q(start_time=DAY0).limit == 7
    assert _q(start_time=DAY0, bucket_width="1m", limit=1440).limit == 1440
    with pytest.raises(BadUsageQuery):
        _q(start_time=DAY0, bucket_width="1h", limit=169)
    with pytest.raises(BadUsageQuery) as err:
        parse_usage_query({**GOOD, "tenants": ["a"] * 1001}, max_rows=1)
    assert err.value.param == "tenants"
    with pytest.raises(BadUsageQuery) as err:
        parse_usage_query({**GOOD, "limit": ["1", "2"]}, max_rows=1)
    assert err.value.param == "limit"


async def test_a_page_token_of_another_query_is_refused(sessions):
    q = _q(start_time=DAY0, end_time=DAY0 + 3 * 86400, limit=1)
    async with sessions() as s:
        token = (await read_usage(s, q))["next_page"]
    for other in ({"group_by": ["tenant"]}, {"tenants": ["acme"]}, {"limit": ["2"]},
                  {"end_time": [str(DAY0 + 4 * 86400)]}):
        with pytest.raises(BadUsageQuery) as err:
            parse_usage_query({**GOOD, "end_time": [str(DAY0 + 3 * 86400)], "limit": ["1"], **other,
                               "page": [token]}, max_rows=10)
        assert err.value.param == "page"
