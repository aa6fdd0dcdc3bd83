"""Per-tenant limits: requests/min, tokens/min and concurrent requests.

Both limiters implement one interface (``Limiter``):

* ``acquire(tenant, limits, tokens, max_hold_s) -> Decision`` reserves one request, a
  concurrency slot and ``tokens`` (prompt tokens + ``max_tokens``, ``gateway.validate.reserve``)
  *before* the request is admitted, so a concurrent burst can never spend more than the
  budget; a refusal's ``retry-after`` is when the bucket would hold ``tokens``, or for a
  concurrency refusal when the earliest held slot's lease lapses were its holder to stop
  renewing it (at least 1 s, at most ``lease_ttl_s``);
* ``settle(lease, used_tokens)`` returns the unused part of the reservation (or charges
  the overshoot) and frees the concurrency slot; ``settle_nowait`` does the same without
  waiting (the gateway's requests end with it: the Redis limiter sends it before any later
  acquire of the same replica, or within ``settle_delay_s``).

Requests and tokens are token buckets that refill continuously (capacity = the
per-minute limit). Concurrency slots are leases (``gateway.leases``): lease ids in a sorted
set scored by when they lapse, ``lease_ttl_s`` after they were taken or last renewed, pruned
on every acquire. The gateway holding a slot renews it while its request runs (for at most
``max_hold_s``), so a gateway that dies holding slots loses them within ``lease_ttl_s``.

``RedisLimiter`` keeps the state in Redis and does each step in one atomic Lua script,
sent through ``redis.asyncio``: the calls of one event-loop step go out in one round trip.
Its keepalive task (``start``) renews every held lease, beats the gateway's heart and probes
Redis in one round trip every ``lease_ttl_s / 3``. When Redis is unreachable it degrades to a
per-replica ``LocalLimiter`` admitting this replica's share of each limit (1/N of it, N the
gateways last seen in Redis; fail mode ``open``) or refuses with 503 (fail mode ``closed``),
and goes back to Redis when it answers again. An acquire carries the deadline after which the
gateway no longer waits for it: Redis refuses it past then, so an acquire the gateway gave up
on (a hung Redis that resumes) never leaves a lease behind. ``LocalLimiter`` alone is the
embedded default (no ``redis_url``). A limit of 0 means unlimited.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from gateway.leases import KEEPALIVE, HeldLeases

if TYPE_CHECKING:
    from redis.commands.core import AsyncScript as Script

log = logging.getLogger("loraplex.gateway.ratelimit")


@dataclass(frozen=True, slots=True)
class Limits:
    requests_per_min: int = 0
    tokens_per_min: int = 0
    max_concurrent: int = 0


@dataclass(slots=True)
class Lease:
    tenant: str
    lease_id: str
    reserved: int
    tokens_per_min: int
    backend: Any
    settled: bool = False


class LeaseIds:
    """Unique lease ids without a system call each: a random per-process prefix and a counter."""

    def __init__(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._counter = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._counter):x}"


@dataclass(slots=True)
class Decision:
    allowed: bool
    lease: Lease | None
    headers: dict[str, str] = field(default_factory=dict)
    status: int = 200
    """429 over a limit, 503 when the limiter cannot decide (fail-closed)."""
    reason: str = ""
    retry_after_s: float = 0.0


class Limiter(Protocol):
    async def start(self) -> None:
        """Begin the limiter's background work (the Redis limiter's keepalive and probe)."""

    async def acquire(self, tenant: str, limits: Limits, tokens: int, max_hold_s: float) -> Decision:
        """Admit or refuse; an admitted request's slot is held until settled, at most ``max_hold_s``."""

    async def settle(self, lease: Lease, used_tokens: int) -> None: ...

    def settle_nowait(self, lease: Lease, used_tokens: int) -> None:
        """``settle`` without waiting for it to be done (failures are handled by the limiter)."""

    async def close(self) -> None: ...


DEFAULT_LEASE_TTL_S = 10.0
"""How long a concurrency lease lives unless renewed (``ratelimit_lease_ttl_s``)."""


def share(limits: Limits, gateways: int) -> Limits:
    """One replica's share of ``limits`` among ``gateways`` replicas: each set limit divided,
    rounded up, at least 1 (0 stays unlimited)."""
    if gateways <= 1:
        return limits

    def part(limit: int) -> int:
        return 0 if limit <= 0 else max(1, math.ceil(limit / gateways))

    return Limits(part(limits.requests_per_min), part(limits.tokens_per_min), part(limits.max_concurrent))


