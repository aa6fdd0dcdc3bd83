"""Prometheus metrics of one worker, in its own registry (several workers may share a process)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class WorkerMetrics:
    def __init__(self, engine: Any, worker_id: str) -> None:
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
        self.ttft_seconds = Histogram("loraplex_worker_time_to_first_token_seconds",
                                      "Arrival to first sampled token", list(labels),
                                      buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.prompt_tokens = Counter("loraplex_worker_prompt_tokens", "Prompt tokens of requests that "
                                     "produced a first token", list(labels), registry=r).labels(**labels)
        self.generation_tokens = Counter("loraplex_worker_generation_tokens", "Tokens sampled",
                                         list(labels), registry=r).labels(**labels)
        self.batched_tokens = Counter("loraplex_worker_step_tokens", "Tokens run through the model "
                                      "(prefill, recompute and decode)", list(labels), registry=r).labels(**labels)
        self._requests = Counter("loraplex_worker_requests", "Finished requests by outcome",
                                 [*labels, "outcome"], registry=r)
        self._labels = labels

    def observe_step(self, seconds: float, tokens: int) -> None:
        self.step_seconds.observe(seconds)
        self.batched_tokens.inc(tokens)

    def observe_first_token(self, seconds: float, prompt_tokens: int) -> None:
        self.ttft_seconds.observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)

    def add_generated(self, n: int) -> None:
        self.generation_tokens.inc(n)

    def request_done(self, outcome: str) -> None:
        self._requests.labels(outcome=outcome, **self._labels).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
