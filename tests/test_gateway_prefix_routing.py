"""Prefix-aware routing through the gateway: stub workers (``tests.stub_worker``, in-process,
serving a real tokenizer so the gateway encodes prompts), residency in memory. A repeated prompt
goes back to the worker that served it, a different tenant's identical prompt is not steered by
it, tenants an operator put in one scope are; the scope sent to workers is the registry's
whatever the client sends; a Responses continuation returns to its worker; and a vLLM worker's
body carries the namespace's ``cache_salt``, never the client's."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import orjson
import pytest

from gateway.app import create_app
from gateway.ratelimit import LocalLimiter
from loraplex.prefix import cache_salt, namespace
from loraplex.residency import MemoryResidency
from loraplex.settings import Settings
from loraplex.tokens import mint
from loraplex.wire import BACKEND_VLLM, HDR_WORKER, WorkerReport
from tests.engine_fixtures import train_tokenizer
from tests.registry_support import fresh_registry
from tests.stub_worker import MutableSnapshots, Stub, make_snapshot, parse_args
from tests.worker_double import worker_client

LIMITS = {"tokens_per_min": 1_000_000, "requests_per_min": 10_000, "max_concurrent": 64}
TENANTS = {"acme": LIMITS, "globex": LIMITS, "initech": LIMITS, "corp-a": LIMITS | {"cache_scope": "corp"},
           "corp-b": LIMITS | {"cache_scope": "corp"}}
SYSTEM = ("You are the support assistant of a hardware shop. Answer in two sentences, cite the order "
          "number when one is given, and never promise a refund before the warehouse confirmed the return. ")


def _chat(question: str, **extra) -> dict:
    return {"model": "smol", "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM * 2}, {"role": "user", "content": question}], **extra}


class _Workers(httpx.AsyncBaseTransport):
    """One in-process stub worker per host (``http://w1`` ...)."""

    def __init__(self, stubs: dict[str, Stub]) -> None:
        self.stubs = stubs
        self.transports = {wid: httpx.ASGITransport(app=stub) for wid, stub in stubs.items()}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.transports[request.url.host].handle_async_request(request)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prefix_tok")
    train_tokenizer(path)
    return path


def _report(wid: str, load: int = 0) -> WorkerReport:
    return WorkerReport(worker_id=wid, url=f"http://{wid}", base_model="smol", base_revision="stub", running=load,
                        timestamp=time.time())


async def _system(tokenizer_dir: Path, settings: Settings | None = None):
    stubs = {w: Stub(parse_args(["--port", "1", "--worker-id", w, "--tokenizer", str(tokenizer_dir)]))
             for w in ("w1", "w2", "w3")}
    res = MemoryResidency()
    for w in stubs:
        await res.publish(_report(w), 60)
    s = settings or Settings()
    app = create_app(s, snapshots=MutableSnapshots(make_snapshot(TENANTS)), limiter=LocalLimiter(), residency=res,
                     http_client=worker_client(_Workers(stubs)), mount_admin=False)
    return s, app, stubs, res


async def _set_load(app, res: MemoryResidency, loads: dict[str, int]) -> None:
    for w, load in loads.items():
        await res.publish(_report(w, load), 60)
    await app.gateway.router.refresh()


async def _ready(app) -> None:
    deadline = time.monotonic() + 10
    while app.gateway.prompts.entry("smol") is None:
        assert time.monotonic() < deadline, "the gateway never got the tokenizer"
        await asyncio.sleep(0.02)


def _h(s: Settings, tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {mint(s, 'u', tenant=tenant)}"}


async def test_a_repeated_prompt_returns_to_its_worker_and_another_tenants_is_not_steered(tokenizer_dir):
    s, app, stubs, res = await _system(tokenizer_dir)
    gw = app.gateway
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:

        async def ask(tenant: str, body: dict) -> str:
            r = await c.post("/v1/chat/completions", json=body, headers=_h(s, tenant))
            assert r.status_code == 200, r.text
            return r.headers[HDR_WORKER]

        await ask("acme", _chat("warm-up"))
        await _ready(app)
        await gw.router.refresh()
        ring = gw.router.candidates("smol", "base:smol")
        assert len(ring) == 3
        # Base-model requests go to the ring's first worker; while it is overloaded, to the next.
        await _set_load(app, res, {ring[0]: 10})
        question = _chat("My order 5521 arrived broken, what now?")
        assert await ask("acme", question) == ring[1]
        assert await ask("corp-a", question) == ring[1]
        await _set_load(app, res, {ring[0]: 0})
        # The ring's first is free again: the prompt acme sent goes back to the worker that holds it ...
        assert await ask("acme", question) == ring[1]
        assert await ask("acme", _chat("My order 5521 arrived broken, what now?", max_tokens=2)) == ring[1]
        # ... a tenant of the same scope is steered the same way ...
        assert await ask("corp-b", question) == ring[1]
        # ... another tenant's identical prompt is not, nor is a prompt of acme's that shares nothing.
        assert await ask("globex", question) == ring[0]
        assert await ask("acme", {"model": "smol", "max_tokens": 3,
                                  "messages": [{"role": "user", "content": "Do you sell soldering irons?"}]}) == ring[0]
        # Nothing the client sends names a scope: its loraplex object is refused, a cache_salt
        # (acme's own, as a vLLM worker would get it) changes nothing.
        forged = _chat("My order 5521 arrived broken, what now?", loraplex={"cache_scope": "tenant:acme"})
        r = await c.post("/v1/chat/completions", json=forged, headers=_h(s, "globex"))
        assert (r.status_code, r.json()["error"]["param"]) == (400, "loraplex")
        salted = _chat("My order 5521 arrived broken, what now?",
                       cache_salt=cache_salt(namespace("r1", None, "tenant:acme")))
        assert await ask("initech", salted) == ring[0]
        metrics = gw.metrics.render().decode()
    sent = [e["ext"] for stub in stubs.values() for e in stub.stats()["exts"]]
    assert {(e["tenant"], e["cache_scope"]) for e in sent} == {
        ("acme", "tenant:acme"), ("globex", "tenant:globex"), ("corp-a", "shared:corp"), ("corp-b", "shared:corp"),
        ("initech", "tenant:initech")}
    assert stubs[ring[0]].stats()["exts"][-1]["ext"]["cache_scope"] == "tenant:initech"
    # Steered: acme's two repeats and corp-b's; every other request went by the ring order.
    assert 'loraplex_gateway_route_decisions_total{reason="prefix"} 3.0' in metrics
    assert 'loraplex_gateway_route_decisions_total{reason="affinity"} 6.0' in metrics


async def test_a_responses_continuation_returns_to_the_previous_turns_worker(tokenizer_dir, tmp_path):
    db = f"sqlite+aiosqlite:///{tmp_path / 'registry.db'}"
    await fresh_registry(db)
    s, app, _, res = await _system(tokenizer_dir, Settings(database_url=db, response_retention_s=3600))
    gw = app.gateway
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        await c.post("/v1/chat/completions", json=_chat("warm-up"), headers=_h(s, "acme"))
        await _ready(app)
        await gw.router.refresh()
        ring = gw.router.candidates("smol", "base:smol")
        await _set_load(app, res, {ring[0]: 10})
        first = await c.post("/v1/responses", json={"model": "smol", "input": "Hello, I need help with order 5521.",
                                                     "instructions": SYSTEM, "max_output_tokens": 4},
                             headers=_h(s, "acme"))
        assert first.status_code == 200, first.text
        assert first.headers[HDR_WORKER] == ring[1]
        # ring[1] is now busier than the margin over the idle ring[0], yet within the load bound:
        # a prefix alone would give way, the conversation does not.
        await _set_load(app, res, {ring[0]: 0, ring[1]: 3, ring[2]: 3})
        nxt = await c.post("/v1/responses", json={"model": "smol", "input": "It arrived broken.",
                                                   "previous_response_id": first.json()["id"],
                                                   "max_output_tokens": 4}, headers=_h(s, "acme"))
        assert nxt.status_code == 200, nxt.text
        assert nxt.headers[HDR_WORKER] == ring[1]
        assert 'loraplex_gateway_route_decisions_total{reason="continuation"} 1.0' in gw.metrics.render().decode()
        # The same conversation's prompt from scratch, without the id: its prefix gives way to load.
        again = await c.post("/v1/chat/completions", json={
            "model": "smol", "max_tokens": 3, "messages": [{"role": "system", "content": SYSTEM},
                                                           {"role": "user", "content": "Hello, I need help with order 5521."}]},
            headers=_h(s, "acme"))
        assert again.headers[HDR_WORKER] == ring[0]


async def test_a_vllm_worker_gets_the_namespaces_cache_salt_never_the_clients():
    bodies: list[dict] = []

    def vllm(request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content)
        bodies.append(body)
        return httpx.Response(200, json={"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                                      "finish_reason": "stop"}],
                                         "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})

    res = MemoryResidency()
    await res.publish(WorkerReport(worker_id="v", url="http://vllm", base_model="smol", base_revision="r1",
                                   device_adapters=["sup-v1"], backend=BACKEND_VLLM, control_url="http://agent",
                                   served_model="base"), 30)
    s = Settings()
    tenants = {"acme": {"bindings": {"support": {"active": ("sup", 1)}}},
               "globex": {"bindings": {"support": {"active": ("sup", 1)}}}}
    app = create_app(s, snapshots=MutableSnapshots(make_snapshot(tenants)), limiter=LocalLimiter(), residency=res,
                     http_client=worker_client(httpx.MockTransport(vllm)), mount_admin=False)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        for tenant, model in (("acme", "support"), ("globex", "support"), ("acme", "smol")):
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            r = await c.post("/v1/chat/completions", json=body, headers=_h(s, tenant))
            assert r.status_code == 200, r.text
        forged = {"model": "support", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                  "cache_salt": bodies[0]["cache_salt"]}
        r = await c.post("/v1/chat/completions", json=forged, headers=_h(s, "globex"))
    # The registry's snapshot: base revision r1, the version's digest, each tenant its own scope.
    digest = "0" * 64
    assert [b["cache_salt"] for b in bodies[:3]] == [
        cache_salt(namespace("r1", digest, "tenant:acme")), cache_salt(namespace("r1", digest, "tenant:globex")),
        cache_salt(namespace("r1", None, "tenant:acme"))]
    assert [b["model"] for b in bodies[:3]] == ["sup-v1", "sup-v1", "base"]
    # A client's cache_salt (here acme's) is replaced by its own namespace's.
    assert r.status_code == 200, r.text
    assert bodies[3]["cache_salt"] == bodies[1]["cache_salt"] != bodies[0]["cache_salt"]
