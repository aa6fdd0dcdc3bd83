"""Errors say nothing of the servers' insides: every error code the gateway can send (found in its
source, so a new code joins the sweep) is sent here where practical, through the gateway app with
workers that put paths, hosts and exception text in their errors, and no answer carries a path, a
host or an exception's text. The worker's detail reaches the gateway's log with the request id."""

from __future__ import annotations

import ast
import asyncio
import logging
import re
import shutil
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.app import create_app
from gateway.errors import ERROR_CODES
from gateway.ratelimit import LocalLimiter
from loraplex.residency import MemoryResidency
from loraplex.settings import Settings
from loraplex.tokens import mint
from tests.registry_support import fresh_registry
from tests.stub_worker import MutableSnapshots, make_snapshot
from tests.worker_double import worker_client

ROOT = Path(__file__).resolve().parent.parent
LOAD_FAILED = ("adapter globex-json2@3 could not be loaded: adapter directory "
               "/srv/loraplex/adapters/globex-json2 does not exist")
TRACEBACK = ('Traceback (most recent call last):\n  File "/srv/loraplex/engine/engine.py", line 460, in step\n'
             "RuntimeError('CUDA error at 10.0.3.7:5432')")
LEAKS = {
    "path": re.compile(r"/srv/|/tmp/|/home/|\w+/\w+/|\.py\b"),
    "host": re.compile(r"127\.0\.0\.1|10\.0\.3\.7|:5432|:\d{2,5}\b|localhost"),
    "exception": re.compile(r"Traceback|\w+Error\(|Exception\(|OperationalError|no such table"),
}
OUTAGES = {"registry_unavailable", "store_unavailable", "no_worker"}
"""Codes of a passing outage: their 503 says when to retry."""
TENANTS = {
    "acme": {"tokens_per_min": 1_000_000, "requests_per_min": 100_000, "max_concurrent": 64,
             "bindings": {"support": {"active": ("sup", 1)},
                          "frozen": {"active": ("sup", 1), "enabled": False, "on_disabled": "refuse"}}},
    "tiny": {"tokens_per_min": 50, "requests_per_min": 1, "max_concurrent": 64,
             "bindings": {"support": {"active": ("sup", 1)}}},
    "gone": {"status": "disabled", "bindings": {}},
}


# --- the codes the gateway can send, from its source -------------------------------------------------

_CODE_ARGS = {"error_body": 2, "sse_error": 1, "_bad": 2, "_error": 2}
"""Calls that take the code positionally: the argument's index."""


def _strings(node: ast.AST | None) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str | bytes):
        v = node.value
        return [v.decode() if isinstance(v, bytes) else v]
    if isinstance(node, ast.IfExp):
        return _strings(node.body) + _strings(node.orelse)
    if isinstance(node, ast.Tuple):
        return [s for e in node.elts for s in _strings(e)]
    return []


