"""End to end: real PostgreSQL + Redis, two gateways, two workers on the demo model.

Everything goes through the public surfaces: the admin API (as ``loraplex admin``
does), the OpenAI-compatible endpoint, and the ``openai`` client. Tests run in file
order; the worker-kill test is last because it changes the fleet.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import pytest

from loraplex.wire import HDR_ADAPTER, HDR_WORKER
from tests.e2e_cluster import Cluster
from tests.engine_fixtures import demo_model_file

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DEMO = Path(__file__).resolve().parent.parent / "demo" / "adapters"
QUESTION = [{"role": "user", "content": "What is the capital of Italy?"}]
FRENCH_WORDS = {"le", "la", "les", "est", "de", "des", "une", "un", "et", "capitale"}


@pytest.fixture(scope="module")
def cluster(pg_url, redis_url, tmp_path_factory):
    model = demo_model_file()
    for name in ("french", "json", "terse"):
        assert (DEMO / name / "adapter_model.safetensors").is_file(), f"demo adapter {name} missing (demo/README.md)"
    home = tmp_path_factory.mktemp("e2e")
    c = Cluster(home=home, database_url=pg_url, redis_url=redis_url,
                redis_prefix=f"loraplex-e2e-{uuid.uuid4().hex[:8]}", model=str(model))
    with c.running():
        _seed(c)
        yield c


def _seed(c: Cluster) -> None:
    base = c.admin("POST", "/base-models", {"path": c.model})["name"]
    c.base_name = base
    for slug in ("acme", "globex"):
        c.admin("POST", "/tenants", {"slug": slug, "requests_per_min": 10_000, "tokens_per_min": 1_000_000,
                                     "max_concurrent": 64})
    for tenant, name in (("acme", "french"), ("acme", "terse"), ("globex", "json")):
        dst = c.home / "adapters" / tenant / name
        shutil.copytree(DEMO / name, dst)
        ad = c.admin("POST", "/adapters", {"name": f"{tenant}-{name}", "uri": str(dst), "base_model": base,
                                           "owner": tenant})
        ad = c.admin("POST", f"/adapters/{ad['id']}/activate", {})
        assert ad["status"] == "active", ad
    c.admin("PUT", "/tenants/acme/bindings/assistant", {"adapter": "acme-french@1"})
    c.admin("PUT", "/tenants/acme/bindings/support", {"adapter": "acme-terse@1"})
    c.admin("PUT", "/tenants/globex/bindings/assistant", {"adapter": "globex-json@1"})
    c.wait_current()


def _chat(c: Cluster, tenant: str, model: str, *, gateway: int = 0, user: str | None = None,
          max_tokens: int = 40, messages: list | None = None) -> httpx.Response:
    body = {"model": model, "messages": messages or QUESTION, "max_tokens": max_tokens, "temperature": 0}
    if user:
        body["user"] = user
    return httpx.post(c.gateways[gateway].url + "/v1/chat/completions", json=body, timeout=120.0,
                      headers={"Authorization": f"Bearer {c.token(tenant)}"})


def test_two_tenants_same_alias_get_their_own_adapter(cluster):
    async def both():
        async with httpx.AsyncClient(timeout=120.0) as client:
            async def ask(tenant: str, gw: int) -> httpx.Response:
                return await client.post(
                    cluster.gateways[gw].url + "/v1/chat/completions",
                    headers={"Authorization": f"Bearer {cluster.token(tenant)}"},
                    json={"model": "assistant", "messages": QUESTION, "max_tokens": 48, "temperature": 0})
            return await asyncio.gather(ask("acme", 0), ask("globex", 1), ask("acme", 1), ask("globex", 0))

    acme1, globex1, acme2, globex2 = asyncio.run(both())
    for r in (acme1, globex1, acme2, globex2):
        assert r.status_code == 200, r.text
    assert acme1.headers[HDR_ADAPTER] == "acme-french@1"
    assert globex1.headers[HDR_ADAPTER] == "globex-json@1"
    french = acme1.json()["choices"][0]["message"]["content"]
    words = {w.strip(".,!?'\"").lower() for w in french.split()}
    assert len(words & FRENCH_WORDS) >= 2, french
    answer = globex1.json()["choices"][0]["message"]["content"]
    assert answer.lstrip().startswith("{"), answer
    # Same tenant, same alias, greedy: the same answer whichever gateway/worker served it.
    assert acme2.json()["choices"][0]["message"]["content"] == french
    assert globex2.json()["choices"][0]["message"]["content"] == answer


def test_models_lists_only_the_callers_aliases(cluster):
    r = httpx.get(cluster.gateways[1].url + "/v1/models",
                  headers={"Authorization": f"Bearer {cluster.token('globex')}"})
    assert r.status_code == 200
    ids = {m["id"] for m in r.json()["data"]}
    assert ids == {"assistant", cluster.base_name}
    r = _chat(cluster, "globex", "support")  # acme's alias: not globex's
    assert r.status_code == 404
    assert "acme" not in r.text


def test_canary_split_near_setting_and_sticky(cluster):
    cluster.admin("POST", "/tenants/acme/bindings/assistant/canary", {"adapter": "acme-terse@1", "percent": 20})
    cluster.wait_current()

    async def run() -> dict[str, str]:
        seen: dict[str, str] = {}
        sem = asyncio.Semaphore(8)
        async with httpx.AsyncClient(timeout=120.0) as client:
            async def one(i: int) -> None:
                user = f"user-{i}"
                async with sem:
                    r = await client.post(cluster.gateways[i % 2].url + "/v1/chat/completions",
                                          headers={"Authorization": f"Bearer {cluster.token('acme')}"},
                                          json={"model": "assistant", "messages": QUESTION, "max_tokens": 1,
                                                "user": user})
                assert r.status_code == 200, r.text
                seen[user] = r.headers[HDR_ADAPTER]
            await asyncio.gather(*(one(i) for i in range(300)))
        return seen

    seen = asyncio.run(run())
    share = Counter(seen.values())["acme-terse@1"] / len(seen)
    assert 0.12 <= share <= 0.28, share  # 20% +- 3.5 sigma at n=300
    # Sticky: the same user gets the same version again, on either gateway.
    for user in list(seen)[:20]:
        i = int(user.split("-")[1])
        r = _chat(cluster, "acme", "assistant", gateway=(i + 1) % 2, user=user, max_tokens=1)
        assert r.headers[HDR_ADAPTER] == seen[user]
    cluster.admin("DELETE", "/tenants/acme/bindings/assistant/canary")


def _until_serving(cluster, label: str, within_s: float) -> set[int]:
    """Poll both gateways until each serves ``label`` for acme's assistant; the ones that do not."""
    t0 = time.monotonic()
    pending = {0, 1}
    while pending and time.monotonic() - t0 < within_s:
        for gw in list(pending):
            if _chat(cluster, "acme", "assistant", gateway=gw, max_tokens=1).headers[HDR_ADAPTER] == label:
                pending.discard(gw)
    return pending


