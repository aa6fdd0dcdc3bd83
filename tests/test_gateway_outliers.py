"""Outlier detection (``gateway.outliers``): failures in a row eject a worker for a backoff that
doubles while it keeps failing, a success resets it, the router skips ejected workers unless
every candidate is, and the metrics show it."""

from __future__ import annotations

import time

from gateway.metrics import GatewayMetrics
from gateway.outliers import FIRST_BYTE, STALL, STATUS_5XX, Outliers
from gateway.router import Router
from loraplex.residency import MemoryResidency
from loraplex.wire import WorkerReport


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_consecutive_failures_eject_for_a_backoff_that_doubles_and_a_success_resets_it():
    clock = Clock()
    seen: list[tuple[str, str]] = []
    o = Outliers(failures=3, base_s=5, max_s=30, on_eject=lambda w, why: seen.append((w, why)), clock=clock)
    o.failure("w1", STATUS_5XX)
    o.failure("w1", STATUS_5XX)
    o.success("w1")  # not in a row: the count starts over
    o.failure("w1", STATUS_5XX)
    o.failure("w1", STATUS_5XX)
    assert not o.ejected("w1")
    o.failure("w1", FIRST_BYTE)
    assert o.ejected("w1") and seen == [("w1", FIRST_BYTE)]
    assert o.ejections()["w1"].until == clock.now + 5 and o.ejections()["w1"].reason == FIRST_BYTE
    o.failure("w1", STALL)  # an attempt that began before the ejection: no longer
    assert o.ejections()["w1"].until == clock.now + 5
    lengths = []
    for _ in range(5):  # out of ejection, it fails again at once: ejected twice as long, up to the cap
        clock.now = o.ejections()["w1"].until
        assert not o.ejected("w1")
        o.failure("w1", STALL)
        lengths.append(o.ejections()["w1"].until - clock.now)
    assert lengths == [10, 20, 30, 30, 30]
    assert o.ejections()["w1"].streak == 6
    o.success("w1")  # it answered: all forgiven
    assert not o.ejected("w1") and o.ejections() == {}
    for _ in range(3):
        o.failure("w1", STATUS_5XX)
    assert o.ejections()["w1"].until == clock.now + 5  # the backoff starts over
    assert len(seen) == 7


def _report(wid: str, device=()) -> WorkerReport:  # type: ignore[no-untyped-def]
    return WorkerReport(worker_id=wid, url=f"http://{wid}", base_model="smol", base_revision="r",
                        device_adapters=list(device), timestamp=time.time())


async def test_router_skips_ejected_workers_unless_every_candidate_is():
    res = MemoryResidency()
    for w in ("w1", "w2", "w3"):
        await res.publish(_report(w, device=["a"] if w == "w1" else ()), 60)
    router = Router(res, refresh_s=60.0, outliers=Outliers(failures=1, base_s=60))
    order = [w.id for w in await router.route("smol", "a")]
    assert order[0] == "w1"
    router.outliers.failure("w1", FIRST_BYTE)
    assert [w.id for w in router.choose("smol", "a")] == order[1:]
    router.outliers.failure(order[1], STATUS_5XX)
    assert [w.id for w in router.choose("smol", "a")] == order[2:]
    router.outliers.failure(order[2], STALL)
    # Every one ejected: they are all tried anyway, in the usual order (Envoy's max_ejection_percent).
    assert [w.id for w in router.choose("smol", "a")] == order
    router.outliers.success("w1")
    assert [w.id for w in router.choose("smol", "a")] == ["w1"]


async def test_ejections_are_a_metric():
    res = MemoryResidency()
    for w in ("w1", "w2"):
        await res.publish(_report(w), 60)
    router = Router(res, refresh_s=60.0, outliers=Outliers(failures=2, base_s=60))
    await router.refresh()
    metrics = GatewayMetrics()
    router.outliers.on_eject = metrics.ejected
    metrics.track_ejections(router)
    for _ in range(2):
        router.outliers.failure("w2", STALL)
    m = metrics.render().decode()
    assert 'loraplex_gateway_worker_ejected{worker="w1"} 0.0' in m
    assert 'loraplex_gateway_worker_ejected{worker="w2"} 1.0' in m
    assert 'loraplex_gateway_worker_ejections_total{reason="stall",worker="w2"} 1.0' in m
    router.outliers.success("w2")
    assert 'loraplex_gateway_worker_ejected{worker="w2"} 0.0' in metrics.render().decode()


async def test_every_gateways_ejections_reach_the_console_through_redis(redis_url, redis_prefix):
    """Gateway A ejects a worker; the console served by another process (B) sees it, until it ends
    or the worker answers A again."""
    import asyncio

    import redis.asyncio as aioredis

    from gateway.console_sources import GatewayConsoleSources
    from gateway.live_stats import LiveStats
    from gateway.outliers import SharedEjections

    r = aioredis.from_url(redis_url)
    try:
        a = Outliers(failures=1, base_s=30, shared=SharedEjections(r, redis_prefix))
        b = GatewayConsoleSources(None, LiveStats(), Outliers(shared=SharedEjections(r, redis_prefix)))
        assert await b.ejections() == {}
        a.failure("w1", FIRST_BYTE)
        await asyncio.sleep(0.1)  # written in the background
        seen = await b.ejections()
        assert list(seen) == ["w1"] and seen["w1"].reason == FIRST_BYTE and seen["w1"].streak == 1
        assert abs(seen["w1"].until - a.ejections()["w1"].until) < 0.01
        a.success("w1")
        await asyncio.sleep(0.1)
        assert await b.ejections() == {}
    finally:
        await r.aclose()
