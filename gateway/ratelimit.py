"""Per-tenant limits: requests/min, tokens/min and concurrent requests.

Both limiters implement one interface (``Limiter``):

* ``acquire(tenant, limits, tokens, lease_ttl_s) -> Decision`` reserves one request, a
  concurrency slot and ``tokens`` (prompt tokens + ``max_tokens``, ``gateway.validate.reserve``)
  *before* the request is admitted, so a concurrent burst can never spend more than the
  budget; a refusal's ``retry-after`` is when the bucket would hold ``tokens``;
* ``settle(lease, used_tokens)`` returns the unused part of the reservation (or charges
  the overshoot) and frees the concurrency slot; ``settle_nowait`` does the same without
  waiting (the gateway's requests end with it: the Redis limiter sends it before any later
  acquire of the same replica, or within ``settle_delay_s``).

Requests and tokens are token buckets that refill continuously (capacity = the
per-minute limit). Concurrency slots are lease ids in a sorted set scored by expiry,
pruned on every acquire, so a gateway that dies holding slots loses them by itself.

``RedisLimiter`` keeps the state in Redis and does each step in one atomic Lua script;
when Redis is unreachable it degrades to a per-replica ``LocalLimiter`` (fail mode
``open``) or refuses with 503 (fail mode ``closed``), and goes back to Redis when it
answers again. ``LocalLimiter`` alone is the embedded default (no ``redis_url``).
A limit of 0 means unlimited.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from gateway.resp import ReplyError, RespConnection, bulk, encode

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
    async def acquire(self, tenant: str, limits: Limits, tokens: int, lease_ttl_s: float) -> Decision: ...

    async def settle(self, lease: Lease, used_tokens: int) -> None: ...

    def settle_nowait(self, lease: Lease, used_tokens: int) -> None:
        """``settle`` without waiting for it to be done (failures are handled by the limiter)."""

    async def close(self) -> None: ...


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
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
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
local out = {}
local slots = {}
for i = 5, #ARGV, 2 do
  local need = tonumber(ARGV[i])
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
    if wait < 1000 then wait = 1000 end
  end
  if reason == '' then
    if rpm > 0 then rq = rq - 1 end
    if tpm > 0 then tk = tk - need end
    if maxc > 0 then
      inflight = inflight + 1
      slots[#slots + 1] = now + ttl
      slots[#slots + 1] = ARGV[i + 1]
    end
  end
  out[#out + 1] = reason
  out[#out + 1] = tostring(rq)
  out[#out + 1] = tostring(tk)
  out[#out + 1] = tostring(wait)
end
if #slots > 0 then
  redis.call('ZADD', kc, unpack(slots))
  redis.call('PEXPIRE', kc, ttl + 1000)
end
redis.call('HSET', kh, 'rq', tostring(rq), 'rt', now, 'tk', tostring(tk), 'tt', now)
redis.call('PEXPIRE', kh, 120000)
return out
"""
"""Acquires ``(need, lease)`` pairs (from ``ARGV[5]`` on) in turn, as many calls one after
the other would: four strings per pair (reason or '', requests left, tokens left, wait ms)."""

