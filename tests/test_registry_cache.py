"""Reader-side snapshot cache and change fan-out: the snapshot mirrors the registry; a change
reaches a reader in the same process, and a reader in a SECOND PROCESS (PostgreSQL
LISTEN/NOTIFY; SQLite + Redis pub/sub) long before the periodic refresh; a reader keeps
serving its last snapshot when the database goes away."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import asyncpg
import pytest

from registry.cache import NotLoaded, SnapshotCache
from registry.migrate import upgrade_async
from registry.records import AdapterRecord
from registry.service import RegistryService
from tests.conftest import PG_ADMIN_URL
from tests.registry_support import TINY, fresh_registry, make_settings, write_adapter

READER = textwrap.dedent("""
    import asyncio, json, sys
    from loraplex.settings import Settings
    from registry.cache import SnapshotCache

    async def main():
        cache = SnapshotCache(Settings.from_env())
        await cache.start()
        seen = -1
        while True:
            snap = cache.current
            if snap.version != seen:
                seen = snap.version
                acme = snap.tenants.get("acme")
                b = acme.bindings.get("support") if acme else None
                print(json.dumps({"version": seen, "active": b.active.label if b and b.active else None,
                                  "canary": b.canary.label if b and b.canary else None,
                                  "tpm": acme.tokens_per_min if acme else None}), flush=True)
            await asyncio.sleep(0.005)

    asyncio.run(main())
""")


async def _seed(svc: RegistryService) -> list[AdapterRecord]:
    await svc.register_base_model(TINY)
    await svc.create_tenant("acme", tokens_per_min=1000, priority="high")
    root = Path(svc.settings.resolved_adapter_root())
    out = []
    for seed in (1, 2):
        write_adapter(root / f"v{seed}", TINY, seed=seed)
        a = await svc.register_adapter("support", f"v{seed}", "tiny", owner="acme")
        out.append(await svc.activate_adapter(a.id))
    await svc.bind("acme", "support", out[0].id, on_disabled="base")
    return out


async def test_snapshot_mirrors_registry_and_follows_changes(db_url, tmp_path):
    await fresh_registry(db_url)
    settings = make_settings(tmp_path, db_url, registry_refresh_s=300.0)
    svc = RegistryService(settings)
    cache = SnapshotCache(settings)
    await cache.start()
    try:
        assert cache.current.version == 0 and cache.current.tenants == {}
        v1, v2 = await _seed(svc)
        version = await svc.version()
        assert await cache.wait_for(version, timeout=5)
        snap = cache.current
        assert snap.version == version
        assert snap.base_models["tiny"].revision == TINY.revision
        acme = snap.tenants["acme"]
        assert (acme.tokens_per_min, acme.priority, acme.active) == (1000, "high", True)
        b = acme.bindings["support"]
        assert b.active.id == v1.id and b.active.label == "support@1" and b.active.sha256 == v1.sha256
        assert (b.active.rank, b.active.alpha, b.active.uri) == (4, 8.0, v1.uri)
        assert (b.canary, b.canary_percent, b.enabled, b.on_disabled, b.base_model) == (None, 0.0, True, "base", "tiny")

        await svc.canary_start("acme", "support", v2.id, 25)
        assert await cache.wait_for(await svc.version(), timeout=5)
        b = cache.current.tenants["acme"].bindings["support"]
        assert b.canary.id == v2.id and b.canary_percent == 25
        await svc.disable_tenant("acme")
        assert await cache.wait_for(await svc.version(), timeout=5)
        assert cache.current.tenants["acme"].active is False
        # snapshots are immutable values: the old one is unchanged
        assert snap.tenants["acme"].status == "active"
        assert await cache.wait_for(10**9, timeout=0.05) is False
    finally:
        await cache.stop()
        await svc.close()


def _reader(env: dict[str, str]) -> tuple[subprocess.Popen, queue.Queue]:
    proc = subprocess.Popen([sys.executable, "-c", READER], env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put((time.monotonic(), json.loads(line)))

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


def _wait_line(lines: queue.Queue, pred, timeout: float) -> tuple[float, dict]:
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError("the reader process did not see the change in time")
        try:
            at, item = lines.get(timeout=left)
        except queue.Empty:
            continue
        if pred(item):
            return at, item


async def _second_process_sees_changes(settings, env: dict[str, str]) -> list[float]:
    svc = RegistryService(settings)
    proc, lines = _reader(env)
    latencies: list[float] = []
    try:
        _, v2 = await _seed(svc)
        await asyncio.to_thread(_wait_line, lines, lambda i: i["active"] == "support@1", 15.0)  # reader is up
        for step in range(3):
            if step == 0:
                t0 = time.monotonic()
                await svc.canary_start("acme", "support", v2.id, 10)
                want = lambda i: i["canary"] == "support@2"  # noqa: E731
            elif step == 1:
                t0 = time.monotonic()
                await svc.canary_promote("acme", "support")
                want = lambda i: i["active"] == "support@2" and i["canary"] is None  # noqa: E731
            else:
                t0 = time.monotonic()
                await svc.set_tenant_limits("acme", tokens_per_min=42)
                want = lambda i: i["tpm"] == 42  # noqa: E731
            at, item = await asyncio.to_thread(_wait_line, lines, want, 2.0)
            assert item["version"] == await svc.version()
            latencies.append(at - t0)
    finally:
        proc.kill()
        proc.wait(timeout=10)
        await svc.close()
    return latencies


async def test_second_process_sees_change_postgres(pg_url, tmp_path):
    """LISTEN/NOTIFY: the reader's periodic refresh is 300 s, so only the notification explains it."""
    await fresh_registry(pg_url)
    settings = make_settings(tmp_path, pg_url)
    env = {"LORAPLEX_DATABASE_URL": pg_url, "LORAPLEX_REGISTRY_REFRESH_S": "300",
           "LORAPLEX_REDIS_PREFIX": settings.redis_prefix, "LORAPLEX_REDIS_URL": ""}
    latencies = await _second_process_sees_changes(settings, env)
    print(f"postgres NOTIFY fan-out latency to a second process: {[round(x * 1000) for x in latencies]} ms")


