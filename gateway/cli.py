"""``loraplex gateway`` (the gateway and its metrics port on uvicorn) and ``loraplex token`` (mint a JWT)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys
from pathlib import Path
from typing import Any

from gateway.access_lines import BufferedLines
from loraplex.devsecrets import refusal
from loraplex.ports import busy
from loraplex.settings import Settings


def log_access(path: str | None = None) -> None:
    """The access log (one JSON line per request, what ``loraplex plan`` reads) to ``path``, appended,
    or to stderr: buffered (flushed every second by the app, or when full), as a write per request
    would cost more CPU than the rest of the request path."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    stream = open(path, "a", encoding="utf-8") if path else sys.stderr  # open for the process's life
    access = logging.getLogger("loraplex.gateway.access")
    access.addHandler(BufferedLines(stream))
    access.propagate = False


GC_GEN0_THRESHOLD = 50_000
"""Allocations between young-generation collections (Python's default: 700). A request makes
a few hundred objects (the HTTP client's futures, responses, buffers): at the default the
collector runs every few requests and costs about a tenth of the gateway's CPU."""


def tune_gc() -> None:
    """Startup objects (modules, the app) are moved out of the collector's view and young
    collections made rarer: the request path keeps its cycles few and short-lived."""
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


def _gateway(args: argparse.Namespace) -> int:
    from gateway.app import create_app
    from gateway.http_edge import gateway_servers, serve_all

    overrides = {}
    if args.host:
        overrides["gateway_host"] = args.host
    if args.port:
        overrides["gateway_port"] = args.port
    settings = Settings.from_env(**overrides)
    problem = refusal(settings, {"LORAPLEX_GATEWAY_HOST / --host": settings.gateway_host},
                      ("jwt_secret", "worker_secret")) or busy(
        {"LORAPLEX_GATEWAY_PORT (or --port)": (settings.gateway_host, settings.gateway_port),
         "LORAPLEX_GATEWAY_METRICS_PORT": (settings.gateway_metrics_host, settings.gateway_metrics_port)})
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    access = logging.getLogger("loraplex.gateway.access")
    if args.no_access_log:
        access.setLevel(logging.WARNING)
    else:
        log_access(settings.access_log or None)
    app = create_app(settings, mount_admin=settings.gateway_mount_admin)
    app.gateway.snapshots.freeze_gc = True  # the live registry's snapshot out of the GC's walk too
    servers = gateway_servers(app, settings)
    tune_gc()
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve_all(servers))
    else:
        uvloop.run(serve_all(servers))
    return 0


def _admin_api(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.admin_server import admin_server_app

    overrides: dict[str, Any] = {}
    if args.host:
        overrides["admin_api_host"] = args.host
    if args.port:
        overrides["admin_api_port"] = args.port
    settings = Settings.from_env(**overrides)
    problem = refusal(settings, {"LORAPLEX_ADMIN_API_HOST / --host": settings.admin_api_host},
                      ("jwt_secret", "worker_secret"))
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    uvicorn.run(admin_server_app(settings), host=settings.admin_api_host, port=settings.admin_api_port,
                log_level="warning", access_log=False)
    return 0


def _seconds(text: str) -> float:
    """A token's lifetime: a number of seconds above 0 (an expired token is no use to mint)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds: {text!r}")
    return value


def _token(args: argparse.Namespace) -> int:
    from loraplex.tokens import mint, mint_admin

    settings = Settings.from_env()
    if args.admin == bool(args.tenant):
        print("give exactly one of --tenant SLUG or --admin", file=sys.stderr)
        return 2
    if args.admin:
        token = mint_admin(settings, subject=args.subject or "admin", ttl_s=args.ttl)
    else:
        token = mint(settings, args.subject or args.tenant, tenant=args.tenant, ttl_s=args.ttl)
    print(token)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("gateway", help="run the OpenAI-compatible gateway (uvicorn)")
    g.add_argument("--host", default="", help="listen address (default: LORAPLEX_GATEWAY_HOST)")
    g.add_argument("--port", type=int, default=0, help="listen port (default: LORAPLEX_GATEWAY_PORT)")
    g.add_argument("--no-access-log", action="store_true", help="do not log one line per request")
    g.set_defaults(handler=_gateway)
    a = sub.add_parser("admin-api", help="run the registry admin API in a process of its own (/admin/...)")
    a.add_argument("--host", default="", help="listen address (default: LORAPLEX_ADMIN_API_HOST)")
    a.add_argument("--port", type=int, default=0, help="listen port (default: LORAPLEX_ADMIN_API_PORT)")
    a.set_defaults(handler=_admin_api)
    t = sub.add_parser("token", help="mint a JWT for a tenant or an admin (HS256, LORAPLEX_JWT_SECRET)")
    t.add_argument("--tenant", default="", help="tenant slug the token belongs to")
    t.add_argument("--admin", action="store_true", help="an admin token (admin scope)")
    t.add_argument("--subject", default="", help="the sub claim (default: the tenant or 'admin')")
    t.add_argument("--ttl", type=_seconds, default=3600.0, help="lifetime in seconds (more than 0; default 3600)")
    t.set_defaults(handler=_token)
