"""End to end: the usage ledger equals what the clients received, request for request.

A fleet of real processes on loopback (``tests.e2e_cluster``) on a PostgreSQL cluster of its own
(``tests.fault_fleet``: the last scenario stops it) and the shared Redis: two workers on the demo
model and two gateways flushing their ledgers every second. Mixed traffic from several tenants
(``Traffic``): streams and whole answers on an alias whose binding has a canary at 50% (two
versions answer it) and on the base model, streams the client leaves mid-way, 429s from a tenant
allowed one request at a time, and 404s of an unknown model.

What each request should add to the ledger is what its client saw: the usage of a whole answer or
a stream's last usage chunk, a 429 or 4xx with no tokens; for a stream the client left, what the
limiter settled (the gateway's access-log record of it: the prompt and completion tokens it settles
the reservation with). The ledger is read before and after each scenario (``registry.usage.totals``
per tenant, adapter version and outcome); the difference must equal the sum of those, exactly:

1. with every gateway up;
2. with one gateway SIGTERMed mid-load (taken out of the clients' rotation first, as a load
   balancer does, its streams still running): it drains its ledger before it exits;
3. with one SIGKILLed mid-load: the ledger may be short, by at most what that gateway served
   since the start of its last successful flush (the ledger's documented loss: the last interval),
   and never over what the clients were charged;
4. with PostgreSQL stopped for 20 s mid-load: the buckets wait in the gateways and land, exactly.

A replacement gateway starts after each stop, so every scenario has two. Tests run in file order
and share the fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from registry.usage import totals
from tests.e2e_cluster import Cluster, Proc
from tests.engine_fixtures import demo_model_file
from tests.fault_fleet import (
    DROPPED,
    ERROR,
    OK,
    TRUNCATED,
    Load,
    Outcome,
    PrivatePostgres,
    access_records,
    chat_body,
    gauge,
    metrics_url,
    request,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DEMO = Path(__file__).resolve().parent.parent / "demo" / "adapters"
FLUSH_INTERVAL_S = 1.0
FLEET_ENV = {"LORAPLEX_USAGE_FLUSH_INTERVAL_S": str(FLUSH_INTERVAL_S), "LORAPLEX_RATELIMIT_LEASE_TTL_S": "4"}
CLIENT_TIMEOUT_S = 60.0
OUTAGE_S = 20.0
FLUSH_TAKES_S = 1.0
"""Most a flush takes from taking the buckets to its commit here (two cores, everything on them):
a SIGKILLed gateway's loss counts from its last successful flush's end less this."""
UNKNOWN_MODEL = "no-such-model"
LONG_TOKENS = 128
"""globex's streams on the base model: long enough to be running when a gateway is stopped."""

Key = tuple[str, str, str]
"""(tenant, adapter version id or "" for the base model, outcome; every ``429:<reason>`` as ``429``)."""


@dataclass
class Fleet:
    cluster: Cluster
    pg: PrivatePostgres
    versions: dict[str, str]
    """Adapter label -> version id (the ledger's ``version``)."""
    spawned: int = 0

    def up(self) -> list[Proc]:
        return [g for g in self.cluster.gateways if g.alive()]

    def replace(self, dead: Proc) -> Proc:
        """A new gateway in ``dead``'s place (``dead`` leaves the fleet; its log stays)."""
        self.cluster.gateways.remove(dead)
        self.spawned += 1
        gw = self.cluster.add_gateway(f"g{self.spawned + 2}")
        self.cluster.wait_ready()
        _warm(self.cluster, gw)
        return gw


def _copy(src: Path, dst: Path) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