def gateway_codes() -> dict[str, str]:
    """code -> the module that sends it: ``code=`` arguments, the code arguments of the error helpers,
    ``"code"`` keys, ``code`` defaults and assignments, and the worker codes the proxy relays."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "gateway").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            got: list[str] = []
            if isinstance(node, ast.Call):
                got += [s for kw in node.keywords if kw.arg == "code" for s in _strings(kw.value)]
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                i = _CODE_ARGS.get(name)
                if i is not None and i < len(node.args):
                    got += _strings(node.args[i])
            elif isinstance(node, ast.Dict):
                got += [s for k, v in zip(node.keys, node.values, strict=True) if _strings(k) == ["code"]
                        for s in _strings(v)]
            elif isinstance(node, ast.arguments):
                args = [*node.args, *node.kwonlyargs]
                defaults = [None] * (len(node.args) - len(node.defaults)) + [*node.defaults, *node.kw_defaults]
                got += [s for a, d in zip(args, defaults, strict=True) if a.arg == "code" for s in _strings(d)]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                if "code" in names or "ADAPTER_FAILURES" in names:
                    got += _strings(node.value)
            for code in got:
                if re.fullmatch(r"[a-z][a-z0-9_]*", code):
                    found.setdefault(code, path.name)
    return found


def test_every_code_the_gateway_sends_is_registered():
    found = gateway_codes()
    assert {"adapter_load_failed", "no_worker", "store_unavailable", "unsupported_path"} <= set(found)
    missing = {c: m for c, m in found.items() if c not in ERROR_CODES}
    assert not missing, f"codes sent but not in gateway.errors.ERROR_CODES: {missing}"


# --- the sweep --------------------------------------------------------------------------------------

def _worker(request: httpx.Request) -> httpx.Response:
    """A worker whose failures (``metadata.mode``) carry paths, hosts and tracebacks."""
    body = orjson.loads(request.content)
    mode = (body.get("metadata") or {}).get("mode", "ok")
    chat = request.url.path.endswith("chat/completions")

    def error(status: int, code: str, message: str) -> httpx.Response:
        return httpx.Response(status, json={"error": {"message": message, "type": "server_error", "code": code}})

    if mode == "load-fail":
        return error(503, "adapter_load_failed", LOAD_FAILED)
    if mode == "non-finite":
        return error(503, "non_finite_output", f"adapter at /srv/loraplex/adapters/x produced NaN; {TRACEBACK}")
    if mode == "adapter-error":
        return error(503, "adapter_error", TRACEBACK)
    if mode == "500":
        return error(500, "internal_error", TRACEBACK)
    if mode == "400":
        return error(400, "invalid_value", f"ValueError('bad stop') in /srv/loraplex/engine/protocol.py; {TRACEBACK}")
    if mode == "ctx":
        return error(400, "context_length_exceeded", "This model's maximum context length is 2048 tokens; the "
                                                     "prompt has 3000 tokens")
    if mode == "overloaded":
        return error(503, "queue_full", "queue of worker at 10.0.3.7:8001 is full")
    if mode == "unreachable":
        raise httpx.ConnectError("Cannot connect to host 10.0.3.7:8001 ssl:default [Connection refused]")
    if mode == "garbage":
        return httpx.Response(200, content=b"<html>/srv/loraplex 502 from 10.0.3.7:8001</html>")
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    if not body.get("stream"):
        choice = ({"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
                  if chat else {"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None})
        return httpx.Response(200, json={"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                                         "choices": [choice], "usage": usage})
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "t"}, "finish_reason": None}]}
    out = b"data: " + orjson.dumps(chunk) + b"\n\n"
    if mode == "stream-error":
        out += b"data: " + orjson.dumps({"error": {"message": LOAD_FAILED + "\n" + TRACEBACK, "type": "server_error",
                                                   "code": "engine_error"}}) + b"\n\n"
        return httpx.Response(200, content=out + b"data: [DONE]\n\n", headers={"content-type": "text/event-stream"})
    if mode == "stream-adapter":
        out += b"data: " + orjson.dumps({"error": {"message": LOAD_FAILED, "type": "server_error",
                                                   "code": "adapter_load_failed"}}) + b"\n\n"
        return httpx.Response(200, content=out + b"data: [DONE]\n\n", headers={"content-type": "text/event-stream"})
    if mode == "stream-break":  # ends without [DONE]
        return httpx.Response(200, content=out, headers={"content-type": "text/event-stream"})
    out += b"data: " + orjson.dumps(chunk | {"choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n"
    return httpx.Response(200, content=out, headers={"content-type": "text/event-stream"})


class Snapshots(MutableSnapshots):
    """The registry snapshot, or a registry that cannot be read (``down``)."""

    down = False

    @property
    def current(self) -> Any:
        if self.down:
            raise ConnectionRefusedError("connect call failed ('10.0.3.7', 5432)")
        return self._current

    @current.setter
    def current(self, value: Any) -> None:
        self._current = value

    def readiness_problem(self) -> str | None:
        """As ``registry.cache.SnapshotCache`` says it: with the database's error."""
        return ("no registry snapshot yet (ConnectionRefusedError: [Errno 111] Connect call failed "
                "('10.0.3.7', 5432))") if self.down else None


@pytest.fixture(scope="module")
def migrated(tmp_path_factory) -> Path:
    """A migrated registry database, copied for each test (migrating takes longer than a test)."""
    path = tmp_path_factory.mktemp("leaks") / "registry.db"
    asyncio.run(fresh_registry(f"sqlite+aiosqlite:///{path}"))
    return path