def test_rollback_reaches_every_gateway_within_2s(cluster):
    cluster.admin("PUT", "/tenants/acme/bindings/assistant", {"adapter": "acme-terse@1"})
    assert not _until_serving(cluster, "acme-terse@1", 10.0)
    out = cluster.cli("rollback", "acme", "assistant", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["active"]["label"] == "acme-french@1"
    # Timed from the CLI's exit (its row flip commits just before), not its interpreter start-up.
    pending = _until_serving(cluster, "acme-french@1", 2.0)
    assert not pending, f"gateways {pending} still serve the old version after 2 s"


def test_tight_token_limit_429s_and_never_overshoots(cluster):
    limit = 600
    cluster.admin("POST", "/tenants", {"slug": "tight", "requests_per_min": 1000, "tokens_per_min": limit,
                                       "max_concurrent": 64})
    cluster.wait_current()

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120.0) as client:
            return await asyncio.gather(*(client.post(
                cluster.gateways[i % 2].url + "/v1/completions",
                headers={"Authorization": f"Bearer {cluster.token('tight')}"},
                json={"model": cluster.base_name, "prompt": "Count to ten:", "max_tokens": 40})
                for i in range(24)))

    t0 = time.monotonic()
    responses = asyncio.run(burst())
    elapsed = time.monotonic() - t0
    ok = [r for r in responses if r.status_code == 200]
    limited = [r for r in responses if r.status_code == 429]
    assert ok and limited, [r.status_code for r in responses]
    assert len(ok) + len(limited) == len(responses)
    # The bucket refills (10 tokens a second) while the burst runs.
    assert sum(r.json()["usage"]["total_tokens"] for r in ok) <= limit + limit * elapsed / 60
    r = limited[0]
    assert int(r.headers["retry-after"]) >= 1
    assert r.headers["x-ratelimit-limit-tokens"] == str(limit)
    assert r.json()["error"]["type"]


def test_openai_client_chat_completions_and_streaming(cluster):
    import openai

    client = openai.OpenAI(base_url=cluster.gateways[0].url + "/v1", api_key=cluster.token("acme"))
    chat = client.chat.completions.create(model="support", messages=QUESTION, max_tokens=24, temperature=0)
    assert chat.choices[0].message.content
    assert chat.usage.completion_tokens > 0
    comp = client.completions.create(model=cluster.base_name, prompt="The sky is", max_tokens=8, temperature=0)
    assert comp.choices[0].text
    pieces, usage = [], None
    for chunk in client.chat.completions.create(model="assistant", messages=QUESTION, max_tokens=24,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == _chat(cluster, "acme", "assistant", max_tokens=24).json()[
        "choices"][0]["message"]["content"]
    assert usage is not None and usage.completion_tokens > 0


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}


