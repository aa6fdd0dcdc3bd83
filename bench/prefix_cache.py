"""Prefix reuse served: loraplex through its gateway, prefix cache on and off, against vLLM-CPU.

One machine, one server at a time, the demo model (its GGUF for loraplex, its ``export-hf`` for
vLLM), 4 random rank-16 PEFT adapters on all projections, the project's streaming client
(``bench/serve_vs_vllm.py``: closed-loop clients, greedy, ``ignore_eos``, prompts sent as token
ids to ``/v1/completions``, tokens counted by arrival, TTFT p50/p99 over the requests sent in
the window, the first burst included).

* ``loraplex``: ``loraplex gateway`` (SQLite registry, Redis) in front of one ``loraplex worker``
  at its defaults (``--worker-kv-bytes`` 0: the pool sized from the machine) with the prefix cache
  on, the adapters registered, activated and bound for one tenant (``tests/e2e_cluster.py``'s
  fleet, ``tests/vllm_fleet.py``'s registration);
* ``loraplex-nocache``: the same build and settings with ``LORAPLEX_PREFIX_CACHE=false``;
* ``vllm``: vLLM's CPU build (``scripts/vllm_venv.sh``) at its defaults (automatic prefix caching
  on) but for a 4 GiB KV space (``VLLM_KV_GIB``), ``--vllm-dtype`` (its best on this CPU), direct; ``--enable-lora`` only for the
  adapter cases, as ``serve_vs_vllm.py`` runs it.

Cases:

* ``prefix/base``, ``prefix/4``: vLLM's ``prefix_repetition`` shape: 4 shared 512-token prefixes,
  each prompt one of them and 32 fresh random tokens, 32 new tokens, 16 clients; the base model,
  then 4 adapters (client ``i`` uses adapter ``i mod 4`` and prefix ``(i + k) mod 4`` for its
  ``k``-th request, so every adapter meets every prefix);
* ``random/base``: no prompt repeats (256 fresh random tokens each, 128 new, 32 clients): what the
  cache costs where it never hits (``loraplex`` against ``loraplex-nocache``, the same build);
* ``conversation`` (loraplex servers only): ``--conversations`` 8-turn Responses conversations one
  after another through the gateway, each turn a new user message of ``--turn-words`` words
  continuing the last with ``previous_response_id`` (so its prompt is every earlier turn, as the
  gateway replays them, and the new message), ``--turn-tokens`` output tokens, after one turn not
  measured: each turn's TTFT (to the first ``response.output_text.delta``), its median over the
  conversations, and last over first.

Where the server's usage says ``cached_tokens`` (loraplex; vLLM with
``--enable-prompt-tokens-details``, which only adds the field), the share of prompt tokens it
served from cache is printed too. Each server process's cores are probed before it starts and
after it stops (``serve_vs_vllm.speed_probe``). ``--rounds N`` runs every server N times,
alternating, and keeps each case's median round.

Prints the tables, writes ``bench/results/prefix_cache.json``.

    python bench/prefix_cache.py [--servers loraplex,loraplex-nocache,vllm] [--cases prefix/base,...]
                                 [--seconds 60] [--warmup 10] [--rounds 1] [--conversations 3]
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
sys.path.insert(0, str(ROOT / "bench"))

from serve_vs_vllm import (  # noqa: E402
    RANK,
    Case,
    Server,
    VLLMServer,
    completion_body,
    drive_http,
    http_phase,
    loadavg,
    median_of_rounds,
    ratio,
    run_cases,
    speed_probe,
    warm,
    with_probes,
)

RESULTS = ROOT / "bench" / "results"
SECRET = "prefix-cache-bench-" + uuid.uuid4().hex
TENANT = "bench"
ADAPTERS = 4
SERVERS = ("loraplex", "loraplex-nocache", "vllm")
WORDS = ("river stone window garden yellow quiet market letter winter travel silver orange simple "
         "morning number mountain engine pocket story bridge little summer forest answer moment paper "
         "signal doctor island button planet kitchen pencil shadow rabbit castle ticket copper harbor").split()


def all_cases() -> list[Case]:
    return [Case("prefix/base", 544, 32, 0, 16, prompts="prefix"),
            Case("prefix/4", 544, 32, ADAPTERS, 16, prompts="prefix"),
            Case("random/base", 256, 128, 0, 32, prompts="unique")]


class GatewayServer(Server):
    """A gateway and one bundled worker (``tests.e2e_cluster.Cluster``), the adapters bound for
    one tenant; requests name the base model or an adapter's alias, with the tenant's token."""

    def __init__(self, label: str, home: Path, model: Path, adapters: dict[str, Path], worker_env: dict[str, str],
                 redis_url: str, adapter_root: Path) -> None:
        from tests.e2e_cluster import Cluster

        super().__init__(home / f"{label}.log")
        self.label = label
        self.adapters = adapters
        self.names = sorted(adapters)
        self.cluster = Cluster(home=home, database_url=f"sqlite+aiosqlite:///{home}/registry.db", redis_url=redis_url,
                               redis_prefix=f"loraplex-bench-{uuid.uuid4().hex[:8]}", model=str(model),
                               extra_env={"LORAPLEX_WORKER_SECRET": SECRET, "LORAPLEX_REGISTRY_REFRESH_S": "1",
                                          "LORAPLEX_ADAPTER_ROOT": str(adapter_root)},
                               worker_env=worker_env)
        self.cluster.migrate()
        self.cluster.add_worker("w1")
        self.cluster.add_gateway("g1")
        self.token = ""

    @property
    def url(self) -> str:
        return self.cluster.gateways[0].url

    def wait_ready(self, timeout_s: float) -> None:
        from tests.vllm_fleet import register_active

        c = self.cluster
        c.wait_ready(timeout_s)
        c.base_name = c.admin("POST", "/base-models", {"path": c.model})["name"]
        c.admin("POST", "/tenants", {"slug": TENANT, "requests_per_min": 1_000_000, "tokens_per_min": 1_000_000_000,
                                     "max_concurrent": 1024})
        register_active(c, TENANT, self.adapters)
        c.wait_current()
        self.token = c.token(TENANT)

    def stop(self) -> None:
        self.cluster.stop()

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def body(self, prompt: list[int], new: int, adapter: int | None) -> dict[str, Any]:
        return completion_body(self.cluster.base_name if adapter is None else self.names[adapter], prompt, new)


# --- the Responses conversation ------------------------------------------------------------------

def turn_text(rng: random.Random, turn: int, words: int) -> str:
    return f"Part {turn + 1}. " + " ".join(rng.choice(WORDS) for _ in range(words)) + ". Go on with the story."


def one_turn(server: GatewayServer, text: str, previous: str | None, new: int) -> dict[str, Any]:
    """One streamed Responses turn: its TTFT, id and usage."""
    body: dict[str, Any] = {"model": server.cluster.base_name, "input": text, "max_output_tokens": new,
                            "temperature": 0.0, "stream": True}
    if previous is not None:
        body["previous_response_id"] = previous
    t0 = time.monotonic()
    ttft = None
    final: dict[str, Any] | None = None
    with httpx.stream("POST", server.url + "/v1/responses", json=body, headers=server.headers(), timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"turn: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            kind = event.get("type")
            if kind == "response.output_text.delta" and ttft is None:
                ttft = time.monotonic() - t0
            elif kind in ("response.completed", "response.incomplete", "response.failed"):
                final = event["response"]
    if final is None or final.get("status") == "failed":
        raise RuntimeError(f"turn did not complete: {final}")
    usage = final.get("usage") or {}
    return {"ttft_s": ttft, "id": final["id"], "input_tokens": usage.get("input_tokens"),
            "cached_tokens": (usage.get("input_tokens_details") or {}).get("cached_tokens"),
            "output_tokens": usage.get("output_tokens")}


def conversations(server: GatewayServer, args: argparse.Namespace) -> dict[str, Any]:
    """``args.conversations`` conversations of ``args.turns`` turns, one after another, after one
    turn not measured (the gateway's first Responses turn sets up what later ones reuse)."""
    rng = random.Random(7)
    one_turn(server, "Hello.", None, 4)
    runs = []
    for _ in range(args.conversations):
        previous, turns = None, []
        for t in range(args.turns):
            turn = one_turn(server, turn_text(rng, t, args.turn_words), previous, args.turn_tokens)
            previous = turn.pop("id")
            turns.append(turn)
        runs.append(turns)
    per_turn = []
    for t in range(args.turns):
        ttfts = [r[t]["ttft_s"] for r in runs if r[t]["ttft_s"] is not None]
        per_turn.append({"turn": t + 1, "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
                         "input_tokens": statistics.median(r[t]["input_tokens"] or 0 for r in runs),
                         "cached_tokens": statistics.median(r[t]["cached_tokens"] or 0 for r in runs)})
    first, last = per_turn[0]["ttft_p50_s"], per_turn[-1]["ttft_p50_s"]
    return {"turns": per_turn, "last_over_first": ratio(last, first), "runs": runs}


# --- the run -------------------------------------------------------------------------------------

def vllm_client_runs(label: str, args: argparse.Namespace, url: str, token: str, base_model: str,
                     loras: list[str] | None, hf: Path, tmp: Path, base: bool = True) -> dict[str, dict[str, Any]]:
    """vLLM's own client (``bench/vllm_client.py``) over the prefix cases this server serves now:
    ``prefix/base`` unless ``base`` is False, ``prefix/4`` when ``loras`` names its adapters."""
    from vllm_client import prefix_repetition
    from vllm_greedy import vllm_python

    python = vllm_python(args.vllm_python)
    out = {}
    plan = ([("prefix/base", None)] if base else []) + ([("prefix/4", loras)] if loras else [])
    for case, names in plan:
        r = prefix_repetition(python, base_url=url, model=base_model, tokenizer=hf, token=token, loras=names,
                              out=tmp / f"vllm-client-{label}-{case.replace('/', '-')}.json",
                              num_prompts=args.vllm_client_prompts, concurrency=16)
        print(f"  {label:9} vllm bench serve {case}: {r['output_throughput']:.1f} out tok/s, TTFT p50/p99 "
              f"{r['median_ttft_ms'] / 1e3:.2f}/{r['p99_ttft_ms'] / 1e3:.2f} s", flush=True)
        out[case] = r
    return out


def gateway_phase(label: str, args: argparse.Namespace, cases: list[Case], vocab: int, home: Path, model: Path,
                  adapters: dict[str, Path], worker_env: dict[str, str], hf: Path) -> dict[str, dict[str, Any]]:
    """One gateway + worker process pair over every case and the conversation."""
    from tests.conftest import REDIS_URL

    before = speed_probe(args.threads)
    home.mkdir(parents=True)
    server = GatewayServer(label, home, model, adapters, worker_env, REDIS_URL, next(iter(adapters.values())).parent)
    try:
        server.wait_ready(600)

        def run(case: Case) -> dict[str, Any]:
            asyncio.run(warm(server, case, vocab))
            return asyncio.run(drive_http(server, case, vocab, args.warmup, args.seconds))

        res = run_cases(label, cases, run)
        if args.vllm_client:
            asked = {c.name for c in cases}
            res["vllm_client"] = vllm_client_runs(label, args, server.url, server.token, server.cluster.base_name,
                                                  server.names if "prefix/4" in asked else None, hf, home,
                                                  base="prefix/base" in asked)
        if args.conversations:
            conv = conversations(server, args)
            res["conversation"] = conv
            print(f"  {label:9} conversation: TTFT p50 by turn " + " ".join(
                "-" if t["ttft_p50_s"] is None else f"{t['ttft_p50_s']:.2f}" for t in conv["turns"])
                + f" s; last/first {conv['last_over_first'] or float('nan'):.2f}", flush=True)
    except BaseException:
        for p in server.cluster.workers + server.cluster.gateways:
            print(f"--- {p.name} ---\n{p.tail()}")
        raise
    finally:
        server.stop()
    after = speed_probe(args.threads)
    extra = {k: res.pop(k) for k in ("conversation", "vllm_client") if k in res}
    return {**with_probes(label, res, before, after), **extra}


VLLM_KV_GIB = "4"
"""vLLM-CPU's KV space (``VLLM_CPU_KVCACHE_SPACE``). 0.32's own default reserves 92% of the host's
memory (``--gpu-memory-utilization``) and refuses to start when other processes hold more than 8%
of it (any machine running the gateway, Redis and PostgreSQL beside it); 4 GiB was its fixed
default before, and what the loraplex worker's pool is capped at."""


def run_server(name: str, args: argparse.Namespace, cases: list[Case], tmp: Path, rnd: int, gguf: Path, hf: Path,
               vocab: int, adapters: dict[str, Path]) -> dict[str, dict[str, Any]]:
    if name in ("loraplex", "loraplex-nocache"):
        env = {"LORAPLEX_THREADS": str(args.threads), "LORAPLEX_KV_CACHE_BYTES": str(args.worker_kv_bytes),
               "LORAPLEX_PREFIX_CACHE": "false" if name.endswith("nocache") else "true",
               "LORAPLEX_LOG_LEVEL": "WARNING"}
        return gateway_phase(name, args, cases, vocab, tmp / f"{name}-{rnd}", gguf, adapters, env, hf)
    from vllm_greedy import vllm_python

    python = vllm_python(args.vllm_python)
    cpus = f"0-{args.threads - 1}" if args.threads > 1 else "0"
    dirs = [adapters[n] for n in sorted(adapters)]

    def make(lora: bool) -> VLLMServer:
        return VLLMServer(tmp / "vllm.log", python, hf, dirs if lora else None, args.vllm_dtype,
                          max(c.clients for c in cases), cpus, kv_space_gib=VLLM_KV_GIB, max_loras=ADAPTERS,
                          prompt_details=True)

    out = http_phase(make, cases, vocab, args, start_timeout=900)
    if args.vllm_client:
        runs: dict[str, dict[str, Any]] = {}
        # each of vLLM's servers only for a prefix case asked for (its LoRA one is slow to serve)
        asked = {c.name for c in cases}
        for lora in [x for x, case in ((False, "prefix/base"), (True, "prefix/4")) if case in asked]:
            server = make(lora)
            try:
                server.wait_ready(900)
                runs.update(vllm_client_runs("vllm", args, server.url, "", "base",
                                             [f"a{i:03d}" for i in range(len(dirs))] if lora else None, hf, tmp,
                                             base=not lora))
            finally:
                server.stop()
        out["vllm_client"] = runs
    return out


def print_tables(cases: list[Case], res: dict[str, dict[str, Any]]) -> dict[str, Any]:
    def get(server: str, case: str, key: str) -> Any:
        return res.get(server, {}).get(case, {}).get(key)

    def f(x: float | None, spec: str = ".1f") -> str:
        return "-" if x is None else format(x, spec)

    rows = []
    print(f"\n{'case':12} {'vLLM':>7} {'cache on':>8} {'off':>7} {'on/vLLM':>7} {'on/off':>7}   "
          f"{'TTFT p50/p99 s: vLLM':>21} {'on':>11} {'off':>11}   {'cached: vLLM':>12} {'on':>6}")
    for c in cases:
        v, on, off = (get(s, c.name, "tok_s") for s in ("vllm", "loraplex", "loraplex-nocache"))
        row: dict[str, Any] = {"case": c.name, "prompt": c.prompt, "new": c.new, "adapters": c.adapters,
                               "clients": c.clients, "vllm_tok_s": v, "loraplex_tok_s": on, "nocache_tok_s": off,
                               "loraplex_over_vllm": ratio(on, v), "loraplex_over_nocache": ratio(on, off)}
        ttft = []
        for s in ("vllm", "loraplex", "loraplex-nocache"):
            a, b = get(s, c.name, "ttft_p50_s"), get(s, c.name, "ttft_p99_s")
            row[f"{s}_ttft_p50_s"], row[f"{s}_ttft_p99_s"] = a, b
            row[f"{s}_cached_share"] = get(s, c.name, "cached_share")
            ttft.append(f"{f(a, '.2f')}/{f(b, '.2f')}")
        rows.append(row)
        print(f"{c.name:12} {f(v):>7} {f(on):>8} {f(off):>7} {f(ratio(on, v), '.2f'):>7} "
              f"{f(ratio(on, off), '.3f'):>7}   {ttft[0]:>21} {ttft[1]:>11} {ttft[2]:>11}   "
              f"{f(row['vllm_cached_share'], '.1%'):>12} {f(row['loraplex_cached_share'], '.1%'):>6}")
    conv = {s: res[s]["conversation"] for s in ("loraplex", "loraplex-nocache") if "conversation" in res.get(s, {})}
    if conv:
        turns = max(len(x["turns"]) for x in conv.values())
        print(f"\nResponses conversation, TTFT p50 s by turn (cached input tokens)\n{'server':18}"
              + "".join(f"{t + 1:>13}" for t in range(turns)) + f"{'last/first':>12}")
        for s, x in conv.items():
            print(f"{s:18}" + "".join(f"{f(t['ttft_p50_s'], '.3f'):>6} ({t['cached_tokens']:>4.0f})"
                                      for t in x["turns"]) + f"{f(x['last_over_first'], '.2f'):>12}")
    return {"rows": rows, "conversation": {s: {k: v for k, v in x.items() if k != "runs"} for s, x in conv.items()}}


def print_vllm_client(res: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The table of vLLM's own client's runs, by case and server."""
    got = {s: r["vllm_client"] for s, r in res.items() if "vllm_client" in r}
    if not got:
        return {}
    print("\nvLLM's client (vllm bench serve, prefix_repetition: 4 x 512-token prefixes + 32, 32 out, 16 clients)")
    print(f"{'case':12} {'server':18} {'out tok/s':>10} {'TTFT p50 s':>11} {'TTFT p99 s':>11} {'TPOT p50 ms':>12}")
    for case in ("prefix/base", "prefix/4"):
        for server, runs in got.items():
            r = runs.get(case)
            if r:
                print(f"{case:12} {server:18} {r['output_throughput']:>10.1f} {r['median_ttft_ms'] / 1e3:>11.2f} "
                      f"{r['p99_ttft_ms'] / 1e3:>11.2f} {r['median_tpot_ms']:>12.1f}")
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--cases", help="comma-separated case names (default: all)")
    ap.add_argument("--seconds", type=float, default=60.0, help="measuring window per case")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds of load before the window")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every server this many times, alternating, and report each case's median round")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="compute threads of every server")
    ap.add_argument("--worker-kv-bytes", type=int, default=0,
                    help="LORAPLEX_KV_CACHE_BYTES of the worker (default 0: the worker's default, sized from the machine)")
    ap.add_argument("--vllm-dtype", default=None,
                    help="vLLM's --dtype (default: its best here: bfloat16 where this CPU multiplies bfloat16 natively, "
                         "else float32)")
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu (default: scripts/vllm_venv.sh)")
    ap.add_argument("--conversations", type=int, default=3, help="Responses conversations per loraplex server (0: none)")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--turn-words", type=int, default=120, help="words of each turn's user message")
    ap.add_argument("--turn-tokens", type=int, default=32, help="max_output_tokens of each turn")
    ap.add_argument("--vllm-client", action="store_true",
                    help="also run vLLM's own client (vllm bench serve, prefix_repetition) against every server")
    ap.add_argument("--vllm-client-prompts", type=int, default=256, help="prompts of each vllm bench serve run")
    args = ap.parse_args()
    if args.vllm_dtype is None:
        from engine.cpu import cpu_has_bf16_matmul

        args.vllm_dtype = "bfloat16" if cpu_has_bf16_matmul() else "float32"
    cases = all_cases()
    names = args.cases.split(",") if args.cases else [c.name for c in cases]
    unknown = set(names) - {c.name for c in cases}
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}; known: {[c.name for c in cases]}")
    cases = [c for c in cases if c.name in names]
    servers = args.servers.split(",")
    if set(servers) - set(SERVERS):
        ap.error(f"unknown servers {sorted(set(servers) - set(SERVERS))} ({', '.join(SERVERS)})")
    with tempfile.TemporaryDirectory(prefix="loraplex-prefix-bench-") as tmp:
        return run(args, cases, servers, Path(tmp))


def run(args: argparse.Namespace, cases: list[Case], servers: list[str], tmp: Path) -> int:
    from engine_lora import write_adapters

    from engine.export_hf import export_hf
    from engine.fetch_demo import fetch_demo
    from loraplex.modelinfo import PROJECTIONS, describe_model

    gguf = fetch_demo()
    hf = export_hf(gguf, tmp / "hf", say=lambda _m: None)
    info = describe_model(hf)
    dirs = write_adapters(tmp / "adapters", info, ADAPTERS, RANK, list(PROJECTIONS), seed=17, base_name=str(hf))
    adapters = {f"a{i}": d for i, d in enumerate(dirs)}
    print(f"model {gguf.name} ({args.threads} threads); {len(cases)} cases, {args.warmup:.0f} s warm-up + "
          f"{args.seconds:.0f} s each; servers {', '.join(servers)}; load average {loadavg()}", flush=True)
    started = loadavg()
    runs: dict[str, list[dict[str, Any]]] = {}
    for rnd in range(args.rounds):
        if args.rounds > 1:
            print(f"round {rnd + 1} of {args.rounds}", flush=True)
        for name in servers:
            phase_cases = cases if name != "vllm" else [c for c in cases if c.prompts == "prefix"]
            runs.setdefault(name, []).append(run_server(name, args, phase_cases, tmp, rnd, gguf, hf, info.vocab_size,
                                                        adapters))
    res: dict[str, dict[str, Any]] = {}
    for name, rs in runs.items():
        convs = [r.pop("conversation") for r in rs if "conversation" in r]
        clients = [r.pop("vllm_client") for r in rs if "vllm_client" in r]
        res[name] = median_of_rounds(rs)
        if convs:  # the round whose last/first is the median
            convs.sort(key=lambda x: x["last_over_first"] or 0.0)
            res[name]["conversation"] = convs[(len(convs) - 1) // 2]
        if clients:
            res[name]["vllm_client"] = clients[-1]
    tables = print_tables(cases, res)
    tables["vllm_client"] = print_vllm_client(res)
    print(f"load average: {started} at start, {loadavg()} at end ({os.cpu_count()} CPUs)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "prefix_cache.json"
    out.write_text(json.dumps({
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads": args.threads,
        "seconds": args.seconds, "warmup": args.warmup, "rounds": args.rounds, "vllm_dtype": args.vllm_dtype,
        "worker_kv_bytes": args.worker_kv_bytes, "servers": servers, "loadavg_start": started, "loadavg_end": loadavg(),
        **tables, "raw": res}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
