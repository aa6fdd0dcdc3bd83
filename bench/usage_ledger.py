"""Usage ledger at scale: what it writes to PostgreSQL, what it costs a gateway, how fast it reads.

Real processes on loopback: a fresh PostgreSQL database seeded (plain SQL) with N tenants (default
100k) and a day of ledger rows for every one of them (the day before the run, as hour rows: 1-3
rows per tenant by alias and outcome), which this process then closes with the gateways' own
rollup (``registry.usage.roll_up``: the day rows, the results kept per tenant); a stub worker (``tests/stub_worker.py``, answering at once) and
four ``loraplex gateway`` processes on it: two keeping the ledger (``LORAPLEX_USAGE_FLUSH_INTERVAL_S``
``--flush-interval``, 10 s by default) and two without it (``0``), all with auth (a JWT per
tenant), the Redis limiter and routing on, no access log. The load generator (raw keep-alive
HTTP/1.1 in ``--procs`` processes) sends non-streamed chat requests, each connection walking the
tenants in its own order, so every flush holds as many distinct tenants as the rate allows.

1. **Gateway CPU per request**, ledger on and off: ``--rounds`` rounds, each sending the same
   ``--requests`` to the pair with the ledger and to the pair without, alternating which goes first;
   the CPU (utime+stime from /proc) of both gateways of the pair over the round, per request.
2. **PostgreSQL writes**: ``--sustain`` seconds of load (at least one whole minute) on the ledger
   pair alone; the flushes it applied (``usage_flushes``), the bucket rows they wrote
   (``pg_stat_user_tables``: inserts plus updates of ``usage_buckets``), the statements a flush is
   (counted in this process on one flush of the same size), and the minute rows stored per
   minute, so rows per day.
3. **Closing the day**: the rollup round that turns the seeded hours into day rows and renders
   every tenant's result (``registry.usage_tenant_days``) in the same transaction, timed per
   statement (what rendering adds to the rollup). With ``--query-only`` the gateway is up and has
   read the day's page once while it was open (summed from the hours, as a gateway that has been
   serving has), and the rollup runs then; in the full run it runs before the gateways start
   (their own maintenance would close the day).
4. **GET /admin/usage** for the seeded day, ``bucket_width=1d&group_by=tenant``: end to end through a
   gateway's admin API (the whole body read). First, once, the first read after the day was closed
   (a gateway whose pool one small page warmed). Then best and median of ``--query-repeats``,
   three ways side by side in each repeat: read after a late minute (a real late flush into the
   day, ``apply_flush``, which renders its tenant again and moves the late-write count on: the
   page is read from the results kept per tenant, as every first read of a finished day is), then
   kept (the gateway's engine answers the page it keeps, ``registry.usage_query.FinishedPages``),
   then summed from the ledger (the ``t`` watermark at 0 and the count moved on: the page built
   from the day rows, the path before the results were kept; the watermark is put back). The
   three bodies must be the same bytes.

Prints a table and writes ``bench/results/usage_ledger.json``. PostgreSQL, the gateways, the stub
and the load generator share this machine: the figures include their contention.

    python bench/usage_ledger.py                                   # 100k tenants
    python bench/usage_ledger.py --tenants 2000 --requests 2000 --rounds 1 --sustain 8 --flush-interval 2 \
        --no-whole-minute                                          # a quick look
    python bench/usage_ledger.py --query-only --query-repeats 7   # 3. and 4. alone: the seeded database,
                                                                   # one gateway, no load (usage_ledger_query.json)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway_overhead import (  # noqa: E402
    REDIS_URL,
    delete_redis_keys,
    http_request,
    stop_process,
    tree_cpu_seconds,
    wait_http,
)
from tests.stub_worker import StubProcess, free_port  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PG_ADMIN = os.environ.get("LORAPLEX_BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
DAY = 86400
STATS_REPORTED_S = 11.0
"""PostgreSQL's backends report their table statistics within 10 s of going idle."""

