"""Admin HTTP API: the registry operations as JSON routes (the gateway mounts it at ``/admin``).

    app = admin_app(RegistryService(settings), settings)   # a Starlette sub-app

Every route but ``GET /openapi.json`` needs a JWT carrying ``settings.jwt_admin_scope`` (401/403);
errors are OpenAI-shaped, never a stack trace (both ``registry.admin_edge``). One table
(``OPERATIONS``) drives the routes, the OpenAPI document and the check of request bodies against
it (fields, types, enums, numeric bounds).
"""

from __future__ import annotations

import operator
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from loraplex import json_body
from loraplex.settings import Settings
from loraplex.tokens import Principal, Verifier
from loraplex.wire import PRIORITY_CLASSES
from registry.admin_edge import (
    EXCEPTION_HANDLERS,
    AdminEndpoint,
    AnswerInternalErrors,
    admin_only,
    error_response,
)
from registry.canary import CanaryPolicies
from registry.console import ConsoleSources, console_routes
from registry.errors import Invalid, PreconditionFailed, etag, parse_if_match
from registry.records import CACHE_SCOPE_NAME, DIMENSIONS, JsonRecord
from registry.service import RegistryService
from registry.service_core import COMMITTED

Handler = Callable[["Call"], Awaitable[dict[str, Any] | Response]]
"""An operation's handler: its JSON answer (or a response it made itself)."""


class ActivationGate(Protocol):
    """Verifies a pending adapter version on a worker before it may go active.

    Called with the adapter version's JSON (``AdapterRecord.to_json()`` with the base model's
    ``base_revision``) and the activate request body; returns an object with
    ``passed``, ``reason`` and ``verification``; raises ``RegistryError`` when it cannot run.
    The gateway provides one (``gateway.activation``); without it, activation records the
    caller's ``verification`` as given.
    """

    async def __call__(self, adapter: dict[str, Any], request: dict[str, Any]) -> Any: ...


@dataclass
class Call:
    service: RegistryService
    path: dict[str, str]
    body: dict[str, Any]
    query: dict[str, Any]
    actor: str
    gate: ActivationGate | None = None
    if_match: int | None = None
    """The row_version the caller read (``If-Match`` or the body's ``row_version``): a conditional write."""


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    op_id: str
    summary: str
    handler: Handler
    body: dict[str, Any] | None = None
    query: dict[str, dict[str, Any]] = field(default_factory=dict)
    status: int = 200
    response: str = "object"
    tag: str = "registry"
    raw_query: bool = False
    """The handler reads the query itself (``Call.query``: each name -> every value given, as strings):
    list parameters and its own 400s; ``query`` then only documents it."""


# --- JSON schemas (used for validation and the OpenAPI document) ----------------------------------

OUT_OF_RANGE = "out_of_range"
"""The code of a number outside a schema's bounds, unless the schema names its own (``x-error-code``)."""


def _obj(props: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}


STR = {"type": "string"}
INT = {"type": "integer", "minimum": 0}
POS = {"type": "integer", "minimum": 1}
NUM = {"type": "number"}
BOOL = {"type": "boolean"}
OBJ = {"type": "object"}
PRIORITY = {"type": "string", "enum": list(PRIORITY_CLASSES)}
ON_DISABLED = {"type": "string", "enum": ["base", "refuse"],
               "description": "a disabled binding answers with the base model ('base') or refuses ('refuse')"}
PERCENT = {"type": "number", "exclusiveMinimum": 0, "maximum": 100, "x-error-code": "invalid_percent"}
ADAPTER_REF = {"type": "string", "description": "adapter version id (uuid) or name@version"}
ROW_VERSION = {"type": "integer", "minimum": 0,
               "description": "change only if the row is still at this row_version (else 412); same as If-Match"}

LIMIT = {**INT, "x-error-code": "invalid_limit"}
LIMITS = {"requests_per_min": LIMIT, "tokens_per_min": LIMIT, "max_concurrent": LIMIT, "priority": PRIORITY}
CACHE_SCOPE = {"type": "string", "pattern": f"^(|{CACHE_SCOPE_NAME})$",
               "description": "the shared prefix-cache scope this tenant's requests reuse KV blocks in; empty: "
                              "its own (the default: a shared cache is a timing side channel between tenants)"}
TENANT_CREATE = _obj({"slug": STR, **LIMITS, "cache_scope": CACHE_SCOPE}, ("slug",))
TENANT_CACHE_SCOPE = _obj({"cache_scope": CACHE_SCOPE, "row_version": ROW_VERSION}, ("cache_scope",))
RETENTION = {"type": "integer", "minimum": 0,
             "description": "seconds this tenant's stored Responses are kept (capped by response_max_retention_s)"}
