"""The console's usage pages: the fleet's (tokens and requests per bucket, the top tenants) and a
tenant's (the same charts, by alias and version, outcomes), read from the usage ledger as
``GET /admin/usage`` reads it (``registry.usage_query``).

The charts are drawn here as SVG geometry (stacked bars, one per bucket, a ``<title>`` each for its
numbers) and put in the page by the template: nothing is fetched or computed in the browser, no
library, and the page's text says the same as its bars.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from registry.service import RegistryService
from registry.usage_query import UsageQuery, parse_usage_query, read_usage, usage_totals

WINDOWS: dict[str, tuple[int, str, str]] = {"24h": (86400, "1h", "1h"), "7d": (7 * 86400, "1h", "1d"),
                                            "30d": (30 * 86400, "1d", "1d")}
"""The windows the pages offer -> (seconds, the charts' bucket width, the tables' width). A window
ends with the current bucket of the tables' width: 7 days are the last 7 UTC days, today's
included, so its tables sum day rows where the rollup has made them, not every hour of a week."""
DEFAULT_WINDOW = "7d"
TOP = 20
"""Tenants on the fleet page, and aliases/versions on a tenant's, with the most tokens."""
TOKENS = (("input", "input (not cached)", "#2456c7"), ("cached", "input, cached", "#8fb0f0"),
          ("output", "output", "#0f8b8d"))
OUTCOMES = (("ok", "ok", "#1e7b34"), ("cancelled", "cancelled", "#a67c00"), ("4xx", "4xx refused", "#5b6475"),
            ("429", "429 rate limited", "#c75d24"), ("5xx", "5xx failed", "#b3261e"))
W, H, LEFT, RIGHT, TOP_PAD, BOTTOM = 420, 160, 44, 8, 8, 22


@dataclass(frozen=True)
class Chart:
    caption: str
    bars: list[dict[str, Any]]
    """Each bar's rects: ``x``, ``y``, ``w``, ``h``, ``fill``, ``title``."""
    legend: list[tuple[str, str]]
    top: str
    first: str
    last: str
    axis_y: float
    empty: bool


def compact(n: float) -> str:
    """1234567 -> ``1.2M``: a chart's axis label."""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


def outcome_class(outcome: str) -> str:
    """``4xx:invalid_value`` -> ``4xx``; ``ok``, ``cancelled`` as they are."""
    return outcome.split(":", 1)[0]


def _stack(buckets: list[dict[str, Any]], series: tuple[tuple[str, str, str], ...], values: Any, caption: str,
           width: str) -> Chart:
    """Stacked bars: ``values(bucket) -> {series key: number}``, one bar per bucket."""
    stacks = [values(b) for b in buckets]
    peak = max([sum(v.values()) for v in stacks] + [0])
    scale = peak or 1
    step = (W - LEFT - RIGHT) / max(1, len(buckets))
    fmt = "%m-%d" if width == "1d" else "%m-%d %H:%M"
    bars = []
    for i, (b, v) in enumerate(zip(buckets, stacks, strict=True)):
        y = H - BOTTOM
        when = datetime.fromtimestamp(b["start_time"], UTC).strftime(fmt)
        rects = []
        for key, label, color in series:
            n = v.get(key, 0)
            if not n:
                continue
            h = (H - BOTTOM - TOP_PAD) * n / scale
            y -= h
            rects.append({"x": round(LEFT + i * step + step * 0.1, 1), "y": round(y, 1),
                          "w": round(max(step * 0.8, 0.6), 1), "h": round(max(h, 0.5), 1), "fill": color,
                          "title": f"{when} UTC: {label} {n:,}"})
        bars.append({"start": b["start_time"], "rects": rects})
    last = buckets[-1]["start_time"] if buckets else 0
    return Chart(caption, bars, [(label, color) for _, label, color in series], compact(peak),
                 datetime.fromtimestamp(buckets[0]["start_time"] if buckets else 0, UTC).strftime(fmt),
                 datetime.fromtimestamp(last, UTC).strftime(fmt), H - BOTTOM, peak == 0)


