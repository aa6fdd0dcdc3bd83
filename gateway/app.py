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
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from gateway import responses_api, usage_api
from gateway.canary_samples import MemorySamples, RedisSamples
from gateway.console_sources import GatewayConsoleSources
from gateway.errors import GatewayError, from_registry, public_message
from gateway.live_stats import LiveStats
from gateway.metrics import metrics_app
from gateway.outliers import Outliers, SharedEjections
from gateway.ratelimit import Limiter, LocalLimiter, RedisLimiter
from gateway.request_path import Gateway, access_log, flush_access_log
from gateway.router import Router
from gateway.traffic import AdapterTraffic
from gateway.usage_ledger import LedgerFlusher, UsageLedger
from gateway.worker_client import WorkerClient
from loraplex.residency import RedisResidency, ResidencyStore, process_residency
from loraplex.settings import Settings
from registry.errors import RegistryError
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
SERVED_PATHS = ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses",
                "GET|DELETE /v1/responses/{id}", "GET /v1/responses/{id}/input_items", "GET /v1/models",
                "GET /v1/models/{model}", "GET /v1/usage")
"""What a client may call (an unknown path's 404 lists them)."""
"""The two hot routes (path -> chat?)."""


class GatewayApp(Starlette):
    """The gateway's Starlette app; the hot routes go straight to ``Gateway.completions`` and
    ``Gateway.responses`` (raw ASGI handlers that answer every error themselves), skipping the
    middleware stack and the router."""

    gateway: Gateway
    metrics_app: Any
    """``/metrics`` for the internal metrics port (``gateway.http_edge.metrics_config``), never this app."""

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


def _error(status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None) -> Response:
    err = GatewayError(status, message, code=code)
    return Response(err.body(), status_code=status, media_type="application/json", headers=headers)


def _created(snapshot: RegistrySnapshot, tenant: TenantView, name: str) -> int:
    """``/v1/models``' ``created`` of a name: when its alias's active version, or the base model, was
    registered (unix seconds; 0 for an alias with no active version)."""
    binding = tenant.bindings.get(name)
    if binding is not None:
        return binding.active.created if binding.active is not None else 0
    base = snapshot.base_models.get(name)
    return base.created if base is not None else 0


def _redis_client(settings: Settings) -> Any:
    """The replica's one Redis client (limiter, residency, adapter traffic)."""
    import redis.asyncio as aioredis
    from redis.utils import HIREDIS_AVAILABLE

    if not HIREDIS_AVAILABLE:
        log.warning("hiredis is not installed: Redis replies are parsed in Python (slower)")
    return aioredis.from_url(settings.redis_url, socket_timeout=0.5, socket_connect_timeout=0.5,
                             health_check_interval=0, max_connections=256)


def _default_snapshots(settings: Settings) -> Any:
    if settings.registry_snapshot_file:
        from gateway.snapshot_file import FileSnapshotSource

        return FileSnapshotSource(settings.registry_snapshot_file)
    from registry.cache import SnapshotCache  # the live registry (lazy: keeps startup light)

    return SnapshotCache(settings)


def _admin_app(settings: Settings, router: Router, client: WorkerClient,
               live: LiveStats) -> tuple[Any, Any] | tuple[None, None]:
    """The registry admin API (``registry.admin_api``) behind the activation gate, with the console
    (fleet and live numbers from ``router`` and ``live``), and its service."""
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


