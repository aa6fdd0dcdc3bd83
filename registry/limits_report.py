"""Limit tuning from the usage ledger: per tenant its limits, what it used per minute, how often it
was throttled and why, and a suggested limit per dimension with the reason in words.

    report = await limits_report(service, window="7d", sort="throttled")

It reads the minute buckets (``usage_buckets`` width ``m``): one SQL statement sums them per
(tenant, minute) and hands each tenant's minutes over as one row (the per-minute values as lists);
the percentiles are computed here, in Python, over each tenant's series. That is one code path
for PostgreSQL and SQLite (SQLite has no ``percentile_cont``), and the series of one tenant over a
week is at most 10,080 numbers.

Per minute, per tenant:

- **tokens**: prompt + completion tokens of admitted requests (what the limiter settled; a 429
  carries none). Cached prompt tokens are part of the prompt, as the limiter counts them.
- **requests**: every request, admitted or refused (the demand: a refused request is one the
  tenant wanted to send).
- **concurrency**: the most requests in flight when one was admitted (``peak_concurrent``).
- **throttled**: any ``429:<reason>`` outcome in the minute; ``requests`` is refused on the
  request rate, ``tokens`` and ``too_large`` on the token rate, ``concurrency`` on concurrency.

**Percentiles are over the minutes in which the tenant sent at least one request.** A limit is a
per-minute cap: it only matters in the minutes the tenant sends. Counting idle minutes as zeros
would make the p99 of a tenant that is busy one hour a day (4% of the minutes) the p99 of its
nights, close to zero, and the report would tell the operator to cut the limit of a tenant that
hits it every afternoon. The operator needs "how much does it send in a busy minute", so idle
minutes are left out and the number of minutes with traffic is shown beside each p99 (vLLM and
Envoy report no such figure; this choice is the report's own). The percentile is the nearest-rank
one (an observed minute's value, never interpolated), so p99 of fewer than 100 minutes is the
peak; below ``MIN_MINUTES`` minutes with traffic no limit is suggested ("too little data").

**Suggestion rule**, per dimension: keep the limit when it lies in ``[p99 x 1.1, p99 x 3]``
(enough room, not absurdly loose); otherwise suggest ``p99 x (1 + headroom)`` rounded *up* to two
significant figures, never below the p99. Headroom is ``HEADROOM_PERCENT`` (25%) unless given,
between 10% and 100%: then a suggestion applied lands inside the keep band for the same traffic
(rounding up adds under 10%), so the next report does not move it again. A limit of 0 is
unlimited and kept. A tenant throttled on a dimension has its p99 pressed against its limit,
so the limit falls below p99 x 1.1 and a raise is suggested; the reason names the throttled
minutes.

**Minute retention**: minute buckets are kept for a while (default 7 days) and then rolled up
into hours and pruned. Where the window reaches back past the oldest minute left, and hour
buckets show there was usage before it, the report says it covers only the minutes that remain
(``limited`` and ``note``); it does not mix hour rows in (an hour's total says nothing about its
busiest minute).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from sqlalchemy import String, case, cast, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from registry.errors import NotFound, RegistryError
from registry.models import Tenant, UsageBucket
from registry.records import MAX_LIMIT, SLUG
from registry.service import RegistryService

HEADROOM_PERCENT = 25
"""Headroom a suggestion adds over the p99, in percent (the default)."""
HEADROOM_RANGE = (10, 100)
"""Headroom a caller may ask for: enough that a suggestion applied lands in ``KEEP_BAND``."""
KEEP_BAND = (Fraction(11, 10), Fraction(3))
"""A limit within ``[p99 x 1.1, p99 x 3]`` is kept: room for bursts, not far beyond any use."""
MIN_MINUTES = 100
"""Minutes with traffic needed before a limit is suggested (fewer: a p99 is just the peak)."""
PERCENTILE = 99
DEFAULT_WINDOW = "7d"
WINDOW = re.compile(r"^([1-9][0-9]{0,4})([mhd])$")
UNIT_S = {"m": 60, "h": 3600, "d": 86400}
MIN_WINDOW_S = 3600
MAX_WINDOW_S = 90 * 86400
SORTS = ("throttled", "headroom")
DEFAULT_LIMIT = 100
MAX_ROWS = 1000
DIMENSIONS = ("requests_per_min", "tokens_per_min", "max_concurrent")
REASON_DIMENSION = {"requests": "requests_per_min", "tokens": "tokens_per_min", "too_large": "tokens_per_min",
                    "concurrency": "max_concurrent"}
"""The limiter's 429 reasons (``gateway.ratelimit``) and the limit each one hit."""
UNITS = {"requests_per_min": "requests/min", "tokens_per_min": "tokens/min", "max_concurrent": "concurrent"}
SERIES = {"requests_per_min": "requests", "tokens_per_min": "tokens", "max_concurrent": "concurrency"}