@pytest.fixture
async def gw(tmp_path, migrated):
    shutil.copy(migrated, tmp_path / "registry.db")
    db = f"sqlite+aiosqlite:///{tmp_path / 'registry.db'}"
    settings = Settings(database_url=db, worker_urls=("http://worker",), max_body_bytes=8192,
                        response_retention_s=3600, response_max_chain=2, canary_judge_interval_s=0.0)
    snapshots = Snapshots(make_snapshot(TENANTS))
    app = create_app(settings, snapshots=snapshots, limiter=LocalLimiter(), residency=MemoryResidency(),
                     http_client=worker_client(httpx.MockTransport(_worker)), mount_admin=False)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app, raise_app_exceptions=False), base_url="http://gw") as c:
        yield c, settings, snapshots, tmp_path / "registry.db"


def _auth(settings: Settings, tenant: str | None = "acme") -> dict[str, str]:
    return {"authorization": f"Bearer {mint(settings, 'u', tenant=tenant)}"}


CHAT = {"model": "support", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
Trigger = Callable[[httpx.AsyncClient, Settings, Any, Path], Awaitable[httpx.Response]]


def _chat(mode: str, **extra: Any) -> Trigger:
    async def go(c: httpx.AsyncClient, s: Settings, _snap: Any, _db: Path) -> httpx.Response:
        return await c.post("/v1/chat/completions", json=CHAT | {"metadata": {"mode": mode}} | extra, headers=_auth(s))
    return go


def _post(path: str, body: Any, tenant: str | None = "acme", raw: bytes | None = None) -> Trigger:
    async def go(c: httpx.AsyncClient, s: Settings, _snap: Any, _db: Path) -> httpx.Response:
        if raw is not None:
            return await c.post(path, content=raw, headers=_auth(s, tenant) | {"content-type": "application/json"})
        return await c.post(path, json=body, headers=_auth(s, tenant))
    return go


async def _chain(c: httpx.AsyncClient, s: Settings, _snap: Any, _db: Path) -> httpx.Response:
    prev = None
    for _ in range(3):
        r = await c.post("/v1/responses", json={"model": "support", "input": "hi", "previous_response_id": prev},
                         headers=_auth(s))
        if r.status_code != 200:
            return r
        prev = r.json()["id"]
    raise AssertionError("a chain longer than response_max_chain was accepted")


async def _too_large(c: httpx.AsyncClient, s: Settings, _snap: Any, _db: Path) -> httpx.Response:
    first = await c.post("/v1/responses", json={"model": "support", "input": "x" * 5000}, headers=_auth(s))
    assert first.status_code == 200, first.text
    return await c.post("/v1/responses", json={"model": "support", "input": "y" * 4000,
                                               "previous_response_id": first.json()["id"]}, headers=_auth(s))


async def _rate_limited(c: httpx.AsyncClient, s: Settings, _snap: Any, _db: Path) -> httpx.Response:
    body = CHAT | {"max_tokens": 1, "messages": [{"role": "user", "content": "a"}]}
    await c.post("/v1/chat/completions", json=body, headers=_auth(s, "tiny"))
    return await c.post("/v1/chat/completions", json=body, headers=_auth(s, "tiny"))


async def _registry_down(c: httpx.AsyncClient, s: Settings, snap: Any, _db: Path) -> httpx.Response:
    snap.down = True
    return await c.post("/v1/chat/completions", json=CHAT, headers=_auth(s))


async def test_readiness_says_nothing_of_the_database(gw):
    c, _settings, snapshots, _db = gw
    assert (await c.get("/readyz")).status_code == 200
    snapshots.down = True
    r = await c.get("/readyz")
    assert r.status_code == 503 and r.json()["status"] == "not ready", r.text
    assert "10.0.3.7" not in r.text and "5432" not in r.text and "Error" not in r.text, r.text


async def _store_down(c: httpx.AsyncClient, s: Settings, _snap: Any, db: Path) -> httpx.Response:
    with sqlite3.connect(db) as conn:
        conn.execute("DROP TABLE IF EXISTS responses")
    return await c.get("/v1/responses/resp_x", headers=_auth(s))


async def _store_down_on_turn(c: httpx.AsyncClient, s: Settings, _snap: Any, db: Path) -> httpx.Response:
    with sqlite3.connect(db) as conn:
        conn.execute("DROP TABLE IF EXISTS responses")
    return await c.post("/v1/responses", json={"model": "support", "input": "hi"}, headers=_auth(s))


async def _stream(c: httpx.AsyncClient, s: Settings, mode: str, path: str = "/v1/chat/completions",
                  body: Any = None) -> httpx.Response:
    return await c.post(path, json=(body or CHAT) | {"stream": True, "metadata": {"mode": mode}}, headers=_auth(s))


def _streamed(mode: str, responses: bool = False) -> Trigger:
    async def go(c: httpx.AsyncClient, s: Settings, _snap: Any, _db: Path) -> httpx.Response:
        if responses:
            return await _stream(c, s, mode, "/v1/responses", {"model": "support", "input": "hi"})
        return await _stream(c, s, mode)
    return go


async def _get(c: httpx.AsyncClient, path: str, s: Settings) -> httpx.Response:
    return await c.get(path, headers=_auth(s))


TRIGGERS: dict[str, list[Trigger]] = {
    "adapter_load_failed": [_chat("load-fail"), _streamed("stream-adapter"), _streamed("stream-adapter", True)],
    "non_finite_output": [_chat("non-finite")],
    "adapter_error": [_chat("adapter-error")],
    "engine_error": [_streamed("stream-error"), _streamed("stream-error", True)],
    "upstream_error": [_chat("500")],
    "internal_error": [_post("/v1/responses", {"model": "support", "input": "hi", "store": False,
                                               "metadata": {"mode": "garbage"}})],
    "stream_interrupted": [_streamed("stream-break"), _streamed("stream-break", True)],
    "invalid_value": [_chat("400"), _chat("ok", temperature=99)],
    "context_length_exceeded": [_chat("ctx")],
    "no_worker": [_chat("unreachable"), _chat("overloaded")],
    "body_too_large": [_post("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": "x" * 9000}]})],
    "method_not_allowed": [lambda c, s, _n, _d: _get(c, "/v1/chat/completions", s)],
    "model_not_found": [_post("/v1/chat/completions", CHAT | {"model": "nope"}),
                        lambda c, s, _n, _d: _get(c, "/v1/models/nope", s)],
    "model_disabled": [_post("/v1/chat/completions", CHAT | {"model": "frozen"})],
    "no_tenant": [_post("/v1/chat/completions", CHAT, tenant=None)],
    "unknown_tenant": [_post("/v1/chat/completions", CHAT, tenant="nobody")],
    "tenant_disabled": [_post("/v1/chat/completions", CHAT, tenant="gone")],
    "unsupported_path": [lambda c, s, _n, _d: _get(c, "/v1/embeddings/x/y", s)],
    "unsupported_parameter": [_post("/v1/responses", {"model": "support", "input": "hi", "background": True})],
    "unsupported_item_type": [_post("/v1/responses", {"model": "support", "input": [{"type": "image"}]})],
    "unsupported_content": [_post("/v1/responses", {"model": "support", "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": "file:///srv/x.png"}]}]})],
    "unsupported_tool": [_post("/v1/responses", {"model": "support", "input": "hi", "tools": [{"type": "web"}]})],
    "previous_response_not_found": [_post("/v1/responses", {"model": "support", "input": "hi",
                                                            "previous_response_id": "resp_nope"})],
    "response_not_found": [lambda c, s, _n, _d: _get(c, "/v1/responses/resp_nope", s)],
    "chain_too_long": [_chain],
    "input_too_large": [_too_large],
    "rate_limit_exceeded": [_rate_limited],
    "request_exceeds_token_limit": [_post("/v1/completions", {"model": "support", "prompt": [1] * 60}, "tiny")],
    "missing_token": [lambda c, _s, _n, _d: c.post("/v1/chat/completions", json=CHAT)],
    "invalid_token": [lambda c, _s, _n, _d: c.post("/v1/chat/completions", json=CHAT,
                                                   headers={"authorization": "Bearer e30.e30.x"})],
    "invalid_json": [_post("/v1/chat/completions", None, raw=b'{"model": '), _post("/v1/responses", None, raw=b"[")],
    "registry_unavailable": [_registry_down],
    "store_unavailable": [_store_down, _store_down_on_turn],
}
NOT_SENT_HERE: dict[str, str] = {
    "request_too_large": "the limiter's own bound, behind request_exceeds_token_limit: tests/test_gateway_ratelimit.py",
    "ratelimiter_unavailable": "a Redis limiter failing closed: tests/test_gateway_ratelimit.py",
    "timeout": "a request past request_timeout_s: tests/test_gateway_proxy.py",
    "shutting_down": "a server's shutdown grace ending: tests/test_gateway_http_edge.py",
    "upstream_stalled": "a worker that stops mid-stream (a real connection): tests/test_gateway_proxy.py",
    "no_worker_on_revision": "workers at another base-model revision: tests/test_gateway_routing.py",
    "worker_busy": "the activation gate's (admin API) refusal: tests/test_activation.py",
    "verifier_refused": "the activation gate's (admin API) refusal: tests/test_activation.py",
}
"""Codes this sweep does not send, and where they are tested."""