TENANT_LIMITS = _obj({**LIMITS, "response_retention_s": RETENTION, "row_version": ROW_VERSION})
BASE_MODEL_CREATE = {
    "oneOf": [
        _obj({"name": STR, "revision": STR, "architecture": STR, **{d: POS for d in DIMENSIONS}},
             ("name", "revision", "architecture", *[d for d in DIMENSIONS if d != "context_length"])),
        _obj({"path": {**STR, "description": "HF model directory or .gguf file on the gateway host"},
              "name": STR}, ("path",)),
    ]
}
ADAPTER_CREATE = _obj({
    "name": STR, "uri": {**STR, "description": "file:// URI or path under the adapter root"},
    "base_model": STR, "version": {**POS, "description": "default: next version of this name"},
    "owner": {**STR, "description": "owning tenant; omit for a shared adapter"},
    "expected_revision": {**STR, "description": "refuse unless the base model is at this revision"},
}, ("name", "uri", "base_model"))
ACTIVATE = _obj({
    "verification": {**OBJ, "description": "results to record (only without an activation gate)"},
    "eval": {**OBJ, "description": "evaluation set for the gate: {cases: [{prompt, expect (regex)}], threshold}"},
    "row_version": ROW_VERSION,
})
DISABLE_ADAPTER = _obj({"reason": STR, "force": {**BOOL, "description": "also disable the bindings active on "
                                                                   "it and abort canaries on it (default: "
                                                                   "refuse while bindings use it)"},
                           "row_version": ROW_VERSION})
FAIL_ADAPTER = _obj({"reason": STR, "verification": OBJ, "row_version": ROW_VERSION}, ("reason",))
UPGRADE = _obj({"to": {**STR, "description": "the new base model (registered first with base-model add)"},
                "dry_run": {**BOOL, "description": "print the plan, change nothing"}}, ("to",))
GC = _obj({"apply": {**BOOL, "description": "delete (default: only list what would be deleted)"},
           "retention_s": {**NUM, "description": "default: LORAPLEX_ADAPTER_RETENTION_S"}})
BIND = _obj({"adapter": ADAPTER_REF, "on_disabled": ON_DISABLED, "row_version": ROW_VERSION}, ("adapter",))
CANARY_START = _obj({"adapter": ADAPTER_REF, "percent": PERCENT, "row_version": ROW_VERSION},
                    ("adapter", "percent"))
CANARY_SET = _obj({"percent": PERCENT, "row_version": ROW_VERSION}, ("percent",))
CANARY_POLICY = _obj({
    "steps": {"type": "array", "items": PERCENT, "description": "canary percents in order; after the last: promote"},
    "interval_s": {**NUM, "description": "least seconds on a step before stepping up"},
    "min_requests": {**POS, "description": "no judgement on fewer requests per arm"},
    "max_failures": {**POS, "description": "failed judgements in a row that abort"},
    "checks": {**OBJ, "description": "check name -> threshold (ratio canary/active): error_rate, empty_share, "
                                     "length_share, ttft_p99, tokens_per_s, completion_length; or -> "
                                     "{threshold, segment: 'metadata.KEY'} to judge the check per value of "
                                     "that key of the requests' metadata"},
    "proportion_test": {"type": "string", "enum": ["two-proportion-z", "fisher-exact"]},
    "sample_test": {"type": "string", "enum": ["mann-whitney-u"]},
    "alpha": {**NUM, "description": "significance level of the tests"},
})
BINDING_TOGGLE = _obj({"on_disabled": {**ON_DISABLED, "description": "while disabled: answer with the base "
                                                                    "model ('base') or refuse ('refuse'); "
                                                                    "a disable without it refuses"},
                        "row_version": ROW_VERSION})

