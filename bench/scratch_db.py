"""A fresh PostgreSQL database for one benchmark run, dropped afterwards.

    with scratch_database("loraplex_plan") as url:   # a postgresql+asyncpg:// URL
        ...
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Iterator

PG_ADMIN_URL = os.environ.get("LORAPLEX_TEST_PG_URL", "postgresql://127.0.0.1:5432/test")


async def _sql(statement: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(PG_ADMIN_URL)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


@contextlib.contextmanager
def scratch_database(prefix: str) -> Iterator[str]:
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    asyncio.run(_sql(f'CREATE DATABASE "{name}"'))
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://", 1) + "/" + name
    finally:
        asyncio.run(_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
