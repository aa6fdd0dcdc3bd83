"""Reading the usage ledger (``usage_buckets``) in the shape of OpenAI's usage API.

    q = parse_usage_query(params, max_rows=settings.usage_query_max_rows)   # 400s naming the field
    page = await read_usage(session, q)                                     # {"object": "page", ...}

A page holds up to ``limit`` buckets of ``bucket_width`` (every bucket of the window, empty ones
too, as OpenAI's API does), each with its results: the sums of one group (tenant, alias, adapter
version, outcome: those named in ``group_by``) with the outcomes' request counts beside the token
sums. The window is widened to whole buckets (UTC), since the ledger's finest bucket is a minute
and a day is only kept whole.

A query is complete whatever the rollup has reached: the ledger keeps minutes, hours and days,
and ``usage_rollups`` says up to where each coarser width is complete. Before that watermark a
bucket is read from the coarse rows, after it from the finer ones summed in the database; the
watermarks are read first, in the same session, and only grow (the finer rows they cover stay
until pruned, long after), so no bucket is read twice or missed. Everything is summed in the
database (the page's rows by ``(width, start)``, or a tenant's by ``(width, tenant, start)``), and
at most ``max_rows`` results come back: a page that would hold more is refused with a 400 that says
how to narrow it. On PostgreSQL the database also writes the page's results as JSON
(``read_usage_json``, what ``GET /admin/usage`` answers with); on SQLite they are built here.

A page of finished days grouped by tenant (no alias or version filter) before the ``t``
watermark is not summed at all: it joins the results the rollup rendered per tenant and day
(``usage_tenant_days``, ``registry.usage_tenant_days``; rendered by ``results_select``, as every page
read from the ledger is, so the bytes are the same), which a late minute renders again in its
flush. A page of finished days (``1d`` buckets all before the day watermark: day rows only, which are
never pruned) changes only when a late minute is added to a day row, and such a flush counts
itself in ``usage_late_writes`` in its own transaction (``registry.usage``). So each engine keeps
those pages' JSON (``FinishedPages``) by the query and that count, read before the page: a kept
page is byte for byte what reading it again would give, and a day still open is always read.

``UsageReader`` is the gateway's way in (``GET /v1/usage``): its own small pool on the registry
database, every failure a ``registry.errors.Unavailable`` (503 with ``retry-after``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from itertools import groupby
from operator import itemgetter
from typing import Any

import orjson
from sqlalchemy import (
    BigInteger,
    ColumnClause,
    String,
    Text,
    cast,
    func,
    literal,
    literal_column,
    select,
    union_all,
)
from sqlalchemy.dialects.postgresql import aggregate_order_by
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.sql import Select

from loraplex.settings import Settings
from registry.db import LazyDatabase
from registry.errors import Invalid, NotFound, unavailable_on_database_failure
from registry.models import UsageBucket, UsageLateWrites, UsageRollup

WIDTHS: dict[str, tuple[str, int]] = {"1m": ("m", 60), "1h": ("h", 3600), "1d": ("d", 86400)}
"""``bucket_width`` -> the ledger's width code and the bucket's seconds."""
LIMITS: dict[str, tuple[int, int]] = {"1m": (60, 1440), "1h": (24, 168), "1d": (7, 31)}
"""``bucket_width`` -> (default, most) buckets a page holds, as in OpenAI's usage API."""
GROUP_KEYS = ("tenant", "alias", "version", "outcome")
FILTERS = {"tenants": "tenant", "aliases": "alias", "versions": "version"}
"""Filter parameter -> the column it restricts."""
PARAMETERS = ("start_time", "end_time", "bucket_width", "group_by", "limit", "page", *FILTERS)
MAX_FILTER_VALUES = 1000
"""Values one filter may list (a longer list is a 400: the IN list would be the cost)."""
MAX_VALUE_CHARS = 200
MAX_TIME = 2**40
"""Latest second a window may name (year 36812): keeps the arithmetic in the database's integers."""
_OUTCOME_SEP, _ITEM_SEP = "\x1f", "\x1e"
"""How the database joins a result's outcomes into one text (control characters no outcome holds)."""


