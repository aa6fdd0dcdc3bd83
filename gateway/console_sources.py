"""What the console shows that the registry does not hold: the fleet and the live numbers.

The admin API (``registry.admin_api``) serves the console; this gives it the workers'
residency reports (the same store the router reads) and the per-version live numbers
(``gateway.live_stats``), both torch-free and read on each page view.
"""

from __future__ import annotations

from typing import Any

from gateway.live_stats import LiveStats
from loraplex.residency import ResidencyStore
from loraplex.wire import WorkerReport


class GatewayConsoleSources:
    def __init__(self, residency: ResidencyStore | None, live: LiveStats) -> None:
        self.residency = residency
        self._live = live

    async def workers(self) -> list[WorkerReport]:
        """Every live worker's last report (none without a residency store)."""
        return [] if self.residency is None else await self.residency.live()

    async def live(self) -> dict[str, dict[str, Any]]:
        return await self._live.snapshot()
