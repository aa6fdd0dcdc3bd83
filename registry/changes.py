"""Change fan-out: every committed registry change is announced with its new version.

PostgreSQL ``LISTEN``/``NOTIFY``, Redis pub/sub (SQLite shared by several processes) and an
in-process hub; readers treat announcements as hints (docs/DESIGN.md, "Change fan-out").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any

from sqlalchemy.engine import make_url

from loraplex.settings import Settings
from registry.db import is_postgres

log = logging.getLogger("loraplex.registry.changes")

LISTENER_APPLICATION_NAME = "loraplex-registry-listen"
"""``application_name`` of the reader's LISTEN connection (visible in ``pg_stat_activity``)."""

RESYNC = -1
"""Delivered after a listener (re)connects: the reader should refresh unconditionally."""


class _Hub:
    """In-process subscribers keyed by database URL; safe across event loops and threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subs: dict[str, set[Subscription]] = {}

    def add(self, key: str, sub: Subscription) -> None:
        with self._lock:
            self._subs.setdefault(key, set()).add(sub)

    def remove(self, key: str, sub: Subscription) -> None:
        with self._lock:
            self._subs.get(key, set()).discard(sub)

    def publish(self, key: str, version: int) -> None:
        with self._lock:
            subs = list(self._subs.get(key, ()))
        for sub in subs:
            sub.deliver_threadsafe(version)


HUB = _Hub()


def _hub_key(database_url: str) -> str:
    return make_url(database_url).render_as_string(hide_password=True)


def asyncpg_dsn(database_url: str) -> str:
    return make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)


class ChangeBus:
    """Announces committed versions and hands out subscriptions, per configuration."""

    def __init__(self, settings: Settings, database_url: str | None = None) -> None:
        self.settings = settings
        self.database_url = database_url or settings.resolved_database_url()
        self.channel = f"{settings.redis_prefix}:registry"
        self.postgres = is_postgres(self.database_url)
        self.use_redis = bool(settings.redis_url) and not self.postgres
        self._redis: Any = None

    async def announce_committed(self, version: int) -> None:
        """After commit: the in-process hub and (SQLite + Redis) Redis pub/sub."""
        HUB.publish(_hub_key(self.database_url), version)
        if self.use_redis:
            try:
                if self._redis is None:
                    import redis.asyncio as aioredis

                    self._redis = aioredis.from_url(self.settings.redis_url, socket_timeout=2.0)
                await self._redis.publish(self.channel, str(version))
            except Exception as exc:  # readers still catch up by their periodic refresh
                log.warning("registry change %d not announced on Redis: %s", version, exc)

    def subscribe(self) -> Subscription:
        return Subscription(self)

    async def close(self) -> None:
        if self._redis is not None:
            with contextlib.suppress(Exception):
                await self._redis.aclose()
            self._redis = None


class Subscription:
    """Announced versions (or ``RESYNC``) as an async queue. ``await start()`` before use."""

    def __init__(self, bus: ChangeBus) -> None:
        self.bus = bus
        self.queue: asyncio.Queue[int] = asyncio.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._key = _hub_key(bus.database_url)
        self.connected = asyncio.Event()
        """Set once the remote listener (LISTEN / Redis) is subscribed (at once when there is none)."""

    def deliver_threadsafe(self, version: int) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self.queue.put_nowait, version)
        except RuntimeError:  # loop closed between the check and the call
            pass

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        HUB.add(self._key, self)
        if self.bus.postgres:
            self._tasks.append(asyncio.create_task(self._listen_postgres(), name="registry-listen-pg"))
        elif self.bus.use_redis:
            self._tasks.append(asyncio.create_task(self._listen_redis(), name="registry-listen-redis"))
        else:
            self.connected.set()

    async def get(self) -> int:
        return await self.queue.get()

    async def close(self) -> None:
        HUB.remove(self._key, self)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()

    async def _listen_postgres(self) -> None:
        import asyncpg

        dsn = asyncpg_dsn(self.bus.database_url)
        delay = 0.2
        while True:
            conn = None
            try:
                conn = await asyncpg.connect(dsn, timeout=5,
                                             server_settings={"application_name": LISTENER_APPLICATION_NAME})
                lost = asyncio.Event()
                conn.add_termination_listener(lambda _c, ev=lost: ev.set())

                def on_notify(_c: Any, _pid: int, _channel: str, payload: str) -> None:
                    try:
                        self.queue.put_nowait(int(payload))
                    except ValueError:
                        self.queue.put_nowait(RESYNC)

                await conn.add_listener(self.bus.channel, on_notify)
                self.connected.set()
                self.queue.put_nowait(RESYNC)  # we may have missed announcements while away
                delay = 0.2
                while not lost.is_set():
                    try:  # asyncio.timeout, not wait_for: wait_for can swallow a cancel on 3.11
                        async with asyncio.timeout(5.0):
                            await lost.wait()
                    except TimeoutError:
                        await conn.fetchval("SELECT 1", timeout=5)  # detect a silently dead link
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("registry LISTEN connection lost (%s); reconnecting in %.1fs", exc, delay)
            finally:
                self.connected.clear()
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(conn.close(), timeout=2)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def _listen_redis(self) -> None:
        import redis.asyncio as aioredis

        delay = 0.2
        while True:
            client = aioredis.from_url(self.bus.settings.redis_url)
            try:
                pubsub = client.pubsub()
                await pubsub.subscribe(self.bus.channel)
                self.connected.set()
                self.queue.put_nowait(RESYNC)
                delay = 0.2
                async for message in pubsub.listen():
                    if message.get("type") != "message":
                        continue
                    try:
                        self.queue.put_nowait(int(message["data"]))
                    except (TypeError, ValueError):
                        self.queue.put_nowait(RESYNC)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("registry Redis subscription lost (%s); reconnecting in %.1fs", exc, delay)
            finally:
                self.connected.clear()
                with contextlib.suppress(Exception):
                    await client.aclose()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