def _bucket_sums(bucket: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
    tokens = {"input": 0, "cached": 0, "output": 0}
    outcomes = {k: 0 for k, _, _ in OUTCOMES}
    for r in bucket["results"]:
        tokens["input"] += r["input_tokens"] - r["input_cached_tokens"]
        tokens["cached"] += r["input_cached_tokens"]
        tokens["output"] += r["output_tokens"]
        for o, n in r["outcomes"].items():
            k = outcome_class(o)
            outcomes[k] = outcomes.get(k, 0) + n
    return tokens, outcomes


def charts(buckets: list[dict[str, Any]], width: str) -> list[Chart]:
    """The tokens and the requests (by outcome) per bucket."""
    per = {"1h": "hour", "1d": "day"}[width]
    return [_stack(buckets, TOKENS, lambda b: _bucket_sums(b)[0], f"tokens per {per}", width),
            _stack(buckets, OUTCOMES, lambda b: _bucket_sums(b)[1], f"requests per {per}, by outcome", width)]


STEP = {"1h": 3600, "1d": 86400}


def _query(window: str, now: float, *, table: bool = False, **params: list[str]) -> UsageQuery:
    """The window in buckets of the charts' width (one page: 24, 168 or 30), or of the tables' (``table``)."""
    seconds, chart, coarse = WINDOWS[window]
    width = coarse if table else chart
    end = (int(now) // STEP[coarse] + 1) * STEP[coarse]
    return parse_usage_query({"start_time": [str(end - seconds)], "end_time": [str(end)], "bucket_width": [width],
                              "limit": [str(seconds // STEP[width])], **params}, max_rows=10_000)


def _ok_first(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's outcomes in reading order: ``ok`` first, then the others by name."""
    for r in rows:
        r["outcomes"] = dict(sorted(r["outcomes"].items(), key=lambda kv: (kv[0] != "ok", kv[0])))
    return rows


def _span(q: UsageQuery) -> dict[str, str]:
    """The window as the page says it (UTC)."""
    return {k: datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M") for k, t in
            (("start", q.start_time), ("end", q.end_time))}


async def _buckets(service: RegistryService, q: UsageQuery) -> list[dict[str, Any]]:
    async with service.db.read() as s:
        page = await read_usage(s, q)
    return page["data"]


async def fleet_usage(service: RegistryService, window: str, now: float | None = None) -> dict[str, Any]:
    """The fleet page: the charts over the window and the ``TOP`` tenants by tokens."""
    now = time.time() if now is None else now
    q = _query(window, now)
    buckets = await _buckets(service, q)
    async with service.db.read() as s:
        tenants = await usage_totals(s, _query(window, now, table=True, group_by=["tenant"]), TOP)
        total = await usage_totals(s, _query(window, now, table=True), 1)
    return {"window": window, "windows": list(WINDOWS), "charts": charts(buckets, q.bucket_width),
            "tenants": _ok_first(tenants), "total": total[0] if total else None, "top": TOP, **_span(q)}


async def tenant_usage(service: RegistryService, slug: str, window: str, now: float | None = None) -> dict[str, Any]:
    """A tenant's page: its charts, its usage by alias and version, and its outcomes."""
    await service.get_tenant(slug)  # a missing tenant is the registry's 404
    now = time.time() if now is None else now
    q = _query(window, now, tenants=[slug])
    buckets = await _buckets(service, q)
    async with service.db.read() as s:
        versions = await usage_totals(s, _query(window, now, table=True, group_by=["alias,version"], tenants=[slug]),
                                      TOP)
        outcomes = await usage_totals(s, _query(window, now, table=True, group_by=["outcome"], tenants=[slug]), 100)
        total = await usage_totals(s, _query(window, now, table=True, tenants=[slug]), 1)
    return {"slug": slug, "window": window, "windows": list(WINDOWS), "charts": charts(buckets, q.bucket_width),
            "versions": _ok_first(versions), "outcomes": sorted(outcomes, key=lambda r: (r["outcome"] != "ok", r["outcome"])),
            "total": total[0] if total else None, "top": TOP, **_span(q)}
