"""Control plane at scale: snapshot loads, start-up, rollback propagation and admin writes with
N tenants on real PostgreSQL and two gateways.

For each size it creates a database, migrates it and bulk-inserts (plain SQL) N tenants with
1.5 bindings each (alias ``a`` everywhere, ``b`` on every other tenant) and 2 adapter versions
per binding (active and previous, each with a verification JSON as a real registry has), then:

* loads the snapshot in this process: time, and memory of the held snapshot (tracemalloc) per
  tenant;
* starts two gateways (``loraplex gateway``) at once, as two replicas starting together: the
  time from spawn to ``/readyz`` 200 for each, and the gateways' RSS once ready;
* for each write rate (default 5 and 20/s) streams that many rollbacks per second, open loop,
  to gateway A's admin API, each of a random tenant's alias ``a``. Each answer carries the
  registry version it committed as (``X-Registry-Version``); a poller per gateway reads
  ``/readyz`` every 10 ms, so "visible on both gateways" is the first moment both report that
  version or later, measured from the moment the write was sent. Meanwhile a client process
  of its own (raw keep-alive HTTP, so its own scheduling adds little) requests ``/v1/models``
  from each gateway at ``--models-rate`` per second (a tenant token; ``0``: back to back), and
  each gateway's ``loraplex_gateway_event_loop_lag_seconds`` histogram is read before and after:
  the ticks over 20 ms are stalls of its event loop, whatever the client saw.

    python bench/control_plane.py                       # 1k and 10k tenants
    python bench/control_plane.py --sizes 100000 --seconds 15
    python bench/control_plane.py --admin-api           # writes to `loraplex admin-api` (own process)

Prints one table and writes ``bench/results/control_plane.json``. The PostgreSQL server runs
on the same machine as the gateways and this client: the figures include their contention.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import multiprocessing as mp
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
PG_ADMIN = os.environ.get("LORAPLEX_BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")

SEED_SQL = """
INSERT INTO base_models (name, revision, architecture, hidden_size, intermediate_size, num_layers, num_heads,
                         num_kv_heads, head_dim, vocab_size, context_length, created_at)
VALUES ('tiny', 'rev-aaaa', 'llama', 32, 64, 2, 4, 2, 8, 100, 128, now());

INSERT INTO tenants (slug, status, requests_per_min, tokens_per_min, max_concurrent, priority, created_at,
                     updated_at)
SELECT 't' || i, 'active', 1000000, 100000000, 1000, 'normal', now(), now() FROM generate_series(0, $N - 1) i;

CREATE TEMP TABLE b AS
SELECT 't' || i AS tenant, alias FROM generate_series(0, $N - 1) i, (VALUES ('a'), ('b')) x(alias)
WHERE alias = 'a' OR i % 2 = 1;

INSERT INTO adapter_versions (id, name, version, base_model, uri, sha256, size_bytes, rank, alpha, target_modules,
                              owner_tenant, status, status_reason, verification, created_at)
SELECT md5(tenant || '/' || alias || '@' || v)::uuid::text, tenant || '-' || alias, v, 'tiny',
       'file:///adapters/' || tenant || '-' || alias || '/' || v, md5(tenant || alias || v) || md5(alias || v),
       1048576, 8, 16, '["q_proj", "k_proj", "v_proj", "o_proj"]', tenant, 'active', NULL,
       json_build_object('worker', 'w1', 'passed', true, 'probes',
                         json_build_array(json_build_object('prompt', 'What is 2+2?', 'base', '4',
                                                            'adapter', 'Four.'))),
       now()
FROM b, generate_series(1, 2) v;

INSERT INTO bindings (tenant, alias, base_model, active_id, previous_id, canary_id, canary_percent, enabled,
                      on_disabled, row_version, created_at, updated_at)
SELECT tenant, alias, 'tiny', md5(tenant || '/' || alias || '@2')::uuid::text,
       md5(tenant || '/' || alias || '@1')::uuid::text, NULL, 0, true, 'refuse', 1, now(), now()
FROM b;

