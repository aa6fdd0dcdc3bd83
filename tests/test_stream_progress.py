"""A busy worker's quiet stream proves progress; a stuck one does not.

The bundled worker's stream starts with ``: accepted`` once its engine took the request and, while it
has nothing to send, sends ``: progress`` when the engine completed a step since it last sent
anything. The gateway counts those comments as progress against its stall bound, never passes one on,
and a stream whose engine is stuck still ends ``upstream_stalled``.

A real engine (a tiny model whose forward is slowed, or held: a stuck engine loop) behind the real
worker API and gateway over loopback; the stub worker's progressing mode for the completions and
Responses relays; a vLLM worker's stream, which sends no comments, through ``relay_sse``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from engine.api import create_worker_app
from engine.engine import Engine, EngineConfig
from gateway.app import create_app
from gateway.proxy import Opened, relay_sse, without_comments
from gateway.ratelimit import LocalLimiter
from loraplex.residency import MemoryResidency
from loraplex.settings import DEV_WORKER_SECRET, Settings
from loraplex.tokens import mint
from loraplex.wire import HDR_WORKER_SECRET
from tests.engine_fixtures import make_tiny_model
from tests.stub_worker import MutableSnapshots, StubProcess, ThreadServer, make_snapshot

AUTH = {HDR_WORKER_SECRET: DEV_WORKER_SECRET}
BASE = {"acme": {"bindings": {}}}
"""The tenant asks for the base model by name (the tiny engine has no LoRA)."""
TENANTS = {"acme": {"bindings": {"support": {"active": ("sup", 1)}}}}
HEARTBEAT_S = 0.1
"""The worker's ``worker_progress_interval_s`` here; the gateway's stall bound is several times it."""
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


class Pace:
    """The engine's forward, slowed by ``delay`` per step or held (``hold``: a stuck engine loop)."""

    def __init__(self, engine: Engine) -> None:
        self.model = engine.model
        self.forward = engine.model.forward
        self.delay = 0.0
        self.free = threading.Event()
        self.free.set()
        self.model.forward = self._forward

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        self.free.wait()
        if self.delay:
            time.sleep(self.delay)
        return self.forward(*args, **kwargs)

    def hold(self) -> None:
        self.free.clear()

    def release(self) -> None:
        self.free.set()

    def close(self) -> None:
        self.free.set()
        del self.model.forward


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine.from_path(make_tiny_model(tmp_path_factory.mktemp("tiny_progress"), "llama", max_position_embeddings=2048),
                           EngineConfig(kv_cache_bytes=4 << 20, max_num_seqs=8, max_waiting=16))
    eng.start()
    yield eng
    eng.stop()


@pytest.fixture
def pace(engine):
    p = Pace(engine)
    yield p
    p.close()
    deadline = time.monotonic() + 10
    while engine.load()["running"] or engine.load()["queue_depth"]:  # the next test starts on an idle engine
        assert time.monotonic() < deadline, engine.load()
        time.sleep(0.02)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def worker(engine: Engine, tmp_path: Any, name: str = "w-progress") -> Iterator[str]:
    """The real worker API for ``engine`` on a loopback port (uvicorn in a thread); yields its URL."""
    import uvicorn

    settings = Settings(home=str(tmp_path), worker_id=name, worker_progress_interval_s=HEARTBEAT_S)
    app = create_worker_app(settings, engine=engine, report=False, warm_start=False)
    port = _port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the worker did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def _gateway(urls: tuple[str, ...], tenants: dict[str, Any], **kw: Any) -> tuple[Settings, Any]:
    s = Settings(worker_urls=urls, request_timeout_s=30, **kw)
    app = create_app(s, snapshots=MutableSnapshots(make_snapshot(tenants)), limiter=LocalLimiter(),
                     residency=MemoryResidency(), mount_admin=False)
    return s, app


def _data(text: str) -> list[str]:
    return [e[len("data: "):] for e in text.split("\n\n") if e.startswith("data: ")]


def _no_comments(text: str) -> None:
    assert not [line for line in text.splitlines() if line.startswith(":")], text


def _failures(app: Any) -> str:
    return "\n".join(line for line in app.state.gateway.metrics.render().decode().splitlines()
                     if line.startswith(("loraplex_gateway_upstream_failures_total{",
                                         "loraplex_gateway_worker_ejected{")))