def _warm(c: Cluster, gw: Proc) -> None:
    """One request through ``gw`` (its prompt counter's tokenizer loads on first use)."""
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=120.0, headers={"Authorization": f"Bearer {c.token('acme')}"},
                   json=chat_body(stream=False, max_tokens=2, model=c.base_name))
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def fleet(redis_url, tmp_path_factory):
    home = tmp_path_factory.mktemp("e2e-usage")
    pg = PrivatePostgres()
    c = Cluster(home=home, database_url=pg.url, redis_url=redis_url,
                redis_prefix=f"loraplex-usage-{uuid.uuid4().hex[:8]}", model=str(demo_model_file()),
                extra_env=FLEET_ENV)
    try:
        pg.create()
        with c.running():
            c.base_name = c.admin("POST", "/base-models", {"path": c.model})["name"]
            for slug, concurrent in (("acme", 64), ("globex", 64), ("tight", 1)):
                c.admin("POST", "/tenants", {"slug": slug, "requests_per_min": 100_000, "tokens_per_min": 10_000_000,
                                             "max_concurrent": concurrent})
            versions: dict[str, str] = {}
            ids = []
            for tenant, name, copy in (("acme", "french", "v1"), ("acme", "french", "v2"), ("globex", "json", "v1")):
                dst = _copy(DEMO / name, home / "adapters" / tenant / f"{name}-{copy}")
                ad = c.admin("POST", "/adapters", {"name": f"{tenant}-{name}", "uri": str(dst), "base_model": c.base_name,
                                                   "owner": tenant})
                ad = c.admin("POST", f"/adapters/{ad['id']}/activate", {})
                versions[ad["label"]] = ad["id"]
                ids.append(ad["id"])
            c.admin("PUT", "/tenants/acme/bindings/assistant", {"adapter": ids[0]})
            c.admin("POST", "/tenants/acme/bindings/assistant/canary", {"adapter": ids[1], "percent": 50})
            c.admin("PUT", "/tenants/globex/bindings/assistant", {"adapter": ids[2]})
            c.wait_current()
            for gw in c.gateways:
                _warm(c, gw)
            yield Fleet(c, pg, versions)
    finally:
        pg.drop()


# --- traffic -------------------------------------------------------------------------------------


@dataclass
class Traffic:
    """Mixed traffic through the gateways in ``live`` (a test takes one out before stopping it),
    one request at a time per lane until ``stop``; per tenant the requests as their clients saw
    them, and apart those the client left mid-stream."""

    fleet: Fleet
    live: list[Proc]
    cancel_on: list[Proc]
    """Gateways where streams are left mid-way (what they settled is read from their access logs)."""
    sent: dict[str, Load] = field(default_factory=lambda: defaultdict(Load))
    left: dict[str, Load] = field(default_factory=lambda: defaultdict(Load))
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def _gw(self, i: int, among: list[Proc] | None = None) -> str:
        gws = among if among is not None else self.live
        return gws[i % len(gws)].url

    async def _lane(self, client: httpx.AsyncClient, tenant: str, model: str, *, stream: bool, max_tokens: int,
                    pause_s: float = 0.0, burst: int = 1) -> None:
        c = self.fleet.cluster
        token = c.token(tenant)
        i = 0
        while not self.stop.is_set():
            url = self._gw(i)
            body = chat_body(stream=stream and i % 3 != 2, max_tokens=max_tokens, model=model)
            await asyncio.gather(*(request(client, self.sent[tenant], url, token, body, hang_s=CLIENT_TIMEOUT_S)
                                   for _ in range(burst)))
            i += 1
            if pause_s:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), pause_s)

    async def _leaving(self, client: httpx.AsyncClient) -> None:
        """acme's streams on its alias, left once their first token came."""
        token = self.fleet.cluster.token("acme")
        i = 0
        while not self.stop.is_set() and self.cancel_on:
            began = asyncio.Event()
            task = asyncio.create_task(request(client, self.left["acme"], self._gw(i, self.cancel_on), token,
                                               chat_body(stream=True, max_tokens=200, model="assistant"),
                                               hang_s=CLIENT_TIMEOUT_S, started=began))
            i += 1
            waiter = asyncio.create_task(began.wait())
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            await asyncio.sleep(0.1)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), 0.5)

    async def run(self, during: Callable[[], Awaitable[None]] | None = None, seconds: float = 0.0) -> None:
        """The lanes until ``during()`` returns (or for ``seconds``), then until every request ended."""
        base = self.fleet.cluster.base_name
        async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=100,
                                                                       max_keepalive_connections=0)) as client:
            lanes = [
                self._lane(client, "acme", "assistant", stream=True, max_tokens=12),
                self._lane(client, "acme", base, stream=False, max_tokens=6),
                self._lane(client, "globex", "assistant", stream=True, max_tokens=8),
                self._lane(client, "globex", base, stream=True, max_tokens=LONG_TOKENS),
                self._lane(client, "tight", base, stream=True, max_tokens=8, burst=3, pause_s=0.3),
                self._lane(client, "globex", UNKNOWN_MODEL, stream=False, max_tokens=4, pause_s=0.5),
                self._leaving(client),
            ]
            tasks = [asyncio.create_task(lane) for lane in lanes]
            try:
                if during is not None:
                    await during()
                else:
                    await asyncio.sleep(seconds)
            finally:
                self.stop.set()
                await asyncio.gather(*tasks)

    def outcomes(self) -> list[tuple[str, Outcome]]:
        return [(t, o) for t, load in self.sent.items() for o in load.outcomes]


