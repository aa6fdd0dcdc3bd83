"""The activation gate: the admin API activates a version only after a worker's probes pass.

Real registry (SQLite) and admin API; the worker is an ``httpx.MockTransport`` seam that
answers ``/internal/adapters/probe`` the way a worker does, so every verdict path is
exercised: differs -> active, identical -> failed, eval below threshold -> failed, load
failure -> failed, no worker -> 503 with nothing recorded.
"""

from __future__ import annotations

import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from gateway.activation import ActivationGate
from gateway.router import Router
from loraplex.residency import MemoryResidency
from loraplex.tokens import mint_admin
from loraplex.wire import HDR_WORKER_SECRET, WorkerReport
from registry.admin_api import admin_app
from registry.service import RegistryService
from tests.registry_support import TINY, fresh_registry, make_settings, write_adapter


class FakeWorker:
    """Answers probes: ``mode`` says what the adapter does to the outputs."""

    def __init__(self) -> None:
        self.mode = "differs"
        self.calls: list[dict] = []
        self.secrets: list[str | None] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/internal/adapters/probe"
        self.secrets.append(request.headers.get(HDR_WORKER_SECRET))
        body = json.loads(request.content)
        self.calls.append(body)
        if self.mode == "load-fails":
            return httpx.Response(422, json={"error": {"message": "sha256 mismatch", "type": "x", "code": "x"}})
        results = []
        for prompt in body["prompts"]:
            base = f"base answer to {prompt}"
            adapter = {"differs": f"Réponse: {prompt}", "same": base, "json": '{"answer": "x"}'}[self.mode]
            results.append({"prompt": prompt, "base": base, "adapter": adapter})
        return httpx.Response(200, json={"results": results, "adapter_load_ms": 12.5})


@pytest.fixture
async def env(tmp_path):
    url = f"sqlite+aiosqlite:///{tmp_path}/registry.db"
    await fresh_registry(url)
    settings = make_settings(tmp_path, url)
    service = RegistryService(settings)
    await service.register_base_model(TINY)
    worker = FakeWorker()
    residency = MemoryResidency()
    await residency.publish(WorkerReport(worker_id="w1", url="http://w1", base_model=TINY.name,
                                         base_revision=TINY.revision), ttl_s=60)
    router = Router(residency)
    client = httpx.AsyncClient(transport=httpx.MockTransport(worker.handler))
    app = Starlette(routes=[Mount("/admin", app=admin_app(service, settings,
                                                          gate=ActivationGate(settings, router, client)))])
    api = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw/admin",
                            headers={"authorization": f"Bearer {mint_admin(settings)}"})
    n = 0

    async def register() -> dict:
        nonlocal n
        n += 1
        path = write_adapter(tmp_path / "adapters" / f"a{n}", seed=n)
        r = await api.post("/adapters", json={"name": "bot", "uri": str(path), "base_model": TINY.name})
        assert r.status_code == 201, r.text
        return r.json()

    yield settings, service, worker, residency, api, register
    await api.aclose()
    await client.aclose()
    await service.close()


async def _audit(service: RegistryService, adapter_id: str) -> list[dict]:
    return await service.audit(target=f"adapter:{adapter_id}")


async def test_adapter_that_changes_outputs_goes_active_with_its_verification(env):
    settings, service, worker, _, api, register = env
    ad = await register()
    assert ad["status"] == "pending"
    r = await api.post(f"/adapters/{ad['id']}/activate", json={})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["status"] == "active"
    v = out["verification"]
    assert v["passed"] is True and v["worker"] == "w1" and v["probes_differing"] == len(v["probes"]) > 0
    assert worker.secrets == [settings.worker_secret]
    assert worker.calls[0]["adapter"]["id"] == ad["id"]  # the version id, the engine's cache key
    actions = [e["action"] for e in await _audit(service, ad["id"])]
    assert "adapter.activate" in actions


async def test_adapter_that_changes_nothing_is_failed_and_recorded(env):
    _, service, worker, _, api, register = env
    worker.mode = "same"
    ad = await register()
    r = await api.post(f"/adapters/{ad['id']}/activate", json={})
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "adapter_verification_failed"
    assert "equal the base model" in r.json()["error"]["message"]
    row = await service.get_adapter(ad["id"])
    assert row["status"] == "failed" and row["verification"]["passed"] is False
    assert (await _audit(service, ad["id"]))[0]["action"] == "adapter.fail"
    # A failed version stays failed: the gate is not re-run on it.
    r = await api.post(f"/adapters/{ad['id']}/activate", json={})
    assert r.status_code == 409


async def test_eval_set_threshold(env):
    _, service, worker, _, api, register = env
    worker.mode = "json"
    passing = {"cases": [{"prompt": "Say hi", "expect": r"^\{.*\}$"}, {"prompt": "Name a color",
                                                                          "expect": "answer"}], "threshold": 1.0}
    ad = await register()
    r = await api.post(f"/adapters/{ad['id']}/activate", json={"eval": passing})
    assert r.status_code == 200, r.text
    assert r.json()["verification"]["eval"] == {"score": 1.0, "threshold": 1.0, "cases": 2, "matched": 2}
    assert worker.calls[-1]["prompts"][-2:] == ["Say hi", "Name a color"]

    failing = {"cases": [{"prompt": "Say hi", "expect": "bonjour"}, {"prompt": "x", "expect": "answer"}],
               "threshold": 0.75}
    ad2 = await register()
    r = await api.post(f"/adapters/{ad2['id']}/activate", json={"eval": failing})
    assert r.status_code == 422
    assert "eval score 0.50 is below the threshold 0.75" in r.json()["error"]["message"]
    assert (await service.get_adapter(ad2["id"]))["status"] == "failed"


async def test_bad_eval_set_and_caller_verification_are_refused_without_recording(env):
    _, service, _, _, api, register = env
    ad = await register()
    for body in ({"eval": {"cases": []}}, {"eval": {"cases": [{"prompt": "p", "expect": "("}]}},
                 {"eval": {"cases": [{"prompt": "p", "expect": "x"}], "threshold": 2}},
                 {"verification": {"passed": True}}):
        r = await api.post(f"/adapters/{ad['id']}/activate", json=body)
        assert r.status_code == 422, (body, r.text)
    assert (await service.get_adapter(ad["id"]))["status"] == "pending"


async def test_load_failure_on_the_worker_fails_the_version(env):
    _, service, worker, _, api, register = env
    worker.mode = "load-fails"
    ad = await register()
    r = await api.post(f"/adapters/{ad['id']}/activate", json={})
    assert r.status_code == 422
    row = await service.get_adapter(ad["id"])
    assert row["status"] == "failed" and "sha256 mismatch" in row["status_reason"]


async def test_no_worker_is_503_and_nothing_recorded(env):
    _, service, _, residency, api, register = env
    ad = await register()
    await residency.remove("w1")
    r = await api.post(f"/adapters/{ad['id']}/activate", json={})
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "no_worker"
    assert (await service.get_adapter(ad["id"]))["status"] == "pending"
