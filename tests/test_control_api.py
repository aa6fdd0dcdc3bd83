"""The worker control API's one route table (``engine.control_api``): what the routes do around a
backend, the same table on the bundled worker and on ``loraplex vllm-agent``, and the agent's
backend answering over HTTP against a double of vLLM's runtime LoRA endpoints (the bundled
worker's backend over a real engine is in ``tests/test_worker_lora.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette

from engine.control import ControlError
from engine.control_api import ControlBackend, control_routes
from engine.internal_api import internal_routes
from loraplex.digest import digest_directory
from loraplex.settings import Settings
from loraplex.wire import HDR_WORKER_SECRET, AdapterRef
from tests.test_vllm_agent import FakeVllm
from vllm_agent.agent import AgentConfig, AgentControl, VllmAgent, create_agent_app

DEMO = Path(__file__).resolve().parent.parent / "demo" / "adapters"
SECRET = "control-api-test-secret-0123456789"
H = {HDR_WORKER_SECRET: SECRET}
REF = {"id": "ver-1", "name": "support@1", "uri": "file:///a", "sha256": "0" * 64}


class Backend(ControlBackend):
    """Records what the routes asked for; ``refusal`` refuses every route in ``check``."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.refusal: ControlError | None = None

    def check(self, *, adapters: bool) -> None:
        self.calls.append(("check", adapters))
        if self.refusal is not None:
            raise self.refusal

    def tokenizer(self) -> bytes:
        return b'{"base_model":"m"}'

    def adapters(self) -> list[dict[str, Any]]:
        return [{"id": "b"}, {"id": "a"}]

    def resident(self) -> dict[str, int]:
        return {"device": 1, "host": 1, "disk": 0}

    async def load(self, ref: AdapterRef, *, pin: bool, reload: bool) -> tuple[dict[str, Any], float]:
        self.calls.append(("load", ref.id, pin, reload))
        return {"id": ref.id}, 1.23456

    async def unload(self, aid: str, *, force: bool) -> None:
        self.calls.append(("unload", aid, force))
        if aid == "busy":
            raise ControlError(409, "busy", "adapter_busy")

    async def pin(self, ref: AdapterRef) -> dict[str, Any]:
        self.calls.append(("pin", ref.id))
        return {"id": ref.id, "pinned": True}

    async def pin_known(self, aid: str) -> dict[str, Any]:
        self.calls.append(("pin_known", aid))
        return {"id": aid, "pinned": True}

    async def unpin(self, aid: str) -> dict[str, Any]:
        self.calls.append(("unpin", aid))
        return {"id": aid, "pinned": False}

    async def probe(self, ref: AdapterRef, prompts: list[str], max_tokens: int) -> tuple[list[tuple[str, str]], float]:
        self.calls.append(("probe", ref.id, max_tokens))
        return [(f"base:{p}", f"tuned:{p}") for p in prompts], 2.0


def _settings(tmp_path: Path) -> Settings:
    return Settings.from_env({"LORAPLEX_HOME": str(tmp_path), "LORAPLEX_ADAPTER_ROOT": str(DEMO),
                              "LORAPLEX_WORKER_SECRET": SECRET, "LORAPLEX_MAX_BODY_BYTES": "4096"})


def _client(app: Starlette) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker")


async def test_the_routes_check_the_secret_then_the_backend_then_the_body(tmp_path):
    backend = Backend()
    async with _client(Starlette(routes=control_routes(backend, _settings(tmp_path)))) as c:
        assert (await c.get("/internal/adapters")).status_code == 401
        assert (await c.get("/internal/adapters", headers={HDR_WORKER_SECRET: "wrong"})).status_code == 403
        assert backend.calls == []  # refused before the backend was asked anything
        backend.refusal = ControlError(503, "still loading", "loading", "server_error")
        r = await c.post("/internal/adapters/load", headers=H, content=b"{oops")
        assert (r.status_code, r.json()["error"]["code"]) == (503, "loading")
        backend.refusal = None
        r = await c.post("/internal/adapters/load", headers=H, content=b"{oops")
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_json")
        r = await c.post("/internal/adapters/load", headers=H, content=b"[" + b" " * 5000 + b"]")
        assert (r.status_code, r.json()["error"]["code"]) == (413, "body_too_large")
        r = await c.post("/internal/adapters/unload", headers=H, json={"id": ""})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_value")
        assert (await c.get("/internal/tokenizer", headers=H)).content == b'{"base_model":"m"}'
    assert [call for call in backend.calls if call[0] == "check"][-1] == ("check", False)  # the tokenizer route


