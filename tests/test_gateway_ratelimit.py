"""Per-tenant limits in real Redis (and the in-process limiter): reservation under bursts,
settlement, concurrency leases, headers, Redis outage and recovery, limits from the snapshot,
and the Redis limiter's pipeline: one round trip per event-loop step, joined script calls,
script reloading, timeouts and cancelled callers."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.app import create_app
from gateway.app import redis_client as gateway_redis
from gateway.ratelimit import MAX_BATCH, Limits, LocalLimiter, RedisLimiter, _StepPipeline
from loraplex.residency import MemoryResidency
from loraplex.settings import Settings
from loraplex.tokens import mint
from tests.stub_worker import MutableSnapshots, free_port, make_snapshot, mock_worker_transport
from tests.worker_double import worker_client


def refill(t0: float, per_min: int) -> int:
    """The most tokens a bucket of ``per_min`` a minute refilled since ``t0`` (``time.monotonic``):
    bounds that hold however slowly this machine ran the calls between."""
    return math.ceil((time.monotonic() - t0) * per_min / 60)


@pytest.fixture
async def redis_client(redis_url):
    r = aioredis.from_url(redis_url)
    yield r
    await r.aclose()


TTL = 1.0
"""The limiters' lease TTL here (renewed every third of it)."""


@pytest.fixture(params=["redis", "local"])
async def limiter(request, redis_url, redis_prefix):
    if request.param == "local":
        yield LocalLimiter(lease_ttl_s=TTL)
        return
    r = aioredis.from_url(redis_url)
    lim = RedisLimiter(r, redis_prefix, lease_ttl_s=TTL)
    yield lim
    await lim.close()
    await r.aclose()


async def test_concurrent_burst_never_overshoots_tokens(limiter):
    limits = Limits(tokens_per_min=10_000)
    results = await asyncio.gather(*[limiter.acquire("acme", limits, 700, 30) for _ in range(60)])
    admitted = [d for d in results if d.allowed]
    # 10_000 / 700 = 14 (refill during the burst is far below one more reservation)
    assert len(admitted) == 14
    assert sum(d.lease.reserved for d in admitted) <= limits.tokens_per_min
    denied = [d for d in results if not d.allowed]
    assert all(d.status == 429 and d.reason == "tokens" for d in denied)
    d = denied[0]
    assert int(d.headers["retry-after"]) >= 1
    assert d.headers["x-ratelimit-limit-tokens"] == "10000"
    assert int(d.headers["x-ratelimit-remaining-tokens"]) < 700
    assert d.headers["x-ratelimit-reset-tokens"]


async def test_settle_refunds_unused_reservation(limiter):
    limits = Limits(tokens_per_min=10_000)
    t0 = time.monotonic()
    d = await limiter.acquire("acme", limits, 5_000, 30)
    assert d.allowed and int(d.headers["x-ratelimit-remaining-tokens"]) <= 5_000
    await limiter.settle(d.lease, 100)
    d2 = await limiter.acquire("acme", limits, 1, 30)
    assert int(d2.headers["x-ratelimit-remaining-tokens"]) >= 9_800
    # Overshoot is charged: usage above the reservation lowers the bucket further.
    d3 = await limiter.acquire("acme", limits, 10, 30)
    await limiter.settle(d3.lease, 5_000)
    d4 = await limiter.acquire("acme", limits, 1, 30)
    assert int(d4.headers["x-ratelimit-remaining-tokens"]) < 5_000 + refill(t0, 10_000)


