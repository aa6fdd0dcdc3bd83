"""Prometheus metrics per tenant and per adapter version, with bounded label cardinality.

Each label dimension admits at most ``max_values`` distinct values and folds later ones into
``"other"`` (``loraplex.label_cap``); per-request series are plain counters rendered by a
collector when scraped. ``loraplex_gateway_tokens{kind}`` counts ``prompt``, ``completion`` and
``cached_prompt`` tokens: a tenant's prefix-cache hit ratio is cached_prompt / prompt.
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from gateway.prefix_routes import REASONS
from gateway.snapshot_source import RefreshedSnapshots
from loraplex.label_cap import OTHER, LabelCap

__all__ = ["OTHER", "GatewayMetrics", "LabelCap", "metrics_app", "status_class"]


def status_class(status: int) -> str:
    return f"{status // 100}xx" if status not in (401, 403, 404, 413, 429, 499, 503) else str(status)


LATENCY_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120)
LOOP_LAG_INTERVAL_S = 0.025
LOOP_LAG_BUCKETS = (.001, .002, .005, .01, .02, .05, .1, .25, .5, 1, 2.5, 5)


class _Series:
    """One (tenant, adapter) pair's request counters."""

    __slots__ = ("by_status", "cached", "completion", "errors", "latency", "latency_sum", "prompt")

    def __init__(self) -> None:
        self.by_status: dict[str, int] = {}
        self.latency = [0] * (len(LATENCY_BUCKETS) + 1)
        """Observations per bucket (not cumulative); the last one is +Inf."""
        self.latency_sum = 0.0
        self.prompt = 0
        self.cached = 0
        """Prompt tokens the worker's prefix cache supplied (counted in ``prompt`` too)."""
        self.completion = 0
        self.errors = 0


class _RequestCollector:
    def __init__(self, series: dict[tuple[str, str], _Series]) -> None:
        self.series = series

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("loraplex_gateway_requests", "Requests by tenant, adapter version and status",
                                       labels=["tenant", "adapter", "status"])
        tokens = CounterMetricFamily("loraplex_gateway_tokens", "Tokens by tenant, adapter version and kind: "
                                     "prompt, completion, cached_prompt (prompt tokens a worker's prefix cache "
                                     "supplied; hit ratio: cached_prompt / prompt)",
                                     labels=["tenant", "adapter", "kind"])
        errors = CounterMetricFamily("loraplex_gateway_errors", "Failed requests (4xx/5xx) by tenant and adapter",
                                     labels=["tenant", "adapter"])
        latency = HistogramMetricFamily("loraplex_gateway_request_seconds", "Request latency by tenant and adapter",
                                        labels=["tenant", "adapter"])
        bounds = [floatToGoString(b) for b in LATENCY_BUCKETS] + ["+Inf"]
        for (t, a), s in list(self.series.items()):
            for status, n in s.by_status.items():
                requests.add_metric([t, a, status], n)
            tokens.add_metric([t, a, "prompt"], s.prompt)
            tokens.add_metric([t, a, "completion"], s.completion)
            tokens.add_metric([t, a, "cached_prompt"], s.cached)
            errors.add_metric([t, a], s.errors)
            cumulative, total = [], 0
            for le, n in zip(bounds, s.latency, strict=True):
                total += n
                cumulative.append((le, total))
            latency.add_metric([t, a], cumulative, s.latency_sum)
        yield from (requests, tokens, errors, latency)


class _SnapshotCollector:
    """The registry snapshot this replica serves from, when it is the live registry's
    (``registry.cache.SnapshotCache``): a static source has no loads to report."""

    def __init__(self) -> None:
        self.source: RefreshedSnapshots | None = None

    def collect(self) -> Iterator[Metric]:
        src = self.source
        if src is None:
            return
        ready = bool(src.ready)
        yield GaugeMetricFamily("loraplex_registry_snapshot_ready", "1 once a complete registry snapshot is held",
                                value=1 if ready else 0)
        if ready:
            yield GaugeMetricFamily("loraplex_registry_snapshot_version", "Registry version of the held snapshot",
                                    value=src.current.version)
            yield GaugeMetricFamily("loraplex_registry_snapshot_age_seconds",
                                    "Seconds since the held snapshot was last confirmed current", value=src.age_s)
            yield GaugeMetricFamily("loraplex_registry_snapshot_tenants", "Tenants in the held snapshot",
                                    value=len(src.current.tenants))
        yield GaugeMetricFamily("loraplex_registry_snapshot_load_seconds", "Duration of the last successful load",
                                value=src.last_load_s)
        yield CounterMetricFamily("loraplex_registry_refresh_failures", "Snapshot refreshes that failed",
                                  value=src.failures)
        loads = CounterMetricFamily("loraplex_registry_snapshot_loads", "Successful snapshot loads by kind",
                                    labels=["kind"])
        for kind, n in src.loads.items():
            loads.add_metric([kind], n)
        yield loads


