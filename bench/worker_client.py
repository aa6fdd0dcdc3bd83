"""The gateway->worker HTTP client alone: httpx vs aiohttp vs the gateway's ``WorkerClient``.

One process drives ``concurrency`` keep-alive requests against the stub worker
(``tests/stub_worker.py``, its own process) and reports this process's CPU time per
request, non-streamed and streamed (5 chunks). This is the measurement behind the choice
of aiohttp for ``gateway/worker_client.py``. Writes ``bench/results/worker_client.json``.

    python bench/worker_client.py [--seconds 3] [--concurrency 16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402

from gateway.worker_client import WorkerClient  # noqa: E402
from loraplex.settings import DEV_WORKER_SECRET  # noqa: E402
from loraplex.wire import HDR_WORKER_SECRET  # noqa: E402
from tests.stub_worker import StubProcess  # noqa: E402

HEADERS = {"content-type": "application/json", HDR_WORKER_SECRET: DEV_WORKER_SECRET, "x-request-id": "r"}


def body(stream: bool) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                         "stream": stream,
                         "loraplex": {"adapter": None, "tenant": "t", "priority": 1, "request_id": "r"}})


async def _loop(one, concurrency: int, seconds: float) -> tuple[int, float]:
    for _ in range(50):
        await one()
    n = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal n
        while time.perf_counter() < stop:
            await one()
            n += 1

    c0 = time.process_time()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return n, 1000 * (time.process_time() - c0) / max(1, n)


async def run_httpx(url: str, stream: bool, concurrency: int, seconds: float) -> tuple[int, float]:
    import httpx

    payload = body(stream)
    async with httpx.AsyncClient(timeout=httpx.Timeout(30, connect=2), trust_env=False,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=256)) as c:
        async def one() -> None:
            r = await c.send(c.build_request("POST", url, content=payload, headers=HEADERS), stream=True)
            try:
                async for _ in r.aiter_raw():
                    pass
            finally:
                await r.aclose()

        return await _loop(one, concurrency, seconds)


async def run_aiohttp(url: str, stream: bool, concurrency: int, seconds: float) -> tuple[int, float]:
    import aiohttp

    payload = body(stream)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
                                     cookie_jar=aiohttp.DummyCookieJar(),
                                     skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding")) as s:
        async def one() -> None:
            async with s.post(url, data=payload, headers=HEADERS) as r:
                while await r.content.readany():
                    pass

        return await _loop(one, concurrency, seconds)


async def run_worker_client(url: str, stream: bool, concurrency: int, seconds: float) -> tuple[int, float]:
    client = WorkerClient(DEV_WORKER_SECRET)
    payload = body(stream)

    async def one() -> None:
        r = await client.post(url, payload, "r")
        async for _ in r.chunks():
            pass
        r.close()

    try:
        return await _loop(one, concurrency, seconds)
    finally:
        await client.close()


CLIENTS = {"httpx": run_httpx, "aiohttp": run_aiohttp, "WorkerClient": run_worker_client}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    rows = []
    with StubProcess("bench", extra=("--chunks", "5")) as stub:
        url = stub.url + "/v1/chat/completions"
        for rnd in range(args.rounds):
            for stream in (False, True):
                for name, fn in CLIENTS.items():
                    n, cpu = run(fn(url, stream, args.concurrency, args.seconds))
                    row = {"round": rnd, "mode": "stream" if stream else "non-stream", "client": name,
                           "requests": n, "rps": n / args.seconds, "client_cpu_ms_per_req": cpu}
                    rows.append(row)
                    print(f"{row['mode']:<10} {name:<12} c={args.concurrency} {row['rps']:8.0f} req/s  "
                          f"client cpu {cpu:.3f} ms/req", flush=True)
    path = ROOT / "bench" / "results" / "worker_client.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": "worker_client", "concurrency": args.concurrency,
                                "seconds_per_run": args.seconds, "results": rows}, indent=2))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