async def test_the_routes_shape_what_the_backend_answers(tmp_path):
    backend = Backend()
    async with _client(Starlette(routes=control_routes(backend, _settings(tmp_path)))) as c:
        listed = (await c.get("/internal/adapters", headers=H)).json()
        assert listed == {"adapters": [{"id": "a"}, {"id": "b"}], "resident": {"device": 1, "host": 1, "disk": 0}}
        r = await c.post("/internal/adapters/load", headers=H, json={"adapter": REF, "pin": True, "reload": True})
        assert r.json() == {"adapter": {"id": "ver-1"}, "load_ms": 1.235}
        await c.post("/internal/adapters/load", headers=H, json=REF)  # the AdapterRef fields at top level
        assert (await c.post("/internal/adapters/unload", headers=H, json={"id": "x", "force": True})).json() == {
            "unloaded": "x"}
        r = await c.post("/internal/adapters/unload", headers=H, json={"adapter": {"id": "busy"}})
        assert (r.status_code, r.json()["error"]["code"]) == (409, "adapter_busy")
        assert (await c.post("/internal/adapters/pin", headers=H, json={"adapter": REF})).json()["adapter"]["pinned"]
        await c.post("/internal/adapters/pin", headers=H, json={"id": "known"})
        await c.post("/internal/adapters/unpin", headers=H, json={"id": "known"})
        r = await c.post("/internal/adapters/probe", headers=H, json={"adapter": REF, "prompts": ["p", "q"],
                                                                       "max_tokens": 4})
        assert r.json() == {"results": [{"prompt": "p", "base": "base:p", "adapter": "tuned:p"},
                                        {"prompt": "q", "base": "base:q", "adapter": "tuned:q"}],
                            "adapter_load_ms": 2.0}
        r = await c.post("/internal/adapters/probe", headers=H, json={"adapter": REF, "prompts": []})
        assert r.status_code == 400
    assert [call for call in backend.calls if call[0] != "check"] == [
        ("load", "ver-1", True, True), ("load", "ver-1", False, False), ("unload", "x", True),
        ("unload", "busy", False), ("pin", "ver-1"), ("pin_known", "known"), ("unpin", "known"),
        ("probe", "ver-1", 4)]


class _State:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.engine = None
        self.model_name = ""


def _table(routes: list[Any]) -> list[tuple[str, frozenset[str]]]:
    return [(r.path, frozenset(r.methods)) for r in routes if r.path.startswith("/internal/")]


async def test_the_bundled_worker_and_the_agent_serve_one_table(tmp_path):
    settings = _settings(tmp_path)
    bundled = internal_routes(_State(settings))
    agent_app = create_agent_app(AgentConfig(vllm_url="http://vllm", url="http://agent", worker_id="v",
                                             base_model="m"), settings)
    assert _table(bundled) == _table(agent_app.routes) == _table(control_routes(Backend(), settings))
    async with _client(Starlette(routes=bundled)) as c:  # no engine yet: every route says so
        r = await c.get("/internal/adapters", headers=H)
        assert (r.status_code, r.json()["error"]["code"]) == (503, "loading")
    await agent_app.state.agent.close()


def _demo_ref(name: str) -> dict[str, Any]:
    return AdapterRef(id=f"ver-{name}", name=f"{name}@1", uri=str(DEMO / name),
                      sha256=digest_directory(DEMO / name)).to_dict()


async def test_the_agent_answers_the_control_routes_over_its_vllm(tmp_path):
    vllm = FakeVllm()
    settings = _settings(tmp_path)
    agent = VllmAgent(AgentConfig(vllm_url="http://vllm", url="http://agent", worker_id="v", base_model="m"),
                      settings)
    await agent.http.aclose()
    agent.http = vllm.client()
    french = _demo_ref("french")
    try:
        async with _client(Starlette(routes=control_routes(AgentControl(agent), settings))) as c:
            r = await c.get("/internal/tokenizer", headers=H)  # started without --model
            assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found")
            r = await c.post("/internal/adapters/load", headers=H, json={"adapter": french})
            assert r.status_code == 200 and r.json()["adapter"]["state"] == "device", r.text
            assert vllm.names == {"ver-french"}
            r = await c.post("/internal/adapters/pin", headers=H, json={"id": "ver-french"})
            assert r.json()["adapter"]["pinned"] is True
            r = await c.post("/internal/adapters/unload", headers=H, json={"id": "ver-french"})
            assert (r.status_code, r.json()["error"]["code"]) == (409, "adapter_busy")
            r = await c.post("/internal/adapters/unpin", headers=H, json={"id": "ver-french"})
            assert r.json()["adapter"]["pinned"] is False
            listed = (await c.get("/internal/adapters", headers=H)).json()
            assert [a["id"] for a in listed["adapters"]] == ["ver-french"]
            assert listed["resident"]["device"] == 1
            assert (await c.post("/internal/adapters/unload", headers=H, json={"id": "ver-french"})).json() == {
                "unloaded": "ver-french"}
            assert vllm.names == set()
            r = await c.post("/internal/adapters/unpin", headers=H, json={"id": "ver-french"})
            assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found")
    finally:
        await agent.close()