_SETTLE = """
local kh = KEYS[1]
local kc = KEYS[2]
local tpm = tonumber(ARGV[1])
local leases = {}
local refunds = {}
for i = 2, #ARGV, 2 do
  refunds[#refunds + 1] = tonumber(ARGV[i])
  leases[#leases + 1] = ARGV[i + 1]
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
"""Settles ``(refund, lease)`` pairs (from ``ARGV[2]`` on) in turn: frees each lease's
slot and returns its unused tokens (a negative refund charges an overshoot)."""

MAX_BATCH = 512
"""Calls joined into one script call at most (the scripts ``unpack`` their arguments)."""


_Command = tuple[Any, list[str], list[Any], bytes]
"""(script, keys, args, the same call as one encoded ``EVALSHA`` frame)."""


def script_call(script: Any, keys: list[str], args: list[Any]) -> _Command:
    """A ``_Command`` encoded in full."""
    return script, keys, args, encode(("EVALSHA", script.sha, len(keys), *keys, *args))


class _Batch:
    """Calls of one script with the same keys and leading arguments made before one flush,
    sent as a single call that carries the rest of each call's arguments in turn (the
    scripts loop over them). Redis spends most of a script call on running the script at
    all; under load dozens of settlements and several acquires share one."""

    __slots__ = ("args", "const", "encoded", "fut", "keys", "prefix", "retrying", "script", "size", "waiters",
                 "watched")

    def __init__(self, script: Any, keys: list[str], const: list[Any], prefix: bytes) -> None:
        self.script = script
        self.keys = keys
        self.const = const
        self.prefix = prefix
        """The encoded ``EVALSHA sha numkeys keys const`` (without the frame's header)."""
        self.args: list[Any] = []
        self.encoded: list[bytes] = []
        """The calls' own arguments, encoded as they come."""
        self.size = 0
        self.fut: asyncio.Future[Any] = None  # type: ignore[assignment]
        """The reply (an error reply as an exception *value*)."""
        self.waiters: list[asyncio.Future[Any]] = []
        """The futures of the calls that wait, one each: a caller that gives up cancels its
        own, never the batch's."""
        self.retrying: asyncio.Future[Any] | None = None
        self.watched = False
        """Whether something deals with the batch's failure for callers that do not wait."""

    def resolve(self, fut: asyncio.Future[Any]) -> None:
        """``fut``'s done-callback: pass the reply (or failure) on to the waiting calls."""
        exc = fut.exception()
        res = None if exc is not None else fut.result()
        for waiter in self.waiters:
            if not waiter.done():
                if exc is not None:
                    waiter.set_exception(exc)
                else:
                    waiter.set_result(res)

    def command(self) -> _Command:
        args = [*self.const, *self.args]
        frame = b"*%d\r\n" % (3 + len(self.keys) + len(args)) + self.prefix + b"".join(self.encoded)
        return self.script, self.keys, args, frame


class _Pipeliner:
    """Coalesces the script calls issued in one event-loop tick into one Redis round trip,
    and calls of one script with the same keys into one call (``join``).

    Under concurrency many requests acquire and settle at the same moment; sending them
    together saves a round trip and the per-command client overhead for each. Over plain
    TCP the frames go through the lean ``RespConnection`` (no task per batch); otherwise
    through a redis-py pipeline.
    """

    def __init__(self, redis: Any, scripts: list[Any]) -> None:
        self.redis = redis
        self.scripts = scripts
        self.conn = RespConnection.from_redis(redis)
        self._pending: list[tuple[_Command | _Batch, asyncio.Future[Any]]] = []
        self._open: dict[tuple[Any, ...], _Batch] = {}
        """Batches still taking calls (until the next flush)."""
        self._prefixes: dict[tuple[Any, ...], bytes] = {}
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def join(self, script: Any, keys: list[str], const: list[Any], args: tuple[Any, ...], *,
             defer_s: float = 0.0, wait: bool = True) -> tuple[_Batch, int, asyncio.Future[Any] | None]:
        """Add a call of ``script`` to the open batch of its keys and ``const`` leading
        arguments (opening one if needed): the batch, this call's index among its calls,
        and (``wait``) a future of its own for the batch's reply. ``defer_s`` as for ``submit``."""
        key = (script.sha, *keys, *const)
        batch = self._open.get(key)
        if batch is None or batch.size >= MAX_BATCH:
            prefix = self._prefixes.get(key)
            if prefix is None:
                if len(self._prefixes) >= 10_000:
                    self._prefixes.clear()
                prefix = self._prefixes[key] = b"".join([bulk(a) for a in ("EVALSHA", script.sha, len(keys), *keys,
                                                                           *const)])
            batch = self._open[key] = _Batch(script, keys, const, prefix)
            batch.fut = self.submit(batch, defer_s=defer_s)
            batch.fut.add_done_callback(batch.resolve)
        elif not defer_s and not self._scheduled:
            self._schedule()  # a deferred batch goes now that a call cannot wait
        batch.args += args
        batch.encoded += map(bulk, args)
        batch.size += 1
        fut = None
        if wait:
            fut = batch.fut.get_loop().create_future()
            batch.waiters.append(fut)
        return batch, batch.size - 1, fut

    def submit(self, cmd: _Command | _Batch, *, defer_s: float = 0.0) -> asyncio.Future[Any]:
        """Queue one script call (or batch); the future gets its reply (an error reply as an
        exception *value*). ``defer_s``: it may wait that long for company (settlements ride
        along with the next acquire instead of costing a round trip of their own)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending.append((cmd, fut))
        if self._scheduled:
            return fut
        if defer_s > 0:
            if self._timer is None:
                self._timer = loop.call_later(defer_s, self._flush)
            return fut
        self._schedule()
        return fut

    def _schedule(self) -> None:
        self._scheduled = True
        asyncio.get_running_loop().call_soon(self._flush)

    def spawn(self, coro: Any) -> None:
        """Run ``coro`` as a task that ``close`` waits for."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def call(self, cmd: _Command, *, defer_s: float = 0.0) -> Any:
        """``submit`` and wait: the reply, or the error raised."""
        res = await self.submit(cmd, defer_s=defer_s)
        return await self.retry(cmd, res) if isinstance(res, Exception) else res

    async def retry(self, cmd: _Command | _Batch, error: Exception) -> Any:
        """After an error reply: a ``NOSCRIPT`` (Redis restarted or flushed its scripts)
        reloads the scripts and sends ``cmd`` again; any other error is raised. (The hot
        callers await ``submit`` themselves and come here only on an error.) A batch is sent
        again once, however many of its callers ask."""
        if isinstance(cmd, _Batch):
            if cmd.retrying is None:
                cmd.retrying = asyncio.ensure_future(self.retry(cmd.command(), error))
                cmd.retrying.add_done_callback(_consume)
            return await asyncio.shield(cmd.retrying)
        res: Any = error
        if _is_noscript(res):
            await self._load_scripts()
            res = await self.submit(cmd)
        if isinstance(res, Exception):
            raise res
        return res

    def _flush(self) -> None:
        self._scheduled = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, []
        self._open.clear()
        if not pending:
            return
        batch = [(cmd.command() if isinstance(cmd, _Batch) else cmd, fut) for cmd, fut in pending]
        conn = self.conn
        if conn is not None and conn.connected:
            conn.push(b"".join([cmd[3] for cmd, _ in batch]), [fut for _, fut in batch])
            return
        self.spawn(self._run(batch))

    async def _run(self, batch: list[tuple[_Command, asyncio.Future[Any]]]) -> None:
        """The slow path: connect first, or go through redis-py (TLS, unix sockets)."""
        try:
            if self.conn is not None:
                await self.conn.connect()
                self.conn.push(b"".join([cmd[3] for cmd, _ in batch]), [fut for _, fut in batch])
                return
            pipe = self.redis.pipeline(transaction=False)
            for (script, keys, args, _), _ in batch:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            results = await pipe.execute(raise_on_error=False)
        except BaseException as exc:  # connection problems: every caller sees them
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc if isinstance(exc, Exception) else ConnectionError("cancelled"))
                    fut.exception()  # a settlement nobody waits for must not warn
            return
        for (_, fut), res in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(res)

    async def _load_scripts(self) -> None:
        if self.conn is not None:
            await self.conn.execute([("SCRIPT", "LOAD", s.script) for s in self.scripts])
        else:
            for s in self.scripts:
                await self.redis.script_load(s.script)

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, []
        self._open.clear()
        if pending:  # settlements still waiting for company
            await self._run([(cmd.command() if isinstance(cmd, _Batch) else cmd, fut) for cmd, fut in pending])
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.conn is not None:
            if self.conn.connected:  # replies come in order: once a PING is answered, so is everything before it
                with contextlib.suppress(Exception):
                    await self.conn.execute([("PING",)])
            await self.conn.close()


