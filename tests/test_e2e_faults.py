"""End to end under faults: what clients see when a piece of the production topology fails.

A fleet of real processes on loopback (``tests.e2e_cluster``) on a PostgreSQL cluster and a Redis
of its own (``tests.fault_fleet``): two workers on the demo model, gateways ``g1`` and ``g2``
(rate limiter fail-open, the default) and ``g3`` (fail-closed). Each scenario breaks one piece
under load and counts what the clients saw (ok, clear error, hung, truncated, dropped), bounds
the recovery, and checks that every request was settled with exactly the tokens its client
received (the access log's prompt + completion tokens are what the gateway settles its
reservation with). Tests run in file order and share the fleet; each restores what it broke,
but the gateway kill leaves ``g2`` dead and the worker kill, last, its worker.

The settings are the smallest that keep the scenarios meaningful: ``FLEET_ENV``.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest

from loraplex.tokens import mint_admin
from tests.e2e_cluster import Cluster, Proc
from tests.engine_fixtures import demo_model_file
from tests.fault_fleet import (
    DROPPED,
    ERROR,
    HUNG,
    OK,
    TRUNCATED,
    Load,
    Outcome,
    PrivatePostgres,
    PrivateRedis,
    chat_body,
    gauge,
    metrics_url,
    request,
    unsettled,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REQUEST_TIMEOUT_S = 40.0
"""Far above every bound asserted here: a request that reaches it has hung."""
LEASE_TTL_S = 4.0
FIRST_BYTE_S = 3.0
STALL_S = 4.0
EJECT_MAX_S = 4.0
FLEET_ENV = {
    "LORAPLEX_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S),
    "LORAPLEX_RATELIMIT_LEASE_TTL_S": str(LEASE_TTL_S),
    "LORAPLEX_WORKER_FIRST_BYTE_TIMEOUT_S": str(FIRST_BYTE_S),
    "LORAPLEX_WORKER_FIRST_BYTE_PER_QUEUED_S": "0.25",
    "LORAPLEX_WORKER_STALL_TIMEOUT_S": str(STALL_S),
    "LORAPLEX_WORKER_EJECT_BASE_S": "1",
    "LORAPLEX_WORKER_EJECT_MAX_S": str(EJECT_MAX_S),
}
CLIENT_TIMEOUT_S = REQUEST_TIMEOUT_S + 10
GATEWAY_SLOTS_BOUND_S = 25.0
"""A killed gateway's slots are back within this (the goal is 15 s)."""
WORKER_BOUND_S = FIRST_BYTE_S + STALL_S + 13.0
"""A request that met a stopped worker is answered (or its stream ended) within this: the
first-byte and stall bounds, and the survivor generating the answer again under the whole
load; half of ``REQUEST_TIMEOUT_S``."""
GAUGE_BOUND_S = 10.0
"""An idle gateway's ``redis_up`` follows Redis within this."""
STREAM_TOKENS = 96
"""Streams begun before the fault: still running when it comes."""
LATE_STREAM_TOKENS = 24
PLAIN_TOKENS = 16
MAX_CONCURRENT = 3


@dataclass
class Fleet:
    cluster: Cluster
    pg: PrivatePostgres
    redis: PrivateRedis

    def gw(self, name: str) -> Proc:
        return next(g for g in self.cluster.gateways if g.name == name)

    def worker(self, name: str) -> Proc:
        return next(w for w in self.cluster.workers if w.name == name)

    @property
    def base(self) -> str:
        return self.cluster.base_name


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    model = demo_model_file()
    home = tmp_path_factory.mktemp("e2e-faults")
    pg = PrivatePostgres()
    redis = PrivateRedis(home / "redis.log")
    c = Cluster(home=home, database_url=pg.url, redis_url=redis.url, redis_prefix="loraplex-faults",
                model=str(model), extra_env=FLEET_ENV)
    try:
        pg.create()
        redis.start()
        c.migrate()
        for wid in ("w1", "w2"):
            c.add_worker(wid)
        c.add_gateway("g1")
        c.add_gateway("g2")
        c.add_gateway("g3", LORAPLEX_RATELIMIT_FAIL_MODE="closed")
        try:
            c.wait_ready()
            _seed(c)
        except BaseException:
            for p in c.workers + c.gateways:
                print(f"--- {p.name} ---\n{p.tail()}")
            raise
        yield Fleet(c, pg, redis)
    finally:
        for p in c.workers + c.gateways:
            p.send_signal(signal.SIGCONT)
        c.stop()
        redis.kill()
        pg.drop()


