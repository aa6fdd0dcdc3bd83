"""Every route with the registry database stopped: a private PostgreSQL cluster (never the shared
one) is migrated and seeded, the gateway (admin API and console mounted) serves on a real uvicorn
port, the cluster is stopped, and every public and admin route is called on one keep-alive
connection. None answers 500; a 503 carries ``retry-after`` and a stable code; the connection
serves the next request; the completions keep serving from the last registry snapshot.

The routes are enumerated from the app, so a new route fails ``test_every_route_is_walked`` until
it is given a call below (or an exemption with its reason).
"""

from __future__ import annotations

import ast
import asyncio
import http.client
import json
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from starlette.routing import Mount, Route

from gateway.app import SERVED_PATHS, create_app
from gateway.ratelimit import LocalLimiter
from loraplex.residency import MemoryResidency
from loraplex.tokens import mint, mint_admin
from registry.service import RegistryService
from tests.registry_support import TINY, fresh_registry, make_settings, write_adapter
from tests.stub_worker import ThreadServer, free_port, mock_worker_transport
from tests.worker_double import worker_client

pytestmark = pytest.mark.e2e  # a PostgreSQL cluster of its own, started and stopped

ROOT = Path(__file__).resolve().parent.parent
PG_VERSION = "15"
UNAVAILABLE_CODES = {"registry_unavailable", "store_unavailable", "registry_busy"}
"""The codes a 503 may carry while the registry database is down."""


class Cluster:
    """A PostgreSQL cluster of this test's own (trust auth, loopback), started, stopped and dropped."""

    def __init__(self) -> None:
        self.name = f"loraplex_outage_{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.url = f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/registry"

    def _run(self, *cmd: str) -> None:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip() or done.stdout.strip()}")

    def create(self) -> None:
        self._run("pg_createcluster", PG_VERSION, self.name, "-p", str(self.port), "--",
                  "--auth=trust", "--no-sync")
        self.start()

        async def create_db() -> None:
            import asyncpg

            conn = await asyncpg.connect(f"postgresql://postgres@127.0.0.1:{self.port}/postgres")
            try:
                await conn.execute("CREATE DATABASE registry")
            finally:
                await conn.close()

        asyncio.run(create_db())

    def start(self) -> None:
        self._run("pg_ctlcluster", PG_VERSION, self.name, "start")

    def stop(self) -> None:
        self._run("pg_ctlcluster", PG_VERSION, self.name, "stop", "-m", "fast")

    def drop(self) -> None:
        subprocess.run(["pg_dropcluster", PG_VERSION, self.name, "--stop"], capture_output=True, timeout=120)


@dataclass
class Seeded:
    settings: Any
    adapter_id: str
    spare_id: str
    response_id: str = ""
    ids: dict[str, str] = field(default_factory=dict)


async def _seed(settings: Any) -> Seeded:
    await fresh_registry(settings.database_url)
    svc = RegistryService(settings)
    try:
        await svc.register_base_model(TINY)
        await svc.create_tenant("acme", requests_per_min=10_000, tokens_per_min=1_000_000, max_concurrent=50)
        ids = []
        for seed in (1, 2):
            d = write_adapter(Path(settings.resolved_adapter_root()) / f"support-{seed}", TINY, seed=seed)
            a = await svc.register_adapter("support", str(d), TINY.name, owner="acme")
            ids.append((await svc.activate_adapter(a.id, verification={"probe": "ok"})).id)
        await svc.bind("acme", "support", ids[0])
    finally:
        await svc.close()
    return Seeded(settings, ids[0], ids[1])


class Conn:
    """One keep-alive HTTP/1.1 connection to the gateway (``http.client`` never reconnects behind
    the test's back: a connection the server dropped fails the next request)."""

    def __init__(self, port: int) -> None:
        self.http = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.sock: Any = None

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                raw: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        hdrs = dict(headers or {})
        if data is not None and "content-type" not in hdrs:
            hdrs["content-type"] = "application/json"
        self.http.request(method, path, body=data, headers=hdrs)
        resp = self.http.getresponse()
        content = resp.read()
        if self.sock is None:
            self.sock = self.http.sock
        assert self.http.sock is self.sock, f"{method} {path}: the connection was replaced"
        assert not resp.will_close, f"{method} {path}: the server closed the connection"
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, content

    def close(self) -> None:
        self.http.close()