async def test_requests_per_minute_and_too_large(limiter):
    limits = Limits(requests_per_min=5, tokens_per_min=1000)
    ok = [await limiter.acquire("acme", limits, 1, 30) for _ in range(5)]
    assert all(d.allowed for d in ok)
    d = await limiter.acquire("acme", limits, 1, 30)
    assert not d.allowed and d.reason == "requests"
    assert d.headers["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= int(d.headers["retry-after"]) <= 13
    big = await limiter.acquire("other", limits, 5000, 30)
    assert not big.allowed and big.reason == "too_large"


async def test_concurrency_slots_free_on_settle_and_after_the_longest_hold(limiter):
    limits = Limits(max_concurrent=2)
    a = await limiter.acquire("acme", limits, 1, 30)
    b = await limiter.acquire("acme", limits, 1, 0.5)  # a request that never settles
    c = await limiter.acquire("acme", limits, 1, 30)
    assert a.allowed and b.allowed and not c.allowed and c.reason == "concurrency"
    assert c.headers["retry-after"] == "1" and int(c.headers["retry-after-ms"]) <= TTL * 1000
    await limiter.settle(a.lease, 1)
    assert (await limiter.acquire("acme", limits, 1, 30)).allowed
    assert not (await limiter.acquire("acme", limits, 1, 30)).allowed
    # b is renewed no longer than its hold (0.5 s), then lapses within the TTL.
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while not (await limiter.acquire("acme", limits, 1, 30)).allowed:
        assert loop.time() - t0 < 0.5 + TTL + 5.0, "the unsettled lease never lapsed"
        await asyncio.sleep(0.05)


async def test_concurrent_acquires_and_settles_count_like_sequential_ones(limiter):
    # Calls made together share one script call in Redis: each still sees the ones before it.
    limits = Limits(requests_per_min=10, tokens_per_min=1000, max_concurrent=4)
    t0 = time.monotonic()
    got = await asyncio.gather(*[limiter.acquire("acme", limits, 100, 30) for _ in range(6)])
    assert [d.allowed for d in got] == [True] * 4 + [False] * 2
    assert [d.reason for d in got[4:]] == ["concurrency"] * 2
    assert [int(d.headers["x-ratelimit-remaining-tokens"]) for d in got[:4]] == [900, 800, 700, 600]
    await asyncio.gather(*[limiter.settle(d.lease, 10) for d in got[:4]])  # slots freed, 4 x 90 tokens back
    again = await asyncio.gather(*[limiter.acquire("acme", limits, 100, 30) for _ in range(4)])
    assert all(d.allowed for d in again)
    assert 860 <= int(again[0].headers["x-ratelimit-remaining-tokens"]) <= 860 + refill(t0, 1000)


async def test_unlimited_when_zero(limiter):
    for _ in range(50):
        assert (await limiter.acquire("acme", Limits(), 10**6, 30)).allowed


class TcpProxy:
    """A loopback TCP forwarder to Redis that can be switched off and on (an outage seam)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.server: asyncio.base_events.Server | None = None
        self.conns: set[asyncio.StreamWriter] = set()

    async def _pipe(self, reader, writer) -> None:
        with contextlib.suppress(Exception):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _handle(self, reader, writer) -> None:
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self.conns.update((writer, uw))
        await asyncio.gather(self._pipe(reader, uw), self._pipe(ur, writer))

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for w in self.conns:
            w.close()
        self.conns.clear()
        await self.server.wait_closed()


async def test_redis_outage_falls_back_to_local_and_recovers(redis_url, redis_prefix, redis_client):
    proxy = TcpProxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]))
    await proxy.start()
    r = aioredis.from_url(f"redis://127.0.0.1:{proxy.port}/0", socket_timeout=0.5, socket_connect_timeout=0.5)
    lim = RedisLimiter(r, redis_prefix, fail_mode="open", retry_s=0.3)
    limits = Limits(requests_per_min=100, tokens_per_min=10_000)
    try:
        d = await lim.acquire("acme", limits, 100, 30)
        assert d.allowed and not lim.degraded
        await lim.settle(d.lease, 100)
        assert await redis_client.exists(f"{redis_prefix}:rl:acme")
        await proxy.stop()
        d = await lim.acquire("acme", limits, 100, 30)
        assert d.allowed and lim.degraded and d.lease.backend is lim.fallback
        # the local limiter still enforces the limits per replica
        burst = [await lim.acquire("acme", Limits(tokens_per_min=1000), 300, 30) for _ in range(5)]
        assert sum(x.allowed for x in burst) == 3
        await proxy.start()
        await asyncio.sleep(0.4)
        d2 = await lim.acquire("acme", limits, 100, 30)
        assert d2.allowed and not lim.degraded and d2.lease.backend is lim
        await lim.settle(d.lease, 50)  # a lease taken during the outage settles locally
        await lim.settle(d2.lease, 50)
    finally:
        await lim.close()
        await r.aclose()
        with contextlib.suppress(Exception):
            await proxy.stop()


async def test_redis_outage_fail_closed_refuses_with_503(redis_prefix):
    r = aioredis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=0.3, socket_connect_timeout=0.3)
    lim = RedisLimiter(r, redis_prefix, fail_mode="closed")
    try:
        d = await lim.acquire("acme", Limits(requests_per_min=10), 1, 30)
        assert not d.allowed and d.status == 503 and "retry-after" in d.headers
    finally:
        await lim.close()
        await r.aclose()


def _gateway(redis_url, redis_prefix, tenants, *, sent=None, delay: float = 0.0):
    s = Settings(worker_urls=("http://worker",), redis_url=redis_url, redis_prefix=redis_prefix)
    snaps = MutableSnapshots(make_snapshot(tenants))
    inner = mock_worker_transport(sent)

    class Slow(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request):
            if delay:
                await asyncio.sleep(delay)
            return await inner.handle_async_request(request)

    app = create_app(s, snapshots=snaps, residency=MemoryResidency(), http_client=worker_client(Slow()),
                     mount_admin=False)
    return s, snaps, app


async def test_burst_through_gateway_admits_within_token_budget(redis_url, redis_prefix, redis_client):
    tenants = {"acme": {"tokens_per_min": 3000, "bindings": {"support": {"active": ("sup", 1)}}}}
    s, _, app = _gateway(redis_url, redis_prefix, tenants, delay=0.05)
    h = {"authorization": f"Bearer {mint(s, 'u', tenant='acme')}"}
    body = {"model": "support", "messages": [{"role": "user", "content": "x" * 100}], "max_tokens": 200}
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        rs = await asyncio.gather(*[c.post("/v1/chat/completions", json=body, headers=h) for _ in range(40)])
        ok = [r for r in rs if r.status_code == 200]
        limited = [r for r in rs if r.status_code == 429]
        assert len(ok) + len(limited) == 40
        reserve = 100 + 64 + 8 + 200  # prompt bytes + template overheads + max_tokens
        assert len(ok) * reserve <= 3000
        assert len(ok) == 3000 // reserve
        r = limited[0]
        assert r.json()["error"]["type"] == "rate_limit_error"
        for k in ("retry-after", "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens",
                  "x-ratelimit-reset-tokens"):
            assert k in r.headers
        # Settled to actual usage (10 tokens each in the mock): the budget is mostly back. The
        # settlements are not waited for, but go to Redis before the next request's reservation.
        r = await c.post("/v1/chat/completions", json=body, headers=h)
        assert r.status_code == 200
        assert int(r.headers["x-ratelimit-remaining-tokens"]) >= 3000 - 10 * len(ok) - reserve - 1
        await asyncio.sleep(0.05)  # and within a few milliseconds anyway
        left = float(await redis_client.hget(f"{redis_prefix}:rl:acme", "tk"))
        assert left >= 3000 - 10 * (len(ok) + 1) - 1


async def test_streaming_reservation_settles_to_actual_usage(redis_url, redis_prefix, redis_client):
    tenants = {"acme": {"tokens_per_min": 100_000, "bindings": {"support": {"active": ("sup", 1)}}}}
    s, _, app = _gateway(redis_url, redis_prefix, tenants)
    h = {"authorization": f"Bearer {mint(s, 'u', tenant='acme')}"}
    body = {"model": "support", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000,
            "stream": True}
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        r = await c.post("/v1/chat/completions", json=body, headers=h)
        assert r.status_code == 200 and "[DONE]" in r.text
        assert '"usage"' not in r.text  # the client did not ask for it
        r = await c.post("/v1/chat/completions", json=body | {"stream_options": {"include_usage": True}}, headers=h)
        assert '"usage"' in r.text
        # 10 = usage reported by the worker, not the 5000+ reserved (settled before this reservation)
        assert int(r.headers["x-ratelimit-remaining-tokens"]) >= 100_000 - 10 - 5074 - 1
        await asyncio.sleep(0.05)
        left = float(await redis_client.hget(f"{redis_prefix}:rl:acme", "tk"))
        assert left >= 100_000 - 2 * 10 - 1


async def test_new_limits_from_snapshot_apply_immediately(redis_url, redis_prefix):
    tenants = {"acme": {"requests_per_min": 1000, "bindings": {"support": {"active": ("sup", 1)}}}}
    s, snaps, app = _gateway(redis_url, redis_prefix, tenants)
    h = {"authorization": f"Bearer {mint(s, 'u', tenant='acme')}"}
    body = {"model": "support", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        for _ in range(3):
            assert (await c.post("/v1/chat/completions", json=body, headers=h)).status_code == 200
        snaps.current = make_snapshot({"acme": {"requests_per_min": 2, "bindings": tenants["acme"]["bindings"]}},
                                      version=2)
        rs = [await c.post("/v1/chat/completions", json=body, headers=h) for _ in range(4)]
        # The bucket is clamped to the new capacity at once: two more, then refused.
        assert [r.status_code for r in rs] == [200, 200, 429, 429]
        assert rs[0].headers["x-ratelimit-limit-requests"] == "2"
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app.metrics_app), base_url="http://m") as m:
            metrics = (await m.get("/metrics")).text
        assert 'loraplex_gateway_rate_limited_total{reason="requests",tenant="acme"}' in metrics


@pytest.mark.parametrize("mode", ["open", "closed"])
async def test_gateway_survives_redis_outage_and_recovers(redis_url, redis_prefix, redis_client, mode):
    proxy = TcpProxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]))
    await proxy.start()
    s = Settings(worker_urls=("http://worker",), redis_url=f"redis://127.0.0.1:{proxy.port}/0",
                 redis_prefix=redis_prefix, ratelimit_fail_mode=mode)
    tenants = {"acme": {"requests_per_min": 10, "bindings": {"support": {"active": ("sup", 1)}}}}
    app = create_app(s, snapshots=MutableSnapshots(make_snapshot(tenants)), residency=MemoryResidency(),
                     http_client=worker_client(mock_worker_transport()), mount_admin=False)
    h = {"authorization": f"Bearer {mint(s, 'u', tenant='acme')}"}
    body = {"model": "support", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    key = f"{redis_prefix}:rl:acme"
    try:
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            assert (await c.post("/v1/chat/completions", json=body, headers=h)).status_code == 200
            before = float(await redis_client.hget(key, "rq"))
            await proxy.stop()
            r = await c.post("/v1/chat/completions", json=body, headers=h)
            if mode == "open":
                assert r.status_code == 200  # the per-replica limiter took over
            else:
                assert r.status_code == 503 and r.json()["error"]["code"] == "ratelimiter_unavailable"
                assert "retry-after" in r.headers
            await proxy.start()
            await asyncio.sleep(1.1)  # the limiter retries Redis after its back-off
            assert (await c.post("/v1/chat/completions", json=body, headers=h)).status_code == 200
            after = float(await redis_client.hget(key, "rq"))
            assert after < before - 0.5  # counted in Redis again (refill is 1/6 per second)
    finally:
        with contextlib.suppress(Exception):
            await proxy.stop()


async def test_scripts_are_reloaded_after_a_flush(redis_client, redis_url, redis_prefix):
    r = aioredis.from_url(redis_url)
    lim = RedisLimiter(r, redis_prefix)
    limits = Limits(tokens_per_min=1000, max_concurrent=1)
    try:
        d = await lim.acquire("acme", limits, 100, 30)
        await redis_client.script_flush()  # as after a Redis restart
        await lim.settle(d.lease, 10)
        await redis_client.script_flush()
        d2 = await lim.acquire("acme", limits, 100, 30)
        assert d2.allowed and not lim.degraded  # the slot was freed and the refund applied
        assert int(d2.headers["x-ratelimit-remaining-tokens"]) >= 1000 - 10 - 100 - 1
    finally:
        await lim.close()
        await r.aclose()


async def test_settlements_not_waited_for_are_applied_and_survive_a_script_flush(redis_client, redis_url,
                                                                                 redis_prefix):
    r = aioredis.from_url(redis_url)
    lim = RedisLimiter(r, redis_prefix)
    limits = Limits(tokens_per_min=1000, max_concurrent=2)
    t0 = time.monotonic()
    try:
        a, b = await asyncio.gather(lim.acquire("acme", limits, 100, 30), lim.acquire("acme", limits, 100, 30))
        await redis_client.script_flush()  # as after a Redis restart: the batch is sent again
        lim.settle_nowait(a.lease, 10)
        lim.settle_nowait(b.lease, 10)
        lim.settle_nowait(b.lease, 10)  # settled once only
        d = await lim.acquire("acme", limits, 100, 30)  # after the settlements, in order
        assert d.allowed and not lim.degraded
        want = 1000 - 2 * 10 - 100  # b's second settlement would have given 90 more
        assert want <= int(d.headers["x-ratelimit-remaining-tokens"]) <= want + refill(t0, 1000)
        assert await redis_client.zcard(f"{redis_prefix}:rl:acme:c") == 1
    finally:
        await lim.close()
        await r.aclose()


async def test_settlements_not_waited_for_turn_to_the_fallback_when_redis_fails(redis_url, redis_prefix):
    proxy = TcpProxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]))
    await proxy.start()
    r = aioredis.from_url(f"redis://127.0.0.1:{proxy.port}/0", socket_timeout=0.3, socket_connect_timeout=0.3)
    lim = RedisLimiter(r, redis_prefix)
    try:
        d = await lim.acquire("acme", Limits(tokens_per_min=1000), 100, 30)
        await proxy.stop()
        lim.settle_nowait(d.lease, 10)
        for _ in range(100):
            if lim.degraded:
                break
            await asyncio.sleep(0.02)
        assert lim.degraded
    finally:
        await lim.close()
        await r.aclose()
        with contextlib.suppress(Exception):
            await proxy.stop()


class RoundTrips:
    """Counts the round trips a limiter's pipeline makes to Redis and how many were in flight
    at once at most."""

    def __init__(self, pipe) -> None:
        self.count = 0
        self.in_flight = 0
        self.most_in_flight = 0
        execute = pipe._execute_commands

        async def counted(commands):
            self.count += 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                return await execute(commands)
            finally:
                self.in_flight -= 1

        pipe._execute_commands = counted


async def test_gateway_client_parses_with_hiredis(redis_url):
    from redis.asyncio.connection import _AsyncHiredisParser

    r = gateway_redis(Settings(redis_url=redis_url))
    try:
        assert await r.ping()
        conn = await r.connection_pool.get_connection()
        assert isinstance(conn._parser, _AsyncHiredisParser)
        await r.connection_pool.release(conn)
    finally:
        await r.aclose()


async def test_calls_of_one_step_share_one_round_trip_and_settlements_go_first(redis_url, redis_prefix):
    r = aioredis.from_url(redis_url, socket_timeout=0.5)
    lim = RedisLimiter(r, redis_prefix)
    counting = RoundTrips(lim._pipe)
    limits = Limits(tokens_per_min=1000, max_concurrent=3)
    t0 = time.monotonic()

    def remaining(d, want: int) -> None:
        """``want``, give or take the tokens the bucket refilled (1000 a minute) since ``t0``."""
        got = int(d.headers["x-ratelimit-remaining-tokens"])
        assert want <= got <= want + refill(t0, 1000), (got, want)

    try:
        got = await asyncio.gather(*[lim.acquire(t, limits, 100, 30) for t in ("a", "a", "a", "b")])
        assert all(d.allowed for d in got) and counting.count == 1
        # Settlements wait for company: they ride along with the next acquire, ahead of it.
        for d in got[:3]:
            lim.settle_nowait(d.lease, 10)
        await asyncio.sleep(0)
        assert counting.count == 1
        d = await lim.acquire("a", limits, 100, 30)
        assert counting.count == 2
        assert d.allowed
        remaining(d, 1000 - 3 * 10 - 100)
        # Calls made while a pipeline is in flight go in the next one, in order.
        first = asyncio.ensure_future(lim.acquire("a", limits, 100, 30))
        await asyncio.sleep(0)  # first joins the queue
        await asyncio.sleep(0)  # and the sender takes it
        assert not lim._pipe._queue and lim._pipe._sender is not None
        lim.settle_nowait(d.lease, 10)
        second = asyncio.ensure_future(lim.acquire("a", limits, 100, 30))
        a, b = await first, await second
        assert counting.count == 4
        remaining(a, 1000 - 3 * 10 - 2 * 100)
        remaining(b, 1000 - 4 * 10 - 2 * 100)  # d's refund first
        # A settlement nobody waits for goes out by itself within ``settle_delay_s``.
        lim.settle_nowait(a.lease, 0)
        await asyncio.sleep(lim.settle_delay_s)
        for _ in range(500):  # it went out on time; a busy machine may run the loop late
            if counting.count >= 5:
                break
            await asyncio.sleep(0.01)
        assert counting.count == 5
        assert await r.zcard(f"{redis_prefix}:rl:a:c") == 1
        # A burst over many loop steps: never two pipelines at once (Redis runs them in order).
        leases = []

        async def request(n):
            for _ in range(n):
                await asyncio.sleep(0)
            d = await lim.acquire("b", Limits(), 1, 30)
            lim.settle_nowait(d.lease, 1)
            leases.append(d.lease)

        await asyncio.gather(*[request(n % 7) for n in range(50)])
        assert len(leases) == 50 and counting.most_in_flight == 1 and 5 < counting.count < 50
    finally:
        await lim.close()
        await r.aclose()


async def test_round_trips_skip_the_socket_timeout_and_keep_the_clients_database(redis_url, redis_prefix,
                                                                                 monkeypatch):
    # With a socket timeout redis-py wraps every send in ``asyncio.wait_for``: the pipeline's
    # own connection has none (its round trips have their own deadline) and the pool's other
    # settings, here the database.
    r = aioredis.from_url(redis_url.rsplit("/", 1)[0] + "/3", socket_timeout=0.5)
    lim = RedisLimiter(r, redis_prefix)
    waits = []
    wait_for = asyncio.wait_for

    def counted(aw, timeout):
        waits.append(timeout)
        return wait_for(aw, timeout)

    try:
        await lim.start()  # the keepalive (on the client's pool) probes at once, then every 3.3 s
        for _ in range(500):  # until its first round trip is back
            if lim._pipe.clock_offset_ms is not None:
                break
            await asyncio.sleep(0.01)
        monkeypatch.setattr(asyncio, "wait_for", counted)
        for _ in range(3):
            d = await lim.acquire("acme", Limits(requests_per_min=100), 1, 30)
            assert d.allowed and d.lease.backend is lim
            await lim.settle(d.lease, 1)
        monkeypatch.undo()
        assert not waits and lim._pipe._conn.socket_timeout is None
        assert await r.exists(f"{redis_prefix}:rl:acme")
        db0 = aioredis.from_url(redis_url)
        assert not await db0.exists(f"{redis_prefix}:rl:acme")
        await db0.aclose()
    finally:
        monkeypatch.undo()
        await r.delete(f"{redis_prefix}:rl:acme", f"{redis_prefix}:rl:acme:c")
        await lim.close()
        await r.aclose()


async def test_joined_calls_are_reloaded_once_split_when_full_and_survive_cancelled_callers(redis_url,
                                                                                            redis_client):
    r = aioredis.from_url(redis_url)
    # Answers with its arguments and how many times it ran (a counter in Redis).
    script = r.register_script(f"-- {uuid.uuid4().hex}\nlocal n = redis.call('INCR', KEYS[1])\n"
                               "return {n, unpack(ARGV)}")
    key = f"batch-{uuid.uuid4().hex}"
    failures = []
    p = _StepPipeline(r, [script], timeout_s=1.0, on_failure=failures.append)

    async def call(const, part):
        i, fut = p.join(script, [key], const, part)
        return await fut, i

    try:
        await redis_client.script_flush()  # the joined call gets NOSCRIPT: scripts reloaded, sent once more
        out = await asyncio.gather(*[call(["c"], f"a{i} b{i}") for i in range(5)], call(["d"], "x y"))
        joined = [res for res, _ in out[:5]]
        assert all(res == joined[0] for res in joined)
        assert joined[0][1:] == [b"c", b"a0 b0 a1 b1 a2 b2 a3 b3 a4 b4"]
        assert [i for _, i in out] == [0, 1, 2, 3, 4, 0]
        assert out[5][0][1:] == [b"d", b"x y"]  # other leading arguments: a call of its own
        assert int(await redis_client.get(key)) == 2 and not failures
        full = await asyncio.gather(*[call(["c"], str(i)) for i in range(MAX_BATCH + 1)])
        assert full[-1][1] == 0 and full[-2][1] == MAX_BATCH - 1  # a full call makes room for another
        assert int(await redis_client.get(key)) == 4
        # A caller that gives up (a request cancelled while it waits) leaves the others be.
        first = asyncio.ensure_future(call(["c"], "gone"))
        second = asyncio.ensure_future(call(["c"], "stays"))
        await asyncio.sleep(0)
        first.cancel()
        res, i = await second
        assert i == 1 and res[1:] == [b"c", b"gone stays"] and first.cancelled()
    finally:
        await redis_client.delete(key)
        await p.close()
        await r.aclose()


async def test_cancelled_acquire_never_fails_the_others(redis_url, redis_prefix):
    r = aioredis.from_url(redis_url)
    lim = RedisLimiter(r, redis_prefix)
    limits = Limits(requests_per_min=100, max_concurrent=10)
    try:
        tasks = [asyncio.ensure_future(lim.acquire("acme", limits, 1, 30)) for _ in range(4)]
        await asyncio.sleep(0)  # all four joined; the pipeline is on its way
        tasks[1].cancel()
        await asyncio.sleep(0)
        tasks[2].cancel()  # cancelled while the pipeline is in flight
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert done[0].allowed and done[3].allowed and not lim.degraded
        assert all(isinstance(x, asyncio.CancelledError) for x in done[1:3])
        assert (await lim.acquire("acme", limits, 1, 30)).allowed  # the connection is fine
    finally:
        await lim.close()
        await r.aclose()


async def test_silent_redis_times_out_to_the_fallback(redis_prefix):
    async def silent(reader, writer):
        await asyncio.sleep(5)

    port = free_port()
    server = await asyncio.start_server(silent, "127.0.0.1", port)
    r = aioredis.from_url(f"redis://127.0.0.1:{port}/0")  # no socket timeout: the limiter's own applies
    lim = RedisLimiter(r, redis_prefix, timeout_s=0.3)
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        got = await asyncio.gather(*[lim.acquire("acme", Limits(requests_per_min=10), 1, 30) for _ in range(3)])
        assert loop.time() - t0 < 2.0
        assert all(d.allowed and d.lease.backend is lim.fallback for d in got) and lim.degraded
    finally:
        await lim.close()
        await r.aclose()
        server.close()


async def test_a_round_trip_that_hangs_after_prompt_ones_still_times_out(redis_url, redis_prefix):
    """The round trips' deadline is one timer moved on while they end in time: a round trip
    that hangs later, while that timer is still set for an earlier one, times out all the same."""
    target = redis_url.rsplit("/", 1)[0].removeprefix("redis://")
    host, _, rport = target.partition(":")
    silent = asyncio.Event()

    async def relay(reader, writer):
        up_reader, up_writer = await asyncio.open_connection(host, int(rport or 6379))

        async def pipe(src, dst, upstream):
            while data := await src.read(65536):
                if upstream and silent.is_set():
                    continue  # Redis never hears of it: no answer comes
                dst.write(data)
                await dst.drain()

        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False),
                             return_exceptions=True)

    port = free_port()
    server = await asyncio.start_server(relay, "127.0.0.1", port)
    r = aioredis.from_url(f"redis://127.0.0.1:{port}/0")
    lim = RedisLimiter(r, redis_prefix, timeout_s=0.5)
    try:
        loop = asyncio.get_running_loop()
        for _ in range(3):  # prompt round trips, each well within the timeout
            assert (await lim.acquire("acme", Limits(requests_per_min=10), 1, 30)).lease.backend is lim
            await asyncio.sleep(0.1)
        silent.set()
        t0 = loop.time()
        got = await lim.acquire("acme", Limits(requests_per_min=10), 1, 30)
        assert got.allowed and got.lease.backend is lim.fallback and lim.degraded
        assert 0.2 <= loop.time() - t0 < 2.0
    finally:
        await lim.close()
        await r.aclose()
        server.close()