def _expected(fleet: Fleet, traffic: Traffic, *, unsettled_on: Proc | None = None
              ) -> tuple[dict[Key, list[int]], list[tuple[str, Outcome]]]:
    """What the ledger must have gained: per key [requests, prompt tokens, completion tokens]; and
    the requests it counts, by tenant. ``unsettled_on``: a killed gateway, whose requests cut by the
    kill were never settled (nothing is owed for them)."""
    want: dict[Key, list[int]] = defaultdict(lambda: [0, 0, 0])
    counted: list[tuple[str, Outcome]] = []
    for tenant, o in traffic.outcomes():
        version = fleet.versions.get(o.adapter, "")
        if o.kind == OK:
            key, tokens = (tenant, version, "ok"), (o.prompt_tokens, o.completion_tokens)
        elif o.kind == ERROR and o.status == 429:
            key, tokens = (tenant, version, "429"), (0, 0)
        elif o.kind == ERROR and 400 <= o.status < 500:
            key, tokens = (tenant, version, f"4xx:{o.code}"), (0, 0)
        elif unsettled_on is not None and o.gateway == unsettled_on.url and o.kind in (DROPPED, TRUNCATED):
            continue
        else:
            raise AssertionError(f"{tenant}: a request ended {o.kind} ({o.status} {o.code}) on {o.gateway}")
        counted.append((tenant, o))
        _add(want[key], 1, *tokens)
    left = {o.rid: o for load in traffic.left.values() for o in load.outcomes}
    records = access_records(fleet.cluster, set(left))
    missing = set(left) - set(records)
    assert not missing, f"streams left mid-way with no access-log record: {missing}"
    for rec in records.values():
        key = (rec["tenant"], fleet.versions.get(rec["adapter"], ""), "cancelled" if rec["status"] == 499 else "ok")
        _add(want[key], 1, rec["prompt_tokens"], rec["completion_tokens"])
    return dict(want), counted


def _add(into: list[int], requests: int, prompt: int, completion: int) -> None:
    into[0] += requests
    into[1] += prompt
    into[2] += completion


def _ledger(fleet: Fleet) -> dict[Key, list[int]]:
    got: dict[Key, list[int]] = defaultdict(lambda: [0, 0, 0])
    for (tenant, version, outcome), t in asyncio.run(
            totals(fleet.pg.url, by=("tenant", "version", "outcome"))).items():
        _add(got[(tenant, version, "429" if outcome.startswith("429:") else outcome)],
             t.requests, t.prompt_tokens, t.completion_tokens)
    return dict(got)


def _at_rest(fleet: Fleet, within_s: float = 20.0) -> dict[Key, list[int]]:
    """The ledger once what the gateways hold has landed (two reads two intervals apart agree):
    a scenario's starting point, whatever requests came before it (a new gateway's first one)."""
    deadline = time.monotonic() + within_s
    last = _ledger(fleet)
    while True:
        time.sleep(2.5 * FLUSH_INTERVAL_S)
        now = _ledger(fleet)
        if now == last:
            return now
        assert time.monotonic() < deadline, "the ledger kept changing with no traffic"
        last = now


def _gained(before: dict[Key, list[int]], after: dict[Key, list[int]]) -> dict[Key, list[int]]:
    out = {}
    for key in before.keys() | after.keys():
        b, a = before.get(key, [0, 0, 0]), after.get(key, [0, 0, 0])
        d = [x - y for x, y in zip(a, b, strict=True)]
        if any(d):
            out[key] = d
    return out


