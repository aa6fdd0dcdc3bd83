"""Which adapter leaves a full tier: the eviction policy the engine's tiers use.

Torch-free on purpose: ``loraplex plan`` (``planner.replay``) drives the very same policy over
a recorded trace to predict the tiers' hit ratios, so what it replays is what the worker does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterable
from typing import Generic, Protocol, TypeVar

K = TypeVar("K", bound=Hashable)
"""A tier's key: the engine's adapter version ids, the planner's adapter indices."""


class EvictionPolicy(Protocol[K]):
    def touch(self, key: K) -> None:
        """``key`` was used now."""

    def remove(self, key: K) -> None:
        """``key`` left the tier."""

    def order(self, candidates: Iterable[K]) -> list[K]:
        """``candidates`` in eviction order (first is evicted first)."""
        ...

    def victim(self, candidates: Collection[K]) -> K | None:
        """The first of ``order(candidates)`` (None when there are none), without ranking them all."""
        ...


class LRUPolicy(Generic[K]):
    """Least recently used first; keys never touched go after every touched one."""

    def __init__(self) -> None:
        self._used: OrderedDict[K, None] = OrderedDict()

    def touch(self, key: K) -> None:
        self._used[key] = None
        self._used.move_to_end(key)

    def remove(self, key: K) -> None:
        self._used.pop(key, None)

    def order(self, candidates: Iterable[K]) -> list[K]:
        cand = set(candidates)
        ranked = [k for k in self._used if k in cand]
        return ranked + [k for k in cand if k not in self._used]

    def victim(self, candidates: Collection[K]) -> K | None:
        for k in self._used:  # oldest first: in a full tier the first is almost always a candidate
            if k in candidates:
                return k
        return next(iter(candidates), None)
