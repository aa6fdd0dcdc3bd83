"""The worker with LoRA on, end to end through its HTTP API (tiny random Llama + tiny PEFT adapters).

Adapter requests are served with their adapter, concurrent adapters each get their own
output, a corrupt adapter fails only its requests, the internal control endpoints, the
residency report (in-process and Redis), the metrics and the warm start.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.server
import json
import shutil
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import save_file

from engine.api import create_worker_app
from engine.engine import Engine
from engine.reporter import build_report, report_forever
from engine.warmstart import PreloadEntryError, parse_entry, plan, warm_start
from loraplex.digest import digest_directory
from loraplex.modelinfo import describe_model
from loraplex.residency import MemoryResidency, RedisResidency
from loraplex.settings import Settings
from loraplex.wire import HDR_ADAPTER, HDR_WORKER_SECRET, AdapterRef
from tests.engine_fixtures import make_tiny_model

SECRET = "test-secret-0123456789"


def make_peft(path, info, seed: int, rank: int = 8, scale: float = 0.6):
    """A PEFT LoRA on q/v/o/down projections, strong enough to change greedy output."""
    g = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    targets = ["q_proj", "v_proj", "o_proj", "down_proj"]
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}))
    tensors = {}
    for layer in range(info.num_layers):
        for proj in targets:
            fin, fout = info.projection_shape(proj)
            part = "mlp" if proj == "down_proj" else "self_attn"
            k = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            tensors[f"{k}.lora_A.weight"] = torch.randn(rank, fin, generator=g) * scale
            tensors[f"{k}.lora_B.weight"] = torch.randn(fout, rank, generator=g) * scale
    save_file(tensors, path / "adapter_model.safetensors")
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("worker_lora")
    tiny = make_tiny_model(root / "base", "llama")
    info = describe_model(tiny)
    adapters = {n: make_peft(root / n, info, seed) for n, seed in (("a", 1), ("b", 2), ("c", 3), ("d", 4),
                                                                      ("pre", 5), ("hot", 6), ("cold", 7))}
    bad = root / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 16, '
                                             '"target_modules": ["q_proj"]}')
    (bad / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not safetensors")
    adapters["bad"] = bad
    served = root / "served"
    shutil.copytree(adapters["c"], served / "c")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    handler.log_message = lambda *a, **k: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    store = f"http://127.0.0.1:{server.server_address[1]}/"
    settings = Settings(home=str(root / "home"), model=str(tiny), worker_id="w-lora", device="cpu",
                        dtype="float32", kv_cache_bytes=2 << 20, max_num_seqs=8, max_loras=2, max_cpu_loras=8,
                        lora_rank_classes=(8, 16), worker_secret=SECRET, max_body_bytes=64 * 1024,
                        adapter_sources=(root.as_uri() + "/", store))
    engine = Engine.from_settings(settings)
    engine.start()
    yield settings, engine, adapters, server
    engine.close()
    server.server_close()


def ref(world, name: str, id_: str | None = None) -> AdapterRef:
    d = world[2][name]
    return AdapterRef(id=id_ or f"id-{name}", name=f"{name}@1", uri=d.as_uri(), sha256=digest_directory(d))


@pytest.fixture
async def client(world):
    settings, engine, *_ = world
    app = create_worker_app(settings, engine=engine, report=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w", timeout=60) as c:
        yield c


def body(adapter: AdapterRef | None, prompt: str = "Hello world", n: int = 8, **kw) -> dict:
    b = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0,
         "ignore_eos": True, **kw}
    if adapter is not None:
        b["loraplex"] = {"adapter": adapter.to_dict(), "tenant": "t1"}
    return b


async def chat(client, adapter: AdapterRef | None, **kw) -> str:
    r = await client.post("/v1/chat/completions", json=body(adapter, **kw), headers=H())
    assert r.status_code == 200, r.text
    assert r.headers[HDR_ADAPTER] == (adapter.name if adapter else "base")
    return r.json()["choices"][0]["message"]["content"]


def H(secret: str = SECRET) -> dict:
    return {HDR_WORKER_SECRET: secret}


async def test_adapter_request_differs_from_base(client, world):
    base = await chat(client, None)
    a = await chat(client, ref(world, "a"))
    assert a != base
    assert await chat(client, ref(world, "a")) == a, "warm (resident) adapter gives the same output"
    h = (await client.get("/health")).json()
    assert h["lora"] is True and h["adapters"]["host"] >= 1 and h["adapters"]["max_loras"] == 2


async def test_concurrent_adapters_each_get_their_own_output(client, world):
    ra, rb = ref(world, "a"), ref(world, "b")
    alone = {"a": await chat(client, ra, prompt="Numbers like"), "b": await chat(client, rb, prompt="Numbers like"),
             "base": await chat(client, None, prompt="Numbers like")}
    assert len(set(alone.values())) == 3
    got = await asyncio.gather(*(chat(client, r, prompt="Numbers like") for r in (ra, rb, None, rb, ra)))
    assert got == [alone["a"], alone["b"], alone["base"], alone["b"], alone["a"]]


async def test_corrupt_adapter_fails_only_its_requests(client, world):
    bad = ref(world, "bad")
    base_task = asyncio.create_task(chat(client, None, n=16))
    other_task = asyncio.create_task(chat(client, ref(world, "b"), n=16))
    r = await client.post("/v1/chat/completions", json=body(bad), headers=H())
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "adapter_load_failed" and "bad@1" in err["message"] and "invalid adapter" in err["message"]
    # A stream that already started ends with an error event carrying the code.
    async with client.stream("POST", "/v1/chat/completions", json=body(bad, stream=True), headers=H()) as s:
        assert s.status_code == 200
        events = [line[6:] async for line in s.aiter_lines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
    assert json.loads(events[-2])["error"]["code"] == "adapter_load_failed" and events[-1] == "[DONE]"
    assert await base_task and await other_task
    _, engine, *_ = world
    assert engine.lora_runtime.manager.state(bad).state == "failed"


async def test_internal_endpoints_need_the_secret(client):
    assert (await client.get("/internal/adapters")).status_code == 401
    r = await client.get("/internal/adapters", headers=H("wrong"))
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    assert (await client.post("/internal/adapters/load", json={}, headers=H("wrong"))).status_code == 403
    assert (await client.get("/internal/adapters", headers=H())).status_code == 200


async def test_load_pin_unpin_unload_list(client, world):
    rc = ref(world, "c")
    r = await client.post("/internal/adapters/load", json={"adapter": rc.to_dict(), "pin": True}, headers=H())
    assert r.status_code == 200, r.text
    a = r.json()["adapter"]
    assert a["id"] == rc.id and a["tier"] == "host" and a["pinned"] and a["rank"] == 8 and r.json()["load_ms"] >= 0
    listed = {x["id"]: x for x in (await client.get("/internal/adapters", headers=H())).json()["adapters"]}
    assert listed[rc.id]["pinned"] and listed[rc.id]["users"] == 0
    r = await client.post("/internal/adapters/unload", json={"id": rc.id}, headers=H())
    assert r.status_code == 409 and r.json()["error"]["code"] == "adapter_busy"
    r = await client.post("/internal/adapters/unpin", json={"id": rc.id}, headers=H())
    assert r.status_code == 200 and not r.json()["adapter"]["pinned"]
    r = await client.post("/internal/adapters/pin", json={"id": rc.id}, headers=H())
    assert r.status_code == 200 and r.json()["adapter"]["pinned"]
    r = await client.post("/internal/adapters/unload", json={"id": rc.id, "force": True}, headers=H())
    assert r.status_code == 200 and r.json() == {"unloaded": rc.id}
    assert rc.id not in {x["id"] for x in (await client.get("/internal/adapters", headers=H())).json()["adapters"]}
    assert (await client.post("/internal/adapters/unload", json={"id": rc.id}, headers=H())).status_code == 404
    assert (await client.post("/internal/adapters/unpin", json={"id": "nope"}, headers=H())).status_code == 404
    r = await client.post("/internal/adapters/load", json={"adapter": ref(world, "bad").to_dict()}, headers=H())
    assert r.status_code == 422 and r.json()["error"]["code"] == "adapter_load_failed"
    r = await client.post("/internal/adapters/load", json={"adapter": {"id": ""}}, headers=H())
    assert r.status_code == 400
    r = await client.post("/internal/adapters/load", content=b"{oops", headers=H())
    assert r.status_code == 400


async def test_unload_refused_while_in_use(client, world):
    from engine.sequence import SamplingParams

    _, engine, *_ = world
    rd = ref(world, "d")
    seq = engine.add_request([5, 6, 7], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True), adapter=rd)
    try:
        for _ in range(500):
            if seq.output_ids:
                break
            await asyncio.sleep(0.01)
        assert seq.output_ids and not seq.is_finished
        r = await client.post("/internal/adapters/unload", json={"id": rd.id, "force": True}, headers=H())
        assert r.status_code == 409 and "running" in r.json()["error"]["message"]
    finally:
        engine.abort(seq)
    # The aborted request's slot is given back when the forward it may be part of ends: the
    # adapter is in use until then.
    for _ in range(500):
        r = await client.post("/internal/adapters/unload", json={"id": rd.id}, headers=H())
        if r.status_code != 409:
            break
        await asyncio.sleep(0.01)
    assert r.status_code == 200


async def test_probe_runs_base_and_adapter(client, world):
    prompts = ["Hello world", "The quick brown fox"]
    r = await client.post("/internal/adapters/probe", headers=H(),
                          json={"adapter": ref(world, "a").to_dict(), "prompts": prompts, "max_tokens": 8})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [x["prompt"] for x in out["results"]] == prompts and out["adapter_load_ms"] >= 0
    for x in out["results"]:
        assert x["base"] != x["adapter"]
    # Same as the chat route serves (greedy, chat template): the probe goes through the engine.
    assert out["results"][0]["adapter"] == await chat(client, ref(world, "a"), prompt="Hello world", n=8,
                                                      ignore_eos=False)
    r = await client.post("/internal/adapters/probe", headers=H(),
                          json={"adapter": ref(world, "bad").to_dict(), "prompts": ["x"]})
    assert r.status_code == 422 and r.json()["error"]["code"] == "adapter_load_failed"
    r = await client.post("/internal/adapters/probe", headers=H(),
                          json={"adapter": ref(world, "a").to_dict(), "prompts": []})
    assert r.status_code == 400


async def test_report_tiers_in_process_and_redis(client, world, redis_url, redis_prefix):
    settings, engine, *_ = world
    ra = ref(world, "a")
    await chat(client, ra)
    rep = build_report(engine, "w-lora", "http://w", settings)
    assert ra.id in rep.host_adapters and ra.id in rep.device_adapters
    assert rep.base_model and rep.base_revision and rep.total_kv_blocks > 0 and rep.max_loras == 2
    fast = settings.replace(report_interval_s=0.05)
    mem = MemoryResidency()
    import redis.asyncio as aioredis

    rclient = aioredis.from_url(redis_url)
    store = RedisResidency(rclient, redis_prefix)
    tasks = [asyncio.create_task(report_forever(engine, s, "w-lora", "http://w", fast)) for s in (mem, store)]
    try:
        for s in (mem, store):
            for _ in range(500):  # the first report goes out at once; 10 s bounds a hang
                live = await s.live()
                if live:
                    break
                await asyncio.sleep(0.02)
            [got] = live
            assert got.worker_id == "w-lora" and ra.id in got.host_adapters and ra.id in got.device_adapters
        assert 0 < await rclient.pttl(f"{redis_prefix}:worker:w-lora") <= settings.worker_report_ttl_s * 1000
    finally:
        for t in tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
    assert await mem.live() == [] and await store.live() == [], "a stopped worker removes its report"
    await rclient.aclose()


ABSENT = 'loraplex_worker_adapter_arrivals_total{tier="absent",worker="w-lora"}'


def _sample(text: str, series: str) -> float:
    """``series``'s value in a Prometheus text page (0 where the page has no such line yet)."""
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series + " ")), 0.0)


