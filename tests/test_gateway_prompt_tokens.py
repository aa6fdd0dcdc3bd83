"""Exact prompt counts at the gateway: the tokenizer a real engine worker serves, the gateway's
count equal to the worker's ``usage.prompt_tokens``, and the context length checked up front."""

from __future__ import annotations

import asyncio
import time

import httpx
import orjson
import pytest

from engine.api import create_worker_app
from engine.engine import Engine, EngineConfig
from gateway.app import create_app
from gateway.ratelimit import LocalLimiter
from gateway.validate import validate
from loraplex.residency import MemoryResidency
from loraplex.settings import Settings
from loraplex.tokens import mint
from loraplex.wire import HDR_WORKER, HDR_WORKER_SECRET
from tests.engine_fixtures import make_tiny_model
from tests.stub_worker import MutableSnapshots, make_snapshot, mock_worker_transport
from tests.worker_double import worker_client

TPM = 100_000
BINDING = {"bindings": {"support": {"active": ("sup", 1)}}}
TENANTS = {f"t{i}": {"tokens_per_min": TPM, **BINDING} for i in range(6)}
CHAT = {"model": "smol", "max_tokens": 3, "temperature": 0,
        "messages": [{"role": "system", "content": "Be terse."},
                     {"role": "user", "content": [{"type": "text", "text": "Hello there, "},
                                                  {"type": "text", "text": "how are you? 2024"}]}]}
COMPLETION = {"model": "smol", "max_tokens": 3, "temperature": 0, "prompt": "def add(a, b):\n    return"}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine.from_path(make_tiny_model(tmp_path_factory.mktemp("tiny_pt"), "llama"),
                           EngineConfig(kv_cache_bytes=1 << 20, max_num_seqs=8, max_waiting=16))
    eng.start()
    yield eng
    eng.stop()


class _Counting(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.paths: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        return await self.inner.handle_async_request(request)


def _system(engine, tmp_path):
    ws = Settings(home=str(tmp_path), worker_id="w1", model_name="smol")
    worker = create_worker_app(ws, engine=engine, report=False)
    transport = _Counting(httpx.ASGITransport(app=worker))
    s = Settings(worker_urls=("http://worker",))
    app = create_app(s, snapshots=MutableSnapshots(make_snapshot(TENANTS)), limiter=LocalLimiter(),
                     residency=MemoryResidency(), http_client=worker_client(transport),
                     mount_admin=False)
    return s, app, worker, transport


async def _ready(gw, base="smol") -> None:
    deadline = time.monotonic() + 10
    while gw.prompts.entry(base) is None:
        assert time.monotonic() < deadline, "the gateway never got the tokenizer"
        await asyncio.sleep(0.02)


async def test_worker_serves_its_tokenizer_behind_the_secret(engine, tmp_path):
    s, _, worker, _ = _system(engine, tmp_path)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=worker), base_url="http://w") as c:
        assert (await c.get("/internal/tokenizer")).status_code == 401
        assert (await c.get("/internal/tokenizer", headers={HDR_WORKER_SECRET: "wrong"})).status_code == 403
        r = await c.get("/internal/tokenizer", headers={HDR_WORKER_SECRET: s.worker_secret})
        assert r.status_code == 200
        data = r.json()
        assert data["base_model"] == "smol" and data["max_model_len"] == engine.max_model_len
        assert set(data["tokenizer"]) >= {"tokenizer", "add_bos", "chat_template", "bos_token", "eos_token"}