@pytest.fixture(scope="module")
def outage(tmp_path_factory):
    """The gateway over a seeded registry whose database is then stopped."""
    cluster = Cluster()
    tmp = tmp_path_factory.mktemp("outage")
    try:
        cluster.create()
        settings = make_settings(tmp, cluster.url, worker_urls=("http://worker",), registry_refresh_s=60.0,
                                 response_retention_s=3600, canary_judge_interval_s=0.0)
        seeded = asyncio.run(_seed(settings))
        app = create_app(settings, limiter=LocalLimiter(), residency=MemoryResidency(),
                         http_client=worker_client(mock_worker_transport()))
        with ThreadServer(app, settings=settings) as server:
            conn = Conn(server.port)
            user = {"authorization": f"Bearer {mint(settings, 'u', tenant='acme')}"}
            status, _, body = conn.request("POST", "/v1/responses", {"model": "support", "input": "hi"}, user)
            assert status == 200, body
            conn.close()
            seeded.response_id = json.loads(body)["id"]
            cluster.stop()
            yield app, server.port, seeded
    finally:
        cluster.drop()


# --- what each route is called with ------------------------------------------------------------------

@dataclass(frozen=True)
class Call:
    method: str
    path: str
    """The concrete path; ``{response_id}``, ``{adapter}``, ``{spare}`` are filled in."""
    body: Any = None
    expect: int = 503
    auth: str = "admin"
    query: str = ""
    raw: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)


B = "/admin/tenants/acme/bindings/support"
CONSOLE_PAGES = {"tenants": "", "tenant": "?slug=acme", "adapters": "", "adapter": "?ref={adapter}", "audit": "",
                 "confirm": "?action=disable&slug=acme", "usage": "", "tenant_usage": "?slug=acme", "limits": ""}
