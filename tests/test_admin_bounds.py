"""The numeric bounds the admin API's OpenAPI document publishes (``minimum``, ``maximum`` and the
exclusive ones, of a body field or of a list's items) are the API's: a value outside them is a
422 naming the field (the schema's ``x-error-code``, else ``out_of_range``) and never reaches
the service. ``test_admin_fuzz`` draws such values at random against a real registry."""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx
import pytest

from loraplex.tokens import mint_admin
from registry import admin_api
from registry.admin_api import OPERATIONS, Operation, admin_app, validate
from registry.errors import Invalid
from registry.service import RegistryService
from tests.registry_support import make_settings
from tests.test_admin_api import _err, mounted
from tests.test_admin_edge import fill, valid_body

BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def bounded_fields() -> list[tuple[Operation, dict[str, Any], str, dict[str, Any]]]:
    """(operation, the schema of its body, a field, the field's schema) for each field with bounds."""
    out = []
    for op in OPERATIONS:
        for schema in (op.body or {}).get("oneOf", [op.body] if op.body else []):
            for name, spec in schema["properties"].items():
                if any(k in spec for k in BOUNDS) or any(k in spec.get("items", {}) for k in BOUNDS):
                    out.append((op, schema, name, spec))
    return out


def outside(spec: dict[str, Any]) -> list[int | float]:
    """Values just outside each bound of a numeric schema (the bound itself where it is exclusive)."""
    step = 1 if spec.get("type") == "integer" else 0.5
    out: list[int | float] = []
    if "minimum" in spec:
        out.append(spec["minimum"] - step)
    if "maximum" in spec:
        out.append(spec["maximum"] + step)
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if key in spec:
            out.append(spec[key])
    return out


def test_the_scan_finds_the_bounded_fields():
    names = {name for _, _, name, _ in bounded_fields()}
    assert {"percent", "requests_per_min", "row_version", "version", "min_requests", "steps",
            "hidden_size"} <= names


@pytest.mark.parametrize("case", bounded_fields(), ids=lambda c: f"{c[0].op_id}.{c[2]}")
def test_validate_refuses_a_value_outside_the_bounds(case):
    op, schema, name, spec = case
    base = valid_body(schema)
    for value in outside(spec.get("items", spec)):
        body = {**base, name: [value] if "items" in spec else value}
        with pytest.raises(Invalid) as exc:
            validate(body, schema)
        assert exc.value.status == 422 and exc.value.param == name, (op.op_id, name, value)
        assert exc.value.code == spec.get("items", spec).get("x-error-code", "out_of_range")


def test_the_bounds_themselves_pass():
    assert validate({"percent": 100}, admin_api.CANARY_SET) == {"percent": 100}
    assert validate({"percent": 0.01, "row_version": 0}, admin_api.CANARY_SET) == {"percent": 0.01,
                                                                                     "row_version": 0}
    assert validate({"steps": [5, 100], "min_requests": 1}, admin_api.CANARY_POLICY)["steps"] == [5, 100]
    with pytest.raises(Invalid) as exc:
        validate({"percent": 0}, admin_api.CANARY_SET)
    assert exc.value.code == "invalid_percent" and "0" in exc.value.message


@pytest.fixture
def spied(tmp_path, monkeypatch):
    """The admin API whose operations record that they ran instead of calling the service."""
    ran: list[str] = []

    def spy(op: Operation) -> Operation:
        async def handler(call: admin_api.Call) -> Any:
            ran.append(op.op_id)
            return {}
        return dataclasses.replace(op, handler=handler)

    monkeypatch.setattr(admin_api, "OPERATIONS", tuple(spy(op) for op in OPERATIONS))
    settings = make_settings(tmp_path, f"sqlite+aiosqlite:///{tmp_path}/never.db")
    app = mounted(admin_app(RegistryService(settings), settings))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t/admin",
                               headers={"authorization": f"Bearer {mint_admin(settings)}"})
    return client, ran


async def test_an_out_of_range_value_never_reaches_the_service(spied):
    client, ran = spied
    async with client:
        for op, schema, name, spec in bounded_fields():
            base = valid_body(schema)
            assert (await client.request(op.method, fill(op.path), json=base)).status_code == op.status, op.op_id
            assert ran == [op.op_id]
            ran.clear()
            for value in outside(spec.get("items", spec)):
                body = {**base, name: [value] if "items" in spec else value}
                r = await client.request(op.method, fill(op.path), json=body)
                assert _err(r, 422)["param"] == name, (op.op_id, name, value)
                assert ran == [], (op.op_id, name, value, "reached the service")