RESPONSES: dict[str, dict[str, Any]] = {
    "Tenant": _obj({"slug": STR, "status": STR, **LIMITS, "response_retention_s": {"type": ["integer", "null"]},
                    "cache_scope": CACHE_SCOPE, "row_version": INT, "created_at": STR, "updated_at": STR}),
    "BaseModel": _obj({"name": STR, "revision": STR, "architecture": STR, **{d: POS for d in DIMENSIONS},
                       "created_at": STR}),
    "Adapter": _obj({"id": STR, "name": STR, "version": POS, "label": STR, "base_model": STR, "uri": STR,
                     "sha256": STR, "size_bytes": INT, "rank": POS, "alpha": NUM,
                     "target_modules": {"type": "array", "items": STR}, "owner_tenant": {"type": ["string", "null"]},
                     "status": {"type": "string", "enum": ["pending", "active", "disabled", "failed"]},
                     "status_reason": {"type": ["string", "null"]}, "verification": {"type": ["object", "null"]},
                     "row_version": INT, "created_at": STR,
                     "detached": {"type": "array", "description": "bindings a forced disable changed",
                                  "items": _obj({"tenant": STR, "alias": STR, "role": STR})}}),
    "UsagePage": _obj({
        "object": {"const": "page"}, "has_more": BOOL, "next_page": {"type": ["string", "null"]},
        "data": {"type": "array", "items": _obj({
            "object": {"const": "bucket"}, "start_time": INT, "end_time": INT,
            "results": {"type": "array", "items": _obj({
                "object": {"const": "organization.usage.completions.result"}, "input_tokens": INT,
                "input_cached_tokens": INT, "output_tokens": INT, "num_model_requests": INT,
                "outcomes": {**OBJ, "description": "requests by outcome: ok, cancelled, 4xx:<code>, "
                                                   "429:<reason>, 5xx:<code>"},
                "tenant": STR, "alias": STR, "version": STR, "outcome": STR})}})}}),
    "Binding": _obj({"tenant": STR, "alias": STR, "base_model": STR, "active": {"$ref": "#/components/schemas/AdapterRef"},
                     "previous": {"$ref": "#/components/schemas/AdapterRef"},
                     "canary": {"$ref": "#/components/schemas/AdapterRef"}, "canary_percent": NUM, "enabled": BOOL,
                     "on_disabled": ON_DISABLED, "row_version": INT, "updated_at": STR}),
    "AdapterRef": {"type": ["object", "null"], "properties": {"id": STR, "label": STR}},
    "CanaryPolicy": _obj({**CANARY_POLICY["properties"], "tenant": STR, "alias": STR, "status": STR,
                          "canary_id": {"type": ["string", "null"]}, "canary": {"type": ["string", "null"]},
                          "step": INT, "percent": {"type": ["number", "null"]},
                          "step_started_at": {"type": ["string", "null"]}, "next_step_at": {"type": ["string", "null"]},
                          "failures": INT, "row_version": INT,
                          "last": {"type": ["object", "null"], "description": "the last judgement: decision, "
                                   "reason in words, window, sample sizes, failures counted, and checks (one per "
                                   "check and segment: verdict pass/fail/inconclusive/no data, canary and active "
                                   "values and counts, ratio or 'inf', test, p, reason); gateway.canary_decide"}}),
    "LimitsReport": _obj({
        "object": {"const": "limits_report"}, "window": STR, "start": INT, "end": INT,
        "covered_from": {**INT, "description": "the oldest minute read (later than start where minutes were "
                                               "pruned: then limited is true and note says so)"},
        "limited": BOOL, "note": {"type": ["string", "null"]}, "sort": STR, "headroom_percent": INT,
        "keep_band": {"type": "array", "items": NUM}, "min_minutes": INT, "percentile": STR,
        "tenants_with_traffic": INT, "tenants_total": INT, "truncated": BOOL,
        "data": {"type": "array", "items": _obj({
            "tenant": STR, "status": {"type": ["string", "null"]}, "minutes": INT, "throttled_minutes": INT,
            "refused": {**OBJ, "description": "429s by the limiter's reason"},
            "used": {"type": ["number", "null"], "description": "the highest p99/limit of its dimensions"},
            "enough_data": BOOL,
            "apply": {"type": ["object", "null"], "description": "the suggested limits, as the body of "
                                                                 "PATCH /tenants/{slug}/limits"},
            "limits": {**OBJ, "description": "per dimension (requests_per_min, tokens_per_min, max_concurrent): "
                                             "limit, peak, p99, used, throttled_minutes, suggested (null: keep), "
                                             "reason"}})},
    }),
    "AuditEntry": _obj({"id": INT, "registry_version": INT, "at": STR, "actor": STR, "action": STR,
                        "target": STR, "before": {"type": ["object", "null"]}, "after": {"type": ["object", "null"]}}),
    "Version": _obj({"version": INT}),
    "Deleted": _obj({"tenant": STR, "alias": STR, "deleted": BOOL}),
    "Error": _obj({"error": _obj({"message": STR, "type": STR, "code": {"type": ["string", "null"]},
                                  "param": {"type": ["string", "null"]}})}),
}


# --- handlers ------------------------------------------------------------------------------------

def _list(records: Sequence[JsonRecord]) -> dict[str, Any]:
    return {"object": "list", "data": [r.to_json() for r in records]}


async def _version(c: Call) -> dict[str, Any]:
    return {"version": await c.service.version()}


async def _usage(c: Call) -> Response:
    from registry.usage_query import parse_usage_query, read_usage_json

    q = parse_usage_query(c.query, max_rows=c.service.settings.usage_query_max_rows)
    async with c.service.db.read() as session:
        page = await read_usage_json(session, q)  # a page may hold 100k results: as JSON
    return Response(page, media_type="application/json")


USAGE_LIST = {"type": "array", "items": STR, "description": "repeat the parameter, or separate values by commas"}
USAGE_QUERY: dict[str, dict[str, Any]] = {
    "start_time": {**INT, "description": "required: the window's first second (unix), aligned down to the width"},
    "end_time": {**INT, "description": "the window's end (unix, exclusive; default now), aligned up to the width"},
    "bucket_width": {"type": "string", "enum": ["1m", "1h", "1d"], "description": "default 1d"},
    "group_by": {"type": "array", "items": {"type": "string", "enum": ["tenant", "alias", "version", "outcome"]},
                 "description": "group the results by these keys (repeat, or separate by commas)"},
    "tenants": {**USAGE_LIST, "description": "only these tenants"},
    "aliases": {**USAGE_LIST, "description": "only these model names (as the clients called them)"},
    "versions": {**USAGE_LIST, "description": "only these adapter version ids"},
    "limit": {"type": "integer", "minimum": 1, "maximum": 1440,
              "description": "buckets per page: 1d default 7, at most 31; 1h 24, 168; 1m 60, 1440"},
    "page": {**STR, "description": "next_page of the page before"},
}


async def _tenants(c: Call) -> dict[str, Any]:
    return _list(await c.service.list_tenants(status=c.query.get("status")))


async def _tenant_create(c: Call) -> dict[str, Any]:
    return (await c.service.create_tenant(actor=c.actor, **c.body)).to_json()


async def _tenant_get(c: Call) -> dict[str, Any]:
    return (await c.service.get_tenant(c.path["slug"])).to_json()


async def _tenant_disable(c: Call) -> dict[str, Any]:
    return (await c.service.disable_tenant(c.path["slug"], actor=c.actor, if_match=c.if_match)).to_json()


async def _tenant_enable(c: Call) -> dict[str, Any]:
    return (await c.service.enable_tenant(c.path["slug"], actor=c.actor, if_match=c.if_match)).to_json()


