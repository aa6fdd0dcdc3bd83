"""Gateway overhead: a stub worker measured directly and through the gateway, and the gateway
beside an older commit's gateway and LiteLLM's proxy on the same stub workload.

Everything runs as real processes on loopback:

* a stub engine worker (``tests/stub_worker.py``) answering instantly and reporting its
  residency into Redis;
* a real registry (SQLite file, seeded by ``bench/gateway_seed.py`` with the measured tree's
  own code; changes fanned out over Redis) with one tenant, one base model and one adapter
  bound to an alias;
* the gateway as ``loraplex gateway`` (uvicorn's httptools protocol with the gateway's edge
  deadlines, uvloop; its metrics on their own port) with auth (JWT),
  resolution, Redis limits (high enough never to refuse) and routing all on;
* a load generator of raw asyncio HTTP/1.1 keep-alive connections spread over several
  processes, so the client side is cheap.

For concurrency 1, 16 and 64, non-streaming and streaming (5 chunks), it prints requests/s
and p50/p99 latency direct vs. through the gateway, the added p50 latency, and the gateway's
CPU time per request (utime+stime of the process and its children from /proc before/after
each run).

Comparison (non-streamed, ``--compare-concurrency``, ``--repeats`` rounds in alternation,
each side with its own stub worker, measured direct and through the proxy in every round):

* ``--baseline REF``, repeatable (or ``LORAPLEX_BENCH_BASELINE``, comma-separated; the first is
  the bar's reference): ``git archive REF`` into a temporary
  directory and run that version's gateway with this venv's interpreter (``PYTHONPATH`` = the
  export) and its own registry. Versions older than the worker secret send none: its stub runs
  with ``--no-secret-check``.
* ``--litellm PYTHON`` (or ``LITELLM_PYTHON``): the python of a venv holding ``litellm[proxy]``
  (never this project's venv). ``litellm --config`` serves one model on the stub worker
  (OpenAI-compatible provider, ``api_base`` = the stub), with its Redis rate limiting on: the
  proxy's limiter on the key's rpm/tpm/parallel limits (a ``custom_auth`` hook hands out the
  key with its limits, since without a database the proxy has no keys with limits; a plain key
  compare is cheaper than our JWT check) over ``general_settings.coordination_redis``, and the
  router's deployment rpm/tpm over ``router_settings.redis_host``. A key with ``rpm_limit`` 2
  must get its 429 before measuring, so the limiter is known to run. No database.

It prints one table per side (req/s, added p50/p99, CPU ms/request) and the CPU ratios
this tree / baseline and LiteLLM / this tree. Writes ``bench/results/gateway_overhead.json``.

    python bench/gateway_overhead.py [--seconds 4] [--concurrency 1,16,64]
    python bench/gateway_overhead.py --skip-matrix --baseline 4946e5a --litellm /tmp/litellm-venv/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import platform
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loraplex.wire import HDR_WORKER_SECRET  # noqa: E402
from tests.stub_worker import StubProcess, free_port  # noqa: E402

REDIS_URL = os.environ.get("LORAPLEX_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
CLK_TCK = os.sysconf("SC_CLK_TCK")
MESSAGES = [{"role": "user", "content": "Say hello to the benchmark."}]


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


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()  # fields from 3 (state) on


def cpu_seconds(pid: int) -> float:
    """utime+stime of one process."""
    f = _stat(pid)
    return (int(f[11]) + int(f[12])) / CLK_TCK


def tree_cpu_seconds(pid: int) -> float:
    """utime+stime of ``pid``, its live descendants, and its reaped children (cutime+cstime)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError):
                children.setdefault(int(_stat(int(entry))[1]), []).append(int(entry))
    f = _stat(pid)
    total = int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        with contextlib.suppress(OSError, IndexError):
            c = _stat(child)
            total += int(c[11]) + int(c[12])
        todo += children.get(child, [])
    return total / CLK_TCK


# -- systems under test -----------------------------------------------------------------------------


@dataclass
class Side:
    """One proxy under test with its own stub worker: requests by ``stream`` flag, direct and via."""

    name: str
    role: str  # "now", "baseline" or "litellm"
    proc: subprocess.Popen
    port: int
    stub: StubProcess
    via: dict[bool, bytes]
    direct: dict[bool, bytes]
    info: dict = field(default_factory=dict)
    cleanup: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        stop_process(self.proc)
        self.stub.stop()
        for fn in reversed(self.cleanup):
            with contextlib.suppress(Exception):
                fn()


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def wait_http(url: str, proc: subprocess.Popen, seconds: float = 60.0, log: Path | None = None) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
    raise RuntimeError(f"{url} did not become ready (exit code {proc.poll()})\n{tail}")