class _EjectionCollector:
    """``loraplex_gateway_worker_ejected{worker}``: 1 while outlier detection skips the worker, for
    every worker this replica knows (read from the router when scraped)."""

    def __init__(self, router: Any, cap: LabelCap) -> None:
        self.router = router
        self.cap = cap

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily("loraplex_gateway_worker_ejected", "1 while this replica's outlier detection "
                                  "ejects the worker (consecutive failures or timeouts)", labels=["worker"])
        ejected = self.router.outliers.ejections()
        for w in self.router.workers():
            gauge.add_metric([self.cap(w.id)], 1 if w.id in ejected else 0)
        yield gauge


class GatewayMetrics:
    def __init__(self, max_tenants: int = 200, max_adapters: int = 500, max_workers: int = 100) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.tenant_cap = LabelCap(max_tenants)
        self.adapter_cap = LabelCap(max_adapters)
        self.worker_cap = LabelCap(max_workers)
        r = self.registry
        self._series: dict[tuple[str, str], _Series] = {}
        r.register(_RequestCollector(self._series))
        self.rate_limited = Counter("loraplex_gateway_rate_limited", "429 answers by tenant and reason",
                                    ["tenant", "reason"], registry=r)
        self.ttft = Histogram("loraplex_gateway_ttft_seconds",
                              "Streaming: time from request arrival to the first token sent to the client",
                              ["tenant", "adapter"], registry=r,
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.upstream_failures = Counter("loraplex_gateway_upstream_failures", "Worker attempts that failed",
                                         ["worker"], registry=r)
        self.ejections = Counter("loraplex_gateway_worker_ejections", "Times outlier detection ejected a worker, "
                                 "by the failure that did it", ["worker", "reason"], registry=r)
        self.routes = Counter("loraplex_gateway_route_requests", "Requests by the API route the client called "
                              "(chat, completions, responses) and status class", ["route", "code"], registry=r)
        self.route_decisions = Counter("loraplex_gateway_route_decisions", "Routing decisions by why the first "
                                       "worker was first: prefix, continuation, affinity, load "
                                       "(gateway.prefix_routes)", ["reason"], registry=r)
        self._routed = {reason: self.route_decisions.labels(reason) for reason in REASONS}
        self.inflight = Gauge("loraplex_gateway_inflight", "Requests in flight in this replica", registry=r)
        self.workers = Gauge("loraplex_gateway_workers", "Workers this replica routes to (fresh residency reports, "
                             "or static URLs)", registry=r)
        self.redis_up: Gauge | None = None
        """Registered by ``track_redis`` when the limiter uses Redis."""
        self.gateways: Gauge | None = None
        """Registered by ``track_gateways`` when the limiter uses Redis."""
        self.loop_lag = Histogram(
            "loraplex_gateway_event_loop_lag_seconds",
            f"How late the event loop ran a timer due every {LOOP_LAG_INTERVAL_S * 1000:g} ms: "
            "the longest any request waited behind other work", registry=r, buckets=LOOP_LAG_BUCKETS)
        self.canary_decisions = Counter("loraplex_canary_decisions", "Canary judge decisions by binding: start, "
                                        "step, promote, abort", ["tenant", "alias", "decision"], registry=r)
        self.canary_judge = Gauge("loraplex_canary_judge_leader", "1 while this replica is the acting canary judge",
                                  registry=r)
        self.usage_pending: Gauge | None = None
        """The usage ledger's metrics, registered by ``track_usage`` when this replica keeps one."""
        self.usage_flush_failures: Counter | None = None
        self.usage_dropped: Counter | None = None
        self._usage_written_at = time.time()
        self._snapshots = _SnapshotCollector()
        r.register(self._snapshots)
        self._children: dict[tuple[str, str, int], tuple[_Series, str]] = {}

    def _labels(self, tenant: str, adapter: str, status: int) -> tuple[_Series, str]:
        key = (tenant, adapter, status)
        hit = self._children.get(key)
        if hit is None:
            ta = (self.tenant_cap(tenant), self.adapter_cap(adapter))
            series = self._series.get(ta)
            if series is None:
                series = self._series[ta] = _Series()
            hit = (series, status_class(status))
            if len(self._children) < 100_000:
                self._children[key] = hit
        return hit

    def observe(self, tenant: str, adapter: str, status: int, seconds: float, prompt_tokens: int,
                completion_tokens: int, cached_tokens: int = 0) -> None:
        """One finished request; ``cached_tokens``: of its ``prompt_tokens``, those the worker's
        prefix cache supplied (``usage.prompt_tokens_details.cached_tokens``)."""
        s, klass = self._labels(tenant or "-", adapter or "-", status)
        s.by_status[klass] = s.by_status.get(klass, 0) + 1
        s.latency[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        s.latency_sum += seconds
        s.prompt += prompt_tokens
        s.completion += completion_tokens
        s.cached += cached_tokens
        if status >= 400:
            s.errors += 1

    def route(self, route: str, status: int) -> None:
        self.routes.labels(route, status_class(status)).inc()

    def routed(self, reason: str) -> None:
        self._routed[reason].inc()

    def first_token(self, tenant: str, adapter: str, seconds: float) -> None:
        self.ttft.labels(self.tenant_cap(tenant or "-"), self.adapter_cap(adapter or "-")).observe(seconds)

    def upstream_failure(self, worker: str) -> None:
        self.upstream_failures.labels(self.worker_cap(worker)).inc()

    def ejected(self, worker: str, reason: str) -> None:
        self.ejections.labels(self.worker_cap(worker), reason).inc()

    def track_ejections(self, router: Any) -> None:
        """Expose which of ``router``'s workers are ejected now (``gateway.outliers``)."""
        self.registry.register(_EjectionCollector(router, self.worker_cap))

    def track_redis(self) -> Gauge:
        if self.redis_up is None:
            self.redis_up = Gauge("loraplex_gateway_redis_up", "1 while the rate limiter reaches Redis (0: on its "
                                  "local fallback), probed every few seconds", registry=self.registry)
        return self.redis_up

    def track_gateways(self) -> Gauge:
        if self.gateways is None:
            self.gateways = Gauge("loraplex_gateway_ratelimit_gateways", "Gateways beating in Redis when it last "
                                  "answered: while Redis is away each admits 1/this of a tenant's limits",
                                  registry=self.registry)
        return self.gateways

    def canary_decision(self, tenant: str, alias: str, decision: str) -> None:
        self.canary_decisions.labels(self.tenant_cap(tenant), self.adapter_cap(alias), decision).inc()

    def track_usage(self) -> None:
        """Register the usage ledger's metrics (``gateway.usage_ledger``; idempotent)."""
        if self.usage_pending is not None:
            return
        r = self.registry
        self.usage_pending = Gauge("loraplex_gateway_usage_pending_buckets", "Usage ledger buckets waiting for the "
                                   "registry database (written at the next flush)", registry=r)
        self.usage_flush_failures = Counter("loraplex_gateway_usage_flush_failures", "Usage ledger flushes that "
                                            "failed (retried at the next interval)", registry=r)
        self.usage_dropped = Counter("loraplex_gateway_usage_dropped_buckets", "Usage ledger buckets dropped: "
                                     "more waited for the database than usage_max_pending_buckets", registry=r)
        age = Gauge("loraplex_gateway_usage_last_flush_age_seconds", "Seconds since the usage ledger last flushed "
                    "successfully (since the replica started before the first)", registry=r)
        self._usage_written_at = time.time()
        age.set_function(lambda: time.time() - self._usage_written_at)

    def usage_flushed(self, pending: int, failed: bool, dropped: int, at: float | None) -> None:
        """After a usage ledger flush (``gateway.usage_ledger.LedgerMetrics``)."""
        self.track_usage()
        assert self.usage_pending is not None and self.usage_flush_failures is not None
        assert self.usage_dropped is not None
        self.usage_pending.set(pending)
        if failed:
            self.usage_flush_failures.inc()
        if dropped:
            self.usage_dropped.inc(dropped)
        if at is not None:
            self._usage_written_at = at

    def limited(self, tenant: str, reason: str) -> None:
        self.rate_limited.labels(self.tenant_cap(tenant), reason).inc()

    def observe_snapshots(self, source: RefreshedSnapshots) -> None:
        """Report this snapshot source's version, age, loads and failures."""
        self._snapshots.source = source

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def watch_loop_lag(self, interval_s: float = LOOP_LAG_INTERVAL_S) -> None:
        """Observe, every ``interval_s``, how much later than due the loop woke this task: a
        synchronous stretch of work (a snapshot rebuild, an admin write's ORM work) shows here
        whatever the request mix."""
        loop = asyncio.get_running_loop()
        observe = self.loop_lag.observe
        while True:
            due = loop.time() + interval_s
            await asyncio.sleep(interval_s)
            observe(max(0.0, loop.time() - due))


CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


def metrics_app(metrics: GatewayMetrics, before_render: Callable[[], None] | None = None) -> Any:
    """The internal metrics port's ASGI app: ``GET /metrics``, 404 for anything else.

    ``before_render`` refreshes gauges read at scrape time."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/metrics" and scope["method"] in ("GET", "HEAD"):
            if before_render is not None:
                before_render()
            status, ctype, body = 200, CONTENT_TYPE, metrics.render()
        else:
            status, ctype, body = 404, b"text/plain; charset=utf-8", b"not found\n"
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return app