async def _tenant_limits(c: Call) -> dict[str, Any]:
    return (await c.service.set_tenant_limits(c.path["slug"], actor=c.actor, **c.body,
                                              if_match=c.if_match)).to_json()


async def _tenant_cache_scope(c: Call) -> dict[str, Any]:
    return (await c.service.set_tenant_cache_scope(c.path["slug"], c.body["cache_scope"], actor=c.actor,
                                                   if_match=c.if_match)).to_json()


async def _base_models(c: Call) -> dict[str, Any]:
    return _list(await c.service.list_base_models())


async def _base_model_create(c: Call) -> dict[str, Any]:
    if "path" in c.body:
        return (await c.service.register_base_model_from_path(c.body["path"], name=c.body.get("name"),
                                                              actor=c.actor)).to_json()
    return (await c.service.register_base_model(c.body, actor=c.actor)).to_json()


async def _adapters(c: Call) -> dict[str, Any]:
    return _list(await c.service.list_adapters(**{k: c.query.get(k) for k in ("name", "base_model", "owner",
                                                                               "status")}))


async def _adapter_create(c: Call) -> dict[str, Any]:
    b = dict(c.body)
    return (await c.service.register_adapter(b.pop("name"), b.pop("uri"), b.pop("base_model"), actor=c.actor,
                                             **b)).to_json()


async def _adapter_get(c: Call) -> dict[str, Any]:
    return (await c.service.get_adapter(c.path["ref"])).to_json()


async def _adapter_activate(c: Call) -> dict[str, Any]:
    if c.gate is None:
        return (await c.service.activate_adapter(c.path["ref"], verification=c.body.get("verification"),
                                                 actor=c.actor, if_match=c.if_match)).to_json()
    if "verification" in c.body:
        raise Invalid("verification is recorded by the activation gate, not given", param="verification")
    adapter = await c.service.get_adapter(c.path["ref"])
    if c.if_match is not None and adapter.row_version != c.if_match:  # before the gate's work
        raise PreconditionFailed(f"adapter {adapter.label} changed since it was read: it is at row_version "
                                 f"{adapter.row_version}, not {c.if_match}", adapter.row_version)
    if adapter.status == "active":
        return adapter.to_json()
    # pending, failed (a retry) or disabled: the gate runs again on the version as it is now
    base = await c.service.base_model_info(adapter.base_model)
    result = await c.gate({**adapter.to_json(), "base_revision": base.revision}, c.body)
    if not result.passed:
        failed = await c.service.fail_adapter(adapter.id, reason=result.reason,
                                              verification=result.verification, actor=c.actor,
                                              if_match=adapter.row_version)
        raise Invalid(f"activation refused: {result.reason}", code="adapter_verification_failed",
                      extra={"adapter": failed.to_json()})
    return (await c.service.activate_adapter(adapter.id, verification=result.verification, actor=c.actor,
                                             if_match=adapter.row_version)).to_json()


async def _adapter_disable(c: Call) -> dict[str, Any]:
    return (await c.service.disable_adapter(c.path["ref"], reason=c.body.get("reason"),
                                            force=c.body.get("force", False), actor=c.actor,
                                            if_match=c.if_match)).to_json()


async def _adapter_enable(c: Call) -> dict[str, Any]:
    return (await c.service.enable_adapter(c.path["ref"], actor=c.actor, if_match=c.if_match)).to_json()


async def _adapter_fail(c: Call) -> dict[str, Any]:
    return (await c.service.fail_adapter(c.path["ref"], reason=c.body["reason"],
                                         verification=c.body.get("verification"), actor=c.actor,
                                         if_match=c.if_match)).to_json()


async def _bindings(c: Call) -> dict[str, Any]:
    return _list(await c.service.list_bindings(tenant=c.query.get("tenant")))


async def _binding_get(c: Call) -> dict[str, Any]:
    return (await c.service.get_binding(c.path["slug"], c.path["alias"])).to_json()


async def _bind(c: Call) -> dict[str, Any]:
    return (await c.service.bind(c.path["slug"], c.path["alias"], c.body["adapter"],
                                 on_disabled=c.body.get("on_disabled"), actor=c.actor,
                                 if_match=c.if_match)).to_json()


async def _unbind(c: Call) -> dict[str, Any]:
    return (await c.service.unbind(c.path["slug"], c.path["alias"], actor=c.actor,
                                   if_match=c.if_match)).to_json()


async def _rollback(c: Call) -> dict[str, Any]:
    return (await c.service.rollback(c.path["slug"], c.path["alias"], actor=c.actor,
                                     if_match=c.if_match)).to_json()


async def _canary_start(c: Call) -> dict[str, Any]:
    return (await c.service.canary_start(c.path["slug"], c.path["alias"], c.body["adapter"], c.body["percent"],
                                         actor=c.actor, if_match=c.if_match)).to_json()


async def _canary_set(c: Call) -> dict[str, Any]:
    return (await c.service.canary_set(c.path["slug"], c.path["alias"], c.body["percent"], actor=c.actor,
                                       if_match=c.if_match)).to_json()


async def _canary_promote(c: Call) -> dict[str, Any]:
    return (await c.service.canary_promote(c.path["slug"], c.path["alias"], actor=c.actor,
                                           if_match=c.if_match)).to_json()


async def _canary_abort(c: Call) -> dict[str, Any]:
    return (await c.service.canary_abort(c.path["slug"], c.path["alias"], actor=c.actor,
                                         if_match=c.if_match)).to_json()