class BadUsageQuery(Invalid):
    """A usage query the ledger cannot answer as asked: a 400 naming the parameter (``param``)."""

    status = 400


def _bad(param: str | None, message: str, code: str = "invalid_value") -> BadUsageQuery:
    return BadUsageQuery(message, code=code, param=param)


@dataclass(frozen=True)
class UsageQuery:
    start_time: int
    """The window's first second, aligned down to the bucket width."""
    end_time: int
    """The window's end (exclusive), aligned up to the bucket width."""
    bucket_width: str
    group_by: tuple[str, ...]
    tenants: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    versions: tuple[str, ...] = ()
    limit: int = 7
    page_start: int | None = None
    """The first bucket of this page (from ``page``); None: the window's first."""
    max_rows: int = 100_000

    @property
    def seconds(self) -> int:
        return WIDTHS[self.bucket_width][1]

    def fingerprint(self) -> str:
        """What a page token is bound to: the query but its page and end (a token of another query is refused)."""
        key = [self.start_time, self.bucket_width, sorted(self.group_by), sorted(self.tenants), sorted(self.aliases),
               sorted(self.versions), self.limit]
        return hashlib.sha256(orjson.dumps(key)).hexdigest()[:16]


# --- parsing -------------------------------------------------------------------------------------

def _values(params: Mapping[str, Iterable[str]], name: str) -> list[str]:
    """A list parameter: repeated (``group_by=a&group_by=b``), ``name[]``, or comma-separated."""
    out: list[str] = []
    for key in (name, name + "[]"):
        for raw in params.get(key, ()):
            out += [v.strip() for v in str(raw).split(",") if v.strip()]
    return out


def _one(params: Mapping[str, Iterable[str]], name: str) -> str | None:
    got = list(params.get(name, ()))
    if len(got) > 1:
        raise _bad(name, f"{name} is given {len(got)} times; give it once")
    return str(got[0]).strip() if got else None


def _int(params: Mapping[str, Iterable[str]], name: str, low: int, high: int) -> int | None:
    raw = _one(params, name)
    if raw is None:
        return None
    if not raw.lstrip("-").isdigit() or len(raw) > 20:
        raise _bad(name, f"{name} must be a whole number (unix seconds for times), got {raw[:40]!r}")
    value = int(raw)
    if not low <= value <= high:
        raise _bad(name, f"{name} must be from {low} to {high}, got {value}")
    return value


