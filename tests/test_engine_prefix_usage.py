"""What a client and an operator see of the worker's prefix cache: ``usage.prompt_tokens_details.cached_tokens``
whole and streamed, on both routes, scoped by tenant unless the gateway names a shared scope; the per-adapter
prompt and cached-prompt counters; the residency report's cached blocks and evictions."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import httpx
import pytest

from engine.api import create_worker_app
from engine.engine import Engine, EngineConfig
from engine.reporter import build_report
from loraplex.settings import DEV_WORKER_SECRET, Settings
from loraplex.wire import EXT_KEY, HDR_WORKER_SECRET
from tests.engine_fixtures import make_tiny_model

AUTH = {HDR_WORKER_SECRET: DEV_WORKER_SECRET}
BLOCK = 16
"""The engine's KV block size: only whole blocks are cached."""


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine.from_path(make_tiny_model(tmp_path_factory.mktemp("tiny_prefix_usage"), "llama"),
                           EngineConfig(kv_cache_bytes=1 << 20, kv_block_size=BLOCK, max_num_seqs=8, max_waiting=16))
    assert eng.config.prefix_cache, "the prefix cache is on by default"
    eng.start()
    yield eng
    eng.stop()


@pytest.fixture
async def client(engine, tmp_path):
    app = create_worker_app(Settings(home=str(tmp_path), worker_id="w-pfx"), engine=engine, report=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w", headers=AUTH) as c:
        yield c


def _prompt(seed: int, n: int = 3 * BLOCK + 5) -> list[int]:
    """Token ids no other test sends (so nothing of them is cached before the test)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


def _ext(tenant: str, scope: str = "") -> dict:
    return {EXT_KEY: {"tenant": tenant, "cache_scope": scope}}


async def _completion(client: httpx.AsyncClient, prompt: list[int], **extra) -> dict:
    r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0,
                                                   "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


async def _streamed(client: httpx.AsyncClient, path: str, body: dict) -> list[dict]:
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(ln[6:]) async for ln in r.aiter_lines() if ln.startswith("data: {")]


def _cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


async def test_a_repeated_prompt_reports_its_cached_tokens(client):
    prompt = _prompt(1)
    first = (await _completion(client, prompt, **_ext("acme")))["usage"]
    second = (await _completion(client, prompt, **_ext("acme")))["usage"]
    assert first["prompt_tokens"] == second["prompt_tokens"] == len(prompt)
    assert _cached(first) == 0
    # Every whole block of the prompt but what must be computed again to sample from: 3 of 3.
    assert 0 < _cached(second) < len(prompt) and _cached(second) % BLOCK == 0
    assert _cached(second) == 3 * BLOCK
    # Cached tokens still count as prompt tokens (token limits charge them).
    assert second["total_tokens"] == len(prompt) + 3


async def test_streamed_usage_chunks_carry_the_cached_tokens(client):
    body = {"messages": [{"role": "system", "content": "You answer in one word. " * 8},
                         {"role": "user", "content": "The quick brown fox jumps over the lazy dog."}],
            "max_tokens": 3, "temperature": 0, "ignore_eos": True, **_ext("acme"),
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    runs = [await _streamed(client, "/v1/chat/completions", body) for _ in range(2)]
    finals = [chunks[-1] for chunks in runs]
    assert all(f["choices"] == [] for f in finals)
    assert _cached(finals[0]["usage"]) == 0 and _cached(finals[1]["usage"]) >= BLOCK
    # The per-chunk usage stays flat: the gateway strips it as one object (gateway.proxy).
    assert all("prompt_tokens_details" not in c["usage"] for c in runs[1][:-1])
    # Completions: the same, and the whole answer agrees with the stream.
    prompt = _prompt(2)
    comp = {"prompt": prompt, "max_tokens": 2, "temperature": 0, **_ext("acme"),
            "stream_options": {"include_usage": True}}
    first = (await _streamed(client, "/v1/completions", comp))[-1]["usage"]
    again = (await _streamed(client, "/v1/completions", comp))[-1]["usage"]
    assert _cached(first) == 0 and _cached(again) == 3 * BLOCK
    assert _cached((await _completion(client, prompt, **_ext("acme")))["usage"]) == 3 * BLOCK


async def test_another_tenant_never_reuses_a_tenants_prompt_unless_one_scope_holds_both(client):
    prompt = _prompt(3)
    await _completion(client, prompt, **_ext("acme"))
    assert _cached((await _completion(client, prompt, **_ext("acme")))["usage"]) == 3 * BLOCK
    assert _cached((await _completion(client, prompt, **_ext("globex")))["usage"]) == 0
    assert _cached((await _completion(client, prompt, **_ext("globex")))["usage"]) == 3 * BLOCK  # its own now
    # The gateway's scope, not the tenant, decides: two tenants an operator put in one shared scope
    # reuse each other's blocks; the tenant's own scope is not that shared one.
    shared = _prompt(4)
    await _completion(client, shared, **_ext("acme", "shared:corp"))
    assert _cached((await _completion(client, shared, **_ext("globex", "shared:corp")))["usage"]) == 3 * BLOCK
    assert _cached((await _completion(client, shared, **_ext("initech")))["usage"]) == 0


async def test_prompt_and_cached_prompt_counters_per_adapter(client):
    def read(text: str) -> dict[str, float]:
        out = {}
        for line in text.splitlines():
            for kind in ("prompt", "cached_prompt"):
                head = f'loraplex_worker_adapter_{kind}_tokens_total{{adapter="base",worker="w-pfx"}} '
                if line.startswith(head):
                    out[kind] = float(line[len(head):])
        return out

    before = read((await client.get("/metrics")).text)
    prompt = _prompt(5)
    await _completion(client, prompt, **_ext("acme"))
    await _completion(client, prompt, **_ext("acme"))
    after = read((await client.get("/metrics")).text)
    assert after["prompt"] - before.get("prompt", 0) == 2 * len(prompt)
    assert after["cached_prompt"] - before.get("cached_prompt", 0) == 3 * BLOCK


async def test_the_residency_report_carries_cached_blocks_and_evictions(client, engine):
    prompt = _prompt(6)
    await _completion(client, prompt, **_ext("acme"))
    settings = Settings(worker_id="w-pfx")
    report = build_report(engine, "w-pfx", "http://w", settings)
    load = engine.load()
    assert report.cached_kv_blocks >= 3 and report.cached_kv_blocks <= report.total_kv_blocks
    assert (report.cached_kv_blocks, report.kv_evictions) == (load["kv_blocks_cached"], load["kv_evictions"])
    # Read from the engine's own numbers, field by field.
    fake = SimpleNamespace(load=lambda: {**load, "kv_blocks_cached": 7, "kv_evictions": 3}, info=engine.info,
                           config=engine.config, lora_runtime=None)
    report = build_report(fake, "w-pfx", "http://w", settings)
    assert (report.cached_kv_blocks, report.kv_evictions) == (7, 3)
    assert json.loads(report.to_json())["kv_evictions"] == 3
