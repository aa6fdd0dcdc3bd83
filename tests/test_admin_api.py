"""Admin HTTP API over the real registry (PostgreSQL and SQLite) through httpx's ASGI
transport: auth (401/403), every operation, OpenAI-shaped errors with the right status,
the OpenAPI document, and 503 for writes when the database is down."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import jwt
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from loraplex.tokens import mint, mint_admin
from registry.admin_api import OPERATIONS, admin_app
from registry.service import RegistryService
from tests.registry_support import TINY, fresh_registry, make_settings, write_adapter


@pytest.fixture
async def api(db_url, tmp_path):
    await fresh_registry(db_url)
    settings = make_settings(tmp_path, db_url)
    service = RegistryService(settings)
    app = mounted(admin_app(service, settings))
    headers = {"authorization": f"Bearer {mint_admin(settings, subject='ops-alice')}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t/admin",
                                 headers=headers) as client:
        client.settings = settings  # type: ignore[attr-defined]
        yield client
    await service.close()


def mounted(admin: Starlette) -> Starlette:
    """As the gateway serves it: a sub-app at /admin."""
    return Starlette(routes=[Mount("/admin", app=admin)])


def _err(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"])
    assert body["error"]["message"] and "Traceback" not in body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


async def test_auth(api):
    s = api.settings
    anon = {"authorization": ""}
    _err(await api.get("/tenants", headers=anon), 401, "missing_token")
    _err(await api.get("/tenants", headers={"authorization": "Basic abc"}), 401)
    _err(await api.get("/tenants", headers={"authorization": "Bearer not.a.jwt"}), 401)
    forged = jwt.encode({"sub": "x", "iss": s.jwt_issuer, "aud": s.jwt_audience, "exp": time.time() + 60,
                         "scope": s.jwt_admin_scope}, "wrong-secret-wrong-secret-wrong-secret", algorithm="HS256")
    _err(await api.get("/tenants", headers={"authorization": f"Bearer {forged}"}), 401)
    expired = mint_admin(s, ttl_s=-60)
    _err(await api.get("/tenants", headers={"authorization": f"Bearer {expired}"}), 401)
    unsigned = jwt.encode({"sub": "x", "iss": s.jwt_issuer, "aud": s.jwt_audience, "exp": time.time() + 60,
                           "scope": s.jwt_admin_scope}, None, algorithm="none")
    _err(await api.get("/tenants", headers={"authorization": f"Bearer {unsigned}"}), 401)
    tenant = mint(s, "acme-backend", tenant="acme")
    e = _err(await api.post("/tenants", json={"slug": "x"}, headers={"authorization": f"Bearer {tenant}"}), 403)
    assert e["type"] == "permission_error"
    assert (await api.get("/tenants")).status_code == 200


@pytest.mark.parametrize("scope", [{"loraplex:admin": 1}, [{"loraplex:admin": 1}], 7, ["loraplex:admin", 1]])
async def test_a_scope_claim_that_is_no_string_or_string_list_grants_nothing(api, scope):
    """Were admin: ``list()`` of an object took its keys as scopes."""
    s = api.settings
    token = jwt.encode({"sub": "x", "iss": s.jwt_issuer, "aud": s.jwt_audience, "exp": time.time() + 60,
                        s.jwt_scope_claim: scope}, s.jwt_secret, algorithm="HS256")
    _err(await api.get("/tenants", headers={"authorization": f"Bearer {token}"}), 401)
    listed = jwt.encode({"sub": "x", "iss": s.jwt_issuer, "aud": s.jwt_audience, "exp": time.time() + 60,
                         s.jwt_scope_claim: ["other", s.jwt_admin_scope]}, s.jwt_secret, algorithm="HS256")
    assert (await api.get("/tenants", headers={"authorization": f"Bearer {listed}"})).status_code == 200


@pytest.mark.parametrize("levels", [65, 1000, 1010, 1030])
async def test_bodies_nested_too_deep_are_400_not_500(api, levels):
    """Were a 500 from 1,000 levels: stdlib json.loads raised RecursionError, uncaught."""
    raw = ('{"slug": "deep", "x": ' + "[" * (levels - 1) + "]" * (levels - 1) + "}").encode()
    e = _err(await api.post("/tenants", content=raw), 400, "invalid_json")
    assert "levels" in e["message"] or "depth limit" in e["message"]
    assert (await api.get("/tenants/deep")).status_code == 404


async def test_openapi_document(api):
    r = await api.get("/openapi.json", headers={"authorization": ""})
    assert r.status_code == 200
    doc = r.json()
    assert doc["openapi"].startswith("3.1")
    ops = {(m.upper(), p) for p, methods in doc["paths"].items() for m in methods}
    assert ops == {(op.method, op.path) for op in OPERATIONS}
    ids = [m["operationId"] for methods in doc["paths"].values() for m in methods.values()]
    assert len(ids) == len(set(ids))
    for needed in ("createTenant", "disableTenant", "enableTenant", "setTenantLimits", "registerBaseModel",
                   "registerAdapter", "activateAdapter", "disableAdapter", "enableAdapter", "bind", "rollback", "startCanary",
                   "setCanary", "promoteCanary", "abortCanary", "enableBinding", "disableBinding", "listAudit",
                   "listTenants", "listAdapters", "listBindings", "listBaseModels"):
        assert needed in ids
    assert doc["paths"]["/tenants/{slug}/bindings/{alias}/canary"]["post"]["requestBody"]["required"] is True


async def test_adapter_disable_in_use_enable_and_plain_binding_disable(api):
    await api.post("/tenants", json={"slug": "acme"})
    assert (await api.post("/base-models", json=TINY.to_dict())).status_code == 201
    root = Path(api.settings.resolved_adapter_root())
    write_adapter(root / "v1", TINY, seed=1)
    ad = (await api.post("/adapters", json={"name": "support", "uri": "v1", "base_model": "tiny"})).json()
    await api.post(f"/adapters/{ad['id']}/activate", json={"verification": {"probe": "ok"}})
    await api.put("/tenants/acme/bindings/support", json={"adapter": "support@1", "on_disabled": "base"})
    # a plain disable refuses, whatever bind chose; the choice is per operation
    r = await api.post("/tenants/acme/bindings/support/disable", json={})
    assert (r.json()["enabled"], r.json()["on_disabled"]) == (False, "refuse")
    r = await api.post("/tenants/acme/bindings/support/enable")
    r = await api.post("/tenants/acme/bindings/support/disable", json={"on_disabled": "base"})
    assert r.json()["on_disabled"] == "base"
    await api.post("/tenants/acme/bindings/support/enable")
    # disabling the version the binding uses: 409 naming it, nothing changed
    r = await api.post("/adapters/support@1/disable", json={"reason": "regression"})
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["error"]["code"] == "adapter_in_use" and body["error"]["type"] == "conflict_error"
    assert "acme/support (active)" in body["error"]["message"]
    assert body["bindings"] == [{"tenant": "acme", "alias": "support", "role": "active"}]
    assert (await api.get("/adapters/support@1")).json()["status"] == "active"
    r = await api.post("/adapters/support@1/disable", json={"reason": "regression", "force": True})
    assert r.status_code == 200 and r.json()["detached"] == body["bindings"]
    assert (await api.get("/tenants/acme/bindings/support")).json()["enabled"] is False
    _err(await api.post("/adapters/support@1/disable", json={"force": "yes"}), 422, "invalid_type")
    # enable: audited, the binding stays disabled
    r = await api.post("/adapters/support@1/enable")
    assert r.status_code == 200 and r.json()["status"] == "active"
    assert (await api.get("/tenants/acme/bindings/support")).json()["enabled"] is False
    audit = (await api.get("/audit", params={"target": f"adapter:{ad['id']}", "limit": 1})).json()["data"]
    assert audit[0]["action"] == "adapter.enable" and audit[0]["actor"] == "ops-alice"
    _err(await api.post("/adapters/support@9/enable"), 404, "adapter_not_found")


async def test_operations_and_errors(api):
    r = await api.post("/tenants", json={"slug": "acme", "requests_per_min": 60, "priority": "high"})
    assert r.status_code == 201 and r.json()["priority"] == "high"
    _err(await api.post("/tenants", json={"slug": "acme"}), 409, "tenant_exists")
    _err(await api.post("/tenants", content=b"{bad json"), 400, "invalid_json")
    _err(await api.post("/tenants", content=b'{"slug": "b", "requests_per_min": NaN}'), 400, "invalid_json")
    _err(await api.post("/tenants", json=["slug"]), 422, "invalid_body")
    _err(await api.post("/tenants", json={"slug": "b", "colour": "red"}), 422, "unknown_field")
    _err(await api.post("/tenants", json={}), 422, "missing_field")
    _err(await api.post("/tenants", json={"slug": "b", "requests_per_min": "many"}), 422, "invalid_type")
    _err(await api.post("/tenants", json={"slug": "b", "requests_per_min": -3}), 422, "invalid_limit")
    _err(await api.post("/tenants", json={"slug": "b", "priority": "urgent"}), 422)
    _err(await api.patch("/tenants/acme/limits", json={"tokens_per_min": -1}), 422, "invalid_limit")
    assert (await api.patch("/tenants/acme/limits", json={"tokens_per_min": 7})).json()["tokens_per_min"] == 7
    _err(await api.patch("/tenants/ghost/limits", json={"tokens_per_min": 7}), 404, "tenant_not_found")
    assert (await api.post("/tenants/acme/disable")).json()["status"] == "disabled"
    assert (await api.post("/tenants/acme/enable")).json()["status"] == "active"
    _err(await api.post("/tenants/ghost/disable"), 404)
    assert [t["slug"] for t in (await api.get("/tenants")).json()["data"]] == ["acme"]
    assert (await api.get("/tenants/acme")).json()["slug"] == "acme"

    r = await api.post("/base-models", json={k: v for k, v in TINY.to_dict().items()})
    assert r.status_code == 201, r.text
    _err(await api.post("/base-models", json=TINY.to_dict()), 409)
    _err(await api.post("/base-models", json={"path": "/nonexistent/model"}), 422, "bad_model_path")
    assert [m["name"] for m in (await api.get("/base-models")).json()["data"]] == ["tiny"]

    root = Path(api.settings.resolved_adapter_root())
    ids = []
    for seed in range(3):
        write_adapter(root / f"v{seed}", TINY, seed=seed)
        r = await api.post("/adapters", json={"name": "support", "uri": f"v{seed}", "base_model": "tiny",
                                              "owner": "acme"})
        assert r.status_code == 201 and r.json()["status"] == "pending", r.text
        ids.append(r.json()["id"])
    _err(await api.post("/adapters", json={"name": "support", "uri": "v0", "base_model": "tiny", "owner": "acme",
                                           "version": 1}), 409, "adapter_version_exists")
    _err(await api.post("/adapters", json={"name": "x", "uri": "v0", "base_model": "nope"}), 404)
    bad = write_adapter(root / "pickled", TINY)
    (bad / "adapter_model.bin").write_bytes(b"\x80\x04.")
    e = _err(await api.post("/adapters", json={"name": "x", "uri": "pickled", "base_model": "tiny"}), 422,
             "pickle_format")
    assert "pickle" in e["message"]
    _err(await api.post("/adapters", json={"name": "x", "uri": "../../etc", "base_model": "tiny"}), 422,
         "path_escape")
    _err(await api.put("/tenants/acme/bindings/support", json={"adapter": ids[0]}), 422, "adapter_not_active")
    for i in ids:
        r = await api.post(f"/adapters/{i}/activate", json={"verification": {"probe": "ok", "latency_ms": 12}})
        assert r.json()["status"] == "active" and r.json()["verification"]["probe"] == "ok"
    _err(await api.post("/adapters/support@9/activate"), 404, "adapter_not_found")
    _err(await api.get("/adapters/not-an-id"), 422)
    assert len((await api.get("/adapters", params={"owner": "acme"})).json()["data"]) == 3

    r = await api.put("/tenants/acme/bindings/support", json={"adapter": ids[0], "on_disabled": "base"})
    assert r.status_code == 200 and r.json()["active"]["label"] == "support@1"
    r = await api.put("/tenants/acme/bindings/support", json={"adapter": "support@2"})
    assert (r.json()["active"]["label"], r.json()["previous"]["label"]) == ("support@2", "support@1")
    assert (await api.post("/tenants/acme/bindings/support/rollback")).json()["active"]["label"] == "support@1"
    _err(await api.post("/tenants/acme/bindings/nope/rollback"), 404, "binding_not_found")
    _err(await api.post("/tenants/ghost/bindings/support/rollback"), 404, "tenant_not_found")
    for pct in (0, 101, -1, "5"):
        _err(await api.post("/tenants/acme/bindings/support/canary", json={"adapter": ids[2], "percent": pct}), 422)
    r = await api.post("/tenants/acme/bindings/support/canary", json={"adapter": ids[2], "percent": 10})
    assert r.json()["canary"]["label"] == "support@3" and r.json()["canary_percent"] == 10
    assert (await api.patch("/tenants/acme/bindings/support/canary", json={"percent": 25})).json()[
        "canary_percent"] == 25
    _err(await api.patch("/tenants/acme/bindings/support/canary", json={"percent": 0}), 422, "invalid_percent")
    r = await api.post("/tenants/acme/bindings/support/canary/promote")
    assert (r.json()["active"]["label"], r.json()["canary"]) == ("support@3", None)
    _err(await api.delete("/tenants/acme/bindings/support/canary"), 409, "no_canary")
    await api.post("/tenants/acme/bindings/support/canary", json={"adapter": ids[1], "percent": 50})
    assert (await api.delete("/tenants/acme/bindings/support/canary")).json()["canary"] is None
    r = await api.post("/tenants/acme/bindings/support/disable", json={"on_disabled": "refuse"})
    assert (r.json()["enabled"], r.json()["on_disabled"]) == (False, "refuse")
    assert (await api.post("/tenants/acme/bindings/support/enable")).json()["enabled"] is True
    assert (await api.get("/tenants/acme/bindings/support")).json()["active"]["id"] == ids[2]
    assert len((await api.get("/bindings", params={"tenant": "acme"})).json()["data"]) == 1
    assert (await api.post(f"/adapters/{ids[0]}/disable", json={"reason": "bad"})).json()["status"] == "disabled"
    assert (await api.post(f"/adapters/{ids[0]}/activate")).json()["status"] == "active"

    audit = (await api.get("/audit", params={"target": "binding:acme/*", "limit": 3})).json()["data"]
    assert [a["action"] for a in audit] == ["binding.enable", "binding.disable", "binding.canary_abort"]
    assert all(a["actor"] == "ops-alice" for a in audit)
    assert (await api.get("/audit", params={"action": "tenant.create"})).json()["data"][0]["target"] == "tenant:acme"
    _err(await api.get("/audit", params={"limit": "many"}), 422)
    _err(await api.get("/audit", params={"limit": 0}), 422)
    _err(await api.get("/audit", params={"colour": "red"}), 422, "unknown_field")
    version = (await api.get("/version")).json()["version"]
    assert version == max(a["registry_version"] for a in (await api.get("/audit")).json()["data"])
    _err(await api.get("/nowhere"), 404)
    _err(await api.put("/tenants"), 405)


async def test_database_down_answers_503(tmp_path):
    url = "postgresql+asyncpg://postgres@127.0.0.1:1/nowhere"
    settings = make_settings(tmp_path, url)
    service = RegistryService(settings)
    app = mounted(admin_app(service, settings))
    headers = {"authorization": f"Bearer {mint_admin(settings)}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t/admin",
                                 headers=headers) as client:
        _err(await client.post("/tenants", json={"slug": "acme"}), 503, "registry_unavailable")
        _err(await client.post("/tenants/acme/bindings/x/rollback"), 503)
        _err(await client.get("/tenants"), 503)
    await service.close()


async def test_missing_schema_answers_503(db_url, tmp_path):
    from registry.migrate import downgrade_async

    await fresh_registry(db_url)
    await downgrade_async(db_url)
    settings = make_settings(tmp_path, db_url, max_body_bytes=1000)
    service = RegistryService(settings)
    headers = {"authorization": f"Bearer {mint_admin(settings)}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mounted(admin_app(service, settings))),
                                 base_url="http://t/admin", headers=headers) as client:
        e = _err(await client.post("/tenants", json={"slug": "acme"}), 503, "registry_schema_missing")
        assert "loraplex migrate" in e["message"]
        _err(await client.get("/tenants"), 503, "registry_schema_missing")
        _err(await client.post("/tenants", json={"slug": "a" * 2000}), 413, "body_too_large")
    await service.close()


async def test_responses_match_the_openapi_document(api):
    """Real responses validate against the schemas the document publishes (JSON Schema 2020-12)."""
    from jsonschema import Draft202012Validator

    doc = (await api.get("/openapi.json")).json()
    for schema in doc["components"]["schemas"].values():
        Draft202012Validator.check_schema(schema)

    def check(method: str, path: str, r: httpx.Response) -> None:
        op = doc["paths"][path][method]
        status = str(r.status_code)
        assert status in op["responses"], (method, path, status)
        schema = op["responses"][status]["content"]["application/json"]["schema"]
        Draft202012Validator({**schema, "components": doc["components"]}).validate(r.json())

    check("post", "/tenants", await api.post("/tenants", json={"slug": "acme"}))
    check("post", "/tenants", await api.post("/tenants", json={"slug": "acme"}))  # 409 error shape
    check("get", "/tenants", await api.get("/tenants"))
    check("post", "/base-models", await api.post("/base-models", json=TINY.to_dict()))
    check("get", "/base-models", await api.get("/base-models"))
    write_adapter(Path(api.settings.resolved_adapter_root()) / "a", TINY)
    r = await api.post("/adapters", json={"name": "bot", "uri": "a", "base_model": "tiny"})
    check("post", "/adapters", r)
    check("post", "/adapters/{ref}/activate", await api.post("/adapters/bot@1/activate", json={}))
    check("get", "/adapters", await api.get("/adapters"))
    check("put", "/tenants/{slug}/bindings/{alias}", await api.put("/tenants/acme/bindings/bot",
                                                                   json={"adapter": "bot@1"}))
    check("get", "/bindings", await api.get("/bindings"))
    check("post", "/tenants/{slug}/bindings/{alias}/rollback", await api.post("/tenants/acme/bindings/bot/rollback"))
    check("delete", "/tenants/{slug}/bindings/{alias}", await api.delete("/tenants/acme/bindings/bot"))
    check("delete", "/tenants/{slug}/bindings/{alias}", await api.delete("/tenants/acme/bindings/bot"))  # 404
    check("get", "/audit", await api.get("/audit"))
    check("get", "/version", await api.get("/version"))
