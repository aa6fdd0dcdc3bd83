"""Where the gateway reads the registry snapshot it serves from: ``SnapshotSource``.

Two sources implement it: the live registry (``registry.cache.SnapshotCache``, structurally: it
keeps its snapshot fresh from the database) and a static file (``gateway.snapshot_file``, by
subclassing: the hooks it has no use for are the no-op defaults here). The app starts and stops
the source in its lifespan, asks it whether the replica is ready (``/readyz``), and the
``loraplex gateway`` command sets ``freeze_gc``. Only the live registry has refresh numbers for
``/metrics`` (``RefreshedSnapshots``).
"""

from __future__ import annotations

from typing import Protocol

from registry.snapshot import RegistrySnapshot


class SnapshotSource(Protocol):
    """The registry snapshot every request resolves against, and the hooks the app calls."""

    freeze_gc: bool = False
    """Move the snapshot out of the cyclic collector's view after each full load (a serving
    process sets it; a source with nothing to load ignores it)."""

    @property
    def current(self) -> RegistrySnapshot:
        """The snapshot to serve from now; raises when none is held (the request path answers 503)."""
        ...

    async def start(self) -> None:
        """Begin keeping ``current`` (the app's lifespan, before the first request)."""
        return None

    async def stop(self) -> None:
        """Release what ``start`` took (the app's lifespan, after the last request)."""
        return None

    def readiness_problem(self) -> str | None:
        """Why this replica should not take traffic (None: ready whenever ``current`` holds a snapshot)."""
        return None


class RefreshedSnapshots(Protocol):
    """A source that loads its snapshot and counts how that goes (``registry.cache.SnapshotCache``):
    what ``loraplex_registry_snapshot_*`` report."""

    @property
    def current(self) -> RegistrySnapshot: ...

    @property
    def ready(self) -> bool: ...

    @property
    def age_s(self) -> float: ...

    @property
    def last_load_s(self) -> float: ...

    @property
    def failures(self) -> int: ...

    @property
    def loads(self) -> dict[str, int]: ...
