"""Async engine and session factory for the registry database (PostgreSQL or SQLite)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def is_postgres(url: str) -> bool:
    return make_url(url).get_backend_name() == "postgresql"


def ensure_sqlite_dir(url: str) -> None:
    """Create the directory of a file-backed SQLite database (the embedded default)."""
    u = make_url(url)
    if u.get_backend_name() == "sqlite" and u.database and u.database != ":memory:":
        Path(u.database).expanduser().parent.mkdir(parents=True, exist_ok=True)


def resolve_url(settings: Any, engine: AsyncEngine | None = None, url: str | None = None) -> str:
    """The database URL a registry component uses: explicit, else its engine's, else the settings'."""
    if url:
        return url
    if engine is not None:
        return engine.url.render_as_string(hide_password=False)
    return str(settings.resolved_database_url())


def make_engine(url: str, *, statement_timeout_s: float | None = 30.0, **kwargs: Any) -> AsyncEngine:
    """An async engine; SQLite gets WAL, foreign keys and a busy timeout for concurrent writers.

    On PostgreSQL, connecting fails after 5 s and (unless ``statement_timeout_s`` is None, as
    for migrations) no statement waits longer than ``statement_timeout_s``: a stuck lock or a
    half-open connection becomes an error (503) instead of a hang.
    """
    if is_sqlite(url):
        ensure_sqlite_dir(url)
        kwargs.setdefault("connect_args", {"timeout": 30})
        engine = create_async_engine(url, **kwargs)

        @event.listens_for(engine.sync_engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None  # we emit BEGIN ourselves (below)
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        @event.listens_for(engine.sync_engine, "begin")
        def _on_begin(conn: Any) -> None:
            conn.exec_driver_sql("BEGIN")

        return engine
    connect_args: dict[str, Any] = {"timeout": 5}  # fail fast (503) instead of asyncpg's 60 s
    if statement_timeout_s is not None:
        connect_args["command_timeout"] = statement_timeout_s
    kwargs.setdefault("connect_args", connect_args)
    kwargs.setdefault("pool_pre_ping", True)
    kwargs.setdefault("pool_size", 10)
    kwargs.setdefault("max_overflow", 20)
    return create_async_engine(url, **kwargs)


def session_factory(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


class LazyDatabase:
    """The registry database for a gateway-side store (stored Responses, the usage ledger, usage
    reads): a pool of its own opened on first use, so a gateway nobody asks never connects, or an
    engine the caller owns (``engine``: never disposed here). ``pool`` sizes an own PostgreSQL pool."""

    def __init__(self, settings: Any, engine: AsyncEngine | None = None, **pool: Any) -> None:
        self.settings = settings
        self._engine = engine
        self._own = engine is None
        self._pool = pool
        self._sessions: async_sessionmaker[AsyncSession] | None = None

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None:
            url = resolve_url(self.settings)
            self._engine = make_engine(url, **self._pool) if is_postgres(url) else make_engine(url)
        return self._engine

    @property
    def sessions(self) -> async_sessionmaker[AsyncSession]:
        if self._sessions is None:
            self._sessions = session_factory(self.engine)
        return self._sessions

    async def close(self) -> None:
        if self._own and self._engine is not None:
            await self._engine.dispose()
            self._engine = None
            self._sessions = None
