"""Resolution: aliases, base model, tenant isolation, canary split and stickiness, disabled bindings."""

from __future__ import annotations

import httpx

from gateway.app import create_app
from gateway.ratelimit import LocalLimiter
from gateway.resolve import Resolver, canary_bucket
from loraplex.residency import MemoryResidency
from loraplex.settings import Settings
from loraplex.tokens import mint
from loraplex.wire import PRIORITY_CLASSES, WorkerRequestExt
from tests.stub_worker import MutableSnapshots, make_snapshot, mock_worker_transport
from tests.worker_double import worker_client

TENANTS = {
    "acme": {"priority": "high", "bindings": {
        "support": {"active": ("sup", 1)},
        "sales": {"active": ("sales", 2), "canary": ("sales", 3), "canary_percent": 20},
        "old": {"active": ("old", 1), "enabled": False, "on_disabled": "base"},
        "paused": {"active": ("paused", 1), "enabled": False, "on_disabled": "refuse"},
    }},
    "globex": {"bindings": {"secret": {"active": ("gx", 1)}}},
}


class Env:
    def __init__(self, tenants=TENANTS) -> None:
        self.settings = Settings(worker_urls=("http://worker",))
        self.sent: list[dict] = []
        self.snaps = MutableSnapshots(make_snapshot(tenants))
        self.app = create_app(self.settings, snapshots=self.snaps, limiter=LocalLimiter(),
                              residency=MemoryResidency(),
                              http_client=worker_client(mock_worker_transport(self.sent)),
                              mount_admin=False)

    def headers(self, tenant: str = "acme") -> dict[str, str]:
        return {"authorization": f"Bearer {mint(self.settings, 'u', tenant=tenant)}"}

    async def __aenter__(self):
        self._ctx = self.app.router.lifespan_context(self.app)
        await self._ctx.__aenter__()
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://gw")
        return self

    async def __aexit__(self, *exc):
        await self.client.aclose()
        await self._ctx.__aexit__(None, None, None)

    async def chat(self, model: str, tenant: str = "acme", **extra) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
        return await self.client.post("/v1/chat/completions", json=body, headers=self.headers(tenant))


async def test_alias_resolves_to_adapter_and_ext_is_forwarded():
    async with Env() as env:
        r = await env.chat("support", user="end-user-1")
        assert r.status_code == 200, r.text
        assert r.headers["x-loraplex-adapter"] == "sup@1"
        ext = env.sent[-1]["loraplex"]
        assert ext["adapter"] == {"id": "sup-v1", "name": "sup@1", "uri": "file:///adapters/sup/1",
                                  "sha256": "0" * 64, "rank": 8, "base_revision": "r1"}
        assert ext["tenant"] == "acme"
        assert ext["priority"] == PRIORITY_CLASSES["high"]
        assert ext["request_id"] == r.headers["x-request-id"]
        assert env.sent[-1]["user"] == "end-user-1"
        # exactly what the worker's reading of the extension gives back (one codec both ways)
        assert WorkerRequestExt.from_dict(ext).to_dict() == ext


async def test_base_model_name_answers_with_base():
    async with Env() as env:
        r = await env.chat("smol")
        assert r.status_code == 200
        assert r.headers["x-loraplex-adapter"] == "base"
        assert env.sent[-1]["loraplex"]["adapter"] is None


async def test_other_tenants_alias_is_indistinguishable_from_missing():
    async with Env() as env:
        foreign = await env.chat("secret")
        missing = await env.chat("nothing-at-all")
        assert foreign.status_code == missing.status_code == 404
        fe, me = foreign.json()["error"], missing.json()["error"]
        assert fe["message"].replace("secret", "X") == me["message"].replace("nothing-at-all", "X")
        assert fe["code"] == me["code"] and fe["type"] == me["type"]
        assert not env.sent  # nothing reached a worker
        assert (await env.chat("secret", tenant="globex")).status_code == 200


async def test_disabled_binding_falls_back_or_refuses():
    async with Env() as env:
        r = await env.chat("old")
        assert r.status_code == 200 and r.headers["x-loraplex-adapter"] == "base"
        assert r.headers["x-loraplex-fallback"] == "binding-disabled"
        assert env.sent[-1]["loraplex"]["adapter"] is None
        r = await env.chat("paused")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_disabled"


async def test_models_lists_own_aliases_and_base_only():
    async with Env() as env:
        r = await env.client.get("/v1/models", headers=env.headers())
        ids = {m["id"] for m in r.json()["data"]}
        assert ids == {"support", "sales", "old", "paused", "smol"}
        r = await env.client.get("/v1/models", headers=env.headers("globex"))
        assert {m["id"] for m in r.json()["data"]} == {"secret", "smol"}
        assert (await env.client.get("/v1/models")).status_code == 401


