"""Registry schema revisions."""
