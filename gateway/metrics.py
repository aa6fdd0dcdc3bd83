"""Prometheus metrics per tenant and per adapter version, with bounded label cardinality.

Each label dimension admits at most ``max_values`` distinct values; later ones are
folded into ``"other"``, so thousands of tenants or adapter versions cannot blow up
the time-series count. Child metrics are cached so the request path does one dict
lookup per metric.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

OTHER = "other"


class LabelCap:
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


def status_class(status: int) -> str:
    return f"{status // 100}xx" if status not in (401, 403, 404, 413, 429, 499, 503) else str(status)


class GatewayMetrics:
    def __init__(self, max_tenants: int = 200, max_adapters: int = 500, max_workers: int = 100) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.tenant_cap = LabelCap(max_tenants)
        self.adapter_cap = LabelCap(max_adapters)
        self.worker_cap = LabelCap(max_workers)
        r = self.registry
        self.requests = Counter("loraplex_gateway_requests", "Requests by tenant, adapter version and status",
                                ["tenant", "adapter", "status"], registry=r)
        self.tokens = Counter("loraplex_gateway_tokens", "Tokens by tenant, adapter version and kind",
                              ["tenant", "adapter", "kind"], registry=r)
        self.errors = Counter("loraplex_gateway_errors", "Failed requests (4xx/5xx) by tenant and adapter",
                              ["tenant", "adapter"], registry=r)
        self.rate_limited = Counter("loraplex_gateway_rate_limited", "429 answers by tenant and reason",
                                    ["tenant", "reason"], registry=r)
        self.latency = Histogram("loraplex_gateway_request_seconds", "Request latency by tenant and adapter",
                                 ["tenant", "adapter"], registry=r,
                                 buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120))
        self.ttft = Histogram("loraplex_gateway_ttft_seconds",
                              "Streaming: time from request arrival to the first token sent to the client",
                              ["tenant", "adapter"], registry=r,
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.upstream_failures = Counter("loraplex_gateway_upstream_failures", "Worker attempts that failed",
                                         ["worker"], registry=r)
        self.inflight = Gauge("loraplex_gateway_inflight", "Requests in flight in this replica", registry=r)
        self._children: dict[tuple, tuple] = {}

    def _labels(self, tenant: str, adapter: str, status: int) -> tuple:
        key = (tenant, adapter, status)
        hit = self._children.get(key)
        if hit is None:
            t, a = self.tenant_cap(tenant), self.adapter_cap(adapter)
            hit = (self.requests.labels(t, a, status_class(status)), self.latency.labels(t, a),
                   self.tokens.labels(t, a, "prompt"), self.tokens.labels(t, a, "completion"),
                   self.errors.labels(t, a))
            if len(self._children) < 100_000:
                self._children[key] = hit
        return hit

    def observe(self, tenant: str, adapter: str, status: int, seconds: float, prompt_tokens: int,
                completion_tokens: int) -> None:
        req, lat, ptok, ctok, err = self._labels(tenant or "-", adapter or "-", status)
        req.inc()
        lat.observe(seconds)
        if prompt_tokens:
            ptok.inc(prompt_tokens)
        if completion_tokens:
            ctok.inc(completion_tokens)
        if status >= 400:
            err.inc()

    def first_token(self, tenant: str, adapter: str, seconds: float) -> None:
        self.ttft.labels(self.tenant_cap(tenant or "-"), self.adapter_cap(adapter or "-")).observe(seconds)

    def upstream_failure(self, worker: str) -> None:
        self.upstream_failures.labels(self.worker_cap(worker)).inc()

    def limited(self, tenant: str, reason: str) -> None:
        self.rate_limited.labels(self.tenant_cap(tenant), reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