async def test_metrics_adapter_tiers_and_ttft_by_cache(client, world):
    await chat(client, None)
    await chat(client, ref(world, "a"))
    await chat(client, ref(world, "a"))  # warm now
    absent = _sample((await client.get("/metrics")).text, ABSENT)  # the module's earlier tests count too
    fresh = ref(world, "b", id_="id-b-fresh")  # same files, new version id: a cold load
    await chat(client, fresh)
    text = (await client.get("/metrics")).text
    assert _sample(text, ABSENT) == absent + 1  # the fresh version arrived absent
    for needle in ('loraplex_worker_adapters_resident{tier="device",worker="w-lora"}',
                   'loraplex_worker_adapter_loads_total{tier="disk",worker="w-lora"}',
                   'loraplex_worker_adapter_loads_total{tier="host",worker="w-lora"}',
                   'loraplex_worker_adapter_load_seconds_bucket{le="0.005",tier="disk",worker="w-lora"}',
                   'loraplex_worker_adapter_evictions_total{tier="device",worker="w-lora"}',
                   'loraplex_worker_adapter_hits_total{tier="host",worker="w-lora"}',
                   "loraplex_worker_adapter_misses_total", "loraplex_worker_adapter_load_failures_total",
                   'loraplex_worker_adapter_requests_total{cache="cold",worker="w-lora"}',
                   'loraplex_worker_time_to_first_token_seconds_count{cache="warm",worker="w-lora"}',
                   'loraplex_worker_time_to_first_token_seconds_count{cache="cold",worker="w-lora"}',
                   'loraplex_worker_time_to_first_token_seconds_count{cache="base",worker="w-lora"}'):
        assert needle in text, needle