def test_responses_continue_on_another_gateway_and_survive_a_restart_of_both(cluster):
    """The Responses API with the official client on PostgreSQL: a conversation started on one
    gateway continues on the other (streamed), json_schema and a function tool's round trip work on
    the demo model, and everything stored survives both gateways restarting."""
    import openai

    def client(gw: int, tenant: str = "acme") -> openai.OpenAI:
        return openai.OpenAI(base_url=cluster.gateways[gw].url + "/v1", api_key=cluster.token(tenant),
                             max_retries=0)

    first = client(0).responses.create(model="assistant", input="What is the capital of Italy?",
                                       instructions="Answer in one sentence.", temperature=0, max_output_tokens=24)
    assert first.status in ("completed", "incomplete") and first.output_text
    chat = _chat(cluster, "acme", "assistant", max_tokens=24, messages=[
        {"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": "What is the capital of Italy?"}])
    assert first.output_text == chat.json()["choices"][0]["message"]["content"], "the same greedy answer as chat"
    events = list(client(1).responses.create(model="assistant", input="And of France?", temperature=0,
                                             max_output_tokens=16, previous_response_id=first.id, stream=True))
    done = events[-1]
    assert done.type in ("response.completed", "response.incomplete") and done.response.previous_response_id == first.id
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == done.response.output_text
    assert done.response.usage.input_tokens > first.usage.input_tokens  # the first turn was replayed
    second = done.response
    assert client(0).models.retrieve("assistant").id == "assistant"

    shaped = client(1).responses.create(model="assistant", input="Name a city.", temperature=0, max_output_tokens=48,
                                        text={"format": {"type": "json_schema", "name": "city", "strict": True,
                                                         "schema": WEATHER["parameters"]}})
    assert set(json.loads(shaped.output_text)) == {"city"}
    called = client(0).responses.create(model="assistant", input="What is the weather in Paris?", tools=[WEATHER],
                                        tool_choice="required", temperature=0, max_output_tokens=48)
    call = next(o for o in called.output if o.type == "function_call")
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    answered = client(1).responses.create(model="assistant", previous_response_id=called.id, tools=[WEATHER],
                                          temperature=0, max_output_tokens=24, input=[
                                              {"type": "function_call_output", "call_id": call.call_id,
                                               "output": "sunny, 21 C"}])
    assert answered.output_text

    for gw in cluster.gateways:
        gw.kill(signal.SIGTERM)
    cluster.gateways.clear()
    cluster.add_gateway("g1")
    cluster.add_gateway("g2")
    cluster.wait_ready()
    for gw in (0, 1):
        assert client(gw).responses.retrieve(second.id).output_text == second.output_text
    items = client(1).responses.input_items.list(second.id, order="asc")
    assert [i.type for i in items.data] == ["message", "message", "message"]
    later = client(1).responses.create(model="assistant", input="Thanks.", previous_response_id=second.id,
                                       temperature=0, max_output_tokens=8)
    assert later.previous_response_id == second.id
    with pytest.raises(openai.NotFoundError):
        client(0, "globex").responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        client(0, "globex").responses.create(model="assistant", input="x", previous_response_id=second.id)
    client(0).responses.delete(later.id)
    with pytest.raises(openai.NotFoundError):
        client(1).responses.retrieve(later.id)


def test_killing_a_worker_moves_traffic_and_loses_nothing_silently(cluster):
    victim = cluster.workers[1]

    async def load() -> list[httpx.Response | Exception]:
        async with httpx.AsyncClient(timeout=120.0) as client:
            async def one(i: int) -> httpx.Response:
                return await client.post(cluster.gateways[i % 2].url + "/v1/chat/completions",
                                         headers={"Authorization": f"Bearer {cluster.token('globex')}"},
                                         json={"model": "assistant", "messages": QUESTION, "max_tokens": 24})

            tasks = [asyncio.ensure_future(one(i)) for i in range(16)]
            await asyncio.sleep(1.0)
            victim.kill()
            return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(load())
    for r in results:
        assert isinstance(r, httpx.Response), r  # every accepted request got an answer
        if r.status_code == 200:
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        else:  # a request the dead worker was generating: an explicit error, never a truncated 200
            assert r.status_code in (502, 503, 504), r.text
            assert r.json()["error"]["message"]
    # Afterwards everything lands on the survivor.
    for i in range(6):
        r = _chat(cluster, "globex", "assistant", gateway=i % 2, max_tokens=4)
        assert r.status_code == 200, r.text
        assert r.headers[HDR_WORKER] == "w1"