async def _timed_chunks(r: httpx.Response, out: list[tuple[float, bytes]]) -> None:
    async for chunk in r.aiter_raw():
        out.append((time.monotonic(), chunk))


async def _wait_until(pred: Any, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


# --- the worker ------------------------------------------------------------------------------------

async def test_a_stream_starts_with_accepted_and_a_stuck_engine_sends_no_progress(engine, pace, tmp_path):
    """The engine is stuck in its step: the completions stream still says at once that the engine took
    the request, then sends nothing at all (no progress comments) until the engine moves again."""
    pace.hold()
    with worker(engine, tmp_path) as url:
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as c:
            body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                got: list[tuple[float, bytes]] = []
                reader = asyncio.create_task(_timed_chunks(r, got))
                try:
                    await _wait_until(lambda: got, 5)
                    assert b"".join(c for _, c in got) == b": accepted\n\n"
                    await asyncio.sleep(8 * HEARTBEAT_S)  # eight heartbeat intervals of a stuck engine
                    assert b"".join(c for _, c in got) == b": accepted\n\n"
                    pace.release()
                    await asyncio.wait_for(reader, 10)
                finally:
                    reader.cancel()
    text = b"".join(c for _, c in got).decode()
    assert text.startswith(": accepted\n\n") and text.endswith("data: [DONE]\n\n")
    events = _data(text)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


async def test_a_quiet_tools_stream_sends_progress_while_the_engine_steps(engine, pace, tmp_path):
    """A ``tools`` answer is parsed whole, so its stream is quiet until the end: while the engine
    steps (slowly) it sends ``: progress`` every interval, and then the answer."""
    pace.delay = 0.03
    with worker(engine, tmp_path) as url:
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as c:
            body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 30, "temperature": 0,
                    "ignore_eos": True, "stream": True, "tools": TOOLS}
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                text = (await r.aread()).decode()
                assert r.status_code == 200, text
    events = [e for e in text.split("\n\n") if e]
    assert events[0] == ": accepted"
    assert json.loads(events[1][6:])["choices"][0]["delta"]["role"] == "assistant"
    beats = [e for e in events if e == ": progress"]
    assert len(beats) >= 2, events  # 30 steps of 30 ms or more, a comment per 0.1 s of quiet
    assert all(e == ": progress" for e in events[2:2 + len(beats)]), "the comments came while it was quiet"
    assert events[-1] == "data: [DONE]"
    finals = [json.loads(e[6:]) for e in events[2 + len(beats):-1]]
    assert finals[-1]["choices"][0]["finish_reason"] in ("length", "tool_calls")


async def test_a_whole_answer_has_no_comments(engine, pace, tmp_path):
    pace.delay = 0.03
    with worker(engine, tmp_path) as url:
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as c:
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hello"}],
                                                          "max_tokens": 12, "ignore_eos": True, "tools": TOOLS})
    assert r.status_code == 200
    assert r.content.startswith(b"{")
    assert r.json()["usage"]["completion_tokens"] == 12


# --- through the gateway -------------------------------------------------------------------------

def test_the_gateway_keeps_a_quiet_progressing_stream_and_passes_no_comment_on(engine, pace, tmp_path):
    """A tools stream quiet for several stall bounds while the engine steps: the client gets the whole
    answer and no comment, the worker is charged no failure; then a whole answer, plain JSON."""
    pace.delay = 0.05
    with worker(engine, tmp_path) as url:
        s, app = _gateway((url,), BASE, worker_stall_timeout_s=5 * HEARTBEAT_S)
        h = {"authorization": f"Bearer {mint(s, 'u', tenant='acme')}"}
        with ThreadServer(app) as gw, httpx.Client(base_url=gw.url, headers=h, timeout=30) as c:
            body = {"model": "smol", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 40,
                    "ignore_eos": True, "stream": True, "tools": TOOLS}
            t0 = time.monotonic()
            r = c.post("/v1/chat/completions", json=body)
            quiet = time.monotonic() - t0
            assert r.status_code == 200, r.text
            _no_comments(r.text)
            events = _data(r.text)
            assert events[-1] == "[DONE]", r.text
            assert "upstream_stalled" not in r.text and "error" not in r.text
            last = json.loads(events[-2])
            assert last["choices"][0]["finish_reason"] in ("length", "tool_calls")
            assert quiet > 2 * s.worker_stall_timeout_s  # it was quiet well past the stall bound
            r = c.post("/v1/chat/completions", json={**body, "stream": False})
            assert r.status_code == 200 and r.content.startswith(b"{")
            assert r.json()["usage"]["completion_tokens"] == 40
        assert f'upstream_failures_total{{worker="{url}"}}' not in _failures(app)
        assert f'worker_ejected{{worker="{url}"}} 0.0' in _failures(app)


