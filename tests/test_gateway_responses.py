"""The Responses API through a real uvicorn gateway, with the official ``openai`` client: stub
workers as processes (they record the chat body each turn became), stored responses in a migrated
SQLite registry, tenants from a stub snapshot."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import openai
import pytest
import redis

from gateway.app import create_app
from loraplex.settings import Settings
from loraplex.tokens import mint
from tests.registry_support import fresh_registry
from tests.stub_worker import MutableSnapshots, StubProcess, ThreadServer, make_snapshot

BINDING = {"bindings": {"support": {"active": ("sup", 1)}}}
TENANTS = {"acme": {"tokens_per_min": 1_000_000, "requests_per_min": 10_000, "max_concurrent": 64, **BINDING},
           "globex": {"tokens_per_min": 1_000_000, "requests_per_min": 10_000, **BINDING}}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
          "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    prefix = f"loraplex-test-{uuid.uuid4().hex[:10]}"
    url = "redis://127.0.0.1:6379/0"
    db = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('responses') / 'registry.db'}"
    asyncio.run(fresh_registry(db))
    worker = StubProcess("w1", redis_url=url, redis_prefix=prefix, device=("sup-v1",))
    worker.start()
    s = Settings(redis_url=url, redis_prefix=prefix, database_url=db, response_retention_s=3600)
    app = create_app(s, snapshots=MutableSnapshots(make_snapshot(TENANTS)), mount_admin=False)
    r = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while r.zcard(f"{prefix}:workers") < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    with ThreadServer(app) as gw:
        gw.app = app
        yield s, gw, worker, db
    worker.stop()
    keys = list(r.scan_iter(f"{prefix}*"))
    if keys:
        r.delete(*keys)
    r.close()


def client(system, tenant: str = "acme") -> openai.OpenAI:
    s, gw, _w, _db = system
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=mint(s, "u", tenant=tenant), max_retries=0)


def last_chat(system) -> dict:
    """The chat body the stub worker got last."""
    return system[2].stats()["exts"][-1]


def rows(system) -> int:
    import sqlite3

    path = system[3].split("///", 1)[1]
    with sqlite3.connect(path) as conn:
        return conn.execute("select count(*) from responses").fetchone()[0]


def test_a_response_is_created_retrieved_listed_and_deleted(system):
    c = client(system)
    r = c.responses.create(model="support", input="hello there", instructions="Be brief.", temperature=0,
                           max_output_tokens=8, metadata={"ticket": "42"})
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.output_text == "ok from w1" and r.model == "support"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens == 5
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Be brief." and r.metadata == {"ticket": "42"} and r.store is True
    sent = last_chat(system)
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
    assert sent["max_tokens"] == 8 and sent["temperature"] == 0
    got = c.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == "ok from w1"
    items = c.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "hello there")]
    assert c.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.delete(r.id)


def test_a_streamed_response_emits_the_responses_events_in_order(system):
    c = client(system)
    events = list(c.responses.create(model="support", input=[{"role": "user", "content": "hi"}], stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == "t0 t1 t2 t3 t4 "
    done = events[-1].response
    assert done.status == "completed" and done.output_text == "t0 t1 t2 t3 t4 " and done.usage.output_tokens == 5
    assert c.responses.retrieve(done.id).output_text == "t0 t1 t2 t3 t4 "  # kept before it completed


def test_a_conversation_continues_from_the_stored_response(system):
    c = client(system)
    first = c.responses.create(model="support", input="My name is Ada.", instructions="Old instructions.")
    second = c.responses.create(model="support", input="What is my name?", previous_response_id=first.id,
                                instructions="New instructions.")
    assert second.previous_response_id == first.id
    assert last_chat(system)["messages"] == [
        {"role": "system", "content": "New instructions."}, {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "ok from w1"}, {"role": "user", "content": "What is my name?"}]
    listed = c.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in listed.data] == ["message", "message", "message"]
    assert [i.role for i in listed.data] == ["user", "assistant", "user"]


def test_json_schema_format_and_function_tools_reach_the_worker_as_chat(system):
    c = client(system)
    c.responses.create(model="support", input="Where?", text={"format": {
        "type": "json_schema", "name": "place", "schema": SCHEMA, "strict": True}})
    assert last_chat(system)["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "place", "schema": SCHEMA, "strict": True}}
    c.responses.create(model="support", input="Weather?", tools=[WEATHER], tool_choice="auto")
    sent = last_chat(system)
    assert sent["tools"] == [{"type": "function", "function": {k: WEATHER[k] for k in
                                                                ("name", "description", "parameters")}}]
    assert sent["tool_choice"] == "auto"
    first = c.responses.create(model="support", input="Weather in Paris?", tools=[WEATHER])
    c.responses.create(model="support", previous_response_id=first.id, tools=[WEATHER], input=[
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    msgs = last_chat(system)["messages"]
    assert msgs[-2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert msgs[-1] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


def test_another_tenant_can_neither_read_delete_list_nor_continue_a_response(system):
    mine = client(system).responses.create(model="support", input="secret plans")
    theirs = client(system, "globex")
    for attempt in (lambda: theirs.responses.retrieve(mine.id), lambda: theirs.responses.delete(mine.id),
                    lambda: theirs.responses.input_items.list(mine.id)):
        with pytest.raises(openai.NotFoundError) as exc:
            attempt()
        assert exc.value.body["code"] == "response_not_found"
        assert exc.value.body["message"] == f"Response with id '{mine.id}' not found."
    before = rows(system)
    with pytest.raises(openai.NotFoundError) as exc:
        theirs.responses.create(model="support", input="and then?", previous_response_id=mine.id)
    assert exc.value.body["code"] == "previous_response_not_found"
    assert rows(system) == before, "a refused request stores nothing"
    assert client(system).responses.retrieve(mine.id).output_text == "ok from w1"  # still there, unchanged


def test_store_false_writes_nothing_and_refusals_name_the_field(system):
    c = client(system)
    before = rows(system)
    r = c.responses.create(model="support", input="ephemeral", store=False)
    assert r.store is False and rows(system) == before
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    for body, param, code in (
            ({"input": [{"type": "image_generation_call"}]}, "input[0].type", "unsupported_item_type"),
            ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "invalid_value"),
            ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
             "input[0].content[0]", "unsupported_content"),
            ({"input": ""}, None, None),
            ({"input": []}, "input", "invalid_value"),
            ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]", "unsupported_tool"),
            ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", "unsupported_parameter"),
            ({"input": "x", "metadata": {"k": 1}}, "metadata", "invalid_value")):
        if param is None:
            continue
        with pytest.raises(openai.BadRequestError) as exc:
            c.responses.create(model="support", **body)
        assert (exc.value.body["param"], exc.value.body["code"]) == (param, code), body
    with pytest.raises(openai.NotFoundError) as exc:
        c.responses.create(model="support", input="x", previous_response_id="resp_missing")
    assert exc.value.body["param"] == "previous_response_id"
    assert rows(system) == before


def test_metrics_name_the_route_and_a_401_says_bearer(system):
    _s, gw, _w, _db = system
    c = client(system)
    c.responses.create(model="support", input="count me")
    c.chat.completions.create(model="support", messages=[{"role": "user", "content": "and me"}])
    from prometheus_client import generate_latest

    want = ['loraplex_gateway_route_requests_total{code="2xx",route="responses"}',
            'loraplex_gateway_route_requests_total{code="2xx",route="chat"}']
    deadline = time.monotonic() + 10
    while True:  # a request is counted when it settles, which may come just after the client has its answer
        body = generate_latest(gw.app.gateway.metrics.registry).decode()
        if all(w in body for w in want) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert [w for w in want if w not in body] == []
    r = httpx.post(gw.url + "/v1/responses", json={"model": "support", "input": "x"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert json.loads(r.text)["error"]["type"] == "authentication_error"


def test_a_chain_past_its_limit_and_a_conversation_past_the_body_limit_are_refused(system):
    s, gw, _w, _db = system
    c = client(system)
    gateway = gw.app.gateway
    try:
        gateway.settings = s.replace(response_max_chain=2, max_body_bytes=4000)
        one = c.responses.create(model="support", input="first")
        two = c.responses.create(model="support", input="second", previous_response_id=one.id)
        before = rows(system)
        with pytest.raises(openai.BadRequestError) as exc:
            c.responses.create(model="support", input="third", previous_response_id=two.id)
        assert (exc.value.body["code"], exc.value.body["param"]) == ("chain_too_long", "previous_response_id")
        big = c.responses.create(model="support", input="x" * 2500)
        with pytest.raises(openai.BadRequestError) as exc:
            c.responses.create(model="support", input="y" * 2500, previous_response_id=big.id)
        assert (exc.value.body["code"], exc.value.body["param"]) == ("input_too_large", "input")
        assert rows(system) == before + 1
    finally:
        gateway.settings = s


def test_a_client_that_leaves_a_stream_cancels_the_worker_and_nothing_is_kept(system):
    _s, gw, worker, _db = system
    cancelled = worker.stats()["cancelled"]
    before = rows(system)
    headers = {"authorization": f"Bearer {mint(system[0], 'u', tenant='acme')}"}
    with httpx.stream("POST", gw.url + "/v1/responses", headers=headers, timeout=30, json={
            "model": "support", "input": "slowly", "stream": True, "metadata": {"stub_chunk_delay": "0.5"}}) as r:
        for line in r.iter_lines():
            if "response.output_text.delta" in line:
                break  # leave after the first token
    deadline = time.monotonic() + 10
    while worker.stats()["cancelled"] == cancelled:
        assert time.monotonic() < deadline, "the worker's request was not cancelled"
        time.sleep(0.05)
    assert rows(system) == before


async def test_the_store_is_per_tenant_and_expired_rows_are_purged(tmp_path):
    from sqlalchemy import text

    from registry.responses import ResponseStore, retention_s

    db = f"sqlite+aiosqlite:///{tmp_path / 'r.db'}"
    await fresh_registry(db)
    s = Settings(database_url=db, response_retention_s=600, response_max_retention_s=3600)
    assert (retention_s(s, None), retention_s(s, 10), retention_s(s, 10**9)) == (600, 10, 3600)
    store = ResponseStore(s)
    try:
        for i, tenant in enumerate(("acme", "acme", "globex")):
            await store.put(tenant=tenant, response={"id": f"resp_{i}", "model": "m", "output": []},
                            input_items=[], context=[], previous=None, adapter="a@1")
        assert (await store.get("acme", "resp_0")) is not None and (await store.get("globex", "resp_0")) is None
        assert not await store.delete("globex", "resp_0")
        async with store._session.begin() as session:
            await session.execute(text("update responses set expires_at = '2000-01-01 00:00:00' where id != 'resp_1'"))
        assert (await store.get("acme", "resp_0")) is None, "an expired response reads as missing"
        assert await store.purge(batch=1) == 1 and await store.purge(batch=1) == 1 and await store.purge() == 0
        assert (await store.get("acme", "resp_1")) is not None
        none = ResponseStore(s.replace(response_max_retention_s=0))
        await none.put(tenant="acme", response={"id": "resp_x", "model": "m", "output": []}, input_items=[],
                       context=[], previous=None, adapter="a@1")
        assert (await store.get("acme", "resp_x")) is None, "no retention: nothing is written"
        await none.close()
    finally:
        await store.close()


async def test_a_tenants_own_retention_is_set_through_the_service_and_zero_keeps_nothing(tmp_path):
    from registry.responses import ResponseStore
    from registry.service import RegistryService

    db = f"sqlite+aiosqlite:///{tmp_path / 'r.db'}"
    await fresh_registry(db)
    s = Settings(database_url=db, home=str(tmp_path / "home"), response_retention_s=600)
    svc = RegistryService(s)
    store = ResponseStore(s)
    try:
        for slug in ("keeps", "forgets"):
            await svc.create_tenant(slug)
        assert (await svc.get_tenant("keeps")).response_retention_s is None
        out = await svc.set_tenant_limits("forgets", response_retention_s=0)
        assert out.response_retention_s == 0
        audit = await svc.audit(action="tenant.limits")
        assert audit[0].after["response_retention_s"] == 0
        for slug in ("keeps", "forgets"):
            await store.put(tenant=slug, response={"id": f"resp_{slug}", "model": "m", "output": []}, input_items=[],
                            context=[], previous=None, adapter="a@1")
        assert await store.get("keeps", "resp_keeps") is not None
        assert await store.get("forgets", "resp_forgets") is None, "a tenant with no retention keeps nothing"
    finally:
        await store.close()
        await svc.close()
