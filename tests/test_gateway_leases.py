"""Concurrency leases that die with their holder, and rate-limit health that tells the truth:
a killed gateway's slots come back within the lease TTL, the keepalive holds a long request's
slot past it, a concurrency 429's ``retry-after`` is the earliest lease's lapse, a hung Redis
that resumes leaves no lease behind, ``loraplex_gateway_redis_up`` is probed on an idle
gateway, and the fail-open fallback admits one replica's share of each limit.

Real Redis (the shared one under a unique prefix, or a private ``redis-server`` the test
pauses, kills and restarts) and, for the killed gateway, a real process killed with SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.app import create_app
from gateway.ratelimit import Limits, LocalLimiter, RedisLimiter, share
from loraplex.residency import MemoryResidency
from loraplex.settings import Settings
from loraplex.wire import WorkerReport
from tests.stub_worker import MutableSnapshots, free_port, make_snapshot, mock_worker_transport
from tests.worker_double import worker_client

ROOT = Path(__file__).resolve().parent.parent


class PrivateRedis:
    """A ``redis-server`` of the test's own on a loopback port: paused (SIGSTOP), resumed,
    killed and started again on the same port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis as redis_sync

        client = redis_sync.Redis(port=self.port, socket_connect_timeout=0.2)
        for _ in range(100):
            with contextlib.suppress(Exception):
                if client.ping():
                    client.close()
                    return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()
        self.proc = None


@pytest.fixture
def private_redis():
    server = PrivateRedis()
    server.start()
    yield server
    server.kill()


# -- a killed gateway --------------------------------------------------------------------------

HOLDER = textwrap.dedent("""
    import asyncio, sys
    import redis.asyncio as aioredis
    from gateway.ratelimit import Limits, RedisLimiter

    async def main(url, prefix, ttl, n):
        lim = RedisLimiter(aioredis.from_url(url), prefix, lease_ttl_s=ttl)
        got = [await lim.acquire("acme", Limits(max_concurrent=n), 1, 300) for _ in range(n)]
        assert all(d.allowed for d in got), got
        print("held", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])))
""")


@pytest.mark.e2e
async def test_a_killed_gateways_slots_come_back_within_the_lease_ttl(redis_url, redis_prefix):
    ttl, slots = 2.0, 3
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, redis_url, redis_prefix, str(ttl), str(slots), cwd=ROOT,
        stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    r = aioredis.from_url(redis_url)
    lim = RedisLimiter(r, redis_prefix, lease_ttl_s=ttl)
    limits = Limits(max_concurrent=slots)
    try:
        assert holder.stdout is not None
        line = await asyncio.wait_for(holder.stdout.readline(), 30)
        assert line.strip() == b"held"
        # The holder's keepalive holds its requests' slots past the TTL...
        await asyncio.sleep(2.5 * ttl)
        d = await lim.acquire("acme", limits, 1, 300)
        assert not d.allowed and d.reason == "concurrency"
        assert 1 <= int(d.headers["retry-after"]) <= math.ceil(ttl)
        # ... and they come back within it once the holder is killed (it settles nothing).
        holder.kill()
        await holder.wait()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        while not (d := await lim.acquire("acme", limits, 1, 300)).allowed:
            assert loop.time() - t0 < ttl + 3.0, "a killed gateway's slots stayed taken"
            await asyncio.sleep(0.05)
        print(f"first slot back {loop.time() - t0:.2f} s after the kill (lease TTL {ttl:g} s)")
        assert await r.zcard(f"{redis_prefix}:rl:acme:c") == 1  # its leases all lapsed: ours alone
    finally:
        if holder.returncode is None:
            holder.kill()
            await holder.wait()
        await lim.close()
        await r.aclose()


async def test_keepalive_holds_a_long_request_past_the_ttl_and_settle_frees_it_at_once(redis_url,
                                                                                       redis_prefix):
    r = aioredis.from_url(redis_url)
    holder = RedisLimiter(r, redis_prefix, lease_ttl_s=0.6)
    other = RedisLimiter(r, redis_prefix, lease_ttl_s=0.6)
    limits = Limits(max_concurrent=1)
    try:
        d = await holder.acquire("acme", limits, 1, 300)
        assert d.allowed and holder.held == 1
        for _ in range(4):  # 2.4 s: four times the TTL
            await asyncio.sleep(0.6)
            assert not (await other.acquire("acme", limits, 1, 300)).allowed
        holder.settle_nowait(d.lease, 1)
        assert holder.held == 0
        assert (await holder.acquire("acme", limits, 1, 300)).allowed  # the settlement went first
    finally:
        await holder.close()
        await other.close()
        await r.aclose()