def _seed(c: Cluster) -> None:
    c.base_name = c.admin("POST", "/base-models", {"path": c.model})["name"]
    for slug, concurrent in (("steady", 64), ("bounded", MAX_CONCURRENT), ("holder", MAX_CONCURRENT)):
        c.admin("POST", "/tenants", {"slug": slug, "requests_per_min": 100_000, "tokens_per_min": 10_000_000,
                                     "max_concurrent": concurrent})
    c.wait_current()
    for gw in c.gateways:  # the prompt counter's tokenizer and the workers' first steps, before any fault
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=120.0,
                       headers={"Authorization": f"Bearer {c.token('steady')}"},
                       json=chat_body(stream=False, max_tokens=2, model=c.base_name))
        assert r.status_code == 200, r.text


def _counts(load: Load) -> str:
    return " ".join(f"{k}={v}" for k, v in load.counts().items())


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=200, max_keepalive_connections=0))


async def _until(cond: Callable[[], bool], within_s: float, every_s: float = 0.2) -> float | None:
    """Seconds until ``cond()`` (blocking: run in a thread) held, or None when it did not within
    ``within_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 <= within_s:
        if await asyncio.to_thread(cond):
            return time.monotonic() - t0
        await asyncio.sleep(every_s)
    return None


async def _begun(streams: list[asyncio.Task[Outcome]], started: list[asyncio.Event], within_s: float = 60.0) -> None:
    """Until every stream has sent its first event or ended (refused, say)."""
    async def one(task: asyncio.Task[Outcome], ev: asyncio.Event) -> None:
        waiter = asyncio.create_task(ev.wait())
        await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()

    await asyncio.wait_for(asyncio.gather(*(one(t, ev) for t, ev in zip(streams, started, strict=True))), within_s)


def _gauge_is(proc: Proc, value: float) -> Callable[[], bool]:
    return lambda: gauge(metrics_url(proc), "loraplex_gateway_redis_up") == value


# --- PostgreSQL ----------------------------------------------------------------------------------


def test_postgresql_stopped_chat_is_served_and_registry_routes_answer_503(fleet):
    c = fleet.cluster
    user = {"Authorization": f"Bearer {c.token('steady')}"}
    admin = {"Authorization": f"Bearer {mint_admin(c.settings)}"}
    stored = httpx.post(fleet.gw("g1").url + "/v1/responses", headers=user, timeout=60.0,
                        json={"model": fleet.base, "input": "Say hi.", "max_output_tokens": 4})
    assert stored.status_code == 200, stored.text
    rid = stored.json()["id"]
    routes = [("GET", f"/v1/responses/{rid}", user, None),
              ("GET", f"/v1/responses/{rid}/input_items", user, None),
              ("DELETE", f"/v1/responses/{rid}", user, None),
              ("POST", "/v1/responses", user, {"model": fleet.base, "input": "And then?", "max_output_tokens": 2,
                                               "previous_response_id": rid}),
              ("POST", "/v1/responses", user, {"model": fleet.base, "input": "Hi.", "max_output_tokens": 2,
                                               "store": True}),
              ("GET", "/admin/tenants", admin, None),
              ("GET", "/admin/adapters", admin, None),
              ("POST", "/admin/tenants", admin, {"slug": "newcomer", "requests_per_min": 10}),
              ("PUT", "/admin/tenants/steady/bindings/assistant", admin, {"adapter": "nothing@1"})]
    load = Load()
    answers: list[tuple[str, str, str, int | str, str | None, str]] = []

    async def chats() -> None:
        async with _client() as client:
            await asyncio.gather(*(request(client, load, fleet.gw(("g1", "g2")[i % 2]).url, c.token("steady"),
                                           chat_body(stream=i % 2 == 1, max_tokens=8, model=fleet.base),
                                           hang_s=CLIENT_TIMEOUT_S) for i in range(4)))

    fleet.pg.stop()
    try:
        asyncio.run(chats())
        for gw in (fleet.gw("g1"), fleet.gw("g2")):
            with httpx.Client(timeout=30.0) as client:  # one keep-alive connection per gateway
                for method, path, headers, body in routes:
                    try:
                        r = client.request(method, gw.url + path, headers=headers, json=body)
                        code = r.json().get("error", {}).get("code", "") if r.content else ""
                        answers.append((gw.name, method, path, r.status_code, r.headers.get("retry-after"), code))
                    except (httpx.HTTPError, ValueError) as exc:
                        answers.append((gw.name, method, path, type(exc).__name__, None, ""))
                    try:  # the connection is still good
                        after = client.get(gw.url + "/v1/models", headers=user).status_code
                    except httpx.HTTPError as exc:
                        after = type(exc).__name__
                    if after != 200:
                        answers.append((gw.name, "GET", f"/v1/models after {method} {path}", after, None, ""))
    finally:
        t_start = time.monotonic()
        fleet.pg.start()

    def registry_back() -> bool:
        return all(httpx.get(g.url + "/admin/tenants", headers=admin, timeout=10.0).status_code == 200 and
                   httpx.get(g.url + f"/v1/responses/{rid}", headers=user, timeout=10.0).status_code == 200
                   for g in (fleet.gw("g1"), fleet.gw("g2")))

    recovered = asyncio.run(_until(registry_back, 30.0, 0.5))
    recovered_s = None if recovered is None else time.monotonic() - t_start
    print(f"\npostgresql stopped: chat {_counts(load)}; registry routes "
          f"{Counter((a[3], a[5]) for a in answers)}; routes back {recovered_s} s after the start began")
    assert load.counts()[OK] == len(load.outcomes), [(o.kind, o.status, o.code) for o in load.outcomes]
    wrong = [a for a in answers if a[3] != 503 or not a[4] or not a[5]]
    assert not wrong, f"not a 503 with retry-after and a code (or the connection did not survive): {wrong}"
    assert recovered is not None, "the registry routes did not answer within 30 s of PostgreSQL's start"
    assert not unsettled(c, load.outcomes)


# --- Redis ---------------------------------------------------------------------------------------


def _redis_outage(fleet: Fleet, break_redis: Callable[[], None], mend_redis: Callable[[], None]) -> list[str]:
    """Break Redis for 5 s (longer than a worker report lives) under traffic on ``g1`` (fail-open)
    and ``g3`` (fail-closed) while ``g2`` stays idle, mend it, and check what clients saw, then
    that the tenant gets all its slots on ``g2`` (whose last traffic was before the outage);
    the problems found (empty: none)."""
    c = fleet.cluster
    g1, g2, g3 = fleet.gw("g1"), fleet.gw("g2"), fleet.gw("g3")
    token = c.token("bounded")
    served, refused = Load(), Load()
    problems: list[str] = []

    async def outage() -> float | None:
        async with _client() as client:
            def plain(gw: Proc, load: Load) -> object:
                return request(client, load, gw.url, token, chat_body(stream=False, max_tokens=4, model=fleet.base),
                               hang_s=CLIENT_TIMEOUT_S)

            up = await asyncio.gather(*(_until(_gauge_is(gw, 1.0), GAUGE_BOUND_S) for gw in (g1, g2, g3)))
            if None in up:
                problems.append(f"redis_up is not 1 with Redis up (g1, g2, g3 after {up} s)")
            break_redis()
            t0 = time.monotonic()
            idle = asyncio.create_task(_until(_gauge_is(g2, 0.0), 5.0))  # no traffic tells g2
            try:
                for _ in range(3):  # one at a time: fail-open may admit only this replica's share
                    await plain(g1, served)
                for _ in range(2):
                    await plain(g3, refused)
                await asyncio.sleep(max(0.0, t0 + 5.0 - time.monotonic()))
                await plain(g1, served)  # routing outlives the worker reports Redis no longer holds
            finally:
                mend_redis()
            return await idle

    idle_down = asyncio.run(outage())

    async def gauges_back() -> dict[str, float | None]:
        took = await asyncio.gather(*(_until(_gauge_is(gw, 1.0), GAUGE_BOUND_S) for gw in (g1, g2, g3)))
        return {gw.name: None if t is None else round(t, 2) for gw, t in zip((g1, g2, g3), took, strict=True)}

    back = asyncio.run(gauges_back())
    slots, closed_after, tries = Load(), Load(), Load()

    async def every_slot() -> None:
        async with _client() as client:
            await asyncio.gather(*(request(client, slots, g2.url, token,
                                           chat_body(stream=True, max_tokens=24, model=fleet.base),
                                           hang_s=CLIENT_TIMEOUT_S) for _ in range(MAX_CONCURRENT)))
            # g2 frees a stream's lease just after its last event, so a request sent at once may still
            # meet one: a concurrency 429 with retry-after, honoured as a client would (3 tries).
            for _ in range(3):
                o = await request(client, tries, g3.url, token,
                                  chat_body(stream=False, max_tokens=2, model=fleet.base), hang_s=CLIENT_TIMEOUT_S)
                if o.status != 429:
                    break
                await asyncio.sleep(min(3.0, float(o.retry_after or 1)))
            closed_after.outcomes.append(o)

    asyncio.run(every_slot())
    print(f"\n  fail-open g1: {_counts(served)} (longest {max(o.end_at - o.sent for o in served.outcomes if o.end_at):.2f} s);"
          f" fail-closed g3: {_counts(refused)} {[(o.status, o.code, o.retry_after) for o in refused.outcomes]};"
          f" idle g2's redis_up 0 after {idle_down} s; redis_up 1 again after {back} s;"
          f" all {MAX_CONCURRENT} slots on g2 then: {[(o.status, o.code) for o in slots.outcomes]},"
          f" g3 then: {[(o.status, o.code) for o in tries.outcomes]}")
    if served.counts()[OK] != len(served.outcomes):
        problems.append(f"fail-open chat not served: {[(o.kind, o.status, o.code) for o in served.outcomes]}")
    for o in refused.outcomes:
        if not (o.status == 503 and o.code and o.retry_after and o.end_at and o.end_at - o.sent < 5.0):
            problems.append(f"fail-closed: not a quick 503 with a code and retry-after: {o}")
    if idle_down is None:
        problems.append("an idle gateway's redis_up did not drop to 0 within 5 s of the outage")
    for name, took in back.items():
        if took is None:
            problems.append(f"{name}'s redis_up not back to 1 within {GAUGE_BOUND_S} s of Redis' return")
    if slots.counts()[OK] != len(slots.outcomes):
        problems.append(f"the tenant could not use all its slots on g2 after the outage (an orphan lease, or a "
                        f"limiter still on its fallback share): "
                        f"{[(o.kind, o.status, o.code, o.retry_after) for o in slots.outcomes]}")
    if closed_after.counts()[OK] != len(closed_after.outcomes):
        problems.append(f"the fail-closed gateway still refuses after Redis returned: "
                        f"{[(o.kind, o.status, o.code) for o in closed_after.outcomes]}")
    wrong = unsettled(c, served.outcomes + refused.outcomes + slots.outcomes + tries.outcomes)
    if wrong:
        problems.append(f"settled != received: {wrong}")
    return problems


def test_redis_killed_chat_served_or_clear_503_and_the_limiter_recovers(fleet):
    print("\nredis killed:", end="")
    problems = _redis_outage(fleet, fleet.redis.kill, fleet.redis.start)
    assert not problems, problems


def test_redis_hung_leaves_no_orphan_lease(fleet):
    print("\nredis hung (SIGSTOP):", end="")
    problems = _redis_outage(fleet, lambda: fleet.redis.signal(signal.SIGSTOP),
                             lambda: fleet.redis.signal(signal.SIGCONT))
    assert not problems, problems


# --- a gateway killed ----------------------------------------------------------------------------


def test_a_killed_gateways_slots_return_within_the_lease_bound(fleet):
    """``g2`` holds every slot of ``holder`` with streams and is killed: ``g1`` admits the tenant
    again within the bound, and its 429s' ``retry-after`` told the truth meanwhile."""
    c = fleet.cluster
    g1, g2 = fleet.gw("g1"), fleet.gw("g2")
    token = c.token("holder")
    held, probes = Load(), Load()

    async def run() -> tuple[float, Outcome | None]:
        async with _client() as client:
            started = [asyncio.Event() for _ in range(MAX_CONCURRENT)]
            streams = [asyncio.create_task(request(client, held, g2.url, token,
                                                   chat_body(stream=True, max_tokens=600, model=fleet.base),
                                                   hang_s=CLIENT_TIMEOUT_S, started=ev)) for ev in started]
            await _begun(streams, started)
            assert all(ev.is_set() for ev in started), [(o.kind, o.status, o.code) for o in held.outcomes]

            def probe() -> object:
                return request(client, probes, g1.url, token, chat_body(stream=False, max_tokens=1, model=fleet.base),
                               hang_s=CLIENT_TIMEOUT_S)

            await probe()  # while every slot is held and its holder alive
            g2.kill(signal.SIGKILL)
            t_kill = time.monotonic()
            admitted = None
            while time.monotonic() - t_kill < GATEWAY_SLOTS_BOUND_S + 5:
                o = await probe()
                if o.kind == OK:
                    admitted = o
                    break
                await asyncio.sleep(0.5)
            await asyncio.gather(*streams)
            return t_kill, admitted

    t_kill, admitted = asyncio.run(run())
    c.gateways.remove(g2)  # dead for the rest of the module (its log stays)
    refused = [o for o in probes.outcomes if o.status == 429]
    after = [o for o in refused if o.sent >= t_kill]
    delay = None if admitted is None else admitted.head_at - t_kill
    print(f"\ngateway killed holding {MAX_CONCURRENT} of {MAX_CONCURRENT} slots: first request admitted on g1 "
          f"{delay if delay is None else round(delay, 2)} s after the kill ({len(after)} 429s before it, "
          f"retry-after {[o.retry_after for o in refused]}); held streams: {_counts(held)}")
    assert held.counts()[HUNG] == 0 and held.counts()[OK] == 0, _counts(held)
    assert refused, "a probe while the slots were held was admitted"
    assert all(o.code == "rate_limit_exceeded" for o in refused), [(o.status, o.code) for o in probes.outcomes]
    assert admitted is not None and delay <= GATEWAY_SLOTS_BOUND_S, f"not admitted within {GATEWAY_SLOTS_BOUND_S} s"
    assert {o.retry_after for o in refused} != {"1"}, "retry-after says 1 whatever the leases say"
    # Honest: a client that waited as told was admitted by then (integer seconds, one probe late).
    told = min((o.head_at + float(o.retry_after) for o in after), default=admitted.head_at)
    assert admitted.head_at <= told + 2.0, (admitted.head_at - t_kill, told - t_kill)
    assert not unsettled(c, probes.outcomes)


