"""Routing with several stub workers as real processes reporting residency into Redis:
preference for warm workers, bounded load, failover, dead workers leaving and coming back."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.app import create_app
from gateway.ratelimit import LocalLimiter
from gateway.router import Router
from loraplex.residency import MemoryResidency, RedisResidency
from loraplex.settings import Settings
from loraplex.tokens import mint
from loraplex.wire import WorkerReport
from tests.stub_worker import MutableSnapshots, StubProcess, make_snapshot, mock_worker_transport
from tests.worker_double import worker_client

TENANTS = {"acme": {"bindings": {"support": {"active": ("sup", 1)}, "sales": {"active": ("sales", 1)}}}}


def _report(wid: str, load: int = 0, device=(), host=(), base: str = "smol", ts: float | None = None):
    return WorkerReport(worker_id=wid, url=f"http://{wid}", base_model=base, base_revision="r",
                        device_adapters=list(device), host_adapters=list(host), running=load,
                        timestamp=ts if ts is not None else time.time())


async def test_router_prefers_device_then_host_then_ring_order():
    res = MemoryResidency()
    for w in ("w1", "w2", "w3"):
        await res.publish(_report(w, device=["a"] if w == "w2" else [], host=["a"] if w == "w3" else []), 5)
    router = Router(res, candidates=3)
    order = [w.id for w in await router.route("smol", "a")]
    assert order[0] == "w2" and order[1] == "w3" and len(order) == 3
    await res.publish(_report("w2"), 5)
    await router.refresh()
    assert (await router.route("smol", "a"))[0].id == "w3"


async def test_router_bounded_load_and_least_loaded_fallback():
    res = MemoryResidency()
    await res.publish(_report("w1", load=50, device=["a"]), 5)
    await res.publish(_report("w2", load=0), 5)
    await res.publish(_report("w3", load=1), 5)
    router = Router(res, candidates=3, load_factor=1.5)
    order = [w.id for w in await router.route("smol", "a")]
    # w1 holds the adapter but is far above 1.5 x mean + 1: it is tried last.
    assert order[-1] == "w1" and set(order[:2]) == {"w2", "w3"}
    # One candidate only, and it is overloaded: the least-loaded live worker serves.
    router1 = Router(res, candidates=1, load_factor=1.5)
    await router1.refresh()
    key = next(f"k{i}" for i in range(1000) if router1._ring_candidates("smol", f"k{i}") == ["w1"])
    await res.publish(_report("w1", load=50, device=[key]), 5)
    await router1.refresh()
    order1 = [w.id for w in await router1.route("smol", key)]
    assert order1[0] == "w2"


async def test_router_filters_base_model_and_consistent_candidates():
    res = MemoryResidency()
    for i in range(6):
        await res.publish(_report(f"w{i}", base="smol" if i < 4 else "other"), 5)
    router = Router(res, candidates=2)
    await router.refresh()
    picks = {tuple(router._ring_candidates("smol", f"adapter-{k}")) for k in range(3)}
    for p in picks:
        assert len(p) == 2 and all(w in {"w0", "w1", "w2", "w3"} for w in p)
    again = Router(res, candidates=2)
    await again.refresh()
    assert again._ring_candidates("smol", "adapter-0") == router._ring_candidates("smol", "adapter-0")
    assert {w.id for w in await router.route("other", None)} == {"w4", "w5"}
    assert await router.route("missing-base", None) == []


async def test_failed_worker_leaves_and_returns_on_next_report():
    res = MemoryResidency()
    await res.publish(_report("w1", device=["a"]), 5)
    await res.publish(_report("w2"), 5)
    router = Router(res, candidates=2, cooldown_s=60)
    w1 = (await router.route("smol", "a"))[0]
    assert w1.id == "w1"
    router.mark_failed(w1)
    assert [w.id for w in await router.route("smol", "a")] == ["w2"]
    await asyncio.sleep(0.01)
    await res.publish(_report("w1", device=["a"]), 5)  # its next report
    await router.refresh()
    assert (await router.route("smol", "a"))[0].id == "w1"


async def test_static_worker_urls_serve_every_base():
    router = Router(None, static_urls=("http://10.0.0.1:8100/",))
    ws = await router.route("anything", "a")
    assert [w.url for w in ws] == ["http://10.0.0.1:8100"]


@pytest.fixture
def stubs(redis_url, redis_prefix):
    procs = [
        StubProcess("w1", redis_url=redis_url, redis_prefix=redis_prefix),
        StubProcess("w2", redis_url=redis_url, redis_prefix=redis_prefix, device=("sup-v1",)),
        StubProcess("w3", redis_url=redis_url, redis_prefix=redis_prefix, host=("sup-v1", "sales-v1")),
    ]
    for p in procs:
        p.start()
    yield {p.worker_id: p for p in procs}
    for p in procs:
        p.stop()


async def _wait_live(redis_url, prefix, n, wait_s=10.0):
    r = aioredis.from_url(redis_url)
    store = RedisResidency(r, prefix)
    try:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if len(await store.live()) >= n:
                return
            await asyncio.sleep(0.1)
        raise AssertionError("stub workers did not report")
    finally:
        await r.aclose()


async def test_routing_and_failover_with_real_workers(stubs, redis_url, redis_prefix):
    await _wait_live(redis_url, redis_prefix, 3)
    s = Settings(redis_url=redis_url, redis_prefix=redis_prefix, worker_report_ttl_s=2.0)
    app = create_app(s, snapshots=MutableSnapshots(make_snapshot(TENANTS)), limiter=LocalLimiter(),
                     mount_admin=False)
    h = {"authorization": f"Bearer {mint(s, 'u', tenant='acme')}"}
    body = {"model": "support", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        seen = [(await c.post("/v1/chat/completions", json=body, headers=h)).headers["x-loraplex-worker"]
                for _ in range(10)]
        assert seen == ["w2"] * 10  # the worker with sup@1 on device
        seen = [(await c.post("/v1/chat/completions", json=body | {"model": "sales"}, headers=h))
                .headers["x-loraplex-worker"] for _ in range(5)]
        assert seen == ["w3"] * 5  # sales@1 is in w3's host memory
        # Kill w2 abruptly: its residency key lives on for a while, yet requests never fail.
        stubs["w2"].kill()
        t0 = time.monotonic()
        for _ in range(10):
            r = await c.post("/v1/chat/completions", json=body, headers=h)
            assert r.status_code == 200, r.text
            assert r.headers["x-loraplex-worker"] in ("w1", "w3")
        assert r.headers["x-loraplex-worker"] == "w3"  # next preference: host memory
        # A worker answering 503 is skipped too (retried before the first byte).
        r = await c.post("/v1/chat/completions", json=body | {"metadata": {"stub_mode": "503"}}, headers=h)
        assert r.status_code == 503  # every candidate answered 503 for this request
        # An adapter that cannot be loaded is not retried elsewhere: the same artifact fails everywhere.
        before = sum(st.stats()["requests"] for name, st in stubs.items() if name != "w2")
        r = await c.post("/v1/chat/completions", json=body | {"metadata": {"stub_mode": "load-fail"}}, headers=h)
        assert r.status_code == 503 and r.json()["error"]["code"] == "adapter_load_failed"
        assert "sha256" not in r.json()["error"]["message"]  # the worker's reason is for the log only
        assert sum(st.stats()["requests"] for name, st in stubs.items() if name != "w2") == before + 1
        # Nor is an adapter whose values went non-finite: it would poison every candidate's batch.
        r = await c.post("/v1/chat/completions", json=body | {"metadata": {"stub_mode": "non-finite"}}, headers=h)
        assert r.status_code == 503 and r.json()["error"]["code"] == "non_finite_output", r.text
        assert sum(st.stats()["requests"] for name, st in stubs.items() if name != "w2") == before + 2
        # The dead worker leaves the live set within the report TTL.
        router = app.state.gateway.router
        while "w2" in {w.id for w in router.workers()} and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.2)
            await router.refresh()
        assert "w2" not in {w.id for w in router.workers()}
        assert stubs["w3"].stats()["adapters"].get("sup-v1", 0) >= 10


async def test_inflight_survives_refresh():
    res = MemoryResidency()
    await res.publish(_report("w1"), 5)
    router = Router(res, refresh_s=0.0)
    w = (await router.route("smol", None))[0]
    router.acquire(w)  # a request in flight holds this object
    await res.publish(_report("w1", device=["a"]), 5)
    await router.refresh()
    again = (await router.route("smol", "a"))[0]
    assert again is w and again.inflight == 1 and "a" in again.device
    router.release(w)
    assert again.load == 0 and router.inflight() == 0


def _app_without_workers(res: MemoryResidency, snapshots: MutableSnapshots | None = None):  # type: ignore[no-untyped-def]
    s = Settings()
    app = create_app(s, snapshots=snapshots or MutableSnapshots(make_snapshot(TENANTS)), limiter=LocalLimiter(),
                     residency=res, http_client=worker_client(mock_worker_transport()),
                     mount_admin=False)
    return s, app


async def test_first_request_after_a_worker_appears_is_served():
    """No stale set: routing that finds no worker reloads the live set before answering 503."""
    res = MemoryResidency()
    s, app = _app_without_workers(res)
    h = {"authorization": f"Bearer {mint(s, 'u', tenant='acme')}"}
    body = {"model": "support", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        r = await c.post("/v1/chat/completions", json=body, headers=h)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker"
        await res.publish(_report("w1"), 5)
        r = await c.post("/v1/chat/completions", json=body, headers=h)  # well within the refresh interval
        assert r.status_code == 200, r.text
        assert r.headers["x-loraplex-worker"] == "w1"


async def test_router_reloads_when_only_failed_workers_are_left():
    res = MemoryResidency()
    await res.publish(_report("w1"), 5)
    router = Router(res, refresh_s=60.0, cooldown_s=60.0)
    w1 = (await router.route("smol", None))[0]
    router.mark_failed(w1)
    await asyncio.sleep(0.01)
    await res.publish(_report("w1"), 5)  # it restarted and reported again
    assert [w.id for w in await router.route("smol", None)] == ["w1"]


async def test_readyz_without_workers_is_ready_and_says_so():
    """Readiness means the gateway can serve its API (admin included); worker health is information."""
    res = MemoryResidency()
    snapshots = MutableSnapshots(make_snapshot(TENANTS, version=7))
    _, app = _app_without_workers(res, snapshots)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        r = await c.get("/readyz")
        assert r.status_code == 200, r.text
        assert r.json()["workers"] == 0 and r.json()["registry_version"] == 7
        assert any("no live worker" in w for w in r.json()["warnings"])
        await res.publish(_report("w1"), 5)
        r = await c.get("/readyz")
        assert r.status_code == 200 and r.json()["workers"] == 1 and "warnings" not in r.json()
        snapshots.current = None  # no registry snapshot: this replica cannot serve
        r = await c.get("/readyz")
        assert r.status_code == 503 and r.json()["problems"] == ["no registry snapshot yet"]


async def test_a_worker_that_stopped_reporting_is_not_chosen_before_any_refresh():
    """Staleness is checked when choosing: a worker whose last report this replica saw is older
    than the report TTL is left out even while the live set is not due for a refresh."""
    res = MemoryResidency()
    await res.publish(_report("w1", device=["a"]), 60)  # stays in the store, never reports again
    await res.publish(_report("w2"), 60)
    router = Router(res, refresh_s=60.0, report_ttl_s=0.3)
    assert [w.id for w in await router.route("smol", "a")] == ["w1", "w2"]
    await asyncio.sleep(0.2)
    await res.publish(_report("w2"), 60)  # w2 reports again, w1 does not
    await router.refresh()
    await asyncio.sleep(0.2)
    assert not router.due()  # no refresh runs: the choice itself leaves w1 out
    assert [w.id for w in router.choose("smol", "a")] == ["w2"]
    await res.publish(_report("w1", device=["a"]), 60)  # it reports again: back in
    await router.refresh()
    assert [w.id for w in router.choose("smol", "a")] == ["w1", "w2"]


async def test_a_quiet_replica_does_not_route_to_a_worker_whose_report_expired():
    """The fault as it was: a worker hangs, its report expires; the next request on a replica
    that has been quiet must not go to it from the last list while the refresh runs behind."""
    res = MemoryResidency()
    await res.publish(_report("w1", device=["a"]), 0.3)  # its last report: it hangs after this
    await res.publish(_report("w2"), 60)
    router = Router(res, refresh_s=0.5, report_ttl_s=0.4)
    assert (await router.route("smol", "a"))[0].id == "w1"
    await asyncio.sleep(0.6)  # quiet: no request, no refresh
    await res.publish(_report("w2"), 60)
    assert [w.id for w in await router.route("smol", "a")] == ["w2"]


class FlakyResidency:
    """A residency store that can be unreachable (``down``) or come back with its reports
    lapsed (``lapsed``)."""

    def __init__(self, res: MemoryResidency) -> None:
        self.res = res
        self.down = False
        self.lapsed = False

    async def publish(self, report: WorkerReport, ttl_s: float) -> None:
        await self.res.publish(report, ttl_s)

    async def remove(self, worker_id: str) -> None:
        await self.res.remove(worker_id)

    async def live(self) -> list[WorkerReport]:
        if self.down:
            raise ConnectionError("store down")
        return [] if self.lapsed else await self.res.live()


async def test_stale_reports_are_routed_on_while_the_store_is_unreachable():
    """Staleness says nothing when the store cannot be read: the last known set is used, as before."""
    res = MemoryResidency()
    store = FlakyResidency(res)
    await res.publish(_report("w1"), 60)
    router = Router(store, refresh_s=0.0, report_ttl_s=0.2)
    assert [w.id for w in await router.route("smol", None)] == ["w1"]
    store.down = True
    await asyncio.sleep(0.3)
    assert [w.id for w in await router.route("smol", None)] == ["w1"]


async def test_a_store_back_from_an_outage_gives_known_workers_one_report_ttl():
    """A hung Redis that resumes holds reports from before the hang (older than the TTL), or none
    when they lapsed in it: the workers could not report either. The known set is routed on for
    one report TTL, then staleness rules again (a worker that still does not report is out)."""
    res = MemoryResidency()
    store = FlakyResidency(res)
    await res.publish(_report("w1"), 60)
    router = Router(store, refresh_s=0.0, report_ttl_s=0.3)
    assert [w.id for w in await router.route("smol", None)] == ["w1"]
    store.down = True
    await asyncio.sleep(0.4)
    assert [w.id for w in await router.route("smol", None)] == ["w1"]
    store.down = False  # back, with the report from before the outage
    await router.refresh()
    assert [w.id for w in router.choose("smol", None)] == ["w1"]
    store.lapsed = True  # ... or with none: it lapsed while the store was away
    await router.refresh()
    assert [w.id for w in router.choose("smol", None)] == ["w1"]
    await asyncio.sleep(0.4)  # one report TTL later, still no new report: never chosen
    await router.refresh()
    assert router.choose("smol", None) == []


async def test_hung_worker_requests_move_on_once_its_report_stops(redis_url, redis_prefix):
    """A whole (not streamed) answer is sent only when done, so its first-byte deadline waits on
    while the worker keeps reporting; a worker that hangs (SIGSTOP) stops reporting, and its
    requests, the one in flight and new ones, go to the other worker within about the report TTL.
    A stream it had started ends with ``upstream_stalled`` then too, long before the stall bound."""
    procs = [StubProcess("w1", redis_url=redis_url, redis_prefix=redis_prefix, device=("sup-v1",), extra=("--chunks", "20")),
             StubProcess("w2", redis_url=redis_url, redis_prefix=redis_prefix)]
    for p in procs:
        p.start()
    hung = procs[0]
    try:
        await _wait_live(redis_url, redis_prefix, 2)
        s = Settings(redis_url=redis_url, redis_prefix=redis_prefix, worker_report_ttl_s=1.0,
                     worker_first_byte_timeout_s=0.3, worker_stall_timeout_s=60, request_timeout_s=10)
        app = create_app(s, snapshots=MutableSnapshots(make_snapshot(TENANTS)), limiter=LocalLimiter(),
                         mount_admin=False)
        h = {"authorization": f"Bearer {mint(s, 'u', tenant='acme')}"}
        body = {"model": "support", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            # Slower than its deadline, yet answered by the worker that has it: it keeps reporting.
            r = await c.post("/v1/chat/completions", json=body | {"metadata": {"stub_delay": "1"}}, headers=h)
            assert r.status_code == 200 and r.headers["x-loraplex-worker"] == "w1"
            t0 = time.monotonic()
            in_flight = asyncio.create_task(c.post("/v1/chat/completions", headers=h,
                                                   json=body | {"metadata": {"stub_delay": "4"}}))
            stream = asyncio.create_task(c.post("/v1/chat/completions", headers=h, json=body | {
                "stream": True, "max_tokens": 20, "metadata": {"stub_chunk_delay": "0.2"}}))
            for _ in range(250):  # until both reached the worker and the stream has begun
                if hung.stats()["inflight"] == 2:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(1.2)  # the stream is under way (chunks 0.2 s apart)
            hung.pause()
            try:
                r = await in_flight
                assert r.status_code == 200 and r.headers["x-loraplex-worker"] == "w2", r.text
                r = await stream
                assert r.status_code == 200 and r.headers["x-loraplex-worker"] == "w1"
                events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
                assert len(events) >= 2 and json.loads(events[-1])["error"]["code"] == "upstream_stalled", r.text
                r = await c.post("/v1/chat/completions", json=body, headers=h)
                assert r.status_code == 200 and r.headers["x-loraplex-worker"] == "w2", r.text
                assert time.monotonic() - t0 < 8  # both well before the 10 s request deadline
            finally:
                hung.resume()
    finally:
        for p in procs:
            p.stop()
