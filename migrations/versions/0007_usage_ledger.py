"""The usage ledger: per (tenant, alias, version, outcome) buckets of a minute, an hour or a day,
the flushes already applied (each gateway's sequence numbers: a retried flush adds nothing) and
how far the rollups have gone.

Revision ID: 0007_usage_ledger
Revises: 0006_tenant_cache_scope
Create Date: 2026-12-07 08:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0007_usage_ledger'
down_revision: str | None = '0006_tenant_cache_scope'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'usage_buckets',
        sa.Column('width', sa.String(1), nullable=False),
        sa.Column('start', sa.BigInteger(), nullable=False),
        sa.Column('tenant', sa.String(64), nullable=False),
        sa.Column('alias', sa.String(200), nullable=False),
        sa.Column('version', sa.String(64), nullable=False),
        sa.Column('outcome', sa.String(64), nullable=False),
        sa.Column('requests', sa.BigInteger(), nullable=False),
        sa.Column('prompt_tokens', sa.BigInteger(), nullable=False),
        sa.Column('cached_tokens', sa.BigInteger(), nullable=False),
        sa.Column('completion_tokens', sa.BigInteger(), nullable=False),
        sa.Column('peak_concurrent', sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint('width', 'start', 'tenant', 'alias', 'version', 'outcome',
                                name='pk_usage_buckets'),
        sa.CheckConstraint("width IN ('m', 'h', 'd')", name='ck_usage_buckets_width'),
    )
    op.create_index('ix_usage_buckets_tenant', 'usage_buckets', ['width', 'tenant', 'start'])
    op.create_table(
        'usage_flushes',
        sa.Column('gateway', sa.String(128), nullable=False),
        sa.Column('seq', sa.BigInteger(), nullable=False),
        sa.Column('applied_at', sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint('gateway', 'seq', name='pk_usage_flushes'),
    )
    op.create_index('ix_usage_flushes_applied_at', 'usage_flushes', ['applied_at'])
    op.create_table(
        'usage_rollups',
        sa.Column('width', sa.String(1), nullable=False),
        sa.Column('done_until', sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint('width', name='pk_usage_rollups'),
    )


def downgrade() -> None:
    op.drop_table('usage_rollups')
    op.drop_index('ix_usage_flushes_applied_at', table_name='usage_flushes')
    op.drop_table('usage_flushes')
    op.drop_index('ix_usage_buckets_tenant', table_name='usage_buckets')
    op.drop_table('usage_buckets')
