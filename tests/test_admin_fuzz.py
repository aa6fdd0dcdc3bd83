"""Fuzz the admin API with arbitrary JSON bodies, query strings and path segments: every
answer is a success or a 4xx in the OpenAI error shape, never a 500, and the registry's
audit log stays consistent with its version. Numbers outside the bounds the OpenAPI document
publishes are 422s that change nothing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient

from loraplex.tokens import mint_admin
from registry.admin_api import OPERATIONS, admin_app
from registry.migrate import upgrade
from registry.service import RegistryService
from tests.registry_support import TINY, make_settings, write_adapter
from tests.test_admin_bounds import bounded_fields
from tests.test_admin_edge import fill, valid_body


def _props(schema: dict) -> list[str]:
    if "oneOf" in schema:
        return [k for option in schema["oneOf"] for k in option["properties"]]
    return list(schema["properties"])


FIELD_NAMES = [*sorted({name for op in OPERATIONS if op.body for name in _props(op.body)}), "extra"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30) | st.sampled_from(["acme", "bot@1", "base", "refuse", "high", "v0", "../x", "tiny", "acme.co", ""]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=6)
bodies = st.one_of(
    st.dictionaries(st.sampled_from(FIELD_NAMES), json_values, max_size=5),
    json_values,
    st.binary(max_size=40),
)
QUERY_NAMES = [*sorted({name for op in OPERATIONS for name in op.query}), "tenant", "x", "group_by[]"]
"""Every query parameter an operation documents (the usage ledger's among them), and some it does not."""
QUERY_VALUES = st.one_of(st.text(max_size=6), st.sampled_from(
    ["1m", "1h", "1d", "tenant", "alias,version", "outcome", "acme", "0", "-1", "1765000000", "99999999999999",
     "1e3", "7", "1441", "eyJhdCI6MH0", ""]), st.integers(0, 2**41).map(str))
segments = st.one_of(st.sampled_from(["acme", "ghost", "bot", "bot@1", "bot@0", "x" * 300, "UPPER", "a b"]),
                     st.text(alphabet=st.characters(whitelist_categories=("L", "N", "P", "S"), blacklist_characters="/?#%\\"),
                              min_size=1, max_size=20))


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    url = f"sqlite+aiosqlite:///{tmp}/registry.db"
    upgrade(url)
    cfg = make_settings(tmp, url)
    write_adapter(Path(cfg.resolved_adapter_root()) / "v0", TINY)
    service = RegistryService(cfg)
    app = Starlette(routes=[Mount("/admin", app=admin_app(service, cfg))])
    with TestClient(app, base_url="http://t", raise_server_exceptions=False) as c:
        c.headers["authorization"] = f"Bearer {mint_admin(cfg)}"
        assert c.post("/admin/tenants", json={"slug": "acme"}).status_code == 201
        assert c.post("/admin/base-models", json=TINY.to_dict()).status_code == 201
        assert c.post("/admin/adapters", json={"name": "bot", "uri": "v0", "base_model": "tiny"}).status_code == 201
        assert c.post("/admin/adapters/bot@1/activate").status_code == 200
        yield c, service
    asyncio.run(service.engine.dispose())


def _fill(path: str, values: list[str]) -> str:
    out, i = [], 0
    for seg in path.split("/"):
        if seg.startswith("{"):
            out.append(values[i % len(values)])
            i += 1
        else:
            out.append(seg)
    return "/".join(out)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(op_index=st.integers(0, len(OPERATIONS) - 1), body=bodies, segs=st.lists(segments, min_size=2, max_size=2),
       query=st.dictionaries(st.sampled_from(QUERY_NAMES), QUERY_VALUES, max_size=3))
def test_admin_api_never_500(client, op_index, body, segs, query):
    c, _ = client
    op = OPERATIONS[op_index]
    path = "/admin" + _fill(op.path, segs)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # NaN/Infinity included
    r = c.request(op.method, path, content=raw, params=query, headers={"content-type": "application/json"})
    assert r.status_code < 500, (op.method, path, body, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"] and "Traceback" not in err["message"]


def beyond(spec: dict) -> st.SearchStrategy:
    """Numbers outside a numeric schema's bounds: below its minimum, above its maximum, at or past
    an exclusive bound (whole numbers only where the schema is an integer)."""
    whole = spec.get("type") == "integer"

    def below(bound: float, inclusive: bool) -> st.SearchStrategy:
        ints = st.integers(-2**62, int(bound) - (0 if inclusive and bound == int(bound) else 1))
        return ints if whole else ints | st.floats(max_value=bound, exclude_max=not inclusive, allow_nan=False,
                                                   allow_infinity=False)

    def above(bound: float, inclusive: bool) -> st.SearchStrategy:
        ints = st.integers(int(bound) + (0 if inclusive and bound == int(bound) else 1), 2**62)
        return ints if whole else ints | st.floats(min_value=bound, exclude_min=not inclusive, allow_nan=False,
                                                   allow_infinity=False)

    sides = []
    if "minimum" in spec:
        sides.append(below(spec["minimum"], inclusive=False))
    if "exclusiveMinimum" in spec:
        sides.append(below(spec["exclusiveMinimum"], inclusive=True))
    if "maximum" in spec:
        sides.append(above(spec["maximum"], inclusive=False))
    if "exclusiveMaximum" in spec:
        sides.append(above(spec["exclusiveMaximum"], inclusive=True))
    return st.one_of(sides)


BOUNDED = bounded_fields()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(BOUNDED), data=st.data())
def test_out_of_range_numbers_are_422_and_change_nothing(client, case, data):
    c, _ = client
    op, schema, name, spec = case
    bounds = spec.get("items", spec)
    value = data.draw(beyond(bounds), label="value")
    body = {**valid_body(schema), name: [value] if "items" in spec else value}
    before = c.get("/admin/version").json()["version"]
    r = c.request(op.method, "/admin" + fill(op.path), json=body)
    assert r.status_code == 422, (op.op_id, name, value, r.text)
    err = r.json()["error"]
    assert err["param"] == name and err["code"] == bounds.get("x-error-code", "out_of_range"), r.text
    assert c.get("/admin/version").json()["version"] == before


def test_audit_consistent_after_fuzzing(client):
    c, _ = client
    version = c.get("/admin/version").json()["version"]
    entries = c.get("/admin/audit", params={"limit": 1000}).json()["data"]
    assert {e["registry_version"] for e in entries} == set(range(1, version + 1))
