"""The gateway's Starlette routes answer each error type the project raises with the status, body
and headers they always had (byte for byte): the refusals of ``/v1/models``, the stored Responses
and ``/v1/usage`` (``GatewayError``), the registry's (``RegistryError`` and its kinds, raised by a
route), Starlette's (no route, wrong method) and a bug's 500. The expected answers are literal: a
change to any of them is a change of the API."""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.app import create_app
from gateway.ratelimit import LocalLimiter
from loraplex.residency import MemoryResidency
from loraplex.settings import Settings
from loraplex.tokens import mint, mint_admin
from registry.errors import Conflict, Invalid, NotFound, PreconditionFailed, RegistryError, Unavailable
from tests.registry_support import fresh_registry
from tests.stub_worker import MutableSnapshots, make_snapshot

TENANTS = {
    "acme": {"bindings": {"support": {"active": ("sup", 1)}}},
    "gone": {"status": "disabled", "bindings": {}},
}
SECRET = "route-errors-secret-0123456789abcdef"


class Snapshots(MutableSnapshots):
    """The registry snapshot, or a registry that cannot be read (``down``)."""

    down = False

    @property
    def current(self) -> Any:
        if self.down:
            raise ConnectionRefusedError("connect call failed")
        return self._current

    @current.setter
    def current(self, value: Any) -> None:
        self._current = value


async def _raises(request: Request) -> Response:
    raise RAISED[request.path_params["name"]]


RAISED: dict[str, Exception] = {
    "registry": RegistryError("refused", param="p"),
    "not_found": NotFound("no such thing", code="thing_not_found", param="thing"),
    "conflict": Conflict("in the way", extra={"bindings": ["a", "b"]}),
    "invalid": Invalid("a bad value", param="v"),
    "precondition": PreconditionFailed("the row moved on", 7),
    "precondition_any": PreconditionFailed("weak tag", None),
    "unavailable": Unavailable("the registry database is unavailable; try again"),
    "busy": Unavailable("the registry is busy; try again", code="registry_busy", retry_after=1),
    "store": Unavailable("the registry database is unavailable; nothing was read", code="store_unavailable"),
    "teapot": HTTPException(418, "short and stout"),
    "bug": RuntimeError("a bug at /srv/loraplex/gateway/app.py"),
}
"""Raised by a route added for the test: every kind the registry raises, and what else reaches the handlers."""


@pytest.fixture
async def gw(tmp_path: Path, sqlite_url: str):
    await fresh_registry(sqlite_url)
    settings = Settings(database_url=sqlite_url, jwt_secret=SECRET, worker_urls=("http://worker",),
                        response_retention_s=3600, canary_judge_interval_s=0.0, usage_flush_interval_s=0.0)
    snapshots = Snapshots(make_snapshot(TENANTS))
    app = create_app(settings, snapshots=snapshots, limiter=LocalLimiter(), residency=MemoryResidency(),
                     mount_admin=False)
    app.router.routes.append(Route("/test/raise/{name}", _raises, methods=["GET"]))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app, raise_app_exceptions=False), base_url="http://gw") as c:
        await app.gateway.responses_store.put(
            tenant="acme", response={"id": "resp_kept", "model": "support", "object": "response"},
            input_items=[{"id": "msg_1", "type": "message"}], context=[], previous=None, adapter="support@1")
        yield c, app, snapshots, Path(sqlite_url.split("///", 1)[1])


def _auth(tenant: str | None = "acme") -> dict[str, str]:
    settings = Settings(jwt_secret=SECRET)
    token = mint(settings, "u", tenant=tenant) if tenant is not None else mint_admin(settings, subject="admin")
    return {"authorization": f"Bearer {token}"}


def _drop(db: Path, *tables: str) -> None:
    with sqlite3.connect(db) as conn:
        for table in tables:
            conn.execute(f"DROP TABLE IF EXISTS {table}")


Case = Callable[[httpx.AsyncClient, Any, Snapshots, Path], Awaitable[httpx.Response]]


def _get(path: str, headers: dict[str, str] | None = None, method: str = "GET") -> Case:
    async def go(c: httpx.AsyncClient, _app: Any, _snap: Snapshots, _db: Path) -> httpx.Response:
        return await c.request(method, path, headers=_auth() if headers is None else headers)
    return go


async def _registry_down(c: httpx.AsyncClient, _app: Any, snap: Snapshots, _db: Path) -> httpx.Response:
    snap.down = True
    return await c.get("/v1/models", headers=_auth())


async def _store_down(c: httpx.AsyncClient, _app: Any, _snap: Snapshots, db: Path) -> httpx.Response:
    _drop(db, "responses")
    return await c.get("/v1/responses/resp_kept", headers=_auth())


async def _usage_down(c: httpx.AsyncClient, _app: Any, _snap: Snapshots, db: Path) -> httpx.Response:
    with sqlite3.connect(db) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    _drop(db, *[t for t in tables if t.startswith("usage")])
    return await c.get("/v1/usage?start_time=0", headers=_auth())


