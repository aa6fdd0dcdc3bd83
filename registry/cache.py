"""Reader-side registry cache: the snapshot every gateway request resolves against.

    cache = SnapshotCache(settings)
    await cache.start()                       # ``current`` is never None after this
    snap = cache.current                      # RegistrySnapshot
    await cache.wait_for(version, timeout=2)  # True once current.version >= version
    await cache.refresh()                     # force a reload now
    await cache.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from loraplex.settings import Settings
from registry.changes import RESYNC, ChangeBus, Subscription
from registry.db import is_postgres, make_engine, resolve_url
from registry.models import AdapterVersion, BaseModelRow, Binding, RegistryState, Tenant
from registry.snapshot import AdapterVersionView, BaseModelView, BindingView, RegistrySnapshot, TenantView

log = logging.getLogger("loraplex.registry.cache")

REFRESH_TIMEOUT_S = 15.0
"""A refresh that takes longer fails (and is retried): a stuck connection never freezes the cache."""


async def load_snapshot(conn: AsyncConnection) -> RegistrySnapshot:
    """Read the whole registry in one transaction (consistent at one version)."""
    version = int((await conn.execute(select(RegistryState.version).where(RegistryState.id == 1))).scalar_one())
    adapters: dict[str, AdapterVersionView] = {}
    for a in (await conn.execute(select(AdapterVersion))).mappings():
        adapters[a["id"]] = AdapterVersionView(
            id=a["id"], name=a["name"], version=a["version"], base_model=a["base_model"], uri=a["uri"],
            sha256=a["sha256"], rank=a["rank"], alpha=float(a["alpha"]), status=a["status"])
    bindings: dict[str, dict[str, BindingView]] = {}
    for b in (await conn.execute(select(Binding))).mappings():
        canary = adapters.get(b["canary_id"]) if b["canary_id"] else None
        bindings.setdefault(b["tenant"], {})[b["alias"]] = BindingView(
            alias=b["alias"], active=adapters.get(b["active_id"]), canary=canary,
            canary_percent=float(b["canary_percent"]) if canary else 0.0, enabled=bool(b["enabled"]),
            on_disabled=b["on_disabled"], base_model=b["base_model"])
    tenants = {
        t["slug"]: TenantView(slug=t["slug"], status=t["status"], requests_per_min=t["requests_per_min"],
                              tokens_per_min=t["tokens_per_min"], max_concurrent=t["max_concurrent"],
                              priority=t["priority"], bindings=bindings.get(t["slug"], {}))
        for t in (await conn.execute(select(Tenant))).mappings()
    }
    base_models = {
        m["name"]: BaseModelView(name=m["name"], revision=m["revision"], architecture=m["architecture"])
        for m in (await conn.execute(select(BaseModelRow))).mappings()
    }
    return RegistrySnapshot(version=version, tenants=tenants, base_models=base_models)


class SnapshotCache:
    """Keeps ``current`` fresh: announcements first, periodic full refresh as a safety net."""

    def __init__(self, settings: Settings, engine: AsyncEngine | None = None, *,
                 bus: ChangeBus | None = None, database_url: str | None = None) -> None:
        self.settings = settings
        self.database_url = resolve_url(settings, engine, database_url)
        self._own_engine = engine is None
        self._engine = engine
        self.bus = bus or ChangeBus(settings, self.database_url)
        self._current: RegistrySnapshot | None = None
        self._changed = asyncio.Condition()
        self._refresh_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._sub: Subscription | None = None
        self.last_error: str | None = None
        """Why the last refresh failed (None after a successful one)."""
        self.last_refresh: float = 0.0
        """``time.monotonic()`` of the last successful refresh."""

    @property
    def current(self) -> RegistrySnapshot:
        if self._current is None:
            raise RuntimeError("SnapshotCache.start() has not been awaited")
        return self._current

    @property
    def healthy(self) -> bool:
        return self.last_error is None

    async def start(self) -> None:
        if self._engine is None:
            self._engine = make_engine(self.database_url, **({"pool_size": 2, "max_overflow": 2}
                                                              if is_postgres(self.database_url) else {}))
        self._sub = self.bus.subscribe()
        await self._sub.start()
        try:  # listen before the first load, so no change between the two is missed
            await asyncio.wait_for(self._sub.connected.wait(), timeout=2.0)
        except TimeoutError:
            log.warning("registry change listener not connected yet; relying on periodic refresh until it is")
        try:
            await self.refresh()
        except Exception as exc:
            log.error("registry unavailable at start (%s); serving an empty registry until it answers", exc)
            self._current = RegistrySnapshot(version=0)
        self._tasks = [asyncio.create_task(self._listen(), name="registry-cache-listen"),
                       asyncio.create_task(self._refresher(), name="registry-cache-refresh")]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self._sub is not None:
            await self._sub.close()
            self._sub = None
        await self.bus.close()
        if self._own_engine and self._engine is not None:
            await self._engine.dispose()
            self._engine = None

    async def refresh(self) -> RegistrySnapshot:
        """Reload now. Raises if the database is unreachable (the old snapshot stays)."""
        assert self._engine is not None, "start() first"
        async with self._refresh_lock:
            try:
                async with asyncio.timeout(REFRESH_TIMEOUT_S), self._engine.connect() as conn:
                    if is_postgres(self.database_url):
                        conn = await conn.execution_options(isolation_level="REPEATABLE READ")
                    async with conn.begin():
                        snap = await load_snapshot(conn)
            except Exception as exc:
                if self.last_error is None:
                    log.error("registry refresh failed, serving version %s: %s",
                              self._current.version if self._current else None, exc)
                self.last_error = f"{type(exc).__name__}: {exc}"
                raise
            if self.last_error is not None:
                log.info("registry reachable again at version %d", snap.version)
            self.last_error = None
            self.last_refresh = time.monotonic()
            if self._current is None or snap.version >= self._current.version:
                self._current = snap
            async with self._changed:
                self._changed.notify_all()
            return self.current

    async def wait_for(self, version: int, timeout: float = 2.0) -> bool:  # noqa: ASYNC109 (public API)
        """True once ``current.version >= version`` (refreshing if needed), False on timeout."""
        if self.current.version >= version:
            return True
        self._want(version)
        try:
            async with asyncio.timeout(timeout):
                async with self._changed:
                    await self._changed.wait_for(lambda: self.current.version >= version)
            return True
        except TimeoutError:
            return self.current.version >= version

    def _want(self, version: int) -> None:
        if version == RESYNC or version > self.current.version:
            self._wake.set()

    async def _listen(self) -> None:
        assert self._sub is not None
        while True:
            version = await self._sub.get()
            self._want(version)

    async def _refresher(self) -> None:
        """Refresh on demand (coalesced), on the periodic timer, and retry after failures."""
        period = max(0.05, float(self.settings.registry_refresh_s))
        retry = 0.5
        while True:
            failing = self.last_error is not None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=min(period, retry) if failing else period)
            self._wake.clear()
            try:
                await self.refresh()
                retry = 0.5
            except asyncio.CancelledError:
                raise
            except Exception:
                retry = min(retry * 2, 5.0)