async def test_second_process_sees_change_sqlite_redis(tmp_path, redis_url, redis_prefix):
    url = f"sqlite+aiosqlite:///{tmp_path}/registry.db"
    await fresh_registry(url)
    settings = make_settings(tmp_path, url, redis_url=redis_url, redis_prefix=redis_prefix)
    env = {"LORAPLEX_DATABASE_URL": url, "LORAPLEX_REGISTRY_REFRESH_S": "300",
           "LORAPLEX_REDIS_URL": redis_url, "LORAPLEX_REDIS_PREFIX": redis_prefix}
    latencies = await _second_process_sees_changes(settings, env)
    print(f"redis pub/sub fan-out latency to a second process: {[round(x * 1000) for x in latencies]} ms")


async def test_reader_keeps_last_snapshot_when_database_goes_away(tmp_path):
    name = f"loraplex_t_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(PG_ADMIN_URL)
    await admin.execute(f'CREATE DATABASE "{name}"')
    url = PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://", 1) + "/" + name
    try:
        await upgrade_async(url)
        settings = make_settings(tmp_path, url, registry_refresh_s=0.2)
        svc = RegistryService(settings)
        await _seed(svc)
        version = await svc.version()
        await svc.close()
        cache = SnapshotCache(settings)
        await cache.start()
        try:
            assert cache.current.version == version and cache.healthy
            await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
            with pytest.raises(Exception):  # noqa: B017 (any driver error)
                await cache.refresh()
            await asyncio.sleep(0.5)  # periodic refreshes fail too
            assert not cache.healthy and cache.last_error
            snap = cache.current
            assert snap.version == version and snap.tenants["acme"].bindings["support"].active.label == "support@1"
        finally:
            await cache.stop()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def test_cache_start_with_database_down_is_not_ready(tmp_path):
    """Never an empty registry in place of the real one: no snapshot until a load succeeds."""
    settings = make_settings(tmp_path, "postgresql+asyncpg://postgres@127.0.0.1:1/nowhere")
    cache = SnapshotCache(settings)
    await cache.start()
    try:
        assert not cache.ready and not cache.healthy and cache.failures >= 1
        assert "no registry snapshot yet" in (cache.readiness_problem() or "")
        with pytest.raises(NotLoaded):
            _ = cache.current
    finally:
        await cache.stop()


async def test_listener_reconnects_after_its_connection_is_killed(pg_url, tmp_path):
    """The LISTEN connection is terminated server-side; the reader reconnects, resyncs, and
    still sees the next change long before its 300 s periodic refresh."""
    from registry.changes import LISTENER_APPLICATION_NAME

    await fresh_registry(pg_url)
    settings = make_settings(tmp_path, pg_url, registry_refresh_s=300.0)
    svc = RegistryService(settings)
    cache = SnapshotCache(settings)
    await cache.start()
    try:
        await _seed(svc)
        assert await cache.wait_for(await svc.version(), timeout=5)
        db = pg_url.rsplit("/", 1)[1]
        admin = await asyncpg.connect(PG_ADMIN_URL)
        try:
            killed = await admin.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = $1 AND application_name = $2", db, LISTENER_APPLICATION_NAME)
        finally:
            await admin.close()
        assert killed == 1
        await asyncio.sleep(0.3)
        await svc.set_tenant_limits("acme", tokens_per_min=7)
        target = await svc.version()
        deadline = time.monotonic() + 10
        while cache.current.version < target:  # no wait_for: it would trigger a refresh itself
            assert time.monotonic() < deadline, "the reader never saw the change after losing LISTEN"
            await asyncio.sleep(0.02)
        assert cache.current.tenants["acme"].tokens_per_min == 7
    finally:
        await cache.stop()
        await svc.close()