async def _bug(c: httpx.AsyncClient, app: Any, _snap: Snapshots, _db: Path) -> httpx.Response:
    def broken(*_: Any) -> list[str]:
        raise RuntimeError("a bug at /srv/loraplex/gateway/resolve.py")

    app.gateway.resolver.models = broken
    return await c.get("/v1/models", headers=_auth())


CASES: dict[str, Case] = {
    "missing token": _get("/v1/models", headers={}),
    "bad token": _get("/v1/models", headers={"authorization": "Bearer not-a-jwt"}),
    "unknown tenant": _get("/v1/models", headers=_auth("nobody")),
    "disabled tenant": _get("/v1/models", headers=_auth("gone")),
    "no tenant": _get("/v1/models/support", headers=_auth(None)),
    "registry down": _registry_down,
    "no such model": _get("/v1/models/nope"),
    "no such response": _get("/v1/responses/resp_nope"),
    "delete no such response": _get("/v1/responses/resp_nope", method="DELETE"),
    "items of no such response": _get("/v1/responses/resp_nope/input_items"),
    "items limit": _get("/v1/responses/resp_kept/input_items?limit=0"),
    "items order": _get("/v1/responses/resp_kept/input_items?order=sideways"),
    "stored response refused": _get("/v1/responses/resp_kept", headers=_auth("gone")),
    "usage refused": _get("/v1/usage?start_time=0", headers={}),
    "usage bad parameter": _get("/v1/usage?start_time=0&bucket_width=1w"),
    "usage other tenant": _get("/v1/usage?start_time=0&tenants=gone"),
    "store down": _store_down,
    "usage down": _usage_down,
    "unknown path": _get("/v1/nothing"),
    "wrong method": _get("/v1/models", method="POST"),
    "bug": _bug,
    **{f"raised {name}": _get(f"/test/raise/{name}") for name in RAISED},
}

