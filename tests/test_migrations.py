"""Alembic migrations: upgrade head / downgrade base on PostgreSQL and SQLite, and the
ORM models agree with what the migrations build (autogenerate finds no difference)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text

from registry.db import make_engine
from registry.migrate import downgrade_async, upgrade_async
from registry.models import Base

ROOT = Path(__file__).resolve().parents[1]
TABLES = {"registry_state", "base_models", "tenants", "adapter_versions", "bindings", "audit_log", "canary_policies", "responses",
          "usage_buckets", "usage_flushes", "usage_rollups", "usage_late_writes",
          "usage_tenant_days"}


async def _tables(engine) -> set[str]:
    async with engine.connect() as conn:
        return set(await conn.run_sync(lambda c: inspect(c).get_table_names())) - {"alembic_version"}


async def test_upgrade_downgrade_and_models_match(db_url):
    engine = make_engine(db_url)
    try:
        await upgrade_async(engine)
        assert await _tables(engine) == TABLES
        async with engine.connect() as conn:
            diff = await conn.run_sync(lambda c: compare_metadata(MigrationContext.configure(c), Base.metadata))
            version = (await conn.execute(text("SELECT version FROM registry_state WHERE id = 1"))).scalar_one()
        assert diff == [], f"models and migrations disagree: {diff}"
        assert version == 0
        await downgrade_async(engine)
        assert await _tables(engine) == set()
        await upgrade_async(engine)  # and back up again
        assert await _tables(engine) == TABLES
        await downgrade_async(engine)
    finally:
        await engine.dispose()


def test_alembic_ini_from_repo_root(tmp_path):
    """Plain ``alembic upgrade head`` from the repository root, URL from LORAPLEX_DATABASE_URL."""
    url = f"sqlite+aiosqlite:///{tmp_path}/cli.db"
    env = {**os.environ, "LORAPLEX_DATABASE_URL": url}
    alembic = [sys.executable, "-m", "alembic", "-c", str(ROOT / "alembic.ini")]
    subprocess.run([*alembic, "upgrade", "head"], cwd=ROOT, env=env, check=True, capture_output=True)
    out = subprocess.run([*alembic, "current"], cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    assert "(head)" in out.stdout
    subprocess.run([*alembic, "downgrade", "base"], cwd=ROOT, env=env, check=True, capture_output=True)


def test_loraplex_migrate_command(tmp_path):
    """``loraplex migrate`` runs from the installed package with the settings' URL."""
    home = tmp_path / "home"
    env = {**os.environ, "LORAPLEX_HOME": str(home)}
    env.pop("LORAPLEX_DATABASE_URL", None)
    run = [sys.executable, "-m", "loraplex_cli", "migrate"]
    subprocess.run(run, cwd=tmp_path, env=env, check=True, capture_output=True)
    assert (home / "registry.db").is_file()
    subprocess.run([*run, "--down", "--revision", "base"], cwd=tmp_path, env=env, check=True, capture_output=True)


async def test_0002_recomputes_version_digests(db_url, tmp_path, caplog):
    """0002 turns each row's weights-file sha256 into the version digest where the files are
    present and unchanged; it logs and leaves the others (workers then refuse them)."""
    import hashlib
    import logging
    import shutil

    from loraplex.digest import digest_directory
    from registry.service import RegistryService
    from tests.registry_support import TINY, fresh_registry, make_settings, write_adapter

    await fresh_registry(db_url)
    settings = make_settings(tmp_path, db_url)
    root = Path(settings.resolved_adapter_root())
    svc = RegistryService(settings)
    try:
        await svc.register_base_model(TINY)
        rows = {n: await svc.register_adapter(n, str(write_adapter(root / n, TINY, seed=i)), "tiny")
                for i, n in enumerate(("kept", "gone", "changed"))}
    finally:
        await svc.close()
    dirs = {n: root / n for n in rows}
    weights_sha = {n: hashlib.sha256((d / "adapter_model.safetensors").read_bytes()).hexdigest()
                   for n, d in dirs.items()}
    assert all(rows[n].sha256 == digest_directory(dirs[n]) != weights_sha[n] for n in rows)

    async def stored() -> dict[str, str]:
        async with engine.connect() as conn:
            return dict((await conn.execute(text("SELECT name, sha256 FROM adapter_versions"))).all())

    engine = make_engine(db_url)
    try:
        await downgrade_async(engine, "0001")
        assert await stored() == weights_sha, "the downgrade restores the weights-file sha256"
        shutil.rmtree(dirs["gone"])
        write_adapter(dirs["changed"], TINY, seed=9)
        with caplog.at_level(logging.WARNING):
            await upgrade_async(engine)
        assert await stored() == {"kept": digest_directory(dirs["kept"]), "gone": weights_sha["gone"],
                                  "changed": weights_sha["changed"]}
        log = caplog.text
        assert "gone@1" in log and "not found" in log and "changed@1" in log and "changed since" in log
        assert "kept@1" not in log
    finally:
        await engine.dispose()