class BadQuery(RegistryError):
    """A report parameter that cannot be read (HTTP 400, naming the parameter)."""

    default_code = "invalid_parameter"


def parse_window(text: str) -> int:
    """``90m``, ``24h``, ``7d`` as seconds (1 hour to 90 days)."""
    m = WINDOW.match(text or "")
    if not m:
        raise BadQuery(f"window must be a number and a unit m, h or d (e.g. 7d, 24h), got {text!r}",
                       param="window")
    seconds = int(m.group(1)) * UNIT_S[m.group(2)]
    if not MIN_WINDOW_S <= seconds <= MAX_WINDOW_S:
        raise BadQuery(f"window must be between 1h and 90d, got {text!r}", param="window")
    return seconds


def round_up_2sf(x: Fraction | float | int) -> int:
    """``x`` rounded up to two significant figures (15,500 -> 16,000; 3.75 -> 4)."""
    n = math.ceil(Fraction(x))
    if n <= 0:
        return 0
    step = 10 ** max(0, len(str(n)) - 2)
    return -(-n // step) * step


def nearest_rank(values: list[int], percent: int = PERCENTILE) -> int:
    """The nearest-rank percentile of ``values`` (sorted here): an observed value, never 0 for
    an empty list's sake (the caller checks there is data)."""
    if not values:
        return 0
    ordered = sorted(values)
    return ordered[-(-percent * len(ordered) // 100) - 1]


def _num(v: int) -> str:
    return f"{v:,}"


def _span(seconds: int) -> str:
    for unit, size in (("d", 86400), ("h", 3600)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size} {unit}"
    return f"{seconds // 60} min"


def suggest(dimension: str, limit: int | None, peak: int, p99: int, minutes: int, throttled: int, span: str,
            headroom_percent: int = HEADROOM_PERCENT) -> dict[str, Any]:
    """One dimension's line of the report: the limit, peak, p99, the share of the limit the p99
    uses, and ``suggested`` (None: keep) with ``reason`` in words."""
    unit = UNITS[dimension]
    used = None if not limit else round(p99 / limit, 4)
    out: dict[str, Any] = {"limit": limit, "peak": peak, "p99": p99, "used": used, "throttled_minutes": throttled,
                           "suggested": None}
    hit = f"; throttled in {_num(throttled)} minute{'s' if throttled != 1 else ''} at {_num(limit or 0)}" \
        if throttled else ""
    if limit is None:
        return out | {"reason": "the tenant is not in the registry: no limit to compare"}
    if limit == 0:
        return out | {"reason": f"unlimited (0); p99 {_num(p99)} {unit} over {span}: keep"}
    if minutes < MIN_MINUTES:
        return out | {"reason": f"too little data: {_num(minutes)} minute{'s' if minutes != 1 else ''} with "
                                f"traffic over {span}, {MIN_MINUTES} needed for a p99{hit}"}
    if p99 == 0:
        return out | {"reason": f"p99 0 {unit} over {span}: nothing to size a limit on; keep"}
    low, high = p99 * KEEP_BAND[0], p99 * KEEP_BAND[1]
    if low <= limit <= high:
        return out | {"reason": f"p99 {_num(p99)} {unit} over {span} uses {used:.0%} of {_num(limit)}, within "
                                f"1.1-3x of p99: keep{hit}"}
    proposed = min(MAX_LIMIT, max(p99, round_up_2sf(Fraction(p99) * (100 + headroom_percent) / 100)))
    if proposed == limit:
        return out | {"reason": f"p99 {_num(p99)} {unit} over {span} + {headroom_percent}% headroom is the "
                                f"limit already: keep{hit}"}
    why = f"p99 {_num(p99)} {unit} over {span} + {headroom_percent}% headroom, rounded up"
    if limit > high:
        why += f"; the limit {_num(limit)} is {limit / p99:.1f}x the p99"
    return out | {"suggested": proposed, "reason": why + hit}


@dataclass
class _Tally:
    """One tenant's minutes with traffic, as the SQL pass hands them over."""

    tokens: list[int] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)
    concurrency: list[int] = field(default_factory=list)
    throttled: int = 0
    throttled_by: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIMENSIONS, 0))


