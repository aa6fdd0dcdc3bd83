"""What the console shows that the registry does not hold: the fleet and the live numbers.

The admin API (``registry.admin_api``) serves the console; this gives it the workers'
residency reports (the same store the router reads), the workers outlier detection ejected
(``gateway.outliers``: every gateway's, with Redis) and the per-version live numbers
(``gateway.live_stats``), all torch-free and read on each page view.
"""

from __future__ import annotations

from typing import Any

from gateway.live_stats import LiveStats
from gateway.outliers import Ejection, Outliers
from loraplex.residency import ResidencyStore
from loraplex.wire import WorkerReport


class GatewayConsoleSources:
    def __init__(self, residency: ResidencyStore | None, live: LiveStats, outliers: Outliers | None = None) -> None:
        self.residency = residency
        self._live = live
        self._outliers = outliers

    async def workers(self) -> list[WorkerReport]:
        """Every live worker's last report (none without a residency store)."""
        return [] if self.residency is None else await self.residency.live()

    async def ejections(self) -> dict[str, Ejection]:
        """Workers ejected now, by worker id (until when and why)."""
        return {} if self._outliers is None else await self._outliers.fleet()

    async def live(self) -> dict[str, dict[str, Any]]:
        return await self._live.snapshot()