def _settled_ledger(fleet: Fleet, before: dict[Key, list[int]], want: dict[Key, list[int]],
                    within_s: float = 20.0) -> dict[Key, list[int]]:
    """The ledger's gain once the gateways' flushes landed: when it equals ``want``, read again two
    intervals later (a flush that counts twice would add then); else what it was at ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        got = _gained(before, _ledger(fleet))
        if got == want:
            time.sleep(2.5 * FLUSH_INTERVAL_S)
            return _gained(before, _ledger(fleet))
        if time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def _check_mix(traffic: Traffic) -> None:
    """The scenario had what it is about: both versions of the canary, left streams, 429s, 4xx."""
    outcomes = traffic.outcomes()
    served = {o.adapter for t, o in outcomes if t == "acme" and o.kind == OK}
    assert {"acme-french@1", "acme-french@2"} <= served, served
    assert any(o.status == 429 for t, o in outcomes if t == "tight"), "the tight tenant was never refused"
    assert any(400 <= o.status < 500 and o.status != 429 for _, o in outcomes), "no 4xx (an unknown model)"
    assert traffic.left["acme"].outcomes, "no stream was left mid-way"


def _summary(want: dict[Key, list[int]]) -> str:
    by: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for (tenant, _, outcome), v in want.items():
        _add(by[f"{tenant}:{outcome}"], *v)
    return ", ".join(f"{k} {v[0]} req {v[1] + v[2]} tok" for k, v in sorted(by.items()))


# --- scenarios -----------------------------------------------------------------------------------


def test_ledger_equals_what_clients_received(fleet):
    before = _at_rest(fleet)
    traffic = Traffic(fleet, fleet.up(), fleet.up())
    asyncio.run(traffic.run(seconds=6.0))
    _check_mix(traffic)
    want, _ = _expected(fleet, traffic)
    got = _settled_ledger(fleet, before, want)
    print(f"\nall up: {_summary(want)}")
    assert got == want


def _running_on(traffic: Traffic, gw: Proc) -> bool:
    """A long stream through ``gw`` has begun, and has most of its tokens to go."""
    return any(o.gateway == gw.url and o.adapter not in traffic.fleet.versions and o.first_at is not None
               and o.end_at is None
               and o.events < LONG_TOKENS // 4 for o in traffic.sent["globex"].outcomes)


async def _when_streaming(traffic: Traffic, gw: Proc, after_s: float, within_s: float = 30.0) -> None:
    await asyncio.sleep(after_s)
    deadline = time.monotonic() + within_s
    while not _running_on(traffic, gw):
        assert time.monotonic() < deadline, f"no stream running on {gw.name}"
        await asyncio.sleep(0.05)


def test_sigterm_mid_load_loses_nothing(fleet):
    """The victim is taken out of rotation while it serves streams, then signalled: it finishes
    them, drains its ledger and exits."""
    before = _at_rest(fleet)
    victim, other = fleet.up()
    traffic = Traffic(fleet, [victim, other], [victim, other])
    signalled: list[float] = []

    async def stop_victim() -> None:
        await _when_streaming(traffic, victim, 2.0)
        traffic.live.remove(victim)
        traffic.cancel_on.remove(victim)
        await asyncio.sleep(0.3)  # requests already sent to it reach it (a load balancer's preStop)
        victim.send_signal(signal.SIGTERM)
        signalled.append(time.monotonic())
        await asyncio.sleep(2.0)

    try:
        asyncio.run(traffic.run(stop_victim))
        assert victim.popen is not None and victim.popen.wait(timeout=60) in (0, -signal.SIGTERM), victim.tail()
        [at] = signalled
        drained = [o for _, o in traffic.outcomes() if o.gateway == victim.url and o.sent < at < (o.end_at or 0)]
        assert drained and all(o.kind == OK for o in drained), [(o.kind, o.status) for o in drained]
        want, _ = _expected(fleet, traffic)
        got = _settled_ledger(fleet, before, want)
        print(f"\nSIGTERM ({len(drained)} requests running on it): {_summary(want)}")
        assert got == want
    finally:
        fleet.replace(victim)


def test_sigkill_mid_load_is_short_by_at_most_the_last_interval(fleet):
    """The ledger is short by at most what the victim served since its last successful flush
    began, and never over what the clients were charged."""
    before = _at_rest(fleet)
    victim, other = fleet.up()
    traffic = Traffic(fleet, [victim, other], [other])
    killed: list[float] = []

    async def kill_victim() -> None:
        await _when_streaming(traffic, victim, 2.0)
        traffic.live.remove(victim)
        age = await asyncio.to_thread(gauge, metrics_url(victim), "loraplex_gateway_usage_last_flush_age_seconds")
        at = time.monotonic()
        victim.kill(signal.SIGKILL)
        assert age is not None and age <= 2 * FLUSH_INTERVAL_S + FLUSH_TAKES_S, f"the victim's last flush: {age} s ago"
        killed.append(at - age - FLUSH_TAKES_S)
        await asyncio.sleep(2.0)

    try:
        asyncio.run(traffic.run(kill_victim))
        [since] = killed
        cut = [o for _, o in traffic.outcomes() if o.gateway == victim.url and o.kind in (DROPPED, TRUNCATED)]
        assert cut, "no request was running on the victim when it was killed"
        want, counted = _expected(fleet, traffic, unsettled_on=victim)
        bound: dict[Key, list[int]] = defaultdict(lambda: [0, 0, 0])
        for tenant, o in counted:
            if o.gateway == victim.url and o.end_at is not None and o.end_at >= since:
                outcome = "ok" if o.kind == OK else "429" if o.status == 429 else f"4xx:{o.code}"
                _add(bound[(tenant, fleet.versions.get(o.adapter, ""), outcome)], 1, o.prompt_tokens,
                     o.completion_tokens)
        got = _gained(before, _at_rest(fleet))  # short or not: what the survivor and the victim wrote
        short = {k: [w - g for w, g in zip(want.get(k, [0, 0, 0]), got.get(k, [0, 0, 0]), strict=True)]
                 for k in want.keys() | got.keys()}
        print(f"\nSIGKILL ({len(cut)} requests cut): {_summary(want)}; "
              f"short {({k: v for k, v in short.items() if any(v)})}, at most {dict(bound)}")
        over = {k: v for k, v in short.items() if min(v) < 0}
        assert not over, f"the ledger holds more than the clients were charged: {over}"
        beyond = {k: (v, bound.get(k, [0, 0, 0])) for k, v in short.items()
                  if any(s > b for s, b in zip(v, bound.get(k, [0, 0, 0]), strict=True))}
        assert not beyond, f"short by more than the victim served in its last interval: {beyond}"
    finally:
        fleet.replace(victim)


def test_postgresql_stopped_for_20s_mid_load_lands_exactly(fleet):
    """The flushes fail while PostgreSQL is away (counted); the buckets wait and land once it is back."""
    before = _at_rest(fleet)
    gateways = fleet.up()
    failures_before = [gauge(metrics_url(g), "loraplex_gateway_usage_flush_failures_total") or 0.0 for g in gateways]
    traffic = Traffic(fleet, list(gateways), list(gateways))

    async def outage() -> None:
        await asyncio.sleep(2.0)
        await asyncio.to_thread(fleet.pg.stop)
        try:
            await asyncio.sleep(OUTAGE_S)
        finally:
            await asyncio.to_thread(fleet.pg.start)
        await asyncio.sleep(2.0)

    asyncio.run(traffic.run(outage))
    failures = [gauge(metrics_url(g), "loraplex_gateway_usage_flush_failures_total") or 0.0 for g in gateways]
    assert all(a > b for a, b in zip(failures, failures_before, strict=True)), (failures_before, failures)
    want, _ = _expected(fleet, traffic)
    got = _settled_ledger(fleet, before, want, within_s=30.0)
    print(f"\nPostgreSQL away {OUTAGE_S:.0f} s: {_summary(want)}; flush failures {failures}")
    assert got == want
    assert all(gauge(metrics_url(g), "loraplex_gateway_usage_pending_buckets") == 0 for g in gateways)
    assert all(not gauge(metrics_url(g), "loraplex_gateway_usage_dropped_buckets_total") for g in gateways)
