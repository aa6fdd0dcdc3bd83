"""Reader-side registry cache: the snapshot every gateway request resolves against.

    cache = SnapshotCache(settings)
    await cache.start()                       # returns even when the database is down
    cache.ready                               # True once a complete snapshot is held
    snap = cache.current                      # RegistrySnapshot (NotLoaded before the first load)
    await cache.wait_for(version, timeout=2)  # True once current.version >= version
    await cache.refresh()                     # bring it up to date now (a delta when possible)
    await cache.stop()

Never ready on nothing: until the first complete load, ``current`` raises ``NotLoaded`` (the
gateway answers 503). A refresh that fails keeps the held snapshot; each failure is logged and
counted (``failures``), and ``stale()`` says when the held one is older than
``registry_max_staleness_s``. Loads are deltas from the audit log (``registry.snapshot_load``);
a full load happens at start and on a gap.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time

from sqlalchemy.ext.asyncio import AsyncEngine

from loraplex.settings import Settings
from registry.changes import RESYNC, ChangeBus, Subscription
from registry.db import is_postgres, make_engine, resolve_url
from registry.snapshot import RegistrySnapshot
from registry.snapshot_load import load_delta, load_full

log = logging.getLogger("loraplex.registry.cache")


class NotLoaded(RuntimeError):
    """No complete registry snapshot has been loaded yet."""


class SnapshotCache:
    """Keeps ``current`` fresh: announcements first, a periodic delta refresh as a safety net."""

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
        self.stall_s = max(0.1, float(settings.registry_stall_s))
        """A load fails only when the database sends nothing for this long (no overall limit)."""
        self.last_error: str | None = None
        """Why the last refresh failed (None after a successful one)."""
        self.last_refresh: float = 0.0
        """``time.monotonic()`` of the last successful refresh (the held snapshot is this fresh)."""
        self.failures = 0
        """Refreshes that failed since start (each one logged)."""
        self.loads = {"full": 0, "delta": 0}
        """Successful loads by kind (a delta with no change counts too)."""
        self.last_load_s = 0.0
        """Seconds the last successful load took."""
        self.freeze_gc = False
        """After each full load, move every tracked object out of the cyclic collector's view
        (``gc.freeze``). For a serving process: snapshot views hold no cycles (refcounting frees
        them when replaced), and otherwise every full collection walks every tenant (0.2-0.9 s
        at 100k tenants, a stall of every request). Off by default: it is process-wide."""

    @property
    def current(self) -> RegistrySnapshot:
        if self._current is None:
            raise NotLoaded("no complete registry snapshot has been loaded yet")
        return self._current

    @property
    def ready(self) -> bool:
        return self._current is not None

    @property
    def healthy(self) -> bool:
        return self.last_error is None

    @property
    def age_s(self) -> float:
        """Seconds since the held snapshot was last confirmed current (inf before the first load)."""
        return time.monotonic() - self.last_refresh if self._current is not None else float("inf")

    def readiness_problem(self) -> str | None:
        """Why this reader should not take traffic: no snapshot, or one past the staleness limit."""
        if self._current is None:
            return f"no registry snapshot yet{f' ({self.last_error})' if self.last_error else ''}"
        limit = float(self.settings.registry_max_staleness_s)
        if limit > 0 and self.age_s > limit:
            return (f"registry snapshot version {self._current.version} is {self.age_s:.0f} s old "
                    f"(limit {limit:g} s): {self.last_error or 'no refresh since'}")
        return None

    async def start(self) -> None:
        """Listen, then load. Returns without a snapshot when the database is down (not ready;
        the refresher keeps trying)."""
        if self._engine is None:
            self._engine = make_engine(self.database_url, **({"pool_size": 2, "max_overflow": 2}
                                                              if is_postgres(self.database_url) else {}))
        self._sub = self.bus.subscribe()
        await self._sub.start()
        try:  # listen before the first load, so no change between the two is missed
            async with asyncio.timeout(2.0):
                await self._sub.connected.wait()
        except TimeoutError:
            log.warning("registry change listener not connected yet; relying on periodic refresh until it is")
        with contextlib.suppress(Exception):  # logged by refresh(); not ready until a load succeeds
            await self.refresh()
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

    async def refresh(self, *, full: bool = False) -> RegistrySnapshot:
        """Bring the snapshot up to date now: a delta on the held one, or a full load (at start,
        on a gap, or with ``full``). Raises if the database fails; the held snapshot stays."""
        assert self._engine is not None, "start() first"
        async with self._refresh_lock:
            held = self._current
            began = time.monotonic()
            kind = "full"
            try:
                async with asyncio.timeout(self.stall_s):
                    conn = await self._engine.connect()
                try:
                    if is_postgres(self.database_url):
                        conn = await conn.execution_options(isolation_level="REPEATABLE READ")
                    async with conn.begin():
                        snap = None
                        if held is not None and not full:
                            kind = "delta"
                            snap = await load_delta(conn, held, self.stall_s)
                        if snap is None:
                            if held is not None and not full:
                                log.info("registry changes since version %d not all in the audit log; "
                                         "loading in full", held.version)
                            kind = "full"
                            snap = await load_full(conn, self.stall_s)
                finally:
                    await conn.close()
            except Exception as exc:
                self.failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                if held is None:
                    log.error("registry %s load failed (%s); not ready until a load succeeds", kind,
                              self.last_error)
                else:
                    log.error("registry %s refresh failed (%s); serving version %d, %.1f s old", kind,
                              self.last_error, held.version, self.age_s)
                raise
            if self.last_error is not None:
                log.info("registry reachable again at version %d", snap.version)
            self.last_error = None
            self.last_refresh = time.monotonic()
            self.last_load_s = self.last_refresh - began
            self.loads[kind] += 1
            if kind == "full":
                log.info("registry snapshot version %d loaded in full: %d tenants in %.2f s", snap.version,
                         len(snap.tenants), self.last_load_s)
            if held is None or snap.version >= held.version:
                self._current = snap
            if kind == "full" and self.freeze_gc:
                gc.freeze()
            async with self._changed:
                self._changed.notify_all()
            return self.current

    async def wait_for(self, version: int, timeout: float = 2.0) -> bool:  # noqa: ASYNC109 (public API)
        """True once ``current.version >= version`` (refreshing if needed), False on timeout."""
        if self._version() >= version:
            return True
        self._want(version)
        try:
            async with asyncio.timeout(timeout):
                async with self._changed:
                    await self._changed.wait_for(lambda: self._version() >= version)
            return True
        except TimeoutError:
            return self._version() >= version

    def _version(self) -> int:
        return self._current.version if self._current is not None else -1

    def _want(self, version: int) -> None:
        if version == RESYNC or version > self._version():
            self._wake.set()

    async def _listen(self) -> None:
        assert self._sub is not None
        while True:
            version = await self._sub.get()
            self._want(version)

    async def _refresher(self) -> None:
        """Refresh on demand (coalesced: one load for any number of announcements), on the
        periodic timer, and retry after failures."""
        period = max(0.05, float(self.settings.registry_refresh_s))
        retry = 0.5
        while True:
            failing = self.last_error is not None or self._current is None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(period, retry) if failing else period):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self.refresh()
                retry = 0.5
            except asyncio.CancelledError:
                raise
            except Exception:
                retry = min(retry * 2, 5.0)
