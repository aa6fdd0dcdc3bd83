"""The admin API's HTTP edge: who may call, and how a refusal is answered, the same on every route.

* ``admin_only`` wraps every admin route (the upload's included): the bearer JWT must carry the
  admin scope, else ``TokenError`` (401, or 403 ``insufficient_scope``).
* ``EXCEPTION_HANDLERS`` answer the project's errors, found along the exception's MRO by
  Starlette: a ``RegistryError`` with its status, body and headers (``Retry-After``, ``ETag``), a
  ``TokenError`` with ``WWW-Authenticate: Bearer`` on a 401, a ``BodyError`` as a 400, Starlette's
  404 and 405 (``Allow``: every method the path serves) in the OpenAI shape.
* ``AnswerInternalErrors``: any other exception is a bug, logged and answered 500, and not raised
  on to the server (which would drop the keep-alive connection it came on).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.json_body import BodyError
from loraplex.tokens import Principal, TokenError, Verifier, bearer
from loraplex.wire import error_body
from registry.errors import RegistryError

log = logging.getLogger("loraplex.registry.admin")

AdminEndpoint = Callable[[Request, Principal], Awaitable[Response]]
"""An admin route's work, given the request and the verified admin who sent it."""


def error_response(status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                   param: str | None = None, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """An answer in the OpenAI error shape."""
    return JSONResponse(error_body(message, type=type, code=code, param=param), status_code=status,
                        headers=headers)


def admin_only(verifier: Verifier, scope: str, endpoint: AdminEndpoint) -> Callable[[Request], Awaitable[Response]]:
    """``endpoint`` as a Starlette endpoint that runs only for a valid token with ``scope``."""

    async def guarded(request: Request) -> Response:
        principal = verifier.verify(bearer(request.headers.get("authorization")))
        if not principal.has_scope(scope):
            raise TokenError("this token lacks the admin scope", 403, "insufficient_scope")
        return await endpoint(request, principal)

    return guarded


async def registry_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RegistryError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def token_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, TokenError)
    if exc.status == 401:
        return error_response(401, exc.message, "authentication_error", exc.code,
                              headers={"www-authenticate": "Bearer"})
    return error_response(exc.status, exc.message, "permission_error", exc.code)


async def body_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, BodyError)
    return error_response(400, exc.message, code=exc.code)


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's routing refusals: 404 (no route) and 405 (the path, not the method)."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return error_response(404, f"no admin route {request.method} {request.url.path}", "not_found_error",
                              "unknown_route")
    if exc.status_code == 405:
        return error_response(405, f"method {request.method} is not allowed here", code="method_not_allowed",
                              headers={"allow": ", ".join(allowed_methods(request))})
    return error_response(exc.status_code, exc.detail, headers=exc.headers)


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves on the request's path: the routes that match it partially
    (the path but not the method; Starlette's 405 names only the first of them)."""
    return sorted({method for route in request.app.routes
                   if isinstance(route, Route) and route.methods
                   and route.matches(request.scope)[0] is Match.PARTIAL
                   for method in route.methods})


EXCEPTION_HANDLERS: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
    RegistryError: registry_error, TokenError: token_error, BodyError: body_error, HTTPException: http_error}


class AnswerInternalErrors:
    """Middleware: an exception no handler answered is logged with its traceback and answered
    500 ``internal_error``, never its text; raised on only when the answer had already begun."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            if started:
                raise
            log.exception("admin %s %s failed", scope["method"], scope["path"])
            answer = error_response(500, "internal error in the registry admin API", "server_error",
                                    "internal_error")
            await answer(scope, receive, send)