_JSON = ("content-type", "application/json")
EXPECTED: dict[str, tuple[int, list[tuple[str, str]], bytes]] = {
    'bad token': (401, [('www-authenticate', 'Bearer'), ('content-length', '103'), _JSON],
        b'{"error":{"message":"invalid token","type":"authentication_error","code":"invalid_token",'
        b'"param":null}}'),
    'bug': (500, [('content-length', '163'), _JSON],
        b'{"error":{"message":"Internal error; the server\'s log has the details under this request\'s x-request-id.",'
        b'"type":"api_error","code":"internal_error","param":null}}'),
    'delete no such response': (404, [('content-length', '138'), _JSON],
        b'{"error":{"message":"Response with id \'resp_nope\' not found.","type":"not_found_error",'
        b'"code":"response_not_found","param":"response_id"}}'),
    'disabled tenant': (403, [('content-length', '106'), _JSON],
        b'{"error":{"message":"tenant is disabled","type":"permission_error",'
        b'"code":"tenant_disabled","param":null}}'),
    'items limit': (400, [('content-length', '134'), _JSON],
        b'{"error":{"message":"\'limit\' must be an integer from 1 to 100",'
        b'"type":"invalid_request_error","code":"invalid_value","param":"limit"}}'),
    'items of no such response': (404, [('content-length', '138'), _JSON],
        b'{"error":{"message":"Response with id \'resp_nope\' not found.","type":"not_found_error",'
        b'"code":"response_not_found","param":"response_id"}}'),
    'items order': (400, [('content-length', '125'), _JSON],
        b'{"error":{"message":"\'order\' must be \'asc\' or \'desc\'",'
        b'"type":"invalid_request_error","code":"invalid_value","param":"order"}}'),
    'missing token': (401, [('www-authenticate', 'Bearer'), ('content-length', '110'), _JSON],
        b'{"error":{"message":"missing bearer token","type":"authentication_error",'
        b'"code":"missing_token","param":null}}'),
    'no such model': (404, [('content-length', '151'), _JSON],
        b'{"error":{"message":"The model \'nope\' does not exist or you do not have access to it.",'
        b'"type":"not_found_error","code":"model_not_found","param":null}}'),
    'no such response': (404, [('content-length', '138'), _JSON],
        b'{"error":{"message":"Response with id \'resp_nope\' not found.","type":"not_found_error",'
        b'"code":"response_not_found","param":"response_id"}}'),
    'no tenant': (403, [('content-length', '120'), _JSON],
        b'{"error":{"message":"this token does not belong to a tenant","type":"permission_error",'
        b'"code":"no_tenant","param":null}}'),
    'raised bug': (500, [('content-length', '163'), _JSON],
        b'{"error":{"message":"Internal error; the server\'s log has the details under this request\'s x-request-id.",'
        b'"type":"api_error","code":"internal_error","param":null}}'),
    'raised busy': (503, [('retry-after', '1'), ('content-length', '126'), _JSON],
        b'{"error":{"message":"the registry is busy; try again","type":"service_unavailable_error",'
        b'"code":"registry_busy","param":null}}'),
    'raised conflict': (409, [('content-length', '89'), _JSON],
        b'{"error":{"message":"in the way","type":"conflict_error","code":"conflict",'
        b'"param":null}}'),
    'raised invalid': (422, [('content-length', '101'), _JSON],
        b'{"error":{"message":"a bad value","type":"invalid_request_error","code":"invalid_value",'
        b'"param":"v"}}'),
    'raised not_found': (404, [('content-length', '103'), _JSON],
        b'{"error":{"message":"no such thing","type":"not_found_error","code":"thing_not_found",'
        b'"param":"thing"}}'),
    'raised precondition': (412, [('etag', '"7"'), ('content-length', '122'), _JSON],
        b'{"error":{"message":"the row moved on","type":"invalid_request_error",'
        b'"code":"precondition_failed","param":"row_version"}}'),
    'raised precondition_any': (412, [('content-length', '114'), _JSON],
        b'{"error":{"message":"weak tag","type":"invalid_request_error",'
        b'"code":"precondition_failed","param":"row_version"}}'),
    'raised registry': (400, [('content-length', '99'), _JSON],
        b'{"error":{"message":"refused","type":"invalid_request_error","code":"invalid_request",'
        b'"param":"p"}}'),
    'raised store': (503, [('retry-after', '2'), ('content-length', '153'), _JSON],
        b'{"error":{"message":"the registry database is unavailable; nothing was read",'
        b'"type":"service_unavailable_error","code":"store_unavailable","param":null}}'),
    'raised teapot': (418, [('content-length', '95'), _JSON],
        b'{"error":{"message":"short and stout","type":"invalid_request_error","code":null,'
        b'"param":null}}'),
    'raised unavailable': (503, [('retry-after', '2'), ('content-length', '149'), _JSON],
        b'{"error":{"message":"the registry database is unavailable; try again",'
        b'"type":"service_unavailable_error","code":"registry_unavailable","param":null}}'),
    'registry down': (503, [('retry-after', '2'), ('content-length', '149'), _JSON],
        b'{"error":{"message":"The registry is not available yet; try again shortly.",'
        b'"type":"service_unavailable","code":"registry_unavailable","param":null}}'),
    'store down': (503, [('retry-after', '2'), ('content-length', '184'), _JSON],
        b'{"error":{"message":"the registry schema is missing or outdated (run `loraplex migrate`); nothing was read",'
        b'"type":"service_unavailable_error","code":"store_unavailable","param":null}}'),
    'stored response refused': (403, [('content-length', '106'), _JSON],
        b'{"error":{"message":"tenant is disabled","type":"permission_error",'
        b'"code":"tenant_disabled","param":null}}'),
    'unknown path': (404, [('content-length', '357'), _JSON],
        b'{"error":{"message":"Invalid URL (GET /v1/nothing): the gateway does not serve this path (it serves POST /v1/chat/completions,'
        b' POST /v1/completions, POST /v1/responses, GET|DELETE /v1/responses/{id},'
        b' GET /v1/responses/{id}/input_items, GET /v1/models, GET /v1/models/{model},'
        b' GET /v1/usage)","type":"not_found_error","code":"unsupported_path","param":null}}'),
    'unknown tenant': (401, [('www-authenticate', 'Bearer'), ('content-length', '105'), _JSON],
        b'{"error":{"message":"unknown tenant","type":"authentication_error",'
        b'"code":"unknown_tenant","param":null}}'),
    'usage bad parameter': (400, [('content-length', '149'), _JSON],
        b'{"error":{"message":"bucket_width must be one of 1m, 1h, 1d, got \'1w\'",'
        b'"type":"invalid_request_error","code":"invalid_value","param":"bucket_width"}}'),
    'usage down': (503, [('retry-after', '2'), ('content-length', '190'), _JSON],
        b'{"error":{"message":"the registry schema is missing or outdated (run `loraplex migrate`); nothing was read",'
        b'"type":"service_unavailable_error","code":"registry_schema_missing","param":null}}'),
    'usage other tenant': (404, [('content-length', '117'), _JSON],
        b'{"error":{"message":"Tenant \'gone\' not found.","type":"not_found_error",'
        b'"code":"tenant_not_found","param":"tenants"}}'),
    'usage refused': (401, [('www-authenticate', 'Bearer'), ('content-length', '110'), _JSON],
        b'{"error":{"message":"missing bearer token","type":"authentication_error",'
        b'"code":"missing_token","param":null}}'),
    'wrong method': (405, [('content-length', '98'), _JSON],
        b'{"error":{"message":"Method Not Allowed","type":"invalid_request_error","code":null,'
        b'"param":null}}'),
}
"""case -> (status, headers in order, body): what the gateway answered before its routes raised."""


async def _answer(case: str, gw: Any) -> tuple[int, list[tuple[str, str]], bytes]:
    c, app, snap, db = gw
    r = await CASES[case](c, app, snap, db)
    return r.status_code, [(k.decode(), v.decode()) for k, v in r.headers.raw], r.content


@pytest.mark.parametrize("case", sorted(CASES))
async def test_each_error_is_answered_as_before(gw, case):
    assert await _answer(case, gw) == EXPECTED[case]


def test_every_case_has_its_answer():
    assert sorted(EXPECTED) == sorted(CASES)