def _is_429() -> Any:
    return UsageBucket.outcome.like("429:%")


def _minutes_stmt(start: int, end: int, tenant: str | None) -> Any:
    """Per tenant: its minutes with traffic, each one's tokens, requests and concurrency as a
    comma-separated list (one row per tenant, not per minute: a week of 100k tenants' minutes
    would be a billion rows to hand over one by one), and the minutes throttled, in all and per
    limit. The per-minute sums happen in the inner query; the outer one only gathers them."""
    refused = _is_429()
    by_dim = {d: UsageBucket.outcome.in_([f"429:{r}" for r, dd in REASON_DIMENSION.items() if dd == d])
              for d in DIMENSIONS}
    per_minute = select(
        UsageBucket.tenant.label("tenant"),
        func.sum(case((refused, 0), else_=UsageBucket.prompt_tokens + UsageBucket.completion_tokens)).label("tokens"),
        func.sum(UsageBucket.requests).label("requests"), func.max(UsageBucket.peak_concurrent).label("conc"),
        func.sum(case((refused, UsageBucket.requests), else_=0)).label("refused"),
        *[func.sum(case((by_dim[d], UsageBucket.requests), else_=0)).label(d) for d in DIMENSIONS],
    ).where(UsageBucket.width == "m", UsageBucket.start >= start, UsageBucket.start < end)
    if tenant is not None:
        per_minute = per_minute.where(UsageBucket.tenant == tenant)
    m = (per_minute.group_by(UsageBucket.tenant, UsageBucket.start)
         .having(func.sum(UsageBucket.requests) > 0).subquery())  # no request: no traffic

    def listed(col: Any) -> Any:
        return func.aggregate_strings(cast(col, String), ",")

    def minutes_with(col: Any) -> Any:
        return func.sum(case((col > 0, 1), else_=0))

    return select(m.c.tenant, listed(m.c.tokens), listed(m.c.requests), listed(m.c.conc),
                  minutes_with(m.c.refused), *[minutes_with(m.c[d]) for d in DIMENSIONS]).group_by(m.c.tenant)


def _ints(listed: str | None) -> list[int]:
    return [int(x) for x in listed.split(",")] if listed else []


async def _tallies(s: AsyncSession, start: int, end: int, tenant: str | None) -> dict[str, _Tally]:
    out: dict[str, _Tally] = {}
    result = await s.stream(_minutes_stmt(start, end, tenant).execution_options(yield_per=1000))
    async for part in result.partitions():
        for slug, tokens, requests, conc, throttled, *by_dim in part:
            out[slug] = _Tally(_ints(tokens), _ints(requests), _ints(conc), int(throttled),
                               {d: int(n) for d, n in zip(DIMENSIONS, by_dim, strict=True)})
    return out


async def _refusals(s: AsyncSession, start: int, end: int, tenant: str | None) -> dict[str, dict[str, int]]:
    """429s per tenant by the limiter's reason (every reason the ledger holds, known or not)."""
    stmt = (select(UsageBucket.tenant, UsageBucket.outcome, func.sum(UsageBucket.requests))
            .where(UsageBucket.width == "m", UsageBucket.start >= start, UsageBucket.start < end, _is_429()))
    if tenant is not None:
        stmt = stmt.where(UsageBucket.tenant == tenant)
    out: dict[str, dict[str, int]] = {}
    for slug, outcome, n in (await s.execute(stmt.group_by(UsageBucket.tenant, UsageBucket.outcome))).all():
        out.setdefault(slug, {})[outcome.split(":", 1)[1]] = int(n)
    return out


async def _coverage(s: AsyncSession, start: int, end: int) -> tuple[int, str | None]:
    """Where the minutes the window asks for begin, and a note when older ones were pruned."""
    oldest = (await s.execute(select(func.min(UsageBucket.start)).where(UsageBucket.width == "m"))).scalar()
    first = start if oldest is None else max(start, int(oldest))
    rolled = (await s.execute(select(func.min(UsageBucket.start)).where(
        UsageBucket.width.in_(("h", "d")), UsageBucket.start + case((UsageBucket.width == "h", 3600), else_=86400)
        > start, UsageBucket.start < (end if oldest is None else first)))).scalar()
    if rolled is None:
        return start, None
    if oldest is None or first >= end:
        return end, ("no minute buckets are left in this window (they were rolled up into hours and pruned): "
                     "the report has no minutes to read")
    return first, (f"minute buckets before {_utc(first)} were rolled up into hours and pruned: the report "
                   f"covers the {_span((end - first) // 60 * 60)} of minutes that remain, not the whole window")


