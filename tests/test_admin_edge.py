"""The admin API's HTTP edge, the same on every route (the upload's included): a missing or
expired token is a 401 with ``WWW-Authenticate``, a token without the admin scope a 403, a
registry outage a 503 with its ``Retry-After``; a method a path does not serve is a 405 naming
every method it does (``Allow``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx
import pytest

from loraplex.tokens import mint, mint_admin
from registry import admin_api
from registry.admin_api import OPERATIONS, Operation, admin_app
from registry.service import RegistryService
from tests.registry_support import TINY, make_settings
from tests.test_admin_api import mounted

DOWN = "postgresql+asyncpg://postgres@127.0.0.1:1/nowhere"
"""A registry database nobody listens on: every operation that reaches it is a 503."""

VALID: dict[str, Any] = {"slug": "acme", "name": "bot", "uri": "v0", "base_model": "tiny", "adapter": "bot@1",
                         "percent": 10, "reason": "r", "to": "other", "cache_scope": "", "revision": "r1",
                         "architecture": "llama"}
"""A valid value for each required body field (an integer field not named here: 1)."""
QUERY = {"/usage": {"start_time": "0"}}
BODY = {"setTenantLimits": {"tokens_per_min": 7}}
"""A request body where the required fields alone are refused before the database is asked."""
PATH = {"slug": "acme", "alias": "bot", "ref": "bot@1", "name": "tiny"}


@dataclasses.dataclass(frozen=True)
class Call:
    """One request each route answers: the method, the path, and what it sends."""

    name: str
    method: str
    path: str
    json: dict[str, Any] | None = None
    params: dict[str, str] = dataclasses.field(default_factory=dict)
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    content: bytes | None = None


def fill(template: str) -> str:
    return "/".join(PATH[seg[1:-1]] if seg.startswith("{") else seg for seg in template.split("/"))


def _body(op: Operation) -> dict[str, Any] | None:
    if op.body is None:
        return None
    if op.op_id in BODY:
        return BODY[op.op_id]
    if "oneOf" in op.body:
        return TINY.to_dict()
    return valid_body(op.body)


def valid_body(schema: dict[str, Any]) -> dict[str, Any]:
    """The required fields of ``schema`` (one option of a oneOf), each with a valid value."""
    return {name: VALID.get(name, 1) for name in schema.get("required", ())}


CALLS = [Call(f"{op.method} {op.path}", op.method, fill(op.path), _body(op), QUERY.get(op.path, {}))
         for op in OPERATIONS]
CALLS.append(Call("POST /adapters/upload", "POST", "/adapters/upload", None, {"name": "up", "base_model": "tiny"},
                  {"x-loraplex-config-bytes": "2"}, b"{}rest"))


@pytest.fixture
async def down(tmp_path):
    """The admin API over a registry database that is down."""
    settings = make_settings(tmp_path, DOWN)
    service = RegistryService(settings)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mounted(admin_app(service, settings))),
                                 base_url="http://t/admin") as client:
        client.settings = settings  # type: ignore[attr-defined]
        yield client
    await service.close()


async def _send(client: httpx.AsyncClient, call: Call, token: str | None) -> httpx.Response:
    headers = {**call.headers, **({"authorization": f"Bearer {token}"} if token else {})}
    return await client.request(call.method, call.path, json=call.json, params=call.params, headers=headers,
                                content=call.content)


def _error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and (code is None or err["code"] == code), r.text
    return err


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.name)
async def test_every_route_refuses_alike(down, call):
    settings = down.settings
    r = await _send(down, call, None)
    assert _error(r, 401, "missing_token")["type"] == "authentication_error"
    assert r.headers.get("www-authenticate") == "Bearer"
    r = await _send(down, call, mint_admin(settings, ttl_s=-60))
    _error(r, 401)
    assert r.headers.get("www-authenticate") == "Bearer"
    r = await _send(down, call, mint(settings, "acme-backend", tenant="acme"))
    assert _error(r, 403, "insufficient_scope")["type"] == "permission_error"
    assert "www-authenticate" not in r.headers
    r = await _send(down, call, mint_admin(settings))
    assert _error(r, 503)["type"] == "service_unavailable_error"
    assert r.headers.get("retry-after") == "2"


async def test_a_method_a_path_does_not_serve_is_405_naming_the_ones_it_does(down):
    for method, path, allow in (("PUT", "/tenants", "GET, HEAD, POST"),
                                ("POST", "/tenants/acme/bindings/bot", "DELETE, GET, HEAD, PUT"),
                                ("PUT", "/adapters/upload", "GET, HEAD, POST"),
                                ("GET", "/tenants/acme/limits", "PATCH")):
        r = await down.request(method, path)
        assert _error(r, 405, "method_not_allowed")["message"] == f"method {method} is not allowed here"
        assert r.headers["allow"] == allow, (method, path)
    _error(await down.get("/nowhere"), 404, "unknown_route")


async def test_a_bug_is_a_logged_500_that_the_server_never_sees(tmp_path, monkeypatch, caplog):
    """httpx's ASGI transport raises what the app raises: the 500 is answered, not raised on
    (a server would drop the keep-alive connection it came on)."""
    async def broken(call: admin_api.Call) -> Any:
        raise RuntimeError("secret detail")

    monkeypatch.setattr(admin_api, "OPERATIONS", tuple(dataclasses.replace(op, handler=broken)
                                                       for op in OPERATIONS))
    settings = make_settings(tmp_path, f"sqlite+aiosqlite:///{tmp_path}/never.db")
    app = mounted(admin_app(RegistryService(settings), settings))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t/admin") as client:
        r = await client.get("/tenants", headers={"authorization": f"Bearer {mint_admin(settings)}"})
    assert _error(r, 500, "internal_error")["type"] == "server_error" and "secret" not in r.text
    assert any("GET /admin/tenants failed" in rec.getMessage() and rec.exc_info for rec in caplog.records)
