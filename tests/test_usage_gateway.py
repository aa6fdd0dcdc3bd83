"""The usage ledger through a real gateway: a uvicorn server, a stub worker process, the local
limiter and the ledger on a migrated SQLite registry. Every way a request ends is recorded once,
with the tokens the limiter settled and its outcome; stopping the server (what SIGTERM does)
writes the buckets before the process would end, with a flush interval far longer than the test."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid

import httpx
import orjson
import pytest

from gateway.app import create_app
from gateway.ratelimit import Lease, LocalLimiter
from loraplex.residency import MemoryResidency
from loraplex.settings import Settings
from loraplex.tokens import mint
from registry.db import make_engine
from registry.migrate import upgrade, upgrade_async
from registry.usage import UsageStore, totals
from tests.stub_worker import MutableSnapshots, StubProcess, ThreadServer, make_snapshot
from tests.worker_double import worker_client

BINDING = {"bindings": {"support": {"active": ("sup", 1)}}}
TENANTS = {
    "acme": {"tokens_per_min": 100_000, **BINDING},
    "once": {"requests_per_min": 1, **BINDING},
}
HI = [{"role": "user", "content": "hi"}]


class Settled(LocalLimiter):
    """The local limiter, keeping what each request was settled at."""

    def __init__(self) -> None:
        super().__init__()
        self.settled: list[tuple[Lease, int]] = []
        self.lock = threading.Lock()

    def settle_nowait(self, lease: Lease, used_tokens: int) -> None:
        with self.lock:
            self.settled.append((lease, used_tokens))
        super().settle_nowait(lease, used_tokens)


@pytest.fixture(scope="module")
def stub():
    with StubProcess("w1", extra=("--chunks", "4000")) as p:
        yield p


def test_every_ending_is_recorded_once_with_what_the_limiter_settled(stub, tmp_path):
    url = f"sqlite+aiosqlite:///{tmp_path}/registry.db"
    upgrade(url)
    settings = Settings(worker_urls=(stub.url,), database_url=url, usage_flush_interval_s=3600.0)
    limiter = Settled()
    app = create_app(settings, snapshots=MutableSnapshots(make_snapshot(TENANTS)), limiter=limiter,
                     residency=MemoryResidency(), mount_admin=False, usage_store=UsageStore(settings))

    def headers(tenant: str) -> dict[str, str]:
        return {"authorization": f"Bearer {mint(settings, 'u', tenant=tenant)}", "x-request-id": uuid.uuid4().hex}

    def chat(c: httpx.Client, tenant: str = "acme", **extra) -> httpx.Response:
        body = {"model": "support", "messages": HI, "max_tokens": 6} | extra
        return c.post("/v1/chat/completions", json=body, headers=headers(tenant))

    with ThreadServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        assert chat(c).status_code == 200
        assert chat(c, stream=True).status_code == 200
        assert chat(c, metadata={"stub_mode": "400"}).status_code == 400
        assert chat(c, metadata={"stub_mode": "500"}).status_code == 502
        broken = chat(c, stream=True, metadata={"stub_mode": "break"})
        assert "stream_interrupted" in broken.text
        assert chat(c, model="nope").status_code == 404
        assert chat(c, tenant="once").status_code == 200
        assert chat(c, tenant="once").status_code == 429
        c.post("/v1/chat/completions", json={"model": "support", "messages": HI}, headers={"authorization": "x"})
        got = 0
        with c.stream("POST", "/v1/chat/completions", headers=headers("acme"),
                      json={"model": "support", "messages": HI, "max_tokens": 50, "stream": True,
                            "metadata": {"stub_chunk_delay": "0.2"}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got += 1
                    if got == 2:
                        break  # the client leaves after two tokens
        flusher = app.state.usage_flusher
        assert flusher is not None and flusher.seq == 0  # nothing written before the server stops
    # The server stopped (its lifespan's shutdown): the buckets are in the database.
    assert flusher.pending == 0 and flusher.seq >= 1

    async def read():
        engine = make_engine(url)
        try:
            return (await totals(engine, by=("tenant", "alias", "version", "outcome")),
                    await totals(engine, by=("tenant",)))
        finally:
            await engine.dispose()

    by_outcome, by_tenant = asyncio.run(read())
    flat = {k: (v.requests, v.prompt_tokens + v.completion_tokens) for k, v in by_outcome.items()}
    assert {k[3] for k in flat} == {"ok", "4xx:invalid_value", "5xx:upstream_error", "5xx:stream_interrupted",
                                    "4xx:model_not_found", "429:requests", "cancelled"}
    assert flat[("acme", "support", "sup-v1", "ok")][0] == 2
    assert flat[("acme", "support", "sup-v1", "4xx:invalid_value")] == (1, 0)
    assert flat[("acme", "support", "sup-v1", "5xx:upstream_error")] == (1, 0)
    assert flat[("acme", "nope", "", "4xx:model_not_found")] == (1, 0)
    assert flat[("once", "support", "sup-v1", "429:requests")] == (1, 0)
    cancelled = flat[("acme", "support", "sup-v1", "cancelled")]
    broke = flat[("acme", "support", "sup-v1", "5xx:stream_interrupted")]
    assert cancelled[0] == broke[0] == 1 and cancelled[1] > 2 and broke[1] > 3  # the prompt and the tokens sent
    for tenant in ("acme", "once"):
        settled = [used for lease, used in limiter.settled if lease.tenant == tenant]
        t = by_tenant[(tenant,)]
        assert t.prompt_tokens + t.completion_tokens == sum(settled), tenant
    assert by_tenant[("acme",)].requests == 7 and by_tenant[("once",)].requests == 2
    assert by_tenant[("acme",)].peak_concurrent == 1


def _caching_worker(request: httpx.Request) -> httpx.Response:
    """A worker that says its prefix cache supplied 32 of the prompt's 40 tokens."""
    body = orjson.loads(request.content)
    usage = {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42,
             "prompt_tokens_details": {"cached_tokens": 32}}
    if not body.get("stream"):
        return httpx.Response(200, json={"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                                      "finish_reason": "stop"}], "usage": usage})
    out = b"data: " + orjson.dumps({"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                                    "choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]})
    out += b"\n\ndata: " + orjson.dumps({"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                                        "choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n"
    return httpx.Response(200, content=out, headers={"content-type": "text/event-stream"})


async def test_cached_tokens_are_what_the_client_was_told(tmp_path):
    """The ledger's cached tokens are the ``prompt_tokens_details.cached_tokens`` relayed; the lifespan's
    end (the server stopping) writes them."""
    url = f"sqlite+aiosqlite:///{tmp_path}/registry.db"
    await upgrade_async(url)
    settings = Settings(worker_urls=("http://worker",), database_url=url, usage_flush_interval_s=3600.0)
    store = UsageStore(settings)
    app = create_app(settings, snapshots=MutableSnapshots(make_snapshot(TENANTS)), limiter=Settled(),
                     residency=MemoryResidency(), http_client=worker_client(httpx.MockTransport(_caching_worker)),
                     mount_admin=False, usage_store=store)
    told = 0
    auth = {"authorization": f"Bearer {mint(settings, 'u', tenant='acme')}"}
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        for stream in (False, True, False):
            r = await c.post("/v1/chat/completions", headers=auth, json={
                "model": "support", "messages": HI, "max_tokens": 3, "stream": stream,
                "stream_options": {"include_usage": True}} if stream else {
                "model": "support", "messages": HI, "max_tokens": 3})
            usage = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")][-1]["usage"] \
                if stream else r.json()["usage"]
            told += usage["prompt_tokens_details"]["cached_tokens"]
    engine = make_engine(url)
    try:
        got = (await totals(engine, by=("tenant",)))[("acme",)]
    finally:
        await engine.dispose()
    assert told == 96 and (got.cached_tokens, got.prompt_tokens, got.requests) == (96, 120, 3)