async def _canary_policy(c: Call) -> dict[str, Any]:
    return (await CanaryPolicies(c.service).get(c.path["slug"], c.path["alias"])).to_json()


async def _canary_set_policy(c: Call) -> dict[str, Any]:
    return (await CanaryPolicies(c.service).set_policy(c.path["slug"], c.path["alias"], c.body,
                                                       actor=c.actor)).to_json()


async def _canary_pause(c: Call) -> dict[str, Any]:
    return (await CanaryPolicies(c.service).pause(c.path["slug"], c.path["alias"], actor=c.actor)).to_json()


async def _canary_resume(c: Call) -> dict[str, Any]:
    return (await CanaryPolicies(c.service).resume(c.path["slug"], c.path["alias"], actor=c.actor)).to_json()


async def _binding_enable(c: Call) -> dict[str, Any]:
    return (await c.service.set_binding_enabled(c.path["slug"], c.path["alias"], True,
                                                on_disabled=c.body.get("on_disabled"), actor=c.actor,
                                                if_match=c.if_match)).to_json()


async def _binding_disable(c: Call) -> dict[str, Any]:
    return (await c.service.set_binding_enabled(c.path["slug"], c.path["alias"], False,
                                                on_disabled=c.body.get("on_disabled"), actor=c.actor,
                                                if_match=c.if_match)).to_json()


async def _gc(c: Call) -> dict[str, Any]:
    from registry.supply import SupplyChain

    return await SupplyChain(c.service).gc(apply=c.body.get("apply", False), retention_s=c.body.get("retention_s"),
                                           actor=c.actor)


async def _base_model_upgrade(c: Call) -> dict[str, Any]:
    from registry.supply import SupplyChain

    return await SupplyChain(c.service).upgrade(c.path["name"], c.body["to"], dry_run=c.body.get("dry_run", False),
                                                gate=c.gate, actor=c.actor)


async def _audit(c: Call) -> dict[str, Any]:
    return _list(await c.service.audit(**{k: v for k, v in c.query.items() if v is not None}))


async def _limits_report(c: Call) -> dict[str, Any]:
    from registry.limits_report import DEFAULT_LIMIT, DEFAULT_WINDOW, HEADROOM_PERCENT, limits_report

    q = c.query
    return await limits_report(c.service, window=q.get("window", DEFAULT_WINDOW), sort=q.get("sort", "throttled"),
                               tenant=q.get("tenant"), limit=q.get("limit", DEFAULT_LIMIT),
                               headroom_percent=q.get("headroom", HEADROOM_PERCENT))


