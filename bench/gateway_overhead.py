"""Gateway overhead: a stub worker measured directly and through the gateway.

Everything runs as real processes on loopback:

* a stub engine worker (``tests/stub_worker.py``) answering instantly and reporting its
  residency into Redis;
* a real registry (SQLite file, seeded through ``registry.service``; changes fanned out
  over Redis) with one tenant, one base model and one adapter bound to an alias;
* the gateway as ``loraplex gateway`` (uvicorn's httptools protocol with the gateway's edge
  deadlines, uvloop; its metrics on their own port) with auth (JWT),
  resolution, Redis limits (high enough never to refuse) and routing all on;
* a load generator of raw asyncio HTTP/1.1 keep-alive connections spread over several
  processes, so the client side is cheap.

For concurrency 1, 16 and 64, non-streaming and streaming (5 chunks), it prints requests/s
and p50/p99 latency direct vs. through the gateway, the added p50 latency, and the gateway
process's CPU time per request (utime+stime from /proc/<pid>/stat before/after each run).
Writes ``bench/results/gateway_overhead.json``.

    python bench/gateway_overhead.py [--seconds 4] [--concurrency 1,16,64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loraplex.wire import HDR_WORKER_SECRET  # noqa: E402
from tests.stub_worker import StubProcess, free_port  # noqa: E402

REDIS_URL = os.environ.get("LORAPLEX_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- load generator ---------------------------------------------------------------------------------


async def _conn(port: int, request: bytes, stream: bool, stop_at: float, lat: list[float],
                bad: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    perf = time.perf_counter
    try:
        while perf() < stop_at:
            t0 = perf()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            low = head.lower()
            i = low.find(b"content-length:")
            if i >= 0:
                n = int(low[i + 15: low.index(b"\r\n", i)])
                await reader.readexactly(n)
            else:
                while True:
                    size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                    await reader.readexactly(size + 2)
                    if size == 0:
                        break
            lat.append(perf() - t0)
            if status != 200:
                bad.append(status)
    finally:
        writer.close()


def _loadgen_proc(port: int, request: bytes, stream: bool, conns: int, start_at: float, seconds: float,
                  out: mp.Queue) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    async def main() -> tuple[list[float], list[int]]:
        lat: list[float] = []
        bad: list[int] = []
        await asyncio.sleep(max(0.0, start_at - time.time()))
        stop_at = time.perf_counter() + seconds
        await asyncio.gather(*[_conn(port, request, stream, stop_at, lat, bad) for _ in range(conns)])
        return lat, bad

    out.put(asyncio.run(main()))


def run_load(port: int, request: bytes, stream: bool, concurrency: int, seconds: float, procs: int) -> dict:
    procs = max(1, min(procs, concurrency))
    per = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()
    start_at = time.time() + 0.3
    ps = [ctx.Process(target=_loadgen_proc, args=(port, request, stream, n, start_at, seconds, q)) for n in per]
    for p in ps:
        p.start()
    lat: list[float] = []
    bad: list[int] = []
    for _ in ps:
        l_, b_ = q.get()
        lat += l_
        bad += b_
    for p in ps:
        p.join()
    lat.sort()
    n = len(lat)
    return {"requests": n, "rps": n / seconds, "p50_ms": 1000 * lat[n // 2] if n else None,
            "p99_ms": 1000 * lat[min(n - 1, int(n * 0.99))] if n else None,
            "mean_ms": 1000 * statistics.fmean(lat) if n else None, "non_200": len(bad)}


def http_request(port: int, path: str, body: dict, token: str | None, worker_secret: str = "") -> bytes:
    raw = json.dumps(body, separators=(",", ":")).encode()
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
            f"Content-Length: {len(raw)}"]
    if token:
        head.append(f"Authorization: Bearer {token}")
    if worker_secret:
        head.append(f"{HDR_WORKER_SECRET}: {worker_secret}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + raw


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


# -- system under test ------------------------------------------------------------------------------


async def seed_registry(settings) -> str:  # type: ignore[no-untyped-def]
    from registry.migrate import upgrade_async
    from registry.service import RegistryService
    from tests.registry_support import TINY, write_adapter

    await upgrade_async(settings.resolved_database_url())
    svc = RegistryService(settings)
    try:
        await svc.register_base_model(TINY)
        await svc.create_tenant("bench", requests_per_min=2**31 - 1, tokens_per_min=2**31 - 1,
                                max_concurrent=100_000)
        d = write_adapter(Path(settings.resolved_adapter_root()) / "support-1", TINY, seed=1)
        a = await svc.register_adapter("support", str(d), TINY.name, owner="bench")
        a = await svc.activate_adapter(a["id"], verification={"bench": "ok"})
        await svc.bind("bench", "support", a["id"])
        return a["id"]
    finally:
        await svc.close()


def wait_http(url: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--procs", type=int, default=2, help="load generator processes")
    ap.add_argument("--no-access-log", action="store_true",
                    help="turn the per-request log line off (default: on, written to /dev/null)")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    from loraplex.settings import Settings
    from loraplex.tokens import mint

    tmp = Path(tempfile.mkdtemp(prefix="loraplex-bench-"))
    (tmp / "adapters").mkdir()
    prefix = f"loraplex-bench-{uuid.uuid4().hex[:8]}"
    db = f"sqlite+aiosqlite:///{tmp}/registry.db"
    settings = Settings(home=str(tmp), database_url=db, adapter_root=str(tmp / "adapters"), redis_url=REDIS_URL,
                        redis_prefix=prefix)
    adapter_id = asyncio.run(seed_registry(settings))
    token = mint(settings, "bench-user", tenant="bench", ttl_s=24 * 3600)

    stub = StubProcess("bench-w1", redis_url=REDIS_URL, redis_prefix=prefix, base_model="tiny",
                       device=(adapter_id,), extra=("--chunks", "5", "--worker-secret", settings.worker_secret)).start()
    gw_port = free_port()
    env = dict(os.environ, LORAPLEX_HOME=str(tmp), LORAPLEX_DATABASE_URL=db, LORAPLEX_REDIS_URL=REDIS_URL,
               LORAPLEX_REDIS_PREFIX=prefix, LORAPLEX_ADAPTER_ROOT=str(tmp / "adapters"),
               LORAPLEX_GATEWAY_PORT=str(gw_port), LORAPLEX_GATEWAY_METRICS_PORT=str(free_port()),
               LORAPLEX_WORKER_SECRET=settings.worker_secret,
               LORAPLEX_LOG_LEVEL="WARNING" if args.no_access_log else "INFO")
    gw_cmd = [sys.executable, "-m", "loraplex_cli", "gateway"]
    gw = subprocess.Popen(gw_cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results: list[dict] = []
    try:
        wait_http(f"http://127.0.0.1:{gw_port}/readyz")
        messages = [{"role": "user", "content": "Say hello to the benchmark."}]
        for stream in (False, True):
            body = {"model": "support", "messages": messages, "max_tokens": 16, "stream": stream}
            direct_req = http_request(stub.port, "/v1/chat/completions",
                                      body | {"loraplex": {"adapter": {"id": adapter_id, "name": "support@1",
                                                                       "uri": "", "sha256": None, "rank": 4},
                                                           "tenant": "bench", "priority": 1,
                                                           "request_id": "r"}}, None, settings.worker_secret)
            gw_req = http_request(gw_port, "/v1/chat/completions", body, token)
            # warm up both paths (connections, JIT-free but caches: JWT, resolution, ring)
            run_load(stub.port, direct_req, stream, 4, 0.5, 1)
            run_load(gw_port, gw_req, stream, 4, 0.5, 1)
            for c in levels:
                procs = 1 if c == 1 else args.procs
                s0 = cpu_seconds(stub.proc.pid)
                direct = run_load(stub.port, direct_req, stream, c, args.seconds, procs)
                direct["worker_cpu_ms_per_req"] = 1000 * (cpu_seconds(stub.proc.pid) - s0) / max(1, direct["requests"])
                g0 = cpu_seconds(gw.pid)
                s0 = cpu_seconds(stub.proc.pid)
                via = run_load(gw_port, gw_req, stream, c, args.seconds, procs)
                via["gateway_cpu_ms_per_req"] = 1000 * (cpu_seconds(gw.pid) - g0) / max(1, via["requests"])
                via["worker_cpu_ms_per_req"] = 1000 * (cpu_seconds(stub.proc.pid) - s0) / max(1, via["requests"])
                row = {"mode": "stream" if stream else "non-stream", "concurrency": c, "direct": direct,
                       "gateway": via, "added_p50_ms": via["p50_ms"] - direct["p50_ms"],
                       "added_p99_ms": via["p99_ms"] - direct["p99_ms"]}
                results.append(row)
                print(f"  {row['mode']:<10} c={c:<3} direct {direct['rps']:8.0f} req/s p50 {direct['p50_ms']:6.2f}"
                      f" | gateway {via['rps']:8.0f} req/s p50 {via['p50_ms']:6.2f} p99 {via['p99_ms']:6.2f}"
                      f" | cpu {via['gateway_cpu_ms_per_req']:.3f} ms/req", flush=True)
    finally:
        gw.terminate()
        try:
            gw.wait(10)
        except subprocess.TimeoutExpired:
            gw.kill()
        stub.stop()
        import redis

        r = redis.Redis.from_url(REDIS_URL)
        keys = list(r.scan_iter(f"{prefix}*"))
        if keys:
            r.delete(*keys)
        r.close()

    print()
    hdr = (f"{'mode':<10} {'conc':>4} | {'direct rps':>10} {'p50':>7} {'p99':>7} | {'gw rps':>8} {'p50':>7} "
           f"{'p99':>7} | {'+p50 ms':>7} {'+p99 ms':>7} | {'gw cpu ms/req':>13} | {'non-200':>7}")
    print(hdr)
    print("-" * len(hdr))
    for row in results:
        d, g = row["direct"], row["gateway"]
        print(f"{row['mode']:<10} {row['concurrency']:>4} | {d['rps']:>10.0f} {d['p50_ms']:>7.2f} {d['p99_ms']:>7.2f}"
              f" | {g['rps']:>8.0f} {g['p50_ms']:>7.2f} {g['p99_ms']:>7.2f} | {row['added_p50_ms']:>7.2f}"
              f" {row['added_p99_ms']:>7.2f} | {g['gateway_cpu_ms_per_req']:>13.3f} | {d['non_200'] + g['non_200']:>7}")
    out = {"benchmark": "gateway_overhead", "seconds_per_run": args.seconds, "loadgen_procs": args.procs,
           "cpus": os.cpu_count(), "python": platform.python_version(), "access_log": not args.no_access_log,
           "load_average_at_end": os.getloadavg(), "results": results}
    path = ROOT / "bench" / "results" / "gateway_overhead.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