async def test_concurrency_retry_after_is_the_earliest_lease_lapse(redis_url, redis_prefix):
    r = aioredis.from_url(redis_url)
    holder = RedisLimiter(r, redis_prefix, lease_ttl_s=30.0)  # renewed every 10 s: not during the test
    asker = RedisLimiter(r, redis_prefix, lease_ttl_s=30.0)
    limits = Limits(max_concurrent=2)
    key = f"{redis_prefix}:rl:acme:c"

    async def redis_ms() -> int:
        s, us = await r.time()
        return s * 1000 + us // 1000

    try:
        assert (await holder.acquire("acme", limits, 1, 300)).allowed
        await asyncio.sleep(0.3)
        assert (await holder.acquire("acme", limits, 1, 300)).allowed
        earliest = (await r.zrange(key, 0, 0, withscores=True))[0][1]
        before = await redis_ms()
        d = await asker.acquire("acme", limits, 1, 300)
        after = await redis_ms()
        assert (await r.zrange(key, 0, 0, withscores=True))[0][1] == earliest  # not renewed meanwhile
        assert not d.allowed and d.reason == "concurrency"
        wait_ms = int(d.headers["retry-after-ms"])
        assert earliest - after <= wait_ms <= earliest - before + 1
        assert int(d.headers["retry-after"]) == math.ceil(wait_ms / 1000) > 25
    finally:
        await holder.close()
        await asker.close()
        await r.aclose()


async def test_local_limiter_retry_after_is_when_the_earliest_lease_would_lapse():
    lim = LocalLimiter(lease_ttl_s=9.0)
    limits = Limits(max_concurrent=1)
    assert (await lim.acquire("acme", limits, 1, 300)).allowed
    d = await lim.acquire("acme", limits, 1, 300)
    assert not d.allowed and d.reason == "concurrency"
    # Renewed every 3 s since taken: it would lapse 6 to 9 s from now.
    assert 6 <= int(d.headers["retry-after"]) <= 9
    short = LocalLimiter(lease_ttl_s=9.0)
    assert (await short.acquire("acme", limits, 1, 2.0)).allowed  # held 2 s at most
    d = await short.acquire("acme", limits, 1, 300)
    assert d.headers["retry-after"] == "2"


async def test_a_cancelled_acquire_leaves_no_lease(redis_url, redis_prefix):
    r = aioredis.from_url(redis_url)
    lim = RedisLimiter(r, redis_prefix, lease_ttl_s=30.0)
    limits = Limits(max_concurrent=1)
    try:
        task = asyncio.ensure_future(lim.acquire("acme", limits, 1, 300))
        await asyncio.sleep(0)  # joined
        await asyncio.sleep(0)  # and on its way to Redis
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        d = await lim.acquire("acme", limits, 1, 300)  # its lease was released before this ran
        assert d.allowed and lim.held == 1
    finally:
        await lim.close()
        await r.aclose()


# -- a hung Redis ------------------------------------------------------------------------------


@pytest.mark.e2e
async def test_an_acquire_given_up_on_leaves_no_lease_when_a_hung_redis_resumes(private_redis):
    r = aioredis.from_url(private_redis.url)
    lim = RedisLimiter(r, "hung", timeout_s=0.3, retry_s=0.2, lease_ttl_s=30.0)
    limits = Limits(max_concurrent=5)
    key = "hung:rl:acme:c"
    try:
        d = await lim.acquire("acme", limits, 1, 300)  # Redis answers: its clock is known
        assert d.allowed and d.lease.backend is lim
        await lim.settle(d.lease, 1)
        assert await r.zcard(key) == 0
        private_redis.pause()
        d = await lim.acquire("acme", limits, 1, 300)  # queued in the stopped Redis, given up on
        assert d.allowed and d.lease.backend is lim.fallback and lim.degraded
        await asyncio.sleep(0.5)
        private_redis.resume()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        while lim.degraded:  # the keepalive probes it back, no request needed
            assert loop.time() - t0 < 5.0
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # the closed connection's queued acquire has long run by now
        check = aioredis.from_url(private_redis.url)
        assert await check.zcard(key) == 0, "the acquire the gateway gave up on left a lease"
        await check.aclose()
        await lim.settle(d.lease, 1)
    finally:
        await lim.close()
        await r.aclose()


@pytest.mark.e2e
async def test_the_first_acquire_after_a_redis_restart_goes_to_redis(private_redis):
    """An idle replica's own connection outlives a Redis restart unseen: once the keepalive
    finds Redis back, the next acquire must reach it, not fail on the dead connection and fall
    back (a second of 503s fail-closed, of shares fail-open)."""
    r = aioredis.from_url(private_redis.url, socket_timeout=0.3, socket_connect_timeout=0.3)
    lim = RedisLimiter(r, "restart", timeout_s=0.3, retry_s=0.2, lease_ttl_s=1.5)
    limits = Limits(max_concurrent=5)
    loop = asyncio.get_running_loop()

    async def until(degraded: bool) -> None:
        t0 = loop.time()
        while lim.degraded != degraded:  # the keepalive alone: no request meanwhile
            assert loop.time() - t0 < 5.0, f"degraded never became {degraded}"
            await asyncio.sleep(0.05)

    try:
        d = await lim.acquire("acme", limits, 1, 300)  # the pipeline's own connection is open
        assert d.allowed and d.lease.backend is lim
        await lim.settle(d.lease, 1)
        private_redis.kill()
        await until(True)
        private_redis.start()
        await until(False)
        d = await lim.acquire("acme", limits, 1, 300)
        assert d.allowed and d.lease.backend is lim and not lim.degraded
        await lim.settle(d.lease, 1)
    finally:
        await lim.close()
        await r.aclose()