# --- a worker killed or stopped ------------------------------------------------------------------

AFTER_S = (0.5, 2.0, 3.5, 5.0, 6.5)
"""When requests are sent after the fault (a worker report lives 3 s)."""


async def _under_load(fleet: Fleet, fault: Callable[[Proc], None]) -> tuple[Load, Proc, float]:
    """Streams and whole answers on ``g1`` and ``g3`` on both workers; once every stream has
    begun, ``fault`` hits the worker serving the most of them; more requests follow at
    ``AFTER_S``. The load, the victim and when it was hit."""
    c = fleet.cluster
    token = c.token("steady")
    gateways = [fleet.gw("g1"), fleet.gw("g3")]
    load = Load()
    async with _client() as client:
        def send(i: int, stream: bool, started: asyncio.Event | None = None) -> asyncio.Task[Outcome]:
            tokens = (STREAM_TOKENS if started is not None else LATE_STREAM_TOKENS) if stream else PLAIN_TOKENS
            body = chat_body(stream=stream, max_tokens=tokens, model=fleet.base)
            return asyncio.create_task(request(client, load, gateways[i % 2].url, token, body,
                                               hang_s=CLIENT_TIMEOUT_S, started=started))

        started = [asyncio.Event() for _ in range(4)]
        tasks = [send(i, True, ev) for i, ev in enumerate(started)]
        tasks += [send(i, False) for i in range(4)]
        await _begun(tasks[:len(started)], started)
        assert all(ev.is_set() for ev in started), [(o.kind, o.status, o.code) for o in load.outcomes]
        on = Counter(o.worker for o in load.outcomes if o.stream and o.end_at is None)
        assert on, "every stream ended before the fault (make STREAM_TOKENS larger)"
        victim = fleet.worker(on.most_common(1)[0][0])
        fault(victim)
        t_fault = time.monotonic()
        for i, at in enumerate(AFTER_S):
            await asyncio.sleep(max(0.0, t_fault + at - time.monotonic()))
            tasks += [send(i, False), send(i + 1, True)]
        await asyncio.gather(*tasks)
    return load, victim, t_fault