SEED_SQL = """
INSERT INTO base_models (name, revision, architecture, hidden_size, intermediate_size, num_layers, num_heads,
                         num_kv_heads, head_dim, vocab_size, context_length, created_at)
VALUES ('tiny', 'rev-aaaa', 'llama', 32, 64, 2, 4, 2, 8, 100, 128, now());

INSERT INTO tenants (slug, status, requests_per_min, tokens_per_min, max_concurrent, priority, created_at,
                     updated_at)
SELECT 't' || i, 'active', 1000000, 100000000, 1000, 'normal', now(), now() FROM generate_series(0, $N - 1) i;

INSERT INTO usage_buckets (width, start, tenant, alias, version, outcome, requests, prompt_tokens, cached_tokens,
                           completion_tokens, peak_concurrent)
SELECT 'h', $DAY, 't' || i, x.alias, x.version, x.outcome, 10 + i % 500, (10 + i % 500) * 40, i % 7 * 30,
       (10 + i % 500) * 25, 1 + i % 9
FROM generate_series(0, $N - 1) i,
     (VALUES ('tiny', '', 'ok', 1), ('assistant', md5('v')::uuid::text, 'ok', 2),
             ('tiny', '', '429:requests', 4), ('tiny', '', '4xx:model_not_found', 10)) x(alias, version, outcome, every)
WHERE i % x.every = 0;

INSERT INTO usage_rollups (width, done_until) VALUES ('h', $DAY + 86400), ('d', $DAY), ('t', $DAY)
ON CONFLICT (width) DO UPDATE SET done_until = excluded.done_until;

UPDATE registry_state SET version = 1 WHERE id = 1;
ANALYZE;
"""
"""Tenants ``t0``..; the ledger's rows of the day at ``$DAY`` for every one (ok on the base model,
every other also on an adapter, every 4th 429s, every 10th an unknown model's 404s), as hour rows
(all in the day's first hour), and the rollup watermarks as before the day's rollup: hours done
past the day, days (and the days' results per tenant) up to it."""


# -- the database -----------------------------------------------------------------------------------


async def create_database(n: int, day: int) -> tuple[str, str]:
    """A migrated, seeded database: (its SQLAlchemy URL, its asyncpg DSN)."""
    import asyncpg

    from registry.migrate import upgrade_async

    name = f"loraplex_usage_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(PG_ADMIN)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    dsn = PG_ADMIN.rsplit("/", 1)[0] + "/" + name
    url = dsn.replace("postgresql://", "postgresql+asyncpg://", 1)
    await upgrade_async(url)
    t0 = time.monotonic()
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(SEED_SQL.replace("$N", str(n)).replace("$DAY", str(day)))
        rows = await conn.fetchval("SELECT count(*) FROM usage_buckets")
    finally:
        await conn.close()
    print(f"  seeded {n:,} tenants and {rows:,} ledger rows in {time.monotonic() - t0:.1f} s ({name})", flush=True)
    return url, dsn


async def drop_database(dsn: str) -> None:
    import asyncpg

    admin = await asyncpg.connect(PG_ADMIN)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{dsn.rsplit("/", 1)[1]}" WITH (FORCE)')
    finally:
        await admin.close()


async def ledger_counts(dsn: str) -> dict[str, int]:
    """Flushes applied so far, and rows written to ``usage_buckets`` (inserted or updated)."""
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        flushes = await conn.fetchval("SELECT count(*) FROM usage_flushes")
        row = await conn.fetchrow("SELECT n_tup_ins, n_tup_upd FROM pg_stat_user_tables WHERE relname = 'usage_buckets'")
        return {"flushes": int(flushes), "bucket_rows": int(row["n_tup_ins"]) + int(row["n_tup_upd"])}
    finally:
        await conn.close()


async def minute_rows(dsn: str, lo: int, hi: int) -> list[int]:
    """Minute rows stored for each whole minute in [lo, hi)."""
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT start, count(*) AS n FROM usage_buckets WHERE width = 'm' AND start >= $1 "
                                "AND start + 60 <= $2 GROUP BY start ORDER BY start", lo, hi)
        return [int(r["n"]) for r in rows]
    finally:
        await conn.close()


