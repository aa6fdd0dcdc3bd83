"""The worker's door: without the gateway's worker secret no route but /health and /metrics does
anything (401/403 before the body is read, nothing reaches the engine or an adapter); the
gateway sends the secret on both of its transports and never passes a worker's refusal on."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from safetensors.torch import save_file

from engine.api import create_worker_app
from engine.engine import Engine
from gateway.app import create_app
from gateway.ratelimit import LocalLimiter
from loraplex.digest import digest_directory
from loraplex.modelinfo import describe_model
from loraplex.residency import MemoryResidency
from loraplex.settings import Settings
from loraplex.tokens import mint
from loraplex.wire import HDR_WORKER_SECRET
from tests.engine_fixtures import make_tiny_model
from tests.stub_worker import (
    MutableSnapshots,
    StubProcess,
    ThreadServer,
    make_snapshot,
    mock_worker_transport,
)
from tests.worker_double import worker_client

SECRET = "worker-auth-test-secret-0123456789"
FOREIGN = {"adapter": {"id": "globex-json-v3", "name": "json@3", "uri": "file:///etc", "sha256": None, "rank": 8},
           "tenant": "globex", "priority": 0}
"""Another tenant's adapter, a URI outside the adapter root, a caller-chosen tenant and priority."""

GUARDED = [
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                      "loraplex": FOREIGN}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4,
                                 "loraplex": FOREIGN | {"adapter": FOREIGN["adapter"] | {"uri": "http://127.0.0.1:6379/"}}}),
    ("GET", "/v1/models", None),
    ("GET", "/internal/adapters", None),
    ("POST", "/internal/adapters/load", {"adapter": FOREIGN["adapter"], "pin": True}),
    ("POST", "/internal/adapters/pin", {"adapter": FOREIGN["adapter"]}),
    ("POST", "/internal/adapters/probe", {"adapter": FOREIGN["adapter"], "prompts": ["hi"]}),
]


def _peft(path, model_dir):
    """A small PEFT LoRA (rank 8 on q_proj) for the tiny model."""
    info = describe_model(model_dir)
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    fin, fout = info.projection_shape("q_proj")
    g = torch.Generator().manual_seed(3)
    save_file({t: w for layer in range(info.num_layers)
               for t, w in ((f"base_model.model.model.layers.{layer}.self_attn.q_proj.lora_A.weight",
                             torch.randn(8, fin, generator=g)),
                            (f"base_model.model.model.layers.{layer}.self_attn.q_proj.lora_B.weight",
                             torch.randn(fout, 8, generator=g)))}, path / "adapter_model.safetensors")
    return path


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    root = tmp_path_factory.mktemp("worker_auth")
    model = make_tiny_model(root / "base", "llama")
    settings = Settings(home=str(root / "home"), model=str(model), worker_id="w-auth", device="cpu",
                        dtype="float32", kv_cache_bytes=1 << 20, max_num_seqs=4, max_loras=2, max_cpu_loras=4,
                        lora_rank_classes=(8,), worker_secret=SECRET)
    adapter = _peft(root / "home" / "adapters" / "acme-private", model)
    engine = Engine.from_settings(settings)
    engine.start()
    yield settings, engine, adapter
    engine.close()


@pytest.fixture
def touched(worker, monkeypatch):
    """Every call that would start a sequence or an adapter load, recorded instead of run."""
    _, engine, _ = worker
    calls: list[str] = []
    manager = engine.lora_runtime.manager
    for obj, name in ((engine, "add_request"), (manager, "prefetch"), (manager, "pin")):
        real = getattr(obj, name)

        def spy(*a, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(*a, **kw)

        monkeypatch.setattr(obj, name, spy)
    return calls


@pytest.fixture
async def client(worker):
    settings, engine, _ = worker
    app = create_worker_app(settings, engine=engine, report=False, warm_start=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w", timeout=60) as c:
        yield c


def _openai_error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code", "param"}
    assert err["code"] == code


@pytest.mark.parametrize(("method", "path", "body"), GUARDED, ids=[f"{m} {p}" for m, p, _ in GUARDED])
async def test_without_the_secret_nothing_happens(client, touched, method, path, body):
    _openai_error(await client.request(method, path, json=body), 401, "unauthorized")
    _openai_error(await client.request(method, path, json=body, headers={HDR_WORKER_SECRET: "guess"}), 403,
                  "forbidden")
    _openai_error(await client.request(method, path, json=body, headers={HDR_WORKER_SECRET: SECRET[:-1]}), 403,
                  "forbidden")
    assert touched == []


async def test_refused_before_the_body_is_read(worker):
    settings, engine, _ = worker
    app = create_worker_app(settings, engine=engine, report=False, warm_start=False)
    received, sent = [], []

    async def receive():
        received.append(1)
        if len(received) > 1:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": b'{"prompt": "hi"}', "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), (b"content-length", b"16")],
             "client": ("10.0.0.9", 1234), "server": ("w", 80), "state": {}}
    await app(scope, receive, send)
    assert sent[0]["status"] == 401
    assert received == []