def _utc(epoch: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(epoch))


def _row(slug: str, t: _Tally, tenant: dict[str, Any] | None, refusals: dict[str, int], span: str,
         headroom_percent: int) -> dict[str, Any]:
    minutes = len(t.requests)
    dims = {}
    for d in DIMENSIONS:
        series = getattr(t, SERIES[d])
        dims[d] = suggest(d, None if tenant is None else tenant[d], max(series, default=0), nearest_rank(series),
                          minutes, t.throttled_by[d], span, headroom_percent)
    used = [x["used"] for x in dims.values() if x["used"] is not None]
    apply = {d: x["suggested"] for d, x in dims.items() if x["suggested"] is not None}
    return {"tenant": slug, "status": None if tenant is None else tenant["status"], "minutes": minutes,
            "throttled_minutes": t.throttled, "refused": dict(sorted(refusals.items())),
            "used": max(used) if used else None, "limits": dims, "apply": apply or None,
            "enough_data": minutes >= MIN_MINUTES}


def _sort_key(sort: str) -> Any:
    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        used = -1.0 if r["used"] is None else r["used"]
        if sort == "throttled":
            return (-r["throttled_minutes"], -used, r["tenant"])
        return (-used, -r["throttled_minutes"], r["tenant"])
    return key


async def limits_report(service: RegistryService, *, window: str = DEFAULT_WINDOW, sort: str = "throttled",
                        tenant: str | None = None, limit: int = DEFAULT_LIMIT,
                        headroom_percent: int = HEADROOM_PERCENT, now: float | None = None) -> dict[str, Any]:
    """The report over the last ``window`` (up to the last whole minute), ``limit`` tenants in the
    ``sort`` order; with ``tenant``, that tenant only (404 if it is not in the registry). Bad
    parameters raise ``BadQuery`` (400) naming the parameter."""
    seconds = parse_window(window)
    if sort not in SORTS:
        raise BadQuery(f"sort must be one of {', '.join(SORTS)}, got {sort!r}", param="sort")
    if not 1 <= limit <= MAX_ROWS:
        raise BadQuery(f"limit must be between 1 and {MAX_ROWS}, got {limit}", param="limit")
    if not HEADROOM_RANGE[0] <= headroom_percent <= HEADROOM_RANGE[1]:
        raise BadQuery(f"headroom must be between {HEADROOM_RANGE[0]} and {HEADROOM_RANGE[1]} (percent), got "
                       f"{headroom_percent}", param="headroom")
    end = int(time.time() if now is None else now) // 60 * 60  # the minute under way is not whole yet
    start = end - seconds
    span = _span(seconds)

    if tenant is not None and not SLUG.match(tenant):
        raise NotFound("no such tenant: not a tenant slug", code="tenant_not_found", param="tenant")

    async with service.db.read() as s:
        if tenant is not None and (await s.execute(select(Tenant.slug).where(Tenant.slug == tenant))).first() is None:
            raise NotFound(f"tenant {tenant!r} not found", code="tenant_not_found", param="tenant")
        first, note = await _coverage(s, start, end)
        tallies = await _tallies(s, first, end, tenant)
        refusals = await _refusals(s, first, end, tenant)
        slugs = sorted(set(tallies) | ({tenant} if tenant else set()))
        tenants: dict[str, dict[str, Any]] = {}
        for i in range(0, len(slugs), 500):
            stmt = select(Tenant).where(Tenant.slug.in_(slugs[i:i + 500]))
            tenants |= {t.slug: {"status": t.status, **{d: getattr(t, d) for d in DIMENSIONS}}
                        for t in (await s.execute(stmt)).scalars()}
        total = (await s.execute(select(func.count()).select_from(Tenant))).scalar_one()
    rows = [_row(slug, tallies.get(slug, _Tally()), tenants.get(slug), refusals.get(slug, {}),
                 span, headroom_percent) for slug in slugs]
    rows.sort(key=_sort_key(sort))
    return {
        "object": "limits_report", "window": window, "start": start, "end": end, "covered_from": first,
        "limited": note is not None, "note": note, "sort": sort, "headroom_percent": headroom_percent,
        "keep_band": [float(KEEP_BAND[0]), float(KEEP_BAND[1])], "min_minutes": MIN_MINUTES,
        "percentile": f"p{PERCENTILE}, nearest rank, over the minutes in which the tenant sent a request",
        "tenants_with_traffic": len(tallies), "tenants_total": total,
        "truncated": len(rows) > limit, "data": rows[:limit],
    }