async def test_a_model_is_retrieved_by_its_id_and_another_tenants_alias_is_not_found():
    async with Env() as env:
        r = await env.client.get("/v1/models/support", headers=env.headers())
        assert r.status_code == 200 and r.json() == {"id": "support", "object": "model", "created": 0,
                                                     "owned_by": "acme"}
        assert (await env.client.get("/v1/models/smol", headers=env.headers())).json()["owned_by"] == "loraplex"
        theirs = await env.client.get("/v1/models/secret", headers=env.headers())  # globex's alias
        missing = await env.client.get("/v1/models/no-such-model", headers=env.headers())
        for r, name in ((theirs, "secret"), (missing, "no-such-model")):
            assert r.status_code == 404
            assert r.json()["error"] == {"message": f"The model '{name}' does not exist or you do not have access "
                                                    f"to it.", "type": "not_found_error", "param": None,
                                         "code": "model_not_found"}
        r = await env.client.get("/v1/models/support")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"


async def test_an_unknown_path_is_refused_as_unsupported_and_a_401_says_bearer():
    async with Env() as env:
        r = await env.client.post("/v1/embeddings", headers=env.headers(), json={"input": "x"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "unsupported_path"
        assert "POST /v1/embeddings" in r.json()["error"]["message"]
        assert "POST /v1/chat/completions" in r.json()["error"]["message"]
        r = await env.client.post("/v1/chat/completions", json={"model": "support", "messages": []})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        r = await env.client.get("/v1/models", headers={"authorization": "Bearer not-a-token"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"


async def test_canary_share_and_stickiness_through_the_gateway():
    async with Env() as env:
        n = 2000
        canary = 0
        for i in range(n):
            r = await env.chat("sales", user=f"user-{i}")
            assert r.status_code == 200
            canary += r.headers["x-loraplex-adapter"] == "sales@3"
        share = 100.0 * canary / n
        assert abs(share - 20.0) <= 3.0, share
        # One end user always lands on the same version.
        for i in range(20):
            seen = {(await env.chat("sales", user=f"user-{i}")).headers["x-loraplex-adapter"] for _ in range(5)}
            assert len(seen) == 1
        # Without a user, the request id decides (a fresh id each time): both versions are seen.
        seen = {(await env.chat("sales")).headers["x-loraplex-adapter"] for _ in range(60)}
        assert seen == {"sales@2", "sales@3"}


async def test_canary_change_and_rollback_apply_on_snapshot_swap():
    async with Env() as env:
        assert (await env.chat("support")).headers["x-loraplex-adapter"] == "sup@1"
        new = dict(TENANTS)
        new["acme"] = {"bindings": {"support": {"active": ("sup", 2)}}}
        env.snaps.current = make_snapshot(new, version=2)
        assert (await env.chat("support")).headers["x-loraplex-adapter"] == "sup@2"
        env.snaps.current = make_snapshot(TENANTS, version=3)
        assert (await env.chat("support")).headers["x-loraplex-adapter"] == "sup@1"


def test_canary_bucket_is_stable_and_uniform():
    assert canary_bucket("acme", "u1") == canary_bucket("acme", "u1")
    buckets = [canary_bucket("acme", f"u{i}") for i in range(20_000)]
    assert all(0 <= b < 10_000 for b in buckets)
    low = sum(b < 5000 for b in buckets) / len(buckets)
    assert 0.48 < low < 0.52
    snap = make_snapshot({"t": {"bindings": {"a": {"active": ("a", 1), "canary": ("a", 2), "canary_percent": 100}}}})
    res = Resolver().resolve(snap, snap.tenants["t"], "a", "anyone")
    assert res.label == "a@2" and res.canary


async def test_one_structured_log_line_per_request(caplog):
    import json
    import logging

    caplog.set_level(logging.INFO, logger="loraplex.gateway.access")
    async with Env() as env:
        r = await env.chat("support")
        await env.chat("nothing")
    lines = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "loraplex.gateway.access"]
    assert len(lines) == 2
    ok, missing = lines
    assert ok["request_id"] == r.headers["x-request-id"]
    assert (ok["tenant"], ok["alias"], ok["adapter"], ok["worker"], ok["status"]) == \
        ("acme", "support", "sup@1", "http://worker", 200)
    assert ok["prompt_tokens"] == 7 and ok["completion_tokens"] == 3 and ok["latency_ms"] > 0
    assert missing["status"] == 404 and missing["adapter"] == ""
