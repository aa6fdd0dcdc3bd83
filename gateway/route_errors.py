"""How the gateway's Starlette routes answer errors: Starlette's ``exception_handlers``.

A route raises; Starlette finds the handler along the exception's MRO (the most derived class
registered wins), so a route has no ``try`` of its own. ``GatewayError`` is answered as it
says (status, OpenAI-shaped body, headers); ``registry.errors.RegistryError`` (the stored
Responses' or the usage ledger's database down) as ``gateway.errors.from_registry`` maps it;
Starlette's ``HTTPException`` (no route, wrong method) in the same shape, an unknown path's 404
listing what the gateway serves; anything else is a logged 500 ``internal_error``. The hot
routes are raw ASGI and answer their own errors (``gateway.request_path``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import GatewayError, from_registry
from registry.errors import RegistryError

log = logging.getLogger("loraplex.gateway")
Handler = Callable[[Request, Exception], Awaitable[Response]]


def error_response(err: GatewayError) -> Response:
    """``err`` as a Starlette response: its status, body and headers."""
    return Response(err.body(), status_code=err.status, media_type="application/json", headers=err.headers)


async def refused(request: Request, exc: Exception) -> Response:
    """A ``GatewayError`` a route raised (auth, the registry snapshot missing, a bad parameter)."""
    assert isinstance(exc, GatewayError)
    return error_response(exc)


async def registry_refused(request: Request, exc: Exception) -> Response:
    """The registry's refusal: a bad value of the request (a 4xx the client reads), or the database
    down (503 ``store_unavailable`` with ``retry-after``, logged; its detail is in the log already:
    ``registry.errors.database_unavailable``)."""
    assert isinstance(exc, RegistryError)
    err = from_registry(exc)
    if err.status >= 500:
        log.warning("%s %s: %s (%s)", request.method, request.url.path, err.message, err.code)
    return error_response(err)


async def server_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s", request.url.path, exc_info=exc)
    return error_response(GatewayError(500, "internal error", code="internal_error"))


def exception_handlers(served: tuple[str, ...]) -> dict[Any, Handler]:
    """The gateway app's handlers; an unknown path's 404 lists ``served`` (``METHOD path``)."""

    async def no_route(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            return error_response(GatewayError(
                404, f"Invalid URL ({request.method} {request.url.path}): the gateway does not serve this path "
                     f"(it serves {', '.join(served)})", code="unsupported_path"))
        return error_response(GatewayError(exc.status_code, str(exc.detail)))

    return {GatewayError: refused, RegistryError: registry_refused, HTTPException: no_route,
            Exception: server_error}
