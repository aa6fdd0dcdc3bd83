"""The proxy through a real uvicorn gateway and real stub worker processes: SSE passthrough,
usage chunk handling, client-disconnect cancellation, mid-stream breaks, deadlines."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from gateway.app import create_app
from gateway.ratelimit import LocalLimiter
from loraplex.residency import MemoryResidency
from loraplex.settings import Settings
from loraplex.tokens import mint
from tests.stub_worker import MutableSnapshots, StubProcess, ThreadServer, make_snapshot

TENANTS = {"acme": {"bindings": {"support": {"active": ("sup", 1)}}}}


@pytest.fixture(scope="module")
def stub():
    with StubProcess("w1", extra=("--chunks", "6")) as p:
        yield p


def _gateway(stub, **kw):
    s = Settings(worker_urls=(stub.url,), **kw)
    app = create_app(s, snapshots=MutableSnapshots(make_snapshot(TENANTS)), limiter=LocalLimiter(),
                     residency=MemoryResidency(), mount_admin=False)
    return s, app


def _body(**kw):
    return {"model": "support", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **kw}


def _events(text: str) -> list[str]:
    return [e[len("data: "):] for e in text.split("\n\n") if e.startswith("data: ")]


def _wait_for(pred, seconds=5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_stream_passes_through_incrementally(stub):
    s, app = _gateway(stub)
    h = {"authorization": f"Bearer {mint(s, 'u', tenant='acme')}"}
    with ThreadServer(app) as gw, httpx.Client(base_url=gw.url, timeout=10) as c:
        body = _body(stream=True, metadata={"stub_chunk_delay": "0.2"})
        t0 = time.monotonic()
        arrivals = []
        with c.stream("POST", "/v1/chat/completions", json=body, headers=h) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["x-loraplex-adapter"] == "sup@1"
            for line in r.iter_lines():
                if line.startswith("data: "):
                    arrivals.append((time.monotonic() - t0, line[6:]))
        # Six chunks 0.2 s apart: the first one arrives long before the last (no buffering).
        assert arrivals[-1][1] == "[DONE]"
        assert len(arrivals) == 7
        assert arrivals[-1][0] - arrivals[0][0] > 0.6
        texts = [json.loads(d)["choices"][0]["delta"]["content"] for _, d in arrivals[:-1]]
        assert texts == [f"t{i} " for i in range(6)]


def test_usage_chunk_only_when_asked(stub):
    s, app = _gateway(stub)
    h = {"authorization": f"Bearer {mint(s, 'u', tenant='acme')}"}
    with ThreadServer(app) as gw, httpx.Client(base_url=gw.url, timeout=10) as c:
        plain = _events(c.post("/v1/chat/completions", json=_body(stream=True), headers=h).text)
        assert all('"usage"' not in e for e in plain) and plain[-1] == "[DONE]"
        # The worker was asked for usage anyway, in every chunk (to settle what was streamed).
        assert stub.stats()["exts"][-1]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        asked = _events(c.post("/v1/chat/completions", json=_body(
            stream=True, stream_options={"include_usage": True}), headers=h).text)
        usage = json.loads(asked[-2])
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
        assert all(json.loads(e)["usage"] is None for e in asked[:-2])  # as OpenAI: null until the last
        every = _events(c.post("/v1/chat/completions", json=_body(
            stream=True, stream_options={"continuous_usage_stats": True}), headers=h).text)
        assert [json.loads(e)["usage"]["completion_tokens"] for e in every[:-1]] == [1, 2, 3, 4, 5, 6]
        comp = c.post("/v1/completions", json={"model": "support", "prompt": "hi", "max_tokens": 3}, headers=h)
        assert comp.status_code == 200 and comp.json()["usage"]["completion_tokens"] == 3


def test_client_disconnect_cancels_upstream_stream(stub):
    s, app = _gateway(stub)
    h = {"authorization": f"Bearer {mint(s, 'u', tenant='acme')}"}
    before = stub.stats()["cancelled"]
    with ThreadServer(app) as gw:
        with httpx.Client(base_url=gw.url, timeout=10) as c, c.stream(
                "POST", "/v1/chat/completions", json=_body(stream=True, metadata={"stub_chunk_delay": "0.5"}),
                headers=h) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # got the first chunk; hang up
        assert _wait_for(lambda: stub.stats()["cancelled"] > before), "worker never saw the cancellation"
        assert app.state.gateway.router.workers()[0].inflight == 0


def test_client_disconnect_cancels_upstream_non_streaming(stub):
    s, app = _gateway(stub)
    h = {"authorization": f"Bearer {mint(s, 'u', tenant='acme')}"}
    before = stub.stats()["cancelled"]
    with ThreadServer(app) as gw:
        # Hang up after 2 s: the request reached the worker long before, its answer is 5 s away.
        with httpx.Client(base_url=gw.url, timeout=2.0) as c, pytest.raises(httpx.ReadTimeout):
            c.post("/v1/chat/completions", json=_body(metadata={"stub_delay": "5"}), headers=h)
        assert _wait_for(lambda: stub.stats()["cancelled"] > before), "worker never saw the cancellation"


def test_broken_stream_ends_with_error_event(stub):
    s, app = _gateway(stub)
    h = {"authorization": f"Bearer {mint(s, 'u', tenant='acme')}"}
    with ThreadServer(app) as gw, httpx.Client(base_url=gw.url, timeout=10) as c:
        r = c.post("/v1/chat/completions", json=_body(stream=True, metadata={"stub_mode": "break"}), headers=h)
        assert r.status_code == 200
        events = _events(r.text)
        assert "[DONE]" not in events
        err = json.loads(events[-1])["error"]
        assert err["code"] == "stream_interrupted"
        assert len(events) >= 2  # the chunks before the break went through
        m = app.state.gateway.metrics.render().decode()
        assert 'loraplex_gateway_requests_total{adapter="sup@1",status="5xx",tenant="acme"}' in m


def test_deadline_and_worker_errors(stub):
    # The deadline falls mid-stream: 6 chunks 0.4 s apart; the first leaves 1.1 s for the round trip.
    s, app = _gateway(stub, request_timeout_s=1.5)
    h = {"authorization": f"Bearer {mint(s, 'u', tenant='acme')}"}
    with ThreadServer(app) as gw, httpx.Client(base_url=gw.url, timeout=10) as c:
        r = c.post("/v1/chat/completions", json=_body(metadata={"stub_delay": "5"}), headers=h)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        r = c.post("/v1/chat/completions", json=_body(stream=True, metadata={"stub_chunk_delay": "0.4"}), headers=h)
        assert r.status_code == 200 and json.loads(_events(r.text)[-1])["error"]["code"] == "timeout"
        r = c.post("/v1/chat/completions", json=_body(metadata={"stub_mode": "500"}), headers=h)
        assert r.status_code == 502 and "boom" not in r.text


def test_deadline_shorter_than_the_watch_delay(stub):
    # A deadline below WATCH_AFTER_S is armed at once, not when the watcher would start.
    s, app = _gateway(stub, request_timeout_s=0.005)
    h = {"authorization": f"Bearer {mint(s, 'u', tenant='acme')}"}
    with ThreadServer(app) as gw, httpx.Client(base_url=gw.url, timeout=10) as c:
        r = c.post("/v1/chat/completions", json=_body(metadata={"stub_delay": "2"}), headers=h)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        assert app.state.gateway.router.workers()[0].inflight == 0


def test_no_worker_is_503():
    s = Settings(worker_urls=("http://127.0.0.1:9",))
    app = create_app(s, snapshots=MutableSnapshots(make_snapshot(TENANTS)), limiter=LocalLimiter(),
                     residency=MemoryResidency(), mount_admin=False)
    h = {"authorization": f"Bearer {mint(s, 'u', tenant='acme')}"}
    with ThreadServer(app) as gw, httpx.Client(base_url=gw.url, timeout=10) as c:
        r = c.post("/v1/chat/completions", json=_body(), headers=h)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker"
        assert c.get("/healthz").status_code == 200


def test_client_gone_while_sending_body(stub):
    import socket

    s, app = _gateway(stub)
    with ThreadServer(app) as gw:
        sock = socket.create_connection(("127.0.0.1", gw.port))
        token = mint(s, "u", tenant="acme")
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 1000\r\nauthorization: Bearer " + token.encode() + b"\r\n\r\n{\"model\"")
        time.sleep(0.2)
        sock.close()
        assert _wait_for(lambda: 'status="499"' in app.state.gateway.metrics.render().decode())
        # the gateway is fine afterwards
        r = httpx.post(gw.url + "/v1/chat/completions", json=_body(), headers={"authorization": f"Bearer {token}"})
        assert r.status_code == 200


class _Recording(LocalLimiter):
    """The local limiter, keeping what each request was settled at."""

    def __init__(self) -> None:
        super().__init__()
        self.settled: list[int] = []

    def settle_nowait(self, lease, used_tokens):  # type: ignore[no-untyped-def]
        self.settled.append(used_tokens)
        super().settle_nowait(lease, used_tokens)


def test_stalled_stream_ends_upstream_stalled_frees_the_slot_and_settles_what_was_streamed(stub):
    """A worker that stops sending mid-stream: the client gets an ``upstream_stalled`` error event
    after the stall bound (not the request deadline), the tenant's one slot is free at once and
    the reservation is settled at the prompt + the tokens that went out."""
    limiter = _Recording()
    s = Settings(worker_urls=(stub.url,), worker_stall_timeout_s=0.5, request_timeout_s=20)
    tenants = {"acme": {"max_concurrent": 1, **TENANTS["acme"]}}
    app = create_app(s, snapshots=MutableSnapshots(make_snapshot(tenants)), limiter=limiter,
                     residency=MemoryResidency(), mount_admin=False)
    h = {"authorization": f"Bearer {mint(s, 'u', tenant='acme')}"}
    with ThreadServer(app) as gw, httpx.Client(base_url=gw.url, timeout=30) as c:
        t0 = time.monotonic()
        r = c.post("/v1/chat/completions", json=_body(stream=True, metadata={"stub_stall_after": "2"},
                                                      stream_options={"continuous_usage_stats": True}), headers=h)
        assert time.monotonic() - t0 < 10  # the stall bound ended it, not the 20 s deadline
        assert r.status_code == 200
        events = _events(r.text)
        chunks = [json.loads(e) for e in events[:-1]]
        assert [e["choices"][0]["delta"]["content"] for e in chunks] == ["t0 ", "t1 "]
        err = json.loads(events[-1])["error"]
        assert err["code"] == "upstream_stalled" and err["type"] == "upstream_error"
        # Settled at what was streamed: the worker's prompt count + the 2 tokens that went out.
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == 2
        assert limiter.settled == [usage["prompt_tokens"] + 2]
        assert _wait_for(lambda: stub.stats()["cancelled"] >= 1), "the stalled worker never saw the hang-up"
        # The tenant's only slot is free again: the next request is admitted and served.
        r = c.post("/v1/chat/completions", json=_body(), headers=h)
        assert r.status_code == 200, r.text
        assert _wait_for(lambda: app.state.gateway.router.workers()[0].inflight == 0)


def test_hung_worker_is_routed_around_before_the_first_byte_and_ejected():
    """The preferred worker hangs (SIGSTOP): a stream sent to it, before or after the hang, is
    answered by the other worker once the first-byte deadline passes (not the request deadline);
    three misses in a row eject it, and the next request goes to the other worker straight away."""
    import threading

    with StubProcess("a") as a, StubProcess("b") as b:
        s = Settings(worker_urls=(a.url, b.url), worker_first_byte_timeout_s=0.5, worker_first_byte_per_queued_s=0,
                     request_timeout_s=8, worker_eject_failures=3, worker_eject_base_s=30)
        app = create_app(s, snapshots=MutableSnapshots(make_snapshot(TENANTS)), limiter=LocalLimiter(),
                         residency=MemoryResidency(), mount_admin=False)
        gateway = app.state.gateway
        hung_url = gateway.router.choose("smol", "sup-v1")[0].url  # where sup@1's requests go first
        hung, other = (a, b) if hung_url == a.url else (b, a)
        h = {"authorization": f"Bearer {mint(s, 'u', tenant='acme')}"}

        def ask(c: httpx.Client, **meta: str) -> tuple[httpx.Response, float]:
            t0 = time.monotonic()
            r = c.post("/v1/chat/completions", json=_body(stream=True, metadata=meta), headers=h)
            return r, time.monotonic() - t0

        with ThreadServer(app) as gw, httpx.Client(base_url=gw.url, timeout=30) as c:
            r, _ = ask(c)
            assert r.headers["x-loraplex-worker"] == hung.url  # it is the preferred one
            in_flight: list[tuple[httpx.Response, float]] = []
            t = threading.Thread(target=lambda: in_flight.append(ask(c, stub_delay="0.4")))
            t.start()
            assert _wait_for(lambda: hung.stats()["inflight"] == 1)
            hung.pause()  # it holds the request it was sent, and takes new connections without answering
            try:
                t.join(15)
                for r, took in [in_flight[0], ask(c), ask(c)]:
                    assert r.status_code == 200, r.text
                    assert r.headers["x-loraplex-worker"] == other.url
                    assert _events(r.text)[-1] == "[DONE]"
                    assert took < 6  # the first-byte deadline moved it on, not the 8 s request deadline
                m = gateway.metrics.render().decode()
                assert f'loraplex_gateway_worker_ejected{{worker="{hung.url}"}} 1.0' in m
                assert f'loraplex_gateway_worker_ejected{{worker="{other.url}"}} 0.0' in m
                assert (f'loraplex_gateway_worker_ejections_total{{reason="first_byte_timeout",'
                        f'worker="{hung.url}"}} 1.0') in m
                failures = f'loraplex_gateway_upstream_failures_total{{worker="{hung.url}"}} 3.0'
                assert failures in m
                r, _ = ask(c)  # ejected: not tried at all
                assert r.status_code == 200 and r.headers["x-loraplex-worker"] == other.url
                assert failures in gateway.metrics.render().decode()
            finally:
                hung.resume()


def test_first_byte_deadline_grows_with_what_the_worker_has_queued():
    from gateway.proxy import Upstream
    from gateway.router import Router, Worker
    from gateway.worker_client import WorkerClient

    up = Upstream(WorkerClient("secret"), Router(None), first_byte_s=10, per_queued_s=0.5)
    w = Worker(id="w", url="http://w", base_model="smol", device=frozenset(), host=frozenset(), reported_load=0,
               report_ts=0.0)
    assert up.first_byte_deadline(w) == 10
    w.queued = 4  # as its last report said
    assert up.first_byte_deadline(w) == 12
    w.max_seqs, w.inflight = 2, 10  # this replica alone sent it 8 more than it runs at once
    assert up.first_byte_deadline(w) == 14