def _answered_at(o: Outcome) -> float | None:
    return o.first_at if o.stream else o.head_at


def _worker_report(load: Load, victim: Proc, t_fault: float) -> tuple[list[Outcome], list[Outcome], str]:
    """The requests in flight at the fault and those sent after it; a line of what they saw: how
    long each waited (from the fault, or from being sent after it) until another worker answered,
    the longest of the streams (their first event) and of the whole answers (the whole answer)."""
    inflight = [o for o in load.outcomes if o.sent < t_fault and (o.end_at is None or o.end_at > t_fault)]
    later = [o for o in load.outcomes if o.sent >= t_fault]

    def longest(outcomes: list[Outcome], stream: bool) -> str:
        waits = [a - max(o.sent, t_fault) for o in outcomes if o.kind == OK and o.stream == stream
                 and o.worker != victim.name and (a := _answered_at(o)) is not None]
        return f"{max(waits):.2f} s" if waits else "-"

    line = (f"{_counts(load)}; in flight {len(inflight)} "
            f"(on {victim.name}: {sum(o.worker == victim.name for o in inflight)} streams begun), "
            f"longest wait for another worker: streams {longest(inflight, True)}, whole answers "
            f"{longest(inflight, False)}; sent after {len(later)}, longest wait: streams {longest(later, True)}, "
            f"whole answers {longest(later, False)}; error codes "
            f"{dict(Counter(o.code for o in load.outcomes if o.kind == ERROR))}")
    return inflight, later, line