UPDATE registry_state SET version = 1 WHERE id = 1;
ANALYZE;
"""


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


async def create_database(n: int) -> str:
    import asyncpg

    from registry.migrate import upgrade_async

    name = f"loraplex_bench_{uuid.uuid4().hex[:10]}"
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
        await conn.execute(SEED_SQL.replace("$N", str(n)))
    finally:
        await conn.close()
    print(f"  seeded {n} tenants in {time.monotonic() - t0:.1f} s ({name})", flush=True)
    return url


async def drop_database(url: str) -> None:
    import asyncpg

    name = url.rsplit("/", 1)[1]
    admin = await asyncpg.connect(PG_ADMIN)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


async def measure_load(url: str, n: int) -> dict[str, Any]:
    """Full snapshot load in this process: time (best of 2), and the held snapshot's memory."""
    from registry.db import make_engine
    from registry.snapshot_load import load_full

    engine = make_engine(url, pool_size=1, max_overflow=0)
    try:
        async def load() -> Any:
            async with engine.connect() as conn:
                conn = await conn.execution_options(isolation_level="REPEATABLE READ")
                async with conn.begin():
                    return await load_full(conn)

        times = []
        for _ in range(2):
            gc.collect()
            t0 = time.perf_counter()
            snap = await load()
            times.append(time.perf_counter() - t0)
            del snap
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        snap = await load()
        gc.collect()
        held, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert len(snap.tenants) == n
        return {"load_s": min(times), "snapshot_bytes": held - base, "bytes_per_tenant": (held - base) / n,
                "load_peak_bytes": peak - base}
    finally:
        await engine.dispose()


