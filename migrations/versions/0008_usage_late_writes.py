"""The usage ledger's late writes: per rolled-up width, how many flushes added minutes to rows
before its watermark (a finished day's page is unchanged while this count is).

Revision ID: 0008_usage_late_writes
Revises: 0007_usage_ledger
Create Date: 2026-12-07 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0008_usage_late_writes'
down_revision: str | None = '0007_usage_ledger'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'usage_late_writes',
        sa.Column('width', sa.String(1), nullable=False),
        sa.Column('flushes', sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint('width', name='pk_usage_late_writes'),
    )


def downgrade() -> None:
    op.drop_table('usage_late_writes')