def delete_redis_keys(patterns: tuple[str, ...], keep: frozenset[bytes] = frozenset()) -> None:
    import redis

    r = redis.Redis.from_url(REDIS_URL)
    try:
        keys = [k for p in patterns for k in r.scan_iter(p) if k not in keep]
        if keys:
            r.delete(*keys)
    finally:
        r.close()


def export_tree(ref: str, into: Path) -> Path:
    """``git archive ref`` of this repository, unpacked into ``into``."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def start_loraplex(name: str, role: str, tree: Path, tmp: Path, *, secret_check: bool,
                   access_log: bool) -> Side:
    """Seed a registry with ``tree``'s code, start a stub worker and ``tree``'s ``loraplex gateway``."""
    home = tmp / name.replace(" ", "-")
    (home / "adapters").mkdir(parents=True)
    prefix = f"loraplex-bench-{uuid.uuid4().hex[:8]}"
    worker_secret = secrets.token_hex(16)
    gw_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env |= dict(PYTHONPATH=str(tree), LORAPLEX_HOME=str(home),
                LORAPLEX_DATABASE_URL=f"sqlite+aiosqlite:///{home}/registry.db", LORAPLEX_REDIS_URL=REDIS_URL,
                LORAPLEX_REDIS_PREFIX=prefix, LORAPLEX_ADAPTER_ROOT=str(home / "adapters"),
                LORAPLEX_JWT_SECRET=secrets.token_hex(32), LORAPLEX_WORKER_SECRET=worker_secret,
                LORAPLEX_GATEWAY_HOST="127.0.0.1", LORAPLEX_GATEWAY_PORT=str(gw_port),
                LORAPLEX_GATEWAY_METRICS_PORT=str(free_port()),
                LORAPLEX_LOG_LEVEL="INFO" if access_log else "WARNING")
    seeded = subprocess.run([sys.executable, str(ROOT / "bench" / "gateway_seed.py")], cwd=tree, env=env,
                            capture_output=True, text=True)
    if seeded.returncode != 0:
        raise RuntimeError(f"seeding the registry of {name} failed:\n{seeded.stderr[-3000:]}")
    seed = json.loads(seeded.stdout.strip().splitlines()[-1])
    extra = ("--chunks", "5") + (("--worker-secret", worker_secret) if secret_check else ("--no-secret-check",))
    stub = StubProcess(f"{prefix}-w1", redis_url=REDIS_URL, redis_prefix=prefix, base_model="tiny",
                       device=(seed["adapter_id"],), extra=extra).start()
    # The command's module moved to loraplex_cli; older trees (a --baseline) still have loraplex/cli.py.
    module = "loraplex_cli" if (tree / "loraplex_cli").is_dir() else "loraplex.cli"
    proc = subprocess.Popen([sys.executable, "-m", module, "gateway"], cwd=tree, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    side = Side(name, role, proc, gw_port, stub, {}, {},
                cleanup=[lambda: delete_redis_keys((f"{prefix}*",))])
    try:
        wait_http(f"http://127.0.0.1:{gw_port}/readyz", proc)
        ext = {"adapter": {"id": seed["adapter_id"], "name": "support@1", "uri": "", "sha256": "0" * 64, "rank": 4},
               "tenant": "bench", "priority": 1, "request_id": "r"}
        for stream in (False, True):
            body = {"model": "support", "messages": MESSAGES, "max_tokens": 16, "stream": stream}
            side.via[stream] = http_request(gw_port, "/v1/chat/completions", body, seed["token"])
            side.direct[stream] = http_request(stub.port, "/v1/chat/completions", body | {"loraplex": ext}, None,
                                               worker_secret if secret_check else "")
    except BaseException:
        side.close()
        raise
    return side


LITELLM_AUTH = '''\
"""Benchmark-only key check for LiteLLM's proxy: hands out keys with rate limits (no database)."""
import hmac

from litellm.proxy._types import UserAPIKeyAuth

BIG = 2**31 - 1


async def user_api_key_auth(request, api_key: str) -> UserAPIKeyAuth:
    if hmac.compare_digest(api_key, {key!r}):
        return UserAPIKeyAuth(api_key=api_key, rpm_limit=BIG, tpm_limit=BIG, max_parallel_requests=100_000)
    if hmac.compare_digest(api_key, {limited!r}):
        return UserAPIKeyAuth(api_key=api_key, rpm_limit=2, tpm_limit=BIG)
    raise ValueError("invalid key")