B = "/tenants/{slug}/bindings/{alias}"
OPERATIONS: tuple[Operation, ...] = (
    Operation("GET", "/version", "getVersion", "Current registry version", _version, response="Version",
              tag="registry"),
    Operation("GET", "/tenants", "listTenants", "List tenants", _tenants, query={"status": STR},
              response="[Tenant]", tag="tenants"),
    Operation("GET", "/usage", "getUsage",
              "The usage ledger in the shape of OpenAI's usage API: buckets of 1m/1h/1d with the tokens (input, "
              "cached input, output), requests and outcomes, grouped by tenant/alias/version/outcome; a page of "
              "buckets at a time (registry.usage_query)", _usage, query=USAGE_QUERY, response="UsagePage",
              tag="usage", raw_query=True),
    Operation("POST", "/tenants", "createTenant", "Create a tenant", _tenant_create, TENANT_CREATE, status=201,
              response="Tenant", tag="tenants"),
    Operation("GET", "/tenants/{slug}", "getTenant", "Get a tenant", _tenant_get, response="Tenant", tag="tenants"),
    Operation("POST", "/tenants/{slug}/disable", "disableTenant", "Disable a tenant (its requests are refused)",
              _tenant_disable, response="Tenant", tag="tenants"),
    Operation("POST", "/tenants/{slug}/enable", "enableTenant", "Enable a tenant", _tenant_enable,
              response="Tenant", tag="tenants"),
    Operation("PATCH", "/tenants/{slug}/limits", "setTenantLimits",
              "Set a tenant's limits and priority class (only the given fields change)", _tenant_limits,
              TENANT_LIMITS, response="Tenant", tag="tenants"),
    Operation("PUT", "/tenants/{slug}/cache-scope", "setTenantCacheScope",
              "Put a tenant in a shared prefix-cache scope (its requests reuse the KV blocks of the scope's "
              "tenants), or back in its own with an empty cache_scope", _tenant_cache_scope, TENANT_CACHE_SCOPE,
              response="Tenant", tag="tenants"),
    Operation("GET", "/base-models", "listBaseModels", "List base models", _base_models, response="[BaseModel]",
              tag="base-models"),
    Operation("POST", "/base-models", "registerBaseModel",
              "Register a base model from its dimensions, or from a model path on the gateway host",
              _base_model_create, BASE_MODEL_CREATE, status=201, response="BaseModel", tag="base-models"),
    Operation("POST", "/base-models/{name}/upgrade", "upgradeBaseModel",
              "Carry the active adapter versions of this base model over to another (re-admitted, re-gated "
              "with their eval sets) and move the bindings whose versions pass, in one audited transaction; "
              "dry_run: the plan only", _base_model_upgrade, UPGRADE, response="object", tag="base-models"),
    Operation("GET", "/adapters", "listAdapters", "List adapter versions", _adapters,
              query={"name": STR, "base_model": STR, "owner": STR, "status": STR}, response="[Adapter]",
              tag="adapters"),
    Operation("POST", "/adapters", "registerAdapter",
              "Register an adapter version (runs admission; the version starts pending)", _adapter_create,
              ADAPTER_CREATE, status=201, response="Adapter", tag="adapters"),
    Operation("GET", "/adapters/{ref}", "getAdapter", "Get an adapter version (id or name@version)", _adapter_get,
              response="Adapter", tag="adapters"),
    Operation("POST", "/adapters/{ref}/activate", "activateAdapter",
              "Activate an adapter version (pending, failed or disabled: the activation gate runs again; a "
              "refusal answers 422 with the failed version and its evidence under 'adapter')",
              _adapter_activate, ACTIVATE, response="Adapter", tag="adapters"),
    Operation("POST", "/adapters/{ref}/disable", "disableAdapter",
              "Disable an adapter version (409 adapter_in_use naming the bindings that route to it, unless "
              "force: then it aborts canaries on it and disables bindings active on it)",
              _adapter_disable, DISABLE_ADAPTER, response="Adapter", tag="adapters"),
    Operation("POST", "/adapters/{ref}/enable", "enableAdapter",
              "Re-enable a disabled adapter version that had been active (bindings stay as they are)",
              _adapter_enable, response="Adapter", tag="adapters"),
    Operation("POST", "/adapters/{ref}/fail", "failAdapter",
              "Mark a pending adapter version failed (activation gate refused it)", _adapter_fail, FAIL_ADAPTER,
              response="Adapter", tag="adapters"),
    Operation("GET", "/bindings", "listBindings", "List bindings", _bindings, query={"tenant": STR},
              response="[Binding]", tag="bindings"),
    Operation("GET", B, "getBinding", "Get a binding", _binding_get, response="Binding", tag="bindings"),
    Operation("PUT", B, "bind", "Bind an alias to an active adapter version (create, or re-point: the "
              "current version becomes previous)", _bind, BIND, response="Binding", tag="bindings"),
    Operation("DELETE", B, "unbind", "Remove an alias (its requests get 404)", _unbind, response="Deleted",
              tag="bindings"),
    Operation("POST", B + "/rollback", "rollback", "Roll an alias back to its previous version", _rollback,
              response="Binding", tag="bindings"),
    Operation("POST", B + "/canary", "startCanary", "Start a canary: send percent of traffic to a version",
              _canary_start, CANARY_START, response="Binding", tag="bindings"),
    Operation("PATCH", B + "/canary", "setCanary", "Change the canary percent", _canary_set, CANARY_SET,
              response="Binding", tag="bindings"),
    Operation("POST", B + "/canary/promote", "promoteCanary",
              "Promote the canary (it becomes active; the old active becomes previous)", _canary_promote,
              response="Binding", tag="bindings"),
    Operation("DELETE", B + "/canary", "abortCanary", "Abort the canary", _canary_abort, response="Binding",
              tag="bindings"),
    Operation("GET", B + "/canary/policy", "getCanaryPolicy",
              "The canary policy and where the judge stands: step, the window's numbers, the next step's time",
              _canary_policy, response="CanaryPolicy", tag="bindings"),
    Operation("PUT", B + "/canary/policy", "setCanaryPolicy",
              "Create or change the canary policy (given fields over the current or the default ones)",
              _canary_set_policy, CANARY_POLICY, response="CanaryPolicy", tag="bindings"),
    Operation("POST", B + "/canary/pause", "pauseCanary", "Stop judging the canary (it keeps its percent)",
              _canary_pause, response="CanaryPolicy", tag="bindings"),
    Operation("POST", B + "/canary/resume", "resumeCanary", "Judge the canary again", _canary_resume,
              response="CanaryPolicy", tag="bindings"),
    Operation("POST", B + "/enable", "enableBinding", "Enable a binding", _binding_enable, BINDING_TOGGLE,
              response="Binding", tag="bindings"),
    Operation("POST", B + "/disable", "disableBinding",
              "Disable a binding (on_disabled: answer with the base model or refuse)", _binding_disable,
              BINDING_TOGGLE, response="Binding", tag="bindings"),
    Operation("POST", "/gc", "collectGarbage",
              "Retention: list (dry run) or, with apply, retire and delete from the adapter store the versions "
              "no binding (active, previous, canary) has referenced for retention_s", _gc, GC, response="object",
              tag="adapters"),
    Operation("GET", "/audit", "listAudit", "Audit trail, newest first", _audit,
              query={"actor": STR, "action": STR, "target": {**STR, "description": "exact, or a prefix ending in *"},
                     "since_version": INT, "limit": {"type": "integer", "minimum": 1, "maximum": 1000}},
              response="[AuditEntry]", tag="audit"),
    Operation("GET", "/limits/report", "getLimitsReport",
              "Limit tuning: per tenant its limits, peak and p99 per-minute requests, tokens and concurrency "
              "over a window of minute buckets, minutes throttled and 429s by reason, and a suggested limit "
              "per dimension with the reason (registry.limits_report)", _limits_report,
              query={"window": {**STR, "pattern": "^[1-9][0-9]{0,4}[mhd]$",
                                "description": "e.g. 7d (default), 24h, 90m; 1h to 90d"},
                     "sort": {"type": "string", "enum": ["throttled", "headroom"],
                              "description": "throttled: most throttled minutes first (default); headroom: "
                                             "least headroom (highest p99/limit) first"},
                     "tenant": {**STR, "description": "this tenant only"},
                     "limit": {"type": "integer", "minimum": 1, "maximum": 1000,
                               "description": "at most this many tenants (default 100)"},
                     "headroom": {"type": "integer", "minimum": 10, "maximum": 100,
                                  "description": "percent a suggestion adds over the p99 (default 25)"}},
              response="LimitsReport", tag="limits"),
)