def _consume(fut: asyncio.Future[Any]) -> None:
    """Mark a shared future's exception retrieved (its callers may all have given up)."""
    if not fut.cancelled():
        fut.exception()


def _is_noscript(res: Any) -> bool:
    return (isinstance(res, Exception) and str(res).startswith("NOSCRIPT")) or \
        type(res).__name__ == "NoScriptError"


class RedisLimiter:
    """Limits shared by every gateway replica, kept in Redis."""

    def __init__(self, redis: Any, prefix: str = "loraplex", *, fail_mode: Literal["open", "closed"] = "open",
                 fallback: LocalLimiter | None = None, retry_s: float = 1.0) -> None:
        self.redis = redis
        self.prefix = f"{prefix}:rl:"
        self.fail_mode = fail_mode
        self.fallback = fallback or LocalLimiter()
        self.retry_s = retry_s
        self._acquire = redis.register_script(_ACQUIRE)
        self._settle = redis.register_script(_SETTLE)
        self._pipe = _Pipeliner(redis, [self._acquire, self._settle])
        self._keys: dict[str, list[str]] = {}
        self._lease_ids = LeaseIds()
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
        if not self.degraded:
            log.warning("redis limiter unreachable (%s); %s", type(exc).__name__,
                        "using the local limiter" if self.fail_mode == "open" else "refusing requests")
        self.degraded = True
        self._down_until = time.monotonic() + self.retry_s

    async def _degraded(self, tenant: str, limits: Limits, tokens: int, lease_ttl_s: float) -> Decision:
        if self.fail_mode == "open":
            return await self.fallback.acquire(tenant, limits, tokens, lease_ttl_s)
        return Decision(False, None, {"retry-after": str(max(1, math.ceil(self.retry_s)))}, 503, "unavailable",
                        self.retry_s)

    async def acquire(self, tenant: str, limits: Limits, tokens: int, lease_ttl_s: float) -> Decision:
        if self._down_until and time.monotonic() < self._down_until:
            return await self._degraded(tenant, limits, tokens, lease_ttl_s)
        lease_id = self._lease_ids.next()
        batch, i, fut = self._pipe.join(self._acquire, self._tenant_keys(tenant),
                                        [limits.requests_per_min, limits.tokens_per_min, limits.max_concurrent,
                                         int(lease_ttl_s * 1000)], (tokens, lease_id))
        try:
            res = await fut  # type: ignore[misc]
            if isinstance(res, Exception):
                res = await self._pipe.retry(batch, res)
            reason, rq, tk, wait = res[4 * i: 4 * i + 4]
        except (TimeoutError, OSError, ReplyError, _redis_errors()) as exc:
            self._failed(exc)
            return await self._degraded(tenant, limits, tokens, lease_ttl_s)
        if self.degraded:
            log.warning("redis limiter reachable again")
            self.degraded = False
            self._down_until = 0.0
        reason = reason.decode() if isinstance(reason, bytes) else reason
        lease = Lease(tenant, lease_id, tokens, limits.tokens_per_min, self) if not reason else None
        return _decision(not reason, lease, limits, reason, float(rq), float(tk), float(wait))

    async def settle(self, lease: Lease, used_tokens: int) -> None:
        if lease.settled:
            return
        lease.settled = True
        if lease.backend is not self:
            await lease.backend.settle(lease, used_tokens)
            return
        batch, _, fut = self._pipe.join(self._settle, self._tenant_keys(lease.tenant), [lease.tokens_per_min],
                                        (lease.reserved - used_tokens, lease.lease_id), defer_s=self.settle_delay_s)
        try:
            res = await fut  # type: ignore[misc]
            if isinstance(res, Exception):
                await self._pipe.retry(batch, res)
        except (TimeoutError, OSError, ReplyError, _redis_errors()) as exc:
            # The concurrency slot expires by itself; the token refund is lost (conservative).
            self._failed(exc)

    def settle_nowait(self, lease: Lease, used_tokens: int) -> None:
        """``settle`` without waiting for Redis: the request is answered, nothing depends on
        the reply, and a request task that ends at once holds its objects that much less.
        A failed batch of settlements is dealt with once, as ``settle`` would (a NOSCRIPT
        resends it, anything else turns the limiter to its fallback for a while)."""
        if lease.settled:
            return
        if lease.backend is not self:
            lease.backend.settle_nowait(lease, used_tokens)
            return
        lease.settled = True
        batch, _, _ = self._pipe.join(self._settle, self._tenant_keys(lease.tenant), [lease.tokens_per_min],
                                      (lease.reserved - used_tokens, lease.lease_id), defer_s=self.settle_delay_s,
                                      wait=False)
        if not batch.watched:
            batch.watched = True
            batch.fut.add_done_callback(lambda fut: self._settled(batch, fut))

    def _settled(self, batch: _Batch, fut: asyncio.Future[Any]) -> None:
        res = fut.exception() or fut.result()
        if not isinstance(res, Exception):
            return
        if _is_noscript(res):
            self._pipe.spawn(self._settle_again(batch, res))
        else:
            self._failed(res)

    async def _settle_again(self, batch: _Batch, error: Exception) -> None:
        try:
            await self._pipe.retry(batch, error)
        except Exception as exc:
            self._failed(exc)

    async def close(self) -> None:
        await self._pipe.close()
        await self.fallback.close()