def _check_worker_fault(c: Cluster, load: Load, victim: Proc, t_fault: float, stream_code: str | None) -> None:
    inflight, later, line = _worker_report(load, victim, t_fault)
    print(f"\n{victim.name} {'killed' if stream_code is None else 'stopped'}: {line}")
    counts = load.counts()
    assert counts[HUNG] == counts[TRUNCATED] == counts[DROPPED] == 0, line
    begun = [o for o in inflight if o.stream and o.worker == victim.name]
    assert begun, "no stream was running on the worker when it was hit"
    for o in begun:  # a stream the worker had begun: an error event, never a silent end
        assert o.kind == ERROR and (stream_code is None or o.code == stream_code), (o.kind, o.code, o.events)
    for o in inflight + later:
        if o in begun:
            continue
        assert o.kind == OK, (o.kind, o.status, o.code, o.stream)
        assert o.worker != victim.name or (o.head_at or 0) - t_fault < 0.3, "answered by the worker that was hit"
    for o in inflight + later:  # answered (a begun stream: ended) within the bound
        at = o.end_at if o in begun else _answered_at(o)
        assert at is not None and at - max(o.sent, t_fault) <= WORKER_BOUND_S, \
            (o.kind, o.code, o.stream, round(at - max(o.sent, t_fault), 2) if at else None)
    assert not unsettled(c, load.outcomes)


def test_a_stopped_worker_is_routed_around(fleet):
    """SIGSTOP: in-flight requests and new ones are answered by the other worker within the
    first-byte and stall bounds, never after ``request_timeout_s``; a stream the stopped worker
    had begun ends with ``upstream_stalled``."""
    c = fleet.cluster
    stopped: list[Proc] = []

    def stop(w: Proc) -> None:
        w.send_signal(signal.SIGSTOP)
        stopped.append(w)

    try:
        load, victim, t_fault = asyncio.run(_under_load(fleet, stop))
    finally:
        for w in stopped:
            w.send_signal(signal.SIGCONT)
        time.sleep(EJECT_MAX_S + 1.0)  # the resumed worker's ejection, if any, is over for the next test
    _check_worker_fault(c, load, victim, t_fault, "upstream_stalled")


def test_a_killed_worker_loses_nothing_silently(fleet):
    """SIGKILL (last: the worker stays dead): whole answers in flight are retried on the other
    worker unseen, a stream the killed worker had begun ends with an error event."""
    load, victim, t_fault = asyncio.run(_under_load(fleet, lambda w: w.kill(signal.SIGKILL)))
    _check_worker_fault(fleet.cluster, load, victim, t_fault, None)