def parse_usage_query(params: Mapping[str, Iterable[str]], *, max_rows: int, now: float | None = None,
                      tenant: str | None = None) -> UsageQuery:
    """A usage query from its parameters (name -> the values given, as strings), or a
    ``BadUsageQuery`` (400) naming the first parameter that is wrong.

    With ``tenant`` the query reads that tenant's rows only, whatever it asks: a ``tenants`` filter
    naming any other tenant is the 404 of a tenant that does not exist (existing or not), and its
    page tokens are bound to the restricted query."""
    unknown = sorted({k.removesuffix("[]") for k in params} - set(PARAMETERS))
    if unknown:
        raise _bad(unknown[0], f"unknown parameter {unknown[0]!r}; this query takes {', '.join(PARAMETERS)}",
                   code="unknown_parameter")
    width = _one(params, "bucket_width") or "1d"
    if width not in WIDTHS:
        raise _bad("bucket_width", f"bucket_width must be one of {', '.join(WIDTHS)}, got {width[:20]!r}")
    seconds = WIDTHS[width][1]
    start = _int(params, "start_time", 0, MAX_TIME)
    if start is None:
        raise _bad("start_time", "start_time is required (unix seconds, the window's first second)",
                   code="missing_parameter")
    end = _int(params, "end_time", 0, MAX_TIME)
    if end is None:
        end = int(now if now is not None else time.time()) + 1
    if end <= start:
        raise _bad("end_time", f"end_time ({end}) must be after start_time ({start})")
    groups = _values(params, "group_by")
    for g in groups:
        if g not in GROUP_KEYS:
            raise _bad("group_by", f"group_by takes {', '.join(GROUP_KEYS)}, got {g[:40]!r}")
    filters: dict[str, Any] = {}  # UsageQuery's tenants, aliases and versions: tuples of names
    for name in FILTERS:
        values = _values(params, name)
        if len(values) > MAX_FILTER_VALUES:
            raise _bad(name, f"{name} lists {len(values)} values; at most {MAX_FILTER_VALUES}")
        for v in values:
            if len(v) > MAX_VALUE_CHARS:
                raise _bad(name, f"{name} has a value over {MAX_VALUE_CHARS} characters")
            if not v.isprintable():  # no name holds one, and PostgreSQL refuses a NUL outright
                raise _bad(name, f"{name} has a value with a control character")
        filters[name] = tuple(dict.fromkeys(values))
    if tenant is not None:
        other = next((t for t in filters["tenants"] if t != tenant), None)
        if other is not None:
            raise NotFound(f"Tenant '{other[:64]}' not found.", code="tenant_not_found", param="tenants")
        filters["tenants"] = (tenant,)
    default, most = LIMITS[width]
    limit = _int(params, "limit", 1, most)
    q = UsageQuery(start - start % seconds, -(-end // seconds) * seconds, width,
                   tuple(dict.fromkeys(groups)), limit=limit or default, max_rows=max_rows, **filters)
    token = _one(params, "page")
    if token:
        at, token_end = _read_token(token, q)
        if token_end % seconds or not q.start_time < token_end <= MAX_TIME + seconds:
            raise _bad("page", "page is not a page token of this API (give next_page as it came)")
        if _one(params, "end_time") is None:
            q = replace(q, end_time=token_end)  # "now" moved on since the first page: keep its window
        elif token_end != q.end_time:
            raise _bad("page", "page belongs to a query with another end_time")
        if not q.start_time <= at < q.end_time or at % seconds:
            raise _bad("page", "page is not a bucket of this window")
        q = replace(q, page_start=at)
    return q


def _make_token(q: UsageQuery, at: int) -> str:
    raw = orjson.dumps({"at": at, "end": q.end_time, "q": q.fingerprint()})
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _read_token(token: str, q: UsageQuery) -> tuple[int, int]:
    """The next page's first bucket and the window's end from a page token (``next_page``)."""
    try:
        if len(token) > 200:
            raise ValueError
        data = orjson.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        at, end, fp = data["at"], data["end"], data["q"]
        if not (isinstance(at, int) and isinstance(end, int) and isinstance(fp, str)):
            raise ValueError
    except (ValueError, TypeError, KeyError, binascii.Error, orjson.JSONDecodeError):
        raise _bad("page", "page is not a page token of this API (give next_page as it came)") from None
    if fp != q.fingerprint():
        raise _bad("page", "page belongs to another query (its parameters but page and end_time must stay the same)")
    return at, end


# --- reading -------------------------------------------------------------------------------------

_UB = UsageBucket.__table__
_KIND = "organization.usage.completions.result"
_COARSER = {"h": "m", "d": "h"}


async def _watermarks(s: AsyncSession) -> dict[str, int]:
    """How far hours (``h``) and days (``d``) are complete, and the days whose results are kept
    per tenant (``t``), each aligned down to its own width."""
    rows = (await s.execute(select(UsageRollup.width, UsageRollup.done_until))).all()
    got = {w: int(u) for w, u in rows}
    return {w: got.get(w, 0) - got.get(w, 0) % sec for w, sec in (("h", 3600), ("d", 86400), ("t", 86400))}


def _sources(width: str, lo: int, hi: int, marks: dict[str, int]) -> list[tuple[str, int, int]]:
    """The ledger rows a page ``[lo, hi)`` of buckets of ``width`` is summed from: ``(width code,
    from, until)`` per stored width, coarse rows before their watermark and finer ones after."""
    if width == "m":
        spans = [("m", lo, hi)]
    elif width == "h":
        spans = [("h", lo, min(hi, marks["h"])), ("m", max(lo, marks["h"]), hi)]
    else:
        d, h = marks["d"], max(marks["d"], marks["h"])
        spans = [("d", lo, min(hi, d)), ("h", max(lo, d), min(hi, h)), ("m", max(lo, h), hi)]
    return [(code, a, b) for code, a, b in spans if a < b]


def _where(q: UsageQuery, source: str, a: int, b: int) -> list[Any]:
    """The rows of width ``source`` from ``a`` until ``b`` that the query's filters let through."""
    where = [_UB.c.width == source, _UB.c.start >= a, _UB.c.start < b]
    for name, column in FILTERS.items():
        values = getattr(q, name)
        if values:
            where.append(_UB.c[column].in_(values) if len(values) > 1 else _UB.c[column] == values[0])
    return where


def _statement(q: UsageQuery, lo: int, hi: int, marks: dict[str, int], dialect: str, top: int | None = None) -> Any:
    """One ``GROUP BY`` over the page's rows: per bucket and group, the sums, the ``ok`` requests and
    the other outcomes' requests joined into one text (``_outcomes`` adds them up). Grouping by the
    outcome too would sort every row again; this way a day of 100k tenants is one pass in key order.
    With ``top``: per group over the whole of ``[lo, hi)``, the ``top`` with the most tokens."""
    code, seconds = WIDTHS[q.bucket_width]
    keys = [k for k in GROUP_KEYS if k in q.group_by]
    parts = []
    for source, a, b in _sources(code, lo, hi, marks):
        bucket = _UB.c.start if source == code else _UB.c.start - _UB.c.start % seconds
        parts.append(select(bucket.label("b"), *[_UB.c[k] for k in keys if k != "outcome"], _UB.c.outcome,
                            _UB.c.requests, _UB.c.prompt_tokens, _UB.c.cached_tokens, _UB.c.completion_tokens)
                     .where(*_where(q, source, a, b)))
    if not parts:
        return None
    rows = (parts[0] if len(parts) == 1 else union_all(*parts)).subquery("rows")
    group = [*([] if top else [rows.c.b]), *[rows.c[k] for k in keys]]
    item = rows.c.outcome + literal(_OUTCOME_SEP) + cast(rows.c.requests, String)
    joined = func.string_agg(item, literal(_ITEM_SEP)) if dialect == "postgresql" \
        else func.group_concat(item, literal(_ITEM_SEP))
    total = [cast(func.sum(c), BigInteger) for c in (rows.c.requests, rows.c.prompt_tokens, rows.c.cached_tokens,
                                                      rows.c.completion_tokens)]
    ok = cast(func.sum(rows.c.requests).filter(rows.c.outcome == "ok"), BigInteger)
    stmt = select(*group, *total, ok, joined.filter(rows.c.outcome != "ok")).group_by(*group)
    if top:
        tokens = func.sum(rows.c.prompt_tokens) + func.sum(rows.c.completion_tokens)
        return stmt.order_by(tokens.desc(), *group).limit(top)
    return stmt.order_by(*group).limit(q.max_rows + 1)


def _outcomes(ok: int | None, joined: str | None) -> dict[str, int]:
    out: dict[str, int] = {"ok": ok} if ok else {}
    if joined:
        for item in joined.split(_ITEM_SEP):
            outcome, _, n = item.rpartition(_OUTCOME_SEP)
            out[outcome] = out.get(outcome, 0) + int(n)
    return out


def _too_many(q: UsageQuery) -> BadUsageQuery:
    return _bad(None, f"this page would hold more than {q.max_rows:,} results (usage_query_max_rows): narrow it "
                      f"with a shorter window, a smaller limit, fewer group_by keys or a tenants/aliases/versions "
                      f"filter", code="too_many_rows")


def _page_span(q: UsageQuery) -> tuple[int, int]:
    """The page's buckets: ``[lo, hi)``."""
    lo = q.page_start if q.page_start is not None else q.start_time
    return lo, min(q.end_time, lo + q.limit * q.seconds)


def _page(q: UsageQuery, lo: int, hi: int, by_bucket: Mapping[int, Any], empty: Any) -> dict[str, Any]:
    seconds = q.seconds
    data = [{"object": "bucket", "start_time": b, "end_time": b + seconds, "results": by_bucket.get(b, empty)}
            for b in range(lo, hi, seconds)]
    more = hi < q.end_time
    return {"object": "page", "data": data, "has_more": more, "next_page": _make_token(q, hi) if more else None}


_COUNTS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")


def _text(sql: str) -> Any:
    """SQL text of a constant of this module, never a value from the request."""
    return literal_column(sql, Text)


def results_select(rows: Any, keys: list[str]) -> Select[Any]:
    """Per group ``(b, *keys)`` of ``rows`` (a subquery of the bucket ``b``, the ``keys`` but the
    outcome, ``outcome`` and the four counts), the group's result as the page's JSON text:
    ``(b, *keys, item)``, unordered. The sums of each group and outcome first, then each group's
    object with its outcomes in outcome order. The one rendering of a result on PostgreSQL: a page
    read from the ledger (``_json_statement``) and the finished days' results kept per tenant
    (``registry.usage_tenant_days``) are the same bytes."""
    plain = [k for k in keys if k != "outcome"]
    by_outcome = [rows.c.b, *[rows.c[k] for k in plain], rows.c.outcome]
    one = select(*by_outcome, *[func.sum(rows.c[c]).label(c) for c in _COUNTS]).group_by(*by_outcome).subquery("one")

    def total(c: str) -> Any:
        return cast(cast(func.sum(one.c[c]), BigInteger), Text)

    outcomes = func.json_object_agg(one.c.outcome, aggregate_order_by(cast(one.c.requests, BigInteger), one.c.outcome))
    item = (_text(f"""'{{"object":"{_KIND}","input_tokens":'""") + total("prompt_tokens")
            + _text("""',"input_cached_tokens":'""") + total("cached_tokens")
            + _text("""',"output_tokens":'""") + total("completion_tokens")
            + _text("""',"num_model_requests":'""") + total("requests")
            + _text("""',"outcomes":'""") + cast(outcomes, Text))
    for k in keys:  # a name is quoted by the database's own JSON encoder
        item = item + _text(f"""',"{k}":'""") + cast(func.to_json(one.c[k]), Text)
    item = item + _text("'}'")
    group = [one.c.b, *[one.c[k] for k in keys]]
    return select(*group, item.label("item")).group_by(*group)


def _buckets_of(two: Any, order: list[Any]) -> Select[Any]:
    """Per bucket of ``two`` (``b``, the groups, ``item``): ``(b, results, the JSON array of the
    items)``, sorted by ``order`` in the aggregate (none: no group keys, one result a bucket). The
    array is the text the page holds as it is (a day of 100k tenants: 20 MB not copied again)."""
    comma: ColumnClause[Any] = literal_column("','")
    joined = func.string_agg(two.c.item, aggregate_order_by(comma, *order) if order else comma)
    return select(two.c.b, func.count(), _text("'['") + joined + _text("']'")).group_by(two.c.b)


def _json_statement(q: UsageQuery, lo: int, hi: int, marks: dict[str, int]) -> Any:
    """PostgreSQL builds the page's results as JSON text, one row per bucket: ``(start, results,
    the results' JSON array items joined by commas)``. A page of 100k results (a day by tenant) is
    then one string to the gateway, whose event loop spends some 25 ms on it instead of the 0.3-0.4 s
    that decoding 100k rows and building and encoding their dicts took. Each result is rendered by
    ``results_select``; at most ``max_rows + 1`` groups are built."""
    code, seconds = WIDTHS[q.bucket_width]
    keys = [k for k in GROUP_KEYS if k in q.group_by]
    plain = [k for k in keys if k != "outcome"]
    parts = []
    for source, a, b in _sources(code, lo, hi, marks):
        bucket = _UB.c.start if source == code else _UB.c.start - _UB.c.start % seconds
        parts.append(select(bucket.label("b"), *[_UB.c[k] for k in plain], _UB.c.outcome,
                            *[_UB.c[c] for c in _COUNTS]).where(*_where(q, source, a, b)))
    if not parts:
        return None
    rows = (parts[0] if len(parts) == 1 else union_all(*parts)).subquery("rows")
    items = results_select(rows, keys)
    two = items.order_by(*items.selected_columns[:-1]).limit(q.max_rows + 1).subquery("two")
    return _buckets_of(two, [two.c[k] for k in keys])


def _from_tenant_days(q: UsageQuery, hi: int, marks: dict[str, int]) -> bool:
    """The page is made of finished days' results kept per tenant (``UsageTenantDay``): days by
    tenant, at most filtered by tenant, all before the ``t`` watermark."""
    return q.bucket_width == "1d" and q.group_by == ("tenant",) and not q.aliases and not q.versions \
        and hi <= marks["t"]


_TENANT_DAYS_SQL = ("SELECT day, result FROM usage_tenant_days WHERE day >= $1 AND day < $2{} "
                    "ORDER BY day, tenant LIMIT $3")
"""The page's results kept per tenant and day, in page order. The ORDER BY is the statement's
own, so the order is guaranteed whatever the plan (an aggregate joining a subquery's ordered
rows keeps their order only as it happens to); the primary key ``(day, tenant)`` gives it, an
index scan with no sort."""


async def _tenant_days_json(session: AsyncSession, q: UsageQuery, lo: int, hi: int) -> dict[int, str]:
    """``_page_json``'s buckets from the results kept per tenant and day: no sums at all, each
    bucket's rendered results joined here in the order the statement gives them, into the page's
    JSON array. Read through the session's asyncpg connection, in its transaction: SQLAlchemy's
    result rows for a day of 100k tenants cost some 0.15 s more than the driver's records. A
    page that would hold more than ``max_rows`` results is refused."""
    args: list[Any] = [lo, hi, q.max_rows + 1]
    sql = _TENANT_DAYS_SQL.format("")
    if q.tenants:
        sql = _TENANT_DAYS_SQL.format(" AND tenant = ANY($4::varchar[])")
        args.append(list(q.tenants))
    asyncpg = (await (await session.connection()).get_raw_connection()).driver_connection
    assert asyncpg is not None, "a session's connection is checked out while it is used"
    rows = await asyncpg.fetch(sql, *args)
    if len(rows) > q.max_rows:
        raise _too_many(q)
    by_bucket: dict[int, str] = {}
    for day, results in groupby(rows, key=itemgetter(0)):
        by_bucket[day] = f"[{','.join([r[1] for r in results])}]"
    return by_bucket


PAGE_CACHE_BYTES = 64 << 20
"""The most JSON one engine keeps of finished days' pages (a day of 100k tenants by tenant is 20 MB)."""


class FinishedPages:
    """The JSON of pages of finished days, by query, all read at one count of the day width's late
    writes (``UsageLateWrites``): a page asked for or kept at another count empties it first (the
    rows changed), and the least recently read go past ``budget`` bytes. One per engine
    (``finished_pages``); ``hits`` and ``misses`` count the pages asked for."""

    def __init__(self, budget: int = PAGE_CACHE_BYTES) -> None:
        self.budget = budget
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._late: int | None = None
        self._pages: OrderedDict[UsageQuery, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pages)

    def get(self, q: UsageQuery, late: int) -> bytes | None:
        if late != self._late:
            self.clear()
            self._late = late
        body = self._pages.get(q)
        if body is None:
            self.misses += 1
            return None
        self._pages.move_to_end(q)
        self.hits += 1
        return body

    def put(self, q: UsageQuery, late: int, body: bytes) -> None:
        """Keep ``body``, read at ``late``: unless the count has moved on since (then it may be stale)."""
        if late != self._late or len(body) > self.budget:
            return
        old = self._pages.pop(q, None)
        self.bytes += len(body) - (len(old) if old is not None else 0)
        self._pages[q] = body
        while self.bytes > self.budget:
            self.bytes -= len(self._pages.popitem(last=False)[1])

    def clear(self) -> None:
        self._pages.clear()
        self.bytes = 0


_FINISHED: weakref.WeakKeyDictionary[Engine, FinishedPages] = weakref.WeakKeyDictionary()


def finished_pages(engine: AsyncEngine) -> FinishedPages:
    """``engine``'s finished pages (made on first use, gone with the engine)."""
    pages = _FINISHED.get(engine.sync_engine)
    if pages is None:
        pages = _FINISHED[engine.sync_engine] = FinishedPages()
    return pages


async def _late_days(s: AsyncSession) -> int:
    """How many flushes have added late minutes to day rows (0: none ever has)."""
    got = (await s.execute(select(UsageLateWrites.flushes).where(UsageLateWrites.width == "d"))).scalar()
    return int(got or 0)


async def read_usage_json(session: AsyncSession, q: UsageQuery) -> bytes:
    """``read_usage``'s page as the JSON the API answers with: on PostgreSQL built by the database
    (``_json_statement``), elsewhere encoded from ``read_usage``'s; a page of finished days from
    the engine's ``FinishedPages`` when it holds it at the current count of late writes."""
    lo, hi = _page_span(q)
    marks = await _watermarks(session)
    if q.bucket_width != "1d" or hi > marks["d"]:  # a day still open: minutes and hours change
        return await _page_json(session, q, lo, hi, marks)
    pages = finished_pages(_engine(session))
    late = await _late_days(session)  # before the page: a late flush after it moves the count on
    body = pages.get(q, late)
    if body is None:
        body = await _page_json(session, q, lo, hi, marks)
        pages.put(q, late, body)
    return body


def _engine(session: AsyncSession) -> AsyncEngine:
    """The engine ``session`` is bound to (the registry's sessions always are)."""
    bind = session.bind
    assert isinstance(bind, AsyncEngine), "usage pages are read by sessions bound to an engine"
    return bind


async def _page_json(session: AsyncSession, q: UsageQuery, lo: int, hi: int, marks: dict[str, int]) -> bytes:
    """The page ``[lo, hi)`` read from the ledger as JSON."""
    if _engine(session).dialect.name != "postgresql":
        return orjson.dumps(await _read_rows(session, q, lo, hi, marks))
    if _from_tenant_days(q, hi, marks):
        kept = await _tenant_days_json(session, q, lo, hi)
        by_bucket = {b: orjson.Fragment(items) for b, items in kept.items()}
    else:
        stmt = _json_statement(q, lo, hi, marks)
        rows = (await session.execute(stmt)).all() if stmt is not None else []
        if sum(n for _, n, _ in rows) > q.max_rows:
            raise _too_many(q)
        by_bucket = {b: orjson.Fragment(items) for b, _, items in rows}
    return orjson.dumps(_page(q, lo, hi, by_bucket, orjson.Fragment(b"[]")))


async def read_usage(session: AsyncSession, q: UsageQuery) -> dict[str, Any]:
    """One page of the query's buckets (``{"object": "page", "data", "has_more", "next_page"}``)."""
    if _engine(session).dialect.name == "postgresql":
        page: dict[str, Any] = orjson.loads(await read_usage_json(session, q))
        return page
    lo, hi = _page_span(q)
    return await _read_rows(session, q, lo, hi, await _watermarks(session))


async def _read_rows(session: AsyncSession, q: UsageQuery, lo: int, hi: int, marks: dict[str, int]) -> dict[str, Any]:
    """The page from the grouped rows, built in Python (SQLite: its aggregates keep no order)."""
    stmt = _statement(q, lo, hi, marks, _engine(session).dialect.name)
    rows = (await session.execute(stmt)).all() if stmt is not None else []
    if len(rows) > q.max_rows:
        raise _too_many(q)
    keys = [k for k in GROUP_KEYS if k in q.group_by]
    by_bucket: dict[int, list[dict[str, Any]]] = {}
    n = len(keys)
    kind = _KIND
    for row in rows:  # a page may hold 100k results: plain indexing, no per-row helpers but the outcomes
        result = {"object": kind, "input_tokens": row[n + 2], "input_cached_tokens": row[n + 3],
                  "output_tokens": row[n + 4], "num_model_requests": row[n + 1],
                  "outcomes": {"ok": row[n + 5]} if row[n + 6] is None else _outcomes(row[n + 5], row[n + 6])}
        if n:
            result.update(zip(keys, row[1:n + 1], strict=True))
        bucket = by_bucket.get(row[0])
        if bucket is None:
            bucket = by_bucket[row[0]] = []
        bucket.append(result)
    return _page(q, lo, hi, by_bucket, [])


async def usage_totals(session: AsyncSession, q: UsageQuery, top: int) -> list[dict[str, Any]]:
    """The window's sums per group of ``q.group_by`` (the whole window: one group without it), the
    ``top`` groups with the most tokens (prompt + completion) first: the console's tables."""
    stmt = _statement(q, q.start_time, q.end_time, await _watermarks(session), _engine(session).dialect.name, top=top)
    if stmt is None:
        return []
    keys = [k for k in GROUP_KEYS if k in q.group_by]
    n = len(keys)
    out = []
    for row in (await session.execute(stmt)).all():
        if row[n] is None:  # no group: the sums of no rows
            continue
        out.append({**dict(zip(keys, row[:n], strict=True)), "num_model_requests": row[n], "input_tokens": row[n + 1],
                    "input_cached_tokens": row[n + 2], "output_tokens": row[n + 3],
                    "outcomes": _outcomes(row[n + 4], row[n + 5])})
    return out


# --- the gateway's reader ------------------------------------------------------------------------

class UsageReader:
    """Usage pages from the registry database for the gateway (``GET /v1/usage``): a pool of its
    own, opened on first use (a gateway nobody asks never connects), and every database failure a
    ``registry.errors.Unavailable`` (503, ``retry-after``), never the driver's exception."""

    def __init__(self, settings: Settings, engine: AsyncEngine | None = None) -> None:
        self.settings = settings
        self._db = LazyDatabase(settings, engine, pool_size=2, max_overflow=4)

    def parse(self, params: Mapping[str, Iterable[str]], tenant: str) -> UsageQuery:
        """The query of ``tenant``'s own rows (``parse_usage_query``)."""
        return parse_usage_query(params, max_rows=self.settings.usage_query_max_rows, tenant=tenant)

    async def page(self, q: UsageQuery) -> dict[str, Any]:
        async with unavailable_on_database_failure("nothing was read"), self._db.sessions() as s:
            return await read_usage(s, q)

    async def close(self) -> None:
        await self._db.close()


def utc(ts: int) -> str:
    """A bucket's start as people read it (``2026-12-07 08:00``, UTC)."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M")
