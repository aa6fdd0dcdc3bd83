"""Adapter version identity covers every file: ``adapter_versions.sha256`` becomes the version
digest (``loraplex.digest``: adapter_config.json + adapter_model.safetensors) instead of the
sha256 of the weights file alone.

Rows are recomputed from their local files when the weights file still has the sha256 the row
recorded; rows whose files are gone or changed are logged and left as they are, so workers
refuse to load them (the old value never matches a version digest) until re-registered.
The downgrade writes the weights-file sha256 back where the files are present.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 09:30:00
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import unquote, urlparse

import sqlalchemy as sa
from alembic import op

from loraplex.digest import digest_directory, sha256_file
from loraplex.peft_config import ADAPTER_FILES, WEIGHTS_FILE

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

log = logging.getLogger("alembic.runtime.migration")

_versions = sa.table("adapter_versions", sa.column("id", sa.String), sa.column("name", sa.String),
                     sa.column("version", sa.Integer), sa.column("uri", sa.Text), sa.column("sha256", sa.String))


def _directory(uri: str) -> Path | None:
    parsed = urlparse(uri)
    if parsed.scheme == "file" and parsed.netloc in ("", "localhost"):
        return Path(unquote(parsed.path))
    if not parsed.scheme:
        return Path(uri)
    return None


def _rows() -> list[sa.Row]:
    return list(op.get_bind().execute(
        sa.select(_versions.c.id, _versions.c.name, _versions.c.version, _versions.c.uri, _versions.c.sha256)))


def _present(row: sa.Row) -> Path | None:
    d = _directory(row.uri)
    if d is None or not all((d / name).is_file() for name in ADAPTER_FILES):
        log.warning("adapter %s@%s (%s): files at %s not found; its sha256 is left as it was",
                    row.name, row.version, row.id, row.uri)
        return None
    return d


def upgrade() -> None:
    bind = op.get_bind()
    for row in _rows():
        d = _present(row)
        if d is None:
            continue
        if sha256_file(d / WEIGHTS_FILE) != row.sha256.lower():
            log.warning("adapter %s@%s (%s): %s changed since registration; its sha256 is left as it was "
                        "(workers will refuse it)", row.name, row.version, row.id, WEIGHTS_FILE)
            continue
        bind.execute(_versions.update().where(_versions.c.id == row.id).values(sha256=digest_directory(d)))


def downgrade() -> None:
    bind = op.get_bind()
    for row in _rows():
        d = _present(row)
        if d is not None and digest_directory(d) == row.sha256.lower():
            bind.execute(_versions.update().where(_versions.c.id == row.id)
                         .values(sha256=sha256_file(d / WEIGHTS_FILE)))
