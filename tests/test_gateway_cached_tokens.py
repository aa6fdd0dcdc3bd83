"""What the gateway relays of a worker's prefix cache: ``usage.prompt_tokens_details.cached_tokens`` on chat and
completions, whole and streamed; Responses' ``input_tokens_details.cached_tokens``; the access log line and the
per-tenant token counters. A worker that says nothing (vLLM without ``--enable-prompt-tokens-details``, or with
no hit: ``null``) reads 0. Token limits still reserve and settle the whole prompt, cached tokens included.

First against a worker double that reports a fixed count (what the gateway does with any worker's numbers),
then end to end against a real engine worker whose prefix cache produces them."""

from __future__ import annotations

import json
import logging
import threading

import httpx
import orjson
import pytest

from engine.api import create_worker_app
from engine.engine import Engine, EngineConfig
from gateway.app import create_app
from gateway.ratelimit import Lease, LocalLimiter
from loraplex.residency import MemoryResidency
from loraplex.settings import Settings
from loraplex.tokens import mint
from loraplex.wire import HDR_WORKER_SECRET
from tests.engine_fixtures import make_tiny_model
from tests.registry_support import fresh_registry
from tests.stub_worker import MutableSnapshots, _secret_refusal, make_snapshot
from tests.worker_double import worker_client

TPM = 1_000_000
BINDING = {"bindings": {"support": {"active": ("sup", 1)}}}
TENANTS = {slug: {"tokens_per_min": TPM, **BINDING} for slug in ("acme", "globex")}
WARM = 32
"""What the worker double says its cache supplied for a prompt that says ``warm``."""


class RecordingLimiter(LocalLimiter):
    """The local limiter, keeping what each request reserved and was settled at."""

    def __init__(self) -> None:
        super().__init__()
        self.reserved: list[int] = []
        self.settled: list[int] = []
        self.lock = threading.Lock()

    async def acquire(self, tenant, limits, tokens, lease_ttl_s=None):  # type: ignore[no-untyped-def]
        with self.lock:
            self.reserved.append(tokens)
        return await super().acquire(tenant, limits, tokens, lease_ttl_s)

    def settle_nowait(self, lease: Lease, used_tokens: int) -> None:
        with self.lock:
            self.settled.append(used_tokens)
        super().settle_nowait(lease, used_tokens)


class AccessLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(record.getMessage()))


@pytest.fixture
def access():
    logger = logging.getLogger("loraplex.gateway.access")
    handler = AccessLines()
    old = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


