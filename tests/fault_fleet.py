"""What the fault tests need around ``tests.e2e_cluster``: a PostgreSQL cluster and a Redis of
their own (the tests stop, kill and pause them; the shared ones on 5432/6379 are never touched),
requests whose every ending is recorded as a client sees it, and what the gateways settled.

``PrivatePostgres`` is a Debian ``pg_createcluster`` cluster on a free loopback port with trust
authentication, dropped at the end; ``PrivateRedis`` a ``redis-server`` without persistence.
``Outcome`` is one request as its client saw it: ok, a clear error (an OpenAI error body, or a
stream ending with an error event), hung (no end within the client's timeout), truncated (a
stream that ended with neither ``[DONE]`` nor an error event) or dropped (the connection broke).
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.e2e_cluster import Cluster, free_port

PG_VERSION = "15"


def _run(*args: str, timeout: float = 120.0) -> None:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")


class PrivatePostgres:
    """A PostgreSQL cluster of its own on a free loopback port (trust auth, no fsync), with one
    database ``loraplex``; ``drop`` removes it, data directory and configuration included."""

    def __init__(self) -> None:
        self.name = f"lpxfault{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.url = f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/loraplex"

    def create(self) -> None:
        _run("pg_createcluster", PG_VERSION, self.name, "-p", str(self.port), "--start-conf=manual",
             "-o", "fsync=off", "-o", "synchronous_commit=off", "-o", "full_page_writes=off",
             "--", "--auth=trust")
        self.start()
        _run("psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-qc", "CREATE DATABASE loraplex")

    def start(self) -> None:
        _run("pg_ctlcluster", "--skip-systemctl-redirect", PG_VERSION, self.name, "start")
        self.wait_ready()

    def stop(self) -> None:
        """A fast shutdown: connections are cut, nothing new is accepted."""
        _run("pg_ctlcluster", "--skip-systemctl-redirect", PG_VERSION, self.name, "stop", "-m", "fast")

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while subprocess.run(["pg_isready", "-q", "-h", "127.0.0.1", "-p", str(self.port)]).returncode != 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"PostgreSQL cluster {self.name} not ready after {timeout}s")
            time.sleep(0.2)

    def drop(self) -> None:
        subprocess.run(["pg_dropcluster", PG_VERSION, self.name, "--stop"], capture_output=True, timeout=120)


class PrivateRedis:
    """A ``redis-server`` of its own on a free loopback port, without persistence (a restart
    starts empty, as a Redis without persistence does in production)."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log = log
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as fh:
            self.popen = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                           "--save", "", "--appendonly", "no"], stdout=fh, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not self.ping():
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start:\n{self.log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)

    def ping(self) -> bool:
        return subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True,
                              timeout=10).stdout.strip() == b"PONG"

    def signal(self, sig: int) -> None:
        assert self.popen is not None
        self.popen.send_signal(sig)

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGCONT)  # a paused one too
            self.popen.kill()
            self.popen.wait(timeout=30)


# --- clients -------------------------------------------------------------------------------------

OK, ERROR, HUNG, TRUNCATED, DROPPED = "ok", "error", "hung", "truncated", "dropped"


