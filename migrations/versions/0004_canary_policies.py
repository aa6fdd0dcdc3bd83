"""Canary policies: how a binding's canaries are judged, and the judge's state.

Revision ID: 0004_canary_policies
Revises: 0003_control_plane
Create Date: 2026-12-06 06:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004_canary_policies'
down_revision: str | None = '0003_control_plane'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        'canary_policies',
        sa.Column('id', BigId, primary_key=True, autoincrement=True),
        sa.Column('tenant', sa.String(64), sa.ForeignKey('tenants.slug'), nullable=False),
        sa.Column('alias', sa.String(200), nullable=False),
        sa.Column('steps', sa.JSON(), nullable=False),
        sa.Column('interval_s', sa.Float(), nullable=False),
        sa.Column('min_requests', sa.Integer(), nullable=False),
        sa.Column('max_failures', sa.Integer(), nullable=False),
        sa.Column('checks', sa.JSON(), nullable=False),
        sa.Column('proportion_test', sa.String(32), nullable=False),
        sa.Column('sample_test', sa.String(32), nullable=False),
        sa.Column('alpha', sa.Float(), nullable=False),
        sa.Column('status', sa.String(16), nullable=False),
        sa.Column('canary_id', sa.String(36), nullable=True),
        sa.Column('step', sa.Integer(), nullable=False),
        sa.Column('step_started_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('failures', sa.Integer(), nullable=False),
        sa.Column('last', sa.JSON(), nullable=True),
        sa.Column('row_version', sa.Integer(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint('tenant', 'alias', name='uq_canary_policies_tenant_alias'),
    )


def downgrade() -> None:
    op.drop_table('canary_policies')
