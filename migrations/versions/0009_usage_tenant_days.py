"""The usage ledger's finished days by tenant: per (day, tenant) the JSON of its result in a page
of days grouped by tenant, rendered when the rollup closes the day (PostgreSQL; the ``t``
watermark of ``usage_rollups`` says how far they are complete, and the rollup renders the days
before it that an existing ledger holds, a day per transaction).

Revision ID: 0009_usage_tenant_days
Revises: 0008_usage_late_writes
Create Date: 2026-12-07 14:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0009_usage_tenant_days'
down_revision: str | None = '0008_usage_late_writes'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'usage_tenant_days',
        sa.Column('day', sa.BigInteger(), nullable=False),
        sa.Column('tenant', sa.String(64), nullable=False),
        sa.Column('result', sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint('day', 'tenant', name='pk_usage_tenant_days'),
    )


def downgrade() -> None:
    op.execute("DELETE FROM usage_rollups WHERE width = 't'")
    op.drop_table('usage_tenant_days')