def create_app(settings: Settings, *, snapshots: Any = None, limiter: Limiter | None = None,
               residency: ResidencyStore | None = None, http_client: WorkerClient | None = None,
               mount_admin: bool = True, usage_store: Any = None) -> GatewayApp:
    """The gateway app. Anything not passed is built from ``settings``:

    * ``snapshots``: ``registry.cache.SnapshotCache`` over the registry database (or a
      ``FileSnapshotSource`` when ``registry_snapshot_file`` is set);
    * ``limiter``: ``RedisLimiter`` (with a local fallback) when ``redis_url`` is set,
      else the in-process ``LocalLimiter``;
    * ``residency``: ``RedisResidency`` when ``redis_url`` is set, else the process table;
    * ``http_client``: the ``WorkerClient`` (pooled aiohttp) for every call to a worker;
    * ``usage_store``: where the usage ledger goes (``registry.usage.UsageStore``): built over the
      registry database when the live registry is (``snapshots`` not passed); None otherwise, or
      with ``usage_flush_interval_s`` 0: no ledger.

    Components passed in are started/stopped by their owner, except the snapshot source,
    whose optional ``start()``/``stop()`` the app calls in its lifespan.
    """
    redis = _redis_client(settings) if settings.redis_url else None
    if snapshots is None:
        snapshots = _default_snapshots(settings)
        if usage_store is None and not settings.registry_snapshot_file:
            from registry.usage import UsageStore

            usage_store = UsageStore(settings)
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
    gw = Gateway(settings, snapshots, limiter, router, http_client)
    gw.metrics.observe_snapshots(snapshots)
    if redis is not None:
        gw.traffic = AdapterTraffic(redis, settings.redis_prefix)
    gw.canary = RedisSamples(redis, settings.redis_prefix) if redis is not None else MemorySamples()
    if not settings.registry_snapshot_file:  # the registry database keeps stored Responses
        from registry.responses import ResponseStore

        gw.responses_store = ResponseStore(settings)
    usage_reader = None
    if not settings.registry_snapshot_file:  # and the usage ledger, each tenant's own at /v1/usage
        from registry.usage_query import UsageReader

        usage_reader = UsageReader(settings)
    usage_flusher = None
    if usage_store is not None and settings.usage_flush_interval_s > 0:
        gw.ledger = UsageLedger()
        gw.metrics.track_usage()
        usage_flusher = LedgerFlusher(gw.ledger, usage_store.write, interval_s=settings.usage_flush_interval_s,
                                      max_pending=settings.usage_max_pending_buckets, metrics=gw.metrics)

    def model_entries(request: Request) -> list[dict[str, Any]]:
        """The models the caller's tenant may name, in ``/v1/models``' shape (GatewayError: refused)."""
        snapshot = gw._snapshot()
        tenant = gw.auth.tenant(request.headers.get("authorization"), snapshot)
        return [{"id": name, "object": "model", "created": _created(snapshot, tenant, name),
                 "owned_by": tenant.slug if name in tenant.bindings else "loraplex"}
                for name in gw.resolver.models(snapshot, tenant)]

    async def models(request: Request) -> Response:
        try:
            data = model_entries(request)
        except GatewayError as err:
            return _error(err.status, err.message, err.code, err.headers)
        return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")

    async def model(request: Request) -> Response:
        """One entry of the caller's ``/v1/models``; any other id (another tenant's alias included)
        is the same 404."""
        name = request.path_params["model"]
        try:
            found = [m for m in model_entries(request) if m["id"] == name]
        except GatewayError as err:
            return _error(err.status, err.message, err.code, err.headers)
        if not found:
            return _error(404, f"The model '{name}' does not exist or you do not have access to it.",
                          "model_not_found")
        return Response(orjson.dumps(found[0]), media_type="application/json")

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        """Ready = this replica can serve its API (a registry snapshot is loaded). Workers are
        reported, not required: during a worker outage the admin API stays in the Service."""
        snap = None
        check = getattr(gw.snapshots, "readiness_problem", None)  # the live cache: loaded, not too stale
        try:
            problem = check() if check is not None else None
            if problem is None:
                snap = gw.snapshots.current
                problem = None if snap is not None else "no registry snapshot yet"
        except Exception as exc:
            problem = f"registry snapshot unavailable: {type(exc).__name__}"
        if problem:  # the database's error text (its host and port) stays in the registry cache's log
            problem = public_message(None, problem, "the registry snapshot is not loaded or not current")
            return JSONResponse({"status": "not ready", "problems": [problem]}, status_code=503)
        await router.refresh()
        workers = len(router.workers())
        body: dict[str, Any] = {"status": "ready", "registry_version": getattr(snap, "version", None),
                                "workers": workers}
        if not workers:
            body["warnings"] = ["no live worker: completions answer 503 no_worker until one reports"]
        return JSONResponse(body)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        if status == 404:
            return _error(404, f"Invalid URL ({request.method} {request.url.path}): the gateway does not serve "
                               f"this path (it serves {', '.join(SERVED_PATHS)})", "unsupported_path")
        return _error(status, str(getattr(exc, "detail", "error")))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        return _error(500, "internal error", "internal_error")

    async def registry_error(request: Request, exc: Exception) -> Response:
        """The registry's refusal (the stored Responses' database down: 503 ``store_unavailable``
        with ``retry-after``), its detail in the log (``registry.errors.database_unavailable``)."""
        assert isinstance(exc, RegistryError)
        err = from_registry(exc)
        log.warning("%s %s: %s (%s)", request.method, request.url.path, err.message, err.code)
        return Response(err.body(), status_code=err.status, media_type="application/json", headers=err.headers)

    if redis is not None:
        gw.live = LiveStats(redis, settings.redis_prefix)
    admin, admin_service = _admin_app(settings, router, http_client, gw.live) if mount_admin else (None, None)
    judge = None
    if admin_service is not None and settings.canary_judge_interval_s > 0 and not settings.registry_snapshot_file:
        from gateway.canary_judge import CanaryJudge

        judge = CanaryJudge(admin_service, gw.canary, gw.metrics, settings.canary_judge_interval_s)


    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        start = getattr(snapshots, "start", None)
        if start is not None:
            await start()
        await router.refresh()
        if own_limiter:
            await limiter.start()  # the Redis limiter's keepalive: held leases renewed, Redis probed
        flusher = asyncio.create_task(flush_access_log(), name="access-log-flush")
        traffic = asyncio.create_task(gw.traffic.run(), name="adapter-traffic") if gw.traffic else None
        lag = asyncio.create_task(gw.metrics.watch_loop_lag(), name="loop-lag")
        samples = asyncio.create_task(gw.canary.run(), name="canary-samples") if gw.canary else None
        purging = asyncio.create_task(_purge_responses(gw.responses_store), name="responses-purge") \
            if gw.responses_store is not None else None
        judging = asyncio.create_task(judge.run(), name="canary-judge") if judge is not None else None
        live = asyncio.create_task(gw.live.publish_forever(), name="live-numbers")
        probing = asyncio.create_task(_probe_workers(router, max(1.0, settings.worker_report_ttl_s)),
                                      name="workers-probe")
        usage = asyncio.create_task(usage_flusher.run(), name="usage-flush") if usage_flusher is not None else None
        rollup = asyncio.create_task(_maintain_usage(usage_store), name="usage-rollup") \
            if usage_flusher is not None else None
        try:
            yield
        finally:
            flusher.cancel()
            lag.cancel()
            for task in (samples, judging, purging, live, probing, usage, rollup):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
            if usage_flusher is not None:  # the requests are over: their usage is written before the end
                await usage_flusher.drain(timeout_s=max(2.0, min(10.0, settings.usage_flush_interval_s)))
            if traffic is not None and gw.traffic is not None:
                traffic.cancel()
                with contextlib.suppress(Exception):
                    await gw.traffic.flush()
            for handler in access_log.handlers:
                handler.flush()
            await gw.prompts.close()
            stop = getattr(snapshots, "stop", None)
            if stop is not None:
                await stop()
            if own_client:
                await http_client.close()
            if own_limiter:
                await limiter.close()
            if redis is not None:
                await redis.aclose()
            if admin_service is not None:
                await admin_service.close()
            if gw.responses_store is not None:
                await gw.responses_store.close()
            if usage_reader is not None:
                await usage_reader.close()
            if usage_store is not None:
                await usage_store.close()

    from starlette.exceptions import HTTPException

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
    app = GatewayApp(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: not_found, RegistryError: registry_error,
                                         Exception: server_error})
    app.gateway = gw
    app.state.gateway = gw
    app.state.canary_judge = judge
    app.state.usage_flusher = usage_flusher

    def refresh_gauges() -> None:
        gw.metrics.inflight.set(router.inflight())
        gw.metrics.workers.set(len(router.workers()))
        if isinstance(limiter, RedisLimiter):
            gw.metrics.track_redis().set(0 if limiter.degraded else 1)
            gw.metrics.track_gateways().set(limiter.gateways)
        gw.metrics.canary_judge.set(1 if judge is not None and judge.leader else 0)

    app.metrics_app = metrics_app(gw.metrics, refresh_gauges)
    return app
