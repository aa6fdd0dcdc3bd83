"""The limiter's pipelined Redis connection: replies in order, error replies to their caller,
script reloading after NOSCRIPT, DB selection, failures and timeouts fail every waiter."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from gateway.ratelimit import _Pipeliner, script_call
from gateway.resp import ReplyError, RespConnection, RespError, encode
from tests.stub_worker import free_port


def test_encode():
    assert encode(("SET", "k", 5)) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n5\r\n"
    assert encode((b"\x00\xff",)) == b"*1\r\n$2\r\n\x00\xff\r\n"


async def test_pipelined_replies_and_errors(redis_url, redis_prefix):
    r = aioredis.from_url(redis_url.rsplit("/", 1)[0] + "/5")
    conn = RespConnection.from_redis(r)
    assert conn is not None and conn.db == 5
    try:
        key = f"{redis_prefix}:x"
        res = await conn.execute([("SET", key, "v"), ("GET", key), ("INCR", key), ("PING",)])
        assert res[0] == b"OK" and res[1] == b"v" and isinstance(res[2], ReplyError) and res[3] == b"PONG"
        assert await r.get(key) == b"v"  # same database as the redis-py client
        many = await asyncio.gather(*[conn.execute([("ECHO", str(i))]) for i in range(200)])
        assert [m[0] for m in many] == [str(i).encode() for i in range(200)]
        await r.delete(key)
    finally:
        await conn.close()
        await r.aclose()


async def test_noscript_is_reloaded(redis_url):
    r = aioredis.from_url(redis_url)
    script = r.register_script(f"-- {uuid.uuid4().hex}\nreturn tonumber(ARGV[1]) + 1")
    p = _Pipeliner(r, [script])
    try:
        assert await p.call(script_call(script, [], [41])) == 42
        assert await asyncio.gather(*[p.call(script_call(script, [], [i])) for i in range(10)]) == list(range(1, 11))
    finally:
        await p.close()
        await r.aclose()


async def test_dead_server_and_silent_server_fail_fast():
    conn = RespConnection("127.0.0.1", free_port(), timeout=0.3)
    with pytest.raises(RespError):
        await conn.execute([("PING",)])

    async def silent(reader, writer):
        await asyncio.sleep(5)

    port = free_port()
    server = await asyncio.start_server(silent, "127.0.0.1", port)
    conn = RespConnection("127.0.0.1", port, timeout=0.3)
    try:
        results = await asyncio.gather(*[conn.execute([("PING",)]) for _ in range(3)], return_exceptions=True)
        assert all(isinstance(x, RespError) for x in results)
    finally:
        await conn.close()
        server.close()
