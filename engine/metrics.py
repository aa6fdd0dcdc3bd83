"""Prometheus metrics of one worker, in its own registry (several workers may share a process).

Adapter tiers (with LoRA on; every series carries ``worker``):

* ``loraplex_worker_adapters_resident{tier}`` gauge: ``device`` (in a slot), ``host`` (host
  memory), ``disk`` (local disk cache);
* ``loraplex_worker_adapter_loads_total{tier}`` and ``loraplex_worker_adapter_load_seconds{tier}``
  histogram: ``source`` (download into the disk cache and read), ``disk`` (local read into
  host memory), ``host`` (host -> device slot copy);
* ``loraplex_worker_adapter_evictions_total{tier}``: ``device`` (slot reused), ``host``
  (dropped from host memory), ``disk`` (deleted from the disk cache to stay within
  ``adapter_cache_max_bytes``);
* ``loraplex_worker_adapter_hits_total{tier}`` (``device``, ``host``),
  ``loraplex_worker_adapter_misses_total``, ``loraplex_worker_adapter_load_failures_total``;
* ``loraplex_worker_adapter_requests_total{cache}``: per request, ``warm`` (hit), ``cold``
  (miss), ``base``;
* ``loraplex_worker_adapter_arrivals_total{tier}``: per adapter request, where its adapter was
  when it arrived: ``device``, ``host``, ``loading`` (a load already under way) or ``absent``
  (this request starts a load): the measured side of ``loraplex plan``'s hit ratios;
* ``loraplex_worker_time_to_first_token_seconds{cache}``: ``warm`` (adapter on device or in
  host memory at arrival), ``cold`` (had to be loaded), ``base`` (no adapter).

Prefix cache, per adapter (``adapter``: ``adapter_metric_label``, the first 12 hex digits of the
version's digest, or ``base``: the worker's ``/metrics`` is open and names no tenant or adapter, and
the registry maps a digest back to its version; at most ``MAX_ADAPTER_LABELS`` values, later ones
``other``, as the gateway caps its labels): ``loraplex_worker_adapter_prompt_tokens_total`` (prompt tokens of requests that produced
a first token) and ``loraplex_worker_adapter_cached_prompt_tokens_total`` (those whose KV came from
the prefix cache): the hit ratio is cached / prompt.

Structured outputs: ``loraplex_worker_grammar_compiles_total`` (schemas compiled) and
``loraplex_worker_grammar_refused_total`` (compiles past the CPU budget: a tenant sending
schemas too complex to serve).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from loraplex.label_cap import LabelCap
from loraplex.wire import AdapterRef

if TYPE_CHECKING:
    from engine.grammar import Grammars
    from engine.lora.manager import AdapterManager
    from engine.lora.runtime import LoRARuntime

MAX_ADAPTER_LABELS = 500
"""Distinct ``adapter`` label values one worker exports (the gateway's default cap too)."""
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def adapter_metric_label(adapter: AdapterRef | None) -> str:
    """The worker's label of an adapter version: its digest's first 12 hex digits (its registry id where
    a caller sent no digest), ``base`` for none. Never the name, which carries the tenant's words."""
    if adapter is None:
        return "base"
    return f"sha256:{adapter.sha256[:12]}" if adapter.sha256 else f"id:{adapter.id[:36]}"


class MetricsSource(Protocol):
    """What the metrics read from their engine (``engine.engine.Engine``)."""

    def load(self) -> dict[str, int]: ...

    @property
    def grammars(self) -> Grammars | None:
        """Its grammar compiles (None: no ``grammar`` counters)."""

    @property
    def lora_runtime(self) -> LoRARuntime | None:
        """Its adapters (None: LoRA off, no adapter series)."""


class WorkerMetrics:
    def __init__(self, engine: MetricsSource, worker_id: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        labels = {"worker": worker_id}
        load = engine.load

        def gauge(name: str, doc: str, key: str) -> None:
            g = Gauge(name, doc, list(labels), registry=r)
            g.labels(**labels).set_function(lambda: load()[key])

        gauge("loraplex_worker_queue_depth", "Requests waiting for admission", "queue_depth")
        gauge("loraplex_worker_running", "Sequences in the running batch", "running")
        gauge("loraplex_worker_kv_blocks_used", "KV cache blocks in use", "kv_blocks_used")
        gauge("loraplex_worker_kv_blocks_total", "KV cache blocks in the pool", "kv_blocks_total")
        self.step_seconds = Histogram("loraplex_worker_step_seconds", "Wall time of one engine step",
                                      list(labels), buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self._ttft = Histogram("loraplex_worker_time_to_first_token_seconds",
                               "Arrival to first sampled token, by adapter cache state at arrival "
                               "(warm, cold, base)", [*labels, "cache"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_seconds = self._ttft.labels(cache="base", **labels)
        self.prompt_tokens = Counter("loraplex_worker_prompt_tokens", "Prompt tokens of requests that "
                                     "produced a first token", list(labels), registry=r).labels(**labels)
        self.generation_tokens = Counter("loraplex_worker_generation_tokens", "Tokens sampled",
                                         list(labels), registry=r).labels(**labels)
        self.batched_tokens = Counter("loraplex_worker_step_tokens", "Tokens run through the model "
                                      "(prefill, recompute and decode)", list(labels), registry=r).labels(**labels)
        self._adapter_cap = LabelCap(MAX_ADAPTER_LABELS)
        self._adapter_prompt = Counter("loraplex_worker_adapter_prompt_tokens", "Prompt tokens of requests that "
                                       "produced a first token, by adapter (base: none)", [*labels, "adapter"],
                                       registry=r)
        self._adapter_cached = Counter("loraplex_worker_adapter_cached_prompt_tokens", "Prompt tokens whose KV "
                                       "came from the prefix cache, by adapter (hit ratio: these / prompt tokens)",
                                       [*labels, "adapter"], registry=r)
        self._requests = Counter("loraplex_worker_requests", "Finished requests by outcome",
                                 [*labels, "outcome"], registry=r)
        self._labels = labels
        self._arrivals = Counter("loraplex_worker_adapter_requests", "Requests by adapter cache state at "
                                 "arrival: warm (hit: device or host), cold (miss: had to load), base",
                                 [*labels, "cache"], registry=r)
        self._tiers = Counter("loraplex_worker_adapter_arrivals", "Adapter requests by where their adapter "
                              "was at arrival: device, host, loading, absent", [*labels, "tier"], registry=r)
        grammars = engine.grammars
        if grammars is not None:
            r.register(_GrammarCollector(grammars, worker_id))
        rt = engine.lora_runtime
        if rt is not None:
            manager = rt.manager
            self._load_seconds = Histogram("loraplex_worker_adapter_load_seconds",
                                           "Adapter load latency by tier (source, disk, host)",
                                           [*labels, "tier"], buckets=_LATENCY_BUCKETS, registry=r)
            manager.on_load = self.observe_adapter_load
            r.register(_LoRACollector(manager, worker_id))

    def observe_arrival(self, cache: str, tier: str | None = None) -> None:
        """One request arrived; ``cache`` is ``warm``/``cold`` for adapter requests, ``base`` otherwise;
        ``tier``: its adapter's state then (``device``, ``host``, ``loading``, ``absent``)."""
        self._arrivals.labels(cache=cache, **self._labels).inc()
        if tier is not None:
            self._tiers.labels(tier=tier, **self._labels).inc()

    def observe_adapter_load(self, tier: str, seconds: float) -> None:
        self._load_seconds.labels(tier=tier, **self._labels).observe(seconds)

    def observe_step(self, seconds: float, tokens: int) -> None:
        self.step_seconds.observe(seconds)
        self.batched_tokens.inc(tokens)

    def observe_first_token(self, seconds: float, prompt_tokens: int, cache: str = "base") -> None:
        self._ttft.labels(cache=cache, **self._labels).observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)

    def observe_prompt(self, adapter: str, prompt_tokens: int, cached_tokens: int) -> None:
        """A request's prompt was run: ``cached_tokens`` of its ``prompt_tokens`` came from the prefix
        cache. ``adapter``: the version's name, or ``base``."""
        label = self._adapter_cap(adapter)
        self._adapter_prompt.labels(adapter=label, **self._labels).inc(prompt_tokens)
        self._adapter_cached.labels(adapter=label, **self._labels).inc(cached_tokens)

    def add_generated(self, n: int) -> None:
        self.generation_tokens.inc(n)

    def request_done(self, outcome: str) -> None:
        self._requests.labels(outcome=outcome, **self._labels).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _GrammarCollector:
    """Grammar compile counters read from ``engine.grammar.Grammars`` at scrape time."""

    def __init__(self, grammars: Grammars, worker_id: str) -> None:
        self.grammars = grammars
        self.worker = worker_id

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        for name, doc, n in (
            ("loraplex_worker_grammar_compiles", "Response-format grammars compiled", self.grammars.compiles),
            ("loraplex_worker_grammar_refused", "Grammar compiles refused past the CPU budget", self.grammars.refused),
        ):
            fam = CounterMetricFamily(name, doc, labels=["worker"])
            fam.add_metric([self.worker], n)
            yield fam


class _LoRACollector:
    """Adapter tier gauges and counters read from the manager's stats at scrape time."""

    def __init__(self, manager: AdapterManager, worker_id: str) -> None:
        self.manager = manager
        self.worker = worker_id

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        m, w = self.manager, self.worker
        st = m.stats
        resident = GaugeMetricFamily("loraplex_worker_adapters_resident", "Adapters resident per tier",
                                     labels=["worker", "tier"])
        for tier, n in m.resident_counts().items():
            resident.add_metric([w, tier], n)
        yield resident
        for name, doc, values in (
            ("loraplex_worker_adapter_loads", "Adapter loads per tier", st.loads),
            ("loraplex_worker_adapter_evictions", "Adapter evictions per tier", st.evictions),
            ("loraplex_worker_adapter_hits", "Slot requests served from a tier without IO", st.hits),
        ):
            fam = CounterMetricFamily(name, doc, labels=["worker", "tier"])
            for tier, n in values.items():
                fam.add_metric([w, tier], n)
            yield fam
        misses = CounterMetricFamily("loraplex_worker_adapter_misses", "Slot requests that had to load first",
                                     labels=["worker"])
        misses.add_metric([w], st.misses)
        yield misses
        failures = CounterMetricFamily("loraplex_worker_adapter_load_failures", "Adapter loads that failed",
                                       labels=["worker"])
        failures.add_metric([w], st.failures)
        yield failures
