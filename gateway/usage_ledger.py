"""The usage ledger's gateway side: every settled request added to a minute bucket in memory,
the buckets handed to the registry database every ``usage_flush_interval_s`` (``registry.usage``).

``UsageLedger.record`` adds a request to its bucket, keyed (minute, tenant, alias, version,
outcome): one request, the prompt, cached prompt and completion tokens the limiter settled
(``Gateway._finish``: the same numbers, once per request, whatever its ending), and the most
requests the tenant had in flight in this gateway when one of them was admitted
(``admit``/``release`` count them: the limiters do not report their count, and a Redis limiter's
is another round trip's work). Memory grows with the active (tenant, alias, version, outcome)
keys of a flush interval, not with requests.

``LedgerFlusher`` hands the buckets over, exactly once:

* every interval the buckets are taken and merged into the *unsent* set, and written in one
  flush with the next sequence number of this gateway (``gateway_id`` carries a random part:
  a restarted gateway never reuses a (gateway, seq));
* a flush that surely failed (``FlushNotApplied``) stays unsent, merged with later buckets;
* a flush whose commit outcome is unknown (``FlushInDoubt``) is kept as it is and retried
  with the same seq and rows before anything else, until the database says it is applied
  (or was already: the retry adds nothing);
* what waits is bounded (``max_pending`` buckets): beyond it the oldest minutes are dropped
  and counted (``loraplex_gateway_usage_dropped_buckets``), never silently;
* ``drain`` (SIGTERM: the app's lifespan shutdown) flushes until nothing waits, for a bounded
  time. A killed gateway (SIGKILL) loses what it held: at most the last interval's requests,
  plus whatever waited unwritten through an outage.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("loraplex.gateway.usage")

Key = tuple[int, str, str, str, str]
"""(minute start, tenant, alias, version, outcome)."""
Row = tuple[int, str, str, str, str, int, int, int, int, int]
"""A bucket as flushed (``registry.usage.Bucket``): its key, then requests, prompt, cached and
completion tokens, peak concurrency."""

_STATUS_CODE = {500: "internal_error", 502: "upstream_error", 503: "service_unavailable", 504: "timeout"}
"""The code of an outcome whose request ended without one (should none have been set)."""


def outcome(status: int, code: str | None = None, reason: str = "") -> str:
    """A request's outcome in the ledger: ``ok``, ``cancelled`` (the client went away),
    ``429:<the limiter's reason>``, ``4xx:<code>`` or ``5xx:<code>`` (``gateway.errors``)."""
    if status < 400:
        return "ok"
    if status == 499:
        return "cancelled"
    if status == 429:
        return f"429:{reason or code or 'rate_limit_exceeded'}"
    if status < 500:
        return f"4xx:{code or f'status_{status}'}"
    return f"5xx:{code or _STATUS_CODE.get(status, f'status_{status}')}"


class UsageLedger:
    """The buckets of the interval in progress, and each tenant's requests in flight here."""

    __slots__ = ("_buckets", "_inflight", "clock")

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._buckets: dict[Key, list[int]] = {}
        self._inflight: dict[str, int] = {}
        self.clock = clock

    def admit(self, tenant: str) -> int:
        """A request of ``tenant`` was admitted: its requests in flight here now, this one included."""
        n = self._inflight.get(tenant, 0) + 1
        self._inflight[tenant] = n
        return n

    def release(self, tenant: str) -> None:
        """An admitted request of ``tenant`` settled."""
        n = self._inflight.get(tenant, 0) - 1
        if n > 0:
            self._inflight[tenant] = n
        else:
            self._inflight.pop(tenant, None)

    def in_flight(self, tenant: str) -> int:
        return self._inflight.get(tenant, 0)

    def record(self, tenant: str, alias: str, version: str, result: str, prompt_tokens: int, cached_tokens: int,
               completion_tokens: int, peak: int) -> None:
        """One settled request, in the minute it settled."""
        now = int(self.clock())
        key = (now - now % 60, tenant, alias, version, result)
        b = self._buckets.get(key)
        if b is None:
            self._buckets[key] = [1, prompt_tokens, cached_tokens, completion_tokens, peak]
            return
        b[0] += 1
        b[1] += prompt_tokens
        b[2] += cached_tokens
        b[3] += completion_tokens
        if peak > b[4]:
            b[4] = peak

    def take(self) -> dict[Key, list[int]]:
        """The buckets so far; the ledger starts afresh."""
        out, self._buckets = self._buckets, {}
        return out

    def __len__(self) -> int:
        return len(self._buckets)


def merge(into: dict[Key, list[int]], more: dict[Key, list[int]]) -> None:
    for key, c in more.items():
        b = into.get(key)
        if b is None:
            into[key] = c
        else:
            for i in range(4):
                b[i] += c[i]
            if c[4] > b[4]:
                b[4] = c[4]


def buckets(rows: dict[Key, list[int]]) -> list[Row]:
    """``rows`` as flushed, in key order."""
    return [(*k, *rows[k]) for k in sorted(rows)]  # type: ignore[misc]


class UsageWriter(Protocol):
    async def __call__(self, gateway: str, seq: int, rows: Sequence[Row]) -> bool:
        """Apply one flush (``registry.usage.apply_flush``): True applied now, False applied before."""


class LedgerMetrics(Protocol):
    def usage_flushed(self, pending: int, failed: bool, dropped: int, at: float | None) -> None:
        """After each flush: buckets waiting, whether it failed, buckets dropped, when it succeeded."""