def _duration(seconds: float) -> str:
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    m, s = divmod(seconds, 60)
    return f"{int(m)}m{int(s)}s"


def _decision(allowed: bool, lease: Lease | None, limits: Limits, reason: str, rq: float, tk: float,
              wait_ms: float) -> Decision:
    h: dict[str, str] = {}
    if limits.requests_per_min > 0:
        rpm = limits.requests_per_min
        h["x-ratelimit-limit-requests"] = str(rpm)
        h["x-ratelimit-remaining-requests"] = str(max(0, math.floor(rq)))
        h["x-ratelimit-reset-requests"] = _duration(max(0.0, rpm - rq) * 60.0 / rpm)
    if limits.tokens_per_min > 0:
        tpm = limits.tokens_per_min
        h["x-ratelimit-limit-tokens"] = str(tpm)
        h["x-ratelimit-remaining-tokens"] = str(max(0, math.floor(tk)))
        h["x-ratelimit-reset-tokens"] = _duration(max(0.0, tpm - tk) * 60.0 / tpm)
    if allowed:
        return Decision(True, lease, h)
    retry = max(0.001, wait_ms / 1000.0)
    h["retry-after"] = str(max(1, math.ceil(retry)))
    h["retry-after-ms"] = str(max(1, math.ceil(wait_ms)))
    return Decision(False, None, h, 429, reason, retry)


_MESSAGES = {
    "requests": "Rate limit reached for requests per minute.",
    "tokens": "Rate limit reached for tokens per minute.",
    "too_large": "Request too large: it needs more tokens than the per-minute limit allows.",
    "concurrency": "Too many concurrent requests.",
}


def limit_message(reason: str) -> str:
    return _MESSAGES.get(reason, "Rate limit reached.")


# ---------------------------------------------------------------------------------------------
# Redis

_ACQUIRE = """
local kh = KEYS[1]
local kc = KEYS[2]
local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
local maxc = tonumber(ARGV[3])
local ttl = tonumber(ARGV[4])
local deadline = tonumber(ARGV[6])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if deadline > 0 and now > deadline then
  return {'late', tostring(now)}
end
local h = redis.call('HMGET', kh, 'rq', 'rt', 'tk', 'tt')
local function level(v, ts, cap)
  if cap <= 0 then return 0 end
  local l = tonumber(v)
  local s = tonumber(ts)
  if l == nil or s == nil then return cap end
  l = l + (now - s) * cap / 60000
  if l > cap then l = cap end
  return l
end
local rq = level(h[1], h[2], rpm)
local tk = level(h[3], h[4], tpm)
local inflight = 0
if maxc > 0 then
  redis.call('ZREMRANGEBYSCORE', kc, '-inf', now)
  inflight = redis.call('ZCARD', kc)
end
local soonest = nil
local out = {}
local slots = {}
for need, lease in string.gmatch(ARGV[5], '(%S+) (%S+)') do
  need = tonumber(need)
  local reason = ''
  local wait = 0
  if rpm > 0 and rq < 1 then
    reason = 'requests'
    wait = (1 - rq) * 60000 / rpm
  end
  if tpm > 0 and need > tpm then
    reason = 'too_large'
    wait = 60000
  elseif tpm > 0 and tk < need then
    local w = (need - tk) * 60000 / tpm
    if w > wait then wait = w end
    if reason == '' then reason = 'tokens' end
  end
  if maxc > 0 and inflight >= maxc then
    if reason == '' then reason = 'concurrency' end
    if soonest == nil then
      local first = redis.call('ZRANGE', kc, 0, 0, 'WITHSCORES')
      soonest = tonumber(first[2]) or (now + ttl)
    end
    if soonest - now > wait then wait = soonest - now end
  end
  if reason == '' then
    if rpm > 0 then rq = rq - 1 end
    if tpm > 0 then tk = tk - need end
    if maxc > 0 then
      inflight = inflight + 1
      slots[#slots + 1] = now + ttl
      slots[#slots + 1] = lease
    end
  end
  out[#out + 1] = reason
  out[#out + 1] = tostring(rq)
  out[#out + 1] = tostring(tk)
  out[#out + 1] = tostring(wait)
end
if #slots > 0 then
  redis.call('ZADD', kc, unpack(slots))
  if redis.call('PTTL', kc) < ttl + 1000 then
    redis.call('PEXPIRE', kc, ttl + 1000)
  end
end
redis.call('HSET', kh, 'rq', tostring(rq), 'rt', now, 'tk', tostring(tk), 'tt', now)
redis.call('PEXPIRE', kh, 120000)
out[#out + 1] = tostring(now)
return out
"""
"""Acquires the ``need lease`` pairs of ``ARGV[5]`` in turn, as many calls one after
the other would: four strings per pair (reason or '', requests left, tokens left, wait ms),
then Redis's time (ms). Leases lapse ``ARGV[4]`` ms from now unless renewed; a concurrency
refusal waits until the earliest lease lapses. Past ``ARGV[6]`` (Redis time, ms; 0: none),
when the gateway no longer waits for the answer, it changes nothing and answers
``{'late', now}``."""