def test_the_sweep_covers_every_registered_code():
    codes = set(ERROR_CODES) | set(gateway_codes())
    assert codes - set(TRIGGERS) - set(NOT_SENT_HERE) == set(), "codes neither sent nor explained"
    assert set(TRIGGERS) & set(NOT_SENT_HERE) == set()


def _codes_in(r: httpx.Response) -> set[str]:
    """The error codes an answer carries: its body's, or its stream's error events' and failed response's."""
    out = set()
    text = r.text
    for m in re.finditer(r'"code":"(\w+)"', text):
        out.add(m.group(1))
    return out


@pytest.mark.parametrize("code", sorted(TRIGGERS))
async def test_an_error_says_nothing_of_the_servers_insides(gw, code, caplog):
    c, settings, snapshots, db = gw
    caplog.set_level(logging.WARNING)
    for trigger in TRIGGERS[code]:
        r = await trigger(c, settings, snapshots, db)
        text = r.text
        assert r.status_code != 200 or "event" in r.headers.get("content-type", ""), text
        assert code in _codes_in(r), f"{code} not sent: {r.status_code} {text[:400]}"
        for kind, pattern in LEAKS.items():
            scrubbed = re.sub(r"/v1/[\w/{}.|-]*", "", text)  # the API's own paths are no secret
            found = pattern.search(scrubbed)
            assert found is None, f"{code}: the answer names a {kind} ({found.group(0)!r}): {text[:600]}"
        assert r.status_code != 500 or code == "internal_error", text
        if code in OUTAGES:
            assert r.headers.get("retry-after", "").isdigit(), f"{code}: a 503 without retry-after"


