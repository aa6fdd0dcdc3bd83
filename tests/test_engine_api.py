"""Worker HTTP API: OpenAI shapes, streaming, usage, bad input -> 4xx, disconnect frees KV."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from engine.api import create_worker_app
from engine.engine import Engine, EngineConfig
from loraplex.settings import DEV_WORKER_SECRET, Settings
from loraplex.wire import HDR_WORKER, HDR_WORKER_SECRET
from tests.engine_fixtures import make_tiny_model

AUTH = {HDR_WORKER_SECRET: DEV_WORKER_SECRET}
"""What the gateway sends (the settings here keep the default worker secret)."""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_api"), "llama")


@pytest.fixture(scope="module")
def engine(tiny_dir):
    eng = Engine.from_path(tiny_dir, EngineConfig(kv_cache_bytes=1 << 20, max_num_seqs=8, max_waiting=16))
    eng.start()
    yield eng
    eng.stop()


@pytest.fixture
def settings(tmp_path):
    return Settings(home=str(tmp_path), worker_id="w-test", max_body_bytes=64 * 1024)


@pytest.fixture
async def client(engine, settings):
    app = create_worker_app(settings, engine=engine, report=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w", headers=AUTH) as c:
        yield c


async def _ok_completion(client: httpx.AsyncClient) -> dict:
    r = await client.post("/v1/completions", json={"prompt": "Hello world", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


async def test_completion_shape_usage_and_header(client):
    r = await client.post("/v1/completions", json={"prompt": "Hello world", "max_tokens": 5, "temperature": 0,
                                                   "ignore_eos": True})
    assert r.status_code == 200
    assert r.headers[HDR_WORKER] == "w-test"
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5


async def test_chat_stream_with_usage(client):
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    # Same request without streaming produces the same text.
    r2 = await client.post("/v1/chat/completions", json={**body, "stream": False})
    assert r2.json()["choices"][0]["message"]["content"] == text


async def test_seeded_sampling_reproducible(client):
    body = {"prompt": "The quick brown", "max_tokens": 8, "temperature": 1.0, "top_p": 0.9, "top_k": 50,
            "seed": 1234, "ignore_eos": True}
    a = (await client.post("/v1/completions", json=body)).json()
    b = (await client.post("/v1/completions", json=body)).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


BAD_BODIES = [
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "word " * 2000}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": [1, 2]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"100000": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "loraplex": "nope"}, "loraplex"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_BODIES)
async def test_bad_input_is_4xx_and_worker_keeps_serving(client, path, body, param):
    r = await client.post(path, json=body)
    assert r.status_code == 400, (body, r.text)
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] == param
    await _ok_completion(client)


async def test_prompt_longer_than_context_code(client):
    r = await client.post("/v1/completions", json={"prompt": "word " * 2000})
    assert r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe{}", b"[1, 2]", b"", b"null"])
async def test_malformed_bodies(client, raw):
    r = await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] in ("invalid_json", "invalid_utf8")
    await _ok_completion(client)


async def test_oversized_body_413(client):
    r = await client.post("/v1/completions", json={"prompt": "x" * 100_000})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "body_too_large"
    await _ok_completion(client)


async def test_adapter_without_lora_support_400(client):
    ext = {"adapter": {"id": "a1", "name": "support@1", "uri": "file:///nope", "sha256": "0" * 64}, "tenant": "t1"}
    r = await client.post("/v1/completions", json={"prompt": "hi", "loraplex": ext})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "adapter_not_supported"


async def test_unknown_route_is_openai_shaped_404(client):
    r = await client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


async def test_health_and_metrics(client):
    await _ok_completion(client)
    h = await client.get("/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    assert h.json()["kv_blocks_total"] > 0
    # What the base weights are in and why (this engine was built with the library's default: as the activations).
    assert h.json()["weights"] == {"format": "float32", "why": "the activations' dtype", "activations": "float32",
                                   "kv_cache": "float32"}
    m = await client.get("/metrics")
    text = m.text
    for name in ("loraplex_worker_queue_depth", "loraplex_worker_running", "loraplex_worker_kv_blocks_used",
                 "loraplex_worker_kv_blocks_total", "loraplex_worker_step_seconds_bucket",
                 "loraplex_worker_time_to_first_token_seconds_bucket", "loraplex_worker_prompt_tokens_total",
                 "loraplex_worker_generation_tokens_total"):
        assert name in text, name


async def _wait_idle(engine: Engine, limit_s: float = 10.0) -> None:
    for _ in range(int(limit_s / 0.02)):
        load = engine.load()
        if load["running"] == 0 and load["queue_depth"] == 0 and load["kv_blocks_used"] == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine not idle: {engine.load()}")


@pytest.fixture
async def live_url(engine, settings):
    """The worker app behind a real uvicorn server on loopback (disconnects are real)."""
    import socket

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_worker_app(settings, engine=engine, report=False)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.started:
            break
        await asyncio.sleep(0.01)
    yield f"http://127.0.0.1:{port}", app
    server.should_exit = True
    await task


def _client_gone(app) -> float:
    reg = app.state.worker.metrics.registry
    return reg.get_sample_value("loraplex_worker_requests_total", {"worker": "w-test", "outcome": "client_gone"}) or 0


async def test_stream_disconnect_aborts_and_frees_blocks(live_url, engine):
    live_url, app = live_url
    await _wait_idle(engine)
    body = {"prompt": "Hello", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=live_url, headers=AUTH) as c:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
            assert engine.load()["running"] == 1
    await _wait_idle(engine)
    assert _client_gone(app) == 1


async def test_nonstream_disconnect_aborts(live_url, engine, monkeypatch):
    live_url, app = live_url
    await _wait_idle(engine)
    # Steps of at least 5 ms: 450 tokens take over 2 s, well past the client's 0.3 s timeout.
    forward = engine.model.forward

    def slow_forward(*args, **kwargs):
        time.sleep(0.005)
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", slow_forward)
    body = {"prompt": "Hello", "max_tokens": 450, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=live_url, timeout=0.3, headers=AUTH) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/v1/completions", json=body)
    await _wait_idle(engine)
    assert _client_gone(app) == 1


async def test_queue_full_is_503(tiny_dir, tmp_path):
    eng = Engine.from_path(tiny_dir, EngineConfig(kv_cache_bytes=1 << 20, max_waiting=1))
    app = create_worker_app(Settings(home=str(tmp_path), worker_id="w-full"), engine=eng, report=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w", headers=AUTH) as c:
        # The engine thread is not started, so the first request stays queued.
        first = asyncio.create_task(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}))
        for _ in range(200):
            if eng.load()["queue_depth"] == 1:
                break
            await asyncio.sleep(0.01)
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "queue_full"
        eng.start()
        try:
            assert (await first).status_code == 200
        finally:
            eng.stop()


def test_app_loads_engine_from_settings_and_reports(tiny_dir, tmp_path):
    """The path a whole-system runner takes: settings only, the app's lifespan loads the model."""
    from starlette.testclient import TestClient

    from loraplex.residency import MemoryResidency

    store = MemoryResidency()
    settings = Settings(home=str(tmp_path), model=str(tiny_dir), worker_id="w-life", model_name="tiny",
                        kv_cache_bytes=1 << 20, report_interval_s=0.05)
    app = create_worker_app(settings, residency=store)
    with TestClient(app) as c:
        assert c.get("/health").json()["model"] == "tiny"
        r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0}, headers=AUTH)
        assert r.status_code == 200 and r.json()["model"] == "tiny"
        reports = []
        for _ in range(500):  # the first report goes out at start; 10 s bounds a hang
            reports = asyncio.run(store.live())
            if reports:
                break
            import time

            time.sleep(0.02)
        assert reports and reports[0].worker_id == "w-life" and reports[0].base_model == "tiny"
        assert reports[0].total_kv_blocks > 0 and len(reports[0].base_revision) == 16
    assert app.state.worker.engine.running_thread is False