def test_preload_entries_parse():
    r = parse_entry("x1=file:///a/b#" + "A" * 64)
    assert (r.id, r.uri, r.sha256) == ("x1", "file:///a/b", "a" * 64)
    assert parse_entry("x2=https://h/p").sha256 is None
    for bad in ("nouri", "=file:///a", "x=file:///a#123"):
        with pytest.raises(PreloadEntryError):
            parse_entry(bad)
    s = Settings(preload_adapters=("p=file:///p",), pin_adapters=("p", "q=file:///q"))
    pre, pins = plan(s)
    assert [r.id for r in pre] == ["p"] and [r.id for r in pins] == ["p", "q"]
    with pytest.raises(PreloadEntryError):
        plan(Settings(pin_adapters=("unknown",)))


async def test_warm_start_preloads_and_pins(world):
    settings, engine, adapters, _ = world
    warm = settings.replace(preload_adapters=(f"id-pre={adapters['pre'].as_uri()}",
                                              f"id-bad={adapters['bad'].as_uri()}"), pin_adapters=("id-pre",))
    app = create_worker_app(warm, engine=engine, report=False)
    async with app.router.lifespan_context(app):
        result = app.state.warm_start
        assert result.loaded == ["id-pre"] and result.pinned == ["id-pre"] and "id-bad" in result.failed
        st = engine.lora_runtime.manager.state("id-pre")
        assert st.in_host and st.pinned
        assert engine.running_thread
    assert engine.running_thread, "an engine the app did not start keeps running"
    engine.lora_runtime.manager.unload("id-pre", force=True)


