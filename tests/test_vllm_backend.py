"""vLLM servers as loraplex workers, against a real vLLM (CPU build) and real loraplex processes.

One vLLM server on the exported demo model (started once for the module), ``loraplex vllm-agent``
beside it, a gateway, PostgreSQL and Redis; a bundled worker joins for the mixed-fleet test.
The tests run in file order: the vLLM-only fleet first, then the mixed fleet, then the test that
kills vLLM under load; last, vLLM is started again on its port under the same agent, and killed
once more in the middle of a stream.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraplex.wire import EXT_KEY, HDR_ADAPTER, HDR_WORKER, HDR_WORKER_SECRET
from tests.e2e_cluster import Cluster, Proc
from tests.engine_fixtures import demo_model_file
from tests.vllm_fleet import (
    SERVED,
    activate_recorded,
    register_active,
    start_agent,
    start_vllm,
    vllm_python,
    wait_http,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DEMO = Path(__file__).resolve().parent.parent / "demo" / "adapters"
SECRET = "vllm-worker-secret-" + uuid.uuid4().hex
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANDOM_SPECS: dict[str, dict[str, Any]] = {  # eight adapters, ranks 8-64, several target sets
    "r8_all": {"r": 8, "lora_alpha": 16, "target_modules": ALL},
    "r16_all": {"r": 16, "lora_alpha": 16, "target_modules": ALL},
    "r32_all": {"r": 32, "lora_alpha": 32, "target_modules": ALL},
    "r64_all": {"r": 64, "lora_alpha": 32, "target_modules": ALL},
    "r8_attn": {"r": 8, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "r16_mlp": {"r": 16, "lora_alpha": 16, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    "r32_qv": {"r": 32, "lora_alpha": 64, "target_modules": ["q_proj", "v_proj"]},
    "r64_od": {"r": 64, "lora_alpha": 64, "target_modules": ["o_proj", "down_proj"]},
}
PROMPTS = ["What is the capital of Italy?", "Name a large ocean.", "How many legs does a spider have?",
           "Write one word about the sea."]
LONG_PROMPT = "Explain to a child, in many sentences, how the tides of the ocean work."
COMPLETION_PROMPTS = ["The capital of Italy is", "The ocean is"]
"""Two prompts per adapter: 16 rows over 8 adapters in one batch (each is sent alone again after)."""
ISO_TOKENS = 8
TIMEOUT = httpx.Timeout(180.0, connect=10.0)


@dataclass
class Fleet:
    cluster: Cluster
    vllm: Proc
    agent: Proc
    gateway: Proc
    hf_dir: Path
    peft: Any
    """The PEFT model holding the eight random adapters (the reference)."""
    ids: dict[str, str]
    """Adapter spec name -> registry version id."""
    dirs: dict[str, Path]
    """Adapter spec name -> its PEFT directory."""
    refs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Tenant -> the AdapterRef of its ``assistant`` binding (the mixed-fleet test sets them)."""

    def chat(self, tenant: str, model: str, prompt: str, max_tokens: int = 8, **extra: Any) -> httpx.Response:
        return httpx.post(self.gateway.url + "/v1/chat/completions", timeout=TIMEOUT, json={
            "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, **extra}, headers={"Authorization": f"Bearer {self.cluster.token(tenant)}"})

    def vllm_chat(self, model: str, prompt: str, max_tokens: int = 8) -> str:
        r = httpx.post(self.vllm.url + "/v1/chat/completions", timeout=TIMEOUT, json={
            "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    def control(self, method: str, path: str, json_body: Any = None, url: str | None = None) -> httpx.Response:
        return httpx.request(method, (url or self.agent.url) + path, json=json_body, timeout=TIMEOUT,
                             headers={HDR_WORKER_SECRET: SECRET})

    def wait_route(self, tenant: str, model: str, worker: str, timeout_s: float = 60.0) -> httpx.Response:
        """Poll until a request for ``model`` is answered 200 by ``worker``."""
        deadline = time.monotonic() + timeout_s
        while True:
            r = self.chat(tenant, model, PROMPTS[0], max_tokens=2)
            if r.status_code == 200 and r.headers.get(HDR_WORKER) == worker:
                return r
            if time.monotonic() > deadline:
                raise AssertionError(f"{model} not served by {worker} after {timeout_s:.0f} s: "
                                     f"{r.status_code} {r.headers.get(HDR_WORKER)} {r.text[:300]}")
            time.sleep(0.5)


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def fleet(pg_url, redis_url, tmp_path_factory):
    from engine.export_hf import export_hf
    from tests.lora_fixtures import peft_adapters

    python = vllm_python()  # built once (cached); a failed build fails the module
    model = demo_model_file()
    home = tmp_path_factory.mktemp("vllm")
    hf_dir = export_hf(model, home / "hf", say=lambda _m: None)
    c = Cluster(home=home, database_url=pg_url, redis_url=redis_url,
                redis_prefix=f"loraplex-vllm-{uuid.uuid4().hex[:8]}", model=str(model),
                extra_env={"LORAPLEX_WORKER_SECRET": SECRET, "LORAPLEX_REGISTRY_REFRESH_S": "1"})
    t0 = time.monotonic()
    vllm = start_vllm(python, hf_dir, home / "vllm.log")
    agent: Proc | None = None
    f: Fleet | None = None
    try:
        c.migrate()
        gateway = c.add_gateway("g1")
        peft, dirs = peft_adapters(hf_dir, home / "adapters" / "iso", RANDOM_SPECS, std=0.1)
        startup = wait_http(vllm, "/health", 900)
        print(f"\nvLLM-CPU start-up: {time.monotonic() - t0:.0f} s ({startup:.0f} s waited after the set-up)")
        agent = start_agent(c, "v1", vllm.url)
        wait_http(agent, "/health", 120)
        wait_http(gateway, "/readyz", 120)
        c.base_name = c.admin("POST", "/base-models", {"path": c.model})["name"]
        for slug in ("iso", "acme", "globex"):
            c.admin("POST", "/tenants", {"slug": slug, "requests_per_min": 100_000, "tokens_per_min": 10_000_000,
                                         "max_concurrent": 256})
        ids = register_active(c, "iso", dirs)
        f = Fleet(c, vllm, agent, gateway, hf_dir, peft, ids, dirs)
        f.wait_route("iso", "r8_all", "v1", timeout_s=120)
        yield f
    except BaseException:
        for p in [vllm, *([agent] if agent else []), *c.workers, *c.gateways]:
            print(f"--- {p.name} ---\n{p.tail(60)}")
        raise
    finally:
        for p in [vllm, *([agent] if agent else []), *([f.vllm, f.agent] if f is not None else [])]:
            p.kill(signal.SIGKILL)  # f.vllm, f.agent: the ones a test restarted
        c.stop()


def test_rows_of_a_mixed_batch_equal_each_request_alone(fleet):
    """16 concurrent greedy requests over 8 adapters (ranks 8-64) through the gateway to vLLM:
    each row equals the same request sent alone (no adapter's weights reach another's row)."""
    rows = [(name, p) for name in RANDOM_SPECS for p in COMPLETION_PROMPTS]
    auth = {"Authorization": f"Bearer {fleet.cluster.token('iso')}"}

    async def send(client: httpx.AsyncClient, name: str, prompt: str) -> httpx.Response:
        return await client.post("/v1/completions", headers=auth, json={
            "model": name, "prompt": prompt, "max_tokens": ISO_TOKENS, "temperature": 0})

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=fleet.gateway.url, timeout=TIMEOUT) as client:
            return await asyncio.gather(*(send(client, n, p) for n, p in rows))

    async def one_by_one() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=fleet.gateway.url, timeout=TIMEOUT) as client:
            return [await send(client, n, p) for n, p in rows]

    batched = asyncio.run(together())
    alone = asyncio.run(one_by_one())
    for (name, prompt), b, a in zip(rows, batched, alone, strict=True):
        assert b.status_code == 200 and a.status_code == 200, (b.text, a.text)
        assert b.headers[HDR_WORKER] == "v1" and a.headers[HDR_WORKER] == "v1"
        assert b.headers[HDR_ADAPTER] == f"iso-{name.replace('_', '-')}@1"
        assert b.json()["choices"][0]["text"] == a.json()["choices"][0]["text"], (name, prompt)
        assert b.json()["model"] == fleet.ids[name]  # vLLM answered with the version's own name
    texts = {name: tuple(a.json()["choices"][0]["text"] for (n, _), a in zip(rows, alone, strict=True) if n == name)
             for name in RANDOM_SPECS}
    assert len(set(texts.values())) == len(RANDOM_SPECS), f"adapters must answer differently: {texts}"
    _report_peft_agreement(fleet, texts)


def test_responses_reach_vllm_through_the_agent_and_continue(fleet):
    """The Responses API in front of vLLM: a turn is vLLM's chat answer, a streamed continuation
    replays the stored first turn, and the stored responses read back."""
    import openai

    c = openai.OpenAI(base_url=fleet.gateway.url + "/v1", api_key=fleet.cluster.token("iso"), max_retries=0)
    first = c.responses.create(model="r8_all", input=PROMPTS[0], temperature=0, max_output_tokens=8)
    assert first.output_text == fleet.vllm_chat(fleet.ids["r8_all"], PROMPTS[0])
    events = list(c.responses.create(model="r8_all", input=PROMPTS[1], temperature=0, max_output_tokens=8,
                                     previous_response_id=first.id, stream=True))
    done = events[-1].response
    assert events[-1].type in ("response.completed", "response.incomplete") and done.output_text
    assert done.usage.input_tokens > first.usage.input_tokens
    assert c.responses.retrieve(done.id).output_text == done.output_text
    assert [i.role for i in c.responses.input_items.list(done.id, order="asc").data] == ["user", "assistant", "user"]
    other = fleet.cluster.add_gateway("g2")  # a second replica on the same PostgreSQL and Redis
    try:
        wait_http(other, "/readyz", 120)
        c2 = openai.OpenAI(base_url=other.url + "/v1", api_key=fleet.cluster.token("iso"), max_retries=0)
        third = c2.responses.create(model="r8_all", input=PROMPTS[2], temperature=0, max_output_tokens=8,
                                    previous_response_id=done.id)
        assert third.previous_response_id == done.id and third.usage.input_tokens > done.usage.input_tokens
        assert c.responses.retrieve(third.id).output_text == third.output_text  # and read back on the first
    finally:
        other.kill()
        fleet.cluster.gateways.remove(other)


def _report_peft_agreement(fleet: Fleet, texts: dict[str, tuple[str, ...]]) -> None:
    """Print how many rows vLLM's greedy text equals PEFT's (transformers, float32, the same
    weights) on: reported, not gated (vLLM-CPU computes in its own kernels)."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(fleet.hf_dir))
    ids = torch.tensor([tok(COMPLETION_PROMPTS[0])["input_ids"]])
    equal = 0
    with torch.no_grad():
        for name, got in texts.items():  # the first prompt of each adapter
            fleet.peft.set_adapter(name)
            out = fleet.peft.generate(input_ids=ids, max_new_tokens=ISO_TOKENS, do_sample=False,
                                      pad_token_id=tok.eos_token_id)[0, ids.shape[1]:]
            equal += tok.decode(out, skip_special_tokens=True) == got[0]
    print(f"\nvLLM-CPU vs PEFT (float32) greedy, {ISO_TOKENS} tokens: {equal} of {len(texts)} adapter rows equal")


def test_activation_gate_probes_through_the_agent_and_rollback_flips_the_version(fleet):
    c = fleet.cluster
    versions = []
    for demo in ("french", "terse"):
        dst = c.home / "adapters" / "iso" / f"roll-{demo}"
        shutil.copytree(DEMO / demo, dst)
        versions.append(c.admin("POST", "/adapters", {"name": "iso-roll", "uri": str(dst), "base_model": c.base_name,
                                                      "owner": "iso"}))
    done = c.admin("POST", f"/adapters/{versions[0]['id']}/activate", {})  # the gate probes through the agent
    assert done["status"] == "active", done
    assert done["verification"]["worker"] == "v1" and done["verification"]["probes_differing"] >= 1
    activate_recorded(c, [versions[1]["id"]])
    v1, v2 = versions
    c.admin("PUT", "/tenants/iso/bindings/roll", {"adapter": v1["id"]})
    fleet.wait_route("iso", "roll", "v1")
    c.admin("PUT", "/tenants/iso/bindings/roll", {"adapter": v2["id"]})
    _wait_version(fleet, "roll", 2)
    want = fleet.vllm_chat(v2["id"], PROMPTS[1])
    for _ in range(3):
        r = fleet.chat("iso", "roll", PROMPTS[1])
        assert r.headers[HDR_ADAPTER] == "iso-roll@2" and r.json()["model"] == v2["id"]
        assert _text(r) == want
    c.admin("POST", "/tenants/iso/bindings/roll/rollback", {})
    _wait_version(fleet, "roll", 1)
    want = fleet.vllm_chat(v1["id"], PROMPTS[1])
    for _ in range(3):
        r = fleet.chat("iso", "roll", PROMPTS[1])
        assert r.headers[HDR_ADAPTER] == "iso-roll@1" and r.json()["model"] == v1["id"]
        assert _text(r) == want


def _wait_version(fleet: Fleet, alias: str, version: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while fleet.chat("iso", alias, PROMPTS[0], max_tokens=1).headers.get(HDR_ADAPTER) != f"iso-{alias}@{version}":
        assert time.monotonic() < deadline, f"{alias} still not at version {version}"
        time.sleep(0.3)


def test_clients_never_reach_the_runtime_update_endpoints(fleet):
    auth = {"Authorization": f"Bearer {fleet.cluster.token('iso')}"}
    d = fleet.dirs["r8_all"]
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        for name in ("evil", fleet.ids["r8_all"]):
            r = httpx.post(fleet.gateway.url + path, json={"lora_name": name, "lora_path": str(d)}, headers=auth,
                           timeout=TIMEOUT)
            assert r.status_code in (404, 405), (path, r.status_code, r.text)
    models = httpx.get(fleet.vllm.url + "/v1/models", timeout=TIMEOUT).json()["data"]
    assert "evil" not in {m["id"] for m in models} and fleet.ids["r8_all"] in {m["id"] for m in models}
    # a version id is no model name at the gateway, not even the tenant's own
    assert fleet.chat("iso", fleet.ids["r8_all"], PROMPTS[0]).status_code == 404
    ref = {"id": "x", "name": "x", "uri": str(d), "sha256": "0" * 64}
    for method, path, body in (("GET", "/internal/adapters", None), ("POST", "/internal/adapters/load", ref),
                               ("POST", "/internal/adapters/unload", {"id": "x"}),
                               ("POST", "/internal/adapters/probe", {"adapter": ref, "prompts": ["hi"]}),
                               ("GET", "/internal/tokenizer", None)):
        r = httpx.request(method, fleet.agent.url + path, json=body, timeout=TIMEOUT)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", (path, r.text)
        r = httpx.request(method, fleet.agent.url + path, json=body, timeout=TIMEOUT,
                          headers={HDR_WORKER_SECRET: "wrong"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", (path, r.text)


def test_agent_loads_verify_the_digest_and_keep_within_their_budget(fleet):
    d = fleet.dirs["r8_all"]
    bad = {"adapter": {"id": "tampered", "name": "tampered", "uri": d.as_uri(), "sha256": "0" * 64}}
    r = fleet.control("POST", "/internal/adapters/load", bad)
    assert r.status_code == 422 and r.json()["error"]["code"] == "adapter_load_failed", r.text
    assert "sha256 mismatch" in r.json()["error"]["message"]
    listed = fleet.control("GET", "/internal/adapters").json()
    assert "tampered" not in {a["id"] for a in listed["adapters"]}
    assert len(listed["adapters"]) <= 16  # the agent's --max-adapters


def test_agent_restart_fails_cleanly_then_adopts_what_vllm_holds(fleet):
    c = fleet.cluster
    held = {a["id"] for a in fleet.control("GET", "/internal/adapters").json()["adapters"]}
    assert fleet.ids["r8_all"] in held
    fleet.agent.kill(signal.SIGKILL)
    # an adapter vLLM no longer holds needs the agent: an explicit 503, never a hang
    httpx.post(fleet.vllm.url + "/v1/unload_lora_adapter", json={"lora_name": fleet.ids["r16_all"]}, timeout=TIMEOUT)
    r = fleet.chat("iso", "r16_all", PROMPTS[0])
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker", r.text
    port = int(fleet.agent.url.rsplit(":", 1)[1])
    agent = start_agent(c, "v1", fleet.vllm.url, port=port)
    fleet.agent = agent
    wait_http(agent, "/health", 120)
    fleet.wait_route("iso", "r8_all", "v1")
    adopted = {a["id"] for a in fleet.control("GET", "/internal/adapters").json()["adapters"]}
    assert held - {fleet.ids["r16_all"]} <= adopted
    assert _text(fleet.chat("iso", "r16_all", PROMPTS[0])) == fleet.vllm_chat(fleet.ids["r16_all"], PROMPTS[0])


def test_two_tenants_on_a_mixed_fleet_each_get_their_adapter(fleet):
    c = fleet.cluster
    w1 = c.add_worker("w1")
    wait_http(w1, "/health", 300)
    refs = {}
    for tenant, demo in (("acme", "french"), ("globex", "json")):
        dst = c.home / "adapters" / tenant / demo
        shutil.copytree(DEMO / demo, dst)
        ad = c.admin("POST", "/adapters", {"name": f"{tenant}-{demo}", "uri": str(dst), "base_model": c.base_name,
                                           "owner": tenant})
        assert c.admin("POST", f"/adapters/{ad['id']}/activate", {})["status"] == "active"
        c.admin("PUT", f"/tenants/{tenant}/bindings/assistant", {"adapter": ad["id"]})
        refs[tenant] = {"id": ad["id"], "name": ad["id"], "uri": str(dst), "sha256": ad["sha256"], "rank": 8}
    fleet.refs = refs
    # residency decides: acme's adapter held by vLLM only, globex's by the bundled worker only
    # (the activation gate's probe left each on whichever worker ran it)
    assert fleet.control("POST", "/internal/adapters/load", {"adapter": refs["acme"]}).status_code == 200
    r = fleet.control("POST", "/internal/adapters/load", {"adapter": refs["globex"]}, url=w1.url)
    assert r.status_code == 200, r.text
    for tenant, url in (("acme", w1.url), ("globex", fleet.agent.url)):
        r = fleet.control("POST", "/internal/adapters/unload", {"id": refs[tenant]["id"], "force": True}, url=url)
        assert r.status_code in (200, 404), r.text
    _wait_reports(c, {"v1": refs["acme"]["id"], "w1": refs["globex"]["id"]}, {"v1": refs["globex"]["id"],
                                                                               "w1": refs["acme"]["id"]})
    fleet.wait_route("acme", "assistant", "v1")
    fleet.wait_route("globex", "assistant", "w1")
    prompt = PROMPTS[2]
    acme, globex = fleet.chat("acme", "assistant", prompt, 24), fleet.chat("globex", "assistant", prompt, 24)
    assert acme.headers[HDR_WORKER] == "v1" and globex.headers[HDR_WORKER] == "w1"
    assert _text(acme) == fleet.vllm_chat(refs["acme"]["id"], prompt, 24)
    direct = httpx.post(w1.url + "/v1/chat/completions", timeout=TIMEOUT, headers={HDR_WORKER_SECRET: SECRET}, json={
        "model": "x", "messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0,
        EXT_KEY: {"adapter": refs["globex"], "tenant": "globex"}})
    assert _text(globex) == _text(direct)
    base = fleet.vllm_chat(SERVED, prompt, 24)
    assert _text(acme) != base and _text(globex) != _text(acme)
    # streamed through vLLM: usage settled from the stream, the client sees events and [DONE]
    with httpx.stream("POST", fleet.gateway.url + "/v1/chat/completions", timeout=TIMEOUT, json={
            "model": "assistant", "messages": [{"role": "user", "content": prompt}], "max_tokens": 24,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}},
            headers={"Authorization": f"Bearer {c.token('acme')}"}) as s:
        assert s.status_code == 200 and s.headers[HDR_WORKER] == "v1"
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"]) == _text(acme)
    assert chunks[-1]["usage"]["completion_tokens"] == acme.json()["usage"]["completion_tokens"]
    assert all(ch.get("usage") is None for ch in chunks[:-1])  # per-chunk usage is not the client's


def _wait_reports(c: Cluster, holds: dict[str, str], lacks: dict[str, str], timeout_s: float = 60.0) -> None:
    """Until each worker's residency report lists the adapter in ``holds`` and not the one in ``lacks``
    (then the gateway's next refresh routes by them)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = {w: set(rep.device_adapters) | set(rep.host_adapters) if rep else set()
                for w, rep in _reports(c, {*holds, *lacks}).items()}
        if all(a in held[w] for w, a in holds.items()) and not any(a in held[w] for w, a in lacks.items()):
            time.sleep(1.0)  # past the gateway's refresh interval
            return
        assert time.monotonic() < deadline, f"reports do not show {holds} without {lacks}"
        time.sleep(0.3)


def _wait_reported(c: Cluster, worker: str, ok: Any, timeout_s: float = 60.0) -> Any:
    """Until ``ok(report)`` holds for ``worker``'s report (None: withdrawn); the report, once the
    gateway's next refresh has had time to see it."""
    deadline = time.monotonic() + timeout_s
    while True:
        rep = _reports(c, {worker})[worker]
        if ok(rep):
            time.sleep(1.0)  # past the gateway's refresh interval
            return rep
        assert time.monotonic() < deadline, f"{worker}'s report: {rep}"
        time.sleep(0.3)


def _reports(c: Cluster, workers: set[str]) -> dict[str, Any]:
    """The workers' residency reports in Redis (None: none published)."""
    import redis

    from loraplex.wire import WorkerReport

    r = redis.Redis.from_url(c.redis_url)
    try:
        raws = {w: r.get(f"{c.redis_prefix}:worker:{w}") for w in workers}
    finally:
        r.close()
    return {w: WorkerReport.from_json(raw) if raw else None for w, raw in raws.items()}


def test_vllm_killed_under_load_fails_over_or_ends_streams_with_an_error(fleet):
    c = fleet.cluster
    w1 = c.workers[0]
    # acme's adapter on vLLM only (the activation gate may have probed it on the bundled worker)
    fleet.control("POST", "/internal/adapters/unload", {"id": fleet.refs["acme"]["id"], "force": True}, url=w1.url)
    _wait_reports(c, {"v1": fleet.refs["acme"]["id"]}, {"w1": fleet.refs["acme"]["id"]})
    fleet.wait_route("acme", "assistant", "v1")
    auth = {"Authorization": f"Bearer {c.token('acme')}"}

    async def stream(client: httpx.AsyncClient, started: asyncio.Event) -> tuple[int, list[str]]:
        body = {"model": "assistant", "messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 400,
                "temperature": 0, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=auth) as s:
            events: list[str] = []
            async for line in s.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
            return s.status_code, events

    async def run() -> list[Any]:
        started = asyncio.Event()
        async with httpx.AsyncClient(base_url=fleet.gateway.url, timeout=TIMEOUT) as client:
            tasks = [asyncio.create_task(stream(client, started)) for _ in range(8)]
            await asyncio.wait_for(started.wait(), 120)
            fleet.vllm.kill(signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)

    results = asyncio.run(run())
    for res in results:
        assert not isinstance(res, BaseException), res
        status, events = res
        if status == 200:
            assert events and (events[-1] == "[DONE]" or json.loads(events[-1]).get("error")), events[-3:]
        else:
            assert status >= 500
    # Streams vLLM had not started are retried on the bundled worker before their first byte
    # (the failover); one vLLM had started ends with the error event checked above.
    # the bundled worker takes acme's traffic (loading the adapter) once vLLM is gone
    r = fleet.wait_route("acme", "assistant", "w1", timeout_s=60)
    assert r.status_code == 200


def test_vllm_restarted_under_its_agent_is_reported_empty_and_loads_again(fleet):
    """vLLM stopped (the previous test killed it) and started again on its port: during the outage
    the agent withdraws its report and answers loads with 503, and the gateway fails over; after
    it, the agent reports the fresh vLLM holding no adapter, and a request for one is served
    again, the gateway loading it through the agent."""
    c = fleet.cluster
    w1 = c.workers[0]
    fleet.vllm.kill(signal.SIGTERM)  # already down when the module runs in order
    _wait_reported(c, "v1", lambda rep: rep is None)
    health = httpx.get(fleet.agent.url + "/health", timeout=TIMEOUT)
    assert health.status_code == 503 and health.json()["status"] == "vllm_down", health.text
    assert fleet.control("GET", "/internal/adapters").json()["adapters"] == []  # its names went with vLLM
    r = fleet.control("POST", "/internal/adapters/load", {"adapter": _ref(fleet, "r32_all")})
    assert r.status_code == 503 and r.json()["error"]["code"] == "vllm_unavailable", r.text
    r = fleet.chat("iso", "r8_all", PROMPTS[0])  # failover: the bundled worker loads it
    assert r.status_code == 200 and r.headers[HDR_WORKER] == "w1", r.text

    port = int(fleet.vllm.url.rsplit(":", 1)[1])
    fleet.vllm = start_vllm(vllm_python(), fleet.hf_dir, c.home / "vllm-restarted.log", port=port)
    print(f"\nvLLM-CPU restart: {wait_http(fleet.vllm, '/health', 900):.0f} s")
    report = _wait_reported(c, "v1", lambda rep: rep is not None)
    assert report.device_adapters == [] and report.url == fleet.vllm.url
    assert httpx.get(fleet.agent.url + "/health", timeout=TIMEOUT).json()["status"] == "ok"
    loads = httpx.get(fleet.agent.url + "/health", timeout=TIMEOUT).json()["loads"]
    w1.kill(signal.SIGTERM)  # vLLM the one worker left: the request below cannot go elsewhere
    _wait_reported(c, "w1", lambda rep: rep is None)
    r = fleet.wait_route("iso", "r32_all", "v1")
    assert r.headers[HDR_ADAPTER] == "iso-r32-all@1" and r.json()["model"] == fleet.ids["r32_all"]
    assert httpx.get(fleet.agent.url + "/health", timeout=TIMEOUT).json()["loads"] == loads + 1
    held = {a["id"] for a in fleet.control("GET", "/internal/adapters").json()["adapters"]}
    assert held == {fleet.ids["r32_all"]}
    assert _text(fleet.chat("iso", "r32_all", PROMPTS[1])) == fleet.vllm_chat(fleet.ids["r32_all"], PROMPTS[1])


def test_a_stream_cut_mid_way_by_vllm_ends_with_an_error_event(fleet):
    """vLLM killed once the first tokens of a long stream (``ignore_eos``) reached the client:
    the stream ends with the gateway's SSE error event (no ``[DONE]``), the request is logged
    and settled as a 502 with the prompt and the tokens relayed, and the worker's failure counted."""
    c, gateway = fleet.cluster, fleet.gateway
    rid = "cut-" + uuid.uuid4().hex
    failures = _upstream_failures(gateway, "v1")
    body = {"model": "r32_all", "messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 600,
            "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events: list[str] = []
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=TIMEOUT, headers={
            "Authorization": f"Bearer {c.token('iso')}", "x-request-id": rid}) as s:
        assert s.status_code == 200 and s.headers[HDR_WORKER] == "v1"
        lines = s.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line[6:])
                if json.loads(events[-1])["choices"][0]["delta"].get("content"):
                    break  # a token reached the client: now vLLM goes
        fleet.vllm.kill(signal.SIGKILL)
        events += [line[6:] for line in lines if line.startswith("data: ")]
    assert "[DONE]" not in events
    error = json.loads(events[-1])["error"]
    assert error["code"] == "stream_interrupted" and error["type"] == "upstream_error", error
    tokens = [json.loads(e) for e in events[:-1]]
    relayed = tokens[-1]["usage"]
    assert 1 <= relayed["completion_tokens"] < 600  # cut mid-way
    deadline = time.monotonic() + 15  # access-log lines are flushed every second
    while True:
        logged = [json.loads(line) for line in gateway.log.read_text(errors="replace").splitlines()
                  if line.startswith("{") and rid in line]
        if logged or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(logged) == 1 and logged[0]["status"] == 502, logged
    assert (logged[0]["prompt_tokens"], logged[0]["completion_tokens"]) == (relayed["prompt_tokens"],
                                                                            relayed["completion_tokens"])
    assert _upstream_failures(gateway, "v1") == failures + 1


def _ref(fleet: Fleet, name: str) -> dict[str, Any]:
    from loraplex.digest import digest_directory

    return {"id": fleet.ids[name], "name": name, "uri": str(fleet.dirs[name]),
            "sha256": digest_directory(fleet.dirs[name])}


def _upstream_failures(gateway: Proc, worker: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    port = gateway.env["LORAPLEX_GATEWAY_METRICS_PORT"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "loraplex_gateway_upstream_failures_total" and s.labels.get("worker") == worker)
