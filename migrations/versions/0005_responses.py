"""Stored Responses (the Responses API's ``store``) and each tenant's retention of them.

Revision ID: 0005_responses
Revises: 0004_canary_policies
Create Date: 2026-12-06 09:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005_responses'
down_revision: str | None = '0004_canary_policies'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('tenants') as batch:
        batch.add_column(sa.Column('response_retention_s', sa.Integer(), nullable=True))
    op.create_table(
        'responses',
        sa.Column('id', sa.String(64), primary_key=True),
        sa.Column('tenant', sa.String(64), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('previous_id', sa.String(64), nullable=True),
        sa.Column('depth', sa.Integer(), nullable=False),
        sa.Column('model', sa.String(200), nullable=False),
        sa.Column('adapter', sa.String(300), nullable=False),
        sa.Column('response', sa.JSON(), nullable=False),
        sa.Column('input_items', sa.JSON(), nullable=False),
        sa.Column('context', sa.JSON(), nullable=False),
    )
    op.create_index('ix_responses_expires_at', 'responses', ['expires_at'])


def downgrade() -> None:
    op.drop_index('ix_responses_expires_at', table_name='responses')
    op.drop_table('responses')
    with op.batch_alter_table('tenants') as batch:
        batch.drop_column('response_retention_s')
