"""Structured outputs in the engine: per-row xgrammar matchers in mixed batches, the compiled
grammar cache, the compile pool's budget and per-tenant order, and the worker API's
``response_format`` (400 for a schema that cannot compile or is too complex)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import threading
import time

import httpx
import jsonschema
import pytest

from engine.api import create_worker_app
from engine.engine import Engine, EngineConfig
from engine.grammar import COMPILE_NICE, GrammarError, Grammars, GrammarTooComplex
from engine.sequence import SamplingParams
from loraplex.openai_request import MAX_GRAMMAR_BYTES, spec_key
from loraplex.settings import DEV_WORKER_SECRET, Settings
from loraplex.wire import HDR_WORKER_SECRET
from tests.engine_fixtures import make_tiny_model

SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["a", "bb", "ccc"]}},
     "required": ["ok", "tag"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
     "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
     "required": ["xs"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine.from_path(make_tiny_model(tmp_path_factory.mktemp("tiny_grammar"), "llama"),
                           EngineConfig(kv_cache_bytes=4 << 20, max_num_seqs=16, max_model_len=256))
    yield eng
    eng.close()


def test_mixed_batch_constrained_and_free_rows(engine):
    """Three schemas, sampled (seeded) and greedy, beside free rows, in the same steps: every
    constrained row ends with JSON valid for its own schema; free rows are not constrained."""
    prompt = engine.tokenizer.encode("Hello world")
    rows = []
    for i in range(12):
        schema = SCHEMAS[i % 3] if i % 4 != 3 else None
        params = SamplingParams(max_tokens=96, temperature=0.0 if i % 2 else 1.0, seed=i, ignore_eos=schema is None,
                                grammar=spec_key("json_schema", schema) if schema else None)
        rows.append((schema, params))
    seqs = engine.generate([prompt] * len(rows), [p for _, p in rows])
    free_texts = []
    for (schema, _), seq in zip(rows, seqs, strict=True):
        if schema is None:
            free_texts.append(seq.output_text)
            continue
        assert seq.finish_reason == "stop", (seq.output_text, seq.finish_reason)
        jsonschema.validate(json.loads(seq.output_text), schema)
    assert not any(t.lstrip().startswith("{") for t in free_texts), free_texts


def test_json_object_and_same_tokens_as_alone(engine):
    """A constrained row gives the same greedy tokens alone and beside other rows."""
    prompt = engine.tokenizer.encode("The quick brown")
    p = SamplingParams(max_tokens=64, temperature=0.0, grammar=spec_key("json_schema", SCHEMAS[0]))
    alone = engine.generate([prompt], p)[0].output_ids
    other = SamplingParams(max_tokens=20, temperature=1.0, seed=3, grammar="json_object")
    mixed = engine.generate([prompt, prompt, engine.tokenizer.encode("Hi")], [other, p, other])
    assert mixed[1].output_ids == alone
    for s in (mixed[0], mixed[2]):  # json_object: valid JSON whenever it finished on its own
        if s.finish_reason == "stop":
            assert isinstance(json.loads(s.output_text), dict)


def test_compiled_grammars_are_cached_and_bounded(engine):
    g = Grammars(engine.tokenizer, engine.model.cfg.vocab_size, sorted(engine.eos_token_ids), cache_size=2)
    keys = [spec_key("json_schema", s) for s in SCHEMAS]
    assert g.compile(keys[0]) is g.compile(keys[0]) and g.compiles == 1
    assert spec_key("json_schema", json.loads(json.dumps(SCHEMAS[0], indent=2))) == keys[0]  # compact text
    for k in keys:
        g.compile(k)
    assert len(g) == 2 and g.compiles == 3
    with pytest.raises(GrammarError, match="cannot be compiled"):
        g.compile(spec_key("json_schema", {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}))


def wide(n: int, tag: str = "") -> dict:
    """An object of ``n`` required string properties: compiling grows faster than linearly with ``n``."""
    props = {f"{tag}field_{i}": {"type": "string"} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _grammars(engine, **kw) -> Grammars:
    return Grammars(engine.tokenizer, engine.model.cfg.vocab_size, sorted(engine.eos_token_ids), **kw)


async def test_a_compile_past_its_cpu_budget_is_refused_and_remembered(engine):
    g = _grammars(engine, budget_s=0.05)
    key = spec_key("json_schema", wide(2500))  # about 0.7 s of CPU on the tiny vocabulary
    assert len(key) < MAX_GRAMMAR_BYTES
    with pytest.raises(GrammarTooComplex, match=r"budget of 0\.05 s"):
        await g.prepare(key, "acme")
    assert g.refused == 1
    t0 = time.perf_counter()
    with pytest.raises(GrammarTooComplex):  # the digest is remembered: refused without compiling
        await g.prepare(key, "globex")
    assert g.refused == 1 and time.perf_counter() - t0 < 0.05
    # The tenant's next schema compiles once its runaway compile has ended; that one is not kept.
    small = spec_key("json_schema", SCHEMAS[0])
    assert await g.prepare(small, "acme") is g.compile(small)
    assert g.compiles == 2 and len(g) == 1
    g.close()


async def test_a_tenant_compiles_one_schema_at_a_time_at_the_lowest_priority(engine, monkeypatch):
    g = _grammars(engine, compile_threads=2, budget_s=60)
    mine = [spec_key("json_schema", wide(600, f"a{i}_")) for i in range(3)]
    theirs = spec_key("json_schema", wide(600, "b_"))
    owner = dict.fromkeys(mine, "acme") | {theirs: "globex"}
    spans: dict[str, list[tuple[float, float]]] = {}
    nices = set()
    build = g._build

    def recorded(key, run=None):
        t0 = time.monotonic()
        nices.add(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        try:
            return build(key, run)
        finally:
            spans.setdefault(owner[key], []).append((t0, time.monotonic()))

    monkeypatch.setattr(g, "_build", recorded)
    got = await asyncio.gather(*(g.prepare(k, "acme") for k in mine), g.prepare(theirs, "globex"),
                               g.prepare(theirs, "initech"))
    assert all(x is not None for x in got) and got[3] is got[4]  # the same text compiled once
    acme = sorted(spans["acme"])
    assert len(acme) == 3 and all(a[1] <= b[0] for a, b in itertools.pairwise(acme)), acme
    assert len(spans["globex"]) == 1 and spans["globex"][0][0] < acme[-1][0]  # not queued behind acme's three
    assert nices == {COMPILE_NICE}
    assert g.compiles == 4
    g.close()


@pytest.fixture
async def client(engine, tmp_path):
    settings = Settings(home=str(tmp_path), worker_id="w-grammar", max_body_bytes=1 << 20)
    engine.start()
    app = create_worker_app(settings, engine=engine, report=False)
    headers = {HDR_WORKER_SECRET: DEV_WORKER_SECRET}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w", headers=headers) as c:
        yield c
    engine.stop()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_response_format_over_http(client, path):
    fmt = {"type": "json_schema", "json_schema": {"name": "tagged", "schema": SCHEMAS[0], "strict": True}}
    body = {"max_tokens": 96, "temperature": 0.7, "seed": 5, "response_format": fmt}
    body |= {"messages": [{"role": "user", "content": "Hello"}]} if "chat" in path else {"prompt": "Hello"}
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if "chat" in path else choice["text"]
    jsonschema.validate(json.loads(text), SCHEMAS[0])
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize(("fmt", "code", "param"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}},
     "invalid_response_format", "response_format"),
    ({"type": "xml"}, "invalid_value", "response_format.type"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "invalid_value", "response_format.json_schema.name"),
])
async def test_bad_response_format_is_a_400_naming_the_problem(client, fmt, code, param):
    r = await client.post("/v1/completions", json={"prompt": "Hello", "response_format": fmt})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == (code, param) and err["message"]
    ok = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    assert ok.status_code == 200


async def test_too_complex_schemas_are_a_400_by_size_and_by_budget(client, engine, monkeypatch):
    fmt = {"type": "json_schema", "json_schema": {"name": "wide", "schema": wide(4000)}}
    compiles = engine.grammars.compiles
    r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "response_format": fmt})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("response_format_too_complex", "response_format")
    assert f"at most {MAX_GRAMMAR_BYTES} bytes" in err["message"]
    assert engine.grammars.compiles == compiles  # refused before any compiling
    monkeypatch.setattr(engine.grammars, "budget_s", 0.05)
    fmt["json_schema"]["schema"] = wide(2500, "b")
    r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "response_format": fmt})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("response_format_too_complex", "response_format")
    assert "CPU time" in err["message"]
    ok = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    assert ok.status_code == 200
    metrics = (await client.get("/metrics")).text
    assert 'loraplex_worker_grammar_refused_total{worker="w-grammar"} 1.0' in metrics, metrics