@dataclass
class Outcome:
    """One request as its client saw it (times in ``time.monotonic()``)."""

    rid: str
    gateway: str
    stream: bool
    sent: float
    kind: str = HUNG
    status: int = 0
    code: str = ""
    """The error code (an error body's, or a stream's error event's)."""
    worker: str = ""
    adapter: str = ""
    """The adapter version that answered (``x-loraplex-adapter``: its label; the base model's name)."""
    retry_after: str | None = None
    head_at: float | None = None
    first_at: float | None = None
    """A stream's first content event."""
    end_at: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    """What the client was told it got: the usage of a whole answer, a stream's last per-chunk usage."""
    events: int = 0

    @property
    def received(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Load:
    """The requests of one scenario, for the counts and the accounting."""

    outcomes: list[Outcome] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out = {k: 0 for k in (OK, ERROR, HUNG, TRUNCATED, DROPPED)}
        for o in self.outcomes:
            out[o.kind] += 1
        return out


def chat_body(*, stream: bool, max_tokens: int, model: str, question: str = "Count to one hundred.") -> dict:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": question}],
                            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


async def request(client: httpx.AsyncClient, load: Load, url: str, token: str, body: dict, *,
                  hang_s: float, path: str = "/v1/chat/completions",
                  started: asyncio.Event | None = None) -> Outcome:
    """Send one request and record how it ended (``hang_s``: how long before it counts as hung);
    ``started`` is set at a stream's first event."""
    stream = bool(body.get("stream"))
    o = Outcome(uuid.uuid4().hex, url, stream, time.monotonic())
    load.outcomes.append(o)
    headers = {"Authorization": f"Bearer {token}", "x-request-id": o.rid}
    try:
        async with asyncio.timeout(hang_s):
            async with client.stream("POST", url + path, json=body, headers=headers) as r:
                o.head_at = time.monotonic()
                o.status = r.status_code
                o.worker = r.headers.get("x-loraplex-worker", "")
                o.adapter = r.headers.get("x-loraplex-adapter", "")
                o.retry_after = r.headers.get("retry-after")
                if r.status_code != 200 or not stream:
                    raw = await r.aread()
                    o.end_at = time.monotonic()
                    try:
                        data = json.loads(raw)
                    except ValueError:
                        o.kind, o.code = ERROR, f"not JSON: {raw[:80]!r}"
                        return o
                    if r.status_code == 200:
                        o.kind = OK
                        o.prompt_tokens = data["usage"]["prompt_tokens"]
                        o.completion_tokens = data["usage"]["completion_tokens"]
                    else:
                        error = data.get("error") if isinstance(data, dict) else None
                        o.kind = ERROR
                        o.code = (error.get("code") or "") if isinstance(error, dict) and error.get("message") \
                            else f"not an OpenAI error: {raw[:80]!r}"
                    return o
                done = False
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        o.kind, o.code = ERROR, event["error"].get("code") or ""
                        continue
                    if isinstance(event.get("usage"), dict):
                        o.prompt_tokens = event["usage"]["prompt_tokens"]
                        o.completion_tokens = event["usage"]["completion_tokens"]
                    if event.get("choices"):
                        o.events += 1
                        if o.first_at is None:
                            o.first_at = time.monotonic()
                            if started is not None:
                                started.set()
                o.end_at = time.monotonic()
                if o.kind != ERROR:
                    o.kind = OK if done else TRUNCATED
    except TimeoutError:
        o.kind = HUNG
    except httpx.TransportError:
        o.end_at = time.monotonic()
        o.kind = DROPPED
    return o


# --- what the gateways saw -----------------------------------------------------------------------

def access_records(cluster: Cluster, rids: set[str], timeout: float = 15.0) -> dict[str, dict]:
    """The access-log records of ``rids`` across every gateway's log (flushed every second):
    what each request was settled with. Waits until all are there or ``timeout`` passes."""
    logs = {p.log for p in cluster.gateways} | set(cluster.home.glob("g*.log"))
    deadline = time.monotonic() + timeout
    while True:
        found: dict[str, dict] = {}
        for log in logs:
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith("{") and '"request_id"' in line:
                    rec = json.loads(line)
                    if rec.get("request_id") in rids:
                        found[rec["request_id"]] = rec
        if len(found) == len(rids) or time.monotonic() > deadline:
            return found
        time.sleep(0.3)


def unsettled(cluster: Cluster, outcomes: list[Outcome]) -> list[tuple[str, str, int, int]]:
    """Requests whose settled tokens (the access log's prompt + completion tokens, the amount the
    gateway settles its reservation with) differ from what their client received:
    ``(rid, kind, received, settled)``; a request with no record counts as settled -1."""
    records = access_records(cluster, {o.rid for o in outcomes})
    wrong = []
    for o in outcomes:
        rec = records.get(o.rid)
        settled = -1 if rec is None else rec["prompt_tokens"] + rec["completion_tokens"]
        if settled != o.received:
            wrong.append((o.rid, o.kind, o.received, settled))
    return wrong


def gauge(metrics_url: str, name: str) -> float | None:
    """A gauge's value on a gateway's metrics port (None: not exported, or no answer)."""
    try:
        text = httpx.get(metrics_url + "/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def metrics_url(proc: Any) -> str:
    return f"http://127.0.0.1:{proc.env['LORAPLEX_GATEWAY_METRICS_PORT']}"

