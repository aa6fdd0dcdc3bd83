"""Hostile values in every field: nested a thousand levels, huge, mistyped, odd text.

Each value of ``HOSTILE`` is put, one at a time, into every field of the public routes (chat and
completions, top-level and nested fields alike; on the gateway and on a worker) and every admin
API body field. Every answer is a
success or a 4xx in the OpenAI error shape, and nothing is logged with a traceback. The hypothesis
fuzzers (``test_gateway_validation``, ``test_admin_fuzz``) draw small random shapes; this corpus
holds the shapes that broke the services before: 1,000-level nesting reached stdlib ``json``'s
recursion limit in the gateway's token count and in the admin API's parse (500s).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from engine.api import create_worker_app
from engine.engine import Engine, EngineConfig
from gateway.app import create_app
from gateway.ratelimit import LocalLimiter
from loraplex.residency import MemoryResidency
from loraplex.settings import DEV_WORKER_SECRET, Settings
from loraplex.tokens import mint, mint_admin
from loraplex.wire import HDR_WORKER_SECRET
from registry.admin_api import OPERATIONS, admin_app
from registry.migrate import upgrade
from registry.service import RegistryService
from tests.engine_fixtures import make_tiny_model
from tests.registry_support import TINY, make_settings, write_adapter
from tests.stub_worker import MutableSnapshots, make_snapshot, mock_worker_transport
from tests.worker_double import worker_client


def _deep(levels: int, open_: str, close: str, leaf: str = "1") -> str:
    return open_ * levels + leaf + close * levels


HOSTILE: dict[str, str] = {
    # name -> the JSON text put in the field (raw: stdlib json cannot write 1,000 levels)
    "null": "null", "true": "true", "zero": "0", "negative": "-1", "big_int": str(2**70), "tiny_int": str(-(2**64)),
    "float": "1e308", "neg_zero": "-0.0", "fraction": "0.5", "empty_str": '""', "nul_str": '"\\u0000"',
    "lone_surrogate": '"\\ud800"', "rtl_emoji": '"\\u202e\U0001f600"', "huge_str": json.dumps("x" * 200_000),
    "empty_list": "[]", "empty_obj": "{}", "long_list": json.dumps(list(range(20_000))),
    "wide_obj": json.dumps({f"k{i}": i for i in range(5_000)}), "list_of_obj": '[{"a": [1, {"b": null}]}]',
    "deep_list_70": _deep(70, "[", "]"), "deep_list_1000": _deep(1000, "[", "]"),
    "deep_list_1030": _deep(1030, "[", "]"), "deep_obj_1000": _deep(1000, '{"a":', "}"),
    "deep_mixed_1010": _deep(505, '[{"a":', "}]"),
}
MARK = "\u0000hostile\u0000"


def _with(body: dict[str, Any], path: tuple[Any, ...], name: str) -> bytes:
    """``body`` as JSON text with the hostile value ``name`` at ``path``."""
    b = copy.deepcopy(body)
    node = b
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = MARK
    return json.dumps(b).replace(json.dumps(MARK), HOSTILE[name]).encode()


CHAT = {"model": "support", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "description": "d",
                                                     "parameters": {"type": "object", "properties": {}}}}],
        "tool_choice": "auto", "stream_options": {"include_usage": True},
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}},
        "logit_bias": {"5": 1}}
COMPLETION = {"model": "support", "prompt": "hi", "max_tokens": 4, "logprobs": 1}
TOP_LEVEL = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "n", "temperature", "top_p",
             "top_k", "stream", "stream_options", "stop", "stop_token_ids", "user", "seed", "logprobs",
             "top_logprobs", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty",
             "ignore_eos", "response_format", "tools", "tool_choice", "parallel_tool_calls", "metadata", "loraplex",
             "best_of", "echo", "suffix"]
NESTED = [("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"), ("messages", 0, "name"),
          ("tools", 0), ("tools", 0, "type"), ("tools", 0, "function"), ("tools", 0, "function", "name"),
          ("tools", 0, "function", "description"), ("tools", 0, "function", "parameters"),
          ("tools", 0, "function", "parameters", "properties"), ("stream_options", "include_usage"),
          ("response_format", "type"), ("response_format", "json_schema"),
          ("response_format", "json_schema", "name"), ("response_format", "json_schema", "schema"),
          ("response_format", "json_schema", "strict"), ("logit_bias", "5")]
PUBLIC_CASES = [("/v1/chat/completions", CHAT, (f,)) for f in TOP_LEVEL] + \
               [("/v1/chat/completions", CHAT, p) for p in NESTED] + \
               [("/v1/completions", COMPLETION, (f,)) for f in TOP_LEVEL if f not in ("messages", "tools")]


def _check(r: httpx.Response, what: Any) -> None:
    assert r.status_code < 500, (what, r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"], (what, r.text[:500])
        assert "Traceback" not in r.text and 'File "' not in r.text, (what, r.text[:500])


def _no_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage() or r.levelno >= logging.ERROR]
    assert not bad, [f"{r.name}: {r.getMessage()[:300]}" for r in bad[:5]]


async def test_public_routes_never_500_on_hostile_values(caplog):
    caplog.set_level(logging.WARNING)
    s = Settings(worker_urls=("http://worker",), max_body_bytes=1 << 20)
    tenants = {"acme": {"bindings": {"support": {"active": ("sup", 1)}}}}
    app = create_app(s, snapshots=MutableSnapshots(make_snapshot(tenants)), limiter=LocalLimiter(),
                     residency=MemoryResidency(), http_client=worker_client(mock_worker_transport()),
                     mount_admin=False)
    h = {"authorization": f"Bearer {mint(s, 'u', tenant='acme')}", "content-type": "application/json"}
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        for route, body, path in PUBLIC_CASES:
            for name in HOSTILE:
                r = await c.post(route, content=_with(body, path, name), headers=h)
                _check(r, (route, path, name))
        assert (await c.post("/v1/chat/completions", json=CHAT, headers=h)).status_code == 200
    _no_tracebacks(caplog)


VALID = {"slug": "acme", "name": "bot", "uri": "v0", "base_model": "tiny", "adapter": "bot@1", "percent": 10,
         "reason": "fuzz", "to": "tiny", "path": "v0", "revision": "r1", "architecture": "llama"}
"""A valid value for each required field, so a hostile value in another field reaches the service."""


async def test_worker_api_never_500_on_hostile_values(tmp_path, caplog):
    """The worker reads the same fields (a gateway forwards only what it accepted, but the worker's
    port answers anyone holding the worker secret)."""
    caplog.set_level(logging.WARNING)
    eng = Engine.from_path(make_tiny_model(tmp_path / "tiny", "llama"),
                           EngineConfig(kv_cache_bytes=4 << 20, max_num_seqs=8, max_model_len=256))
    eng.start()
    app = create_worker_app(Settings(home=str(tmp_path), worker_id="w-fuzz", max_body_bytes=1 << 20), engine=eng,
                            report=False)
    h = {HDR_WORKER_SECRET: DEV_WORKER_SECRET, "content-type": "application/json"}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w", headers=h) as c:
            for route, body, path in PUBLIC_CASES:
                for name in HOSTILE:
                    r = await c.post(route, content=_with(body, path, name))
                    _check(r, (route, path, name))
    finally:
        eng.stop()
        eng.close()
    _no_tracebacks(caplog)


def _admin_cases() -> list[tuple[Any, dict[str, Any], str]]:
    """(operation, a body with its required fields valid, the field to make hostile)."""
    out = []
    for op in OPERATIONS:
        if op.body is None:
            continue
        for sch in op.body.get("oneOf", [op.body]):
            base = {k: VALID.get(k, 1) for k in sch.get("required", ())}
            out += [(op, base, name) for name in sorted(sch.get("properties", {}))]
    return out


def _path(template: str) -> str:
    values = {"slug": "acme", "alias": "bot", "ref": "bot@1", "name": "tiny", "id": "bot@1"}
    parts = [values.get(seg[1:-1], "bot@1") if seg.startswith("{") else seg for seg in template.split("/")]
    return "/".join(parts)


def test_admin_api_never_500_on_hostile_values(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    url = f"sqlite+aiosqlite:///{tmp_path}/registry.db"
    upgrade(url)
    cfg = make_settings(tmp_path, url, max_body_bytes=1 << 20)
    write_adapter(Path(cfg.resolved_adapter_root()) / "v0", TINY)
    service = RegistryService(cfg)
    app = Starlette(routes=[Mount("/admin", app=admin_app(service, cfg))])

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     headers={"authorization": f"Bearer {mint_admin(cfg)}",
                                              "content-type": "application/json"}) as c:
            assert (await c.post("/admin/tenants", json={"slug": "acme"})).status_code == 201
            assert (await c.post("/admin/base-models", json=TINY.to_dict())).status_code == 201
            r = await c.post("/admin/adapters", json={"name": "bot", "uri": "v0", "base_model": "tiny"})
            assert r.status_code == 201, r.text
            assert (await c.post("/admin/adapters/bot@1/activate")).status_code == 200
            cases = _admin_cases()
            assert len(cases) > 20, "the scan found the admin body fields"
            for op, base, field in cases:
                for name in HOSTILE:
                    r = await c.request(op.method, "/admin" + _path(op.path), content=_with(base, (field,), name))
                    _check(r, (op.method, op.path, field, name))
            for name in ("deep_list_1000", "deep_obj_1000", "huge_str"):  # the body itself
                _check(await c.post("/admin/tenants", content=HOSTILE[name].encode()), name)
        await service.engine.dispose()

    asyncio.run(run())
    _no_tracebacks(caplog)