async def test_with_the_secret_the_routes_work(client, touched):
    h = {HDR_WORKER_SECRET: SECRET}
    r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0}, headers=h)
    assert r.status_code == 200, r.text
    assert touched == ["add_request"]
    models = await client.get("/v1/models", headers=h)
    assert models.status_code == 200 and models.json()["data"][0]["object"] == "model"
    assert (await client.get("/internal/adapters", headers=h)).status_code == 200


async def test_health_and_metrics_are_open_and_name_no_tenant_or_adapter(client, worker):
    ref = {"id": "acme-private-v9", "name": "acme-private@9", "uri": worker[2].as_uri(),
           "sha256": digest_directory(worker[2])}
    r = await client.post("/v1/chat/completions", headers={HDR_WORKER_SECRET: SECRET},
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                "loraplex": {"adapter": ref, "tenant": "acme-secret-tenant"}})
    assert r.status_code == 200, r.text
    listed = (await client.get("/internal/adapters", headers={HDR_WORKER_SECRET: SECRET})).json()["adapters"]
    assert ref["id"] in {a["id"] for a in listed}
    for path in ("/health", "/metrics"):
        open_ = await client.get(path)
        assert open_.status_code == 200, path
        assert "acme" not in open_.text, path


def test_a_worker_with_an_empty_secret_refuses_everyone():
    from engine.worker_auth import SecretRefused, check_worker_secret

    with pytest.raises(SecretRefused) as exc:
        check_worker_secret(b"anything", "")
    assert exc.value.status == 403
    check_worker_secret(SECRET.encode(), SECRET)  # no exception


# --- the gateway side ---------------------------------------------------------------------------------

TENANTS = {"acme": {"bindings": {"support": {"active": ("sup", 1)}}}}


def _gateway(settings: Settings, **kw):
    return create_app(settings, snapshots=MutableSnapshots(make_snapshot(TENANTS)), limiter=LocalLimiter(),
                      residency=MemoryResidency(), mount_admin=False, **kw)


def _chat(**kw):
    return {"model": "support", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


@pytest.mark.parametrize("stream", [False, True])
def test_gateway_sends_the_secret_over_its_fast_transport(stream):
    with StubProcess("w-sec", extra=("--worker-secret", SECRET)) as stub:
        right = Settings(worker_urls=(stub.url,), worker_secret=SECRET)
        wrong = Settings(worker_urls=(stub.url,), worker_secret="not-the-workers")
        for settings, expect in ((right, 200), (wrong, 503)):
            h = {"authorization": f"Bearer {mint(settings, 'u', tenant='acme')}"}
            with ThreadServer(_gateway(settings)) as gw, httpx.Client(base_url=gw.url, timeout=10) as c:
                r = c.post("/v1/chat/completions", json=_chat(stream=stream), headers=h)
            assert r.status_code == expect, r.text
            if expect == 503:  # the worker's refusal is the operator's problem, never shown as a client 401
                assert r.json()["error"]["code"] == "no_worker"
                assert HDR_WORKER_SECRET not in r.text
        stats = stub.stats()
        assert stats["completed"] == 1 and stats["refused"] >= 1


async def test_gateway_sends_the_secret_through_httpx():
    sent: list[dict] = []
    settings = Settings(worker_urls=("http://w1",), worker_secret=SECRET)
    app = _gateway(settings, http_client=worker_client(mock_worker_transport(sent, secret=SECRET), secret=SECRET))
    h = {"authorization": f"Bearer {mint(settings, 'u', tenant='acme')}"}
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        r = await c.post("/v1/chat/completions", json=_chat(), headers=h)
    assert r.status_code == 200, r.text
    assert len(sent) == 1


def test_gateway_refuses_a_secret_that_would_split_headers():
    with pytest.raises(ValueError, match="line breaks"):
        _gateway(Settings(worker_urls=("http://w1",), worker_secret="s\r\nx-evil: 1"))