async def test_continuous_usage_counts_every_token(client):
    """``continuous_usage_stats``: each chunk carries the tokens generated so far (the gateway
    settles a stream that ends early from it)."""
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True,
                                                                   "continuous_usage_stats": True}}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = [json.loads(ln[6:]) async for ln in r.aiter_lines() if ln.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 6
    assert len({c["usage"]["prompt_tokens"] for c in chunks}) == 1
    assert list(chunks[-2])[-1] == "usage"  # the last key of a content chunk


async def _chunks(client: httpx.AsyncClient, path: str, body: dict) -> list[dict]:
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(ln[6:]) async for ln in r.aiter_lines() if ln.startswith("data: {")]


async def test_chat_logprobs_whole_and_streamed(client):
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 3}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 6 and choice["logprobs"]["refusal"] is None
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"} and e["logprob"] <= 0
        assert len(e["top_logprobs"]) == 3
        assert e["top_logprobs"][0]["token"] == e["token"]  # greedy: the chosen token is the best
        assert abs(e["top_logprobs"][0]["logprob"] - e["logprob"]) < 1e-6
    assert bytes(b for e in content for b in e["bytes"]).decode("utf-8", "replace") == choice["message"]["content"]
    streamed = [e for c in await _chunks(client, "/v1/chat/completions", body) for ch in c["choices"]
                if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert streamed == content


async def test_completion_logprobs_offsets_and_stream(client):
    body = {"prompt": "Hello world", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    r = await client.post("/v1/completions", json=body)
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]
    for d, v in zip(lp["top_logprobs"], lp["token_logprobs"], strict=True):
        assert len(d) <= 2 and max(d.values()) == pytest.approx(v)  # greedy: the chosen token is the best
    parts = [ch["logprobs"] for c in await _chunks(client, "/v1/completions", body) for ch in c["choices"]
             if ch["logprobs"]]
    assert [t for p in parts for t in p["tokens"]] == lp["tokens"]
    assert [o for p in parts for o in p["text_offset"]] == lp["text_offset"]


async def test_logit_bias_and_penalties_steer_the_output(client, engine):
    base = {"prompt": "Hello world", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    plain = (await client.post("/v1/completions", json=base)).json()["choices"][0]["logprobs"]
    forced = engine.tokenizer.token_text(42)
    r = await client.post("/v1/completions", json={**base, "logit_bias": {"42": 100}})
    assert r.status_code == 200, r.text
    biased = r.json()["choices"][0]["logprobs"]
    assert biased["tokens"] == [forced] * 4 != plain["tokens"]
    assert biased["token_logprobs"][0] < plain["token_logprobs"][0]  # the model's own, unbiased logprob


async def test_n_choices_whole_and_streamed(client):
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "temperature": 1.0, "seed": 9,
            "ignore_eos": True, "n": 3, "logprobs": True}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(len(c["logprobs"]["content"]) == 5 for c in out["choices"])
    assert out["usage"]["completion_tokens"] == 15  # summed over the choices; the prompt counted once
    one = (await client.post("/v1/chat/completions", json={**body, "n": 1})).json()
    assert out["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert one["choices"][0]["message"] == out["choices"][0]["message"]  # sample 0 draws with the seed itself
    chunks = await _chunks(client, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    texts = {0: "", 1: "", 2: ""}
    ends = {}
    for c in chunks[:-1]:
        for ch in c["choices"]:
            texts[ch["index"]] += ch["delta"].get("content") or ""
            if ch["finish_reason"]:
                ends[ch["index"]] = ch["finish_reason"]
    assert texts == {c["index"]: c["message"]["content"] for c in out["choices"]}
    assert ends == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1]["usage"]["completion_tokens"] == 15


@pytest.mark.e2e
def test_a_worker_told_to_stop_during_its_model_load_stops_at_once(tmp_path):
    """The model loads before the server takes the process's signals: a SIGTERM then ends the
    process without waiting for the load, the warm start and a whole start-up."""
    import os
    import signal
    import subprocess

    from tests.e2e_cluster import BIN, free_port
    from tests.engine_fixtures import demo_model_file

    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env.update(LORAPLEX_MODEL=str(demo_model_file()), LORAPLEX_HOME=str(tmp_path), LORAPLEX_REDIS_URL="",
               LORAPLEX_WORKER_PORT=str(free_port()), LORAPLEX_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([str(BIN), "worker"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    import queue
    import threading

    out: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.put(line)
        out.put(None)

    threading.Thread(target=pump, daemon=True).start()
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while not any("loading the base model" in line for line in lines):
            line = out.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, "the worker exited:\n" + "".join(lines)
            lines.append(line)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
    except queue.Empty:
        raise AssertionError("the worker never said it loads its model:\n" + "".join(lines)) from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    while (line := out.get(timeout=10)) is not None:
        lines.append(line)
    rest = "".join(lines)
    assert proc.returncode == -signal.SIGTERM
    assert "loaded in" not in rest and "Uvicorn running" not in rest, rest
