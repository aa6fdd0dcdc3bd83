"""The gateway in front of vLLM: what it adds, and what affinity routing saves in adapter loads.

Real processes on loopback: vLLM's CPU build on the exported demo model (``tests/vllm_fleet.py``:
the venv of ``scripts/vllm_venv.sh``, eager mode, one OpenMP thread each), ``loraplex vllm-agent``
beside each vLLM, ``loraplex gateway`` on a SQLite registry and Redis, and random rank-8 PEFT
adapters registered for one tenant (one alias each).

1. Overhead (one vLLM): ``--clients`` closed-loop clients over 8 and then 32 adapters, each
   request greedy with ``--max-tokens`` tokens, sent direct to vLLM (``model`` = version id,
   adapters registered beforehand) and through the gateway (alias; the agent loads), in
   ``--rounds`` alternating rounds of ``--requests`` each: p50 latency each side, the added
   p50 and the gateway's CPU time per request (utime+stime from ``/proc``), also net of what
   the idle gateway spends in the same time (its registry and residency refreshes: measured
   for ``--idle-s`` before the rounds), which dominates when vLLM-CPU takes seconds a request.
2. Loads (two vLLM workers, each agent with ``--max-adapters`` names): the same random sequence
   of ``--load-requests`` over 64 adapters through the gateway (affinity: the hash ring and the
   residency preference) and round-robin over the two workers (each request loads through that
   worker's agent first, as a router without affinity must): adapter loads (the agents'
   counters) per second and per request.

Prints the tables and writes ``bench/results/gateway_vllm.json``. vLLM-CPU is slow and the
machine is usually shared: compare only within one run.

    python bench/gateway_vllm.py [--clients 32] [--requests 64] [--rounds 2] [--max-tokens 4]
                                 [--load-requests 64] [--skip-loads | --skip-overhead]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loraplex.wire import HDR_WORKER_SECRET  # noqa: E402
from tests.e2e_cluster import Cluster, Proc  # noqa: E402
from tests.vllm_fleet import register_active, start_agent, start_vllm, vllm_python, wait_http  # noqa: E402

SECRET = "bench-worker-secret-" + uuid.uuid4().hex
PROMPT = "The capital of Italy is"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def adapters(home: Path, hf_dir: Path, n: int) -> dict[str, Path]:
    from tests.lora_fixtures import peft_adapters

    specs = {f"a{i:02d}": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]} for i in range(n)}
    _, dirs = peft_adapters(hf_dir, home / "adapters" / "bench", specs, std=0.1)
    return dirs


async def closed_loop(url: str, headers: dict[str, str], models: list[str], clients: int,
                      requests: int, max_tokens: int) -> list[float]:
    """``requests`` completions from ``clients`` concurrent loops over ``models`` in turn; latencies (s)."""
    todo = list(range(requests))
    latencies: list[float] = []

    async def loop(client: httpx.AsyncClient) -> None:
        while todo:
            i = todo.pop()
            t0 = time.perf_counter()
            r = await client.post("/v1/completions", headers=headers, json={
                "model": models[i % len(models)], "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0})
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            latencies.append(time.perf_counter() - t0)

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=clients)) as client:
        await asyncio.gather(*(loop(client) for _ in range(clients)))
    return latencies


def overhead(c: Cluster, vllm: Proc, agent: Proc, gateway: Proc, ids: dict[str, str], args: Any,
             dirs: dict[str, Path]) -> list[dict]:
    token = {"Authorization": f"Bearer {c.token('bench')}"}
    rows = []
    for n in (8, 32):
        names = sorted(ids)[:n]
        for name in names:  # direct needs them registered; the gateway's side then finds them held too
            r = httpx.post(agent.url + "/internal/adapters/load", timeout=600, headers={HDR_WORKER_SECRET: SECRET},
                           json={"adapter": _ref(ids, dirs, name)})
            r.raise_for_status()
        # warm-up, not measured: the gateway's tokenizer fetch, connections, the snapshot
        asyncio.run(closed_loop(gateway.url, token, names, min(args.clients, len(names)), len(names), 1))
        idle = idle_cpu_rate(gateway, args.idle_s)
        direct: list[float] = []
        through: list[float] = []
        cpu = wall = 0.0
        for _ in range(args.rounds):
            direct += asyncio.run(closed_loop(vllm.url, {}, [ids[m] for m in names], args.clients, args.requests,
                                              args.max_tokens))
            cpu0, t0 = cpu_seconds(gateway.popen.pid), time.perf_counter()  # type: ignore[union-attr]
            through += asyncio.run(closed_loop(gateway.url, token, names, args.clients, args.requests,
                                               args.max_tokens))
            cpu += cpu_seconds(gateway.popen.pid) - cpu0  # type: ignore[union-attr]
            wall += time.perf_counter() - t0
        row = {"adapters": n, "clients": args.clients, "requests": len(through), "rounds": args.rounds,
               "direct_p50_ms": statistics.median(direct) * 1e3, "gateway_p50_ms": statistics.median(through) * 1e3,
               "gateway_cpu_ms_per_request": cpu / len(through) * 1e3, "gateway_idle_cpu_ms_per_s": idle * 1e3,
               "gateway_net_cpu_ms_per_request": (cpu - idle * wall) / len(through) * 1e3,
               "load_average": os.getloadavg()[0]}
        row["added_p50_ms"] = row["gateway_p50_ms"] - row["direct_p50_ms"]
        rows.append(row)
    return rows


def idle_cpu_rate(gateway: Proc, seconds: float) -> float:
    """CPU seconds per second the gateway spends with no request in flight."""
    pid = gateway.popen.pid  # type: ignore[union-attr]
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    time.sleep(seconds)
    return (cpu_seconds(pid) - cpu0) / (time.perf_counter() - t0)


def _ref(ids: dict[str, str], dirs: dict[str, Path], name: str) -> dict[str, str]:
    from loraplex.digest import digest_directory

    return {"id": ids[name], "name": name, "uri": str(dirs[name]), "sha256": digest_directory(dirs[name])}


def loads(c: Cluster, fleet: list[tuple[Proc, Proc]], gateway: Proc, ids: dict[str, str], args: Any,
          dirs: dict[str, Path]) -> list[dict]:
    token = {"Authorization": f"Bearer {c.token('bench')}"}
    rng = random.Random(7)
    sequence = [rng.choice(sorted(ids)) for _ in range(args.load_requests)]
    refs = {name: _ref(ids, dirs, name) for name in ids}

    def counted() -> int:
        return sum(httpx.get(a.url + "/health", timeout=30).json()["loads"] for _, a in fleet)

    async def affinity() -> None:
        await closed_loop(gateway.url, token, sequence, args.clients, len(sequence), args.max_tokens)

    async def round_robin() -> None:
        todo = list(enumerate(sequence))

        async def loop(client: httpx.AsyncClient) -> None:
            while todo:
                i, name = todo.pop()
                vllm, agent = fleet[i % len(fleet)]
                r = await client.post(agent.url + "/internal/adapters/load", json={"adapter": refs[name]},
                                      headers={HDR_WORKER_SECRET: SECRET})
                r.raise_for_status()
                r = await client.post(vllm.url + "/v1/completions", json={
                    "model": ids[name], "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0})
                r.raise_for_status()

        async with httpx.AsyncClient(timeout=600) as client:
            await asyncio.gather(*(loop(client) for _ in range(args.clients)))

    rows = []
    for mode, run in (("affinity (gateway)", affinity), ("round-robin", round_robin)):
        for _, agent in fleet:  # start from empty workers
            for a in httpx.get(agent.url + "/internal/adapters", headers={HDR_WORKER_SECRET: SECRET},
                               timeout=60).json()["adapters"]:
                httpx.post(agent.url + "/internal/adapters/unload", json={"id": a["id"], "force": True},
                           headers={HDR_WORKER_SECRET: SECRET}, timeout=60)
        time.sleep(3)  # the reports say so before the run
        httpx.get(gateway.url + "/readyz", timeout=60)  # the gateway reloads the live set now
        before, t0 = counted(), time.perf_counter()
        asyncio.run(run())
        seconds, n = time.perf_counter() - t0, counted() - before
        rows.append({"mode": mode, "requests": len(sequence), "adapters": len(ids), "seconds": seconds,
                     "loads": n, "loads_per_s": n / seconds, "loads_per_request": n / len(sequence),
                     "load_average": os.getloadavg()[0]})
    return rows


def wait_reports(c: Cluster, control: dict[str, str], timeout_s: float = 120.0) -> None:
    """Until each worker's report in Redis names its (restarted) agent's URL."""
    import redis

    from loraplex.wire import WorkerReport

    r = redis.Redis.from_url(c.redis_url)
    deadline = time.monotonic() + timeout_s
    while True:
        raws = [r.get(f"{c.redis_prefix}:worker:{wid}") for wid in control]
        if all(raw and WorkerReport.from_json(raw).control_url == url for raw, url in zip(raws, control.values(),
                                                                                           strict=True)):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"reports of {sorted(control)} do not name the agents {control}")
        time.sleep(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64, help="requests per side in each round")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (direct, then gateway)")
    ap.add_argument("--idle-s", type=float, default=5.0, help="seconds the idle gateway's CPU is measured")
    ap.add_argument("--load-requests", type=int, default=64, help="requests of the loads run, per routing")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--max-adapters", type=int, default=16, help="each agent's --max-adapters in the loads run")
    ap.add_argument("--skip-loads", action="store_true")
    ap.add_argument("--skip-overhead", action="store_true")
    args = ap.parse_args()

    from engine.export_hf import export_hf
    from engine.fetch_demo import fetch_demo
    from tests.conftest import REDIS_URL

    python = vllm_python()
    home = Path(tempfile.mkdtemp(prefix="loraplex-bench-vllm-"))
    hf_dir = export_hf(fetch_demo(), home / "hf", say=lambda _m: None)
    c = Cluster(home=home, database_url=f"sqlite+aiosqlite:///{home}/registry.db", redis_url=REDIS_URL,
                redis_prefix=f"loraplex-bench-{uuid.uuid4().hex[:8]}", model=str(fetch_demo()),
                extra_env={"LORAPLEX_WORKER_SECRET": SECRET, "LORAPLEX_REGISTRY_REFRESH_S": "1"})
    procs: list[Proc] = []
    result: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "args": vars(args)}
    try:
        servers = [start_vllm(python, hf_dir, home / f"vllm{i}.log") for i in range(1 if args.skip_loads else 2)]
        procs += servers
        c.migrate()
        gateway = c.add_gateway("g1")
        procs.append(gateway)
        dirs = adapters(home, hf_dir, 64)
        t0 = time.monotonic()
        for s in servers:
            wait_http(s, "/health", 1200)
        result["vllm_startup_s"] = time.monotonic() - t0
        agents = [start_agent(c, f"v{i}", s.url, max_adapters=args.max_adapters if i else 64)
                  for i, s in enumerate(servers)]
        procs += agents
        for p in [*agents, gateway]:
            wait_http(p, "/health" if p in agents else "/readyz", 300)
        c.base_name = c.admin("POST", "/base-models", {"path": c.model})["name"]
        c.admin("POST", "/tenants", {"slug": "bench", "requests_per_min": 1_000_000, "tokens_per_min": 100_000_000,
                                     "max_concurrent": 1024})
        ids = register_active(c, "bench", dirs)
        load_avg = os.getloadavg()
        if not args.skip_loads:  # overhead on one worker: the second stays out until the loads run
            agents[1].kill()
            time.sleep(4)
        result["overhead"] = [] if args.skip_overhead else overhead(c, servers[0], agents[0], gateway, ids, args,
                                                                    dirs)
        print(f"\nGateway + agent in front of vLLM-CPU ({args.clients} clients, {args.rounds} x {args.requests} "
              f"requests per side, {args.max_tokens} tokens; load average {load_avg[0]:.1f} at the start)")
        print(f"{'adapters':>8} {'direct p50 ms':>14} {'gateway p50 ms':>15} {'added p50 ms':>13} {'gw CPU ms/req':>14}"
              f" {'idle ms/s':>10} {'net ms/req':>11} {'load avg':>9}")
        for r in result["overhead"]:
            print(f"{r['adapters']:>8} {r['direct_p50_ms']:>14.1f} {r['gateway_p50_ms']:>15.1f} "
                  f"{r['added_p50_ms']:>13.1f} {r['gateway_cpu_ms_per_request']:>14.2f} "
                  f"{r['gateway_idle_cpu_ms_per_s']:>10.2f} {r['gateway_net_cpu_ms_per_request']:>11.2f} "
                  f"{r['load_average']:>9.1f}")
        if not args.skip_loads:
            agents[0].kill()
            agents[:] = [start_agent(c, f"v{i}", s.url, max_adapters=args.max_adapters) for i, s in enumerate(servers)]
            procs += agents
            for a in agents:
                wait_http(a, "/health", 300)
            wait_reports(c, {a.name: a.url for a in agents})
            result["loads"] = loads(c, list(zip(servers, agents, strict=True)), gateway, ids, args, dirs)
            print(f"\nAdapter loads, 2 vLLM workers x {args.max_adapters} adapter names, 64 adapters, "
                  f"{args.load_requests} requests, {args.clients} clients")
            print(f"{'routing':>20} {'seconds':>8} {'loads':>6} {'loads/s':>8} {'loads/request':>14} {'load avg':>9}")
            for r in result["loads"]:
                print(f"{r['mode']:>20} {r['seconds']:>8.1f} {r['loads']:>6} {r['loads_per_s']:>8.2f} "
                      f"{r['loads_per_request']:>14.2f} {r['load_average']:>9.1f}")
        result["load_average_end"] = os.getloadavg()
    finally:
        for p in procs:
            p.kill()
    out = ROOT / "bench" / "results" / "gateway_vllm.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