async def test_adapter_load_failed_is_a_fixed_sentence_and_the_reason_is_logged(gw, caplog):
    c, settings, _snap, _db = gw
    caplog.set_level(logging.WARNING, logger="loraplex.gateway")
    r = await c.post("/v1/chat/completions", json=CHAT | {"metadata": {"mode": "load-fail"}},
                     headers=_auth(settings) | {"x-request-id": "req-load-1"})
    assert r.status_code == 503
    assert r.json()["error"] == {"message": ERROR_CODES["adapter_load_failed"], "type": "service_unavailable",
                                 "code": "adapter_load_failed", "param": None}
    assert "globex-json2" not in r.text and "/srv/" not in r.text
    logged = [rec.getMessage() for rec in caplog.records if "req-load-1" in rec.getMessage()]
    assert any("/srv/loraplex/adapters/globex-json2 does not exist" in m for m in logged), logged
    # Streamed: the error event carries the same sentence.
    r = await _stream(c, settings, "stream-adapter")
    events = [orjson.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    errors = [e["error"] for e in events if "error" in e]
    assert [(e["code"], e["message"]) for e in errors] == [("adapter_load_failed",
                                                             ERROR_CODES["adapter_load_failed"])], errors


def test_the_leak_patterns_catch_what_the_workers_send():
    """The sweep's patterns find each kind in the workers' raw texts (they can fail)."""
    raw = LOAD_FAILED + TRACEBACK
    assert all(p.search(raw) for p in LEAKS.values())