# --- validation ----------------------------------------------------------------------------------

_PY: dict[str, type | tuple[type, ...]] = {"string": str, "integer": int, "number": (int, float), "boolean": bool,
                                           "object": dict, "array": list, "null": type(None)}


def _type_ok(value: Any, types: str | list[str]) -> bool:
    for t in [types] if isinstance(types, str) else types:
        if isinstance(value, bool) and t in ("integer", "number"):
            continue
        if isinstance(value, _PY[t]):
            return True
    return False


def validate(body: Any, schema: dict[str, Any]) -> dict[str, Any]:
    """Check a JSON body against the (small) schema subset used above: fields, types, enums and
    numeric bounds (of a field, or of a list's items); 422 on the first problem."""
    if "oneOf" in schema:  # the option whose fields the body uses most
        keys = set(body) if isinstance(body, dict) else set()
        return validate(body, min(schema["oneOf"], key=lambda o: len(keys - set(o["properties"]))))
    if not isinstance(body, dict):
        raise Invalid("the request body must be a JSON object", code="invalid_body")
    props = schema["properties"]
    unknown = sorted(set(body) - set(props))
    if unknown and schema.get("additionalProperties") is False:
        raise Invalid(f"unknown field {unknown[0]!r}; allowed: {', '.join(props)}", code="unknown_field",
                      param=unknown[0])
    for name in schema.get("required", ()):
        if body.get(name) is None:
            raise Invalid(f"field {name!r} is required", code="missing_field", param=name)
    out: dict[str, Any] = {}
    for name, value in body.items():
        if value is None:
            continue  # null means "not given"
        spec = props[name]
        if not _type_ok(value, spec["type"]):
            raise Invalid(f"field {name!r} must be of type {spec['type']}, got {type(value).__name__}",
                          code="invalid_type", param=name)
        if "enum" in spec and value not in spec["enum"]:
            raise Invalid(f"field {name!r} must be one of {', '.join(map(str, spec['enum']))}", param=name)
        _in_bounds(value, spec, name, f"field {name!r}")
        if "items" in spec and isinstance(value, list):
            for item in value:
                _in_bounds(item, spec["items"], name, f"each item of field {name!r}")
        out[name] = value
    return out


_BOUNDS = (("minimum", operator.ge, ">="), ("exclusiveMinimum", operator.gt, ">"),
           ("maximum", operator.le, "<="), ("exclusiveMaximum", operator.lt, "<"))


def _in_bounds(value: Any, spec: dict[str, Any], param: str, what: str) -> None:
    """Refuse a number outside the bounds ``spec`` publishes (422, ``x-error-code`` or ``out_of_range``);
    anything else is not this check's to judge."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    for key, within, words in _BOUNDS:
        if key in spec and not within(value, spec[key]):
            raise Invalid(f"{what} must be {words} {spec[key]}, got {value!r}",
                          code=spec.get("x-error-code", OUT_OF_RANGE), param=param)


def _if_match(request: Request, body: dict[str, Any], op: Operation) -> int | None:
    """The precondition of a conditional write: ``If-Match`` or the body's ``row_version``."""
    header = request.headers.get("if-match")
    field = body.pop("row_version", None)
    if header is None:
        return field
    if op.method == "GET" or op.status == 201:
        raise Invalid(f"If-Match is not supported on {op.method} {op.path}", code="invalid_if_match",
                      param="If-Match")
    value = parse_if_match(header)
    if field is not None and value is not None and field != value:
        raise Invalid("If-Match and row_version disagree", code="invalid_if_match", param="row_version")
    return value if value is not None else field


def _parse_query(request: Request, spec: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in request.query_params.items():
        if name not in spec:
            raise Invalid(f"unknown query parameter {name!r}", code="unknown_field", param=name)
        if spec[name]["type"] == "integer":
            try:
                out[name] = int(value)
            except ValueError:
                raise Invalid(f"query parameter {name!r} must be an integer", code="invalid_type",
                              param=name) from None
        else:
            out[name] = value
    return out


def _query_lists(request: Request) -> dict[str, list[str]]:
    """Each query parameter -> every value given (for an operation that reads its own query)."""
    out: dict[str, list[str]] = {}
    for name, value in request.query_params.multi_items():
        out.setdefault(name, []).append(value)
    return out


# --- OpenAPI -------------------------------------------------------------------------------------

def openapi_document() -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        params = [{"name": p, "in": "path", "required": True, "schema": STR}
                  for p in _path_params(op.path)]
        params += [{"name": n, "in": "query", "required": False, "schema": s} for n, s in op.query.items()]
        if op.response.startswith("["):
            ref = {"$ref": f"#/components/schemas/{op.response[1:-1]}"}
            schema = {"type": "object", "properties": {"object": {"const": "list"},
                                                       "data": {"type": "array", "items": ref}}}
        else:
            schema = {"$ref": f"#/components/schemas/{op.response}"}
        error = {"description": "error (OpenAI shape)",
                 "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        entry: dict[str, Any] = {
            "operationId": op.op_id, "summary": op.summary, "tags": [op.tag], "parameters": params,
            "responses": {str(op.status): {"description": "success",
                                           "content": {"application/json": {"schema": schema}}},
                          **{str(s): error for s in (400, 401, 403, 404, 409, 412, 422, 503)}},
        }
        if op.body is not None:
            entry["requestBody"] = {"required": True, "content": {"application/json": {"schema": op.body}}}
        paths.setdefault(op.path, {})[op.method.lower()] = entry
    return {
        "openapi": "3.1.0",
        "info": {"title": "loraplex registry admin API", "version": "1",
                 "description": "Tenants, base models, adapter versions, bindings, canaries and the audit "
                                "trail. Mounted by the gateway at /admin. Bearer JWT with the admin scope."},
        "servers": [{"url": "/admin"}],
        "security": [{"bearerAuth": []}],
        "paths": paths,
        "components": {"schemas": RESPONSES,
                       "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer",
                                                          "bearerFormat": "JWT"}}},
    }