def gateway_id() -> str:
    """This process's name in ``usage_flushes``: host and pid for people, a random part so that a
    restarted gateway (same host, maybe the same pid) never reuses a (gateway, seq)."""
    return f"{socket.gethostname()[:80]}-{os.getpid()}-{os.urandom(6).hex()}"


@dataclass(slots=True)
class _Flush:
    """A flush whose commit outcome is unknown: retried with the same seq and rows."""

    seq: int
    rows: list[Row]
    first_tried: float


class LedgerFlusher:
    """Hands ``ledger``'s buckets to ``write`` every ``interval_s`` (see the module docstring)."""

    def __init__(self, ledger: UsageLedger, write: UsageWriter, *, interval_s: float = 10.0,
                 max_pending: int = 100_000, metrics: LedgerMetrics | None = None, gateway: str | None = None,
                 write_timeout_s: float = 30.0, give_up_s: float = 6 * 3600.0) -> None:
        self.ledger = ledger
        self.write = write
        self.interval_s = interval_s
        self.max_pending = max_pending
        self.metrics = metrics
        self.gateway = gateway or gateway_id()
        self.write_timeout_s = write_timeout_s
        self.give_up_s = give_up_s
        """A flush in doubt this long is dropped (counted): ``registry.usage.FLUSH_KEEP_S`` is longer."""
        self.seq = 0
        self.unsent: dict[Key, list[int]] = {}
        self.in_doubt: list[_Flush] = []
        self.dropped = 0
        self.failures = 0
        self.last_success: float | None = None
        self._lock = asyncio.Lock()

    @property
    def pending(self) -> int:
        """Buckets waiting for the database (unsent and in doubt)."""
        return len(self.unsent) + sum(len(f.rows) for f in self.in_doubt)

    async def _try(self, seq: int, rows: list[Row]) -> bool | None:
        """True: applied (now or before); False: surely not applied; None: in doubt."""
        from registry.usage import FlushInDoubt, FlushNotApplied  # with the database (keeps startup light)

        try:
            async with asyncio.timeout(self.write_timeout_s):
                await self.write(self.gateway, seq, rows)
            return True
        except FlushNotApplied as exc:
            log.warning("usage flush %d not written (retried next interval): %s", seq, exc)
            return False
        except (FlushInDoubt, TimeoutError) as exc:
            log.warning("usage flush %d: commit outcome unknown (retried as it is): %s", seq, exc)
            return None
        except Exception:  # not the database's answer: retried as it is, which can never add it twice
            log.exception("usage flush %d failed (retried as it is)", seq)
            return None

    async def flush(self) -> bool:
        """One flush round: True when nothing is left waiting."""
        async with self._lock:
            return await self._flush()

    async def _flush(self) -> bool:
        merge(self.unsent, self.ledger.take())
        failed = False
        dropped = 0
        now = time.monotonic()
        while self.in_doubt:
            f = self.in_doubt[0]
            if now - f.first_tried > self.give_up_s:
                dropped += len(f.rows)
                self.in_doubt.pop(0)
                log.error("usage flush %d dropped: its outcome stayed unknown for %.0f s", f.seq, now - f.first_tried)
                continue
            if await self._try(f.seq, f.rows) is not True:
                failed = True
                break
            self.in_doubt.pop(0)
        if not failed and self.unsent:
            self.seq += 1
            seq, rows = self.seq, buckets(self.unsent)
            sent, self.unsent = self.unsent, {}
            try:
                done = await self._try(seq, rows)
            except BaseException:  # cancelled (shutdown, drain's deadline): maybe mid-commit
                self.in_doubt.append(_Flush(seq, rows, now))
                raise
            if done is False:
                merge(self.unsent, sent)  # buckets that arrived meanwhile are in the ledger, not here
                failed = True
            elif done is None:
                self.in_doubt.append(_Flush(seq, rows, now))
                failed = True
        dropped += self._trim()
        if failed:
            self.failures += 1
        else:
            self.last_success = time.time()
        self.dropped += dropped
        if self.metrics is not None:
            self.metrics.usage_flushed(self.pending, failed, dropped, None if failed else self.last_success)
        return not failed and not self.unsent and not self.in_doubt

    def _trim(self) -> int:
        """Drop the oldest waiting buckets beyond ``max_pending``; how many were dropped."""
        excess = self.pending - self.max_pending
        if excess <= 0:
            return 0
        n = excess
        while excess > 0 and self.in_doubt:
            f = self.in_doubt[0]
            if len(f.rows) <= excess:
                excess -= len(f.rows)
                self.in_doubt.pop(0)
            else:  # rows are in key order: the oldest minutes first
                f.rows = f.rows[excess:]
                excess = 0
        if excess > 0:
            for key in sorted(self.unsent)[:excess]:
                del self.unsent[key]
        log.error("usage ledger: %d buckets dropped (more than %d waited for the database)", n, self.max_pending)
        return n

    async def run(self) -> None:
        """Flush every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.flush()
            except Exception:
                log.exception("usage flush failed")

    async def drain(self, timeout_s: float = 10.0, retry_s: float = 0.5) -> bool:
        """Flush until nothing waits (requests settling meanwhile included) or ``timeout_s``
        passed: True when everything was written."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                    done = await self.flush()
            except TimeoutError:
                done = False
            if done and not len(self.ledger):
                return True
            if time.monotonic() + retry_s >= deadline:
                log.error("usage ledger: %d buckets not written at shutdown", self.pending + len(self.ledger))
                return False
            if not done:
                await asyncio.sleep(retry_s)

