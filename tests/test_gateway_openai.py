"""The official ``openai`` client, unchanged, against a real uvicorn gateway with Redis limits,
Redis residency and stub workers as real processes."""

from __future__ import annotations

import time

import openai
import pytest
import redis

from gateway.app import create_app
from loraplex.settings import Settings
from loraplex.tokens import mint
from tests.stub_worker import MutableSnapshots, StubProcess, ThreadServer, make_snapshot

TENANTS = {
    "acme": {"requests_per_min": 1000, "tokens_per_min": 1_000_000, "max_concurrent": 16,
             "bindings": {"support": {"active": ("sup", 1)}}},
    "tiny": {"requests_per_min": 2, "bindings": {"support": {"active": ("sup", 1)}}},
}


@pytest.fixture(scope="module")
def system():
    import uuid

    prefix = f"loraplex-test-{uuid.uuid4().hex[:10]}"
    url = "redis://127.0.0.1:6379/0"
    workers = [StubProcess(f"w{i}", redis_url=url, redis_prefix=prefix, device=("sup-v1",) if i == 1 else ())
               for i in (1, 2)]
    for w in workers:
        w.start()
    s = Settings(redis_url=url, redis_prefix=prefix)
    app = create_app(s, snapshots=MutableSnapshots(make_snapshot(TENANTS)), mount_admin=False)
    r = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while r.zcard(f"{prefix}:workers") < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    with ThreadServer(app) as gw:
        yield s, gw
    for w in workers:
        w.stop()
    keys = list(r.scan_iter(f"{prefix}*"))
    if keys:
        r.delete(*keys)
    r.close()


def _client(system, tenant="acme") -> openai.OpenAI:
    s, gw = system
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=mint(s, "u", tenant=tenant), max_retries=0)


def test_chat_non_streaming(system):
    c = _client(system)
    out = c.chat.completions.create(model="support", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert out.choices[0].message.content == "ok from w1"
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    raw = c.chat.completions.with_raw_response.create(model="support", messages=[{"role": "user", "content": "x"}])
    assert raw.headers["x-loraplex-adapter"] == "sup@1"
    assert raw.headers["x-ratelimit-limit-requests"] == "1000"


def test_chat_streaming_with_and_without_usage(system):
    c = _client(system)
    chunks = list(c.chat.completions.create(model="support", messages=[{"role": "user", "content": "hi"}],
                                            stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "t0 t1 t2 t3 t4 "
    assert all(ch.usage is None for ch in chunks)
    chunks = list(c.chat.completions.create(model="support", messages=[{"role": "user", "content": "hi"}],
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_completions_both_ways(system):
    c = _client(system)
    out = c.completions.create(model="support", prompt="hello", max_tokens=4)
    assert out.choices[0].text == "ok from w1" and out.usage.completion_tokens == 4
    parts = list(c.completions.create(model="smol", prompt="hello", max_tokens=3, stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices) == "t0 t1 t2 "  # max_tokens=3


def test_models_and_errors(system):
    c = _client(system)
    assert {m.id for m in c.models.list()} == {"support", "smol"}
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="support", messages=[], max_tokens=4)
    _s, gw = system
    bad = openai.OpenAI(base_url=gw.url + "/v1", api_key="not-a-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="support", messages=[{"role": "user", "content": "hi"}])
    tiny = _client(system, "tiny")
    with pytest.raises(openai.RateLimitError) as exc:
        for _ in range(3):
            tiny.chat.completions.create(model="support", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=2)
    assert exc.value.response.headers["retry-after"]