def _path_params(path: str) -> list[str]:
    return [seg[1:-1] for seg in path.split("/") if seg.startswith("{")]


# --- the app -------------------------------------------------------------------------------------

def admin_app(service: RegistryService, settings: Settings, *, gate: ActivationGate | None = None,
              console: ConsoleSources | None = None) -> Starlette:
    """The admin API as a Starlette app, to mount at ``/admin``, with the web console at
    ``/admin/console`` (``registry.console``).

    With ``gate``, activating an adapter version first verifies it on a worker; ``console``
    gives the console the fleet and live numbers (without it those pages say so). Every route but
    the OpenAPI document runs behind ``registry.admin_edge.admin_only``; refusals are answered by
    the app's exception handlers (``registry.admin_edge``).
    """
    verifier = Verifier(settings)
    doc = openapi_document()

    def endpoint(op: Operation) -> AdminEndpoint:
        async def handle(request: Request, principal: Principal) -> Response:
            body: dict[str, Any] = {}
            raw = await request.body()
            if len(raw) > settings.max_body_bytes:
                return error_response(413, f"request body over {settings.max_body_bytes} bytes", code="body_too_large")
            if op.body is not None:
                body = validate(json_body.loads(raw) if raw.strip() else {}, op.body)
            elif raw.strip() and raw.strip() not in (b"{}", b"null"):
                raise Invalid(f"{op.method} {op.path} takes no request body", code="unexpected_body")
            query = _query_lists(request) if op.raw_query else _parse_query(request, op.query)
            if_match = _if_match(request, body, op)
            call = Call(service, dict(request.path_params), body, query, principal.subject or "admin", gate,
                        if_match)
            COMMITTED.set(None)
            result = await op.handler(call)
            resp = result if isinstance(result, Response) else JSONResponse(result, status_code=op.status)
            if isinstance(result, dict) and isinstance(result.get("row_version"), int):
                resp.headers["etag"] = etag(result["row_version"])
            committed = COMMITTED.get()
            if committed is not None:
                resp.headers["x-registry-version"] = str(committed)
            return resp

        return handle

    async def openapi(request: Request) -> Response:
        return JSONResponse(doc)

    async def upload(request: Request, principal: Principal) -> Response:
        """``POST /adapters/upload?name=&base_model=[&owner=&version=]``: the body is adapter_config.json
        (``x-loraplex-config-bytes`` long) then adapter_model.safetensors, streamed into the store."""
        from registry.supply import SupplyChain

        q = request.query_params
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > settings.max_adapter_bytes:
            return error_response(413, f"the upload is larger than the cap of {settings.max_adapter_bytes} bytes "
                                       f"(LORAPLEX_MAX_ADAPTER_BYTES)", code="upload_too_large")
        for key in ("name", "base_model"):
            if not q.get(key):
                raise Invalid(f"query parameter {key} is required", param=key)
        raw_cfg, raw_ver = request.headers.get("x-loraplex-config-bytes", ""), q.get("version")
        if not raw_cfg.isdigit():
            raise Invalid("header x-loraplex-config-bytes must give the size of adapter_config.json",
                          param="x-loraplex-config-bytes")
        if raw_ver is not None and not raw_ver.isdigit():
            raise Invalid(f"version must be a positive integer, got {raw_ver!r}", param="version")
        result = await SupplyChain(service).upload(
            q["name"], q["base_model"], request.stream(), config_bytes=int(raw_cfg), owner=q.get("owner"),
            version=int(raw_ver) if raw_ver is not None else None, actor=principal.subject or "admin")
        return JSONResponse(result.to_json(), status_code=201)

    def admin(work: AdminEndpoint) -> Callable[[Request], Awaitable[Response]]:
        return admin_only(verifier, settings.jwt_admin_scope, work)

    routes: list[BaseRoute] = [Route("/openapi.json", openapi, methods=["GET"]),
                               Route("/adapters/upload", admin(upload), methods=["POST"])]
    routes += [Route(op.path, admin(endpoint(op)), methods=[op.method]) for op in OPERATIONS]
    routes += console_routes(service, settings, verifier, console)
    app = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS,
                    middleware=[Middleware(AnswerInternalErrors)])
    app.state.service = service
    return app