async def one_flush_statements(url: str, rows: int) -> dict[str, Any]:
    """The statements (and time) of one flush of ``rows`` buckets, applied in this process the way a
    gateway applies it (``registry.usage.apply_flush``), counted as SQLAlchemy sends them."""
    from sqlalchemy import event

    from registry.db import make_engine
    from registry.usage import apply_flush

    engine = make_engine(url, pool_size=1, max_overflow=0)
    sent: list[str] = []
    event.listen(engine.sync_engine, "before_cursor_execute",
                 lambda conn, cursor, statement, *a: sent.append(statement.split(None, 1)[0].upper()))
    now = int(time.time())
    minute = now - now % 60 - 3600
    buckets = [(minute, f"t{i}", "tiny", "", "ok", 1, 40, 0, 5, 1) for i in range(max(1, rows))]
    try:
        await apply_flush(engine, "bench-count", 1, buckets[:1])  # connect and warm
        sent.clear()
        t0 = time.perf_counter()
        await apply_flush(engine, f"bench-count-{uuid.uuid4().hex[:6]}", 1, sorted(buckets))
        took = time.perf_counter() - t0
    finally:
        await engine.dispose()
    return {"rows": len(buckets), "statements": len(sent), "kinds": sent, "seconds": took}


async def close_day(url: str, day: int) -> dict[str, Any]:
    """The rollup round that closes ``day`` (its hours are done), as a gateway's maintenance runs
    it: its seconds, the day rows and the results per tenant it wrote, and the seconds of the
    statements that render those results (``usage_tenant_days``), timed as SQLAlchemy sends them."""
    from sqlalchemy import event

    from registry.db import make_engine
    from registry.usage import roll_up

    engine = make_engine(url, pool_size=1, max_overflow=0)
    spent: list[tuple[str, float]] = []
    started: dict[int, float] = {}

    def before(conn: Any, cursor: Any, statement: str, *a: Any) -> None:
        started[id(cursor)] = time.perf_counter()

    def after(conn: Any, cursor: Any, statement: str, *a: Any) -> None:
        spent.append((statement, time.perf_counter() - started.pop(id(cursor))))

    event.listen(engine.sync_engine, "before_cursor_execute", before)
    event.listen(engine.sync_engine, "after_cursor_execute", after)
    try:
        async with engine.connect() as conn:  # connected before the clock starts
            await conn.exec_driver_sql("SELECT 1")
        spent.clear()
        t0 = time.perf_counter()
        done = await roll_up(engine, day + DAY + 600)
        took = time.perf_counter() - t0
    finally:
        await engine.dispose()
    if done.days != 1:
        raise RuntimeError(f"the rollup closed {done.days} days, not the seeded one")
    render = sum(s for statement, s in spent if "usage_tenant_days" in statement)
    return {"seconds": took, "render_seconds": render, "statements": len(spent)}


async def late_minute(url: str, day: int, tenant: str, seq: int) -> None:
    """One late minute of ``tenant`` into the closed ``day``, flushed as a gateway back from an
    outage flushes it (``registry.usage.apply_flush``): its day row, its result kept per tenant
    and the late-write count change in one transaction."""
    from registry.db import make_engine
    from registry.usage import apply_flush

    engine = make_engine(url, pool_size=1, max_overflow=0)
    try:
        await apply_flush(engine, "bench-late", seq, [(day + 3600, tenant, "tiny", "", "ok", 1, 40, 0, 25, 1)])
    finally:
        await engine.dispose()


async def set_results_aside(dsn: str, aside: bool) -> None:
    """``aside``: the days' results kept per tenant left unused (the ``t`` watermark at 0) and the
    late-write count moved on, so the next page is summed from the day rows; else ``t`` put back
    at the day watermark (where the rollup left it)."""
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        if aside:
            await conn.execute("INSERT INTO usage_late_writes (width, flushes) VALUES ('d', 1) ON CONFLICT (width) "
                               "DO UPDATE SET flushes = usage_late_writes.flushes + 1")
            await conn.execute("UPDATE usage_rollups SET done_until = 0 WHERE width = 't'")
        else:
            await conn.execute("UPDATE usage_rollups SET done_until = (SELECT done_until FROM usage_rollups "
                               "WHERE width = 'd') WHERE width = 't'")
    finally:
        await conn.close()