def test_a_stuck_engine_still_ends_the_stream_upstream_stalled(engine, pace, tmp_path):
    """No steps, no progress comments: the stall bound ends the stream as before."""
    pace.hold()
    with worker(engine, tmp_path) as url:
        s, app = _gateway((url,), BASE, worker_stall_timeout_s=5 * HEARTBEAT_S)
        h = {"authorization": f"Bearer {mint(s, 'u', tenant='acme')}"}
        with ThreadServer(app) as gw, httpx.Client(base_url=gw.url, headers=h, timeout=30) as c:
            body = {"model": "smol", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4,
                    "stream": True}
            t0 = time.monotonic()
            r = c.post("/v1/chat/completions", json=body)
            assert time.monotonic() - t0 < 20  # the stall bound ended it, not the request deadline
            pace.release()
        assert r.status_code == 200
        _no_comments(r.text)
        events = _data(r.text)
        assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
        assert json.loads(events[-1])["error"]["code"] == "upstream_stalled"
        assert f'upstream_failures_total{{worker="{url}"}} 1.0' in _failures(app)


def test_the_first_byte_is_the_engine_taking_the_request_not_its_first_token(engine, pace, tmp_path):
    """A completions stream's first token comes after the first-byte deadline (a slow step): the
    worker's ``: accepted`` met the deadline, so the request stays on the first worker it went to and
    no worker is charged a first-byte failure."""
    pace.delay = 1.5
    with worker(engine, tmp_path, "w-a") as a, worker(engine, tmp_path, "w-b") as b:
        s, app = _gateway((a, b), BASE, worker_first_byte_timeout_s=1.0, worker_first_byte_per_queued_s=0,
                          worker_stall_timeout_s=10)
        h = {"authorization": f"Bearer {mint(s, 'u', tenant='acme')}"}
        with ThreadServer(app) as gw, httpx.Client(base_url=gw.url, headers=h, timeout=30) as c:
            r = c.post("/v1/completions", json={"model": "smol", "prompt": "Hello", "max_tokens": 1,
                                                "ignore_eos": True, "stream": True})
        assert r.status_code == 200, r.text
        _no_comments(r.text)
        assert _data(r.text)[-1] == "[DONE]"
        assert "upstream_failures_total{" not in _failures(app), _failures(app)


# --- the stub worker's progressing mode: completions, Responses, ejection -------------------------

@pytest.fixture(scope="module")
def stub():
    with StubProcess("w1", extra=("--chunks", "4")) as p:
        yield p


