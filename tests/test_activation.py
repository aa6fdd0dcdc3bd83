"""The activation gate: the admin API activates a version only after a worker's probes pass.

Real registry (SQLite) and admin API; the worker is an ``httpx.MockTransport`` seam that
answers ``/internal/adapters/probe`` the way a worker does, so every verdict path is
exercised: differs -> active, identical -> failed, empty or one-for-all answers -> failed,
eval below threshold -> failed, load failure -> failed, an engine failure -> failed without
trying the next worker, an unreachable worker -> the next one, no worker -> 503 with nothing
recorded; a failed version can be activated again.
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
from registry.records import AuditRecord
from registry.service import RegistryService
from tests.registry_support import TINY, fresh_registry, make_settings, write_adapter
from tests.worker_double import worker_client


class FakeWorker:
    """Answers probes: ``mode`` says what the adapter does to the outputs (``modes`` per worker host)."""

    def __init__(self) -> None:
        self.mode = "differs"
        self.modes: dict[str, str] = {}
        self.calls: list[dict] = []
        self.hosts: list[str] = []
        self.secrets: list[str | None] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/internal/adapters/probe"
        self.secrets.append(request.headers.get(HDR_WORKER_SECRET))
        body = json.loads(request.content)
        self.calls.append(body)
        self.hosts.append(request.url.host)
        mode = self.modes.get(request.url.host, self.mode)
        if mode == "unreachable":
            raise httpx.ConnectError("connection refused", request=request)
        if mode == "breaks-off":
            raise httpx.RemoteProtocolError("server disconnected without sending a response", request=request)
        if mode == "load-fails":
            return httpx.Response(422, json={"error": {"message": "sha256 mismatch", "type": "x", "code": "x"}})
        if mode == "engine-fails":
            return httpx.Response(503, json={"error": {"message": "non-finite logits in the step", "type": "x",
                                                       "code": "engine_error"}})
        if mode == "busy":
            return httpx.Response(503, json={"error": {"message": "queue full", "type": "x", "code": "queue_full"}})
        results = []
        for prompt in body["prompts"]:
            base = f"base answer to {prompt}"
            adapter = {"differs": f"Réponse: {prompt}", "same": base, "json": f'{{"answer": "{prompt}"}}',
                       "empty": "", "blank": " \n ", "constant": "ok ok ok ok",
                       "one-empty": "" if prompt == body["prompts"][-1] else f"Réponse: {prompt}"}[mode]
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
    client = worker_client(httpx.MockTransport(worker.handler))
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
    await client.close()
    await service.close()


async def _audit(service: RegistryService, adapter_id: str) -> list[AuditRecord]:
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
    actions = [e.action for e in await _audit(service, ad["id"])]
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
    assert row.status == "failed" and row.verification["passed"] is False
    assert (await _audit(service, ad["id"]))[0].action == "adapter.fail"
    # The refusal carries the evidence: the failed version with every probe's base and adapter output.
    evidence = r.json()["adapter"]
    assert evidence["status"] == "failed" and evidence["verification"]["probes"][0]["base"].startswith("base")
    assert evidence["verification"]["probes"][0]["adapter"] == evidence["verification"]["probes"][0]["base"]


async def test_failed_activation_can_be_retried(env):
    _, service, worker, _, api, register = env
    worker.mode = "same"
    ad = await register()
    assert (await api.post(f"/adapters/{ad['id']}/activate", json={})).status_code == 422
    r = await api.post(f"/adapters/{ad['id']}/activate", json={})  # still the same: failed again, recorded
    assert r.status_code == 422 and r.json()["error"]["code"] == "adapter_verification_failed"
    worker.mode = "differs"  # e.g. the worker's LoRA settings fixed
    r = await api.post(f"/adapters/{ad['id']}/activate", json={})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "active" and r.json()["verification"]["passed"] is True
    assert len(worker.calls) == 3
    actions = [e.action for e in await _audit(service, ad["id"])]
    assert actions == ["adapter.activate", "adapter.fail", "adapter.fail", "adapter.register"]


@pytest.mark.parametrize(("mode", "words"), [("empty", "answered nothing"), ("blank", "answered nothing"),
                                             ("one-empty", "answered nothing"),
                                             ("constant", "same answer to every prompt")])
async def test_empty_or_degenerate_output_is_a_failed_activation(env, mode, words):
    """An adapter that answers "" (or one text for everything) differs from the base, yet fails."""
    _, service, worker, _, api, register = env
    worker.mode = mode
    ad = await register()
    r = await api.post(f"/adapters/{ad['id']}/activate", json={})
    assert r.status_code == 422, r.text
    assert "degenerate output" in r.json()["error"]["message"] and words in r.json()["error"]["message"]
    row = await service.get_adapter(ad["id"])
    assert row.status == "failed" and words in row.status_reason
    assert row.verification["passed"] is False and len(row.verification["probes"]) == 3


async def _two_workers(residency) -> None:
    for wid in ("w1", "w2"):
        await residency.publish(WorkerReport(worker_id=wid, url=f"http://{wid}", base_model=TINY.name,
                                             base_revision=TINY.revision), ttl_s=60)


async def test_engine_failure_fails_the_version_without_trying_another_worker(env):
    _, service, worker, residency, api, register = env
    await _two_workers(residency)
    worker.modes = {"w1": "engine-fails", "w2": "engine-fails"}
    ad = await register()
    r = await api.post(f"/adapters/{ad['id']}/activate", json={})
    assert r.status_code == 422, r.text
    assert "engine failed during the probe" in r.json()["error"]["message"]
    assert "non-finite logits" in r.json()["error"]["message"]
    assert len(worker.hosts) == 1  # the second worker was spared
    row = await service.get_adapter(ad["id"])
    assert row.status == "failed" and row.verification["error"]["code"] == "engine_error"


async def test_worker_breaking_off_mid_probe_fails_without_trying_another(env):
    _, service, worker, residency, api, register = env
    await _two_workers(residency)
    worker.modes = {"w1": "breaks-off", "w2": "breaks-off"}
    ad = await register()
    r = await api.post(f"/adapters/{ad['id']}/activate", json={})
    assert r.status_code == 422, r.text
    assert "broke off during the probe" in r.json()["error"]["message"]
    assert len(worker.hosts) == 1
    assert (await service.get_adapter(ad["id"])).status == "failed"


async def test_unreachable_worker_hands_the_probe_to_the_next(env):
    _, service, worker, residency, api, register = env
    await _two_workers(residency)
    worker.modes = {"w1": "unreachable", "w2": "unreachable"}
    ad = await register()
    r = await api.post(f"/adapters/{ad['id']}/activate", json={})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker"
    assert sorted(worker.hosts) == ["w1", "w2"]  # each tried in turn: none took the probe
    assert (await service.get_adapter(ad["id"])).status == "pending"
    # w2 comes back (a fresh report); w1 is still down
    worker.modes = {"w1": "unreachable"}
    await residency.publish(WorkerReport(worker_id="w2", url="http://w2", base_model=TINY.name,
                                         base_revision=TINY.revision), ttl_s=60)
    r = await api.post(f"/adapters/{ad['id']}/activate", json={})
    assert r.status_code == 200, r.text
    assert r.json()["verification"]["worker"] == "w2"


async def test_busy_worker_records_nothing(env):
    _, service, worker, _, api, register = env
    worker.mode = "busy"
    ad = await register()
    r = await api.post(f"/adapters/{ad['id']}/activate", json={})
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_busy"
    assert (await service.get_adapter(ad["id"])).status == "pending"


async def test_eval_set_threshold(env):
    _, service, worker, _, api, register = env
    worker.mode = "json"
    passing = {"cases": [{"prompt": "Say hi", "expect": r"^\{.*\}$"}, {"prompt": "Name a color",
                                                                          "expect": "answer"}], "threshold": 1.0}
    ad = await register()
    r = await api.post(f"/adapters/{ad['id']}/activate", json={"eval": passing})
    assert r.status_code == 200, r.text
    assert r.json()["verification"]["eval"] == {"score": 1.0, "threshold": 1.0, "cases": 2, "matched": 2,
                                                "failed_cases": [], "set": passing}
    assert worker.calls[-1]["prompts"][-2:] == ["Say hi", "Name a color"]

    failing = {"cases": [{"prompt": "Say hi", "expect": "bonjour"}, {"prompt": "x", "expect": "answer"}],
               "threshold": 0.75}
    ad2 = await register()
    r = await api.post(f"/adapters/{ad2['id']}/activate", json={"eval": failing})
    assert r.status_code == 422
    assert "eval score 0.50 is below the threshold 0.75" in r.json()["error"]["message"]
    assert (await service.get_adapter(ad2["id"])).status == "failed"
    # which cases failed, and what the adapter answered
    assert r.json()["adapter"]["verification"]["eval"]["failed_cases"] == [
        {"prompt": "Say hi", "expect": "bonjour", "adapter": '{"answer": "Say hi"}'}]


async def test_bad_eval_set_and_caller_verification_are_refused_without_recording(env):
    _, service, _, _, api, register = env
    ad = await register()
    for body in ({"eval": {"cases": []}}, {"eval": {"cases": [{"prompt": "p", "expect": "("}]}},
                 {"eval": {"cases": [{"prompt": "p", "expect": "x"}], "threshold": 2}},
                 {"verification": {"passed": True}}):
        r = await api.post(f"/adapters/{ad['id']}/activate", json=body)
        assert r.status_code == 422, (body, r.text)
    assert (await service.get_adapter(ad["id"])).status == "pending"


async def test_load_failure_on_the_worker_fails_the_version(env):
    _, service, worker, _, api, register = env
    worker.mode = "load-fails"
    ad = await register()
    r = await api.post(f"/adapters/{ad['id']}/activate", json={})
    assert r.status_code == 422
    row = await service.get_adapter(ad["id"])
    assert row.status == "failed" and "sha256 mismatch" in row.status_reason


async def test_no_worker_is_503_and_nothing_recorded(env):
    _, service, _, residency, api, register = env
    ad = await register()
    await residency.remove("w1")
    r = await api.post(f"/adapters/{ad['id']}/activate", json={})
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "no_worker"
    assert (await service.get_adapter(ad["id"])).status == "pending"


async def test_gate_probes_only_on_workers_at_the_versions_base_revision(env):
    _, service, worker, residency, api, register = env
    await residency.publish(WorkerReport(worker_id="w1", url="http://w1", base_model=TINY.name,
                                         base_revision="rev-other"), ttl_s=60)
    ad = await register()
    r = await api.post(f"/adapters/{ad['id']}/activate", json={})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker_on_revision", r.text
    assert "rev-other" in r.json()["error"]["message"] and worker.calls == []
    assert (await service.get_adapter(ad["id"])).status == "pending"
    await residency.publish(WorkerReport(worker_id="w2", url="http://w2", base_model=TINY.name,
                                         base_revision=TINY.revision), ttl_s=60)
    r = await api.post(f"/adapters/{ad['id']}/activate", json={})
    assert r.status_code == 200, r.text
    assert worker.hosts == ["w2"] and worker.calls[-1]["adapter"]["base_revision"] == TINY.revision
