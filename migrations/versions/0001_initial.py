"""Initial registry schema: base models, tenants, adapter versions, bindings, audit log, version.

Revision ID: 0001
Revises:
Create Date: 2026-11-29 17:40:47.104670
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('audit_log',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('registry_version', sa.BigInteger(), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('actor', sa.String(length=200), nullable=False),
    sa.Column('action', sa.String(length=64), nullable=False),
    sa.Column('target', sa.String(length=400), nullable=False),
    sa.Column('before', sa.JSON(), nullable=True),
    sa.Column('after', sa.JSON(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_audit_log'))
    )
    op.create_index(op.f('ix_audit_log_action'), 'audit_log', ['action'], unique=False)
    op.create_index('ix_audit_log_target', 'audit_log', ['target'], unique=False)
    op.create_table('base_models',
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('revision', sa.String(length=128), nullable=False),
    sa.Column('architecture', sa.String(length=64), nullable=False),
    sa.Column('hidden_size', sa.Integer(), nullable=False),
    sa.Column('intermediate_size', sa.Integer(), nullable=False),
    sa.Column('num_layers', sa.Integer(), nullable=False),
    sa.Column('num_heads', sa.Integer(), nullable=False),
    sa.Column('num_kv_heads', sa.Integer(), nullable=False),
    sa.Column('head_dim', sa.Integer(), nullable=False),
    sa.Column('vocab_size', sa.Integer(), nullable=False),
    sa.Column('context_length', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_base_models'))
    )
    op.create_table('registry_state',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('version', sa.BigInteger(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_registry_state'))
    )
    # The one row every write transaction bumps (and locks).
    op.execute("INSERT INTO registry_state (id, version, updated_at) VALUES (1, 0, CURRENT_TIMESTAMP)")
    op.create_table('tenants',
    sa.Column('slug', sa.String(length=64), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('requests_per_min', sa.Integer(), nullable=False),
    sa.Column('tokens_per_min', sa.Integer(), nullable=False),
    sa.Column('max_concurrent', sa.Integer(), nullable=False),
    sa.Column('priority', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.CheckConstraint("priority IN ('high', 'normal', 'low')", name=op.f('ck_tenants_priority')),
    sa.CheckConstraint("status IN ('active', 'disabled')", name=op.f('ck_tenants_status')),
    sa.CheckConstraint('requests_per_min >= 0 AND tokens_per_min >= 0 AND max_concurrent >= 0', name=op.f('ck_tenants_limits')),
    sa.PrimaryKeyConstraint('slug', name=op.f('pk_tenants'))
    )
    op.create_table('adapter_versions',
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('base_model', sa.String(length=200), nullable=False),
    sa.Column('uri', sa.Text(), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('alpha', sa.Float(), nullable=False),
    sa.Column('target_modules', sa.JSON(), nullable=False),
    sa.Column('owner_tenant', sa.String(length=64), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('status_reason', sa.Text(), nullable=True),
    sa.Column('verification', sa.JSON(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.CheckConstraint("status IN ('pending', 'active', 'disabled', 'failed')", name=op.f('ck_adapter_versions_status')),
    sa.CheckConstraint('rank >= 1', name=op.f('ck_adapter_versions_rank')),
    sa.CheckConstraint('version >= 1', name=op.f('ck_adapter_versions_version')),
    sa.ForeignKeyConstraint(['base_model'], ['base_models.name'], name=op.f('fk_adapter_versions_base_model_base_models')),
    sa.ForeignKeyConstraint(['owner_tenant'], ['tenants.slug'], name=op.f('fk_adapter_versions_owner_tenant_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_adapter_versions')),
    sa.UniqueConstraint('name', 'version', name='uq_adapter_versions_name_version')
    )
    op.create_index(op.f('ix_adapter_versions_base_model'), 'adapter_versions', ['base_model'], unique=False)
    op.create_index(op.f('ix_adapter_versions_owner_tenant'), 'adapter_versions', ['owner_tenant'], unique=False)
    op.create_table('bindings',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('tenant', sa.String(length=64), nullable=False),
    sa.Column('alias', sa.String(length=200), nullable=False),
    sa.Column('base_model', sa.String(length=200), nullable=False),
    sa.Column('active_id', sa.String(length=36), nullable=False),
    sa.Column('previous_id', sa.String(length=36), nullable=True),
    sa.Column('canary_id', sa.String(length=36), nullable=True),
    sa.Column('canary_percent', sa.Float(), nullable=False),
    sa.Column('enabled', sa.Boolean(), nullable=False),
    sa.Column('on_disabled', sa.String(length=16), nullable=False),
    sa.Column('row_version', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.CheckConstraint("on_disabled IN ('base', 'refuse')", name=op.f('ck_bindings_on_disabled')),
    sa.CheckConstraint('canary_percent >= 0 AND canary_percent <= 100', name=op.f('ck_bindings_canary_percent')),
    sa.ForeignKeyConstraint(['active_id'], ['adapter_versions.id'], name=op.f('fk_bindings_active_id_adapter_versions')),
    sa.ForeignKeyConstraint(['base_model'], ['base_models.name'], name=op.f('fk_bindings_base_model_base_models')),
    sa.ForeignKeyConstraint(['canary_id'], ['adapter_versions.id'], name=op.f('fk_bindings_canary_id_adapter_versions')),
    sa.ForeignKeyConstraint(['previous_id'], ['adapter_versions.id'], name=op.f('fk_bindings_previous_id_adapter_versions')),
    sa.ForeignKeyConstraint(['tenant'], ['tenants.slug'], name=op.f('fk_bindings_tenant_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_bindings')),
    sa.UniqueConstraint('tenant', 'alias', name='uq_bindings_tenant_alias')
    )
    op.create_index(op.f('ix_bindings_active_id'), 'bindings', ['active_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_bindings_active_id'), table_name='bindings')
    op.drop_table('bindings')
    op.drop_index(op.f('ix_adapter_versions_owner_tenant'), table_name='adapter_versions')
    op.drop_index(op.f('ix_adapter_versions_base_model'), table_name='adapter_versions')
    op.drop_table('adapter_versions')
    op.drop_table('tenants')
    op.drop_table('registry_state')
    op.drop_table('base_models')
    op.drop_index('ix_audit_log_target', table_name='audit_log')
    op.drop_index(op.f('ix_audit_log_action'), table_name='audit_log')
    op.drop_table('audit_log')
