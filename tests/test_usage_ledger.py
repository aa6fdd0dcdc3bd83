"""The usage ledger's gateway side without a database: outcomes, buckets, and the flusher's
exactly-once rules (a flush that surely failed merges into the next, one in doubt is retried as
it was, what waits is bounded and what is dropped is counted)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.metrics import GatewayMetrics
from gateway.usage_ledger import LedgerFlusher, UsageLedger, gateway_id, outcome
from registry.usage import FlushInDoubt, FlushNotApplied


@pytest.mark.parametrize(("status", "code", "reason", "want"), [
    (200, None, "", "ok"),
    (499, None, "", "cancelled"),
    (429, "rate_limit_exceeded", "tokens", "429:tokens"),
    (429, "request_too_large", "too_large", "429:too_large"),
    (429, "rate_limit_exceeded", "", "429:rate_limit_exceeded"),
    (404, "model_not_found", "", "4xx:model_not_found"),
    (400, "invalid_value", "", "4xx:invalid_value"),
    (502, "stream_interrupted", "", "5xx:stream_interrupted"),
    (503, "ratelimiter_unavailable", "", "5xx:ratelimiter_unavailable"),
    (504, None, "", "5xx:timeout"),
    (500, None, "", "5xx:internal_error"),
])
def test_outcomes(status, code, reason, want):
    assert outcome(status, code, reason) == want


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_requests_add_to_their_minute_bucket_and_peak_is_the_max():
    clock = Clock(1_700_000_000.5)  # 1_699_999_980 is the minute's start
    led = UsageLedger(clock)
    assert led.admit("acme") == 1 and led.admit("acme") == 2
    led.record("acme", "bot", "bot-v1", "ok", 10, 4, 5, 2)
    led.release("acme")
    led.record("acme", "bot", "bot-v1", "ok", 7, 0, 3, 1)
    led.release("acme")
    assert led.in_flight("acme") == 0
    led.record("acme", "bot", "bot-v1", "429:tokens", 0, 0, 0, 0)
    clock.t += 60  # the next minute: a bucket of its own
    led.record("acme", "bot", "bot-v1", "ok", 1, 0, 1, 1)
    got = led.take()
    m = 1_699_999_980
    assert got == {(m, "acme", "bot", "bot-v1", "ok"): [2, 17, 4, 8, 2],
                   (m, "acme", "bot", "bot-v1", "429:tokens"): [1, 0, 0, 0, 0],
                   (m + 60, "acme", "bot", "bot-v1", "ok"): [1, 1, 0, 1, 1]}
    assert len(led) == 0 and led.take() == {}


def test_memory_grows_with_keys_not_requests():
    led = UsageLedger(Clock(1_700_000_000))
    for i in range(10_000):
        led.record(f"t{i % 5}", "a", "", "ok", 1, 0, 1, 1)
    assert len(led) == 5


def test_gateway_ids_differ_between_starts():
    assert gateway_id() != gateway_id()


class FakeDB:
    """Flushes applied by (gateway, seq), as the database keeps them; ``fail`` scripts the next
    attempts: 'not' (surely not applied), 'lost' (applied, the reply lost), 'doubt' (not applied,
    outcome unknown)."""

    def __init__(self) -> None:
        self.applied: dict[tuple[str, int], list[tuple]] = {}
        self.fail: list[str] = []
        self.calls: list[int] = []

    async def __call__(self, gateway: str, seq: int, rows) -> bool:
        self.calls.append(seq)
        mode = self.fail.pop(0) if self.fail else "ok"
        if mode == "not":
            raise FlushNotApplied("connection refused")
        if mode == "doubt":
            raise FlushInDoubt("connection lost during commit")
        fresh = (gateway, seq) not in self.applied
        if fresh:
            self.applied[(gateway, seq)] = list(rows)
        if mode == "lost":
            raise FlushInDoubt("connection lost after commit")
        return fresh

    def totals(self) -> dict[tuple, list[int]]:
        out: dict[tuple, list[int]] = {}
        for rows in self.applied.values():
            for r in rows:
                t = out.setdefault(r[:5], [0, 0, 0, 0, 0])
                for i in range(4):
                    t[i] += r[5 + i]
                t[4] = max(t[4], r[9])
        return out


async def test_a_flush_that_surely_failed_merges_into_the_next():
    led, db = UsageLedger(Clock(1_700_000_000)), FakeDB()
    f = LedgerFlusher(led, db, gateway="g")
    led.record("a", "x", "", "ok", 5, 0, 5, 1)
    db.fail = ["not"]
    assert not await f.flush()
    assert f.pending == 1 and f.failures == 1
    led.record("a", "x", "", "ok", 5, 0, 5, 1)
    assert await f.flush()
    assert db.totals() == {(1_699_999_980, "a", "x", "", "ok"): [2, 10, 0, 10, 1]}
    assert f.pending == 0


@pytest.mark.parametrize("mode", ["lost", "doubt"])
async def test_a_flush_in_doubt_is_retried_with_the_same_seq_and_counted_once(mode):
    led, db = UsageLedger(Clock(1_700_000_000)), FakeDB()
    f = LedgerFlusher(led, db, gateway="g")
    led.record("a", "x", "", "ok", 5, 0, 5, 1)
    db.fail = [mode, "not"]
    assert not await f.flush()
    led.record("a", "x", "", "ok", 1, 0, 1, 1)  # arrives while the first flush is in doubt
    assert not await f.flush()  # the retry fails too: still in doubt, still the same seq
    assert await f.flush()
    assert db.calls[:3] == [1, 1, 1] and db.calls[3] == 2
    assert db.totals() == {(1_699_999_980, "a", "x", "", "ok"): [2, 6, 0, 6, 1]}


async def test_what_waits_is_bounded_and_the_oldest_are_dropped_and_counted():
    clock = Clock(1_700_000_000)
    led, db = UsageLedger(clock), FakeDB()
    metrics = GatewayMetrics()
    f = LedgerFlusher(led, db, gateway="g", max_pending=3, metrics=metrics)
    for _ in range(5):
        led.record("a", "x", "", "ok", 1, 0, 1, 1)
        clock.t += 60
    db.fail = ["not"]
    assert not await f.flush()
    assert f.pending == 3 and f.dropped == 2
    text = metrics.render().decode()
    assert "loraplex_gateway_usage_dropped_buckets_total 2.0" in text
    assert "loraplex_gateway_usage_pending_buckets 3.0" in text
    assert "loraplex_gateway_usage_flush_failures_total 1.0" in text
    assert await f.flush()
    starts = sorted(k[0] for k in db.totals())
    assert starts == [1_699_999_980 + 60 * m for m in (2, 3, 4)]  # the two oldest minutes went
    assert "loraplex_gateway_usage_pending_buckets 0.0" in metrics.render().decode()


async def test_in_doubt_flushes_count_against_the_bound_too():
    clock = Clock(1_700_000_000)
    led, db = UsageLedger(clock), FakeDB()
    f = LedgerFlusher(led, db, gateway="g", max_pending=2)
    for _ in range(3):
        led.record("a", "x", "", "ok", 1, 0, 1, 1)
        clock.t += 60
    db.fail = ["doubt"]
    assert not await f.flush()
    assert f.pending == 2 and f.dropped == 1 and len(f.in_doubt) == 1
    assert await f.flush()
    assert len(db.totals()) == 2


async def test_drain_writes_what_settles_while_it_runs():
    led, db = UsageLedger(Clock(1_700_000_000)), FakeDB()
    f = LedgerFlusher(led, db, gateway="g")
    led.record("a", "x", "", "ok", 1, 0, 1, 1)
    db.fail = ["not", "not"]

    async def late() -> None:
        await asyncio.sleep(0.05)
        led.record("a", "x", "", "cancelled", 3, 0, 2, 1)

    task = asyncio.create_task(late())
    assert await f.drain(timeout_s=5, retry_s=0.1)
    await task
    assert db.totals() == {(1_699_999_980, "a", "x", "", "ok"): [1, 1, 0, 1, 1],
                           (1_699_999_980, "a", "x", "", "cancelled"): [1, 3, 0, 2, 1]}


async def test_drain_gives_up_after_its_time():
    led, db = UsageLedger(Clock(1_700_000_000)), FakeDB()
    f = LedgerFlusher(led, db, gateway="g")
    led.record("a", "x", "", "ok", 1, 0, 1, 1)
    db.fail = ["not"] * 100
    assert not await f.drain(timeout_s=0.5, retry_s=0.1)
    assert f.pending == 1


async def test_last_flush_age_is_reported():
    led, db = UsageLedger(Clock(1_700_000_000)), FakeDB()
    metrics = GatewayMetrics()
    assert b"loraplex_gateway_usage" not in metrics.render()  # a replica without a ledger exports none
    metrics.track_usage()
    metrics._usage_written_at -= 100
    text = metrics.render().decode()
    age = float(next(line for line in text.splitlines()
                     if line.startswith("loraplex_gateway_usage_last_flush_age_seconds ")).split()[1])
    assert age >= 100
    f = LedgerFlusher(led, db, gateway="g", metrics=metrics)
    led.record("a", "x", "", "ok", 1, 0, 1, 1)
    assert await f.flush()
    text = metrics.render().decode()
    age = float(next(line for line in text.splitlines()
                     if line.startswith("loraplex_gateway_usage_last_flush_age_seconds ")).split()[1])
    assert age < 5


async def test_a_flush_cancelled_mid_write_is_kept_in_doubt_and_retried_once():
    """Cancelled while writing (the shutdown's deadline): its commit may have happened, so its
    rows are retried with the same seq, never re-sent under a new one."""
    led, db = UsageLedger(Clock(1_700_000_000)), FakeDB()
    started = asyncio.Event()

    async def slow(gateway, seq, rows):
        await db(gateway, seq, rows)  # applied, then the reply never comes
        started.set()
        await asyncio.sleep(60)

    f = LedgerFlusher(led, slow, gateway="g")
    led.record("a", "x", "", "ok", 5, 0, 5, 1)
    task = asyncio.create_task(f.flush())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [x.seq for x in f.in_doubt] == [1] and f.pending == 1
    f.write = db
    assert await f.flush()
    assert db.calls == [1, 1]
    assert db.totals() == {(1_699_999_980, "a", "x", "", "ok"): [1, 5, 0, 5, 1]}


async def test_a_writer_failing_unexpectedly_loses_nothing():
    led, db = UsageLedger(Clock(1_700_000_000)), FakeDB()
    calls = []

    async def broken(gateway, seq, rows):
        calls.append(seq)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return await db(gateway, seq, rows)

    f = LedgerFlusher(led, broken, gateway="g")
    led.record("a", "x", "", "ok", 5, 0, 5, 1)
    assert not await f.flush()
    assert await f.flush()
    assert calls == [1, 1] and len(db.totals()) == 1
