"""Bounded Prometheus label values: the same convention on gateways and workers.

A label whose values come from traffic (tenants, adapter versions, workers) admits at most
``max_values`` distinct values per process and folds every later one into ``"other"``, so a
registry of thousands of tenants or adapters cannot blow up the series count of one scrape.
"""

from __future__ import annotations

OTHER = "other"


class LabelCap:
    """The first ``max_values`` distinct values pass as they are; later ones read ``"other"``."""

    def __init__(self, max_values: int) -> None:
        self.max_values = max_values
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        if len(self._seen) < self.max_values:
            self._seen.add(value)
            return value
        return OTHER