class Gateway:
    def __init__(self, name: str, url: str, home: Path, secret: str, command: str = "gateway",
                 mount_admin: bool = True) -> None:
        self.name = name
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.metrics_port = free_port()
        env = {"LORAPLEX_GATEWAY_MOUNT_ADMIN": "true" if mount_admin else "false", **os.environ, "LORAPLEX_DATABASE_URL": url, "LORAPLEX_HOME": str(home / name),
               "LORAPLEX_JWT_SECRET": secret, "LORAPLEX_WORKER_SECRET": secret, "LORAPLEX_REDIS_URL": "",
               "LORAPLEX_GATEWAY_METRICS_PORT": str(self.metrics_port), "LORAPLEX_LOG_LEVEL": "WARNING",
               "LORAPLEX_WORKER_URLS": "http://127.0.0.1:9", "LORAPLEX_ADAPTER_ROOT": str(home / "adapters")}
        self.log = open(home / f"{name}.log", "w")
        self.started = time.monotonic()
        extra = ["--no-access-log"] if command == "gateway" else []
        self.proc = subprocess.Popen([sys.executable, "-m", "loraplex_cli", command, "--port", str(self.port), *extra],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.ready_s: float | None = None

    async def wait_ready(self, client: Any, limit_s: float) -> float:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway {self.name} exited ({self.proc.returncode}); see its log")
            with contextlib.suppress(Exception):
                r = await client.get(self.base + "/readyz", timeout=2)
                if r.status_code == 200:
                    self.ready_s = time.monotonic() - self.started
                    return self.ready_s
            await asyncio.sleep(0.05)
        raise RuntimeError(f"gateway {self.name} not ready after {limit_s:.0f} s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


async def version_poller(client: Any, gw: Gateway, seen: list[tuple[float, int]], stop: asyncio.Event) -> None:
    """(time, registry version) of ``gw`` every 10 ms."""
    while not stop.is_set():
        with contextlib.suppress(Exception):
            r = await client.get(gw.base + "/readyz", timeout=5)
            if r.status_code == 200:
                seen.append((time.monotonic(), int(r.json()["registry_version"])))
        await asyncio.sleep(0.01)


def visible_at(seen: list[tuple[float, int]], version: int, after: float) -> float | None:
    for at, v in seen:
        if at >= after and v >= version:
            return at
    return None


def _models_proc(port: int, token: str, rate: float, seconds: float, out: Any) -> None:
    """One gateway's ``/v1/models`` load from a process of its own: a keep-alive connection, a
    request every ``1/rate`` s (``rate`` 0: back to back), each latency from its send."""

    async def main() -> list[float]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        request = (f"GET /v1/models HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {token}\r\n\r\n"
                   .encode())
        lat: list[float] = []
        start = time.perf_counter()
        i = 0
        while time.perf_counter() - start < seconds:
            if rate > 0:
                await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
            i += 1
            t0 = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            low = head.lower()
            at = low.index(b"content-length:")
            await reader.readexactly(int(low[at + 15: low.index(b"\r\n", at)]))
            lat.append(time.perf_counter() - t0)
            assert head.startswith(b"HTTP/1.1 200"), head[:64]
        writer.close()
        return lat

    out.put(asyncio.run(main()))


def loop_lag(gw: Gateway) -> dict[str, float]:
    """``le`` -> cumulative count of the gateway's event-loop lag histogram."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{gw.metrics_port}/metrics", timeout=10).read().decode()
    prefix = 'loraplex_gateway_event_loop_lag_seconds_bucket{le="'
    return {line[len(prefix):].split('"')[0]: float(line.split()[-1])
            for line in text.splitlines() if line.startswith(prefix)}


def lag_between(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Ticks in the interval, those over 20 ms, and the bound of the largest lag seen."""
    d = {le: after[le] - before.get(le, 0.0) for le in after}
    total = d.get("+Inf", 0.0)
    worst = next((le for le, n in sorted(((le, n) for le, n in d.items() if le != "+Inf"),
                                          key=lambda x: float(x[0])) if n >= total), "+Inf")
    return {"ticks": int(total), "over_20ms": int(total - d.get("0.02", 0.0)), "max_at_most_s": worst}


async def write_stream(client: Any, gw: Gateway, token: str, n: int, rate: float, seconds: float,
                       out: list[dict[str, Any]]) -> None:
    headers = {"authorization": f"Bearer {token}"}
    rng = random.Random(rate)

    async def one() -> None:
        tenant = f"t{rng.randrange(n)}"
        t0 = time.monotonic()
        try:
            r = await client.post(f"{gw.base}/admin/tenants/{tenant}/bindings/a/rollback", headers=headers,
                                  timeout=120)
            status, version = r.status_code, int(r.headers.get("x-registry-version", 0))
        except Exception as exc:
            status, version = 0, 0
            print(f"  write failed: {exc!r}", flush=True)
        out.append({"sent": t0, "s": time.monotonic() - t0, "status": status, "version": version})

    tasks = []
    start = time.monotonic()
    for i in range(int(rate * seconds)):
        await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)


async def run_size(n: int, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from loraplex.settings import Settings
    from loraplex.tokens import mint, mint_admin

    print(f"== {n} tenants", flush=True)
    url = await create_database(n)
    result: dict[str, Any] = {"tenants": n, "bindings": n + n // 2, "versions": 2 * (n + n // 2)}
    gws: list[Gateway] = []
    procs: list[Gateway] = []
    result["admin_api"] = "own process" if args.admin_api else "mounted in gateway A"
    try:
        result |= await measure_load(url, n)
        print(f"  full load {result['load_s']:.2f} s, {result['bytes_per_tenant']:.0f} B/tenant held", flush=True)
        secret = "bench-" + uuid.uuid4().hex
        settings = Settings(jwt_secret=secret)
        home = Path(tempfile.mkdtemp(prefix="loraplex-cp-"))
        (home / "adapters").mkdir()
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
            gws = [Gateway("a", url, home, secret, mount_admin=not args.admin_api),
                   Gateway("b", url, home, secret, mount_admin=not args.admin_api)]
            ready = await asyncio.gather(*(g.wait_ready(client, args.ready_timeout) for g in gws))
            writer = gws[0]
            if args.admin_api:  # the admin API in a process of its own: writes leave the gateways' loops
                writer = Gateway("admin", url, home, secret, command="admin-api")
                await writer.wait_ready(client, args.ready_timeout)
                procs.append(writer)
            result["startup_to_ready_s"] = ready
            result["gateway_rss_mb"] = [rss_mb(g.proc.pid) for g in gws]
            print(f"  ready after {', '.join(f'{r:.1f}' for r in ready)} s; RSS "
                  f"{', '.join(f'{m:.0f}' for m in result['gateway_rss_mb'] if m)} MB", flush=True)
            admin = mint_admin(settings, ttl_s=3600)
            user = mint(settings, "u", tenant="t1", ttl_s=3600)
            result["rates"] = {}
            for rate in args.rates:
                stop = asyncio.Event()
                seen: list[list[tuple[float, int]]] = [[], []]
                writes: list[dict[str, Any]] = []
                bg = [asyncio.create_task(version_poller(client, g, seen[i], stop)) for i, g in enumerate(gws)]
                ctx = mp.get_context("fork")
                q: Any = ctx.Queue()
                lag0 = [loop_lag(g) for g in gws]
                models = [ctx.Process(target=_models_proc, args=(g.port, user, args.models_rate, args.seconds + 2.0, q))
                          for g in gws]
                for p in models:
                    p.start()
                await write_stream(client, writer, admin, n, rate, args.seconds, writes)
                await asyncio.sleep(2.0)  # the last changes propagate
                stop.set()
                await asyncio.gather(*bg)
                lat = [x for _ in models for x in await asyncio.to_thread(q.get, True, 120)]
                for p in models:
                    p.join(30)
                lags = [lag_between(b, loop_lag(g)) for b, g in zip(lag0, gws, strict=True)]
                ok = [w for w in writes if w["status"] == 200]
                prop = []
                never = 0
                for w in ok:
                    ats = [visible_at(s, w["version"], w["sent"]) for s in seen]
                    if None in ats:
                        never += 1
                    else:
                        prop.append(max(ats) - w["sent"])  # type: ignore[type-var]
                row = {"writes": len(writes), "writes_ok": len(ok),
                       "write_p50_s": pct([w["s"] for w in writes], 50),
                       "write_p99_s": pct([w["s"] for w in writes], 99),
                       "rollback_visible_p50_s": pct(prop, 50), "rollback_visible_max_s": max(prop, default=None),
                       "not_visible_within_2s_after": never,
                       "models_requests": len(lat), "models_p50_ms": (pct(lat, 50) or 0) * 1000,
                       "models_p99_ms": (pct(lat, 99) or 0) * 1000, "models_max_ms": max(lat, default=0) * 1000,
                       "models_rate_per_gateway": args.models_rate, "loop_lag": lags}
                result["rates"][str(rate)] = row
                print(f"  {rate}/s: writes {row['writes_ok']}/{row['writes']} ok, p50/p99 "
                      f"{row['write_p50_s'] * 1000:.0f}/{row['write_p99_s'] * 1000:.0f} ms; rollback visible on "
                      f"both p50/max {_s(row['rollback_visible_p50_s'])}/{_s(row['rollback_visible_max_s'])}; "
                      f"/v1/models p50/p99 {row['models_p50_ms']:.1f}/{row['models_p99_ms']:.1f} ms; loop ticks over 20 ms "
                      f"{', '.join(str(x['over_20ms']) for x in lags)} of "
                      f"{', '.join(str(x['ticks']) for x in lags)}, max lag <= "
                      f"{', '.join(x['max_at_most_s'] + ' s' for x in lags)}", flush=True)
            result["gateway_rss_after_mb"] = [rss_mb(g.proc.pid) for g in gws]
    finally:
        for g in gws + procs:
            g.stop()
        await drop_database(url)
    return result


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| tenants | admin API | full load | held snapshot per tenant | start-up to ready (A, B) | writes/s | admin write "
             "p50 / p99, ok | rollback visible on both p50 / max | `/v1/models` p50 / p99 / max | loop ticks over 20 ms "
             "(A, B) | max loop lag (A, B) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for rate, row in r["rates"].items():
            lines.append(
                f"| {r['tenants']:,} | {r['admin_api']} | {r['load_s']:.2f} s | {r['bytes_per_tenant'] / 1024:.2f} KB | "
                f"{' / '.join(f'{x:.1f}' for x in r['startup_to_ready_s'])} s | {rate} | "
                f"{row['write_p50_s'] * 1000:.0f} / {row['write_p99_s'] * 1000:.0f} ms, "
                f"{row['writes_ok']} of {row['writes']} | "
                f"{_s(row['rollback_visible_p50_s'])} / {_s(row['rollback_visible_max_s'])} | "
                f"{row['models_p50_ms']:.1f} / {row['models_p99_ms']:.1f} / {row['models_max_ms']:.0f} ms | "
                f"{' / '.join(str(x['over_20ms']) for x in row['loop_lag'])} | "
                f"{' / '.join('<= ' + x['max_at_most_s'] + ' s' for x in row['loop_lag'])} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,10000", help="tenant counts, comma-separated")
    ap.add_argument("--rates", default="5,20", help="admin writes per second, comma-separated")
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each write stream")
    ap.add_argument("--ready-timeout", type=float, default=180.0)
    ap.add_argument("--admin-api", action="store_true",
                    help="send the writes to `loraplex admin-api` (a third process) instead of gateway A's /admin")
    ap.add_argument("--models-rate", type=float, default=100.0,
                    help="/v1/models requests per second per gateway (0: back to back, as fast as answered)")
    ap.add_argument("--quick", action="store_true", help="1k tenants, 5 writes/s for 4 s")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.rates, args.seconds = "1000", "5", 4.0
    args.rates = [float(x) if "." in x else int(x) for x in args.rates.split(",")]
    results = [asyncio.run(run_size(int(n), args)) for n in args.sizes.split(",")]
    print()
    print(table(results))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"benchmark": "control_plane", "cpus": os.cpu_count(), "python": platform.python_version(),
           "seconds_per_rate": args.seconds, "results": results,
           "load_avg_at_end": os.getloadavg()}
    (RESULTS / "control_plane.json").write_text(json.dumps(out, indent=2))
    print(f"\nwrote {RESULTS / 'control_plane.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
