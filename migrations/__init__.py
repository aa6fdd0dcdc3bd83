"""Alembic environment and revisions for the registry schema (the only way it changes)."""
