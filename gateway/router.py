"""Routing: which engine worker should serve an adapter version.

Workers publish residency/load reports (``loraplex.residency``). The router keeps a
consistent-hash ring (uhashring) per base model over the live workers, refreshed from
the store at most every ``refresh_s`` (never per request), and for an adapter version id
takes ``route_candidates`` ring neighbours. Among them it prefers a worker with the
adapter in a device slot, then in host memory, then the ring order; a candidate whose
load is above the bound (``route_load_factor`` x mean load + 1) is skipped; if every
candidate is skipped or gone, the least-loaded live worker serves. The ring order is
stable, so an adapter keeps landing on the same few workers and stays warm there.

Within that, a request's prompt prefix moves the worker most likely to hold it in its KV cache
to the front (``gateway.prefix_routes``: the rule weighing prefix against load is there): only
candidates under the bound and of the best residency tier among them qualify, so a prefix never
costs an adapter load or an overloaded worker. ``on_route`` hears why the first worker was put
first (``gateway.prefix_routes.REASONS``).

A worker that fails (connection error, broken response) is marked failed for
``cooldown_s`` and leaves the candidate lists; it comes back earlier when it publishes
a fresh report. A worker whose last report this replica saw is older than ``report_ttl_s``
is never chosen, whatever the background refresh did (a hung worker stops reporting);
while the store is unreachable the last known set is routed on as it is. Workers that
keep failing are ejected for a while (``gateway.outliers``) and skipped unless every
candidate is. When no usable worker is left for a base model, ``route`` reloads the
live set at once instead of waiting for the next periodic refresh. Static ``worker_urls``
are always live (unless failed or ejected) for every base model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from uhashring import HashRing

from gateway.outliers import Outliers
from gateway.prefix_routes import AFFINITY, LOAD, PrefixQuery, PrefixRoutes
from loraplex.residency import ResidencyStore
from loraplex.wire import BACKEND_VLLM, WorkerReport

log = logging.getLogger("loraplex.gateway.router")


@dataclass(slots=True)
class Worker:
    id: str
    url: str
    base_model: str
    device: frozenset[str]
    host: frozenset[str]
    reported_load: int
    report_ts: float
    inflight: int = 0
    """Requests this gateway replica has in flight on the worker (``Router.acquire``/``release``)."""
    base_revision: str = ""
    vllm: bool = False
    """A vLLM server (``WorkerReport.backend``): the body it gets names the adapter in ``model``."""
    control: str = ""
    """Where its control API answers (``/internal/...``): its agent's URL for vLLM, else ``url``."""
    served_model: str = ""
    """vLLM's name of the base model."""
    queued: int = 0
    """Requests the worker reported waiting in its queue."""
    max_seqs: int = 0
    """Sequences it runs at once (0: not reported)."""
    seen_at: float = float("inf")
    """``time.monotonic()`` when this replica last saw a new report of it (static workers: never stale)."""

    def __post_init__(self) -> None:
        self.control = self.control or self.url

    @property
    def load(self) -> int:
        return max(self.reported_load, self.inflight)

    @property
    def waiting(self) -> int:
        """Requests ahead of a new one: those it reported queued, or this replica's own beyond
        its sequence slots, whichever is more."""
        own = self.inflight - self.max_seqs if self.max_seqs else 0
        return max(self.queued, own)


