"""What a judged request leaves for the canary judge: the outcome read from a stream or a whole
answer, and the samples read back by binding, version and time (in process and in Redis)."""

from __future__ import annotations

import uuid

import orjson
import pytest
import redis.asyncio as aioredis

from gateway.canary_samples import MemorySamples, RedisSamples, sample
from gateway.proxy import Opened, StreamResult, finish_of, relay_sse
from loraplex.openai_request import FieldError, parse


def _chunk(content: str, finish: str | None = None) -> bytes:
    body = {"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]}
    return b"data: " + orjson.dumps(body) + b"\n\n"


async def _relay(events: bytes, watch: bool) -> StreamResult:
    sent: list[dict] = []

    async def send(msg: dict) -> None:
        sent.append(msg)

    result = StreamResult(watch=watch)
    await relay_sse(Opened(None, None, events, None), send, keep_usage=False, result=result)  # type: ignore[arg-type]
    assert b"".join(m["body"] for m in sent) == events  # passed through unchanged
    return result


async def test_stream_outcome_is_read_only_for_judged_requests():
    words = _chunk("Hello") + _chunk(" there", "length") + b"data: [DONE]\n\n"
    got = await _relay(words, watch=True)
    assert got.text and got.length and got.done
    empty = _chunk("") + _chunk("", "stop") + b"data: [DONE]\n\n"
    got = await _relay(empty, watch=True)
    assert not got.text and not got.length
    got = await _relay(words, watch=False)  # not under a canary: no search at all
    assert not got.text and not got.length


def test_whole_answer_outcome():
    chat = {"choices": [{"message": {"role": "assistant", "content": ""}, "finish_reason": "stop"}]}
    assert finish_of(orjson.dumps(chat)) == (True, False)
    chat["choices"][0]["message"]["content"] = "Rome."
    chat["choices"][0]["finish_reason"] = "length"
    assert finish_of(orjson.dumps(chat)) == (False, True)
    tool = {"choices": [{"message": {"content": None, "tool_calls": [{"id": "c"}]}, "finish_reason": "tool_calls"}]}
    assert finish_of(orjson.dumps(tool)) == (False, False)
    assert finish_of(b"not json") == (False, False)


@pytest.fixture(params=["memory", "redis"])
async def store(request, redis_url):
    if request.param == "memory":
        yield MemorySamples()
        return
    client = aioredis.from_url(redis_url)
    yield RedisSamples(client, f"loraplex-test-{uuid.uuid4().hex[:8]}")
    await client.aclose()


async def test_samples_by_binding_version_and_time(store):
    s1 = sample("v1", True, 0.5, 0.1, 20, False, False)
    s2 = sample("v2", False, 0.2, None, 0, False, False)
    store.record("acme/support", s1)
    store.record("acme/support", s2)
    store.record("globex/support", sample("v1", True, 0.5, 0.1, 20, False, True))
    await store.flush()
    arms = await store.read("acme/support", s1[0] - 1)
    assert set(arms) == {"v1", "v2"}
    assert arms["v1"].requests == 1 and arms["v1"].errors == 0 and arms["v1"].ttft == [pytest.approx(0.1)]
    assert arms["v1"].tokens_per_s == [pytest.approx(19 / 0.4)] and arms["v1"].length == 0
    assert arms["v2"].errors == 1 and arms["v2"].ttft == []
    whole = sample("v3", True, 0.5, None, 20, False, False)  # a whole answer: its latency, no decode rate
    assert whole[3] == 0.5 and whole[4] == 0.0
    assert await store.read("acme/support", s2[0] + 1) == {}  # only what came after the step began
    assert (await store.read("globex/support", 0))["v1"].length == 1


async def test_samples_keep_the_requests_metadata_labels(store):
    s = sample("v1", True, 0.5, None, 3, True, False, {"topic": "refund", "n": 3, "long": "x" * 100})  # type: ignore[dict-item]
    store.record("acme/support", s)
    store.record("acme/support", sample("v1", True, 0.5, None, 3, False, False))
    await store.flush()
    arm = (await store.read("acme/support", s[0] - 1))["v1"]
    by_topic = arm.segments("topic")
    assert by_topic["refund"].empty == 1 and by_topic["(none)"].requests == 1
    assert arm.rows[0][6] == {"topic": "refund", "long": "x" * 64}  # strings only, cut to 64 characters


def test_a_requests_metadata_is_parsed_and_checked():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "metadata": {"topic": "refund"}}
    assert parse(body, chat=True).metadata == {"topic": "refund"}
    assert parse({**body, "metadata": None}, chat=True).metadata is None
    for bad in ({"topic": 3}, ["topic"], {f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}):
        with pytest.raises(FieldError) as exc:
            parse({**body, "metadata": bad}, chat=True)
        assert exc.value.param == "metadata"
