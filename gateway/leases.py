"""Concurrency leases that die with their holder, and the gateways a Redis limiter knows of.

A concurrency slot is a lease id in the tenant's sorted set (``{prefix}:rl:{tenant}:c``),
scored by when it lapses: ``lease_ttl_s`` (seconds) after it was taken or last renewed.
The gateway that holds it renews it while its request runs and removes it when the request
ends (``settle``), so a gateway that dies (``kill -9``) frees its slots within ``lease_ttl_s``.

* ``HeldLeases``: the leases this process holds in Redis, by concurrency key, each with the
  latest time it may be renewed to (the request's own deadline bounds how long a slot a
  request that somehow never settles keeps);
* ``KEEPALIVE``: one script call per interval renews every held lease of every tenant
  (``ZADD XX``: a lease Redis already dropped is never brought back) and beats this gateway's
  heart in ``{prefix}:gateways`` (gateway ids scored by when last seen), answering how many
  gateways beat within ``lease_ttl_s`` and Redis's clock.
"""

from __future__ import annotations

import time

KEEPALIVE = """
local ttl = tonumber(ARGV[1])
local window = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
redis.call('PEXPIRE', KEYS[1], window * 2)
local gateways = redis.call('ZCARD', KEYS[1])
local renewed = 0
for i = 2, #KEYS do
  local kc = KEYS[i]
  local args = {}
  for lease in string.gmatch(ARGV[i + 2], '%S+') do
    args[#args + 1] = now + ttl
    args[#args + 1] = lease
    if #args >= 1000 then
      renewed = renewed + redis.call('ZADD', kc, 'XX', 'CH', unpack(args))
      args = {}
    end
  end
  if #args > 0 then
    renewed = renewed + redis.call('ZADD', kc, 'XX', 'CH', unpack(args))
  end
  if redis.call('PTTL', kc) < ttl + 1000 then
    redis.call('PEXPIRE', kc, ttl + 1000)
  end
end
return {gateways, renewed, now}
"""
"""``KEYS``: the gateways set, then one concurrency set per tenant; ``ARGV``: lease TTL (ms),
this gateway's id, the live window (ms), then per tenant its held lease ids, space-separated.
Answers the live gateways, the leases renewed (those still there) and Redis's time (ms)."""


class HeldLeases:
    """The leases this process holds in Redis: concurrency key -> lease id -> the monotonic
    time after which it is no longer renewed."""

    __slots__ = ("_by_key",)

    def __init__(self) -> None:
        self._by_key: dict[str, dict[str, float]] = {}

    def hold(self, key: str, lease_id: str, until: float) -> None:
        held = self._by_key.get(key)
        if held is None:
            held = self._by_key[key] = {}
        held[lease_id] = until

    def release(self, key: str, lease_id: str) -> None:
        held = self._by_key.get(key)
        if held is not None and held.pop(lease_id, None) is not None and not held:
            del self._by_key[key]

    def renewable(self, now: float | None = None) -> dict[str, list[str]]:
        """The leases to renew now, by key; those held past their time are let go (they lapse
        in Redis within the TTL)."""
        now = time.monotonic() if now is None else now
        out: dict[str, list[str]] = {}
        for key in list(self._by_key):
            held = self._by_key[key]
            for lease_id in [lid for lid, until in held.items() if until <= now]:
                del held[lease_id]
            if held:
                out[key] = list(held)
            else:
                del self._by_key[key]
        return out

    def __len__(self) -> int:
        return sum(len(held) for held in self._by_key.values())

