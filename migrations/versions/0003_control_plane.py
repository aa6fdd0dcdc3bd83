"""Control plane at scale: conditional writes on every mutable row, and indexes for deltas.

* ``tenants.row_version`` and ``adapter_versions.row_version`` (bindings had one): bumped on
  every change of the row, the ``ETag`` a client sends back in ``If-Match``.
* ``audit_log.registry_version`` index: readers fetch the changes since their version.
* ``bindings.canary_id`` index: a changed adapter version finds the bindings routing to it.

Revision ID: 0003_control_plane
Revises: 0002
Create Date: 2026-12-01 15:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0003_control_plane'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('tenants') as batch:
        batch.add_column(sa.Column('row_version', sa.Integer(), server_default=sa.text('1'), nullable=False))
    with op.batch_alter_table('adapter_versions') as batch:
        batch.add_column(sa.Column('row_version', sa.Integer(), server_default=sa.text('1'), nullable=False))
    op.create_index('ix_audit_log_registry_version', 'audit_log', ['registry_version'])
    op.create_index('ix_bindings_canary_id', 'bindings', ['canary_id'])


def downgrade() -> None:
    op.drop_index('ix_bindings_canary_id', table_name='bindings')
    op.drop_index('ix_audit_log_registry_version', table_name='audit_log')
    with op.batch_alter_table('adapter_versions') as batch:
        batch.drop_column('row_version')
    with op.batch_alter_table('tenants') as batch:
        batch.drop_column('row_version')
