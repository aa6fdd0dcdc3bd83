"""Alembic environment (async). Works three ways:

* ``alembic upgrade head`` from the repository root (``alembic.ini``); the URL comes from
  ``-x url=...``, ``sqlalchemy.url`` in the ini, or ``LORAPLEX_DATABASE_URL`` / the embedded default;
* ``loraplex migrate`` (``registry.migrate``) with a programmatic ``Config``;
* from async code that already holds a connection (``config.attributes["connection"]``).

SQLite gets ``render_as_batch`` so ALTERs become table rebuilds.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection

from loraplex.settings import Settings
from registry.db import is_sqlite, make_engine
from registry.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    x = context.get_x_argument(as_dictionary=True)
    return x.get("url") or config.get_main_option("sqlalchemy.url") or Settings.from_env().resolved_database_url()


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )


def do_run_migrations(connection: Connection) -> None:
    _configure(connection)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    url = _url()
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=is_sqlite(url), dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


async def run_async_migrations() -> None:
    engine = make_engine(_url(), statement_timeout_s=None)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(do_run_migrations)
            await connection.commit()
    finally:
        await engine.dispose()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        do_run_migrations(connection)
        return
    asyncio.run(run_async_migrations())


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