_SETTLE = """
local kh = KEYS[1]
local kc = KEYS[2]
local tpm = tonumber(ARGV[1])
local leases = {}
local refunds = {}
for refund, lease in string.gmatch(ARGV[2], '(%S+) (%S+)') do
  refunds[#refunds + 1] = tonumber(refund)
  leases[#leases + 1] = lease
end
redis.call('ZREM', kc, unpack(leases))
local any = false
for _, refund in ipairs(refunds) do
  if refund ~= 0 then any = true end
end
if tpm > 0 and any then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local h = redis.call('HMGET', kh, 'tk', 'tt')
  local l = tonumber(h[1])
  local s = tonumber(h[2])
  if l == nil or s == nil then l = tpm else l = l + (now - s) * tpm / 60000 end
  for _, refund in ipairs(refunds) do
    if refund ~= 0 then
      l = l + refund
      if l > tpm then l = tpm end
    end
  end
  redis.call('HSET', kh, 'tk', tostring(l), 'tt', now)
  redis.call('PEXPIRE', kh, 120000)
end
return 1
"""
"""Settles the ``refund lease`` pairs of ``ARGV[2]`` in turn: frees each lease's
slot and returns its unused tokens (a negative refund charges an overshoot)."""

MAX_BATCH = 512
"""Calls joined into one script call at most (the scripts ``unpack`` their leases)."""


class _Call:
    """Calls of one script with the same keys and leading arguments queued in one event-loop
    step, sent as a single ``EVALSHA`` whose last argument carries each call's own part in
    turn, space-separated (the scripts loop over them): Redis and redis-py spend most of a
    call on the call and on each argument, and under load dozens of settlements and several
    acquires share one call of a few arguments."""

    __slots__ = ("deadline", "head", "parts", "script", "waiters")

    def __init__(self, script: Script, head: tuple[bytes, ...], deadline: bool) -> None:
        self.script = script
        self.head = head
        """``EVALSHA sha numkeys keys... const...``, encoded."""
        self.deadline = deadline
        """Send the round trip's deadline on Redis's clock after the parts (``_StepPipeline.deadline``)."""
        self.parts: list[str] = []
        self.waiters: list[asyncio.Future[Any]] = []
        """One future per caller that waits: a caller that gives up cancels its own only."""

    def resolve(self, reply: Any) -> None:
        """Pass the reply (an exception when the call failed) on to the waiting callers."""
        for waiter in self.waiters:
            if not waiter.done():
                if isinstance(reply, BaseException):
                    waiter.set_exception(reply)
                else:
                    waiter.set_result(reply)


