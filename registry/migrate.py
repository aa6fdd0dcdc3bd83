"""Apply the registry schema migrations programmatically (what ``loraplex migrate`` runs)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from registry.db import ensure_sqlite_dir, make_engine


def script_location() -> str:
    """The ``migrations`` package directory (installed, editable, or next to ``registry``)."""
    import importlib.util

    candidates: list[Path] = []
    spec = importlib.util.find_spec("migrations")
    if spec is not None:
        if spec.origin and spec.origin not in ("namespace", "built-in"):
            candidates.append(Path(spec.origin).parent)
        candidates += [Path(p) for p in (spec.submodule_search_locations or [])]
    candidates.append(Path(__file__).resolve().parent.parent / "migrations")
    for path in candidates:
        if (path / "env.py").is_file() and (path / "versions").is_dir():
            return str(path.resolve())
    raise FileNotFoundError("the registry migrations (migrations/env.py) are not installed")


def alembic_config(url: str | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", script_location())
    if url:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Blocking ``alembic upgrade`` (runs its own event loop; not for async callers)."""
    ensure_sqlite_dir(url)
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)


async def _run(engine: AsyncEngine, fn: Callable[[Config, str], None], revision: str) -> None:
    cfg = alembic_config()

    def run(connection: Connection) -> None:
        cfg.attributes["connection"] = connection
        fn(cfg, revision)

    async with engine.begin() as conn:
        await conn.run_sync(run)


async def upgrade_async(url_or_engine: str | AsyncEngine, revision: str = "head") -> None:
    """``alembic upgrade`` from async code (tests, the embedded server)."""
    await _with_engine(url_or_engine, command.upgrade, revision)


async def downgrade_async(url_or_engine: str | AsyncEngine, revision: str = "base") -> None:
    await _with_engine(url_or_engine, command.downgrade, revision)


async def _with_engine(url_or_engine: str | AsyncEngine, fn: Callable[[Config, str], None], revision: str) -> None:
    if isinstance(url_or_engine, AsyncEngine):
        await _run(url_or_engine, fn, revision)
        return
    engine = make_engine(url_or_engine, statement_timeout_s=None)
    try:
        await _run(engine, fn, revision)
    finally:
        await engine.dispose()
