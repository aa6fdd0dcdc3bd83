"""Shared fixtures: real PostgreSQL and Redis (as CI starts them), SQLite in tmp dirs.

``LORAPLEX_TEST_PG_URL`` and ``LORAPLEX_TEST_REDIS_URL`` override where they are.
Each test module gets its own throwaway PostgreSQL database and Redis key prefix,
so test runs never see each other's rows or keys.
"""

from __future__ import annotations

import os
import uuid

import pytest

PG_ADMIN_URL = os.environ.get("LORAPLEX_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("LORAPLEX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _pg_with_db(url: str, db: str) -> str:
    return url.rsplit("/", 1)[0] + "/" + db


@pytest.fixture(scope="module")
def pg_url():
    """A fresh PostgreSQL database (asyncpg URL for SQLAlchemy), dropped afterwards."""
    import asyncio

    import asyncpg

    name = f"loraplex_t_{uuid.uuid4().hex[:12]}"

    async def run(sql: str) -> None:
        conn = await asyncpg.connect(PG_ADMIN_URL)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run(f'CREATE DATABASE "{name}"'))
    yield _pg_with_db(PG_ADMIN_URL, name).replace("postgresql://", "postgresql+asyncpg://", 1)
    asyncio.run(run(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request, tmp_path):
    """Each test runs twice: on a real PostgreSQL database and on SQLite."""
    if request.param == "postgresql":
        return request.getfixturevalue("pg_url")
    return f"sqlite+aiosqlite:///{tmp_path}/registry.db"


@pytest.fixture
def sqlite_url(tmp_path):
    return f"sqlite+aiosqlite:///{tmp_path}/registry.db"


@pytest.fixture(scope="session")
def redis_url():
    return REDIS_URL


@pytest.fixture
def redis_prefix():
    """A unique key namespace; keys under it are deleted after the test."""
    import redis as redis_sync

    prefix = f"loraplex-test-{uuid.uuid4().hex[:10]}"
    yield prefix
    client = redis_sync.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(f"{prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()