"""The console's pages that read the registry, with their query."""
CALLS: dict[str, list[Call]] = {
    # Public: the completions serve from the last snapshot; what reads the database answers 503.
    "POST /v1/chat/completions": [Call("POST", "/v1/chat/completions", {
        "model": "support", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, 200, "user")],
    "POST /v1/completions": [Call("POST", "/v1/completions", {"model": "support", "prompt": "hi", "max_tokens": 4},
                                  200, "user")],
    "POST /v1/responses": [
        Call("POST", "/v1/responses", {"model": "support", "input": "hi", "store": False}, 200, "user"),
        Call("POST", "/v1/responses", {"model": "support", "input": "hi"}, 503, "user"),
        Call("POST", "/v1/responses", {"model": "support", "input": "hi", "store": False, "stream": True}, 200,
             "user"),
        Call("POST", "/v1/responses", {"model": "support", "input": "and?", "previous_response_id": "{response_id}"},
             503, "user"),
        Call("POST", "/v1/responses", {"model": "support", "input": "and?", "store": False, "stream": True,
                                       "previous_response_id": "{response_id}"}, 503, "user"),
    ],
    "GET /v1/responses/{response_id}": [Call("GET", "/v1/responses/{response_id}", auth="user")],
    "DELETE /v1/responses/{response_id}": [Call("DELETE", "/v1/responses/{response_id}", auth="user")],
    "GET /v1/responses/{response_id}/input_items": [Call("GET", "/v1/responses/{response_id}/input_items",
                                                         auth="user")],
    "GET /v1/models": [Call("GET", "/v1/models", expect=200, auth="user")],
    "GET /v1/models/{model:path}": [Call("GET", "/v1/models/support", expect=200, auth="user")],
    "GET /v1/usage": [Call("GET", "/v1/usage", auth="user", query="?start_time=0&bucket_width=1d")],
    "GET /healthz": [Call("GET", "/healthz", expect=200, auth="")],
    "GET /readyz": [Call("GET", "/readyz", expect=200, auth="")],
    # Admin API: every operation reads or writes the database.
    "GET /admin/openapi.json": [Call("GET", "/admin/openapi.json", expect=200)],
    "POST /admin/adapters/upload": [Call("POST", "/admin/adapters/upload", query="?name=up&base_model=" + TINY.name,
                                         raw=b"{}", headers={"x-loraplex-config-bytes": "2"})],
    "GET /admin/version": [Call("GET", "/admin/version")],
    "GET /admin/tenants": [Call("GET", "/admin/tenants")],
    "POST /admin/tenants": [Call("POST", "/admin/tenants", {"slug": "newco"})],
    "GET /admin/tenants/{slug}": [Call("GET", "/admin/tenants/acme")],
    "POST /admin/tenants/{slug}/disable": [Call("POST", "/admin/tenants/acme/disable")],
    "POST /admin/tenants/{slug}/enable": [Call("POST", "/admin/tenants/acme/enable")],
    "PATCH /admin/tenants/{slug}/limits": [Call("PATCH", "/admin/tenants/acme/limits", {"max_concurrent": 5})],
    "PUT /admin/tenants/{slug}/cache-scope": [Call("PUT", "/admin/tenants/acme/cache-scope", {"cache_scope": "group"})],
    "GET /admin/base-models": [Call("GET", "/admin/base-models")],
    "POST /admin/base-models": [Call("POST", "/admin/base-models", {
        "name": "other", "revision": "r", "architecture": TINY.architecture, "hidden_size": TINY.hidden_size,
        "num_layers": TINY.num_layers, "num_heads": TINY.num_heads, "num_kv_heads": TINY.num_kv_heads,
        "head_dim": TINY.head_dim, "intermediate_size": TINY.intermediate_size, "vocab_size": TINY.vocab_size})],
    "POST /admin/base-models/{name}/upgrade": [Call("POST", f"/admin/base-models/{TINY.name}/upgrade",
                                                    {"to": "other", "dry_run": True})],
    "GET /admin/adapters": [Call("GET", "/admin/adapters")],
    "POST /admin/adapters": [Call("POST", "/admin/adapters", {"name": "new", "uri": "support-1",
                                                              "base_model": TINY.name})],
    "GET /admin/adapters/{ref}": [Call("GET", "/admin/adapters/{adapter}")],
    "POST /admin/adapters/{ref}/activate": [Call("POST", "/admin/adapters/{spare}/activate", {})],
    "POST /admin/adapters/{ref}/disable": [Call("POST", "/admin/adapters/{spare}/disable", {"reason": "x"})],
    "POST /admin/adapters/{ref}/enable": [Call("POST", "/admin/adapters/{spare}/enable")],
    "POST /admin/adapters/{ref}/fail": [Call("POST", "/admin/adapters/{spare}/fail", {"reason": "x"})],
    "GET /admin/bindings": [Call("GET", "/admin/bindings")],
    "GET /admin/tenants/{slug}/bindings/{alias}": [Call("GET", B)],
    "PUT /admin/tenants/{slug}/bindings/{alias}": [Call("PUT", B, {"adapter": "{spare}"})],
    "DELETE /admin/tenants/{slug}/bindings/{alias}": [Call("DELETE", B)],
    "POST /admin/tenants/{slug}/bindings/{alias}/rollback": [Call("POST", B + "/rollback")],
    "POST /admin/tenants/{slug}/bindings/{alias}/canary": [Call("POST", B + "/canary",
                                                                {"adapter": "{spare}", "percent": 10})],
    "PATCH /admin/tenants/{slug}/bindings/{alias}/canary": [Call("PATCH", B + "/canary", {"percent": 20})],
    "DELETE /admin/tenants/{slug}/bindings/{alias}/canary": [Call("DELETE", B + "/canary")],
    "POST /admin/tenants/{slug}/bindings/{alias}/canary/promote": [Call("POST", B + "/canary/promote")],
    "GET /admin/tenants/{slug}/bindings/{alias}/canary/policy": [Call("GET", B + "/canary/policy")],
    "PUT /admin/tenants/{slug}/bindings/{alias}/canary/policy": [Call("PUT", B + "/canary/policy",
                                                                      {"interval_s": 5})],
    "POST /admin/tenants/{slug}/bindings/{alias}/canary/pause": [Call("POST", B + "/canary/pause")],
    "POST /admin/tenants/{slug}/bindings/{alias}/canary/resume": [Call("POST", B + "/canary/resume")],
    "POST /admin/tenants/{slug}/bindings/{alias}/enable": [Call("POST", B + "/enable", {})],
    "POST /admin/tenants/{slug}/bindings/{alias}/disable": [Call("POST", B + "/disable", {"on_disabled": "base"})],
    "POST /admin/gc": [Call("POST", "/admin/gc", {})],
    "GET /admin/audit": [Call("GET", "/admin/audit")],
    "GET /admin/usage": [Call("GET", "/admin/usage", query="?start_time=0&group_by=tenant")],
    "GET /admin/limits/report": [Call("GET", "/admin/limits/report", query="?window=7d")],
    # The console: its shell and assets are files; its pages read the registry.
    "GET /admin/console": [Call("GET", "/admin/console", expect=200)],
    "GET /admin/console/static/{name}": [Call("GET", "/admin/console/static/console.js", expect=200)],
    "GET /admin/console/view/{page}": [
        *(Call("GET", f"/admin/console/view/{page}", query=q) for page, q in CONSOLE_PAGES.items()),
        # No worker reports, no live numbers: nothing to look up in the registry.
        *(Call("GET", f"/admin/console/view/{page}", expect=200) for page in ("whoami", "fleet", "live"))],
}
EXEMPT: dict[str, str] = {}
"""Routes not walked, with the reason (none today)."""


def app_routes(app: Any) -> set[str]:
    """Every ``METHOD path`` the gateway serves: the hot routes (``SERVED_PATHS``) and its Starlette
    routes, the mounted admin app's included."""
    out = set()
    for entry in SERVED_PATHS:
        methods, path = entry.split(" ", 1)
        path = path.replace("{id}", "{response_id}").replace("{model}", "{model:path}")
        out.update(f"{m} {path}" for m in methods.split("|"))

    def walk(routes: list[Any], prefix: str) -> None:
        for r in routes:
            if isinstance(r, Mount):
                walk(r.routes, prefix + r.path)
            elif isinstance(r, Route):
                out.update(f"{m} {prefix}{r.path}" for m in r.methods or () if m != "HEAD")

    walk(app.routes, "")
    return out


def console_pages() -> set[str]:
    """The console's pages (the keys of ``VIEWS`` in registry/console/views.py)."""
    tree = ast.parse((ROOT / "registry" / "console" / "views.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign | ast.Assign) and "VIEWS" in ast.unparse(
                node.target if isinstance(node, ast.AnnAssign) else node.targets[0]):
            assert isinstance(node.value, ast.Dict)
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    raise AssertionError("no VIEWS table in registry/console/views.py")


def test_every_console_page_is_walked():
    walked = {c.path.rsplit("/", 1)[1] for c in CALLS["GET /admin/console/view/{page}"]}
    assert console_pages() - walked == set(), "console pages not walked"


def test_every_route_is_walked(outage):
    app, _conn, _seeded = outage
    served = app_routes(app)
    assert served - set(CALLS) - set(EXEMPT) == set(), "routes neither walked nor exempt"
    assert set(CALLS) - served == set(), "walked routes the gateway does not serve"


def _fill(value: Any, seeded: Seeded) -> Any:
    if isinstance(value, str):
        return (value.replace("{response_id}", seeded.response_id).replace("{adapter}", seeded.adapter_id)
                .replace("{spare}", seeded.spare_id))
    if isinstance(value, dict):
        return {k: _fill(v, seeded) for k, v in value.items()}
    return value


@pytest.mark.parametrize("route", sorted(CALLS))
def test_a_route_with_the_registry_down(outage, route):
    _app, port, seeded = outage
    conn = Conn(port)
    s = seeded.settings
    tokens = {"admin": mint_admin(s), "user": mint(s, "u", tenant="acme"), "": ""}
    for call in CALLS[route]:
        headers = dict(call.headers)
        if tokens[call.auth]:
            headers["authorization"] = f"Bearer {tokens[call.auth]}"
        what = f"{call.method} {call.path} {call.body}"
        status, hdrs, body = conn.request(call.method, _fill(call.path + call.query, seeded), _fill(call.body, seeded),
                                          headers, call.raw)
        assert status != 500, f"{what}: {body[:300]!r}"
        assert status == call.expect, f"{what}: {status} {body[:300]!r}"
        if status == 503:
            assert hdrs.get("retry-after", "").isdigit(), f"{what}: no retry-after"
            if hdrs.get("content-type", "").startswith("application/json"):
                code = json.loads(body)["error"]["code"]
                assert code in UNAVAILABLE_CODES, f"{what}: {code}"
        # The connection serves the next request.
        assert conn.request("GET", "/healthz")[0] == 200
    conn.close()


def test_an_unexpected_error_keeps_the_connection(outage, monkeypatch, caplog):
    """A bug (not an outage) on a Starlette route is a logged 500, and the keep-alive connection
    serves the next request (Starlette re-raises after answering; the app does not let the server
    see it)."""
    app, port, seeded = outage

    async def broken(tenant: str, response_id: str) -> None:
        raise RuntimeError("a bug at /srv/loraplex/registry/responses.py")

    monkeypatch.setattr(app.gateway.responses_store, "get", broken)
    conn = Conn(port)
    user = {"authorization": f"Bearer {mint(seeded.settings, 'u', tenant='acme')}"}
    status, _, body = conn.request("GET", f"/v1/responses/{seeded.response_id}", headers=user)
    assert status == 500 and json.loads(body)["error"]["code"] == "internal_error", body
    assert b"/srv/" not in body and b"RuntimeError" not in body
    assert conn.request("GET", "/healthz")[0] == 200
    assert any("unhandled error" in r.getMessage() for r in caplog.records)
    conn.close()
