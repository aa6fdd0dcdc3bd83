"""``loraplex admin-api``: the registry admin API in a process of its own.

The gateway mounts the admin API at ``/admin`` by default (the embedded default: one
process). At scale its database work (a few statements and the ORM's CPU per write) shares
the event loop with every request; run it here instead and set
``LORAPLEX_GATEWAY_MOUNT_ADMIN=false`` on the gateways. The routes are the same
(``/admin/...``), with the activation gate (it probes workers found the way the gateway finds
them), plus ``/healthz`` and ``/readyz`` (200 while the registry database answers).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from gateway.app import redis_client, registry_admin
from gateway.live_stats import LiveStats
from gateway.outliers import Outliers, SharedEjections
from gateway.router import Router
from gateway.worker_client import WorkerClient
from loraplex.residency import RedisResidency, process_residency
from loraplex.settings import Settings
from registry.errors import RegistryError

log = logging.getLogger("loraplex.admin_api")


def admin_server_app(settings: Settings) -> Starlette:
    redis = redis_client(settings) if settings.redis_url else None
    residency = RedisResidency(redis, settings.redis_prefix) if redis is not None else process_residency()
    client = WorkerClient(settings.worker_secret)
    router = Router(residency, candidates=settings.route_candidates, load_factor=settings.route_load_factor,
                    static_urls=settings.worker_urls, cooldown_s=max(2.0, settings.worker_report_ttl_s),
                    outliers=Outliers(shared=SharedEjections(redis, settings.redis_prefix) if redis is not None else None))
    admin, service = registry_admin(settings, router, client, LiveStats(redis, settings.redis_prefix))
    if admin is None or service is None:
        raise RuntimeError("the registry admin API is not available in this install")

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        try:
            version = await service.version()
        except RegistryError as exc:
            return JSONResponse({"status": "not ready", "problems": [exc.message]}, status_code=503,
                                headers=exc.headers)
        return JSONResponse({"status": "ready", "registry_version": version})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await router.refresh()
        try:
            yield
        finally:
            await client.close()
            await service.close()
            if redis is not None:
                await redis.aclose()

    routes: list[Any] = [Route("/healthz", healthz, methods=["GET"]), Route("/readyz", readyz, methods=["GET"]),
                         Mount("/admin", app=admin)]
    return Starlette(routes=routes, lifespan=lifespan)
