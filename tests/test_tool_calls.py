"""Tool calls: one reading of tools/tool_choice for gateway and worker, the default tool prompt,
forced calls constrained to valid arguments, and OpenAI's response and stream shapes."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from engine.api import create_worker_app
from engine.engine import Engine, EngineConfig
from engine.protocol import RequestError, parse_request
from gateway.errors import GatewayError
from gateway.validate import validate
from loraplex.openai_request import FieldError, parse
from loraplex.settings import DEV_WORKER_SECRET, Settings
from loraplex.tool_calls import forced_schema, parse_output, parse_tools, render_prompt
from loraplex.wire import HDR_WORKER_SECRET
from tests.engine_fixtures import make_tiny_model

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "celsius": {"type": "boolean"}},
           "required": ["city", "celsius"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}
MSG = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": MSG, "tool_choice": "required"}, "tool_choice"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"messages": MSG, "tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"messages": MSG, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"messages": MSG, "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": MSG, "tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": MSG, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"messages": [*MSG, {"role": "tool", "content": "sunny"}]}, "messages[1].tool_call_id"),
    ({"messages": [*MSG, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_gateway_and_worker_refuse_the_same_tool_bodies(engine, body, param):
    with pytest.raises(FieldError) as shared:
        parse(body, chat=True)
    assert shared.value.param == param
    with pytest.raises(GatewayError) as gw:
        validate({"model": "m", **body}, chat=True, max_tokens_cap=8192)
    with pytest.raises(RequestError) as worker:
        parse_request(dict(body), "chat", engine.tokenizer, 2048, "m")
    assert gw.value.param == worker.value.body["error"]["param"] == param


def test_tool_choices_and_completions():
    assert parse_tools({"tools": TOOLS}, True).choice == "auto"
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}, True) is None
    named = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, True)
    assert [t.name for t in named.offered] == ["get_time"] and named.forced
    with pytest.raises(FieldError) as exc:
        parse({"prompt": "x", "tools": TOOLS}, chat=False)
    assert exc.value.param == "tools"


def test_forced_schema_accepts_valid_calls_only():
    spec = parse_tools({"tools": TOOLS, "tool_choice": "required"}, True)
    schema = forced_schema(spec)
    jsonschema.validate([{"name": "get_time", "arguments": {"zone": "UTC"}},
                         {"name": "get_weather", "arguments": {"city": "Oslo", "celsius": True}}], schema)
    for bad in ([], [{"name": "get_time", "arguments": {"zone": "PST"}}], [{"name": "x", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = forced_schema(parse_tools({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, True))
    assert one["maxItems"] == 1


def test_parse_output_auto_and_forced():
    auto = parse_tools({"tools": TOOLS}, True)
    text = 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    content, calls = parse_output(text, auto)
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("get_time", {"zone": "CET"})]
    assert calls[0].id.startswith("call_")
    assert parse_output('{"name": "get_weather", "arguments": {"city": "Oslo", "celsius": false}}', auto)[1]
    assert parse_output('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', auto)[1] == []
    assert parse_output("plain answer", auto) == ("plain answer", [])
    forced = parse_tools({"tools": TOOLS, "tool_choice": "required"}, True)
    assert parse_output('[{"name": "get_time", "arguments": {"zone": "UTC"}}', forced)[1] == []  # cut short


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine.from_path(make_tiny_model(tmp_path_factory.mktemp("tiny_tools"), "llama", max_position_embeddings=2048),
                           EngineConfig(kv_cache_bytes=16 << 20, max_num_seqs=8, max_model_len=2048))
    yield eng
    eng.close()


def test_default_prompt_renders_tools_calls_and_results(engine):
    tok = engine.tokenizer
    assert "tools" not in tok.chat_template  # the tiny template has no tool format: the default applies
    req = parse({"messages": [*MSG, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": '{"city": "Paris", "celsius": true}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21"}], "tools": TOOLS}, chat=True)
    text = render_prompt(tok, req.messages, req.tools)
    assert "<tools>" in text and '"name": "get_weather"' in text and "Weather now" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "celsius": true}}' in text
    assert "<tool_response>\nsunny, 21\n</tool_response>" in text
    assert render_prompt(tok, parse({"messages": MSG}, chat=True).messages, None) == \
        tok.render_chat(MSG, add_generation_prompt=True)


@pytest.fixture
async def client(engine, tmp_path):
    engine.start()
    app = create_worker_app(Settings(home=str(tmp_path), worker_id="w-tools"), engine=engine, report=False)
    headers = {HDR_WORKER_SECRET: DEV_WORKER_SECRET}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w", headers=headers) as c:
        yield c
    engine.stop()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
async def test_forced_calls_always_validate(client, choice):
    for seed in range(4):
        body = {"messages": MSG, "tools": TOOLS, "tool_choice": choice, "max_tokens": 300, "temperature": 1.0,
                "seed": seed}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice_out = r.json()["choices"][0]
        assert choice_out["finish_reason"] == "tool_calls", choice_out
        calls = choice_out["message"]["tool_calls"]
        assert calls and choice_out["message"]["content"] is None
        for c in calls:
            assert c["id"].startswith("call_") and c["type"] == "function"
            if isinstance(choice, dict):
                assert c["function"]["name"] == "get_time"
            jsonschema.validate(json.loads(c["function"]["arguments"]), PARAMS[c["function"]["name"]])


async def test_forced_call_streamed_shape_and_tool_turn(client):
    body = {"messages": MSG, "tools": TOOLS, "tool_choice": "required", "max_tokens": 300, "temperature": 0,
            "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = [json.loads(ln[6:]) async for ln in r.aiter_lines() if ln.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls and [tc["index"] for tc in calls] == list(range(len(calls)))
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    first = calls[0]
    follow = {"messages": [*MSG, {"role": "assistant", "content": None, "tool_calls": [
        {"id": first["id"], "type": "function", "function": first["function"]}]},
        {"role": "tool", "tool_call_id": first["id"], "content": "sunny"}], "tools": TOOLS, "max_tokens": 8}
    r = await client.post("/v1/chat/completions", json=follow)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