'''

LITELLM_REDIS_KEYS = ("{api_key:*", "{model_per_key:*", "global_router:*")


def litellm_config(stub_url: str, master_key: str) -> str:
    redis = urllib.parse.urlsplit(REDIS_URL)
    return textwrap.dedent(f"""\
        model_list:
          - model_name: support
            litellm_params:
              model: openai/support
              api_base: {stub_url}/v1
              api_key: stub-key
              rpm: {2**31 - 1}
              tpm: {2**31 - 1}
        router_settings:
          redis_host: {redis.hostname or "127.0.0.1"}
          redis_port: {redis.port or 6379}
        general_settings:
          master_key: {master_key}
          custom_auth: bench_auth.user_api_key_auth
          coordination_redis:
            url: {REDIS_URL}
        """)


def check_litellm_limiter(port: int, key: str) -> str:
    """The key with rpm_limit 2 must be refused by the third request, or the limiter is not on."""
    body = json.dumps({"model": "support", "messages": MESSAGES, "max_tokens": 16}).encode()
    codes = []
    for _ in range(4):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                codes.append(r.status)
        except urllib.error.HTTPError as exc:
            codes.append(exc.code)
    if codes[:2] != [200, 200] or 429 not in codes[2:]:
        raise RuntimeError(f"LiteLLM's rate limiter did not refuse a key over its rpm_limit of 2: {codes}")
    return f"rpm_limit 2: statuses {codes}"


def start_litellm(python: str, tmp: Path) -> Side:
    """LiteLLM's proxy in its own venv, one model on a secret-free stub worker, Redis limits on."""
    exe = Path(python).parent / "litellm"
    if not exe.exists():
        raise RuntimeError(f"{exe} not found: --litellm/LITELLM_PYTHON must be the python of a venv with "
                           "litellm[proxy] installed")
    version = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    home = tmp / "litellm"
    home.mkdir()
    stub = StubProcess("litellm-w1", extra=("--chunks", "5", "--no-secret-check")).start()
    key, limited = f"sk-bench-{secrets.token_hex(16)}", f"sk-limited-{secrets.token_hex(16)}"
    (home / "bench_auth.py").write_text(LITELLM_AUTH.format(key=key, limited=limited))
    (home / "config.yaml").write_text(litellm_config(stub.url, f"sk-{secrets.token_hex(32)}"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONPATH": str(home)}
    log = home / "stderr.log"
    import redis

    r = redis.Redis.from_url(REDIS_URL)
    before = frozenset(k for p in LITELLM_REDIS_KEYS for k in r.scan_iter(p))
    r.close()
    with open(log, "wb") as err:
        proc = subprocess.Popen([str(exe), "--config", str(home / "config.yaml"), "--host", "127.0.0.1",
                                 "--port", str(port)], cwd=home, env=env, stdout=subprocess.DEVNULL, stderr=err)
    side = Side(f"litellm {version}", "litellm", proc, port, stub, {}, {},
                cleanup=[lambda: delete_redis_keys(LITELLM_REDIS_KEYS, keep=before)])
    try:
        wait_http(f"http://127.0.0.1:{port}/health/liveliness", proc, seconds=180, log=log)
        side.info = {"version": version, "limiter_check": check_litellm_limiter(port, limited)}
        for stream in (False, True):
            body = {"model": "support", "messages": MESSAGES, "max_tokens": 16, "stream": stream}
            side.via[stream] = http_request(port, "/v1/chat/completions", body, key)
            side.direct[stream] = http_request(stub.port, "/v1/chat/completions", body, None)
    except BaseException:
        side.close()
        raise
    return side


# -- measurement ------------------------------------------------------------------------------------


def measure(side: Side, stream: bool, concurrency: int, seconds: float, procs: int) -> dict:
    """One run straight to ``side``'s stub, then one through ``side``'s proxy, at ``concurrency``."""
    procs = 1 if concurrency == 1 else procs
    s0 = cpu_seconds(side.stub.proc.pid)
    direct = run_load(side.stub.port, side.direct[stream], stream, concurrency, seconds, procs)
    direct["worker_cpu_ms_per_req"] = 1000 * (cpu_seconds(side.stub.proc.pid) - s0) / max(1, direct["requests"])
    g0 = tree_cpu_seconds(side.proc.pid)
    s0 = cpu_seconds(side.stub.proc.pid)
    via = run_load(side.port, side.via[stream], stream, concurrency, seconds, procs)
    via["gateway_cpu_s"] = tree_cpu_seconds(side.proc.pid) - g0
    via["gateway_cpu_ms_per_req"] = 1000 * via["gateway_cpu_s"] / max(1, via["requests"])
    via["worker_cpu_ms_per_req"] = 1000 * (cpu_seconds(side.stub.proc.pid) - s0) / max(1, via["requests"])
    return {"mode": "stream" if stream else "non-stream", "concurrency": concurrency, "direct": direct,
            "gateway": via, "added_p50_ms": via["p50_ms"] - direct["p50_ms"],
            "added_p99_ms": via["p99_ms"] - direct["p99_ms"]}


def warm_up(side: Side, stream: bool, seconds: float = 0.5) -> None:
    run_load(side.stub.port, side.direct[stream], stream, 4, 0.5, 1)
    run_load(side.port, side.via[stream], stream, 4, seconds, 1)


def run_matrix(side: Side, levels: list[int], seconds: float, procs: int) -> list[dict]:
    results: list[dict] = []
    for stream in (False, True):
        warm_up(side, stream)
        for c in levels:
            row = measure(side, stream, c, seconds, procs)
            d, via = row["direct"], row["gateway"]
            results.append(row)
            print(f"  {row['mode']:<10} c={c:<3} direct {d['rps']:8.0f} req/s p50 {d['p50_ms']:6.2f}"
                  f" | gateway {via['rps']:8.0f} req/s p50 {via['p50_ms']:6.2f} p99 {via['p99_ms']:6.2f}"
                  f" | cpu {via['gateway_cpu_ms_per_req']:.3f} ms/req", flush=True)
    return results


def summarise_side(runs: list[dict]) -> dict:
    vias = [r["gateway"] for r in runs]
    requests = sum(v["requests"] for v in vias)
    return {"runs": len(runs), "requests": requests, "rps": statistics.fmean(v["rps"] for v in vias),
            "added_p50_ms": statistics.median(r["added_p50_ms"] for r in runs),
            "added_p99_ms": statistics.median(r["added_p99_ms"] for r in runs),
            "p50_ms": statistics.median(v["p50_ms"] for v in vias),
            "cpu_ms_per_req": 1000 * sum(v["gateway_cpu_s"] for v in vias) / max(1, requests),
            "cpu_ms_per_req_each_run": [v["gateway_cpu_ms_per_req"] for v in vias],
            "non_200": sum(r["direct"]["non_200"] + r["gateway"]["non_200"] for r in runs)}


def run_comparison(sides: list[Side], concurrency: int, seconds: float, repeats: int, procs: int) -> dict:
    """``repeats`` rounds over every side (order reversed every other round), non-streamed."""
    for side in sides:
        warm_up(side, False, seconds=1.0)
    runs: dict[str, list[dict]] = {s.name: [] for s in sides}
    for rnd in range(repeats):
        for side in sides if rnd % 2 == 0 else sides[::-1]:
            row = measure(side, False, concurrency, seconds, procs)
            runs[side.name].append(row)
            print(f"  round {rnd + 1} {side.name:<24} {row['gateway']['rps']:8.0f} req/s"
                  f" +p50 {row['added_p50_ms']:7.2f} ms cpu {row['gateway']['gateway_cpu_ms_per_req']:.3f} ms/req",
                  flush=True)
    return {"concurrency": concurrency, "seconds_per_run": seconds, "repeats": repeats,
            "sides": {s.name: summarise_side(runs[s.name]) | {"role": s.role, "info": s.info} for s in sides},
            "runs": runs}


def print_comparison(cmp: dict, now: str, baselines: list[str], litellm: str | None) -> dict:
    sides = cmp["sides"]
    print(f"\nnon-streamed, concurrency {cmp['concurrency']}, {cmp['repeats']} x {cmp['seconds_per_run']:g} s per side")
    hdr = (f"{'side':<26} | {'req/s':>8} | {'+p50 ms':>8} | {'+p99 ms':>8} | {'CPU ms/req':>10} | {'non-200':>7}")
    print(hdr)
    print("-" * len(hdr))
    for name, s in sides.items():
        print(f"{name:<26} | {s['rps']:>8.0f} | {s['added_p50_ms']:>8.2f} | {s['added_p99_ms']:>8.2f} |"
              f" {s['cpu_ms_per_req']:>10.3f} | {s['non_200']:>7}")
    ratios: dict[str, Any] = {}
    cpu_now = sides[now]["cpu_ms_per_req"]
    for i, baseline in enumerate(baselines):
        ratio = cpu_now / sides[baseline]["cpu_ms_per_req"]
        if i == 0:
            ratios["cpu_now_over_baseline"] = ratio
        ratios.setdefault("cpu_now_over_each_baseline", {})[baseline] = ratio
        bar = " (bar: <= 1.5x)" if i == 0 else ""
        print(f"CPU per request, {now} / {baseline}: {ratio:.2f}x{bar}")
    if litellm:
        ratios["cpu_litellm_over_now"] = sides[litellm]["cpu_ms_per_req"] / cpu_now
        print(f"CPU per request, {litellm} / {now}: {ratios['cpu_litellm_over_now']:.0f}x (bar: >= 40x)")
    return ratios


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--procs", type=int, default=2, help="load generator processes")
    ap.add_argument("--no-access-log", action="store_true",
                    help="turn the per-request log line off (default: on, written to /dev/null)")
    ap.add_argument("--skip-matrix", action="store_true", help="only the comparison (needs --baseline/--litellm)")
    ap.add_argument("--baseline", action="append", default=[],
                    help="git ref whose gateway is measured beside this tree's (e.g. 4946e5a); repeat it to "
                         "measure several (the first is the bar's reference)")
    ap.add_argument("--litellm", default=os.environ.get("LITELLM_PYTHON", ""),
                    help="python of a venv with litellm[proxy]; its proxy is measured beside ours")
    ap.add_argument("--compare-concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="comparison rounds over every side")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    if not args.baseline and os.environ.get("LORAPLEX_BENCH_BASELINE"):
        args.baseline = os.environ["LORAPLEX_BENCH_BASELINE"].split(",")
    if args.skip_matrix and not (args.baseline or args.litellm):
        ap.error("--skip-matrix needs --baseline or --litellm")

    tmp = Path(tempfile.mkdtemp(prefix="loraplex-bench-"))
    sides: list[Side] = []
    results: list[dict] = []
    comparison: dict | None = None
    load_start = os.getloadavg()
    try:
        now = start_loraplex("loraplex (this tree)", "now", ROOT, tmp, secret_check=True,
                             access_log=not args.no_access_log)
        sides.append(now)
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        now.info = {"commit": head, "uncommitted_changes": bool(dirty)}
        if not args.skip_matrix:
            results = run_matrix(now, levels, args.seconds, args.procs)
        baselines: list[Side] = []
        litellm = None
        for name in args.baseline:
            ref = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", name], check=True,
                                 capture_output=True, text=True).stdout.strip()
            tree = export_tree(ref, tmp / f"baseline-{ref}")
            baseline = start_loraplex(f"loraplex {ref}", "baseline", tree, tmp, secret_check=False,
                                      access_log=not args.no_access_log)
            baseline.info = {"ref": name, "commit": ref}
            sides.append(baseline)
            baselines.append(baseline)
        if args.litellm:
            litellm = start_litellm(args.litellm, tmp)
            sides.append(litellm)
        if baselines or litellm:
            comparison = run_comparison(sides, args.compare_concurrency, args.seconds, args.repeats, args.procs)
    finally:
        for side in sides:
            side.close()
        shutil.rmtree(tmp, ignore_errors=True)

    if results:
        print()
        hdr = (f"{'mode':<10} {'conc':>4} | {'direct rps':>10} {'p50':>7} {'p99':>7} | {'gw rps':>8} {'p50':>7} "
               f"{'p99':>7} | {'+p50 ms':>7} {'+p99 ms':>7} | {'gw cpu ms/req':>13} | {'non-200':>7}")
        print(hdr)
        print("-" * len(hdr))
        for row in results:
            d, g = row["direct"], row["gateway"]
            print(f"{row['mode']:<10} {row['concurrency']:>4} | {d['rps']:>10.0f} {d['p50_ms']:>7.2f}"
                  f" {d['p99_ms']:>7.2f} | {g['rps']:>8.0f} {g['p50_ms']:>7.2f} {g['p99_ms']:>7.2f} |"
                  f" {row['added_p50_ms']:>7.2f} {row['added_p99_ms']:>7.2f} | {g['gateway_cpu_ms_per_req']:>13.3f}"
                  f" | {d['non_200'] + g['non_200']:>7}")
    if comparison is not None:
        comparison["ratios"] = print_comparison(comparison, sides[0].name, [b.name for b in baselines],
                                                litellm.name if litellm else None)
    out = {"benchmark": "gateway_overhead", "seconds_per_run": args.seconds, "loadgen_procs": args.procs,
           "cpus": os.cpu_count(), "python": platform.python_version(), "access_log": not args.no_access_log,
           "load_average_at_start": load_start, "load_average_at_end": os.getloadavg(), "results": results,
           "comparison": comparison}
    path = ROOT / "bench" / "results" / "gateway_overhead.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"\nload average at start {load_start[0]:.2f}, at end {out['load_average_at_end'][0]:.2f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
