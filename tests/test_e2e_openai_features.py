"""End to end with the official ``openai`` client: structured outputs, tool calls, logprobs,
``n`` and the sampling fields through a gateway to real workers (demo model, its adapters,
real PostgreSQL + Redis).

Every response and stream chunk is validated into the client's own typed models
(``ChatCompletion``, ``ChatCompletionChunk``, ``Completion``) with pydantic validation, so a
missing required field fails; json_schema answers are checked with jsonschema over 100
mixed-adapter requests and five schemas at once; forced tool calls over mixed adapters.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.e2e_cluster import Cluster
from tests.engine_fixtures import demo_model_file

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DEMO = Path(__file__).resolve().parent.parent / "demo" / "adapters"
ALIASES = ["base", "french", "json", "terse"]
"""``base`` is the base model's name (set once seeded); the others are acme's aliases."""
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40},
                                      "confident": {"type": "boolean"}},
     "required": ["answer", "confident"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                      "country": {"type": "string", "maxLength": 24}},
     "required": ["city", "country"], "additionalProperties": False},
    {"type": "object", "properties": {"sentiment": {"enum": ["positive", "neutral", "negative"]}},
     "required": ["sentiment"], "additionalProperties": False},
    {"type": "object", "properties": {"yes": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}},
     "required": ["yes", "level"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]
Q = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]


@pytest.fixture(scope="module")
def cluster(pg_url, redis_url, tmp_path_factory):
    model = demo_model_file()
    home = tmp_path_factory.mktemp("e2e-features")
    c = Cluster(home=home, database_url=pg_url, redis_url=redis_url,
                redis_prefix=f"loraplex-e2e-{uuid.uuid4().hex[:8]}", model=str(model))
    with c.running(gateways=("g1",)):
        base = c.admin("POST", "/base-models", {"path": c.model})["name"]
        c.base_name = base
        c.admin("POST", "/tenants", {"slug": "acme", "requests_per_min": 100_000, "tokens_per_min": 10_000_000,
                                     "max_concurrent": 128})
        for name in ("french", "json", "terse"):
            dst = c.home / "adapters" / name
            shutil.copytree(DEMO / name, dst)
            ad = c.admin("POST", "/adapters", {"name": f"acme-{name}", "uri": str(dst), "base_model": base,
                                               "owner": "acme"})
            c.admin("POST", f"/adapters/{ad['id']}/activate", {})
            c.admin("PUT", f"/tenants/acme/bindings/{name}", {"adapter": f"acme-{name}@1"})
        c.wait_current()
        yield c


def _model(c: Cluster, alias: str) -> str:
    return c.base_name if alias == "base" else alias


@pytest.fixture(scope="module")
def client(cluster):
    import openai

    with openai.OpenAI(base_url=cluster.gateways[0].url + "/v1", api_key=cluster.token("acme"),
                       timeout=300.0, max_retries=0) as cl:
        yield cl


def _chat(client: Any, **kw: Any) -> Any:
    """A chat completion validated into ``ChatCompletion`` from the raw JSON."""
    from openai.types.chat import ChatCompletion

    raw = client.chat.completions.with_raw_response.create(**kw)
    return ChatCompletion.model_validate(raw.http_response.json())


def _chat_stream(client: Any, **kw: Any) -> list[Any]:
    from openai.types.chat import ChatCompletionChunk

    return [ChatCompletionChunk.model_validate(c.model_dump(exclude_unset=True))
            for c in client.chat.completions.create(stream=True, **kw)]


def test_every_shape_validates_into_the_client_models(cluster, client):
    from openai import BadRequestError
    from openai.types import Completion

    m = _model(cluster, "json")
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMAS[1], "strict": True}}
    r = _chat(client, model=m, messages=Q, response_format=fmt, max_tokens=80, temperature=0.7, seed=3,
              logprobs=True, top_logprobs=3, logit_bias={"198": -5}, presence_penalty=0.3,
              frequency_penalty=0.2, n=2)
    assert len(r.choices) == 2 and r.usage.completion_tokens > 0
    for ch in r.choices:
        jsonschema.validate(json.loads(ch.message.content), SCHEMAS[1])
        assert ch.logprobs.content and len(ch.logprobs.content[0].top_logprobs) == 3
    chunks = _chat_stream(client, model=m, messages=Q, response_format=fmt, max_tokens=80, temperature=0,
                          logprobs=True, top_logprobs=2, stream_options={"include_usage": True})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS[1])
    assert chunks[-1].usage is not None
    assert sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs)
    r = _chat(client, model=_model(cluster, "terse"), messages=Q, max_completion_tokens=20, temperature=0,
              stop=[".", "\n", "!", "?", ";"])
    assert r.choices[0].finish_reason in ("stop", "length")
    raw = client.completions.with_raw_response.create(model=_model(cluster, "base"), prompt="The capital of France is",
                                                      max_tokens=8, temperature=0, logprobs=3)
    comp = Completion.model_validate(raw.http_response.json())
    assert len(comp.choices[0].logprobs.tokens) == len(comp.choices[0].logprobs.text_offset) > 0
    with pytest.raises(BadRequestError) as exc:
        client.chat.completions.create(model=m, messages=Q, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"$ref": "#/$defs/missing"}}})
    assert exc.value.code == "invalid_response_format"


def test_tool_calls_forced_auto_and_a_tool_turn(cluster, client):
    for alias in ALIASES:  # required: a call whose arguments validate, whatever the adapter
        r = _chat(client, model=_model(cluster, alias), messages=Q, tools=TOOLS, tool_choice="required",
                  max_tokens=80, temperature=0.7, seed=1, n=2)
        for ch in r.choices:
            assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
            for call in ch.message.tool_calls:
                assert call.id.startswith("call_") and call.function.name == "get_weather"
                jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    chunks = _chat_stream(client, model=_model(cluster, "base"), messages=Q, tools=TOOLS, max_tokens=60,
                          tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls and chunks[-1].choices[0].finish_reason == "tool_calls"
    call = calls[0]
    r = _chat(client, model=_model(cluster, "base"), tools=TOOLS, max_tokens=30, temperature=0, messages=[
        *Q, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "get_weather",
                                                             "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}])
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = _chat(client, model=_model(cluster, "french"), messages=Q, tools=TOOLS, max_tokens=30, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")  # auto: parsed, either way valid


def test_json_schema_answers_always_validate_over_mixed_adapters(cluster):
    import openai

    async def go() -> list[tuple[int, str]]:
        async with openai.AsyncOpenAI(base_url=cluster.gateways[0].url + "/v1", api_key=cluster.token("acme"),
                                      timeout=600.0, max_retries=0) as cl:
            async def one(i: int) -> tuple[int, str]:
                schema = SCHEMAS[i % len(SCHEMAS)]
                r = await cl.chat.completions.create(
                    model=_model(cluster, ALIASES[(i // len(SCHEMAS)) % len(ALIASES)]),
                    messages=[{"role": "user", "content": f"Question {i}: describe Paris in JSON."}],
                    response_format={"type": "json_schema",
                                     "json_schema": {"name": f"s{i % len(SCHEMAS)}", "schema": schema}},
                    max_tokens=120, temperature=0.8, seed=i)
                return i, r.choices[0].message.content
            return await asyncio.gather(*(one(i) for i in range(100)))

    for i, text in asyncio.run(go()):
        jsonschema.validate(json.loads(text), SCHEMAS[i % len(SCHEMAS)])