# -- processes ----------------------------------------------------------------------------------------


class Gateway:
    """``loraplex gateway`` with or without the ledger."""

    def __init__(self, name: str, url: str, home: Path, env: dict[str, str], flush_interval: float) -> None:
        self.name = name
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.ledger = flush_interval > 0
        genv = env | {"LORAPLEX_DATABASE_URL": url, "LORAPLEX_HOME": str(home / name),
                      "LORAPLEX_GATEWAY_PORT": str(self.port), "LORAPLEX_GATEWAY_METRICS_PORT": str(free_port()),
                      "LORAPLEX_USAGE_FLUSH_INTERVAL_S": str(flush_interval)}
        self.log = home / f"{name}.log"
        (home / name).mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as fh:
            self.proc = subprocess.Popen([sys.executable, "-m", "loraplex_cli", "gateway", "--no-access-log"],
                                         cwd=ROOT, env=genv, stdout=fh, stderr=subprocess.STDOUT)

    def cpu(self) -> float:
        return tree_cpu_seconds(self.proc.pid)


# -- load -------------------------------------------------------------------------------------------


async def _conn(port: int, requests: list[bytes], first: int, step: int, count: int, bad: list[int]) -> None:
    """``count`` requests on one keep-alive connection: ``requests[first]``, then every ``step``-th."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    i = first
    try:
        for _ in range(count):
            writer.write(requests[i % len(requests)])
            i += step
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            low = head.lower()
            at = low.find(b"content-length:")
            if at >= 0:
                await reader.readexactly(int(low[at + 15: low.index(b"\r\n", at)]))
            else:
                while True:
                    size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                    await reader.readexactly(size + 2)
                    if size == 0:
                        break
            if status != 200:
                bad.append(status)
    finally:
        writer.close()


_REQUESTS: list[bytes] = []
"""Every tenant's request, set before the load processes fork (they share it)."""


def _loadgen(jobs: list[tuple[int, int, int, int]], out: mp.Queue) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    async def main() -> list[int]:
        bad: list[int] = []
        await asyncio.gather(*(_conn(port, _REQUESTS, first, step, count, bad) for port, first, step, count in jobs))
        return bad

    out.put(asyncio.run(main()))


