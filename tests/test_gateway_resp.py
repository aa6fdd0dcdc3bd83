"""The limiter's pipelined Redis connection: replies in order, error replies to their caller,
script reloading after NOSCRIPT, DB selection, failures and timeouts fail every waiter."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from gateway.ratelimit import MAX_BATCH, _Pipeliner, script_call
from gateway.resp import ReplyError, RespConnection, RespError, encode
from tests.stub_worker import free_port


@pytest.fixture
async def redis_client(redis_url):
    r = aioredis.from_url(redis_url)
    yield r
    await r.aclose()


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


async def test_calls_of_one_script_and_keys_join_one_call(redis_url, redis_client):
    r = aioredis.from_url(redis_url)
    # Answers with its arguments and how many times it ran (a counter in Redis).
    script = r.register_script(f"-- {uuid.uuid4().hex}\nlocal n = redis.call('INCR', KEYS[1])\n"
                               "return {n, unpack(ARGV)}")
    key = f"batch-{uuid.uuid4().hex}"
    p = _Pipeliner(r, [script])

    async def call(const, args):
        batch, i, fut = p.join(script, [key], const, args)
        res = await fut
        if isinstance(res, Exception):
            res = await p.retry(batch, res)
        return res, i

    try:
        await redis_client.script_flush()  # the first call of the batch gets NOSCRIPT: reloaded and sent once
        out = await asyncio.gather(*[call(["c"], (f"a{i}", f"b{i}")) for i in range(5)], call(["d"], ("x", "y")))
        batched = [res for res, _ in out[:5]]
        assert all(res == batched[0] for res in batched)
        assert batched[0][1:] == [b"c"] + [f"{k}{i}".encode() for i in range(5) for k in "ab"]
        assert [i for _, i in out] == [0, 1, 2, 3, 4, 0]
        assert out[5][0][1:] == [b"d", b"x", b"y"]  # other leading arguments: a call of its own
        assert int(await redis_client.get(key)) == 2
        full = await asyncio.gather(*[call(["c"], (i,)) for i in range(MAX_BATCH + 1)])
        assert full[-1][1] == 0 and full[-2][1] == MAX_BATCH - 1  # a full batch makes room for another
        assert int(await redis_client.get(key)) == 4
        # A caller that gives up (a request cancelled while it waits) leaves the others be.
        first = asyncio.ensure_future(call(["c"], ("gone",)))
        second = asyncio.ensure_future(call(["c"], ("stays",)))
        await asyncio.sleep(0)
        first.cancel()
        res, i = await second
        assert i == 1 and res[1:] == [b"c", b"gone", b"stays"] and first.cancelled()
    finally:
        await redis_client.delete(key)
        await p.close()
        await r.aclose()


async def test_a_batch_is_encoded_as_the_call_it_stands_for(redis_url):
    r = aioredis.from_url(redis_url)
    script = r.register_script("return 1")
    p = _Pipeliner(r, [script])
    try:
        batch, _, _ = p.join(script, ["k1", "k2"], [5, "c"], (7, "lease"))
        assert p.join(script, ["k1", "k2"], [5, "c"], (b"\x00", -9))[0] is batch
        expected = script_call(script, ["k1", "k2"], [5, "c", 7, "lease", b"\x00", -9])
        assert batch.command()[2:] == expected[2:]
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