def test_comments_never_reach_the_client_and_a_progressing_worker_is_not_ejected(stub):
    """Streams quiet for twice the stall bound before their first token, each kind: chat, completions
    and a Responses stream. Every one is answered whole, no comment reaches a client, and the worker,
    which took more requests than it takes failures to eject it, is charged nothing."""
    s, app = _gateway((stub.url,), TENANTS, worker_stall_timeout_s=0.5, worker_first_byte_timeout_s=0.5,
                      worker_eject_failures=3)
    h = {"authorization": f"Bearer {mint(s, 'u', tenant='acme')}"}
    slow = {"stub_progress": "0.1", "stub_delay": "1.2", "stub_chunk_delay": "0.1"}
    with ThreadServer(app) as gw, httpx.Client(base_url=gw.url, headers=h, timeout=30) as c:
        for path, body in [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "stream_options": {"include_usage": True}}),
        ]:
            r = c.post(path, json={"model": "support", "max_tokens": 4, "stream": True, "metadata": slow, **body})
            assert r.status_code == 200, r.text
            _no_comments(r.text)
            events = _data(r.text)
            assert events[-1] == "[DONE]" and "upstream_stalled" not in r.text, r.text
            pieces = [json.loads(e)["choices"] for e in events[:-1]]
            assert [p[0].get("text") or p[0]["delta"].get("content") for p in pieces if p] == ["t0 ", "t1 ", "t2 ",
                                                                                               "t3 "]
        r = c.post("/v1/responses", json={"model": "support", "input": "hi", "stream": True, "store": False,
                                          "metadata": slow})
        assert r.status_code == 200, r.text
        _no_comments(r.text)
        kinds = [json.loads(line[6:])["type"] for line in r.text.splitlines() if line.startswith("data: ")]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
        r = c.post("/v1/chat/completions", json={"model": "support", "max_tokens": 4, "metadata": slow,
                                                 "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("ok from")
        # The same quiet worker, stuck after two chunks (no comments), is still ended upstream_stalled.
        r = c.post("/v1/chat/completions", json={"model": "support", "max_tokens": 4, "stream": True,
                                                 "messages": [{"role": "user", "content": "hi"}],
                                                 "metadata": {**slow, "stub_stall_after": "2"}})
        _no_comments(r.text)
        assert json.loads(_data(r.text)[-1])["error"]["code"] == "upstream_stalled"
    failures = _failures(app)
    assert f'upstream_failures_total{{worker="{stub.url}"}} 1.0' in failures, failures  # the stalled one only
    assert f'worker_ejected{{worker="{stub.url}"}} 0.0' in failures


# --- relay_sse: comments and a vLLM worker's patient stream ---------------------------------------

def test_without_comments_keeps_every_event_but_the_comments():
    events = b': accepted\n\ndata: {"a":1}\n\n: progress\n\nevent: x\n: note\ndata: {"b":"x\\n:y"}\n\n'
    assert without_comments(events) == b'data: {"a":1}\n\nevent: x\ndata: {"b":"x\\n:y"}\n\n'
    assert without_comments(b": progress\n\n: progress\n\n") == b""


class _Response:
    status = 200

    def close(self) -> None:
        pass


async def _relayed(patient: bool, alive: Any) -> tuple[bytes, Any]:
    """A stream quiet for 0.5 s (three stall bounds) between its first and last chunk."""
    async def chunks() -> AsyncIterator[bytes]:
        await asyncio.sleep(0.5)
        yield b'data: {"choices":[{"index":0,"delta":{"content":"b"}}]}\n\ndata: [DONE]\n\n'

    opened = Opened(worker=None, response=_Response(), first=b': accepted\n\ndata: {"choices":[{"index":0,'  # type: ignore[arg-type]
                    b'"delta":{"content":"a"}}]}\n\n', chunks=chunks(), stall_s=0.15, alive=alive, check_s=0.05,
                    patient=patient)
    sent: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message["body"])

    result = await relay_sse(opened, send, keep_usage=False)
    return b"".join(sent), result


async def test_a_vllm_workers_quiet_stream_waits_while_it_reports():
    """vLLM sends no progress comments: its stream (``patient``) is not cut by silence while the worker
    reports, but is once it stops; a stream that is not patient is cut by silence."""
    body, result = await _relayed(True, lambda: True)
    assert result.error is None and result.done and body.endswith(b"data: [DONE]\n\n")
    assert b": accepted" not in body
    body, result = await _relayed(True, lambda: False)
    assert result.stalled and b"upstream_stalled" in body
    body, result = await _relayed(False, lambda: True)
    assert result.stalled and b"upstream_stalled" in body


def test_a_vllm_worker_opens_a_patient_stream():
    """``Upstream.open`` marks a vLLM worker's stream patient, and only a vLLM worker's."""
    from gateway.proxy import Upstream
    from gateway.router import Router, Worker

    class Client:
        async def post(self, url: str, body: bytes, request_id: str) -> Any:
            class R(_Response):
                cache = ""

                async def chunks(self) -> AsyncIterator[bytes]:
                    yield b"data: [DONE]\n\n"

            return R()

    async def main() -> list[bool]:
        up = Upstream(Client(), Router(None))  # type: ignore[arg-type]
        out = []
        for vllm in (True, False):
            w = Worker(id="w", url="http://w", base_model="smol", device=frozenset(), host=frozenset(),
                       reported_load=0, report_ts=0.0, vllm=vllm)

            async def body(worker: Worker, reload: bool) -> bytes:
                return b"{}"

            opened = await up.open([w], "/v1/chat/completions", b"{}", "r1", vllm=body)
            out.append(opened.patient)
            up.done(opened)
        return out

    assert asyncio.run(main()) == [True, False]