def run_load(ports: list[int], total: int | None, seconds: float | None, concurrency: int, procs: int) -> dict:
    """``total`` requests (or as many as ``seconds`` allow, in batches) spread over ``ports``, one
    connection per ``concurrency``, each walking the tenants from its own random start."""
    if total is None:
        assert seconds is not None
        done: dict[str, Any] = {"requests": 0, "seconds": 0.0, "non_200": 0}
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            r = run_load(ports, concurrency * 50, None, concurrency, procs)
            done = {k: done[k] + r[k] for k in done}
        done["rps"] = done["requests"] / done["seconds"]
        return done
    conns = [(ports[c % len(ports)], secrets.randbelow(len(_REQUESTS)), concurrency,
              total // concurrency + (1 if c < total % concurrency else 0)) for c in range(concurrency)]
    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()
    ps = [ctx.Process(target=_loadgen, args=(conns[p::procs], q)) for p in range(procs)]
    t0 = time.perf_counter()
    for p in ps:
        p.start()
    bad = [b for _ in ps for b in q.get()]
    took = time.perf_counter() - t0
    for p in ps:
        p.join()
    return {"requests": total, "seconds": took, "rps": total / took, "non_200": len(bad)}


def cpu_round(side: list[Gateway], requests: int, concurrency: int, procs: int) -> dict[str, Any]:
    before = sum(g.cpu() for g in side)
    r = run_load([g.port for g in side], requests, None, concurrency, procs)
    r["gateway_cpu_s"] = sum(g.cpu() for g in side) - before
    r["cpu_us_per_request"] = r["gateway_cpu_s"] / r["requests"] * 1e6
    return r


# -- the query --------------------------------------------------------------------------------------


def read_open_day(gw: Gateway, token: str, day: int) -> float:
    """The day by tenant while it is still open (summed from its hours), as a gateway that has
    been serving reads it before the rollup closes the day: its seconds."""
    import httpx

    params = {"start_time": day, "end_time": day + DAY, "bucket_width": "1d", "group_by": "tenant"}
    t0 = time.perf_counter()
    r = httpx.get(gw.base + "/admin/usage", params=params, headers={"authorization": f"Bearer {token}"},
                  timeout=120.0)
    if r.status_code != 200:
        raise RuntimeError(f"GET /admin/usage -> {r.status_code}: {r.content[:300]!r}")
    return time.perf_counter() - t0


def time_query(gw: Gateway, token: str, day: int, repeats: int, tenants: int, url: str, dsn: str) -> dict[str, Any]:
    """The day by tenant: its first read after the rollup closed it, then each repeat read after a
    late minute, kept, and summed from the ledger; the first repeat only warms the gateway's pool
    and the database's cache."""
    import httpx

    params = {"start_time": day, "end_time": day + DAY, "bucket_width": "1d", "group_by": "tenant"}
    auth = {"authorization": f"Bearer {token}"}
    times: dict[str, list[float]] = {"read": [], "kept": [], "summed": []}
    bodies: dict[str, bytes] = {}

    def get(client: httpx.Client, query: dict[str, Any]) -> tuple[float, bytes]:
        t0 = time.perf_counter()
        r = client.get(gw.base + "/admin/usage", params=query, headers=auth)
        body = r.content
        took = time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(f"GET /admin/usage -> {r.status_code}: {body[:300]!r}")
        return took, body

    with httpx.Client(timeout=120.0) as client:
        get(client, params | {"tenants": "t0"})  # the gateway's pool and admin path warm, not this page
        first, bodies["first"] = get(client, params)
        for i in range(repeats + 1):
            for way in ("read", "kept", "summed"):
                if way == "read":
                    asyncio.run(late_minute(url, day, f"t{secrets.randbelow(tenants)}", i + 1))
                if way == "summed":
                    asyncio.run(set_results_aside(dsn, True))
                try:
                    took, bodies[way] = get(client, params)
                finally:
                    if way == "summed":
                        asyncio.run(set_results_aside(dsn, False))
                times[way].append(took)
            if not bodies["read"] == bodies["kept"] == bodies["summed"]:
                raise RuntimeError("GET /admin/usage: the pages read, kept and summed from the ledger differ")
    results = len(orjson.loads(bodies["kept"])["data"][0]["results"])
    if results != tenants:
        raise RuntimeError(f"GET /admin/usage returned {results} tenants of {tenants}")
    out: dict[str, Any] = {"results": results, "bytes": len(bodies["kept"]), "first_read_s": first}
    for way, ts in times.items():
        out[way] = {"best_s": min(ts[1:]), "median_s": statistics.median(ts[1:]), "all_s": ts[1:]}
    return out


def query_lines(q: dict[str, Any], closed: dict[str, Any]) -> list[str]:
    head = f"GET /admin/usage, a day by tenant ({q['results']:,} results, {q['bytes'] / 1e6:.1f} MB)"

    def line(what: str, way: str) -> str:
        return f"| {head}, {what} | best {q[way]['best_s'] * 1000:.0f} ms, median {q[way]['median_s'] * 1000:.0f} ms |"

    return [f"| the rollup closing the day (day rows and results per tenant, one transaction) | "
            f"{closed['seconds'] * 1000:.0f} ms, of which rendering the results {closed['render_seconds'] * 1000:.0f} ms |",
            f"| {head}, the first read after the day closed | {q['first_read_s'] * 1000:.0f} ms |",
            line("read after a late minute (results kept per tenant)", "read"),
            line("a finished day's page kept", "kept"),
            line("summed from the ledger (results per tenant set aside)", "summed")]


# -- the run ----------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    from loraplex.settings import Settings
    from loraplex.tokens import mint, mint_admin

    now = int(time.time())
    day = now - now % DAY - DAY
    url, dsn = asyncio.run(create_database(args.tenants, day))
    tmp = Path(tempfile.mkdtemp(prefix="loraplex-usage-bench-"))
    prefix = f"loraplex-usage-bench-{uuid.uuid4().hex[:8]}"
    secret, worker_secret = secrets.token_hex(32), secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")} | {
        "LORAPLEX_REDIS_URL": REDIS_URL, "LORAPLEX_REDIS_PREFIX": prefix, "LORAPLEX_JWT_SECRET": secret,
        "LORAPLEX_WORKER_SECRET": worker_secret, "LORAPLEX_ADAPTER_ROOT": str(tmp / "adapters"),
        "LORAPLEX_GATEWAY_HOST": "127.0.0.1", "LORAPLEX_LOG_LEVEL": "WARNING"}
    stub = StubProcess(f"{prefix}-w1", redis_url=REDIS_URL, redis_prefix=prefix, base_model="tiny",
                       extra=("--chunks", "5", "--worker-secret", worker_secret))
    gateways: list[Gateway] = []
    result: dict[str, Any] = {"tenants": args.tenants, "flush_interval_s": args.flush_interval,
                              "concurrency": args.concurrency, "requests_per_round": args.requests}
    try:
        result["close_day"] = asyncio.run(close_day(url, day))  # before the gateways: their maintenance would
        stub.start()
        t0 = time.monotonic()
        gateways = [Gateway(f"ledger-{i}", url, tmp, env, args.flush_interval) for i in (1, 2)]
        gateways += [Gateway(f"plain-{i}", url, tmp, env, 0) for i in (1, 2)]
        for g in gateways:
            wait_http(g.base + "/readyz", g.proc, args.ready_timeout, g.log)
        print(f"  4 gateways ready in {time.monotonic() - t0:.1f} s", flush=True)
        on, off = gateways[:2], gateways[2:]
        settings = Settings(jwt_secret=secret)
        t0 = time.monotonic()
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Say hello to the ledger."}], "max_tokens": 16}
        _REQUESTS[:] = [http_request(0, "/v1/chat/completions", body,
                                     mint(settings, f"u{i}", tenant=f"t{i}", ttl_s=DAY)) for i in range(args.tenants)]
        print(f"  {args.tenants:,} tenant tokens in {time.monotonic() - t0:.1f} s", flush=True)
        for side in (on, off):  # every gateway's pools, caches and the stub connection warm
            run_load([g.port for g in side], args.concurrency * 20, None, args.concurrency, args.procs)

        rounds: dict[str, list[dict[str, Any]]] = {"ledger": [], "no_ledger": []}
        for r in range(args.rounds):
            order = [("ledger", on), ("no_ledger", off)]
            for name, side in order if r % 2 == 0 else order[::-1]:
                got = cpu_round(side, args.requests, args.concurrency, args.procs)
                rounds[name].append(got)
                print(f"  round {r + 1} {name:9}: {got['rps']:7.0f} req/s, gateway CPU "
                      f"{got['cpu_us_per_request']:6.0f} us/request, non-200 {got['non_200']}", flush=True)
        cpu = {name: sum(x["gateway_cpu_s"] for x in rs) / sum(x["requests"] for x in rs) * 1e6
               for name, rs in rounds.items()}
        result["cpu_rounds"] = rounds
        result["cpu_us_per_request"] = cpu
        result["ledger_cpu_overhead"] = cpu["ledger"] / cpu["no_ledger"] - 1
        result["rps"] = {name: statistics.mean(x["rps"] for x in rs) for name, rs in rounds.items()}

        # PostgreSQL writes: the ledger pair alone, at full rate, over at least one whole minute
        # (the minute rows it leaves). Before each count the last flush has landed and PostgreSQL's
        # statistics are reported (an idle backend reports them within 10 s).
        time.sleep(args.flush_interval + STATS_REPORTED_S)
        before = asyncio.run(ledger_counts(dsn))
        t_lo = time.time()
        seconds = args.sustain
        if args.whole_minute:
            seconds = max(seconds, -(-t_lo // 60) * 60 + 61 - t_lo)
        load = run_load([g.port for g in on], None, seconds, args.concurrency, args.procs)
        t_hi = time.time()
        time.sleep(args.flush_interval + STATS_REPORTED_S)
        after = asyncio.run(ledger_counts(dsn))
        flushes = after["flushes"] - before["flushes"]
        rows = after["bucket_rows"] - before["bucket_rows"]
        per_flush = rows / flushes if flushes else 0.0
        one = asyncio.run(one_flush_statements(url, round(per_flush)))
        per_minute = asyncio.run(minute_rows(dsn, int(t_lo), int(t_hi)))
        steady_flushes_s = len(on) / args.flush_interval
        result["postgres"] = {
            "sustained_rps": load["rps"], "sustained_s": load["seconds"], "requests": load["requests"],
            "flushes": flushes, "bucket_rows_written": rows, "rows_per_flush": per_flush,
            "statements_per_flush": one["statements"], "statement_kinds": one["kinds"],
            "flush_seconds": one["seconds"],
            "steady_flushes_per_s": steady_flushes_s,
            "steady_statements_per_s": steady_flushes_s * one["statements"],
            "steady_bucket_rows_per_s": steady_flushes_s * per_flush,
            "minute_rows_per_minute": per_minute,
            "minute_rows_per_day": statistics.mean(per_minute) * 1440 if per_minute else None,
            # This load has one key per tenant (one alias, the base model, ok): at most a row per
            # tenant and hour, and per tenant and day.
            "hour_rows_per_day_at_most": args.tenants * 24,
            "day_rows_per_day_at_most": args.tenants,
        }

        admin = mint_admin(settings, ttl_s=DAY)
        result["admin_usage_day_by_tenant"] = time_query(on[0], admin, day, args.query_repeats, args.tenants, url,
                                                            dsn)
    finally:
        for g in gateways:
            stop_process(g.proc)
        stub.stop()
        delete_redis_keys((f"{prefix}*",))
        asyncio.run(drop_database(dsn))
    return result


def table(r: dict[str, Any]) -> str:
    pg, q, cpu = r["postgres"], r["admin_usage_day_by_tenant"], r["cpu_us_per_request"]
    per_day = pg["minute_rows_per_day"]
    lines = [
        "| figure | value |", "|---|---|",
        f"| tenants | {r['tenants']:,} |",
        f"| request rate, ledger on / off (2 gateways) | {r['rps']['ledger']:,.0f} / {r['rps']['no_ledger']:,.0f} req/s |",
        f"| gateway CPU per request, ledger on / off | {cpu['ledger']:.0f} / {cpu['no_ledger']:.0f} us "
        f"({r['ledger_cpu_overhead'] * 100:+.1f}%) |",
        f"| sustained rate for the write figures | {pg['sustained_rps']:,.0f} req/s for {pg['sustained_s']:.0f} s |",
        f"| flushes (flush interval {r['flush_interval_s']:g} s, 2 gateways) | {pg['flushes']} for "
        f"{pg['requests']:,} requests |",
        f"| bucket rows per flush | {pg['rows_per_flush']:,.0f} |",
        f"| statements per flush (one transaction) | {pg['statements_per_flush']} "
        f"({' '.join(pg['statement_kinds'])}), {pg['flush_seconds'] * 1000:.0f} ms |",
        f"| PostgreSQL writes at that rate | {pg['steady_flushes_per_s']:.2f} transactions/s, "
        f"{pg['steady_statements_per_s']:.1f} statements/s, {pg['steady_bucket_rows_per_s']:,.0f} bucket rows/s |",
        f"| minute rows per day (kept 7 days) | {'-' if per_day is None else f'{per_day:,.0f}'} |",
        f"| hour / day rows per day, at most (a key per tenant) | {pg['hour_rows_per_day_at_most']:,} / "
        f"{pg['day_rows_per_day_at_most']:,} |",
        *query_lines(q, r["close_day"]),
    ]
    return "\n".join(lines)


def run_query_only(args: argparse.Namespace) -> dict[str, Any]:
    """Part 3 alone: the seeded database and one gateway (no ledger of its own), no load."""
    from loraplex.settings import Settings
    from loraplex.tokens import mint_admin

    now = int(time.time())
    day = now - now % DAY - DAY
    url, dsn = asyncio.run(create_database(args.tenants, day))
    tmp = Path(tempfile.mkdtemp(prefix="loraplex-usage-bench-"))
    prefix = f"loraplex-usage-bench-{uuid.uuid4().hex[:8]}"
    secret, worker_secret = secrets.token_hex(32), secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")} | {
        "LORAPLEX_REDIS_URL": REDIS_URL, "LORAPLEX_REDIS_PREFIX": prefix, "LORAPLEX_JWT_SECRET": secret,
        "LORAPLEX_WORKER_SECRET": worker_secret, "LORAPLEX_ADAPTER_ROOT": str(tmp / "adapters"),
        "LORAPLEX_GATEWAY_HOST": "127.0.0.1", "LORAPLEX_LOG_LEVEL": "WARNING"}
    stub = StubProcess(f"{prefix}-w1", redis_url=REDIS_URL, redis_prefix=prefix, base_model="tiny",
                       extra=("--chunks", "5", "--worker-secret", worker_secret))
    gw: Gateway | None = None
    try:
        stub.start()
        gw = Gateway("query", url, tmp, env, 0)
        wait_http(gw.base + "/readyz", gw.proc, args.ready_timeout, gw.log)
        admin = mint_admin(Settings(jwt_secret=secret), ttl_s=DAY)
        open_day_s = read_open_day(gw, admin, day)
        closed = asyncio.run(close_day(url, day)) | {"open_day_read_s": open_day_s}
        return {"tenants": args.tenants, "close_day": closed,
                "admin_usage_day_by_tenant": time_query(gw, admin, day, args.query_repeats, args.tenants, url, dsn)}
    finally:
        if gw is not None:
            stop_process(gw.proc)
        stub.stop()
        delete_redis_keys((f"{prefix}*",))
        asyncio.run(drop_database(dsn))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tenants", type=int, default=100_000)
    ap.add_argument("--requests", type=int, default=20_000, help="requests per round and side")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of ledger on / off, alternating")
    ap.add_argument("--concurrency", type=int, default=32, help="connections, spread over the pair's gateways")
    ap.add_argument("--procs", type=int, default=2, help="load generator processes")
    ap.add_argument("--flush-interval", type=float, default=10.0, help="LORAPLEX_USAGE_FLUSH_INTERVAL_S of the ledger pair")
    ap.add_argument("--sustain", type=float, default=60.0, help="seconds of load for the PostgreSQL write figures")
    ap.add_argument("--no-whole-minute", dest="whole_minute", action="store_false",
                    help="do not extend --sustain to cover a whole minute (no minute rows per day then)")
    ap.add_argument("--query-repeats", type=int, default=5)
    ap.add_argument("--query-only", action="store_true",
                    help="only 3. and 4.: seed the database, close the day and time GET /admin/usage on one gateway, no load")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    args = ap.parse_args()
    result = run_query_only(args) if args.query_only else run(args)
    print()
    print("\n".join(["| figure | value |", "|---|---|", *query_lines(result["admin_usage_day_by_tenant"],
                                                                       result["close_day"])])
          if args.query_only else table(result))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"benchmark": "usage_ledger", "cpus": os.cpu_count(), "python": platform.python_version(),
           "args": vars(args), "result": result, "load_avg_at_end": os.getloadavg()}
    path = RESULTS / ("usage_ledger_query.json" if args.query_only else "usage_ledger.json")
    path.write_text(json.dumps(out, indent=2))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