class Router:
    def __init__(self, residency: ResidencyStore | None, *, candidates: int = 3, load_factor: float = 1.5,
                 static_urls: tuple[str, ...] = (), refresh_s: float = 0.5, cooldown_s: float = 5.0,
                 report_ttl_s: float = 3.0, outliers: Outliers | None = None) -> None:
        self.residency = residency
        self.report_ttl_s = report_ttl_s
        self.outliers = outliers if outliers is not None else Outliers()
        self._blind = False
        """The last refresh could not read the store: staleness is unknown, the last set is used."""
        self._grace_until = 0.0
        """Until then (one report TTL after the store came back), a known worker missing from the
        store or with an unchanged report is kept: nothing could be seen while the store was away."""
        self.n_candidates = max(1, candidates)
        self.load_factor = load_factor
        self.refresh_s = refresh_s
        self.cooldown_s = cooldown_s
        self._static = [
            Worker(id=u, url=u.rstrip("/"), base_model="", device=frozenset(), host=frozenset(),
                   reported_load=0, report_ts=0.0) for u in static_urls
        ]
        self._workers: dict[str, Worker] = {w.id: w for w in self._static}
        self._pools: dict[str, list[Worker]] = {}
        """Workers per base model (rebuilt with the live set)."""
        self._rings: dict[str, HashRing | None] = {}
        self._ring_cache: dict[tuple[str, str], list[str]] = {}
        self._failed: dict[str, float] = {}
        self._refreshed = 0.0
        self._refreshing: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self.prefixes = PrefixRoutes()
        """Where recent prompt prefixes were sent (``record`` them once a worker took the request)."""
        self.on_route: Callable[[str], None] | None = None
        """Called with why each choice's first worker is first (the gateway counts them)."""

    # -- live set -------------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Reload the live workers from the residency store now."""
        if self.residency is None:
            self._refreshed = time.monotonic()
            return
        try:
            reports = await self.residency.live()
        except Exception as exc:  # store unreachable: keep routing on the last known set
            log.warning("residency store unreachable (%s); keeping %d known workers",
                        type(exc).__name__, len(self._workers))
            self._refreshed = time.monotonic()
            self._blind = True
            return
        if self._blind:
            self._store_back()
        self._apply(reports)
        self._refreshed = time.monotonic()
        self._blind = False

    def _store_back(self) -> None:
        """The store answers again after an outage. Reports written before it are older than
        the report TTL, and those that lapsed in it are gone, though their workers may be well:
        they could not report either while it was away. So the last known set gets one report
        TTL from now to report anew before staleness rules it out again."""
        now = time.monotonic()
        self._grace_until = now + self.report_ttl_s
        for w in self._workers.values():
            w.seen_at = max(w.seen_at, now)

    def _apply(self, reports: list[WorkerReport]) -> None:
        old = self._workers
        seen = time.monotonic()
        workers: dict[str, Worker] = {w.id: w for w in self._static}
        for r in reports:
            prev = old.get(r.worker_id)
            failed_at = self._failed.get(r.worker_id)
            if failed_at is not None and r.timestamp > failed_at:
                del self._failed[r.worker_id]  # a fresh report after the failure: back in
            if prev is not None and prev.url == r.url.rstrip("/") and prev.base_model == r.base_model:
                # Update in place: requests in flight hold this object and decrement its counter.
                if r.timestamp != prev.report_ts:
                    prev.seen_at = seen
                prev.queued = r.queue_depth
                prev.max_seqs = r.max_num_seqs
                prev.device = frozenset(r.device_adapters)
                prev.host = frozenset(r.host_adapters)
                prev.reported_load = r.load
                prev.report_ts = r.timestamp
                prev.base_revision = r.base_revision
                prev.vllm = r.backend == BACKEND_VLLM
                prev.control = r.control_url.rstrip("/") or prev.url
                prev.served_model = r.served_model
                workers[r.worker_id] = prev
                continue
            workers[r.worker_id] = Worker(
                id=r.worker_id, url=r.url.rstrip("/"), base_model=r.base_model,
                device=frozenset(r.device_adapters), host=frozenset(r.host_adapters),
                reported_load=r.load, report_ts=r.timestamp, base_revision=r.base_revision,
                vllm=r.backend == BACKEND_VLLM, control=r.control_url.rstrip("/"), served_model=r.served_model,
                queued=r.queue_depth, max_seqs=r.max_num_seqs, seen_at=seen)
        if seen < self._grace_until:
            for wid, prev in old.items():
                workers.setdefault(wid, prev)
        if set(workers) != set(old) or any(workers[k].base_model != old[k].base_model for k in workers):
            self._rings = {}
            self._ring_cache = {}
        self._workers = workers
        self._pools = {}
        self.outliers.forget(set(workers))

    async def _maybe_refresh(self) -> None:
        if time.monotonic() - self._refreshed < self.refresh_s:
            return
        if self._refreshed == 0.0:
            async with self._lock:
                if self._refreshed == 0.0:
                    await self.refresh()
            return
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.create_task(self.refresh())

    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    # -- load of this replica ------------------------------------------------------------------

    def acquire(self, worker: Worker) -> None:
        """Count a request this replica sends to ``worker`` (part of its load until ``release``)."""
        worker.inflight += 1

    def release(self, worker: Worker) -> None:
        worker.inflight -= 1

    def inflight(self) -> int:
        """Requests this replica has in flight on all its workers."""
        return sum(w.inflight for w in self._workers.values())

    # -- failures -------------------------------------------------------------------------------

    def mark_failed(self, worker: Worker) -> None:
        self._failed[worker.id] = time.time()
        self._ring_cache = {}
        log.warning("worker %s (%s) marked failed for %.1fs", worker.id, worker.url, self.cooldown_s)

    def fresh(self, w: Worker) -> bool:
        """Whether ``w``'s last report is recent enough to route to it (or nothing can tell)."""
        return self._blind or time.monotonic() - w.seen_at <= self.report_ttl_s

    def gone_quiet(self, w: Worker) -> bool:
        """Whether ``w`` stopped reporting: a refresh that ran more than ``report_ttl_s`` after its
        last new report found none newer (False while the store is unreachable, or for a static URL)."""
        return not self._blind and self._refreshed - w.seen_at > self.report_ttl_s

    def _usable(self, w: Worker, now: float) -> bool:
        failed_at = self._failed.get(w.id)
        if failed_at is None:
            return True
        if now - failed_at > self.cooldown_s:
            del self._failed[w.id]
            return True
        return False

    # -- choosing -------------------------------------------------------------------------------

    def _ring(self, base_model: str) -> HashRing | None:
        if base_model in self._rings:
            return self._rings[base_model]
        ids = [w.id for w in self._workers.values() if w.base_model in (base_model, "")]
        ring = HashRing(nodes=sorted(ids)) if ids else None
        self._rings[base_model] = ring
        return ring

    def _ring_candidates(self, base_model: str, key: str) -> list[str]:
        ck = (base_model, key)
        hit = self._ring_cache.get(ck)
        if hit is not None:
            return hit
        ring = self._ring(base_model)
        ids = [n["nodename"] for n in ring.range(key, size=min(self.n_candidates, len(ring.get_nodes())),
                                                 unique=True)] if ring else []
        if len(self._ring_cache) > 50_000:
            self._ring_cache.clear()
        self._ring_cache[ck] = ids
        return ids

    def candidates(self, base_model: str, key: str) -> list[str]:
        """The ring's candidate worker ids for ``key`` (an adapter version id), preferred first."""
        return self._ring_candidates(base_model, key)

    def _pool(self, base_model: str) -> list[Worker]:
        pool = self._pools.get(base_model)
        if pool is None:
            pool = self._pools[base_model] = [w for w in self._workers.values() if w.base_model in (base_model, "")]
        return pool

    def several(self, base_model: str) -> bool:
        """Whether more than one known worker serves ``base_model`` (else a prefix cannot steer)."""
        return len(self._pool(base_model)) > 1

    async def route(self, base_model: str, adapter_id: str | None, prefix: PrefixQuery | None = None) -> list[Worker]:
        """Workers to try, best first: preferred candidates, then the least-loaded others.

        When the live set has no usable worker for ``base_model``, it is reloaded once right
        away before the answer is "none" (a worker that just reported serves the next request).
        """
        if self.due():
            await self._maybe_refresh()
        workers = self.choose(base_model, adapter_id, prefix)
        if not workers and self.residency is not None:
            await self._refresh_now()
            workers = self.choose(base_model, adapter_id, prefix)
        return workers

    def refresh_soon(self) -> None:
        """Start a refresh in the background when one is due (no waiting for it)."""
        if self.residency is not None and self.due() and self._refreshed and (
                self._refreshing is None or self._refreshing.done()):
            self._refreshing = asyncio.create_task(self.refresh())

    async def _refresh_now(self) -> None:
        """A refresh now, shared by every caller that asks while it runs."""
        task = self._refreshing
        if task is None or task.done():
            task = self._refreshing = asyncio.create_task(self.refresh())
        await asyncio.shield(task)

    def due(self) -> bool:
        """Whether the live set is due for a refresh (``route`` starts one)."""
        return time.monotonic() - self._refreshed >= self.refresh_s

    def choose(self, base_model: str, adapter_id: str | None, prefix: PrefixQuery | None = None) -> list[Worker]:
        """``route`` from the live set as it is (the request path calls it directly, without a
        coroutine, while no refresh is due). ``prefix``: the request's prompt prefix and
        conversation, to put the worker most likely to hold it first."""
        now = time.time() if self._failed else 0.0
        pool = self._pool(base_model)
        if self._failed:
            pool = [w for w in pool if self._usable(w, now)]
        if not self._blind:  # a worker that stopped reporting is never chosen
            fresh_after = time.monotonic() - self.report_ttl_s
            if any(w.seen_at < fresh_after for w in pool):
                pool = [w for w in pool if w.seen_at >= fresh_after]
        outliers = self.outliers
        if outliers.any_ejected and pool:
            t = time.time()
            healthy = [w for w in pool if not outliers.ejected(w.id, t)]
            if healthy:  # every one ejected: try them anyway (the best of a bad lot)
                pool = healthy
        if not pool:
            return []
        usable = None if len(pool) == len(self._pool(base_model)) else {w.id for w in pool}
        bound = self.load_factor * sum(w.load for w in pool) / len(pool) + 1
        workers = self._workers
        ok = []
        for i in self._ring_candidates(base_model, adapter_id or f"base:{base_model}"):
            w = workers.get(i)
            if w is not None and w.load <= bound and (usable is None or w.id in usable):
                ok.append(w)
        reason = AFFINITY if ok else LOAD
        if adapter_id is not None and len(ok) > 1:
            ok.sort(key=lambda w: _tier(w, adapter_id))
        if prefix is not None and ok:
            reason = self._prefer(ok, adapter_id, prefix) or reason
        if self.on_route is not None:
            self.on_route(reason)
        if len(ok) == len(pool):
            return ok
        chosen = {w.id for w in ok}
        rest = [w for w in pool if w.id not in chosen]
        rest.sort(key=_load)
        return ok + rest

    def _prefer(self, ok: list[Worker], adapter_id: str | None, prefix: PrefixQuery) -> str | None:
        """Move the worker ``prefix`` points to (``PrefixRoutes.prefer``) to the front of ``ok``,
        among those of ``ok[0]``'s residency tier; why, or None when it points nowhere."""
        eligible = ok
        if adapter_id is not None and len(ok) > 1:
            tier = _tier(ok[0], adapter_id)
            eligible = [w for w in ok if _tier(w, adapter_id) == tier]
        first, reason = self.prefixes.prefer(prefix, eligible)
        if first is None:
            return None
        if first is not ok[0]:
            ok.remove(first)
            ok.insert(0, first)
        return reason


def _tier(w: Worker, adapter_id: str) -> int:
    return 0 if adapter_id in w.device else 1 if adapter_id in w.host else 2


def _load(w: Worker) -> int:
    return w.load
