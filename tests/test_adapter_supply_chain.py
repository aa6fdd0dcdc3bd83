"""The adapter supply chain against a real S3 API server (moto's standalone server on loopback):
adapter stores, register by store URI, worker fetch into the disk tier with the sha256 checked
(corrupt object, store down), the base-revision refusal at load, upload through the admin API
(size cap, refusals leave nothing behind) and retention (gc)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from engine.lora.manager import AdapterManager
from engine.lora.slots import SlotBank
from engine.lora.sources import SourcePolicy, SourceRegistry, StoreSource
from gateway.activation import GateResult
from loraplex.adapter_store import DirectoryStore, ObjectStore, StoreError, version_prefix
from loraplex.digest import digest_contents, digest_directory
from loraplex.peft_config import ADAPTER_FILES
from loraplex.tokens import mint_admin
from loraplex.wire import AdapterRef
from registry.admin_api import admin_app
from registry.service import RegistryService
from tests.e2e_cluster import Cluster
from tests.engine_fixtures import demo_model_file
from tests.registry_support import TINY, fresh_registry, make_settings, write_adapter

MOTO_START_S = 90.0
DEMO = Path(__file__).resolve().parent.parent / "demo" / "adapters"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 API server on a free loopback port; the session fails (never skips) if it cannot start."""
    exe = Path(sys.executable).parent / "moto_server"
    port = _free_port()
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + MOTO_START_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"moto_server exited with {proc.returncode}: "
                            f"{proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
            try:
                httpx.get(url + "/", timeout=2.0)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    pytest.fail(f"moto_server did not answer on {url} within {MOTO_START_S:.0f} s")
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def bucket(s3_endpoint, monkeypatch):
    """A fresh bucket; the standard AWS_* environment points the client at the local server."""
    for key, value in {"AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                       "AWS_ALLOW_HTTP": "true"}.items():
        monkeypatch.setenv(key, value)
    name = f"adapters-{uuid.uuid4().hex[:12]}"
    r = httpx.put(f"{s3_endpoint}/{name}", timeout=10.0)
    assert r.status_code == 200, r.text
    return f"s3://{name}/catalogue"


def _files(d: Path) -> dict[str, bytes]:
    return {n: (d / n).read_bytes() for n in ADAPTER_FILES}


async def _put_version(store, d: Path) -> tuple[str, str]:
    digest = digest_directory(d)
    prefix = version_prefix(digest)
    for name, data in _files(d).items():
        await store.put(prefix + name, data)
    return store.uri_for(prefix), digest


@pytest.mark.parametrize("kind", ["directory", "s3"])
async def test_store_put_read_list_delete(kind, tmp_path, request):
    if kind == "s3":
        store = ObjectStore(request.getfixturevalue("bucket"), timeout_s=10, retries=1)
    else:
        store = DirectoryStore(tmp_path / "store")

    async def chunks():
        for part in (b"ab", b"", b"cd"):
            yield part

    assert await store.put("sha256/x/a", b"hello") == 5
    assert await store.put("sha256/x/b", chunks()) == 4
    assert await store.read("sha256/x/b", 100) == b"abcd"
    assert store.read_sync("sha256/x/a", 100) == b"hello"
    assert [o.key for o in await store.list("sha256/")] == ["sha256/x/a", "sha256/x/b"]
    assert store.key_of(store.uri_for("sha256/x/")) == "sha256/x/"
    assert store.key_of(store.url + "../elsewhere/") is None
    with pytest.raises(StoreError, match="larger"):
        await store.read("sha256/x/a", 2)
    await store.delete(["sha256/x/a", "sha256/x/b", "sha256/x/never"])
    assert await store.list("sha256/") == []
    with pytest.raises(StoreError) as exc:
        await store.read("sha256/x/a", 100)
    assert exc.value.missing


def _manager(tmp_path: Path, store, cache: str = "cache") -> AdapterManager:
    bank = SlotBank.for_model(TINY, (8, 16), slots_per_class=2)
    sources = SourceRegistry([StoreSource(store)], policy=SourcePolicy([store.url]))
    return AdapterManager(TINY, bank, max_loras=4, max_cpu_loras=8, cache_dir=str(tmp_path / cache),
                          sources=sources, failure_ttl_s=0.0)


def _wait(m: AdapterManager, ref: AdapterRef, timeout: float = 60.0) -> str:
    m.prefetch(ref)
    deadline = time.monotonic() + timeout
    while (s := m.state(ref).state) == "loading":
        assert time.monotonic() < deadline, "load did not finish"
        time.sleep(0.02)
    return s


async def test_worker_fetches_from_s3_checks_sha256_and_survives_store_down(bucket, tmp_path):
    store = ObjectStore(bucket, timeout_s=10, retries=1)
    good_uri, good_sha = await _put_version(store, write_adapter(tmp_path / "good", TINY, seed=1))
    bad_uri, bad_sha = await _put_version(store, write_adapter(tmp_path / "bad", TINY, seed=2))
    good = AdapterRef(id="good-1", name="good@1", uri=good_uri, sha256=good_sha, base_revision=TINY.revision)
    bad = AdapterRef(id="bad-1", name="bad@1", uri=bad_uri, sha256=bad_sha)
    # Corrupt the stored weights after registration: only that adapter's loads fail.
    key = store.key_of(bad_uri) + ADAPTER_FILES[1]
    data = bytearray(await store.read(key, 1 << 20))
    data[-1] ^= 0x01
    await store.put(key, bytes(data))
    m = _manager(tmp_path, store)
    try:
        assert _wait(m, bad) == "failed"
        assert "sha256 mismatch" in (m.state(bad).error or "")
        assert _wait(m, good) == "host"
        assert m.acquire_slots([good]) and m.stats.loads["source"] == 1
        m.release([good])
        assert (tmp_path / "cache" / "good-1").is_dir() and not (tmp_path / "cache" / "bad-1").exists()
        # A worker on another base revision refuses the version, naming both revisions.
        other = AdapterRef(id="good-2", name="good@2", uri=good_uri, sha256=good_sha, base_revision="rev-zzzz")
        assert _wait(m, other) == "failed"
        assert "rev-zzzz" in m.state(other).error and repr(TINY.revision) in m.state(other).error
    finally:
        m.close()
    # The store goes down (nothing listens on its endpoint): a new worker process sharing the disk
    # tier still serves the cached adapter; an uncached one fails with a clear error, in bounded time.
    os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{_free_port()}"
    down = ObjectStore(bucket, timeout_s=2, retries=0)
    m2 = _manager(tmp_path, down)
    try:
        assert _wait(m2, good) == "host" and m2.stats.loads["disk"] == 1
        t0 = time.monotonic()
        fresh = AdapterRef(id="bad-2", name="bad@2", uri=bad_uri, sha256=bad_sha)
        assert _wait(m2, fresh) == "failed"
        assert "fetch of" in m2.state(fresh).error and time.monotonic() - t0 < 30
    finally:
        m2.close()


def test_a_stalled_store_fails_the_load_after_the_timeout(tmp_path, monkeypatch):
    """A store that accepts connections and never answers: each fetch gives up after the timeout
    and fails that adapter's load with the reason, and adapters already in the disk tier load
    meanwhile (downloads have loader threads of their own)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    for key, value in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{listener.getsockname()[1]}",
                       "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}.items():
        monkeypatch.setenv(key, value)
    store = ObjectStore("s3://stalled/p", timeout_s=5, retries=0)
    # one adapter is already in the worker's disk tier (fetched before the store stalled)
    files = _files(write_adapter(tmp_path / "cached", TINY, seed=9))
    digest = digest_contents(files)
    cached = AdapterRef(id="c-1", name="c@1", uri=store.uri_for(version_prefix(digest)), sha256=digest)
    entry = tmp_path / "cache" / "c-1"
    entry.mkdir(parents=True)
    for name, data in files.items():
        (entry / name).write_bytes(data)
    m = _manager(tmp_path, store)
    try:
        stalled = [AdapterRef(id=f"s-{i}", name=f"s@{i}", uri=store.uri_for(f"sha256/{i:064x}/"),
                              sha256=f"{i:064x}") for i in range(3)]
        t0 = time.monotonic()
        for ref in stalled:  # more than the loader threads
            m.prefetch(ref)
        # loads from the disk tier do not wait behind the stalled downloads
        assert _wait(m, cached, timeout=60) == "host"
        assert [m.state(r).state for r in stalled] == ["loading"] * 3
        for ref in stalled:
            assert _wait(m, ref, timeout=120) == "failed"
            assert "fetch of" in m.state(ref).error
        assert time.monotonic() - t0 < 100
    finally:
        m.close()
        stop.set()
        t.join(timeout=5)
        for conn in held:
            conn.close()
        listener.close()


@pytest.fixture(params=["postgresql+s3", "sqlite+directory"])
def registry_and_store(request, tmp_path):
    """PostgreSQL with the S3 store, and SQLite with the default local store."""
    if request.param == "postgresql+s3":
        return request.getfixturevalue("pg_url"), request.getfixturevalue("bucket")
    return request.getfixturevalue("sqlite_url"), ""


@pytest.fixture
async def admin(registry_and_store, tmp_path):
    url, store = registry_and_store
    await fresh_registry(url)
    settings = make_settings(tmp_path, url, adapter_store=store, max_adapter_bytes=64 * 1024)
    service = RegistryService(settings)
    await service.register_base_model(TINY)
    app = Starlette(routes=[Mount("/admin", app=admin_app(service, settings))])
    headers = {"authorization": f"Bearer {mint_admin(settings, subject='ops')}"}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t/admin",
                                     headers=headers, timeout=60.0) as client:
            yield client, service
    finally:
        await service.close()


def _body(d: Path) -> tuple[bytes, dict[str, str]]:
    f = _files(d)
    return f[ADAPTER_FILES[0]] + f[ADAPTER_FILES[1]], {"x-loraplex-config-bytes": str(len(f[ADAPTER_FILES[0]]))}


async def test_register_by_store_uri_and_upload(admin, tmp_path):
    client, service = admin
    store = service.adapter_store
    uri, sha = await _put_version(store, write_adapter(tmp_path / "a", TINY, seed=3))
    r = await client.post("/adapters", json={"name": "support", "uri": uri, "base_model": TINY.name})
    assert r.status_code == 201, r.text
    assert r.json()["uri"] == uri and r.json()["sha256"] == sha and r.json()["status"] == "pending"
    # outside the store, and a store URI with nothing there: refused with the reason
    r = await client.post("/adapters", json={"name": "x", "uri": "s3://elsewhere/v/", "base_model": TINY.name})
    assert r.status_code == 422 and r.json()["error"]["code"] == "unsupported_uri"
    r = await client.post("/adapters", json={"name": "x", "uri": store.uri_for("sha256/" + "0" * 64 + "/"),
                                             "base_model": TINY.name})
    assert r.status_code == 422 and r.json()["error"]["code"] == "missing_file"

    before = {o.key for o in await store.list("")}
    body, headers = _body(write_adapter(tmp_path / "b", TINY, seed=4))
    r = await client.post("/adapters/upload", params={"name": "upl", "base_model": TINY.name}, content=body,
                          headers=headers)
    assert r.status_code == 201, r.text
    up = r.json()
    assert up["label"] == "upl@1" and up["uri"] == store.uri_for(version_prefix(up["sha256"]))
    assert {o.key for o in await store.list("")} - before == {version_prefix(up["sha256"]) + n
                                                              for n in ADAPTER_FILES}
    audit = await service.audit(target=f"adapter:{up['id']}")
    assert [e.action for e in audit] == ["adapter.register"]

    # Refusals leave the store and the registry as they were.
    state = ({o.key for o in await store.list("")}, await service.version())
    bad_body, bad_headers = _body(write_adapter(tmp_path / "c", TINY, seed=5, config={"r": 8}))
    r = await client.post("/adapters/upload", params={"name": "bad", "base_model": TINY.name}, content=bad_body,
                          headers=bad_headers)
    assert r.status_code == 422 and r.json()["error"]["code"] == "rank_mismatch", r.text

    async def big():
        for _ in range(20):
            yield b"\0" * 8192

    r = await client.post("/adapters/upload", params={"name": "big", "base_model": TINY.name}, content=big(),
                          headers={"x-loraplex-config-bytes": "10"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "upload_too_large", r.text
    # same bytes, a version number that exists: the shared files stay (upl@1 records them)
    r = await client.post("/adapters/upload", params={"name": "upl", "base_model": TINY.name, "version": "1"},
                          content=body, headers=headers)
    assert r.status_code == 409, r.text
    # new bytes refused by the registry: their files are removed again
    body2, headers2 = _body(write_adapter(tmp_path / "d", TINY, seed=6))
    r = await client.post("/adapters/upload", params={"name": "upl", "base_model": TINY.name, "version": "1"},
                          content=body2, headers=headers2)
    assert r.status_code == 409, r.text
    r = await client.post("/adapters/upload", params={"name": "x", "base_model": "nope"}, content=body2,
                          headers=headers2)
    assert r.status_code == 404
    assert ({o.key for o in await store.list("")}, await service.version()) == state


async def test_gc_spares_versions_in_use(admin, tmp_path):
    client, service = admin
    await service.create_tenant("acme")
    ids = []
    for i in range(3):
        body, headers = _body(write_adapter(tmp_path / f"v{i}", TINY, seed=10 + i))
        r = await client.post("/adapters/upload", params={"name": "bot", "base_model": TINY.name}, content=body,
                              headers=headers)
        assert r.status_code == 201, r.text
        ids.append(r.json()["id"])
        await service.activate_adapter(ids[-1])
    await service.bind("acme", "support", ids[1])
    await service.bind("acme", "support", ids[2])  # v1 becomes previous: still in use
    r = await client.post("/gc", json={"retention_s": 0})
    plan = r.json()
    assert r.status_code == 200 and [v["id"] for v in plan["versions"]] == [ids[0]] and plan["deleted"] == []
    assert len(await service.adapter_store.list("sha256/")) == 6  # a dry run deletes nothing
    r = await client.post("/gc", json={"retention_s": 3600})
    assert r.json()["versions"] == []  # within the retention period
    r = await client.post("/gc", json={"retention_s": 0, "apply": True})
    assert [d["id"] for d in r.json()["deleted"]] == [ids[0]]
    left = {o.key for o in await service.adapter_store.list("sha256/")}
    gone = await service.get_adapter(ids[0])
    assert len(left) == 4 and not any(k.startswith(version_prefix(gone.sha256)) for k in left)
    assert gone.status == "disabled" and "garbage-collected" in gone.status_reason
    assert next(e.action for e in await service.audit(target=f"adapter:{ids[0]}")) == "adapter.gc"
    r = await client.put("/tenants/acme/bindings/support", json={"adapter": ids[0]})
    assert r.status_code == 422  # a collected version can no longer be bound


class Gate:
    """The activation gate's seam: passes every version but the (name, base revision) pairs in
    ``refuse``, recording calls."""

    def __init__(self, refuse: set[tuple[str, str]]) -> None:
        self.refuse = refuse
        self.calls: list[tuple[dict, dict]] = []

    async def __call__(self, adapter: dict, request: dict) -> GateResult:
        self.calls.append((adapter, request))
        if (adapter["name"], adapter["base_revision"]) in self.refuse:
            return GateResult(False, "eval score 0.00 is below the threshold 1.00", {"passed": False})
        return GateResult(True, None, {"passed": True, "eval": {"score": 1.0, "set": request.get("eval")}})


async def test_base_model_upgrade_moves_only_passing_versions(pg_url, tmp_path, bucket):
    await fresh_registry(pg_url)
    settings = make_settings(tmp_path, pg_url, adapter_store=bucket)
    service = RegistryService(settings)
    gate = Gate(refuse={("weak", "rev-cccc")})
    new_base = dataclasses.replace(TINY, name="tiny-v2", revision="rev-cccc")
    evalset = {"cases": [{"prompt": "hi", "expect": "hello"}], "threshold": 1.0}
    app = Starlette(routes=[Mount("/admin", app=admin_app(service, settings, gate=gate))])
    headers = {"authorization": f"Bearer {mint_admin(settings, subject='ops')}"}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t/admin",
                                     headers=headers, timeout=60.0) as client:
            await service.register_base_model(TINY)
            await service.create_tenant("acme")
            ids = {}
            for i, name in enumerate(("strong", "weak")):
                uri, _ = await _put_version(service.adapter_store, write_adapter(tmp_path / name, TINY, seed=20 + i))
                ids[name] = (await service.register_adapter(name, uri, TINY.name)).id
                r = await client.post(f"/adapters/{ids[name]}/activate", json={"eval": evalset})
                assert r.status_code == 200, r.text
                await service.bind("acme", name, ids[name])
            gate.calls.clear()
            # NEW must be registered first
            r = await client.post(f"/base-models/{TINY.name}/upgrade", json={"to": "tiny-v2"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "base_model_not_found"
            await service.register_base_model(new_base)
            version = await service.version()
            r = await client.post(f"/base-models/{TINY.name}/upgrade", json={"to": "tiny-v2", "dry_run": True})
            assert r.status_code == 200, r.text
            plan = r.json()
            assert [(v["from"]["label"], v["passed"], v["bindings"]) for v in plan["versions"]] == [
                ("strong@1", None, ["acme/strong"]), ("weak@1", None, ["acme/weak"])]
            assert await service.version() == version and gate.calls == []  # a dry run changes nothing

            r = await client.post(f"/base-models/{TINY.name}/upgrade", json={"to": "tiny-v2"})
            assert r.status_code == 200, r.text
            done = r.json()
            by_from = {v["from"]["label"]: v for v in done["versions"]}
            assert by_from["strong@1"]["passed"] and by_from["strong@1"]["to"]["label"] == "strong@2"
            assert not by_from["weak@1"]["passed"] and "eval score" in by_from["weak@1"]["reason"]
            # each version was gated on NEW's revision with the eval set it was activated with
            assert {a["base_revision"] for a, _ in gate.calls} == {"rev-cccc"}
            assert all(req == {"eval": evalset} for _, req in gate.calls)
            strong = await service.get_binding("acme", "strong")
            assert strong.base_model == "tiny-v2" and strong.active.label == "strong@2"
            assert strong.previous.label == "strong@1"
            weak = await service.get_binding("acme", "weak")
            assert weak.base_model == TINY.name and weak.active.label == "weak@1"
            assert (await service.get_adapter("weak@2")).status == "failed"
            upgrade_audit = await service.audit(action="base_model.upgrade")
            assert len(upgrade_audit) == 1
            assert [e.target for e in await service.audit(action="binding.upgrade")] == ["binding:acme/strong"]
    finally:
        await service.close()


@pytest.mark.e2e
@pytest.mark.slow
def test_upload_register_bind_serve_through_a_fresh_worker(pg_url, redis_url, bucket, tmp_path):
    """Real processes: ``loraplex admin adapter upload`` into S3, the activation gate and then traffic
    on a worker that has never seen the adapter (it fetches it from the store into its disk tier);
    a corrupted object fails only its own version's load, with the reason."""
    home = tmp_path / "e2e"
    home.mkdir()
    c = Cluster(home=home, database_url=pg_url, redis_url=redis_url,
                redis_prefix=f"loraplex-sc-{uuid.uuid4().hex[:8]}", model=str(demo_model_file()),
                extra_env={"LORAPLEX_ADAPTER_STORE": bucket, "LORAPLEX_GATEWAY_SHUTDOWN_GRACE_S": "3"})
    asyncio.run(fresh_registry(pg_url))  # the module's database: empty it of the other tests' rows
    try:
        c.migrate()
        c.add_worker("w1")
        c.add_gateway("g1")
        c.wait_ready()
        base = c.admin("POST", "/base-models", {"path": c.model})["name"]
        c.admin("POST", "/tenants", {"slug": "acme"})
        up = c.cli("adapter", "upload", str(DEMO / "french"), "acme-french", "--base-model", base,
                   "--owner", "acme", "--progress")
        assert up.returncode == 0, up.stderr + up.stdout
        assert "upload [" in up.stderr and "uploaded acme-french@1" in up.stdout
        ad = c.admin("GET", "/adapters/acme-french@1")
        assert ad["uri"].startswith(bucket + "/sha256/") and ad["status"] == "pending"
        assert not list((home / "adapter-cache").glob("*/adapter_model.safetensors"))
        ad = c.admin("POST", f"/adapters/{ad['id']}/activate", {})
        assert ad["status"] == "active", ad
        c.admin("PUT", "/tenants/acme/bindings/assistant", {"adapter": "acme-french@1"})
        c.wait_current()
        r = httpx.post(c.gateways[0].url + "/v1/chat/completions", timeout=120.0,
                       headers={"Authorization": f"Bearer {c.token('acme')}"},
                       json={"model": "assistant", "max_tokens": 8, "temperature": 0,
                             "messages": [{"role": "user", "content": "What is the capital of Italy?"}]})
        assert r.status_code == 200, r.text
        assert r.headers["x-loraplex-adapter"] == "acme-french@1" and r.json()["choices"][0]["message"]["content"]
        assert (home / "adapter-cache" / ad["id"] / "adapter_model.safetensors").is_file()
        # a corrupt object (changed after registration) fails that version's load with the reason;
        # the other adapter keeps serving
        up = c.cli("adapter", "upload", str(DEMO / "json"), "acme-json", "--base-model", base, "--owner", "acme")
        assert up.returncode == 0, up.stderr
        bad = c.admin("GET", "/adapters/acme-json@1")
        store = ObjectStore(bucket, timeout_s=10, retries=1)
        key = store.key_of(bad["uri"]) + ADAPTER_FILES[1]
        data = bytearray(asyncio.run(store.read(key, 1 << 30)))
        data[len(data) // 2] ^= 0x01
        asyncio.run(store.put(key, bytes(data)))
        r = httpx.post(f"{c.gateways[0].url}/admin/adapters/{bad['id']}/activate", json={}, timeout=120.0,
                       headers={"Authorization": f"Bearer {mint_admin(c.settings)}"})
        assert r.status_code == 422 and r.json()["error"]["code"] == "adapter_verification_failed", r.text
        assert "sha256 mismatch" in r.json()["error"]["message"]
        r = httpx.post(c.gateways[0].url + "/v1/chat/completions", timeout=120.0,
                       headers={"Authorization": f"Bearer {c.token('acme')}"},
                       json={"model": "assistant", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200 and r.headers["x-loraplex-adapter"] == "acme-french@1", r.text
        plan = c.cli("gc")  # the bound version is in use: nothing to collect
        assert plan.returncode == 0 and "would delete 0 version(s)" in plan.stdout, plan.stderr + plan.stdout
        # a refused upload (unknown base model) leaves nothing behind
        bad = c.cli("adapter", "upload", str(DEMO / "json"), "x", "--base-model", "nope")
        assert bad.returncode == 1 and "nope" in bad.stderr
    except BaseException:
        for p in c.workers + c.gateways:
            print(f"--- {p.name} ---\n{p.tail()}")
        raise
    finally:
        c.stop(grace_s=15.0)


class RacingStore(DirectoryStore):
    """A concurrent refused upload of the same bytes removes the shared files right after this
    upload stored them (the interleaving a refused upload's clean-up can produce)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.raced = False

    async def put(self, key, data):
        size = await super().put(key, data)
        if key.endswith(ADAPTER_FILES[1]) and key.startswith("sha256/") and not self.raced:
            self.raced = True
            await self.delete([key.rsplit("/", 1)[0] + "/" + n for n in ADAPTER_FILES])
        return size


async def test_upload_restores_files_removed_by_a_concurrent_cleanup(sqlite_url, tmp_path):
    from registry.supply import SupplyChain

    await fresh_registry(sqlite_url)
    settings = make_settings(tmp_path, sqlite_url)
    service = RegistryService(settings)
    store = RacingStore(tmp_path / "store")
    try:
        await service.register_base_model(TINY)
        body, headers = _body(write_adapter(tmp_path / "a", TINY, seed=30))

        async def chunks():
            yield body

        out = await SupplyChain(service, store).upload("race", TINY.name, chunks(),
                                                       config_bytes=int(headers["x-loraplex-config-bytes"]))
        assert store.raced
        key = store.key_of(out.uri)
        assert sorted(o.key for o in await store.list(key)) == sorted(key + n for n in ADAPTER_FILES)
    finally:
        await service.close()
