"""``loraplex admin usage`` against a running admin API over a real SQLite ledger: the table, ``--json``
(every page of the window in one), ``--csv``, the times it accepts, and a refusal naming the field."""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
from datetime import UTC, datetime

import pytest

from registry.usage_commands import time_arg
from tests.test_admin_cli import run, server  # noqa: F401  (the fixture)
from tests.test_usage_api import HOUR, _ledger, _sum


@pytest.fixture
def ledger(server):  # noqa: F811
    settings = server[0]
    asyncio.run(_ledger(settings.database_url))
    return settings


def test_the_table_shows_each_group_and_the_total(ledger, capsys):
    code, out, err = run(capsys, "usage", "--start", str(HOUR), "--end", str(HOUR + 7200), "--width", "1h",
                         "--group-by", "tenant,alias")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["BUCKET", "(UTC)", "TENANT", "ALIAS", "REQUESTS", "INPUT", "CACHED", "OUTPUT",
                                "OUTCOMES"]
    day = datetime.fromtimestamp(HOUR, UTC).strftime("%Y-%m-%d %H:00")
    acme = next(line for line in lines if "acme" in line and "support" in line)
    assert acme.startswith(day) and acme.split()[4:8] == ["6", "340", "100", "63"]
    assert acme.endswith("ok 3, 429:tokens 2, cancelled 1")
    assert "secret-alias" in out and "(base)" not in out
    total = _sum()
    assert lines[-1] == (f"total: {total['num_model_requests']:,} requests, {total['input_tokens']:,} input tokens "
                         f"({total['input_cached_tokens']:,} cached), {total['output_tokens']:,} output tokens")


def test_json_holds_every_page_of_the_window(ledger, capsys):
    code, out, err = run(capsys, "usage", "--start", str(HOUR), "--end", str(HOUR + 7200), "--width", "1m",
                         "--limit", "50", "--json", "--tenant", "globex")
    assert code == 0, err
    page = json.loads(out)
    assert [b["start_time"] for b in page["data"]] == list(range(HOUR, HOUR + 7200, 60))
    assert page["has_more"] is False
    got = sum(r["num_model_requests"] for b in page["data"] for r in b["results"])
    assert got == _sum("globex")["num_model_requests"]


def test_csv_has_a_line_per_bucket_and_group_and_a_column_per_outcome(ledger, capsys):
    code, out, err = run(capsys, "usage", "--start", str(HOUR), "--end", str(HOUR + 7200), "--group-by", "tenant",
                         "--csv")
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["tenant"] for r in rows] == ["acme", "globex"]
    for r in rows:
        want = _sum(r["tenant"])
        assert int(r["num_model_requests"]) == want["num_model_requests"]
        assert int(r["input_cached_tokens"]) == want["input_cached_tokens"]
        assert {o: int(r[o]) for o in want["outcomes"]} == want["outcomes"]
    assert list(rows[0])[:3] == ["start_time", "start_utc", "tenant"] and rows[0]["5xx:no_worker"] == "0"


def test_a_refusal_names_the_field(ledger, capsys):
    code, _, err = run(capsys, "usage", "--start", "24h", "--group-by", "model")
    assert code == 1 and "group_by" in err and "400" in err


def test_times_are_unix_seconds_iso_dates_or_a_time_ago():
    now = 1_765_000_000.5
    assert time_arg("1765000000") == 1_765_000_000
    assert time_arg("now", now) == 1_765_000_000
    assert time_arg("24h", now) == 1_765_000_000 - 86400
    assert time_arg("7d", now) == 1_765_000_000 - 7 * 86400
    assert time_arg("90m", now) == 1_765_000_000 - 5400
    assert time_arg("2026-12-01") == int(datetime(2026, 12, 1, tzinfo=UTC).timestamp())
    assert time_arg("2026-12-01T08:00") == int(datetime(2026, 12, 1, 8, tzinfo=UTC).timestamp())
    assert time_arg("2026-12-01T08:00+01:00") == int(datetime(2026, 12, 1, 7, tzinfo=UTC).timestamp())
    for bad in ("yesterday", "24x", "-5", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            time_arg(bad)
