"""``loraplex admin usage``: the usage ledger through ``GET /admin/usage``, every page of the window,
as a table (people), ``--json`` (the API's page shape, all buckets in one) or ``--csv`` (one line per
bucket and group, a column per outcome: for a spreadsheet or a billing script)."""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import time
from datetime import UTC, datetime
from typing import Any

from registry.admin_client import admin_request

GROUP_KEYS = ("tenant", "alias", "version", "outcome")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
PAGE_BUCKETS = {"1m": 1440, "1h": 168, "1d": 31}
"""Buckets asked per request unless ``--limit`` says: the most a page may hold (fewer requests)."""
MAX_PAGES = 10_000
"""Pages one command follows (a window of minutes over ten years): past it, the command stops and says so."""


def time_arg(value: str, now: float | None = None) -> int:
    """Unix seconds from unix seconds, ``now``, a time ago (``90m``, ``24h``, ``7d``, ``2w``) or an ISO date
    or date-time (UTC unless it names its offset)."""
    text = value.strip()
    now = time.time() if now is None else now
    if text.isdigit():
        return int(text)
    if text == "now":
        return int(now)
    ago = re.fullmatch(r"(\d{1,7})([smhdw])", text)
    if ago:
        return int(now) - int(ago.group(1)) * UNITS[ago.group(2)]
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a time: {value!r} (unix seconds, 'now', 24h / 7d ago, or an ISO "
                                         f"date such as 2026-12-01 or 2026-12-01T08:00)") from None
    return int((at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp())


def _when(start: int, width: str) -> str:
    fmt = "%Y-%m-%d" if width == "1d" else "%Y-%m-%d %H:%M"
    return datetime.fromtimestamp(start, UTC).strftime(fmt)


def _outcomes(r: dict[str, Any]) -> str:
    ordered = sorted(r["outcomes"].items(), key=lambda kv: (kv[0] != "ok", kv[0]))
    return ", ".join(f"{k} {n:,}" for k, n in ordered)


def _rows(page: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    return [(b["start_time"], r) for b in page["data"] for r in b["results"]]


def usage_table(page: dict[str, Any], keys: list[str], width: str) -> str:
    """Buckets with usage, one line per bucket and group, and the window's total."""
    rows = _rows(page)
    if not rows:
        return "(no usage in this window)"
    head = ["BUCKET (UTC)", *[k.upper() for k in keys], "REQUESTS", "INPUT", "CACHED", "OUTPUT", "OUTCOMES"]
    cells = [head] + [[_when(start, width), *[r.get(k) or ("(base)" if k == "version" else "-") for k in keys],
                       f"{r['num_model_requests']:,}", f"{r['input_tokens']:,}", f"{r['input_cached_tokens']:,}",
                       f"{r['output_tokens']:,}", _outcomes(r)] for start, r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    numeric = {len(keys) + i for i in range(1, 5)}
    lines = ["  ".join(c.rjust(w) if i in numeric and n else c.ljust(w)
                       for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()
             for n, row in enumerate(cells)]
    total = {k: sum(r[k] for _, r in rows) for k in ("num_model_requests", "input_tokens", "input_cached_tokens",
                                                     "output_tokens")}
    lines.append(f"total: {total['num_model_requests']:,} requests, {total['input_tokens']:,} input tokens "
                 f"({total['input_cached_tokens']:,} cached), {total['output_tokens']:,} output tokens")
    return "\n".join(lines)


def usage_csv(page: dict[str, Any], keys: list[str]) -> str:
    """A header, then one line per bucket and group: its start (unix and UTC), the group, the sums, and
    the requests of each outcome seen in the window (a column each)."""
    rows = _rows(page)
    outcomes = sorted({o for _, r in rows for o in r["outcomes"]}, key=lambda o: (o != "ok", o))
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["start_time", "start_utc", *keys, "num_model_requests", "input_tokens", "input_cached_tokens",
                "output_tokens", *outcomes])
    for start, r in rows:
        w.writerow([start, datetime.fromtimestamp(start, UTC).isoformat(timespec="minutes").replace("+00:00", "Z"),
                    *[r.get(k, "") for k in keys], r["num_model_requests"], r["input_tokens"],
                    r["input_cached_tokens"], r["output_tokens"], *[r["outcomes"].get(o, 0) for o in outcomes]])
    return out.getvalue()


def usage(a: argparse.Namespace) -> int:
    asked = {g.strip() for g in (a.group_by or "").split(",")}
    keys = [k for k in GROUP_KEYS if k in asked]  # another key: the API refuses it, naming group_by
    params: dict[str, Any] = {"start_time": a.start, "end_time": a.end, "bucket_width": a.width,
                              "group_by": a.group_by or None, "tenants": a.tenant, "aliases": a.alias,
                              "versions": a.versions, "limit": a.limit or PAGE_BUCKETS[a.width]}
    merged: dict[str, Any] = {"object": "page", "data": [], "has_more": False, "next_page": None}
    token = None
    for _ in range(MAX_PAGES):
        page = admin_request(a, "GET", "/usage", params=params | {"page": token})
        merged["data"] += page["data"]
        token = page["next_page"] if page["has_more"] else None
        if token is None:
            break
    else:
        merged["has_more"], merged["next_page"] = True, token
    if a.json:
        print(json.dumps(merged, indent=2, sort_keys=True))
    elif a.csv:
        print(usage_csv(merged, keys), end="")
    else:
        print(usage_table(merged, keys, a.width))
    if merged["has_more"]:
        print(f"(stopped after {MAX_PAGES} pages: narrow the window)", flush=True)
    return 0


def register(groups: Any, leaf: Any) -> None:
    """The ``usage`` command under ``loraplex admin`` (``leaf`` as ``registry.cli`` makes commands)."""
    p = leaf(groups, "usage", usage, "the usage ledger: tokens, requests and outcomes per bucket and group",
             "Tokens (input, cached input, output), requests and their outcomes (ok, cancelled, 4xx:<code>, "
             "429:<reason>, 5xx:<code>) from the usage ledger, per bucket of a minute, an hour or a day (UTC), "
             "grouped by tenant, alias, adapter version or outcome: GET /admin/usage, every page of the window.\n\n"
             "examples:\n  loraplex admin usage --start 24h --width 1h\n"
             "  loraplex admin usage --start 7d --group-by tenant\n"
             "  loraplex admin usage --start 2026-12-01 --end 2026-12-08 --tenant acme --group-by alias,version --csv")
    p.add_argument("--start", type=time_arg, required=True, metavar="TIME",
                   help="the window's start: unix seconds, an ISO date or date-time (UTC), or a time ago (24h, 7d)")
    p.add_argument("--end", type=time_arg, metavar="TIME", help="the window's end (default now), as --start")
    p.add_argument("--width", choices=["1m", "1h", "1d"], default="1d", help="bucket width (default 1d)")
    p.add_argument("--group-by", metavar="KEYS", help="comma-separated: tenant, alias, version, outcome")
    p.add_argument("--tenant", action="append", help="only this tenant (repeat for more)")
    p.add_argument("--alias", action="append", help="only this alias (repeat for more)")
    p.add_argument("--version", dest="versions", action="append", metavar="VERSION_ID",
                   help="only this adapter version id (repeat for more)")
    p.add_argument("--limit", type=int, help="buckets per request (default: the most, 1d 31, 1h 168, 1m 1440); "
                   "every page is read either way")
    p.add_argument("--csv", action="store_true", help="print CSV: a line per bucket and group, a column per outcome")