async def test_warm_start_top_n_from_redis_traffic(world, redis_url, redis_prefix):
    import redis.asyncio as aioredis

    settings, engine, *_ = world
    r = aioredis.from_url(redis_url)
    hot, cold = ref(world, "hot"), ref(world, "cold")
    await r.zadd(f"{redis_prefix}:adapter-traffic", {hot.id: 50, cold.id: 3, "id-unknown": 80})
    await r.hset(f"{redis_prefix}:adapter-refs", mapping={hot.id: hot.to_json(), cold.id: cold.to_json()})
    await r.aclose()
    s = settings.replace(redis_url=redis_url, redis_prefix=redis_prefix, preload_top_n=2)
    t0 = time.monotonic()
    result = await warm_start(engine, s)
    assert time.monotonic() - t0 < 60
    assert result is not None and result.loaded == [hot.id], "top 2 by traffic; ids without a ref are skipped"
    m = engine.lora_runtime.manager
    assert m.state(hot).in_host and m.state(cold).state == "absent"
    assert await warm_start(engine, s.replace(preload_top_n=0)) is None


async def test_http_adapter_reaches_the_disk_tier_and_report(client, world):
    settings, engine, adapters, server = world
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        remote = AdapterRef(id="id-remote-c", name="c@2", uri=f"http://127.0.0.1:{server.server_address[1]}/c",
                            sha256=digest_directory(adapters["c"]))
        got = await chat(client, remote)
        assert got == await chat(client, ref(world, "c")), "same files over HTTP give the same output"
    finally:
        server.shutdown()
    rep = build_report(engine, "w-lora", "http://w", settings)
    assert "id-remote-c" in rep.disk_adapters and "id-remote-c" in rep.host_adapters
    text = (await client.get("/metrics")).text
    assert 'loraplex_worker_adapter_loads_total{tier="source",worker="w-lora"} 1.0' in text
    assert 'loraplex_worker_adapters_resident{tier="disk",worker="w-lora"} 1.0' in text


async def test_adapter_ref_without_digest_is_refused(client, world):
    """The gateway always sends the version digest; a ref without one never reaches the engine."""
    _, engine, *_ = world
    bare = AdapterRef(id="id-bare", name="a@9", uri=world[2]["a"].as_uri())
    r = await client.post("/v1/chat/completions", json=body(bare), headers=H())
    assert r.status_code == 400 and "sha256" in r.json()["error"]["message"]
    r = await client.post("/internal/adapters/load", json={"adapter": bare.to_dict()}, headers=H())
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value"
    assert engine.lora_runtime.manager.state("id-bare").state == "absent"
