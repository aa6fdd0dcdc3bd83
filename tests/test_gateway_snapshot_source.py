"""The gateway reaches its registry snapshot through ``gateway.snapshot_source.SnapshotSource`` only:
the app starts and stops the source in its lifespan, ``/readyz`` asks it, and only the live
registry's cache (built by the app) reports loads on ``/metrics``; a static file source has the
interface's no-op hooks."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from gateway.app import create_app
from gateway.ratelimit import LocalLimiter
from gateway.snapshot_file import FileSnapshotSource
from gateway.snapshot_source import SnapshotSource
from loraplex.residency import MemoryResidency
from loraplex.settings import Settings
from registry.snapshot import RegistrySnapshot
from tests.stub_worker import make_snapshot

TENANTS = {"acme": {"bindings": {"support": {"active": ("sup", 1)}}}}


class Recording(SnapshotSource):
    """A source that says what the app asked of it."""

    def __init__(self, snapshot: RegistrySnapshot) -> None:
        self.snapshot = snapshot
        self.calls: list[str] = []
        self.problem: str | None = None

    @property
    def current(self) -> RegistrySnapshot:
        return self.snapshot

    async def start(self) -> None:
        self.calls.append("start")

    async def stop(self) -> None:
        self.calls.append("stop")

    def readiness_problem(self) -> str | None:
        return self.problem


def _app(settings: Settings, snapshots: SnapshotSource | None = None):  # type: ignore[no-untyped-def]
    return create_app(settings, snapshots=snapshots, limiter=LocalLimiter(), residency=MemoryResidency(),
                      mount_admin=False)


async def test_the_app_starts_stops_and_asks_the_source():
    source = Recording(make_snapshot(TENANTS, version=4))
    app = _app(Settings(worker_urls=("http://worker",)), source)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        assert source.calls == ["start"]
        r = await c.get("/readyz")
        assert r.status_code == 200 and r.json()["registry_version"] == 4, r.text
        source.problem = "registry snapshot version 4 is 90 s old (limit 60 s): ConnectionRefusedError: 10.0.3.7:5432"
        r = await c.get("/readyz")
        assert r.status_code == 503 and r.json()["problems"] == [
            "the registry snapshot is not loaded or not current"], r.text
        source.problem = "no registry snapshot yet"
        assert (await c.get("/readyz")).json()["problems"] == ["no registry snapshot yet"]
    assert source.calls == ["start", "stop"]
    assert b"loraplex_registry_snapshot" not in app.gateway.metrics.render()


async def test_a_snapshot_file_is_a_source_with_nothing_to_start_or_report(tmp_path: Path):
    path = tmp_path / "snapshot.json"
    path.write_text(json.dumps({"version": 9, "base_models": {"smol": {"revision": "r1"}}, "tenants": {}}))
    app = _app(Settings(worker_urls=("http://worker",), registry_snapshot_file=str(path)))
    source = app.gateway.snapshots
    assert isinstance(source, FileSnapshotSource)
    source.freeze_gc = True  # as ``loraplex gateway`` sets it: nothing to freeze
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        assert source.readiness_problem() is None
        r = await c.get("/readyz")
        assert r.status_code == 200 and r.json()["registry_version"] == 9, r.text
    assert b"loraplex_registry_snapshot" not in app.gateway.metrics.render()
