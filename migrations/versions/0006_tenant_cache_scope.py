"""Tenants' prefix-cache scope: empty (the tenant's own, the default) or a shared scope's name.

Revision ID: 0006_tenant_cache_scope
Revises: 0005_responses
Create Date: 2026-12-07 07:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0006_tenant_cache_scope'
down_revision: str | None = '0005_responses'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('tenants') as batch:
        batch.add_column(sa.Column('cache_scope', sa.String(64), nullable=False, server_default=''))


def downgrade() -> None:
    with op.batch_alter_table('tenants') as batch:
        batch.drop_column('cache_scope')