# -- health ------------------------------------------------------------------------------------


def _gauge(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _redis_up(text: str) -> float | None:
    return _gauge(text, "loraplex_gateway_redis_up")


@pytest.mark.e2e
async def test_redis_up_follows_redis_on_an_idle_gateway(private_redis):
    s = Settings(worker_urls=("http://worker",), redis_url=private_redis.url, redis_prefix="idle",
                 ratelimit_lease_ttl_s=1.5)
    tenants = {"acme": {"requests_per_min": 10, "bindings": {"support": {"active": ("sup", 1)}}}}
    app = create_app(s, snapshots=MutableSnapshots(make_snapshot(tenants)), residency=MemoryResidency(),
                     http_client=worker_client(mock_worker_transport()), mount_admin=False)
    loop = asyncio.get_running_loop()

    async def until(metrics, want: float, bound_s: float) -> float:
        t0 = loop.time()
        while _redis_up((await metrics.get("/metrics")).text) != want:
            assert loop.time() - t0 < bound_s, f"redis_up never became {want:g}"
            await asyncio.sleep(0.1)
        return loop.time() - t0

    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app.metrics_app), base_url="http://m") as m:
        await until(m, 1, 5.0)
        private_redis.kill()  # no request is sent from here on
        await until(m, 0, 5.0)
        private_redis.start()
        back = await until(m, 1, 5.0)
        print(f"redis_up back to 1 {back:.2f} s after Redis restarted (idle gateway)")


# -- fail-open share ---------------------------------------------------------------------------


def test_share_divides_each_set_limit_rounding_up():
    assert share(Limits(10, 1000, 8), 1) == Limits(10, 1000, 8)
    assert share(Limits(10, 1000, 8), 3) == Limits(4, 334, 3)
    assert share(Limits(0, 1, 0), 4) == Limits(0, 1, 0)  # unlimited stays unlimited, a limit stays >= 1


@pytest.mark.e2e
async def test_fail_open_admits_each_gateways_share(private_redis):
    clients = [aioredis.from_url(private_redis.url, socket_timeout=0.3, socket_connect_timeout=0.3)
               for _ in range(2)]
    gateways = [RedisLimiter(c, "share", retry_s=0.2, timeout_s=0.3) for c in clients]
    try:
        for g in gateways:
            await g.start()
        for _ in range(2):  # after a first round each has beaten its heart: the second sees both
            for g in gateways:
                assert await g.keepalive()
        assert [g.gateways for g in gateways] == [2, 2]
        private_redis.kill()
        per_min = Limits(requests_per_min=10)
        admitted = 0
        for g in gateways:
            got = [await g.acquire("acme", per_min, 1, 300) for _ in range(8)]
            assert g.degraded and all(d.allowed == (i < 5) for i, d in enumerate(got)), got
            admitted += sum(d.allowed for d in got)
        assert admitted == 10  # the tenant's limit across the fleet, not 10 per gateway
        # Tokens: a replica's share is 500 of 1000; a 600-token request still fits the tenant's
        # limit and goes when the share's bucket is full, the next waits for the debt to refill.
        tokens = Limits(tokens_per_min=1000)
        big = await gateways[0].acquire("globex", tokens, 600, 300)
        assert big.allowed and big.lease.backend is gateways[0].fallback
        again = await gateways[0].acquire("globex", tokens, 600, 300)
        assert not again.allowed and again.reason == "tokens"
        too_big = await gateways[0].acquire("globex", tokens, 1001, 300)
        assert too_big.reason == "too_large"
    finally:
        for g in gateways:
            await g.close()
        for c in clients:
            await c.aclose()


async def test_workers_gauge_follows_the_reports_on_an_idle_gateway():
    s = Settings(worker_report_ttl_s=1.0)
    residency = MemoryResidency()
    tenants = {"acme": {"bindings": {"support": {"active": ("sup", 1)}}}}
    app = create_app(s, snapshots=MutableSnapshots(make_snapshot(tenants)), residency=residency,
                     http_client=worker_client(mock_worker_transport()), mount_admin=False)
    loop = asyncio.get_running_loop()

    async def until(metrics, want: float, why: str) -> None:
        t0 = loop.time()
        while _gauge((await metrics.get("/metrics")).text, "loraplex_gateway_workers") != want:
            assert loop.time() - t0 < 10.0, why
            await asyncio.sleep(0.1)

    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app.metrics_app), base_url="http://m") as m:
        # No request comes: the gateway finds a worker that starts reporting, and drops it when
        # it stops (its one report lives 2.5 s).
        await residency.publish(WorkerReport(worker_id="w1", url="http://w1", base_model="base",
                                             base_revision="r1"), ttl_s=2.5)
        await until(m, 1, "an idle gateway never saw a worker that reports")
        await until(m, 0, "an idle gateway still counts a worker that stopped reporting")