async def test_gateway_count_equals_worker_usage(engine, tmp_path):
    s, app, _, transport = _system(engine, tmp_path)
    gw = app.gateway
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        # The first request starts the fetch and waits for it: counted exactly too.
        h = {"authorization": f"Bearer {mint(s, 'u', tenant='t0')}"}
        r = await c.post("/v1/chat/completions", json=CHAT, headers=h)
        assert r.status_code == 200
        assert int(r.headers["x-ratelimit-remaining-tokens"]) == TPM - r.json()["usage"]["prompt_tokens"] - 3
        await _ready(gw)
        assert transport.paths.count("/internal/tokenizer") == 1
        for i, (path, body) in enumerate([("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION),
                                          ("/v1/completions", COMPLETION | {"prompt": "x" * 300})], start=1):
            fields = validate(dict(body), chat=path.endswith("chat/completions"), max_tokens_cap=8192).fields
            counted, max_len = await gw.prompts.count("smol", fields)
            assert max_len == engine.max_model_len
            h = {"authorization": f"Bearer {mint(s, 'u', tenant=f't{i}')}"}
            r = await c.post(path, json=body, headers=h)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == counted
            # Reserved: the exact prompt + max_tokens (a fresh bucket per tenant).
            assert int(r.headers["x-ratelimit-remaining-tokens"]) == TPM - counted - 3
        assert transport.paths.count("/internal/tokenizer") == 1  # fetched once


async def test_context_length_is_checked_at_the_gateway(engine, tmp_path):
    s, app, _, transport = _system(engine, tmp_path)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        h = {"authorization": f"Bearer {mint(s, 'u', tenant='t0')}"}
        assert (await c.post("/v1/completions", json=COMPLETION, headers=h)).status_code == 200
        assert app.gateway.prompts.known("smol")
        sent = transport.paths.count("/v1/completions")
        r = await c.post("/v1/completions", json=COMPLETION | {"prompt": "word " * 2000}, headers=h)
        assert r.status_code == 400 and HDR_WORKER not in r.headers
        assert r.json()["error"]["code"] == "context_length_exceeded"
        r = await c.post("/v1/completions", json=COMPLETION | {"max_tokens": engine.max_model_len}, headers=h)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert transport.paths.count("/v1/completions") == sent  # neither reached the worker


async def test_without_a_tokenizer_the_bound_reserves_but_never_refuses():
    """No worker serves a tokenizer: the byte bound (over the limit here) is capped at the
    bucket's capacity instead of deciding a 400."""
    s = Settings(worker_urls=("http://worker",))
    record: list[dict] = []
    app = create_app(s, snapshots=MutableSnapshots(make_snapshot({"small": {"tokens_per_min": 300, **BINDING}})),
                     limiter=LocalLimiter(), residency=MemoryResidency(),
                     http_client=worker_client(mock_worker_transport(record)), mount_admin=False)
    body = {"model": "support", "messages": [{"role": "user", "content": "x" * 1000}]}
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        r = await c.post("/v1/chat/completions", json=body, headers={
            "authorization": f"Bearer {mint(s, 'u', tenant='small')}"})
        assert r.status_code == 200, r.text
        assert r.headers["x-ratelimit-remaining-tokens"] == "0"  # reserved the whole capacity
        assert record[-1]["max_tokens"] == 1 and "max_completion_tokens" not in record[-1]
        assert not app.gateway.prompts.known("smol")


async def test_stream_from_a_real_worker_settles_at_its_usage(engine, tmp_path):
    s, app, _, _ = _system(engine, tmp_path)
    settled: list[int] = []
    limiter = app.gateway.limiter
    real = limiter.settle_nowait
    limiter.settle_nowait = lambda lease, used: (settled.append(used), real(lease, used))[1]
    body = CHAT | {"stream": True, "ignore_eos": True, "max_tokens": 5}
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        h = {"authorization": f"Bearer {mint(s, 'u', tenant='t5')}"}
        r = await c.post("/v1/chat/completions", json=body, headers=h)
        events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: {")]
        assert '"usage"' not in r.text  # the per-chunk usage stays between worker and gateway
        r = await c.post("/v1/chat/completions", json=body | {"stream_options": {"include_usage": True}},
                         headers=h)
        chunks = [orjson.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
        assert all(ch["usage"] is None for ch in chunks[:-1]) and len(chunks) == len(events) + 1
        usage = chunks[-1]["usage"]
        fields = validate(dict(CHAT), chat=True, max_tokens_cap=8192).fields
        assert usage["prompt_tokens"] == (await app.gateway.prompts.count("smol", fields))[0]
        assert settled == [usage["total_tokens"]] * 2