def _double(request: httpx.Request) -> httpx.Response:
    """A worker that reports ``WARM`` cached tokens for a prompt saying ``warm``, else ``null`` details (vLLM's
    answer without a hit or without ``--enable-prompt-tokens-details``)."""
    refused = _secret_refusal(request.headers.get(HDR_WORKER_SECRET, "").encode("latin-1") or None,
                              Settings().worker_secret)
    if refused is not None:
        return httpx.Response(refused[0], json=refused[1])
    body = orjson.loads(request.content)
    chat = request.url.path.endswith("chat/completions")
    prompt = json.dumps(body.get("messages") if chat else body.get("prompt"))
    usage = {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42,
             "prompt_tokens_details": {"cached_tokens": WARM} if "warm" in prompt else None}
    obj = "chat.completion" if chat else "text_completion"
    if not body.get("stream"):
        choice = ({"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
                  if chat else {"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None})
        return httpx.Response(200, json={"id": "x", "object": obj, "created": 0, "model": body.get("model"),
                                         "choices": [choice], "usage": usage})
    obj += ".chunk" if chat else ""
    out = b""
    for i in range(2):
        choice = ({"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": "stop" if i else None}
                  if chat else {"index": 0, "text": f"t{i}", "finish_reason": "stop" if i else None, "logprobs": None})
        chunk = {"id": "x", "object": obj, "created": 0, "model": body.get("model"), "choices": [choice],
                 "usage": {"prompt_tokens": 40, "completion_tokens": i + 1, "total_tokens": 41 + i}}
        if "warm" in prompt:  # as some vLLM builds send every chunk's usage: with its details object
            chunk["usage"]["prompt_tokens_details"] = {"cached_tokens": WARM}
        out += b"data: " + orjson.dumps(chunk) + b"\n\n"
    out += b"data: " + orjson.dumps({"id": "x", "object": obj, "created": 0, "model": body.get("model"),
                                     "choices": [], "usage": usage}) + b"\n\n"
    out += b"data: [DONE]\n\n"
    return httpx.Response(200, content=out, headers={"content-type": "text/event-stream"})


@pytest.fixture
async def gateway(tmp_path):
    """(settings, app, limiter) in front of the worker double (``_double``)."""
    db = f"sqlite+aiosqlite:///{tmp_path / 'registry.db'}"
    await fresh_registry(db)
    s = Settings(worker_urls=("http://worker",), database_url=db)
    limiter = RecordingLimiter()
    app = create_app(s, snapshots=MutableSnapshots(make_snapshot(TENANTS)), limiter=limiter,
                     residency=MemoryResidency(), http_client=worker_client(httpx.MockTransport(_double)),
                     mount_admin=False)
    async with app.router.lifespan_context(app):
        yield s, app, limiter


def _auth(s: Settings, tenant: str = "acme") -> dict[str, str]:
    return {"authorization": f"Bearer {mint(s, 'u', tenant=tenant)}"}


def _events(text: str) -> list[dict]:
    return [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: {")]


def _tokens(app, tenant: str, kind: str) -> float:
    value = app.gateway.metrics.registry.get_sample_value(
        "loraplex_gateway_tokens_total", {"tenant": tenant, "adapter": "sup@1", "kind": kind})
    return value or 0.0


async def test_chat_and_completions_relay_the_workers_cached_tokens(gateway, access):
    s, app, limiter = gateway
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        for path, field in (("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")):
            for word, cached in (("warm", WARM), ("cold", 0)):
                content = [{"role": "user", "content": f"{word} hello"}] if field == "messages" else f"{word} hello"
                body = {"model": "support", field: content, "max_tokens": 5}
                r = await c.post(path, json=body, headers=_auth(s))
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
                r = await c.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                                 headers=_auth(s))
                chunks = _events(r.text)
                assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {
                    "cached_tokens": cached}
                # The per-chunk usage the gateway asked for is stripped, details and all: the client did not ask.
                assert len(chunks) == 3 and all(ch["usage"] is None for ch in chunks[:-1])
    lines = [ln for ln in access.lines if ln["tenant"] == "acme"]
    assert [ln["cached_tokens"] for ln in lines] == [WARM, WARM, 0, 0] * 2
    assert all(ln["prompt_tokens"] == 40 for ln in lines)
    # Token limits: the whole prompt settled, cached tokens included; each reservation counted it whole too.
    assert limiter.settled == [42] * 8
    assert all(r >= 40 + 5 for r in limiter.reserved)
    assert _tokens(app, "acme", "prompt") == 8 * 40 and _tokens(app, "acme", "cached_prompt") == 4 * WARM


async def test_responses_report_the_cached_input_tokens(gateway, access):
    s, app, _ = gateway
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        for word, cached in (("warm", WARM), ("cold", 0)):
            body = {"model": "support", "input": f"{word} hello", "max_output_tokens": 5, "store": False}
            r = await c.post("/v1/responses", json=body, headers=_auth(s, "globex"))
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            assert usage["input_tokens"] == 40 and usage["input_tokens_details"] == {"cached_tokens": cached}
            r = await c.post("/v1/responses", json={**body, "stream": True}, headers=_auth(s, "globex"))
            done = [e for e in _events(r.text) if e["type"] == "response.completed"]
            assert done and done[0]["response"]["usage"]["input_tokens_details"] == {"cached_tokens": cached}
    assert [ln["cached_tokens"] for ln in access.lines if ln["tenant"] == "globex"] == [WARM, WARM, 0, 0]
    assert _tokens(app, "globex", "cached_prompt") == 2 * WARM


# --- end to end: a real engine worker's prefix cache -------------------------------------------------------

SYSTEM = "You are a support agent for a shipping company. Answer in one short sentence. " * 3


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine.from_path(make_tiny_model(tmp_path_factory.mktemp("tiny_gw_cached"), "llama"),
                           EngineConfig(kv_cache_bytes=1 << 20, max_num_seqs=8, max_waiting=16))
    eng.start()
    yield eng
    eng.stop()


@pytest.fixture
async def served(engine, tmp_path):
    """(settings, gateway app, limiter) in front of a real worker over the engine."""
    worker = create_worker_app(Settings(home=str(tmp_path), worker_id="w1", model_name="smol"), engine=engine,
                               report=False)
    db = f"sqlite+aiosqlite:///{tmp_path / 'registry.db'}"
    await fresh_registry(db)
    s = Settings(worker_urls=("http://worker",), database_url=db)
    limiter = RecordingLimiter()
    app = create_app(s, snapshots=MutableSnapshots(make_snapshot(TENANTS)), limiter=limiter,
                     residency=MemoryResidency(), http_client=worker_client(httpx.ASGITransport(app=worker)),
                     mount_admin=False)
    async with app.router.lifespan_context(app):
        yield s, app, limiter


async def test_a_real_workers_cache_reaches_the_client_scoped_by_tenant(served, access):
    s, app, limiter = served
    body = {"model": "smol", "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is my parcel?"}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        got = []
        for tenant in ("acme", "acme", "globex"):
            r = await c.post("/v1/chat/completions", json=body, headers=_auth(s, tenant))
            assert r.status_code == 200, r.text
            got.append(r.json()["usage"])
        r = await c.post("/v1/chat/completions", json={**body, "stream": True,
                                                       "stream_options": {"include_usage": True}},
                         headers=_auth(s, "acme"))
        streamed = _events(r.text)[-1]["usage"]
    first, again, other = (u["prompt_tokens_details"]["cached_tokens"] for u in got)
    assert first == 0 and again >= 16 and again < got[1]["prompt_tokens"]
    assert other == 0, "another tenant's identical prompt finds nothing of acme's"
    assert streamed["prompt_tokens_details"]["cached_tokens"] == again
    lines = {ln["request_id"]: ln for ln in access.lines}
    assert sorted(ln["cached_tokens"] for ln in lines.values()) == sorted([0, again, 0, again])
    # Settled at the whole prompt + completion, whatever was cached.
    assert limiter.settled[1] == got[1]["total_tokens"] == got[1]["prompt_tokens"] + 3
    assert limiter.settled[-1] == streamed["total_tokens"]


async def test_a_continued_response_finds_its_earlier_turns_cached(served):
    s, app, _ = served
    instructions = "You track parcels for a courier. Be brief and exact about dates. " * 3  # cached by nothing yet
    turn = {"model": "smol", "max_output_tokens": 4, "temperature": 0, "instructions": instructions}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        r = await c.post("/v1/responses", json={**turn, "input": "Where is my parcel?"}, headers=_auth(s))
        assert r.status_code == 200, r.text
        first = r.json()
        r = await c.post("/v1/responses", json={**turn, "input": "And when will it arrive?",
                                                "previous_response_id": first["id"]}, headers=_auth(s))
        assert r.status_code == 200, r.text
        second = r.json()["usage"]
    assert first["usage"]["input_tokens_details"]["cached_tokens"] == 0
    assert second["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"] - 16
    assert second["input_tokens_details"]["cached_tokens"] < second["input_tokens"]