class _StepPipeline:
    """Sends the script calls made in one event-loop step in one round trip on a redis-py
    connection of its own (``_own_connection``), calls of one script with the same keys and
    leading arguments joined into one (``_Call``).

    One pipeline is in flight at a time and calls queued meanwhile go in the next, so Redis
    runs the calls in the order they were made (a settlement before any later acquire of
    this replica). A ``NOSCRIPT`` reply (Redis restarted or flushed its scripts) loads the
    scripts and sends the refused calls again before anything queued after them; any other
    failure goes to every caller of the pipeline and to ``on_failure``.

    A call joined with ``deadline`` gets one more argument: when the round trip stops being
    waited for, on Redis's clock (``clock_offset_ms``, measured by the limiter), so that Redis
    can refuse what the gateway no longer waits for.
    """

    def __init__(self, redis: Any, scripts: list[Script], *, timeout_s: float,
                 on_failure: Callable[[BaseException], None]) -> None:
        self.redis = redis
        self.scripts = scripts
        self.timeout_s = timeout_s
        self.on_failure = on_failure
        from hiredis import pack_command  # lazy: the embedded gateway never loads redis
        from redis.exceptions import NoScriptError, ResponseError

        self._pack = pack_command
        self._noscript = NoScriptError
        self._response_error = ResponseError
        self._conn: Any = None
        """The pipeline's own connection (``_own_connection``), made on first use."""
        self._closing: set[asyncio.Task[None]] = set()
        """Disconnects of connections given up on (``reconnect``)."""
        self._queue: list[_Call] = []
        self._open: dict[tuple[Any, ...], _Call] = {}
        """Calls still taking company (until the queue is sent)."""
        self._heads: dict[tuple[Any, ...], tuple[bytes, ...]] = {}
        """Encoded command heads by script, keys and leading arguments."""
        self._sender: asyncio.Task[None] | None = None
        self._loop: Any = None
        """The loop the sender runs on."""
        self._timer: asyncio.TimerHandle | None = None
        """Sends deferred calls that found no company (``_deferred``)."""
        self._timer_loop: Any = None
        self._watch: asyncio.TimerHandle | None = None
        """The round trips' watchdog (``_watchdog``)."""
        self._due = 0.0
        """When the round trip in flight times out (0: none in flight)."""
        self._expired = False
        self.clock_offset_ms: float | None = None
        """Redis's clock less this host's (ms), as last measured; None: not yet known."""

    def deadline(self) -> bytes:
        """The Redis time (ms) after which the round trip in flight is no longer waited for,
        a tenth of ``timeout_s`` early (the answer still has to travel back); ``0``: no clock
        offset known yet. The offset is measured as Redis's time in a reply less this host's
        when the reply arrived, so it errs early, never late."""
        if self.clock_offset_ms is None or not self._due:
            return b"0"
        left_s = self._due - self._loop.time() - 0.1 * self.timeout_s
        return b"%d" % int(time.time() * 1000 + left_s * 1000 + self.clock_offset_ms)

    def join(self, script: Script, keys: list[str], const: list[Any], part: str, *,
             defer_s: float = 0.0, wait: bool = True,
             deadline: bool = False) -> tuple[int, asyncio.Future[Any] | None]:
        """Queue a call of ``script`` with its own ``part`` of the last argument, joined to the
        open call of its keys and ``const`` leading arguments: this call's index among the
        joined ones, and (``wait``) a future of its own for their reply. ``defer_s``: the call
        may wait that long for company (a settlement rides along with the next acquire
        instead of costing a round trip of its own). ``deadline``: the script takes the round
        trip's deadline (``deadline()``) after ``part``."""
        key = (script.sha, *keys, *const)
        call = self._open.get(key)
        if call is None or len(call.parts) >= MAX_BATCH:
            head = self._heads.get(key)
            if head is None:
                if len(self._heads) >= 10_000:
                    self._heads.clear()
                head = self._heads[key] = (b"EVALSHA", script.sha.encode(), b"%d" % len(keys),
                                           *(k.encode() for k in keys), *(str(c).encode() for c in const))
            call = self._open[key] = _Call(script, head, deadline)
            self._queue.append(call)
        call.parts.append(part)
        fut = None
        loop = self._loop
        if loop is None or not loop.is_running():  # asking asyncio costs a getpid call on 3.11
            loop = asyncio.get_running_loop()
        if wait:
            fut = loop.create_future()
            call.waiters.append(fut)
        self._kick(defer_s, loop)
        return len(call.parts) - 1, fut

    def _kick(self, defer_s: float, loop: asyncio.AbstractEventLoop) -> None:
        if self._sender is not None:
            return  # the running sender takes the queue after its pipeline
        if defer_s > 0:
            # One timer at a time, left to run out rather than cancelled when the queue goes
            # out sooner (arming and cancelling one per settlement cost more than the rest of it).
            if self._timer is None or self._timer_loop is not loop:
                self._timer = loop.call_later(defer_s, self._deferred, loop)
                self._timer_loop = loop
            return
        if loop is not self._loop:
            self._loop = loop
            self._watch = None  # a timer of another loop never fires here
        # A task's first step runs after the callbacks already due: the calls of this step join.
        self._sender = loop.create_task(self._send_queued())

    def _deferred(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        if self._queue:
            self._kick(0.0, loop)

    async def _send_queued(self) -> None:
        try:
            while self._queue:
                calls, self._queue = self._queue, []
                self._open.clear()
                await self._send(calls)
        finally:
            self._sender = None

    async def _send(self, calls: list[_Call]) -> None:
        loop = self._loop
        self._due = loop.time() + self.timeout_s
        if self._watch is None:
            self._watch = loop.call_at(self._due, self._watchdog)
        try:
            replies = await self._execute(calls)
            refused = [i for i, r in enumerate(replies) if isinstance(r, self._noscript)]
            if refused:
                await self._execute_commands([("SCRIPT", "LOAD", s.script) for s in self.scripts])
                again = await self._execute([calls[i] for i in refused])
                for i, reply in zip(refused, again, strict=True):
                    replies[i] = reply
        except Exception as exc:  # connection problems: every caller sees them
            replies = [exc] * len(calls)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not self._expired or task is None or task.uncancel() > 0:
                # The sender itself cancelled (the loop shuts down).
                self._expired = False
                for call in calls:
                    call.resolve(ConnectionError("the Redis limiter was stopped"))
                raise
            self._expired = False  # cut short by the watchdog: a timeout, as every caller sees it
            replies = [TimeoutError(f"no answer from Redis within {self.timeout_s:g} s")] * len(calls)
        finally:
            self._due = 0.0
        failure = next((r for r in replies if isinstance(r, Exception)), None)
        if failure is not None:
            self.on_failure(failure)
        for call, reply in zip(calls, replies, strict=True):
            call.resolve(reply)

    def _watchdog(self) -> None:
        """Cancels the sender when its round trip runs past ``timeout_s`` (``_send`` answers
        its callers with a timeout). One timer, moved on while round trips end in time,
        instead of an ``asyncio.timeout`` (a timer armed and cancelled) per round trip."""
        self._watch = None
        if not self._due or self._sender is None:
            return  # nothing in flight: the next round trip arms it again
        loop = self._loop
        if loop.time() < self._due:
            self._watch = loop.call_at(self._due, self._watchdog)
            return
        self._expired = True
        self._sender.cancel()

    async def _execute(self, calls: list[_Call]) -> list[Any]:
        deadline = self.deadline()
        return await self._execute_commands([(*c.head, " ".join(c.parts).encode(), deadline) if c.deadline
                                             else (*c.head, " ".join(c.parts).encode()) for c in calls])

    async def _execute_commands(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """One round trip: ``commands`` written at once, their replies read in order (an error
        reply in its place, like a pipeline's ``raise_on_error=False``)."""
        conn = self._conn
        if conn is None:
            conn = self._conn = _own_connection(self.redis)
        # hiredis packs in C what redis-py's ``pack_commands`` packs in Python (the same bytes).
        pack = self._pack
        packed = b"".join([pack(c) for c in commands])
        await conn.send_packed_command(packed, check_health=False)
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(await conn.read_response())
            except self._response_error as exc:
                replies.append(exc)
        return replies

    def reconnect(self) -> None:
        """Redis was found away: the next round trip opens a new connection. An idle replica's
        connection outlives a Redis restart unseen, and its first round trip after the keepalive
        saw Redis back would fail on it (a second of fail-open shares or fail-closed 503s)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            task = asyncio.get_running_loop().create_task(conn.disconnect())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Send what is still queued (settlements waiting for company) and wait for it."""
        if self._queue and self._sender is None:
            self._kick(0.0, asyncio.get_running_loop())
        if self._sender is not None:
            await asyncio.shield(self._sender)
        for timer in (self._timer, self._watch):
            if timer is not None:
                timer.cancel()
        self._timer = self._watch = None
        if self._conn is not None:
            conn, self._conn = self._conn, None
            await conn.disconnect()


def _own_connection(redis: Any) -> Any:
    """A connection of the pipeline's own, with the settings of ``redis``'s pool but no socket
    timeout: the pipeline's ``timeout_s`` bounds each round trip already, and with a socket
    timeout redis-py wraps every send in ``asyncio.wait_for`` (a task each on Python 3.11) and
    every read in a timeout context, which cost more CPU than the rest of the round trip
    (docs/DESIGN.md, "Gateway"). A connection error or a cut-short round trip disconnects
    it; the next round trip connects again."""
    pool = redis.connection_pool
    return pool.connection_class(**{**pool.connection_kwargs, "socket_timeout": None})


class RedisLimiter:
    """Limits shared by every gateway replica, kept in Redis (``redis.asyncio`` client)."""

    def __init__(self, redis: Any, prefix: str = "loraplex", *, fail_mode: Literal["open", "closed"] = "open",
                 fallback: LocalLimiter | None = None, retry_s: float = 1.0, timeout_s: float = 1.0,
                 lease_ttl_s: float = DEFAULT_LEASE_TTL_S) -> None:
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be positive, not {lease_ttl_s}")
        self.redis = redis
        self.prefix = f"{prefix}:rl:"
        self.fail_mode = fail_mode
        self.lease_ttl_s = lease_ttl_s
        """A concurrency lease lapses this long after it was taken or last renewed."""
        self.keepalive_s = lease_ttl_s / 3
        """How often the keepalive renews the held leases and probes Redis (while it answers)."""
        self.fallback = fallback or LocalLimiter(lease_ttl_s=lease_ttl_s)
        self.retry_s = retry_s
        """How long the limiter stays on its fallback after Redis failed before trying it again
        (and how often the keepalive probes Redis meanwhile)."""
        self.timeout_s = timeout_s
        self._ttl_ms = max(1, int(lease_ttl_s * 1000))
        self._acquire = redis.register_script(_ACQUIRE)
        self._settle = redis.register_script(_SETTLE)
        self._keepalive = redis.register_script(KEEPALIVE)
        self._pipe = _StepPipeline(redis, [self._acquire, self._settle], timeout_s=timeout_s,
                                   on_failure=self._failed)
        self._keys: dict[str, list[str]] = {}
        self._lease_ids = LeaseIds()
        self.gateway_id = os.urandom(8).hex()
        """This replica's id in the gateways set (``{prefix}:gateways``)."""
        self._gateways_key = f"{prefix}:gateways"
        self.gateways = 1
        """Gateways seen beating within ``lease_ttl_s`` when Redis last answered (at least 1):
        the fallback admits 1/``gateways`` of each limit."""
        self._held = HeldLeases()
        self._keeper: asyncio.Task[None] | None = None
        self._stopping = False
        self._wake = asyncio.Event()
        """Set when a request finds Redis away: the keepalive probes it ``retry_s`` later."""
        self._down_until = 0.0
        self.degraded = False
        self.settle_delay_s = 0.005
        """Settlements wait up to this long to share a round trip with the next acquire."""

    def _tenant_keys(self, tenant: str) -> list[str]:
        """The tenant's bucket hash and concurrency set (built once per tenant)."""
        keys = self._keys.get(tenant)
        if keys is None:
            if len(self._keys) >= 50_000:
                self._keys.clear()
            base = self.prefix + tenant
            keys = self._keys[tenant] = [base, base + ":c"]
        return keys

    def _failed(self, exc: BaseException) -> None:
        self._pipe.reconnect()
        if not self.degraded:
            self._wake.set()
            log.warning("redis limiter unreachable (%s: %s); %s", type(exc).__name__, exc,
                        f"using the local limiter (1/{self.gateways} of each limit)" if self.fail_mode == "open"
                        else "refusing requests")
        self.degraded = True
        self._down_until = time.monotonic() + self.retry_s

    def _reached(self) -> None:
        if self.degraded:
            log.warning("redis limiter reachable again")
            self.degraded = False
            self._down_until = 0.0

    def _clock(self, redis_ms: Any) -> None:
        """Redis's time in a reply that just arrived: the clock offset the acquires' deadlines use."""
        self._pipe.clock_offset_ms = float(redis_ms) - time.time() * 1000

    # -- keepalive --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the keepalive (idempotent; the first acquire starts it too): every
        ``keepalive_s`` (``retry_s`` while Redis is away) one round trip renews the leases this
        replica holds, beats its heart in the gateways set and tells whether Redis answers."""
        if self._keeper is None or self._keeper.done():
            self._keeper = asyncio.get_running_loop().create_task(self._keep(), name="ratelimit-keepalive")

    async def _keep(self) -> None:
        # A timer sets ``_wake`` rather than a timeout around the wait: a cancellation that met
        # an expiring ``asyncio.timeout`` was taken for the timeout (Python 3.11), and the loop
        # then outlived ``close``. ``_stopping`` ends it even so.
        loop = asyncio.get_running_loop()
        while not self._stopping:
            await self.keepalive()
            self._wake.clear()
            if not self.degraded and not self._stopping:
                timer = loop.call_later(self.keepalive_s, self._wake.set)
                try:
                    await self._wake.wait()  # the interval, or a request found Redis away meanwhile
                finally:
                    timer.cancel()
            if self.degraded and not self._stopping:
                await asyncio.sleep(self.retry_s)

    async def keepalive(self) -> bool:
        """One keepalive round trip (``gateway.leases.KEEPALIVE``): True when Redis answered."""
        keys = [self._gateways_key]
        args: list[Any] = [self._ttl_ms, self.gateway_id, self._ttl_ms]
        for key, lease_ids in self._held.renewable().items():
            keys.append(key)
            args.append(" ".join(lease_ids))
        try:
            async with asyncio.timeout(self.timeout_s):
                gateways, _renewed, now = await self._keepalive(keys=keys, args=args)
        except Exception as exc:
            self._failed(exc)
            return False
        self._clock(now)
        self.gateways = max(1, int(gateways))
        self._reached()
        return True

    @property
    def held(self) -> int:
        """Concurrency leases this replica holds in Redis now."""
        return len(self._held)

    # -- acquire and settle -----------------------------------------------------------------------

    async def _degraded(self, tenant: str, limits: Limits, tokens: int, max_hold_s: float) -> Decision:
        if self.fail_mode == "open":
            return await self.fallback.acquire(tenant, share(limits, self.gateways), tokens, max_hold_s,
                                               largest=limits.tokens_per_min)
        return Decision(False, None, {"retry-after": str(max(1, math.ceil(self.retry_s)))}, 503, "unavailable",
                        self.retry_s)

    async def acquire(self, tenant: str, limits: Limits, tokens: int, max_hold_s: float) -> Decision:
        if self._keeper is None:
            await self.start()
        if self._down_until and time.monotonic() < self._down_until:
            return await self._degraded(tenant, limits, tokens, max_hold_s)
        lease_id = self._lease_ids.next()
        keys = self._tenant_keys(tenant)
        i, fut = self._pipe.join(self._acquire, keys,
                                 [limits.requests_per_min, limits.tokens_per_min, limits.max_concurrent,
                                  self._ttl_ms], f"{tokens} {lease_id}", deadline=True)
        try:
            reply = await fut  # type: ignore[misc]
        except asyncio.CancelledError:
            if limits.max_concurrent > 0:  # its lease, if Redis grants it, goes straight away
                self._pipe.join(self._settle, keys, [limits.tokens_per_min], f"0 {lease_id}",
                                defer_s=self.settle_delay_s, wait=False)
            raise
        except Exception:  # the pipeline reported it (``_failed``)
            return await self._degraded(tenant, limits, tokens, max_hold_s)
        if reply[0] in (b"late", "late"):  # Redis ran it after its deadline: nothing was taken
            self._clock(reply[1])
            self._failed(TimeoutError(f"Redis answered after {self.timeout_s:g} s"))
            return await self._degraded(tenant, limits, tokens, max_hold_s)
        if self._pipe.clock_offset_ms is None:
            self._clock(reply[-1])
        if self.degraded:
            self._reached()
        reason, rq, tk, wait = reply[4 * i: 4 * i + 4]
        reason = reason.decode() if isinstance(reason, bytes) else reason
        if reason:
            return _decision(False, None, limits, reason, float(rq), float(tk), float(wait))
        if limits.max_concurrent > 0:
            self._held.hold(keys[1], lease_id, time.monotonic() + max_hold_s)
        lease = Lease(tenant, lease_id, tokens, limits.tokens_per_min, self)
        return _decision(True, lease, limits, reason, float(rq), float(tk), float(wait))

    def _join_settle(self, lease: Lease, used_tokens: int, wait: bool) -> asyncio.Future[Any] | None:
        keys = self._tenant_keys(lease.tenant)
        self._held.release(keys[1], lease.lease_id)
        return self._pipe.join(self._settle, keys, [lease.tokens_per_min],
                               f"{lease.reserved - used_tokens} {lease.lease_id}", defer_s=self.settle_delay_s,
                               wait=wait)[1]

    async def settle(self, lease: Lease, used_tokens: int) -> None:
        if lease.settled:
            return
        lease.settled = True
        if lease.backend is not self:
            await lease.backend.settle(lease, used_tokens)
            return
        # A failure is reported by the pipeline: the concurrency slot lapses by itself (no
        # longer renewed) and the token refund is lost (conservative).
        with contextlib.suppress(Exception):
            await self._join_settle(lease, used_tokens, True)

    def settle_nowait(self, lease: Lease, used_tokens: int) -> None:
        """``settle`` without waiting for Redis: the request is answered and nothing depends on
        the reply (the pipeline deals with failures as it does for ``settle``)."""
        if lease.settled:
            return
        if lease.backend is not self:
            lease.backend.settle_nowait(lease, used_tokens)
            return
        lease.settled = True
        self._join_settle(lease, used_tokens, False)

    async def close(self) -> None:
        """Stop the keepalive, leave the gateways set and send what is still queued."""
        if self._keeper is not None:
            self._stopping = True
            self._wake.set()
            self._keeper.cancel()
            await asyncio.wait({self._keeper}, timeout=self.timeout_s + 1)
            self._keeper = None
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.timeout_s):
                    await self.redis.zrem(self._gateways_key, self.gateway_id)
        await self._pipe.close()
        await self.fallback.close()


# ---------------------------------------------------------------------------------------------
# In-process


class _Bucket:
    __slots__ = ("leases", "rq", "rt", "tk", "tt")

    def __init__(self) -> None:
        self.rq: float | None = None
        self.rt = 0.0
        self.tk: float | None = None
        self.tt = 0.0
        self.leases: dict[str, tuple[float, float]] = {}
        """Lease id -> (when taken, when no longer held: its ``max_hold_s``)."""


def _level(value: float | None, ts: float, cap: int, now: float) -> float:
    if cap <= 0:
        return 0.0
    if value is None:
        return float(cap)
    return min(float(cap), value + (now - ts) * cap / 60.0)


class LocalLimiter:
    """The same limits in this process only (embedded default, and Redis fallback).

    Its leases cannot outlive their holder (the process), so a held lease stays until settled
    or ``max_hold_s``; a concurrency refusal's ``retry-after`` is the one a Redis limiter gives,
    when the earliest held lease would lapse were its holder to stop renewing it now (held
    leases count as renewed every ``lease_ttl_s / 3`` since taken): between 2/3 of
    ``lease_ttl_s`` and ``lease_ttl_s``, or the earlier end of its hold."""

    def __init__(self, max_tenants: int = 100_000, *, lease_ttl_s: float = DEFAULT_LEASE_TTL_S) -> None:
        self._buckets: dict[str, _Bucket] = {}
        self.max_tenants = max_tenants
        self.lease_ttl_s = lease_ttl_s
        self._lease_ids = LeaseIds()

    async def start(self) -> None:
        """Nothing runs in the background: in-process leases need no renewing."""

    def _soonest_lapse(self, b: _Bucket, now: float) -> float:
        ttl = self.lease_ttl_s
        period = ttl / 3
        return min(min(until, taken + ttl + (now - taken) // period * period)
                   for taken, until in b.leases.values())

    async def acquire(self, tenant: str, limits: Limits, tokens: int, max_hold_s: float, *,
                      largest: int = 0) -> Decision:
        """``largest``: the largest reservation admitted (0: ``tokens_per_min``); one over the
        bucket's capacity goes when the bucket is full and leaves it owing the rest (the Redis
        limiter's fallback: a replica's share of the tokens may be less than one request)."""
        now = time.monotonic()
        b = self._buckets.get(tenant)
        if b is None:
            if len(self._buckets) >= self.max_tenants:
                self._buckets.pop(next(iter(self._buckets)))
            b = self._buckets[tenant] = _Bucket()
        rpm, tpm, maxc = limits.requests_per_min, limits.tokens_per_min, limits.max_concurrent
        rq = _level(b.rq, b.rt, rpm, now)
        tk = _level(b.tk, b.tt, tpm, now)
        if maxc > 0 and b.leases:
            for lid in [k for k, (_, until) in b.leases.items() if until <= now]:
                del b.leases[lid]
        reason = ""
        wait = 0.0
        need = min(tokens, tpm)
        if rpm > 0 and rq < 1:
            reason, wait = "requests", (1 - rq) * 60000 / rpm
        if tpm > 0 and tokens > (largest or tpm):
            reason, wait = "too_large", 60000.0
        elif tpm > 0 and tk < need:
            wait = max(wait, (need - tk) * 60000 / tpm)
            reason = reason or "tokens"
        if maxc > 0 and len(b.leases) >= maxc:
            reason = reason or "concurrency"
            wait = max(wait, (self._soonest_lapse(b, now) - now) * 1000)
        lease = None
        if not reason:
            if rpm > 0:
                rq -= 1
            if tpm > 0:
                tk -= tokens
            lease = Lease(tenant, self._lease_ids.next(), tokens, tpm, self)
            if maxc > 0:
                b.leases[lease.lease_id] = (now, now + max_hold_s)
        b.rq, b.rt, b.tk, b.tt = rq, now, tk, now
        return _decision(not reason, lease, limits, reason, rq, tk, wait)

    async def settle(self, lease: Lease, used_tokens: int) -> None:
        self.settle_nowait(lease, used_tokens)

    def settle_nowait(self, lease: Lease, used_tokens: int) -> None:
        lease.settled = True
        b = self._buckets.get(lease.tenant)
        if b is None:
            return
        b.leases.pop(lease.lease_id, None)
        refund = lease.reserved - used_tokens
        if lease.tokens_per_min > 0 and refund:
            now = time.monotonic()
            b.tk = min(float(lease.tokens_per_min),
                       _level(b.tk, b.tt, lease.tokens_per_min, now) + refund)
            b.tt = now

    async def close(self) -> None:
        self._buckets.clear()
