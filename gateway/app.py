"""The gateway application: ``create_app(settings, ...) -> GatewayApp`` (a Starlette app).

The hot routes (``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``) are raw ASGI
handlers (no Request/Response objects) on the request path (``gateway.request_path.Gateway``),
dispatched before Starlette's middleware and router. The rest (``/v1/models``, the stored
responses, health, readiness, the registry admin API under ``/admin``) are ordinary Starlette
routes; ``/metrics`` is a separate app (``app.metrics_app``) for the internal metrics port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.types import Lifespan

from gateway import responses_api, usage_api
from gateway.canary_samples import MemorySamples, RedisSamples
from gateway.console_sources import GatewayConsoleSources
from gateway.errors import GatewayError, public_message
from gateway.live_stats import LiveStats
from gateway.metrics import metrics_app
from gateway.outliers import Outliers, SharedEjections
from gateway.ratelimit import Limiter, LocalLimiter, RedisLimiter
from gateway.request_path import Gateway, access_log, flush_access_log
from gateway.route_errors import exception_handlers
from gateway.router import Router
from gateway.snapshot_source import RefreshedSnapshots, SnapshotSource
from gateway.traffic import AdapterTraffic
from gateway.usage_ledger import LedgerFlusher, UsageLedger
from gateway.worker_client import WorkerClient
from loraplex.residency import RedisResidency, ResidencyStore, process_residency
from loraplex.settings import Settings
from registry.snapshot import RegistrySnapshot, TenantView

log = logging.getLogger("loraplex.gateway")


async def _purge_responses(store: Any, every_s: float = 60.0, batch: int = 500) -> None:
    """Remove expired stored Responses, ``batch`` rows a statement, every replica (idempotent)."""
    while True:
        await asyncio.sleep(every_s * random.uniform(0.5, 1.0))
        try:
            removed = batch
            while removed == batch:  # another batch while the last one was full
                removed = await store.purge(batch)
        except Exception as exc:
            log.warning("removing expired responses failed (retried): %s", exc)


async def _maintain_usage(store: Any, every_s: float = 60.0) -> None:
    """Roll the usage ledger up and prune it (``registry.usage``), every replica in turn: the
    database lets one work at a time (idempotent and safe concurrently besides)."""
    while True:
        await asyncio.sleep(every_s * random.uniform(0.5, 1.0))
        try:
            await store.maintain()
        except Exception as exc:
            log.warning("usage ledger rollup or pruning failed (retried): %s", exc)


async def _probe_workers(router: Router, every_s: float) -> None:
    """Reload the live workers on a timer too, not only when requests come: an idle gateway's
    ``loraplex_gateway_workers`` drops a worker that stopped reporting (``refresh`` keeps the last
    set while the residency store is unreachable)."""
    while True:
        await asyncio.sleep(every_s)
        if router.due():
            await router.refresh()



_HOT_ROUTES = {"/v1/chat/completions": True, "/v1/completions": False}
"""The two hot routes (path -> chat?)."""
SERVED_PATHS = ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses",
                "GET|DELETE /v1/responses/{id}", "GET /v1/responses/{id}/input_items", "GET /v1/models",
                "GET /v1/models/{model}", "GET /v1/usage")
"""What a client may call (an unknown path's 404 lists them)."""


class GatewayApp(Starlette):
    """The gateway's Starlette app; the hot routes go straight to ``Gateway.completions`` and
    ``Gateway.responses`` (raw ASGI handlers that answer every error themselves), skipping the
    middleware stack and the router. The other routes raise, and ``gateway.route_errors``
    answers."""

    def __init__(self, gateway: Gateway, metrics: Any, *, routes: list[Any], lifespan: Lifespan[Starlette],
                 canary_judge: Any = None, usage_flusher: LedgerFlusher | None = None) -> None:
        super().__init__(routes=routes, lifespan=lifespan, exception_handlers=exception_handlers(SERVED_PATHS))
        self.gateway = gateway
        self.metrics_app = metrics
        """``/metrics`` for the internal metrics port (``gateway.http_edge.metrics_config``), never this app."""
        self.state.gateway = gateway
        self.state.canary_judge = canary_judge
        self.state.usage_flusher = usage_flusher

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            chat = _HOT_ROUTES.get(scope["path"])
            if chat is not None:
                await self.gateway.completions(scope, receive, send, chat=chat)
                return
            if scope["path"] == "/v1/responses":
                await self.gateway.responses(scope, receive, send)
                return
        else:
            await super().__call__(scope, receive, send)
            return
        answered = False

        async def sending(message: Any) -> None:
            nonlocal answered
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True
            await send(message)

        try:
            await super().__call__(scope, receive, sending)
        except Exception:
            if not answered:
                raise
            # Answered already (``server_error``'s 500, logged): Starlette re-raises for the server,
            # which would drop the keep-alive connection and fail the client's next request on it.


def _created(snapshot: RegistrySnapshot, tenant: TenantView, name: str) -> int:
    """``/v1/models``' ``created`` of a name: when its alias's active version, or the base model, was
    registered (unix seconds; 0 for an alias with no active version)."""
    binding = tenant.bindings.get(name)
    if binding is not None:
        return binding.active.created if binding.active is not None else 0
    base = snapshot.base_models.get(name)
    return base.created if base is not None else 0


def redis_client(settings: Settings) -> Any:
    """The replica's one Redis client (limiter, residency, adapter traffic)."""
    import redis.asyncio as aioredis
    from redis.utils import HIREDIS_AVAILABLE

    if not HIREDIS_AVAILABLE:
        log.warning("hiredis is not installed: Redis replies are parsed in Python (slower)")
    return aioredis.from_url(settings.redis_url, socket_timeout=0.5, socket_connect_timeout=0.5,
                             health_check_interval=0, max_connections=256)


def _snapshot_source(settings: Settings) -> tuple[SnapshotSource, RefreshedSnapshots | None]:
    """The snapshot source ``settings`` name, and its refresh numbers when it is the live registry."""
    if settings.registry_snapshot_file:
        from gateway.snapshot_file import FileSnapshotSource

        return FileSnapshotSource(settings.registry_snapshot_file), None
    from registry.cache import SnapshotCache  # the live registry (lazy: keeps startup light)

    cache = SnapshotCache(settings)
    return cache, cache


def registry_admin(settings: Settings, router: Router, client: WorkerClient,
                   live: LiveStats) -> tuple[Any, Any] | tuple[None, None]:
    """The registry admin API (``registry.admin_api``) behind the activation gate, with the console
    (fleet and live numbers from ``router`` and ``live``), and its service; (None, None) in an
    install without it."""
    try:
        from registry.admin_api import admin_app
        from registry.service import RegistryService
    except ImportError:
        log.info("registry admin API not available; /admin is not mounted")
        return None, None
    from gateway.activation import ActivationGate

    service = RegistryService(settings)
    return admin_app(service, settings, gate=ActivationGate(settings, router, client),
                     console=GatewayConsoleSources(router.residency, live, router.outliers)), service


def _run_task(stack: contextlib.AsyncExitStack, work: Coroutine[Any, Any, None], name: str,
              then: Callable[[], Awaitable[Any]] | None = None) -> None:
    """Run ``work`` as a task until ``stack`` closes: then it is cancelled (and ``then`` awaited)."""
    task = asyncio.create_task(work, name=name)

    async def stop() -> None:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        if then is not None:
            await then()

    stack.push_async_callback(stop)


async def _flush_access_handlers() -> None:
    for handler in access_log.handlers:
        handler.flush()


def create_app(settings: Settings, *, snapshots: SnapshotSource | None = None, limiter: Limiter | None = None,
               residency: ResidencyStore | None = None, http_client: WorkerClient | None = None,
               mount_admin: bool = True, usage_store: Any = None) -> GatewayApp:
    """The gateway app. Anything not passed is built from ``settings``:

    * ``snapshots``: ``registry.cache.SnapshotCache`` over the registry database (or a
      ``FileSnapshotSource`` when ``registry_snapshot_file`` is set); only the one built here
      reports its loads on ``/metrics``;
    * ``limiter``: ``RedisLimiter`` (with a local fallback) when ``redis_url`` is set,
      else the in-process ``LocalLimiter``;
    * ``residency``: ``RedisResidency`` when ``redis_url`` is set, else the process table;
    * ``http_client``: the ``WorkerClient`` (pooled aiohttp) for every call to a worker;
    * ``usage_store``: where the usage ledger goes (``registry.usage.UsageStore``): built over the
      registry database when the live registry is (``snapshots`` not passed); None otherwise, or
      with ``usage_flush_interval_s`` 0: no ledger.

    Components passed in are started/stopped by their owner, except the snapshot source,
    whose ``start()``/``stop()`` the app calls in its lifespan.
    """
    redis = redis_client(settings) if settings.redis_url else None
    refreshed: RefreshedSnapshots | None = None
    if snapshots is None:
        snapshots, refreshed = _snapshot_source(settings)
        if usage_store is None and not settings.registry_snapshot_file:
            from registry.usage import UsageStore

            usage_store = UsageStore(settings)
    source: SnapshotSource = snapshots
    own_limiter = limiter is None
    if limiter is None:
        limiter = RedisLimiter(redis, settings.redis_prefix, fail_mode=settings.ratelimit_fail_mode,
                               lease_ttl_s=settings.ratelimit_lease_ttl_s) \
            if redis is not None else LocalLimiter(lease_ttl_s=settings.ratelimit_lease_ttl_s)
    if residency is None:
        residency = RedisResidency(redis, settings.redis_prefix) if redis is not None else process_residency()
    own_client = http_client is None
    if http_client is None:
        http_client = WorkerClient(settings.worker_secret)
    router = Router(residency, candidates=settings.route_candidates, load_factor=settings.route_load_factor,
                    static_urls=settings.worker_urls,
                    cooldown_s=max(2.0, settings.worker_report_ttl_s), report_ttl_s=settings.worker_report_ttl_s,
                    outliers=Outliers(settings.worker_eject_failures, settings.worker_eject_base_s,
                                      settings.worker_eject_max_s,
                                      shared=SharedEjections(redis, settings.redis_prefix) if redis is not None else None))
    responses_store = None
    usage_reader = None
    if not settings.registry_snapshot_file:  # the registry database keeps stored Responses
        from registry.responses import ResponseStore
        from registry.usage_query import UsageReader

        responses_store = ResponseStore(settings)
        usage_reader = UsageReader(settings)  # and the usage ledger, each tenant's own at /v1/usage
    ledger = UsageLedger() if usage_store is not None and settings.usage_flush_interval_s > 0 else None
    traffic = AdapterTraffic(redis, settings.redis_prefix) if redis is not None else None
    canary = RedisSamples(redis, settings.redis_prefix) if redis is not None else MemorySamples()
    gw = Gateway(settings, source, limiter, router, http_client,
                 live=LiveStats(redis, settings.redis_prefix) if redis is not None else None, traffic=traffic,
                 canary=canary, responses_store=responses_store, ledger=ledger, refreshed=refreshed)
    usage_flusher = None
    if ledger is not None:
        usage_flusher = LedgerFlusher(ledger, usage_store.write, interval_s=settings.usage_flush_interval_s,
                                      max_pending=settings.usage_max_pending_buckets, metrics=gw.metrics)

    def model_entries(request: Request) -> list[dict[str, Any]]:
        """The models the caller's tenant may name, in ``/v1/models``' shape (GatewayError: refused)."""
        snapshot = gw._snapshot()
        tenant = gw.auth.tenant(request.headers.get("authorization"), snapshot)
        return [{"id": name, "object": "model", "created": _created(snapshot, tenant, name),
                 "owned_by": tenant.slug if name in tenant.bindings else "loraplex"}
                for name in gw.resolver.models(snapshot, tenant)]

    async def models(request: Request) -> Response:
        return Response(orjson.dumps({"object": "list", "data": model_entries(request)}),
                        media_type="application/json")

    async def model(request: Request) -> Response:
        """One entry of the caller's ``/v1/models``; any other id (another tenant's alias included)
        is the same 404."""
        name = request.path_params["model"]
        found = [m for m in model_entries(request) if m["id"] == name]
        if not found:
            raise GatewayError(404, f"The model '{name}' does not exist or you do not have access to it.",
                               code="model_not_found")
        return Response(orjson.dumps(found[0]), media_type="application/json")

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        """Ready = this replica can serve its API (a registry snapshot is loaded, and current for the
        live registry). Workers are reported, not required: during a worker outage the admin API
        stays in the Service."""
        snap: RegistrySnapshot | None = None
        try:
            problem = source.readiness_problem()
            if problem is None:
                snap = source.current
                problem = None if snap is not None else "no registry snapshot yet"
        except Exception as exc:
            problem = f"registry snapshot unavailable: {type(exc).__name__}"
        if problem:  # the database's error text (its host and port) stays in the registry cache's log
            problem = public_message(None, problem, "the registry snapshot is not loaded or not current")
            return JSONResponse({"status": "not ready", "problems": [problem]}, status_code=503)
        await router.refresh()
        workers = len(router.workers())
        body: dict[str, Any] = {"status": "ready", "registry_version": snap.version if snap is not None else None,
                                "workers": workers}
        if not workers:
            body["warnings"] = ["no live worker: completions answer 503 no_worker until one reports"]
        return JSONResponse(body)

    admin, admin_service = registry_admin(settings, router, http_client, gw.live) if mount_admin else (None, None)
    judge = None
    if admin_service is not None and settings.canary_judge_interval_s > 0 and not settings.registry_snapshot_file:
        from gateway.canary_judge import CanaryJudge

        judge = CanaryJudge(admin_service, gw.canary, gw.metrics, settings.canary_judge_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        """Start what serves, each pushing its own stop: the stack runs them in reverse after the
        last request (the background tasks first, the usage ledger drained and the adapter traffic
        flushed after them), then closes what ``create_app`` built."""
        async with contextlib.AsyncExitStack() as stack:
            if usage_store is not None:
                stack.push_async_callback(usage_store.close)
            if usage_reader is not None:
                stack.push_async_callback(usage_reader.close)
            if responses_store is not None:
                stack.push_async_callback(responses_store.close)
            if admin_service is not None:
                stack.push_async_callback(admin_service.close)
            if redis is not None:
                stack.push_async_callback(redis.aclose)
            if own_client:
                stack.push_async_callback(http_client.close)
            await source.start()
            stack.push_async_callback(source.stop)
            stack.push_async_callback(gw.prompts.close)
            await router.refresh()
            if own_limiter:
                await limiter.start()  # the Redis limiter's keepalive: held leases renewed, Redis probed
                stack.push_async_callback(limiter.close)
            _run_task(stack, flush_access_log(), "access-log-flush", then=_flush_access_handlers)
            if traffic is not None:
                _run_task(stack, traffic.run(), "adapter-traffic", then=_flush_traffic)
            if usage_flusher is not None:  # the requests are over: their usage is written before the end
                _run_task(stack, usage_flusher.run(), "usage-flush", then=_drain_usage)
            _run_task(stack, gw.metrics.watch_loop_lag(), "loop-lag")
            _run_task(stack, canary.run(), "canary-samples")
            if responses_store is not None:
                _run_task(stack, _purge_responses(responses_store), "responses-purge")
            if judge is not None:
                _run_task(stack, judge.run(), "canary-judge")
            _run_task(stack, gw.live.publish_forever(), "live-numbers")
            _run_task(stack, _probe_workers(router, max(1.0, settings.worker_report_ttl_s)), "workers-probe")
            if usage_flusher is not None:
                _run_task(stack, _maintain_usage(usage_store), "usage-rollup")
            yield

    async def _flush_traffic() -> None:
        if traffic is not None:
            with contextlib.suppress(Exception):  # Redis away: these counts are lost, the shutdown goes on
                await traffic.flush()

    async def _drain_usage() -> None:
        if usage_flusher is not None:
            await usage_flusher.drain(timeout_s=max(2.0, min(10.0, settings.usage_flush_interval_s)))

    routes: list[Any] = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        *responses_api.routes(gw, gw.responses_store),
        *(usage_api.routes(gw, usage_reader) if usage_reader is not None else ()),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
    ]
    if admin is not None:
        routes.append(Mount("/admin", app=admin))

    def refresh_gauges() -> None:
        gw.metrics.inflight.set(router.inflight())
        gw.metrics.workers.set(len(router.workers()))
        if isinstance(limiter, RedisLimiter):
            gw.metrics.track_redis().set(0 if limiter.degraded else 1)
            gw.metrics.track_gateways().set(limiter.gateways)
        gw.metrics.canary_judge.set(1 if judge is not None and judge.leader else 0)

    return GatewayApp(gw, metrics_app(gw.metrics, refresh_gauges), routes=routes, lifespan=lifespan,
                      canary_judge=judge, usage_flusher=usage_flusher)