def _redis_errors() -> type[BaseException]:
    from redis.exceptions import RedisError

    return RedisError


# ---------------------------------------------------------------------------------------------
# In-process


class _Bucket:
    __slots__ = ("leases", "rq", "rt", "tk", "tt")

    def __init__(self) -> None:
        self.rq: float | None = None
        self.rt = 0.0
        self.tk: float | None = None
        self.tt = 0.0
        self.leases: dict[str, float] = {}


def _level(value: float | None, ts: float, cap: int, now: float) -> float:
    if cap <= 0:
        return 0.0
    if value is None:
        return float(cap)
    return min(float(cap), value + (now - ts) * cap / 60.0)


class LocalLimiter:
    """The same limits in this process only (embedded default, and Redis fallback)."""

    def __init__(self, max_tenants: int = 100_000) -> None:
        self._buckets: dict[str, _Bucket] = {}
        self.max_tenants = max_tenants
        self._lease_ids = LeaseIds()

    async def acquire(self, tenant: str, limits: Limits, tokens: int, lease_ttl_s: float) -> Decision:
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
            for lid in [k for k, exp in b.leases.items() if exp <= now]:
                del b.leases[lid]
        reason = ""
        wait = 0.0
        if rpm > 0 and rq < 1:
            reason, wait = "requests", (1 - rq) * 60000 / rpm
        if tpm > 0 and tokens > tpm:
            reason, wait = "too_large", 60000.0
        elif tpm > 0 and tk < tokens:
            wait = max(wait, (tokens - tk) * 60000 / tpm)
            reason = reason or "tokens"
        if maxc > 0 and len(b.leases) >= maxc:
            reason = reason or "concurrency"
            wait = max(wait, 1000.0)
        lease = None
        if not reason:
            if rpm > 0:
                rq -= 1
            if tpm > 0:
                tk -= tokens
            lease = Lease(tenant, self._lease_ids.next(), tokens, tpm, self)
            if maxc > 0:
                b.leases[lease.lease_id] = now + lease_ttl_s
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
